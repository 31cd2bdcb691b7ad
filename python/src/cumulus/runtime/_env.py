"""The rank environment set by the Cumulus worker agent (docs/architecture.md, "Rank
environment"), parsed into a frozen :class:`Context`."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cumulus import _contract
from cumulus._contract import (
    RANK_CONTRACT_VARS,
    RANK_ENV_AGENT_SOCKET,
    RANK_ENV_AGENT_TOKEN,
    RANK_ENV_AGENT_URL,
    RANK_ENV_ATTEMPT,
    RANK_ENV_CKPT_STAGING,
    RANK_ENV_DATA_PLAN,
    RANK_ENV_GPU_MEMORY_FRACTION,
    RANK_ENV_JOB_ID,
    RANK_ENV_LOCAL_RANK,
    RANK_ENV_LOCAL_WORLD_SIZE,
    RANK_ENV_MASTER_ADDR,
    RANK_ENV_MASTER_PORT,
    RANK_ENV_OUTPUT_DIR,
    RANK_ENV_RANK,
    RANK_ENV_RESUME_DIR,
    RANK_ENV_RESUME_STEP,
    RANK_ENV_SHARDS_FILE,
    RANK_ENV_WORLD_SIZE,
)
from cumulus.errors import NotInCumulusRank, RankEnvironmentError

__all__ = [
    "CONTRACT_VARS",
    "DEFAULT_MASTER_ADDR",
    "DEFAULT_MASTER_PORT",
    "MAX_AGENT_SOCKET_BYTES",
    "MAX_SHARDS",
    "MAX_SHARDS_FILE_BYTES",
    "Context",
    "context_from_env",
    "get_context",
    "read_shards_file",
]

#: The variables of the rank contract, as the worker agent sets them. A job's own ``env``
#: entry with one of these names is dropped by the agent, so a job cannot fake them.
CONTRACT_VARS: tuple[str, ...] = RANK_CONTRACT_VARS

#: Variables the agent always sets for a rank (the others depend on the job).
REQUIRED_VARS: tuple[str, ...] = (
    RANK_ENV_RANK,
    RANK_ENV_WORLD_SIZE,
    RANK_ENV_LOCAL_RANK,
    RANK_ENV_LOCAL_WORLD_SIZE,
    RANK_ENV_MASTER_ADDR,
    RANK_ENV_MASTER_PORT,
    RANK_ENV_ATTEMPT,
    RANK_ENV_SHARDS_FILE,
    RANK_ENV_AGENT_URL,
    RANK_ENV_AGENT_TOKEN,
)

#: Variables that only a Cumulus rank has; one of them without ``CUMULUS_JOB_ID`` means a
#: broken environment, not a standalone run.
_AGENT_ONLY_VARS: tuple[str, ...] = (
    RANK_ENV_ATTEMPT,
    RANK_ENV_AGENT_URL,
    RANK_ENV_AGENT_TOKEN,
    RANK_ENV_AGENT_SOCKET,
    RANK_ENV_CKPT_STAGING,
    RANK_ENV_RESUME_DIR,
    RANK_ENV_RESUME_STEP,
)

#: ``MASTER_ADDR`` of a standalone context when the environment has none.
DEFAULT_MASTER_ADDR = "127.0.0.1"
#: ``MASTER_PORT`` of a standalone context when the environment has none (torchrun's).
DEFAULT_MASTER_PORT = 29500
#: Largest shards file read, in bytes (as the Rust example trainer).
MAX_SHARDS_FILE_BYTES = _contract.MAX_SHARDS_FILE_BYTES
#: Most shards one rank may be given (the job-wide limit of Cumulus).
MAX_SHARDS = _contract.MAX_SHARDS
#: Longest ``CUMULUS_AGENT_SOCKET`` path, in bytes: a Unix socket address holds 108 bytes
#: (``sun_path`` on Linux), the path's terminating NUL included.
MAX_AGENT_SOCKET_BYTES = 107


@dataclass(frozen=True)
class Context:
    """Who and where this rank is, read once from the environment.

    Under Cumulus every field comes from the worker agent. In a standalone context
    (``get_context(standalone=True)`` outside Cumulus, e.g. under ``torchrun`` or plain
    ``python``) the torchrun variables are used when set, with defaults rank 0 of world
    size 1; ``job_id``, ``staging_dir`` and the resume fields are ``None`` and
    ``standalone`` is true (``CUMULUS_SHARDS_FILE`` and ``CUMULUS_GPU_MEMORY_FRACTION``
    are still read when set).
    """

    #: ``RANK``: this rank, ``0 <= rank < world_size``.
    rank: int
    #: ``WORLD_SIZE``: number of ranks of the job.
    world_size: int
    #: ``LOCAL_RANK``: this rank's index among the job's ranks on this worker.
    local_rank: int
    #: ``LOCAL_WORLD_SIZE``: the job's ranks on this worker.
    local_world_size: int
    #: ``MASTER_ADDR``: host of rank 0 (for ``torch.distributed`` rendezvous).
    master_addr: str
    #: ``MASTER_PORT``: port for the rendezvous on ``master_addr``.
    master_port: int
    #: ``CUMULUS_JOB_ID``, e.g. ``job-000001`` (``None`` standalone).
    job_id: str | None
    #: ``CUMULUS_ATTEMPT``: this rank's attempt number, 0 for the first run, +1 per restart
    #: (standalone: ``TORCHELASTIC_RESTART_COUNT`` or 0).
    attempt: int
    #: This rank's shard files, in order (``CUMULUS_SHARDS_FILE``, one path a line);
    #: empty when the job has no dataset.
    shard_paths: tuple[Path, ...]
    #: ``CUMULUS_CKPT_STAGING``: where this attempt writes a checkpoint part before it is
    #: committed (``None`` when the job has no checkpoint dir, and standalone).
    staging_dir: Path | None
    #: ``CUMULUS_RESUME_STEP``: the committed step this attempt resumes from, or ``None``.
    resume_step: int | None
    #: ``CUMULUS_RESUME_DIR``: this rank's committed part of ``resume_step``, or ``None``.
    resume_dir: Path | None
    #: ``CUMULUS_AGENT_URL``: the worker agent's rank-local API, e.g.
    #: ``http://127.0.0.1:41234`` (``None`` standalone).
    agent_url: str | None = None
    #: ``CUMULUS_AGENT_TOKEN``: this attempt's secret for the rank-local API (never shown
    #: in ``repr``).
    agent_token: str | None = field(default=None, repr=False)
    #: True when not run by Cumulus.
    standalone: bool = False
    #: ``CUMULUS_GPU_MEMORY_FRACTION``: this rank's share of its GPU's memory, ``0 < f <=
    #: 1``, set only for a job submitted with ``--gpu-memory-fraction`` (``None``
    #: otherwise). Cooperative: :func:`cumulus.runtime.apply_gpu_memory_fraction` passes it
    #: to ``torch.cuda.set_per_process_memory_fraction``; nothing else enforces it.
    gpu_memory_fraction: float | None = None
    #: ``CUMULUS_AGENT_SOCKET``: the Unix domain socket (an absolute path) on which the
    #: worker agent serves the rank-local API, set when ranks run as another user than the
    #: agent (``cumulus-worker --run-as``). Every request then goes through it (the path of
    #: ``agent_url`` still applies, its host and port do not); ``None`` when the agent is
    #: reached over TCP at ``agent_url`` (and standalone).
    agent_socket: str | None = None
    #: ``CUMULUS_OUTPUT_DIR``: a directory of this attempt, empty at its start, whose
    #: contents the agent uploads as the attempt's artifacts when it ends (also when it
    #: fails): ``cumulusctl artifacts``, :meth:`cumulus.Job.artifacts`. ``None`` when
    #: not set (an agent older than artifacts; standalone unless set by hand).
    output_dir: Path | None = None
    #: ``CUMULUS_DATA_PLAN``: an elastic job's data plan for this rank (a JSON file,
    #: :func:`cumulus.runtime.data_plan`); ``None`` for a job with a fixed world size.
    data_plan_path: Path | None = None

    @property
    def is_resuming(self) -> bool:
        """Whether this attempt resumes from a committed checkpoint."""
        return self.resume_step is not None

    @property
    def checkpoints_enabled(self) -> bool:
        """Whether this rank can commit checkpoints (a Cumulus rank of a job with a
        checkpoint dir)."""
        return self.staging_dir is not None and self.agent_url is not None


def _cut(value: str) -> str:
    return value if len(value) <= 200 else value[:200] + "..."


def _get(env: Mapping[str, str], name: str) -> str | None:
    """The value of ``name``; an empty value counts as unset (as the Rust trainer)."""
    value = env.get(name)
    return value if value else None


def _int(
    env: Mapping[str, str],
    name: str,
    *,
    default: int | None = None,
    minimum: int = 0,
    maximum: int | None = None,
    what: str = "a non-negative integer",
) -> int:
    raw = _get(env, name)
    if raw is None:
        if default is None:
            raise RankEnvironmentError(f"environment variable {name} is not set", name)
        return default
    text = raw.strip()
    # int() accepts "1_000", "+3" and non-ASCII digits; the contract is plain decimal.
    if not text.isascii() or not text.isdigit():
        raise RankEnvironmentError(
            f"environment variable {name}={_cut(raw)!r} is invalid: expected {what}", name
        )
    value = int(text)
    if value < minimum or (maximum is not None and value > maximum):
        raise RankEnvironmentError(
            f"environment variable {name}={_cut(raw)!r} is invalid: expected {what}", name
        )
    return value


_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)", re.ASCII)


def _gpu_memory_fraction(env: Mapping[str, str]) -> float | None:
    """``CUMULUS_GPU_MEMORY_FRACTION`` as a float ``0 < f <= 1``, ``None`` when unset."""
    raw = _get(env, RANK_ENV_GPU_MEMORY_FRACTION)
    if raw is None:
        return None
    text = raw.strip()
    # float() also takes "nan", "inf", "1e-3" and "0_5"; the agent writes plain decimals.
    value = float(text) if _DECIMAL.fullmatch(text) else math.nan
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise RankEnvironmentError(
            f"environment variable {RANK_ENV_GPU_MEMORY_FRACTION}={_cut(raw)!r} is invalid: "
            "expected a decimal fraction 0 < f <= 1 (e.g. 0.5)",
            RANK_ENV_GPU_MEMORY_FRACTION,
        )
    return value


def read_shards_file(path: Path) -> tuple[Path, ...]:
    """Reads a shards file: one shard path a line, in order; blank lines are skipped.

    An empty file is an empty tuple (a job without a dataset).

    :raises RankEnvironmentError: the file cannot be read, is larger than
        :data:`MAX_SHARDS_FILE_BYTES` or lists more than :data:`MAX_SHARDS` shards.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SHARDS_FILE_BYTES + 1)
    except OSError as e:
        raise RankEnvironmentError(
            f"cannot read the shards file {path} ({RANK_ENV_SHARDS_FILE}): {e}",
            RANK_ENV_SHARDS_FILE,
        ) from e
    if len(data) > MAX_SHARDS_FILE_BYTES:
        raise RankEnvironmentError(
            f"shards file {path} is larger than {MAX_SHARDS_FILE_BYTES} bytes",
            RANK_ENV_SHARDS_FILE,
        )
    text = data.decode("utf-8", errors="surrogateescape")
    shards = tuple(Path(line.rstrip("\r")) for line in text.split("\n") if line.strip())
    if len(shards) > MAX_SHARDS:
        raise RankEnvironmentError(
            f"shards file {path} lists {len(shards)} shards, at most {MAX_SHARDS}",
            RANK_ENV_SHARDS_FILE,
        )
    return shards


