"""Progress reports that never block the training loop and never raise into it.

The caller's thread only validates the report and stores it in a one-slot mailbox; a
daemon thread sends the newest report to the agent at most every
:data:`MIN_INTERVAL_S` seconds. Reports made in between are coalesced (the newest wins:
the agent keeps only the latest progress anyway), so a loop reporting every step costs
one lock per step, whatever the agent does: the sender is woken only when the mailbox
was empty (while a report waits out the interval, a newer one just replaces it), so a
loop of hundreds of steps per second does not wake a second thread, and take the GIL
from the loop, at every step.

The agent's reply to a report may carry the action it asks of the rank (``{"action":
"pause"}``...): the sender thread records it in the runtime's
:class:`~cumulus.runtime._control.StopControl`, where ``should_stop()`` reads it.
"""

from __future__ import annotations

import atexit
import math
import numbers
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

from cumulus import _contract
from cumulus.errors import AgentError, InvalidMetric, InvalidStep, StaleAttempt
from cumulus.runtime._agent import AgentClient
from cumulus.runtime._control import StopControl

__all__ = [
    "FAILURES_LOGGED",
    "MAX_METRICS",
    "MAX_METRIC_NAME_BYTES",
    "MIN_INTERVAL_S",
    "ProgressReport",
    "ProgressReporter",
    "validate_report",
]

#: Most metrics in one report (the agent's limit).
MAX_METRICS = _contract.MAX_METRICS
#: Longest metric name, in UTF-8 bytes (the agent's limit).
MAX_METRIC_NAME_BYTES = _contract.MAX_METRIC_NAME_BYTES
#: Least time between two reports sent, in seconds (as the Rust example trainer).
MIN_INTERVAL_S = 0.2
#: Failed sends logged in full on stderr; after that only every 100th.
FAILURES_LOGGED = 5
#: Largest step the agent accepts (u64).
_MAX_U64 = 2**64 - 1


@dataclass(frozen=True)
class ProgressReport:
    """One validated report: ``step`` of ``total_steps`` with named metrics (NaN and
    infinities included)."""

    step: int
    total_steps: int | None
    metrics: Mapping[str, float]


