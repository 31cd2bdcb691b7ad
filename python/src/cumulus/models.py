"""Typed, read-only views of the coordinator API's JSON (the proto messages of
``proto/proto/cumulus.proto`` as serde JSON). Standard library only.

Units are in field names: ``*_ms`` are milliseconds (durations, or Unix epoch times for
``*_at_ms``), ``*_bytes`` bytes. Every object keeps the JSON it was made from in ``raw``,
so fields added by a newer server are not lost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cumulus import _contract, _metrics
from cumulus._contract import JobState, MemberRole, RankPhase, WorkerState
from cumulus.errors import ProtocolError

__all__ = [
    "FINISHED_STATES",
    "JOB_STATES",
    "STOP_ACTIONS",
    "ArtifactFile",
    "ArtifactRef",
    "BlobRef",
    "CheckpointInfo",
    "ClusterInfo",
    "GpuInfo",
    "JobInfo",
    "JobState",
    "JobSummary",
    "LogLine",
    "MemberInfo",
    "MemberRole",
    "ProgressSample",
    "RankInfo",
    "RankPhase",
    "ResizeEvent",
    "RestartInfo",
    "UploadInfo",
    "WarmSpareInfo",
    "WorkerInfo",
    "WorkerState",
]

#: Every job state, in the order of the Rust ``JobState``.
JOB_STATES: tuple[str, ...] = _contract.JOB_STATES
#: Job states after which nothing changes (``paused`` is not one: a paused job can be
#: resumed or cancelled).
FINISHED_STATES = _contract.TERMINAL_JOB_STATES
#: Values of :attr:`JobInfo.stop_action` while a stop of the job's ranks is in flight.
STOP_ACTIONS = frozenset(_contract.STOP_ACTIONS) - {_contract.StopAction.STOP.value}

T = TypeVar("T")
E = TypeVar("E", JobState, RankPhase, MemberRole, WorkerState)


def _get(d: Mapping[str, Any], key: str, kind: type[T], default: T) -> T:
    value = d.get(key)
    if value is None:
        return default
    # JSON has one number type; bool is an int in Python but not in JSON.
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # type: ignore[return-value]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(
            f"field {key!r} of the coordinator's answer is {value!r}, expected {kind.__name__}"
        )
    return value


def _enum(d: Mapping[str, Any], key: str, kind: type[E]) -> E:
    """The member of the ``str`` enum ``kind`` spelled by field ``key``.

    :raises ProtocolError: the field is missing or not one of ``kind``'s spellings (a
        server newer than this SDK: upgrade the ``cumulus`` package)."""
    value = d.get(key)
    try:
        return kind(value)
    except ValueError:
        expected = ", ".join(m.value for m in kind)
        raise ProtocolError(
            f"field {key!r} of the coordinator's answer is {value!r}, not one of {expected}"
            " (is the coordinator newer than this SDK?)"
        ) from None


def _opt_int(d: Mapping[str, Any], key: str) -> int | None:
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"field {key!r} of the coordinator's answer is {value!r}, not an int")
    return value


def _opt_float(d: Mapping[str, Any], key: str) -> float | None:
    if d.get(key) is None:
        return None
    return _get(d, key, float, 0.0)


def _obj(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProtocolError(f"{what} in the coordinator's answer is not a JSON object: {value!r}")
    return value


def _list(d: Mapping[str, Any], key: str) -> list[Any]:
    value = d.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ProtocolError(f"field {key!r} of the coordinator's answer is not a list")
    return value


def _str_tuple(d: Mapping[str, Any], key: str) -> tuple[str, ...]:
    items = _list(d, key)
    for item in items:
        if not isinstance(item, str):
            raise ProtocolError(
                f"field {key!r} of the coordinator's answer holds {item!r}, not a str"
            )
    return tuple(items)


def _metric_map(d: Mapping[str, Any], key: str) -> dict[str, float]:
    """A map of metrics: numbers, NaN and the infinities as their JSON strings
    (:mod:`cumulus._metrics`)."""
    value = d.get(key)
    if value is None:
        return {}
    m = _obj(value, f"field {key!r}")
    out: dict[str, float] = {}
    for name, raw in m.items():
        if not isinstance(name, str):
            raise ProtocolError(f"field {key!r} of the coordinator's answer has a non-str key")
        decoded = _metrics.decode(raw)
        if decoded is None:
            raise ProtocolError(
                f"metric {name!r} in the coordinator's answer is {raw!r}, not a number"
                f" or one of {_contract.METRIC_JSON_NAN!r}, {_contract.METRIC_JSON_INFINITY!r},"
                f" {_contract.METRIC_JSON_NEG_INFINITY!r}"
            )
        out[name] = decoded
    return out


@dataclass(frozen=True)
class BlobRef:
    """A blob of the cluster's blob store: a packed directory named by its digest."""

    #: BLAKE3 of its bytes, 64 lowercase hex digits.
    digest: str
    size_bytes: int

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> BlobRef:
        """Builds it from a ``BlobRef`` JSON object.

        :raises ProtocolError: a field has the wrong type or the digest is malformed."""
        d = _obj(d, "a blob reference")
        digest = _get(d, "digest", str, "")
        if len(digest) != _contract.BLOB_DIGEST_HEX_LEN or any(
            c not in "0123456789abcdef" for c in digest
        ):
            raise ProtocolError(f"a blob digest in the coordinator's answer is {digest!r}")
        size = _get(d, "size_bytes", int, 0)
        if size < 0:
            raise ProtocolError(f"a blob size in the coordinator's answer is {size}")
        return cls(digest=digest, size_bytes=size)

    def to_json(self) -> dict[str, Any]:
        """The ``BlobRef`` JSON object."""
        return {"digest": self.digest, "size_bytes": self.size_bytes}


