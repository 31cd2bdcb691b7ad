"""ShardReader: formats, order, and exactly-once resume through state()/restore()."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
from pathlib import Path

import pytest

from cumulus.runtime import ShardReader, list_shards, shard_format
from localcluster import DIGITS, bin_dir


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    a = tmp_path / "a.csv"
    a.write_text('1,x\n\n2,y\n3,"z,w"\n')
    b = tmp_path / "b.jsonl.gz"
    with gzip.open(b, "wt") as f:
        f.write('{"id": 4}\n\n{"id": 5}\n')
    c = tmp_path / "c.png"
    c.write_bytes(b"\x89PNG")
    d = tmp_path / "d.tsv"
    d.write_text("6\tq\n")
    return [a, b, c, d]


EXPECTED = [["1", "x"], ["2", "y"], ["3", "z,w"], {"id": 4}, {"id": 5}, b"\x89PNG", ["6", "q"]]


def test_formats_by_name() -> None:
    assert shard_format(Path("x.CSV.gz")) == "csv"
    assert shard_format(Path("x.ndjson")) == "jsonl"
    assert shard_format(Path("x.tsv")) == "tsv"
    assert shard_format(Path("x.jpg")) == "file"


def test_every_record_in_order(shards: list[Path]) -> None:
    with ShardReader(shards) as r:
        assert list(r) == EXPECTED
        assert r.state()["shard"] == len(shards)


def test_header_and_forced_format(tmp_path: Path) -> None:
    p = tmp_path / "data.txt"
    p.write_text("id,v\n1,2\n")
    assert list(ShardReader([p], format="csv", csv_header=True)) == [["1", "2"]]
    assert list(ShardReader([p])) == [b"id,v\n1,2\n"]


@pytest.mark.parametrize("stop_after", range(len(EXPECTED) + 1))
def test_restore_resumes_exactly_once(shards: list[Path], stop_after: int) -> None:
    first = ShardReader(shards)
    seen = [next(first) for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state()))  # as it travels in a checkpoint
    first.close()
    second = ShardReader(shards)
    second.restore(state)
    assert seen + list(second) == EXPECTED


def test_restore_refuses_other_shards(shards: list[Path]) -> None:
    state = ShardReader(shards).state()
    with pytest.raises(ValueError, match="other shards"):
        ShardReader(shards[:2]).restore(state)
    with pytest.raises(ValueError, match="not a ShardReader state"):
        ShardReader(shards).restore({"shard": "x"})
    with pytest.raises(ValueError, match="fewer than"):
        ShardReader(shards).restore({**state, "record": 99})


def test_no_shards_no_records() -> None:
    r = ShardReader([])
    assert list(r) == []
    r.restore(r.state())


def test_dot_files_are_not_shards_and_a_directory_is_its_shards(
    shards: list[Path], tmp_path: Path
) -> None:
    stats = tmp_path / ".feature-stats.json"
    stats.write_text('{"format": "cumulus-feature-stats/1"}')
    (tmp_path / "sub").mkdir()  # not a regular file: not a shard
    # What a plain os.listdir of the folder gives: the dot-file among the shards.
    listed = [tmp_path / n for n in sorted(os.listdir(tmp_path))]
    assert stats in listed
    assert list_shards(tmp_path) == shards
    for paths in (listed, [tmp_path], [str(tmp_path)]):
        with ShardReader(paths) as r:
            assert r.paths == tuple(shards)
            assert list(r) == EXPECTED
    with pytest.raises(NotADirectoryError):
        list_shards(shards[0])


def test_a_dataset_split_folder_reads_as_exactly_its_rows(tmp_path: Path) -> None:
    ctl = bin_dir() / "cumulusctl"
    if not os.access(ctl, os.X_OK):
        pytest.skip(f"{ctl} not built")
    out = tmp_path / "digits"
    r = subprocess.run(
        [str(ctl), "dataset", "split", str(DIGITS), "--shards", "3", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert ".feature-stats.json" in os.listdir(out)
    rows = sorted(map(tuple, ShardReader([DIGITS])))
    for paths in ([out / n for n in os.listdir(out)], [out], list_shards(out)):
        assert sorted(map(tuple, ShardReader(paths))) == rows
