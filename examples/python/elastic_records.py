#!/usr/bin/env python3
"""Consumes a data set's records through an elastic job's data plan, exactly once per
epoch, and proves it: the smallest trainer of an elastic world size.

    cumulusctl submit --world-size 2:4 --dataset /tmp/digits --ckpt-dir /tmp/ckpt -- \\
        python examples/python/elastic_records.py train --out /tmp/out --epochs 2 \\
        --total-steps 1900

Every step takes ``--batch`` records from :class:`cumulus.runtime.ElasticData` (each
epoch's records as the leader dealt them to this rank; a rank whose share of an epoch is
used up goes on to the next, and once every epoch is done it takes empty steps). Every
``--ckpt-every`` steps it commits a checkpoint whose state is the data position with a
*carry*: the number of records consumed and the sum, modulo 2^64, of each record's id
hash (SHA-256 of ``epoch \\0 shard name \\0 record index``, its first 8 bytes). The sum
does not depend on the order or on which rank consumed a record; after a resize the rank
that takes over a departed rank's records takes over its carry too. Every rank runs
``--total-steps`` steps (the same on all, so every step's checkpoint has all parts; pick
it large enough for the smallest world size) and writes ``<out>/rank-<R>.json``:
``{"rank", "world_size", "count", "sum"}``. The sums of the last ranks add up to what
``digest`` prints for the data set when every record was consumed exactly once, however
often the job was resized or restarted.

    python examples/python/elastic_records.py digest --shards-dir /tmp/digits --epochs 2

Asked to stop (a pause, a preemption, a grow of the job: ``runtime.should_stop()``), a
rank goes on to its next ``--ckpt-every`` step, commits it and exits 0 without writing
results, so every rank stops at the same step and the job resumes from it with no step
redone.

While the file ``--slow-file`` exists, each step sleeps ``--step-sleep-ms`` (tests keep
the job running through resizes that way).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MASK = (1 << 64) - 1


def record_hash(epoch: int, shard: str, index: int) -> int:
    """The id hash of record ``index`` of ``shard`` in ``epoch``."""
    h = hashlib.sha256(f"{epoch}\0{shard}\0{index}".encode())
    return int.from_bytes(h.digest()[:8], "little")


def digest(args: argparse.Namespace) -> None:
    from cumulus import runtime

    shards = runtime.list_shards(args.shards_dir)
    total, count = 0, 0
    for epoch in range(args.epochs):
        for shard in shards:
            for index, _ in enumerate(runtime.ShardReader([shard])):
                total = (total + record_hash(epoch, shard.name, index)) & MASK
                count += 1
    print(json.dumps({"count": count, "sum": f"{total:016x}"}))


def train(args: argparse.Namespace) -> None:
    from cumulus import runtime

    ctx = runtime.get_context()
    data = runtime.ElasticData()
    point = runtime.resume()
    data.restore(point.state if point else None, point.step if point else None)
    step, total, count = 0, 0, 0
    if point is not None:
        step = point.step
        carries: list[Any] = list(data.carried) if data.started_plan else []
        if not data.started_plan:
            carries = [point.state.get(runtime.DATA_STATE_KEY, {}).get("carry")]
        for c in carries:
            if isinstance(c, dict):
                total = (total + int(c["sum"], 16)) & MASK
                count += int(c["count"])
    plan = data.plan
    print(
        f"rank {ctx.rank} of {ctx.world_size} attempt {ctx.attempt}: from step {step}, "
        f"epoch {data.epoch}, {count} records so far"
        + (
            f" (resized from {plan.previous_world_size} ranks)"
            if plan is not None and data.started_plan
            else ""
        ),
        file=sys.stderr,
        flush=True,
    )
    slow = Path(args.slow_file) if args.slow_file else None
    asked = False
    while step < args.total_steps:
        taken = 0
        while taken < args.batch and data.epoch < args.epochs:
            reader = data.reader()
            if next(reader, None) is None:
                data.next_epoch()
                continue
            pos = reader.state()
            shard, first = data.segments()[int(pos["shard"])]
            index = first + int(pos["record"]) - 1
            total = (total + record_hash(data.epoch, shard.name, index)) & MASK
            count += 1
            taken += 1
        step += 1
        if slow is not None and args.step_sleep_ms > 0 and slow.exists():
            time.sleep(args.step_sleep_ms / 1000)
        runtime.report(step, args.total_steps, records=float(count))
        asked = asked or runtime.should_stop()
        if step % args.ckpt_every == 0 or step == args.total_steps:
            carry = {"sum": f"{total:016x}", "count": count}
            state = {runtime.DATA_STATE_KEY: data.state(carry=carry)}
            with runtime.checkpoint(step, state):
                pass
            if asked and step < args.total_steps:
                print(
                    f"rank {ctx.rank} asked to {runtime.stop_request()}: stopped at "
                    f"checkpoint step {step}",
                    file=sys.stderr,
                    flush=True,
                )
                return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "count": count,
    }
    result["sum"] = f"{total:016x}"
    tmp = out / f".rank-{ctx.rank}.json.{os.getpid()}"
    tmp.write_text(json.dumps(result))
    tmp.replace(out / f"rank-{ctx.rank}.json")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--out", required=True)
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--total-steps", type=int, required=True)
    t.add_argument("--batch", type=int, default=1)
    t.add_argument("--ckpt-every", type=int, default=20)
    t.add_argument("--slow-file", default="")
    t.add_argument("--step-sleep-ms", type=int, default=0)
    d = sub.add_parser("digest")
    d.add_argument("--shards-dir", required=True)
    d.add_argument("--epochs", type=int, default=1)
    args = p.parse_args()
    if args.cmd == "train":
        train(args)
    else:
        digest(args)


if __name__ == "__main__":
    main()
