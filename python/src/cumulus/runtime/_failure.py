"""What a rank died of: its uncaught exception, reported to the worker agent before the
process ends (``POST /v1/exception`` on the rank-local API, docs/architecture.md).

In a Cumulus rank, importing :mod:`cumulus.runtime` chains a :data:`sys.excepthook` and
a :data:`threading.excepthook` (:func:`install_exception_report`, once per process). On
an uncaught exception they send its type, message and last frames to the agent, then
call the hook before them (the traceback is printed as usual). When the process then
exits non-zero, the agent reports the exception as the cause of the exit, and the job's
failure reads ``rank 0 attempt 2 exited with code 1: ValueError: bad lr (train.py:42)``
(``cumulusctl status``/``describe``, :attr:`cumulus.JobInfo.failure_cause`,
:class:`cumulus.JobFailed`). Without the runtime (or before it is imported), the agent
names the last line of the rank's output instead.

A report never raises and waits at most :data:`EXCEPTION_TIMEOUT_S`; a failed one is
noted on stderr before the traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from cumulus._contract import (
    RANK_ENV_AGENT_SOCKET,
    RANK_ENV_AGENT_TOKEN,
    RANK_ENV_AGENT_URL,
    RANK_MAX_EXCEPTION_FRAME_BYTES,
    RANK_MAX_EXCEPTION_FRAMES,
    RANK_MAX_EXCEPTION_MESSAGE_BYTES,
    RANK_MAX_EXCEPTION_TYPE_BYTES,
)
from cumulus.runtime._agent import AgentClient

__all__ = [
    "EXCEPTION_TIMEOUT_S",
    "MAX_FRAMES",
    "MAX_FRAME_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_TYPE_BYTES",
    "describe_exception",
    "install_exception_report",
]

#: Longest wait for the agent's answer to an exception report, in seconds.
EXCEPTION_TIMEOUT_S = 2.0
#: Longest exception type sent, in bytes.
MAX_TYPE_BYTES = RANK_MAX_EXCEPTION_TYPE_BYTES
#: Longest exception message sent, in bytes (a longer one is cut).
MAX_MESSAGE_BYTES = RANK_MAX_EXCEPTION_MESSAGE_BYTES
#: Most frames sent (the innermost ones).
MAX_FRAMES = RANK_MAX_EXCEPTION_FRAMES
#: Longest frame (and origin) sent, in bytes.
MAX_FRAME_BYTES = RANK_MAX_EXCEPTION_FRAME_BYTES


def _cut(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` bytes of UTF-8, at a character boundary."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= max_bytes:
        return text
    return data[:max_bytes].decode("utf-8", errors="ignore")


def _type_name(exc_type: type[BaseException]) -> str:
    """``ValueError`` for built-ins and the script's own classes, else
    ``module.QualName`` (``torch.OutOfMemoryError``)."""
    name = getattr(exc_type, "__qualname__", None) or getattr(exc_type, "__name__", "Exception")
    module = getattr(exc_type, "__module__", None)
    if isinstance(module, str) and module not in ("builtins", "__main__"):
        name = f"{module}.{name}"
    return _cut(str(name), MAX_TYPE_BYTES) or "Exception"


def _message(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    try:
        text = str(exc)
    except Exception:
        text = f"<unprintable {type(exc).__name__}>"
    return _cut(text, MAX_MESSAGE_BYTES)


def _installation_dirs() -> tuple[str, ...]:
    """Directories of the Python installation and of this package: a frame there is not
    the job's own code."""
    dirs = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        with contextlib.suppress(KeyError, OSError, ValueError):
            dirs.add(os.path.realpath(sysconfig.get_paths()[key]))
    dirs.add(os.path.realpath(Path(__file__).resolve().parent.parent))
    return tuple(d.rstrip(os.sep) + os.sep for d in dirs if d)


def describe_exception(
    exc_type: type[BaseException], exc: BaseException | None, tb: TracebackType | None
) -> dict[str, Any]:
    """The body of ``POST /v1/exception`` for an exception: its type, message (cut to
    :data:`MAX_MESSAGE_BYTES`), last :data:`MAX_FRAMES` frames as ``file:line in
    function`` (innermost last) and its origin, ``file:line`` with the file's base name of
    the innermost frame outside the Python installation (else the innermost frame)."""
    try:
        frames = traceback.extract_tb(tb)[-MAX_FRAMES:] if tb is not None else []
    except Exception:
        frames = []
    installation = _installation_dirs()
    origin = ""
    for frame in reversed(frames):
        path = os.path.realpath(frame.filename) if frame.filename else ""
        if not path.startswith(installation):
            origin = f"{os.path.basename(frame.filename)}:{frame.lineno}"
            break
    if not origin and frames:
        origin = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}"
    return {
        "type": _type_name(exc_type),
        "message": _message(exc),
        "frames": [_cut(f"{f.filename}:{f.lineno} in {f.name}", MAX_FRAME_BYTES) for f in frames],
        "origin": _cut(origin, MAX_FRAME_BYTES),
    }


def _report(agent: AgentClient, exc_type: Any, exc: Any, tb: Any) -> None:
    """Sends one exception report; on failure, a note on stderr. Never raises."""
    try:
        agent.report_exception(describe_exception(exc_type, exc, tb), timeout_s=EXCEPTION_TIMEOUT_S)
    except Exception as e:
        with contextlib.suppress(Exception):
            print(f"cumulus: could not report the exception to the agent: {e}", file=sys.stderr)


_ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]
_installed: tuple[_ExceptHook, Callable[[Any], Any]] | None = None
_lock = threading.Lock()


def install_exception_report(agent: AgentClient) -> bool:
    """Chains a :data:`sys.excepthook` and a :data:`threading.excepthook` that report an
    uncaught exception to ``agent`` (see the module documentation), once per process;
    returns whether this call installed them. The hooks before them still run after the
    report (SystemExit in a thread is left alone, as Python's own hook does)."""
    global _installed
    with _lock:
        if _installed is not None:
            return False
        previous = sys.excepthook
        previous_thread = threading.excepthook

        def hook(
            exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
        ) -> None:
            _report(agent, exc_type, exc, tb)
            previous(exc_type, exc, tb)

        def thread_hook(args: Any) -> None:
            if not issubclass(args.exc_type, SystemExit):
                _report(agent, args.exc_type, args.exc_value, args.exc_traceback)
            previous_thread(args)

        sys.excepthook = hook
        threading.excepthook = thread_hook
        _installed = (hook, thread_hook)
        global _installed_agent
        _installed_agent = agent
        return True


_installed_agent: AgentClient | None = None


def use_token(token: str) -> None:
    """Reports later exceptions with ``token``: the new attempt's, after an in-process
    restart (:func:`cumulus.runtime.run`). Nothing when no hook is installed."""
    agent = _installed_agent
    if agent is not None:
        agent._token = token


def install_from_env(environ: dict[str, str] | None = None) -> bool:
    """:func:`install_exception_report` for the agent the rank environment names
    (``CUMULUS_AGENT_URL``, ``CUMULUS_AGENT_TOKEN``, ``CUMULUS_AGENT_SOCKET``); does
    nothing outside a Cumulus rank or with a malformed URL. Returns whether it
    installed the hooks."""
    env = os.environ if environ is None else environ
    url = env.get(RANK_ENV_AGENT_URL, "")
    token = env.get(RANK_ENV_AGENT_TOKEN, "")
    if not url or not token:
        return False
    try:
        agent = AgentClient(url, token, socket_path=env.get(RANK_ENV_AGENT_SOCKET) or None)
    except ValueError:
        return False
    return install_exception_report(agent)