@dataclass(frozen=True)
class ArtifactRef:
    """What one rank attempt left in its ``CUMULUS_OUTPUT_DIR``, packed (``Job.artifacts``
    on the wire: the newest attempt of each rank that left any)."""

    rank: int
    attempt: int
    blob: BlobRef

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ArtifactRef:
        """Builds it from an ``Artifact`` JSON object."""
        d = _obj(d, "an artifact")
        blob = d.get("blob")
        if blob is None:
            raise ProtocolError("an artifact in the coordinator's answer has no blob")
        return cls(
            rank=_get(d, "rank", int, 0),
            attempt=_get(d, "attempt", int, 0),
            blob=BlobRef.from_json(blob),
        )


@dataclass(frozen=True)
class ArtifactFile:
    """One file a rank attempt left in its ``CUMULUS_OUTPUT_DIR`` (:meth:`Job.artifacts
    <cumulus.Job.artifacts>`)."""

    rank: int
    attempt: int
    #: Relative to the output dir, ``/``-separated.
    path: str
    size_bytes: int


@dataclass(frozen=True)
class UploadInfo:
    """A working directory sent with a submit (:attr:`Job.upload <cumulus.Job.upload>`)."""

    #: The packed directory in the blob store.
    blob: BlobRef
    #: Bytes sent: 0 when the cluster already had the digest (an unchanged directory).
    sent_bytes: int
    #: Regular files packed, and their total size in bytes.
    file_count: int
    unpacked_bytes: int


@dataclass(frozen=True)
class RankInfo:
    """One rank as the cluster sees it."""

    rank: int
    #: Current attempt (0 for the first run).
    attempt: int
    #: Worker the current attempt is placed on (``""`` when unplaced).
    worker_id: str
    #: ``pending`` | ``waiting`` (restart backoff) | ``running`` | ``exited`` | ``failed``
    #: | ``stopped`` (the job ended first; never running in a job that has ended):
    #: a :class:`RankPhase`, a string enum (``rank.state == "running"`` holds).
    state: RankPhase
    exit_code: int | None
    signal: int | None
    started_at_ms: int
    exited_at_ms: int
    #: Latest progress the leader has seen for this attempt (soft state).
    step: int
    total_steps: int
    local_rank: int
    shard_count: int
    #: Restart not before this time (leader clock), when waiting.
    not_before_ms: int
    #: OS process id of the attempt on its worker (0 when not started).
    pid: int
    #: UUIDs of the GPUs the current attempt was given: its ``CUDA_VISIBLE_DEVICES``
    #: (empty for a job without GPUs, or before the attempt is placed).
    gpus: tuple[str, ...] = ()
    #: The metrics of the attempt's latest progress report (``runtime.report(step,
    #: loss=...)``), as the leader last saw them (NaN and infinities included: a
    #: diverging run); empty when unknown.
    metrics: Mapping[str, float] = field(default_factory=dict)
    #: Steps per second of the running attempt, smoothed over its recent reports (0.0:
    #: not known yet).
    steps_per_s: float = 0.0
    #: Time left to ``total_steps`` at that rate, in milliseconds (0: unknown).
    eta_ms: int = 0
    #: The committed step the current attempt resumed from (``None``: from scratch).
    resume_step: int | None = None
    #: The job that committed :attr:`resume_step` when it is another one (a job started
    #: with ``resume_from`` that has committed no step of its own yet); ``""``: this job.
    resume_job_id: str = ""
    #: What the current attempt died of when it exited non-zero, as its agent could tell
    #: (``""`` otherwise): the uncaught exception the runtime reported, e.g. ``ValueError:
    #: bad lr (train.py:42)``, else the last line the program wrote.
    exit_cause: str = ""
    #: The leader flagged the current attempt a straggler (its steps/s stayed below the
    #: job's ``straggler_fraction`` of the other ranks' median for its window).
    straggler: bool = False
    #: The running attempt listens for in-process restarts (``cumulus.runtime.run``), as
    #: its worker last reported: a group restart may keep its process.
    in_process: bool = False

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RankInfo:
        """Builds it from a ``RankStatus`` JSON object.

        :raises ProtocolError: a field has the wrong type."""
        d = _obj(d, "a rank")
        return cls(
            rank=_get(d, "rank", int, 0),
            attempt=_get(d, "attempt", int, 0),
            worker_id=_get(d, "worker_id", str, ""),
            state=_enum(d, "state", RankPhase),
            exit_code=_opt_int(d, "exit_code"),
            signal=_opt_int(d, "signal"),
            started_at_ms=_get(d, "started_at_ms", int, 0),
            exited_at_ms=_get(d, "exited_at_ms", int, 0),
            step=_get(d, "step", int, 0),
            total_steps=_get(d, "total_steps", int, 0),
            local_rank=_get(d, "local_rank", int, 0),
            shard_count=_get(d, "shard_count", int, 0),
            not_before_ms=_get(d, "not_before_ms", int, 0),
            pid=_get(d, "pid", int, 0),
            gpus=_str_tuple(d, "gpus"),
            metrics=_metric_map(d, "metrics"),
            steps_per_s=_get(d, "steps_per_s", float, 0.0),
            eta_ms=_get(d, "eta_ms", int, 0),
            resume_step=_opt_int(d, "resume_step"),
            resume_job_id=_get(d, "resume_job_id", str, ""),
            exit_cause=_get(d, "exit_cause", str, ""),
            straggler=_get(d, "straggler", bool, False),
            in_process=_get(d, "in_process", bool, False),
        )


