"""The Python package against the contract between processes, as the Rust crate
``cumulus-api`` (``api/src``) defines it: wire spellings, rank environment variables,
shared limits.

The Rust sources are read with small regexes (no Rust toolchain needed); outside the
repository (an installed sdist) the module is skipped.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from cumulus import client as client_module
from cumulus import runtime as runtime_module
from cumulus.client import Client
from cumulus.models import FINISHED_STATES, JOB_STATES, STOP_ACTIONS, JobInfo, RankInfo
from cumulus.runtime import _env

API_SRC = Path(__file__).resolve().parents[2] / "api" / "src"

# --- Reading the Rust ---------------------------------------------------------------------

_STR_CONST = re.compile(r'^\s*pub const (\w+): &str = "((?:[^"\\]|\\.)*)";', re.MULTILINE)
_INT_CONST = re.compile(
    r"^\s*pub const (\w+): (?:u8|u16|u32|u64|u128|usize|i8|i16|i32|i64|i128|isize) = ([^;]+);",
    re.MULTILINE,
)
_STR_LIST_CONST = re.compile(r"^\s*pub const (\w+): &\[&str\] = &\[(.*?)\];", re.MULTILINE | re.S)
_INT_LITERAL = re.compile(r"[0-9][0-9_]*")
_WIRE_ENTRY = re.compile(r'(\w+)\s*=>\s*"((?:[^"\\]|\\.)*)"')


def _strip_comments(text: str) -> str:
    """Rust source without its whole-line comments (doc comments included), so prose that
    looks like code cannot be parsed as code."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("//"))


def _code(path: Path) -> str:
    return _strip_comments(path.read_text(encoding="utf-8"))


def _int_expr(expr: str) -> int:
    """Evaluates an integer literal (``65_536``) or a product of them (``64 * 1024``)."""
    value = 1
    for factor in expr.split("*"):
        factor = factor.strip()
        if not _INT_LITERAL.fullmatch(factor):
            raise ValueError(f"unsupported constant expression {expr.strip()!r}")
        value *= int(factor.replace("_", ""))
    return value


def _str_consts(code: str) -> dict[str, str]:
    """``pub const NAME: &str = "VALUE";`` as ``{NAME: VALUE}``."""
    return dict(_STR_CONST.findall(code))


def _int_consts(code: str) -> dict[str, int]:
    """``pub const NAME: <integer type> = EXPR;`` as ``{NAME: value}``."""
    return {name: _int_expr(expr) for name, expr in _INT_CONST.findall(code)}


def _str_list_const(code: str, name: str) -> tuple[str, ...]:
    """A ``pub const NAME: &[&str] = &[...];`` whose items are string literals or names of
    ``&str`` constants of the same file, resolved, in order."""
    lists = dict(_STR_LIST_CONST.findall(code))
    if name not in lists:
        raise AssertionError(f"no `pub const {name}: &[&str]` in the Rust source")
    consts = _str_consts(code)
    items: list[str] = []
    for raw in lists[name].split(","):
        item = raw.strip()
        if not item:
            continue
        if item.startswith('"') and item.endswith('"'):
            items.append(item[1:-1])
        elif item in consts:
            items.append(consts[item])
        else:
            raise AssertionError(f"{name} names {item!r}, which is no `&str` constant here")
    return tuple(items)


def _wire_table(code: str, ty: str) -> dict[str, str]:
    """The ``Variant => "spelling"`` table of ``wire_enum!(Ty, ...)``, in order."""
    m = re.search(rf"wire_enum!\(\s*{ty}\s*,[^{{]*\{{(.*?)\}}\s*\)\s*;", code, re.S)
    if m is None:
        raise AssertionError(f"no wire_enum!({ty}, ...) table in the Rust source")
    table = dict(_WIRE_ENTRY.findall(m.group(1)))
    assert table, f"the wire_enum!({ty}, ...) table is empty"
    return table


def _braced_body(code: str, start: int) -> str:
    """The text inside the first ``{ ... }`` at or after ``start`` (braces balanced)."""
    open_at = code.index("{", start)
    depth = 0
    for i in range(open_at, len(code)):
        if code[i] == "{":
            depth += 1
        elif code[i] == "}":
            depth -= 1
            if depth == 0:
                return code[open_at + 1 : i]
    raise AssertionError("unbalanced braces in the Rust source")


