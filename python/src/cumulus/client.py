"""Client SDK of the coordinators' HTTP API (docs/architecture.md, "Coordinator HTTP API";
``coordinator/src/http.rs``), with leader following.

Every request carries ``Authorization: Bearer <token>`` (the cluster's or a user's), or,
with a user's client certificate and no token, no ``Authorization`` header: the TLS
connection presents the certificate (``cumulus://user/NAME``, from ``cumulusctl certs
issue user NAME``) and the coordinators take the request as that user's, with the role the
cluster gave them. Every connection is TLS (``https://``), the coordinators verified
against the cluster's CA certificate only, unless the cluster runs plaintext
(``--insecure``): see :func:`cumulus._config.resolve`.

A follower answers a write (and a linearizable read) with 503 and the leader's address in
the ``x-cumulus-leader-http`` header: the request is sent there at once. A refused or
dropped connection, a timeout, or a 503 without a leader (an election in progress)
moves on to the next configured address after a backoff (0.1 s doubling up to 2 s). Both
are bounded by ``retry_max_tries`` (20) and ``retry_total_s`` (30 s), as ``cumulusctl``.
Submits are idempotent: one request id per submit, reused by every retry, so a retry
after a lost answer never creates a second job.

Example::

    import cumulus

    client = cumulus.Client()  # CUMULUS_HTTP + CUMULUS_TOKEN_FILE + CUMULUS_TLS_CA, or ./.cumulus
    job = client.submit(["python", "train.py"], world_size=2, ckpt_dir="/shared/ckpt")
    for line in job.logs(follow=True):
        print(line.rank, line.line)
    info = job.wait()
    print(info.state, [c.step for c in job.checkpoints()])

Pausing: ``job.pause()`` asks the ranks to commit a checkpoint and exit (they see
:func:`cumulus.runtime.should_stop` and :func:`~cumulus.runtime.should_pause`), and the
job becomes ``paused``; ``job.resume()`` queues it again, from that checkpoint. A time
limit (``submit(..., time_limit_s=3600, signal_before_s=60)``) ends a job ``timed_out``,
its ranks asked to checkpoint ``signal_before_s`` before it. ``submit(...,
resume_from="job-000012@400")`` starts a new job from another job's committed step, and
``submit(..., preemptible=True)`` lets a job of higher priority stop (after a
checkpoint) and requeue it.

Progress: ``job.summary()`` gives the job's step, rate, time left, latest metrics and
progress history; ``client.summaries(state="running")`` lists the newest jobs' summaries.

Cleaning up: ``job.delete(checkpoints=True)`` removes a finished job's record and its
checkpoints; ``client.purge(older_than_s=7 * 86_400, state="cancelled")`` removes every
finished job (of this user) that ended more than a week ago.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import pathlib
import re
import secrets
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import httpx
from httpx_sse import EventSource, SSEError

from cumulus import _bundle, _contract, _remote, _transfer
from cumulus._bundle import PackedDir
from cumulus._config import Connection, normalize_address, resolve
from cumulus.errors import (
    ApiError,
    ConfigError,
    Conflict,
    Forbidden,
    InvalidSpec,
    JobFailed,
    NotFound,
    ProtocolError,
    ResourceExhausted,
    ResultUnavailable,
    ServerError,
    SubmitWarning,
    Unauthorized,
    Unavailable,
    WaitTimeout,
)
from cumulus.models import (
    FINISHED_STATES,
    JOB_STATES,
    ArtifactFile,
    CheckpointInfo,
    ClusterInfo,
    JobInfo,
    JobSummary,
    LogLine,
    UploadInfo,
)

__all__ = ["LEADER_HTTP_HEADER", "Client", "Job", "new_request_id"]

#: Header naming the leader's HTTP address in a follower's 503.
LEADER_HTTP_HEADER = _contract.LEADER_HTTP_HEADER
#: Longest request id, in bytes.
MAX_REQUEST_ID_BYTES = _contract.MAX_REQUEST_ID_BYTES
#: Most ``env`` entries of a job.
MAX_ENV = _contract.MAX_ENV_ENTRIES
#: Most whole GPUs one rank may ask for (``gpus_per_rank``).
MAX_GPUS_PER_RANK = _contract.MAX_GPUS_PER_WORKER
#: Thousandths of a GPU in one whole GPU: a ``gpu_memory_fraction`` is kept in these steps.
WHOLE_GPU_PERMILLE = _contract.WHOLE_GPU_PERMILLE
#: Consecutive failed log-stream connections before :meth:`Job.logs` gives up.
LOG_MAX_CONSECUTIVE_FAILURES = 20
#: Most last lines ``logs(tail=...)`` may ask for (the coordinator's ``MAX_TAIL_LINES``).
MAX_TAIL = 10_000
#: A silent log stream is presumed dead (and resumed elsewhere) after this, in seconds.
LOG_READ_TIMEOUT_S = 30.0
#: Longest time limit a job may ask for, in seconds (365 days; the coordinator's
#: ``MAX_TIME_LIMIT_MS``).
MAX_TIME_LIMIT_S = _contract.MAX_TIME_LIMIT_MS // 1000
#: Largest checkpoint step (``resume_from``): the coordinator keeps steps as ``u64``.
MAX_STEP = 2**64 - 1
#: A job id as the leader makes them: ``job-`` and 6 to 20 ASCII digits (the Rust
#: ``is_job_id``).
JOB_ID_PATTERN = re.compile(r"job-[0-9]{6,20}")
#: Largest ``older_than_ms`` :meth:`Client.purge` sends (2**53 - 1: exact in every JSON
#: reader; over 285,000 years).
MAX_PURGE_AGE_MS = 2**53 - 1
#: Most job summaries one :meth:`Client.summaries` call asks for (the coordinator's
#: ``MAX_SUMMARIES``).
MAX_SUMMARIES = _contract.MAX_SUMMARIES
#: :meth:`Job.wait`'s first pause between two polls, in seconds; each next pause is
#: :data:`WAIT_POLL_GROWTH` times longer, up to its ``poll_interval_s``. A job that ends
#: ``t`` seconds into the wait is seen at most about ``(WAIT_POLL_GROWTH - 1) * t`` later
#: (plus the first pause): ``Client.run`` of a short function ends ~0.3 s after its
#: submit, and with 0.1 s doubling it was seen up to 0.4 s late (p50 0.37 s, half the
#: calls of a slower interpreter 0.77 s: docs/benchmarks.md P5).
WAIT_FIRST_POLL_S = 0.05
#: Growth of :meth:`Job.wait`'s pause from one poll to the next.
WAIT_POLL_GROWTH = 1.25
#: Highest queue priority a job may have (and, negated, the lowest).
_MAX_PRIORITY = _contract.MAX_PRIORITY
#: Longest stop grace a job may ask for, in seconds.
_MAX_STOP_GRACE_S = _contract.MAX_STOP_GRACE_MS // 1000
#: Longest startup timeout a job may ask for, in seconds (7 days).
MAX_STARTUP_TIMEOUT_S = _contract.MAX_STARTUP_TIMEOUT_MS // 1000
#: Startup timeout of a job with a progress timeout that names none, in seconds (the
#: coordinator's ``DEFAULT_STARTUP_TIMEOUT_MS``).
DEFAULT_STARTUP_TIMEOUT_S = _contract.DEFAULT_STARTUP_TIMEOUT_MS / 1000


#: Time limit of :meth:`Client.cluster`'s one try at the named leader, in seconds.
_LEADER_TRY_TIMEOUT_S = 2.0
#: Set while :meth:`Client.run_async` submits: its submit issues no SubmitWarning.
_QUIET_SUBMIT: ContextVar[bool] = ContextVar("cumulus_quiet_submit", default=False)


def new_request_id() -> str:
    """A random idempotency key (32 hex digits), as ``cumulusctl submit`` makes."""
    return secrets.token_hex(16)


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])
    text = resp.text.strip()
    return text[:500] if text else f"HTTP {resp.status_code}"


_STATUS_ERRORS: dict[int, type[ApiError]] = {
    400: InvalidSpec,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    429: ResourceExhausted,
}


def _final_status(status: int) -> bool:
    """Whether an answer is final for a retried read: a 4xx other than 408 (timeout) and
    429 (too many requests) says the same on every try and at every coordinator (as
    ``cumulusctl logs`` decides)."""
    return 400 <= status < 500 and status not in (408, 429)


#: What a 401 suggests when the request carried a token.
TOKEN_HINT = "check the token: CUMULUS_TOKEN_FILE / token_file="


def _raise_for(resp: httpx.Response, address: str, hint: str = TOKEN_HINT) -> None:
    status = resp.status_code
    message = _error_text(resp)
    if status == 401:
        message = f"{message} ({hint})"
    cls = _STATUS_ERRORS.get(status, ServerError)
    raise cls(message, status=status, address=address)


def _check_gpus(gpus_per_rank: int | None, fraction: float | None) -> None:
    """Refuses GPU arguments the coordinator would refuse (as ``cumulusctl submit``).

    :raises InvalidSpec: ``gpus_per_rank`` is not an int ``0..=64``, ``fraction`` is not a
        finite number with ``0 < f <= 1`` that is at least 0.0005 (it would round to no
        thousandth), or both are given with more than one GPU per rank."""
    if gpus_per_rank is not None and (
        isinstance(gpus_per_rank, bool)
        or not isinstance(gpus_per_rank, int)
        or not 0 <= gpus_per_rank <= MAX_GPUS_PER_RANK
    ):
        raise InvalidSpec(
            f"gpus_per_rank must be an int 0..={MAX_GPUS_PER_RANK}, got {gpus_per_rank!r}",
            status=None,
        )
    if fraction is None:
        return
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, numbers.Real)
        or not math.isfinite(fraction)
        or not 0 < fraction <= 1
        # The coordinator keeps thousandths, rounded: below half of one is nothing.
        or float(fraction) * WHOLE_GPU_PERMILLE < 0.5
    ):
        raise InvalidSpec(
            "gpu_memory_fraction must be a number with 0 < fraction <= 1 (steps of 0.001, "
            f"at least 0.0005), got {fraction!r}",
            status=None,
        )
    if gpus_per_rank is not None and gpus_per_rank > 1:
        raise InvalidSpec(
            f"gpu_memory_fraction applies to one GPU per rank, but gpus_per_rank is "
            f"{gpus_per_rank}: leave gpus_per_rank out (or 1) with a fraction",
            status=None,
        )


def _duration_ms(name: str, value: object) -> int:
    """``value`` seconds as whole milliseconds, refusing what is not a positive duration.

    :raises InvalidSpec: not a real number (``bool`` included), not finite, not positive,
        under half a millisecond, or over :data:`MAX_TIME_LIMIT_S`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not float(value) > 0
    ):
        raise InvalidSpec(
            f"{name} must be a positive number of seconds (None: no limit), got {value!r}",
            status=None,
        )
    ms = round(float(value) * 1000)
    if ms < 1:
        raise InvalidSpec(f"{name} must be at least 0.001 s, got {value!r}", status=None)
    if ms > MAX_TIME_LIMIT_S * 1000:
        raise InvalidSpec(
            f"{name} must be at most {MAX_TIME_LIMIT_S} s (365 days), got {value!r}",
            status=None,
        )
    return ms


