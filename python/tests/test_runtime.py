"""The rank runtime against a fake agent: progress reports, checkpoints, resume, stop."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path

import pytest

from cumulus import errors, runtime
from cumulus.runtime import Context, Runtime, StopControl, _stop
from fake_agent import FakeAgent, Request
from localcluster import wait_for


def make_context(
    agent_url: str | None,
    staging: Path | None,
    *,
    resume_step: int | None = None,
    resume_dir: Path | None = None,
    rank: int = 0,
) -> Context:
    return Context(
        rank=rank,
        world_size=2,
        local_rank=rank,
        local_world_size=2,
        master_addr="127.0.0.1",
        master_port=29500,
        job_id="job-000001",
        attempt=0,
        shard_paths=(),
        staging_dir=staging,
        resume_step=resume_step,
        resume_dir=resume_dir,
        agent_url=agent_url,
        agent_token="tok-1",
        standalone=False,
    )


@pytest.fixture(autouse=True)
def _no_sigterm_handler_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop checks install a SIGTERM handler on first use: not in the pytest process
    (the SIGTERM tests run their own processes). Also a fresh stop flag for each test."""
    monkeypatch.setattr(_stop, "_installed", True)
    monkeypatch.setattr(_stop, "_stop", threading.Event())


@pytest.fixture
def staging(tmp_path: Path) -> Path:
    s = tmp_path / "ckpt" / "job-000001" / ".staging" / "rank-0.attempt-0"
    s.mkdir(parents=True)
    return s


@pytest.fixture
def agent(staging: Path) -> Iterator[FakeAgent]:
    with FakeAgent(staging) as a:
        yield a


@pytest.fixture
def rt(agent: FakeAgent, staging: Path) -> Iterator[Runtime]:
    r = Runtime(make_context(agent.url, staging), commit_deadline_s=5, progress_interval_s=0.05)
    yield r
    r.close(1)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- progress ----------------------------------------------------------------------------


def test_report_reaches_the_agent_with_the_token(rt: Runtime, agent: FakeAgent) -> None:
    rt.report(7, 100, loss=0.25, lr=Fraction(1, 4))  # type: ignore[arg-type]  # any Real
    assert rt.flush(5)
    (req,) = agent.of("/v1/progress")
    assert req.authorization == "Bearer tok-1"
    assert req.body == {"step": 7, "total_steps": 100, "metrics": {"loss": 0.25, "lr": 0.25}}


def test_total_steps_is_left_out_when_unknown(rt: Runtime, agent: FakeAgent) -> None:
    rt.report(1)
    assert rt.flush(5)
    assert agent.of("/v1/progress")[0].body == {"step": 1, "metrics": {}}


def test_non_finite_metrics_are_sent_in_the_contracts_json_spelling(
    rt: Runtime, agent: FakeAgent
) -> None:
    rt.report(3, loss=math.nan, up=math.inf, down=-math.inf, lr=0.5)
    assert rt.flush(5)
    (sent,) = agent.of("/v1/progress")
    assert sent.body == {
        "step": 3,
        "metrics": {"loss": "NaN", "up": "Infinity", "down": "-Infinity", "lr": 0.5},
    }


@pytest.mark.parametrize(
    ("metrics", "match"),
    [
        ({"loss": "0.1"}, "real number"),
        ({"loss": None}, "real number"),
        ({"ok": True}, "real number"),
        ({"x" * 129: 1.0}, "names"),
        ({f"m{i}": 1.0 for i in range(65)}, "at most 64"),
    ],
)
def test_bad_metrics_fail_at_the_call(
    rt: Runtime, agent: FakeAgent, metrics: dict[str, object], match: str
) -> None:
    with pytest.raises(errors.InvalidMetric, match=match):
        rt.report(1, **metrics)  # type: ignore[arg-type]
    rt.flush(1)
    assert agent.of("/v1/progress") == []


@pytest.mark.parametrize(("step", "total"), [(-1, None), (1.5, None), (True, None), (1, -2)])
def test_bad_steps_fail_at_the_call(rt: Runtime, step: object, total: object) -> None:
    with pytest.raises(errors.InvalidStep):
        rt.report(step, total)  # type: ignore[arg-type]


def test_reports_are_coalesced_and_the_newest_wins(rt: Runtime, agent: FakeAgent) -> None:
    agent.progress_delay_s = 0.05
    for step in range(1, 2001):
        rt.report(step, 2000, loss=1.0 / step)
    assert rt.flush(5)
    sent = agent.of("/v1/progress")
    assert 1 <= len(sent) < 100
    assert sent[-1].body["step"] == 2000
    steps = [r.body["step"] for r in sent]
    assert steps == sorted(steps)


def test_a_report_wakes_the_sender_only_when_none_was_pending(
    agent: FakeAgent, staging: Path
) -> None:
    # While a report waits out the interval, newer ones replace it without waking the
    # sender thread (which would take the GIL from the training loop at every step).
    r = Runtime(make_context(agent.url, staging), progress_interval_s=30)
    try:
        r.report(1, 1000)
        wait_for(lambda: len(agent.of("/v1/progress")) == 1, 10, "the first report sent")
        reporter = r._reporter
        assert reporter is not None
        notified: list[int] = []
        notify = reporter._cond.notify

        def counting_notify(n: int = 1) -> None:
            notified.append(n)
            notify(n)

        reporter._cond.notify = counting_notify  # type: ignore[method-assign]
        for step in range(2, 1001):
            r.report(step, 1000)
        assert len(notified) == 1, "one wake-up: the report that found the mailbox empty"
        assert reporter.coalesced == 998
        assert r.flush(5)
        assert agent.of("/v1/progress")[-1].body["step"] == 1000
    finally:
        r.close(1)


