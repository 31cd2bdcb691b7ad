"""XGBoost under a real local cluster: ``examples/python/boosting_digits.py`` (one
boosting round per step, the bundled digits data split into shards) run fault-free and
with the rank ``kill -9``ed after a committed checkpoint ends with byte-identical models."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import cumulus
from localcluster import REPO_ROOT, LocalCluster, explain

pytestmark = [pytest.mark.cluster]

xgb = pytest.importorskip(
    "xgboost", reason="XGBoost is not installed (pip install -e './python[test]')"
)

EXAMPLE = REPO_ROOT / "examples" / "python" / "boosting_digits.py"
ROUNDS, CKPT_EVERY, KILL_AT = 40, 10, 27
JOB_TIMEOUT_S = 180


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
            "--rounds",
            str(ROUNDS),
            "--ckpt-every",
            str(CKPT_EVERY),
            *extra,
        ],
        world_size=1,
        dataset=shards,
        ckpt_dir=base / f"ckpt-{name}",
        max_restarts=2,
        backoff_initial_ms=100,
        backoff_max_ms=500,
        name=f"boost-{name}",
    )
    return job, out


def result(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "result.json").read_text())
    return data


def test_boosting_resumes_byte_identically_after_a_kill(
    cluster: LocalCluster, client: cumulus.Client, digits_shards: Path, tmp_path: Path
) -> None:
    clean, clean_out = submit(client, digits_shards, tmp_path, "clean")
    killed, killed_out = submit(
        client, digits_shards, tmp_path, "killed", "--kill-at-round", str(KILL_AT)
    )
    info = clean.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded and info.restarts_used == 0, explain(clean, cluster)
    info = killed.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded, explain(killed, cluster)
    assert info.restarts_used == 1, explain(killed, cluster)
    (restart,) = info.restarts
    resumed = KILL_AT - KILL_AT % CKPT_EVERY
    assert restart.resume_step == resumed, restart
    assert "signal 9" in restart.cause or "killed" in restart.cause, restart.cause

    a, b = result(clean_out), result(killed_out)
    assert a["attempt"] == 0 and a["resumed_from"] is None, a
    assert b["attempt"] == 1 and b["resumed_from"] == resumed, b
    assert a["rounds"] == b["rounds"] == ROUNDS
    assert a["data_digest"] == b["data_digest"]
    assert a["valid_accuracy"] > 0.9, a

    # The final models, byte for byte.
    blob_a = (clean_out / "model.ubj").read_bytes()
    blob_b = (killed_out / "model.ubj").read_bytes()
    assert a["model_sha256"] == b["model_sha256"]
    assert blob_a == blob_b
    model = xgb.Booster()
    model.load_model(bytearray(blob_b))
    assert model.num_boosted_rounds() == ROUNDS

    # The checkpoints hold the booster in XGBoost's own format.
    latest = killed.checkpoints()[0]
    assert latest.step == ROUNDS and latest.verified
    part = Path(latest.path) / "rank-0" / "attempt-1"
    names = sorted(p.name for p in part.iterdir())
    assert names == ["cumulus-ckpt.json", "cumulus-state.json", "model.ubj"], names
    assert (part / "model.ubj").read_bytes() == blob_b
    lines = [(x.attempt, x.line) for x in killed.logs(follow=False)]
    assert (0, f"killing itself at round {KILL_AT}") in lines
    assert any(at == 1 and f"start={resumed}" in text for at, text in lines), lines
