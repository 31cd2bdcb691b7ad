"""``examples/python/ddp_digits.py`` in an elastic job (``world_size=(2, 4)``) on two
workers of two slots: one worker is lost for good (it and its ranks ``kill -9``ed), the
job goes on at 2 ranks from its committed step, and over the whole run every record of
the data set is consumed exactly once (the last ranks' record counts and sums, which
carry those of the ranks they took over from, add up to the data set's)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from cumulus import runtime
from localcluster import REPO_ROOT, LocalCluster, explain, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (pip install -e './python[torch]')"
)

EXAMPLE = REPO_ROOT / "examples" / "python" / "ddp_digits.py"
DIGITS = REPO_ROOT / "data" / "digits" / "digits.csv.gz"
MASK = (1 << 64) - 1
# 16 records a step and rank: 4 ranks take about 28 steps (150 ms each) for the 1797
# records, 2 about 57, with room for an uneven deal after the loss.
STEPS, CKPT_EVERY, BATCH, EPOCHS, SLEEP_MS = 80, 5, 16, 1, 150
JOB_TIMEOUT_S = 240


def expected(shards: Path) -> tuple[int, int]:
    """Record count and id-hash sum of every record of ``shards`` once per epoch,
    recomputed here from the documented hash (SHA-256 of ``epoch\\0shard\\0index``,
    first 8 bytes little-endian)."""
    count, total = 0, 0
    for epoch in range(EPOCHS):
        for shard in runtime.list_shards(shards):
            for index, _ in enumerate(runtime.ShardReader([shard])):
                h = hashlib.sha256(f"{epoch}\0{shard.name}\0{index}".encode()).digest()
                total = (total + int.from_bytes(h[:8], "little")) & MASK
                count += 1
    return count, total


def test_elastic_ddp_shrinks_on_a_lost_worker_and_consumes_every_record_once(
    tmp_path: Path,
) -> None:
    with LocalCluster(tmp_path / "cluster", workers=2, slots=2) as cluster:
        shards = tmp_path / "digits"
        r = cluster.cumulusctl(
            "dataset", "split", str(DIGITS), "--shards", "8", "--out", str(shards)
        )
        assert r.returncode == 0, r.stderr + r.stdout
        out = tmp_path / "out"
        client = cluster.client()
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
                "--batch-size",
                str(BATCH),
                "--epochs",
                str(EPOCHS),
                "--step-sleep-ms",
                str(SLEEP_MS),
            ],
            world_size=(2, 4),
            dataset=shards,
            ckpt_dir=tmp_path / "ckpt",
            name="ddp-elastic",
        )
        status = wait_for(
            lambda: (
                s
                if (s := job.status()).world_size_now == 4
                and s.committed_step is not None
                and all(x.pid > 0 for x in s.ranks)
                else None
            ),
            JOB_TIMEOUT_S,
            "4 ranks running with a committed step",
        )
        # The worker of rank 3 is lost for good: it and its ranks die at once.
        lost = status.ranks[3].worker_id
        (entry,) = [w for w in cluster.file["workers"] if w["worker_id"] == lost]
        os.kill(entry["pid"], signal.SIGKILL)
        for rank in status.ranks:
            if rank.worker_id == lost:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank.pid, signal.SIGKILL)
        info = job.wait(timeout_s=JOB_TIMEOUT_S)
        assert info.succeeded, explain(job, cluster)
        assert [(e.from_world_size, e.to_world_size) for e in info.resizes] == [(4, 2)], (
            info.resizes
        )
        assert info.resizes[0].resume_step is not None
        results = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
        assert {r["world_size"] for r in results} == {2}, results
        # The 2 ranks took over the positions and carries of the 4 before the loss.
        assert sum(r["carries_taken"] for r in results) == 4, results
        count = sum(r["record_count"] for r in results)
        total = sum(int(r["record_sum"], 16) for r in results) & MASK
        assert (count, total) == expected(shards), results
