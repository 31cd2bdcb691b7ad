"""The deployment files under ``deploy/`` (docs/deploy.md): the Kubernetes overlays render,
validate offline against a pinned Kubernetes version's schemas (``kubernetes-validate``),
and keep the invariants the deployment promises; the systemd units and the install script
give only flags and variables the binaries accept.

Rendering: with ``kubectl`` on PATH, ``kubectl kustomize``; always also a small renderer
of the kustomize features the files use (resources, namespace, images, JSON 6902 patches
with a target, configMapGenerator without a name suffix), whose output must then equal
kubectl's, so the checks run the same on a machine without kubectl. No Kubernetes cluster
is started: the install script's run against a real cluster is in compose/test.sh.
"""

from __future__ import annotations

import base64
import copy
import http.server
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S = REPO_ROOT / "deploy" / "kubernetes"
SYSTEMD = REPO_ROOT / "deploy" / "systemd"
INSTALL = REPO_ROOT / "scripts" / "install-worker.sh"
OVERLAYS = ("dev", "production")
#: The Kubernetes version whose OpenAPI schemas every manifest must satisfy (strict: no
#: field the version does not know). StatefulSet ordinals and the PDB's
#: unhealthyPodEvictionPolicy are GA from 1.31.
KUBERNETES_VERSION = "1.31.0"
#: The coordinators each overlay runs.
REPLICAS = {"dev": 3, "production": 5}

