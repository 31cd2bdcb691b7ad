#!/usr/bin/env python3
"""Runs a training script and says how long its rank took to make its first progress
report: the figure to choose ``--startup-timeout-s`` (``startup_timeout_s``) from.

    cumulusctl submit --world-size 2 --dataset /tmp/digits -- \\
        python examples/python/first_report.py examples/python/ddp_digits.py --out /tmp/ddp

The script runs in this process, as ``python SCRIPT ARGS...`` would run it (same
``sys.argv[1:]``, ``__name__ == "__main__"``); its first ``cumulus.runtime`` report
prints one line on stderr (so in the rank's log)::

    cumulus: rank 0 made its first progress report 3.41 s after its process started

The time counts from the process's start as the kernel recorded it (``/proc/self/stat``;
Linux only), so the interpreter's own start is in it: what the leader's startup timeout
measures, but for the time the agent takes to spawn the process.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
from typing import Any


def process_age_s() -> float:
    """Seconds since this process started (the kernel's start time, in clock ticks since
    boot, against the uptime)."""
    with open("/proc/self/stat", encoding="ascii") as f:
        # Field 22 (starttime) counts from the end of the command name, which may hold
        # spaces: split after its closing parenthesis.
        fields = f.read().rsplit(")", 1)[1].split()
    started_ticks = int(fields[19])
    with open("/proc/uptime", encoding="ascii") as f:
        uptime_s = float(f.read().split()[0])
    return uptime_s - started_ticks / os.sysconf("SC_CLK_TCK")


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: first_report.py SCRIPT [ARGS...]")
    started = time.monotonic() - process_age_s()
    from cumulus import runtime

    report = runtime.Runtime.report
    said = threading.Event()

    def timed_report(self: runtime.Runtime, *args: Any, **kwargs: Any) -> None:
        if not said.is_set():
            said.set()
            print(
                f"cumulus: rank {self.context.rank} made its first progress report "
                f"{time.monotonic() - started:.2f} s after its process started",
                file=sys.stderr,
                flush=True,
            )
        report(self, *args, **kwargs)

    runtime.Runtime.report = timed_report  # type: ignore[method-assign]
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
