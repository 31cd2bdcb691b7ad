"""In-process restarts under a real local cluster (docs/architecture.md, "Restart
paths"): the DDP example (``examples/python/ddp_digits.py``, gloo, world size 2, which runs
its training in ``cumulus.runtime.run``) with one rank ``kill -9``ed keeps the survivor's
process and ends bit-identical to a fault-free run; a second kill during the recovery
falls back to a full restart, still exact; a SIGSTOPped rank is replaced while its peer
keeps its process; and a survivor that ignores the restart is fenced (its commit refused)
and then replaced by a full restart."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

import cumulus
from conftest import PROGRAMS
from localcluster import REPO_ROOT, LocalCluster, explain, wait_for

pytestmark = [pytest.mark.cluster]

EXAMPLE = REPO_ROOT / "examples" / "python" / "ddp_digits.py"
STEPS, CKPT_EVERY, KILL_AT = 160, 40, 90
RESUMED = KILL_AT - KILL_AT % CKPT_EVERY
JOB_TIMEOUT_S = 300


def submit_ddp(
    client: cumulus.Client, shards: Path, base: Path, name: str, *extra: str
) -> tuple[cumulus.Job, Path]:
    out = base / name
    job = client.submit(
        [
            sys.executable,
            str(EXAMPLE),
            "--out",
            str(out),
            "--steps",
            str(STEPS),
            "--ckpt-every",
            str(CKPT_EVERY),
            # Paced: the leader hears of the survivor's first progress report (a heartbeat,
            # 1 s) before the kill, as it must to keep its process.
            "--step-sleep-ms",
            "15",
            *extra,
        ],
        world_size=2,
        dataset=shards,
        ckpt_dir=base / f"ckpt-{name}",
        max_restarts=3,
        backoff_initial_ms=100,
        backoff_max_ms=500,
        stop_grace_s=1,  # a replaced rank blocked in its rendezvous goes quickly
        name=f"inproc-{name}",
    )
    return job, out


def results(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


def start_pids(job: cumulus.Job) -> dict[tuple[int, int], int]:
    """``(rank, attempt) → pid`` from the example's start lines in the job's logs."""
    pids = {}
    for x in job.logs(follow=False):
        m = re.search(r"rank=(\d+) attempt=(\d+) .* pid=(\d+)", x.line)
        if m:
            pids[(int(m[1]), int(m[2]))] = int(m[3])
    return pids


def assert_same_training(clean: list[dict[str, Any]], other: list[dict[str, Any]]) -> None:
    for ra, rb in zip(clean, other, strict=True):
        assert ra["steps"] == rb["steps"] == STEPS
        assert ra["records"] == rb["records"] == STEPS * 32
        assert ra["record_digest"] == rb["record_digest"], (ra, rb)
        assert ra["weights_sha256"] == rb["weights_sha256"] == clean[0]["weights_sha256"]


def test_ddp_survivor_keeps_its_process_and_the_run_stays_exact(
    cluster: LocalCluster, client: cumulus.Client, digits_shards: Path, tmp_path: Path
) -> None:
    pytest.importorskip("torch", reason="PyTorch is not installed")
    clean, clean_out = submit_ddp(client, digits_shards, tmp_path, "clean")
    once, once_out = submit_ddp(
        client, digits_shards, tmp_path, "once", "--kill-rank", "1", "--kill-at-step", str(KILL_AT)
    )
    # Rank 1 dies at step 90; rank 0, restarted in-process, kills itself as its second
    # attempt begins: a failure during the recovery.
    twice, twice_out = submit_ddp(
        client,
        digits_shards,
        tmp_path,
        "twice",
        "--kill-rank",
        "1",
        "--kill-at-step",
        str(KILL_AT),
        "--kill-again-rank",
        "0",
    )
    assert clean.wait(timeout_s=JOB_TIMEOUT_S).succeeded, explain(clean, cluster)
    reference = results(clean_out)

    info = once.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded and info.restarts_used == 1, explain(once, cluster)
    (restart,) = info.restarts
    assert restart.path == "in_process", (restart, explain(once, cluster))
    assert restart.in_process_ranks == (0,), restart
    assert restart.resume_step == RESUMED, restart
    after = results(once_out)
    assert [r["attempt"] for r in after] == [1, 1], after
    assert all(r["resumed_from"] == RESUMED for r in after), after
    # The survivor restored the step from its asynchronous checkpoint's host copy, the
    # replacement from the part's files.
    assert [r["restore_source"] for r in after] == ["memory", "disk"], after
    pids = start_pids(once)
    # The survivor kept its process; the killed rank got a new one.
    assert after[0]["pid"] == pids[(0, 0)] == pids[(0, 1)], (after, pids)
    assert after[1]["pid"] == pids[(1, 1)] != pids[(1, 0)], (after, pids)
    assert_same_training(reference, after)
    assert (clean_out / "model.safetensors").read_bytes() == (
        once_out / "model.safetensors"
    ).read_bytes()

    info = twice.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded and info.restarts_used == 2, explain(twice, cluster)
    first, second = info.restarts
    assert first.path == "in_process" and first.in_process_ranks == (0,), first
    assert second.path == "full" and second.in_process_ranks == (), second
    assert "had not" in second.path_reason, second
    after = results(twice_out)
    assert [r["attempt"] for r in after] == [2, 2], after
    assert [r["restore_source"] for r in after] == ["disk", "disk"], after
    pids = start_pids(twice)
    # The full restart gave both ranks new processes.
    assert after[0]["pid"] == pids[(0, 2)] != pids[(0, 0)], (after, pids)
    assert after[1]["pid"] == pids[(1, 2)] != pids[(1, 0)], (after, pids)
    assert_same_training(reference, after)


def test_a_stopped_rank_is_replaced_and_its_peer_leaves_the_collective(
    cluster: LocalCluster, client: cumulus.Client, digits_shards: Path, tmp_path: Path
) -> None:
    """A SIGSTOPped rank holds its peer in the next collective (its sockets stay open):
    once the leader fails it as hung (the progress timeout), the group restart keeps the
    peer's process and replaces the stopped one, whose SIGKILL closes its connections,
    so the peer leaves its collective at once; the run stays exact."""
    pytest.importorskip("torch", reason="PyTorch is not installed")
    clean, clean_out = submit_ddp(client, digits_shards, tmp_path, "clean")
    out = tmp_path / "stopped"
    job = client.submit(
        [
            sys.executable,
            str(EXAMPLE),
            "--out",
            str(out),
            "--steps",
            str(STEPS),
            "--ckpt-every",
            str(CKPT_EVERY),
            # Slower than the others: the stop lands well before the last step, however
            # late the test sees step 40 committed (heartbeats).
            "--step-sleep-ms",
            "40",
        ],
        world_size=2,
        dataset=digits_shards,
        ckpt_dir=tmp_path / "ckpt-stopped",
        max_restarts=3,
        backoff_initial_ms=100,
        backoff_max_ms=500,
        progress_timeout_s=3,
        stop_grace_s=1,
        name="inproc-stopped",
    )

    def listening() -> list[cumulus.RankInfo] | None:
        info = job.status()
        ranks = info.ranks
        ready = (info.committed_step or 0) >= CKPT_EVERY and all(
            r.state == "running" and r.in_process and r.step > CKPT_EVERY for r in ranks
        )
        return list(ranks) if ready else None

    ranks = wait_for(listening, 120, "both ranks listening, step 40 committed")
    stopped = ranks[1].pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        info = job.wait(timeout_s=JOB_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGKILL)
    assert info.succeeded and info.restarts_used == 1, explain(job, cluster)
    (restart,) = info.restarts
    assert restart.path == "in_process" and restart.in_process_ranks == (0,), restart
    assert "hung" in restart.cause, restart
    assert clean.wait(timeout_s=JOB_TIMEOUT_S).succeeded, explain(clean, cluster)
    after = results(out)
    pids = start_pids(job)
    assert after[0]["pid"] == pids[(0, 0)] == pids[(0, 1)], (after, pids)
    assert after[1]["pid"] == pids[(1, 1)] != stopped, (after, pids)
    assert_same_training(results(clean_out), after)


def test_a_survivor_ignoring_the_restart_is_fenced_then_replaced(
    cluster: LocalCluster, client: cumulus.Client, tmp_path: Path
) -> None:
    job = client.submit(
        [sys.executable, str(PROGRAMS / "ignoring_survivor.py")],
        world_size=2,
        ckpt_dir=tmp_path / "ckpt",
        max_restarts=3,
        backoff_initial_ms=100,
        backoff_max_ms=500,
        name="inproc-ignoring",
    )

    def listening() -> list[cumulus.RankInfo] | None:
        info = job.status()
        ranks = info.ranks
        ready = (
            info.committed_step == 1
            and ranks[0].in_process
            and all(r.state == "running" and r.step >= 1 and r.pid for r in ranks)
        )
        return list(ranks) if ready else None

    ranks = wait_for(listening, 120, "rank 0 listening for restarts after step 1")
    os.kill(ranks[1].pid, signal.SIGKILL)
    info = job.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded and info.restarts_used == 2, explain(job, cluster)
    first, second = info.restarts
    assert first.path == "in_process" and first.in_process_ranks == (0,), first
    assert second.path == "full", second
    assert "did not leave its step" in second.cause, second
    lines = [(x.rank, x.attempt, x.line) for x in job.logs(follow=False)]
    fenced = [line for r, a, line in lines if r == 0 and line.startswith("fenced: ")]
    assert fenced, lines
    assert not any("NOT FENCED" in line for _, _, line in lines), lines
    # The abandoned attempt's part of step 2 never counted: the job resumed from step 1.
    assert second.resume_step == 1, second
