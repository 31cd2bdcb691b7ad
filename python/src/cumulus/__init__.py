"""Cumulus for Python: the rank runtime and the client SDK.

* :mod:`cumulus.runtime` — what a training script running as a Cumulus rank calls:
  :func:`~cumulus.runtime.get_context`, :func:`~cumulus.runtime.report`,
  :func:`~cumulus.runtime.checkpoint`, :func:`~cumulus.runtime.resume`,
  :func:`~cumulus.runtime.should_stop`, :func:`~cumulus.runtime.stop_agreed`,
  :func:`~cumulus.runtime.should_pause`,
  :func:`~cumulus.runtime.stop_request`, :func:`~cumulus.runtime.time_to_checkpoint`,
  :func:`~cumulus.runtime.list_checkpoints`, :class:`~cumulus.runtime.ShardReader`,
  :class:`~cumulus.runtime.EpochSampler`.
  Standard library only.
* :mod:`cumulus.ckpt` — framework checkpoints (PyTorch, NumPy, JSON values, RNG state)
  written into a checkpoint part and restored bit for bit; frameworks imported lazily.
* :mod:`cumulus.torch` — :func:`~cumulus.torch.exact_ddp`: ``DistributedDataParallel``
  whose resume is bit for bit at any world size (not imported by ``import cumulus``;
  PyTorch imported when it is called).
* :class:`cumulus.Client` — submit jobs (a local directory uploaded with them, a Python
  environment built for them), run functions on the cluster (``client.run(fn, ...)``
  returns their value), follow jobs, read their logs, checkpoints and artifacts (needs
  ``httpx``, ``cloudpickle``, ``pathspec``, ``blake3``; imported only when first used, so
  ranks never load them).
* :mod:`cumulus.errors` — every exception, and :class:`~cumulus.SubmitWarning`.
* States as string enums from the generated contract: :class:`~cumulus.JobState`
  (``JobInfo.state``), :class:`~cumulus.RankPhase` (a rank's state, ``RankInfo.state``),
  :class:`~cumulus.WorkerState`, :class:`~cumulus.MemberRole`; each member equals its
  wire spelling (``info.state == "running"``).
"""

# No `from __future__ import annotations` and no bare `typing` names here: what this
# module binds is the package's public namespace (`dir(cumulus)`).
import typing as _typing

from cumulus import errors, runtime
from cumulus.errors import (
    AgentError,
    ApiError,
    BundleError,
    CheckpointFailed,
    CheckpointsDisabled,
    ConfigError,
    Conflict,
    CumulusError,
    Forbidden,
    InvalidMetric,
    InvalidSpec,
    InvalidState,
    InvalidStep,
    JobFailed,
    NotACoordinator,
    NotFound,
    NotInCumulusRank,
    ProtocolError,
    PythonVersionMismatch,
    RankEnvironmentError,
    RemoteError,
    ResourceExhausted,
    ResultUnavailable,
    ServerError,
    StaleAttempt,
    SubmitWarning,
    Unauthorized,
    Unavailable,
    Unsupported,
    WaitTimeout,
    WorkdirTooLarge,
)
from cumulus.models import (
    ArtifactFile,
    CheckpointInfo,
    ClusterInfo,
    GpuInfo,
    JobInfo,
    JobState,
    JobSummary,
    LogLine,
    MemberInfo,
    MemberRole,
    ProgressSample,
    RankInfo,
    RankPhase,
    ResizeEvent,
    StragglerFlag,
    UploadInfo,
    WarmSpareInfo,
    WorkerInfo,
    WorkerState,
)
from cumulus.runtime import (
    Context,
    ElasticData,
    EpochSampler,
    ResumePoint,
    ShardReader,
    checkpoint,
    get_context,
    list_checkpoints,
    report,
    resume,
    should_pause,
    should_stop,
    stop_agreed,
    stop_request,
    time_to_checkpoint,
)

if _typing.TYPE_CHECKING:
    from cumulus.client import Client, Job

__version__ = "0.1.0"

__all__ = [
    "AgentError",
    "ApiError",
    "ArtifactFile",
    "BundleError",
    "CheckpointFailed",
    "CheckpointInfo",
    "CheckpointsDisabled",
    "Client",
    "ClusterInfo",
    "ConfigError",
    "Conflict",
    "Context",
    "CumulusError",
    "ElasticData",
    "EpochSampler",
    "Forbidden",
    "GpuInfo",
    "InvalidMetric",
    "InvalidSpec",
    "InvalidState",
    "InvalidStep",
    "Job",
    "JobFailed",
    "JobInfo",
    "JobState",
    "JobSummary",
    "LogLine",
    "MemberInfo",
    "MemberRole",
    "NotACoordinator",
    "NotFound",
    "NotInCumulusRank",
    "ProgressSample",
    "ProtocolError",
    "PythonVersionMismatch",
    "RankEnvironmentError",
    "RankInfo",
    "RankPhase",
    "RemoteError",
    "ResizeEvent",
    "ResourceExhausted",
    "ResultUnavailable",
    "ResumePoint",
    "ServerError",
    "ShardReader",
    "StaleAttempt",
    "StragglerFlag",
    "SubmitWarning",
    "Unauthorized",
    "Unavailable",
    "Unsupported",
    "UploadInfo",
    "WaitTimeout",
    "WarmSpareInfo",
    "WorkdirTooLarge",
    "WorkerInfo",
    "WorkerState",
    "__version__",
    "checkpoint",
    "errors",
    "get_context",
    "list_checkpoints",
    "report",
    "resume",
    "runtime",
    "should_pause",
    "should_stop",
    "stop_agreed",
    "stop_request",
    "time_to_checkpoint",
]


def __getattr__(name: str) -> _typing.Any:
    # The SDK needs httpx; a rank that only uses the runtime never imports it.
    if name in ("Client", "Job"):
        from cumulus import client

        return getattr(client, name)
    raise AttributeError(f"module 'cumulus' has no attribute {name!r}")
