"""The exception report a rank's runtime sends its agent before the process dies
(``cumulus.runtime._failure``): what it says and its bounds. The report reaching a real
agent and naming the job's failure is in test_cluster.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from cumulus import _contract
from cumulus.runtime import _failure


def _raised(exc: BaseException) -> tuple[type[BaseException], BaseException, object]:
    try:
        raise exc
    except BaseException as e:
        return type(e), e, e.__traceback__


def test_a_report_names_type_message_frames_and_the_origin_in_the_jobs_code() -> None:
    exc_type, exc, tb = _raised(ValueError("bad lr\nsee the docs"))
    report = _failure.describe_exception(exc_type, exc, tb)  # type: ignore[arg-type]
    assert report["type"] == "ValueError"
    assert report["message"] == "bad lr\nsee the docs"
    assert report["origin"] == f"test_failure.py:{_raised.__code__.co_firstlineno + 2}"
    assert report["frames"][-1].endswith(f":{_raised.__code__.co_firstlineno + 2} in _raised")


def test_an_exception_raised_inside_the_python_installation_points_at_the_callers_line() -> None:
    import json

    try:
        json.loads("{")
    except ValueError as e:
        report = _failure.describe_exception(type(e), e, e.__traceback__)
    line = test_an_exception_raised_inside_the_python_installation_points_at_the_callers_line
    assert report["type"] == "json.decoder.JSONDecodeError"
    assert report["origin"] == f"test_failure.py:{line.__code__.co_firstlineno + 4}"
    assert "json" in report["frames"][-1]


def test_every_field_stays_within_the_contracts_bounds() -> None:
    exc_type, exc, tb = _raised(RuntimeError("é" * _contract.RANK_MAX_EXCEPTION_MESSAGE_BYTES))

    def deep(n: int) -> None:
        if n == 0:
            raise exc
        deep(n - 1)

    try:
        deep(3 * _contract.RANK_MAX_EXCEPTION_FRAMES)
    except RuntimeError as e:
        report = _failure.describe_exception(type(e), e, e.__traceback__)
    assert len(report["message"].encode()) <= _contract.RANK_MAX_EXCEPTION_MESSAGE_BYTES
    assert len(report["frames"]) == _contract.RANK_MAX_EXCEPTION_FRAMES
    assert all(
        len(f.encode()) <= _contract.RANK_MAX_EXCEPTION_FRAME_BYTES for f in report["frames"]
    )
    assert exc_type is RuntimeError and tb is not None


def test_outside_a_rank_nothing_is_installed(tmp_path: Path) -> None:
    assert not _failure.install_from_env({})
    # A rank whose agent is gone: the report fails quietly before the usual traceback,
    # and the process still ends as Python's own hook ends it.
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            from cumulus import runtime
            raise KeyError("missing")
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        env={
            "PATH": "/usr/bin:/bin",
            _contract.RANK_ENV_AGENT_URL: "http://127.0.0.1:9",
            _contract.RANK_ENV_AGENT_TOKEN: "t",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("cumulus: could not report the exception to the agent"), lines
    assert lines[-1] == "KeyError: 'missing'", lines
