"""``cumulus.runtime._writeback.Writeback``: while a part is written into the staging dir,
each file's new bytes are handed to the kernel's writeback as they are written; after
the block its thread hands every watched file whole, closes every descriptor and ends
(the block's exit does not wait for it); small files are left alone; the bytes are never
changed; an error in the block still closes everything."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from cumulus.runtime import _writeback
from cumulus.runtime._writeback import MIN_BYTES, Writeback

pytestmark = pytest.mark.skipif(
    not _writeback.available(), reason="no sync_file_range on this platform"
)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s")
        time.sleep(0.005)


def test_new_bytes_are_handed_while_the_block_writes(tmp_path: Path) -> None:
    chunk = os.urandom(MIN_BYTES)
    with Writeback(tmp_path) as w, open(tmp_path / "model.safetensors", "wb") as f:
        for i in range(1, 4):
            f.write(chunk)
            f.flush()
            # The thread hands what was written before the block goes on writing.
            wait_until(partial(lambda n: w.handed_bytes >= n, i * MIN_BYTES))
        assert w.early_calls >= 3
    assert w.join(10)
    assert w.handed_bytes == 3 * MIN_BYTES


def test_every_watched_file_is_handed_whole_and_closed(tmp_path: Path) -> None:
    before = open_fds()
    data = {
        "a.bin": os.urandom(MIN_BYTES + 123),
        "sub/b.bin": os.urandom(2 * MIN_BYTES + 7),
        "small.json": b"{}",
    }
    with Writeback(tmp_path, interval_s=3600) as w:  # only the final pass runs
        for rel, payload in data.items():
            (tmp_path / rel).parent.mkdir(exist_ok=True)
            (tmp_path / rel).write_bytes(payload)
    assert w.join(10)
    assert w.early_calls == 0
    # The two large files, whole; the small one is left to the agent's fsync.
    assert w.handed_bytes == len(data["a.bin"]) + len(data["sub/b.bin"])
    assert open_fds() == before
    for rel, payload in data.items():
        assert hashlib.sha256((tmp_path / rel).read_bytes()).digest() == (
            hashlib.sha256(payload).digest()
        )


def test_an_error_in_the_block_propagates_and_closes_everything(tmp_path: Path) -> None:
    before = open_fds()

    w = Writeback(tmp_path)

    def write_then_fail() -> None:
        with w:
            (tmp_path / "model.bin").write_bytes(os.urandom(MIN_BYTES))
            wait_until(lambda: w.handed_bytes >= MIN_BYTES)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_then_fail()
    assert w.join(10)
    assert open_fds() == before


def test_a_file_removed_while_watched_is_no_error(tmp_path: Path) -> None:
    with Writeback(tmp_path) as w:
        (tmp_path / "tmp.bin").write_bytes(os.urandom(MIN_BYTES))
        wait_until(lambda: w.handed_bytes >= MIN_BYTES)
        (tmp_path / "tmp.bin").rename(tmp_path / "final.bin")
        (tmp_path / "other.bin").write_bytes(os.urandom(MIN_BYTES))
        (tmp_path / "final.bin").unlink()
    assert w.join(10)
    assert w.handed_bytes >= 2 * MIN_BYTES


def test_a_file_sized_first_and_filled_after_is_handed_as_it_fills(tmp_path: Path) -> None:
    # As safetensors writes: a temp file, ftruncate to the final size, the data, a rename.
    chunk = os.urandom(MIN_BYTES)
    with Writeback(tmp_path) as w:
        with open(tmp_path / ".tmp-model", "wb") as f:
            f.truncate(3 * MIN_BYTES)
            wait_until(lambda: w.early_calls >= 1)
            for i in range(2, 5):
                f.write(chunk)
                f.flush()
                wait_until(partial(lambda n: w.early_calls >= n, i))
        (tmp_path / ".tmp-model").rename(tmp_path / "model.safetensors")
    assert w.join(10)
    assert w.handed_bytes == 3 * MIN_BYTES
