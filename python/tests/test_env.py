"""The rank environment: parsing the worker agent's contract into a Context."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cumulus.errors import NotInCumulusRank, RankEnvironmentError
from cumulus.runtime import context_from_env, read_shards_file


@pytest.fixture
def shards_file(tmp_path: Path) -> Path:
    p = tmp_path / "rank-1.attempt-3.shards"
    p.write_text("/data/a.csv\n\n/data/b dir/c.csv.gz\n")
    return p


@pytest.fixture
def full_env(shards_file: Path) -> dict[str, str]:
    return {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.1.2.3",
        "MASTER_PORT": "29597",
        "CUMULUS_JOB_ID": "job-000007",
        "CUMULUS_ATTEMPT": "3",
        "CUMULUS_SHARDS_FILE": str(shards_file),
        "CUMULUS_AGENT_URL": "http://127.0.0.1:41234/",
        "CUMULUS_AGENT_TOKEN": "s3cret",
        "CUMULUS_CKPT_STAGING": "/ck/job-000007/.staging/rank-1.attempt-3",
        "CUMULUS_RESUME_DIR": "/ck/job-000007/step-00000100/rank-1/attempt-2",
        "CUMULUS_RESUME_STEP": "100",
        "PATH": "/usr/bin",
    }


def test_full_contract_is_parsed(full_env: dict[str, str]) -> None:
    ctx = context_from_env(full_env)
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (1, 4, 1, 2)
    assert (ctx.master_addr, ctx.master_port) == ("10.1.2.3", 29597)
    assert (ctx.job_id, ctx.attempt) == ("job-000007", 3)
    assert ctx.shard_paths == (Path("/data/a.csv"), Path("/data/b dir/c.csv.gz"))
    assert ctx.staging_dir == Path("/ck/job-000007/.staging/rank-1.attempt-3")
    assert ctx.resume_step == 100
    assert ctx.resume_dir == Path("/ck/job-000007/step-00000100/rank-1/attempt-2")
    assert ctx.agent_url == "http://127.0.0.1:41234"
    assert ctx.agent_token == "s3cret"
    assert ctx.agent_socket is None  # an agent whose ranks run as itself: TCP
    assert ctx.is_resuming and ctx.checkpoints_enabled and not ctx.standalone


def test_context_is_frozen_and_hides_the_token(full_env: dict[str, str]) -> None:
    ctx = context_from_env(full_env)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.rank = 0  # type: ignore[misc]
    assert "s3cret" not in repr(ctx)


def test_optional_variables(full_env: dict[str, str]) -> None:
    for name in ("CUMULUS_CKPT_STAGING", "CUMULUS_RESUME_DIR", "CUMULUS_RESUME_STEP"):
        del full_env[name]
    ctx = context_from_env(full_env)
    assert ctx.staging_dir is None and ctx.resume_step is None and ctx.resume_dir is None
    assert not ctx.checkpoints_enabled and not ctx.is_resuming


@pytest.mark.parametrize(
    "path",
    [
        "/run/cumulus/agent.sock",
        "/" + "a" * 106,  # 107 bytes: the longest a socket address holds
        "/tmp/d\u00e9j\u00e0/agent.sock",
    ],
)
def test_the_agent_socket(full_env: dict[str, str], path: str) -> None:
    full_env["CUMULUS_AGENT_SOCKET"] = path
    ctx = context_from_env(full_env)
    assert ctx.agent_socket == path
    assert ctx.agent_url == "http://127.0.0.1:41234"  # still read: its path applies


def test_an_empty_agent_socket_counts_as_unset(full_env: dict[str, str]) -> None:
    full_env["CUMULUS_AGENT_SOCKET"] = ""
    assert context_from_env(full_env).agent_socket is None


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("agent.sock", "not an absolute path"),
        ("run/cumulus/agent.sock", "not an absolute path"),
        ("./agent.sock", "not an absolute path"),
        ("/" + "a" * 107, "108 bytes long"),
        ("/" + "\u00e9" * 54, "109 bytes long"),  # 55 characters, but 109 bytes
        ("/run/agent\0.sock", "NUL"),
    ],
)
def test_a_bad_agent_socket_is_named(full_env: dict[str, str], path: str, problem: str) -> None:
    full_env["CUMULUS_AGENT_SOCKET"] = path
    with pytest.raises(RankEnvironmentError, match="CUMULUS_AGENT_SOCKET") as e:
        context_from_env(full_env)
    assert e.value.name == "CUMULUS_AGENT_SOCKET"
    assert problem in str(e.value)
    assert not e.value.is_resume


def test_outside_a_rank_is_a_clear_error() -> None:
    with pytest.raises(NotInCumulusRank, match="standalone=True"):
        context_from_env({"PATH": "/usr/bin"})


def test_standalone_defaults_and_torchrun_variables(tmp_path: Path) -> None:
    ctx = context_from_env({}, standalone=True)
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (0, 1, 0, 1)
    assert (ctx.master_addr, ctx.master_port) == ("127.0.0.1", 29500)
    assert ctx.standalone and ctx.job_id is None and ctx.shard_paths == ()
    assert ctx.staging_dir is None and ctx.resume_step is None and ctx.agent_url is None

    shards = tmp_path / "shards"
    shards.write_text("/x\n")
    torchrun = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "1234",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "CUMULUS_SHARDS_FILE": str(shards),
    }
    ctx = context_from_env(torchrun, standalone=True)
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (3, 4, 1, 2)
    assert (ctx.master_addr, ctx.master_port, ctx.attempt) == ("node0", 1234, 2)
    assert ctx.shard_paths == (Path("/x"),)


def test_standalone_changes_nothing_inside_a_rank(full_env: dict[str, str]) -> None:
    assert context_from_env(full_env, standalone=True) == context_from_env(full_env)


@pytest.mark.parametrize(
    "name",
    [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_PORT",
        "CUMULUS_ATTEMPT",
        "CUMULUS_SHARDS_FILE",
        "CUMULUS_AGENT_URL",
        "CUMULUS_AGENT_TOKEN",
    ],
)
def test_a_missing_variable_is_named(full_env: dict[str, str], name: str) -> None:
    full_env[name] = ""  # empty counts as unset
    with pytest.raises(RankEnvironmentError, match=name) as e:
        context_from_env(full_env)
    assert e.value.name == name


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("RANK", "x"),
        ("RANK", "-1"),
        ("RANK", "4"),  # not below WORLD_SIZE
        ("WORLD_SIZE", "0"),
        ("LOCAL_RANK", "2"),  # not below LOCAL_WORLD_SIZE
        ("LOCAL_WORLD_SIZE", "8"),  # above WORLD_SIZE
        ("MASTER_PORT", "70000"),
        ("MASTER_PORT", "0"),
        ("CUMULUS_ATTEMPT", "1.5"),
        ("CUMULUS_ATTEMPT", "\u0661"),  # ARABIC-INDIC DIGIT ONE: not plain decimal
        ("CUMULUS_AGENT_URL", "ftp://127.0.0.1:1"),
    ],
)
def test_invalid_values_are_named(full_env: dict[str, str], name: str, value: str) -> None:
    full_env[name] = value
    with pytest.raises(RankEnvironmentError) as e:
        context_from_env(full_env)
    assert e.value.name is not None and e.value.name in str(e.value)
    assert not e.value.is_resume


@pytest.mark.parametrize(
    ("value", "expected"),
    [("0.5", 0.5), ("1", 1.0), ("0.125", 0.125), ("0.001", 0.001), ("", None), (None, None)],
)
def test_gpu_memory_fraction(
    full_env: dict[str, str], value: str | None, expected: float | None
) -> None:
    if value is not None:
        full_env["CUMULUS_GPU_MEMORY_FRACTION"] = value
    assert context_from_env(full_env).gpu_memory_fraction == expected


@pytest.mark.parametrize(
    "value", ["0", "0.0", "-0.1", "1.5", "1.0001", "nan", "inf", "1e-1", "0_5", "abc"]
)
def test_invalid_gpu_memory_fractions_are_named(full_env: dict[str, str], value: str) -> None:
    full_env["CUMULUS_GPU_MEMORY_FRACTION"] = value
    with pytest.raises(RankEnvironmentError, match="CUMULUS_GPU_MEMORY_FRACTION") as e:
        context_from_env(full_env)
    assert e.value.name == "CUMULUS_GPU_MEMORY_FRACTION"
    assert repr(value) in str(e.value)


def test_standalone_reads_the_gpu_memory_fraction_too() -> None:
    assert context_from_env({}, standalone=True).gpu_memory_fraction is None
    env = {"CUMULUS_GPU_MEMORY_FRACTION": "0.25"}
    assert context_from_env(env, standalone=True).gpu_memory_fraction == 0.25
    with pytest.raises(RankEnvironmentError, match="CUMULUS_GPU_MEMORY_FRACTION"):
        context_from_env({"CUMULUS_GPU_MEMORY_FRACTION": "2"}, standalone=True)


@pytest.mark.parametrize(
    ("drop", "step"),
    [("CUMULUS_RESUME_DIR", "100"), ("CUMULUS_RESUME_STEP", "100"), (None, "-1"), (None, "x")],
)
def test_resume_problems_say_so(full_env: dict[str, str], drop: str | None, step: str) -> None:
    full_env["CUMULUS_RESUME_STEP"] = step
    if drop:
        del full_env[drop]
    with pytest.raises(RankEnvironmentError) as e:
        context_from_env(full_env)
    assert e.value.is_resume, e.value


def test_resume_without_a_checkpoint_target_is_refused(full_env: dict[str, str]) -> None:
    del full_env["CUMULUS_CKPT_STAGING"]
    with pytest.raises(RankEnvironmentError, match="CUMULUS_CKPT_STAGING"):
        context_from_env(full_env)


@pytest.mark.parametrize(
    "stray",
    ["CUMULUS_AGENT_URL", "CUMULUS_AGENT_SOCKET", "CUMULUS_RESUME_STEP", "CUMULUS_ATTEMPT"],
)
def test_agent_variables_without_a_job_id_are_refused(stray: str) -> None:
    with pytest.raises(RankEnvironmentError, match=stray):
        context_from_env({stray: "1"}, standalone=True)


def test_shards_file(tmp_path: Path) -> None:
    p = tmp_path / "s"
    p.write_text("")
    assert read_shards_file(p) == ()
    p.write_text("a\r\n  \nb\n")
    assert read_shards_file(p) == (Path("a"), Path("b"))
    with pytest.raises(RankEnvironmentError, match="CUMULUS_SHARDS_FILE"):
        read_shards_file(tmp_path / "missing")
