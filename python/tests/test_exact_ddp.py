"""``cumulus.torch.exact_ddp``: four real gloo ranks (plain processes, no cluster) train a
small MLP straight through and "restarted" (fresh model, optimizer and DDP from the state
after step 5). Stock DDP ends with other weights when restarted (its first iteration lays
the gradient buckets out in another order); with ``exact_ddp`` both runs, and both of
its reduction paths, end with the same bits. The cluster version of this (a real job,
a rank killed) is in ``test_ddp.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import cumulus.torch
from gloo_ranks import gloo_ranks, gloo_results

pytestmark = [pytest.mark.torch]

pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e './python[torch]')")

PROGRAM = Path(__file__).parent / "programs" / "exact_ddp_rank.py"
WORLD = 4
SPLIT = 5  # the program's default: 12 steps, restarted after step 5
TIMEOUT_S = 240


def test_restarted_ddp_is_bit_identical_with_exact_ddp_and_not_without(tmp_path: Path) -> None:
    with gloo_ranks(PROGRAM, WORLD, tmp_path / "store") as ranks:
        results = gloo_results(ranks, TIMEOUT_S)
    assert all(r == results[0] for r in results), results  # DDP: every rank the same
    r = results[0]
    # The cause: a fresh DDP's first iteration lays its bucket out in parameter order,
    # every later one in gradient-ready order (here the last layer's bias first).
    first, second, third = r["layouts"]
    assert first == ["0.weight@0", "0.bias@2048", "3.weight@2080", "3.bias@2400"], first
    assert second == third == ["3.bias@0", "3.weight@10", "0.bias@330", "0.weight@362"]
    # Stock DDP: the restarted run's first step (6) sums in another order; the weights
    # part there.
    straight, restarted = r["stock"]
    assert straight != restarted
    assert r["stock_first_differing_step"] == SPLIT + 1, r
    # exact_ddp: the same bits, whichever collectives reduced the buckets, however
    # large they are.
    assert len({*r["gather"], *r["alltoall"], *r["buckets"]}) == 1, r
    assert r["gather_first_differing_step"] is None
    assert "bucket_cap_mb" in r["refused"]  # a DDP and DDP arguments: which one is meant?


def test_importing_it_does_not_import_torch() -> None:
    code = "import sys, cumulus, cumulus.torch; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_a_bad_gather_threshold_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="gather_max_bytes"):
        cumulus.torch.exact_ddp(object(), gather_max_bytes=bad)  # type: ignore[arg-type]
