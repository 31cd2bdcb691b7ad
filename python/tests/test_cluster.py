"""Integration tests against real local clusters (``cumulusctl local up``): Python ranks
using ``cumulus.runtime`` under a real worker agent, driven through the SDK."""

from __future__ import annotations

import json
import math
import sys
import textwrap
import warnings
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest

import cumulus
from conftest import RECORDS_PER_SHARD, SHARDS, TRAINER, UNRELATED_CA_PEM
from cumulus import errors
from localcluster import LocalCluster, explain, wait_for

pytestmark = pytest.mark.cluster

TOTAL_RECORDS = SHARDS * RECORDS_PER_SHARD
TOTAL_SUM = TOTAL_RECORDS * (TOTAL_RECORDS + 1) // 2
JOB_TIMEOUT_S = 180


def wait_watching_progress(
    job: cumulus.Job, timeout_s: float
) -> tuple[cumulus.JobInfo, dict[int, int]]:
    """Waits for the job like ``Job.wait``, returning also the highest step the leader
    showed for each rank while it ran (progress is soft state: the leader learns it from
    the agent's next heartbeat, every second, and shows it for live attempts only)."""
    seen: dict[int, int] = {}

    def finished() -> cumulus.JobInfo | None:
        info = job.status()
        for r in info.ranks:
            seen[r.rank] = max(seen.get(r.rank, 0), r.step)
        return info if info.finished else None

    return wait_for(finished, timeout_s, f"{job.id} to finish"), seen


def results(out: Path, world_size: int) -> list[dict[str, int | None]]:
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world_size)]


