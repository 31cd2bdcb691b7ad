"""PyTorch DDP under a real local cluster: ``examples/python/ddp_digits.py`` (gloo, world
size 2, the bundled digits data split into shards) run fault-free, with one rank
``kill -9``ed after a committed checkpoint, and paused then resumed, ends with
byte-identical weights and the same record digest on every rank."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

import cumulus
from localcluster import REPO_ROOT, LocalCluster, explain, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (pip install -e './python[torch]')"
)
safetensors_torch = pytest.importorskip("safetensors.torch")

EXAMPLE = REPO_ROOT / "examples" / "python" / "ddp_digits.py"
STEPS, CKPT_EVERY, KILL_AT = 300, 50, 130
JOB_TIMEOUT_S = 300


def submit(
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
            *extra,
        ],
        world_size=2,
        dataset=shards,
        ckpt_dir=base / f"ckpt-{name}",
        max_restarts=2,
        backoff_initial_ms=100,
        backoff_max_ms=500,
        name=f"ddp-{name}",
    )
    return job, out


def rank_results(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


def test_ddp_resumes_bit_identically_after_a_rank_is_killed(
    cluster: LocalCluster, client: cumulus.Client, digits_shards: Path, tmp_path: Path
) -> None:
    # Both jobs at once (the worker has 4 slots): the same results, half the wall time.
    clean, clean_out = submit(client, digits_shards, tmp_path, "clean")
    killed, killed_out = submit(
        client,
        digits_shards,
        tmp_path,
        "killed",
        "--kill-rank",
        "0",
        "--kill-at-step",
        str(KILL_AT),
    )
    info = clean.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded and info.restarts_used == 0, explain(clean, cluster)
    info = killed.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded, explain(killed, cluster)
    assert info.restarts_used == 1, explain(killed, cluster)
    (restart,) = info.restarts
    assert restart.resume_step == KILL_AT - KILL_AT % CKPT_EVERY, restart
    assert "signal 9" in restart.cause or "killed" in restart.cause, restart.cause

    a, b = rank_results(clean_out), rank_results(killed_out)
    assert all(r["attempt"] == 0 and r["resumed_from"] is None for r in a), a
    assert all(r["attempt"] == 1 and r["resumed_from"] == 100 for r in b), b
    for ra, rb in zip(a, b, strict=True):
        assert ra["steps"] == rb["steps"] == STEPS
        assert ra["records"] == rb["records"] == STEPS * 32
        # Every rank consumed the same records in the same order in both runs...
        assert ra["record_digest"] == rb["record_digest"], (ra, rb)
        # ...and ended with the same weights (the same on both ranks: DDP).
        assert ra["weights_sha256"] == rb["weights_sha256"] == a[0]["weights_sha256"]
    assert a[0]["record_digest"] != a[1]["record_digest"]  # each rank has its own shards

    # The final weights, bit for bit.
    blob_a = (clean_out / "model.safetensors").read_bytes()
    blob_b = (killed_out / "model.safetensors").read_bytes()
    assert hashlib.sha256(blob_a).hexdigest() == a[0]["weights_sha256"]
    assert blob_a == blob_b
    wa = safetensors_torch.load(blob_a)
    wb = safetensors_torch.load(blob_b)
    assert wa.keys() == wb.keys() and len(wa) == 4
    for k in wa:
        assert wa[k].dtype == torch.float32
        assert torch.equal(wa[k].view(torch.int32), wb[k].view(torch.int32)), k

    # The checkpoints are framework checkpoints: model, optimizer, RNG; the sampler's
    # position is in the JSON state.
    latest = killed.checkpoints()[0]
    assert latest.step == STEPS and latest.verified
    part = Path(latest.path) / "rank-1" / "attempt-1"
    names = sorted(p.name for p in part.iterdir())
    assert names == [
        "cumulus-ckpt.json",
        "cumulus-state.json",
        "model.safetensors",
        "optimizer.safetensors",
    ], names
    state = json.loads((part / "cumulus-state.json").read_text())
    assert state["sampler"]["taken"] == STEPS * 32 and state["sampler"]["format"] == 1
    lines = [(x.rank, x.attempt, x.line) for x in killed.logs(follow=False)]
    assert (0, 0, f"rank=0 killing itself at step {KILL_AT}") in lines
    assert any(r == 1 and a_ == 1 and "start=100" in text for r, a_, text in lines), lines


def test_ddp_paused_and_resumed_ends_bit_identical_to_a_fault_free_run(
    cluster: LocalCluster, client: cumulus.Client, digits_shards: Path, tmp_path: Path
) -> None:
    # The fault-free reference and a run paused mid-way (paced so the pause lands
    # before the end), then resumed.
    clean, clean_out = submit(client, digits_shards, tmp_path, "clean")
    paused, paused_out = submit(client, digits_shards, tmp_path, "paused", "--step-sleep-ms", "20")

    def past_first_checkpoint() -> bool:
        info = paused.status()
        return info.committed_step is not None and info.committed_step >= CKPT_EVERY

    wait_for(past_first_checkpoint, JOB_TIMEOUT_S, "the first checkpoint")
    paused.pause()

    def is_paused() -> bool:
        return paused.status().state == "paused"

    wait_for(is_paused, JOB_TIMEOUT_S, "the job paused")
    stopped = paused.status()
    step = stopped.committed_step
    assert step is not None and CKPT_EVERY <= step < STEPS, stopped
    assert stopped.restarts_used == 0
    paused.resume()
    info = paused.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded and info.restarts_used == 0, explain(paused, cluster)
    assert clean.wait(timeout_s=JOB_TIMEOUT_S).succeeded, explain(clean, cluster)

    a, b = rank_results(clean_out), rank_results(paused_out)
    assert all(r["resumed_from"] == step for r in b), (step, b)
    for ra, rb in zip(a, b, strict=True):
        assert ra["record_digest"] == rb["record_digest"], (ra, rb)
        assert ra["weights_sha256"] == rb["weights_sha256"]
    assert (clean_out / "model.safetensors").read_bytes() == (
        paused_out / "model.safetensors"
    ).read_bytes()