def _time_limit_ms(
    time_limit_s: float | None, signal_before_s: float | None
) -> tuple[int | None, int | None]:
    """``(time_limit_ms, signal_before_ms)`` of :meth:`Client.submit`'s arguments, each
    ``None`` when not given.

    :raises InvalidSpec: a value is not a positive duration, ``signal_before_s`` is given
        without ``time_limit_s``, or it is not less than ``time_limit_s``."""
    limit_ms = None if time_limit_s is None else _duration_ms("time_limit_s", time_limit_s)
    if signal_before_s is None:
        return limit_ms, None
    if limit_ms is None:
        raise InvalidSpec(
            "signal_before_s needs a time_limit_s: it says how long before the time limit "
            "the ranks are asked to checkpoint and stop",
            status=None,
        )
    signal_ms = _duration_ms("signal_before_s", signal_before_s)
    if signal_ms >= limit_ms:
        raise InvalidSpec(
            f"signal_before_s ({signal_before_s!r} s) must be less than time_limit_s "
            f"({time_limit_s!r} s): the ranks are asked to stop that long before the limit",
            status=None,
        )
    return limit_ms, signal_ms


def _resume_from(resume_from: object) -> tuple[str, int | None] | None:
    """``(resume_from_job, resume_from_step)`` of :meth:`Client.submit`'s ``resume_from``
    (``"job-000012"``, ``"job-000012@400"`` or ``("job-000012", 400)``), the step
    ``None`` when not given (the coordinator takes the job's newest committed one);
    ``None`` for ``None``.

    :raises InvalidSpec: not one of those forms, a job id that is not ``job-`` and 6 to
        20 digits, or a step that is not an int ``0..=2**64-1`` (``bool`` refused)."""
    if resume_from is None:
        return None
    forms = '"JOB", "JOB@STEP" or (JOB, STEP), e.g. "job-000012@400"'
    step: object = None
    if isinstance(resume_from, str):
        job, at, step_text = resume_from.partition("@")
        if at:
            if not step_text.isascii() or not step_text.isdigit():
                raise InvalidSpec(
                    f"resume_from: step {step_text!r} is not a number ({forms}), "
                    f"got {resume_from!r}",
                    status=None,
                )
            # Past 20 digits it is over u64 anyway (and int() refuses over 4300 digits).
            step = int(step_text) if len(step_text) <= 20 else MAX_STEP + 1
    elif isinstance(resume_from, tuple) and len(resume_from) == 2:
        job, step = resume_from
        if step is None:
            raise InvalidSpec(
                f"resume_from: the step of a (JOB, STEP) pair must be an int (or pass the "
                f"job id alone for its newest step), got {resume_from!r}",
                status=None,
            )
    else:
        raise InvalidSpec(f"resume_from must be {forms}, got {resume_from!r}", status=None)
    if not isinstance(job, str) or not JOB_ID_PATTERN.fullmatch(job):
        raise InvalidSpec(
            f"resume_from must name a job id (job- and 6 to 20 digits, e.g. job-000012), "
            f"got {resume_from!r}",
            status=None,
        )
    if step is not None and (
        isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP
    ):
        raise InvalidSpec(
            f"resume_from: the step must be an int 0..={MAX_STEP}, got {resume_from!r}",
            status=None,
        )
    return job, step


def _check_job_id(job_id: object) -> str:
    """``job_id`` if it can name a job in a URL path.

    :raises InvalidSpec: not a non-empty ``str``, or it holds ``/``, ``?``, ``#``, ``%``
        or whitespace (it would address another resource)."""
    if not isinstance(job_id, str) or not job_id or any(c in "/?#%" or c.isspace() for c in job_id):
        raise InvalidSpec(f"not a job id: {job_id!r}", status=None)
    return job_id


def _check_flag(name: str, value: object) -> bool:
    """``value`` if it is a ``bool`` (a destructive switch is never guessed from a truthy
    value such as ``"false"``).

    :raises InvalidSpec: it is not a ``bool``."""
    if not isinstance(value, bool):
        raise InvalidSpec(f"{name} must be True or False, got {value!r}", status=None)
    return value


def _argv(command: Sequence[str]) -> list[str]:
    """:meth:`Client.submit`'s ``command`` as a list of ``str`` (path-like arguments
    converted).

    :raises TypeError: a single string (not split into arguments).
    :raises InvalidSpec: empty, or an argument that is not a ``str``."""
    if isinstance(command, (str, bytes)):
        raise TypeError(
            "command must be a sequence of arguments (argv), e.g. ['python', 'train.py']; "
            "split a shell string with shlex.split()"
        )
    argv = [str(a) if isinstance(a, os.PathLike) else a for a in command]
    if not argv or not all(isinstance(a, str) for a in argv):
        raise InvalidSpec("command must be a non-empty list of str", status=None)
    return argv


def _check_world_size(world_size: object) -> None:
    """:raises InvalidSpec: ``world_size`` is not an int ``>= 1`` (``bool`` refused)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidSpec(f"world_size must be an int >= 1, got {world_size!r}", status=None)


def _elastic_world_size(world_size: object) -> tuple[int, int]:
    """``(min_world_size, world_size)`` of ``submit(world_size=...)``: an int is a fixed
    world (min 0), a pair ``(MIN, MAX)`` an elastic one with ``1 <= MIN <= MAX``.

    :raises InvalidSpec: anything else.
    """
    if isinstance(world_size, tuple):
        if len(world_size) != 2:
            raise InvalidSpec(
                f"world_size must be an int or a pair (MIN, MAX), got {world_size!r}",
                status=None,
            )
        low, high = world_size
        _check_world_size(low)
        _check_world_size(high)
        assert isinstance(low, int) and isinstance(high, int)
        if low > high:
            raise InvalidSpec(
                f"world_size (MIN, MAX) needs MIN <= MAX, got {world_size!r}", status=None
            )
        return low, high
    _check_world_size(world_size)
    assert isinstance(world_size, int)
    return 0, world_size


def _request_id(request_id: str | None) -> str:
    """``request_id``, or a new random one for ``None``.

    :raises InvalidSpec: not 1 to :data:`MAX_REQUEST_ID_BYTES` bytes."""
    rid = request_id if request_id is not None else new_request_id()
    if not 1 <= len(rid.encode()) <= MAX_REQUEST_ID_BYTES:
        raise InvalidSpec(f"request_id must be 1..={MAX_REQUEST_ID_BYTES} bytes", status=None)
    return rid


def _env_map(env: Mapping[str, str] | None) -> dict[str, str]:
    """A job's ``env`` as a new dict.

    :raises InvalidSpec: too many entries, or an entry that is not ``str`` to ``str`` with
        a non-empty key without ``=``."""
    env_map = dict(env or {})
    if len(env_map) > MAX_ENV:
        raise InvalidSpec(f"at most {MAX_ENV} env entries, got {len(env_map)}", status=None)
    for k, v in env_map.items():
        if not isinstance(k, str) or not isinstance(v, str) or not k or "=" in k:
            raise InvalidSpec(
                f"env entry {k!r}={v!r}: keys and values must be str, keys non-empty without '='",
                status=None,
            )
    return env_map


def _restart_policy(
    restart_scope: str | None,
    max_restarts: int | None,
    backoff_initial_ms: int | None,
    backoff_max_ms: int | None,
) -> dict[str, Any]:
    """The spec's ``restart`` object: the arguments that are given.

    :raises InvalidSpec: ``backoff_initial_ms`` is larger than ``backoff_max_ms``."""
    if (
        backoff_initial_ms is not None
        and backoff_max_ms is not None
        and backoff_initial_ms > backoff_max_ms
    ):
        raise InvalidSpec(
            f"backoff_initial_ms {backoff_initial_ms} is larger than backoff_max_ms "
            f"{backoff_max_ms}",
            status=None,
        )
    restart: dict[str, Any] = {}
    if restart_scope is not None:
        restart["scope"] = restart_scope
    if max_restarts is not None:
        restart["max_restarts"] = max_restarts
    if backoff_initial_ms is not None:
        restart["backoff_initial_ms"] = backoff_initial_ms
    if backoff_max_ms is not None:
        restart["backoff_max_ms"] = backoff_max_ms
    return restart


def _absolute(p: str | os.PathLike[str] | None) -> str:
    """A spec path: ``""`` for none, an ``s3://`` URL as is, else made absolute here (the
    workers would resolve a relative one elsewhere)."""
    if p is None:
        return ""
    s = os.fspath(p)
    return s if s.startswith("s3://") or not s else os.path.abspath(s)


def _stop_grace_ms(stop_grace_s: float | None) -> int | None:
    """``stop_grace_s`` in milliseconds (``None`` when not given).

    :raises InvalidSpec: not a number of seconds from 0 to ``_MAX_STOP_GRACE_S``
        (``bool`` refused)."""
    if stop_grace_s is None:
        return None
    if (
        isinstance(stop_grace_s, bool)
        or not isinstance(stop_grace_s, (int, float))
        or not 0 <= stop_grace_s <= _MAX_STOP_GRACE_S
    ):
        raise InvalidSpec(
            f"stop_grace_s must be a number of seconds in 0..={_MAX_STOP_GRACE_S}, "
            f"got {stop_grace_s!r}",
            status=None,
        )
    return round(stop_grace_s * 1000)


def _startup_timeout_ms(startup_timeout_s: float | None) -> int:
    """``startup_timeout_s`` in milliseconds (0, the cluster's default, when not given).

    :raises InvalidSpec: not a number of seconds with ``0 < s <=``
        :data:`MAX_STARTUP_TIMEOUT_S` (``bool`` refused)."""
    if startup_timeout_s is None:
        return 0
    if (
        isinstance(startup_timeout_s, bool)
        or not isinstance(startup_timeout_s, (int, float))
        or not 0 < startup_timeout_s <= MAX_STARTUP_TIMEOUT_S
        or round(startup_timeout_s * 1000) == 0
    ):
        raise InvalidSpec(
            f"startup_timeout_s must be a number of seconds with 0 < s <= "
            f"{MAX_STARTUP_TIMEOUT_S} (7 days), got {startup_timeout_s!r}",
            status=None,
        )
    return round(startup_timeout_s * 1000)


def _check_priority(priority: int | None) -> None:
    """:raises InvalidSpec: ``priority`` is given and not an int within
    ``±_MAX_PRIORITY`` (``bool`` refused)."""
    if priority is not None and (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not -_MAX_PRIORITY <= priority <= _MAX_PRIORITY
    ):
        raise InvalidSpec(
            f"priority must be an integer in -{_MAX_PRIORITY}..={_MAX_PRIORITY}, got {priority!r}",
            status=None,
        )


_WARM_PYTHON = re.compile(r"python(3(\.[0-9]+)?)?")
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _warm_spares(
    warm_spares: int | None, warm_imports: Sequence[str] | None, argv: Sequence[str]
) -> dict[str, Any]:
    """The spec fields of ``warm_spares`` and ``warm_imports`` (the rule of
    ``cumulus_api::warm::check``).

    :raises InvalidSpec: out of bounds, not module names, imports without spares, or a
        command a spare cannot run (``python SCRIPT ...`` or ``python -m MODULE ...``)."""
    n = 0 if warm_spares is None else warm_spares
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= _contract.MAX_WARM_SPARES:
        raise InvalidSpec(
            f"warm_spares must be an integer in 0..={_contract.MAX_WARM_SPARES}, got "
            f"{warm_spares!r}",
            status=None,
        )
    if isinstance(warm_imports, str):
        raise InvalidSpec(
            "warm_imports must be a list of module names, not one string", status=None
        )
    imports = list(warm_imports or ())
    if len(imports) > _contract.MAX_WARM_IMPORTS:
        raise InvalidSpec(
            f"warm_imports names {len(imports)} modules, above the limit of "
            f"{_contract.MAX_WARM_IMPORTS}",
            status=None,
        )
    for m in imports:
        if (
            not isinstance(m, str)
            or len(m.encode()) > _contract.MAX_WARM_IMPORT_BYTES
            or not _MODULE_NAME.fullmatch(m)
        ):
            raise InvalidSpec(f"warm_imports: {m!r} is not a module name", status=None)
    if n == 0 and imports:
        raise InvalidSpec("warm_imports needs warm_spares of at least 1", status=None)
    if n > 0:
        program = argv[0].rsplit("/", 1)[-1]
        rest = list(argv[1:])
        python = bool(_WARM_PYTHON.fullmatch(program))
        module = len(rest) >= 2 and rest[0] == "-m" and bool(_MODULE_NAME.fullmatch(rest[1]))
        script = bool(rest) and rest[0] != "" and not rest[0].startswith("-")
        if not (python and (module or script)):
            raise InvalidSpec(
                "warm_spares needs a command that starts a Python interpreter on a script or "
                "a module (python SCRIPT ... or python -m MODULE ...; argv[0] named python, "
                f"python3 or python3.N, no options before the script), got {list(argv)[:3]!r}",
                status=None,
            )
    out: dict[str, Any] = {}
    if n:
        out["warm_spares"] = n
    if imports:
        out["warm_imports"] = imports
    return out


def _straggler_fields(
    action: str | None, fraction: float | None, window_s: float | None
) -> dict[str, Any]:
    """The spec fields of ``straggler_action``, ``straggler_fraction`` and
    ``straggler_window_s`` (only those given; the coordinator fills the defaults).

    :raises InvalidSpec: an action that is not one of
        :data:`cumulus._contract.STRAGGLER_ACTIONS`, a fraction or window out of the
        contract's bounds (``bool`` refused)."""
    out: dict[str, Any] = {}
    if action is not None:
        if action not in _contract.STRAGGLER_ACTIONS:
            raise InvalidSpec(
                f"straggler_action must be one of {', '.join(_contract.STRAGGLER_ACTIONS)}, "
                f"got {action!r}",
                status=None,
            )
        out["straggler_action"] = action
    if fraction is not None:
        lo = _contract.MIN_STRAGGLER_FRACTION_PERMILLE / 1000
        hi = _contract.MAX_STRAGGLER_FRACTION_PERMILLE / 1000
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, (int, float))
            or not lo <= fraction <= hi
        ):
            raise InvalidSpec(
                f"straggler_fraction must be a number with {lo} <= f <= {hi}, got {fraction!r}",
                status=None,
            )
        out["straggler_fraction"] = float(fraction)
    if window_s is not None:
        lo_s = _contract.MIN_STRAGGLER_WINDOW_MS / 1000
        hi_s = _contract.MAX_STRAGGLER_WINDOW_MS / 1000
        if (
            isinstance(window_s, bool)
            or not isinstance(window_s, (int, float))
            or not lo_s <= window_s <= hi_s
        ):
            raise InvalidSpec(
                f"straggler_window_s must be a number of seconds with {lo_s:g} <= s <= "
                f"{hi_s:g}, got {window_s!r}",
                status=None,
            )
        out["straggler_window_ms"] = round(window_s * 1000)
    return out


