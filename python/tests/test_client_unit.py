"""The client SDK against scripted coordinators (httpx.MockTransport): configuration
(addresses, token, TLS), leader following, retries, error mapping, waiting and the SSE log
stream."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import ssl
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import pytest

import cumulus
from conftest import (
    ENCRYPTED_USER_KEY_PEM,
    OTHER_KEY_PEM,
    UNRELATED_CA_PEM,
    USER_CERT_PEM,
    USER_KEY_PEM,
    WORKER_CERT_PEM,
)
from cumulus import _bundle, errors
from cumulus._config import (
    MAX_PEM_FILE_BYTES,
    Connection,
    load_ca,
    load_client_certificate,
    normalize_address,
    resolve,
)
from cumulus.client import Client
from cumulus.models import FINISHED_STATES, JOB_STATES, WorkerInfo

A, B, C = "127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"

Handler = Callable[[httpx.Request], httpx.Response]


def job_json(job_id: str = "job-000001", state: str = "running", **extra: Any) -> dict[str, Any]:
    return {
        "id": job_id,
        "spec": {"name": "t", "world_size": 2, "command": ["python", "t.py"], "env": {}},
        "state": state,
        "submitted_at_ms": 1,
        "finished_at_ms": 0,
        "restarts_used": 0,
        "failure_cause": "",
        "ranks": [
            {"rank": 0, "attempt": 0, "worker_id": "w", "state": "running", "exit_code": None},
            {"rank": 1, "attempt": 1, "worker_id": "w", "state": "exited", "exit_code": 0},
        ],
        "committed_step": None,
        "restarts": [],
        "request_id": "r",
        "shard_count": 0,
        **extra,
    }


class Script:
    """Routes requests to per-(address, method, path) handlers; records them."""

    def __init__(self) -> None:
        self.calls: list[httpx.Request] = []
        self.routes: dict[tuple[str, str, str], list[Handler]] = {}

    def on(self, addr: str, method: str, path: str, *handlers: Handler) -> None:
        self.routes.setdefault((addr, method, path), []).extend(handlers)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(request)
        key = (f"{request.url.host}:{request.url.port}", request.method, request.url.path)
        handlers = self.routes.get(key)
        if not handlers:
            raise httpx.ConnectError("connection refused", request=request)
        handler = handlers.pop(0) if len(handlers) > 1 else handlers[0]
        return handler(request)

    def where(self) -> list[str]:
        return [f"{r.url.host}:{r.url.port} {r.method} {r.url.path}" for r in self.calls]


def ok(body: Any) -> Handler:
    return lambda r: httpx.Response(200, json=body)


def status(code: int, error: str, headers: dict[str, str] | None = None) -> Handler:
    return lambda r: httpx.Response(code, json={"error": error}, headers=headers)


def refused(r: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=r)


#: What the client reads from the environment (the tests say what they mean instead).
CONNECTION_VARIABLES = (
    "CUMULUS_HTTP",
    "CUMULUS_ADDR",
    "CUMULUS_TOKEN",
    "CUMULUS_TOKEN_FILE",
    "CUMULUS_TLS_CA",
    "CUMULUS_TLS_CERT",
    "CUMULUS_TLS_KEY",
    "CUMULUS_INSECURE",
    "CUMULUS_LOCAL_DIR",
)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in CONNECTION_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def script() -> Script:
    return Script()


@pytest.fixture
def httpx_clients(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The keyword arguments of every ``httpx.Client`` made while the test runs."""
    made: list[dict[str, Any]] = []
    real = httpx.Client

    def spy(**kwargs: Any) -> httpx.Client:
        made.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(httpx, "Client", spy)
    return made


def one_log_line_stream(r: httpx.Request) -> httpx.Response:
    """An SSE answer to a log request: one line "hi" of rank 0, then the end."""
    return httpx.Response(
        200,
        headers={"content-type": "text/event-stream"},
        content=sse(("log", "c1", line(0, 0, 0, "hi")), ("end", "c1", {})),
    )


@pytest.fixture
def client(script: Script) -> Iterator[Client]:
    c = Client(
        [A, B, C],
        token="tok",
        insecure=True,
        transport=httpx.MockTransport(script),
        retry_total_s=5,
    )
    yield c
    c.close()


# -- configuration ---------------------------------------------------------------------


def write_cluster(dir: Path, token: str = "file-token", *, tls: bool = False) -> None:
    """A ``cluster.json`` as ``cumulusctl local up`` writes it (``cumulusctl --insecure
    local up`` without ``tls``: no ``tls_dir``)."""
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "token").write_text(token + "\n")
    cluster: dict[str, Any] = {
        "token_file": str(dir / "token"),
        "coordinators": [{"node_id": i, "grpc": "x", "http": f"127.0.0.1:800{i}"} for i in (1, 2)],
        "workers": [],
    }
    if tls:
        (dir / "tls").mkdir(exist_ok=True)
        (dir / "tls" / "ca.pem").write_text(UNRELATED_CA_PEM)
        cluster["tls_dir"] = str(dir / "tls")
    (dir / "cluster.json").write_text(json.dumps(cluster))


def write_ca(path: Path) -> Path:
    path.write_text(UNRELATED_CA_PEM)
    return path


def test_config_from_the_local_cluster_file(tmp_path: Path) -> None:
    write_cluster(tmp_path / "lc")
    conn = resolve(environ={"CUMULUS_LOCAL_DIR": str(tmp_path / "lc")})
    # No tls_dir: a cluster started with `cumulusctl --insecure local up`, plaintext.
    assert conn.addresses == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert conn.ca_file is None and conn.ssl_context is None and conn.scheme == "http"
    assert conn.token == "file-token"
    assert "file-token" not in repr(conn)


def test_config_from_the_environment_wins(tmp_path: Path) -> None:
    write_cluster(tmp_path)
    (tmp_path / "other").write_text("  env-token \n")
    env = {
        "CUMULUS_LOCAL_DIR": str(tmp_path),
        "CUMULUS_HTTP": "http://h1:1/, h2:2",
        "CUMULUS_TOKEN_FILE": str(tmp_path / "other"),
        "CUMULUS_INSECURE": "1",
    }
    conn = resolve(environ=env)
    assert conn.addresses == ("http://h1:1", "http://h2:2")
    assert conn.token == "env-token"
    assert resolve(environ={**env, "CUMULUS_TOKEN_FILE": "", "CUMULUS_TOKEN": "t2"}).token == "t2"
    assert resolve(["h3:3"], token="t3", environ=env).addresses == ("http://h3:3",)


def test_config_errors_say_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="CUMULUS_HTTP"):
        resolve(environ={"CUMULUS_LOCAL_DIR": str(tmp_path)})
    with pytest.raises(errors.ConfigError, match="no token"):
        resolve(environ={"CUMULUS_LOCAL_DIR": str(tmp_path), "CUMULUS_HTTP": "h:1"})
    with pytest.raises(errors.ConfigError, match="both"):
        resolve(environ={"CUMULUS_HTTP": "h:1", "CUMULUS_TOKEN": "a", "CUMULUS_TOKEN_FILE": "b"})
    with pytest.raises(errors.ConfigError, match="gRPC"):
        resolve(environ={"CUMULUS_ADDR": "h:50051", "CUMULUS_TOKEN": "a"})
    with pytest.raises(errors.ConfigError, match="visible ASCII"):
        resolve(environ={"CUMULUS_HTTP": "h:1", "CUMULUS_TOKEN": "a b"})


@pytest.mark.parametrize("bad", ["h", "h:0", ":80", "h:99999", "h/x:1", "h:x"])
def test_bad_addresses_are_refused(bad: str) -> None:
    with pytest.raises(errors.ConfigError, match="host:port"):
        normalize_address(bad, "test")


def test_an_address_takes_the_scheme_tls_decides() -> None:
    assert normalize_address("https://h:1/", "test") == "http://h:1"
    assert normalize_address("http://h:1", "test", scheme="https") == "https://h:1"


# -- TLS resolution (cumulusctl's --insecure / --tls-ca / cluster.json tls_dir) --------


def test_a_tls_local_cluster_is_https_verified_by_its_own_ca_only(tmp_path: Path) -> None:
    write_cluster(tmp_path, tls=True)
    conn = resolve(environ={"CUMULUS_LOCAL_DIR": str(tmp_path)})
    assert conn.addresses == ("https://127.0.0.1:8001", "https://127.0.0.1:8002")
    assert conn.ca_file == tmp_path / "tls" / "ca.pem"
    assert conn.tls and conn.scheme == "https"
    ctx = conn.ssl_context
    assert ctx is not None
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    # The cluster CA and nothing else (no system CAs).
    assert [c["subject"] for c in ctx.get_ca_certs()] == [((("commonName", "cumulus test CA"),),)]


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "Yes"])
def test_insecure_is_plaintext_even_for_a_tls_local_cluster(tmp_path: Path, value: str) -> None:
    write_cluster(tmp_path, tls=True)
    conn = resolve(environ={"CUMULUS_LOCAL_DIR": str(tmp_path), "CUMULUS_INSECURE": value})
    assert conn.addresses[0] == "http://127.0.0.1:8001"
    assert conn.ca_file is None and conn.ssl_context is None
    explicit = resolve(["https://h:1"], token="t", environ={"CUMULUS_INSECURE": value})
    assert explicit.addresses == ("http://h:1",)
    assert resolve(["h:1"], token="t", insecure=True, environ={}).addresses == ("http://h:1",)


@pytest.mark.parametrize("value", ["0", "false", "No", ""])
def test_a_false_insecure_variable_is_not_set(tmp_path: Path, value: str) -> None:
    write_cluster(tmp_path, tls=True)
    conn = resolve(environ={"CUMULUS_LOCAL_DIR": str(tmp_path), "CUMULUS_INSECURE": value})
    assert conn.scheme == "https"


def test_the_insecure_argument_wins_over_the_variable(tmp_path: Path) -> None:
    write_cluster(tmp_path, tls=True)
    env = {"CUMULUS_LOCAL_DIR": str(tmp_path), "CUMULUS_INSECURE": "1"}
    assert resolve(insecure=False, environ=env).scheme == "https"


def test_a_malformed_insecure_variable_is_refused() -> None:
    with pytest.raises(errors.ConfigError, match="CUMULUS_INSECURE='maybe'"):
        resolve(["h:1"], token="t", environ={"CUMULUS_INSECURE": "maybe"})


def test_a_ca_argument_or_variable_makes_any_addresses_https(tmp_path: Path) -> None:
    ca = write_ca(tmp_path / "ca.pem")
    conn = resolve(["h:1", "http://h:2"], token="t", tls_ca=ca, environ={})
    assert conn.addresses == ("https://h:1", "https://h:2") and conn.ca_file == ca
    env = {"CUMULUS_HTTP": "h:1", "CUMULUS_TOKEN": "t", "CUMULUS_TLS_CA": str(ca)}
    assert resolve(environ=env).addresses == ("https://h:1",)
    assert resolve(environ=env).ca_file == ca
    # The argument wins over the variable.
    other = write_ca(tmp_path / "other.pem")
    assert resolve(tls_ca=other, environ=env).ca_file == other


def test_a_ca_wins_over_the_local_cluster_files(tmp_path: Path) -> None:
    write_cluster(tmp_path / "lc", tls=True)
    ca = write_ca(tmp_path / "ca.pem")
    conn = resolve(environ={"CUMULUS_LOCAL_DIR": str(tmp_path / "lc"), "CUMULUS_TLS_CA": str(ca)})
    assert conn.ca_file == ca and conn.addresses[0] == "https://127.0.0.1:8001"
    # A CA for a plaintext local cluster: TLS all the same (as cumulusctl --tls-ca).
    write_cluster(tmp_path / "plain")
    assert resolve(local_dir=tmp_path / "plain", tls_ca=ca, environ={}).scheme == "https"


@pytest.mark.parametrize(
    ("addresses", "env"),
    [
        (["127.0.0.1:8001"], {"CUMULUS_TOKEN": "t"}),
        ("https://127.0.0.1:8001", {"CUMULUS_TOKEN": "t"}),
        (None, {"CUMULUS_HTTP": "127.0.0.1:8001", "CUMULUS_TOKEN": "t"}),
    ],
)
def test_explicit_addresses_need_a_ca_or_insecure(
    tmp_path: Path, addresses: list[str] | str | None, env: dict[str, str]
) -> None:
    # The local cluster's CA is for the local cluster's addresses only, as in cumulusctl.
    write_cluster(tmp_path, tls=True)
    with pytest.raises(errors.ConfigError, match="CUMULUS_TLS_CA") as e:
        resolve(addresses, environ={"CUMULUS_LOCAL_DIR": str(tmp_path), **env})
    assert "CUMULUS_INSECURE" in str(e.value)


def test_explicit_addresses_need_a_ca_or_insecure_in_the_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(errors.ConfigError, match=r"CUMULUS_TLS_CA.*CUMULUS_INSECURE"):
        Client([A], token="tok")
    monkeypatch.setenv("CUMULUS_INSECURE", "true")
    with Client([A], token="tok") as c:
        assert c.addresses == (f"http://{A}",)