@dataclass(frozen=True)
class ResizeEvent:
    """One change of an elastic job's world size."""

    #: Leader time, in ms since the Unix epoch.
    at_ms: int
    from_world_size: int
    to_world_size: int
    #: The committed step the new ranks resumed from (``None``: from scratch).
    resume_step: int | None
    #: Why: a lost worker with no room for its ranks, capacity back at a checkpoint
    #: boundary, the first placement with the ranks that fit.
    cause: str

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ResizeEvent:
        """Builds it from a ``ResizeEvent`` JSON object."""
        d = _obj(d, "a resize event")
        return cls(
            at_ms=_get(d, "at_ms", int, 0),
            from_world_size=_get(d, "from_world_size", int, 0),
            to_world_size=_get(d, "to_world_size", int, 0),
            resume_step=_opt_int(d, "resume_step"),
            cause=_get(d, "cause", str, ""),
        )


@dataclass(frozen=True)
class StragglerFlag:
    """A rank attempt the leader flagged as a straggler: its steps/s stayed below the
    job's ``straggler_fraction`` of the median of the other ranks for the job's
    ``straggler_window_ms``."""

    rank: int
    attempt: int
    #: The worker it ran on.
    worker_id: str
    #: Its steps/s, and the median of the other ranks', when it was flagged.
    steps_per_s: float
    median_steps_per_s: float
    #: What was done: ``"warn"``, ``"restart"`` or ``"exclude"`` (a
    #: :data:`cumulus._contract.STRAGGLER_ACTIONS` spelling).
    action: str
    #: Leader time of the flag, in ms since the Unix epoch.
    at_ms: int

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StragglerFlag:
        """Builds it from a ``StragglerFlag`` JSON object."""
        d = _obj(d, "a straggler flag")
        return cls(
            rank=_get(d, "rank", int, 0),
            attempt=_get(d, "attempt", int, 0),
            worker_id=_get(d, "worker_id", str, ""),
            steps_per_s=_get(d, "steps_per_s", float, 0.0),
            median_steps_per_s=_get(d, "median_steps_per_s", float, 0.0),
            action=_get(d, "action", str, ""),
            at_ms=_get(d, "at_ms", int, 0),
        )