def _optional_spec_fields(
    *,
    ckpt_keep: int | None,
    gpus_per_rank: int | None,
    gpu_memory_fraction: float | None,
    stop_grace_ms: int | None,
    priority: int | None,
    time_limit_ms: int | None,
    signal_before_ms: int | None,
    resume: tuple[str, int | None] | None,
    preemptible: bool,
) -> dict[str, Any]:
    """The spec fields a job leaves out unless it sets them (the coordinator's defaults
    apply), from already checked values."""
    fields: dict[str, Any] = {}
    if ckpt_keep is not None:
        fields["ckpt_keep"] = ckpt_keep
    if gpus_per_rank is not None:
        fields["gpus_per_rank"] = gpus_per_rank
    if gpu_memory_fraction is not None:
        fields["gpu_memory_fraction"] = float(gpu_memory_fraction)
    if stop_grace_ms is not None:
        fields["stop_grace_ms"] = stop_grace_ms
    if priority is not None:
        fields["priority"] = priority
    if time_limit_ms is not None:
        fields["time_limit_ms"] = time_limit_ms
    if signal_before_ms is not None:
        fields["signal_before_ms"] = signal_before_ms
    if resume is not None:
        resume_job, resume_step = resume
        fields["resume_from_job"] = resume_job
        if resume_step is not None:
            fields["resume_from_step"] = resume_step
    if preemptible:
        fields["preemptible"] = True
    return fields


def _purge_age_ms(older_than_s: object) -> int:
    """``older_than_s`` seconds as whole milliseconds (rounded), for :meth:`Client.purge`.

    :raises InvalidSpec: not a real number (``bool`` included), not finite, not
        positive, under half a millisecond (it would round to 0 ms, which the coordinator
        refuses), or over :data:`MAX_PURGE_AGE_MS` milliseconds."""
    too_large = f"older_than_s must be at most {MAX_PURGE_AGE_MS // 1000} s, got {older_than_s!r}"
    seconds = math.nan
    if not isinstance(older_than_s, bool) and isinstance(older_than_s, numbers.Real):
        try:
            seconds = float(older_than_s)
        except OverflowError:  # an int or Fraction beyond any float
            raise InvalidSpec(too_large, status=None) from None
    if not math.isfinite(seconds) or not seconds > 0:
        raise InvalidSpec(
            f"older_than_s must be a positive, finite number of seconds, got {older_than_s!r}",
            status=None,
        )
    ms = round(seconds * 1000)
    if ms < 1:
        raise InvalidSpec(
            f"older_than_s must be at least 0.001 s, got {older_than_s!r}", status=None
        )
    if ms > MAX_PURGE_AGE_MS:
        raise InvalidSpec(too_large, status=None)
    return ms


def _purge_state(state: object) -> str:
    """The wire ``state`` of :meth:`Client.purge`: ``""`` (every finished state) for
    ``None``, else ``state`` itself.

    :raises InvalidSpec: ``state`` is neither ``None`` nor one of
        :data:`~cumulus.models.FINISHED_STATES`."""
    if state is None:
        return ""
    if not isinstance(state, str) or state not in FINISHED_STATES:
        raise InvalidSpec(
            f"state must be None (every finished state) or one of "
            f"{', '.join(sorted(FINISHED_STATES))}, got {state!r}",
            status=None,
        )
    return state


def _summaries_params(state: object, limit: object) -> dict[str, str]:
    """The query of :meth:`Client.summaries`: ``state`` and ``limit`` when given.

    :raises InvalidSpec: ``state`` is neither ``None`` nor one of
        :data:`~cumulus.models.JOB_STATES`, or ``limit`` is neither ``None`` nor an int
        ``1..=10000`` (``bool`` refused)."""
    params: dict[str, str] = {}
    if state is not None:
        if not isinstance(state, str) or state not in JOB_STATES:
            raise InvalidSpec(
                f"state must be None (any state) or one of {', '.join(JOB_STATES)}, got {state!r}",
                status=None,
            )
        params["state"] = state
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_SUMMARIES:
            raise InvalidSpec(
                f"limit must be None (the coordinator's default, {_contract.DEFAULT_SUMMARIES}) "
                f"or an int 1..={MAX_SUMMARIES}, got {limit!r}",
                status=None,
            )
        params["limit"] = str(limit)
    return params


#: A Python version an environment may ask for: ``3.X`` or ``3.X.Y`` (the Rust
#: ``blobs::is_valid_python_version``).
PYTHON_VERSION_PATTERN = re.compile(r"3\.[0-9]{1,3}(\.[0-9]{1,3})?")


def _requirements_text(requirements: Sequence[str] | str | os.PathLike[str]) -> str:
    """The requirements text of ``requirements``: a list of requirement lines, or the
    path of a requirements file (read here).

    :raises InvalidSpec: a line holds a newline or is not a ``str``, the file cannot be
        read, or the text is over ``MAX_REQUIREMENTS_BYTES``."""
    if isinstance(requirements, (str, os.PathLike)):
        path = os.fspath(requirements)
        try:
            with open(path, "rb") as f:
                data = f.read(_contract.MAX_REQUIREMENTS_BYTES + 1)
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidSpec(f"requirements file {path}: {e}", status=None) from e
    else:
        if isinstance(requirements, bytes) or not all(
            isinstance(r, str) and "\n" not in r and "\r" not in r for r in requirements
        ):
            raise InvalidSpec(
                "requirements must be a list of requirement lines (str, no newline) or the "
                f"path of a requirements file, got {requirements!r}",
                status=None,
            )
        text = "".join(f"{r}\n" for r in requirements)
    if len(text.encode()) > _contract.MAX_REQUIREMENTS_BYTES:
        raise InvalidSpec(
            f"the requirements are over {_contract.MAX_REQUIREMENTS_BYTES} bytes", status=None
        )
    return text


def _environment(
    requirements: Sequence[str] | str | os.PathLike[str] | None,
    python: str | None,
    index_url: str | None,
    find_links: Sequence[str | os.PathLike[str]] | None,
    no_index: bool,
) -> dict[str, Any] | None:
    """The spec's ``environment`` (``None`` without ``requirements`` and ``python``).

    :raises InvalidSpec: an invalid value, or index options without an environment."""
    _check_flag("no_index", no_index)
    if requirements is None and python is None:
        if index_url is not None or find_links is not None or no_index:
            raise InvalidSpec(
                "index_url, find_links and no_index apply to an environment: give "
                "requirements (or python) too",
                status=None,
            )
        return None
    if python is not None and (
        not isinstance(python, str) or not PYTHON_VERSION_PATTERN.fullmatch(python)
    ):
        raise InvalidSpec(f'python must be "3.X" or "3.X.Y", got {python!r}', status=None)
    links = [os.fspath(x) for x in find_links or []]
    if isinstance(find_links, (str, bytes)) or not all(isinstance(x, str) and x for x in links):
        raise InvalidSpec(
            f"find_links must be a list of directories or URLs, got {find_links!r}", status=None
        )
    if len(links) > _contract.MAX_FIND_LINKS:
        raise InvalidSpec(
            f"at most {_contract.MAX_FIND_LINKS} find_links, got {len(links)}", status=None
        )
    if index_url is not None and not isinstance(index_url, str):
        raise InvalidSpec(f"index_url must be a str, got {index_url!r}", status=None)
    return {
        "requirements": "" if requirements is None else _requirements_text(requirements),
        "python": python or "",
        "index_url": index_url or "",
        # Worker paths made absolute here, as every spec path; URLs as they are.
        "find_links": [x if "://" in x else os.path.abspath(x) for x in links],
        "no_index": no_index,
    }


