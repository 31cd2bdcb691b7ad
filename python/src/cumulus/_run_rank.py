"""The rank side of :meth:`cumulus.Client.run`, after the bootstrap's version check: load
the pickled call, run it inside the rank runtime, write its result (or its exception)
into ``$CUMULUS_OUTPUT_DIR``, where the agent picks it up as the attempt's artifacts.

Standard library and ``cloudpickle`` (the copy the client sent) only.

* Rank 0 (every rank with ``gather``) writes the pickled return value to
  ``REMOTE_RESULT_FILE``; past ``max_result_bytes``, or when the value cannot be pickled,
  it writes the error file instead and exits with ``EXIT_CANNOT_RUN`` (the same call
  would fail the same way again: the job fails at once, spending no restart).
* An exception writes ``REMOTE_ERROR_FILE`` (``kind``, ``type``, ``message``,
  ``traceback``, ``rank``, ``attempt``) and exits 1: the job restarts within its budget
  as for any failed rank (the function resumes from its checkpoint, if it made one).
* A call that cannot be loaded here (a module it needs by reference is missing) writes
  the error file and exits with ``EXIT_CANNOT_RUN``.
* ``SystemExit`` passes through (a function that checkpointed for a pause may exit 0);
  nothing is written then.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cumulus import _contract, runtime

__all__ = ["MAX_MESSAGE_CHARS", "MAX_TRACEBACK_CHARS", "error_record", "main"]

#: Longest exception message kept in the error file, in characters.
MAX_MESSAGE_CHARS = 64 * 1024
#: Longest traceback kept in the error file, in characters (its end is kept).
MAX_TRACEBACK_CHARS = 256 * 1024


def _qualified(kind: type[BaseException]) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def error_record(kind: str, exc: BaseException, rank: int, attempt: int) -> dict[str, Any]:
    """The error file's JSON for ``exc``, its message and traceback cut to their limits
    (the traceback's end is kept: it names the failing line)."""
    try:
        message = str(exc)
    except Exception as e:  # a broken __str__ must not hide the error
        message = f"<the exception's str() failed: {type(e).__name__}>"
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if len(text) > MAX_TRACEBACK_CHARS:
        text = "...(cut)...\n" + text[-MAX_TRACEBACK_CHARS:]
    return {
        "kind": kind,
        "type": _qualified(type(exc)),
        "message": message[:MAX_MESSAGE_CHARS],
        "traceback": text,
        "rank": rank,
        "attempt": attempt,
    }


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Output:
    """The attempt's output dir (``None`` outside a Cumulus rank: nothing is written)."""

    def __init__(self, meta: Mapping[str, Any], ctx: runtime.Context) -> None:
        self.dir = ctx.output_dir
        self.meta = meta
        self.rank = ctx.rank
        self.attempt = ctx.attempt

    def error(self, kind: str, exc: BaseException) -> None:
        record = error_record(kind, exc, self.rank, self.attempt)
        sys.stderr.write(record["traceback"] or f"{record['type']}: {record['message']}\n")
        sys.stderr.flush()
        if self.dir is not None:
            data = json.dumps(record).encode()
            _write_atomically(self.dir / str(self.meta["error_file"]), data)

    def result(self, data: bytes) -> None:
        if self.dir is None:
            sys.stderr.write("cumulus: no $CUMULUS_OUTPUT_DIR: the result is not kept\n")
            return
        _write_atomically(self.dir / str(self.meta["result_file"]), data)


class ResultTooLarge(Exception):
    """The function's pickled return value is larger than the result limit."""


def _load(here: Path) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    import cloudpickle  # noqa: F401  (its reconstructors must be importable)

    with open(here / "payload.pkl", "rb") as f:
        fn, args, kwargs = pickle.load(f)
    return fn, tuple(args), dict(kwargs)


def main(here: str | os.PathLike[str], meta: Mapping[str, Any], gather: bool) -> int:
    """Runs the call in ``here/payload.pkl``; returns the process's exit code."""
    import cloudpickle

    rt = runtime.get_runtime()
    ctx = rt.context
    out = _Output(meta, ctx)
    cannot_run = int(meta["exit_cannot_run"])
    try:
        fn, args, kwargs = _load(Path(here))
    except Exception as e:
        out.error("load", e)
        return cannot_run
    try:
        value = fn(*args, **kwargs)
    except SystemExit:
        rt.close()
        raise
    except BaseException as e:
        out.error("exception", e)
        rt.close()
        return 1
    rt.close()
    if ctx.rank != 0 and not gather:
        return 0
    try:
        data = cloudpickle.dumps(value)
    except Exception as e:
        out.error("result", e)
        return cannot_run
    limit = int(meta["max_result_bytes"])
    if len(data) > limit:
        too_large = ResultTooLarge(
            f"the function's return value pickles to {len(data)} bytes, over the result "
            f"limit of {limit} bytes: write large outputs as files into "
            f"${_contract.RANK_ENV_OUTPUT_DIR} (Job.download fetches them) and return "
            "something small"
        )
        out.error("result", too_large)
        return cannot_run
    out.result(data)
    return 0