@dataclass(frozen=True)
class RestartInfo:
    """One restart the leader committed."""

    #: 1-based count within the job.
    number: int
    failed_at_ms: int
    #: Jittered backoff the leader chose.
    delay_ms: int
    not_before_ms: int
    #: Why, e.g. ``rank 2 attempt 0 exited with code 1``.
    cause: str
    #: Ranks restarted.
    ranks: tuple[int, ...]
    #: Checkpoint step the restarted ranks resume from (``None``: from scratch).
    resume_step: int | None
    #: How it was carried out: ``"in_process"`` (the ranks in :attr:`in_process_ranks`
    #: kept their processes and re-entered ``cumulus.runtime.run``'s function) or
    #: ``"full"`` (every restarted rank got a new process); see ``RESTART_PATHS``.
    path: str = "full"
    #: Why the leader chose that path.
    path_reason: str = ""
    #: Ranks whose new attempt continued in the previous attempt's process.
    in_process_ranks: tuple[int, ...] = ()

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RestartInfo:
        """Builds it from a ``RestartRecord`` JSON object."""
        d = _obj(d, "a restart")
        return cls(
            number=_get(d, "number", int, 0),
            failed_at_ms=_get(d, "failed_at_ms", int, 0),
            delay_ms=_get(d, "delay_ms", int, 0),
            not_before_ms=_get(d, "not_before_ms", int, 0),
            cause=_get(d, "cause", str, ""),
            ranks=tuple(int(r) for r in _list(d, "ranks")),
            resume_step=_opt_int(d, "resume_step"),
            path=_get(d, "path", str, "") or "full",
            path_reason=_get(d, "path_reason", str, ""),
            in_process_ranks=tuple(int(r) for r in _list(d, "in_process_ranks")),
        )