def _default_variant(code: str, ty: str) -> str:
    """The variant marked ``#[default]`` in ``pub enum Ty``."""
    m = re.search(rf"pub enum {ty}\b", code)
    if m is None:
        raise AssertionError(f"no `pub enum {ty}` in the Rust source")
    d = re.search(r"#\[default\]\s*(\w+)", _braced_body(code, m.end()))
    if d is None:
        raise AssertionError(f"`pub enum {ty}` has no #[default] variant")
    return d.group(1)


def _terminal_job_variants(code: str) -> set[str]:
    """The ``JobState`` variants ``JobState::is_terminal`` matches."""
    m = re.search(r"fn is_terminal\(self\) -> bool", code)
    if m is None:
        raise AssertionError("no `JobState::is_terminal` in the Rust source")
    return set(re.findall(r"JobState::(\w+)", _braced_body(code, m.end())))


@dataclass(frozen=True)
class RustContract:
    """What the Python side mirrors, read from ``api/src``."""

    #: ``wire_enum!`` tables: type name -> {variant: spelling}, in declaration order.
    wire: dict[str, dict[str, str]]
    #: Default variant of the enums with a ``#[default]``.
    defaults: dict[str, str]
    #: Spellings of the job states ``JobState::is_terminal`` accepts.
    terminal_job_states: frozenset[str]
    #: ``rank_env.rs``: constant name -> variable name.
    env_names: dict[str, str]
    #: ``rank_env::CONTRACT_VARS``, in order.
    contract_vars: tuple[str, ...]
    #: ``limits.rs``: constant name -> value.
    limits: dict[str, int]
    #: ``leader.rs``: ``&str`` constants.
    leader: dict[str, str]
    #: ``gpus.rs``: integer constants.
    gpus: dict[str, int]


@pytest.fixture(scope="module")
def rust() -> RustContract:
    if not API_SRC.is_dir():
        pytest.skip(
            f"{API_SRC} is not here: the Rust contract (crate cumulus-api) is only in a "
            "checkout of the repository"
        )
    states = _code(API_SRC / "states.rs")
    rank_env = _code(API_SRC / "rank_env.rs")
    job_states = _wire_table(states, "JobState")
    return RustContract(
        wire={
            ty: _wire_table(states, ty)
            for ty in (
                "JobState",
                "RankState",
                "RankPhase",
                "RestartScope",
                "CommitTier",
                "StopAction",
            )
        },
        defaults={ty: _default_variant(states, ty) for ty in ("RestartScope", "CommitTier")},
        terminal_job_states=frozenset(job_states[v] for v in _terminal_job_variants(states)),
        env_names=_str_consts(rank_env),
        contract_vars=_str_list_const(rank_env, "CONTRACT_VARS"),
        limits=_int_consts(_code(API_SRC / "limits.rs")),
        leader=_str_consts(_code(API_SRC / "leader.rs")),
        gpus=_int_consts(_code(API_SRC / "gpus.rs")),
    )


def test_the_rust_parser_reads_literals_and_products_only() -> None:
    assert _int_expr("128") == 128
    assert _int_expr("3_600_000") == 3_600_000
    assert _int_expr("64 * 1024") == 65_536
    for bad in ("1 << 20", "u32::MAX", "64 + 1", "", "-1"):
        with pytest.raises(ValueError, match="unsupported"):
            _int_expr(bad)
    code = (
        'wire_enum!(Color, "color", "red, blue", {\n'
        '    // Ignored => "comment",\n'
        '    Red => "red",\n'
        '    Blue => "blue",\n'
        "});\n"
    )
    assert _wire_table(_strip_comments(code), "Color") == {"Red": "red", "Blue": "blue"}
    with pytest.raises(AssertionError, match="no wire_enum"):
        _wire_table(code, "Shade")


# --- Python sources -----------------------------------------------------------------------


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
    """Every variable name ``cumulus.runtime._env`` reads: the string literal passed as
    ``name`` to its ``_get(env, name)`` / ``_int(env, name, ...)``."""
    tree = ast.parse(inspect.getsource(_env))
    names: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"_get", "_int"}
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            names.add(node.args[1].value)
    assert names, "found no environment reads in cumulus.runtime._env"
    return names


# --- States -------------------------------------------------------------------------------


