"""Integration tests of the job lifecycle against a real local cluster: pausing and
resuming a job, a time limit, and deleting and purging finished jobs, with a Python rank
that checkpoints when asked to stop (``tests/programs/lifecycle_trainer.py``)."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import cumulus
from conftest import PROGRAMS
from cumulus import errors
from localcluster import LocalCluster, explain, wait_for

pytestmark = pytest.mark.cluster

LIFECYCLE_TRAINER = [sys.executable, str(PROGRAMS / "lifecycle_trainer.py")]
JOB_TIMEOUT_S = 180
#: Deadline of one condition (a state, a step reached), in seconds.
STEP_TIMEOUT_S = 90


def events(out: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = out / f"events-rank-{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def of_kind(out: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in events(out) if e["event"] == kind]


def status_when(
    job: cumulus.Job, condition: Callable[[cumulus.JobInfo], bool]
) -> Callable[[], cumulus.JobInfo | None]:
    """A predicate for ``wait_for``: the job's status when ``condition(status)`` holds,
    else ``None``."""

    def check() -> cumulus.JobInfo | None:
        info = job.status()
        return info if condition(info) else None

    return check


def committed_state(info: cumulus.JobInfo, ckpt_dir: Path, rank: int = 0) -> dict[str, Any]:
    """The ``state`` rank ``rank`` committed at the job's committed step."""
    assert info.committed_step is not None
    step_dir = ckpt_dir / info.id / f"step-{info.committed_step:08d}"
    (state_file,) = step_dir.glob(f"rank-{rank}/attempt-*/cumulus-state.json")
    state: dict[str, Any] = json.loads(state_file.read_text())
    return state


