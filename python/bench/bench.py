"""Benchmarks of the Python side of Cumulus (issue 23, item 6), on this machine.

    python/.venv/bin/python python/bench/bench.py --out DIR [--smoke]

1. ``ddp_steps_per_s_ratio``: steps/s of ``examples/python/ddp_digits.py`` (gloo, world
   size 2, CPU) under a local Cumulus cluster vs under ``torchrun --standalone``, in
   alternated runs; checkpoints off in both (the script only checkpoints under Cumulus).
   Target >= 0.99.
2. ``kill_to_first_step_ratio``: rank 0 SIGKILLs itself mid-run; the time from that
   SIGKILL to the first training step logged by the restarted rank 0, under Cumulus (group
   restart, backoff set low, resume from the committed checkpoint) vs under
   ``torchrun --max-restarts 3`` (which restarts the script; without a Cumulus
   checkpoint it starts again from step 0). Target <= 1.0.
3. ``report_us_per_call``: :func:`cumulus.runtime.Runtime.report` on the caller's thread,
   against a fake agent. Target < 20 us.
4. ``ckpt_blocked_ratio``: time the training loop is blocked by a 1 GiB PyTorch
   checkpoint through :func:`cumulus.ckpt.save_checkpoint_async` (the copy to host
   memory; the write and the commit go on in the background) vs ``torch.save`` + fsync
   of the same state in the same rank. Target <= 1.0. Also reported: the synchronous
   :func:`cumulus.ckpt.save_checkpoint` (committed when it returns) vs the same
   (``ckpt_blocked_sync_ratio``), and the asynchronous call's time until committed.
5. ``run`` (issue 41, in ``run_bench.py``): ``Client.run(lambda: 1)`` submit -> result
   p50/p99 with the environment cached (target p50 <= 1 s); the same with a cold small
   environment beside uv's own time for it (target <= 1.1 x uv + 1 s); a 100 MiB
   uploaded working directory: first submit -> first step over a plain submit (target
   <= 3 s), a second submit of it uploads 0 bytes and adds <= 0.2 s.

Prints a table and writes ``DIR/python-bench-<unix time>.json`` (a list of rows: name,
value, unit, target, met, details, machine). ``--smoke`` shrinks everything (seconds, tiny
state) and judges nothing: it checks that the benchmark runs. The exit status is 1 when a
measurement failed to run, 0 otherwise (targets missed included).

Everything runs on loopback, in a temp dir of its own, with a deadline on every wait;
every process started is killed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
EXAMPLE = REPO / "examples" / "python" / "ddp_digits.py"
STAMPED = HERE / "stamped.py"
CKPT_RANK = HERE / "ckpt_rank.py"
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _bin_dir() -> Path:
    """``$CUMULUS_BIN_DIR``, else ``target/release`` when built, else ``target/debug``."""
    env = os.environ.get("CUMULUS_BIN_DIR")
    if env:
        return Path(env)
    release = REPO / "target" / "release"
    if all(os.access(release / n, os.X_OK) for n in ("cumulusctl", "cumulus-worker")):
        return release
    return REPO / "target" / "debug"


# The test helpers (a real local cluster; a fake rank-local agent) are reused as they are.
os.environ["CUMULUS_BIN_DIR"] = str(_bin_dir())
sys.path.insert(0, str(REPO / "python" / "tests"))

import cumulus  # noqa: E402
import run_bench  # noqa: E402  (beside this file)
from cumulus import runtime  # noqa: E402
from cumulus.errors import WaitTimeout  # noqa: E402
from fake_agent import FakeAgent  # noqa: E402
from localcluster import LocalCluster, binaries_missing  # noqa: E402


@dataclass(frozen=True)
class Config:
    smoke: bool
    #: Item 1: alternated (Cumulus, torchrun) pairs, steps per run.
    ddp_pairs: int
    ddp_steps: int
    #: Item 2: alternated pairs; steps, checkpoint cadence and kill step of each run.
    kill_pairs: int
    kill_steps: int
    kill_ckpt_every: int
    kill_at: int
    #: Item 3: report() calls timed in one loop, and calls timed one by one.
    report_calls: int
    report_samples: int
    #: Item 4: state size (MiB) and repetitions of each way.
    ckpt_mib: int
    ckpt_reps: int
    #: Item 5: timed Client.run calls (each kind), cold-environment pairs, working
    #: directory size (MiB) and its alternated pairs.
    run_calls: int
    run_cold_pairs: int
    workdir_mib: int
    workdir_pairs: int
    #: Deadline of one run (a job or a torchrun), seconds.
    run_timeout_s: float


FULL = Config(
    smoke=False,
    ddp_pairs=3,
    ddp_steps=4000,
    kill_pairs=3,
    kill_steps=400,
    kill_ckpt_every=50,
    kill_at=260,
    report_calls=200_000,
    report_samples=50_000,
    ckpt_mib=1024,
    ckpt_reps=3,
    run_calls=20,
    run_cold_pairs=5,
    workdir_mib=100,
    workdir_pairs=3,
    run_timeout_s=600,
)
SMOKE = Config(
    smoke=True,
    ddp_pairs=1,
    ddp_steps=40,
    kill_pairs=1,
    kill_steps=30,
    kill_ckpt_every=10,
    kill_at=15,
    report_calls=20_000,
    report_samples=5_000,
    ckpt_mib=8,
    ckpt_reps=1,
    run_calls=2,
    run_cold_pairs=1,
    workdir_mib=4,
    workdir_pairs=1,
    run_timeout_s=120,
)

#: Cumulus restart delay of item 2 (initial and max backoff), milliseconds.
RESTART_BACKOFF_MS = 10


@dataclass
class Row:
    name: str
    what: str
    value: float | None
    unit: str
    #: e.g. ">= 0.99"; ``None``: informational.
    target: str | None = None
    met: bool | None = None
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def judge(self, smoke: bool) -> Row:
        if self.target is None or self.value is None or smoke:
            self.met = None
            return self
        op, bound = self.target.split()
        limit = float(bound)
        self.met = {
            ">=": self.value >= limit,
            "<=": self.value <= limit,
            "<": self.value < limit,
            ">": self.value > limit,
        }[op]
        return self


class BenchError(Exception):
    pass


# -- processes -----------------------------------------------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    """This environment without any rank or Cumulus variables, one thread per process."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in drop and not k.startswith(("CUMULUS_", "TORCHELASTIC_"))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_group(cmd: Sequence[str], *, timeout_s: float, log: Path, env: dict[str, str]) -> None:
    """Runs ``cmd`` in a session of its own (output to ``log``); kills the whole process
    group on timeout or on any exception, and raises unless it exits with 0."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            raise BenchError(
                f"{cmd[0]} did not finish within {timeout_s:.0f} s:\n{tail(log)}"
            ) from None
        except BaseException:
            kill_group(proc)
            raise
        finally:
            # Whatever it left behind in its group (torchrun's workers) goes too.
            kill_group(proc)
    if rc != 0:
        raise BenchError(f"{cmd[0]} exited with {rc}:\n{tail(log)}")


#: How long a group gets between SIGTERM and SIGKILL, in seconds: more than the 30 s
#: torchrun itself gives its workers (which may ignore SIGTERM: the example script turns
#: it into a stop request) before it SIGKILLs them.
STOP_GRACE_S = 40.0


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Ends ``proc``'s process group: SIGTERM first, SIGKILL after :data:`STOP_GRACE_S`.
    torchrun starts each worker in a session of its own, out of reach of the group's
    signals; only torchrun, stopped by SIGTERM, ends them (a SIGKILLed torchrun leaves
    them running, a hung gloo group among them)."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"({path}: {e})"
    return "\n".join(lines[-n:])


def run_job(
    client: cumulus.Client,
    cmd: Sequence[str],
    *,
    timeout_s: float,
    poll_interval_s: float = 0.2,
    **spec: Any,
) -> cumulus.JobInfo:
    """Submits a job and waits for it to succeed (cancelled on timeout), asking the
    cluster every ``poll_interval_s`` seconds."""
    job = client.submit(list(cmd), **spec)
    try:
        info = job.wait(timeout_s=timeout_s, poll_interval_s=poll_interval_s)
    except BaseException as e:
        with suppress(cumulus.CumulusError):
            job.cancel()
        if isinstance(e, WaitTimeout):
            raise BenchError(f"{job.id} did not finish in {timeout_s} s:\n{job_logs(job)}") from e
        raise
    if not info.succeeded:
        raise BenchError(f"{job.id} {info.state}: {info.failure_cause}\n{job_logs(job)}")
    return info


def job_logs(job: cumulus.Job, n: int = 40) -> str:
    try:
        lines = [f"[r{x.rank} a{x.attempt}] {x.line}" for x in job.logs(follow=False)]
    except cumulus.CumulusError as e:
        return f"(logs unavailable: {e})"
    return "\n".join(lines[-n:])


def rank_results(out: Path, world_size: int = 2) -> list[dict[str, Any]]:
    results = []
    for r in range(world_size):
        path = out / f"rank-{r}.json"
        if not path.exists():
            raise BenchError(f"{path} was not written")
        results.append(json.loads(path.read_text()))
    return results


def ddp_command(out: Path, *, steps: int, ckpt_every: int, log_every: int) -> list[str]:
    return [
        str(EXAMPLE),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--ckpt-every",
        str(ckpt_every),
        "--log-every",
        str(log_every),
        "--backend",
        "gloo",
    ]


# -- 1. DDP steps/s ------------------------------------------------------------------------


def bench_ddp(cfg: Config, client: cumulus.Client, tmp: Path) -> list[Row]:
    """Steps/s (mean over the ranks, measured by the script over its training loop)."""
    off = 1 << 62  # checkpoints off in both: torchrun has no Cumulus checkpoint dir
    runs: dict[str, list[float]] = {"cumulus": [], "torchrun": []}

    def under_cumulus(i: int) -> float:
        out = tmp / f"ddp-cumulus-{i}"
        run_job(
            client,
            [PYTHON, *ddp_command(out, steps=cfg.ddp_steps, ckpt_every=off, log_every=off)],
            timeout_s=cfg.run_timeout_s,
            # The script times its own loop, so when the end is seen does not matter; a
            # Python client asking 5 times a second took ~7% of the ranks' 2 cores (the
            # torchrun side waits on its process, for nothing).
            poll_interval_s=2.0,
            world_size=2,
            env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
            max_restarts=0,
            name=f"bench-ddp-{i}",
        )
        return statistics.fmean(r["steps_per_s"] for r in rank_results(out))

    def under_torchrun(i: int) -> float:
        out = tmp / f"ddp-torchrun-{i}"
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2"]
        cmd += ddp_command(out, steps=cfg.ddp_steps, ckpt_every=off, log_every=off)
        run_group(
            cmd, timeout_s=cfg.run_timeout_s, log=tmp / f"ddp-torchrun-{i}.log", env=child_env()
        )
        return statistics.fmean(r["steps_per_s"] for r in rank_results(out))

    for i in range(cfg.ddp_pairs):
        order = ("cumulus", "torchrun") if i % 2 == 0 else ("torchrun", "cumulus")
        for who in order:
            v = under_cumulus(i) if who == "cumulus" else under_torchrun(i)
            runs[who].append(v)
            log(f"  ddp pair {i}: {who} {v:.1f} steps/s")

    c, t = statistics.median(runs["cumulus"]), statistics.median(runs["torchrun"])
    details = {
        "runs_steps_per_s": runs,
        "pairs": cfg.ddp_pairs,
        "steps_per_run": cfg.ddp_steps,
        "world_size": 2,
        "backend": "gloo (CPU)",
        "checkpoints": "off in both (the script checkpoints only under Cumulus)",
        "statistic": "median of runs; a run's value is the mean of its ranks' steps/s",
    }
    return [
        Row("ddp_steps_per_s_cumulus", "DDP steps/s under Cumulus", c, "steps/s", details=details),
        Row("ddp_steps_per_s_torchrun", "DDP steps/s under torchrun", t, "steps/s"),
        Row(
            "ddp_steps_per_s_ratio",
            "DDP steps/s, Cumulus / torchrun",
            c / t,
            "x",
            target=">= 0.99",
            details=details,
        ),
    ]


# -- 2. kill -9 -> first step after the restart ----------------------------------------------

STEP_LINE = re.compile(r"^step (\d+)/")
START_LINE = re.compile(r"start=(\d+)")


def stamped_lines(stamps: Path, rank: int, attempt: int) -> list[tuple[float, str]]:
    lines: list[tuple[float, str]] = []
    for path in sorted(stamps.glob(f"rank-{rank}.attempt-{attempt}.pid-*.log")):
        for raw in path.read_text(errors="replace").splitlines():
            t, _, line = raw.partition(" ")
            lines.append((float(t), line))
    lines.sort(key=lambda x: x[0])
    return lines


def kill_to_first_step(stamps: Path) -> dict[str, Any]:
    """From rank 0's stamped output: when attempt 0 SIGKILLed itself, and when a later
    attempt logged its first training step (which attempt, which step, where it started).
    A restarted attempt that fails before its first step (it happens to torchrun's) does
    not count: the clock runs until a step is done."""
    killed = [t for t, line in stamped_lines(stamps, 0, 0) if "killing itself" in line]
    if not killed:
        raise BenchError(f"rank 0 attempt 0 never killed itself (stamps in {stamps})")
    for attempt in range(1, 10):
        after = stamped_lines(stamps, 0, attempt)
        starts = [(t, int(m.group(1))) for t, line in after if (m := START_LINE.search(line))]
        for t, line in after:
            m = STEP_LINE.match(line)
            if m:
                return {
                    "seconds": t - killed[0],
                    "first_step": int(m.group(1)),
                    "resumed_from": starts[0][1] if starts else None,
                    # kill -> the script's "start=" line (after imports, process group,
                    # data and checkpoint load): the rest is DDP setup and the step itself.
                    "to_start_line_s": starts[0][0] - killed[0] if starts else None,
                    "attempt": attempt,
                }
    raise BenchError(f"no restarted rank 0 logged a training step (stamps in {stamps})")


def bench_kill(cfg: Config, client: cumulus.Client, tmp: Path) -> list[Row]:
    runs: dict[str, list[dict[str, Any]]] = {"cumulus": [], "torchrun": []}
    kill = ["--kill-rank", "0", "--kill-at-step", str(cfg.kill_at)]

    def script(out: Path) -> list[str]:
        cmd = ddp_command(out, steps=cfg.kill_steps, ckpt_every=cfg.kill_ckpt_every, log_every=1)
        return [str(STAMPED), *cmd, *kill]

    def under_cumulus(i: int) -> dict[str, Any]:
        stamps = tmp / f"kill-cumulus-{i}.stamps"
        stamps.mkdir()
        info = run_job(
            client,
            [PYTHON, *script(tmp / f"kill-cumulus-{i}")],
            timeout_s=cfg.run_timeout_s,
            world_size=2,
            ckpt_dir=tmp / f"kill-cumulus-{i}.ckpt",
            env={
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                "CUMULUS_BENCH_STAMPS": str(stamps),
            },
            max_restarts=3,
            restart_scope="group",
            backoff_initial_ms=RESTART_BACKOFF_MS,
            backoff_max_ms=RESTART_BACKOFF_MS,
            name=f"bench-kill-{i}",
        )
        r = kill_to_first_step(stamps)
        r["restarts_used"] = info.restarts_used
        r["restart_delay_ms"] = [x.delay_ms for x in info.restarts]
        r["resume_step"] = [x.resume_step for x in info.restarts]
        return r

    torchrun_failures: list[str] = []

    def under_torchrun(i: int) -> dict[str, Any]:
        # torchrun sometimes fails every restart (gloo "connectFullMesh ... Connection
        # refused" on a loaded machine); such a run is recorded and the run repeated.
        for k in range(3):
            stamps = tmp / f"kill-torchrun-{i}.{k}.stamps"
            stamps.mkdir()
            cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "3"]
            cmd += script(tmp / f"kill-torchrun-{i}.{k}")
            try:
                run_group(
                    cmd,
                    timeout_s=cfg.run_timeout_s,
                    log=tmp / f"kill-torchrun-{i}.{k}.log",
                    env=child_env(CUMULUS_BENCH_STAMPS=str(stamps)),
                )
            except BenchError as e:
                torchrun_failures.append(str(e)[-600:])
                log(f"  kill pair {i}: torchrun run failed, repeating it:\n{str(e)[-600:]}")
                continue
            return kill_to_first_step(stamps)
        raise BenchError(f"torchrun failed 3 runs in a row: {torchrun_failures[-1]}")

    for i in range(cfg.kill_pairs):
        order = ("cumulus", "torchrun") if i % 2 == 0 else ("torchrun", "cumulus")
        for who in order:
            r = under_cumulus(i) if who == "cumulus" else under_torchrun(i)
            runs[who].append(r)
            log(
                f"  kill pair {i}: {who} {r['seconds']:.2f} s to step {r['first_step']} "
                f"(attempt {r['attempt']}, resumed from {r['resumed_from']})"
            )

    c = statistics.median(r["seconds"] for r in runs["cumulus"])
    t = statistics.median(r["seconds"] for r in runs["torchrun"])
    c_from = sorted({r["resumed_from"] for r in runs["cumulus"]})
    t_from = sorted({r["resumed_from"] for r in runs["torchrun"]})
    details = {
        "runs": runs,
        "pairs": cfg.kill_pairs,
        "steps": cfg.kill_steps,
        "ckpt_every": cfg.kill_ckpt_every,
        "killed_at_step": cfg.kill_at,
        "cumulus": (
            f"group restart, backoff {RESTART_BACKOFF_MS} ms; resumes exactly from the "
            f"committed checkpoint (step {c_from})"
        ),
        "torchrun": (
            "--max-restarts 3, default --monitor-interval; restarts the script, which has "
            f"no Cumulus checkpoint to resume from: starts again at step {t_from} "
            f"({cfg.kill_at} steps of work lost)"
        ),
        "torchrun_failed_runs": torchrun_failures,
        "measured": (
            "SIGKILL (stamped by the dying rank) -> first step line of a restarted rank 0; "
            "a restarted attempt that fails before its first step counts in the time"
        ),
    }
    return [
        Row("kill_to_first_step_cumulus_s", "kill -9 -> first step, Cumulus", c, "s"),
        Row("kill_to_first_step_torchrun_s", "kill -9 -> first step, torchrun", t, "s"),
        Row(
            "kill_to_first_step_ratio",
            "kill -9 -> first step, Cumulus / torchrun",
            c / t,
            "x",
            target="<= 1.0",
            details=details,
        ),
    ]


# -- 3. report() -----------------------------------------------------------------------------


def bench_report(cfg: Config) -> list[Row]:
    with FakeAgent() as agent:
        ctx = runtime.Context(
            rank=0,
            world_size=1,
            local_rank=0,
            local_world_size=1,
            master_addr="127.0.0.1",
            master_port=29500,
            job_id="job-bench",
            attempt=0,
            shard_paths=(),
            staging_dir=None,
            resume_step=None,
            resume_dir=None,
            agent_url=agent.url,
            agent_token="bench",
            standalone=False,
        )
        rt = runtime.Runtime(ctx)
        try:
            for i in range(1000):  # warm-up (the sender thread starts)
                rt.report(i, 10**9, loss=0.5, lr=0.1)
            n = cfg.report_calls
            t0 = time.perf_counter_ns()
            for i in range(n):
                rt.report(i, n, loss=0.5, lr=0.1)
            mean_us = (time.perf_counter_ns() - t0) / n / 1000
            samples = []
            for i in range(cfg.report_samples):
                a = time.perf_counter_ns()
                rt.report(i, n, loss=0.5, lr=0.1)
                samples.append(time.perf_counter_ns() - a)
            samples.sort()
            rt.flush(5)
        finally:
            rt.close(5)
        sent = len(agent.of("/v1/progress"))
    q = statistics.quantiles(samples, n=100)
    details = {
        "calls": n,
        "metrics_per_call": 2,
        "p50_us": q[49] / 1000,
        "p99_us": q[98] / 1000,
        "max_us": samples[-1] / 1000,
        "reports_sent_to_agent": sent,
        "agent": "fake rank-local agent on loopback (python/tests/fake_agent.py)",
    }
    return [
        Row(
            "report_us_per_call",
            "runtime.report() on the caller's thread",
            mean_us,
            "us",
            target="< 20",
            details=details,
        )
    ]


# -- 4. checkpoint blocking time -------------------------------------------------------------


def bench_ckpt(cfg: Config, client: cumulus.Client, tmp: Path) -> list[Row]:
    result = tmp / "ckpt-result.json"
    run_job(
        client,
        [
            PYTHON,
            str(CKPT_RANK),
            "--mib",
            str(cfg.ckpt_mib),
            "--reps",
            str(cfg.ckpt_reps),
            "--plain-dir",
            str(tmp / "ckpt-plain"),
            "--result",
            str(result),
        ],
        timeout_s=cfg.run_timeout_s,
        world_size=1,
        ckpt_dir=tmp / "ckpt-cumulus",
        ckpt_keep=1,
        env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        max_restarts=0,
        name="bench-ckpt",
    )
    r = json.loads(result.read_text())
    c, p = statistics.median(r["cumulus_s"]), statistics.median(r["plain_s"])
    a = statistics.median(r["cumulus_async_s"])
    a_committed = statistics.median(r["cumulus_async_committed_s"])
    details = {
        "state_bytes": r["bytes"],
        "reps": cfg.ckpt_reps,
        "cumulus_async_s": r["cumulus_async_s"],
        "cumulus_async_committed_s": r["cumulus_async_committed_s"],
        "cumulus_s": r["cumulus_s"],
        "plain_s": r["plain_s"],
        "cumulus_async": (
            "ckpt.save_checkpoint_async(model=...): blocked while the state is copied to "
            "host memory; the first call also allocates the host buffers, later ones reuse "
            "them; then safetensors + agent commit (fsync) in the background while the "
            "loop takes a step; committed_s: call -> wait() returned"
        ),
        "cumulus": "ckpt.save_checkpoint(model=...): safetensors + agent commit (fsync)",
        "plain": "torch.save(state_dict) + fsync(file) + fsync(dir)",
        "order": "rotated per repetition (cumulus, plain, cumulus_async); median of each",
    }
    mib = f"{cfg.ckpt_mib} MiB"
    return [
        Row("ckpt_blocked_async_s", f"{mib} checkpoint blocks, Cumulus async", a, "s"),
        Row(
            "ckpt_async_committed_s",
            f"{mib} checkpoint, Cumulus async call -> committed",
            a_committed,
            "s",
        ),
        Row(
            "ckpt_async_first_blocked_s",
            f"{mib} checkpoint blocks, Cumulus async, first call (allocates)",
            r["cumulus_async_s"][0],
            "s",
        ),
        Row("ckpt_blocked_cumulus_s", f"{mib} checkpoint blocks, Cumulus", c, "s"),
        Row("ckpt_blocked_plain_s", f"{mib} checkpoint blocks, torch.save+fsync", p, "s"),
        Row(
            "ckpt_blocked_sync_ratio",
            f"{mib} checkpoint blocked time, Cumulus sync / plain",
            c / p,
            "x",
            details=details,
        ),
        Row(
            "ckpt_blocked_ratio",
            f"{mib} checkpoint blocked time, Cumulus async / plain",
            a / p,
            "x",
            target="<= 1.0",
            details=details,
        ),
    ]


# -- driver ----------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine_info() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        import torch

        torch_version = str(torch.__version__)
    except ImportError:
        torch_version = None
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "mem_gib": mem_gib,
        "python": platform.python_version(),
        "torch": torch_version,
        "cumulus_bin_dir": os.environ["CUMULUS_BIN_DIR"],
        "commit": commit or None,
        "load_avg_start": list(os.getloadavg()),
    }


def fmt(v: float | None) -> str:
    if v is None:
        return "error"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def print_table(rows: list[Row], smoke: bool) -> None:
    head = ("what", "result", "target", "met")
    body = [
        (
            r.what,
            f"{fmt(r.value)} {r.unit}" if r.value is not None else f"error: {r.error}"[:60],
            r.target or "-",
            "-" if r.met is None else ("yes" if r.met else "NO"),
        )
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(4)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*head))
    print(line.format(*("-" * w for w in widths)))
    for b in body:
        print(line.format(*b))
    if smoke:
        print("(smoke run: sizes shrunk, targets not judged)")


#: uv, which the worker builds jobs' environments with (item 5): the project's
#: virtualenv's (``scripts/setup.sh`` installs it there).
UV = str(Path(sys.executable).with_name("uv"))
#: The local cluster's directory under the temp dir (its processes' logs are there).
CLUSTER_DIR = "cluster"


def bench_run(cfg: Config, client: cumulus.Client, tmp: Path) -> list[Row]:
    """Item 5 (``run_bench.py``): Client.run latency, cold environments, workdirs; the
    agent's log (for the phase split) is in the cluster's directory."""
    rows: list[Row] = []
    logs = tmp / CLUSTER_DIR
    parts: list[tuple[str, str, Callable[..., list[dict[str, Any]]], tuple[Any, ...]]] = [
        ("run_p50_s", "Client.run latency", run_bench.bench_run_latency, (logs,)),
        ("run_cold_budget", "Client.run, cold environment", run_bench.bench_run_cold, (UV,)),
        ("workdir_first_added_s", "uploaded workdir", run_bench.bench_workdir, (logs,)),
    ]
    for name, what, fn, extra in parts:
        log(f"  {what}...")
        try:
            rows.extend(Row(**r) for r in fn(cfg, client, tmp, *extra))
        except Exception as e:
            log(traceback.format_exc())
            rows.append(Row(name, what, None, "", error=f"{type(e).__name__}: {e}"[:2000]))
    return rows


@contextmanager
def local_cluster(tmp: Path) -> Iterator[cumulus.Client]:
    reason = binaries_missing()
    if reason:
        raise BenchError(reason)
    if not os.access(UV, os.X_OK):
        raise BenchError(f"{UV} is missing: run ./scripts/setup.sh (the venv's test tools)")
    with (
        LocalCluster(
            tmp / CLUSTER_DIR, coordinators=1, workers=1, slots=4, env={"CUMULUS_UV": UV}
        ) as cluster,
        cluster.client() as client,
    ):
        yield client


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Config, set[str]]:
    """The command line: its arguments, the sizes to run at and the measurements to run."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where the JSON goes (created)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; checks it runs")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (for debugging)")
    p.add_argument(
        "--only",
        action="append",
        choices=["ddp", "kill", "report", "ckpt", "run"],
        help="run only these measurements (repeatable)",
    )
    p.add_argument(
        "--ddp-pairs",
        type=int,
        metavar="N",
        help="alternated (Cumulus, torchrun) pairs of the DDP measurement (default: 3; "
        "more pairs make the median of a noisy 2-core machine settle)",
    )
    p.add_argument(
        "--run-calls",
        type=int,
        metavar="N",
        help="timed Client.run calls of the run measurement, each kind (default: 20)",
    )
    args = p.parse_args(argv)
    cfg = SMOKE if args.smoke else FULL
    for flag, value, attr in (
        ("--ddp-pairs", args.ddp_pairs, "ddp_pairs"),
        ("--run-calls", args.run_calls, "run_calls"),
    ):
        if value is not None:
            if value < 1:
                p.error(f"{flag} must be at least 1")
            cfg = replace(cfg, **{attr: value})
    only = set(args.only or ["ddp", "kill", "report", "ckpt", "run"])
    return args, cfg, only


