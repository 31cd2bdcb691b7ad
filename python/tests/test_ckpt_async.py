"""``cumulus.ckpt.save_checkpoint_async`` against a fake agent: it returns once the
snapshot is taken, writes the same bytes as ``save_checkpoint``, is not changed by later
training, commits one checkpoint at a time, and its errors are not lost."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cumulus import ckpt, errors, runtime
from cumulus.runtime import CommittedPart, Runtime
from fake_agent import FakeAgent, Request
from localcluster import wait_for

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (pip install -e './python[torch]')"
)
np = pytest.importorskip("numpy")

pytestmark = pytest.mark.torch


def make_context(agent_url: str | None, staging: Path | None) -> runtime.Context:
    return runtime.Context(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        master_addr="127.0.0.1",
        master_port=29500,
        job_id="job-000001",
        attempt=0,
        shard_paths=(),
        staging_dir=staging,
        resume_step=None,
        resume_dir=None,
        agent_url=agent_url,
        agent_token="tok-1",
        standalone=agent_url is None,
    )


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
def rt(agent: FakeAgent, staging: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Runtime]:
    """The process-wide runtime, on the fake agent; fresh staging buffers."""
    r = Runtime(make_context(agent.url, staging), commit_deadline_s=5)
    monkeypatch.setattr(runtime, "_default", r)
    monkeypatch.setattr(ckpt, "_buffers", None)
    yield r
    r.close(1)


class Gate:
    """A scripted answer to ``POST /v1/checkpoint`` that holds the request until
    :meth:`open` is called, then commits it as the agent does."""

    def __init__(self, agent: FakeAgent) -> None:
        self.agent = agent
        self.entered = threading.Event()
        self.released = threading.Event()

    def __call__(self, req: Request) -> tuple[int, Any]:
        self.entered.set()
        assert self.released.wait(30), "the gate was never opened"
        return self.agent.commit(req)

    def open(self) -> None:
        self.released.set()


@pytest.fixture
def gate(agent: FakeAgent) -> Iterator[Callable[[], Gate]]:
    gates: list[Gate] = []

    def make() -> Gate:
        g = Gate(agent)
        gates.append(g)
        agent.queue("/v1/checkpoint", g)
        return g

    yield make
    for g in gates:  # never leave a commit hanging
        g.open()


class Net:
    """A model with tied weights, an Adam optimizer with state, a scheduler, a data
    generator, and other objects of every kind a snapshot copies."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(6, 6)
        )
        self.model[3].weight = self.model[0].weight  # tied: one storage, two names
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.data = torch.Generator().manual_seed(5)
        base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
        self.view = base.t()[1:]  # a non-contiguous view
        self.arrays = {
            "c": np.arange(12.0).reshape(3, 4),
            "f": np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)),
            "strided": np.arange(24.0).reshape(4, 6)[:, ::2].T,  # neither C nor F
        }
        self.meta: dict[str, Any] = {
            "epoch": 1,
            "names": ["a", "b"],
            "nested": {"x": [1.5, None, True]},
        }
        self.custom = Custom()

    def step(self) -> None:
        x = torch.randn(8, 6, generator=self.data)
        loss = self.model(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()

    def objects(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.opt,
            "scheduler": self.sched,
            "rng": ckpt.RNG(self.data),
            "view": self.view,
            **self.arrays,
            "meta": self.meta,
            "custom": self.custom,
        }

    def mutate(self) -> None:
        """What training does after a checkpoint call: everything changes in place."""
        self.step()
        self.step()
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1.0)
            self.view.add_(100.0)
        for a in self.arrays.values():
            a += 7
        self.meta["epoch"] = 99
        self.meta["names"].append("c")
        self.meta["nested"]["x"][0] = -1.0
        self.custom.state["w"].add_(5.0)
        torch.rand(3, generator=self.data)
        random.random()


