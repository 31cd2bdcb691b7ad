"""A rank of ``test_exact_ddp.py``: a gloo process group of ``WORLD`` plain processes
training a small MLP with DDP, twice per mode: straight through ``STEPS`` steps, and
"restarted" after ``SPLIT`` steps (the model and optimizer state copied into a fresh
model, a fresh optimizer and a fresh DDP, as a restarted process loads them, so the new
DDP runs its first iteration with its first-iteration bucket layout). Modes: ``stock``
(``DistributedDataParallel``), ``gather`` (``exact_ddp``, every bucket all-gathered;
``static_graph``), ``alltoall`` (``exact_ddp`` on a DDP made first, every bucket
all-to-all then all-gathered), ``buckets`` (``exact_ddp`` with buckets of 4 kB: several,
whose members change at the rebuild; ``find_unused_parameters``,
``gradient_as_bucket_view``).

Prints one JSON line: ``{mode: [SHA-256 of the straight run's final weights, of the
restarted run's]}``, ``{mode}_first_differing_step`` (the first step after which their
weights differ, or null), and ``layouts``: the parameters of each bucket, in order, of
the first three iterations of a fresh DDP (recorded by a pass-through hook of an extra
DDP; not part of any run above), and ``refused``: the error of ``exact_ddp`` given a DDP
and DDP arguments.

Usage: ``exact_ddp_rank.py RANK WORLD STORE_FILE [STEPS SPLIT]``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cumulus.torch import exact_ddp

MODES = ("stock", "gather", "alltoall", "buckets")


def make_model() -> nn.Module:
    torch.manual_seed(1)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 10))


def wrap(model: nn.Module, mode: str) -> nn.Module:
    if mode == "stock":
        return nn.parallel.DistributedDataParallel(model)
    ddp: nn.Module
    if mode == "buckets":
        ddp = exact_ddp(
            model, bucket_cap_mb=0.004, find_unused_parameters=True, gradient_as_bucket_view=True
        )
    elif mode == "gather":
        ddp = exact_ddp(model, gather_max_bytes=1 << 30, static_graph=True)
    else:  # a DDP made by the caller gets the hook
        ddp = exact_ddp(nn.parallel.DistributedDataParallel(model), gather_max_bytes=0)
    return ddp


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def train(mode: str, rank: int, steps: int, split: int | None) -> list[str]:
    """Trains ``steps`` steps (a fresh model, optimizer and DDP after ``split``); the
    SHA-256 of the weights after each step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(1001 + rank)  # this rank's dropout
    data = torch.Generator().manual_seed(500 + rank)
    ddp = wrap(model, mode)
    loss_fn = nn.CrossEntropyLoss()
    digests = []
    for step in range(1, steps + 1):
        if step - 1 == split:
            state, opt_state = model.state_dict(), opt.state_dict()
            dropout = torch.get_rng_state()
            model = make_model()
            model.load_state_dict(state)
            torch.set_rng_state(dropout)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            opt.load_state_dict(opt_state)
            ddp = wrap(model, mode)
        x = torch.rand(32, 64, generator=data)
        y = torch.randint(0, 10, (32,), generator=data)
        loss = loss_fn(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        digests.append(digest(model))
    return digests


def layouts() -> list[list[str]]:
    """``name@offset`` of every parameter in each bucket, iterations 1 to 3 of a fresh
    DDP (its hook returns the bucket unreduced)."""
    model = make_model()
    names = {id(p): n for n, p in model.named_parameters()}
    seen: list[list[str]] = []

    def record(state: Any, bucket: Any) -> Any:
        offset, parts = 0, []
        for p in bucket.parameters():
            parts.append(f"{names[id(p)]}@{offset}")
            offset += p.numel()
        seen.append(parts)
        done: Any = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, lambda state, bucket: record(state, bucket))
    for _ in range(3):
        ddp(torch.zeros(1, 64)).sum().backward()
    return seen


def main() -> int:
    rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    steps, split = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (12, 5)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result: dict[str, Any] = {}
    for mode in MODES:
        straight, restarted = train(mode, rank, steps, None), train(mode, rank, steps, split)
        result[mode] = [straight[-1], restarted[-1]]
        differ = [s for s in range(steps) if straight[s] != restarted[s]]
        result[f"{mode}_first_differing_step"] = differ[0] + 1 if differ else None
    result["layouts"] = layouts()
    try:
        exact_ddp(nn.parallel.DistributedDataParallel(make_model()), bucket_cap_mb=1)
    except ValueError as e:
        result["refused"] = str(e)
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