@pytest.mark.parametrize(
    ("insecure", "tls_ca", "env"),
    [
        (True, "ca.pem", {}),
        (None, None, {"CUMULUS_INSECURE": "1", "CUMULUS_TLS_CA": "ca.pem"}),
        (True, None, {"CUMULUS_TLS_CA": "ca.pem"}),
        (None, "ca.pem", {"CUMULUS_INSECURE": "yes"}),
    ],
)
def test_insecure_and_a_ca_together_are_refused(
    tmp_path: Path, insecure: bool | None, tls_ca: str | None, env: dict[str, str]
) -> None:
    write_ca(tmp_path / "ca.pem")
    env = {k: str(tmp_path / v) if k == "CUMULUS_TLS_CA" else v for k, v in env.items()}
    ca = None if tls_ca is None else tmp_path / tls_ca
    # Refused before anything else is resolved (there is no address nor token here).
    with pytest.raises(errors.ConfigError, match=r"both .* set"):
        resolve(insecure=insecure, tls_ca=ca, local_dir=tmp_path, environ=env)


def _bad_ca(tmp_path: Path, case: str) -> Path:
    path = tmp_path / "ca.pem"
    if case == "missing":
        return tmp_path / "nope.pem"
    if case == "a directory":
        path.mkdir()
    elif case == "too large":
        path.write_text(UNRELATED_CA_PEM + "#" * MAX_PEM_FILE_BYTES)
    elif case == "not PEM":
        path.write_bytes(b"\x00\x01 binary DER, say")
    elif case == "a key, no certificate":
        path.write_text("-----BEGIN PRIVATE KEY-----\nMEECAQAw\n-----END PRIVATE KEY-----\n")
    elif case == "a broken certificate":
        path.write_text(
            "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n"
        )
    return path


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "a directory",
        "too large",
        "not PEM",
        "a key, no certificate",
        "a broken certificate",
    ],
)
def test_a_bad_ca_file_is_a_config_error_naming_it(tmp_path: Path, case: str) -> None:
    path = _bad_ca(tmp_path, case)
    named = re.escape(str(path))
    with pytest.raises(errors.ConfigError, match=f"CA certificate {named}"):
        load_ca(path)
    with pytest.raises(errors.ConfigError, match=named):
        resolve(["h:1"], token="t", tls_ca=path, environ={})
    with pytest.raises(errors.ConfigError, match=named):
        Client([A], token="t", tls_ca=path)


def test_a_local_cluster_whose_ca_is_gone_is_a_config_error(tmp_path: Path) -> None:
    write_cluster(tmp_path, tls=True)
    (tmp_path / "tls" / "ca.pem").unlink()
    with pytest.raises(errors.ConfigError, match=re.escape(str(tmp_path / "tls" / "ca.pem"))):
        resolve(environ={"CUMULUS_LOCAL_DIR": str(tmp_path)})


def test_every_call_of_a_tls_client_is_https_with_the_cluster_ca(
    tmp_path: Path, script: Script, httpx_clients: list[dict[str, Any]]
) -> None:
    ca = write_ca(tmp_path / "ca.pem")
    # A leader hint is host:port (or written with http://): it is followed over TLS.
    hint = {"x-cumulus-leader-http": f"http://{C}"}
    script.on(A, "POST", "/v1/jobs", status(503, "not the leader", hint))
    script.on(C, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    script.on(C, "GET", "/v1/jobs/job-000001", ok({"job": job_json()}))
    script.on(C, "GET", "/v1/jobs", ok({"jobs": [job_json()]}))
    script.on(C, "POST", "/v1/jobs/job-000001/cancel", ok({"job": job_json(state="cancelled")}))
    script.on(C, "GET", "/v1/jobs/job-000001/checkpoints", ok({"checkpoints": []}))
    script.on(C, "GET", "/v1/cluster", ok({"node_id": 3, "members": [], "workers": []}))
    script.on(B, "GET", "/health", ok({"node_id": 2, "leader_id": 3, "term": 1}))
    script.on(A, "GET", "/v1/jobs/job-000001/logs", status(503, "busy"))
    script.on(
        B,
        "GET",
        "/v1/jobs/job-000001/logs",
        one_log_line_stream,
    )
    with Client(
        [A, B, C], token="tok", tls_ca=ca, transport=httpx.MockTransport(script), retry_total_s=5
    ) as c:
        assert c.addresses == (f"https://{A}", f"https://{B}", f"https://{C}")
        assert httpx_clients[-1]["verify"] is c.connection.ssl_context is not None
        job = c.submit(["true"])
        assert job.status().state == "running"
        assert [j.id for j in c.jobs()] == ["job-000001"]
        assert job.cancel().state == "cancelled"
        assert job.checkpoints() == []
        assert c.cluster().node_id == 3
        assert c.health(B)["node_id"] == 2
        assert [x.line for x in job.logs(follow=True)] == ["hi"]
    assert {r.url.scheme for r in script.calls} == {"https"}
    assert f"{C} POST /v1/jobs" in script.where()
    assert f"{B} GET /v1/jobs/job-000001/logs" in script.where()


def test_a_plaintext_client_keeps_default_verification_and_http(
    script: Script, httpx_clients: list[dict[str, Any]]
) -> None:
    script.on(A, "GET", "/v1/jobs", ok({"jobs": []}))
    with Client([A], token="tok", insecure=True, transport=httpx.MockTransport(script)) as c:
        assert c.jobs() == [] and c.connection.ssl_context is None
    assert httpx_clients[-1]["verify"] is True
    assert [r.url.scheme for r in script.calls] == ["http"]


# -- a user's client certificate (cumulusctl --tls-cert / --tls-key) ----------------------


def write_user_cert(
    dir: Path, cert: str = USER_CERT_PEM, key: str = USER_KEY_PEM
) -> tuple[Path, Path]:
    """``user-test.pem`` and ``user-test-key.pem`` in ``dir``, as ``cumulusctl certs
    issue user test`` names them."""
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "user-test.pem").write_text(cert)
    (dir / "user-test-key.pem").write_text(key)
    return dir / "user-test.pem", dir / "user-test-key.pem"


def test_a_client_certificate_resolves_no_token_from_the_environment_or_the_cluster_file(
    tmp_path: Path,
) -> None:
    write_cluster(tmp_path / "lc", token="file-token", tls=True)
    cert, key = write_user_cert(tmp_path / "certs")
    (tmp_path / "env-token").write_text("env-file-token\n")
    env = {
        "CUMULUS_LOCAL_DIR": str(tmp_path / "lc"),
        "CUMULUS_TOKEN": "env-token",
        # Both set is an error without a certificate; with one neither is read.
        "CUMULUS_TOKEN_FILE": str(tmp_path / "env-token"),
    }
    for conn in (
        resolve(tls_cert=cert, tls_key=key, environ=env),
        resolve(environ={**env, "CUMULUS_TLS_CERT": str(cert), "CUMULUS_TLS_KEY": str(key)}),
    ):
        assert conn.token is None
        assert (conn.cert_file, conn.key_file) == (cert, key)
        assert conn.cert_user == "test"
        # The local cluster's addresses and CA, as without a certificate.
        assert conn.addresses == ("https://127.0.0.1:8001", "https://127.0.0.1:8002")
        assert conn.ca_file == tmp_path / "lc" / "tls" / "ca.pem"
        assert conn.ssl_context is not None and conn.ssl_context.verify_mode == ssl.CERT_REQUIRED
        text = repr(conn)
        assert "file-token" not in text and "env-token" not in text
        assert "BEGIN" not in text and "PRIVATE" not in text
    with pytest.raises(errors.ConfigError, match="both CUMULUS_TOKEN and CUMULUS_TOKEN_FILE"):
        resolve(environ=env)


def test_an_explicit_token_is_kept_with_a_client_certificate(tmp_path: Path) -> None:
    cert, key = write_user_cert(tmp_path)
    ca = write_ca(tmp_path / "ca.pem")
    (tmp_path / "token").write_text("cu.alice.secret\n")
    args: dict[str, Any] = {"tls_ca": ca, "tls_cert": cert, "tls_key": key, "environ": {}}
    assert resolve(["h:1"], token="t", **args).token == "t"
    assert resolve(["h:1"], token_file=tmp_path / "token", **args).token == "cu.alice.secret"
    conn = resolve(["h:1"], token="secret-token", **args)
    assert conn.addresses == ("https://h:1",) and "secret-token" not in repr(conn)


def test_the_certificate_arguments_win_over_the_variables_one_by_one(tmp_path: Path) -> None:
    cert, key = write_user_cert(tmp_path / "a")
    other_cert, other_key = write_user_cert(tmp_path / "b")
    ca = write_ca(tmp_path / "ca.pem")
    env = {"CUMULUS_TLS_CERT": str(other_cert), "CUMULUS_TLS_KEY": str(other_key)}
    conn = resolve(["h:1"], tls_ca=ca, tls_cert=cert, tls_key=key, environ=env)
    assert (conn.cert_file, conn.key_file) == (cert, key)
    # Each setting on its own, as cumulusctl's --tls-cert and CUMULUS_TLS_KEY.
    conn = resolve(["h:1"], tls_ca=ca, tls_cert=cert, environ=env)
    assert (conn.cert_file, conn.key_file) == (cert, other_key)
    # Blank variables are not set.
    blank = {"CUMULUS_TLS_CERT": " ", "CUMULUS_TLS_KEY": "", "CUMULUS_TOKEN": "t"}
    assert resolve(["h:1"], tls_ca=ca, environ=blank).cert_file is None


@pytest.mark.parametrize(
    ("given", "missing"),
    [
        ({"tls_cert": "user-test.pem"}, "without its private key"),
        ({"tls_key": "user-test-key.pem"}, "without its certificate"),
        ({"env": {"CUMULUS_TLS_CERT": "user-test.pem"}}, "CUMULUS_TLS_CERT .*without"),
        ({"env": {"CUMULUS_TLS_KEY": "user-test-key.pem"}}, "CUMULUS_TLS_KEY .*without"),
    ],
)
def test_a_certificate_without_its_key_or_a_key_alone_is_refused(
    tmp_path: Path, given: dict[str, Any], missing: str
) -> None:
    write_user_cert(tmp_path)
    ca = write_ca(tmp_path / "ca.pem")
    env = {k: str(tmp_path / v) for k, v in given.get("env", {}).items()}
    args = {k: tmp_path / v for k, v in given.items() if k != "env"}
    with pytest.raises(errors.ConfigError, match=missing) as e:
        resolve(["h:1"], token="t", tls_ca=ca, environ=env, **args)
    assert str(tmp_path / "user-test") in str(e.value)
    if not env:
        with pytest.raises(errors.ConfigError, match=missing):
            Client([A], tls_ca=ca, **args)


@pytest.mark.parametrize(
    ("insecure", "env"),
    [(True, {}), (None, {"CUMULUS_INSECURE": "1"})],
)
def test_a_client_certificate_with_insecure_is_refused(
    tmp_path: Path, insecure: bool | None, env: dict[str, str]
) -> None:
    cert, key = write_user_cert(tmp_path)
    with pytest.raises(errors.ConfigError, match=r"both .* client certificate needs TLS") as e:
        resolve(["h:1"], insecure=insecure, tls_cert=cert, tls_key=key, environ=env)
    assert str(cert) in str(e.value)
    with pytest.raises(errors.ConfigError, match="needs TLS"):
        resolve(
            ["h:1"],
            insecure=insecure,
            environ={**env, "CUMULUS_TLS_CERT": str(cert), "CUMULUS_TLS_KEY": str(key)},
        )


def test_a_client_certificate_needs_a_ca(tmp_path: Path) -> None:
    cert, key = write_user_cert(tmp_path / "certs")
    with pytest.raises(errors.ConfigError, match=r"client certificate .* needs one: .*tls_ca="):
        resolve(["h:1"], tls_cert=cert, tls_key=key, environ={})
    # A plaintext local cluster (`cumulusctl --insecure local up`) has no CA.
    write_cluster(tmp_path / "plain")
    with pytest.raises(errors.ConfigError, match="needs TLS, but the local cluster") as e:
        resolve(local_dir=tmp_path / "plain", tls_cert=cert, tls_key=key, environ={})
    assert str(cert) in str(e.value)
    # A CA makes it TLS (as cumulusctl --tls-ca).
    ca = write_ca(tmp_path / "ca.pem")
    conn = resolve(local_dir=tmp_path / "plain", tls_ca=ca, tls_cert=cert, tls_key=key, environ={})
    assert conn.scheme == "https" and conn.token is None


