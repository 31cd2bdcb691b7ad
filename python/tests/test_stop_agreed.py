"""``runtime.stop_agreed()``: two real ranks of a gloo process group, only one of them
sent SIGTERM, both stop at the same step."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import IO

import pytest

from cumulus import runtime
from gloo_ranks import gloo_ranks, gloo_results

pytestmark = [pytest.mark.torch]

pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e './python[torch]')")

PROGRAM = Path(__file__).parent / "programs" / "stop_agreed_rank.py"
TIMEOUT_S = 120


def read_line(stream: IO[str], what: str) -> str:
    line = stream.readline()  # the child's own deadline (communicate below) bounds it
    assert line, f"the rank exited before printing {what}"
    return line.strip()


def test_one_signalled_rank_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    with gloo_ranks(PROGRAM, 2, tmp_path / "store") as ranks:
        assert ranks[1].stdout is not None
        assert read_line(ranks[1].stdout, "ready") == "ready"
        ranks[1].send_signal(signal.SIGTERM)  # rank 1 alone is asked to stop
        lines = gloo_results(ranks, TIMEOUT_S)
    assert lines[0]["step"] == lines[1]["step"] >= 20, lines
    assert lines[1]["request"] == "signal"
    assert lines[0]["request"] is None  # rank 0 was not asked; it stopped by agreement


def test_without_a_process_group_it_is_should_stop() -> None:
    assert runtime.stop_agreed() is runtime.should_stop()
    with pytest.raises(RuntimeError, match="init_process_group"):
        runtime.stop_agreed(group=object())
