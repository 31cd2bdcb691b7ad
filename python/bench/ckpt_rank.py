"""A Cumulus rank (world size 1, with a checkpoint dir) that times how long the training
loop is blocked by checkpointing ``--mib`` MiB of float32 parameters, three ways, in an
order rotated every repetition:

* ``cumulus``: :func:`cumulus.ckpt.save_checkpoint` (safetensors into the staging dir, then
  the agent's commit, which fsyncs the part) — the call returns once it is committed;
* ``cumulus_async``: :func:`cumulus.ckpt.save_checkpoint_async` — the call returns once
  the state is copied to host memory (the time the loop is blocked); a "training step"
  then changes the parameters while the background thread writes and commits, and
  ``wait()`` gives the time from the call until committed;
* ``plain``: ``torch.save(model.state_dict(), f)`` into a new file, then ``fsync`` of the
  file and its dir, in ``--plain-dir`` (on the same file system as the checkpoint dir);
  the previous file is deleted after the timed part, as a job keeping its last
  checkpoint until the next is durable does (and as Cumulus's ``keep`` does).

Every arm starts from the same memory: the previous checkpoint of each kind is deleted
after the timed part (Cumulus prunes its older step once the new one is committed), then
the rank waits until the cluster has pruned and ``--settle-s`` more (:data:`SETTLE_S`).
On a VM that reports free memory to its host (virtio-balloon free page reporting, 2 s
after pages are freed), a first write to memory the host took back costs a fault in the
host: 1 GiB of new anonymous memory takes 0.75-0.83 s to write on machine M, 0.16-0.20 s
to write again. Without the wait, an arm that follows a deletion writes into pages
still backed, and which arm that is decides the ratio (deleting the old file just
before ``torch.save``, an in-place overwrite, made the plain arm 1.24 s instead of
~2.8 s). A checkpoint taken minutes after the last meets the settled state.

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
#: Seconds waited before each timed arm once the old checkpoints are gone, by default:
#: longer than the kernel's free page reporting delay (2 s, mm/page_reporting.c).
SETTLE_S = 3.0
#: Longest wait for the cluster to prune the older step, seconds.
PRUNE_TIMEOUT_S = 60.0


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def settle(job_ckpt_dir: Path, settle_s: float) -> None:
    """Waits until ``job_ckpt_dir`` holds at most one step (``ckpt_keep`` 1: the older
    one pruned), then ``settle_s`` seconds."""
    deadline = time.monotonic() + PRUNE_TIMEOUT_S
    while len(list(job_ckpt_dir.glob("step-*"))) > 1:
        if time.monotonic() > deadline:
            sys.exit(f"{job_ckpt_dir}: the older step was not pruned in {PRUNE_TIMEOUT_S} s")
        time.sleep(0.01)
    time.sleep(settle_s)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--plain-dir", type=Path, required=True)
    p.add_argument(
        "--ckpt-dir", type=Path, required=True, help="the job's checkpoint root (ckpt_dir)"
    )
    p.add_argument("--settle-s", type=float, default=SETTLE_S)
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


class Arms:
    """The three ways of checkpointing, timed; samples in the order taken."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], plain_dir: Path) -> None:
        self.model = model
        self.params = params
        self.plain_dir = plain_dir
        #: The last plain checkpoint, kept until the next is durable.
        self.plain_file: Path | None = None
        self.samples: dict[str, list[float]] = {
            "cumulus_s": [],
            "cumulus_async_s": [],
            "cumulus_async_committed_s": [],
            "plain_s": [],
        }

    def training_step(self) -> None:
        with torch.no_grad():
            for t in self.params:
                t.add_(1.0)  # new bytes to write

    def cumulus(self, rep: int, step: int) -> None:
        t0 = time.perf_counter()
        part = ckpt.save_checkpoint(step, {"rep": rep}, model=self.model)
        took = time.perf_counter() - t0
        self.samples["cumulus_s"].append(took)
        print(f"rep {rep} cumulus {took:.3f} s -> {part.dir}", flush=True)

    def cumulus_async(self, rep: int, step: int) -> None:
        t0 = time.perf_counter()
        pending = ckpt.save_checkpoint_async(step, {"rep": rep}, model=self.model)
        blocked = time.perf_counter() - t0
        self.training_step()  # training goes on while the commit runs
        part = pending.wait()
        committed = time.perf_counter() - t0
        self.samples["cumulus_async_s"].append(blocked)
        self.samples["cumulus_async_committed_s"].append(committed)
        print(
            f"rep {rep} cumulus_async blocked {blocked:.3f} s, committed after "
            f"{committed:.3f} s -> {part.dir}",
            flush=True,
        )

    def plain(self, rep: int, step: int) -> None:
        new_file = self.plain_dir / f"model-{step}.pt"
        t0 = time.perf_counter()
        torch.save(self.model.state_dict(), new_file)
        fsync_path(new_file)
        fsync_path(self.plain_dir)
        took = time.perf_counter() - t0
        self.samples["plain_s"].append(took)
        self.drop_plain()
        self.plain_file = new_file
        print(f"rep {rep} plain {took:.3f} s", flush=True)

    def drop_plain(self) -> None:
        if self.plain_file is not None:
            self.plain_file.unlink()
            self.plain_file = None


def main() -> int:
    args = parse_args()
    rt = runtime.init(standalone=False)
    if not rt.checkpoints_enabled:
        sys.exit("this job has no checkpoint dir")
    if rt.context.job_id is None:
        sys.exit("this rank has no job id")
    job_ckpt_dir = args.ckpt_dir / rt.context.job_id
    model, params = make_model(args.mib)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"state: {nbytes / 2**20:.0f} MiB in {len(params)} tensors", flush=True)

    args.plain_dir.mkdir(parents=True, exist_ok=True)
    arms = Arms(model, params, args.plain_dir)
    modes = ("cumulus", "plain", "cumulus_async")
    step = 0
    for rep in range(args.reps):
        # Rotate which goes first, so none always follows the same one.
        order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
        for how in order:
            settle(job_ckpt_dir, args.settle_s)
            arms.training_step()
            step += 1
            getattr(arms, how)(rep, step)
    arms.drop_plain()

    tmp = args.result.with_suffix(".tmp")
    tmp.write_text(json.dumps({**arms.samples, "bytes": nbytes}))
    tmp.replace(args.result)
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