def test_a_loop_that_reports_never_polls_the_control_action_itself(
    agent: FakeAgent, staging: Path
) -> None:
    # Progress replies carry the control action: while they come, should_stop() reads
    # what the reporter's thread recorded and makes no request from the loop's thread.
    r = Runtime(
        make_context(agent.url, staging), progress_interval_s=0.05, control_poll_interval_s=0.3
    )
    try:
        r.report(1)
        assert r.flush(5)
        end = time.monotonic() + 1.5
        step = 1
        while time.monotonic() < end:
            step += 1
            r.report(step)
            assert not r.should_stop()
            time.sleep(0.01)
        assert r.control.polls == 0, "no GET /v1/control while progress replies came"
        assert agent.of("/v1/control") == []
        # Without reports, the loop polls again once an interval passes unanswered.
        assert r.flush(5)
        time.sleep(0.35)
        assert not r.should_stop()
        assert r.control.polls == 1
    finally:
        r.close(1)


def test_report_never_raises_or_waits_when_the_agent_is_down(
    staging: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    r = Runtime(make_context(f"http://127.0.0.1:{closed_port()}", staging), progress_interval_s=0)
    start = time.monotonic()
    for step in range(1000):
        r.report(step, loss=1.0)
    # Generous bound: 1000 calls that each waited for a connection would take far longer.
    assert time.monotonic() - start < 1.0
    wait_for(lambda: r._reporter is not None and r._reporter.failures >= 1, 10, "a failure")
    r.close(1)
    assert "progress report failed" in capfd.readouterr().err


def test_a_stale_attempt_stops_reporting(rt: Runtime, agent: FakeAgent) -> None:
    agent.queue("/v1/progress", (401, {"error": "unknown agent token"}))
    rt.report(1)
    wait_for(lambda: rt._reporter is not None and rt._reporter.stale, 5, "stale")
    rt.report(2)
    rt.flush(1)
    assert len(agent.of("/v1/progress")) == 1
    # The agent no longer knows the attempt: it has ended, so the rank should stop.
    assert rt.control.known == "stop"


def test_a_restart_without_checkpoints_says_it_starts_over(
    agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 42 item 6: the rank's log says it too, not only the submit.
    first = make_context(agent.url, None)
    Runtime(first).close(1)
    assert "starts over" not in capsys.readouterr().err
    Runtime(dataclasses.replace(first, attempt=2)).close(1)
    err = capsys.readouterr().err
    assert "attempt 2 of job-000001 starts over from step 0" in err, err
    assert "no checkpoint directory" in err, err


def test_standalone_reports_are_validated_and_dropped() -> None:
    r = Runtime(runtime.context_from_env({}, standalone=True))
    r.report(1, loss=0.5)
    r.report(1, loss=math.nan)  # a diverging run: reported as such, never raised
    with pytest.raises(errors.InvalidMetric):
        r.report(1, loss="nan")  # type: ignore[arg-type]
    assert r.flush(0) and r.agent is None


# -- checkpoints -------------------------------------------------------------------------


def test_checkpoint_commits_the_staging_dir(rt: Runtime, agent: FakeAgent, staging: Path) -> None:
    (staging / "leftover.bin").write_bytes(b"from a failed try")
    with rt.checkpoint(10, state={"epoch": 1}) as part:
        assert os.fspath(part) == str(staging)
        assert list(staging.iterdir()) == []  # leftovers are removed first
        (part / "model.bin").write_bytes(b"weights")
        part.state["seen"] = 640
    assert part.committed is not None
    assert part.committed.dir == "step-00000010/rank-0/attempt-0"
    assert part.committed.path == staging.parent.parent / part.committed.dir
    (req,) = agent.of("/v1/checkpoint")
    assert req.authorization == "Bearer tok-1"
    assert req.body == {"step": 10, "state": {"epoch": 1, "seen": 640}}
    files = sorted(p.name for p in part.committed.path.iterdir())
    assert files == ["cumulus-state.json", "model.bin"]
    state = json.loads((part.committed.path / "cumulus-state.json").read_text())
    assert state == {"epoch": 1, "seen": 640}
    assert rt.checkpointer.last_committed_step == 10


def test_an_exception_in_the_block_commits_nothing(
    rt: Runtime, agent: FakeAgent, staging: Path
) -> None:
    def write_then_fail() -> None:
        with rt.checkpoint(10) as part:
            (part / "half.bin").write_bytes(b"x")
            _ = 1 / 0

    with pytest.raises(ZeroDivisionError):
        write_then_fail()
    assert agent.of("/v1/checkpoint") == []
    assert list(staging.iterdir()) == []


@pytest.mark.parametrize("status", [409, 401])
def test_a_stale_verdict_raises_stale_attempt_at_once(
    rt: Runtime, agent: FakeAgent, status: int
) -> None:
    agent.queue("/v1/checkpoint", (status, {"error": "attempt 0 of rank 0 is stale"}))
    with pytest.raises(errors.StaleAttempt, match="is stale") as e, rt.checkpoint(10):
        pass
    assert e.value.status == status
    assert len(agent.of("/v1/checkpoint")) == 1


@pytest.mark.parametrize("asked", ["action", "sigterm", "unknown until refused"])
def test_a_part_refused_after_a_stop_request_is_a_clean_stop(
    rt: Runtime, agent: FakeAgent, staging: Path, asked: str
) -> None:
    # A cancelled (or replaced) attempt's stop checkpoint: the agent refuses it (409);
    # the rank was asked to stop, so that is the stop itself, not an error.
    agent.action = "stop"
    if asked == "action":
        assert rt.should_stop()
    elif asked == "sigterm":
        _stop.request_stop()
    # "unknown until refused": the runtime asks the agent once the part is refused.
    refusal = (409, {"error": "attempt job-000001/0/0 is no longer desired on this worker"})
    agent.queue("/v1/checkpoint", refusal, refusal)
    with rt.checkpoint(10, state={"k": 1}) as part:
        (part / "model.bin").write_bytes(b"w")
    assert part.committed is None
    assert list(staging.iterdir()) == [], "nothing is left staged"

    def write(d: Path) -> None:
        (d / "m").write_bytes(b"w")

    assert rt.save_checkpoint(11, write) is None
    assert rt.checkpointer.last_committed_step is None
    assert len(agent.of("/v1/checkpoint")) == 2


def test_a_part_refused_without_a_stop_request_still_raises(rt: Runtime, agent: FakeAgent) -> None:
    agent.queue("/v1/checkpoint", (409, {"error": "attempt 0 of rank 0 is stale"}))
    with pytest.raises(errors.StaleAttempt, match="is stale"), rt.checkpoint(10):
        pass
    assert rt.stop_request() is None


def test_leader_failures_are_retried(rt: Runtime, agent: FakeAgent) -> None:
    agent.queue(
        "/v1/checkpoint",
        (503, {"error": "the leader could not be reached"}),
        (502, {"error": "the leader failed"}),
    )
    with rt.checkpoint(10) as part:
        (part / "a").write_text("a")
    assert part.committed is not None
    assert [r.body["step"] for r in agent.of("/v1/checkpoint")] == [10, 10, 10]


def test_a_refused_commit_is_not_retried(rt: Runtime, agent: FakeAgent, staging: Path) -> None:
    agent.queue("/v1/checkpoint", (400, {"error": "job has no checkpoint dir"}))
    with pytest.raises(errors.CheckpointFailed, match="not retryable") as e, rt.checkpoint(10):
        pass
    assert e.value.step == 10
    assert isinstance(e.value.__cause__, errors.AgentError)
    assert e.value.__cause__.status == 400
    assert len(agent.of("/v1/checkpoint")) == 1
    assert list(staging.iterdir()) == []


def test_retries_end_at_the_deadline(staging: Path, agent: FakeAgent) -> None:
    agent.queue("/v1/checkpoint", *[(503, {"error": "down"})] * 100)
    r = Runtime(make_context(agent.url, staging), commit_deadline_s=0.5)
    start = time.monotonic()
    with pytest.raises(errors.CheckpointFailed, match="tries"), r.checkpoint(10):
        pass
    assert time.monotonic() - start < 5
    assert 2 <= len(agent.of("/v1/checkpoint")) < 100


def test_an_unreachable_agent_fails_after_retries(staging: Path) -> None:
    r = Runtime(make_context(f"http://127.0.0.1:{closed_port()}", staging), commit_deadline_s=0.3)
    with pytest.raises(errors.CheckpointFailed) as e, r.checkpoint(10):
        pass
    assert isinstance(e.value.__cause__, errors.AgentError)
    assert e.value.__cause__.status is None


def test_save_rewrites_the_part_on_every_try(rt: Runtime, agent: FakeAgent, staging: Path) -> None:
    def storage_failure(req: Request) -> tuple[int, object]:
        # The agent empties the staging dir after an I/O error.
        for p in staging.iterdir():
            p.unlink()
        return 500, {"error": "checkpoint I/O error: fsync: No space left on device"}

    agent.queue("/v1/checkpoint", storage_failure)
    calls: list[Path] = []

    def write(d: Path) -> None:
        calls.append(d)
        (d / "model.bin").write_bytes(b"w")

    part = rt.save_checkpoint(10, write, state={"k": 1})
    assert part is not None
    assert calls == [staging, staging]
    assert part.path is not None
    assert sorted(p.name for p in part.path.iterdir()) == ["cumulus-state.json", "model.bin"]


def test_steps_must_increase(rt: Runtime, agent: FakeAgent) -> None:
    with rt.checkpoint(10):
        pass
    for step in (10, 5):
        with pytest.raises(errors.InvalidStep, match="not after step 10"), rt.checkpoint(step):
            pass
    with pytest.raises(errors.InvalidStep), rt.checkpoint(-1):
        pass
    assert len(agent.of("/v1/checkpoint")) == 1


def test_steps_must_be_after_the_resume_step(
    agent: FakeAgent, staging: Path, tmp_path: Path
) -> None:
    r = Runtime(make_context(agent.url, staging, resume_step=100, resume_dir=tmp_path))
    with pytest.raises(errors.InvalidStep, match="not after step 100"), r.checkpoint(100):
        pass


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"x": math.nan}, "not JSON"),
        ({"x": object()}, "not JSON"),
        ([1, 2], "must be a dict"),
        ({"x": "a" * (64 * 1024)}, "at most 65536"),
    ],
)
def test_bad_state_is_refused_before_writing(
    rt: Runtime, agent: FakeAgent, state: object, match: str
) -> None:
    with pytest.raises(errors.InvalidState, match=match), rt.checkpoint(10, state=state):  # type: ignore[arg-type]
        pass
    assert agent.of("/v1/checkpoint") == []