def _bad_client_files(tmp_path: Path, case: str) -> tuple[Path, Path, Path]:
    """``(cert, key, the file the error must name)``."""
    cert, key = write_user_cert(tmp_path)
    if case == "missing certificate":
        cert.unlink()
        return cert, key, cert
    if case == "missing key":
        key.unlink()
        return cert, key, key
    if case == "certificate is a directory":
        cert.unlink()
        cert.mkdir()
        return cert, key, cert
    if case == "certificate too large":
        cert.write_text(USER_CERT_PEM + "#" * MAX_PEM_FILE_BYTES)
        return cert, key, cert
    if case == "key too large":
        key.write_text(USER_KEY_PEM + "#" * MAX_PEM_FILE_BYTES)
        return cert, key, key
    if case == "certificate not PEM":
        cert.write_bytes(b"\x30\x82 DER bytes")
        return cert, key, cert
    if case == "certificate is a key":
        cert.write_text(USER_KEY_PEM)
        return cert, key, cert
    if case == "key is a certificate":
        key.write_text(USER_CERT_PEM)
        return cert, key, key
    if case == "encrypted key":
        key.write_text(ENCRYPTED_USER_KEY_PEM)
        return cert, key, key
    if case == "broken certificate":
        cert.write_text(
            "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n"
        )
        return cert, key, cert
    if case == "key of another certificate":
        key.write_text(OTHER_KEY_PEM)
        return cert, key, key
    if case == "a worker's certificate":
        cert.write_text(WORKER_CERT_PEM)
        return cert, key, cert
    if case == "no cumulus identity":
        cert.write_text(UNRELATED_CA_PEM)
        return cert, key, cert
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("missing certificate", "No such file"),
        ("missing key", "No such file"),
        ("certificate is a directory", "directory"),
        ("certificate too large", "larger than"),
        ("key too large", "larger than"),
        ("certificate not PEM", "no PEM certificate"),
        ("certificate is a key", "no PEM certificate"),
        ("key is a certificate", "no PEM private key"),
        ("encrypted key", "encrypted"),
        ("broken certificate", "not a usable PEM certificate and key"),
        ("key of another certificate", "does not match the certificate"),
        ("a worker's certificate", r"names cumulus://worker/w1, not a user"),
        ("no cumulus identity", "names no cumulus:// identity"),
    ],
)
def test_a_bad_client_certificate_or_key_is_a_config_error_naming_the_file(
    tmp_path: Path, case: str, why: str
) -> None:
    cert, key, named = _bad_client_files(tmp_path, case)
    ca = write_ca(tmp_path / "ca.pem")
    with pytest.raises(errors.ConfigError, match=why) as e:
        load_client_certificate(ssl.create_default_context(), cert, key)
    assert str(named) in str(e.value)
    with pytest.raises(errors.ConfigError, match=re.escape(str(named))):
        resolve(["h:1"], tls_ca=ca, tls_cert=cert, tls_key=key, environ={})
    with pytest.raises(errors.ConfigError, match=re.escape(str(named))):
        Client([A], tls_ca=ca, tls_cert=cert, tls_key=key)


def test_a_connection_needs_a_credential_and_both_certificate_files(tmp_path: Path) -> None:
    cert, key = write_user_cert(tmp_path)
    ca = write_ca(tmp_path / "ca.pem")
    assert Connection(("https://h:1",), None, ca, cert, key).cert_user == "test"
    with pytest.raises(errors.ConfigError, match="neither a token nor"):
        Connection(("https://h:1",), None, ca)
    with pytest.raises(errors.ConfigError, match="without key_file"):
        Connection(("https://h:1",), None, ca, cert_file=cert)
    with pytest.raises(errors.ConfigError, match="without cert_file"):
        Connection(("https://h:1",), "t", ca, key_file=key)
    with pytest.raises(errors.ConfigError, match="needs TLS"):
        Connection(("http://h:1",), None, None, cert, key)


def test_a_certificate_client_sends_no_authorization_header(
    tmp_path: Path,
    script: Script,
    monkeypatch: pytest.MonkeyPatch,
    httpx_clients: list[dict[str, Any]],
) -> None:
    # The environment's token is not read with a certificate.
    monkeypatch.setenv("CUMULUS_TOKEN", "admin-token")
    cert, key = write_user_cert(tmp_path)
    ca = write_ca(tmp_path / "ca.pem")
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    script.on(A, "GET", "/v1/jobs/job-000001", ok({"job": job_json(owner="test")}))
    script.on(A, "GET", "/health", ok({"node_id": 1, "leader_id": 1, "term": 1}))
    script.on(
        A,
        "GET",
        "/v1/jobs/job-000001/logs",
        one_log_line_stream,
    )
    with Client(
        [A], tls_ca=ca, tls_cert=cert, tls_key=key, transport=httpx.MockTransport(script)
    ) as c:
        assert c.connection.token is None and c.connection.cert_user == "test"
        assert httpx_clients[-1]["verify"] is c.connection.ssl_context is not None
        assert "Authorization" not in httpx_clients[-1]["headers"]
        assert "admin-token" not in repr(c) and "BEGIN" not in repr(c.connection)
        job = c.submit(["true"])
        assert job.status().owner == "test"
        assert c.health(A)["node_id"] == 1
        assert [x.line for x in job.logs(follow=False)] == ["hi"]
    assert len(script.calls) == 4
    assert all("authorization" not in r.headers for r in script.calls)
    assert {r.url.scheme for r in script.calls} == {"https"}
    # An explicit token is sent, and decides alone.
    script.calls.clear()
    script.on(A, "GET", "/v1/jobs", ok({"jobs": []}))
    with Client(
        [A],
        token="tok",
        tls_ca=ca,
        tls_cert=cert,
        tls_key=key,
        transport=httpx.MockTransport(script),
    ) as c:
        assert c.jobs() == []
    assert [r.headers.get("authorization") for r in script.calls] == ["Bearer tok"]


def test_a_refused_certificate_is_unauthorized_and_says_so(tmp_path: Path, script: Script) -> None:
    cert, key = write_user_cert(tmp_path)
    ca = write_ca(tmp_path / "ca.pem")
    script.on(A, "GET", "/v1/jobs", status(401, "missing or wrong bearer token"))
    script.on(A, "GET", "/v1/jobs/job-000001/logs", status(401, "missing or wrong bearer token"))
    with Client(
        [A], tls_ca=ca, tls_cert=cert, tls_key=key, transport=httpx.MockTransport(script)
    ) as c:
        with pytest.raises(errors.Unauthorized, match=r"client certificate .*user-test\.pem"):
            c.jobs()
        with pytest.raises(errors.Unauthorized, match="client certificate"):
            list(c.logs("job-000001"))
    with (
        Client(
            [A],
            token="tok",
            tls_ca=ca,
            tls_cert=cert,
            tls_key=key,
            transport=httpx.MockTransport(script),
        ) as c,
        pytest.raises(errors.Unauthorized, match="check the token"),
    ):
        c.jobs()


# -- leader following and retries ------------------------------------------------------


def test_a_write_follows_the_leader_hint(client: Client, script: Script) -> None:
    script.on(A, "POST", "/v1/jobs", status(503, "not the leader", {"x-cumulus-leader-http": C}))
    script.on(C, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    script.on(C, "GET", "/v1/jobs/job-000001", ok({"job": job_json()}))
    job = client.submit(["python", "t.py"], world_size=2)
    assert job.id == "job-000001" and job.created
    assert job.status().state == "running"
    # The leader that answered is asked first from then on.
    assert script.where() == [
        f"{A} POST /v1/jobs",
        f"{C} POST /v1/jobs",
        f"{C} GET /v1/jobs/job-000001",
    ]
    assert all(r.headers["authorization"] == "Bearer tok" for r in script.calls)


def test_an_election_and_a_dead_node_are_ridden_out(client: Client, script: Script) -> None:
    script.on(A, "GET", "/v1/jobs", status(503, "no leader"), ok({"jobs": [job_json()]}))
    script.on(B, "GET", "/v1/jobs", refused)
    script.on(C, "GET", "/v1/jobs", status(503, "no leader"))
    jobs = client.jobs()
    assert [j.id for j in jobs] == ["job-000001"]
    assert script.where()[:4] == [f"{x} GET /v1/jobs" for x in (A, B, C, A)]


def test_a_retried_submit_reuses_its_request_id(client: Client, script: Script) -> None:
    def lost_answer(r: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=r)

    script.on(A, "POST", "/v1/jobs", lost_answer)
    script.on(B, "POST", "/v1/jobs", ok({"job_id": "job-000009", "created": False}))
    job = client.submit(["true"], request_id=None)
    ids = {json.loads(r.content)["request_id"] for r in script.calls}
    assert len(ids) == 1 and job.request_id in ids
    assert not job.created


def test_no_coordinator_is_unavailable_within_the_budget(script: Script) -> None:
    c = Client(
        [A, B], token="t", insecure=True, transport=httpx.MockTransport(script), retry_total_s=0.3
    )
    with pytest.raises(errors.Unavailable, match="no coordinator answered") as e:
        c.jobs()
    assert e.value.status is None
    assert len(script.calls) >= 2


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (400, errors.InvalidSpec),
        (401, errors.Unauthorized),
        (403, errors.Forbidden),
        (404, errors.NotFound),
        (409, errors.Conflict),
        (429, errors.ResourceExhausted),
        (500, errors.ServerError),
    ],
)
def test_errors_are_typed_and_carry_the_message(
    client: Client, script: Script, code: int, cls: type[errors.ApiError]
) -> None:
    script.on(A, "GET", "/v1/jobs/job-1", status(code, f"server says {code}"))
    with pytest.raises(cls, match=f"server says {code}") as e:
        client.get_job("job-1")
    assert e.value.status == code and e.value.address == f"http://{A}"
    assert len(script.calls) == 1  # definitive answers are not retried


def test_submit_builds_the_spec(
    client: Client, script: Script, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000002", "created": True}))
    monkeypatch.chdir(tmp_path)
    client.submit(
        ["python", Path("t.py")],  # type: ignore[list-item]
        world_size=3,
        dataset="data",
        ckpt_dir="s3://not-a-dir",
        env={"A": "1"},
        max_restarts=5,
        restart_scope="rank",
        backoff_initial_ms=100,
        progress_timeout_s=1.5,
        startup_timeout_s=90,
        ckpt_keep=2,
        request_id="rid-1",
    )
    body = json.loads(script.calls[0].content)
    assert body["request_id"] == "rid-1"
    spec = body["spec"]
    assert spec["command"] == ["python", "t.py"]
    assert spec["world_size"] == 3 and spec["env"] == {"A": "1"} and spec["ckpt_keep"] == 2
    assert spec["dataset"] == str(tmp_path / "data")
    assert spec["ckpt_dir"] == "s3://not-a-dir"
    assert spec["restart"] == {"scope": "rank", "max_restarts": 5, "backoff_initial_ms": 100}
    assert spec["progress_timeout_ms"] == 1500
    assert spec["startup_timeout_ms"] == 90_000


def test_submit_checks_its_arguments(client: Client) -> None:
    with pytest.raises(TypeError, match="shlex"):
        client.submit("python t.py")  # a str is a Sequence[str]: refused at run time
    for bad in (0, -1, 0.0001, 7 * 86_400 + 1, True, "60"):
        with pytest.raises(errors.InvalidSpec, match="startup_timeout_s"):
            client.submit(["true"], startup_timeout_s=bad)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidSpec, match="world_size"):
        client.submit(["x"], world_size=0)
    with pytest.raises(errors.InvalidSpec, match="env"):
        client.submit(["x"], env={"A=B": "1"})
    with pytest.raises(errors.InvalidSpec, match="request_id"):
        client.submit(["x"], request_id="r" * 129)


def test_submit_sends_an_elastic_world_size_and_refuses_a_bad_one(
    client: Client, script: Script
) -> None:
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    client.submit(["x"], world_size=(2, 4))
    client.submit(["x"], world_size=3)
    specs = [json.loads(r.content)["spec"] for r in script.calls]
    assert (specs[0]["world_size"], specs[0]["min_world_size"]) == (4, 2)
    assert specs[1]["world_size"] == 3 and "min_world_size" not in specs[1]
    for bad in ((4, 2), (0, 2), (1, 2, 3), (1.5, 2), (True, 2)):
        with pytest.raises(errors.InvalidSpec, match="world_size"):
            client.submit(["x"], world_size=bad)  # type: ignore[arg-type]


def test_submit_sends_warm_spares_and_refuses_bad_ones(client: Client, script: Script) -> None:
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    client.submit(["python3", "t.py"])
    client.submit(["python3", "t.py"], warm_spares=2, warm_imports=["torch", "numpy.linalg"])
    client.submit(["/v/bin/python", "-m", "pkg.train"], warm_spares=1)
    specs = [json.loads(r.content)["spec"] for r in script.calls]
    warm = [{k: v for k, v in s.items() if k.startswith("warm")} for s in specs]
    assert warm == [
        {},
        {"warm_spares": 2, "warm_imports": ["torch", "numpy.linalg"]},
        {"warm_spares": 1},
    ]
    for kwargs, field in [
        ({"warm_spares": 9}, "warm_spares"),
        ({"warm_spares": -1}, "warm_spares"),
        ({"warm_spares": True}, "warm_spares"),
        ({"warm_spares": 1, "warm_imports": ["os; rm"]}, "warm_imports"),
        ({"warm_spares": 1, "warm_imports": "torch"}, "warm_imports"),
        ({"warm_imports": ["torch"]}, "warm_spares of at least 1"),
    ]:
        with pytest.raises(errors.InvalidSpec, match=field):
            client.submit(["python3", "t.py"], **kwargs)  # type: ignore[arg-type]
    for argv in (["bash", "run.sh"], ["python3", "-u", "t.py"], ["python3"]):
        with pytest.raises(errors.InvalidSpec, match="warm_spares needs"):
            client.submit(argv, warm_spares=1)
    assert len(script.calls) == 3  # nothing refused was sent