Doc = dict[str, Any]
COORDINATOR = {"app.kubernetes.io/name": "cumulus", "app.kubernetes.io/component": "coordinator"}
WORKER = {"app.kubernetes.io/name": "cumulus", "app.kubernetes.io/component": "worker"}
CLIENT = {"cumulus.io/client": "true"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume"}
WORKLOADS = {"StatefulSet", "DaemonSet", "Deployment", "Job"}


# ---- rendering -----------------------------------------------------------------------


def _docs(text: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all(text) if d]


def _pointer(path: str) -> list[str | int]:
    parts: list[str | int] = []
    for raw in path.lstrip("/").split("/"):
        p = raw.replace("~1", "/").replace("~0", "~")
        parts.append(int(p) if p.isdigit() else p)
    return parts


def _json6902(doc: Doc, ops: list[Doc]) -> None:
    """Applies the JSON patch operations the overlays use: add, replace, remove."""
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = doc
        for p in parents:
            node = node[p]
        if op["op"] == "remove":
            del node[last]
        elif op["op"] == "replace":
            if last not in (range(len(node)) if isinstance(node, list) else node):
                raise AssertionError(f"replace: no {op['path']}")
            node[last] = copy.deepcopy(op["value"])
        elif op["op"] == "add":
            if isinstance(node, list):
                node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
            else:
                node[last] = copy.deepcopy(op["value"])
        else:
            raise AssertionError(f"the fallback renderer has no JSON patch op {op['op']!r}")


def pod_specs(doc: Doc) -> Iterator[Doc]:
    """The pod spec of a workload (none for other kinds)."""
    if doc["kind"] in WORKLOADS:
        yield doc["spec"]["template"]["spec"]


def containers(spec: Doc) -> list[Doc]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def render_fallback(directory: Path) -> list[Doc]:
    """The kustomize features these files use, and nothing more (anything else fails)."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
    known.add("configMapGenerator")
    assert set(kust) <= known, f"{directory}: not supported by the fallback: {set(kust) - known}"
    docs: list[Doc] = []
    for res in kust.get("resources", []):
        path = directory / res
        docs += render_fallback(path) if path.is_dir() else _docs(path.read_text())
    for gen in kust.get("configMapGenerator", []):
        assert gen.get("options") == {"disableNameSuffixHash": True}, gen
        data = {Path(f).name: (directory / f).read_text() for f in gen["files"]}
        meta = {"name": gen["name"]}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    for patch in kust.get("patches", []):
        target = patch["target"]
        hits = [
            d
            for d in docs
            if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]
        ]
        assert len(hits) == 1, f"patch target {target} matches {len(hits)} resources"
        _json6902(hits[0], yaml.safe_load(patch["patch"]))
    for image in kust.get("images", []):
        for doc in docs:
            for spec in pod_specs(doc):
                for c in containers(spec):
                    if c["image"].split(":")[0] == image["name"]:
                        c["image"] = f"{image['newName']}:{image['newTag']}"
    namespace = kust.get("namespace")
    if namespace:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = namespace
            if doc["kind"] in ("RoleBinding", "ClusterRoleBinding"):
                for subject in doc.get("subjects", []):
                    if subject["kind"] == "ServiceAccount":
                        subject["namespace"] = namespace
    return docs


def _key(doc: Doc) -> tuple[str, str, str]:
    return (doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"])


@cache
def rendered(overlay: str) -> tuple[Doc, ...]:
    """The overlay's resources (kubectl's rendering when there is a kubectl)."""
    ours = render_fallback(K8S / "overlays" / overlay)
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return tuple(ours)
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    theirs = _docs(out)
    assert {_key(d): d for d in ours} == {_key(d): d for d in theirs}, (
        "the fallback renderer disagrees with kubectl kustomize"
    )
    return tuple(theirs)


def one(docs: tuple[Doc, ...], kind: str, name: str) -> Doc:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def env_of(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


# ---- what the binaries accept --------------------------------------------------------


def bin_dir() -> Path:
    """Where the Cumulus binaries are: ``$CUMULUS_BIN_DIR``, else ``target/debug``."""
    return Path(os.environ.get("CUMULUS_BIN_DIR") or REPO_ROOT / "target" / "debug")


@cache
def help_of(binary: str) -> tuple[frozenset[str], frozenset[str]]:
    """The flags and environment variables ``binary --help`` lists."""
    path = bin_dir() / binary
    if not path.exists():
        pytest.skip(f"{path} is missing (cargo build --workspace --bins)")
    text = subprocess.run(
        [str(path), "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    flags = frozenset(re.findall(r"(--[a-z0-9][a-z0-9-]*)", text))
    envs = frozenset(re.findall(r"\[env: ([A-Z0-9_]+)[=\]]", text))
    return flags, envs


def flag_names(args: list[str]) -> set[str]:
    return {a.split("=")[0] for a in args if a.startswith("--")}


# ---- the tests -----------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_validates_against_the_pinned_kubernetes_schemas(overlay: str) -> None:
    docs = rendered(overlay)
    assert len(docs) >= 15
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{_key(doc)}: {e.message} at {list(e.path)}") from e


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_requests_and_limits(overlay: str) -> None:
    for doc in rendered(overlay):
        for spec in pod_specs(doc):
            for c in containers(spec):
                res = c.get("resources", {})
                for kind in ("requests", "limits"):
                    assert {"cpu", "memory"} <= set(res.get(kind, {})), (
                        f"{_key(doc)} container {c['name']}: no {kind} for cpu and memory"
                    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_coordinators_keep_a_majority_and_stable_names(overlay: str) -> None:
    docs = rendered(overlay)
    sts = one(docs, "StatefulSet", "cumulus-coordinator")
    replicas = sts["spec"]["replicas"]
    assert replicas == REPLICAS[overlay]
    # The initial membership is the StatefulSet's first size.
    config = one(docs, "ConfigMap", "cumulus-coordinator")
    assert int(config["data"]["initial-members"]) == replicas
    # The budget keeps exactly a majority: a quorum survives every voluntary disruption,
    # and one node at a time can still be drained.
    pdb = one(docs, "PodDisruptionBudget", "cumulus-coordinator")
    assert pdb["spec"]["minAvailable"] == replicas // 2 + 1
    assert pdb["spec"]["selector"]["matchLabels"] == sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["ordinals"] == {"start": 1}, "node id = ordinal, from 1"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 1
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Retain",
        "whenScaled": "Retain",
    }
    # The headless Service publishes nodes that are not ready (a node catching up must
    # still be reached by the leader); the client Service has ready ones only.
    raft = one(docs, "Service", sts["spec"]["serviceName"])
    assert raft["spec"]["clusterIP"] == "None" and raft["spec"]["publishNotReadyAddresses"]
    client = one(docs, "Service", "cumulus-coordinator")
    assert not client["spec"].get("publishNotReadyAddresses")
    assert client["spec"]["selector"] == raft["spec"]["selector"] == COORDINATOR
    # One volume each, holding the data dir.
    spec = sts["spec"]["template"]["spec"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    main = spec["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    data_dir = next(a.split("=", 1)[1] for a in main["args"] if a.startswith("--data-dir="))
    assert Path(data_dir).parent == Path(mounts[claim["metadata"]["name"]])
    # Never two on one node (production requires it; dev, for a one-node kind, prefers it).
    anti = spec["affinity"]["podAntiAffinity"]
    terms = anti.get("requiredDuringSchedulingIgnoredDuringExecution") or [
        t["podAffinityTerm"] for t in anti["preferredDuringSchedulingIgnoredDuringExecution"]
    ]
    assert terms[0]["topologyKey"] == "kubernetes.io/hostname"
    assert terms[0]["labelSelector"]["matchLabels"] == COORDINATOR
    if overlay == "production":
        assert "requiredDuringSchedulingIgnoredDuringExecution" in anti
    assert main["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    # Workers know every coordinator by its stable name.
    worker = one(docs, "DaemonSet", "cumulus-worker")["spec"]["template"]["spec"]
    coordinators = env_of(worker["containers"][0])["CUMULUS_COORDINATORS"]["value"]
    want = [f"cumulus-coordinator-{i}.cumulus-raft:7000" for i in range(1, replicas + 1)]
    assert coordinators.split(",") == want


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_point_at_endpoints_the_servers_serve(overlay: str) -> None:
    coordinator_routes = set(
        re.findall(r'\.route\("(/[a-z]+)"', (REPO_ROOT / "coordinator/src/http.rs").read_text())
    )
    agent_routes = set(
        re.findall(r'\.route\("(/[a-z]+)"', (REPO_ROOT / "worker/src/agent_api.rs").read_text())
    )
    assert {"/health", "/ready"} <= coordinator_routes and "/health" in agent_routes
    served = {"cumulus-coordinator": coordinator_routes, "cumulus-worker": agent_routes}
    docs = rendered(overlay)
    for name, routes in served.items():
        kind = "StatefulSet" if name == "cumulus-coordinator" else "DaemonSet"
        (main,) = one(docs, kind, name)["spec"]["template"]["spec"]["containers"]
        ports = {p["name"] for p in main["ports"]}
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            get = main[probe]["httpGet"]
            assert get["path"] in routes, f"{name} {probe}: {get['path']} is not served"
            assert get["port"] in ports and get["scheme"] == "HTTPS", (name, probe, get)
    sts = one(docs, "StatefulSet", "cumulus-coordinator")
    assert (
        sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"]
        == "/ready"
    ), "readiness: false on a node that is not caught up"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_let_only_cluster_members_in(overlay: str) -> None:
    docs = rendered(overlay)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    # Every pod of the overlay is selected by an ingress policy: nothing is left open.
    for doc in docs:
        if doc["kind"] not in WORKLOADS:
            continue
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert any(
            p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
            and "Ingress" in p["spec"]["policyTypes"]
            for p in policies
        ), f"no NetworkPolicy selects {_key(doc)}"

    def sources(policy: Doc, port: str) -> list[dict[str, str]]:
        found = []
        for rule in policy["spec"].get("ingress", []):
            if rule.get("ports") and port not in {p["port"] for p in rule["ports"]}:
                continue
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, f"only pods of this namespace: {peer}"
                found.append(peer["podSelector"]["matchLabels"])
        return found

    coord = one(docs, "NetworkPolicy", "cumulus-coordinator")
    assert coord["spec"]["podSelector"]["matchLabels"] == COORDINATOR

    # The gRPC port carries Raft (which takes only the peer token over a coordinator's
    # certificate), the worker service and the client service: cluster members only.
    def canon(selectors: list[dict[str, str]]) -> list[str]:
        return sorted(json.dumps(s, sort_keys=True) for s in selectors)

    assert canon(sources(coord, "grpc")) == canon([COORDINATOR, WORKER, CLIENT])
    assert canon(sources(coord, "http")) == canon([COORDINATOR, CLIENT])
    # Only coordinators reach the Raft port, and it truly is a port of its own: the one
    # --raft-listen binds, apart from the gRPC and HTTP ports, published by the headless
    # Service only, and named in every --peer entry the start script writes.
    assert sources(coord, "raft") == [COORDINATOR]
    sts = one(docs, "StatefulSet", "cumulus-coordinator")
    main = sts["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert set(ports) == {"grpc", "http", "raft"} and len(set(ports.values())) == 3, ports
    listen = {
        flag: int(value.rsplit(":", 1)[1])
        for flag, value in (a.split("=", 1) for a in main["args"] if "=" in a)
        if flag.endswith("-listen")
    }
    assert listen == {
        "--grpc-listen": ports["grpc"],
        "--http-listen": ports["http"],
        "--raft-listen": ports["raft"],
    }
    env = env_of(main)
    for name in ("grpc", "http", "raft"):
        assert env[f"CUMULUS_{name.upper()}_PORT"]["value"] == str(ports[name]), name
    headless = one(docs, "Service", sts["spec"]["serviceName"])
    assert {p["name"]: p["targetPort"] for p in headless["spec"]["ports"]}["raft"] == "raft"
    client = one(docs, "Service", "cumulus-coordinator")
    assert "raft" not in {p["targetPort"] for p in client["spec"]["ports"]}, "clients: no Raft"
    start = (K8S / "base" / "coordinator-start.sh").read_text()
    (peer,) = re.findall(r'^peer\(\) \{ echo "(--peer=.*)"; \}$', start, re.M)
    assert peer.count("@") == 2 and peer.endswith(":$raft_port"), peer
    # No rule opens every port of a coordinator.
    assert all(rule.get("ports") for rule in coord["spec"]["ingress"])
    worker = one(docs, "NetworkPolicy", "cumulus-worker")
    assert sources(worker, "agent") == [COORDINATOR, WORKER]
    (open_rule,) = [r for r in worker["spec"]["ingress"] if not r.get("ports")]
    assert open_rule["from"] == [{"podSelector": {"matchLabels": WORKER}}], "rank traffic"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_reach_only_the_pods_that_need_them(overlay: str) -> None:
    allowed = {
        "cumulus-coordinator-pki": {"cumulus-coordinator"},
        "cumulus-peer-token": {"cumulus-coordinator"},
        "cumulus-cluster-token": {"cumulus-coordinator", "cumulus-worker"},
        "cumulus-metrics-token": {"cumulus-coordinator", "cumulus-worker"},
        "cumulus-s3": {"cumulus-coordinator", "cumulus-worker", "minio", "minio-bucket"},
    }
    docs = rendered(overlay)
    seen: dict[str, set[str]] = {}
    for doc in docs:
        for spec in pod_specs(doc):
            name = doc["metadata"]["name"]
            for vol in spec.get("volumes", []):
                if "secret" in vol:
                    seen.setdefault(vol["secret"]["secretName"], set()).add(name)
                assert "projected" not in vol, f"{name}: a projected volume is not checked here"
            for c in containers(spec):
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        seen.setdefault(ref["name"], set()).add(name)
                assert "envFrom" not in c, f"{name}: envFrom would hide what it takes"
    for secret, users in seen.items():
        assert users <= allowed[secret], f"Secret {secret} mounted by {users - allowed[secret]}"
    assert seen["cumulus-coordinator-pki"] == {"cumulus-coordinator"}
    # No private key in a ConfigMap (nor any Secret with a key in git but the dev S3 one).
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            for value in (doc.get("data") or {}).values():
                assert "PRIVATE KEY-----" not in value, _key(doc)
        if doc["kind"] == "Secret":
            assert overlay == "dev" and doc["metadata"]["name"] == "cumulus-s3", _key(doc)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_accounts_and_rbac_grant_the_least(overlay: str) -> None:
    docs = rendered(overlay)
    bindings = [d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    bound = {s["name"] for b in bindings for s in b["subjects"]}
    assert bound == {"cumulus-certs"}, "only the certs Job calls the Kubernetes API"
    role = one(docs, "Role", "cumulus-certs")
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
        assert set(rule["verbs"]) <= {"create", "get"}, rule
        if "get" in rule["verbs"]:
            assert rule.get("resourceNames"), f"get only by name: {rule}"
    for doc in docs:
        for spec in pod_specs(doc):
            account = spec.get("serviceAccountName", "default")
            if account == "cumulus-certs":
                continue
            assert spec.get("automountServiceAccountToken") is False, (
                f"{_key(doc)} runs as {account} with an API token"
            )
    for name in ("cumulus-coordinator", "cumulus-worker", "cumulus-certs"):
        account = one(docs, "ServiceAccount", name)
        assert account["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_coordinators_run_as_non_root_on_a_read_only_root(overlay: str) -> None:
    sts = one(rendered(overlay), "StatefulSet", "cumulus-coordinator")
    spec = sts["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    for c in containers(spec):
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    # The worker: root for rank isolation, with the few capabilities it needs.
    worker = one(rendered(overlay), "DaemonSet", "cumulus-worker")["spec"]["template"]["spec"]
    (agent,) = worker["containers"]
    assert agent["securityContext"]["capabilities"] == {
        "drop": ["ALL"],
        "add": ["CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETGID", "SETUID"],
    }
    assert agent["securityContext"]["allowPrivilegeEscalation"] is False
    assert env_of(agent)["CUMULUS_RUN_AS"]["value"] == "60000-60999"
    hostpaths = {v["name"]: v["hostPath"]["path"] for v in worker["volumes"] if "hostPath" in v}
    assert hostpaths == {"data": env_of(agent)["CUMULUS_DATA_DIR"]["value"]}
    gpus = agent["resources"]["limits"].get("nvidia.com/gpu")
    assert (gpus is not None) == (overlay == "production")


def test_the_coordinator_flags_in_the_manifests_and_unit_are_ones_it_accepts() -> None:
    flags, envs = help_of("cumulus-coordinator")
    # cumulusctl's variables (for `kubectl exec ... cumulusctl`): the client configuration.
    client_config = (REPO_ROOT / "api" / "src" / "client_config.rs").read_text()
    ctl_envs = set(re.findall(r'"(CUMULUS_[A-Z_]+)"', client_config))
    assert {"CUMULUS_ADDR", "CUMULUS_HTTP", "CUMULUS_TLS_CA"} <= ctl_envs
    start = (K8S / "base" / "coordinator-start.sh").read_text()
    # Variables of the start script itself, not of the coordinator.
    script_vars = set(re.findall(r"\$\{(CUMULUS_[A-Z_]+):\?\}", start))
    script_flags = set(re.findall(r"(--[a-z][a-z-]+)=", start)) | {"--join", "--rejoin-empty"}
    assert script_flags == {"--peer", "--node-id", "--tls-cert", "--tls-key"} | {
        "--join",
        "--rejoin-empty",
    }
    assert script_flags <= flags
    for overlay in OVERLAYS:
        sts = one(rendered(overlay), "StatefulSet", "cumulus-coordinator")
        main = sts["spec"]["template"]["spec"]["containers"][0]
        assert flag_names(main["args"]) <= flags, flag_names(main["args"]) - flags
        names = {n for n in env_of(main) if n.startswith("CUMULUS_")}
        unknown = names - envs - script_vars - ctl_envs
        assert not unknown, f"variables neither the coordinator nor cumulusctl reads: {unknown}"
    unit = (SYSTEMD / "cumulus-coordinator.service").read_text()
    (exec_start,) = re.findall(r"^ExecStart=(\S+) (.*)$", unit, re.M)
    assert exec_start[0].endswith("/cumulus-coordinator")
    assert flag_names(exec_start[1].split()) <= flags
    unit_envs = set(re.findall(r"^#   (CUMULUS_[A-Z_]+)=", unit, re.M))
    assert unit_envs - {"CUMULUS_PEERS"} <= envs and "CUMULUS_NODE_ID" in unit_envs
    peers = re.search(r"^#   CUMULUS_PEERS=(.*)$", unit, re.M)
    assert peers and flag_names(peers.group(1).split()) == {"--peer"}
    # Raft on a port of its own, which every --peer entry names (ID=GRPC@HTTP@RAFT).
    assert "--raft-listen" in flags and "CUMULUS_RAFT_LISTEN" in envs
    assert "--raft-listen" in flag_names(exec_start[1].split())
    assert all(p.count("@") == 2 for p in peers.group(1).split()), peers.group(1)


def test_the_worker_settings_in_the_manifests_script_and_unit_are_ones_it_accepts() -> None:
    _, envs = help_of("cumulus-worker")
    script = INSTALL.read_text()
    written = set(re.findall(r"\bsetting (CUMULUS_[A-Z_]+) ", script))
    assert {"CUMULUS_COORDINATORS", "CUMULUS_TLS_ENROL", "CUMULUS_RUN_AS"} <= written
    assert written <= envs, written - envs
    entry = (REPO_ROOT / "compose" / "worker-entrypoint.sh").read_text()
    # The image's entry point reads only the agent's own variables (and its own switch).
    read = set(re.findall(r"\$\{(CUMULUS_[A-Z_]+)", entry)) - {"CUMULUS_INSTALL_FOREGROUND"}
    assert read <= envs, read - envs
    for overlay in OVERLAYS:
        ds = one(rendered(overlay), "DaemonSet", "cumulus-worker")
        names = set(env_of(ds["spec"]["template"]["spec"]["containers"][0]))
        cumulus = {n for n in names if n.startswith("CUMULUS_")}
        assert cumulus <= envs, cumulus - envs
    # The unit the script writes is the template in deploy/systemd with its defaults.
    body = script.split('cat >"$tmp/unit" <<EOF\n', 1)[1].split("\nEOF\n", 1)[0]
    defaults = {
        "$agent_user": "root",
        "$config_dir": "/etc/cumulus-worker",
        "$prefix": "/usr/local/bin",
        "$caps": "CAP_CHOWN CAP_DAC_OVERRIDE CAP_FOWNER CAP_KILL CAP_SETGID CAP_SETUID",
    }
    for var, value in defaults.items():
        body = body.replace(var, value)
    assert body + "\n" == (SYSTEMD / "cumulus-worker.service").read_text()
    caps = re.search(r'caps="(CAP_[A-Z_ ]+)"', script)
    assert caps and caps.group(1) == defaults["$caps"]
    for unit in ("cumulus-worker.service", "cumulus-coordinator.service"):
        text = (SYSTEMD / unit).read_text()
        for hardening in ("NoNewPrivileges=yes", "ProtectSystem=", "LimitNOFILE="):
            assert hardening in text, f"{unit}: {hardening}"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_the_systemd_units_verify_and_keep_their_hardening(tmp_path: Path) -> None:
    """``systemd-analyze verify`` on the units, their binaries pointed at the built ones,
    and their exposure (``systemd-analyze security``) no worse than when written: the
    coordinator 1.8 ("OK"); the worker 6.0, root with the capabilities rank isolation
    needs and the devices, home and W+X memory training code needs."""
    help_of("cumulus-coordinator")  # skips without the binaries
    help_of("cumulus-worker")
    most_exposed = {"cumulus-coordinator.service": 2.0, "cumulus-worker.service": 6.0}
    for unit, binary in (
        ("cumulus-worker.service", "cumulus-worker"),
        ("cumulus-coordinator.service", "cumulus-coordinator"),
    ):
        text = (SYSTEMD / unit).read_text()
        text = text.replace(f"/usr/local/bin/{binary}", str(bin_dir() / binary))
        text = re.sub(r"^EnvironmentFile=.*$", "", text, flags=re.M)
        (tmp_path / unit).write_text(text)
        for check in (["verify", "--man=no"], ["security", "--offline=yes"]):
            done = subprocess.run(
                ["systemd-analyze", *check, str(tmp_path / unit)],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert done.returncode == 0, f"{unit} {check[0]}: {done.stderr}"
        score = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout)
        assert score, done.stdout[-500:]
        assert float(score.group(1)) <= most_exposed[unit], f"{unit}: {score.group(0)}"


def test_the_scripts_parse() -> None:
    for script in (
        INSTALL,
        K8S / "base" / "certs.sh",
        K8S / "base" / "coordinator-start.sh",
        REPO_ROOT / "compose" / "worker-entrypoint.sh",
    ):
        subprocess.run(["sh", "-n", str(script)], check=True, timeout=30)
    subprocess.run(["bash", "-n", str(K8S / "scale-coordinators.sh")], check=True, timeout=30)
    # The dev overlay's rendering is what docs/deploy.md applies: it must name the images
    # the compose Dockerfile builds.
    dockerfile = (REPO_ROOT / "compose" / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM \S+ AS (\S+)", dockerfile, re.M))
    for doc in rendered("dev"):
        for spec in pod_specs(doc):
            for c in containers(spec):
                image = c["image"].split(":")[0]
                if image.startswith("cumulus") and image != "cumulusctl":
                    assert image.removeprefix("cumulus-") in targets, image
                elif image == "cumulusctl":
                    assert "cumulusctl" in targets
    json.dumps(rendered("production"))  # plain data, nothing YAML-specific left


# ---- the StatefulSet's start, run for real -----------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _ready(port: int, ca: Path) -> tuple[int, Doc] | None:
    """``GET /ready`` over HTTPS: the status and the body, ``None`` while nothing answers."""
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(
            f"https://127.0.0.1:{port}/ready", context=context, timeout=5
        ) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return None


def _start_as_the_pod(tmp: Path, node: int, initial: int, pki: Path) -> tuple[Any, int, int, Path]:
    """Starts node ``node`` as its pod would: the init container's script copies its
    files from the "Secrets" (directories here), then the container's command runs
    ``coordinator-start.sh`` with the manifest's args and variables, the pod's paths and
    ports moved to temporary ones. Returns the process, its HTTP and Raft ports and its
    CA file."""
    docs = rendered("dev")
    spec = one(docs, "StatefulSet", "cumulus-coordinator")["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    main = spec["containers"][0]
    root = tmp / f"node-{node}"
    secrets, config = root / "secrets", root / "config"
    secrets.mkdir(parents=True)
    config.mkdir()
    (config / "initial-members").write_text(f"{initial}\n")
    (config / "rejoin-empty").write_text("")
    moved = {
        "/secrets/pki": str(pki),
        "/secrets/cluster-token": str(pki / "cluster-token"),
        "/secrets/peer-token": str(pki / "peer-token"),
        "/secrets/metrics-token": str(pki / "metrics-token"),
        "/run/cumulus/secrets": str(secrets),
    }
    script = init["command"][2]
    for pod_path, here in moved.items():
        script = script.replace(pod_path, here)
    host = f"cumulus-coordinator-{node}"
    path = f"{bin_dir()}:{os.environ['PATH']}"
    subprocess.run(["sh", "-c", script], env={"HOSTNAME": host, "PATH": path}, check=True)
    start = root / "coordinator-start.sh"
    start.write_text(one(docs, "ConfigMap", "cumulus-coordinator-start")["data"][start.name])
    grpc, http, raft = _free_port(), _free_port(), _free_port()
    env = {e["name"]: e["value"] for e in main["env"] if "value" in e}
    env = {k: v.replace("/run/cumulus/secrets", str(secrets)) for k, v in env.items()}
    env |= {
        "CUMULUS_CONFIG_DIR": str(config),
        "CUMULUS_GRPC_PORT": str(grpc),
        "CUMULUS_HTTP_PORT": str(http),
        "CUMULUS_RAFT_PORT": str(raft),
        "HOSTNAME": host,
        "PATH": path,
    }
    args = {
        "--grpc-listen": f"127.0.0.1:{grpc}",
        "--http-listen": f"127.0.0.1:{http}",
        "--raft-listen": f"127.0.0.1:{raft}",
        "--data-dir": str(root / "data" / "data"),
    }
    assert flag_names(main["args"]) == set(args)
    assert main["command"][1].endswith(start.name)
    log = (root / "coordinator.log").open("wb")
    proc = subprocess.Popen(
        [main["command"][0], str(start), *(f"{k}={v}" for k, v in args.items())],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return proc, http, raft, secrets / "ca.pem"


def _wait_ready(proc: Any, port: int, ca: Path, want: int, log: Path) -> Doc:
    deadline = time.monotonic() + 120
    while True:
        got = _ready(port, ca)
        if got and got[0] == want:
            return got[1]
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"/ready never answered {want} (last: {got}): {log.read_text()}")
        time.sleep(0.1)


def test_the_statefulset_starts_a_coordinator_that_becomes_ready(tmp_path: Path) -> None:
    """The init container's and start script's work, run on real processes: node 1 of a
    one-member cluster bootstraps it and is ready; node 2, above ``initial-members``,
    starts with ``--join`` and is not ready until it is added."""
    help_of("cumulus-coordinator")  # skips without the binaries
    pki = tmp_path / "pki"
    hosts = "--hosts=cumulus-coordinator-1.cumulus-raft,cumulus-coordinator-2.cumulus-raft"
    subprocess.run(
        [bin_dir() / "cumulusctl", "certs", "init", "--dir", pki, "--coordinators=1,2", hosts],
        check=True,
        capture_output=True,
        timeout=60,
    )
    (pki / "cluster-token").mkdir()
    (pki / "cluster-token" / "token").write_text("c" * 32)
    (pki / "peer-token").mkdir()
    (pki / "peer-token" / "token").write_text("p" * 32)
    (pki / "metrics-token").mkdir()
    (pki / "metrics-token" / "token").write_text("m" * 32)
    procs = []
    try:
        first, port, raft, ca = _start_as_the_pod(tmp_path, 1, 1, pki)
        procs.append(first)
        log1 = tmp_path / "node-1" / "coordinator.log"
        body = _wait_ready(first, port, ca, 200, log1)
        assert body["ready"] is True and body["leader_id"] == 1, body
        # Its Raft service listens on the port of its own, under the name peers dial.
        assert f"raft=cumulus-coordinator-1.cumulus-raft:{raft}" in log1.read_text()
        socket.create_connection(("127.0.0.1", raft), timeout=5).close()
        joining, port, _, ca = _start_as_the_pod(tmp_path, 2, 1, pki)
        procs.append(joining)
        body = _wait_ready(joining, port, ca, 503, tmp_path / "node-2" / "coordinator.log")
        assert body["ready"] is False and body["reason"], body
        log = (tmp_path / "node-2" / "coordinator.log").read_text()
        assert "initialized a new cluster" not in log, "a node above initial-members joins"
        # The files the coordinator reads are its own and private (the CA key check).
        for f in (tmp_path / "node-1" / "secrets").iterdir():
            assert f.stat().st_mode & 0o077 == 0, f
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)


# ---- the certs Job's script, against a stand-in for the Kubernetes API -------------


class _Objects(http.server.ThreadingHTTPServer):
    """The part of the Kubernetes API ``certs.sh`` uses (GET an object by name, POST one;
    409 when it exists), storing objects in memory. No API server runs here: this
    stand-in lets the script's requests and objects be checked for real."""

    def __init__(self, token: str) -> None:
        super().__init__(("127.0.0.1", 0), _ObjectsHandler)
        self.token = token
        self.objects: dict[tuple[str, str], Doc] = {}
        self.posts = 0