def test_the_state_file_name_is_reserved(rt: Runtime, agent: FakeAgent) -> None:
    with pytest.raises(errors.InvalidState, match="reserved"), rt.checkpoint(10) as part:
        (part / runtime.STATE_FILE).write_text("{}")
    assert agent.of("/v1/checkpoint") == []


def test_nested_checkpoints_are_refused(rt: Runtime) -> None:
    with rt.checkpoint(10), pytest.raises(RuntimeError, match="already being written"):
        rt.save_checkpoint(20, lambda d: None)


def test_checkpoint_outside_a_rank_fails_clearly() -> None:
    r = Runtime(runtime.context_from_env({}, standalone=True))
    assert not r.checkpoints_enabled
    with pytest.raises(errors.NotInCumulusRank, match="needs a Cumulus rank"), r.checkpoint(1):
        pass


def test_checkpoint_without_a_checkpoint_dir_fails_clearly(agent: FakeAgent) -> None:
    r = Runtime(make_context(agent.url, None))
    with pytest.raises(errors.CheckpointsDisabled, match="ckpt-dir"), r.checkpoint(1):
        pass


# -- resume ------------------------------------------------------------------------------


def test_resume_reads_the_committed_state(
    rt: Runtime, agent: FakeAgent, staging: Path, tmp_path: Path
) -> None:
    with rt.checkpoint(10, state={"reader": {"shard": 1, "record": 5}}) as part:
        (part / "model.bin").write_bytes(b"w")
    assert part.committed is not None and part.committed.path is not None
    r = Runtime(make_context(agent.url, staging, resume_step=10, resume_dir=part.committed.path))
    point = r.resume()
    assert point is not None
    assert (point.step, point.dir) == (10, part.committed.path)
    assert point.state == {"reader": {"shard": 1, "record": 5}}
    assert (point.dir / "model.bin").read_bytes() == b"w"