def test_submit_sends_the_gpu_arguments_only_when_given(client: Client, script: Script) -> None:
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    client.submit(["x"])
    client.submit(["x"], gpus_per_rank=2)
    # Any real number goes out as a JSON float.
    client.submit(["x"], gpu_memory_fraction=Fraction(1, 4))  # type: ignore[arg-type]
    client.submit(["x"], gpus_per_rank=1, gpu_memory_fraction=1)
    specs = [json.loads(r.content)["spec"] for r in script.calls]
    gpu_fields = [{k: v for k, v in s.items() if k.startswith("gpu")} for s in specs]
    assert gpu_fields == [
        {},
        {"gpus_per_rank": 2},
        {"gpu_memory_fraction": 0.25},
        {"gpus_per_rank": 1, "gpu_memory_fraction": 1.0},
    ]
    assert isinstance(gpu_fields[2]["gpu_memory_fraction"], float)


@pytest.mark.parametrize("gpus", [0, 1, 64])
def test_submit_takes_gpus_per_rank_in_range(client: Client, script: Script, gpus: int) -> None:
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    client.submit(["x"], gpus_per_rank=gpus)
    assert json.loads(script.calls[0].content)["spec"]["gpus_per_rank"] == gpus


@pytest.mark.parametrize("fraction", [0.0005, 0.001, 0.5, 1])
def test_submit_takes_gpu_fractions_in_range(
    client: Client, script: Script, fraction: float
) -> None:
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    client.submit(["x"], gpu_memory_fraction=fraction, gpus_per_rank=0)
    assert json.loads(script.calls[0].content)["spec"]["gpu_memory_fraction"] == fraction


@pytest.mark.parametrize("gpus", [-1, 65, True, 1.0, "1"])
def test_submit_refuses_bad_gpus_per_rank(client: Client, script: Script, gpus: Any) -> None:
    with pytest.raises(errors.InvalidSpec, match=r"gpus_per_rank must be an int 0\.\.=64") as e:
        client.submit(["x"], gpus_per_rank=gpus)
    assert e.value.status is None and script.calls == []


@pytest.mark.parametrize(
    "fraction",
    [0, -0.5, 1.0001, 2, 0.0004, float("nan"), float("inf"), True, "0.5", [0.5]],
)
def test_submit_refuses_bad_gpu_fractions(client: Client, script: Script, fraction: Any) -> None:
    with pytest.raises(errors.InvalidSpec, match="gpu_memory_fraction must be a number") as e:
        client.submit(["x"], gpu_memory_fraction=fraction)
    assert e.value.status is None and script.calls == []


def test_submit_refuses_a_fraction_of_several_gpus(client: Client, script: Script) -> None:
    with pytest.raises(errors.InvalidSpec, match="applies to one GPU per rank") as e:
        client.submit(["x"], gpus_per_rank=2, gpu_memory_fraction=0.5)
    assert e.value.status is None and script.calls == []


def test_run_passes_the_gpu_arguments_on(client: Client, script: Script) -> None:
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    script.on(A, "GET", "/v1/jobs/job-000001", ok({"job": job_json(state="succeeded")}))
    client.run(["x"], timeout_s=5, gpus_per_rank=1, gpu_memory_fraction=0.5)
    spec = json.loads(script.calls[0].content)["spec"]
    assert (spec["gpus_per_rank"], spec["gpu_memory_fraction"]) == (1, 0.5)


# -- jobs ------------------------------------------------------------------------------


def test_job_info_is_typed(client: Client, script: Script) -> None:
    restarts = [
        {
            "number": 1,
            "cause": "rank 0 attempt 0 exited with code 1",
            "ranks": [0, 1],
            "resume_step": 10,
        }
    ]
    script.on(
        A,
        "GET",
        "/v1/jobs/job-000001",
        ok({"job": job_json(committed_step=20, restarts_used=1, restarts=restarts)}),
    )
    info = client.job("job-000001").status()
    assert info.world_size == 2 and info.command == ("python", "t.py")
    assert info.committed_step == 20 and info.restarts[0].resume_step == 10
    assert info.ranks[1].attempt == 1 and info.ranks[1].exit_code == 0
    assert not info.finished
    assert "linearizable=true" in str(script.calls[0].url)


def test_wait_polls_until_finished(client: Client, script: Script) -> None:
    script.on(
        A,
        "GET",
        "/v1/jobs/job-000001",
        ok({"job": job_json(state="pending")}),
        ok({"job": job_json(state="running")}),
        ok({"job": job_json(state="succeeded")}),
    )
    assert client.job("job-000001").wait(timeout_s=10, poll_interval_s=0.01).succeeded


def test_wait_times_out_and_the_job_keeps_running(client: Client, script: Script) -> None:
    script.on(A, "GET", "/v1/jobs/job-000001", ok({"job": job_json(state="running")}))
    with pytest.raises(errors.WaitTimeout, match="running") as e:
        client.job("job-000001").wait(timeout_s=0.2, poll_interval_s=0.05)
    assert e.value.job.state == "running"


def test_run_raises_when_the_job_fails(client: Client, script: Script) -> None:
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    script.on(
        A,
        "GET",
        "/v1/jobs/job-000001",
        ok({"job": job_json(state="failed", failure_cause="restart budget spent")}),
    )
    with pytest.raises(errors.JobFailed, match="restart budget spent") as e:
        client.run(["false"], timeout_s=5)
    assert e.value.job.state == "failed"


def test_cancel_is_idempotent_but_not_for_finished_jobs(client: Client, script: Script) -> None:
    script.on(A, "POST", "/v1/jobs/job-000001/cancel", status(409, "job is already cancelled"))
    script.on(A, "GET", "/v1/jobs/job-000001", ok({"job": job_json(state="cancelled")}))
    assert client.job("job-000001").cancel().state == "cancelled"
    script.on(A, "POST", "/v1/jobs/job-000002/cancel", status(409, "already succeeded"))
    script.on(A, "GET", "/v1/jobs/job-000002", ok({"job": job_json("job-000002", "succeeded")}))
    with pytest.raises(errors.Conflict, match="already succeeded"):
        client.job("job-000002").cancel()


def test_checkpoints_are_typed(client: Client, script: Script) -> None:
    script.on(
        A,
        "GET",
        "/v1/jobs/job-000001/checkpoints",
        ok(
            {
                "checkpoints": [
                    {
                        "step": 20,
                        "path": "/c/job-000001/step-00000020",
                        "verified": True,
                        "bytes": 42,
                        "latest": True,
                        "tiers": ["L1"],
                    }
                ]
            }
        ),
    )
    job = client.job("job-000001")
    (c,) = job.get_checkpoints()
    assert (c.step, c.size_bytes, c.latest, c.verified, c.tiers) == (20, 42, True, True, ("L1",))


def test_pause_and_resume_post_and_return_the_job(client: Client, script: Script) -> None:
    script.on(
        A,
        "POST",
        "/v1/jobs/job-000001/pause",
        ok({"job": job_json(stop_action="pause", running_ms=1234)}),
    )
    script.on(A, "POST", "/v1/jobs/job-000001/resume", ok({"job": job_json(state="pending")}))
    job = client.job("job-000001")
    info = job.pause()
    assert (info.state, info.stop_action, info.running_ms) == ("running", "pause", 1234)
    assert not info.finished
    assert client.resume("job-000001").state == "pending"
    assert client.pause("job-000001").stop_action == "pause"
    assert script.where() == [
        f"{A} POST /v1/jobs/job-000001/pause",
        f"{A} POST /v1/jobs/job-000001/resume",
        f"{A} POST /v1/jobs/job-000001/pause",
    ]
    assert all(r.content == b"" for r in script.calls)  # no body
    assert all(r.headers["authorization"] == "Bearer tok" for r in script.calls)


def test_pause_and_resume_follow_the_leader(client: Client, script: Script) -> None:
    not_leader = status(503, "not the leader", {"x-cumulus-leader-http": B})
    script.on(A, "POST", "/v1/jobs/job-000001/pause", not_leader)
    script.on(B, "POST", "/v1/jobs/job-000001/pause", ok({"job": job_json(state="paused")}))
    assert client.job("job-000001").pause().paused
    assert script.where()[-1] == f"{B} POST /v1/jobs/job-000001/pause"


def test_pause_is_idempotent_but_not_for_finished_jobs(client: Client, script: Script) -> None:
    script.on(
        A,
        "POST",
        "/v1/jobs/job-000001/pause",
        status(409, "job job-000001 is already paused"),
        status(409, "a pause of job job-000001 is already in flight"),
    )
    script.on(
        A,
        "GET",
        "/v1/jobs/job-000001",
        ok({"job": job_json(state="paused")}),
        ok({"job": job_json(stop_action="pause")}),
    )
    job = client.job("job-000001")
    assert job.pause().state == "paused"
    assert job.pause().stop_action == "pause"
    for state, stop_action, message in [
        ("succeeded", "", "job job-000002 already succeeded"),
        ("running", "time_limit", "a time_limit stop of job job-000002 is in flight"),
    ]:
        script.routes.pop((A, "POST", "/v1/jobs/job-000002/pause"), None)
        script.routes.pop((A, "GET", "/v1/jobs/job-000002"), None)
        script.on(A, "POST", "/v1/jobs/job-000002/pause", status(409, message))
        script.on(
            A,
            "GET",
            "/v1/jobs/job-000002",
            ok({"job": job_json("job-000002", state, stop_action=stop_action)}),
        )
        with pytest.raises(errors.Conflict, match=message):
            client.job("job-000002").pause()


def test_resume_is_idempotent_but_refuses_what_is_not_paused(
    client: Client, script: Script
) -> None:
    # A retried resume whose first try went through: the job is queued already.
    script.on(A, "POST", "/v1/jobs/job-000001/resume", status(409, "job is not paused"))
    script.on(A, "GET", "/v1/jobs/job-000001", ok({"job": job_json(state="pending")}))
    assert client.job("job-000001").resume().state == "pending"
    for state, stop_action in [("running", "pause"), ("timed_out", ""), ("cancelled", "")]:
        script.routes.pop((A, "GET", "/v1/jobs/job-000002"), None)
        script.on(A, "POST", "/v1/jobs/job-000002/resume", status(409, "cannot resume"))
        script.on(
            A,
            "GET",
            "/v1/jobs/job-000002",
            ok({"job": job_json("job-000002", state, stop_action=stop_action)}),
        )
        with pytest.raises(errors.Conflict, match="cannot resume"):
            client.job("job-000002").resume()


@pytest.mark.parametrize("op", ["pause", "resume"])
@pytest.mark.parametrize(
    ("code", "cls"), [(404, errors.NotFound), (403, errors.Forbidden), (400, errors.InvalidSpec)]
)
def test_pause_and_resume_errors_are_typed(
    client: Client, script: Script, op: str, code: int, cls: type[errors.ApiError]
) -> None:
    script.on(A, "POST", f"/v1/jobs/job-000009/{op}", status(code, f"{op} refused"))
    with pytest.raises(cls, match=f"{op} refused") as e:
        getattr(client.job("job-000009"), op)()
    assert e.value.status == code
    assert len(script.calls) == 1


def test_a_pause_answer_without_a_job_is_a_protocol_error(client: Client, script: Script) -> None:
    script.on(A, "POST", "/v1/jobs/job-000001/pause", ok({}))
    with pytest.raises(errors.ProtocolError, match="pause: the answer has no job"):
        client.pause("job-000001")


def test_paused_and_timed_out_states() -> None:
    paused = cumulus.JobInfo.from_json(job_json(state="paused", committed_step=30))
    assert paused.paused and not paused.finished and not paused.timed_out
    timed_out = cumulus.JobInfo.from_json(job_json(state="timed_out", running_ms=3000))
    assert timed_out.finished and timed_out.timed_out and not timed_out.succeeded
    assert timed_out.running_ms == 3000
    assert "timed_out" in FINISHED_STATES and "paused" not in FINISHED_STATES
    assert set(JOB_STATES) >= FINISHED_STATES | {"paused", "pending", "running"}
    # Answers of an older coordinator, without the new fields, have the defaults.
    old = cumulus.JobInfo.from_json(job_json())
    assert (old.stop_action, old.running_ms, old.time_limit_ms, old.signal_before_ms) == (
        "",
        0,
        0,
        0,
    )
    job = job_json()
    job["spec"] = {**job["spec"], "time_limit_ms": 3000, "signal_before_ms": 2000}
    info = cumulus.JobInfo.from_json(job)
    assert (info.time_limit_ms, info.signal_before_ms) == (3000, 2000)
    with pytest.raises(errors.ProtocolError, match="stop_action"):
        cumulus.JobInfo.from_json(job_json(stop_action=1))
    with pytest.raises(errors.ProtocolError, match="running_ms"):
        cumulus.JobInfo.from_json(job_json(running_ms="1"))


