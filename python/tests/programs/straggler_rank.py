"""A rank for the straggler test: reports one more step every 20 ms until it is asked to
stop. It never synchronizes with the other ranks, so a rank the test slows down (SIGSTOP
and SIGCONT) reports fewer steps per second than the others."""

from __future__ import annotations

import time

from cumulus import runtime


def main() -> None:
    step = 0
    while not runtime.should_stop():
        step += 1
        runtime.report(step)
        time.sleep(0.02)


if __name__ == "__main__":
    main()