def _func_keyword(kwargs: dict[str, Any]) -> Any:
    """The function of ``run(func=fn, ...)`` (the product brief's spelling), taken out of
    the keywords meant for it.

    :raises TypeError: no function at all."""
    if "func" not in kwargs:
        raise TypeError("run() needs a function: run(fn, *args, **kwargs) or run(func=fn)")
    return kwargs.pop("func")


def _logs_params(
    follow: bool, rank: int | None, tail: int | None, cursor: str | None
) -> dict[str, str]:
    """The query of a log stream.

    :raises InvalidSpec: ``tail`` is not an int ``0..=MAX_TAIL``, or comes with a
        ``cursor``."""
    params = {"follow": "true" if follow else "false"}
    if rank is not None:
        params["rank"] = str(rank)
    if tail is not None:
        if isinstance(tail, bool) or not isinstance(tail, int) or not 0 <= tail <= MAX_TAIL:
            raise InvalidSpec(f"tail must be an int 0..={MAX_TAIL}, got {tail!r}", status=None)
        if cursor:
            raise InvalidSpec("tail and cursor exclude each other", status=None)
        params["tail"] = str(tail)
    return params


class Client:
    """A client of one Cumulus cluster's coordinators.

    :param addresses: coordinator HTTP addresses (``host:port``, a list or a
        comma-separated string); default ``$CUMULUS_HTTP``, else the local cluster's
        ``cluster.json``.
    :param token: the bearer token (the cluster's, or a user's from ``cumulusctl token
        create``); default from ``token_file``, ``$CUMULUS_TOKEN``,
        ``$CUMULUS_TOKEN_FILE`` or the local cluster's token file (only ``token`` and
        ``token_file`` with ``tls_cert``).
    :param tls_ca: the cluster's CA certificate (PEM), as ``cumulusctl --tls-ca``: talk
        HTTPS and trust only this CA; default ``$CUMULUS_TLS_CA``, else the local
        cluster's (``<tls_dir>/ca.pem`` in ``cluster.json``) when the addresses come from
        it. Explicit addresses need it (or ``insecure``).
    :param tls_cert: a user's client certificate (PEM), as ``cumulusctl --tls-cert``:
        ``<CA dir>/user-NAME.pem`` from ``cumulusctl certs issue user NAME --dir CA_DIR``;
        with ``tls_key``, presented to the coordinators, which take a request without a
        token as that user's, with the role the cluster gave them (``cumulusctl token
        create NAME --role ...``; revoking the user revokes the certificate). Only
        ``token``/``token_file`` then give a token, which decides alone when given (never
        ``$CUMULUS_TOKEN*`` nor the local cluster's). Needs a CA (``tls_ca`` or the local
        cluster's); not with ``insecure``. Default ``$CUMULUS_TLS_CERT``.
    :param tls_key: the private key of ``tls_cert`` (PEM, unencrypted:
        ``<CA dir>/user-NAME-key.pem``); both or neither. Default ``$CUMULUS_TLS_KEY``.
    :param insecure: talk plaintext HTTP to a cluster started with ``--insecure``, as
        ``cumulusctl --insecure``; default ``$CUMULUS_INSECURE`` (``1``, ``true``,
        ``yes``). Not together with a CA.
    :param local_dir: the local cluster's directory (default ``$CUMULUS_LOCAL_DIR``, else
        ``.cumulus``).
    :param timeout_s: time limit of one HTTP request, in seconds.
    :param connect_timeout_s: TCP connect time limit, in seconds.
    :param retry_max_tries: most tries of one call over all addresses.
    :param retry_total_s: no new try starts this many seconds after the first.
    :param transport: an httpx transport (tests; it brings its own TLS settings).
    :raises ConfigError: no address, token or TLS setting could be resolved, the CA
        file is missing, unreadable or not PEM, or the client certificate or key is
        missing, unreadable, not PEM, encrypted, not a user's, or they do not match, or
        only one of them is given, or one is given with ``insecure`` (the message names
        the file or setting).
    """

    def __init__(
        self,
        addresses: str | Sequence[str] | None = None,
        *,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        insecure: bool | None = None,
        local_dir: str | os.PathLike[str] | None = None,
        timeout_s: float = _contract.REQUEST_TIMEOUT_MS / 1000,
        connect_timeout_s: float = _contract.CONNECT_TIMEOUT_MS / 1000,
        retry_max_tries: int = _contract.RETRY_MAX_TRIES,
        retry_total_s: float = _contract.RETRY_TOTAL_MS / 1000,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.connection: Connection = resolve(
            addresses,
            token=token,
            token_file=token_file,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            insecure=insecure,
            local_dir=local_dir,
        )
        self.retry_max_tries = max(1, retry_max_tries)
        self.retry_total_s = retry_total_s
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        conn = self.connection
        tls = conn.ssl_context
        if conn.token is not None:
            headers = {"Authorization": f"Bearer {conn.token}"}
            self._unauthorized_hint = TOKEN_HINT
        else:
            # No token: the client certificate alone authenticates (a token would decide).
            headers = {}
            self._unauthorized_hint = (
                f"the client certificate {conn.cert_file} was refused: its user must exist "
                "on the cluster (`cumulusctl token create NAME`) and not be revoked"
            )
        self._http = httpx.Client(
            timeout=self._timeout,
            transport=transport,
            headers=headers,
            # Only the cluster's CA (and the user's certificate, when given): every URL
            # (configured, leader hint, log stream) is https:// with it, http:// without.
            verify=tls if tls is not None else True,
            # Coordinators are addressed directly (often on loopback): no proxies, and no
            # SSL_CERT_FILE from the environment.
            trust_env=False,
        )
        # The address that answered last (maybe a leader hint outside the configured list).
        self._preferred = self.connection.addresses[0]

    @property
    def addresses(self) -> tuple[str, ...]:
        """The configured coordinator base URLs (``https://host:port`` with TLS, else
        ``http://host:port``)."""
        return self.connection.addresses

    def __repr__(self) -> str:
        return f"Client({list(self.addresses)!r})"

    def close(self) -> None:
        """Closes the connections."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport -------------------------------------------------------------------

    def _backoff_s(self, retry: int) -> float:
        initial_s = _contract.RETRY_BACKOFF_INITIAL_MS / 1000
        return float(min(initial_s * 2 ** max(retry - 1, 0), _contract.RETRY_BACKOFF_MAX_MS / 1000))

    def _request(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
    ) -> Any:
        """Sends one call with leader following and rotation; returns the parsed JSON.

        :raises ApiError: the mapped error of a definitive answer, or
            :class:`Unavailable` once the retry budget is spent."""
        resp, base = self._call(
            method,
            path,
            lambda base: self._http.request(method, base + path, json=body, params=params),
        )
        try:
            return resp.json()
        except ValueError as e:
            raise ProtocolError(
                f"{method} {path}: the answer is not JSON: {resp.text[:200]!r}",
                status=resp.status_code,
                address=base,
            ) from e

    def _call(
        self, method: str, path: str, send: Callable[[str], httpx.Response]
    ) -> tuple[httpx.Response, str]:
        """Sends one call with leader following and rotation: ``send(base)`` makes one
        try against the coordinator at ``base``. Returns the first successful (2xx)
        response and its coordinator; a streamed response is the caller's to close.

        :raises ApiError: the mapped error of a definitive answer, or
            :class:`Unavailable` once the retry budget is spent."""
        addrs = list(self.addresses)
        start = time.monotonic()
        index = addrs.index(self._preferred) if self._preferred in addrs else 0
        base = self._preferred
        hint_hops = 0
        rotations = 0
        tries = 0
        last = "no try made"
        while True:
            tries += 1
            try:
                resp = send(base)
            except httpx.TransportError as e:
                last = f"{base}: {type(e).__name__}: {e}"
                leader = None
            else:
                if resp.is_success:
                    self._preferred = base
                    return resp, base
                try:
                    resp.read()
                finally:
                    resp.close()
                if resp.status_code != 503:
                    _raise_for(resp, base, self._unauthorized_hint)
                last = f"{base}: HTTP 503: {_error_text(resp)}"
                leader = resp.headers.get(LEADER_HTTP_HEADER)
            elapsed = time.monotonic() - start
            if tries >= self.retry_max_tries or elapsed >= self.retry_total_s:
                raise Unavailable(
                    f"{method} {path}: no coordinator answered after {tries} tries in "
                    f"{elapsed * 1000:.0f} ms (last: {last})",
                    status=None,
                    address=base,
                )
            hinted = None
            if leader:
                try:
                    hinted = normalize_address(
                        leader, LEADER_HTTP_HEADER, scheme=self.connection.scheme
                    )
                except ValueError:
                    hinted = None
            # Follow a hint at once, but not around in circles between stale hints.
            if hinted is not None and hinted != base and hint_hops < len(addrs) + 2:
                hint_hops += 1
                base = hinted
                continue
            rotations += 1
            index = (index + 1) % len(addrs)
            base = addrs[index]
            time.sleep(min(self._backoff_s(rotations), max(0.0, self.retry_total_s - elapsed)))

    # -- jobs ------------------------------------------------------------------------

    def submit(
        self,
        command: Sequence[str],
        *,
        world_size: int | tuple[int, int] = 1,
        dataset: str | os.PathLike[str] | None = None,
        ckpt_dir: str | os.PathLike[str] | None = None,
        ckpt_keep: int | None = None,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        working_dir: str | os.PathLike[str] | None = None,
        max_restarts: int | None = None,
        restart_scope: str | None = None,
        backoff_initial_ms: int | None = None,
        backoff_max_ms: int | None = None,
        progress_timeout_s: float | None = None,
        startup_timeout_s: float | None = None,
        ckpt_url: str | None = None,
        ckpt_commit_tier: str | None = None,
        gpus_per_rank: int | None = None,
        gpu_memory_fraction: float | None = None,
        request_id: str | None = None,
        allow_pending: bool = False,
        stop_grace_s: float | None = None,
        time_limit_s: float | None = None,
        signal_before_s: float | None = None,
        priority: int | None = None,
        resume_from: str | tuple[str, int] | None = None,
        preemptible: bool = False,
        fail_fast: bool = True,
        upload: str | os.PathLike[str] | PackedDir | None = None,
        upload_max_bytes: int = _contract.DEFAULT_MAX_WORKDIR_BYTES,
        requirements: Sequence[str] | str | os.PathLike[str] | None = None,
        python: str | None = None,
        index_url: str | None = None,
        find_links: Sequence[str | os.PathLike[str]] | None = None,
        no_index: bool = False,
        warm_spares: int | None = None,
        warm_imports: Sequence[str] | None = None,
        straggler_action: str | None = None,
        straggler_fraction: float | None = None,
        straggler_window_s: float | None = None,
    ) -> Job:
        """Submits a job: ``command`` (argv; ``argv[0]`` is looked up in the worker's
        ``PATH``) run by ``world_size`` ranks. Relative paths are made absolute here, as
        ``cumulusctl submit`` does (the workers resolve them elsewhere).

        :param world_size: the number of ranks, or ``(MIN, MAX)`` for an elastic job: it
            starts with as many ranks as fit (at least MIN), continues with fewer when a
            lost worker's ranks have no room, and grows back at a checkpoint boundary;
            the records not consumed are dealt over the new ranks exactly once
            (:class:`cumulus.runtime.ElasticData`).
        :param dataset: directory whose regular files (sorted) are the shards, or an
            ``s3://`` prefix.
        :param ckpt_dir: checkpoint root; checkpoints are disabled without it.
        :param ckpt_keep: committed steps to keep (cluster default 3).
        :param env: extra environment of every rank (the rank contract variables win).
        :param max_restarts: job-wide restart budget (cluster default 3).
        :param restart_scope: ``"group"`` (default: restart every rank) or ``"rank"``.
        :param backoff_initial_ms: delay before the first restart, milliseconds.
        :param backoff_max_ms: upper bound of the restart delay, milliseconds.
        :param progress_timeout_s: a rank whose reported step does not advance for this
            many seconds after its first progress report is declared hung and restarted
            (``None``/0: off). Choose a few times the longest gap between two reports.
        :param startup_timeout_s: the longest time from a rank's process start to its
            first progress report (interpreter, imports, data loading, rendezvous) before
            it is declared hung, ``0 < s <= 7 days``. ``None``: the cluster's default
            (:data:`DEFAULT_STARTUP_TIMEOUT_S`, 10 minutes) when ``progress_timeout_s``
            is set, no bound otherwise.
        :param ckpt_url: S3 checkpoint target ``s3://bucket/prefix``.
        :param ckpt_commit_tier: with ``ckpt_url``: ``"l2"`` (default) or ``"l1"``.
        :param gpus_per_rank: whole GPUs each rank gets (0..=64; ``None``/0: none), distinct
            GPUs of its worker named (by UUID) in its ``CUDA_VISIBLE_DEVICES``; the job's
            ranks are packed onto as few workers as possible. A job the alive workers can
            never hold stays pending (``JobInfo.pending_reason`` says why).
        :param gpu_memory_fraction: share of one GPU each rank gets, ``0 < f <= 1`` in
            steps of 0.001: ranks of this and other jobs share a GPU while their fractions
            sum to at most 1. Implies one GPU per rank (``gpus_per_rank`` ``None``, 0 or
            1). Cooperative: the rank sees it as ``CUMULUS_GPU_MEMORY_FRACTION`` and
            :func:`cumulus.runtime.apply_gpu_memory_fraction` passes it to PyTorch; nothing
            enforces it.
        :param request_id: idempotency key (1..=128 bytes); default a random one, reused
            by every retry of this call.
        :param stop_grace_s: seconds between SIGTERM and SIGKILL when a rank is stopped
            (0..=3600; room for a last checkpoint); default: the agent's (5 s).
        :param time_limit_s: the job's running time limit, in seconds (``0 <
            time_limit_s <= 365 days``; kept in milliseconds); pending and paused time
            does not count (``JobInfo.running_ms``). At the limit the job ends
            ``timed_out``. ``None``: no limit.
        :param signal_before_s: with ``time_limit_s``: how long before the limit the ranks
            are asked to checkpoint and stop (they see
            :func:`cumulus.runtime.stop_request` ``== "time_limit"``), in seconds, ``0 <
            signal_before_s < time_limit_s``; their SIGTERM still comes at the limit.
            ``None``: no earlier request (0 ms).
        :param priority: queue priority, ``-1000..=1000`` (``None``: 0); pending jobs
            start highest priority first, in submission order within one priority, and a
            job behind a waiting one starts first only when it cannot delay it.
        :param resume_from: start from a committed checkpoint step of an earlier job
            (as ``cumulusctl submit --resume-from JOB[@STEP]``): ``"job-000012"`` (its
            newest committed step, chosen by the coordinator), ``"job-000012@400"`` or
            ``("job-000012", 400)`` (step 400). The job must have that job's world size
            and shard plan; its dataset and checkpoint target (``dataset``, ``ckpt_dir``,
            ``ckpt_url``, ``ckpt_commit_tier``) are taken from it when left out. The
            step is kept until this job commits one of its own. The caller must own that
            job (or be an admin). ``None``: from scratch.
        :param preemptible: the job may be preempted: when a job of higher priority
            waits for its slots, its ranks are asked to checkpoint and stop (they see
            :func:`cumulus.runtime.stop_request` ``== "preempt"``) and it is queued
            again, resuming from that step; no restart budget is spent. ``False``
            (default): never preempted.
        :param fail_fast: ``True`` (default): a first attempt whose ranks all exit
            non-zero within 10 s of their start, before any progress report, with the
            same exit code and error (a mistyped script path: "can't open file") fails
            the job at once with that error, spending no restart. ``False``: such a
            failure is restarted under the budget like any other, for programs whose
            first start may fail by chance.
        :param upload: a local directory sent as the ranks' working directory: packed
            (``.git`` left out, ``.gitignore`` and ``.cumulusignore`` honoured) and
            stored in the cluster's blob store unless it has the same digest already
            (an unchanged directory sends nothing; :attr:`Job.upload` says what was
            sent). Each rank attempt runs in a fresh unpacked copy of it. Not with
            ``working_dir``.
        :param upload_max_bytes: largest packed ``upload`` accepted, in bytes (default
            512 MiB); past it :class:`~cumulus.errors.WorkdirTooLarge` names the largest
            files.
        :param requirements: the ranks' Python environment: requirement lines
            (``["numpy==2.1", "torch"]``) or the path of a requirements file, installed
            with uv into a virtual environment each worker builds once and caches (the
            ranks' ``python3`` is its interpreter). A failed install fails the job once,
            spending no restart.
        :param python: the environment's Python, ``"3.X"`` or ``"3.X.Y"`` (default: the
            worker's ``python3``); alone, a bare environment of that version.
        :param index_url: the package index of the environment (uv's ``--index-url``).
        :param find_links: directories (on the workers) or URLs with packages (uv's
            ``--find-links``), at most 16.
        :param no_index: use ``find_links`` only (uv's ``--no-index``).
        :param warm_spares: idle interpreters each worker keeps for the job (0..=8;
            ``None``/0: none), started in its environment with ``warm_imports`` done and
            holding no slot and no GPU: a replacement rank on that worker takes one
            instead of starting Python and importing again (its pid is the spare's).
            Needs a command ``python SCRIPT ...`` or ``python -m MODULE ...``.
        :param warm_imports: modules the spares import before they get a rank (e.g.
            ``["torch", "numpy"]``); none may touch a GPU on import.
        :param straggler_action: what the leader does about a straggler, a rank whose
            steps/s (from its progress reports) stays below ``straggler_fraction`` of the
            median of the job's other ranks for ``straggler_window_s``: ``"warn"``
            (``None``: the default; an event, :attr:`RankInfo.straggler`,
            :attr:`JobInfo.stragglers`), ``"restart"`` (its attempt restarts under the
            restart policy, spending budget, on another worker when one has room),
            ``"exclude"`` (it runs on; its worker is avoided in the job's later
            placements) or ``"off"``.
        :param straggler_fraction: ``0.1 <= f <= 0.95`` (``None``: 0.7).
        :param straggler_window_s: seconds a rank must stay below to be flagged, ``2 <=
            s <= 86400`` (``None``: 60).
        :param allow_pending: accept a job larger than the alive workers offer in all
            (slots, GPUs); it stays pending until workers join. Without it the
            coordinator refuses such a job (:class:`InvalidSpec`).
        :returns: the job's handle (``created`` says whether this call created it).
        :raises InvalidSpec: the coordinator refused the spec (the message says why),
            or an argument is invalid (checked here first; a ``ValueError``).
        :raises WorkdirTooLarge: ``upload`` packs to more than ``upload_max_bytes``.
        :raises BundleError: ``upload`` cannot be packed (a symbolic link or special
            file in it, an unreadable file...).
        :raises Unauthorized: wrong token.
        :raises Unavailable: no coordinator could take the write.
        """
        argv = _argv(command)
        environment = _environment(requirements, python, index_url, find_links, no_index)
        if upload is not None and working_dir is not None:
            raise InvalidSpec(
                "upload and working_dir exclude each other: the ranks run in the uploaded "
                "directory",
                status=None,
            )
        min_world_size, world_size = _elastic_world_size(world_size)
        rid = _request_id(request_id)
        env_map = _env_map(env)
        _check_gpus(gpus_per_rank, gpu_memory_fraction)
        time_limit_ms, signal_before_ms = _time_limit_ms(time_limit_s, signal_before_s)
        resume = _resume_from(resume_from)
        _check_flag("preemptible", preemptible)
        _check_flag("fail_fast", fail_fast)
        restart = _restart_policy(restart_scope, max_restarts, backoff_initial_ms, backoff_max_ms)
        warm = _warm_spares(warm_spares, warm_imports, argv)
        stragglers = _straggler_fields(straggler_action, straggler_fraction, straggler_window_s)
        spec: dict[str, Any] = {
            "name": name or "",
            "world_size": world_size,
            "command": argv,
            "env": env_map,
            "dataset": _absolute(dataset),
            "ckpt_dir": _absolute(ckpt_dir),
            "restart": restart,
            "progress_timeout_ms": round((progress_timeout_s or 0) * 1000),
            "startup_timeout_ms": _startup_timeout_ms(startup_timeout_s),
            "working_dir": _absolute(working_dir),
            "ckpt_url": ckpt_url or "",
            "ckpt_commit_tier": ckpt_commit_tier or "",
        }
        if min_world_size:
            spec["min_world_size"] = min_world_size
        stop_grace_ms = _stop_grace_ms(stop_grace_s)
        _check_priority(priority)
        spec |= _optional_spec_fields(
            ckpt_keep=ckpt_keep,
            gpus_per_rank=gpus_per_rank,
            gpu_memory_fraction=gpu_memory_fraction,
            stop_grace_ms=stop_grace_ms,
            priority=priority,
            time_limit_ms=time_limit_ms,
            signal_before_ms=signal_before_ms,
            resume=resume,
            preemptible=preemptible,
        )
        if not fail_fast:
            spec["fail_fast"] = False
        spec |= warm
        spec |= stragglers
        if environment is not None:
            spec["environment"] = environment
        uploaded = None
        if upload is not None:
            uploaded = _transfer.upload_directory(self, upload, max_bytes=upload_max_bytes)
            spec["workdir"] = uploaded.blob.to_json()
        request: dict[str, Any] = {"request_id": rid, "spec": spec}
        if allow_pending:
            request["allow_pending"] = True
        body = self._request("POST", "/v1/jobs", body=request)
        if not isinstance(body, dict) or not isinstance(body.get("job_id"), str):
            raise ProtocolError(f"submit: malformed answer {body!r}")
        said = body.get("warnings") or []
        if not isinstance(said, list) or not all(isinstance(w, str) for w in said):
            raise ProtocolError(f"submit: malformed warnings {said!r}")
        job = Job(
            self,
            body["job_id"],
            created=bool(body.get("created", True)),
            request_id=rid,
            upload=uploaded,
            warnings=tuple(said),
        )
        if not _QUIET_SUBMIT.get():
            for text in job.warnings:
                warnings.warn(f"{job.id}: {text}", SubmitWarning, stacklevel=2)
        return job

    def run_command(
        self,
        command: Sequence[str],
        *,
        timeout_s: float | None = None,
        **submit_args: Any,
    ) -> JobInfo:
        """Submits a job running ``command`` (arguments as :meth:`submit`) and waits
        until it finishes.

        :param timeout_s: give up waiting after this many seconds (the job keeps running).
        :returns: the final status of a job that succeeded.
        :raises JobFailed: the job failed, was cancelled or timed out
            (``.job.failure_cause``).
        :raises WaitTimeout: ``timeout_s`` passed first.
        :raises: as :meth:`submit`.
        """
        job = self.submit(command, **submit_args)
        info = job.wait(timeout_s=timeout_s)
        if not info.succeeded:
            cause = f": {info.failure_cause}" if info.failure_cause else ""
            raise JobFailed(f"job {info.id} {info.state}{cause}", info)
        return info

    def run(
        self,
        fn: Callable[..., Any] | Sequence[str] | None = None,
        /,
        *args: Any,
        world_size: int = 1,
        gpus_per_rank: int | None = None,
        gpu_memory: float | None = None,
        duration: float | None = None,
        requirements: Sequence[str] | str | os.PathLike[str] | None = None,
        upload: str | os.PathLike[str] | None = None,
        gather: bool = False,
        timeout: float | None = None,
        ckpt_dir: str | os.PathLike[str] | None = None,
        max_restarts: int | None = None,
        options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Runs ``fn(*args, **kwargs)`` on ``world_size`` ranks of the cluster and
        returns rank 0's return value (with ``gather``: every rank's, a list in rank
        order). :meth:`run_async` then :meth:`Job.result`; see :meth:`run_async` for the
        arguments.

        ``client.run(func=fn, ...)`` is the same as ``client.run(fn, ...)``.
        ``client.run(["python", "train.py"], timeout_s=60, **submit_args)`` (a command,
        not a function) is :meth:`run_command`, as in earlier versions.

        :param timeout: give up waiting after this many seconds (the job keeps running;
            :class:`~cumulus.errors.WaitTimeout`).
        :raises RemoteError: ``fn`` raised on a rank (its type, message and traceback),
            or its result could not be delivered (too large, not picklable).
        :raises PythonVersionMismatch: the ranks' Python is not this client's
            ``major.minor``; the job failed at once.
        :raises JobFailed: the job failed otherwise, was cancelled or timed out.
        :raises: as :meth:`run_async`.
        """
        if fn is None:
            fn = _func_keyword(kwargs)
        if not callable(fn):
            return self._run_command_form(
                fn,
                args,
                {
                    "world_size": world_size,
                    "gpus_per_rank": gpus_per_rank,
                    "gpu_memory_fraction": gpu_memory,
                    "time_limit_s": duration,
                    "requirements": requirements,
                    "upload": upload,
                    "ckpt_dir": ckpt_dir,
                    "max_restarts": max_restarts,
                },
                timeout,
                kwargs,
            )
        job = self.run_async(
            fn,
            *args,
            world_size=world_size,
            gpus_per_rank=gpus_per_rank,
            gpu_memory=gpu_memory,
            duration=duration,
            requirements=requirements,
            upload=upload,
            gather=gather,
            ckpt_dir=ckpt_dir,
            max_restarts=max_restarts,
            options=options,
            **kwargs,
        )
        return job.result(timeout=timeout)

    def _run_command_form(
        self,
        command: Sequence[str],
        args: tuple[Any, ...],
        named: dict[str, Any],
        timeout: float | None,
        kwargs: dict[str, Any],
    ) -> JobInfo:
        """``run(command, ...)``: :meth:`run_command` with the arguments given."""
        if args:
            raise TypeError("run(command, ...) takes the command alone, then keywords")
        if not isinstance(command, Sequence):
            raise TypeError(f"run() needs a function (or a command), got {command!r}")
        submit_args = {k: v for k, v in named.items() if v is not None}
        if submit_args.get("world_size") == 1:
            del submit_args["world_size"]
        timeout_s = kwargs.pop("timeout_s", timeout)
        return self.run_command(command, timeout_s=timeout_s, **submit_args, **kwargs)

    def run_async(
        self,
        fn: Callable[..., Any] | None = None,
        /,
        *args: Any,
        world_size: int = 1,
        gpus_per_rank: int | None = None,
        gpu_memory: float | None = None,
        duration: float | None = None,
        requirements: Sequence[str] | str | os.PathLike[str] | None = None,
        upload: str | os.PathLike[str] | None = None,
        gather: bool = False,
        ckpt_dir: str | os.PathLike[str] | None = None,
        max_restarts: int | None = None,
        options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Job:
        """Submits ``fn(*args, **kwargs)`` to run on every one of ``world_size`` ranks and
        returns the job's handle (:meth:`Job.result` waits for the value;
        :meth:`Job.pause`, :meth:`Job.resume`, :meth:`Job.cancel`, :meth:`Job.logs`,
        :meth:`Job.checkpoints`, :meth:`Job.artifacts` as for any job).

        The function and its arguments are pickled by value with cloudpickle (its module
        too when it is your own code rather than an installed package) and sent, with
        copies of ``cumulus`` and ``cloudpickle``, in the job's working directory; each
        rank runs it with the worker's ``python3`` (or the environment's, with
        ``requirements``) inside the rank runtime, so :mod:`cumulus.runtime` works in it
        (:func:`~cumulus.runtime.get_context`, checkpoints, :func:`~cumulus.runtime.resume`
        after a restart, :func:`~cumulus.runtime.should_pause`). Rank 0 (every rank with
        ``gather``) writes its pickled return value into its ``$CUMULUS_OUTPUT_DIR``; an
        exception is written there as its type, message and traceback, and the rank
        exits 1 (the job restarts within its budget, as for any failure; a function that
        checkpoints resumes). A function pickled by this client's Python needs the same
        ``major.minor`` on the ranks: otherwise the job fails at once, spending no
        restart. A function may ``sys.exit(0)`` (after its checkpoint for a pause):
        nothing is written then.

        The names below are options of the run; every other keyword is passed to
        ``fn`` (to pass one of these names to it, bind it with ``functools.partial``).

        :param world_size: ranks to run ``fn`` on (``torch.distributed`` is set up by
            the rank environment: ``MASTER_ADDR``, ``RANK``...).
        :param gpus_per_rank: whole GPUs each rank gets (see :meth:`submit`).
        :param gpu_memory: share of one GPU each rank gets, ``0 < f <= 1``
            (:meth:`submit`'s ``gpu_memory_fraction``).
        :param duration: the job's time limit in seconds (:meth:`submit`'s
            ``time_limit_s``).
        :param requirements: packages the ranks need (requirement lines or a
            requirements file): an environment built on each worker with this client's
            Python ``major.minor`` (unless ``options`` names a ``python``).
        :param upload: a local directory sent as the ranks' working directory (see
            :meth:`submit`): importable by ``fn`` (it is the rank's current directory).
        :param gather: return every rank's value, a list in rank order.
        :param ckpt_dir: the job's checkpoint root (needed for
            :func:`cumulus.runtime.checkpoint` in ``fn``).
        :param max_restarts: the job's restart budget (cluster default 3).
        :param options: further :meth:`submit` arguments (``env``, ``name``,
            ``dataset``, ``ckpt_url``, ``backoff_initial_ms``, ``find_links``,
            ``no_index``, ``python``...), and ``max_result_bytes`` (default 64 MiB: past
            it the rank writes an error instead of the value).
        :raises TypeError: ``fn`` is not callable, or it or its arguments cannot be
            pickled.
        :raises: as :meth:`submit`.
        """
        if fn is None:
            fn = _func_keyword(kwargs)
        if not callable(fn):
            raise TypeError(f"run_async() needs a function, got {fn!r}")
        _check_flag("gather", gather)
        opts = dict(options or {})
        for taken in ("command", "working_dir", "upload", "requirements", "world_size"):
            if taken in opts:
                raise TypeError(f"options may not set {taken!r}: it is run's own")
        max_result_bytes = opts.pop("max_result_bytes", _contract.DEFAULT_MAX_RESULT_BYTES)
        if isinstance(max_result_bytes, bool) or not isinstance(max_result_bytes, int):
            raise InvalidSpec(f"max_result_bytes must be an int, got {max_result_bytes!r}")
        if requirements is not None and "python" not in opts:
            opts["python"] = _remote.client_python()
        opts["env"] = {**_remote.RUN_ENV, **dict(opts.get("env") or {})}
        for name, value in (
            ("gpus_per_rank", gpus_per_rank),
            ("gpu_memory_fraction", gpu_memory),
            ("time_limit_s", duration),
            ("ckpt_dir", ckpt_dir),
            ("max_restarts", max_restarts),
        ):
            if value is not None:
                if name in opts:
                    raise TypeError(f"{name!r} is given twice (as an argument and in options)")
                opts[name] = value
        upload_max = opts.pop("upload_max_bytes", _contract.DEFAULT_MAX_WORKDIR_BYTES)
        with _remote.function_bundle(fn, args, kwargs, max_result_bytes=max_result_bytes) as d:
            packed = _bundle.pack_directory(
                upload, mounts={_remote.RUN_DIR: d}, max_bytes=upload_max
            )
        # A function is run again whole on a restart: no warning that restarts without
        # checkpoints start over (they are in Job.warnings all the same).
        quiet = _QUIET_SUBMIT.set(True)
        try:
            with packed:
                job = self.submit(
                    _remote.run_command(gather),
                    world_size=world_size,
                    upload=packed,
                    requirements=requirements,
                    **opts,
                )
        finally:
            _QUIET_SUBMIT.reset(quiet)
        job.gather = gather
        return job

    def job(self, job_id: str) -> Job:
        """The handle of an existing job (no request is made)."""
        return Job(self, job_id)

    def get_job(self, job_id: str, *, linearizable: bool = True) -> JobInfo:
        """A job's current status.

        :param linearizable: read through the leader's read index (sees every write
            acknowledged before); ``False`` reads the answering coordinator's state, which
            may lag.
        :raises NotFound: no such job.
        """
        body = self._request(
            "GET",
            f"/v1/jobs/{job_id}",
            params={"linearizable": "true" if linearizable else "false"},
        )
        job = body.get("job") if isinstance(body, dict) else None
        if job is None:
            raise ProtocolError(f"GET /v1/jobs/{job_id}: the answer has no job")
        return JobInfo.from_json(job)

    def jobs(self, *, linearizable: bool = True) -> list[JobInfo]:
        """Every job the cluster keeps (finished jobs are evicted past the state budget)."""
        body = self._request(
            "GET", "/v1/jobs", params={"linearizable": "true" if linearizable else "false"}
        )
        jobs = body.get("jobs") if isinstance(body, dict) else None
        return [JobInfo.from_json(j) for j in jobs or []]

    def summary(self, job_id: str) -> JobSummary:
        """A job's progress in one record: its step (its slowest rank's), rate, time
        left, latest metrics, running and paused time, and its progress history (at most
        240 samples, oldest first). After a leader change (``live`` false) the figures
        come from the replicated record only until its ranks report again.

        :raises InvalidSpec: ``job_id`` is not a job id (checked here, nothing sent).
        :raises NotFound: no such job.
        """
        path = f"/v1/jobs/{_check_job_id(job_id)}/summary"
        return JobSummary.from_json(self._request("GET", path))

    def summaries(self, state: str | None = None, limit: int | None = None) -> list[JobSummary]:
        """The summaries (see :meth:`summary`) of the newest jobs, newest first, without
        their history.

        :param state: only jobs in this state (one of
            :data:`~cumulus.models.JOB_STATES`); ``None``: any state.
        :param limit: at most this many, ``1..=10000``; ``None``: the coordinator's
            default (1000).
        :raises InvalidSpec: ``state`` or ``limit`` is invalid (checked here, nothing
            sent; a ``ValueError``), or the coordinator refused the request.
        """
        params = _summaries_params(state, limit)
        body = self._request("GET", "/v1/jobs/summaries", params=params)
        if not isinstance(body, dict):
            raise ProtocolError(f"GET /v1/jobs/summaries: malformed answer {body!r}")
        items = body.get("summaries")
        if items is None:
            return []
        if not isinstance(items, list):
            raise ProtocolError(f"GET /v1/jobs/summaries: malformed answer {body!r}")
        return [JobSummary.from_json(s) for s in items]

    def cancel(self, job_id: str) -> JobInfo:
        """Cancels a job (its ranks get SIGTERM, then SIGKILL after the agent's grace).
        Cancelling a job already cancelled returns its status.

        :raises NotFound: no such job.
        :raises Conflict: the job already finished otherwise (succeeded or failed).
        """
        try:
            body = self._request("POST", f"/v1/jobs/{job_id}/cancel")
        except Conflict:
            # A retried cancel whose first try went through, or a second cancel.
            info = self.get_job(job_id)
            if info.state == _contract.JobState.CANCELLED.value:
                return info
            raise
        return self._job_answer(f"/v1/jobs/{job_id}/cancel", body)

    def pause(self, job_id: str) -> JobInfo:
        """Pauses a job: its ranks are asked to commit a checkpoint at their current step
        and exit (:func:`cumulus.runtime.should_pause` is true for them), then SIGTERM
        and SIGKILL follow as for a cancel; the job's state becomes ``paused`` (its
        ``stop_action`` is ``"pause"`` meanwhile) and it holds no slots. A pending job is
        paused at once. :meth:`resume` continues it from its latest committed step.
        Pausing a job already paused, or whose pause is in flight, returns its status.

        :raises NotFound: no such job.
        :raises Conflict: the job cannot be paused now (it finished, or another stop of
            it is in flight).
        :raises Forbidden: the job is another user's.
        """
        path = f"/v1/jobs/{job_id}/pause"
        try:
            body = self._request("POST", path)
        except Conflict:
            # A retried pause whose first try went through, or a second pause.
            info = self.get_job(job_id)
            paused = _contract.JobState.PAUSED.value
            pausing = info.stop_action == _contract.StopAction.PAUSE.value
            if info.state == paused or (pausing and not info.finished):
                return info
            raise
        return self._job_answer(path, body)

    def resume(self, job_id: str) -> JobInfo:
        """Resumes a paused job: it is queued again (state ``pending``) and its ranks
        restart from its latest committed step (:func:`cumulus.runtime.resume`).
        Resuming a job that is pending or running with no stop in flight returns its
        status (a retried resume).

        :raises NotFound: no such job.
        :raises Conflict: the job is not paused (it finished, or its pause is still in
            flight: wait until it is ``paused``).
        :raises Forbidden: the job is another user's.
        """
        path = f"/v1/jobs/{job_id}/resume"
        try:
            body = self._request("POST", path)
        except Conflict:
            # A retried resume whose first try went through.
            info = self.get_job(job_id)
            queued = (_contract.JobState.PENDING.value, _contract.JobState.RUNNING.value)
            if info.state in queued and not info.stop_action:
                return info
            raise
        return self._job_answer(path, body)

    def delete(self, job_id: str, *, checkpoints: bool = False) -> bool:
        """Deletes a finished job (``succeeded``, ``failed``, ``cancelled`` or
        ``timed_out``): its record is gone from the cluster (:meth:`get_job` then raises
        :class:`NotFound`, :meth:`jobs` no longer lists it). Its checkpoints are kept
        unless ``checkpoints`` is true.

        A pending, running or paused job is refused: :meth:`cancel` it and wait until it
        is ``cancelled`` first.

        :param checkpoints: also delete the job's checkpoints: its directory
            ``<ckpt_dir>/<job_id>`` (local) or its prefix under ``ckpt_url`` (S3).
        :returns: whether checkpoints were deleted (``False`` without ``checkpoints``,
            or when the job had none to delete).
        :raises InvalidSpec: ``job_id`` is not a job id or ``checkpoints`` is not a
            ``bool`` (checked here, nothing sent), or the coordinator refused the request.
        :raises NotFound: no such job. A delete retried after a lost answer (a dropped
            connection, a leader change) whose first try went through sees this too.
        :raises Conflict: the job has not finished (the message says its state).
        :raises Forbidden: the job is another user's.
        """
        path = f"/v1/jobs/{_check_job_id(job_id)}"
        flag = _check_flag("checkpoints", checkpoints)
        body = self._request("DELETE", path, params={"checkpoints": "true" if flag else "false"})
        deleted = body.get("checkpoints_deleted") if isinstance(body, dict) else None
        if not isinstance(deleted, bool):
            raise ProtocolError(f"DELETE {path}: malformed answer {body!r}")
        return deleted

    def purge(
        self,
        *,
        older_than_s: float,
        state: str | None = None,
        checkpoints: bool = False,
    ) -> list[str]:
        """Deletes every finished job that finished more than ``older_than_s`` seconds
        ago, as :meth:`delete` does for one. A user that is not an admin purges only
        their own jobs; pending, running and paused jobs are never touched.

        :param older_than_s: minimum age, in seconds since the job finished (a positive,
            finite number; sent in whole milliseconds, so at least 0.001).
        :param state: only jobs in this finished state (``"succeeded"``, ``"failed"``,
            ``"cancelled"`` or ``"timed_out"``); ``None``: every finished state.
        :param checkpoints: also delete each job's checkpoints (see :meth:`delete`).
        :returns: the ids of the deleted jobs, ascending (empty when none matched). A
            purge retried after a lost answer lists only what its last try deleted.
        :raises InvalidSpec: ``older_than_s``, ``state`` or ``checkpoints`` is invalid
            (checked here, nothing sent; a ``ValueError``), or the coordinator refused
            the request.
        """
        request = {
            "state": _purge_state(state),
            "older_than_ms": _purge_age_ms(older_than_s),
            "checkpoints": _check_flag("checkpoints", checkpoints),
        }
        body = self._request("POST", "/v1/jobs/purge", body=request)
        ids = body.get("job_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ProtocolError(f"POST /v1/jobs/purge: malformed answer {body!r}")
        return list(ids)

    @staticmethod
    def _job_answer(path: str, body: Any) -> JobInfo:
        job = body.get("job") if isinstance(body, dict) else None
        if job is None:
            raise ProtocolError(f"POST {path}: the answer has no job")
        return JobInfo.from_json(job)

    def checkpoints(self, job_id: str) -> list[CheckpointInfo]:
        """A job's kept checkpoint steps, newest first, each verified by the answering
        coordinator against its manifest (every byte re-hashed: this reads the data).

        :raises NotFound: no such job.
        """
        body = self._request("GET", f"/v1/jobs/{job_id}/checkpoints")
        items = body.get("checkpoints") if isinstance(body, dict) else None
        return [CheckpointInfo.from_json(c) for c in items or []]

    def cluster(self) -> ClusterInfo:
        """Members, leader, Raft indexes and workers, from the leader when the first
        answer names one that answers at once (as ``cumulusctl cluster status``): only
        the leader knows the workers' heartbeats and which coordinators stopped answering
        (:attr:`MemberInfo.role <cumulus.models.MemberInfo.role>` ``unreachable``).
        Otherwise as the answering coordinator sees them (:attr:`ClusterInfo.node_id`)."""
        first = ClusterInfo.from_json(self._request("GET", "/v1/cluster"))
        leader = first.leader
        if leader is None or first.leader_id == first.node_id or not leader.http_addr:
            return first
        # One quick try: the named leader may be the one that just died.
        try:
            base = normalize_address(leader.http_addr, "leader", scheme=self.connection.scheme)
            resp = self._http.get(base + "/v1/cluster", timeout=_LEADER_TRY_TIMEOUT_S)
            if resp.is_success:
                answer = ClusterInfo.from_json(resp.json())
                if answer.leader_id == answer.node_id:
                    return answer
        except (httpx.HTTPError, ValueError, ProtocolError, ConfigError):
            pass
        return first

    def health(self, address: str) -> Mapping[str, Any]:
        """``GET /health`` of one coordinator (``host:port``; no token needed, no retry),
        over this client's scheme and TLS: its ``node_id``, ``leader_id`` and ``term``.

        :raises Unavailable: it did not answer."""
        base = normalize_address(address, "address", scheme=self.connection.scheme)
        try:
            resp = self._http.get(base + "/health")
        except httpx.TransportError as e:
            raise Unavailable(f"{base}: {e}", address=base) from e
        if not resp.is_success:
            _raise_for(resp, base, self._unauthorized_hint)
        body: Mapping[str, Any] = resp.json()
        return body

    # -- logs ------------------------------------------------------------------------

    def logs(
        self,
        job_id: str,
        *,
        follow: bool = True,
        rank: int | None = None,
        cursor: str | None = None,
        tail: int | None = None,
    ) -> Iterator[LogLine]:
        """Every log line of a job's ranks (all attempts, in order per rank) over
        Server-Sent Events. A dropped stream is resumed on the next coordinator with
        ``Last-Event-ID``: no line is lost or repeated.

        :param follow: keep streaming until the job finished and every log is drained;
            ``False`` stops at the current end.
        :param rank: only this rank.
        :param cursor: resume after a cursor (an event id seen before).
        :param tail: start each rank at its last ``tail`` lines so far (``0..=10000``;
            0: at the current end), as ``cumulusctl logs --tail``; ``None``: from the
            beginning. Not with ``cursor`` (a resumed stream goes on from its cursor).
        :raises NotFound: no such job.
        :raises Unauthorized: wrong token (or a refused client certificate).
        :raises Forbidden: the user may not read this job's logs.
        :raises ApiError: another answer a retry cannot change (a 4xx but 408 and 429),
            at once, with the coordinator's message.
        :raises Unavailable: 20 consecutive tries failed (connections, 5xx, 408, 429).
        :raises ProtocolError: a malformed event.
        """
        params = _logs_params(follow, rank, tail, cursor)
        addrs = list(self.addresses)
        index = addrs.index(self._preferred) if self._preferred in addrs else 0
        last_offset: dict[tuple[int, int], int] = {}
        failures = 0
        timeout = httpx.Timeout(
            LOG_READ_TIMEOUT_S, connect=self._timeout.connect, read=LOG_READ_TIMEOUT_S
        )
        while True:
            base = addrs[index % len(addrs)]
            headers = {"Accept": "text/event-stream"}
            if cursor:
                headers["Last-Event-ID"] = cursor
            failure: str
            try:
                with self._http.stream(
                    "GET",
                    f"{base}/v1/jobs/{job_id}/logs",
                    params=params,
                    headers=headers,
                    timeout=timeout,
                ) as resp:
                    if _final_status(resp.status_code):
                        resp.read()
                        _raise_for(resp, base, self._unauthorized_hint)
                    if not resp.is_success:
                        resp.read()
                        failure = f"{base}: HTTP {resp.status_code}: {_error_text(resp)}"
                    else:
                        failures = 0
                        failure = f"{base}: the stream closed without an end event"
                        for sse in EventSource(resp).iter_sse():
                            if sse.event == "end":
                                return
                            if sse.event not in ("log", "message", ""):
                                continue
                            try:
                                data = json.loads(sse.data)
                            except ValueError as e:
                                raise ProtocolError(
                                    f"log event from {base} is not JSON: {sse.data[:200]!r}",
                                    address=base,
                                ) from e
                            line = LogLine.from_json(data)
                            if sse.id:
                                cursor = sse.id
                            key = (line.rank, line.attempt)
                            seen = last_offset.get(key)
                            if seen is not None and line.offset <= seen:
                                continue
                            last_offset[key] = line.offset
                            yield line
            except (httpx.TransportError, SSEError) as e:
                failure = f"{base}: {type(e).__name__}: {e}"
            failures += 1
            if failures >= LOG_MAX_CONSECUTIVE_FAILURES:
                raise Unavailable(
                    f"lost the log stream of {job_id}: {failures} consecutive failed tries "
                    f"(last: {failure})",
                    address=base,
                )
            index += 1
            time.sleep(min(0.2 * 2 ** (failures - 1), 5.0))


class Job:
    """The handle of one job. Cheap: it holds the id, and every method asks the cluster.

    ``created`` is false when :meth:`Client.submit`'s request id had already created this
    job (a retried submit).
    """

    def __init__(
        self,
        client: Client,
        job_id: str,
        *,
        created: bool = False,
        request_id: str | None = None,
        upload: UploadInfo | None = None,
        gather: bool | None = None,
        warnings: tuple[str, ...] = (),
    ) -> None:
        self.client = client
        #: e.g. ``job-000001``.
        self.id = job_id
        self.created = created
        self.request_id = request_id
        #: What the coordinator said about the submitted job, one sentence each (each
        #: also issued as a :class:`~cumulus.errors.SubmitWarning` by
        #: :meth:`Client.submit`); empty for a handle made otherwise.
        self.warnings = warnings
        #: The working directory this submit sent (``submit(upload=...)``), else ``None``.
        self.upload = upload
        #: Whether :meth:`result` returns every rank's value (``Client.run(gather=...)``);
        #: ``None``: read from the job's command.
        self.gather = gather

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Job) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def status(self, *, linearizable: bool = True) -> JobInfo:
        """The job's current status (see :meth:`Client.get_job`)."""
        return self.client.get_job(self.id, linearizable=linearizable)

    def wait(self, timeout_s: float | None = None, *, poll_interval_s: float = 1.0) -> JobInfo:
        """Polls until the job finished (succeeded, failed, cancelled or timed_out) and
        returns its final status; check ``.succeeded`` / ``.failure_cause``. A paused job
        has not finished: this waits on until it is resumed and ends (or ``timeout_s``).

        :param timeout_s: give up after this many seconds (``None``: wait forever).
        :param poll_interval_s: longest time between two polls (the first polls come
            faster: :data:`WAIT_FIRST_POLL_S`, growing by :data:`WAIT_POLL_GROWTH` per
            poll).
        :raises WaitTimeout: ``timeout_s`` passed; the job keeps running.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        interval = min(WAIT_FIRST_POLL_S, poll_interval_s)
        while True:
            info = self.status()
            if info.finished:
                return info
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise WaitTimeout(
                    f"gave up waiting for {self.id} after {timeout_s} s (it is {info.state})",
                    info,
                )
            sleep = interval if deadline is None else min(interval, deadline - now)
            time.sleep(max(sleep, 0.0))
            interval = min(interval * WAIT_POLL_GROWTH, poll_interval_s)

    def summary(self) -> JobSummary:
        """The job's progress summary with its history (see :meth:`Client.summary`)."""
        return self.client.summary(self.id)

    def cancel(self) -> JobInfo:
        """Cancels the job (see :meth:`Client.cancel`)."""
        return self.client.cancel(self.id)

    def checkpoints(self) -> list[CheckpointInfo]:
        """The job's kept checkpoint steps, newest first (see :meth:`Client.checkpoints`)."""
        return self.client.checkpoints(self.id)

    #: Alias of :meth:`checkpoints` (the product brief's name).
    get_checkpoints = checkpoints

    def logs(
        self,
        *,
        follow: bool = True,
        rank: int | None = None,
        cursor: str | None = None,
        tail: int | None = None,
    ) -> Iterator[LogLine]:
        """The job's log lines (see :meth:`Client.logs`; ``tail=N``: each rank's last N
        lines so far, then what follows)."""
        return self.client.logs(self.id, follow=follow, rank=rank, cursor=cursor, tail=tail)

    def pause(self) -> JobInfo:
        """Pauses the job: its ranks checkpoint and exit, it becomes ``paused`` (see
        :meth:`Client.pause`)."""
        return self.client.pause(self.id)

    def resume(self) -> JobInfo:
        """Resumes the paused job from its latest committed step (see
        :meth:`Client.resume`)."""
        return self.client.resume(self.id)

    def delete(self, *, checkpoints: bool = False) -> bool:
        """Deletes the finished job, and with ``checkpoints`` its checkpoints; returns
        whether checkpoints were deleted (see :meth:`Client.delete`). The handle names a
        job that no longer exists afterwards."""
        return self.client.delete(self.id, checkpoints=checkpoints)

    # -- remote functions and artifacts ----------------------------------------------

    def result(self, timeout: float | None = None) -> Any:
        """Waits until the job of :meth:`Client.run_async` finishes and returns rank 0's
        return value (with ``gather``: every rank's, a list in rank order), downloaded
        from the ranks' artifacts. A result is a pickle: only read results of jobs you
        trust (your own).

        :param timeout: give up after this many seconds (the job keeps running).
        :raises RemoteError: the function raised on a rank (its remote type, message and
            traceback; the lowest such rank's), or its result could not be delivered.
        :raises PythonVersionMismatch: a rank's Python was not the client's
            ``major.minor``.
        :raises JobFailed: the job failed without a remote error (e.g. a rank was
            killed and the restart budget ran out), was cancelled or timed out.
        :raises ResultUnavailable: it succeeded but a rank left no result (not a job of
            :meth:`Client.run`, or its artifacts were not uploaded).
        :raises WaitTimeout: ``timeout`` passed first.
        """
        info = self.wait(timeout_s=timeout)
        gather = self.gather if self.gather is not None else _remote.GATHER_FLAG in info.command
        if not info.succeeded:
            self._raise_failure(info)
        values = []
        for rank in range(info.world_size) if gather else [0]:
            outcome = self._outcome(info, rank)
            if outcome is None or outcome.result is None:
                raise ResultUnavailable(
                    f"job {info.id} succeeded but rank {rank} left no result "
                    f"({_contract.REMOTE_RESULT_FILE} in its artifacts): not a job of "
                    "Client.run, or its artifacts were not uploaded (see its log)",
                    info,
                )
            values.append(_remote.load_result(outcome.result))
        return values if gather else values[0]

    def _outcome(self, info: JobInfo, rank: int) -> _remote.RemoteOutcome | None:
        artifact = _transfer.artifact_of(info, rank)
        if artifact is None:
            return None
        wanted = frozenset({_contract.REMOTE_RESULT_FILE, _contract.REMOTE_ERROR_FILE})
        files = _transfer.read_artifact(self.client, artifact, want=wanted)
        return _remote.outcome_of(rank, artifact.attempt, files)

    def _raise_failure(self, info: JobInfo) -> None:
        outcomes = [self._outcome(info, a.rank) for a in info.artifacts]
        errors = [o for o in outcomes if o is not None and o.error is not None]
        # A refused interpreter explains everything else; then the lowest rank's error.
        errors.sort(key=lambda o: (o.error.get("kind") != "python_version_mismatch", o.rank))  # type: ignore[union-attr]
        if errors:
            _remote.raise_remote_error(errors[0], info)
        cause = f": {info.failure_cause}" if info.failure_cause else ""
        raise JobFailed(f"job {info.id} {info.state}{cause}", info)

    def artifacts(self) -> list[ArtifactFile]:
        """The files the job's ranks left in their ``$CUMULUS_OUTPUT_DIR`` (the newest
        attempt of each rank that left any), in rank order then archive order; a
        :meth:`Client.run` job's result and error files among them
        (``_cumulus/...``). Reads each rank's packed artifacts from the cluster.

        :raises Forbidden: the job is not the caller's (only its owner or an admin reads
            its artifacts).
        :raises BundleError: an artifact archive is malformed.
        """
        info = self.status()
        out = []
        for artifact in sorted(info.artifacts, key=lambda a: a.rank):
            for f in _transfer.read_artifact(self.client, artifact):
                out.append(ArtifactFile(artifact.rank, artifact.attempt, f.path, f.size))
        return out

    def download(self, path: str, dest: str | os.PathLike[str], *, rank: int = 0) -> pathlib.Path:
        """Writes the file ``path`` (relative to the output dir, as :meth:`artifacts`
        lists it) of rank ``rank``'s artifacts to ``dest`` (a file, or an existing
        directory to put it in under its name); returns where it was written. Replaces
        ``dest`` atomically.

        :raises FileNotFoundError: the rank left no artifacts, or none at ``path``.
        :raises Forbidden: the job is not the caller's.
        """
        info = self.status()
        artifact = _transfer.artifact_of(info, rank)
        if artifact is None:
            raise FileNotFoundError(f"rank {rank} of {self.id} left no artifacts")
        files = _transfer.read_artifact(self.client, artifact, want=path)
        found = [f for f in files if f.path == path and f.data is not None]
        if not found:
            listed = ", ".join(f.path for f in files[:20]) or "nothing"
            raise FileNotFoundError(
                f"rank {rank} of {self.id} (attempt {artifact.attempt}) left no {path!r} "
                f"in its artifacts (it left {listed})"
            )
        target = pathlib.Path(dest)
        if target.is_dir():
            target = target / pathlib.PurePosixPath(path).name
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:
            tmp.write_bytes(found[0].data or b"")
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return target