def test_python_finished_states_are_the_rust_terminal_job_states(rust: RustContract) -> None:
    assert rust.terminal_job_states == {"succeeded", "failed", "cancelled", "timed_out"}
    assert rust.terminal_job_states == FINISHED_STATES
    assert "paused" not in FINISHED_STATES


def test_python_job_state_list_is_the_rust_one_in_order(rust: RustContract) -> None:
    assert tuple(rust.wire["JobState"].values()) == JOB_STATES


def test_python_stop_actions_are_the_rust_ones(rust: RustContract) -> None:
    actions = set(rust.wire["StopAction"].values())
    # What a rank is asked (GET /v1/control, progress replies)...
    assert actions == runtime_module.STOP_ACTIONS
    assert runtime_module.PAUSE_ACTIONS == {"pause", "preempt"} <= actions
    # ...and what a job shows while its ranks are asked to checkpoint and stop.
    assert actions - {"stop"} == STOP_ACTIONS


def test_python_job_states_match_the_rust_contract(rust: RustContract) -> None:
    spellings = list(rust.wire["JobState"].values())
    assert _documented_spellings(JobInfo, "state") == spellings
    assert set(spellings) >= FINISHED_STATES
    for state in spellings:
        job = JobInfo.from_json({"id": "job-000001", "state": state})
        assert job.finished == (state in rust.terminal_job_states), state
        assert job.succeeded == (state == rust.wire["JobState"]["Succeeded"]), state


def test_python_rank_states_are_the_rust_rank_phases(rust: RustContract) -> None:
    # The APIs show a RankPhase (RankStatus.state); RankState is the stored form.
    phases = list(rust.wire["RankPhase"].values())
    assert _documented_spellings(RankInfo, "state") == phases
    for phase in phases:
        assert RankInfo.from_json({"rank": 0, "state": phase}).state == phase
    assert "unplaced" in rust.wire["RankState"].values()
    assert "unplaced" not in phases, "the APIs never show a stored-only state"


@pytest.mark.parametrize(
    ("param", "rust_type"),
    [("restart_scope", "RestartScope"), ("ckpt_commit_tier", "CommitTier")],
)
def test_client_submit_documents_the_rust_spellings_and_default(
    rust: RustContract, param: str, rust_type: str
) -> None:
    doc = _param_doc(Client.submit, param)
    documented = re.findall(r'``"([a-z0-9_]+)"``', doc)
    table = rust.wire[rust_type]
    assert sorted(documented) == sorted(table.values()), doc
    default = table[rust.defaults[rust_type]]
    assert f'``"{default}"`` (default' in doc, f"{param}: Rust's default is {default!r}: {doc}"


# --- Rank environment ---------------------------------------------------------------------


def test_python_contract_vars_are_the_rust_contract_vars_in_order(rust: RustContract) -> None:
    assert len(set(rust.contract_vars)) == len(rust.contract_vars)
    assert set(rust.contract_vars) <= set(rust.env_names.values())
    assert rust.contract_vars == _env.CONTRACT_VARS
    assert rust.contract_vars == runtime_module.CONTRACT_VARS


def test_every_variable_the_runtime_reads_is_in_the_rust_contract(rust: RustContract) -> None:
    read = _env_names_read_by_the_runtime()
    # TORCHELASTIC_RESTART_COUNT: torchrun's, read only by a standalone (non-Cumulus) run.
    assert read - set(rust.contract_vars) == {"TORCHELASTIC_RESTART_COUNT"}
    assert set(_env.REQUIRED_VARS) <= set(rust.contract_vars)
    assert set(_env._AGENT_ONLY_VARS) <= set(rust.contract_vars)


def test_the_runtime_reads_every_variable_of_the_rust_contract(rust: RustContract) -> None:
    assert set(rust.contract_vars) - _env_names_read_by_the_runtime() == set()


def test_python_required_vars_are_what_the_agent_always_sets(rust: RustContract) -> None:
    # The agent (worker/src/supervisor.rs) sets every contract variable for every rank
    # except these: CKPT_STAGING only for a job with a checkpoint target, RESUME_* only for
    # a resuming attempt, GPU_MEMORY_FRACTION only for a job with a GPU memory fraction,
    # AGENT_SOCKET only on an agent whose ranks run as another user (--run-as).
    # JOB_ID is always set; the runtime checks it on its own, first (without it the
    # process is not a Cumulus rank at all).
    per_job = {
        rust.env_names[n]
        for n in (
            "CKPT_STAGING",
            "RESUME_DIR",
            "RESUME_STEP",
            "GPU_MEMORY_FRACTION",
            "AGENT_SOCKET",
        )
    }
    job_id = rust.env_names["JOB_ID"]
    expected = tuple(v for v in rust.contract_vars if v not in per_job and v != job_id)
    assert expected == _env.REQUIRED_VARS


