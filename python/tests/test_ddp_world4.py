"""Exact resume at world size 4 (issue 47): ``examples/python/ddp_digits.py`` as 4 ranks
on the 2 workers of a real local cluster (2 slots each), the digits data in 8 shards, rank
3 ``kill -9``ed mid-epoch after a committed checkpoint. With ``cumulus.torch.exact_ddp``
(the example's default) the restarted job ends with the fault-free run's weights, bit for
bit; with stock ``DistributedDataParallel`` (``--stock-ddp``) it consumes the same
records in the same order and ends with other weights (its first iteration after the
restart lays the gradient buckets out differently, and a sum of four floats depends on
the order). The example trains in ``cumulus.runtime.run``, so the exact run's restart is
in-process: the three survivors, on both workers, keep their processes (issue 43)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import cumulus
from localcluster import DIGITS, REPO_ROOT, LocalCluster, explain

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e './python[torch]')")

EXAMPLE = REPO_ROOT / "examples" / "python" / "ddp_digits.py"
WORLD = 4
# About 449 records and 14 steps of 32 per rank and epoch: the kill at step 25 and the
# resume from step 20 are both mid-epoch.
STEPS, CKPT_EVERY, KILL_RANK, KILL_AT = 40, 10, 3, 25
JOB_TIMEOUT_S = 400


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One coordinator, two workers of 2 slots: a 4-rank job spans both."""
    with LocalCluster(tmp_path_factory.mktemp("cluster"), workers=2, slots=2) as c:
        yield c


def submit(
    client: cumulus.Client, shards: Path, base: Path, name: str, *extra: str
) -> tuple[cumulus.Job, Path]:
    out = base / name
    cmd = [sys.executable, str(EXAMPLE), "--out", str(out), "--steps", str(STEPS)]
    job = client.submit(
        [*cmd, "--ckpt-every", str(CKPT_EVERY), "--log-every", "10", *extra],
        world_size=WORLD,
        dataset=shards,
        ckpt_dir=base / f"ckpt-{name}",
        max_restarts=1,
        backoff_initial_ms=100,
        backoff_max_ms=200,
        name=f"ddp4-{name}",
    )
    return job, out


def results(
    cluster: LocalCluster, clean: tuple[cumulus.Job, Path], killed: tuple[cumulus.Job, Path]
) -> tuple[str, str, bytes, bytes]:
    """Checks a fault-free job and its killed twin (the same records everywhere, one
    restart from step 20); their weights' SHA-256 and bytes."""
    info = clean[0].wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded and info.restarts_used == 0, explain(clean[0], cluster)
    assert len({r.worker_id for r in info.ranks}) == 2, info.ranks  # 2 ranks per worker
    info = killed[0].wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded and info.restarts_used == 1, explain(killed[0], cluster)
    assert info.restarts[0].resume_step == KILL_AT - KILL_AT % CKPT_EVERY, info.restarts
    a, b = (
        [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORLD)]
        for _, out in (clean, killed)
    )
    assert all(r["resumed_from"] is None for r in a), a
    assert all(r["attempt"] == 1 and r["resumed_from"] == 20 for r in b), b
    for ra, rb in zip(a, b, strict=True):
        # Both runs fed every rank the same records in the same order...
        assert ra["steps"] == rb["steps"] == STEPS
        assert ra["record_digest"] == rb["record_digest"], (ra, rb)
        # ...and every rank of a run holds the same weights (DDP).
        assert ra["weights_sha256"] == a[0]["weights_sha256"]
        assert rb["weights_sha256"] == b[0]["weights_sha256"]
    weights = [(out / "model.safetensors").read_bytes() for _, out in (clean, killed)]
    return a[0]["weights_sha256"], b[0]["weights_sha256"], weights[0], weights[1]


def start_pids(job: cumulus.Job) -> dict[tuple[int, int], int]:
    """``(rank, attempt) → pid`` from the example's start lines in the job's logs."""
    pids = {}
    for x in job.logs(follow=False):
        m = re.search(r"rank=(\d+) attempt=(\d+) .* pid=(\d+)", x.line)
        if m:
            pids[(int(m[1]), int(m[2]))] = int(m[3])
    return pids


def assert_survivors_kept_their_processes(cluster: LocalCluster, job: cumulus.Job) -> None:
    """The restart was in-process for ranks 0-2 (both workers): their pids did not
    change; the killed rank 3 got a new process."""
    info = job.status()
    (restart,) = info.restarts
    assert restart.path == "in_process", (restart, explain(job, cluster))
    assert restart.in_process_ranks == (0, 1, 2), restart
    pids = start_pids(job)
    for rank in range(WORLD - 1):
        assert pids[(rank, 0)] == pids[(rank, 1)], pids
    assert pids[(KILL_RANK, 0)] != pids[(KILL_RANK, 1)], pids


def test_ddp_at_world_size_4_resumes_bit_identically_only_with_exact_ddp(
    two_workers: LocalCluster, tmp_path: Path
) -> None:
    shards = tmp_path / "digits"
    split = ("dataset", "split", str(DIGITS), "--shards", "8", "--out", str(shards))
    r = two_workers.cumulusctl(*split)
    assert r.returncode == 0, r.stderr + r.stdout
    kill = ("--kill-rank", str(KILL_RANK), "--kill-at-step", str(KILL_AT))
    with two_workers.client() as client:
        # All four queued at once; each takes every slot, so they run one after another.
        jobs = [
            submit(client, shards, tmp_path, "clean"),
            # Paced (sleeps only: the same training), so the leader has heard every
            # survivor's progress (a heartbeat, 1 s) before the kill, as it must to keep
            # their processes.
            submit(client, shards, tmp_path, "killed", "--step-sleep-ms", "100", *kill),
            submit(client, shards, tmp_path, "stock-clean", "--stock-ddp"),
            submit(client, shards, tmp_path, "stock-killed", "--stock-ddp", *kill),
        ]
        clean, killed, clean_blob, killed_blob = results(two_workers, jobs[0], jobs[1])
        assert clean == killed
        assert clean_blob == killed_blob
        assert_survivors_kept_their_processes(two_workers, jobs[1][0])
        # The same script on stock DDP: the same records, other weights.
        clean, killed, clean_blob, killed_blob = results(two_workers, jobs[2], jobs[3])
        assert clean != killed
        assert clean_blob != killed_blob