def _resume(env: Mapping[str, str]) -> tuple[int | None, Path | None]:
    dir_raw = _get(env, RANK_ENV_RESUME_DIR)
    step_raw = _get(env, RANK_ENV_RESUME_STEP)
    if dir_raw is None and step_raw is None:
        return None, None
    if dir_raw is None:
        raise RankEnvironmentError(
            f"{RANK_ENV_RESUME_STEP} is set but {RANK_ENV_RESUME_DIR} is not", RANK_ENV_RESUME_DIR
        )
    if step_raw is None:
        raise RankEnvironmentError(
            f"{RANK_ENV_RESUME_DIR} is set but {RANK_ENV_RESUME_STEP} is not", RANK_ENV_RESUME_STEP
        )
    step = _int(
        env,
        RANK_ENV_RESUME_STEP,
        what="a non-negative integer (the checkpoint step)",
    )
    return step, Path(dir_raw)


def _agent_url(env: Mapping[str, str]) -> str:
    url = _get(env, RANK_ENV_AGENT_URL)
    if url is None:
        raise RankEnvironmentError(
            f"environment variable {RANK_ENV_AGENT_URL} is not set", RANK_ENV_AGENT_URL
        )
    if not url.startswith(("http://", "https://")):
        raise RankEnvironmentError(
            f"environment variable {RANK_ENV_AGENT_URL}={_cut(url)!r} is invalid: "
            "expected an http:// or https:// URL",
            RANK_ENV_AGENT_URL,
        )
    return url.rstrip("/")