@dataclass(frozen=True)
class JobInfo:
    """A job's status at one moment (``GET /v1/jobs/{id}``)."""

    #: e.g. ``job-000001``.
    id: str
    name: str
    #: ``pending`` | ``running`` | ``succeeded`` | ``failed`` | ``cancelled`` | ``paused``
    #: | ``timed_out``: a :class:`JobState`, a string enum (``info.state == "running"``
    #: holds). A paused job is not finished: :meth:`Job.resume <cumulus.Job.resume>`
    #: queues it again (it resumes from its committed step).
    state: JobState
    world_size: int
    command: tuple[str, ...]
    submitted_at_ms: int
    #: 0 while the job runs.
    finished_at_ms: int
    restarts_used: int
    #: Why the job failed, was cancelled or timed out (``""`` otherwise).
    failure_cause: str
    ranks: tuple[RankInfo, ...]
    #: Latest committed checkpoint step, ``None`` before the first.
    committed_step: int | None
    restarts: tuple[RestartInfo, ...]
    #: The idempotency key the job was submitted with.
    request_id: str
    shard_count: int
    #: The job spec as the server holds it (with defaults filled in).
    spec: Mapping[str, Any] = field(repr=False)
    #: The whole JSON object.
    raw: Mapping[str, Any] = field(repr=False)
    #: Why a pending job is not placed yet: what it needs against what the alive workers
    #: offer in all (``cannot be placed: ...``) and have free now. ``""`` when the job is
    #: not pending, and in :meth:`Client.jobs <cumulus.Client.jobs>` (only a single job's
    #: status has it).
    pending_reason: str = ""
    #: Who submitted it: a user's name, or ``"admin"`` for the cluster token.
    owner: str = ""
    #: Whole GPUs each rank gets (0: none; 1 with a ``gpu_memory_fraction``).
    gpus_per_rank: int = 0
    #: Share of one GPU each rank gets, ``0 < f < 1``; ``None``: whole GPUs (or none).
    gpu_memory_fraction: float | None = None
    #: The stop of the job's ranks in flight: ``"pause"``, ``"time_limit"`` or
    #: ``"preempt"`` while its ranks are asked to checkpoint and exit; ``""`` when none.
    stop_action: str = ""
    #: Time the job has run so far, in milliseconds, pending and paused time excluded
    #: (what its time limit counts).
    running_ms: int = 0
    #: The job's time limit on :attr:`running_ms`, in milliseconds (0: none).
    time_limit_ms: int = 0
    #: How long before the time limit the ranks are asked to checkpoint and stop, in
    #: milliseconds (0: not set).
    signal_before_ms: int = 0
    #: Queue priority, ``-1000..=1000`` (higher starts first; 0 by default).
    priority: int = 0
    #: The earlier job this one started from (``Client.submit(resume_from=...)``), e.g.
    #: ``job-000012``; ``""``: from scratch.
    resume_from_job: str = ""
    #: The committed step of :attr:`resume_from_job` it started from (the coordinator
    #: fills in that job's newest when none was asked for); ``None`` without one.
    resume_from_step: int | None = None
    #: Whether a job of higher priority may preempt it (checkpoint, stop action
    #: ``"preempt"``, queued again).
    preemptible: bool = False
    #: Time the job has spent paused so far, in milliseconds.
    paused_ms: int = 0
    #: How many times the job's state has changed: it only grows (the state itself can
    #: go back, to ``pending`` after a preemption or ``paused``), so it orders two reads.
    state_changes: int = 0
    #: What the ranks left in their output dirs: the newest attempt of each rank that
    #: left any, in rank order.
    artifacts: tuple[ArtifactRef, ...] = ()
    #: The packed working directory sent with the job (``None``: none).
    workdir: BlobRef | None = None
    #: What the leader does about a straggler: ``"warn"``, ``"restart"``, ``"exclude"``
    #: or ``"off"``.
    straggler_action: str = _contract.DEFAULT_STRAGGLER_ACTION
    #: A rank is slow below this share of the other ranks' median steps/s.
    straggler_fraction: float = _contract.DEFAULT_STRAGGLER_FRACTION_PERMILLE / 1000
    #: How long a rank must stay slow to be flagged, in milliseconds.
    straggler_window_ms: int = _contract.DEFAULT_STRAGGLER_WINDOW_MS
    #: Rank attempts flagged as stragglers, oldest first (at most 64 kept).
    stragglers: tuple[StragglerFlag, ...] = ()
    #: Workers the job's later placements avoid while others have room (its stragglers'
    #: under ``straggler_action`` ``"restart"`` or ``"exclude"``).
    avoided_workers: tuple[str, ...] = ()
    #: An elastic job's fewest ranks (``0``: a fixed world of :attr:`world_size`, which
    #: is then the most).
    min_world_size: int = 0
    #: The ranks the job runs with now (:attr:`world_size` unless it is elastic).
    world_size_now: int = 0
    #: Every change of an elastic job's world size, oldest first (at most 64 kept).
    resizes: tuple[ResizeEvent, ...] = ()

    @property
    def finished(self) -> bool:
        """Whether the job reached a final state (succeeded, failed, cancelled or
        timed_out). A paused job is not finished."""
        return self.state in FINISHED_STATES

    @property
    def paused(self) -> bool:
        """Whether the job is paused (:meth:`Job.resume <cumulus.Job.resume>` continues
        it)."""
        return self.state == _contract.JobState.PAUSED.value

    @property
    def timed_out(self) -> bool:
        """Whether the job ended at its time limit."""
        return self.state == _contract.JobState.TIMED_OUT.value

    @property
    def succeeded(self) -> bool:
        """Whether the job succeeded."""
        return self.state == _contract.JobState.SUCCEEDED.value

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> JobInfo:
        """Builds it from a ``Job`` JSON object.

        :raises ProtocolError: a field has the wrong type or the id is missing."""
        d = _obj(d, "a job")
        spec = _obj(d.get("spec") or {}, "the job spec")
        job_id = _get(d, "id", str, "")
        if not job_id:
            raise ProtocolError("a job in the coordinator's answer has no id")
        return cls(
            id=job_id,
            name=_get(spec, "name", str, ""),
            state=_enum(d, "state", JobState),
            world_size=_get(spec, "world_size", int, 0),
            command=tuple(str(a) for a in _list(spec, "command")),
            submitted_at_ms=_get(d, "submitted_at_ms", int, 0),
            finished_at_ms=_get(d, "finished_at_ms", int, 0),
            restarts_used=_get(d, "restarts_used", int, 0),
            failure_cause=_get(d, "failure_cause", str, ""),
            ranks=tuple(RankInfo.from_json(r) for r in _list(d, "ranks")),
            committed_step=_opt_int(d, "committed_step"),
            restarts=tuple(RestartInfo.from_json(r) for r in _list(d, "restarts")),
            request_id=_get(d, "request_id", str, ""),
            shard_count=_get(d, "shard_count", int, 0),
            spec=spec,
            raw=d,
            pending_reason=_get(d, "pending_reason", str, ""),
            owner=_get(d, "owner", str, ""),
            gpus_per_rank=_get(spec, "gpus_per_rank", int, 0),
            gpu_memory_fraction=_opt_float(spec, "gpu_memory_fraction"),
            stop_action=_get(d, "stop_action", str, ""),
            running_ms=_get(d, "running_ms", int, 0),
            time_limit_ms=_get(spec, "time_limit_ms", int, 0),
            priority=_get(spec, "priority", int, 0),
            signal_before_ms=_get(spec, "signal_before_ms", int, 0),
            resume_from_job=_get(spec, "resume_from_job", str, ""),
            resume_from_step=_opt_int(spec, "resume_from_step"),
            preemptible=_get(spec, "preemptible", bool, False),
            paused_ms=_get(d, "paused_ms", int, 0),
            state_changes=_get(d, "state_changes", int, 0),
            artifacts=tuple(ArtifactRef.from_json(a) for a in _list(d, "artifacts")),
            workdir=BlobRef.from_json(spec["workdir"]) if spec.get("workdir") else None,
            straggler_action=_get(spec, "straggler_action", str, "")
            or _contract.DEFAULT_STRAGGLER_ACTION,
            straggler_fraction=_get(
                spec,
                "straggler_fraction",
                float,
                _contract.DEFAULT_STRAGGLER_FRACTION_PERMILLE / 1000,
            ),
            straggler_window_ms=_get(spec, "straggler_window_ms", int, 0)
            or _contract.DEFAULT_STRAGGLER_WINDOW_MS,
            stragglers=tuple(StragglerFlag.from_json(f) for f in _list(d, "stragglers")),
            avoided_workers=_str_tuple(d, "avoided_workers"),
            min_world_size=_get(spec, "min_world_size", int, 0),
            world_size_now=_get(d, "world_size_now", int, 0),
            resizes=tuple(ResizeEvent.from_json(r) for r in _list(d, "resizes")),
        )