def test_a_python_rank_reports_checkpoints_and_finishes(
    cluster: LocalCluster, client: cumulus.Client, dataset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job = client.submit(
        # 40 steps of 60 ms: long enough for a few heartbeats to carry progress.
        [*TRAINER, "--out", str(out), "--ckpt-every", "10", "--sleep-ms", "60"],
        world_size=2,
        dataset=dataset,
        ckpt_dir=tmp_path / "ckpt",
        name="python-fault-free",
    )
    info, progress = wait_watching_progress(job, JOB_TIMEOUT_S)
    assert info.succeeded, explain(job, cluster)
    assert info.restarts_used == 0 and info.committed_step == 40

    res = results(out, 2)
    assert sum(r["count"] for r in res) == TOTAL_RECORDS  # type: ignore[misc]
    assert sum(r["sum"] for r in res) == TOTAL_SUM  # type: ignore[misc]
    assert all(r["attempt"] == 0 and r["resumed_from"] is None for r in res)
    # Progress reports of both ranks reached the leader.
    assert sorted(progress) == [0, 1] and all(0 < s <= 40 for s in progress.values()), progress

    checkpoints = job.checkpoints()
    assert [c.step for c in checkpoints] == [40, 30, 20]  # ckpt_keep defaults to 3
    assert all(c.verified and c.size_bytes > 0 for c in checkpoints)
    assert checkpoints[0].latest and not checkpoints[1].latest
    part = Path(checkpoints[0].path) / "rank-1" / "attempt-0"
    assert json.loads((part / "model.json").read_text())["count"] == TOTAL_RECORDS // 2
    reader = json.loads((part / "cumulus-state.json").read_text())["reader"]
    assert (reader["shard"], reader["record"]) == (1, RECORDS_PER_SHARD)  # at its last record

    lines = [x.line for x in job.logs(follow=False)]
    assert "rank=0 checkpoint 10 committed: step-00000010/rank-0/attempt-0" in lines


def test_a_killed_rank_resumes_exactly_and_the_stale_attempt_is_refused(
    cluster: LocalCluster, client: cumulus.Client, dataset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job = client.submit(
        [
            *TRAINER,
            "--out",
            str(out),
            "--ckpt-every",
            "10",
            "--sleep-ms",
            "20",
            "--kill-rank",
            "0",
            "--kill-at-step",
            "15",
            "--stale-probe",
        ],
        world_size=2,
        dataset=dataset,
        ckpt_dir=tmp_path / "ckpt",
        max_restarts=3,
        backoff_initial_ms=100,
        backoff_max_ms=500,
        name="python-kill-resume",
    )
    info = job.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded, explain(job, cluster)
    assert info.restarts_used == 1, explain(job, cluster)
    (restart,) = info.restarts
    assert restart.resume_step == 10 and sorted(restart.ranks) == [0, 1], restart
    assert "signal 9" in restart.cause or "killed" in restart.cause, restart.cause

    # Every record consumed exactly once over both attempts.
    res = results(out, 2)
    assert all(r["attempt"] == 1 and r["resumed_from"] == 10 for r in res), res
    assert sum(r["count"] for r in res) == TOTAL_RECORDS  # type: ignore[misc]
    assert sum(r["sum"] for r in res) == TOTAL_SUM  # type: ignore[misc]

    # Rank 1's first attempt, stopped for the group restart, could not commit: refused,
    # which the runtime returns as not committed (it was asked to stop), not an error.
    probe = json.loads((out / "probe-rank-1.attempt-0.json").read_text())
    assert probe["error"] == "refused", probe

    assert [c.step for c in job.checkpoints()] == [40, 30, 20]
    lines = [(x.rank, x.attempt, x.line) for x in job.logs(follow=False)]
    assert (0, 0, "rank=0 killing itself at step 15") in lines
    assert any(r == 0 and a == 1 and "start=10" in text for r, a, text in lines), lines


def test_sdk_errors_cancel_and_should_stop(
    cluster: LocalCluster, client: cumulus.Client, tmp_path: Path
) -> None:
    with pytest.raises(errors.NotFound, match="job-999999"):
        client.get_job("job-999999")
    with pytest.raises(errors.InvalidSpec):
        client.submit(["true"], world_size=100_000)
    with (
        cluster.client(token="wrong-token") as bad,
        pytest.raises(errors.Unauthorized),
    ):
        bad.jobs()
    assert client.cluster().leader is not None
    assert [w.state for w in client.cluster().workers] == ["alive"]

    script = textwrap.dedent(
        """
        import time
        from cumulus import runtime
        runtime.should_stop()  # installs the SIGTERM handler
        print("ready", flush=True)
        while not runtime.should_stop():
            time.sleep(0.02)
        # "stop" when the agent's request came first, "signal" when SIGTERM did.
        print(f"stopped gracefully: {runtime.stop_request()}", flush=True)
        """
    )
    job = client.submit([sys.executable, "-c", script], name="python-cancel")
    assert job.created
    for entry in job.logs(follow=True):
        if entry.line == "ready":
            break
    assert job.cancel().state == "cancelled"
    assert job.cancel().state == "cancelled"  # idempotent
    info = job.wait(timeout_s=60)
    assert info.state == "cancelled"
    assert job in [client.job(j.id) for j in client.jobs()]
    assert job.checkpoints() == []  # no checkpoint dir
    wait_for(
        lambda: (
            {"stopped gracefully: stop", "stopped gracefully: signal"}
            & {x.line for x in job.logs(follow=False)}
        ),
        30,
        "the rank to log its graceful stop",
    )


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


def test_the_sdk_speaks_https_to_a_tls_local_cluster(
    cluster: LocalCluster, client: cumulus.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in CONNECTION_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    ca = cluster.ca_file
    assert ca is not None and ca.is_file(), "cumulusctl local up makes a TLS cluster by default"
    addr = cluster.http_addrs[0]
    # Found through cluster.json alone, as cumulusctl does: https, verified by its CA.
    with cumulus.Client(local_dir=cluster.dir) as local:
        assert local.addresses == tuple(f"https://{a}" for a in cluster.http_addrs)
        assert local.connection.ca_file == ca
        assert local.cluster().leader is not None
        assert local.health(addr)["node_id"] >= 1
    assert client.addresses[0] == f"https://{addr}" and client.jobs() is not None
    # Plaintext HTTP to the TLS port gets no answer, raw or through the SDK.
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://{addr}/health", timeout=5, trust_env=False)
    with cluster.client(insecure=True, tls_ca=None, retry_total_s=0.5) as plain:
        assert plain.addresses[0] == f"http://{addr}"
        with pytest.raises(errors.Unavailable):
            plain.jobs()
    # A CA that did not sign the coordinators' certificates is not trusted.
    other = tmp_path / "other-ca.pem"
    other.write_text(UNRELATED_CA_PEM)
    with cluster.client(tls_ca=other, retry_total_s=0.5) as wrong:
        with pytest.raises(errors.Unavailable, match="CERTIFICATE_VERIFY_FAILED"):
            wrong.jobs()
        with pytest.raises(errors.Unavailable, match="CERTIFICATE_VERIFY_FAILED"):
            wrong.health(addr)


def test_the_sdk_speaks_plaintext_to_an_insecure_local_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in CONNECTION_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with LocalCluster(tmp_path / "plain", insecure=True) as plain:
        assert "tls_dir" not in plain.file and plain.ca_file is None
        with cumulus.Client(local_dir=plain.dir) as c:
            assert c.addresses == tuple(f"http://{a}" for a in plain.http_addrs)
            assert c.connection.ca_file is None
            assert c.cluster().leader is not None
        # Explicit addresses need insecure=True (or CUMULUS_INSECURE) to be plaintext.
        with pytest.raises(errors.ConfigError, match="CUMULUS_INSECURE"):
            cumulus.Client(plain.http_addrs, token_file=plain.token_file)
        with plain.client() as c:
            assert c.jobs() == []


def test_a_users_client_certificate_authenticates_as_that_user_until_revoked(
    cluster: LocalCluster, client: cumulus.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in CONNECTION_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    # The cluster (administrator) token is where the SDK looks for one: with a client
    # certificate it must take neither, or the jobs below would be the administrator's.
    monkeypatch.setenv("CUMULUS_LOCAL_DIR", str(cluster.dir))
    monkeypatch.setenv("CUMULUS_TOKEN_FILE", str(cluster.token_file))
    user = "cert-user"
    r = cluster.cumulusctl("token", "create", user, "--role", "submit")
    assert r.returncode == 0, r.stderr + r.stdout
    tls_dir = Path(cluster.file["tls_dir"])
    r = cluster.cumulusctl("certs", "issue", "user", user, "--dir", str(tls_dir))
    assert r.returncode == 0, r.stderr + r.stdout
    cert, key = tls_dir / f"user-{user}.pem", tls_dir / f"user-{user}-key.pem"
    assert cert.is_file() and key.is_file(), sorted(p.name for p in tls_dir.iterdir())

    # Another user's job: the administrator's, through the cluster token.
    theirs = client.submit([sys.executable, "-c", "import time; time.sleep(600)"], name="admin")
    try:
        with cumulus.Client(
            cluster.http_addrs, tls_ca=cluster.ca_file, tls_cert=cert, tls_key=key
        ) as mine:
            token_resolved = mine.connection.token is not None  # (never shown on failure)
            assert not token_resolved and mine.connection.cert_user == user
            job = mine.submit(
                [sys.executable, "-c", "print('hello from a certificate', flush=True)"],
                name="by-certificate",
            )
            info = job.wait(timeout_s=JOB_TIMEOUT_S)
            assert info.succeeded, explain(job, cluster)
            assert info.owner == user
            assert client.get_job(job.id).owner == user
            assert "hello from a certificate" in [x.line for x in job.logs(follow=False)]

            assert client.get_job(theirs.id).owner == "admin"
            with pytest.raises(errors.Forbidden):
                mine.cancel(theirs.id)
            with pytest.raises(errors.Forbidden):
                mine.pause(theirs.id)
            assert not client.get_job(theirs.id).finished

            r = cluster.cumulusctl("token", "revoke", user)
            assert r.returncode == 0, r.stderr + r.stdout

            def refused() -> errors.Unauthorized | None:
                try:
                    mine.jobs()
                except errors.Unauthorized as e:
                    return e
                return None

            err = wait_for(refused, 30, f"the revoked {user}'s certificate to be refused")
            assert "client certificate" in str(err)
            with pytest.raises(errors.Unauthorized):
                list(job.logs(follow=False))
            with pytest.raises(errors.Unauthorized):
                mine.submit(["true"])
    finally:
        client.cancel(theirs.id)
    assert theirs.wait(timeout_s=60).state == "cancelled"


def test_submit_across_a_leader_kill_creates_exactly_one_job(
    ha_cluster: LocalCluster, ha_client: cumulus.Client
) -> None:
    leader = ha_client.cluster().leader
    assert leader is not None
    # A linearizable read is served by the leader, which the client then prefers: kill it
    # under the client's feet, so the submit meets a dead node, then an election.
    ha_client.jobs(linearizable=True)
    assert ha_client._preferred == f"{ha_cluster.scheme}://{leader.http_addr}"
    ha_cluster.kill_coordinator(leader.http_addr)
    rid = "python-sdk-leader-kill"
    job = ha_client.submit(["true"], request_id=rid, name="leader-kill")
    assert job.created
    # A retry of the same submit (same request id and spec) is the same job...
    again = ha_client.submit(["true"], request_id=rid, name="leader-kill")
    assert again.id == job.id and not again.created
    # ...and the same request id with another spec is refused.
    with pytest.raises(errors.InvalidSpec, match="different spec"):
        ha_client.submit(["false"], request_id=rid, name="leader-kill")
    mine = [j for j in ha_client.jobs() if j.request_id == rid]
    assert [j.id for j in mine] == [job.id]
    assert job.wait(timeout_s=JOB_TIMEOUT_S).succeeded, explain(job, ha_cluster)
    new_leader = ha_client.cluster().leader
    assert new_leader is not None and new_leader.node_id != leader.node_id

    # The new leader shows the killed one as unreachable, with the role it had in its
    # view (issue 42 item 7): never heard from since the election, for over 20 heartbeats.
    def killed_shown() -> cumulus.MemberInfo | None:
        info = ha_client.cluster()
        if info.leader_id != info.node_id:
            ha_client.jobs(linearizable=True)  # prefer the leader: only it knows
            return None
        m = next(m for m in info.members if m.node_id == leader.node_id)
        return m if m.role is cumulus.MemberRole.UNREACHABLE else None

    killed = wait_for(killed_shown, 60, "the killed leader shown unreachable")
    assert killed.role == "unreachable" and killed.last_role == "follower", killed
    assert killed.last_ack_age_ms is not None and killed.last_ack_age_ms > 0, killed
    others = [m for m in ha_client.cluster().members if m.node_id != leader.node_id]
    assert {m.role for m in others} == {"leader", "follower"}, others


def test_logs_follow_across_a_coordinator_kill_yield_every_line_once(
    ha_cluster: LocalCluster, ha_client: cumulus.Client
) -> None:
    n = 150
    script = textwrap.dedent(
        f"""
        import time
        for i in range({n}):
            print(f"line {{i}}", flush=True)
            time.sleep(0.02)
        """
    )
    job = ha_client.submit([sys.executable, "-c", script], name="logs-across-kill")
    # The stream starts at the coordinator that took the submit (the leader).
    serving = ha_client._preferred.removeprefix(f"{ha_cluster.scheme}://")
    got: list[str] = []
    for entry in job.logs(follow=True):
        got.append(entry.line)
        if len(got) == 40:
            ha_cluster.kill_coordinator(serving)
    assert got == [f"line {i}" for i in range(n)], explain(job, ha_cluster)
    assert job.wait(timeout_s=JOB_TIMEOUT_S).succeeded


def test_a_failure_names_the_exception_the_rank_died_of(
    client: cumulus.Client, tmp_path: Path
) -> None:
    # Issue 42 item 4: the runtime reports the uncaught exception to its agent, so the
    # job's failure (and JobFailed) says what raised and where.
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            from cumulus import runtime


            def configure(lr: float) -> None:
                if lr > 1:
                    raise ValueError(f"bad lr {lr}")


            runtime.get_context()
            configure(5.0)
            """
        )
    )
    line = script.read_text().splitlines().index('        raise ValueError(f"bad lr {lr}")') + 1
    with pytest.raises(errors.JobFailed) as failed:
        client.run_command(
            [sys.executable, str(script)],
            max_restarts=0,
            timeout_s=JOB_TIMEOUT_S,
            name="raises",
        )
    info = failed.value.job
    assert info.state == "failed"
    for text in (str(failed.value), info.failure_cause):
        assert "ValueError: bad lr 5.0" in text and f"train.py:{line}" in text, text
    assert info.ranks[0].exit_cause == f"ValueError: bad lr 5.0 (train.py:{line})"


def test_non_finite_metrics_are_reported_and_shown_as_such(
    cluster: LocalCluster, client: cumulus.Client, tmp_path: Path
) -> None:
    # Issue 42 item 6: a diverging run's report(loss=nan) is a metric like any other,
    # never an exception in its telemetry call; every reader shows it.
    done = tmp_path / "done"
    script = textwrap.dedent(
        f"""
        import math, pathlib, time
        from cumulus import runtime

        runtime.report(1, 2, loss=math.nan, grad=math.inf, low=-math.inf, lr=0.5)
        assert runtime.flush(30)
        deadline = time.monotonic() + 300  # the test touches the file well before
        while not pathlib.Path({str(done)!r}).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        """
    )
    job = client.submit([sys.executable, "-c", script], max_restarts=0, name="non-finite-metrics")

    def reported() -> Mapping[str, float] | None:
        info = job.status()
        assert not info.finished, explain(job, cluster)
        return info.ranks[0].metrics or None

    try:
        metrics = wait_for(reported, 120, "the rank's metrics")
        assert math.isnan(metrics["loss"]), metrics
        assert metrics["grad"] == math.inf and metrics["low"] == -math.inf, metrics
        assert metrics["lr"] == 0.5, metrics
        summary = job.summary()
        assert math.isnan(summary.metrics["loss"]) and summary.metrics["grad"] == math.inf
        # The JSON on the wire spells them as the contract says.
        raw = job.status().raw["ranks"][0]["metrics"]
        assert raw["loss"] == "NaN" and raw["grad"] == "Infinity", raw
        assert raw["low"] == "-Infinity" and raw["lr"] == 0.5, raw
        shown = cluster.cumulusctl("status", job.id)
        assert shown.returncode == 0, shown.stderr
        assert "grad=inf" in shown.stdout and "loss=nan" in shown.stdout, shown.stdout
        assert "low=-inf" in shown.stdout, shown.stdout
    finally:
        done.touch()
    assert job.wait(timeout_s=JOB_TIMEOUT_S).succeeded, explain(job, cluster)


def test_restarts_without_a_checkpoint_dir_warn_at_submit(
    client: cumulus.Client, tmp_path: Path
) -> None:
    # Issue 42 item 6: every restart of such a job starts over from step 0: say it.
    with pytest.warns(cumulus.SubmitWarning, match="no checkpoint directory") as said:
        job = client.submit(["true"], max_restarts=2, name="warned")
    (w,) = said
    assert job.id in str(w.message) and "up to 2 times" in str(w.message)
    assert "step 0" in str(w.message)
    assert w.filename == __file__, w.filename  # points at the caller's submit
    assert len(job.warnings) == 1 and "no checkpoint directory" in job.warnings[0]
    # No word when restarts resume from a checkpoint, or there are no restarts.
    with warnings.catch_warnings():
        warnings.simplefilter("error", cumulus.SubmitWarning)
        quiet = [
            client.submit(["true"], max_restarts=2, ckpt_dir=tmp_path / "ckpt"),
            client.submit(["true"], max_restarts=0),
        ]
    assert all(not j.warnings for j in quiet)
    for j in (job, *quiet):
        assert j.wait(timeout_s=JOB_TIMEOUT_S).succeeded
