"""A rank for the straggler benchmark's clean runs: reports one more step every 20 ms for
``CUMULUS_BENCH_RUN_S`` seconds, then exits 0. Ranks never synchronize, so each one's
steps/s is its own scheduling on a shared machine: what the leader's detector judges."""

from __future__ import annotations

import os
import time

from cumulus import runtime


def main() -> None:
    until = time.monotonic() + float(os.environ["CUMULUS_BENCH_RUN_S"])
    step = 0
    while time.monotonic() < until and not runtime.should_stop():
        step += 1
        runtime.report(step)
        time.sleep(0.02)


if __name__ == "__main__":
    main()