@dataclass(frozen=True)
class ProgressSample:
    """One sample of a job's progress (:attr:`JobSummary.history`)."""

    #: Leader time, in ms since the Unix epoch.
    at_ms: int
    step: int
    #: 0: unknown.
    total_steps: int
    #: 0.0: unknown.
    steps_per_s: float
    #: At most 16 metrics (the first by name).
    metrics: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ProgressSample:
        """Builds it from a ``ProgressSample`` JSON object.

        :raises ProtocolError: a field has the wrong type."""
        d = _obj(d, "a progress sample")
        return cls(
            at_ms=_get(d, "at_ms", int, 0),
            step=_get(d, "step", int, 0),
            total_steps=_get(d, "total_steps", int, 0),
            steps_per_s=_get(d, "steps_per_s", float, 0.0),
            metrics=_metric_map(d, "metrics"),
        )


@dataclass(frozen=True)
class JobSummary:
    """A job's progress in one record (``GET /v1/jobs/{id}/summary``, and without
    :attr:`history` ``GET /v1/jobs/summaries``): the replicated record's facts with the
    leader's view of its ranks' reports."""

    job_id: str
    name: str
    #: ``pending`` | ``running`` | ``succeeded`` | ``failed`` | ``cancelled`` | ``paused``
    #: | ``timed_out``: a :class:`JobState`.
    state: JobState
    #: The job's step: its slowest rank's latest reported step (for a finished job, the
    #: step its ranks reported when they exited).
    step: int
    #: The slowest rank's total steps (0: unknown).
    total_steps: int
    #: The slowest rank's smoothed steps per second; after the job stopped running, the
    #: last rate seen while it ran (0.0: unknown).
    steps_per_s: float
    #: Time left to :attr:`total_steps` at that rate, in milliseconds (0: unknown, or the
    #: job is not running).
    eta_ms: int
    #: The latest metrics of the lowest rank that reported any.
    metrics: Mapping[str, float]
    restarts_used: int
    #: Time the job has run so far, pending and paused time excluded.
    running_ms: int
    #: Time the job has spent paused so far.
    paused_ms: int
    #: Latest committed checkpoint step, ``None`` before the first.
    committed_step: int | None
    submitted_at_ms: int
    #: 0 while the job has not finished.
    finished_at_ms: int
    #: Whether the answering leader saw the job's ranks report (step, rate and metrics
    #: are then current); ``False`` after a leader change or once the history was
    #: evicted: the figures come from the replicated record only.
    live: bool
    #: Progress over time, oldest first: at most 240 samples, the interval between them
    #: doubling whenever they fill (10 s at first). Empty in :meth:`Client.summaries
    #: <cumulus.Client.summaries>`.
    history: tuple[ProgressSample, ...] = field(default=(), repr=False)
    #: The whole JSON object.
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def finished(self) -> bool:
        """Whether the job reached a final state (a paused job has not)."""
        return self.state in FINISHED_STATES

    @property
    def eta_s(self) -> float | None:
        """:attr:`eta_ms` in seconds; ``None`` when unknown (or the job is not
        running)."""
        return self.eta_ms / 1000 if self.eta_ms else None

    @property
    def progress(self) -> float | None:
        """:attr:`step` over :attr:`total_steps` (``None`` when the total is
        unknown)."""
        return self.step / self.total_steps if self.total_steps else None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> JobSummary:
        """Builds it from a ``JobSummary`` JSON object.

        :raises ProtocolError: a field has the wrong type or the job id is missing."""
        d = _obj(d, "a job summary")
        job_id = _get(d, "job_id", str, "")
        if not job_id:
            raise ProtocolError("a job summary in the coordinator's answer has no job_id")
        return cls(
            job_id=job_id,
            name=_get(d, "name", str, ""),
            state=_enum(d, "state", JobState),
            step=_get(d, "step", int, 0),
            total_steps=_get(d, "total_steps", int, 0),
            steps_per_s=_get(d, "steps_per_s", float, 0.0),
            eta_ms=_get(d, "eta_ms", int, 0),
            metrics=_metric_map(d, "metrics"),
            restarts_used=_get(d, "restarts_used", int, 0),
            running_ms=_get(d, "running_ms", int, 0),
            paused_ms=_get(d, "paused_ms", int, 0),
            committed_step=_opt_int(d, "committed_step"),
            submitted_at_ms=_get(d, "submitted_at_ms", int, 0),
            finished_at_ms=_get(d, "finished_at_ms", int, 0),
            live=_get(d, "live", bool, False),
            history=tuple(ProgressSample.from_json(h) for h in _list(d, "history")),
            raw=d,
        )


