"""The rank side of ``Client.run`` without a cluster: the call's directory
(``cumulus._remote.function_bundle``) run by a real interpreter started with ``-S`` (no
site-packages: only the copies of ``cumulus`` and ``cloudpickle`` the bundle carries),
as a rank would run it, and its output read back as ``Job.result`` does."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cumulus import _bundle, _contract, _remote
from cumulus.errors import PythonVersionMismatch, RemoteError


def add(a: int, b: int, *, scale: int = 1) -> dict[str, Any]:
    from cumulus import runtime

    ctx = runtime.get_context(standalone=True)
    return {"sum": (a + b) * scale, "rank": ctx.rank}


def boom(message: str) -> None:
    raise ValueError(message)


def big() -> bytes:
    return b"x" * 1000


class Point:
    """A class of this (test) module: pickled by value with the call."""

    def __init__(self, x: int) -> None:
        self.x = x


def make_point(x: int) -> Point:
    return Point(x)


def run_rank(
    tmp_path: Path,
    fn: Callable[..., Any],
    *args: Any,
    rank: int = 0,
    gather: bool = False,
    max_result_bytes: int = _contract.DEFAULT_MAX_RESULT_BYTES,
    **kwargs: Any,
) -> tuple[subprocess.CompletedProcess[str], _remote.RemoteOutcome]:
    """Runs the call as rank ``rank`` of 2 would (its working directory holding the
    bundle, ``python -S`` so nothing installed helps), and reads its output dir back."""
    workdir = tmp_path / f"work-{rank}"
    out = tmp_path / f"out-{rank}"
    out.mkdir(parents=True)
    with _remote.function_bundle(fn, args, kwargs, max_result_bytes=max_result_bytes) as d:
        shutil.copytree(d, workdir / _remote.RUN_DIR)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUMULUS_", "PYTHON"))}
    env |= {
        _contract.RANK_ENV_OUTPUT_DIR: str(out),
        _contract.RANK_ENV_RANK: str(rank),
        _contract.RANK_ENV_WORLD_SIZE: "2",
    }
    argv = _remote.run_command(gather)
    assert argv[0] == "python3"
    proc = subprocess.run(
        [sys.executable, "-S", *argv[1:]],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Read back as the client does: pack the output dir, read the archive.
    with _bundle.pack_directory(out) as packed:
        files = _bundle.read_archive(packed.file, packed.size_bytes, what="out", read_all=True)
    return proc, _remote.outcome_of(rank, 0, files)


def test_a_call_runs_with_only_the_bundled_packages(tmp_path: Path) -> None:
    proc, outcome = run_rank(tmp_path, add, 2, 3, scale=10)
    assert proc.returncode == 0, proc.stderr
    assert outcome.error is None and outcome.result is not None
    assert _remote.load_result(outcome.result) == {"sum": 50, "rank": 0}
    # The interpreter really had no site-packages: cloudpickle came from the bundle.
    check = subprocess.run(
        [sys.executable, "-S", "-c", "import cloudpickle"],
        capture_output=True,
        check=False,
        cwd=tmp_path,
        env={"PATH": os.environ.get("PATH", "")},
    )
    assert check.returncode != 0


def test_a_class_of_the_callers_module_travels_by_value(tmp_path: Path) -> None:
    proc, outcome = run_rank(tmp_path, make_point, 7)
    assert proc.returncode == 0, proc.stderr
    assert outcome.result is not None
    assert _remote.load_result(outcome.result).x == 7


def test_only_rank_0_writes_a_result_unless_gathering(tmp_path: Path) -> None:
    proc, outcome = run_rank(tmp_path, add, 1, 1, rank=1)
    assert proc.returncode == 0 and outcome.result is None and outcome.error is None
    proc, outcome = run_rank(tmp_path / "g", add, 1, 1, rank=1, gather=True)
    assert outcome.result is not None
    assert _remote.load_result(outcome.result) == {"sum": 2, "rank": 1}


def test_an_exception_comes_back_with_its_traceback(tmp_path: Path) -> None:
    proc, outcome = run_rank(tmp_path, boom, "no such weights")
    assert proc.returncode == 1
    assert "ValueError: no such weights" in proc.stderr
    with pytest.raises(RemoteError) as e:
        _remote.raise_remote_error(outcome, None)
    err = e.value
    assert (err.remote_type, err.remote_message, err.rank) == (
        "builtins.ValueError",
        "no such weights",
        0,
    )
    # cloudpickle drops the file name of code pickled by value: the frame keeps its
    # function name and line.
    assert ", in boom\nValueError: no such weights" in err.remote_traceback
    assert "Remote traceback:" in str(err) and err.remote_traceback.rstrip() in str(err)


def test_a_version_mismatch_is_refused_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_remote, "client_python", lambda: "3.1")
    proc, outcome = run_rank(tmp_path, add, 1, 2)
    assert proc.returncode == _contract.EXIT_CANNOT_RUN
    assert outcome.result is None and outcome.error is not None
    with pytest.raises(PythonVersionMismatch, match=r"pickled by Python 3\.1") as e:
        _remote.raise_remote_error(outcome, None)
    assert e.value.client == "3.1"
    assert e.value.remote == f"{sys.version_info.major}.{sys.version_info.minor}"


def test_a_result_over_the_limit_is_an_error_not_a_retry(tmp_path: Path) -> None:
    proc, outcome = run_rank(tmp_path, big, max_result_bytes=100)
    assert proc.returncode == _contract.EXIT_CANNOT_RUN
    with pytest.raises(RemoteError, match="over the result limit of 100 bytes") as e:
        _remote.raise_remote_error(outcome, None)
    assert e.value.remote_type.endswith("ResultTooLarge")


def test_an_unpicklable_call_is_refused_at_the_client() -> None:
    lock = __import__("threading").Lock()
    with (
        pytest.raises(TypeError, match="picklable by cloudpickle"),
        _remote.function_bundle(add, (lock,), {}),
    ):
        pass


def test_installed_modules_go_by_reference_and_the_callers_by_value() -> None:
    assert _remote.by_value_modules(add) == [sys.modules[__name__]]
    assert _remote.by_value_modules(pickle.dumps) == []
    assert _remote.by_value_modules(pytest.raises) == []
    assert _remote.by_value_modules(_remote.run_command) == []
