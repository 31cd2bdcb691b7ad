"""When to checkpoint: :func:`cumulus.runtime.time_to_checkpoint`'s rule, on its own so
it can be tested with a fake clock. Standard library only."""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable

from cumulus.errors import InvalidStep

__all__ = ["CheckpointSchedule"]


def _check_every_steps(every_steps: object) -> int | None:
    if every_steps is None:
        return None
    if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
        raise ValueError(f"every_steps must be None or an int >= 1, got {every_steps!r}")
    return every_steps


def _check_every_seconds(every_seconds: object) -> float | None:
    if every_seconds is None:
        return None
    if (
        isinstance(every_seconds, bool)
        or not isinstance(every_seconds, numbers.Real)
        or not math.isfinite(every_seconds)
        or not float(every_seconds) > 0
    ):
        raise ValueError(
            f"every_seconds must be None or a positive, finite number, got {every_seconds!r}"
        )
    return float(every_seconds)


class CheckpointSchedule:
    """Decides whether a step is one to checkpoint at.

    A step is due when checkpoints can be committed, the step is after the last one
    committed or resumed from, and any of: a stop was asked (pause, time limit,
    preemption, SIGTERM), ``step`` is a positive multiple of ``every_steps``, or ``every_seconds``
    passed since the schedule started or last said yes. Each yes restarts the seconds'
    clock (the caller is expected to checkpoint when told).

    :param clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since = clock()

    def due(
        self,
        step: object,
        *,
        every_steps: object = None,
        every_seconds: object = None,
        enabled: bool,
        floor: int | None,
        stop: Callable[[], bool],
    ) -> bool:
        """Whether to checkpoint at ``step``.

        :param enabled: checkpoints can be committed (else never due).
        :param floor: the last step committed or resumed from (``None``: none).
        :param stop: whether a stop was asked (called only when it can matter).
        :raises InvalidStep: ``step`` is not a non-negative int.
        :raises ValueError: ``every_steps`` is not ``None`` or an int >= 1, or
            ``every_seconds`` not ``None`` or a positive finite number.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidStep(f"step must be a non-negative int, got {step!r}")
        steps = _check_every_steps(every_steps)
        seconds = _check_every_seconds(every_seconds)
        if not enabled or (floor is not None and step <= floor):
            return False
        now = self._clock()
        due = (
            (steps is not None and step > 0 and step % steps == 0)
            or (seconds is not None and now - self._since >= seconds)
            or stop()
        )
        if due:
            self._since = now
        return due
