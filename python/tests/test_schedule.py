"""``runtime.time_to_checkpoint`` (the rule, with a fake clock, and through a rank's
runtime) and the client side of ``runtime.list_checkpoints``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cumulus import errors, runtime
from cumulus.runtime import CheckpointSchedule, Runtime, _stop
from fake_agent import FakeAgent
from test_runtime import make_context


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def never() -> bool:
    return False


def always() -> bool:
    return True


def due(
    s: CheckpointSchedule,
    step: object,
    *,
    every_steps: object = None,
    every_seconds: object = None,
    enabled: bool = True,
    floor: int | None = None,
    stop: bool = False,
) -> bool:
    return s.due(
        step,
        every_steps=every_steps,
        every_seconds=every_seconds,
        enabled=enabled,
        floor=floor,
        stop=always if stop else never,
    )


def test_every_steps_is_due_on_positive_multiples() -> None:
    s = CheckpointSchedule(Clock())
    assert [n for n in range(0, 31) if due(s, n, every_steps=10)] == [10, 20, 30]


def test_every_seconds_counts_from_the_start_and_from_each_yes() -> None:
    clock = Clock()
    s = CheckpointSchedule(clock)
    assert not due(s, 1, every_seconds=60)
    clock.now += 59.9
    assert not due(s, 2, every_seconds=60)
    clock.now += 0.1
    assert due(s, 3, every_seconds=60)
    clock.now += 30
    assert not due(s, 4, every_seconds=60)
    # A yes for another reason restarts the clock too.
    assert due(s, 10, every_steps=10, every_seconds=60)
    clock.now += 45
    assert not due(s, 11, every_steps=10, every_seconds=60)
    clock.now += 15
    assert due(s, 12, every_steps=10, every_seconds=60)


def test_a_stop_request_is_always_due() -> None:
    s = CheckpointSchedule(Clock())
    assert due(s, 7, stop=True) and due(s, 8, every_steps=1000, stop=True)
    assert not due(s, 9)


def test_never_due_when_disabled_or_not_after_the_floor() -> None:
    s = CheckpointSchedule(Clock())
    assert not due(s, 10, every_steps=10, enabled=False, stop=True)
    assert not due(s, 10, every_steps=10, floor=10, stop=True)
    assert not due(s, 5, every_steps=5, floor=10, stop=True)
    assert due(s, 20, every_steps=10, floor=10)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"step": -1}, errors.InvalidStep, "non-negative int"),
        ({"step": True}, errors.InvalidStep, "non-negative int"),
        ({"step": 1.0}, errors.InvalidStep, "non-negative int"),
        ({"step": 1, "every_steps": 0}, ValueError, "every_steps"),
        ({"step": 1, "every_steps": 2.0}, ValueError, "every_steps"),
        ({"step": 1, "every_steps": True}, ValueError, "every_steps"),
        ({"step": 1, "every_seconds": 0}, ValueError, "every_seconds"),
        ({"step": 1, "every_seconds": float("nan")}, ValueError, "every_seconds"),
        ({"step": 1, "every_seconds": float("inf")}, ValueError, "every_seconds"),
        ({"step": 1, "every_seconds": "60"}, ValueError, "every_seconds"),
    ],
)
def test_bad_arguments_are_refused_even_when_disabled(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    step = kwargs.pop("step")
    with pytest.raises(error, match=match):
        due(CheckpointSchedule(Clock()), step, enabled=False, **kwargs)  # type: ignore[arg-type]


# -- through the runtime ----------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_sigterm_handler_here(monkeypatch: pytest.MonkeyPatch) -> None:
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


def test_the_runtime_counts_its_own_commits_and_the_resume_step(
    agent: FakeAgent, staging: Path
) -> None:
    rt = Runtime(make_context(agent.url, staging, resume_step=20), control_poll_interval_s=0)
    try:
        assert not rt.time_to_checkpoint(20, every_steps=10)  # resumed from it
        assert rt.time_to_checkpoint(30, every_steps=10)
        with rt.checkpoint(30) as part:
            (part / "w").write_text("30")
        assert not rt.time_to_checkpoint(30, every_steps=10)
        assert not rt.time_to_checkpoint(31, every_steps=10)
        agent.action = "pause"
        assert rt.time_to_checkpoint(31, every_steps=10)
    finally:
        rt.close(1)


def test_standalone_never_checkpoints() -> None:
    rt = Runtime(runtime.get_context(standalone=True))
    assert not rt.time_to_checkpoint(100, every_steps=1)
    assert rt.list_checkpoints() == []


def test_list_checkpoints_asks_the_agent(agent: FakeAgent, staging: Path) -> None:
    rt = Runtime(make_context(agent.url, staging))
    try:
        agent.queue("/v1/checkpoints", (200, {"steps": [30, 10, 20]}))
        assert rt.list_checkpoints() == [10, 20, 30]
        (req,) = agent.of("/v1/checkpoints")
        assert (req.method, req.authorization) == ("GET", "Bearer tok-1")
        for bad in ({"steps": [-1]}, {"steps": "10"}, {"steps": [True]}, {}, b"not json"):
            agent.queue("/v1/checkpoints", (200, bad))
            with pytest.raises(errors.AgentError, match="malformed"):
                rt.list_checkpoints()
        agent.queue("/v1/checkpoints", (200, {"steps": list(range(1025))}))
        with pytest.raises(errors.AgentError, match="malformed"):
            rt.list_checkpoints()
        agent.queue("/v1/checkpoints", (401, {"error": "unknown agent token"}))
        with pytest.raises(errors.StaleAttempt):
            rt.list_checkpoints()
    finally:
        rt.close(1)


def test_without_a_checkpoint_dir_the_list_is_empty(agent: FakeAgent) -> None:
    rt = Runtime(make_context(agent.url, None))
    try:
        assert rt.list_checkpoints() == [] and agent.of("/v1/checkpoints") == []
        assert not rt.time_to_checkpoint(10, every_steps=10)
    finally:
        rt.close(1)