def test_wait_goes_on_through_a_pause_and_ends_at_timed_out(client: Client, script: Script) -> None:
    script.on(
        A,
        "GET",
        "/v1/jobs/job-000001",
        *[
            ok({"job": job_json(state=state)})
            for state in ("running", "paused", "paused", "pending", "running", "timed_out")
        ],
    )
    info = client.job("job-000001").wait(timeout_s=10, poll_interval_s=0.01)
    assert info.state == "timed_out"
    assert len(script.calls) == 6


def test_wait_times_out_on_a_paused_job(client: Client, script: Script) -> None:
    script.on(A, "GET", "/v1/jobs/job-000001", ok({"job": job_json(state="paused")}))
    with pytest.raises(errors.WaitTimeout, match="paused"):
        client.job("job-000001").wait(timeout_s=0.2, poll_interval_s=0.05)


def test_run_raises_when_the_job_times_out(client: Client, script: Script) -> None:
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    script.on(
        A,
        "GET",
        "/v1/jobs/job-000001",
        ok({"job": job_json(state="timed_out", failure_cause="time limit of 3 s reached")}),
    )
    with pytest.raises(errors.JobFailed, match="timed_out: time limit") as e:
        client.run(["sleep", "60"], timeout_s=5, time_limit_s=3)
    assert e.value.job.timed_out
    assert json.loads(script.calls[0].content)["spec"]["time_limit_ms"] == 3000


def test_submit_sends_the_time_limit_in_milliseconds(client: Client, script: Script) -> None:
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    client.submit(["x"])
    client.submit(["x"], time_limit_s=3, signal_before_s=2)
    client.submit(["x"], time_limit_s=1.5)
    client.submit(["x"], time_limit_s=Fraction(1, 4), signal_before_s=0.001)  # type: ignore[arg-type]
    client.submit(["x"], time_limit_s=7 * 24 * 3600, signal_before_s=600)
    client.submit(["x"], time_limit_s=365 * 86_400)
    specs = [json.loads(r.content)["spec"] for r in script.calls]
    fields = [
        {k: v for k, v in s.items() if k in ("time_limit_ms", "signal_before_ms")} for s in specs
    ]
    assert fields == [
        {},
        {"time_limit_ms": 3000, "signal_before_ms": 2000},
        {"time_limit_ms": 1500},
        {"time_limit_ms": 250, "signal_before_ms": 1},
        {"time_limit_ms": 604_800_000, "signal_before_ms": 600_000},
        {"time_limit_ms": 31_536_000_000},
    ]
    assert all(isinstance(v, int) for f in fields for v in f.values())


@pytest.mark.parametrize(
    ("limit", "before", "match"),
    [
        (0, None, "time_limit_s must be a positive number of seconds"),
        (-3, None, "time_limit_s must be a positive number"),
        (float("nan"), None, "time_limit_s must be a positive number"),
        (float("inf"), None, "time_limit_s must be a positive number"),
        (True, None, "time_limit_s must be a positive number"),
        ("3", None, "time_limit_s must be a positive number"),
        (0.0001, None, "time_limit_s must be at least 0.001 s"),
        (1e30, None, "time_limit_s must be at most 31536000 s"),
        (365 * 86_400 + 0.001, None, "time_limit_s must be at most"),
        (None, 2, "signal_before_s needs a time_limit_s"),
        (3, 0, "signal_before_s must be a positive number"),
        (3, -1, "signal_before_s must be a positive number"),
        (3, "1", "signal_before_s must be a positive number"),
        (3, 3, r"signal_before_s \(3 s\) must be less than time_limit_s \(3 s\)"),
        (3, 5.5, "must be less than time_limit_s"),
        (0.002, 0.0019, "must be less than time_limit_s"),  # both 2 ms once rounded
    ],
)
def test_submit_refuses_bad_time_limits(
    client: Client, script: Script, limit: Any, before: Any, match: str
) -> None:
    with pytest.raises(errors.InvalidSpec, match=match) as e:
        client.submit(["x"], time_limit_s=limit, signal_before_s=before)
    assert isinstance(e.value, ValueError)
    assert e.value.status is None and script.calls == []


def test_malformed_answers_are_protocol_errors(client: Client, script: Script) -> None:
    script.on(A, "GET", "/v1/jobs/job-1", ok({"job": {"id": "job-1", "state": 3}}))
    with pytest.raises(errors.ProtocolError, match="state"):
        client.get_job("job-1")


# -- GPUs in the answers ---------------------------------------------------------------


def test_gpu_fields_of_a_job_are_typed(client: Client, script: Script) -> None:
    job = job_json(state="pending", pending_reason="cannot be placed: it needs 2 GPUs")
    job["spec"] = {**job["spec"], "gpus_per_rank": 1, "gpu_memory_fraction": 0.25}
    job["ranks"][0]["gpus"] = ["GPU-a"]
    job["ranks"][1]["gpus"] = []
    script.on(A, "GET", "/v1/jobs/job-000001", ok({"job": job}))
    info = client.get_job("job-000001")
    assert info.pending_reason == "cannot be placed: it needs 2 GPUs"
    assert (info.gpus_per_rank, info.gpu_memory_fraction) == (1, 0.25)
    assert [r.gpus for r in info.ranks] == [("GPU-a",), ()]


def test_answers_without_gpu_fields_have_the_defaults() -> None:
    info = cumulus.JobInfo.from_json(job_json())
    assert info.pending_reason == "" and info.gpus_per_rank == 0
    assert info.gpu_memory_fraction is None
    assert all(r.gpus == () for r in info.ranks)
    # A null optional double (serde's None) is absent too; a whole number is a float.
    spec: dict[str, Any] = {"gpu_memory_fraction": None}
    job: dict[str, Any] = {"id": "j", "state": "running"}
    assert cumulus.JobInfo.from_json({**job, "spec": spec}).gpu_memory_fraction is None
    spec = {"gpu_memory_fraction": 1}
    fraction = cumulus.JobInfo.from_json({**job, "spec": spec}).gpu_memory_fraction
    assert fraction == 1.0 and isinstance(fraction, float)
    # The models are still built without the new fields.
    worker = WorkerInfo("w", "h", "a", 4, 0, cumulus.WorkerState.ALIVE, 0, 0.0, 0, 0)
    assert worker.gpus == ()
    rank = cumulus.RankInfo(
        0, 0, "w", cumulus.RankPhase.RUNNING, None, None, 0, 0, 0, 0, 0, 0, 0, 0
    )
    assert rank.gpus == ()


def gpu_json(uuid: str = "GPU-a", *, known: bool = True, **extra: Any) -> dict[str, Any]:
    """A ``GpuInfo`` JSON object (``known``: with a status), ``extra`` fields replaced."""
    gpu: dict[str, Any] = {
        "device": {"index": 1, "uuid": uuid, "name": "Fake 80GB", "memory_total_bytes": 80 << 30},
        "status": (
            {
                "uuid": uuid,
                "memory_used_bytes": 1 << 30,
                "utilization_percent": 42,
                "healthy": False,
                "error": "Xid 79",
            }
            if known
            else None
        ),
        "allocated": 0.5,
    }
    return {**gpu, **extra}


def test_the_gpus_of_a_worker_are_typed(client: Client, script: Script) -> None:
    no_status = gpu_json("GPU-b", known=False)
    del no_status["status"]  # a follower's answer may leave it out or say null
    worker = {"worker_id": "w", "state": "alive", "slots": 4}
    workers = [
        {**worker, "gpus": [gpu_json(), gpu_json("GPU-c", known=False), no_status]},
        {**worker, "worker_id": "cpu-only"},
    ]
    script.on(A, "GET", "/v1/cluster", ok({"node_id": 1, "members": [], "workers": workers}))
    gpus_worker, cpu_worker = client.cluster().workers
    assert cpu_worker.gpus == ()
    known, *unknown = gpus_worker.gpus
    assert known == cumulus.GpuInfo(
        index=1,
        uuid="GPU-a",
        name="Fake 80GB",
        memory_total_bytes=80 << 30,
        memory_used_bytes=1 << 30,
        utilization_percent=42,
        healthy=False,
        error="Xid 79",
        allocated=0.5,
    )
    assert [g.uuid for g in unknown] == ["GPU-c", "GPU-b"]
    for g in unknown:
        assert (g.memory_used_bytes, g.utilization_percent, g.healthy, g.error) == (
            None,
            None,
            None,
            "",
        )
        assert g.memory_total_bytes == 80 << 30 and g.allocated == 0.5
    # allocated is a JSON number: an integral one is a float too.
    whole = cumulus.GpuInfo.from_json(gpu_json(allocated=1))
    assert whole.allocated == 1.0 and isinstance(whole.allocated, float)


@pytest.mark.parametrize(
    ("rank", "match"),
    [({"gpus": "GPU-a"}, "'gpus'"), ({"gpus": ["GPU-a", 1]}, "'gpus'"), ({"gpus": [None]}, "None")],
)
def test_malformed_rank_gpus_are_protocol_errors(rank: dict[str, Any], match: str) -> None:
    with pytest.raises(errors.ProtocolError, match=match):
        cumulus.RankInfo.from_json({"state": "running", **rank})


@pytest.mark.parametrize(
    ("job", "match"),
    [
        ({"pending_reason": 7}, "pending_reason"),
        ({"spec": {"gpus_per_rank": True}}, "gpus_per_rank"),
        ({"spec": {"gpus_per_rank": 1.5}}, "gpus_per_rank"),
        ({"spec": {"gpu_memory_fraction": "0.5"}}, "gpu_memory_fraction"),
        ({"spec": {"gpu_memory_fraction": False}}, "gpu_memory_fraction"),
    ],
)
def test_malformed_job_gpu_fields_are_protocol_errors(job: dict[str, Any], match: str) -> None:
    with pytest.raises(errors.ProtocolError, match=match):
        cumulus.JobInfo.from_json({"id": "job-1", "state": "running", **job})


@pytest.mark.parametrize(
    ("gpu", "match"),
    [
        ("GPU-a", "a GPU"),
        (gpu_json(device=["GPU-a"]), "device"),
        (gpu_json(device={"index": "0"}), "index"),
        (gpu_json(device={"uuid": 1}), "uuid"),
        (gpu_json(device={"memory_total_bytes": 1.5}), "memory_total_bytes"),
        (gpu_json(status="healthy"), "status"),
        (gpu_json(status={"healthy": "yes"}), "healthy"),
        (gpu_json(status={"utilization_percent": True}), "utilization_percent"),
        (gpu_json(status={"memory_used_bytes": "1"}), "memory_used_bytes"),
        (gpu_json(status={"error": None, "healthy": 1}), "healthy"),
        (gpu_json(allocated="0.5"), "allocated"),
        (gpu_json(allocated=True), "allocated"),
    ],
)
def test_malformed_gpus_are_protocol_errors(gpu: Any, match: str) -> None:
    worker = {"worker_id": "w", "state": "alive"}
    cluster = {"node_id": 1, "workers": [{**worker, "gpus": [gpu]}]}
    with pytest.raises(errors.ProtocolError, match=match):
        cumulus.ClusterInfo.from_json(cluster)
    with pytest.raises(errors.ProtocolError, match="'gpus'"):
        cumulus.ClusterInfo.from_json({"workers": [{**worker, "gpus": gpu_json()}]})


# -- logs ------------------------------------------------------------------------------


def sse(*events: tuple[str, str, dict[str, Any]]) -> bytes:
    return "".join(f"event: {e}\nid: {i}\ndata: {json.dumps(d)}\n\n" for e, i, d in events).encode()


def line(rank: int, attempt: int, offset: int, text: str) -> dict[str, Any]:
    return {"rank": rank, "attempt": attempt, "offset": offset, "line": text}


def test_logs_resume_elsewhere_with_last_event_id(client: Client, script: Script) -> None:
    first = sse(("log", "r0a0o4", line(0, 0, 0, "one")), ("log", "r0a0o8", line(0, 0, 4, "two")))

    def dropped(r: httpx.Request) -> httpx.Response:
        def body() -> Iterator[bytes]:
            yield first
            raise httpx.ReadError("connection reset", request=r)

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    def resumed(r: httpx.Request) -> httpx.Response:
        assert r.headers["last-event-id"] == "r0a0o8"
        assert r.url.params["follow"] == "true" and r.url.params["rank"] == "0"
        # A replayed line is suppressed by its offset.
        data = sse(
            ("log", "r0a0o8", line(0, 0, 4, "two")),
            ("log", "r0a1o6", line(0, 1, 0, "three")),
            ("end", "r0a1o6", {}),
        )
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=data)

    script.on(A, "GET", "/v1/jobs/job-000001/logs", dropped)
    script.on(B, "GET", "/v1/jobs/job-000001/logs", resumed)
    lines = list(client.job("job-000001").logs(follow=True, rank=0))
    assert [(x.attempt, x.line) for x in lines] == [(0, "one"), (0, "two"), (1, "three")]


