"""Warm spares on a real local cluster (``Client.submit(warm_spares=...)``): a restarted
rank runs in a spare the agent kept (its pid the spare's, shown before in the cluster
status), sees exactly what a freshly started rank sees, the DDP example killed mid-run
still ends bit-identical to a fault-free run, and the spares are gone once the job
ends."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

import cumulus
from localcluster import REPO_ROOT, LocalCluster, explain, pid_alive, wait_for

pytestmark = [pytest.mark.cluster]

PROBE = Path(__file__).resolve().parent / "programs" / "spare_probe.py"
EXAMPLE = REPO_ROOT / "examples" / "python" / "ddp_digits.py"
JOB_TIMEOUT_S = 300
#: Variables that differ between two attempts of one rank, however started.
PER_ATTEMPT = {
    "CUMULUS_ATTEMPT",
    "CUMULUS_AGENT_TOKEN",
    "CUMULUS_OUTPUT_DIR",
    "CUMULUS_SHARDS_FILE",
    "MASTER_PORT",
}


def spares_of(client: cumulus.Client, job_id: str) -> set[int]:
    """The pids of the warm spares the workers say they keep for ``job_id``."""
    return {s.pid for w in client.cluster().workers for s in w.warm_spares if s.job_id == job_id}


def wait_spares_gone(client: cumulus.Client, job: cumulus.Job, seen: set[int]) -> None:
    """Once the job has ended: no worker lists a spare of it, and none of the spares
    ever seen lives (a spare that became a rank ended with it)."""
    wait_for(lambda: not spares_of(client, job.id), 60, f"{job.id}'s spares unlisted")
    wait_for(lambda: not any(pid_alive(p) for p in seen), 60, f"{job.id}'s spares {seen} dead")


def test_a_spare_runs_a_restarted_rank_as_a_fresh_process_would(
    cluster: LocalCluster, client: cumulus.Client, tmp_path: Path
) -> None:
    out = tmp_path / "probe"
    out.mkdir()
    job = client.submit(
        [sys.executable, str(PROBE), str(out)],
        working_dir=tmp_path,
        max_restarts=1,
        backoff_initial_ms=10,
        backoff_max_ms=10,
        warm_spares=1,
        # cumulus.runtime read early: the spare still installs its exception report.
        warm_imports=["json", "cumulus.runtime"],
        name="spare-probe",
    )
    # Attempt 0 has reported progress and waits: its agent starts the job's spare.
    spare = wait_for(lambda: spares_of(client, job.id), 120, "a warm spare listed")
    (out / "go").touch()
    info = job.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded and info.restarts_used == 1, explain(job, cluster)
    assert "3" in info.restarts[0].cause, info.restarts[0]

    fresh: dict[str, Any] = json.loads((out / "attempt-0.json").read_text())
    warm: dict[str, Any] = json.loads((out / "attempt-1.json").read_text())
    assert warm["pid"] in spare, (warm["pid"], spare)
    assert fresh["pid"] not in spare
    for view in (fresh, warm):
        assert view["pid"] == view["pgid"] == view["sid"], view  # a session of its own
        assert view["stdin"] == "/dev/null" and view["name"] == "__main__"
        assert view["main_is_this"]
    same = ("argv", "file", "cwd", "path0", "ppid", "uid", "gid", "groups", "umask", "executable")
    assert {k: fresh[k] for k in same} == {k: warm[k] for k in same}
    assert fresh["cwd"] == str(tmp_path.resolve()) and fresh["path0"] == str(PROBE.parent)
    env0 = {k: v for k, v in fresh["env"].items() if k not in PER_ATTEMPT}
    env1 = {k: v for k, v in warm["env"].items() if k not in PER_ATTEMPT}
    assert env0 == env1
    assert warm["env"]["CUMULUS_ATTEMPT"] == "1"
    assert set(fresh["env"]) == set(warm["env"])

    lines = [(x.attempt, x.line) for x in job.logs(follow=False)]
    assert (1, "stdout of attempt 1") in lines and (1, "stderr of attempt 1") in lines, lines
    assert any(
        a == 1 and line.startswith(f"[setup] warm spare pid {warm['pid']} ") for a, line in lines
    ), lines
    assert not any(a == 0 and "warm spare" in line for a, line in lines), lines
    wait_spares_gone(client, job, spare | {warm["pid"]})


@pytest.mark.torch
def test_ddp_killed_rank_resumes_exactly_in_a_warm_spare(
    cluster: LocalCluster, client: cumulus.Client, digits_shards: Path, tmp_path: Path
) -> None:
    pytest.importorskip("torch", reason="PyTorch is not installed")
    steps, ckpt_every = 300, 50

    def submit(name: str, *extra: str, **spec: Any) -> tuple[cumulus.Job, Path]:
        out = tmp_path / name
        job = client.submit(
            [
                sys.executable,
                str(EXAMPLE),
                "--out",
                str(out),
                "--steps",
                str(steps),
                "--ckpt-every",
                str(ckpt_every),
                *extra,
            ],
            world_size=2,
            dataset=digits_shards,
            ckpt_dir=tmp_path / f"ckpt-{name}",
            max_restarts=2,
            backoff_initial_ms=100,
            backoff_max_ms=500,
            name=f"ddp-{name}",
            **spec,
        )
        return job, out

    clean, clean_out = submit("clean")
    # Paced, so that the kill lands after a committed step and with the spare kept.
    warm, warm_out = submit("warm", "--step-sleep-ms", "40", warm_spares=1, warm_imports=["torch"])
    spare = wait_for(lambda: spares_of(client, warm.id), 120, "a warm spare listed")

    def committed() -> bool:
        step = warm.status().committed_step
        return step is not None and step >= ckpt_every

    wait_for(committed, JOB_TIMEOUT_S, "the first committed step")
    rank0 = next(r for r in warm.status().ranks if r.rank == 0)
    assert rank0.pid > 0 and rank0.attempt == 0, rank0
    os.kill(rank0.pid, signal.SIGKILL)

    def restarted() -> set[int] | None:
        ranks = warm.status().ranks
        ok = all(r.attempt == 1 and r.state == "running" and r.pid > 0 for r in ranks)
        return {r.pid for r in ranks} if ok else None

    pids = wait_for(restarted, JOB_TIMEOUT_S, "both ranks running again")
    info = warm.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded and info.restarts_used == 1, explain(warm, cluster)
    assert clean.wait(timeout_s=JOB_TIMEOUT_S).succeeded, explain(clean, cluster)
    resumed = info.restarts[0].resume_step
    assert resumed is not None and resumed >= ckpt_every, info.restarts

    # One of the restarted ranks ran in the spare listed before the kill.
    took = [
        x.line for x in warm.logs(follow=False) if x.attempt == 1 and "warm spare pid" in x.line
    ]
    assert len(took) == 1, took
    spare_pid = int(took[0].split()[4])
    assert spare_pid in spare and spare_pid in pids, (took, spare, pids)

    a = [json.loads((clean_out / f"rank-{r}.json").read_text()) for r in range(2)]
    b = [json.loads((warm_out / f"rank-{r}.json").read_text()) for r in range(2)]
    assert all(r["attempt"] == 1 and r["resumed_from"] == resumed for r in b), b
    for ra, rb in zip(a, b, strict=True):
        assert ra["record_digest"] == rb["record_digest"], (ra, rb)
        assert ra["weights_sha256"] == rb["weights_sha256"]
    assert (clean_out / "model.safetensors").read_bytes() == (
        warm_out / "model.safetensors"
    ).read_bytes()
    wait_spares_gone(client, warm, spare | pids)
