#!/usr/bin/env python3
"""PyTorch DDP on the bundled digits data, checkpointed and resumed bit-identically by
Cumulus.

A small MLP (64 → hidden → 10, with dropout) trained with SGD + momentum by
``DistributedDataParallel`` (gloo on CPU, NCCL when CUDA is present), made by
``cumulus.torch.exact_ddp``: DDP with a communication hook that sums the gradients in rank
order, so a resumed run is exact at any world size (stock DDP's is only up to 2 ranks;
``--stock-ddp`` runs it). Deterministic: fixed seeds,
``torch.use_deterministic_algorithms(True)``, one thread per rank. Each rank trains
on its own records — its Cumulus shards (``cumulusctl dataset split``), else every
``WORLD_SIZE``-th row of ``--data`` — in batches from ``runtime.EpochSampler`` (each
epoch shuffled from a per-rank seed, batches carrying over epochs); every
``--ckpt-every`` steps it commits the model, the optimizer and every RNG (dropout)
through :mod:`cumulus.ckpt`, passed at each call, with the sampler's position in the
JSON state, and a restarted attempt resumes from the last committed step, so its final
weights equal a fault-free run's bit for bit. Those periodic checkpoints are asynchronous
(``ckpt.save_checkpoint_async``): training waits only while the state is copied to host
memory, and goes on while it is written and committed; a checkpoint waits for the
previous one, and the rank waits for the last one before it exits.

Runs unchanged::

    torchrun --nproc-per-node 2 examples/python/ddp_digits.py --out /tmp/ddp
    cumulusctl dataset split data/digits/digits.csv.gz --shards 4 --out /tmp/digits
    cumulusctl submit --world-size 2 --dataset /tmp/digits --ckpt-dir /tmp/ckpt \\
        --warm-spares 1 --warm-imports torch -- \\
        python examples/python/ddp_digits.py --out /tmp/ddp

(``--warm-spares 1 --warm-imports torch``: each worker keeps an interpreter with PyTorch
imported, which a restarted rank takes instead of starting again.)

At the end rank 0 writes ``<out>/model.safetensors`` (the final weights), and every rank
``<out>/rank-<R>.json``: its steps, attempt, resume step, the SHA-256 of its final
weights and the digest of every record it consumed, in order (the chain
``d = sha256(d ‖ "epoch:shard:line\\n")`` from 32 zero bytes).

Stopping: every step the ranks call ``runtime.stop_agreed()``: ``should_stop()`` (a
pause, a time limit, a preemption or a cancel, told by the worker agent; or SIGTERM)
all-reduced, so that all of them stop at the same step: each commits its part of a checkpoint at
that step (synchronously: committed before the rank exits) and exits 0. A paused job
(``cumulusctl pause`` / ``Job.pause()``) thus resumes exactly where it stopped, and its
final weights are still a fault-free run's. Under plain
``torchrun`` only SIGTERM asks to stop, and nothing is committed.

Restarts in-process: the training runs in ``runtime.run(train_attempt, args)``. When a
rank dies, the job's other ranks keep their processes (and their imports): each leaves
its step, and ``runtime.run`` calls ``train_attempt`` again as the rank's new attempt,
which forms a new process group and resumes from the last committed step as a new
process would; only the dead rank gets a new process. Under ``torchrun`` (no agent)
``runtime.run`` just calls it.

Elastic jobs (``--world-size 2:4``, ``submit(world_size=(2, 4))``): the ranks read their
records through the job's data plan (``runtime.ElasticData``) instead of the sampler:
``--epochs`` passes over the data set, each record once per epoch however often the job
is resized (a batch may span two epochs; once every epoch is done, batches are empty and
only the momentum moves the weights). Every checkpoint's state holds the data position
under ``"cumulus_data"`` with a *carry*: the number of records consumed and the sum,
modulo 2^64, of their id hashes (as ``elastic_records.py``'s), which the rank that takes
over a departed rank's records takes over too. ``rank-<R>.json`` then has
``world_size``, ``record_count``, ``record_sum`` and ``carries_taken`` (the carries its
attempt started with); the last ranks' sums add up to the data set's. A resized run's
weights differ from a fixed-size run's (other ranks, other batches); a fixed-size job
reads its records as before.

Fault injection, for tests: ``--kill-rank R --kill-at-step S`` makes rank R's first
attempt SIGKILL itself after step S, once the last checkpoint before S is committed;
``--kill-again-rank R`` makes rank R SIGKILL itself when its second attempt begins
(before it restores anything: a failure during the recovery); ``--hang-rank R
--hang-at-step S`` makes rank R's first attempt stop making progress after step S (the
job's progress timeout then fails it, and an in-process restart interrupts it).
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cumulus import ckpt, runtime
from cumulus.torch import exact_ddp
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
        help="CSV (.gz), or a dataset split folder (its dot-files such as"
        " .feature-stats.json are not shards), read when the job has no shards:"
        " rank R takes rows R, R+W, ...",
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument(
        "--epochs",
        type=int,
        default=1,
        help="an elastic job's passes over its data set (its ranks read the data plan);"
        " a fixed-size job's sampler runs on for --steps",
    )
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument(
        "--step-sleep-ms",
        type=int,
        default=0,
        help="sleep this long after each step (paces a demo or a test; changes no result)",
    )
    p.add_argument(
        "--stock-ddp",
        action="store_true",
        help="plain DistributedDataParallel, without exact_ddp: with 3 or more ranks a"
        " resumed run ends with other weights than a fault-free run",
    )
    p.add_argument("--kill-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--kill-at-step", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--kill-again-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--hang-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--hang-at-step", type=int, default=None, help=argparse.SUPPRESS)
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


def init_distributed(
    args: argparse.Namespace, ctx: runtime.Context
) -> tuple[torch.device, str]:
    """Deterministic PyTorch, this rank's device and the process group: ``(device,
    backend)``."""
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
    return device, backend


@dataclass
class DataPosition:
    """Where this rank is in its records, carried in every checkpoint's JSON state: the
    sampler's position (epoch, offset; each epoch's order comes from its seed) and the
    digest of the records consumed."""

    sampler: runtime.EpochSampler
    digest: bytes = bytes(32)

    def next_batch(self, ids: list[str], size: int) -> list[int]:
        """The next ``size`` record indices, chained into the digest."""
        batch = self.sampler.take(size)
        h = hashlib.sha256(self.digest)
        for i in batch:
            h.update(f"{self.sampler.epoch}:{ids[i]}\n".encode())
        self.digest = hashlib.sha256(h.digest()).digest()
        return batch

    def state(self) -> dict[str, Any]:
        """The checkpoint's JSON state."""
        return {"sampler": self.sampler.state(), "digest": self.digest.hex()}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Takes back :meth:`state` of a loaded checkpoint."""
        self.sampler.restore(state["sampler"])
        self.digest = bytes.fromhex(state["digest"])


MASK = (1 << 64) - 1


def record_hash(epoch: int, shard: str, index: int) -> int:
    """The id hash of record ``index`` of ``shard`` in ``epoch`` (as elastic_records.py's)."""
    h = hashlib.sha256(f"{epoch}\0{shard}\0{index}".encode())
    return int.from_bytes(h.digest()[:8], "little")


@dataclass
class ElasticFeed:
    """An elastic job's records, as its data plan deals them to this rank (the module
    doc): batches of features and labels, and the position with its record count and
    sum for every checkpoint's state."""

    epochs: int
    features: int
    data: runtime.ElasticData = field(default_factory=runtime.ElasticData)
    count: int = 0
    total: int = 0
    #: The carries this attempt took over when it started: the old ranks' after a
    #: resize, else its own checkpoint's (the count of those that held one).
    carries_taken: int = 0

    @property
    def epoch(self) -> int:
        return self.data.epoch

    def restore(self, point: runtime.ResumePoint | None) -> None:
        """Moves to where this attempt starts and takes over the carries: the plan's
        start after a resize, else the checkpoint's own position."""
        self.data.restore(point.state if point else None, point.step if point else None)
        if point is None:
            return
        carries: list[Any] = list(self.data.carried)
        if not self.data.started_plan:
            carries = [(point.state.get(runtime.DATA_STATE_KEY) or {}).get("carry")]
        for c in carries:
            if isinstance(c, dict):
                self.total = (self.total + int(c["sum"], 16)) & MASK
                self.count += int(c["count"])
                self.carries_taken += 1

    def next_batch(
        self, size: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``size`` records (fewer at the end of the data), counted."""
        rows: list[list[str]] = []
        while len(rows) < size and self.data.epoch < self.epochs:
            reader = self.data.reader()
            row = next(reader, None)
            if row is None:
                self.data.next_epoch()
                continue
            pos = reader.state()
            shard, first = self.data.segments()[int(pos["shard"])]
            index = first + int(pos["record"]) - 1
            self.total = (
                self.total + record_hash(self.data.epoch, shard.name, index)
            ) & MASK
            self.count += 1
            rows.append(row)
        x = torch.tensor(
            [[float(v) for v in r[:-1]] for r in rows], dtype=torch.float32
        ).reshape(len(rows), self.features)
        y = torch.tensor([int(r[-1]) for r in rows], dtype=torch.int64)
        return (x / 16.0).to(device), y.to(device)

    def state(self) -> dict[str, Any]:
        """The checkpoint's JSON state: the data position with the carry."""
        carry = {"sum": f"{self.total:016x}", "count": self.count}
        return {runtime.DATA_STATE_KEY: self.data.state(carry=carry)}


def rank_data(
    args: argparse.Namespace, ctx: runtime.Context, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[str], ElasticFeed | None]:
    """This rank's records (features, labels, ids) for a fixed-size job; for an elastic
    one (it has a data plan) empty ones and the feed that reads the plan."""
    plan = runtime.data_plan()
    if plan is None:
        x, y, ids = load_records(ctx, args.data)
        return x.to(device), y.to(device), ids, None
    reader = runtime.ElasticData(plan=plan)
    feed = ElasticFeed(args.epochs, elastic_features(reader, ctx), reader)
    return torch.empty(0), torch.empty(0), [], feed


def elastic_features(feed_data: runtime.ElasticData, ctx: runtime.Context) -> int:
    """The feature count of the data set: columns of its first record, less the label."""
    segments = [
        p
        for e in (feed_data.plan.epochs if feed_data.plan else {}).values()
        for p, _ in e
    ]
    for shard in [*ctx.shard_paths, *segments]:
        for row in runtime.ShardReader([shard]):
            return len(row) - 1
    sys.exit(f"rank {ctx.rank}: no records in its shards nor its data plan")


class Checkpoints:
    """This rank's checkpoints: the periodic ones asynchronous, one in flight at a time;
    the stop one synchronous (committed before the rank exits)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        # The periodic checkpoint being committed in the background, if any.
        self.pending: ckpt.PendingCheckpoint | None = None

    def _committed(self, p: ckpt.PendingCheckpoint) -> None:
        """Waits for ``p``; raises its error (StaleAttempt: this attempt was replaced)."""
        self._say(p.step, p.wait())

    def _say(self, step: int, part: runtime.CommittedPart | None) -> None:
        if part is None:  # refused: this rank is being stopped (cancelled, replaced)
            print(
                f"rank={self.rank} checkpoint {step} not committed: stopping",
                flush=True,
            )
        else:
            print(
                f"rank={self.rank} checkpoint {step} committed: {part.dir}", flush=True
            )

    def reap(self) -> None:
        """Takes the background checkpoint's result once it is done."""
        if self.pending is not None and self.pending.done():
            self._committed(self.pending)
            self.pending = None

    def drain(self) -> None:
        """Waits for the background checkpoint, if any."""
        if self.pending is not None:
            p, self.pending = self.pending, None
            self._committed(p)

    def save(
        self, step: int, state: dict[str, Any], *, stop: bool, **objects: Any
    ) -> None:
        """Saves ``step``: in the background, or, at a stop, committed before it returns
        (after the periodic one still in flight)."""
        if not stop:
            # One at a time (the next call would wait too).
            self.drain()
            # Blocks while the state is copied; written and committed meanwhile.
            self.pending = ckpt.save_checkpoint_async(step, state, **objects)
            return
        self.drain()
        # Refused (None) when the job was cancelled or this attempt replaced: nothing to
        # keep, and not an error.
        self._say(step, ckpt.save_checkpoint(step, state, **objects))


def wait_committed(
    ctx: runtime.Context, step: int, ckpt_every: int, saver: Checkpoints
) -> None:
    """Fault injection: waits until the last checkpoint before ``step`` is committed by
    every rank."""
    saver.drain()  # this rank's part; then the others'
    if ctx.staging_dir is not None:
        last = step - step % ckpt_every
        deadline = time.monotonic() + 60
        while committed_step(ctx) < last:
            if time.monotonic() > deadline:
                sys.exit(f"timed out waiting for step {last} to be committed")
            time.sleep(0.02)


def kill_self(
    ctx: runtime.Context, step: int, ckpt_every: int, saver: Checkpoints
) -> None:
    """Fault injection: SIGKILLs this rank once the last checkpoint before ``step`` is
    committed by every rank."""
    wait_committed(ctx, step, ckpt_every, saver)
    print(f"rank={ctx.rank} killing itself at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def hang(ctx: runtime.Context, step: int, ckpt_every: int, saver: Checkpoints) -> None:
    """Fault injection: stops making progress (for ever) once the last checkpoint before
    ``step`` is committed; only an in-process restart (or a kill) ends it."""
    wait_committed(ctx, step, ckpt_every, saver)
    print(f"rank={ctx.rank} hanging at step {step}", flush=True)
    while True:
        time.sleep(0.05)


@dataclass
class Training:
    """What the training loop works on."""

    args: argparse.Namespace
    rt: runtime.Runtime
    device: torch.device
    model: nn.Module
    ddp: nn.Module
    opt: torch.optim.Optimizer
    #: A fixed-size job's sampler position (``None`` for an elastic job).
    data: DataPosition | None
    ids: list[str]
    x: torch.Tensor
    y: torch.Tensor
    #: An elastic job's records (instead of ``data``, ``ids``, ``x``, ``y``).
    elastic: ElasticFeed | None = None
    #: ``(step, time.monotonic())`` once the step halfway to ``--steps`` ended: the
    #: second half's steps/s leaves out start-up work (a warm spare's imports).
    half: tuple[int, float] | None = None

    @property
    def position(self) -> DataPosition | ElasticFeed:
        """Where this rank is in its records (either kind)."""
        out = self.data if self.elastic is None else self.elastic
        assert out is not None
        return out


def train(t: Training, start: int) -> tuple[int, float, bool]:
    """Steps ``start + 1`` to ``--steps``, checkpointing: ``(last step, its loss,
    stopped)``, ``stopped`` when every rank was asked to stop (its checkpoint taken)."""
    args, rt, ctx = t.args, t.rt, t.rt.context
    loss_fn = nn.CrossEntropyLoss()
    saver = Checkpoints(ctx.rank)
    step, value = start, float("nan")
    for step in range(start + 1, args.steps + 1):
        if t.elastic is None:
            assert t.data is not None
            batch = t.data.next_batch(t.ids, args.batch_size)
            idx = torch.tensor(batch, device=t.device)
            loss = loss_fn(t.ddp(t.x[idx]), t.y[idx])
        else:
            xb, yb = t.elastic.next_batch(args.batch_size, t.device)
            # An empty batch (this rank's records are done) still joins the all-reduce.
            loss = loss_fn(t.ddp(xb), yb) if len(yb) else t.ddp(xb).sum() * 0.0
        t.opt.zero_grad(set_to_none=True)
        loss.backward()
        t.opt.step()
        value = loss.item()
        rt.report(step, args.steps, loss=value)
        if t.half is None and step >= (start + args.steps) // 2:
            t.half = (step, time.monotonic())
        if args.step_sleep_ms > 0:
            time.sleep(args.step_sleep_ms / 1000)
        if step % args.log_every == 0 and ctx.rank == 0:
            if t.elastic is not None:
                epoch = t.elastic.epoch
            else:
                assert t.data is not None
                epoch = t.data.sampler.epoch
            print(
                f"step {step}/{args.steps} epoch {epoch} loss {value:.4f}",
                flush=True,
            )
        saver.reap()
        # Every rank stops at the same step: the step's checkpoint needs all their parts.
        stop = rt.stop_agreed()
        if (step % args.ckpt_every == 0 or stop) and rt.checkpoints_enabled:
            saver.save(
                step,
                t.position.state(),
                stop=stop,
                model=t.model,
                optimizer=t.opt,
                rng=ckpt.RNG(),
            )
        if (
            ctx.rank == args.kill_rank
            and step == args.kill_at_step
            and ctx.attempt == 0
        ):
            kill_self(ctx, step, args.ckpt_every, saver)
        if (
            ctx.rank == args.hang_rank
            and step == args.hang_at_step
            and ctx.attempt == 0
        ):
            hang(ctx, step, args.ckpt_every, saver)
        if stop:
            asked = rt.stop_request() or "another rank was asked"
            print(f"rank={ctx.rank} asked to stop at step {step} ({asked})", flush=True)
            return step, value, True
    saver.drain()  # the last checkpoint is committed before the rank ends
    return step, value, False


def save_weights(t: Training) -> str:
    """Rank 0 writes ``<out>/model.safetensors``; every rank gets the SHA-256 of its
    final weights."""
    out = t.args.out
    out.mkdir(parents=True, exist_ok=True)
    weights = {
        k: v.detach().cpu().contiguous() for k, v in t.model.state_dict().items()
    }
    blob = st_save(weights)
    if t.rt.context.rank == 0:
        tmp = out / "model.safetensors.tmp"
        tmp.write_bytes(blob)
        tmp.replace(out / "model.safetensors")
    return hashlib.sha256(blob).hexdigest()


def main() -> int:
    args = parse_args()
    runtime.install_stop_handler()  # SIGTERM asks to stop (should_stop, stop_agreed)
    # One call per attempt: a restart of the job's ranks calls it again in this process.
    return int(runtime.run(train_attempt, args))


def train_attempt(args: argparse.Namespace) -> int:
    """One attempt of this rank: process group, data, model, resume, training, results."""
    rt = runtime.get_runtime()  # this attempt's runtime (a new one after each restart)
    ctx = rt.context
    if ctx.rank == args.kill_again_rank and ctx.attempt == 1:
        print(f"rank={ctx.rank} killing itself as attempt 1 begins", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    device, backend = init_distributed(args, ctx)
    x, y, ids, elastic = rank_data(args, ctx, device)
    features = x.shape[1] if elastic is None else elastic.features

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = nn.Sequential(
        nn.Linear(features, args.hidden),
        nn.ReLU(),
        nn.Dropout(args.dropout),
        nn.Linear(args.hidden, 10),
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    torch.manual_seed(args.seed * 1000 + 1 + ctx.rank)  # this rank's dropout masks
    # This rank's data order: each epoch shuffled from (seed, epoch).
    data = (
        DataPosition(
            runtime.EpochSampler(len(ids), seed=args.seed * 1000 + 500 + ctx.rank)
        )
        if elastic is None
        else None
    )

    start = 0
    point = ckpt.load_checkpoint(model=model, optimizer=opt, rng=ckpt.RNG())
    if point is not None:
        start = point.step
    if data is not None and point is not None:
        data.restore(point.state)
    if elastic is not None:
        elastic.restore(point)
    records = (
        len(ids)
        if elastic is None
        else f"{elastic.count} so far, epoch {elastic.epoch}"
    )
    print(
        f"rank={ctx.rank} attempt={ctx.attempt} world={ctx.world_size} backend={backend} "
        f"records={records} start={start} pid={os.getpid()}",
        flush=True,
    )
    wrap = nn.parallel.DistributedDataParallel if args.stock_ddp else exact_ddp
    ddp = wrap(model, device_ids=[device.index] if device.type == "cuda" else None)
    t = Training(args, rt, device, model, ddp, opt, data, ids, x, y, elastic)
    t0 = time.monotonic()
    step, value, stopped = train(t, start)
    if stopped:
        rt.close()
        dist.destroy_process_group()
        return 0
    end = time.monotonic()
    elapsed = end - t0
    result: dict[str, Any] = {
        "rank": ctx.rank,
        "attempt": ctx.attempt,
        "pid": os.getpid(),
        "resumed_from": start if point is not None else None,
        # "memory": restored from the host copy of this process's asynchronous checkpoint
        # (a survivor of an in-process restart); "disk": from the committed part's files.
        "restore_source": point.source if point is not None else None,
        "steps": step,
    }
    if data is not None:
        result |= {
            "epoch": data.sampler.epoch,
            "records": data.sampler.taken,
            "record_digest": data.digest.hex(),
        }
    if elastic is not None:
        result |= {
            "epoch": elastic.epoch,
            "world_size": ctx.world_size,
            "record_count": elastic.count,
            "record_sum": f"{elastic.total:016x}",
            "carries_taken": elastic.carries_taken,
        }
    result |= {
        "weights_sha256": save_weights(t),
        "final_loss": value if step > start else None,
        "steps_per_s": (step - start) / elapsed if elapsed > 0 else None,
        "steps_per_s_second_half": (
            (step - t.half[0]) / (end - t.half[1])
            if t.half is not None and step > t.half[0] and end > t.half[1]
            else None
        ),
    }
    (args.out / f"rank-{ctx.rank}.json").write_text(json.dumps(result, indent=1))
    print(f"rank={ctx.rank} done: {json.dumps(result)}", flush=True)
    rt.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