def test_a_paused_job_checkpoints_and_resumes_where_it_stopped(
    cluster: LocalCluster, client: cumulus.Client, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    ckpt = tmp_path / "ckpt"
    steps = 600
    job = client.submit(
        # 600 steps of 50 ms: about 30 s, much longer than the pause takes to land.
        # Checkpoints only when asked to stop: the one resumed from is the pause's.
        [*LIFECYCLE_TRAINER, "--out", str(out), "--steps", str(steps), "--sleep-ms", "50"],
        ckpt_dir=ckpt,
        name="python-pause-resume",
    )
    wait_for(
        lambda: any(r.step >= 5 for r in job.status().ranks),
        STEP_TIMEOUT_S,
        f"{job.id} to report a few steps",
    )

    info = job.pause()
    assert info.state in ("running", "paused") and not info.finished, explain(job, cluster)
    paused: cumulus.JobInfo = wait_for(
        status_when(job, lambda i: i.paused and i.committed_step is not None),
        STEP_TIMEOUT_S,
        f"{job.id} to be paused with a committed step",
    )
    assert not paused.finished
    pause_step = paused.committed_step
    assert pause_step is not None and 5 <= pause_step < steps, explain(job, cluster)

    # The rank saw a pause (should_pause), committed at the step it had reached, and exited.
    (stop,) = of_kind(out, "stop")
    assert (stop["action"], stop["pause"], stop["step"]) == ("pause", True, pause_step), stop
    assert stop["committed"].startswith(f"step-{pause_step:08d}/rank-0/"), stop
    assert committed_state(paused, ckpt) == {"action": "pause", "pause": True}
    assert not (out / "rank-0.json").exists()
    assert pause_step in [c.step for c in job.checkpoints()]
    # A paused job holds no running rank, and stays paused.
    assert all(r.state != "running" for r in paused.ranks), paused
    assert job.status().paused
    assert job.pause().paused  # pausing it again changes nothing

    resumed = job.resume()
    assert resumed.state in ("pending", "running"), resumed
    info = job.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded, explain(job, cluster)
    assert info.running_ms >= 0

    # The second run started from the paused step and went on to the end: every step ran
    # exactly once over both runs (the sum says so).
    starts = of_kind(out, "start")
    assert [s["resumed_from"] for s in starts] == [None, pause_step], starts
    assert starts[1]["start"] == pause_step
    assert starts[1]["resumed_state"] == {"action": "pause", "pause": True}
    result = json.loads((out / "rank-0.json").read_text())
    assert result["resumed_from"] == pause_step, result
    assert result["steps"] == steps and result["sum"] == steps * (steps + 1) // 2, result
    lines = [x.line for x in job.logs(follow=False)]
    assert any(f'"step": {pause_step}, "action": "pause"' in line for line in lines), lines


def test_a_time_limit_asks_the_rank_to_checkpoint_then_times_the_job_out(
    cluster: LocalCluster, client: cumulus.Client, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    ckpt = tmp_path / "ckpt"
    steps = 100_000
    job = client.submit(
        # 100000 steps of 50 ms: over an hour, far past the 3 s limit.
        [*LIFECYCLE_TRAINER, "--out", str(out), "--steps", str(steps), "--sleep-ms", "50"],
        ckpt_dir=ckpt,
        name="python-time-limit",
        time_limit_s=3,
        signal_before_s=2,
    )
    assert job.status().time_limit_ms == 3000
    info: cumulus.JobInfo = wait_for(
        status_when(job, lambda i: i.finished),
        STEP_TIMEOUT_S,
        f"{job.id} to end at its time limit",
    )
    assert info.state == "timed_out" and info.timed_out, explain(job, cluster)
    assert not info.succeeded
    assert (info.time_limit_ms, info.signal_before_ms) == (3000, 2000)
    assert info.running_ms < 60_000, info

    # The rank was told "time_limit" (not a pause), committed the step it had reached
    # then (after the request: it commits nothing else), and exited 0.
    (stop,) = of_kind(out, "stop")
    assert (stop["action"], stop["pause"]) == ("time_limit", False), stop
    assert info.committed_step == stop["step"], explain(job, cluster)
    assert 0 < stop["step"] < steps
    assert committed_state(info, ckpt) == {"action": "time_limit", "pause": False}
    assert [c.step for c in job.checkpoints()] == [stop["step"]]
    assert not (out / "rank-0.json").exists()
    assert all(r.exit_code in (0, None) for r in info.ranks), info


def trainer(out: Path, *, steps: int, sleep_ms: int, ckpt_every: int) -> list[str]:
    """The argv of the lifecycle trainer."""
    return [
        *LIFECYCLE_TRAINER,
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--sleep-ms",
        str(sleep_ms),
        "--ckpt-every",
        str(ckpt_every),
    ]


def gone(client: cumulus.Client, job_id: str) -> bool:
    """Whether the cluster no longer knows ``job_id`` (a linearizable read says 404)."""
    try:
        client.get_job(job_id)
    except errors.NotFound:
        return True
    return False


def running_with_checkpoint(
    client: cumulus.Client, cluster: LocalCluster, out: Path, ckpt: Path, name: str
) -> cumulus.Job:
    """A job of the lifecycle trainer that runs for over an hour (100000 steps of 50 ms),
    committing every 5 steps, returned once it is running with a committed step."""
    job = client.submit(
        trainer(out, steps=100_000, sleep_ms=50, ckpt_every=5),
        ckpt_dir=ckpt,
        name=name,
    )
    wait_for(
        status_when(job, lambda i: i.state == "running" and i.committed_step is not None),
        STEP_TIMEOUT_S,
        f"{job.id} to run and commit a checkpoint",
    )
    assert (ckpt / job.id).is_dir(), explain(job, cluster)
    return job


def test_a_finished_job_is_deleted_with_its_checkpoints_and_a_running_one_is_not(
    cluster: LocalCluster, client: cumulus.Client, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    ckpt = tmp_path / "ckpt"
    job = client.submit(
        # 20 steps of 20 ms, a checkpoint every 5: committed steps 5, 10, 15 and 20.
        trainer(out, steps=20, sleep_ms=20, ckpt_every=5),
        ckpt_dir=ckpt,
        name="python-delete",
    )
    info = job.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded and info.committed_step == 20, explain(job, cluster)
    assert job.checkpoints(), explain(job, cluster)
    job_dir = ckpt / job.id
    assert job_dir.is_dir() and any(job_dir.glob("step-*")), sorted(job_dir.iterdir())

    assert job.delete(checkpoints=True) is True
    with pytest.raises(errors.NotFound):
        job.status()
    assert job.id not in [j.id for j in client.jobs()]
    wait_for(lambda: not job_dir.exists(), STEP_TIMEOUT_S, f"{job_dir} to be deleted")
    assert ckpt.is_dir()  # only the job's own directory went
    # It is gone: a second delete finds nothing.
    with pytest.raises(errors.NotFound):
        client.delete(job.id, checkpoints=True)

    # A job that has not finished is refused, and nothing of it is deleted.
    running = running_with_checkpoint(client, cluster, out, ckpt, "python-delete-running")
    with pytest.raises(errors.Conflict, match=running.id) as e:
        client.delete(running.id, checkpoints=True)
    assert e.value.status == 409
    info = running.status()
    assert info.state == "running" and not info.finished, explain(running, cluster)
    assert (ckpt / running.id).is_dir()
    running.cancel()
    cancelled: cumulus.JobInfo = wait_for(
        status_when(running, lambda i: i.finished),
        STEP_TIMEOUT_S,
        f"{running.id} to end cancelled",
    )
    assert cancelled.state == "cancelled", explain(running, cluster)
    # Cancelled, it can go; without `checkpoints` its checkpoints stay.
    assert running.delete() is False
    assert gone(client, running.id)
    assert (ckpt / running.id).is_dir()


def test_purge_deletes_old_jobs_of_one_finished_state_only(
    cluster: LocalCluster, client: cumulus.Client, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    ckpt = tmp_path / "ckpt"
    succeeded = client.submit(
        trainer(out, steps=5, sleep_ms=10, ckpt_every=5),
        ckpt_dir=ckpt,
        name="python-purge-succeeded",
    )
    assert succeeded.wait(timeout_s=JOB_TIMEOUT_S).succeeded, explain(succeeded, cluster)

    job = running_with_checkpoint(client, cluster, out, ckpt, "python-purge-cancelled")
    job.cancel()
    info: cumulus.JobInfo = wait_for(
        status_when(job, lambda i: i.finished),
        STEP_TIMEOUT_S,
        f"{job.id} to end cancelled",
    )
    assert info.state == "cancelled", explain(job, cluster)
    # The jobs older than 1 ms in state cancelled: this one and any an earlier test left.
    expected = sorted(j.id for j in client.jobs() if j.state == "cancelled")
    assert job.id in expected

    # The cancelled job finished more than 1 ms ago by now, but the coordinator's clock
    # measures the age: purge until it went.
    answers: list[list[str]] = []

    def purged_it() -> bool:
        answers.append(client.purge(older_than_s=0.001, state="cancelled"))
        return job.id in answers[-1]

    wait_for(purged_it, STEP_TIMEOUT_S, f"a purge of the cancelled jobs to delete {job.id}")
    assert all(ids == sorted(ids) for ids in answers), answers
    purged = [i for ids in answers for i in ids]
    assert len(purged) == len(set(purged)) and set(purged) <= set(expected), (answers, expected)
    assert gone(client, job.id)
    assert (ckpt / job.id).is_dir()  # checkpoints=False keeps the checkpoints
    # The succeeded job was not cancelled: it stays, with its checkpoints.
    assert succeeded.status().succeeded
    assert [c.step for c in succeeded.checkpoints()] == [5]
    # Nothing cancelled is left to purge.
    assert client.purge(older_than_s=0.001, state="cancelled") == []
    assert not [j.id for j in client.jobs() if j.state == "cancelled"]

    # Arguments the client refuses are never sent: nothing more is deleted.
    with pytest.raises(errors.InvalidSpec, match="state must be None"):
        client.purge(older_than_s=0.001, state="running")
    with pytest.raises(errors.InvalidSpec, match="older_than_s"):
        client.purge(older_than_s=0)
    assert succeeded.status().succeeded


#: A rank that starts slowly (``sys.argv[1]`` seconds before its first report: the
#: interpreter, imports, a rendezvous), then reports 30 steps of 50 ms. Rank 0 ignores
#: SIGTERM, so a stop of it lasts the job's whole stop grace; rank 1's first attempt
#: kills itself at step 10. With ``sys.argv[1] == "never"`` it never reports at all.
SLOW_START = textwrap.dedent(
    """
    import os, signal, sys, time
    from cumulus import runtime
    ctx = runtime.get_context()
    if sys.argv[1] == "never":
        time.sleep(600)
    if ctx.rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(float(sys.argv[1]))
    for step in range(1, 31):
        runtime.report(step, 30)
        if ctx.rank == 1 and ctx.attempt == 0 and step == 10:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)
    runtime.flush()
    """
)


def test_a_slow_start_is_not_a_hang_and_no_first_report_is_a_startup_timeout(
    cluster: LocalCluster, client: cumulus.Client
) -> None:
    # A start (4 s) twice the progress timeout (2 s), and a restart whose rank 0 takes
    # the whole stop grace (3 s) to go: neither counts against the progress timeout,
    # which starts at each attempt's first report. The default startup timeout (10
    # minutes) bounds the time to it.
    slow = client.submit(
        [sys.executable, "-c", SLOW_START, "4"],
        world_size=2,
        progress_timeout_s=2,
        stop_grace_s=3,
        max_restarts=1,
        backoff_initial_ms=100,
        name="python-slow-start",
    )
    # A rank that never reports fails by its startup timeout, which says so.
    silent = client.submit(
        [sys.executable, "-c", SLOW_START, "never"],
        progress_timeout_s=2,
        startup_timeout_s=3,
        max_restarts=0,
        name="python-never-reports",
    )
    described = cluster.cumulusctl("describe", silent.id)
    assert described.returncode == 0, described.stderr
    assert "first report within 3s of start (startup timeout)" in described.stdout, described.stdout

    failed = silent.wait(timeout_s=JOB_TIMEOUT_S)
    assert failed.state == "failed", explain(silent, cluster)
    assert (
        "rank 0 attempt 0: no first report within 3000 ms of start (startup timeout)"
        in failed.failure_cause
    ), explain(silent, cluster)

    done = slow.wait(timeout_s=JOB_TIMEOUT_S)
    assert done.succeeded, explain(slow, cluster)
    assert done.restarts_used == 1, explain(slow, cluster)
    (restart,) = done.restarts
    assert restart.cause.startswith("rank 1 attempt 0 was killed by signal 9"), restart
    assert [r.attempt for r in done.ranks] == [1, 1], done


def test_a_cancel_stops_the_readme_loop_cleanly(
    cluster: LocalCluster, client: cumulus.Client, tmp_path: Path
) -> None:
    # python/README.md's loop checkpoints when should_stop(): on a cancel that
    # checkpoint is refused, which the runtime takes as the stop it is (no StaleAttempt):
    # every rank exits 0, and the cancelled job shows no rank running.
    job = client.submit(
        [sys.executable, str(PROGRAMS / "readme_loop.py")],
        world_size=2,
        ckpt_dir=tmp_path / "ckpt",
        name="python-readme-cancel",
    )
    wait_for(
        lambda: all(r.step >= 5 for r in job.status().ranks),
        STEP_TIMEOUT_S,
        f"{job.id} to report a few steps on every rank",
    )
    job.cancel()
    info = job.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.state == "cancelled", explain(job, cluster)
    assert not [r for r in info.ranks if r.state in ("running", "pending")], info.ranks
    ended: cumulus.JobInfo = wait_for(
        status_when(job, lambda i: all(r.exit_code is not None for r in i.ranks)),
        STEP_TIMEOUT_S,
        f"the exits of {job.id}'s ranks to be recorded",
    )
    assert [(r.exit_code, r.signal, r.state) for r in ended.ranks] == [
        (0, None, "exited"),
        (0, None, "exited"),
    ], explain(job, cluster)
    lines = [x.line for x in job.logs(follow=False)]
    assert not [line for line in lines if "Traceback" in line or "StaleAttempt" in line], lines