def main(argv: Sequence[str] | None = None) -> int:
    args, cfg, only = parse_args(argv)

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    machine = machine_info()
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="cumulus-pybench-"))
    rows: list[Row] = []

    def attempt(name: str, what: str, fn: Callable[[], list[Row]]) -> None:
        log(f"[{time.monotonic() - started:6.1f} s] {what}...")
        try:
            rows.extend(fn())
        except Exception as e:
            log(traceback.format_exc())
            rows.append(Row(name, what, None, "", error=f"{type(e).__name__}: {e}"))

    try:
        if "report" in only:
            attempt("report_us_per_call", "report() cost", lambda: bench_report(cfg))
        if only & {"ddp", "kill", "ckpt", "run"}:
            log(f"[{time.monotonic() - started:6.1f} s] starting a local cluster...")
            try:
                with local_cluster(tmp) as client:
                    if "ddp" in only:
                        attempt(
                            "ddp_steps_per_s_ratio",
                            "DDP steps/s",
                            lambda: bench_ddp(cfg, client, tmp),
                        )
                    if "kill" in only:
                        attempt(
                            "kill_to_first_step_ratio",
                            "kill -9 -> first step",
                            lambda: bench_kill(cfg, client, tmp),
                        )
                    if "ckpt" in only:
                        attempt(
                            "ckpt_blocked_ratio",
                            "checkpoint blocking time",
                            lambda: bench_ckpt(cfg, client, tmp),
                        )
                    if "run" in only:
                        log(f"[{time.monotonic() - started:6.1f} s] sending code (issue 41)...")
                        rows.extend(bench_run(cfg, client, tmp))
            except Exception as e:  # the cluster itself
                log(traceback.format_exc())
                rows.append(Row("local_cluster", "local cluster", None, "", error=f"{e}"[:2000]))
    finally:
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    machine["load_avg_end"] = list(os.getloadavg())
    machine["mode"] = "smoke" if cfg.smoke else "full"
    machine["wall_s"] = round(time.monotonic() - started, 1)
    for r in rows:
        r.judge(cfg.smoke)
    print_table(rows, cfg.smoke)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"python-bench-{int(time.time())}.json"
    data = [{**asdict(r), "machine": machine} for r in rows]
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path} ({machine['wall_s']} s)")
    return 1 if any(r.value is None for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