@dataclass(frozen=True)
class CheckpointInfo:
    """One kept checkpoint step of a job (``GET /v1/jobs/{id}/checkpoints``)."""

    step: int
    #: Directory of the step (``s3://...`` for an S3 commit tier).
    path: str
    #: True when ``MANIFEST.json`` exists and every file verifies.
    verified: bool
    #: Total size of the step's files.
    size_bytes: int
    #: Whether ``LATEST`` names this step.
    latest: bool
    #: Tiers holding a verified copy: ``L1`` (local), ``L2`` (S3).
    tiers: tuple[str, ...]

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CheckpointInfo:
        """Builds it from a ``CheckpointInfo`` JSON object."""
        d = _obj(d, "a checkpoint")
        return cls(
            step=_get(d, "step", int, 0),
            path=_get(d, "path", str, ""),
            verified=_get(d, "verified", bool, False),
            size_bytes=_get(d, "bytes", int, 0),
            latest=_get(d, "latest", bool, False),
            tiers=tuple(str(t) for t in _list(d, "tiers")),
        )


@dataclass(frozen=True)
class MemberInfo:
    """One coordinator of the cluster."""

    node_id: int
    grpc_addr: str
    http_addr: str
    #: ``leader`` | ``follower`` | ``candidate`` | ``learner`` | ``unreachable`` |
    #: ``shutdown``: a :class:`MemberRole`. The leader shows a coordinator that has not
    #: answered its heartbeats for a while (about a second) as ``unreachable``.
    role: MemberRole
    voter: bool
    #: With :attr:`role` ``unreachable``: the role it had (``follower`` or ``learner``);
    #: ``None`` otherwise.
    last_role: MemberRole | None = None
    #: On the leader's answer: milliseconds since the coordinator last acknowledged the
    #: leader (``None`` for the leader itself, and in a follower's answer).
    last_ack_age_ms: int | None = None
    #: Its Raft address (``cumulus-coordinator --raft-listen``); ``""`` when Raft shares
    #: its gRPC port.
    raft_addr: str = ""


@dataclass(frozen=True)
class GpuInfo:
    """One GPU of a worker: what the agent registered, its last heartbeat's reading and
    the share of it given to running ranks."""

    #: NVML index on its worker (0-based).
    index: int
    #: NVML UUID (``GPU-...``): what ``CUDA_VISIBLE_DEVICES`` names.
    uuid: str
    #: Product name, e.g. ``NVIDIA H100 80GB HBM3``.
    name: str
    memory_total_bytes: int
    #: From the last heartbeat; ``None`` when unknown (the answer came from a follower,
    #: or no heartbeat carried it yet), as are ``utilization_percent`` and ``healthy``.
    memory_used_bytes: int | None = None
    #: 0..=100: time a kernel ran over NVML's last sample period.
    utilization_percent: int | None = None
    #: ``False``: NVML answered an error for it, or it is gone; the leader places nothing
    #: new on it and fails the ranks using it. ``None``: unknown.
    healthy: bool | None = None
    #: Why it is unhealthy (``""`` otherwise).
    error: str = ""
    #: Sum of the shares given to running ranks, 0..=1 (a whole GPU counts 1).
    allocated: float = 0.0

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> GpuInfo:
        """Builds it from a ``GpuInfo`` JSON object (``device``, ``status``, ``allocated``).

        :raises ProtocolError: a field has the wrong type."""
        d = _obj(d, "a GPU")
        device = _obj(d.get("device") or {}, "a GPU's device")
        raw_status = d.get("status")
        status = None if raw_status is None else _obj(raw_status, "a GPU's status")
        return cls(
            index=_get(device, "index", int, 0),
            uuid=_get(device, "uuid", str, ""),
            name=_get(device, "name", str, ""),
            memory_total_bytes=_get(device, "memory_total_bytes", int, 0),
            memory_used_bytes=None if status is None else _get(status, "memory_used_bytes", int, 0),
            utilization_percent=(
                None if status is None else _get(status, "utilization_percent", int, 0)
            ),
            healthy=None if status is None else _get(status, "healthy", bool, False),
            error="" if status is None else _get(status, "error", str, ""),
            allocated=_get(d, "allocated", float, 0.0),
        )