def _agent_socket(env: Mapping[str, str]) -> str | None:
    """``CUMULUS_AGENT_SOCKET``: an absolute path of at most :data:`MAX_AGENT_SOCKET_BYTES`
    bytes without NUL, ``None`` when unset."""
    path = _get(env, RANK_ENV_AGENT_SOCKET)
    if path is None:
        return None
    problem = None
    if "\0" in path:
        problem = "contains a NUL character"
    elif not path.startswith("/"):
        problem = "is not an absolute path"
    else:
        try:
            size = len(os.fsencode(path))
        except UnicodeEncodeError:
            problem = "cannot be encoded as a file name"
        else:
            if size > MAX_AGENT_SOCKET_BYTES:
                problem = (
                    f"is {size} bytes long, longer than a Unix socket address allows "
                    f"({MAX_AGENT_SOCKET_BYTES} bytes)"
                )
    if problem is not None:
        raise RankEnvironmentError(
            f"environment variable {RANK_ENV_AGENT_SOCKET}={_cut(path)!r} is invalid: it "
            f"{problem} (expected the absolute path of the agent's Unix socket)",
            RANK_ENV_AGENT_SOCKET,
        )
    return path


def _ranks(env: Mapping[str, str], standalone: bool) -> tuple[int, int, int, int]:
    """``(rank, world_size, local_rank, local_world_size)``, checked against each other."""
    default = (lambda d: d) if standalone else (lambda d: None)
    world_size = _int(
        env, RANK_ENV_WORLD_SIZE, default=default(1), minimum=1, what="a positive integer"
    )
    rank = _int(env, RANK_ENV_RANK, default=default(0))
    local_world_size = _int(
        env, RANK_ENV_LOCAL_WORLD_SIZE, default=default(1), minimum=1, what="a positive integer"
    )
    local_rank = _int(env, RANK_ENV_LOCAL_RANK, default=default(0))
    if rank >= world_size:
        raise RankEnvironmentError(
            f"{RANK_ENV_RANK}={rank} must be below {RANK_ENV_WORLD_SIZE}={world_size}",
            RANK_ENV_RANK,
        )
    if local_rank >= local_world_size:
        raise RankEnvironmentError(
            f"{RANK_ENV_LOCAL_RANK}={local_rank} must be below "
            f"{RANK_ENV_LOCAL_WORLD_SIZE}={local_world_size}",
            RANK_ENV_LOCAL_RANK,
        )
    if local_world_size > world_size:
        raise RankEnvironmentError(
            f"{RANK_ENV_LOCAL_WORLD_SIZE}={local_world_size} is larger than "
            f"{RANK_ENV_WORLD_SIZE}={world_size}",
            RANK_ENV_LOCAL_WORLD_SIZE,
        )
    return rank, world_size, local_rank, local_world_size


