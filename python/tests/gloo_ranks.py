"""Plain processes forming one gloo process group through a file store (no cluster):
``program RANK WORLD STORE`` each, started together, their last stdout line read as JSON,
every one killed on the way out."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def gloo_ranks(program: Path, world: int, store: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """Starts ``world`` ranks of ``program`` (without the runner's ``CUMULUS_*``
    variables: they are no cluster's ranks) and kills any still running at the end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUMULUS_")}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(program), str(r), str(world), str(store)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    try:
        yield ranks
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()


def gloo_results(ranks: list[subprocess.Popen[str]], timeout_s: float) -> list[Any]:
    """Waits for every rank (``timeout_s`` each), asserts each exited 0, and returns
    each one's last stdout line parsed as JSON, in rank order."""
    outs = [p.communicate(timeout=timeout_s) for p in ranks]
    assert [p.returncode for p in ranks] == [0] * len(ranks), outs
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
