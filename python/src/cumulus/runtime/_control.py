"""What the worker agent asks of this rank: the control action behind
:func:`cumulus.runtime.should_stop`, :func:`~cumulus.runtime.should_pause` and
:func:`~cumulus.runtime.stop_request`.

The agent stops a rank in three moves ("tell the rank first"): it answers an action other
than ``"none"`` on the rank-local API (``GET /v1/control``, and in the reply to every
``POST /v1/progress``), then after a notice period it sends SIGTERM to the rank's process
group, then SIGKILL after the job's stop grace. A rank that checks :func:`should_stop` in
its loop learns the action in the first move and has the whole notice period to commit a
checkpoint at its current step and exit 0.

The action is learned two ways, both of which never block the loop for long and never
raise into it:

* the progress reporter's thread records the action of every progress reply;
* a check (:meth:`StopControl.action`) polls ``GET /v1/control`` itself once
  :data:`CONTROL_POLL_INTERVAL_S` seconds have passed without an answer (a progress
  reply counts: a loop that reports never polls from its own thread), each poll waiting at most
  :data:`~cumulus.runtime._agent.CONTROL_TIMEOUT_S`; a failed poll is ignored (and
  tried again at the next interval).

Once known, an action stays: the agent never takes a stop request back. Polls end then;
a progress reply with a different action still replaces it (e.g. ``"stop"`` when a job
being paused is cancelled). An attempt the agent no longer knows (401) counts as asked to
``"stop"``: it has ended, and nothing it commits would be accepted.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from cumulus import _contract
from cumulus.errors import StaleAttempt
from cumulus.runtime._agent import ACTION_NONE, CONTROL_TIMEOUT_S, AgentClient

__all__ = [
    "ACTION_NONE",
    "ACTION_PAUSE",
    "ACTION_PREEMPT",
    "ACTION_STOP",
    "ACTION_TIME_LIMIT",
    "CONTROL_POLL_INTERVAL_S",
    "PAUSE_ACTIONS",
    "STOP_ACTIONS",
    "StopControl",
]

#: Least time between two ``GET /v1/control`` polls made by the checks, in seconds.
CONTROL_POLL_INTERVAL_S = 1.0
#: The attempt is no longer wanted (job cancelled, group restart, the job ended): exit.
ACTION_STOP = _contract.StopAction.STOP.value
#: The user paused the job: commit a checkpoint at the current step and exit 0; the job
#: resumes from it later.
ACTION_PAUSE = _contract.StopAction.PAUSE.value
#: The job's time limit is near: commit a checkpoint and exit 0; the job ends
#: ``timed_out``.
ACTION_TIME_LIMIT = _contract.StopAction.TIME_LIMIT.value
#: The scheduler needs the slots: as a pause, and the job is queued again.
ACTION_PREEMPT = _contract.StopAction.PREEMPT.value
#: Every stop action of the rank-local API (a newer agent may add others: each is a
#: request to stop).
STOP_ACTIONS = frozenset(_contract.STOP_ACTIONS)
#: Actions after which the job continues later, from the checkpoint committed now.
PAUSE_ACTIONS = frozenset({ACTION_PAUSE, ACTION_PREEMPT})


class StopControl:
    """The action the agent asked of one rank's attempt, learned from progress replies
    (:meth:`record`) and from polls of ``GET /v1/control`` (:meth:`action`). Thread-safe.

    :param agent: the attempt's agent client; ``None`` (standalone): never polls, and
        only :meth:`record` sets an action.
    :param poll_interval_s: least time between two polls, in seconds.
    :param poll_timeout_s: time limit of one poll, in seconds.
    :param clock: a monotonic clock, in seconds (tests).
    """

    def __init__(
        self,
        agent: AgentClient | None,
        *,
        poll_interval_s: float = CONTROL_POLL_INTERVAL_S,
        poll_timeout_s: float = CONTROL_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._agent = agent
        self._poll_interval_s = poll_interval_s
        self._poll_timeout_s = poll_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._action: str | None = None
        self._next_poll_at = -float("inf")
        self._polling = False
        #: Polls of ``GET /v1/control`` made.
        self.polls = 0
        #: Polls that failed (no answer, an error status, a malformed reply).
        self.poll_failures = 0
        #: Set once the agent no longer knows the attempt (401/409); polls end then.
        self.stale = False

    def __repr__(self) -> str:
        return f"StopControl(action={self._action!r}, polls={self.polls})"

    @property
    def known(self) -> str | None:
        """The action known now, without polling (``None``: nothing asked)."""
        with self._lock:
            return self._action

    def record(self, action: str | None) -> None:
        """Records an action the agent answered (``None`` and ``"none"``: nothing asked).
        Any answer is as fresh as a poll: the next poll waits a whole interval from now,
        so a loop whose progress reports are answered (every
        :data:`~cumulus.runtime._progress.MIN_INTERVAL_S` at most) never polls from its
        own thread."""
        with self._lock:
            self._next_poll_at = self._clock() + self._poll_interval_s
            if action is None or action == ACTION_NONE:
                return
            self._action = action

    def record_stale(self) -> None:
        """The agent answered that the attempt is unknown or stale (401/409): it has
        ended, so this rank is asked to stop (``"stop"``, unless another action is already
        known), and polls end."""
        with self._lock:
            self.stale = True
            if self._action is None:
                self._action = ACTION_STOP

    def action(self) -> str | None:
        """The action asked of this rank, ``None`` while nothing is; polls the agent first
        when the last poll is :attr:`poll_interval_s` old and no action is known yet.
        Never raises for I/O, and waits at most ``poll_timeout_s`` (another thread's poll
        in flight is not waited for)."""
        with self._lock:
            if (
                self._agent is None
                or self._action is not None
                or self.stale
                or self._polling
                or self._clock() < self._next_poll_at
            ):
                return self._action
            self._polling = True
            self._next_poll_at = self._clock() + self._poll_interval_s
        try:
            self._poll(self._agent)
        finally:
            with self._lock:
                self._polling = False
        return self.known

    def poll_now(self) -> str | None:
        """The action asked of this rank, asking the agent at once (whatever the poll
        interval) when none is known yet: for a decision that cannot wait, such as
        whether a refused checkpoint was refused because the attempt is being stopped.
        Never raises for I/O; waits at most ``poll_timeout_s``."""
        with self._lock:
            if self._agent is None or self._action is not None or self.stale:
                return self._action
            self._next_poll_at = self._clock() + self._poll_interval_s
        self._poll(self._agent)
        return self.known

    def _poll(self, agent: AgentClient) -> None:
        self.polls += 1
        try:
            action = agent.control(timeout_s=self._poll_timeout_s)
        except StaleAttempt:
            self.record_stale()
        except Exception as e:  # an agent that is down, slow or broken: try again later
            self.poll_failures += 1
            if self.poll_failures == 1:
                print(
                    f"cumulus: polling the agent's control action failed (ignored, tried "
                    f"again every {self._poll_interval_s:g} s): {e}",
                    file=sys.stderr,
                )
        else:
            self.record(action)