def test_resume_falls_back_to_the_manifest(agent: FakeAgent, staging: Path, tmp_path: Path) -> None:
    step_dir = tmp_path / "job" / "step-00000020"
    part = step_dir / "rank-1" / "attempt-3"
    part.mkdir(parents=True)
    manifest = {"parts": [{"rank": 0, "state": {"a": 0}}, {"rank": 1, "state": {"a": 1}}]}
    (step_dir / "MANIFEST.json").write_text(json.dumps(manifest))
    r = Runtime(make_context(agent.url, staging, resume_step=20, resume_dir=part, rank=1))
    point = r.resume()
    assert point is not None and point.state == {"a": 1}


def test_no_resume_on_a_fresh_start(rt: Runtime) -> None:
    assert rt.resume() is None
    assert Runtime(runtime.context_from_env({}, standalone=True)).resume() is None


# -- GPU memory fraction -----------------------------------------------------------------


@pytest.fixture
def with_fraction(monkeypatch: pytest.MonkeyPatch) -> Callable[[float | None], Runtime]:
    """Makes the process-wide runtime (restored after the test) one whose context has the
    given ``gpu_memory_fraction``."""

    def make(fraction: float | None) -> Runtime:
        ctx = dataclasses.replace(make_context(None, None), gpu_memory_fraction=fraction)
        r = Runtime(ctx)
        monkeypatch.setattr(runtime, "_default", r)
        return r

    return make


class FakeCuda:
    """``torch.cuda`` as far as ``apply_gpu_memory_fraction`` uses it."""

    def __init__(self, available: bool) -> None:
        self.available = available
        self.calls: list[tuple[float, object]] = []

    def is_available(self) -> bool:
        return self.available

    def current_device(self) -> int:
        return 3

    def set_per_process_memory_fraction(self, fraction: float, device: object) -> None:
        self.calls.append((fraction, device))


def fake_torch(monkeypatch: pytest.MonkeyPatch, *, cuda: bool) -> FakeCuda:
    fake = FakeCuda(cuda)
    module = types.ModuleType("torch")
    module.cuda = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", module)
    return fake


def test_no_fraction_does_nothing_and_imports_no_torch(
    monkeypatch: pytest.MonkeyPatch, with_fraction: Callable[[float | None], Runtime]
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # importing torch now fails
    with_fraction(None)
    assert runtime.apply_gpu_memory_fraction() is None
    assert runtime.apply_gpu_memory_fraction("cuda:1") is None
    # The same runtime with a fraction does import torch (so the check above means it).
    with_fraction(0.5)
    with pytest.raises(ImportError, match="CUMULUS_GPU_MEMORY_FRACTION"):
        runtime.apply_gpu_memory_fraction()


def test_the_fraction_goes_to_torch_for_the_current_or_given_device(
    monkeypatch: pytest.MonkeyPatch, with_fraction: Callable[[float | None], Runtime]
) -> None:
    cuda = fake_torch(monkeypatch, cuda=True)
    rt = with_fraction(0.25)
    assert runtime.apply_gpu_memory_fraction() == 0.25
    assert runtime.apply_gpu_memory_fraction("cuda:1") == 0.25
    assert rt.apply_gpu_memory_fraction(0) == 0.25
    assert cuda.calls == [(0.25, 3), (0.25, "cuda:1"), (0.25, 0)]


def test_a_fraction_without_cuda_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, with_fraction: Callable[[float | None], Runtime]
) -> None:
    cuda = fake_torch(monkeypatch, cuda=False)
    with_fraction(0.5)
    with pytest.raises(errors.RankEnvironmentError, match="is_available") as e:
        runtime.apply_gpu_memory_fraction()
    assert e.value.name == "CUMULUS_GPU_MEMORY_FRACTION"
    assert cuda.calls == []