class Custom:
    """State with a value neither JSON nor a tensor: written with ``torch.save``."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {"dtype": torch.float16, "w": torch.ones(3)}

    def state_dict(self) -> dict[str, Any]:
        return {"dtype": self.state["dtype"], "w": self.state["w"]}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.state = dict(s)


def committed(part: CommittedPart | None) -> CommittedPart:
    """The part a commit returned, committed: ``None`` (refused because the rank was
    asked to stop) is never expected here."""
    assert part is not None, "the part was not committed"
    return part


def files_of(part: CommittedPart) -> dict[str, bytes]:
    assert part.path is not None
    return {p.name: p.read_bytes() for p in sorted(part.path.iterdir())}


# -- returning before the commit ---------------------------------------------------------


def test_it_returns_before_the_agent_answers(
    rt: Runtime, agent: FakeAgent, gate: Callable[[], Gate], staging: Path
) -> None:
    g = gate()
    net = Net()
    pending = ckpt.save_checkpoint_async(10, {"epoch": 1}, model=net.model)
    assert isinstance(pending, ckpt.PendingCheckpoint) and pending.step == 10
    assert g.entered.wait(10), "the background thread never asked for the commit"
    assert not pending.done()
    with pytest.raises(TimeoutError, match="step 10 is still being committed"):
        pending.wait(0.05)
    g.open()
    part = pending.wait(10)
    assert pending.done()
    assert part == CommittedPart(
        step=10,
        dir="step-00000010/rank-0/attempt-0",
        path=staging.parent.parent / "step-00000010/rank-0/attempt-0",
    )
    assert pending.wait() is part  # again: the same part
    assert ckpt.wait_pending() is part
    assert rt.checkpointer.last_committed_step == 10
    (req,) = agent.of("/v1/checkpoint")
    assert req.body == {"step": 10, "state": {"epoch": 1}}
    assert sorted(files_of(part)) == [
        "cumulus-ckpt.json",
        "cumulus-state.json",
        "model.safetensors",
    ]
    assert part.path is not None
    assert json.loads((part.path / "cumulus-state.json").read_text()) == {"epoch": 1}


def test_wait_pending_without_a_commit_is_none(rt: Runtime) -> None:
    assert ckpt.wait_pending() is None
    assert ckpt.wait_pending(0) is None


def test_the_part_has_the_shape_save_checkpoint_returns(rt: Runtime, agent: FakeAgent) -> None:
    net = Net()
    sync = ckpt.save_checkpoint(1, {"k": 1}, model=net.model)
    part = ckpt.save_checkpoint_async(2, {"k": 1}, model=net.model).wait(10)
    assert type(part) is type(sync) is CommittedPart
    assert (sync.step, part.step) == (1, 2)
    assert part.dir == sync.dir.replace("step-00000001", "step-00000002")
    assert part.path is not None and sync.path is not None
    assert part.path.parent.parent.parent == sync.path.parent.parent.parent
    assert [r.body for r in agent.of("/v1/checkpoint")] == [
        {"step": 1, "state": {"k": 1}},
        {"step": 2, "state": {"k": 1}},
    ]


# -- what is written ---------------------------------------------------------------------


def test_the_files_are_byte_identical_to_save_checkpoint(rt: Runtime) -> None:
    net = Net()
    net.step()
    net.step()  # the optimizer and the scheduler have state
    state = {"epoch": 3, "seen": [1, 2.5, "x"]}
    sync = committed(ckpt.save_checkpoint(1, state, **net.objects()))
    part = committed(ckpt.save_checkpoint_async(2, state, **net.objects()).wait(10))
    expected, got = files_of(sync), files_of(part)
    assert (
        sorted(got)
        == sorted(expected)
        == sorted(
            [
                "c.npy",
                "cumulus-ckpt.json",
                "cumulus-state.json",
                "custom.pt",
                "f.npy",
                "model.safetensors",
                "optimizer.safetensors",
                "strided.npy",
                "view.safetensors",
            ]
        )
    )
    for name in expected:
        assert got[name] == expected[name], name
    assert part.path is not None
    index = ckpt.read_index(part.path)
    assert index["custom"]["encoding"] == "torch.save"
    assert index["scheduler"]["kind"] == "state_dict" and index["rng"]["kind"] == "rng"

    # A second asynchronous checkpoint copies into the same host buffers.
    assert ckpt._buffers is not None
    buffers = {k: b.data_ptr() for k, (b, _) in ckpt._buffers[1].items()}
    net.step()
    sync = committed(ckpt.save_checkpoint(3, state, **net.objects()))
    part = committed(ckpt.save_checkpoint_async(4, state, **net.objects()).wait(10))
    assert files_of(part) == files_of(sync)
    assert ckpt._buffers is not None
    assert {k: b.data_ptr() for k, (b, _) in ckpt._buffers[1].items()} == buffers


def test_the_host_buffers_can_be_released(rt: Runtime) -> None:
    net = Net()
    first = ckpt.save_checkpoint_async(1, model=net.model)
    ckpt.release_async_buffers()  # while the commit is in flight: it keeps its own
    assert ckpt._buffers is None
    assert committed(first.wait(10)).step == 1
    assert committed(ckpt.save_checkpoint_async(2, model=net.model).wait(10)).step == 2
    assert ckpt._buffers is not None
    ckpt.release_async_buffers()
    assert ckpt._buffers is None


def test_training_after_the_call_does_not_change_the_checkpoint(
    rt: Runtime, agent: FakeAgent, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    net = Net()
    net.step()
    objects = net.objects()
    expected_dir = ckpt.save(tmp_path / "expected", **objects)  # the bytes at call time
    state: dict[str, Any] = {"epoch": 1, "names": ["a"]}

    # The background thread writes only once training has changed everything.
    may_write = threading.Event()
    write_all = ckpt._write_all

    def write_later(d: Path, captured: Any) -> None:
        assert may_write.wait(30)
        write_all(d, captured)

    monkeypatch.setattr(ckpt, "_write_all", write_later)
    pending = ckpt.save_checkpoint_async(10, state, **objects)
    net.mutate()
    state["epoch"] = 2
    state["names"].append("b")
    may_write.set()
    part = committed(pending.wait(10))

    assert part.path is not None
    for p in sorted(expected_dir.iterdir()):
        assert (part.path / p.name).read_bytes() == p.read_bytes(), p.name
    assert json.loads((part.path / "cumulus-state.json").read_text()) == {
        "epoch": 1,
        "names": ["a"],
    }
    (req,) = agent.of("/v1/checkpoint")
    assert req.body["state"] == {"epoch": 1, "names": ["a"]}
    # And it loads back as the state of that moment.
    fresh = Net()
    ckpt.load(part.path, model=fresh.model, optimizer=fresh.opt, meta=None)
    before = ckpt.load(expected_dir, model=None)["model"]
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, before[k]), k


# -- one commit at a time, and errors ----------------------------------------------------


def test_a_second_call_waits_for_the_first(
    rt: Runtime, agent: FakeAgent, gate: Callable[[], Gate]
) -> None:
    g = gate()
    net = Net()
    first = ckpt.save_checkpoint_async(10, model=net.model)
    assert g.entered.wait(10)
    second: list[ckpt.PendingCheckpoint] = []
    t = threading.Thread(
        target=lambda: second.append(ckpt.save_checkpoint_async(20, model=net.model))
    )
    t.start()
    t.join(0.3)
    assert t.is_alive() and not second, "the second call did not wait for the first"
    assert len(agent.of("/v1/checkpoint")) == 1
    g.open()
    t.join(10)
    assert second and first.done()
    assert committed(first.wait()).step == 10 and committed(second[0].wait(10)).step == 20
    assert [r.body["step"] for r in agent.of("/v1/checkpoint")] == [10, 20]


def test_save_checkpoint_waits_for_the_pending_commit(
    rt: Runtime, agent: FakeAgent, gate: Callable[[], Gate]
) -> None:
    g = gate()
    net = Net()
    pending = ckpt.save_checkpoint_async(10, model=net.model)
    assert g.entered.wait(10)
    threading.Timer(0.2, g.open).start()
    part = committed(ckpt.save_checkpoint(20, model=net.model))
    assert pending.done() and part.step == 20
    assert [r.body["step"] for r in agent.of("/v1/checkpoint")] == [10, 20]


@pytest.mark.parametrize("status", [409, 401])
def test_a_stale_verdict_is_raised_by_wait(rt: Runtime, agent: FakeAgent, status: int) -> None:
    agent.queue("/v1/checkpoint", (status, {"error": "attempt 0 of rank 0 is stale"}))
    net = Net()
    pending = ckpt.save_checkpoint_async(10, model=net.model)
    for _ in range(2):  # every time
        with pytest.raises(errors.StaleAttempt, match="is stale") as e:
            pending.wait(10)
        assert e.value.status == status
    with pytest.raises(errors.StaleAttempt):
        ckpt.wait_pending()
    # Raised already: the next checkpoint goes ahead.
    assert committed(ckpt.save_checkpoint_async(11, model=net.model).wait(10)).step == 11


def test_an_error_never_waited_for_is_raised_by_the_next_call(
    rt: Runtime, agent: FakeAgent, staging: Path
) -> None:
    agent.queue("/v1/checkpoint", (409, {"error": "attempt 0 of rank 0 is stale"}))
    net = Net()
    pending = ckpt.save_checkpoint_async(10, model=net.model)
    wait_for(pending.done, 10, "the commit to end")
    with pytest.raises(errors.StaleAttempt, match="is stale"):
        ckpt.save_checkpoint_async(20, model=net.model)
    assert len(agent.of("/v1/checkpoint")) == 1  # the second was not started
    assert list(staging.iterdir()) == []
    # Once raised, it is not raised again.
    assert committed(ckpt.save_checkpoint_async(20, model=net.model).wait(10)).step == 20

    # save_checkpoint raises it too.
    agent.queue("/v1/checkpoint", (409, {"error": "stale again"}))
    pending = ckpt.save_checkpoint_async(30, model=net.model)
    wait_for(pending.done, 10, "the commit to end")
    with pytest.raises(errors.StaleAttempt, match="stale again"):
        ckpt.save_checkpoint(40, model=net.model)
    assert committed(ckpt.save_checkpoint(40, model=net.model)).step == 40


def test_commit_failures_are_retried_as_save_checkpoint_does(
    rt: Runtime, agent: FakeAgent, staging: Path
) -> None:
    def storage_failure(req: Request) -> tuple[int, object]:
        for p in staging.iterdir():  # the agent empties the staging dir after an I/O error
            p.unlink()
        return 500, {"error": "checkpoint I/O error: fsync: No space left on device"}

    agent.queue("/v1/checkpoint", storage_failure, (503, {"error": "leader unreachable"}))
    net = Net()
    part = committed(ckpt.save_checkpoint_async(10, model=net.model).wait(10))
    assert [r.body["step"] for r in agent.of("/v1/checkpoint")] == [10, 10, 10]
    assert part.path is not None
    assert sorted(p.name for p in part.path.iterdir()) == [
        "cumulus-ckpt.json",
        "cumulus-state.json",
        "model.safetensors",
    ]


def test_what_is_checked_before_the_copy_is_raised_by_the_call(
    rt: Runtime, agent: FakeAgent
) -> None:
    net = Net()
    ckpt.save_checkpoint_async(10, model=net.model).wait(10)
    with pytest.raises(errors.InvalidStep, match="not after step 10"):
        ckpt.save_checkpoint_async(10, model=net.model)
    with pytest.raises(errors.InvalidState):
        ckpt.save_checkpoint_async(11, {"x": float("nan")}, model=net.model)
    with pytest.raises(ValueError, match="nothing to checkpoint"):
        ckpt.save_checkpoint_async(11)
    with pytest.raises(TypeError, match=r"cannot checkpoint a builtins\.object"):
        ckpt.save_checkpoint_async(11, thing=object())
    assert len(agent.of("/v1/checkpoint")) == 1
    assert committed(ckpt.save_checkpoint_async(11, model=net.model).wait(10)).step == 11


def test_objects_that_cannot_be_copied_name_save_checkpoint(rt: Runtime, agent: FakeAgent) -> None:
    linear_model = pytest.importorskip("sklearn.linear_model")
    est = linear_model.LinearRegression().fit([[0.0], [1.0]], [0.0, 1.0])
    with pytest.raises(TypeError, match=r"'est'.*cumulus\.ckpt\.save_checkpoint"):
        ckpt.save_checkpoint_async(10, model=Net().model, est=est)
    assert agent.of("/v1/checkpoint") == []
    assert committed(ckpt.save_checkpoint(10, est=est)).step == 10


def test_standalone_it_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "_default", Runtime(make_context(None, None)))
    with pytest.raises(errors.NotInCumulusRank):
        ckpt.save_checkpoint_async(1, model=torch.nn.Linear(2, 2))
    assert ckpt.wait_pending() is None


def test_close_waits_for_the_pending_commit(
    rt: Runtime, agent: FakeAgent, gate: Callable[[], Gate]
) -> None:
    g = gate()
    pending = ckpt.save_checkpoint_async(10, model=Net().model)
    assert g.entered.wait(10)
    threading.Timer(0.3, g.open).start()
    start = time.monotonic()
    rt.close(1)
    assert pending.done() and time.monotonic() - start >= 0.2
    assert committed(pending.wait()).step == 10


# -- at exit -----------------------------------------------------------------------------

EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    from cumulus import ckpt, runtime

    ctx = runtime.Context(
        rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
        master_port=29500, job_id="job-000001", attempt=0, shard_paths=(),
        staging_dir=Path(sys.argv[2]), resume_step=None, resume_dir=None,
        agent_url=sys.argv[1], agent_token="tok-1", standalone=False,
    )
    runtime._default = runtime.Runtime(ctx, commit_deadline_s=5)
    ckpt.save_checkpoint_async(10, {"k": 1}, model=torch.nn.Linear(4, 4))
    print("returned", flush=True)
    """
)


