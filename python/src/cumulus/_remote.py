"""The client side of :meth:`cumulus.Client.run`: a function call made into a small
directory the ranks run, and the job's outcome read back from its artifacts.

The directory (packed into the job's working directory as ``_cumulus_run/``) holds:

* ``payload.pkl``: ``(fn, args, kwargs)`` pickled by value with cloudpickle (the
  function's module too, when it is the caller's own code rather than an installed
  package, so a worker without it still loads the function);
* ``meta.json``: the client's Python ``major.minor``, the contract's file names, exit
  code and result limit;
* ``bootstrap.py`` (:mod:`cumulus._run_bootstrap`): the version check, then
  :func:`cumulus._run_rank.main`;
* ``lib/``: copies of the pure-Python packages a rank needs to load the call,
  ``cumulus`` and ``cloudpickle``, from the client's installed files (put first on the
  rank's ``sys.path``).

The job's command is ``python3 _cumulus_run/bootstrap.py`` (``--gather`` with
``gather=True``): the worker's ``python3``, or the job environment's.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import pickle
import shutil
import site
import sys
import sysconfig
import tempfile
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle

import cumulus
from cumulus import _contract
from cumulus._bundle import ArchiveFile
from cumulus.errors import PythonVersionMismatch, RemoteError
from cumulus.models import JobInfo

__all__ = [
    "BOOTSTRAP",
    "GATHER_FLAG",
    "RUN_DIR",
    "RUN_ENV",
    "RemoteOutcome",
    "by_value_modules",
    "client_python",
    "function_bundle",
    "load_result",
    "outcome_of",
    "raise_remote_error",
    "run_command",
]

#: The directory of a :meth:`cumulus.Client.run` job's working directory that holds the
#: call (reserved: an uploaded directory may not have it).
RUN_DIR = "_cumulus_run"
#: The bootstrap script, relative to the rank's working directory.
BOOTSTRAP = f"{RUN_DIR}/bootstrap.py"
#: The bootstrap's flag for ``gather=True``: every rank writes its result.
GATHER_FLAG = "--gather"
#: Version of the directory's layout (``meta.json``'s ``format``).
FORMAT = 1
#: The packages copied into ``lib/`` (pure Python, imported by the rank side).
VENDORED = ("cumulus", "cloudpickle")
#: Environment of every rank of a run: Python's output unbuffered, so its log is live.
RUN_ENV = {"PYTHONUNBUFFERED": "1"}


def client_python() -> str:
    """This interpreter's ``major.minor`` (e.g. ``"3.11"``): what the ranks must run."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def run_command(gather: bool) -> list[str]:
    """The job's command: the bootstrap run by the rank's ``python3``."""
    return ["python3", BOOTSTRAP, *([GATHER_FLAG] if gather else [])]


