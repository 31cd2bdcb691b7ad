"""``cumulus.ckpt.load_checkpoint`` after an in-process restart: it restores from the host
copy the asynchronous checkpoint of this process kept, when that copy is the very part
the new attempt resumes from, with the same result as reading the part from disk; from
disk otherwise (another step or attempt, or the buffers copied into since)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cumulus import ckpt, errors, runtime
from cumulus.runtime import CommittedPart, Runtime
from fake_agent import FakeAgent
from test_ckpt_async import Net, committed, make_context

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (pip install -e './python[torch]')"
)
np = pytest.importorskip("numpy")

pytestmark = pytest.mark.torch


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
    """Attempt 0's process-wide runtime, on the fake agent; no snapshot kept yet."""
    r = Runtime(make_context(agent.url, staging), commit_deadline_s=5)
    monkeypatch.setattr(runtime, "_default", r)
    monkeypatch.setattr(ckpt, "_buffers", None)
    monkeypatch.setattr(ckpt, "_host_copy", None)
    yield r
    r.close(1)


def restart_into(
    monkeypatch: pytest.MonkeyPatch, agent: FakeAgent, part: CommittedPart, *, job: str = ""
) -> Runtime:
    """What an in-process restart does to this process: a runtime of attempt 1 that
    resumes from ``part``."""
    assert part.path is not None
    ctx = dataclasses.replace(
        make_context(agent.url, None),
        attempt=1,
        agent_token="tok-2",
        resume_step=part.step,
        resume_dir=part.path,
        job_id=job or "job-000001",
    )
    r = Runtime(ctx, commit_deadline_s=5)
    monkeypatch.setattr(runtime, "_default", r)
    return r


def restored(net: Net) -> dict[str, Any]:
    """Everything a restore sets, comparable."""
    out: dict[str, Any] = {f"model.{k}": v.clone() for k, v in net.model.state_dict().items()}
    out["optimizer"] = repr(net.opt.state_dict())
    out["scheduler"] = net.sched.state_dict()
    out["view"] = net.view.clone()
    out |= {f"array.{k}": a.copy() for k, a in net.arrays.items()}
    out["custom"] = repr(net.custom.state)
    out["rng"] = runtime.rng_state(net.data)
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y) and x.dtype == y.dtype, k
        elif isinstance(x, np.ndarray):
            assert np.array_equal(x, y) and x.dtype == y.dtype, k
        else:
            assert x == y, k


def test_a_restart_restores_the_host_copy_as_the_disk_would(
    rt: Runtime, agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = Net()
    net.step()
    net.step()
    state = {"epoch": 3}
    part = committed(ckpt.save_checkpoint_async(2, state, **net.objects()).wait(10))
    net.mutate()  # training went on past the checkpoint, then a peer died
    rt._abandon()
    restart_into(monkeypatch, agent, part)

    from_memory = Net()
    from_memory.mutate()
    point = ckpt.load_checkpoint(**from_memory.objects())
    assert point is not None and point.step == 2 and point.state == state
    assert point.source == "memory"
    got = restored(from_memory)

    from_disk = Net()
    from_disk.mutate()
    assert part.path is not None
    ckpt.load(part.path, **from_disk.objects())
    assert_same(got, restored(from_disk))

    # Nothing restored shares memory with the host buffers the next snapshot copies into.
    assert ckpt._buffers is not None
    buffers = {b.untyped_storage().data_ptr() for b, _ in ckpt._buffers[1].values()}
    tensors = [*from_memory.model.state_dict().values(), from_memory.view]
    for s in from_memory.opt.state.values():
        tensors += [t for t in s.values() if isinstance(t, torch.Tensor)]
    assert not buffers & {t.untyped_storage().data_ptr() for t in tensors}


def test_another_step_attempt_or_job_is_read_from_disk(
    rt: Runtime, agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = Net()
    older = committed(ckpt.save_checkpoint(1, **net.objects()))
    net.step()
    part = committed(ckpt.save_checkpoint_async(2, **net.objects()).wait(10))
    # The resume step is not the snapshot's.
    restart_into(monkeypatch, agent, older)
    point = ckpt.load_checkpoint(**Net().objects())
    assert point is not None and point.step == 1 and point.source == "disk"
    # The same step, but another attempt's part of it (same files, another directory).
    assert part.path is not None
    other = part.path.parent / "attempt-7"
    other.mkdir()
    for f in part.path.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    restart_into(monkeypatch, agent, dataclasses.replace(part, path=other))
    point = ckpt.load_checkpoint(**Net().objects())
    assert point is not None and point.source == "disk"
    # Another job's runtime.
    restart_into(monkeypatch, agent, part, job="job-000002")
    point = ckpt.load_checkpoint(**Net().objects())
    assert point is not None and point.source == "disk"
    # The snapshot's own part: memory.
    restart_into(monkeypatch, agent, part)
    point = ckpt.load_checkpoint(**Net().objects())
    assert point is not None and point.source == "memory"


def test_a_later_snapshot_leaves_the_older_part_to_the_disk(
    rt: Runtime, agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = Net()
    part = committed(ckpt.save_checkpoint_async(1, **net.objects()).wait(10))
    net.step()
    # Step 2's snapshot copied into step 1's buffers (its commit then refused: it never
    # became the resume step).
    agent.queue("/v1/checkpoint", (409, {"error": "stale"}))
    later = ckpt.save_checkpoint_async(2, **net.objects())
    with pytest.raises(errors.StaleAttempt):
        later.wait(10)
    restart_into(monkeypatch, agent, part)
    fresh = Net()
    point = ckpt.load_checkpoint(**fresh.objects())
    assert point is not None and point.step == 1 and point.source == "disk"
    expected = Net()
    assert part.path is not None
    ckpt.load(part.path, **expected.objects())
    assert_same(restored(fresh), restored(expected))