class _ObjectsHandler(http.server.BaseHTTPRequestHandler):
    server: _Objects

    def _answer(self, code: int, body: Doc) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _path(self) -> list[str] | None:
        if self.headers.get("Authorization") != f"Bearer {self.server.token}":
            self._answer(401, {"kind": "Status", "code": 401})
            return None
        parts = self.path.strip("/").split("/")
        assert parts[:3] == ["api", "v1", "namespaces"], self.path
        return parts[4:]

    def do_GET(self) -> None:
        parts = self._path()
        if parts is None:
            return
        kind, name = parts
        found = self.server.objects.get((kind, name))
        self._answer(200, found) if found else self._answer(404, {"kind": "Status"})

    def do_POST(self) -> None:
        parts = self._path()
        if parts is None:
            return
        (kind,) = parts
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.posts += 1
        key = (kind, body["metadata"]["name"])
        if key in self.server.objects:
            self._answer(409, {"kind": "Status", "code": 409})
        else:
            self.server.objects[key] = body
            self._answer(201, body)

    def log_message(self, *args: Any) -> None:
        pass


def _check_certs_job_objects(made: dict[tuple[str, str], Doc], names: set[str]) -> None:
    """The certificates serve every coordinator's names (pod, namespace, client Service),
    the ConfigMap holds the CA certificate alone, the tokens are distinct."""
    pki = {
        k: base64.b64decode(v)
        for k, v in made["secrets", "cumulus-coordinator-pki"]["data"].items()
    }
    ids = range(1, 8)
    want = {"ca.pem", "ca-key.pem"} | {f"coordinator-{i}{s}.pem" for i in ids for s in ("", "-key")}
    assert set(pki) == want
    for i in ids:
        der = base64.b64decode(b"".join(pki[f"coordinator-{i}.pem"].strip().splitlines()[1:-1]))
        for host in (f"cumulus-coordinator-{i}.cumulus-raft", "cumulus-coordinator"):
            assert host.encode() in der, f"coordinator {i}'s certificate lacks {host}"
        assert f"cumulus-coordinator-{i}.cumulus-raft.cumulus-dev.svc".encode() in der
    ca = made["configmaps", "cumulus-ca"]
    assert set(ca) - {"apiVersion", "kind", "metadata"} == {"binaryData"}
    assert base64.b64decode(ca["binaryData"]["ca.pem"]) == pki["ca.pem"]
    assert b"PRIVATE KEY" not in base64.b64decode(ca["binaryData"]["ca.pem"])
    tokens = [
        base64.b64decode(made["secrets", n]["data"]["token"]).decode()
        for n in sorted(names - {"cumulus-coordinator-pki"})
    ]
    assert all(re.fullmatch(r"[0-9a-f]{64}", t) for t in tokens) and len(set(tokens)) == 3


