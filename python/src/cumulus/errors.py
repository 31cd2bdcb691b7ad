"""Every exception Cumulus raises, in one place.

Standard library only: the rank runtime imports this module.

Two families share the base class :class:`CumulusError`:

* the rank runtime (:mod:`cumulus.runtime`): :class:`NotInCumulusRank`,
  :class:`RankEnvironmentError`, :class:`CheckpointsDisabled`, :class:`InvalidStep`,
  :class:`InvalidMetric`, :class:`InvalidState`, :class:`AgentError`,
  :class:`StaleAttempt`, :class:`CheckpointFailed`;
* the client SDK (:mod:`cumulus.client`): :class:`ConfigError`, :class:`ApiError` and its
  subclasses (one per HTTP status the coordinators answer), :class:`NotACoordinator`,
  :class:`WaitTimeout`, :class:`JobFailed`, :class:`Unsupported`; remote functions
  (:meth:`cumulus.Client.run`) and uploads: :class:`RemoteError`,
  :class:`PythonVersionMismatch`, :class:`ResultUnavailable`, :class:`BundleError`,
  :class:`WorkdirTooLarge`.

And one warning (Python ``warnings``, not an exception): :class:`SubmitWarning`, what the
coordinator says about a job it accepted (e.g. restarts without a checkpoint directory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cumulus import _contract

if TYPE_CHECKING:
    from cumulus.models import JobInfo

__all__ = [
    "AgentError",
    "ApiError",
    "BundleError",
    "CheckpointFailed",
    "CheckpointsDisabled",
    "ConfigError",
    "Conflict",
    "CumulusError",
    "Forbidden",
    "InvalidMetric",
    "InvalidSpec",
    "InvalidState",
    "InvalidStep",
    "JobFailed",
    "NotACoordinator",
    "NotFound",
    "NotInCumulusRank",
    "ProtocolError",
    "PythonVersionMismatch",
    "RankEnvironmentError",
    "RemoteError",
    "ResourceExhausted",
    "ResultUnavailable",
    "ServerError",
    "StaleAttempt",
    "SubmitWarning",
    "Unauthorized",
    "Unavailable",
    "Unsupported",
    "WaitTimeout",
    "WorkdirTooLarge",
]


class CumulusError(Exception):
    """Base class of every error raised by the ``cumulus`` package."""


# ---------------------------------------------------------------------------------------
# Rank runtime
# ---------------------------------------------------------------------------------------


class NotInCumulusRank(CumulusError, RuntimeError):
    """The process is not a rank started by a Cumulus worker agent (``CUMULUS_JOB_ID`` is
    not set), and the call needs one. ``get_context(standalone=True)`` gives a context for
    plain ``python`` or ``torchrun`` runs instead."""


class RankEnvironmentError(CumulusError, ValueError):
    """A rank environment variable is missing or malformed, or variables that only make
    sense together are not all set. :attr:`name` is the variable (or ``None`` when the
    problem concerns several)."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name

    @property
    def is_resume(self) -> bool:
        """Whether the problem concerns the resume variables (``CUMULUS_RESUME_*``)."""
        names = (_contract.RANK_ENV_RESUME_DIR, _contract.RANK_ENV_RESUME_STEP)
        return any(n in (self.name or "") or n in str(self) for n in names)


class CheckpointsDisabled(CumulusError, RuntimeError):
    """The job was submitted without a checkpoint directory (``CUMULUS_CKPT_STAGING`` is
    not set), so nothing can be committed. Submit it with ``ckpt_dir=...``."""


class InvalidStep(CumulusError, ValueError):
    """A checkpoint or progress step is not a non-negative integer, or a checkpoint step
    is not after the last one committed (or resumed from) by this rank."""


class InvalidMetric(CumulusError, ValueError):
    """A progress metric is not a real number (NaN and infinities are valid ones), or its
    name is empty or too long, or there are too many metrics."""