def _installed_roots() -> list[Path]:
    """Where installed packages and the standard library live: a module under one of
    them is pickled by reference (the rank's environment must have it)."""
    paths = sysconfig.get_paths()
    roots = [paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    with contextlib.suppress(AttributeError):
        roots.extend(site.getsitepackages())
    with contextlib.suppress(AttributeError):
        roots.append(site.getusersitepackages())
    return [Path(r).resolve() for r in roots if r]


def by_value_modules(fn: Callable[..., Any]) -> list[types.ModuleType]:
    """The modules to pickle by value with ``fn``: its own module when that is the
    caller's code (not ``__main__``, which cloudpickle pickles by value anyway, not an
    installed package or the standard library, not ``cumulus`` or ``cloudpickle``)."""
    module = inspect.getmodule(fn)
    if module is None or module.__name__ == "__main__":
        return []
    if module.__name__.split(".")[0] in VENDORED:
        return []
    file = getattr(module, "__file__", None)
    if not file:
        return []  # built in
    path = Path(file).resolve()
    if any(path.is_relative_to(root) for root in _installed_roots()):
        return []
    return [module]


def _pickle_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bytes:
    """``(fn, args, kwargs)`` pickled with cloudpickle, ``fn``'s own module by value.

    :raises TypeError: something in the call cannot be pickled (the message says what)."""
    registered = set(cloudpickle.list_registry_pickle_by_value())
    added = [m for m in by_value_modules(fn) if m.__name__ not in registered]
    for module in added:
        cloudpickle.register_pickle_by_value(module)
    try:
        data: bytes = cloudpickle.dumps((fn, tuple(args), dict(kwargs)))
        return data
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise TypeError(
            f"Client.run cannot send {getattr(fn, '__qualname__', fn)!r} and its arguments: "
            f"they must be picklable by cloudpickle ({type(e).__name__}: {e})"
        ) from e
    finally:
        for module in added:
            cloudpickle.unregister_pickle_by_value(module)


def _copy_package(name: str, lib: Path) -> None:
    module = sys.modules.get(name) or __import__(name)
    source = Path(inspect.getfile(module)).parent
    shutil.copytree(
        source,
        lib / name,
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.pyd"),
    )


@contextlib.contextmanager
def function_bundle(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    max_result_bytes: int = _contract.DEFAULT_MAX_RESULT_BYTES,
) -> Iterator[Path]:
    """A temporary directory holding the call (see the module documentation), removed
    when the block ends. The ranks must run this client's ``major.minor``
    (:func:`client_python`).

    :raises TypeError: the call cannot be pickled."""
    payload = _pickle_call(fn, args, kwargs)
    meta = {
        "format": FORMAT,
        "python": client_python(),
        "cumulus": cumulus.__version__,
        "output_dir_env": _contract.RANK_ENV_OUTPUT_DIR,
        "result_file": _contract.REMOTE_RESULT_FILE,
        "error_file": _contract.REMOTE_ERROR_FILE,
        "exit_cannot_run": _contract.EXIT_CANNOT_RUN,
        "max_result_bytes": max_result_bytes,
    }
    with tempfile.TemporaryDirectory(prefix="cumulus-run-") as tmp:
        root = Path(tmp)
        (root / "payload.pkl").write_bytes(payload)
        (root / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        shutil.copyfile(Path(__file__).with_name("_run_bootstrap.py"), root / "bootstrap.py")
        lib = root / "lib"
        for name in VENDORED:
            _copy_package(name, lib)
        yield root


@dataclass(frozen=True)
class RemoteOutcome:
    """What one rank's artifacts say about the call: its pickled result or its error
    record (``None`` when it left neither)."""

    rank: int
    attempt: int
    result: bytes | None
    error: Mapping[str, Any] | None


def outcome_of(rank: int, attempt: int, files: list[ArchiveFile]) -> RemoteOutcome:
    """The outcome of one rank from its artifacts' files (read with their bytes)."""
    by_path = {f.path: f for f in files}
    result = by_path.get(_contract.REMOTE_RESULT_FILE)
    error = by_path.get(_contract.REMOTE_ERROR_FILE)
    record: Mapping[str, Any] | None = None
    if error is not None and error.data is not None:
        try:
            parsed = json.loads(error.data)
        except ValueError:
            parsed = None
        record = (
            parsed
            if isinstance(parsed, dict)
            else {"type": "?", "message": f"unreadable error file: {error.data[:200]!r}"}
        )
    return RemoteOutcome(rank, attempt, result.data if result is not None else None, record)


def _text(record: Mapping[str, Any], key: str) -> str:
    value = record.get(key)
    return value if isinstance(value, str) else ""


def raise_remote_error(outcome: RemoteOutcome, job: JobInfo | None) -> None:
    """Raises what ``outcome``'s error record says.

    :raises PythonVersionMismatch: the bootstrap refused the rank's Python.
    :raises RemoteError: anything else (the function raised, the result could not be
        delivered, the call could not be loaded)."""
    record = outcome.error
    if record is None:
        return
    if record.get("kind") == "python_version_mismatch":
        raise PythonVersionMismatch(
            _text(record, "message"),
            client=_text(record, "client_python"),
            remote=_text(record, "remote_python"),
            job=job,
        )
    raise RemoteError(
        remote_type=_text(record, "type") or "?",
        remote_message=_text(record, "message"),
        remote_traceback=_text(record, "traceback"),
        rank=outcome.rank,
        job=job,
    )


def load_result(data: bytes) -> Any:
    """A rank's result, unpickled. Only load results of jobs you trust (your own): a
    pickle runs code as it loads."""
    return pickle.loads(data)
