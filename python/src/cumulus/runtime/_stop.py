"""The SIGTERM half of ``should_stop()``: whether the worker agent signalled this rank.

The agent stops a rank (job cancelled or paused, time limit, group restart, worker
shutting down) by telling it first (the control action, :mod:`cumulus.runtime._control`),
then with SIGTERM to its process group after a notice period, then SIGKILL after a grace
time (``--stop-grace-ms``, 5 s by default). A rank that missed the action (it never asked)
still sees the SIGTERM here.

The SIGTERM handler is installed only once asked for (:func:`install_stop_handler`, or
the first stop check from the main thread): a script that never checks keeps Python's
default, dying at once on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = [
    "install_stop_handler",
    "request_stop",
    "stop_handler_installed",
    "stop_signalled",
]

_stop = threading.Event()
_lock = threading.Lock()
_installed = False
_previous: Any = None


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if _stop.is_set():
        # A second SIGTERM: give up the graceful path and let it act as before.
        signal.signal(signal.SIGTERM, _previous if _previous is not None else signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    _stop.set()
    if callable(_previous):
        handler: Callable[[int, FrameType | None], Any] = _previous
        handler(signum, frame)


def install_stop_handler() -> None:
    """Installs the SIGTERM handler behind :func:`should_stop` (idempotent).

    The first SIGTERM only sets the stop flag (and calls a Python handler installed
    before, if any); a second one is handled as it was before this call (by default it
    terminates the process).

    :raises RuntimeError: called from a thread other than the main thread (Python only
        lets the main thread install signal handlers).
    """
    global _installed, _previous
    with _lock:
        if _installed:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "cumulus.runtime: the SIGTERM handler behind should_stop() must be "
                "installed from the main thread; call install_stop_handler() (or "
                "should_stop()) once from the main thread first"
            )
        _previous = signal.signal(signal.SIGTERM, _on_sigterm)
        _installed = True


def stop_handler_installed() -> bool:
    """Whether :func:`install_stop_handler` has run."""
    return _installed


def stop_signalled() -> bool:
    """True once this rank got SIGTERM (or :func:`request_stop` was called).

    The first call installs the SIGTERM handler (see :func:`install_stop_handler`).

    :raises RuntimeError: the first call is made from a thread other than the main thread.
    """
    if not _installed:
        install_stop_handler()
    return _stop.is_set()


def request_stop() -> None:
    """Sets the stop flag as a SIGTERM would (for tests and for a trainer's own signal
    handling)."""
    _stop.set()
