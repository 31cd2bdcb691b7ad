#!/usr/bin/env python3
"""PyTorch DDP on the bundled digits data, checkpointed and resumed bit-identically by
Cumulus.

A small MLP (64 → hidden → 10, with dropout) trained with SGD + momentum by
``DistributedDataParallel`` (gloo on CPU, NCCL when CUDA is present). Deterministic: fixed
seeds, ``torch.use_deterministic_algorithms(True)``, one thread per rank. Each rank trains
on its own records — its Cumulus shards (``cumulusctl dataset split``), else every
``WORLD_SIZE``-th row of ``--data`` — drawing batches from a per-rank shuffle that
carries over epochs; every ``--ckpt-every`` steps it commits the model, the optimizer,
the shuffle and every RNG (dropout) through :mod:`cumulus.ckpt`, and a restarted attempt
resumes from the last committed step, so its final weights equal a fault-free run's bit
for bit. Those periodic checkpoints are asynchronous
(``ckpt.save_checkpoint_async``): training waits only while the state is copied to host
memory, and goes on while it is written and committed; a checkpoint waits for the
previous one, and the rank waits for the last one before it exits.

Runs unchanged::

    torchrun --nproc-per-node 2 examples/python/ddp_digits.py --out /tmp/ddp
    cumulusctl dataset split data/digits/digits.csv.gz --shards 4 --out /tmp/digits
    cumulusctl submit --world-size 2 --dataset /tmp/digits --ckpt-dir /tmp/ckpt -- \\
        python examples/python/ddp_digits.py --out /tmp/ddp

At the end rank 0 writes ``<out>/model.safetensors`` (the final weights), and every rank
``<out>/rank-<R>.json``: its steps, attempt, resume step, the SHA-256 of its final
weights and the digest of every record it consumed, in order (the chain
``d = sha256(d ‖ "epoch:shard:line\\n")`` from 32 zero bytes).

Stopping: every step each rank checks ``runtime.should_stop()`` (a pause, a time limit,
a preemption or a cancel, told by the worker agent; or SIGTERM) and the ranks all-reduce
it, so that all of them stop at the same step: each commits its part of a checkpoint at
that step (synchronously: committed before the rank exits) and exits 0. A paused job
(``cumulusctl pause`` / ``Job.pause()``) thus resumes exactly where it stopped, and its
final weights are still a fault-free run's. Under plain
``torchrun`` only SIGTERM asks to stop, and nothing is committed.

Fault injection, for tests: ``--kill-rank R --kill-at-step S`` makes rank R's first
attempt SIGKILL itself after step S, once the last checkpoint before S is committed.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from cumulus import ckpt, errors, runtime
from safetensors.torch import save as st_save
from torch import nn

BUNDLED = Path(__file__).resolve().parents[2] / "data" / "digits" / "digits.csv.gz"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output dir (created)")
    p.add_argument(
        "--data",
        type=Path,
        default=BUNDLED,
        help="CSV (.gz) read when the job has no shards: rank R takes rows R, R+W, ...",
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument(
        "--step-sleep-ms",
        type=int,
        default=0,
        help="sleep this long after each step (paces a demo or a test; changes no result)",
    )
    p.add_argument("--kill-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--kill-at-step", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def load_records(
    ctx: runtime.Context, data: Path
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """This rank's records: features (scaled to [0, 1]), labels, and record ids
    ``shard:line``."""
    rows: list[list[str]] = []
    ids: list[str] = []
    if ctx.shard_paths:
        for shard in ctx.shard_paths:
            for i, row in enumerate(runtime.ShardReader([shard])):
                rows.append(row)
                ids.append(f"{shard.name}:{i}")
    else:
        for i, row in enumerate(runtime.ShardReader([data])):
            if i % ctx.world_size == ctx.rank:
                rows.append(row)
                ids.append(f"{data.name}:{i}")
    if not rows:
        sys.exit(
            f"rank {ctx.rank}: no records (shards: {list(map(str, ctx.shard_paths))})"
        )
    x = (
        torch.tensor([[float(v) for v in r[:-1]] for r in rows], dtype=torch.float32)
        / 16.0
    )
    y = torch.tensor([int(r[-1]) for r in rows], dtype=torch.int64)
    return x, y, ids


def committed_step(ctx: runtime.Context) -> int:
    """The job's newest committed step (local checkpoint layout: ``LATEST``), else 0."""
    assert ctx.staging_dir is not None
    try:
        text = (ctx.staging_dir.parent.parent / "LATEST").read_text().strip()
    except FileNotFoundError:
        return 0
    return int(text.removeprefix("step-"))