class InvalidState(CumulusError, ValueError):
    """A checkpoint ``state`` is not a JSON object of finite values, or is larger than the
    agent accepts (64 KiB serialized)."""


class AgentError(CumulusError):
    """A request to the worker agent's rank-local API failed.

    :attr:`status` is the HTTP status, or ``None`` when no answer came (connection
    refused or reset, timeout); :attr:`message` is the agent's ``error`` text.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class StaleAttempt(AgentError):
    """The agent or the leader rejected this attempt as stale (HTTP 409, or 401 once the
    agent has dropped the attempt's token): another attempt replaced this one, or the job
    ended. Retrying cannot help; the rank must stop (exit) at once."""


class CheckpointFailed(CumulusError):
    """A checkpoint part could not be committed: the agent refused it for a reason other
    than staleness, or every retry until the commit deadline failed. :attr:`step` is the
    checkpoint's step; ``__cause__`` is the last :class:`AgentError`."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


# ---------------------------------------------------------------------------------------
# Client SDK
# ---------------------------------------------------------------------------------------


class ConfigError(CumulusError, ValueError):
    """Nothing (or nothing valid) says where the cluster is or what its token is: no
    ``CUMULUS_HTTP``/addresses, no token, or an unreadable ``cluster.json`` or token
    file; or the TLS settings cannot be used (a bad CA certificate, a client certificate
    or key that is unreadable, not a user's or mismatched, one without the other, or
    one with ``insecure``)."""


class ApiError(CumulusError):
    """A coordinator answered with an error. :attr:`status` is the HTTP status (``None``
    when no coordinator answered at all), :attr:`message` the server's ``error`` text and
    :attr:`address` the coordinator (``host:port``) that answered last."""

    def __init__(
        self, message: str, *, status: int | None = None, address: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.address = address


class InvalidSpec(ApiError, ValueError):
    """HTTP 400: the request (usually the job spec) was refused; the message says why."""


class Unauthorized(ApiError, PermissionError):
    """HTTP 401: the bearer token is missing or wrong, or, without a token, the client
    certificate names no user the cluster has (never created, or revoked)."""


class Forbidden(ApiError, PermissionError):
    """HTTP 403: the token is valid but may not do this (e.g. pausing or cancelling
    another user's job)."""


class NotFound(ApiError, LookupError):
    """HTTP 404: no such job."""


class Conflict(ApiError):
    """HTTP 409: the operation does not apply in the job's current state (e.g. cancelling
    a job that already finished, resuming a job that is not paused, pausing one whose
    stop is already in flight)."""


class ResourceExhausted(ApiError):
    """HTTP 429: the cluster's state budget is full; retry after old jobs were evicted."""


class ServerError(ApiError):
    """HTTP 500 (or another unexpected status) from a coordinator."""


class Unavailable(ApiError, ConnectionError):
    """No coordinator could serve the request within the retry budget: every address was
    unreachable, timed out, or answered 503 (no leader, e.g. during an election)."""


class ProtocolError(ApiError):
    """A coordinator's answer is not what the API promises (malformed JSON or event)."""


class NotACoordinator(CumulusError):
    """A server's TLS certificate is valid under the cluster CA but does not name a
    coordinator (``cumulus://coordinator/N``): a worker's or another member's certificate
    served on a coordinator's address. The connection is closed after the handshake,
    before any request or token is sent; it is not retried. :attr:`address` is the server
    (``host:port``), :attr:`found` the identity its certificate names (or why none)."""

    def __init__(self, message: str, *, address: str, found: str) -> None:
        super().__init__(message)
        self.address = address
        self.found = found


class WaitTimeout(CumulusError, TimeoutError):
    """``Job.wait(timeout_s=...)`` gave up; the job keeps running. :attr:`job` is its last
    status seen."""

    def __init__(self, message: str, job: JobInfo) -> None:
        super().__init__(message)
        self.job = job


class JobFailed(CumulusError):
    """``Client.run`` waited for a job that ended ``failed``, ``cancelled`` or
    ``timed_out``. :attr:`job` is its final status (``job.failure_cause`` says why)."""

    def __init__(self, message: str, job: JobInfo) -> None:
        super().__init__(message)
        self.job = job


class Unsupported(CumulusError, NotImplementedError):
    """The coordinator API has no endpoint for this operation yet; the message names the
    missing server feature."""

    def __init__(self, message: str, *, feature: str) -> None:
        super().__init__(message)
        self.feature = feature


# ---------------------------------------------------------------------------------------
# Remote functions and uploads
# ---------------------------------------------------------------------------------------


class BundleError(CumulusError, ValueError):
    """A directory cannot be packed for upload (a symbolic link out of it, a special file
    in it, an unreadable file, a path too long, too many files), or a packed directory read back
    (a job's artifacts) is not one: an entry that is a link or a device, a path that is
    absolute or climbs out with ``..``, a decompression bomb. The message names the
    entry."""


class WorkdirTooLarge(BundleError):
    """A directory to upload holds more bytes in files than the upload limit
    (``DEFAULT_MAX_WORKDIR_BYTES``, 512 MiB, unless raised). The message names the
    largest files; :attr:`limit_bytes` is the limit."""

    def __init__(self, message: str, *, limit_bytes: int) -> None:
        super().__init__(message)
        self.limit_bytes = limit_bytes


class RemoteError(CumulusError):
    """The function :meth:`cumulus.Client.run` ran raised an exception on a rank (or its
    result could not be delivered: too large, not picklable). :attr:`remote_type` is the
    exception's qualified type name (e.g. ``builtins.ValueError``), :attr:`remote_message`
    its text, :attr:`remote_traceback` the remote traceback as text, :attr:`rank` the rank
    that raised it and :attr:`job` the job's final status (``None`` when unknown)."""

    def __init__(
        self,
        *,
        remote_type: str,
        remote_message: str,
        remote_traceback: str,
        rank: int,
        job: JobInfo | None = None,
    ) -> None:
        where = f" (rank {rank} of {job.id})" if job is not None else f" (rank {rank})"
        text = f"{remote_type}: {remote_message}{where}"
        if remote_traceback:
            text += f"\n\nRemote traceback:\n{remote_traceback.rstrip()}"
        super().__init__(text)
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        self.rank = rank
        self.job = job


class PythonVersionMismatch(CumulusError):
    """A remote function was refused before it ran: the rank's Python (``major.minor``,
    :attr:`remote`) is not the client's (:attr:`client`), and a function pickled by one
    cannot be loaded by the other. The job failed at once, spending no restart. Run it
    with an environment of the client's version (``requirements=[...]`` builds one with
    the client's ``major.minor``), or from a client of the workers' version."""

    def __init__(self, message: str, *, client: str, remote: str, job: JobInfo | None) -> None:
        super().__init__(message)
        self.client = client
        self.remote = remote
        self.job = job


class ResultUnavailable(CumulusError):
    """A job ended without the result :meth:`cumulus.Job.result` looks for: it succeeded
    but rank 0 (with ``gather``, some rank) left no result file (not a job of
    :meth:`cumulus.Client.run`, or its artifacts were not uploaded: the rank's log says
    why). :attr:`job` is its final status."""

    def __init__(self, message: str, job: JobInfo) -> None:
        super().__init__(message)
        self.job = job


class SubmitWarning(UserWarning):
    """What the coordinator said about a job it accepted, issued with
    :func:`warnings.warn` by :meth:`Client.submit <cumulus.Client.submit>` (the same
    sentences ``cumulusctl submit`` prints on stderr, also in :attr:`Job.warnings
    <cumulus.Job.warnings>`): e.g. a job that may restart but has no checkpoint directory,
    whose every restart starts over from step 0. Silence one kind with
    ``warnings.filterwarnings("ignore", category=cumulus.SubmitWarning)``."""
