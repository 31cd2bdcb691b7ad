"""A Cumulus rank (world size 1, with a checkpoint dir) that times how long the training
loop is blocked by checkpointing ``--mib`` MiB of float32 parameters, three ways, in an
order rotated every repetition:

* ``cumulus``: :func:`cumulus.ckpt.save_checkpoint` (safetensors into the staging dir, then
  the agent's commit, which fsyncs the part) — the call returns once it is committed;
* ``cumulus_async``: :func:`cumulus.ckpt.save_checkpoint_async` — the call returns once
  the state is copied to host memory (the time the loop is blocked); a "training step"
  then changes the parameters while the background thread writes and commits, and
  ``wait()`` gives the time from the call until committed;
* ``plain``: ``torch.save(model.state_dict(), f)`` then ``fsync`` of the file and its dir,
  in ``--plain-dir`` (on the same file system as the checkpoint dir).

Writes ``{"cumulus_s": [...], "cumulus_async_s": [...], "cumulus_async_committed_s":
[...], "plain_s": [...], "bytes": N}`` to ``--result`` (samples in the order taken; the
first ``cumulus_async`` call also allocates the host buffers the later ones reuse).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from cumulus import ckpt, runtime

#: Parameters per tensor (64 MiB of float32), as a large model's layers would be.
CHUNK = 16 << 20


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--plain-dir", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True)
    return p.parse_args()


def make_model(mib: int) -> tuple[nn.Module, list[nn.Parameter]]:
    """A model of ``mib`` MiB of random float32 parameters, in tensors of at most
    ``CHUNK`` elements, and those parameters."""
    torch.manual_seed(0)
    numel = mib * (1 << 20) // 4
    model = nn.Module()
    params = []
    left = numel
    while left > 0:
        n = min(CHUNK, left)
        params.append(nn.Parameter(torch.empty(n).uniform_(-1, 1)))
        left -= n
    model.params = nn.ParameterList(params)
    return model, params


def main() -> int:
    args = parse_args()
    rt = runtime.init(standalone=False)
    if not rt.checkpoints_enabled:
        sys.exit("this job has no checkpoint dir")
    model, params = make_model(args.mib)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"state: {nbytes / 2**20:.0f} MiB in {len(params)} tensors", flush=True)

    args.plain_dir.mkdir(parents=True, exist_ok=True)
    plain_file = args.plain_dir / "model.pt"
    cumulus_s: list[float] = []
    async_s: list[float] = []
    async_committed_s: list[float] = []
    plain_s: list[float] = []
    modes = ("cumulus", "plain", "cumulus_async")
    step = 0

    def training_step() -> None:
        with torch.no_grad():
            for t in params:
                t.add_(1.0)  # new bytes to write

    for rep in range(args.reps):
        # Rotate which goes first, so none always meets a warm (or dirty) page cache.
        order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
        for how in order:
            training_step()
            step += 1
            if how == "cumulus":
                t0 = time.perf_counter()
                part = ckpt.save_checkpoint(step, {"rep": rep}, model=model)
                cumulus_s.append(time.perf_counter() - t0)
                print(f"rep {rep} cumulus {cumulus_s[-1]:.3f} s -> {part.dir}", flush=True)
            elif how == "cumulus_async":
                t0 = time.perf_counter()
                pending = ckpt.save_checkpoint_async(step, {"rep": rep}, model=model)
                async_s.append(time.perf_counter() - t0)
                training_step()  # training goes on while the commit runs
                part = pending.wait()
                async_committed_s.append(time.perf_counter() - t0)
                print(
                    f"rep {rep} cumulus_async blocked {async_s[-1]:.3f} s, committed after "
                    f"{async_committed_s[-1]:.3f} s -> {part.dir}",
                    flush=True,
                )
            else:
                plain_file.unlink(missing_ok=True)
                t0 = time.perf_counter()
                torch.save(model.state_dict(), plain_file)
                fsync_path(plain_file)
                fsync_path(args.plain_dir)
                plain_s.append(time.perf_counter() - t0)
                print(f"rep {rep} plain {plain_s[-1]:.3f} s", flush=True)
    plain_file.unlink(missing_ok=True)

    tmp = args.result.with_suffix(".tmp")
    result = {
        "cumulus_s": cumulus_s,
        "cumulus_async_s": async_s,
        "cumulus_async_committed_s": async_committed_s,
        "plain_s": plain_s,
        "bytes": nbytes,
    }
    tmp.write_text(json.dumps(result))
    tmp.replace(args.result)
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
