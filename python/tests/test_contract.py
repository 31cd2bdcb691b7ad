"""The Python package against the contract between processes.

The contract's values (wire spellings, environment variables, limits, JSON shapes) come
from the Rust crate ``cumulus-api``, which generates ``cumulus._contract`` and
``api/contract.json`` (``cargo run -p cumulus-api --bin cumulus-contract``; ``cargo test
-p cumulus-api`` fails while either is stale). These tests check that the package uses
the generated values (and nothing copied beside them), that its documentation names them,
and that the generated module agrees with ``api/contract.json``.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from cumulus import _config, _contract
from cumulus import client as client_module
from cumulus import runtime as runtime_module
from cumulus.client import Client
from cumulus.errors import InvalidSpec
from cumulus.models import FINISHED_STATES, JOB_STATES, STOP_ACTIONS, JobInfo, RankInfo
from cumulus.runtime import _checkpoint, _env

PACKAGE = Path(_contract.__file__).resolve().parent
CONTRACT_JSON = PACKAGE.parents[2] / "api" / "contract.json"


# --- Helpers ------------------------------------------------------------------------------


def _documented_spellings(cls: type, field_name: str) -> list[str]:
    """The ````name```` spellings in the ``#:`` comment just above ``field_name: ...`` in
    the source of ``cls`` (how ``cumulus.models`` documents a string field's values)."""
    lines = inspect.getsource(cls).splitlines()
    at = next((i for i, line in enumerate(lines) if re.match(rf"\s+{field_name}\s*:", line)), None)
    assert at is not None, f"{cls.__name__} has no field {field_name!r}"
    comment: list[str] = []
    for line in reversed(lines[:at]):
        stripped = line.strip()
        if not stripped.startswith("#:"):
            break
        comment.insert(0, stripped[2:])
    return re.findall(r"``([a-z0-9_]+)``", " ".join(comment))


def _param_doc(func: Callable[..., object], param: str) -> str:
    """The text of ``:param <param>:`` in ``func``'s docstring, continuation lines joined."""
    doc = inspect.getdoc(func) or ""
    m = re.search(rf":param {param}:(.*?)(?=\n:|\Z)", doc, re.S)
    assert m is not None, f"{func.__qualname__} does not document {param!r}"
    return " ".join(m.group(1).split())


def _env_names_read_by_the_runtime() -> set[str]:
    """Every variable name ``cumulus.runtime._env`` reads: the second argument of its
    ``_get(env, name)`` / ``_int(env, name, ...)``, a name of that module (a contract
    constant) or a string literal."""
    tree = ast.parse(inspect.getsource(_env))
    names: set[str] = set()
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"_get", "_int"}
            and len(node.args) >= 2
        ):
            continue
        arg = node.args[1]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            names.add(arg.value)
        elif isinstance(arg, ast.Name) and isinstance(getattr(_env, arg.id, None), str):
            names.add(getattr(_env, arg.id))
    assert names, "found no environment reads in cumulus.runtime._env"
    return names


