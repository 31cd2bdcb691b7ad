"""EpochSampler: epoch orders from the seed, ranks' disjoint shares, and a resume at the
exact record from its JSON state or as a checkpointed object."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cumulus import ckpt
from cumulus.runtime import EpochSampler


def test_each_epoch_is_a_permutation_of_its_own() -> None:
    s = EpochSampler(50, seed=7)
    epochs = [s.take(50) for _ in range(3)]
    assert all(sorted(e) == list(range(50)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3
    assert [s.epoch, s.offset, s.taken] == [2, 50, 150]
    # A function of (seed, epoch) alone: another sampler, or another process, agrees.
    assert EpochSampler(50, seed=7).order(2) == epochs[2]
    assert EpochSampler(50, seed=8).order(0) != epochs[0]
    assert EpochSampler(5, shuffle=False).take(7) == [0, 1, 2, 3, 4, 0, 1]


def test_a_batch_spans_the_end_of_an_epoch() -> None:
    s = EpochSampler(10, seed=1)
    first = s.take(8)
    spanning = s.take(4)
    assert spanning[:2] == s.order(0)[8:] and spanning[2:] == s.order(1)[:2]
    assert (s.epoch, s.offset) == (1, 2)
    assert first == s.order(0)[:8]


@pytest.mark.parametrize("stop_after", [0, 1, 9, 10, 11, 25, 40])
def test_restore_continues_at_the_exact_record(stop_after: int) -> None:
    reference = EpochSampler(10, seed=3)
    expected = reference.take(stop_after + 17)
    first = EpochSampler(10, seed=3)
    seen = first.take(stop_after) if stop_after else []
    state = json.loads(json.dumps(first.state()))  # as it travels in a checkpoint
    assert len(json.dumps(state)) < 200
    second = EpochSampler(10, seed=3)
    second.restore(state)
    assert seen + second.take(17) == expected
    assert second.state() == reference.state()


def test_ranks_share_each_epoch_disjointly_and_equally() -> None:
    ranks = [EpochSampler(11, seed=5, rank=r, world_size=3) for r in range(3)]
    assert all(r.epoch_length == 3 for r in ranks)
    for _ in range(4):
        shares = [r.take(3) for r in ranks]
        flat = [i for share in shares for i in share]
        assert len(set(flat)) == 9 and set(flat) <= set(range(11))
    assert ranks[0].order(1) != ranks[0].order(2)


def test_a_state_of_other_records_is_refused() -> None:
    s = EpochSampler(10, seed=3)
    s.take(4)
    with pytest.raises(ValueError, match="taken over other records"):
        EpochSampler(10, seed=4).restore(s.state())
    with pytest.raises(ValueError, match="taken over other records"):
        EpochSampler(12, seed=3).restore(s.state())
    with pytest.raises(ValueError, match="taken over other records"):
        EpochSampler(10, seed=3, rank=1, world_size=2).restore(s.state())
    with pytest.raises(ValueError, match="not an EpochSampler state"):
        EpochSampler(10).restore({"epoch": 1})
    with pytest.raises(ValueError, match="past the epoch"):
        EpochSampler(10, seed=3).restore({**s.state(), "offset": 11})


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        EpochSampler(0)
    with pytest.raises(ValueError, match="rank 2 is not below world_size 2"):
        EpochSampler(10, rank=2, world_size=2)
    with pytest.raises(ValueError, match="cannot be shared by 4 ranks"):
        EpochSampler(3, world_size=4)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        EpochSampler(3).take(0)
    with pytest.raises(ValueError, match="seed must be an int"):
        EpochSampler(3, seed=1.5)  # type: ignore[arg-type]


def test_it_is_a_checkpointed_object_too(tmp_path: Path) -> None:
    s = EpochSampler(20, seed=9)
    s.take(27)
    ckpt.save(tmp_path, data=s)
    index = ckpt.read_index(tmp_path)
    assert index["data"]["kind"] == "state_dict" and index["data"]["files"] == []
    resumed = EpochSampler(20, seed=9)
    assert ckpt.load(tmp_path, data=resumed)["data"] is resumed
    assert resumed.take(30) == s.take(30)
    assert ckpt.load(tmp_path, data=None)["data"]["taken"] == 27