def context_from_env(env: Mapping[str, str], *, standalone: bool = False) -> Context:
    """Parses a rank environment (``env`` maps variable names to values; an empty value
    counts as unset).

    :param standalone: outside a Cumulus rank, return a standalone context instead of
        raising :class:`~cumulus.errors.NotInCumulusRank`.
    :raises NotInCumulusRank: ``CUMULUS_JOB_ID`` is not set and ``standalone`` is false.
    :raises RankEnvironmentError: a variable is missing or malformed, or Cumulus-only
        variables are set without ``CUMULUS_JOB_ID``.
    """
    job_id = _get(env, RANK_ENV_JOB_ID)
    if job_id is None:
        stray = [name for name in _AGENT_ONLY_VARS if _get(env, name) is not None]
        if stray:
            raise RankEnvironmentError(
                f"{', '.join(stray)} set but {RANK_ENV_JOB_ID} is not: this is neither a "
                "Cumulus rank (the worker agent sets them all) nor a clean standalone run",
                stray[0],
            )
        if not standalone:
            raise NotInCumulusRank(
                f"not running as a Cumulus rank ({RANK_ENV_JOB_ID} is not set); submit the "
                "script to a cluster (cumulusctl submit / cumulus.Client.submit), or call "
                "get_context(standalone=True) to run it under plain python or torchrun"
            )
        return _standalone(env)

    missing = [name for name in REQUIRED_VARS if _get(env, name) is None]
    if missing:
        raise RankEnvironmentError(
            f"{RANK_ENV_JOB_ID}={_cut(job_id)!r} is set but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not: the rank environment is "
            "incomplete (is this process really started by a Cumulus worker agent?)",
            missing[0],
        )
    rank, world_size, local_rank, local_world_size = _ranks(env, standalone=False)
    master_addr = _get(env, RANK_ENV_MASTER_ADDR) or DEFAULT_MASTER_ADDR
    master_port = _int(
        env, RANK_ENV_MASTER_PORT, minimum=1, maximum=65535, what="a TCP port (1..=65535)"
    )
    attempt = _int(env, RANK_ENV_ATTEMPT)
    agent_url = _agent_url(env)
    agent_token = _get(env, RANK_ENV_AGENT_TOKEN)
    agent_socket = _agent_socket(env)
    shards_file = _get(env, RANK_ENV_SHARDS_FILE)
    assert shards_file is not None  # checked with REQUIRED_VARS
    shard_paths = read_shards_file(Path(shards_file))
    staging_raw = _get(env, RANK_ENV_CKPT_STAGING)
    staging_dir = Path(staging_raw) if staging_raw is not None else None
    resume_step, resume_dir = _resume(env)
    gpu_memory_fraction = _gpu_memory_fraction(env)
    if resume_step is not None and staging_dir is None:
        raise RankEnvironmentError(
            f"{RANK_ENV_RESUME_STEP} is set but {RANK_ENV_CKPT_STAGING} is not: a resumed job "
            "always has a checkpoint target",
            RANK_ENV_RESUME_STEP,
        )
    return Context(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=master_addr,
        master_port=master_port,
        job_id=job_id,
        attempt=attempt,
        shard_paths=shard_paths,
        staging_dir=staging_dir,
        resume_step=resume_step,
        resume_dir=resume_dir,
        agent_url=agent_url,
        agent_token=agent_token,
        standalone=False,
        gpu_memory_fraction=gpu_memory_fraction,
        agent_socket=agent_socket,
        output_dir=_output_dir(env),
        data_plan_path=_data_plan_path(env),
    )