def test_logs_of_an_unknown_job(client: Client, script: Script) -> None:
    script.on(A, "GET", "/v1/jobs/job-9/logs", status(404, 'no job "job-9"'))
    with pytest.raises(errors.NotFound, match="no job"):
        list(client.logs("job-9"))


def test_a_refused_log_stream_is_final_not_retried(client: Client, script: Script) -> None:
    # A 403 says the same at every coordinator and on every try: raised at once, with the
    # coordinator's message, and the next address is never asked.
    script.on(A, "GET", "/v1/jobs/job-3/logs", status(403, "job job-3 belongs to alice"))
    with pytest.raises(errors.Forbidden, match="belongs to alice"):
        list(client.logs("job-3", follow=True))
    assert script.where() == [f"{A} GET /v1/jobs/job-3/logs"]


def test_the_sdk_is_loaded_lazily() -> None:
    assert cumulus.Client is Client
    with pytest.raises(AttributeError):
        _ = cumulus.Nope


def test_a_job_names_its_owner() -> None:
    assert cumulus.JobInfo.from_json(job_json(owner="alice")).owner == "alice"
    assert cumulus.JobInfo.from_json(job_json()).owner == ""
    with pytest.raises(errors.ProtocolError):
        cumulus.JobInfo.from_json(job_json(owner=7))


def test_a_rank_shows_its_metrics_rate_and_time_left() -> None:
    job = job_json()
    job["ranks"][0].update(
        {"metrics": {"loss": 0.25, "acc": 1}, "steps_per_s": 12.5, "eta_ms": 3000}
    )
    info = cumulus.JobInfo.from_json(job)
    r = info.ranks[0]
    assert dict(r.metrics) == {"loss": 0.25, "acc": 1.0}
    assert (r.steps_per_s, r.eta_ms) == (12.5, 3000)
    assert info.ranks[1].metrics == {} and info.ranks[1].steps_per_s == 0.0
    job["ranks"][0]["metrics"] = {"loss": "high"}
    with pytest.raises(errors.ProtocolError):
        cumulus.JobInfo.from_json(job)


def test_stop_grace_is_sent_in_milliseconds_and_checked(client: Client, script: Script) -> None:
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    client.submit(["true"], stop_grace_s=90)
    assert json.loads(script.calls[-1].content)["spec"]["stop_grace_ms"] == 90_000
    for bad in (-1, 3601, True, "5"):
        with pytest.raises(errors.InvalidSpec, match="stop_grace_s"):
            client.submit(["true"], stop_grace_s=bad)  # type: ignore[arg-type]


# -- delete and purge ------------------------------------------------------------------


def test_delete_sends_a_delete_with_the_checkpoints_flag(client: Client, script: Script) -> None:
    script.on(
        A,
        "DELETE",
        "/v1/jobs/job-000001",
        ok({"job_id": "job-000001", "checkpoints_deleted": False}),
        ok({"job_id": "job-000001", "checkpoints_deleted": True}),
    )
    assert client.delete("job-000001") is False
    assert client.job("job-000001").delete(checkpoints=True) is True
    assert script.where() == [f"{A} DELETE /v1/jobs/job-000001"] * 2
    assert [dict(r.url.params) for r in script.calls] == [
        {"checkpoints": "false"},
        {"checkpoints": "true"},
    ]
    assert all(r.content == b"" for r in script.calls)  # no body
    assert all(r.headers["authorization"] == "Bearer tok" for r in script.calls)


def test_delete_follows_the_leader(client: Client, script: Script) -> None:
    not_leader = status(503, "not the leader", {"x-cumulus-leader-http": C})
    script.on(A, "DELETE", "/v1/jobs/job-000001", not_leader)
    script.on(
        C,
        "DELETE",
        "/v1/jobs/job-000001",
        ok({"job_id": "job-000001", "checkpoints_deleted": True}),
    )
    assert client.delete("job-000001", checkpoints=True)
    assert script.where() == [f"{A} DELETE /v1/jobs/job-000001", f"{C} DELETE /v1/jobs/job-000001"]
    assert script.calls[-1].url.params["checkpoints"] == "true"


@pytest.mark.parametrize(
    ("code", "cls", "message"),
    [
        (409, errors.Conflict, "job job-000003 is running: cancel it before deleting it"),
        (400, errors.InvalidSpec, "job job-000003 is paused: cancel it before deleting it"),
        (404, errors.NotFound, 'no job "job-000003"'),
        (403, errors.Forbidden, "job job-000003 belongs to alice"),
    ],
)
def test_delete_errors_are_typed(
    client: Client, script: Script, code: int, cls: type[errors.ApiError], message: str
) -> None:
    script.on(A, "DELETE", "/v1/jobs/job-000003", status(code, message))
    with pytest.raises(cls, match=re.escape(message)) as e:
        client.job("job-000003").delete()
    assert e.value.status == code
    assert len(script.calls) == 1  # definitive answers are not retried


@pytest.mark.parametrize("job_id", ["", "job-1/cancel", "../x", "job-1?checkpoints=true", "a b", 7])
def test_delete_refuses_what_is_not_a_job_id(client: Client, script: Script, job_id: Any) -> None:
    with pytest.raises(errors.InvalidSpec, match="not a job id") as e:
        client.delete(job_id)
    assert e.value.status is None and script.calls == []


@pytest.mark.parametrize("flag", ["false", 0, 1, None])
def test_delete_and_purge_take_only_a_bool_for_checkpoints(
    client: Client, script: Script, flag: Any
) -> None:
    with pytest.raises(errors.InvalidSpec, match="checkpoints must be True or False"):
        client.delete("job-000001", checkpoints=flag)
    with pytest.raises(errors.InvalidSpec, match="checkpoints must be True or False"):
        client.purge(older_than_s=1, checkpoints=flag)
    assert script.calls == []


@pytest.mark.parametrize(
    "answer",
    [{}, {"job_id": "job-000001"}, {"checkpoints_deleted": "true"}, {"checkpoints_deleted": 1}, []],
)
def test_a_malformed_delete_answer_is_a_protocol_error(
    client: Client, script: Script, answer: Any
) -> None:
    script.on(A, "DELETE", "/v1/jobs/job-000001", ok(answer))
    with pytest.raises(errors.ProtocolError, match="DELETE /v1/jobs/job-000001"):
        client.delete("job-000001")


def test_purge_posts_the_filter_and_returns_the_ids(client: Client, script: Script) -> None:
    script.on(
        A,
        "POST",
        "/v1/jobs/purge",
        ok({"job_ids": ["job-000002", "job-000005"]}),
        ok({"job_ids": []}),
        ok({"job_ids": ["job-000007"]}),
        ok({"job_ids": []}),
    )
    assert client.purge(older_than_s=7 * 86_400, state="cancelled") == ["job-000002", "job-000005"]
    assert client.purge(older_than_s=0.001) == []
    # Any real number of seconds (a Fraction here) goes out as whole milliseconds.
    age: Any = Fraction(3, 2)
    assert client.purge(older_than_s=age, state="timed_out", checkpoints=True) == ["job-000007"]
    assert client.purge(older_than_s=90, state="failed") == []
    assert script.where() == [f"{A} POST /v1/jobs/purge"] * 4
    assert [json.loads(r.content) for r in script.calls] == [
        {"state": "cancelled", "older_than_ms": 604_800_000, "checkpoints": False},
        {"state": "", "older_than_ms": 1, "checkpoints": False},
        {"state": "timed_out", "older_than_ms": 1500, "checkpoints": True},
        {"state": "failed", "older_than_ms": 90_000, "checkpoints": False},
    ]
    assert all(not r.url.params for r in script.calls)


@pytest.mark.parametrize("state", sorted(FINISHED_STATES))
def test_purge_takes_every_finished_state(client: Client, script: Script, state: str) -> None:
    script.on(A, "POST", "/v1/jobs/purge", ok({"job_ids": []}))
    client.purge(older_than_s=1, state=state)
    assert json.loads(script.calls[0].content)["state"] == state


@pytest.mark.parametrize(
    ("older_than_s", "match"),
    [
        (0, "older_than_s must be a positive, finite number of seconds"),
        (-1, "must be a positive, finite number"),
        (float("nan"), "must be a positive, finite number"),
        (float("inf"), "must be a positive, finite number"),
        (True, "must be a positive, finite number"),
        ("60", "must be a positive, finite number"),
        (None, "must be a positive, finite number"),
        (0.0004, "older_than_s must be at least 0.001 s"),
        (1e30, "older_than_s must be at most"),
        (10**400, "older_than_s must be at most"),
    ],
)
def test_purge_refuses_bad_ages(
    client: Client, script: Script, older_than_s: Any, match: str
) -> None:
    with pytest.raises(errors.InvalidSpec, match=match) as e:
        client.purge(older_than_s=older_than_s)
    assert isinstance(e.value, ValueError)
    assert e.value.status is None and script.calls == []


@pytest.mark.parametrize("state", ["", "running", "pending", "paused", "Cancelled", "all", 3])
def test_purge_refuses_states_that_are_not_finished(
    client: Client, script: Script, state: Any
) -> None:
    with pytest.raises(errors.InvalidSpec, match="state must be None") as e:
        client.purge(older_than_s=60, state=state)
    assert "cancelled, failed, succeeded, timed_out" in str(e.value)
    assert isinstance(e.value, ValueError)
    assert e.value.status is None and script.calls == []


def test_purge_needs_an_age(client: Client) -> None:
    with pytest.raises(TypeError, match="older_than_s"):
        client.purge()  # type: ignore[call-arg]


def test_purge_errors_and_malformed_answers(client: Client, script: Script) -> None:
    script.on(
        A,
        "POST",
        "/v1/jobs/purge",
        status(400, "older_than_ms must be positive"),
        ok({"job_ids": "job-000001"}),
        ok({"job_ids": [1]}),
        ok({}),
    )
    with pytest.raises(errors.InvalidSpec, match="older_than_ms must be positive") as e:
        client.purge(older_than_s=1)
    assert e.value.status == 400
    for _ in range(3):
        with pytest.raises(errors.ProtocolError, match="POST /v1/jobs/purge: malformed answer"):
            client.purge(older_than_s=1)


def test_submit_sends_the_priority_and_refuses_one_out_of_range(
    client: Client, script: Script
) -> None:
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    client.submit(["x"])
    client.submit(["x"], priority=-1000)
    client.submit(["x"], priority=7)
    specs = [json.loads(r.content)["spec"] for r in script.calls]
    assert [s.get("priority") for s in specs] == [None, -1000, 7]
    for bad in (1001, -1001, True, 1.5, "3"):
        with pytest.raises(errors.InvalidSpec, match="priority must be an integer"):
            client.submit(["x"], priority=bad)  # type: ignore[arg-type]
    assert len(script.calls) == 3, "nothing sent for a refused priority"


def test_submit_sends_resume_from_and_preemptible_only_when_given(
    client: Client, script: Script
) -> None:
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000002", "created": True}))
    client.submit(["x"])
    client.submit(["x"], resume_from="job-000012")
    client.submit(["x"], resume_from="job-000012@400")
    client.submit(["x"], resume_from=("job-000012", 400))
    client.submit(["x"], resume_from="job-00000000000000000001@0", preemptible=True)
    client.submit(["x"], resume_from=("job-000012", 2**64 - 1), preemptible=False)
    client.submit(["x"], preemptible=True)
    specs = [json.loads(r.content)["spec"] for r in script.calls]
    fields = [
        {k: v for k, v in s.items() if k.startswith("resume_from") or k == "preemptible"}
        for s in specs
    ]
    assert fields == [
        {},
        {"resume_from_job": "job-000012"},
        {"resume_from_job": "job-000012", "resume_from_step": 400},
        {"resume_from_job": "job-000012", "resume_from_step": 400},
        {"resume_from_job": "job-00000000000000000001", "resume_from_step": 0, "preemptible": True},
        {"resume_from_job": "job-000012", "resume_from_step": 2**64 - 1},
        {"preemptible": True},
    ]
    # What the new job does not set is left for the coordinator to take from the source.
    assert (specs[1]["dataset"], specs[1]["ckpt_dir"], specs[1]["ckpt_url"]) == ("", "", "")


def test_run_passes_resume_from_and_preemptible_on(client: Client, script: Script) -> None:
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000002", "created": True}))
    script.on(A, "GET", "/v1/jobs/job-000002", ok({"job": job_json("job-000002", "succeeded")}))
    client.run(["x"], timeout_s=5, resume_from="job-000001@3", preemptible=True)
    spec = json.loads(script.calls[0].content)["spec"]
    assert (spec["resume_from_job"], spec["resume_from_step"], spec["preemptible"]) == (
        "job-000001",
        3,
        True,
    )


