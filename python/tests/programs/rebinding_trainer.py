"""A PyTorch rank program for ``test_ckpt_rebinding.py``: a linear model trained by SGD
with momentum on 64 in-memory records, 16 per step, shuffled anew each epoch by the
everyday line ``perm = torch.randperm(n, generator=order)``, so the variable ``perm`` is
rebound to a new tensor every 4 steps. Every ``--ckpt-every`` steps it checkpoints the
model, the optimizer, the epoch's permutation and the shuffle's generator
(``cumulus.ckpt``) with the position in the epoch (the JSON state).

``--objects``:

* ``each-call`` (the documented way): the objects are passed at each save; a resumed
  attempt loads the permutation with ``perm=None`` and rebinds ``perm`` to
  ``point.objects["perm"]``;
* ``collected``: they are collected once, ``objects = dict(..., perm=perm)``, and
  ``**objects`` is passed to every load and save: after a rebinding the dict still holds
  the first epoch's permutation (the save refuses it: ``ckpt.StaleObject``).

``--kill-at-step S``: the first attempt SIGKILLs itself after step S, once the last
checkpoint before S is committed. At the end it writes ``<out>/result.json``: attempt,
resume step, the SHA-256 of the final weights, the digest of the batches in order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

from cumulus import ckpt, runtime

N, BATCH = 64, 16


def kill_self(step: int, ckpt_every: int) -> None:
    last = step - step % ckpt_every
    deadline = time.monotonic() + 60
    while last not in runtime.list_checkpoints():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for step {last} to be committed")
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGKILL)


def problem() -> tuple[torch.Tensor, torch.Tensor, nn.Module, torch.optim.Optimizer]:
    """The records (features, targets), the model and its optimizer, deterministic."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(N, 8, generator=data)
    y = x @ torch.randn(8, 1, generator=data) + 0.1 * torch.randn(N, 1, generator=data)
    model = nn.Linear(8, 1)
    return x, y, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--objects", choices=["each-call", "collected"], required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=6)
    p.add_argument("--kill-at-step", type=int, default=None)
    args = p.parse_args()
    rt = runtime.init()
    ctx = rt.context
    x, y, model, opt = problem()
    order = torch.Generator().manual_seed(2)
    perm = torch.randperm(N, generator=order)

    start, epoch, pos, digest = 0, 0, 0, ""
    if args.objects == "collected":
        objects = {"model": model, "optimizer": opt, "perm": perm, "rng": ckpt.RNG(order)}
        point = ckpt.load_checkpoint(**objects)
    else:
        point = ckpt.load_checkpoint(model=model, optimizer=opt, perm=None, rng=ckpt.RNG(order))
        if point is not None:
            perm = point.objects["perm"]
    if point is not None:
        start, epoch, pos = point.step, point.state["epoch"], point.state["pos"]
        digest = point.state["digest"]
    for step in range(start + 1, args.steps + 1):
        if pos == N:
            perm = torch.randperm(N, generator=order)  # a new tensor each epoch
            epoch, pos = epoch + 1, 0
        idx = perm[pos : pos + BATCH]
        pos += BATCH
        digest = hashlib.sha256(f"{digest}:{idx.tolist()}".encode()).hexdigest()
        loss = (model(x[idx]) - y[idx]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        rt.report(step, args.steps, loss=loss.item())
        if step % args.ckpt_every == 0 and rt.checkpoints_enabled:
            state = {"epoch": epoch, "pos": pos, "digest": digest}
            if args.objects == "collected":
                ckpt.save_checkpoint(step, state, **objects)
            else:
                ckpt.save_checkpoint(
                    step, state, model=model, optimizer=opt, perm=perm, rng=ckpt.RNG(order)
                )
        if step == args.kill_at_step and ctx.attempt == 0:
            kill_self(step, args.ckpt_every)

    weights = b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "attempt": ctx.attempt,
        "resumed_from": start if point is not None else None,
        "epoch": epoch,
        "weights_sha256": hashlib.sha256(weights).hexdigest(),
        "batch_digest": digest,
    }
    (args.out / "result.json").write_text(json.dumps(result))
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
