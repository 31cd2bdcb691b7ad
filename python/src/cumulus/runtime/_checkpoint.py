"""Checkpoint parts: written into the attempt's staging dir, committed by the worker agent
(``POST /v1/checkpoint``), resumed from ``CUMULUS_RESUME_DIR``.

The commit protocol (docs/architecture.md, "Checkpoint layout"): the rank writes its part
into ``CUMULUS_CKPT_STAGING``; the agent hashes and fsyncs every file, renames the dir to
``<ckpt_dir>/<job>/step-N/rank-R/attempt-A/``, re-creates an empty staging dir and reports
the part to the leader; it answers once the leader acknowledged. A step is committed (and
can be resumed from) once every rank's part of it is.

:meth:`Checkpointer.save_async` does the writing and the commit on a background thread
(one commit in flight at a time); :class:`PendingCheckpoint` is its handle.

A commit refused (HTTP 409/401) after this rank was asked to stop (a cancel, a group
restart replacing it, SIGTERM) is a clean stop, not an error: the attempt is ending, the
part is not committed, and the call returns ``None`` (``StagedCheckpoint.committed``
stays ``None``) instead of raising :class:`~cumulus.errors.StaleAttempt`, so the usual
loop (checkpoint when ``should_stop()``, then exit 0) exits 0. Without a stop request a
refusal still raises.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from cumulus._contract import MANIFEST_FILE, MAX_STATE_JSON_BYTES, Manifest, ManifestPart
from cumulus.errors import (
    AgentError,
    CheckpointFailed,
    CheckpointsDisabled,
    InvalidState,
    InvalidStep,
    NotInCumulusRank,
    StaleAttempt,
)
from cumulus.runtime._agent import CHECKPOINT_TIMEOUT_S, AgentClient
from cumulus.runtime._env import Context
from cumulus.runtime._writeback import Writeback

__all__ = [
    "COMMIT_DEADLINE_S",
    "MAX_STATE_BYTES",
    "STATE_FILE",
    "Checkpointer",
    "CommittedPart",
    "PendingCheckpoint",
    "ResumePoint",
    "StagedCheckpoint",
]

#: Largest checkpoint ``state``, serialized compactly, in bytes (the agent's limit).
MAX_STATE_BYTES = MAX_STATE_JSON_BYTES
#: File in every part holding the ``state`` it was committed with (read by ``resume()``
#: whatever the storage backend). The name is reserved in the staging dir.
STATE_FILE = "cumulus-state.json"
#: Default time within which a commit is retried, in seconds.
COMMIT_DEADLINE_S = 120.0
#: First wait before retrying a commit, in seconds; doubles up to ``_BACKOFF_MAX_S``.
_BACKOFF_INITIAL_S = 0.1
_BACKOFF_MAX_S = 5.0
#: Agent statuses after which the same request may succeed: 502/503 (the leader failed or
#: was unreachable; the agent keeps the part committed locally and re-reports it).
_RETRY_STATUSES = frozenset({502, 503})


@dataclass(frozen=True)
class CommittedPart:
    """A checkpoint part the leader acknowledged."""

    #: The checkpoint's step.
    step: int
    #: The part's directory relative to the job's checkpoint dir, e.g.
    #: ``step-00000100/rank-0/attempt-1`` (the agent's answer).
    dir: str
    #: The part's absolute path on this machine (``None`` when it cannot be derived).
    path: Path | None


@dataclass(frozen=True)
class ResumePoint:
    """Where this attempt resumes: this rank's committed part of ``step``."""

    #: The committed step.
    step: int
    #: This rank's part of it (``CUMULUS_RESUME_DIR``): read your files from here.
    dir: Path
    #: The ``state`` the part was committed with (``{}`` when none was recorded).
    state: Mapping[str, Any] = field(default_factory=dict)
    #: What :func:`cumulus.ckpt.load_checkpoint` loaded from the part, by name (read
    #: only): the objects passed, restored in place, and for a name passed as ``None``
    #: (or a JSON value) the saved value, to rebind (``perm = point.objects["perm"]``).
    #: Empty from :func:`cumulus.runtime.resume`, which loads nothing.
    objects: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    #: Where :func:`cumulus.ckpt.load_checkpoint` read :attr:`objects` from: ``"memory"``
    #: (after an in-process restart, the host copy this process's asynchronous
    #: checkpoint kept of this very part) or ``"disk"`` (the part's files). ``None`` from
    #: :func:`cumulus.runtime.resume`, which loads nothing.
    source: str | None = field(default=None, compare=False)