def _string_literals(path: Path) -> set[str]:
    """Every string constant in a Python source file, docstrings left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    }


# --- The generated module -----------------------------------------------------------------


def test_the_generated_module_says_so_and_exports_everything() -> None:
    doc = _contract.__doc__ or ""
    assert "do not edit" in doc
    assert "cargo run -p cumulus-api --bin cumulus-contract" in doc
    public = {
        name
        for name, value in vars(_contract).items()
        if not name.startswith("_")
        and not inspect.ismodule(value)
        and getattr(value, "__module__", _contract.__name__) == _contract.__name__
    }
    assert set(_contract.__all__) == public


@pytest.fixture(scope="module")
def contract_json() -> dict[str, Any]:
    if not CONTRACT_JSON.is_file():
        pytest.skip(f"{CONTRACT_JSON} is only in a checkout of the repository")
    parsed: dict[str, Any] = json.loads(CONTRACT_JSON.read_text(encoding="utf-8"))
    return parsed


def test_the_generated_module_holds_what_contract_json_lists(
    contract_json: dict[str, Any],
) -> None:
    for name, entry in contract_json["constants"].items():
        value = getattr(_contract, name)
        expected = tuple(entry["value"]) if isinstance(entry["value"], list) else entry["value"]
        assert value == expected, name
    for name, entry in contract_json["enums"].items():
        cls = getattr(_contract, name)
        assert [m.value for m in cls] == entry["values"], name
    terminal = contract_json["enums"]["JobState"]["terminal_job_states"]
    assert set(terminal) == _contract.TERMINAL_JOB_STATES
    assert contract_json["enums"]["RestartScope"]["default"] == _contract.DEFAULT_RESTART_SCOPE
    assert contract_json["enums"]["CommitTier"]["default"] == _contract.DEFAULT_COMMIT_TIER
    for name, fields in contract_json["shapes"].items():
        cls = getattr(_contract, name)
        assert set(typing.get_type_hints(cls)) == {f["name"] for f in fields}, name
        assert cls.__required_keys__ == {f["name"] for f in fields if f["required"]}, name


def test_no_contract_string_is_copied_outside_the_generated_module() -> None:
    names = {
        *_contract.RANK_CONTRACT_VARS,
        *_contract.RANK_GPU_VARS,
        *_contract.CLIENT_ENV_VARS,
        _contract.LEADER_HTTP_HEADER,
        _contract.MANIFEST_FILE,
        _contract.LATEST_FILE,
        _contract.CLUSTER_FILE,
        _contract.DEFAULT_LOCAL_DIR,
        _contract.CA_FILE,
        _contract.IDENTITY_SCHEME,
    }
    copies = {
        str(path.relative_to(PACKAGE)): sorted(_string_literals(path) & names)
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_contract.py"
    }
    assert {k: v for k, v in copies.items() if v} == {}


# --- States -------------------------------------------------------------------------------


def test_python_finished_states_are_the_terminal_job_states() -> None:
    assert {"succeeded", "failed", "cancelled", "timed_out"} == FINISHED_STATES
    assert _contract.TERMINAL_JOB_STATES == FINISHED_STATES
    assert "paused" not in FINISHED_STATES


def test_python_job_state_list_is_the_contract_one_in_order() -> None:
    assert tuple(s.value for s in _contract.JobState) == JOB_STATES == _contract.JOB_STATES


def test_python_stop_actions_are_the_contract_ones() -> None:
    actions = set(_contract.STOP_ACTIONS)
    # What a rank is asked (GET /v1/control, progress replies)...
    assert actions == runtime_module.STOP_ACTIONS
    assert runtime_module.PAUSE_ACTIONS == {"pause", "preempt"} <= actions
    # ...and what a job shows while its ranks are asked to checkpoint and stop.
    assert actions - {"stop"} == STOP_ACTIONS


def test_python_job_states_are_documented_and_classified() -> None:
    spellings = list(_contract.JOB_STATES)
    assert _documented_spellings(JobInfo, "state") == spellings
    for state in spellings:
        job = JobInfo.from_json({"id": "job-000001", "state": state})
        assert job.finished == (state in _contract.TERMINAL_JOB_STATES), state
        assert job.succeeded == (state == _contract.JobState.SUCCEEDED), state
        assert job.paused == (state == _contract.JobState.PAUSED), state
        assert job.timed_out == (state == _contract.JobState.TIMED_OUT), state


def test_python_rank_states_are_the_rank_phases() -> None:
    # The APIs show a RankPhase (RankStatus.state); RankState is the stored form.
    phases = list(_contract.RANK_PHASES)
    assert _documented_spellings(RankInfo, "state") == phases
    for phase in phases:
        assert RankInfo.from_json({"rank": 0, "state": phase}).state == phase
    assert "unplaced" in _contract.RANK_STATES
    assert "unplaced" not in phases, "the APIs never show a stored-only state"


@pytest.mark.parametrize(
    ("param", "spellings", "default"),
    [
        ("restart_scope", _contract.RESTART_SCOPES, _contract.DEFAULT_RESTART_SCOPE),
        ("ckpt_commit_tier", _contract.COMMIT_TIERS, _contract.DEFAULT_COMMIT_TIER),
    ],
)
def test_client_submit_documents_the_spellings_and_default(
    param: str, spellings: tuple[str, ...], default: str
) -> None:
    doc = _param_doc(Client.submit, param)
    documented = re.findall(r'``"([a-z0-9_]+)"``', doc)
    assert sorted(documented) == sorted(spellings), doc
    assert f'``"{default}"`` (default' in doc, f"{param}: the default is {default!r}: {doc}"


# --- Rank environment ---------------------------------------------------------------------


def test_python_contract_vars_are_the_contract_ones_in_order() -> None:
    contract_vars = _contract.RANK_CONTRACT_VARS
    assert len(set(contract_vars)) == len(contract_vars)
    assert contract_vars == _env.CONTRACT_VARS == runtime_module.CONTRACT_VARS


def test_every_variable_the_runtime_reads_is_in_the_contract() -> None:
    read = _env_names_read_by_the_runtime()
    # TORCHELASTIC_RESTART_COUNT: torchrun's, read only by a standalone (non-Cumulus) run.
    assert read - set(_contract.RANK_CONTRACT_VARS) == {"TORCHELASTIC_RESTART_COUNT"}
    assert set(_env.REQUIRED_VARS) <= set(_contract.RANK_CONTRACT_VARS)
    assert set(_env._AGENT_ONLY_VARS) <= set(_contract.RANK_CONTRACT_VARS)


def test_the_runtime_reads_every_variable_of_the_contract() -> None:
    assert set(_contract.RANK_CONTRACT_VARS) - _env_names_read_by_the_runtime() == set()


def test_python_required_vars_are_what_the_agent_always_sets() -> None:
    # The agent (worker/src/supervisor.rs) sets every contract variable for every rank
    # except these: CKPT_STAGING only for a job with a checkpoint target, RESUME_* only for
    # a resuming attempt, GPU_MEMORY_FRACTION only for a job with a GPU memory fraction,
    # AGENT_SOCKET only on an agent whose ranks run as another user (--run-as), DATA_PLAN
    # only for an elastic job (a world size MIN:MAX).
    # OUTPUT_DIR is set for every rank, but the runtime does not require it: only a
    # remote function's result needs it (cumulus._run_rank), and without it that says so.
    # JOB_ID is always set; the runtime checks it on its own, first (without it the
    # process is not a Cumulus rank at all).
    per_job = {
        _contract.RANK_ENV_CKPT_STAGING,
        _contract.RANK_ENV_RESUME_DIR,
        _contract.RANK_ENV_RESUME_STEP,
        _contract.RANK_ENV_GPU_MEMORY_FRACTION,
        _contract.RANK_ENV_AGENT_SOCKET,
        _contract.RANK_ENV_OUTPUT_DIR,
        _contract.RANK_ENV_DATA_PLAN,
    }
    expected = tuple(
        v
        for v in _contract.RANK_CONTRACT_VARS
        if v not in per_job and v != _contract.RANK_ENV_JOB_ID
    )
    assert expected == _env.REQUIRED_VARS


def test_the_shards_file_limits_are_the_contract_ones(tmp_path: Path) -> None:
    assert _env.MAX_SHARDS_FILE_BYTES == _contract.MAX_SHARDS_FILE_BYTES == 64 << 20
    assert _env.MAX_SHARDS == _contract.MAX_SHARDS
    too_many = tmp_path / "shards"
    too_many.write_text("a\n" * (_contract.MAX_SHARDS + 1))
    with pytest.raises(Exception, match=f"at most {_contract.MAX_SHARDS}"):
        _env.read_shards_file(too_many)


# --- Limits and names ---------------------------------------------------------------------

#: (Python module, public Python name, ``_contract`` name) of every limit the package
#: exposes under a name of its own.
PUBLIC_LIMITS = [
    (client_module, "MAX_REQUEST_ID_BYTES", "MAX_REQUEST_ID_BYTES"),
    (client_module, "MAX_ENV", "MAX_ENV_ENTRIES"),
    # One limit in Rust: most GPUs a worker registers and a rank asks for.
    (client_module, "MAX_GPUS_PER_RANK", "MAX_GPUS_PER_WORKER"),
    (client_module, "MAX_SUMMARIES", "MAX_SUMMARIES"),
    (client_module, "WHOLE_GPU_PERMILLE", "WHOLE_GPU_PERMILLE"),
    (client_module, "LEADER_HTTP_HEADER", "LEADER_HTTP_HEADER"),
    (runtime_module, "MAX_METRICS", "MAX_METRICS"),
    (runtime_module, "MAX_METRIC_NAME_BYTES", "MAX_METRIC_NAME_BYTES"),
    (runtime_module, "MAX_STATE_BYTES", "MAX_STATE_JSON_BYTES"),
    (_env, "MAX_SHARDS", "MAX_SHARDS"),
    (_config, "CLUSTER_FILE", "CLUSTER_FILE"),
    (_config, "DEFAULT_LOCAL_DIR", "DEFAULT_LOCAL_DIR"),
    (_config, "MAX_TOKEN_BYTES", "MAX_TOKEN_BYTES"),
    (_config, "CA_FILE", "CA_FILE"),
    (_config, "MAX_PEM_FILE_BYTES", "MAX_PEM_FILE_BYTES"),
]


@pytest.mark.parametrize(
    ("module", "py_name", "contract_name"),
    PUBLIC_LIMITS,
    ids=[f"{m.__name__}.{p}" for m, p, _ in PUBLIC_LIMITS],
)
def test_python_name_is_the_contract_value(
    module: object, py_name: str, contract_name: str
) -> None:
    assert getattr(module, py_name) == getattr(_contract, contract_name)


def test_client_submit_documents_the_request_id_limit() -> None:
    doc = _param_doc(Client.submit, "request_id")
    assert f"(1..={_contract.MAX_REQUEST_ID_BYTES} bytes)" in doc, doc


def test_client_bounds_are_the_contract_ones() -> None:
    assert client_module.MAX_TIME_LIMIT_S * 1000 == _contract.MAX_TIME_LIMIT_MS
    assert f"1..={_contract.MAX_SUMMARIES}" in _param_doc(Client.summaries, "limit")
    bound = _contract.MAX_PRIORITY
    assert f"-{bound}..={bound}" in _param_doc(Client.submit, "priority")
    grace_s = _contract.MAX_STOP_GRACE_MS // 1000
    assert f"(0..={grace_s};" in _param_doc(Client.submit, "stop_grace_s")
    sent: list[dict[str, Any]] = []

    def coordinator(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content)["spec"])
        return httpx.Response(400, json={"error": "refused by the coordinator"})

    with Client(
        ["127.0.0.1:1"],
        token="0123456789abcdef0123",
        insecure=True,
        transport=httpx.MockTransport(coordinator),
    ) as client:
        # The bounds themselves are sent...
        for ok in (-bound, bound):
            with pytest.raises(InvalidSpec, match="refused by the coordinator"):
                client.submit(["true"], priority=ok, stop_grace_s=grace_s)
        assert [(s["priority"], s["stop_grace_ms"]) for s in sent] == [
            (-bound, _contract.MAX_STOP_GRACE_MS),
            (bound, _contract.MAX_STOP_GRACE_MS),
        ]
        # ...one past them is refused here, before anything is sent.
        for bad in (-bound - 1, bound + 1):
            with pytest.raises(InvalidSpec, match=rf"priority must be an integer in -{bound}"):
                client.submit(["true"], priority=bad)
        with pytest.raises(InvalidSpec, match=rf"0\.\.={grace_s}, got {grace_s + 1}"):
            client.submit(["true"], stop_grace_s=grace_s + 1)


def test_client_retry_defaults_are_the_contract_ones() -> None:
    params = inspect.signature(Client).parameters
    assert params["retry_max_tries"].default == _contract.RETRY_MAX_TRIES
    assert params["retry_total_s"].default * 1000 == _contract.RETRY_TOTAL_MS
    assert params["timeout_s"].default * 1000 == _contract.REQUEST_TIMEOUT_MS
    assert params["connect_timeout_s"].default * 1000 == _contract.CONNECT_TIMEOUT_MS
    backoff = Client._backoff_s
    assert backoff(None, 1) * 1000 == _contract.RETRY_BACKOFF_INITIAL_MS  # type: ignore[arg-type]
    assert backoff(None, 2) * 1000 == 2 * _contract.RETRY_BACKOFF_INITIAL_MS  # type: ignore[arg-type]
    assert backoff(None, 60) * 1000 == _contract.RETRY_BACKOFF_MAX_MS  # type: ignore[arg-type]


def test_the_client_resolves_the_contract_environment(tmp_path: Path) -> None:
    env = {
        _contract.CLIENT_ENV_HTTP: "127.0.0.1:1,127.0.0.1:2",
        _contract.CLIENT_ENV_TOKEN: "0123456789abcdef0123",
        _contract.CLIENT_ENV_INSECURE: "1",
        _contract.CLIENT_ENV_LOCAL_DIR: str(tmp_path),
    }
    conn = _config.resolve(environ=env)
    assert conn.addresses == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert conn.token == env[_contract.CLIENT_ENV_TOKEN]
    assert not conn.tls


def test_the_client_reads_the_contract_cluster_file(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123\n")
    coordinator: _contract.ClusterFileCoordinator = {
        "node_id": 1,
        "grpc": "127.0.0.1:7001",
        "http": "127.0.0.1:8001",
        "pid": None,
        "data_dir": str(tmp_path / "c1"),
        "log": str(tmp_path / "c1.log"),
    }
    cluster: _contract.ClusterFileJson = {
        "token_file": str(token),
        "coordinators": [coordinator],
        "workers": [],
    }
    (tmp_path / _contract.CLUSTER_FILE).write_text(json.dumps(cluster))
    conn = _config.resolve(environ={_contract.CLIENT_ENV_LOCAL_DIR: str(tmp_path)})
    assert conn.addresses == ("http://127.0.0.1:8001",)
    assert conn.token == "0123456789abcdef0123"


def test_a_resume_reads_the_contract_manifest(tmp_path: Path) -> None:
    part = tmp_path / "step-00000007" / "rank-1" / "attempt-0"
    part.mkdir(parents=True)
    manifest: _contract.Manifest = {
        "format_version": _contract.MANIFEST_FORMAT_VERSION,
        "job_id": "job-000001",
        "step": 7,
        "world_size": 2,
        "committed_at_ms": 1,
        "parts": [
            {
                "rank": r,
                "attempt": 0,
                "dir": f"step-00000007/rank-{r}/attempt-0",
                "files": [],
                "state": {"rank": r},
            }
            for r in range(2)
        ],
    }
    (tmp_path / "step-00000007" / _contract.MANIFEST_FILE).write_text(json.dumps(manifest))
    assert _checkpoint._read_manifest_state(part, 1) == {"rank": 1}
    assert _checkpoint._read_manifest_state(part, 5) is None
