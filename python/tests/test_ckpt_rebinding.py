"""A checkpointed tensor that the script rebinds every epoch (``perm =
torch.randperm(...)``), on a real local cluster: passed at each save and rebound from
``point.objects`` on resume, a run killed mid-way ends with a fault-free run's weights;
collected once in a dict, the first save after a rebinding fails the rank with
``StaleObject`` instead of checkpointing the old permutation and resuming silently
into other weights."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import cumulus
from localcluster import LocalCluster, explain

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e './python[torch]')")

PROGRAM = Path(__file__).parent / "programs" / "rebinding_trainer.py"
STEPS, CKPT_EVERY, KILL_AT = 30, 6, 21  # 4 steps an epoch: step 18 is mid-epoch 4
JOB_TIMEOUT_S = 180


def submit(
    client: cumulus.Client, base: Path, name: str, *extra: str, max_restarts: int = 2
) -> tuple[cumulus.Job, Path]:
    out = base / name
    job = client.submit(
        [sys.executable, str(PROGRAM), "--out", str(out), "--steps", str(STEPS), *extra],
        world_size=1,
        ckpt_dir=base / f"ckpt-{name}",
        max_restarts=max_restarts,
        backoff_initial_ms=100,
        backoff_max_ms=500,
        name=f"rebind-{name}",
    )
    return job, out


def result(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "result.json").read_text())
    return data


def test_a_tensor_rebound_every_epoch_resumes_exactly(
    cluster: LocalCluster, client: cumulus.Client, tmp_path: Path
) -> None:
    mode = ("--objects", "each-call", "--ckpt-every", str(CKPT_EVERY))
    clean, clean_out = submit(client, tmp_path, "clean", *mode)
    killed, killed_out = submit(client, tmp_path, "killed", *mode, "--kill-at-step", str(KILL_AT))
    info = clean.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded and info.restarts_used == 0, explain(clean, cluster)
    info = killed.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded and info.restarts_used == 1, explain(killed, cluster)
    assert info.restarts[0].resume_step == KILL_AT - KILL_AT % CKPT_EVERY

    a, b = result(clean_out), result(killed_out)
    assert a["resumed_from"] is None and b["resumed_from"] == 18 and b["attempt"] == 1, (a, b)
    assert a["epoch"] == b["epoch"] == (STEPS - 1) // 4  # perm rebound 7 times
    # The same batches in the same order, and the same weights, bit for bit.
    assert a["batch_digest"] == b["batch_digest"], (a, b)
    assert a["weights_sha256"] == b["weights_sha256"], (a, b)


def test_a_rebound_tensor_collected_once_is_refused_not_saved_stale(
    cluster: LocalCluster, client: cumulus.Client, tmp_path: Path
) -> None:
    job, out = submit(
        client,
        tmp_path,
        "collected",
        "--objects",
        "collected",
        "--ckpt-every",
        "6",
        max_restarts=0,
    )
    info = job.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.state == "failed", explain(job, cluster)
    assert not (out / "result.json").exists()
    lines = [x.line for x in job.logs(follow=False)]
    # The first save after the first rebinding (step 5) says what is wrong and how to fix.
    assert any("StaleObject" in line and "'perm'" in line for line in lines), lines
    assert any("Pass perm=perm at each save" in line for line in lines), lines
    assert job.checkpoints() == []
