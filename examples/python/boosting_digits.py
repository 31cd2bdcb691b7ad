#!/usr/bin/env python3
"""XGBoost on the bundled digits data, checkpointed between boosting rounds and resumed
exactly by Cumulus.

A multi-class booster (``multi:softprob``, ``hist`` trees, row and column subsampling)
grown one round per step. The data set is read in full through
:class:`cumulus.runtime.ShardReader`: the job's shards (``cumulusctl dataset split``) in
order, else ``--data``; every fifth record is held out for validation. Deterministic: one
thread, and the sampling RNG reseeded from ``--seed`` and the round before each round
(XGBoost's sampling RNG lives in C++ and is not part of a saved model, so a run that
carried it over rounds could not resume exactly). Every ``--ckpt-every`` rounds the
booster is committed through :mod:`cumulus.ckpt` (XGBoost's own UBJSON model format); a
restarted attempt loads it and grows the remaining rounds, so its final model equals a
fault-free run's byte for byte.

World size 1 (boosting on one process; XGBoost's own distributed training needs its
collective, which this example does not set up). Runs unchanged::

    python examples/python/boosting_digits.py --out /tmp/boost
    cumulusctl dataset split data/digits/digits.csv.gz --shards 4 --out /tmp/digits
    cumulusctl submit --world-size 1 --dataset /tmp/digits --ckpt-dir /tmp/ckpt -- \\
        python examples/python/boosting_digits.py --out /tmp/boost

At the end it writes ``<out>/model.ubj`` (the final model, XGBoost's UBJSON) and
``<out>/result.json``: rounds, attempt, resume round, the SHA-256 of the model, the
validation accuracy and the digest of the records read.

Fault injection, for tests: ``--kill-at-round R`` makes the first attempt SIGKILL itself
after round R, once the last checkpoint before R is committed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import xgboost as xgb
from cumulus import ckpt, runtime

BUNDLED = Path(__file__).resolve().parents[2] / "data" / "digits" / "digits.csv.gz"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output dir (created)")
    p.add_argument(
        "--data",
        type=Path,
        default=BUNDLED,
        help="CSV (.gz), or a dataset split folder (its dot-files such as"
        " .feature-stats.json are not shards), read when the job has no shards:"
        " 64 features, then the label",
    )
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--max-depth", type=int, default=4)
    p.add_argument("--eta", type=float, default=0.3)
    p.add_argument("--subsample", type=float, default=0.8)
    p.add_argument("--colsample", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--kill-at-round", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def load_records(
    ctx: runtime.Context, data: Path
) -> tuple[np.ndarray, np.ndarray, str]:
    """Every record of the job's shards (else of ``data``), in order: features scaled to
    [0, 1], labels, and the digest of the records read."""
    paths = list(ctx.shard_paths) or [data]
    h = hashlib.sha256()
    rows: list[list[float]] = []
    for row in runtime.ShardReader(paths):
        h.update((",".join(row) + "\n").encode())
        rows.append([float(v) for v in row])
    if not rows:
        sys.exit(f"no records in {list(map(str, paths))}")
    a = np.asarray(rows, dtype=np.float32)
    return a[:, :-1] / 16.0, a[:, -1].astype(np.int32), h.hexdigest()


def committed_step(ctx: runtime.Context) -> int:
    """The job's newest committed step (local checkpoint layout: ``LATEST``), else 0."""
    assert ctx.staging_dir is not None
    try:
        text = (ctx.staging_dir.parent.parent / "LATEST").read_text().strip()
    except FileNotFoundError:
        return 0
    return int(text.removeprefix("step-"))


def kill_self(ctx: runtime.Context, rnd: int, ckpt_every: int) -> None:
    """Fault injection: SIGKILLs this process once the last checkpoint before round
    ``rnd`` is committed."""
    if ctx.staging_dir is not None:
        last = rnd - rnd % ckpt_every
        deadline = time.monotonic() + 60
        while committed_step(ctx) < last:
            if time.monotonic() > deadline:
                sys.exit(f"timed out waiting for round {last} to be committed")
            time.sleep(0.02)
    print(f"killing itself at round {rnd}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    args = parse_args()
    rt = runtime.init(handle_sigterm=True)
    ctx = rt.context
    if ctx.world_size != 1:
        sys.exit(f"boosting_digits.py runs at world size 1 (got {ctx.world_size})")

    x, y, data_digest = load_records(ctx, args.data)
    valid = np.arange(len(y)) % 5 == 0
    dtrain = xgb.DMatrix(x[~valid], label=y[~valid], nthread=1)
    dvalid = xgb.DMatrix(x[valid], label=y[valid], nthread=1)
    params = {
        "objective": "multi:softprob",
        "num_class": 10,
        "tree_method": "hist",
        "max_depth": args.max_depth,
        "eta": args.eta,
        "subsample": args.subsample,
        "colsample_bytree": args.colsample,
        "eval_metric": "mlogloss",
        "nthread": 1,
    }

    booster: xgb.Booster | None = None
    start = 0
    point = ckpt.load_checkpoint(model=None)  # None: the saved booster comes back
    if point is not None:
        booster, start = point.objects["model"], point.step
        if point.state.get("data_digest") != data_digest:
            sys.exit("the data set changed since the checkpoint was committed")
    print(
        f"attempt={ctx.attempt} records={len(y)} train={int((~valid).sum())} "
        f"valid={int(valid.sum())} start={start}",
        flush=True,
    )

    t0 = time.monotonic()
    loss = float("nan")
    for rnd in range(start + 1, args.rounds + 1):
        # One round, its sampling seeded by the round: the same trees whether or not the
        # process started at round 1.
        evals: dict[str, dict[str, list[float]]] = {}
        booster = xgb.train(
            {**params, "seed": args.seed * 100_003 + rnd},
            dtrain,
            num_boost_round=1,
            xgb_model=booster,
            evals=[(dvalid, "valid")],
            evals_result=evals,
            verbose_eval=False,
        )
        loss = evals["valid"]["mlogloss"][-1]
        rt.report(rnd, args.rounds, valid_mlogloss=loss)
        if rnd % args.log_every == 0:
            print(f"round {rnd}/{args.rounds} valid mlogloss {loss:.5f}", flush=True)

        if rnd % args.ckpt_every == 0 and rt.checkpoints_enabled:
            part = ckpt.save_checkpoint(
                rnd, {"data_digest": data_digest}, model=booster
            )
            # None: refused because this rank is being stopped (a cancel): not an error.
            print(
                f"checkpoint {rnd}: {part.dir if part else 'not committed'}", flush=True
            )

        if rnd == args.kill_at_round and ctx.attempt == 0:
            kill_self(ctx, rnd, args.ckpt_every)
        if rt.should_stop():
            print(f"asked to stop at round {rnd}", flush=True)
            return 0

    elapsed = time.monotonic() - t0
    assert booster is not None
    blob = bytes(booster.save_raw(raw_format="ubj"))
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "model.ubj.tmp"
    tmp.write_bytes(blob)
    tmp.replace(args.out / "model.ubj")
    pred = booster.predict(dvalid).argmax(axis=1)
    result = {
        "attempt": ctx.attempt,
        "resumed_from": start if point is not None else None,
        "rounds": booster.num_boosted_rounds(),
        "model_sha256": hashlib.sha256(blob).hexdigest(),
        "valid_accuracy": float((pred == y[valid]).mean()),
        "valid_mlogloss": loss,
        "data_digest": data_digest,
        "rounds_per_s": (args.rounds - start) / elapsed if elapsed > 0 else None,
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(f"done: {json.dumps(result)}", flush=True)
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