def test_the_certs_job_makes_the_secrets_once(tmp_path: Path) -> None:
    """certs.sh, run with the Job's environment: the Secrets and the CA ConfigMap it makes
    are valid objects, the certificates serve every coordinator's names, no key leaves
    the Secret; a second run changes nothing; a missing ConfigMap is made again from the
    Secret's CA certificate."""
    help_of("cumulus-coordinator")  # skips without the binaries
    docs = rendered("dev")
    job = one(docs, "Job", "cumulus-certs")["spec"]["template"]["spec"]
    (container,) = job["containers"]
    script = tmp_path / "certs.sh"
    script.write_text(one(docs, "ConfigMap", "cumulus-certs-script")["data"]["certs.sh"])
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "namespace").write_text("cumulus-dev")
    (sa / "token").write_text("sa-token")
    (sa / "ca.crt").write_text("")
    api = _Objects("sa-token")
    threading.Thread(target=api.serve_forever, daemon=True).start()
    env = {e["name"]: e["value"] for e in container["env"]}
    env |= {
        "TMPDIR": str(tmp_path),
        "HOME": str(tmp_path),
        "PATH": f"{bin_dir()}:{os.environ['PATH']}",
        "CUMULUS_K8S_API": f"http://127.0.0.1:{api.server_address[1]}",
        "CUMULUS_K8S_SA_DIR": str(sa),
    }

    def run() -> str:
        done = subprocess.run(
            ["sh", str(script)], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    try:
        first = run()
        made = dict(api.objects)
        names = {"cumulus-coordinator-pki", "cumulus-cluster-token", "cumulus-peer-token"}
        names.add("cumulus-metrics-token")
        assert set(made) == {("secrets", n) for n in names} | {("configmaps", "cumulus-ca")}
        assert first.count("created ") == 5, first
        for obj in made.values():
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        _check_certs_job_objects(made, names)

        # Again: everything is kept, nothing is sent.
        posts = api.posts
        again = run()
        assert api.posts == posts and again.count("kept ") == 5, again
        assert api.objects == made
        # The ConfigMap alone lost: made again from the Secret's CA certificate.
        del api.objects["configmaps", "cumulus-ca"]
        run()
        assert api.objects == made
    finally:
        api.shutdown()
        api.server_close()
