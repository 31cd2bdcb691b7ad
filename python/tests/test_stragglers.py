"""Straggler detection against a real local cluster (one coordinator, two workers): a
rank the test throttles to about a third of its speed with SIGSTOP/SIGCONT (30% duty
cycle) is flagged a straggler within its window, and with ``straggler_action="restart"``
its attempt restarts on the other worker, which the job avoids from then on. The ranks
(``tests/programs/straggler_rank.py``) report a step every 20 ms and never synchronize,
so only the throttled one slows down."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

import cumulus
from conftest import PROGRAMS
from localcluster import LocalCluster, explain, wait_for

pytestmark = pytest.mark.cluster

RANK = [sys.executable, str(PROGRAMS / "straggler_rank.py")]
#: The job's straggler window, in seconds (the shortest the contract allows is 2 s).
WINDOW_S = 4.0
#: The detector's lookback for that window: the rates are measured over 5 s.
LOOKBACK_S = 5.0
#: Deadline of one condition, in seconds (a loaded machine).
STEP_TIMEOUT_S = 90


def throttle(pid: int, stop: threading.Event) -> None:
    """Lets ``pid`` run 30 ms of every 100 ms until ``stop`` (or the process is gone)."""
    try:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.07)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.03)
    except ProcessLookupError:
        return
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@pytest.mark.filterwarnings("ignore:.*no checkpoint directory")
def test_a_throttled_rank_is_flagged_and_restarted_on_another_worker(tmp_path: Path) -> None:
    with (
        LocalCluster(tmp_path / "cluster", coordinators=1, workers=2, slots=2) as cluster,
        cluster.client() as client,
    ):
        job = client.submit(
            RANK,
            world_size=2,
            straggler_action="restart",
            straggler_window_s=WINDOW_S,
            restart_scope="rank",
            max_restarts=2,
            backoff_initial_ms=100,
            stop_grace_s=1,
        )

        def reporting() -> cumulus.JobInfo | None:
            info = job.status()
            assert not info.finished, explain(job, cluster)
            ok = len(info.ranks) == 2 and all(
                r.state == "running" and r.pid > 0 and r.step > 0 for r in info.ranks
            )
            return info if ok else None

        info = wait_for(reporting, STEP_TIMEOUT_S, "both ranks reporting")
        assert info.straggler_action == "restart" and info.straggler_window_ms == 4_000
        slow = info.ranks[1]
        stop = threading.Event()
        thread = threading.Thread(target=throttle, args=(slow.pid, stop), daemon=True)
        started = time.monotonic()
        thread.start()
        try:
            flagged = wait_for(
                lambda: (lambda i: i if i.stragglers else None)(job.status()),
                STEP_TIMEOUT_S,
                "a straggler flag",
            )
        finally:
            stop.set()
            thread.join()
        took_s = time.monotonic() - started
        (flag,) = flagged.stragglers
        assert (flag.rank, flag.attempt, flag.worker_id, flag.action) == (
            1,
            0,
            slow.worker_id,
            "restart",
        ), flagged
        assert flag.steps_per_s < 0.7 * flag.median_steps_per_s, flag
        # Below after a part of the lookback, then the window; the rest is slack for a
        # loaded machine (heartbeats, the loop, this test's polling).
        print(f"flagged {took_s:.1f} s after the throttling began (window {WINDOW_S} s)")
        assert took_s < WINDOW_S + LOOKBACK_S + 20, took_s

        def moved() -> cumulus.JobInfo | None:
            info = job.status()
            assert not info.finished, explain(job, cluster)
            r = info.ranks[1]
            return info if r.attempt == 1 and r.state == "running" and r.step > 0 else None

        after = wait_for(moved, STEP_TIMEOUT_S, "rank 1 restarted")
        assert after.ranks[1].worker_id != slow.worker_id, after
        assert after.avoided_workers == (slow.worker_id,), after
        assert after.ranks[0].attempt == 0, "a rank-scope restart leaves rank 0 alone"
        assert after.restarts_used == 1
        assert "straggler" in after.restarts[0].cause, after.restarts
        assert not after.ranks[1].straggler and not after.ranks[0].straggler
        # The CLI shows the flag among the events.
        out = cluster.cumulusctl("describe", job.id)
        assert out.returncode == 0, out.stderr
        assert "flagged a straggler" in out.stdout, out.stdout
        job.cancel()
        job.wait(timeout_s=STEP_TIMEOUT_S)