class StagedCheckpoint(os.PathLike[str]):
    """The staging dir of one checkpoint being written, yielded by
    :meth:`Checkpointer.checkpoint`. Use it as a path (``open(stage / "model.pt", "wb")``,
    ``os.fspath(stage)``); fill :attr:`state` before the block ends to commit more resume
    state; after the block, :attr:`committed` says where the part went."""

    def __init__(self, step: int, path: Path, state: dict[str, Any]) -> None:
        #: The checkpoint's step.
        self.step = step
        #: The staging dir (the attempt's ``CUMULUS_CKPT_STAGING``).
        self.path = path
        #: The JSON state committed with the part (≤ 64 KiB); may be changed in the block.
        self.state = state
        #: Set once the leader acknowledged the part.
        self.committed: CommittedPart | None = None

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __truediv__(self, other: str | os.PathLike[str]) -> Path:
        return self.path / other

    def __repr__(self) -> str:
        return f"StagedCheckpoint(step={self.step}, path={str(self.path)!r})"


class PendingCheckpoint:
    """A checkpoint being written and committed on a background thread, returned by
    :meth:`Checkpointer.save_async` (and :func:`cumulus.ckpt.save_checkpoint_async`).

    Its outcome is the one the synchronous call would have had: :meth:`wait` returns the
    :class:`CommittedPart` (``None``: refused because this rank is being stopped) or
    raises the error (:class:`~cumulus.errors.StaleAttempt`,
    :class:`~cumulus.errors.CheckpointFailed`, an ``OSError`` of the first write...). An
    error nobody asked for with :meth:`wait` is raised by the rank's next checkpoint
    instead, or, failing that, logged on stderr at exit.
    """

    def __init__(self, step: int, exit_wait_s: float) -> None:
        #: The checkpoint's step.
        self.step = step
        self._exit_wait_s = exit_wait_s
        self._done = threading.Event()
        self._part: CommittedPart | None = None
        self._error: BaseException | None = None
        self._raised = False

    def __repr__(self) -> str:
        if not self._done.is_set():
            how = "in flight"
        elif self._error is not None:
            how = f"failed: {type(self._error).__name__}"
        else:
            how = "committed"
        return f"PendingCheckpoint(step={self.step}, {how})"

    def done(self) -> bool:
        """Whether the commit has ended (committed, or failed); never blocks."""
        return self._done.is_set()

    def committed_part(self) -> CommittedPart | None:
        """The part, once committed; ``None`` while in flight, or when the commit failed
        or was refused. Never blocks nor raises (an error stays for :meth:`wait`)."""
        if not self._done.is_set() or self._error is not None:
            return None
        return self._part

    def wait(self, timeout_s: float | None = None) -> CommittedPart | None:
        """Waits until the part is committed (at most ``timeout_s`` seconds; ``None``: as
        long as the commit takes, which its retry deadline bounds) and returns it, or
        ``None`` when it was refused because this rank is being stopped (see the module
        doc). May be called again: it returns the same part, or raises the same error.

        :raises TimeoutError: still in flight after ``timeout_s`` seconds (it goes on).
        :raises StaleAttempt: this attempt was replaced (HTTP 409/401): exit now.
        :raises CheckpointFailed: the commit failed until the commit deadline.
        :raises: whatever writing the files raised on the first try (``OSError``...).
        """
        if not self._done.wait(timeout_s):
            raise TimeoutError(
                f"checkpoint step {self.step} is still being committed after {timeout_s} s"
            )
        return self._outcome()

    def _outcome(self) -> CommittedPart | None:
        if self._error is not None:
            self._raised = True
            _untrack(self)
            raise self._error
        return self._part

    def _finish(self, part: CommittedPart | None, error: BaseException | None) -> None:
        self._part, self._error = part, error
        if error is None:
            _untrack(self)
        self._done.set()

    def _settle(self, timeout_s: float, why: str) -> None:
        """Waits up to ``timeout_s`` seconds; reports on stderr a commit still in flight
        then, or one that failed without its error having been raised (``why``: when)."""
        if not self._done.wait(max(timeout_s, 0.0)):
            print(
                f"cumulus: checkpoint step {self.step} was still being committed {why} "
                f"(waited {max(timeout_s, 0.0):.0f} s); it may be lost",
                file=sys.stderr,
                flush=True,
            )
            return
        if self._error is not None and not self._raised:
            self._raised = True
            _untrack(self)
            print(
                f"cumulus: checkpoint step {self.step} was not committed (found {why}): "
                f"{type(self._error).__name__}: {self._error}",
                file=sys.stderr,
                flush=True,
            )