def _check_step(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidStep(f"{name} must be an int, got {type(value).__name__} {value!r}")
    as_int = int(value)
    if not 0 <= as_int <= _MAX_U64:
        raise InvalidStep(f"{name} must be in 0..2**64, got {as_int}")
    return as_int


def validate_report(
    step: object, total_steps: object, metrics: Mapping[str, object]
) -> ProgressReport:
    """Checks a report as the agent would, so that a bad one fails at the call.

    :raises InvalidStep: ``step`` or ``total_steps`` is not an int in ``0..2**64``.
    A non-finite value (NaN, an infinity: a diverging run) is a valid metric, reported
    and shown as such (``nan``, ``inf``, ``-inf``).

    :raises InvalidMetric: a metric is not a real number (``bool`` and tensors are
        refused: pass ``loss.item()``), a name is empty or longer than
        :data:`MAX_METRIC_NAME_BYTES` bytes, or there are more than :data:`MAX_METRICS`.
    """
    checked_step = _check_step(step, "step")
    checked_total = None if total_steps is None else _check_step(total_steps, "total_steps")
    if len(metrics) > MAX_METRICS:
        raise InvalidMetric(f"at most {MAX_METRICS} metrics per report, got {len(metrics)}")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not name or len(name.encode("utf-8", errors="surrogatepass")) > MAX_METRIC_NAME_BYTES:
            raise InvalidMetric(
                f"metric names must be 1..={MAX_METRIC_NAME_BYTES} bytes, got {name!r}"
            )
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise InvalidMetric(
                f"metric {name!r} must be a real number, got {type(value).__name__}"
                " (convert tensors with .item())"
            )
        try:
            out[name] = float(value)
        except (OverflowError, ValueError) as e:  # e.g. a Fraction too large for a float
            raise InvalidMetric(f"metric {name!r} is not representable as a float: {e}") from e
    return ProgressReport(checked_step, checked_total, out)


class ProgressReporter:
    """Sends the newest :class:`ProgressReport` to the agent from a daemon thread.

    :meth:`submit` never blocks on the network and never raises; failures are counted
    and logged on stderr (the first :data:`FAILURES_LOGGED`, then every 100th). At exit
    the newest pending report is sent (waiting up to ``exit_flush_s``).

    The action a reply carries, and a stale verdict (401/409), are recorded in
    ``control`` when given.
    """

    def __init__(
        self,
        agent: AgentClient,
        *,
        min_interval_s: float = MIN_INTERVAL_S,
        exit_flush_s: float = 2.0,
        control: StopControl | None = None,
    ) -> None:
        self._agent = agent
        self._control = control
        self._min_interval_s = min_interval_s
        self._cond = threading.Condition()
        self._pending: ProgressReport | None = None
        self._sending = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._last_sent_at = -math.inf
        #: Reports handed to the agent successfully.
        self.sent = 0
        #: Reports that failed to send.
        self.failures = 0
        #: Reports replaced by a newer one before they were sent.
        self.coalesced = 0
        #: Set once the agent said this attempt is stale; nothing is sent after it.
        self.stale = False
        self._exit_flush_s = exit_flush_s
        # A bound method would keep the reporter alive for the atexit registry.
        ref = weakref.ref(self)

        def at_exit() -> None:
            reporter = ref()
            if reporter is not None:
                reporter.close(reporter._exit_flush_s)

        self._atexit = at_exit
        atexit.register(at_exit)

    def submit(self, report: ProgressReport) -> None:
        """Stores ``report`` as the newest; wakes the sender only if nothing was pending
        (a pending report means the sender already waits for its send time, and takes
        the newest then). A few microseconds."""
        with self._cond:
            if self._closed or self.stale:
                return
            if self._pending is not None:
                self.coalesced += 1
                self._pending = report
                return
            self._pending = report
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="cumulus-progress", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def flush(self, timeout_s: float) -> bool:
        """Sends the pending report now (ignoring the interval) and waits for it; returns
        whether nothing is pending or being sent when it returns."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._last_sent_at = -math.inf
            self._cond.notify_all()
            while self._pending is not None or self._sending:
                if self._thread is None or not self._thread.is_alive() or self.stale:
                    return self._pending is None and not self._sending
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Flushes (up to ``timeout_s``) and stops the sender thread."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._pending = None
            self._cond.notify_all()
        atexit.unregister(self._atexit)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    if self._pending is not None:
                        wait = self._last_sent_at + self._min_interval_s - time.monotonic()
                        if wait <= 0:
                            break
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()
                report = self._pending
                self._pending = None
                self._sending = True
                self._last_sent_at = time.monotonic()
            assert report is not None
            try:
                action = self._agent.progress(report.step, report.total_steps, report.metrics)
            except StaleAttempt as e:
                self.stale = True
                if self._control is not None:
                    self._control.record_stale()
                print(
                    f"cumulus: progress reports stopped: {e} (this attempt has ended)",
                    file=sys.stderr,
                )
            except AgentError as e:
                self.failures += 1
                if self.failures <= FAILURES_LOGGED or self.failures % 100 == 0:
                    print(
                        f"cumulus: progress report failed ({self.failures} so far, ignored): {e}",
                        file=sys.stderr,
                    )
            except Exception as e:  # never let the sender die silently
                self.failures += 1
                print(f"cumulus: progress sender error (ignored): {e!r}", file=sys.stderr)
            else:
                self.sent += 1
                if self._control is not None:
                    # Even "nothing asked" is news: it spares the loop a poll.
                    self._control.record(action)
            finally:
                with self._cond:
                    self._sending = False
                    self._cond.notify_all()