@pytest.mark.parametrize(
    ("resume_from", "match"),
    [
        ("", "resume_from must name a job id"),
        ("job-1", "resume_from must name a job id"),
        ("job-12345", "resume_from must name a job id"),
        ("job-000000000000000000001", "resume_from must name a job id"),  # 21 digits
        ("Job-000012", "resume_from must name a job id"),
        ("job-00001x", "resume_from must name a job id"),
        ("job-\u0661\u0662\u0663\u0664\u0665\u0666", "resume_from must name a job id"),
        (" job-000012", "resume_from must name a job id"),
        ("job-000012/x", "resume_from must name a job id"),
        ("@400", "resume_from must name a job id"),
        ("job-000012@", "resume_from: step '' is not a number"),
        ("job-000012@-1", "resume_from: step '-1' is not a number"),
        ("job-000012@+4", "resume_from: step '\\+4' is not a number"),
        ("job-000012@4_0", "is not a number"),
        ("job-000012@ 4", "is not a number"),
        ("job-000012@1.5", "is not a number"),
        ("job-000012@4@5", "is not a number"),
        ("job-000012@\u0664", "is not a number"),
        ("job-000012@18446744073709551616", "resume_from: the step must be an int"),
        ("job-000012@" + "9" * 5000, "resume_from: the step must be an int"),
        (("job-000012", -1), "resume_from: the step must be an int"),
        (("job-000012", True), "resume_from: the step must be an int"),
        (("job-000012", 1.0), "resume_from: the step must be an int"),
        (("job-000012", "400"), "resume_from: the step must be an int"),
        (("job-000012", 2**64), "resume_from: the step must be an int"),
        (("job-000012", None), "resume_from: the step of a .JOB, STEP. pair must be an int"),
        (("job-1", 4), "resume_from must name a job id"),
        ((12, 4), "resume_from must name a job id"),
        (("job-000012",), "resume_from must be"),
        (("job-000012", 4, 5), "resume_from must be"),
        (["job-000012", 4], "resume_from must be"),
        (12, "resume_from must be"),
        (b"job-000012", "resume_from must be"),
    ],
)
def test_submit_refuses_bad_resume_from(
    client: Client, script: Script, resume_from: Any, match: str
) -> None:
    with pytest.raises(errors.InvalidSpec, match=match) as e:
        client.submit(["x"], resume_from=resume_from)
    assert isinstance(e.value, ValueError)
    assert e.value.status is None and script.calls == []


@pytest.mark.parametrize("flag", ["false", 0, 1, None])
def test_submit_takes_only_a_bool_for_preemptible(
    client: Client, script: Script, flag: Any
) -> None:
    with pytest.raises(errors.InvalidSpec, match="preemptible must be True or False"):
        client.submit(["x"], preemptible=flag)
    assert script.calls == []


def test_job_info_shows_resume_from_and_preemptible() -> None:
    # Answers of an older coordinator, without the new fields, have the defaults.
    old = cumulus.JobInfo.from_json(job_json())
    assert (old.resume_from_job, old.resume_from_step, old.preemptible) == ("", None, False)
    job = job_json()
    job["spec"] = {
        **job["spec"],
        "resume_from_job": "job-000012",
        "resume_from_step": 400,
        "preemptible": True,
    }
    info = cumulus.JobInfo.from_json(job)
    assert (info.resume_from_job, info.resume_from_step, info.preemptible) == (
        "job-000012",
        400,
        True,
    )
    # serde's None for the optional step, and step 0, are told apart.
    job["spec"] = {**job["spec"], "resume_from_step": None, "preemptible": False}
    assert cumulus.JobInfo.from_json(job).resume_from_step is None
    job["spec"] = {**job["spec"], "resume_from_step": 0}
    assert cumulus.JobInfo.from_json(job).resume_from_step == 0


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"resume_from_job": 12}, "resume_from_job"),
        ({"resume_from_step": "400"}, "resume_from_step"),
        ({"resume_from_step": True}, "resume_from_step"),
        ({"preemptible": 1}, "preemptible"),
        ({"preemptible": "true"}, "preemptible"),
    ],
)
def test_malformed_resume_from_and_preemptible_are_protocol_errors(
    spec: dict[str, Any], match: str
) -> None:
    job = job_json()
    job["spec"] = {**job["spec"], **spec}
    with pytest.raises(errors.ProtocolError, match=match):
        cumulus.JobInfo.from_json(job)


# -- progress summaries ----------------------------------------------------------------


def summary_json(job_id: str = "job-000001", **extra: Any) -> dict[str, Any]:
    """A ``JobSummary`` JSON object with every field set, ``extra`` fields replaced."""
    return {
        "job_id": job_id,
        "name": "train",
        "state": "running",
        "step": 40,
        "total_steps": 100,
        "steps_per_s": 2.5,
        "eta_ms": 24_000,
        "metrics": {"loss": 0.5, "acc": 1},
        "restarts_used": 1,
        "running_ms": 16_000,
        "paused_ms": 3_000,
        "committed_step": 30,
        "submitted_at_ms": 1_700_000_000_000,
        "finished_at_ms": 0,
        "history": [
            {"at_ms": 1_700_000_010_000, "step": 10, "total_steps": 100, "steps_per_s": 2},
            {
                "at_ms": 1_700_000_020_000,
                "step": 35,
                "total_steps": 100,
                "steps_per_s": 2.5,
                "metrics": {"loss": 0.75},
            },
        ],
        "live": True,
        **extra,
    }


def test_summary_gets_the_job_summary_with_its_history(client: Client, script: Script) -> None:
    script.on(A, "GET", "/v1/jobs/job-000001/summary", ok(summary_json()))
    s = client.job("job-000001").summary()
    assert script.where() == [f"{A} GET /v1/jobs/job-000001/summary"]
    assert not script.calls[0].url.params
    assert isinstance(s, cumulus.JobSummary)
    assert (s.job_id, s.name, s.state, s.live) == ("job-000001", "train", "running", True)
    assert (s.step, s.total_steps, s.steps_per_s, s.eta_ms) == (40, 100, 2.5, 24_000)
    assert dict(s.metrics) == {"loss": 0.5, "acc": 1.0}
    assert isinstance(s.metrics["acc"], float)
    assert (s.restarts_used, s.running_ms, s.paused_ms, s.committed_step) == (1, 16_000, 3_000, 30)
    assert (s.submitted_at_ms, s.finished_at_ms) == (1_700_000_000_000, 0)
    assert (s.eta_s, s.progress, s.finished) == (24.0, 0.4, False)
    assert s.history == (
        cumulus.ProgressSample(1_700_000_010_000, 10, 100, 2.0, {}),
        cumulus.ProgressSample(1_700_000_020_000, 35, 100, 2.5, {"loss": 0.75}),
    )
    assert isinstance(s.history[0].steps_per_s, float)
    assert s.raw["job_id"] == "job-000001"
    assert "history" not in repr(s) and "raw" not in repr(s)


def cluster_json(node_id: int, leader_id: int, **roles: str) -> dict[str, Any]:
    """A ``ClusterStatusResponse``: members 1..3 at A, B, C with ``roles`` (``n1="leader"``)."""
    addrs = {1: A, 2: B, 3: C}
    members = [
        {"node_id": n, "http_addr": addrs[n], "role": roles.get(f"n{n}", "follower"), "voter": True}
        for n in (1, 2, 3)
    ]
    return {"node_id": node_id, "leader_id": leader_id, "members": members, "workers": []}


def test_cluster_asks_the_leader_and_reads_unreachable_members(
    client: Client, script: Script
) -> None:
    # A follower answers first; the leader it names knows who stopped answering.
    script.on(A, "GET", "/v1/cluster", ok(cluster_json(1, 2, n2="leader")))
    leader_view = cluster_json(2, 2, n2="leader", n3="unreachable")
    leader_view["members"][2] |= {"last_role": "follower", "last_ack_age_ms": 4200}
    leader_view["members"][1] |= {"raft_addr": "b.example:7100"}  # --raft-listen
    script.on(B, "GET", "/v1/cluster", ok(leader_view))
    info = client.cluster()
    assert info.node_id == 2 and script.where()[-1] == f"{B} GET /v1/cluster"
    dead = info.members[2]
    assert dead.role == "unreachable" and dead.role is cumulus.MemberRole.UNREACHABLE
    assert (dead.last_role, dead.last_ack_age_ms) == (cumulus.MemberRole.FOLLOWER, 4200)
    assert info.members[0].last_role is None and info.members[0].last_ack_age_ms is None
    assert (info.members[0].raft_addr, info.members[1].raft_addr) == ("", "b.example:7100")
    # A named leader that does not answer: the first answer stands.
    script.routes.pop((B, "GET", "/v1/cluster"))
    assert client.cluster().node_id == 1


def test_summary_follows_the_leader(client: Client, script: Script) -> None:
    path = "/v1/jobs/job-000001/summary"
    script.on(A, "GET", path, status(503, "not the leader", {"x-cumulus-leader-http": B}))
    script.on(B, "GET", path, ok(summary_json()))
    assert client.summary("job-000001").step == 40
    assert script.where() == [f"{A} GET {path}", f"{B} GET {path}"]


def test_a_summary_without_its_defaults_has_them() -> None:
    s = cumulus.JobSummary.from_json(
        {"job_id": "job-000001", "state": "pending", "committed_step": None}
    )
    assert (s.name, s.state, s.step, s.total_steps, s.steps_per_s, s.eta_ms) == (
        "",
        cumulus.JobState.PENDING,
        0,
        0,
        0.0,
        0,
    )
    assert s.metrics == {} and s.history == () and s.live is False
    assert (s.restarts_used, s.running_ms, s.paused_ms, s.committed_step) == (0, 0, 0, None)
    assert (s.submitted_at_ms, s.finished_at_ms) == (0, 0)
    assert (s.eta_s, s.progress) == (None, None)
    sample = cumulus.ProgressSample.from_json({})
    assert sample == cumulus.ProgressSample(0, 0, 0, 0.0, {})
    finished = cumulus.JobSummary.from_json(summary_json(state="succeeded", eta_ms=0))
    assert finished.finished and finished.eta_s is None


@pytest.mark.parametrize(
    ("summary", "match"),
    [
        ({"name": "x"}, "no job_id"),
        ({"job_id": ""}, "no job_id"),
        ({"job_id": 7}, "job_id"),
        (summary_json(state=3), "state"),
        (summary_json(step="40"), "step"),
        (summary_json(step=True), "step"),
        (summary_json(total_steps=1.5), "total_steps"),
        (summary_json(steps_per_s="fast"), "steps_per_s"),
        (summary_json(steps_per_s=False), "steps_per_s"),
        (summary_json(eta_ms=1.5), "eta_ms"),
        (summary_json(metrics={"loss": "high"}), "loss"),
        (summary_json(metrics=[1.0]), "metrics"),
        (summary_json(paused_ms="3"), "paused_ms"),
        (summary_json(running_ms=None, committed_step="30"), "committed_step"),
        (summary_json(committed_step=True), "committed_step"),
        (summary_json(finished_at_ms=-0.5), "finished_at_ms"),
        (summary_json(live="true"), "live"),
        (summary_json(history={"at_ms": 1}), "history"),
        (summary_json(history=[3]), "a progress sample"),
        (summary_json(history=[{"at_ms": "1"}]), "at_ms"),
        (summary_json(history=[{"steps_per_s": "x"}]), "steps_per_s"),
        (summary_json(history=[{"metrics": {"loss": None, "acc": "1"}}]), "acc"),
    ],
)
def test_malformed_summaries_are_protocol_errors(summary: Any, match: str) -> None:
    with pytest.raises(errors.ProtocolError, match=match):
        cumulus.JobSummary.from_json(summary)


def test_a_malformed_summary_answer_is_a_protocol_error(client: Client, script: Script) -> None:
    script.on(A, "GET", "/v1/jobs/job-000001/summary", ok([summary_json()]))
    with pytest.raises(errors.ProtocolError, match="a job summary"):
        client.summary("job-000001")


@pytest.mark.parametrize(
    ("code", "error"),
    [(404, errors.NotFound), (401, errors.Unauthorized), (400, errors.InvalidSpec)],
)
def test_summary_errors_are_typed(
    client: Client, script: Script, code: int, error: type[errors.ApiError]
) -> None:
    script.on(A, "GET", "/v1/jobs/job-000009/summary", status(code, "nope"))
    with pytest.raises(error, match="nope"):
        client.summary("job-000009")


@pytest.mark.parametrize("job_id", ["", "job-1/cancel", "../x", "job-1?x=1", "a b", 7, None])
def test_summary_refuses_what_is_not_a_job_id(client: Client, script: Script, job_id: Any) -> None:
    with pytest.raises(errors.InvalidSpec, match="not a job id"):
        client.summary(job_id)
    assert script.calls == []


def test_summaries_send_the_filter_and_parse_the_list(client: Client, script: Script) -> None:
    listed = [
        summary_json("job-000003", history=None),
        {"job_id": "job-000002", "state": "paused"},
    ]
    script.on(
        A,
        "GET",
        "/v1/jobs/summaries",
        ok({"summaries": listed}),
        ok({"summaries": []}),
        ok({}),
        ok({"summaries": listed[1:]}),
    )
    got = client.summaries()
    assert [s.job_id for s in got] == ["job-000003", "job-000002"]
    assert got[0].history == () and got[0].step == 40 and got[1].state == "paused"
    assert client.summaries(state="running") == []
    assert client.summaries(limit=10_000) == []
    assert [s.job_id for s in client.summaries("paused", 1)] == ["job-000002"]
    assert script.where() == [f"{A} GET /v1/jobs/summaries"] * 4
    assert [dict(r.url.params) for r in script.calls] == [
        {},
        {"state": "running"},
        {"limit": "10000"},
        {"state": "paused", "limit": "1"},
    ]


