"""ElasticData: an elastic job's records by its data plan (CUMULUS_DATA_PLAN), its
position in checkpoints, and the plan's start after a resize."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cumulus import _contract
from cumulus.errors import RankEnvironmentError
from cumulus.runtime import DATA_STATE_KEY, ElasticData, ShardReader, data_plan


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    out = []
    for name, rows in (("a.csv", 4), ("b.csv", 3), ("c.csv", 2)):
        p = tmp_path / name
        p.write_text("".join(f"{name},{i}\n" for i in range(rows)))
        out.append(p)
    return out


def write_plan(tmp_path: Path, plan: dict[str, Any]) -> dict[str, str]:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return {_contract.RANK_ENV_DATA_PLAN: str(path)}


def ids(records: Any) -> list[str]:
    return [f"{r[0]}:{r[1]}" for r in records]


def test_shard_reader_skips_the_first_records_of_each_segment(shards: list[Path]) -> None:
    r = ShardReader(shards, first_records=[3, 0, 5])
    assert ids(r) == ["a.csv:3", "b.csv:0", "b.csv:1", "b.csv:2"]
    r = ShardReader(shards, first_records=[1, 2, 0])
    assert ids([next(r), next(r)]) == ["a.csv:1", "a.csv:2"]
    state = r.state()
    assert (state["shard"], state["record"]) == (0, 2)
    again = ShardReader(shards, first_records=[1, 2, 0])
    again.restore(state)
    assert ids(again) == ["a.csv:3", "b.csv:2", "c.csv:0", "c.csv:1"]
    with pytest.raises(ValueError, match="first_records"):
        ShardReader(shards, first_records=[1])


def test_without_a_plan_every_epoch_reads_the_shards_whole(shards: list[Path]) -> None:
    data = ElasticData(tuple(shards), plan=None)
    data.plan = None
    assert len(ids(data.reader())) == 9
    data.next_epoch()
    reader = data.reader()
    assert ids([next(reader)]) == ["a.csv:0"]
    assert data.state() == {"epoch": 1, "segment": 0, "record": 1}
    resumed = ElasticData(tuple(shards), plan=None)
    resumed.plan = None
    resumed.restore({DATA_STATE_KEY: data.state()}, resume_step=10)
    assert resumed.epoch == 1 and ids(resumed.reader())[0] == "a.csv:1"


def test_a_resized_attempt_starts_the_plan_with_the_carries(
    tmp_path: Path, shards: list[Path]
) -> None:
    a, b, c = shards
    env = write_plan(
        tmp_path,
        {
            "world_size": 2,
            "previous_world_size": 4,
            "from_step": 40,
            "start_epoch": 1,
            "epochs": {
                "1": [{"shard": str(a), "first_record": 2}, {"shard": str(c), "first_record": 0}]
            },
            "carry": [{"count": 5}, {"count": 7}],
        },
    )
    plan = data_plan(env)
    assert plan is not None and plan.resized and plan.from_step == 40
    data = ElasticData((b,), plan=plan)
    # Resumed from the resize's step: the plan's start, with the old ranks' carries.
    data.restore({DATA_STATE_KEY: {"epoch": 0, "segment": 0, "record": 1}}, resume_step=40)
    assert data.started_plan and data.epoch == 1
    assert data.carried == ({"count": 5}, {"count": 7})
    reader = data.reader()
    assert ids([next(reader)]) == ["a.csv:2"]
    assert data.state(carry={"count": 13}) == {
        "epoch": 1,
        "segment": 0,
        "record": 1,
        "carry": {"count": 13},
    }
    assert ids(reader) == ["a.csv:3", "c.csv:0", "c.csv:1"]
    data.next_epoch()  # epoch 2 is not in the plan: this rank's shards, whole
    assert ids(data.reader()) == ["b.csv:0", "b.csv:1", "b.csv:2"]
    # Resumed from a later step: its own position, no carries.
    later = ElasticData((b,), plan=plan)
    later.restore({DATA_STATE_KEY: {"epoch": 1, "segment": 1, "record": 1}}, resume_step=60)
    assert not later.started_plan and later.carried == ()
    assert ids(later.reader()) == ["c.csv:1"]


def test_a_carry_is_bounded_and_a_bad_plan_is_refused(tmp_path: Path, shards: list[Path]) -> None:
    data = ElasticData(tuple(shards), plan=None)
    with pytest.raises(ValueError, match="carry"):
        data.state(carry="x" * 2000)
    env = write_plan(tmp_path, {"world_size": -1})
    with pytest.raises(RankEnvironmentError, match="world_size"):
        data_plan(env)
    assert data_plan({}) is None
