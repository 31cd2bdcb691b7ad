"""The training loop of python/README.md ("A training loop with the runtime"), line for
line, with a model of one number so that it runs anywhere: the program a new user
writes first. The cancel test runs it to see that a cancel ends every rank with exit 0.

``model`` counts the steps; ``train_step`` sleeps ``sys.argv[1]`` seconds (default
0.02) so that a test can act while it runs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from cumulus import runtime

TOTAL = 100_000
BATCH = 8
STEP_S = float(sys.argv[1]) if len(sys.argv) > 1 else 0.02


def init_model() -> dict[str, float]:
    return {"steps": 0.0}


def load_model(path: Path) -> dict[str, float]:
    model: dict[str, float] = json.loads(path.read_text())
    return model


def save_model(model: dict[str, float], path: Path) -> None:
    path.write_text(json.dumps(model))


def train_step(model: dict[str, float]) -> float:
    time.sleep(STEP_S)
    model["steps"] += 1
    return 1.0 / model["steps"]


# From here on, python/README.md's loop as it is written there.
ctx = runtime.get_context(standalone=True)  # also runs under plain python / torchrun
start, model = 0, init_model()
if (r := runtime.resume()) is not None:  # a restarted (or resumed) attempt
    model = load_model(r.dir / "model.bin")
    start = r.step
for step in range(start + 1, TOTAL + 1):
    loss = train_step(model)
    runtime.report(step, TOTAL, loss=loss)  # microseconds; sent in the background
    stop = runtime.should_stop()  # paused, time limit near, cancelled, SIGTERM
    if (stop or step % 100 == 0) and runtime.checkpoints_enabled():
        with runtime.checkpoint(step, state={"seen": step * BATCH}) as part:
            save_model(model, part / "model.bin")  # committed when the block ends
    if stop:
        sys.exit(0)  # a paused job resumes from this step