def stop_everywhere(rt: runtime.Runtime, device: torch.device) -> bool:
    """Whether any rank was asked to stop (``should_stop()``), agreed by all: a
    collective, so call it on every rank at every step."""
    flag = torch.tensor([1.0 if rt.should_stop() else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def main() -> int:
    args = parse_args()
    rt = runtime.init(handle_sigterm=True)
    ctx = rt.context
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available() and args.backend != "gloo"
    backend = args.backend if args.backend != "auto" else ("nccl" if cuda else "gloo")
    # Under Cumulus CUDA_VISIBLE_DEVICES shows a rank only its own GPU(s); under torchrun
    # every rank sees them all: LOCAL_RANK modulo the visible count fits both.
    device = (
        torch.device("cuda", ctx.local_rank % torch.cuda.device_count())
        if cuda
        else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
        runtime.apply_gpu_memory_fraction()  # --gpu-memory-fraction, when the job has one
    # torchrun sets these too; Cumulus sets them for every rank.
    os.environ.setdefault("MASTER_ADDR", ctx.master_addr)
    os.environ.setdefault("MASTER_PORT", str(ctx.master_port))
    dist.init_process_group(
        backend,
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=datetime.timedelta(seconds=120),
    )

    x, y, ids = load_records(ctx, args.data)
    x, y = x.to(device), y.to(device)
    n = len(ids)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = nn.Sequential(
        nn.Linear(x.shape[1], args.hidden),
        nn.ReLU(),
        nn.Dropout(args.dropout),
        nn.Linear(args.hidden, 10),
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    torch.manual_seed(args.seed * 1000 + 1 + ctx.rank)  # this rank's dropout masks
    order = torch.Generator().manual_seed(
        args.seed * 1000 + 500 + ctx.rank
    )  # data order
    perm = torch.randperm(n, generator=order)
    epoch, pos, records, digest = 0, 0, 0, bytes(32)

    start = 0
    point = ckpt.load_checkpoint(
        model=model, optimizer=opt, perm=perm, rng=ckpt.RNG(order)
    )
    if point is not None:
        s = point.state
        start, epoch, pos, records = point.step, s["epoch"], s["pos"], s["records"]
        digest = bytes.fromhex(s["digest"])
    print(
        f"rank={ctx.rank} attempt={ctx.attempt} world={ctx.world_size} backend={backend} "
        f"records={n} start={start}",
        flush=True,
    )
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if cuda else None
    )
    loss_fn = nn.CrossEntropyLoss()

    # The periodic checkpoint being committed in the background, if any.
    pending: ckpt.PendingCheckpoint | None = None

    def committed(p: ckpt.PendingCheckpoint) -> None:
        """Waits for ``p``; raises its error (StaleAttempt: this attempt was replaced)."""
        part = p.wait()
        print(f"rank={ctx.rank} checkpoint {p.step} committed: {part.dir}", flush=True)

    t0 = time.monotonic()
    step, value = start, float("nan")
    for step in range(start + 1, args.steps + 1):
        batch: list[int] = []
        while len(batch) < args.batch_size:
            if pos == n:
                epoch, pos = epoch + 1, 0
                perm = torch.randperm(n, generator=order)
            take = min(args.batch_size - len(batch), n - pos)
            batch.extend(perm[pos : pos + take].tolist())
            pos += take
        h = hashlib.sha256(digest)
        for i in batch:
            h.update(f"{epoch}:{ids[i]}\n".encode())
        digest = hashlib.sha256(h.digest()).digest()
        records += len(batch)

        idx = torch.tensor(batch, device=device)
        loss = loss_fn(ddp(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.item()
        rt.report(step, args.steps, loss=value)
        if args.step_sleep_ms > 0:
            time.sleep(args.step_sleep_ms / 1000)
        if step % args.log_every == 0 and ctx.rank == 0:
            print(
                f"step {step}/{args.steps} epoch {epoch} loss {value:.4f}", flush=True
            )

        if pending is not None and pending.done():
            committed(pending)
            pending = None

        # Every rank stops at the same step: the step's checkpoint needs all their parts.
        stop = stop_everywhere(rt, device)
        if (step % args.ckpt_every == 0 or stop) and rt.checkpoints_enabled:
            state = {
                "epoch": epoch,
                "pos": pos,
                "records": records,
                "digest": digest.hex(),
            }
            objects = {
                "model": model,
                "optimizer": opt,
                "perm": perm,
                "rng": ckpt.RNG(order),
            }
            if not stop:
                if pending is not None:
                    committed(pending)  # one at a time (the next call would wait too)
                # Blocks while the state is copied; written and committed meanwhile.
                pending = ckpt.save_checkpoint_async(step, state, **objects)
            else:
                # The stop checkpoint must be committed before exit 0: synchronous,
                # after the periodic one still in flight.
                try:
                    if pending is not None:
                        p, pending = pending, None
                        committed(p)
                    part = ckpt.save_checkpoint(step, state, **objects)
                except errors.StaleAttempt as e:
                    # Cancelled, or replaced by a restart: nothing to keep.
                    print(f"rank={ctx.rank} stop checkpoint refused: {e}", flush=True)
                else:
                    print(
                        f"rank={ctx.rank} checkpoint {step} committed: {part.dir}",
                        flush=True,
                    )

        if (
            ctx.rank == args.kill_rank
            and step == args.kill_at_step
            and ctx.attempt == 0
        ):
            if pending is not None:
                p, pending = pending, None
                committed(p)  # this rank's part; then the others'
            if ctx.staging_dir is not None:
                last = step - step % args.ckpt_every
                deadline = time.monotonic() + 60
                while committed_step(ctx) < last:
                    if time.monotonic() > deadline:
                        sys.exit(f"timed out waiting for step {last} to be committed")
                    time.sleep(0.02)
            print(f"rank={ctx.rank} killing itself at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if stop:
            asked = rt.stop_request() or "another rank was asked"
            print(f"rank={ctx.rank} asked to stop at step {step} ({asked})", flush=True)
            rt.close()
            dist.destroy_process_group()
            return 0

    if pending is not None:
        committed(pending)  # the last checkpoint is committed before the rank ends
    elapsed = time.monotonic() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    blob = st_save(weights)
    if ctx.rank == 0:
        tmp = args.out / "model.safetensors.tmp"
        tmp.write_bytes(blob)
        tmp.replace(args.out / "model.safetensors")
    result = {
        "rank": ctx.rank,
        "attempt": ctx.attempt,
        "resumed_from": start if point is not None else None,
        "steps": step,
        "epoch": epoch,
        "records": records,
        "record_digest": digest.hex(),
        "weights_sha256": hashlib.sha256(blob).hexdigest(),
        "final_loss": value if step > start else None,
        "steps_per_s": (step - start) / elapsed if elapsed > 0 else None,
    }
    (args.out / f"rank-{ctx.rank}.json").write_text(json.dumps(result, indent=1))
    print(f"rank={ctx.rank} done: {json.dumps(result)}", flush=True)
    rt.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
