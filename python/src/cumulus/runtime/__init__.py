"""The rank runtime: what a training script running as a Cumulus rank calls.

Standard library only, so it never clashes with a trainer's own environment.

A short loop::

    import sys
    from cumulus import runtime

    ctx = runtime.get_context(standalone=True)  # also runs under plain python/torchrun
    start = 0
    if (r := runtime.resume()) is not None:      # a restarted or resumed attempt
        model.load(r.dir / "model.bin")
        start = r.step
    for step in range(start + 1, total + 1):
        loss = train_step()
        runtime.report(step, total, loss=loss)   # never blocks, never raises for I/O
        stop = runtime.should_stop()             # paused, time limit, cancelled, SIGTERM
        if (stop or step % 100 == 0) and runtime.checkpoints_enabled():
            with runtime.checkpoint(step) as part:
                model.save(part / "model.bin")
        if stop:
            sys.exit(0)                          # a paused job resumes from this step

:func:`time_to_checkpoint` says when to checkpoint (every N steps, every T seconds, and
whenever a stop was asked), :func:`list_checkpoints` lists the job's committed steps.

Stopping: the worker agent tells a rank to stop before it signals it. Its control action
(``"stop"``, ``"pause"``, ``"time_limit"``, ``"preempt"``) comes in the replies to the
progress reports and from ``GET /v1/control``, which :func:`should_stop` polls at most
every :data:`CONTROL_POLL_INTERVAL_S` seconds (waiting at most 0.5 s, never raising;
outside a Cumulus rank it never polls, and only SIGTERM counts); SIGTERM follows after a
notice period, SIGKILL after the job's stop grace.

* :func:`should_stop` is true once any stop was asked (an action, or SIGTERM): commit a
  checkpoint at the current step and exit 0. For a pause or a preemption the job resumes
  from that checkpoint later (:func:`resume`); at a time limit it ends ``timed_out`` with
  it. For ``"stop"`` (cancelled, or replaced by a group restart) the checkpoint is not
  needed and is refused: the call returns without committing
  (:meth:`Runtime.save_checkpoint` returns ``None``, the ``checkpoint()`` block's
  ``committed`` stays ``None``), never raising for it: just exit 0.
* :func:`should_pause` is true when the job will continue later (``"pause"`` or
  ``"preempt"``).
* :func:`stop_request` names what was asked: the action, ``"signal"`` for a SIGTERM
  without a known action, ``None`` when nothing was.

A distributed job should stop every rank at the same step (each rank's part of a step
is needed for that step to be committed): :func:`stop_agreed` is :func:`should_stop`
all-reduced over a ``torch.distributed`` group, the same answer on every rank.

:class:`EpochSampler` hands out indices into in-memory records epoch after epoch, each
epoch shuffled from its seed; its position is a small JSON value (the checkpoint's
``state``), so a resumed rank continues at the exact record.

The runtime reaches the worker agent's rank-local API over TCP at ``CUMULUS_AGENT_URL``,
or, when the agent sets ``CUMULUS_AGENT_SOCKET`` (ranks run as another user than the
agent, ``cumulus-worker --run-as``), through that Unix domain socket
(:attr:`Context.agent_socket`).

:func:`apply_gpu_memory_fraction` passes a job's ``--gpu-memory-fraction``
(``CUMULUS_GPU_MEMORY_FRACTION``, :attr:`Context.gpu_memory_fraction`) to
``torch.cuda.set_per_process_memory_fraction``; call it once CUDA's device is chosen (it
does nothing, and imports nothing, for a job without a fraction).

In-process restarts: :func:`run` runs a training function and, when a peer rank fails,
re-enters it in the same process at the job's last committed step instead of letting
the agent replace the process (the interpreter, its imports and a CUDA context are
kept)::

    def train() -> None:
        dist.init_process_group("gloo")          # MASTER_PORT is new at each restart
        point = ckpt.load_checkpoint(model=model, optimizer=opt, rng=ckpt.RNG())
        ...                                      # the usual loop, report() every step
        dist.destroy_process_group()

    runtime.run(train)

Only scripts that call it opt in; the others keep today's restarts (a new process per
rank). See :func:`run`.

:func:`rng_state` / :func:`set_rng_state` capture and restore every random number
generator (Python, NumPy, torch CPU and CUDA, and generators passed in) as plain JSON;
:mod:`cumulus.ckpt` saves them with the model.

The module-level functions use one process-wide :class:`Runtime`, made on first use
(or by :func:`init`). Outside a Cumulus rank that runtime is standalone: reports are
validated and dropped, :func:`resume` returns ``None``, and :func:`checkpoint` raises
:class:`~cumulus.errors.NotInCumulusRank`.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from cumulus._contract import RANK_ENV_CUDA_VISIBLE_DEVICES, RANK_ENV_GPU_MEMORY_FRACTION
from cumulus.errors import CumulusError, RankEnvironmentError
from cumulus.runtime import _inprocess
from cumulus.runtime._agent import AgentClient, install_unreachable_exit
from cumulus.runtime._checkpoint import (
    COMMIT_DEADLINE_S,
    MAX_STATE_BYTES,
    STATE_FILE,
    Checkpointer,
    CommittedPart,
    PendingCheckpoint,
    ResumePoint,
    StagedCheckpoint,
)
from cumulus.runtime._control import (
    CONTROL_POLL_INTERVAL_S,
    PAUSE_ACTIONS,
    STOP_ACTIONS,
    StopControl,
)
from cumulus.runtime._distributed import any_rank
from cumulus.runtime._elastic import DATA_STATE_KEY, DataPlan, ElasticData, data_plan
from cumulus.runtime._env import (
    CONTRACT_VARS,
    Context,
    context_from_env,
    get_context,
    read_shards_file,
)
from cumulus.runtime._failure import install_from_env as _install_exception_report
from cumulus.runtime._inprocess import RestartOffer, RestartRequested
from cumulus.runtime._progress import (
    MAX_METRIC_NAME_BYTES,
    MAX_METRICS,
    MIN_INTERVAL_S,
    ProgressReporter,
    validate_report,
)
from cumulus.runtime._rng import RNG_STATE_VERSION, rng_state, set_rng_state
from cumulus.runtime._sampler import EpochSampler
from cumulus.runtime._schedule import CheckpointSchedule
from cumulus.runtime._shards import ShardReader, list_shards, shard_format
from cumulus.runtime._stop import (
    install_stop_handler,
    request_stop,
    stop_handler_installed,
    stop_signalled,
)

__all__ = [
    "COMMIT_DEADLINE_S",
    "CONTRACT_VARS",
    "CONTROL_POLL_INTERVAL_S",
    "DATA_STATE_KEY",
    "MAX_METRICS",
    "MAX_METRIC_NAME_BYTES",
    "MAX_STATE_BYTES",
    "PAUSE_ACTIONS",
    "RNG_STATE_VERSION",
    "STATE_FILE",
    "STOP_ACTIONS",
    "AgentClient",
    "CheckpointSchedule",
    "Checkpointer",
    "CommittedPart",
    "Context",
    "DataPlan",
    "ElasticData",
    "EpochSampler",
    "PendingCheckpoint",
    "RestartOffer",
    "RestartRequested",
    "ResumePoint",
    "Runtime",
    "ShardReader",
    "StagedCheckpoint",
    "StopControl",
    "apply_gpu_memory_fraction",
    "checkpoint",
    "checkpoints_enabled",
    "context_from_env",
    "data_plan",
    "flush",
    "get_context",
    "get_runtime",
    "init",
    "install_stop_handler",
    "list_checkpoints",
    "list_shards",
    "read_shards_file",
    "report",
    "request_stop",
    "resume",
    "rng_state",
    "run",
    "save_checkpoint",
    "set_rng_state",
    "shard_format",
    "should_pause",
    "should_stop",
    "stop_agreed",
    "stop_request",
    "time_to_checkpoint",
]


class Runtime:
    """The runtime of one rank: progress reports, checkpoints and resume for
    :attr:`context`.

    :param context: the rank's context (see :func:`get_context`).
    :param commit_deadline_s: how long a checkpoint commit is retried, in seconds.
    :param progress_interval_s: least time between two progress reports sent, in seconds.
    :param control_poll_interval_s: least time between two polls of the agent's control
        action by :meth:`should_stop` (and the other stop checks), in seconds.
    """

    def __init__(
        self,
        context: Context,
        *,
        commit_deadline_s: float = COMMIT_DEADLINE_S,
        progress_interval_s: float = MIN_INTERVAL_S,
        control_poll_interval_s: float = CONTROL_POLL_INTERVAL_S,
    ) -> None:
        self.context = context
        agent = None
        if not context.standalone and context.agent_url and context.agent_token:
            agent = AgentClient(
                context.agent_url, context.agent_token, socket_path=context.agent_socket
            )
        #: The agent client, ``None`` standalone.
        self.agent = agent
        #: Commits and resumes this rank's checkpoint parts.
        self.checkpointer = Checkpointer(
            context, agent, commit_deadline_s=commit_deadline_s, stop_asked=self._asked_to_stop
        )
        #: What the agent asked of this rank (see :meth:`stop_request`).
        self.control = StopControl(agent, poll_interval_s=control_poll_interval_s)
        self._reporter = (
            ProgressReporter(agent, min_interval_s=progress_interval_s, control=self.control)
            if agent
            else None
        )
        self._schedule = CheckpointSchedule()
        if not context.standalone and context.attempt > 0 and context.staging_dir is None:
            # A restart of a job without a checkpoint dir: say it in the rank's log too.
            print(
                f"cumulus: attempt {context.attempt} of {context.job_id} starts over from step 0:"
                " the job has no checkpoint directory to resume from (submit it with"
                " --ckpt-dir / ckpt_dir)",
                file=sys.stderr,
                flush=True,
            )

    def __repr__(self) -> str:
        return f"Runtime({self.context!r})"

    @property
    def checkpoints_enabled(self) -> bool:
        """Whether :meth:`checkpoint` can commit (a Cumulus rank of a job with a
        checkpoint dir)."""
        return self.checkpointer.enabled

    def report(self, step: int, total_steps: int | None = None, **metrics: float) -> None:
        """Reports progress: ``step`` steps done of ``total_steps``, with named metrics
        (e.g. ``loss=0.12``). Shown by ``cumulusctl status`` and used by the leader's hang
        detection (``progress_timeout``).

        Returns in microseconds: the report is sent by a background thread, at most every
        0.2 s (newer reports replace unsent ones); a failed send is logged on stderr,
        never raised. Standalone, the report is validated and dropped.

        :raises InvalidStep: ``step``/``total_steps`` is not an int in ``0..2**64``.
        NaN and infinities are valid values (a diverging run reports them): they are
        shown as ``nan``, ``inf`` and ``-inf``.

        :raises InvalidMetric: a metric is not a real number (a tensor, a str, a bool...),
            or a name is empty or too long, or there are more than 64 metrics.
        """
        _inprocess.check()
        checked = validate_report(step, total_steps, metrics)
        if self._reporter is not None:
            self._reporter.submit(checked)

    def flush(self, timeout_s: float = 2.0) -> bool:
        """Sends the pending progress report now and waits up to ``timeout_s`` seconds;
        returns whether it went out (always true standalone). Done at exit as well."""
        return True if self._reporter is None else self._reporter.flush(timeout_s)

    def checkpoint(
        self, step: int, state: Mapping[str, Any] | None = None
    ) -> AbstractContextManager[StagedCheckpoint]:
        """A context manager yielding the staging dir of checkpoint ``step`` and
        committing it when the block ends (see :meth:`Checkpointer.checkpoint`)::

            with rt.checkpoint(step, state={"epoch": epoch}) as part:
                torch.save(model.state_dict(), part / "model.pt")
            print(part.committed.dir)   # step-00000100/rank-0/attempt-1

        A part refused because this rank was asked to stop (cancelled, replaced) is not
        an error: ``part.committed`` stays ``None``; exit 0.

        :raises NotInCumulusRank: standalone run.
        :raises CheckpointsDisabled: the job has no checkpoint dir.
        :raises InvalidStep: ``step`` is not after the last committed or resumed step.
        :raises InvalidState: ``state`` is not a JSON object of at most 64 KiB.
        :raises StaleAttempt: this attempt was replaced (HTTP 409/401) before it was
            asked to stop: exit now.
        :raises CheckpointFailed: the commit failed until the commit deadline.
        """
        _inprocess.check()
        return self.checkpointer.checkpoint(step, state)

    def save_checkpoint(
        self,
        step: int,
        write: Callable[[Path], None],
        state: Mapping[str, Any] | None = None,
    ) -> CommittedPart | None:
        """Commits checkpoint ``step`` whose files ``write(staging_dir)`` writes, calling
        it again before every retry (see :meth:`Checkpointer.save`), and returns the
        committed part; ``None`` when it was refused because this rank was asked to stop
        (see :meth:`checkpoint`). Raises as :meth:`checkpoint`."""
        _inprocess.check()
        return self.checkpointer.save(step, write, state)

    def resume(self) -> ResumePoint | None:
        """Where this attempt resumes: the committed step, this rank's part dir and the
        state it was committed with; ``None`` for a fresh start (and standalone)."""
        return self.checkpointer.resume()

    def time_to_checkpoint(
        self,
        step: int,
        every_steps: int | None = None,
        every_seconds: float | None = None,
    ) -> bool:
        """Whether to commit a checkpoint at ``step`` now: checkpoints can be committed
        (:attr:`checkpoints_enabled`: always false standalone or for a job without a
        checkpoint dir, so the same loop runs anywhere), ``step`` is after the last step
        this rank committed or resumed from, and any of

        * a stop was asked (:meth:`should_stop`: pause, time limit, preemption, SIGTERM),
        * ``step`` is a positive multiple of ``every_steps``,
        * ``every_seconds`` seconds passed since the runtime started or this last
          returned true (each true restarts that clock: checkpoint when told).

        ::

            for step in range(start + 1, total + 1):
                train_step()
                if runtime.time_to_checkpoint(step, every_steps=100, every_seconds=600):
                    with runtime.checkpoint(step) as part:
                        save(part)
                if runtime.should_stop():
                    sys.exit(0)

        :raises InvalidStep: ``step`` is not a non-negative int.
        :raises ValueError: ``every_steps`` is not ``None`` or an int >= 1, or
            ``every_seconds`` not ``None`` or a positive, finite number.
        :raises RuntimeError: as :meth:`should_stop` (its first call installs the SIGTERM
            handler, from the main thread only).
        """
        ckpt = self.checkpointer
        floor = ckpt.last_committed_step
        resumed = self.context.resume_step
        if resumed is not None and (floor is None or resumed > floor):
            floor = resumed
        return self._schedule.due(
            step,
            every_steps=every_steps,
            every_seconds=every_seconds,
            enabled=ckpt.enabled,
            floor=floor,
            stop=self.should_stop,
        )

    def list_checkpoints(self) -> list[int]:
        """The committed checkpoint steps of this rank's job, ascending, as its checkpoint
        store shows them (the step ``LATEST`` names and every older step with a valid
        manifest; at most the newest 1,024). A step is committed once every rank's part
        is in and the leader wrote its manifest, shortly after the last rank's
        :meth:`checkpoint` returned. Empty standalone and for a job without a
        checkpoint dir.

        :raises StaleAttempt: the agent no longer knows this attempt (it ended).
        :raises AgentError: the agent could not read the store, or did not answer.
        """
        if self.agent is None or not self.checkpoints_enabled:
            return []
        return self.agent.checkpoints()

    def should_stop(self) -> bool:
        """True once this rank was asked to stop: the agent's control action is one
        (learned from a progress reply, or polled from ``GET /v1/control`` at most every
        ``control_poll_interval_s``), or SIGTERM came. Commit a checkpoint at the current
        step and exit 0. Never raises for I/O; a poll waits at most 0.5 s.

        The first stop check installs the SIGTERM handler (see
        :func:`install_stop_handler`).

        :raises RuntimeError: the first stop check is made from a thread other than the
            main thread.
        """
        _inprocess.check()
        if stop_signalled():
            return True
        return self.control.action() is not None

    def stop_agreed(self, group: Any = None) -> bool:
        """:meth:`should_stop`, agreed by every rank of a ``torch.distributed`` process
        group (default: the whole world): true on every rank as soon as any rank was
        asked to stop, so that all of them checkpoint the same step and exit together (a
        step is committed only once every rank's part of it is). An all-reduce (MAX) of
        one int, on the CPU for gloo and on the current CUDA device for NCCL: a
        collective, so call it on every rank of ``group`` at every step, where
        :meth:`should_stop` would be. Without an initialized process group it is
        :meth:`should_stop`. A rank that did not see the request itself reads
        :meth:`stop_request` ``None``.

        :raises RuntimeError: as :meth:`should_stop`; or ``group`` given without an
            initialized process group.
        """
        return any_rank(self.should_stop(), group)

    def _asked_to_stop(self) -> bool:
        """Whether this rank was asked to stop (SIGTERM, or an action of the agent, which
        is asked at once when none is known): a checkpoint refused then is refused
        because the attempt is ending, and is not an error (see :class:`Checkpointer`).
        Safe from any thread."""
        if stop_handler_installed() and stop_signalled():
            return True
        return self.control.poll_now() is not None

    def should_pause(self) -> bool:
        """True when the job will continue later from the checkpoint committed now: the
        action is ``"pause"`` (the user paused the job) or ``"preempt"`` (the scheduler
        requeues it). Implies :meth:`should_stop`. Raises as :meth:`should_stop`."""
        stop_signalled()
        return self.control.action() in PAUSE_ACTIONS

    def stop_request(self) -> str | None:
        """What this rank was asked: the agent's action (``"stop"``, ``"pause"``,
        ``"time_limit"``, ``"preempt"``; a newer agent may name others), ``"signal"``
        for a SIGTERM with no action known, ``None`` while nothing was asked. An attempt
        the agent no longer knows (HTTP 401: it has ended) counts as ``"stop"``. Raises
        as :meth:`should_stop`."""
        signalled = stop_signalled()
        action = self.control.action()
        if action is not None:
            return action
        return "signal" if signalled else None

    def apply_gpu_memory_fraction(self, device: Any = None) -> float | None:
        """Applies :attr:`Context.gpu_memory_fraction`; see
        :func:`cumulus.runtime.apply_gpu_memory_fraction`."""
        fraction = self.context.gpu_memory_fraction
        if fraction is None:
            return None
        try:
            torch = importlib.import_module("torch")
        except ImportError as e:
            raise ImportError(
                f"{RANK_ENV_GPU_MEMORY_FRACTION}={fraction} is set (the job was submitted with "
                "--gpu-memory-fraction) but PyTorch cannot be imported here: "
                f"apply_gpu_memory_fraction() needs torch with CUDA ({e})"
            ) from e
        if not torch.cuda.is_available():
            raise RankEnvironmentError(
                f"{RANK_ENV_GPU_MEMORY_FRACTION}={fraction} is set (the job was submitted with "
                "--gpu-memory-fraction) but torch.cuda.is_available() is False: this rank "
                "sees no CUDA GPU (a CPU-only torch, no driver, or an empty "
                f"{RANK_ENV_CUDA_VISIBLE_DEVICES}), so there is no GPU memory to limit",
                RANK_ENV_GPU_MEMORY_FRACTION,
            )
        if device is None:
            device = torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        return fraction

    def _abandon(self) -> None:
        """Drops this runtime for an in-process restart: its background checkpoint (of
        an attempt that can no longer commit) is not waited for, and its progress sender
        stops without sending."""
        self.checkpointer.abandon_pending()
        if self._reporter is not None:
            self._reporter.close(0.0)

    def close(self, timeout_s: float = 2.0) -> None:
        """Waits for a checkpoint being committed in the background
        (:meth:`Checkpointer.save_async`, :func:`cumulus.ckpt.save_checkpoint_async`),
        within its commit deadline, logging on stderr a failure nobody raised; then
        flushes the last progress report (up to ``timeout_s`` seconds) and stops the
        sender thread. Reports made after it are dropped. Never raises for either: to
        handle a background commit's error, call
        :meth:`Checkpointer.wait_pending` (:func:`cumulus.ckpt.wait_pending`) first."""
        self.checkpointer.settle_pending("at close")
        if self._reporter is not None:
            self._reporter.close(timeout_s)


_default: Runtime | None = None
_default_lock = threading.Lock()


def init(
    *,
    standalone: bool = True,
    commit_deadline_s: float = COMMIT_DEADLINE_S,
    handle_sigterm: bool = False,
) -> Runtime:
    """Makes the process-wide runtime the module-level functions use, from the
    environment, and returns it. Optional: the first module-level call does it with the
    defaults.

    In a Cumulus rank, the runtime made here (or by the first module-level call) also
    chains a :data:`sys.excepthook` that exits with ``EXIT_AGENT_UNREACHABLE`` (75) when
    an uncaught error says the agent never answered
    (:func:`cumulus.runtime._agent.install_unreachable_exit`).

    :param standalone: outside a Cumulus rank, run standalone (the default) instead of
        raising :class:`~cumulus.errors.NotInCumulusRank`.
    :param commit_deadline_s: how long a checkpoint commit is retried, in seconds.
    :param handle_sigterm: install the SIGTERM handler behind :func:`should_stop` now
        (call from the main thread) rather than on its first call.
    :raises RuntimeError: :func:`init` already made the runtime (or a module-level call
        did).
    :raises NotInCumulusRank: ``standalone=False`` outside a Cumulus rank.
    :raises RankEnvironmentError: a rank variable is missing or malformed.
    """
    global _default
    with _default_lock:
        if _default is not None:
            raise RuntimeError(
                "cumulus.runtime.init() was already called (or a module-level function "
                "already made the runtime); call it once, before any other runtime call"
            )
        _default = Runtime(get_context(standalone=standalone), commit_deadline_s=commit_deadline_s)
        rt = _default
    if rt.agent is not None:
        install_unreachable_exit()
    if handle_sigterm:
        install_stop_handler()
    return rt


def get_runtime() -> Runtime:
    """The process-wide runtime (made with :func:`init`'s defaults on first use).

    :raises RankEnvironmentError: a rank variable is missing or malformed.
    """
    global _default
    rt = _default
    if rt is not None:
        return rt
    with _default_lock:
        if _default is None:
            _default = Runtime(get_context(standalone=True))
            if _default.agent is not None:
                install_unreachable_exit()
        return _default


def _replace_runtime(old: Runtime) -> Runtime:
    """Makes the process-wide runtime again from the environment (an in-process restart
    set the new attempt's variables), with ``old``'s settings."""
    global _default
    with _default_lock:
        _default = Runtime(
            get_context(standalone=False), commit_deadline_s=old.checkpointer.commit_deadline_s
        )
        return _default


def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs the training function ``fn(*args, **kwargs)`` and returns its result, with
    in-process restarts: when a peer rank fails and the leader restarts the job's ranks,
    this process keeps running and calls ``fn`` again as the rank's new attempt, instead
    of being replaced by a new process.

    ``fn`` must be written as a whole attempt: it forms its ``torch.distributed`` process
    group (``MASTER_ADDR``/``MASTER_PORT`` from the environment, a new port at each
    restart), restores the resume step (:func:`cumulus.ckpt.load_checkpoint` or
    :func:`resume`), trains while calling :func:`report` every step, and returns. On each
    call the runtime (:func:`get_runtime`, :func:`get_context`, the module functions)
    describes the current attempt. Do not call :func:`init` inside it.

    When the agent hands this process a new attempt, the current call is abandoned: the
    next :func:`report`, stop check or checkpoint raises :class:`RestartRequested` (a
    ``BaseException``), a collective blocked on the lost peer fails (gloo: when the peer's
    connection closes or the group's timeout passes; NCCL: its communicators are
    aborted), and a function that does neither for 2 s gets :class:`RestartRequested`
    raised asynchronously. The runtime then tears the process group down (bounded: a
    process whose teardown hangs exits, and the job restarts in full), drops the
    abandoned attempt's background checkpoint (it can no longer commit), sets the new
    attempt's environment, waits out the rest of the restart's backoff and calls ``fn``
    again. An exception of ``fn`` that looks like a lost peer (a failed collective) waits
    up to 60 s for that restart; any other exception propagates as it would without
    ``run``.

    Standalone (not a Cumulus rank), it just calls ``fn``. Only scripts that call it opt
    in; the others are restarted as new processes.

    :raises RuntimeError: ``run`` is already running in this process.
    """
    return _inprocess.run(fn, *args, **kwargs)


def report(step: int, total_steps: int | None = None, **metrics: float) -> None:
    """Reports progress without blocking; see :meth:`Runtime.report`."""
    get_runtime().report(step, total_steps, **metrics)


def flush(timeout_s: float = 2.0) -> bool:
    """Sends the pending progress report now; see :meth:`Runtime.flush`."""
    return get_runtime().flush(timeout_s)


def checkpoint(
    step: int, state: Mapping[str, Any] | None = None
) -> AbstractContextManager[StagedCheckpoint]:
    """Writes and commits checkpoint ``step``; see :meth:`Runtime.checkpoint`."""
    return get_runtime().checkpoint(step, state)


def save_checkpoint(
    step: int, write: Callable[[Path], None], state: Mapping[str, Any] | None = None
) -> CommittedPart | None:
    """Writes (again on retry) and commits checkpoint ``step``; see
    :meth:`Runtime.save_checkpoint`."""
    return get_runtime().save_checkpoint(step, write, state)


def time_to_checkpoint(
    step: int, every_steps: int | None = None, every_seconds: float | None = None
) -> bool:
    """Whether to commit a checkpoint at ``step`` now (every ``every_steps`` steps, every
    ``every_seconds`` seconds, and whenever a stop was asked; never when checkpoints
    cannot be committed); see :meth:`Runtime.time_to_checkpoint`."""
    return get_runtime().time_to_checkpoint(step, every_steps, every_seconds)


def list_checkpoints() -> list[int]:
    """The committed checkpoint steps of this rank's job, ascending (empty standalone or
    without checkpoints); see :meth:`Runtime.list_checkpoints`."""
    return get_runtime().list_checkpoints()


def checkpoints_enabled() -> bool:
    """Whether this process can commit checkpoints (a Cumulus rank of a job with a
    checkpoint dir)."""
    return get_runtime().checkpoints_enabled


def resume() -> ResumePoint | None:
    """Where this attempt resumes, or ``None``; see :meth:`Runtime.resume`."""
    return get_runtime().resume()


def _current_runtime() -> Runtime | None:
    """The process-wide runtime, or ``None`` when the environment cannot make one (a
    malformed rank variable: the stop checks then fall back to SIGTERM alone)."""
    try:
        return get_runtime()
    except CumulusError:
        return None


def should_stop() -> bool:
    """True once this rank was asked to stop (paused, time limit near, preempted,
    cancelled or replaced: the agent's control action; or SIGTERM): commit a checkpoint at
    the current step and exit 0. Call it once per step; it polls the agent at most every
    :data:`CONTROL_POLL_INTERVAL_S` seconds, never raises for I/O, and does no I/O
    outside a Cumulus rank. See :meth:`Runtime.should_stop`.

    :raises RuntimeError: the first call is made from a thread other than the main thread
        (it installs the SIGTERM handler).
    """
    rt = _current_runtime()
    return rt.should_stop() if rt is not None else stop_signalled()


def stop_agreed(group: Any = None) -> bool:
    """Whether any rank of the ``torch.distributed`` ``group`` (default: the world) was
    asked to stop, the same answer on every rank: a collective that replaces
    :func:`should_stop` in a distributed loop (call it on every rank at every step). See
    :meth:`Runtime.stop_agreed`.

    ::

        for step in range(start + 1, total + 1):
            train_step()
            stop = runtime.stop_agreed()          # the same on every rank
            if stop or step % 100 == 0:
                ckpt.save_checkpoint(step, model=model, optimizer=opt)
            if stop:
                sys.exit(0)
    """
    _inprocess.check()
    rt = _current_runtime()
    return any_rank(rt.should_stop() if rt is not None else stop_signalled(), group)


def should_pause() -> bool:
    """True when the job continues later from the checkpoint committed now (``"pause"``
    or ``"preempt"``); see :meth:`Runtime.should_pause`."""
    rt = _current_runtime()
    if rt is None:
        stop_signalled()
        return False
    return rt.should_pause()


def stop_request() -> str | None:
    """What this rank was asked: ``"stop"``, ``"pause"``, ``"time_limit"``,
    ``"preempt"``, ``"signal"`` (SIGTERM, no action known) or ``None``; see
    :meth:`Runtime.stop_request`."""
    rt = _current_runtime()
    if rt is None:
        return "signal" if stop_signalled() else None
    return rt.stop_request()


def apply_gpu_memory_fraction(device: Any = None) -> float | None:
    """Limits this process's PyTorch CUDA memory to the job's ``--gpu-memory-fraction``
    (``CUMULUS_GPU_MEMORY_FRACTION``, :attr:`Context.gpu_memory_fraction`) of ``device``'s
    memory, and returns the fraction; returns ``None`` and does nothing (not even import
    torch) when the job has no fraction, as every job without ``--gpu-memory-fraction``
    and every standalone run without the variable.

    Call it once, after choosing the CUDA device (``torch.cuda.set_device``) and before
    allocating on it. The agent's ``CUDA_VISIBLE_DEVICES`` already restricts which GPUs
    the rank sees (its own, as ``cuda:0``, ``cuda:1``...); the fraction is how several
    ranks or jobs share one of them.

    Cooperative, not enforced: it calls ``torch.cuda.set_per_process_memory_fraction``,
    so PyTorch's caching allocator refuses (raises out-of-memory for) allocations past
    the fraction in this process. Nothing stops CUDA memory allocated outside that
    allocator (CUDA contexts, NCCL buffers, other libraries) or by other processes; an
    enforced limit needs NVIDIA MPS (its per-client pinned memory limit) or MIG.

    :param device: the CUDA device to limit (a ``torch.device``, ``"cuda:0"`` or an
        index); ``None``: the current device (``torch.cuda.current_device()``).
    :raises RankEnvironmentError: the fraction is set but ``torch.cuda.is_available()`` is
        false (no CUDA GPU visible to this rank), or the variable is malformed.
    :raises ImportError: the fraction is set but PyTorch is not installed.
    """
    return get_runtime().apply_gpu_memory_fraction(device)


# In a Cumulus rank, an uncaught exception is reported to the agent before the process
# dies: the job's failure then names it (``cumulus.runtime._failure``).
_install_exception_report()