@pytest.mark.parametrize("state", JOB_STATES)
def test_summaries_take_every_job_state(client: Client, script: Script, state: str) -> None:
    script.on(A, "GET", "/v1/jobs/summaries", ok({"summaries": []}))
    client.summaries(state=state)
    assert script.calls[0].url.params["state"] == state


@pytest.mark.parametrize(
    ("state", "limit", "match"),
    [
        ("", None, "state must be None"),
        ("Running", None, "state must be None"),
        ("all", None, "state must be None"),
        (3, None, "state must be None"),
        (None, 0, "limit must be None"),
        (None, -1, "limit must be None"),
        (None, 10_001, "limit must be None"),
        (None, True, "limit must be None"),
        (None, 1.0, "limit must be None"),
        (None, "10", "limit must be None"),
    ],
)
def test_summaries_refuse_bad_arguments(
    client: Client, script: Script, state: Any, limit: Any, match: str
) -> None:
    with pytest.raises(errors.InvalidSpec, match=match) as e:
        client.summaries(state=state, limit=limit)
    assert isinstance(e.value, ValueError)
    assert e.value.status is None and script.calls == []


@pytest.mark.parametrize(
    "body", [[], {"summaries": {"job_id": "job-000001"}}, {"summaries": [3]}, "x"]
)
def test_malformed_summaries_answers_are_protocol_errors(
    client: Client, script: Script, body: Any
) -> None:
    script.on(A, "GET", "/v1/jobs/summaries", ok(body))
    with pytest.raises(errors.ProtocolError):
        client.summaries()


def test_a_job_shows_its_paused_time() -> None:
    assert cumulus.JobInfo.from_json(job_json(paused_ms=4_500)).paused_ms == 4_500
    assert cumulus.JobInfo.from_json(job_json()).paused_ms == 0
    with pytest.raises(errors.ProtocolError, match="paused_ms"):
        cumulus.JobInfo.from_json(job_json(paused_ms="4500"))


def test_a_job_shows_its_state_changes_and_where_each_rank_resumed_from() -> None:
    job = cumulus.JobInfo.from_json(
        job_json(
            state_changes=4,
            ranks=[
                {"rank": 0, "state": "running", "resume_step": 40, "resume_job_id": "job-000003"},
                {"rank": 1, "state": "running"},
            ],
        )
    )
    assert job.state_changes == 4
    assert (job.ranks[0].resume_step, job.ranks[0].resume_job_id) == (40, "job-000003")
    assert (job.ranks[1].resume_step, job.ranks[1].resume_job_id) == (None, "")
    with pytest.raises(errors.ProtocolError, match="resume_step"):
        cumulus.JobInfo.from_json(
            job_json(ranks=[{"rank": 0, "state": "running", "resume_step": "40"}])
        )


# -- uploads, environments, remote functions (issue 41) --------------------------------


def test_logs_tail_is_sent_and_checked(client: Client, script: Script) -> None:
    def tailed(r: httpx.Request) -> httpx.Response:
        assert r.url.params["tail"] == "5"
        data = sse(("log", "r0a0o4", line(0, 0, 0, "last")), ("end", "r0a0o4", {}))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=data)

    script.on(A, "GET", "/v1/jobs/job-000001/logs", tailed)
    assert [x.line for x in client.job("job-000001").logs(tail=5)] == ["last"]
    for bad in (-1, 10_001, True, "5"):
        with pytest.raises(errors.InvalidSpec, match="tail must be"):
            list(client.logs("job-000001", tail=bad))  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidSpec, match="exclude"):
        list(client.logs("job-000001", tail=1, cursor="r0a0o4"))


def test_an_upload_is_put_once_then_named_in_the_spec(
    client: Client, script: Script, tmp_path: Path
) -> None:
    (tmp_path / "train.py").write_text("print(1)\n")
    with _bundle.pack_directory(tmp_path) as packed:
        digest, data = packed.digest, packed.read()
    path = f"/v1/blobs/{digest}"

    def put(r: httpx.Request) -> httpx.Response:
        body = r.read()
        assert r.headers["content-length"] == str(len(body)) and body == data
        return httpx.Response(201, json={"digest": digest, "size_bytes": len(body)})

    stored = lambda r: httpx.Response(200, headers={"content-length": str(len(data))})  # noqa: E731
    script.on(A, "HEAD", path, lambda r: httpx.Response(404), stored)
    script.on(A, "PUT", path, put)
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    first = client.submit(["python3", "train.py"], upload=tmp_path, requirements=["numpy==2.1"])
    second = client.submit(["python3", "train.py"], upload=tmp_path)
    assert first.upload is not None and second.upload is not None
    assert first.upload.sent_bytes == first.upload.blob.size_bytes == len(data)
    assert second.upload.sent_bytes == 0 and second.upload.blob == first.upload.blob
    assert [c.method for c in script.calls] == ["HEAD", "PUT", "POST", "HEAD", "POST"]
    spec = json.loads(script.calls[2].content)["spec"]
    assert spec["workdir"] == {"digest": digest, "size_bytes": len(data)}
    assert spec["environment"] == {
        "requirements": "numpy==2.1\n",
        "python": "",
        "index_url": "",
        "find_links": [],
        "no_index": False,
    }
    assert "environment" not in json.loads(script.calls[4].content)["spec"]


def test_an_unchanged_upload_is_not_packed_again_while_the_cluster_has_it(
    client: Client, script: Script, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "project"
    root.mkdir()
    (root / "train.py").write_text("print(1)\n")
    (root / "fresh.py").write_text("x = 1\n")  # modified "now": checked by its bytes
    with _bundle.pack_directory(root) as packed:
        digest, data = packed.digest, packed.read()
    path = f"/v1/blobs/{digest}"
    packs: list[int] = []
    real = _bundle.pack_selection

    def counting(*args: Any, **kwargs: Any) -> _bundle.PackedDir:
        packs.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_bundle, "pack_selection", counting)
    put = lambda r: httpx.Response(201, json={"digest": digest, "size_bytes": len(r.read())})  # noqa: E731
    stored = lambda r: httpx.Response(200, headers={"content-length": str(len(data))})  # noqa: E731
    gone = lambda r: httpx.Response(404)  # noqa: E731
    script.on(A, "HEAD", path, gone, stored, gone, gone, stored)
    script.on(A, "PUT", path, put, put)
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    jobs = [client.submit(["python3", "train.py"], upload=root) for _ in range(2)]
    assert len(packs) == 1
    assert [j.upload.sent_bytes if j.upload else -1 for j in jobs] == [len(data), 0]
    assert jobs[1].upload == dataclasses.replace(jobs[0].upload, sent_bytes=0)  # type: ignore[type-var]
    # The cluster lost the blob: packed and sent again.
    client.submit(["python3", "train.py"], upload=root)
    assert len(packs) == 2
    assert [c.method for c in script.calls][-4:] == ["HEAD", "HEAD", "PUT", "POST"]
    client.submit(["python3", "train.py"], upload=root)
    assert len(packs) == 2 and [c.method for c in script.calls][-2:] == ["HEAD", "POST"]
    # With the cache turned off, every submit packs.
    monkeypatch.setenv("CUMULUS_NO_UPLOAD_CACHE", "1")
    client.submit(["python3", "train.py"], upload=root)
    assert len(packs) == 3


def test_environment_arguments_are_checked_before_sending(
    client: Client, script: Script, tmp_path: Path
) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("torch\n")
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000001", "created": True}))
    client.submit(["x"], requirements=req, python="3.11", find_links=["wheels"], no_index=True)
    env = json.loads(script.calls[0].content)["spec"]["environment"]
    assert env["requirements"] == "torch\n" and env["python"] == "3.11"
    assert env["find_links"] == [os.path.abspath("wheels")] and env["no_index"] is True
    bad: list[tuple[dict[str, Any], str]] = [
        ({"requirements": ["a\nb"]}, "no newline"),
        ({"requirements": "absent.txt"}, "requirements file"),
        ({"requirements": ["x" * 70_000]}, "over 65536 bytes"),
        ({"python": "3"}, "python must be"),
        ({"python": "2.7"}, "python must be"),
        ({"no_index": True}, "give requirements"),
        ({"requirements": [], "find_links": "dir"}, "find_links must be a list"),
        ({"requirements": [], "find_links": ["d"] * 17}, "at most 16 find_links"),
        ({"upload": tmp_path, "working_dir": tmp_path}, "exclude each other"),
    ]
    for kwargs, match in bad:
        with pytest.raises(errors.InvalidSpec, match=match):
            client.submit(["x"], **kwargs)
    assert len(script.calls) == 1


def test_run_keeps_its_own_options_apart_from_the_functions(client: Client) -> None:
    with pytest.raises(TypeError, match="needs a function"):
        client.run_async("not callable")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"run\(func=fn\)"):
        client.run_async()
    with pytest.raises(TypeError, match="picklable"):
        client.run_async(func=len, lock=__import__("threading").Lock())
    with pytest.raises(TypeError, match="options may not set 'upload'"):
        client.run_async(len, options={"upload": "."})
    with pytest.raises(TypeError, match="given twice"):
        client.run_async(len, ckpt_dir="/c", options={"ckpt_dir": "/d"})
    with pytest.raises(TypeError, match="picklable"):
        client.run_async(len, __import__("threading").Lock())


def test_fail_fast_is_sent_only_when_turned_off(client: Client, script: Script) -> None:
    for n in range(2):
        script.on(A, "POST", "/v1/jobs", ok({"job_id": f"job-00000{n}", "created": True}))
    client.submit(["true"])
    client.submit(["true"], fail_fast=False)
    specs = [json.loads(c.content)["spec"] for c in script.calls]
    assert "fail_fast" not in specs[0] and specs[1]["fail_fast"] is False
    with pytest.raises(errors.InvalidSpec, match="fail_fast"):
        client.submit(["true"], fail_fast="no")  # type: ignore[arg-type]


def test_submit_sends_the_straggler_rule_only_when_given_and_checks_it(
    client: Client, script: Script
) -> None:
    script.on(A, "POST", "/v1/jobs", ok({"job_id": "job-000003", "created": True}))
    client.submit(["x"])
    client.submit(["x"], straggler_action="restart", straggler_fraction=0.5, straggler_window_s=2.5)
    client.submit(["x"], straggler_action="off")
    specs = [json.loads(r.content)["spec"] for r in script.calls]
    fields = [{k: v for k, v in s.items() if k.startswith("straggler")} for s in specs]
    assert fields == [
        {},
        {"straggler_action": "restart", "straggler_fraction": 0.5, "straggler_window_ms": 2500},
        {"straggler_action": "off"},
    ]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"straggler_action": "kill"}, "straggler_action must be one of warn, restart"),
        ({"straggler_fraction": 0.99}, "straggler_fraction must be a number"),
        ({"straggler_fraction": True}, "straggler_fraction must be a number"),
        ({"straggler_window_s": 1}, "straggler_window_s must be a number of seconds"),
        ({"straggler_window_s": 86_401}, "straggler_window_s must be a number of seconds"),
    ]
    for kwargs, match in bad:
        with pytest.raises(errors.InvalidSpec, match=match):
            client.submit(["x"], **kwargs)
    assert len(script.calls) == 3, "nothing sent for a refused rule"


def test_job_info_shows_stragglers_and_the_rule() -> None:
    # An older coordinator's answer: the defaults, no flags.
    old = cumulus.JobInfo.from_json(job_json())
    assert (old.straggler_action, old.straggler_fraction, old.straggler_window_ms) == (
        "warn",
        0.7,
        60_000,
    )
    assert old.stragglers == () and old.avoided_workers == ()
    assert not any(r.straggler for r in old.ranks)
    job = job_json()
    job["spec"] = {
        **job["spec"],
        "straggler_action": "exclude",
        "straggler_fraction": 0.5,
        "straggler_window_ms": 30_000,
    }
    job["ranks"][1]["straggler"] = True
    job["stragglers"] = [
        {
            "rank": 1,
            "attempt": 1,
            "worker_id": "w",
            "steps_per_s": 3,
            "median_steps_per_s": 10.5,
            "action": "exclude",
            "at_ms": 12,
        }
    ]
    job["avoided_workers"] = ["w"]
    info = cumulus.JobInfo.from_json(job)
    assert (info.straggler_action, info.straggler_fraction, info.straggler_window_ms) == (
        "exclude",
        0.5,
        30_000,
    )
    assert info.ranks[1].straggler and not info.ranks[0].straggler
    assert info.stragglers == (cumulus.StragglerFlag(1, 1, "w", 3.0, 10.5, "exclude", 12),)
    assert info.avoided_workers == ("w",)
    job["stragglers"] = [{"rank": "1"}]
    with pytest.raises(errors.ProtocolError, match="rank"):
        cumulus.JobInfo.from_json(job)
