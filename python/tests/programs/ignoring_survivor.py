"""A rank program for ``test_inprocess_restart``'s fencing test (world size 2, standard
library only): a survivor that ignores an in-process restart.

* Attempt 0 of each rank commits step 1 and reports progress. Rank 0 then listens for
  in-process restarts by hand (``GET /v1/restart``, as ``cumulus.runtime.run`` would) but
  ignores the one it gets: it tries to commit step 2 as its abandoned attempt, which must
  be refused (it prints ``fenced: ...``), then goes on as if nothing happened until the
  agent kills it. Rank 1 reports until the test kills it.
* Later attempts commit the step after their resume step and exit 0.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from cumulus import errors, runtime


def write(step: int):  # type: ignore[no-untyped-def]
    def fill(d: Path) -> None:
        (d / "step.txt").write_text(str(step))

    return fill


def main() -> int:
    rt = runtime.get_runtime()
    ctx = rt.context
    if ctx.attempt > 0:
        step = (ctx.resume_step or 0) + 1
        rt.save_checkpoint(step, write(step))
        rt.report(step, step)
        rt.close()
        print(f"rank={ctx.rank} attempt={ctx.attempt} committed step {step}", flush=True)
        return 0
    rt.save_checkpoint(1, write(1))
    rt.report(1, 3)
    rt.flush()
    if ctx.rank == 1:
        while True:  # until the test kills it
            rt.report(1, 3)
            time.sleep(0.1)
    assert rt.agent is not None
    offer = None
    while offer is None:
        rt.report(1, 3)
        offer = rt.agent.restart_poll(timeout_s=1.0)
    print(f"rank=0 got an in-process restart and ignores it: {offer[:80]!r}", flush=True)
    try:
        part = rt.save_checkpoint(2, write(2))
    except errors.StaleAttempt as e:
        print(f"fenced: checkpoint step 2 refused: {e}", flush=True)
    else:
        if part is None:
            print("fenced: checkpoint step 2 refused (not committed)", flush=True)
        else:
            print(f"NOT FENCED: checkpoint step 2 committed as {part.dir}", flush=True)
    while True:  # until the agent gives up on it
        rt.report(2, 3)
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