def run_exit_script(agent: FakeAgent, staging: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, agent.url, str(staging)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_pending_commit_is_waited_for_at_exit(
    agent: FakeAgent, staging: Path, gate: Callable[[], Gate]
) -> None:
    g = gate()  # the agent holds the commit until the gate opens
    proc = subprocess.Popen(
        [sys.executable, "-c", EXIT_SCRIPT, agent.url, str(staging)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert g.entered.wait(60), "the commit never reached the agent"
        assert proc.stdout is not None
        first = proc.stdout.readline()  # the script's last line ran: it is exiting now
        # Held at exit while the agent holds the commit (a broken hook exits at once).
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
        g.open()
        out, err = proc.communicate(timeout=60)
        out = first + out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "returned"
    part = staging.parent.parent / "step-00000010" / "rank-0" / "attempt-0"
    assert sorted(p.name for p in part.iterdir()) == [
        "cumulus-ckpt.json",
        "cumulus-state.json",
        "model.safetensors",
    ]
    assert "not committed" not in r.stderr


def test_an_error_nobody_waited_for_is_logged_at_exit(agent: FakeAgent, staging: Path) -> None:
    agent.queue("/v1/checkpoint", (409, {"error": "attempt 0 of rank 0 is stale"}))
    r = run_exit_script(agent, staging)
    assert r.returncode == 0, r.stderr
    assert "checkpoint step 10 was not committed (found at exit): StaleAttempt" in r.stderr
    assert "is stale" in r.stderr
