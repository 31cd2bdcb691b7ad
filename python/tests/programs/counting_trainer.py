"""A rank program for the integration tests, written against ``cumulus.runtime`` only.

Each step consumes one record of this rank's shards (CSV rows ``id,value``) and adds its
value to a running sum: the "model" is ``(sum, count)``. Every ``--ckpt-every`` steps it
commits a checkpoint holding the model (a file) and the reader position (the state).
A resumed attempt restores both, so the final ``(sum, count)`` of every rank equals a
fault-free run's exactly when every record was consumed once.

At the end each rank writes ``<out>/rank-<R>.json``. Fault injection:

* ``--kill-rank R --kill-at-step S``: rank R's first attempt SIGKILLs itself at step S,
  once the job's newest checkpoint is committed (``LATEST`` written by the leader).
* ``--stale-probe``: a first attempt of another rank, once asked to stop (SIGTERM),
  tries one more checkpoint commit and records its outcome in
  ``<out>/probe-rank-<R>.attempt-<A>.json`` (the agent must refuse it, and the runtime
  return it uncommitted: ``"refused"``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cumulus import errors, runtime


def latest_step(staging: Path) -> int | None:
    """The step named by the job's ``LATEST`` (local checkpoint layout), or ``None``."""
    try:
        text = (staging.parent.parent / "LATEST").read_text().strip()
    except FileNotFoundError:
        return None
    return int(text.removeprefix("step-"))


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.02)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--sleep-ms", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--stale-probe", action="store_true")
    return p.parse_args()


def probe_and_exit(rt: runtime.Runtime, out: Path, step: int) -> int:
    """``--stale-probe``: tries one more checkpoint commit after ``step`` and records
    what it raised."""
    ctx = rt.context
    record: dict[str, object] = {
        "rank": ctx.rank,
        "attempt": ctx.attempt,
        "error": None,
        "status": None,
    }
    try:
        with rt.checkpoint(step + 1000, state={"probe": True}) as part:
            (part / "probe.txt").write_text("stale")
        record["error"] = "committed" if part.committed is not None else "refused"
    except errors.StaleAttempt as e:
        record["error"], record["status"] = "StaleAttempt", e.status
    except errors.CumulusError as e:
        record["error"] = f"{type(e).__name__}: {e}"
    name = f"probe-rank-{ctx.rank}.attempt-{ctx.attempt}.json"
    (out / name).write_text(json.dumps(record))
    print(f"probe: {record}", flush=True)
    return 0


def kill_self(ctx: runtime.Context, staging: Path, step: int, ckpt_every: int) -> None:
    """``--kill-rank``: SIGKILLs this rank once the last checkpoint before ``step`` is
    committed."""
    last = step - step % ckpt_every
    wait_until(lambda: (latest_step(staging) or 0) >= last, 60, f"step {last} committed")
    print(f"rank={ctx.rank} killing itself at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    args = parse_args()
    rt = runtime.init(handle_sigterm=True)
    ctx = rt.context
    reader = runtime.ShardReader(ctx.shard_paths)
    total, count, step = 0, 0, 0
    resumed_from = None
    point = rt.resume()
    if point is not None:
        model = json.loads((point.dir / "model.json").read_text())
        total, count = model["sum"], model["count"]
        reader.restore(point.state["reader"])
        step = resumed_from = point.step
    print(
        f"rank={ctx.rank} attempt={ctx.attempt} world={ctx.world_size} "
        f"shards={len(ctx.shard_paths)} start={step}",
        flush=True,
    )

    probing = args.stale_probe and ctx.attempt == 0 and ctx.rank != args.kill_rank
    for record in reader:
        step += 1
        total += int(record[1])
        count += 1
        rt.report(step, loss=1.0 / step, records=float(count))
        if step % args.ckpt_every == 0 and rt.checkpoints_enabled:
            try:
                with rt.checkpoint(step, state={"reader": reader.state()}) as part:
                    model = {"sum": total, "count": count}
                    (part / "model.json").write_text(json.dumps(model))
            except errors.StaleAttempt:
                if not probing:
                    raise
                # Replaced while committing: the probe's outcome already.
                return probe_and_exit(rt, args.out, step)
            if part.committed is None:  # refused: this attempt is being stopped
                print(f"rank={ctx.rank} checkpoint {step} not committed: stopping", flush=True)
                return 0
            print(f"rank={ctx.rank} checkpoint {step} committed: {part.committed.dir}", flush=True)
        if (
            ctx.rank == args.kill_rank
            and ctx.attempt == 0
            and step == args.kill_at_step
            and ctx.staging_dir is not None
        ):
            kill_self(ctx, ctx.staging_dir, step, args.ckpt_every)
        if rt.should_stop():
            print(f"rank={ctx.rank} asked to stop at step {step}", flush=True)
            return probe_and_exit(rt, args.out, step) if probing else 0
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)

    if probing:
        # Stay until the agent stops this attempt (the killed rank's restart does).
        wait_until(rt.should_stop, 120, "SIGTERM")
        return probe_and_exit(rt, args.out, step)

    rt.flush()
    result = {
        "rank": ctx.rank,
        "attempt": ctx.attempt,
        "sum": total,
        "count": count,
        "steps": step,
        "resumed_from": resumed_from,
    }
    (args.out / f"rank-{ctx.rank}.json").write_text(json.dumps(result))
    print(f"rank={ctx.rank} done: {result}", flush=True)
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