def test_a_fraction_with_a_cpu_only_torch_is_a_clear_error(
    with_fraction: Callable[[float | None], Runtime],
) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: this test needs a torch without a GPU")
    with_fraction(0.5)
    with pytest.raises(errors.RankEnvironmentError, match=r"FRACTION=0\.5 .*is_available"):
        runtime.apply_gpu_memory_fraction()


def test_the_fraction_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = fake_torch(monkeypatch, cuda=True)
    for name in list(os.environ):
        if name.startswith("CUMULUS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CUMULUS_GPU_MEMORY_FRACTION", "0.125")
    monkeypatch.setattr(runtime, "_default", None)  # made from the environment on first use
    assert runtime.apply_gpu_memory_fraction() == 0.125
    assert runtime.get_runtime().context.standalone
    assert cuda.calls == [(0.125, 3)]


# -- stop --------------------------------------------------------------------------------


def make_runtime(agent_url: str | None, staging: Path | None, poll_s: float) -> Runtime:
    return Runtime(
        make_context(agent_url, staging),
        progress_interval_s=0.01,
        control_poll_interval_s=poll_s,
    )


def test_nothing_asked_is_no_stop(rt: Runtime, agent: FakeAgent) -> None:
    assert rt.should_stop() is False
    assert rt.should_pause() is False
    assert rt.stop_request() is None
    # The first check polled GET /v1/control with the token; the next ones within the
    # poll interval (1 s) did not.
    (req,) = agent.of("/v1/control")
    assert (req.method, req.authorization) == ("GET", "Bearer tok-1")
    assert runtime.CONTROL_POLL_INTERVAL_S == 1.0


@pytest.mark.parametrize(
    ("action", "pause"),
    [
        ("stop", False),
        ("pause", True),
        ("time_limit", False),
        ("preempt", True),
        ("a_newer_action", False),  # an action this runtime does not know still stops
    ],
)
def test_a_polled_action_is_a_stop_request(
    agent: FakeAgent, staging: Path, action: str, pause: bool
) -> None:
    r = make_runtime(agent.url, staging, 3600)
    agent.action = action
    assert r.should_stop() is True
    assert r.should_pause() is pause
    assert r.stop_request() == action
    assert len(agent.of("/v1/control")) == 1
    r.close(1)


def test_an_action_in_a_progress_reply_is_seen_without_polling(
    agent: FakeAgent, staging: Path
) -> None:
    r = make_runtime(agent.url, staging, 3600)
    assert r.should_stop() is False  # the one poll this interval allows: "none"
    r.report(1, 10)
    assert r.flush(5)
    assert agent.of("/v1/progress")[0].body["step"] == 1
    assert r.should_stop() is False  # a 204: nothing asked

    agent.action = "pause"
    r.report(2, 10)
    assert r.flush(5)  # the reply is recorded before the send counts as done
    assert r.control.known == "pause"
    assert r.should_stop() and r.should_pause() and r.stop_request() == "pause"
    assert len(agent.of("/v1/control")) == 1  # learned from the reply alone
    r.close(1)


def test_a_later_progress_reply_replaces_the_action(agent: FakeAgent, staging: Path) -> None:
    r = make_runtime(agent.url, staging, 3600)
    agent.action = "pause"
    r.report(1)
    assert r.flush(5)
    agent.action = "stop"  # e.g. the job being paused was cancelled
    r.report(2)
    assert r.flush(5)
    assert r.stop_request() == "stop" and not r.should_pause()
    r.close(1)