#: Background commits in flight, or failed with their error not raised yet: waited for
#: (and reported) at interpreter exit.
_unsettled: set[PendingCheckpoint] = set()
_unsettled_lock = threading.Lock()
_exit_hook_registered = False


def _track(pending: PendingCheckpoint) -> None:
    global _exit_hook_registered
    with _unsettled_lock:
        _unsettled.add(pending)
        if not _exit_hook_registered:
            atexit.register(_settle_at_exit)
            _exit_hook_registered = True


def _untrack(pending: PendingCheckpoint) -> None:
    with _unsettled_lock:
        _unsettled.discard(pending)


def _settle_at_exit() -> None:
    """At interpreter exit: lets every background commit finish (each within its commit
    deadline plus one request's time limit) and reports any that did not."""
    start = time.monotonic()
    with _unsettled_lock:
        pending = sorted(_unsettled, key=lambda p: p.step)
    for p in pending:
        p._settle(start + p._exit_wait_s - time.monotonic(), "at exit")


def _state_dict(state: Mapping[str, Any] | None) -> dict[str, Any]:
    if state is None:
        return {}
    if not isinstance(state, Mapping):
        raise InvalidState(f"state must be a dict (a JSON object), got {type(state).__name__}")
    return dict(state)


def _encode_state(state: Mapping[str, Any]) -> bytes:
    if not isinstance(state, Mapping):
        raise InvalidState(f"state must be a dict (a JSON object), got {type(state).__name__}")
    try:
        # Compact and not ASCII-escaped: the size the agent measures (serde_json).
        data = json.dumps(
            dict(state), separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise InvalidState(f"state is not JSON (finite numbers, str keys): {e}") from e
    if len(data) > MAX_STATE_BYTES:
        raise InvalidState(
            f"state is {len(data)} bytes serialized, at most {MAX_STATE_BYTES}: put large "
            "data in files of the checkpoint instead"
        )
    return data


def _empty_dir(path: Path) -> None:
    """Creates ``path`` (not its parents) if missing and removes everything inside."""
    with suppress(FileExistsError):
        path.mkdir()
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


def _read_state_file(part: Path) -> dict[str, Any] | None:
    try:
        with open(part / STATE_FILE, "rb") as f:
            data = f.read(MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        return None
    parsed = json.loads(data)
    return parsed if isinstance(parsed, dict) else None


def _read_manifest_state(part: Path, rank: int) -> dict[str, Any] | None:
    """The part's state from the step's ``MANIFEST.json`` (local layout:
    ``step-N/rank-R/attempt-A``), or ``None``."""
    path = part.parent.parent / MANIFEST_FILE
    try:
        parsed = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(parsed, dict):
        return None
    # Read as the contract's shapes, so that mypy checks the field names; the values are
    # still checked, as anything read from disk.
    parts: object = cast(Manifest, parsed).get("parts", [])
    for p in parts if isinstance(parts, list) else []:
        if not isinstance(p, dict):
            continue
        entry = cast(ManifestPart, p)
        if entry.get("rank") == rank and isinstance(entry.get("state"), dict):
            return dict(entry["state"])
    return None


class Checkpointer:
    """Writes this rank's checkpoint parts and has the agent commit them.

    Commits are retried with doubling backoff (0.1 s up to 5 s) until ``commit_deadline_s``
    after the first try when the agent could not be reached or answered 502/503 (the
    leader failed or was unreachable: the agent keeps the part and re-reports it). A
    409/401 raises :class:`~cumulus.errors.StaleAttempt` at once: another attempt replaced
    this one, and the rank must exit; when ``stop_asked()`` says this rank was already
    asked to stop, the refusal is the stop's own and the commit returns ``None`` instead.

    One checkpoint at a time: :meth:`save_async` commits on a background thread, and every
    checkpoint (:meth:`checkpoint`, :meth:`save`, :meth:`save_async`) first waits for the
    one in flight, raising its error if :meth:`PendingCheckpoint.wait` did not.
    """

    def __init__(
        self,
        context: Context,
        agent: AgentClient | None,
        *,
        commit_deadline_s: float = COMMIT_DEADLINE_S,
        stop_asked: Callable[[], bool] | None = None,
    ) -> None:
        self.context = context
        self._agent = agent
        self.commit_deadline_s = commit_deadline_s
        #: Whether this rank was asked to stop (an agent action or SIGTERM), checked when
        #: a commit is refused; ``None``: never (every refusal raises).
        self.stop_asked = stop_asked
        self._lock = threading.Lock()
        #: The last step this process committed (``None`` before the first).
        self.last_committed_step: int | None = None
        #: The latest background commit (see :meth:`save_async`).
        self._pending: PendingCheckpoint | None = None
        self._async_lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether checkpoints can be committed (a Cumulus rank of a job with a checkpoint
        dir)."""
        return self._agent is not None and self.context.staging_dir is not None

    def _require(self) -> tuple[AgentClient, Path]:
        if self.context.standalone or self._agent is None:
            raise NotInCumulusRank(
                "checkpoint() needs a Cumulus rank (CUMULUS_JOB_ID and CUMULUS_AGENT_URL are "
                "not set): a standalone run has nobody to commit checkpoints; check "
                "Checkpointer.enabled (or cumulus.runtime.checkpoints_enabled()) first"
            )
        if self.context.staging_dir is None:
            raise CheckpointsDisabled(
                f"job {self.context.job_id} has no checkpoint dir (CUMULUS_CKPT_STAGING is "
                "not set): submit it with a checkpoint dir (cumulusctl submit --ckpt-dir, "
                "Client.submit(ckpt_dir=...))"
            )
        return self._agent, self.context.staging_dir

    def _acquire(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                "a checkpoint of this rank is already being written (checkpoints cannot be "
                "nested or written from two threads at once)"
            )

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        self._acquire()
        try:
            yield
        finally:
            self._lock.release()

    def _await_previous(self) -> None:
        """Waits for the background commit in flight, if any; raises its error unless
        :meth:`PendingCheckpoint.wait` already did."""
        pending = self._pending
        if pending is None:
            return
        pending._done.wait()
        if pending._error is not None and not pending._raised:
            pending._outcome()

    def _check_step(self, step: object) -> int:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidStep(f"checkpoint step must be a non-negative int, got {step!r}")
        floor = self.last_committed_step
        resume = self.context.resume_step
        if resume is not None and (floor is None or resume > floor):
            floor = resume
        if floor is not None and step <= floor:
            # The leader refuses such a part as stale (409), which would read as "this
            # attempt was replaced": say what is really wrong instead.
            raise InvalidStep(
                f"checkpoint step {step} is not after step {floor}, the last one this rank "
                "committed or resumed from: steps must increase"
            )
        return step

    def _part_path(self, staging: Path, rel: str) -> Path | None:
        # staging = <ckpt_dir>/<job>/.staging/rank-R.attempt-A
        path = staging.parent.parent / rel
        return path if path.is_dir() else None

    def _commit(
        self,
        agent: AgentClient,
        staging: Path,
        step: int,
        state: Mapping[str, Any],
        rewrite: Callable[[], None] | None,
    ) -> CommittedPart | None:
        start = time.monotonic()
        backoff = _BACKOFF_INITIAL_S
        tries = 0
        while True:
            tries += 1
            try:
                if rewrite is not None and tries > 1:
                    rewrite()
                rel = agent.commit_checkpoint(step, state)
            except StaleAttempt as e:
                if self.stop_asked is not None and self.stop_asked():
                    print(
                        f"cumulus: checkpoint step {step} was not committed: this rank is "
                        f"being stopped and the agent refused the part ({e})",
                        file=sys.stderr,
                        flush=True,
                    )
                    return None
                raise
            except OSError as e:  # rewriting the staging dir failed
                last: Exception = e
                retryable = True
            except AgentError as e:
                last = e
                retryable = e.status is None or e.status in _RETRY_STATUSES
                if e.status == 500 and rewrite is not None:
                    # A storage failure emptied the staging dir; it is written again.
                    retryable = True
            else:
                part = CommittedPart(step=step, dir=rel, path=self._part_path(staging, rel))
                self.last_committed_step = step
                return part
            elapsed = time.monotonic() - start
            if not retryable or elapsed + backoff > self.commit_deadline_s:
                why = "" if retryable else " (not retryable)"
                raise CheckpointFailed(
                    f"checkpoint step {step}: commit failed after {tries} "
                    f"{'try' if tries == 1 else 'tries'} in {elapsed:.1f} s{why}: {last}",
                    step,
                ) from last
            time.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    @staticmethod
    def _write_state_file(staging: Path, state_bytes: bytes) -> None:
        target = staging / STATE_FILE
        if target.exists():
            raise InvalidState(
                f"{STATE_FILE} is reserved in a checkpoint for the state Cumulus commits; "
                "name your file differently"
            )
        target.write_bytes(state_bytes)

    @contextmanager
    def checkpoint(
        self, step: int, state: Mapping[str, Any] | None = None
    ) -> Iterator[StagedCheckpoint]:
        """Yields the (emptied) staging dir for checkpoint ``step``; when the block ends
        without an exception, commits it with ``state`` and sets the yielded object's
        ``committed`` (left ``None`` when the part was refused because this rank is being
        stopped: just exit). An exception in the block commits nothing, empties the
        staging dir and propagates.

        The block runs once: a commit that fails in a way that needs the files written
        again (a storage error on the worker) raises :class:`CheckpointFailed`; use
        :meth:`save` to have them rewritten and retried.

        :raises NotInCumulusRank: standalone run.
        :raises CheckpointsDisabled: the job has no checkpoint dir.
        :raises InvalidStep: ``step`` is not after the last committed or resumed step.
        :raises InvalidState: ``state`` is not a JSON object of at most 64 KiB.
        :raises StaleAttempt: this attempt was replaced before it was asked to stop: exit.
        :raises CheckpointFailed: the commit failed after every retry.
        """
        agent, staging = self._require()
        self._await_previous()
        with self._exclusive():
            step = self._check_step(step)
            stage = StagedCheckpoint(step, staging, _state_dict(state))
            _encode_state(stage.state)
            try:
                _empty_dir(staging)
            except OSError as e:
                raise CheckpointFailed(
                    f"checkpoint step {step}: cannot prepare the staging dir {staging}: {e}",
                    step,
                ) from e
            try:
                with Writeback(staging):
                    yield stage
                state_bytes = _encode_state(stage.state)
                self._write_state_file(staging, state_bytes)
            except BaseException:
                _empty_dir(staging)
                raise
            try:
                stage.committed = self._commit(agent, staging, step, stage.state, rewrite=None)
            except BaseException:
                # The next checkpoint starts from an empty staging dir either way.
                _empty_dir(staging)
                raise
            if stage.committed is None:  # refused: the files stay nowhere
                _empty_dir(staging)

    def save(
        self,
        step: int,
        write: Callable[[Path], None],
        state: Mapping[str, Any] | None = None,
    ) -> CommittedPart | None:
        """Commits checkpoint ``step``: ``write(staging_dir)`` writes the part's files;
        it is called again before every retry (from an emptied staging dir), as the Rust
        example trainer does, so storage failures on the worker are retried too. Returns
        the committed part, or ``None`` when it was refused because this rank is being
        stopped (see the module doc): just exit.

        :raises: as :meth:`checkpoint`, plus whatever ``write`` raises on the first try.
        """
        agent, staging = self._require()
        self._await_previous()
        with self._exclusive():
            step = self._check_step(step)
            state_dict = _state_dict(state)
            return self._save_locked(agent, staging, step, write, state_dict)

    def _save_locked(
        self,
        agent: AgentClient,
        staging: Path,
        step: int,
        write: Callable[[Path], None],
        state: dict[str, Any],
    ) -> CommittedPart | None:
        state_bytes = _encode_state(state)

        def fill() -> None:
            _empty_dir(staging)
            with Writeback(staging):  # the disk writes start while the part is written
                write(staging)
            self._write_state_file(staging, state_bytes)

        try:
            fill()
            part = self._commit(agent, staging, step, state, rewrite=fill)
        except BaseException:
            _empty_dir(staging)
            raise
        if part is None:  # refused: the files stay nowhere
            _empty_dir(staging)
        return part

    def save_async(
        self,
        step: int,
        snapshot: Callable[[], Callable[[Path], None]],
        state: Mapping[str, Any] | None = None,
    ) -> PendingCheckpoint:
        """Starts committing checkpoint ``step`` on a background thread and returns its
        handle. On the caller's thread it waits for the previous background commit (and
        raises its error if nobody has), checks ``step`` and ``state`` (copied, as JSON),
        then calls ``snapshot()``, which must take a copy of whatever the part holds that
        training may change and return ``write(staging_dir)``; the background thread then
        does what :meth:`save` does with that ``write`` (called again before every retry),
        so the outcome is the same.

        :raises: as :meth:`save` for the previous background commit's error and for
            what is checked before the snapshot (:class:`~cumulus.errors.NotInCumulusRank`,
            :class:`~cumulus.errors.CheckpointsDisabled`,
            :class:`~cumulus.errors.InvalidStep`, :class:`~cumulus.errors.InvalidState`),
            plus whatever ``snapshot`` raises. The commit's own errors come from
            :meth:`PendingCheckpoint.wait`.
        """
        agent, staging = self._require()
        with self._async_lock:
            self._await_previous()
            self._acquire()
            previous, pending = self._pending, None
            try:
                step = self._check_step(step)
                state_dict: dict[str, Any] = json.loads(_encode_state(_state_dict(state)))
                write = snapshot()
                pending = PendingCheckpoint(
                    step, exit_wait_s=self.commit_deadline_s + CHECKPOINT_TIMEOUT_S
                )
                thread = threading.Thread(
                    target=self._run_async,
                    args=(pending, agent, staging, step, write, state_dict),
                    name=f"cumulus-checkpoint-{step}",
                    daemon=True,
                )
                _track(pending)
                self._pending = pending
                thread.start()
            except BaseException:
                if pending is not None:  # the thread did not start
                    _untrack(pending)
                    self._pending = previous
                self._lock.release()
                raise
            return pending

    def _run_async(
        self,
        pending: PendingCheckpoint,
        agent: AgentClient,
        staging: Path,
        step: int,
        write: Callable[[Path], None],
        state: dict[str, Any],
    ) -> None:
        part: CommittedPart | None = None
        error: BaseException | None = None
        try:
            part = self._save_locked(agent, staging, step, write, state)
        except BaseException as e:
            # The error is kept (and raised later) with its traceback, but not the frames'
            # locals: they hold the snapshot.
            traceback.clear_frames(e.__traceback__)
            error = e
        finally:
            # The lock is free before the handle says done: the next checkpoint takes it.
            self._lock.release()
            pending._finish(part, error)

    def wait_pending(self, timeout_s: float | None = None) -> CommittedPart | None:
        """Waits for the latest background commit (:meth:`save_async`) and returns its
        part, as :meth:`PendingCheckpoint.wait`; ``None`` when there was none.

        :raises: as :meth:`PendingCheckpoint.wait`.
        """
        pending = self._pending
        return None if pending is None else pending.wait(timeout_s)

    def abandon_pending(self) -> None:
        """Forgets the background commit of this attempt (an in-process restart replaced
        it): it is not waited for at exit, and its error is never raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending._raised = True
            _untrack(pending)

    def settle_pending(self, why: str = "at close") -> None:
        """Waits for the background commit in flight (within its commit deadline plus one
        request's time limit) and logs on stderr a failure whose error was not raised, or
        a commit still in flight after that: never raises."""
        pending = self._pending
        if pending is not None:
            pending._settle(pending._exit_wait_s, why)

    def resume(self) -> ResumePoint | None:
        """Where this attempt resumes (``None`` for a fresh start): the step, this rank's
        committed part dir, and the state the part was committed with (from its
        ``cumulus-state.json``, else the step's ``MANIFEST.json``, else ``{}``).

        :raises CheckpointFailed: the resume dir is missing (the agent verified it before
            starting this attempt, so something removed it since).
        """
        ctx = self.context
        if ctx.resume_step is None or ctx.resume_dir is None:
            return None
        part = ctx.resume_dir
        if not part.is_dir():
            raise CheckpointFailed(
                f"resume dir {part} (CUMULUS_RESUME_DIR) of step {ctx.resume_step} is not a "
                "directory",
                ctx.resume_step,
            )
        try:
            state = _read_state_file(part)
        except ValueError as e:
            raise CheckpointFailed(
                f"{part / STATE_FILE} is not valid JSON: {e}", ctx.resume_step
            ) from e
        if state is None:
            state = _read_manifest_state(part, ctx.rank) or {}
        return ResumePoint(step=ctx.resume_step, dir=part, state=state)
