"""A rank of ``test_stop_agreed.py``: a gloo process group of ``WORLD`` plain processes
(no Cumulus job: the runtime is standalone, so SIGTERM is the only stop request), each
stepping until ``runtime.stop_agreed()`` says stop. Prints ``ready`` at step 20, then,
once stopped, one JSON line: its rank, the step it stopped at, its own ``stop_request()``.

Usage: ``stop_agreed_rank.py RANK WORLD STORE_FILE``.
"""

from __future__ import annotations

import json
import sys
import time

import torch.distributed as dist

from cumulus import runtime

MAX_STEPS = 100_000


def main() -> int:
    rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    runtime.init(handle_sigterm=True)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    for step in range(1, MAX_STEPS + 1):
        time.sleep(0.002)  # a training step
        if step == 20:
            print("ready", flush=True)
        if runtime.stop_agreed():
            line = {"rank": rank, "step": step, "request": runtime.stop_request()}
            print(json.dumps(line), flush=True)
            dist.destroy_process_group()
            return 0
    return 3


if __name__ == "__main__":
    sys.exit(main())
