"""A rank program for the lifecycle integration tests (pause, resume, time limits),
written against ``cumulus.runtime`` only.

Each step adds its number to a running sum (the "model"): after step ``S`` the sum is
``S * (S + 1) / 2`` exactly when every step ran once, across any number of attempts.
Each step reports progress, then checks ``should_stop()``; once asked to stop it commits
a checkpoint at its current step, holding the model (a file) and, in the state, what it
was asked (``stop_request()``, ``should_pause()``), and exits 0. Every ``--ckpt-every``
steps it commits one as well (0: only when asked to stop). An attempt resumes from
``resume()``.

It appends one JSON line per event to ``<out>/events-rank-<R>.jsonl``: ``start`` (its
attempt and the step it resumed from), ``stop`` (the step, the action, whether it was a
pause, the committed part) and ``done``; at the end it writes ``<out>/rank-<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from cumulus import errors, runtime


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--sleep-ms", type=int, default=50)
    p.add_argument("--ckpt-every", type=int, default=0)
    args = p.parse_args()

    rt = runtime.init(handle_sigterm=True)
    ctx = rt.context
    events = args.out / f"events-rank-{ctx.rank}.jsonl"

    def event(kind: str, **fields: Any) -> None:
        line = {"event": kind, "rank": ctx.rank, "attempt": ctx.attempt, **fields}
        with events.open("a") as f:
            f.write(json.dumps(line) + "\n")
        print(f"rank={ctx.rank} {kind}: {json.dumps(fields)}", flush=True)

    step, total = 0, 0
    point = rt.resume()
    if point is not None:
        step = point.step
        total = json.loads((point.dir / "model.json").read_text())["sum"]
        if total != step * (step + 1) // 2:
            sys.exit(f"the checkpoint of step {step} holds sum {total}: not every step once")
    event(
        "start",
        start=step,
        resumed_from=None if point is None else point.step,
        resumed_state=None if point is None else dict(point.state),
    )

    def commit(at: int, asked: str | None, pause: bool) -> str:
        with rt.checkpoint(at, state={"action": asked, "pause": pause}) as part:
            (part / "model.json").write_text(json.dumps({"sum": total, "step": at}))
        # Not committed when the job was cancelled (the agent refuses a stopping rank's part).
        return part.committed.dir if part.committed is not None else ""

    while step < args.steps:
        step += 1
        total += step
        rt.report(step, args.steps, sum=float(total))
        if rt.should_stop():
            asked, pause = rt.stop_request(), rt.should_pause()
            committed = None
            if rt.checkpoints_enabled:
                try:
                    committed = commit(step, asked, pause)
                except errors.StaleAttempt as e:
                    # Cancelled or replaced: nothing to keep, just go.
                    committed = f"refused: {e}"
            event("stop", step=step, action=asked, pause=pause, committed=committed)
            rt.close()
            return 0
        if args.ckpt_every and step % args.ckpt_every == 0 and rt.checkpoints_enabled:
            commit(step, None, False)
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)

    rt.flush()
    result = {
        "rank": ctx.rank,
        "attempt": ctx.attempt,
        "steps": step,
        "sum": total,
        "resumed_from": None if point is None else point.step,
    }
    (args.out / f"rank-{ctx.rank}.json").write_text(json.dumps(result))
    event("done", steps=step, sum=total)
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