@dataclass(frozen=True)
class WorkerInfo:
    """One worker agent as the leader sees it."""

    worker_id: str
    host: str
    http_addr: str
    slots: int
    slots_used: int
    #: ``alive`` | ``expired``: a :class:`WorkerState`.
    state: WorkerState
    last_heartbeat_age_ms: int
    cpu_percent: float
    memory_used_bytes: int
    memory_total_bytes: int
    #: The worker's GPUs, in index order.
    gpus: tuple[GpuInfo, ...] = ()
    #: The warm spares its agent keeps (from its last heartbeat; empty on a follower).
    warm_spares: tuple[WarmSpareInfo, ...] = ()


@dataclass(frozen=True)
class WarmSpareInfo:
    """An idle interpreter a worker keeps for a job (``Client.submit(warm_spares=...)``),
    waiting to become one of its ranks."""

    job_id: str
    #: Its process id: a rank attempt that takes it keeps this pid.
    pid: int
    #: Milliseconds since it was started.
    age_ms: int


@dataclass(frozen=True)
class ClusterInfo:
    """The cluster as the answering coordinator sees it (``GET /v1/cluster``)."""

    #: The coordinator that answered.
    node_id: int
    leader_id: int | None
    term: int
    commit_index: int | None
    last_applied_index: int | None
    members: tuple[MemberInfo, ...]
    workers: tuple[WorkerInfo, ...]
    raw: Mapping[str, Any] = field(repr=False)

    @property
    def leader(self) -> MemberInfo | None:
        """The leader, when known."""
        return next((m for m in self.members if m.node_id == self.leader_id), None)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ClusterInfo:
        """Builds it from a ``ClusterStatusResponse`` JSON object."""
        d = _obj(d, "the cluster status")
        members = tuple(
            MemberInfo(
                node_id=_get(m, "node_id", int, 0),
                grpc_addr=_get(m, "grpc_addr", str, ""),
                http_addr=_get(m, "http_addr", str, ""),
                role=_enum(m, "role", MemberRole),
                voter=_get(m, "voter", bool, False),
                last_role=_enum(m, "last_role", MemberRole) if m.get("last_role") else None,
                last_ack_age_ms=_opt_int(m, "last_ack_age_ms"),
                raft_addr=_get(m, "raft_addr", str, ""),
            )
            for m in (_obj(x, "a member") for x in _list(d, "members"))
        )
        workers = tuple(
            WorkerInfo(
                worker_id=_get(w, "worker_id", str, ""),
                host=_get(w, "host", str, ""),
                http_addr=_get(w, "http_addr", str, ""),
                slots=_get(w, "slots", int, 0),
                slots_used=_get(w, "slots_used", int, 0),
                state=_enum(w, "state", WorkerState),
                last_heartbeat_age_ms=_get(w, "last_heartbeat_age_ms", int, 0),
                cpu_percent=_get(w, "cpu_percent", float, 0.0),
                memory_used_bytes=_get(w, "memory_used_bytes", int, 0),
                memory_total_bytes=_get(w, "memory_total_bytes", int, 0),
                gpus=tuple(GpuInfo.from_json(g) for g in _list(w, "gpus")),
                warm_spares=tuple(
                    WarmSpareInfo(
                        job_id=_get(x, "job_id", str, ""),
                        pid=_get(x, "pid", int, 0),
                        age_ms=_get(x, "age_ms", int, 0),
                    )
                    for x in (_obj(y, "a warm spare") for y in _list(w, "warm_spares"))
                ),
            )
            for w in (_obj(x, "a worker") for x in _list(d, "workers"))
        )
        return cls(
            node_id=_get(d, "node_id", int, 0),
            leader_id=_opt_int(d, "leader_id"),
            term=_get(d, "term", int, 0),
            commit_index=_opt_int(d, "commit_index"),
            last_applied_index=_opt_int(d, "last_applied_index"),
            members=members,
            workers=workers,
            raw=d,
        )


@dataclass(frozen=True)
class LogLine:
    """One line of a rank's log (stdout and stderr together), without its newline."""

    rank: int
    attempt: int
    #: Byte offset of the line in that attempt's log.
    offset: int
    line: str

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LogLine:
        """Builds it from the ``data`` of a ``log`` event."""
        d = _obj(d, "a log event")
        for key in ("rank", "attempt", "offset"):
            if not isinstance(d.get(key), int) or isinstance(d.get(key), bool):
                raise ProtocolError(f"log event without an integer {key!r}: {dict(d)!r}")
        if not isinstance(d.get("line"), str):
            raise ProtocolError(f"log event without a 'line' string: {dict(d)!r}")
        return cls(rank=d["rank"], attempt=d["attempt"], offset=d["offset"], line=d["line"])