def test_polls_are_rate_limited(agent: FakeAgent, staging: Path) -> None:
    r = make_runtime(agent.url, staging, 0.25)
    start = time.monotonic()
    checks = 0
    while time.monotonic() - start < 1.0:
        assert r.should_stop() is False
        checks += 1
    polls = len(agent.of("/v1/control"))
    # At most one poll per started interval, however many checks.
    assert 2 <= polls <= 5 < checks, (polls, checks)
    agent.action = "time_limit"
    wait_for(r.should_stop, 5, "the next poll to see the action")
    assert r.stop_request() == "time_limit" and not r.should_pause()
    # Once an action is known the checks stop polling.
    polled = len(agent.of("/v1/control"))
    # Checks for longer than a poll interval: none of them polls again.
    until = time.monotonic() + 0.3
    while time.monotonic() < until:
        assert r.should_stop()
    assert len(agent.of("/v1/control")) == polled
    r.close(1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_poll_interval_is_kept_to_the_clock(agent: FakeAgent) -> None:
    clock = FakeClock()
    control = StopControl(runtime.AgentClient(agent.url, "tok-1"), clock=clock)
    for at in (100.0, 100.5, 100.999):
        clock.now = at
        assert control.action() is None
    assert control.polls == 1
    clock.now = 101.0
    agent.action = "preempt"
    assert control.action() == "preempt"
    assert control.polls == 2
    clock.now = 200.0
    assert control.action() == "preempt" and control.polls == 2  # known: no more polls


def test_an_unknown_token_never_raises_and_means_the_attempt_ended(
    agent: FakeAgent, staging: Path
) -> None:
    agent.queue("/v1/control", (401, {"error": "unknown agent token: the attempt has ended"}))
    r = make_runtime(agent.url, staging, 0)
    assert r.should_stop() is True
    assert r.stop_request() == "stop" and not r.should_pause()
    assert r.control.stale
    r.should_stop()
    assert len(agent.of("/v1/control")) == 1  # no polls after it
    r.close(1)


def test_an_agent_that_is_down_never_raises(
    staging: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    r = make_runtime(f"http://127.0.0.1:{closed_port()}", staging, 0)
    for _ in range(3):
        assert r.should_stop() is False
        assert r.should_pause() is False
        assert r.stop_request() is None
    assert r.control.polls == 9 and r.control.poll_failures == 9
    err = capfd.readouterr().err
    assert err.count("polling the agent's control action failed") == 1, err
    r.close(0)


def test_a_slow_agent_delays_a_check_by_the_poll_timeout_at_most(
    agent: FakeAgent, staging: Path
) -> None:
    agent.control_delay_s = 3
    r = make_runtime(agent.url, staging, 0)
    start = time.monotonic()
    assert r.should_stop() is False
    assert time.monotonic() - start < 1.5  # the poll gave up after 0.5 s
    assert r.control.poll_failures == 1
    r.close(0)


@pytest.mark.parametrize(
    "reply",
    [
        (200, b"not json"),
        (200, {"action": 3}),
        (200, {"action": ""}),
        (200, {"action": "Pause!"}),
        (200, {}),
        (500, {"error": "internal"}),
        (404, {"error": "no such route"}),  # an agent older than the control endpoint
    ],
)
def test_bad_control_replies_are_ignored_and_polled_again(
    agent: FakeAgent, staging: Path, reply: tuple[int, object]
) -> None:
    agent.queue("/v1/control", reply)
    r = make_runtime(agent.url, staging, 0)
    assert r.should_stop() is False and r.control.poll_failures == 1
    agent.action = "pause"
    assert r.should_stop() is True and r.stop_request() == "pause"
    r.close(0)


def test_odd_progress_replies_are_still_sent_reports(agent: FakeAgent, staging: Path) -> None:
    agent.queue(
        "/v1/progress",
        (200, None),
        (200, {"action": "none"}),
        (202, b"not json"),
    )
    r = make_runtime(agent.url, staging, 3600)
    for step in (1, 2, 3):
        r.report(step)
        assert r.flush(5)
    assert r._reporter is not None and (r._reporter.sent, r._reporter.failures) == (3, 0)
    assert r.control.known is None
    r.close(1)


def test_outside_a_rank_nothing_is_polled() -> None:
    r = Runtime(runtime.context_from_env({}, standalone=True))
    assert r.agent is None
    assert r.should_stop() is False and r.stop_request() is None and not r.should_pause()
    assert r.control.polls == 0
    # A rank context without an agent URL: no polls either.
    r = Runtime(make_context(None, None))
    assert r.should_stop() is False and r.control.polls == 0


def test_sigterm_without_an_action_is_a_signal(agent: FakeAgent, staging: Path) -> None:
    r = make_runtime(agent.url, staging, 0)
    assert r.stop_request() is None
    runtime.request_stop()  # as the SIGTERM handler does
    assert r.should_stop() is True
    assert r.stop_request() == "signal" and r.should_pause() is False
    # An action learned later names the request better.
    agent.action = "pause"
    assert r.stop_request() == "pause" and r.should_pause()
    r.close(0)


def test_the_module_functions_use_the_process_runtime(
    agent: FakeAgent, staging: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime, "_default", make_runtime(agent.url, staging, 0))
    assert runtime.should_stop() is False and runtime.stop_request() is None
    agent.action = "preempt"
    assert runtime.should_stop() and runtime.should_pause()
    assert runtime.stop_request() == "preempt"


def test_the_module_functions_survive_a_broken_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in list(os.environ):
        if name.startswith("CUMULUS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CUMULUS_AGENT_URL", "http://127.0.0.1:1")  # without CUMULUS_JOB_ID
    monkeypatch.setattr(runtime, "_default", None)
    with pytest.raises(errors.RankEnvironmentError):
        runtime.get_runtime()
    assert runtime.should_stop() is False
    assert runtime.should_pause() is False
    assert runtime.stop_request() is None
    runtime.request_stop()
    assert runtime.should_stop() and runtime.stop_request() == "signal"


# -- the agent's Unix socket (ranks run as another user than the agent) -------------------

needs_unix_sockets = pytest.mark.skipif(
    not hasattr(socket, "AF_UNIX"), reason="no Unix domain sockets on this platform"
)


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[Path]:
    """Where a fake agent serves its Unix socket: in ``tmp_path`` when that is short
    enough for a socket address (108 bytes), else in a short temporary dir."""
    path = tmp_path / "agent.sock"
    if len(os.fsencode(path)) <= 100:
        yield path
        return
    short = "/tmp" if os.path.isdir("/tmp") else None
    with tempfile.TemporaryDirectory(prefix="cumulus-", dir=short) as d:
        yield Path(d) / "agent.sock"


@pytest.fixture
def unix_agent(staging: Path, socket_path: Path) -> Iterator[FakeAgent]:
    with FakeAgent(staging, socket_path=socket_path) as a:
        yield a


def from_this_process(req: Request) -> bool:
    """Whether a request came from this process over the Unix socket (``SO_PEERCRED``,
    where the OS has it)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return True
    return req.peer_pid == os.getpid()


@needs_unix_sockets
def test_reports_commits_and_polls_go_through_the_agent_socket(
    agent: FakeAgent, unix_agent: FakeAgent, staging: Path, socket_path: Path
) -> None:
    # agent_url names a live TCP agent: nothing may reach it.
    context = dataclasses.replace(make_context(agent.url, staging), agent_socket=str(socket_path))
    r = Runtime(context, commit_deadline_s=5, progress_interval_s=0.05, control_poll_interval_s=0)
    assert r.agent is not None and r.agent.socket_path == str(socket_path)
    assert str(socket_path) in repr(r.agent)

    r.report(3, 10, loss=0.5)
    assert r.flush(5)
    (req,) = unix_agent.of("/v1/progress")
    assert req.authorization == "Bearer tok-1"
    assert req.body == {"step": 3, "total_steps": 10, "metrics": {"loss": 0.5}}
    assert from_this_process(req), req

    with r.checkpoint(5, state={"epoch": 2}) as part:
        (part / "model.bin").write_bytes(b"weights")
    assert part.committed is not None
    assert part.committed.dir == "step-00000005/rank-0/attempt-0"
    assert part.committed.path == staging.parent.parent / part.committed.dir
    assert (staging.parent.parent / part.committed.dir / "model.bin").read_bytes() == b"weights"
    (req,) = unix_agent.of("/v1/checkpoint")
    assert req.authorization == "Bearer tok-1"
    assert req.body == {"step": 5, "state": {"epoch": 2}}
    assert from_this_process(req), req

    assert r.should_stop() is False
    unix_agent.action = "pause"
    assert r.should_stop() and r.should_pause()
    polls = unix_agent.of("/v1/control")
    assert len(polls) >= 2 and all(q.authorization == "Bearer tok-1" for q in polls)
    r.close(1)
    assert agent.requests == []


@needs_unix_sockets
def test_the_environment_selects_the_socket(
    unix_agent: FakeAgent, staging: Path, socket_path: Path, tmp_path: Path
) -> None:
    shards = tmp_path / "shards"
    shards.write_text("")
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "CUMULUS_JOB_ID": "job-000001",
        "CUMULUS_ATTEMPT": "0",
        "CUMULUS_SHARDS_FILE": str(shards),
        # Nothing listens there: a request over TCP would fail.
        "CUMULUS_AGENT_URL": f"http://127.0.0.1:{closed_port()}",
        "CUMULUS_AGENT_TOKEN": "tok-1",
        "CUMULUS_AGENT_SOCKET": str(socket_path),
        "CUMULUS_CKPT_STAGING": str(staging),
    }
    context = runtime.context_from_env(env)
    assert context.agent_socket == str(socket_path)
    r = Runtime(context, commit_deadline_s=5, progress_interval_s=0.05)
    r.report(1, loss=1.0)
    assert r.flush(5)
    with r.checkpoint(1):
        pass
    assert r._reporter is not None and r._reporter.failures == 0
    assert [q.body["step"] for q in unix_agent.of("/v1/progress")] == [1]
    assert [q.body["step"] for q in unix_agent.of("/v1/checkpoint")] == [1]
    r.close(1)


@needs_unix_sockets
def test_the_url_path_prefix_applies_over_the_socket(
    unix_agent: FakeAgent, socket_path: Path
) -> None:
    client = runtime.AgentClient("http://127.0.0.1:1/agent/", "tok-1", str(socket_path))
    unix_agent.queue("/agent/v1/control", (200, {"action": "preempt"}))
    assert client.control(timeout_s=5) == "preempt"
    (req,) = unix_agent.of("/agent/v1/control")
    assert (req.method, req.authorization) == ("GET", "Bearer tok-1")


@needs_unix_sockets
def test_an_answer_over_the_socket_is_checked_as_over_tcp(
    unix_agent: FakeAgent, socket_path: Path
) -> None:
    client = runtime.AgentClient("http://127.0.0.1:1", "tok-1", str(socket_path))
    unix_agent.queue("/v1/progress", (409, {"error": "attempt replaced"}))
    with pytest.raises(errors.StaleAttempt, match="attempt replaced"):
        client.progress(1, None, {}, timeout_s=5)
    unix_agent.queue("/v1/control", (403, {"error": "not a rank of this attempt"}))
    with pytest.raises(errors.AgentError, match="not a rank") as e:
        client.control(timeout_s=5)
    assert e.value.status == 403


@needs_unix_sockets
def test_a_missing_socket_is_an_agent_error_naming_it(socket_path: Path) -> None:
    client = runtime.AgentClient("http://127.0.0.1:1", "tok-1", socket_path=str(socket_path))
    with pytest.raises(errors.AgentError) as e:
        client.control(timeout_s=5)
    assert e.value.status is None
    assert str(socket_path) in str(e.value) and "failed" in str(e.value)
    assert repr(client) == (f"AgentClient('http://127.0.0.1:1', socket_path={str(socket_path)!r})")


RANK_STOP_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from cumulus import runtime
    print("first", runtime.stop_request(), flush=True)
    if sys.argv[1] == "signal":
        os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not runtime.should_stop():
        assert time.monotonic() < deadline, "no stop seen"
        time.sleep(0.01)
    print("then", runtime.stop_request(), runtime.should_pause(), flush=True)
    """
)


@pytest.mark.parametrize(
    ("how", "expected"),
    [("signal", "then signal False"), ("pause", "then pause True")],
)
def test_a_rank_process_sees_the_agent_action_or_sigterm(
    agent: FakeAgent, tmp_path: Path, how: str, expected: str
) -> None:
    shards = tmp_path / "shards"
    shards.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUMULUS_")}
    env.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        CUMULUS_JOB_ID="job-000001",
        CUMULUS_ATTEMPT="0",
        CUMULUS_SHARDS_FILE=str(shards),
        CUMULUS_AGENT_URL=agent.url,
        CUMULUS_AGENT_TOKEN="tok-1",
    )

    def asked(req: Request) -> tuple[int, object]:
        # "none" to the first poll, then the action (the rank polls once a second).
        return 200, {"action": "none" if len(agent.of("/v1/control")) == 1 else how}

    if how != "signal":
        agent.queue("/v1/control", *[asked] * 5)
    r = subprocess.run(
        [sys.executable, "-c", RANK_STOP_SCRIPT, how],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["first None", expected], r.stdout + r.stderr
    assert all(q.authorization == "Bearer tok-1" for q in agent.of("/v1/control"))


UNREACHABLE_SCRIPT = textwrap.dedent(
    """
    import sys
    from cumulus import errors, runtime
    runtime.init(commit_deadline_s=0.3)
    if sys.argv[1] == "caught":
        try:
            with runtime.checkpoint(1):
                pass
        except errors.CheckpointFailed as e:
            print("caught", type(e.__cause__).__name__, e.__cause__.status, flush=True)
        sys.exit(0)
    with runtime.checkpoint(1):
        pass
    """
)


@pytest.mark.parametrize(
    ("how", "code"),
    [("uncaught", 75), ("caught", 0), ("answered", 1)],
)
def test_a_rank_that_never_reaches_its_agent_exits_75(
    agent: FakeAgent, staging: Path, tmp_path: Path, how: str, code: int
) -> None:
    """An uncaught commit failure for want of any answer from the agent exits with the
    contract's EXIT_AGENT_UNREACHABLE; a script that catches it keeps control; a failure
    the agent answered (HTTP 503 until the deadline) stays Python's exit 1."""
    from cumulus._contract import EXIT_AGENT_UNREACHABLE

    assert EXIT_AGENT_UNREACHABLE == 75
    shards = tmp_path / "shards"
    shards.write_text("")
    if how == "answered":
        agent.queue("/v1/checkpoint", *[(503, {"error": "leader unreachable"})] * 50)
    url = agent.url if how == "answered" else f"http://127.0.0.1:{closed_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUMULUS_")}
    env.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        CUMULUS_JOB_ID="job-000001",
        CUMULUS_ATTEMPT="0",
        CUMULUS_SHARDS_FILE=str(shards),
        CUMULUS_AGENT_URL=url,
        CUMULUS_AGENT_TOKEN="tok-1",
        CUMULUS_CKPT_STAGING=str(staging),
    )
    r = subprocess.run(
        [sys.executable, "-c", UNREACHABLE_SCRIPT, how],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == code, r.stdout + r.stderr
    if how == "uncaught":
        assert "CheckpointFailed" in r.stderr and "exiting with code 75" in r.stderr, r.stderr
    elif how == "caught":
        assert r.stdout.splitlines() == ["caught AgentError None"], r.stdout + r.stderr
    else:
        assert "CheckpointFailed" in r.stderr and "exiting with code" not in r.stderr, r.stderr


def test_only_errors_without_an_answer_are_unreachable() -> None:
    from cumulus.runtime._agent import agent_unreachable

    no_answer = errors.AgentError("POST /v1/checkpoint failed: refused", status=None)
    failed = errors.CheckpointFailed("commit failed", 1)
    failed.__cause__ = no_answer
    answered = errors.CheckpointFailed("commit failed", 1)
    answered.__cause__ = errors.AgentError("HTTP 503", status=503)
    assert agent_unreachable(no_answer) and agent_unreachable(failed)
    assert not agent_unreachable(answered)
    assert not agent_unreachable(errors.StaleAttempt("stale", status=409))
    assert not agent_unreachable(errors.CheckpointFailed("no cause", 1))
    assert not agent_unreachable(ValueError("x")) and not agent_unreachable(None)


STOP_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from cumulus import runtime
    assert runtime.should_stop() is False          # installs the handler
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not runtime.should_stop():
        assert time.monotonic() < deadline, "no stop seen"
        time.sleep(0.01)
    print("stopping gracefully", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)           # a second SIGTERM terminates
    time.sleep(10)
    sys.exit("still alive after the second SIGTERM")
    """
)


def test_should_stop_after_sigterm_and_a_second_one_terminates() -> None:
    r = subprocess.run(
        [sys.executable, "-c", STOP_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert "stopping gracefully" in r.stdout, r.stderr
    assert r.returncode == -15, (r.returncode, r.stderr)


def test_module_functions_run_standalone() -> None:
    script = textwrap.dedent(
        """
        from cumulus import errors, runtime
        runtime.report(1, 10, loss=0.5)
        assert runtime.resume() is None and not runtime.checkpoints_enabled()
        try:
            with runtime.checkpoint(1):
                pass
        except errors.NotInCumulusRank as e:
            print("refused:", e)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUMULUS_")}
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert r.returncode == 0, r.stderr
    assert "refused: checkpoint() needs a Cumulus rank" in r.stdout


def test_the_runtime_imports_no_third_party_module() -> None:
    script = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import cumulus, cumulus.runtime\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(sorted(new - set(sys.stdlib_module_names) - {'cumulus'}))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