def _data_plan_path(env: Mapping[str, str]) -> Path | None:
    raw = _get(env, RANK_ENV_DATA_PLAN)
    return Path(raw) if raw is not None else None


def _output_dir(env: Mapping[str, str]) -> Path | None:
    raw = _get(env, RANK_ENV_OUTPUT_DIR)
    return Path(raw) if raw is not None else None


def _standalone(env: Mapping[str, str]) -> Context:
    rank, world_size, local_rank, local_world_size = _ranks(env, standalone=True)
    master_port = _int(
        env,
        RANK_ENV_MASTER_PORT,
        default=DEFAULT_MASTER_PORT,
        minimum=1,
        maximum=65535,
        what="a TCP port (1..=65535)",
    )
    attempt = _int(env, "TORCHELASTIC_RESTART_COUNT", default=0)
    shards_file = _get(env, RANK_ENV_SHARDS_FILE)
    shard_paths = read_shards_file(Path(shards_file)) if shards_file is not None else ()
    return Context(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=_get(env, RANK_ENV_MASTER_ADDR) or DEFAULT_MASTER_ADDR,
        master_port=master_port,
        job_id=None,
        attempt=attempt,
        shard_paths=shard_paths,
        staging_dir=None,
        resume_step=None,
        resume_dir=None,
        standalone=True,
        gpu_memory_fraction=_gpu_memory_fraction(env),
        output_dir=_output_dir(env),
    )


def get_context(*, standalone: bool = False) -> Context:
    """This process's rank context, from its environment.

    :param standalone: outside a Cumulus rank, return a standalone context (torchrun's
        ``RANK``/``WORLD_SIZE``/... when set, else rank 0 of 1) instead of raising. Inside
        a Cumulus rank it changes nothing.
    :raises NotInCumulusRank: not a Cumulus rank and ``standalone`` is false.
    :raises RankEnvironmentError: a rank variable is missing or malformed.
    """
    return context_from_env(os.environ, standalone=standalone)