# --- Limits and names ---------------------------------------------------------------------

#: (Python module, Python name, Rust ``limits.rs`` name) of every mirrored limit.
MIRRORED_LIMITS = [
    (client_module, "MAX_REQUEST_ID_BYTES", "MAX_REQUEST_ID_BYTES"),
    (client_module, "MAX_ENV", "MAX_ENV_ENTRIES"),
    # One limit in Rust: most GPUs a worker registers and a rank asks for.
    (client_module, "MAX_GPUS_PER_RANK", "MAX_GPUS_PER_WORKER"),
    (runtime_module, "MAX_METRICS", "MAX_METRICS"),
    (runtime_module, "MAX_METRIC_NAME_BYTES", "MAX_METRIC_NAME_BYTES"),
    (runtime_module, "MAX_STATE_BYTES", "MAX_STATE_JSON_BYTES"),
    (_env, "MAX_SHARDS", "MAX_SHARDS"),
]


@pytest.mark.parametrize(
    ("module", "py_name", "rust_name"),
    MIRRORED_LIMITS,
    ids=[f"{m.__name__}.{p}" for m, p, _ in MIRRORED_LIMITS],
)
def test_python_limit_equals_the_rust_limit(
    rust: RustContract, module: object, py_name: str, rust_name: str
) -> None:
    assert rust_name in rust.limits, f"limits.rs has no {rust_name}"
    assert getattr(module, py_name) == rust.limits[rust_name]


def test_client_submit_documents_the_rust_request_id_limit(rust: RustContract) -> None:
    doc = _param_doc(Client.submit, "request_id")
    assert f"(1..={rust.limits['MAX_REQUEST_ID_BYTES']} bytes)" in doc, doc


def test_python_time_limit_bound_is_the_rust_one() -> None:
    """``MAX_TIME_LIMIT_MS``, wherever the Rust defines it (the spec validation)."""
    roots = [API_SRC, API_SRC.parents[1] / "raft-store" / "src"]
    if not all(r.is_dir() for r in roots):
        pytest.skip("the Rust sources are only in a checkout of the repository")
    const = re.compile(r"^\s*pub const MAX_TIME_LIMIT_MS: u64 = ([^;]+);", re.MULTILINE)
    found = {
        str(path): _int_expr(m.group(1))
        for root in roots
        for path in sorted(root.rglob("*.rs"))
        if (m := const.search(_code(path))) is not None
    }
    assert found, "no `pub const MAX_TIME_LIMIT_MS` in api/src or raft-store/src"
    assert set(found.values()) == {client_module.MAX_TIME_LIMIT_S * 1000}, found


def test_python_summaries_bound_is_the_coordinator_one() -> None:
    """``MAX_SUMMARIES`` of ``coordinator/src/api.rs``: the most ``Client.summaries`` asks
    for."""
    api_rs = API_SRC.parents[1] / "coordinator" / "src" / "api.rs"
    if not api_rs.is_file():
        pytest.skip("the Rust sources are only in a checkout of the repository")
    m = re.search(r"^\s*pub const MAX_SUMMARIES: usize = ([^;]+);", _code(api_rs), re.MULTILINE)
    assert m is not None, "no `pub const MAX_SUMMARIES` in coordinator/src/api.rs"
    assert _int_expr(m.group(1)) == client_module.MAX_SUMMARIES
    assert f"1..={client_module.MAX_SUMMARIES}" in _param_doc(Client.summaries, "limit")


def test_python_leader_header_is_the_rust_one(rust: RustContract) -> None:
    assert rust.leader["LEADER_HTTP_HEADER"] == client_module.LEADER_HTTP_HEADER


def test_python_gpu_share_steps_are_the_rust_ones(rust: RustContract) -> None:
    # A GPU memory fraction is kept in thousandths of a GPU.
    assert rust.gpus["WHOLE_GPU_PERMILLE"] == client_module.WHOLE_GPU_PERMILLE
