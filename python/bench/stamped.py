"""Runs a Python script (``stamped.py SCRIPT ARGS...``) with every line it prints on stdout
and stderr also written, with the wall-clock time it was printed at, to
``$CUMULUS_BENCH_STAMPS/rank-<RANK>.attempt-<A>.pid-<PID>.log`` (one ``<unix time> <line>``
per line, flushed per line, so a line printed just before a SIGKILL is kept), and every
``cumulus.runtime`` progress report (``Runtime.report(step, ...)``, which the script makes
after each training step, on every rank, under Cumulus and torchrun alike) as a line
``report step <N>``.

It also stamps the phases of a rank's (re)start: ``stamped: script`` when it starts the
script (a new process, or a warm spare that took the attempt), and ``stamped: <name>
begins`` / ``stamped: <name> returns`` around ``torch.distributed.init_process_group``
(``rendezvous``: the store, the gloo mesh) and ``cumulus.ckpt.load_checkpoint``
(``restore``), as the script calls them (``dist.init_process_group``,
``ckpt.load_checkpoint``).

The attempt is ``CUMULUS_ATTEMPT`` under Cumulus and ``TORCHELASTIC_RESTART_COUNT`` under
torchrun. The benchmark uses it to time "rank killed" → "first step after the restart"
with the same clock under both launchers, without changing the script.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from typing import Any, TextIO


class _Stamped:
    """A text stream that writes through to ``inner`` and logs complete lines to ``log``."""

    def __init__(self, inner: TextIO, log_fd: int) -> None:
        self._inner = inner
        self._fd = log_fd
        self._partial = ""

    def write(self, s: str) -> int:
        now = time.time()
        n = self._inner.write(s)
        text = self._partial + s
        *lines, self._partial = text.split("\n")
        if lines:
            # One unbuffered write: in the file before the next statement (a SIGKILL).
            os.write(self._fd, "".join(f"{now:.6f} {line}\n" for line in lines).encode())
        return n

    def flush(self) -> None:
        self._inner.flush()

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def _stamp_reports(fd: int) -> None:
    """Stamps every ``Runtime.report`` call (the step it reports) into ``fd``."""
    from cumulus.runtime import Runtime

    report = Runtime.report

    def stamped(self: Runtime, step: int, *args: object, **kwargs: object) -> None:
        os.write(fd, f"{time.time():.6f} report step {step}\n".encode())
        report(self, step, *args, **kwargs)  # type: ignore[arg-type]

    Runtime.report = stamped  # type: ignore[method-assign]


def _stamp_phases(fd: int) -> None:
    """Stamps the beginning and the end of each ``init_process_group`` and
    ``load_checkpoint`` call (imported here, before the script: it imports them anyway)."""
    import torch.distributed as dist

    from cumulus import ckpt

    def wrap(module: Any, attr: str, name: str) -> None:
        inner = getattr(module, attr)

        def stamped(*args: Any, **kwargs: Any) -> Any:
            os.write(fd, f"{time.time():.6f} stamped: {name} begins\n".encode())
            try:
                return inner(*args, **kwargs)
            finally:
                os.write(fd, f"{time.time():.6f} stamped: {name} returns\n".encode())

        setattr(module, attr, stamped)

    wrap(dist, "init_process_group", "rendezvous")
    wrap(ckpt, "load_checkpoint", "restore")


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: stamped.py SCRIPT [ARGS...]")
    out = os.environ.get("CUMULUS_BENCH_STAMPS")
    if out:
        rank = os.environ.get("RANK", "0")
        attempt = os.environ.get("CUMULUS_ATTEMPT") or os.environ.get(
            "TORCHELASTIC_RESTART_COUNT", "0"
        )
        path = os.path.join(out, f"rank-{rank}.attempt-{attempt}.pid-{os.getpid()}.log")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout = _Stamped(sys.stdout, fd)
        sys.stderr = _Stamped(sys.stderr, fd)
        _stamp_reports(fd)
        os.write(fd, f"{time.time():.6f} stamped: script\n".encode())
        _stamp_phases(fd)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
