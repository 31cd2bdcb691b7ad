"""``bench.py --only run``: sending code (issue 41), on a local cluster of real processes.

1. ``run_p50_s`` / ``run_p99_s``: ``Client.run(lambda: 1)`` submit -> result, the job's
   environment cached on the worker (requirements naming a small wheel built here; the
   first call builds it and is not counted), over ``run_calls`` calls. Target p50 <= 1 s.
   Beside it, the same without requirements (the worker's own ``python3``), and a few
   uncounted calls of a probe function whose timestamps split a call into its phases.
2. ``run_cold_budget``: ``Client.run(lambda: 1)`` whose environment is new to the worker
   (a wheel of its own, ``--no-index --find-links``), against uv's own time to build the
   same environment (``uv venv`` + ``uv pip install`` of that wheel into a fresh directory
   with a fresh cache), alternated; medians. Target: Cumulus <= 1.1 x uv + 1 s (the row's
   value is Cumulus / (1.1 x uv + 1 s), target <= 1.0).
3. ``workdir_first_added_s``: a 100 MiB working directory (random bytes in four files and
   a script that stamps the wall clock at its first step): ``Client.submit(upload=dir)``
   -> first step, minus a plain submit of the same script from the directory's local path
   (``working_dir``) -> first step. Target <= 3 s. Then a second submit of the unchanged
   directory: bytes uploaded (target 0) and time added over the plain submit (target
   <= 0.2 s). Alternated (plain, first, second / first, second, plain ...); each pair
   changes one small file so that its first upload is new to the cluster; medians of the
   per-pair differences. The details split each kind into the SDK's steps (pack, HEAD,
   PUT, POST) and the agent's (from its log: placement, blob fetch, unpack, spawn).

Every wait has a deadline; the wheels, environments and directories live in the caller's
temp dir. Rows are plain dicts (``bench.Row``'s fields), made into rows by ``bench.py``.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import cumulus
from cumulus import _bundle, _transfer, _upload_cache
from cumulus import client as client_module

#: Files of random bytes the working directory's size is split into (item 3).
WORKDIR_FILES = 4
#: How often a wait for a first-step stamp looks at the file, seconds (the stamp holds
#: the rank's own clock reading, so this only bounds the benchmark's wall time).
STAMP_POLL_S = 0.01
#: How often that wait also asks the cluster whether the job failed, seconds.
STAMP_STATUS_EVERY_S = 1.0
#: Calls of the probe function (item 1's phase split), not counted in the latency rows.
PROBE_CALLS = 5

#: The script of item 3's working directory: at its first step it writes the wall clock
#: and the bytes it sees under data/ (atomically) where $BENCH_STAMP says.
WORKDIR_SCRIPT = """\
import os, sys, time
t = time.time()  # the first step
data = sum(e.stat().st_size for e in os.scandir("data"))
stamp = os.environ["BENCH_STAMP"]
with open(stamp + ".tmp", "w") as f:
    f.write(f"{t!r} {data}\\n")
os.replace(stamp + ".tmp", stamp)
print("FIRST_STEP", t, data, flush=True)
"""


def row(name: str, what: str, value: float | None, unit: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "what": what, "value": value, "unit": unit, **kw}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def quantile(samples: list[float], q: int) -> float:
    """The ``q``-th percentile (inclusive method: within the samples' range)."""
    if len(samples) == 1:
        return samples[0]
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


# -- wheels and uv -----------------------------------------------------------------------


def write_wheel(directory: Path, name: str, version: str = "1.0") -> Path:
    """A pure-Python wheel of package ``name`` (``VALUE = 1``) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", "VALUE = 1\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: cumulus-bench\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n",
        )
        z.writestr(
            f"{info}/RECORD",
            f"{name}/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n",
        )
    return path


def uv_env() -> dict[str, str]:
    """uv's environment for the uv arm: no config files, no interpreter downloads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "VIRTUAL_ENV"))}
    env.update(UV_PYTHON_DOWNLOADS="never", UV_NO_CONFIG="1", UV_NO_PROGRESS="1")
    return env


def uv_cold_build(uv: str, python: str, wheels: Path, package: str, work: Path) -> float:
    """Seconds uv takes to build the environment of ``package`` from ``wheels`` the way
    the worker does (``uv venv --relocatable --python X`` then ``uv pip install``), into
    a fresh directory with a fresh cache."""
    venv, cache = work / "venv", work / "uv-cache"
    work.mkdir(parents=True)
    env = {**uv_env(), "UV_CACHE_DIR": str(cache)}
    t0 = time.perf_counter()
    for cmd in (
        [uv, "venv", "--relocatable", "--python", python, str(venv)],
        [
            uv, "pip", "install", "--python", str(venv / "bin" / "python"),
            "--no-index", "--find-links", str(wheels), package,
        ],
    ):  # fmt: skip
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return time.perf_counter() - t0


# -- phases of a call, from the SDK's side ------------------------------------------------


@dataclass
class Phases:
    """Wall time the SDK spends in each of its steps during one call, seconds: packing,
    ``HEAD``, ``PUT``, the submit ``POST``, the wait (with its poll count) and the
    result's download; filled by :func:`timed_sdk`."""

    times: dict[str, float] = field(default_factory=dict)
    #: When each step was first entered (``time.time()``).
    starts: dict[str, float] = field(default_factory=dict)
    polls: int = 0
    final: cumulus.JobInfo | None = None

    def add(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + seconds


_current: list[Phases] = []


@contextmanager
def timed_sdk() -> Iterator[Callable[[], Phases]]:
    """Wraps the SDK's steps with timers for the duration of the block; yields a
    function that starts a fresh :class:`Phases` for the next call and returns it. The
    wrappers add microseconds to a call."""
    saved: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, attr: str, phase: str) -> None:
        inner = getattr(owner, attr)

        def timed(*a: Any, **kw: Any) -> Any:
            if _current:
                _current[-1].starts.setdefault(phase, time.time())
            t0 = time.perf_counter()
            try:
                out = inner(*a, **kw)
            finally:
                if _current:
                    _current[-1].add(phase, time.perf_counter() - t0)
            if phase == "wait" and _current:
                _current[-1].final = out
            return out

        saved.append((owner, attr, inner))
        setattr(owner, attr, timed)

    def request(self: Any, method: str, path: str, *a: Any, **kw: Any) -> Any:
        t0, t_wall = time.perf_counter(), time.time()
        try:
            return inner_request(self, method, path, *a, **kw)
        finally:
            if _current:
                if method == "POST" and path == "/v1/jobs":
                    _current[-1].add("submit_post", time.perf_counter() - t0)
                    _current[-1].starts.setdefault("submit", t_wall)
                elif method == "GET" and path.startswith("/v1/jobs/"):
                    _current[-1].polls += 1

    inner_request = client_module.Client._request
    saved.append((client_module.Client, "_request", inner_request))
    client_module.Client._request = request  # type: ignore[method-assign]
    # pack_directory = select_directory (the walk, milliseconds) + pack_selection; an
    # upload through the digest cache calls list_directory, then pack_selection on a miss.
    wrap(_bundle, "pack_selection", "pack")
    wrap(_upload_cache, "list_directory", "list")
    wrap(_upload_cache, "lookup", "cache_lookup")
    wrap(_transfer, "stat_blob", "head")
    wrap(_transfer, "put_blob", "put")
    wrap(client_module.Job, "wait", "wait")
    wrap(client_module.Job, "_outcome", "result_download")

    def fresh() -> Phases:
        _current.clear()
        _current.append(Phases())
        return _current[-1]

    try:
        yield fresh
    finally:
        _current.clear()
        for owner, attr, inner in reversed(saved):
            setattr(owner, attr, inner)


def _process_start_s() -> float:
    """This process's start time (epoch seconds, 10 ms resolution): its age from
    ``/proc/self/stat`` (start in clock ticks since boot) against ``CLOCK_BOOTTIME``,
    taken from the wall clock (``/proc/stat``'s whole-second ``btime`` drifts from it)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


def probe() -> dict[str, float]:
    """Run on the rank (pickled by value): when its process started and when the
    function was entered, epoch seconds."""
    import time as t

    entered = t.time()
    return {"process_start": _process_start_s(), "fn_entered": entered}


def _one_call(client: cumulus.Client, timeout_s: float, fn: Callable[[], Any], **run: Any) -> Any:
    return client.run(fn, timeout=timeout_s, max_restarts=0, **run)


def _split(
    ph: Phases, t_call: float, t_done: float, probed: dict[str, float], ev: dict[str, float]
) -> dict[str, float]:
    """One probe call's timeline cut into consecutive phases, seconds: the SDK's timers,
    the leader's timestamps of the job (``*_at_ms``), the agent's log lines (``ev``:
    :func:`worker_events`) and the probe's own clock readings, all on this machine's
    clock. A phase whose mark is missing (no such log line) merges into the next."""
    info = ph.final
    assert info is not None
    rank = info.ranks[0]
    wait_end = t_done - ph.times.get("result_download", 0.0)
    marks = [
        ("call", t_call),
        ("client: pickle + vendored copies", ph.starts.get("pack")),
        ("client: pack (tar.gz + BLAKE3)", ph.starts.get("head")),
        ("client: HEAD blob (+ PUT when new)", ph.starts.get("submit") or None),
        ("client: POST submit -> leader commit", info.submitted_at_ms / 1000),
        ("placement -> agent starts the attempt", ev.get("starting")),
        ("agent: environment lookup", ev.get("env_ready")),
        ("agent: blob fetch", ev.get("blob_fetched")),
        ("agent: unpack workdir", ev.get("unpacked")),
        ("agent: -> fork (the rank's start time in /proc, 10 ms)", probed["process_start"]),
        ("agent: -> spawned", ev.get("running")),
        ("rank: exec, interpreter, bootstrap, unpickle -> fn entered", probed["fn_entered"]),
        ("rank: fn, result, exit; agent: pack + PUT artifacts", ev.get("artifacts_uploaded")),
        ("agent: RankExited -> leader commit", rank.exited_at_ms / 1000),
        ("leader: job finished", info.finished_at_ms / 1000),
        ("client: notices (polling)", wait_end),
        ("client: GET artifact, unpickle", t_done),
    ]
    out: dict[str, float] = {}
    last = t_call
    for name, t in marks[1:]:
        if t is None:
            continue
        out[name] = round(t - last, 4)
        last = t
    out["total"] = round(t_done - t_call, 4)
    out["RankStarted committed, after submit (leader clock)"] = round(
        (rank.started_at_ms - info.submitted_at_ms) / 1000, 4
    )
    out["polls"] = float(ph.polls)
    return out


#: The agent's INFO lines that mark an attempt's phases (worker/src/supervisor, envs,
#: blobs), in the order they come.
WORKER_EVENTS = (
    ("starting rank attempt", "starting"),
    ("Python environment ready", "env_ready"),
    ("workdir unpacked", "unpacked"),
    ("rank attempt running", "running"),
    ("artifacts uploaded", "artifacts_uploaded"),
    ("rank attempt finished", "finished"),
)
_LOG_LINE = re.compile(r"^(\S+Z)\s+INFO\s+\S+ (.*)$")


def worker_events(cluster_dir: Path, job_id: str, digest: str | None = None) -> dict[str, float]:
    """Epoch seconds of the agent's log lines about rank 0 attempt 0 of ``job_id`` (and,
    with ``digest``, when that blob was fetched into its cache): best effort, for the
    phase split only (empty when the log says nothing)."""
    attempt = f"attempt={job_id}/rank-0/attempt-0"
    out: dict[str, float] = {}
    for path in sorted(cluster_dir.glob("worker*.log")):
        for line in path.read_text(errors="replace").splitlines():
            m = _LOG_LINE.match(line)
            if not m:
                continue
            text = m.group(2)
            if digest and "blob fetched into the cache" in text and digest in text:
                # Fetched for this attempt only when after its start (else an earlier
                # job's fetch of the same blob).
                name = "blob_fetched" if "starting" in out else ""
            elif attempt in text:
                name = next((n for msg, n in WORKER_EVENTS if text.startswith(msg)), "")
            else:
                continue
            if name and name not in out:
                out[name] = datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
    return out


def worker_split(ev: dict[str, float], submitted: float) -> dict[str, float]:
    """The agent's phases of one attempt, seconds: from the leader's submit commit to the
    agent starting the attempt (placement, delivery), then each step to the next one
    logged (environment, blob fetch, unpack, spawn)."""
    out: dict[str, float] = {}
    last, last_name = submitted, "submitted"
    for name in ("starting", "env_ready", "blob_fetched", "unpacked", "running"):
        if name in ev:
            out[f"{last_name} -> {name}"] = round(ev[name] - last, 4)
            last, last_name = ev[name], name
    return out


# -- 1 and 2: Client.run latency, warm and cold environments ------------------------------


def _workdir_digest(info: cumulus.JobInfo) -> str | None:
    spec = info.raw.get("spec") if isinstance(info.raw, dict) else None
    workdir = spec.get("workdir") if isinstance(spec, dict) else None
    digest = workdir.get("digest") if isinstance(workdir, dict) else None
    return digest if isinstance(digest, str) else None


def bench_run_latency(
    cfg: Any, client: cumulus.Client, tmp: Path, cluster_dir: Path
) -> list[dict[str, Any]]:
    wheels = tmp / "run-wheels-warm"
    write_wheel(wheels, "cumbench_warm")
    env_opts = {
        "requirements": ["cumbench_warm"],
        "options": {"find_links": [str(wheels)], "no_index": True},
    }
    timeout = cfg.run_timeout_s
    rows: list[dict[str, Any]] = []
    with timed_sdk() as fresh:
        # The first call builds the environment on the worker: not counted.
        t0 = time.perf_counter()
        if _one_call(client, timeout, lambda: 1, **env_opts) != 1:
            raise RuntimeError("Client.run(lambda: 1) did not return 1")
        first = time.perf_counter() - t0
        log(f"  run: first call (builds the environment) {first:.2f} s")
        samples: dict[str, list[float]] = {"env": [], "noenv": []}
        polls: dict[str, list[int]] = {"env": [], "noenv": []}
        # Alternated: with the cached environment, then the worker's python3.
        for i in range(cfg.run_calls):
            for kind in ("env", "noenv"):
                ph = fresh()
                t0 = time.perf_counter()
                v = _one_call(client, timeout, lambda: 1, **(env_opts if kind == "env" else {}))
                samples[kind].append(time.perf_counter() - t0)
                polls[kind].append(ph.polls)
                if v != 1:
                    raise RuntimeError(f"Client.run(lambda: 1) returned {v!r}")
            log(f"  run call {i}: {samples['env'][-1]:.3f} s ({samples['noenv'][-1]:.3f} s no env)")
        # Where a call's time goes: a probe function, with the cached environment.
        splits = []
        for _ in range(PROBE_CALLS):
            ph = fresh()
            t_call = time.time()
            probed = _one_call(client, timeout, probe, **env_opts)
            t_done = time.time()
            assert ph.final is not None
            ev = worker_events(cluster_dir, ph.final.id, _workdir_digest(ph.final))
            splits.append(_split(ph, t_call, t_done, probed, ev))
    phases = {
        k: round(statistics.median(s.get(k, 0.0) for s in splits), 4)
        for k in dict.fromkeys(k for s in splits for k in s)
    }
    log(
        "  run phases (median of probe calls, s): "
        + ", ".join(f"{k}: {v}" for k, v in phases.items())
    )
    for kind, label in (("env", "cached environment"), ("noenv", "no environment")):
        s = samples[kind]
        details = {
            "calls": len(s),
            "samples_s": [round(x, 4) for x in s],
            "max_s": max(s),
            "polls_per_call": statistics.median(polls[kind]),
            "first_call_s (builds the environment)": first,
            "environment": (
                "requirements ['cumbench_warm'] (a local wheel, --no-index --find-links), "
                "built by the first call and cached on the worker"
                if kind == "env"
                else "none: the worker's python3"
            ),
            "phases_median_s (probe calls, cached environment)": phases,
            "measured": "wall time of Client.run(lambda: 1) in this process, submit to value",
        }
        suffix = "" if kind == "env" else "_noenv"
        rows.append(
            row(
                f"run_p50_s{suffix}",
                f"Client.run(lambda: 1) p50, {label}",
                statistics.median(s),
                "s",
                target="<= 1.0" if kind == "env" else None,
                details=details,
            )
        )
        rows.append(
            row(f"run_p99_s{suffix}", f"Client.run(lambda: 1) p99, {label}", quantile(s, 99), "s")
        )
    return rows


def bench_run_cold(cfg: Any, client: cumulus.Client, tmp: Path, uv: str) -> list[dict[str, Any]]:
    python = cumulus._remote.client_python()
    runs: dict[str, list[float]] = {"cumulus": [], "uv": []}
    for i in range(cfg.run_cold_pairs):
        package = f"cumbench_cold_{i}_{os.getpid()}"
        wheels = tmp / f"run-wheels-cold-{i}"
        write_wheel(wheels, package)
        order = ("cumulus", "uv") if i % 2 == 0 else ("uv", "cumulus")
        for who in order:
            if who == "uv":
                v = uv_cold_build(uv, python, wheels, package, tmp / f"uv-cold-{i}")
            else:
                t0 = time.perf_counter()
                r = _one_call(
                    client,
                    cfg.run_timeout_s,
                    lambda: 1,
                    requirements=[package],
                    options={"find_links": [str(wheels)], "no_index": True},
                )
                v = time.perf_counter() - t0
                if r != 1:
                    raise RuntimeError(f"Client.run(lambda: 1) returned {r!r}")
            runs[who].append(v)
            log(f"  cold pair {i}: {who} {v:.3f} s")
    c, u = statistics.median(runs["cumulus"]), statistics.median(runs["uv"])
    budget = 1.1 * u + 1.0
    details = {
        "runs_s": runs,
        "pairs": cfg.run_cold_pairs,
        "budget_s": budget,
        "cumulus": (
            "Client.run(lambda: 1, requirements=[a wheel new to the worker], no_index, "
            "find_links): submit -> value, the worker building the environment with uv"
        ),
        "uv": (
            f"uv venv --relocatable --python {python} + uv pip install --no-index "
            "--find-links of the same wheel, fresh directory and fresh UV_CACHE_DIR"
        ),
        "order": "alternated per pair; medians",
    }
    return [
        row("run_cold_s", "Client.run(lambda: 1), cold small environment", c, "s", details=details),
        row("run_cold_uv_s", "uv venv + uv pip install of that environment", u, "s"),
        row(
            "run_cold_budget",
            "cold Client.run / (1.1 x uv + 1 s)",
            c / budget,
            "x",
            target="<= 1.0",
            details=details,
        ),
    ]


# -- 3. a 100 MiB working directory -----------------------------------------------------


def make_workdir(root: Path, total_bytes: int) -> None:
    data = root / "data"
    data.mkdir(parents=True)
    each = total_bytes // WORKDIR_FILES
    for i in range(WORKDIR_FILES):
        with (data / f"blob-{i}.bin").open("wb") as f:
            left = each
            while left:
                n = min(left, 1 << 20)
                f.write(os.urandom(n))
                left -= n
    (root / "main.py").write_text(WORKDIR_SCRIPT)


def wait_stamp(job: cumulus.Job, stamp: Path, timeout_s: float) -> tuple[float, int]:
    """The first-step stamp's (wall clock, data bytes) once the rank wrote it."""
    deadline = time.monotonic() + timeout_s
    next_status = time.monotonic() + STAMP_STATUS_EVERY_S
    while True:
        try:
            t, data = stamp.read_text().split()
            return float(t), int(data)
        except FileNotFoundError:
            pass
        now = time.monotonic()
        if now > deadline:
            raise RuntimeError(f"{job.id} wrote no first-step stamp within {timeout_s} s")
        if now > next_status:
            next_status = now + STAMP_STATUS_EVERY_S
            info = job.status()
            if info.finished and not stamp.exists():
                raise RuntimeError(
                    f"{job.id} {info.state} without a first step: {info.failure_cause}"
                )
        time.sleep(STAMP_POLL_S)


def bench_workdir(
    cfg: Any, client: cumulus.Client, tmp: Path, cluster_dir: Path
) -> list[dict[str, Any]]:
    root = tmp / "workdir"
    total = cfg.workdir_mib * 1024 * 1024
    make_workdir(root, total)
    want_data = (total // WORKDIR_FILES) * WORKDIR_FILES
    stamps = tmp / "workdir-stamps"
    stamps.mkdir()
    runs: dict[str, list[float]] = {"plain": [], "first": [], "second": []}
    sent: dict[str, list[int]] = {"first": [], "second": []}
    sdk: dict[str, list[dict[str, float]]] = {"first": [], "second": []}
    worker_side: dict[str, list[dict[str, float]]] = {"plain": [], "first": [], "second": []}
    n = 0

    def one(kind: str, fresh: Callable[[], Phases]) -> float:
        nonlocal n
        n += 1
        stamp = stamps / f"{n}-{kind}"
        common: dict[str, Any] = {
            "env": {"BENCH_STAMP": str(stamp)},
            "max_restarts": 0,
            "name": f"bench-workdir-{kind}-{n}",
        }
        where: dict[str, Any] = {"working_dir": root} if kind == "plain" else {"upload": root}
        ph = fresh()
        t0 = time.time()
        job = client.submit(["python3", "main.py"], **common, **where)
        t_first, data = wait_stamp(job, stamp, cfg.run_timeout_s)
        info = job.wait(timeout_s=cfg.run_timeout_s, poll_interval_s=0.2)
        if not info.succeeded:
            raise RuntimeError(f"{job.id} {info.state}: {info.failure_cause}")
        if data != want_data:
            raise RuntimeError(f"{job.id} saw {data} bytes under data/, not {want_data}")
        if kind != "plain":
            assert job.upload is not None
            sent[kind].append(job.upload.sent_bytes)
            sdk[kind].append(dict(ph.times))
        # submitted (leader) -> first step: placement, fetch, unpack, spawn, interpreter.
        submitted = info.submitted_at_ms / 1000
        ev = worker_events(cluster_dir, job.id, job.upload.blob.digest if job.upload else None)
        split = worker_split(ev, submitted)
        split["-> first step"] = round(t_first - ev.get("running", submitted), 4)
        split["submitted -> first step"] = round(t_first - submitted, 4)
        worker_side[kind].append(split)
        return t_first - t0

    with timed_sdk() as fresh:
        for i in range(cfg.workdir_pairs):
            # A new first upload each pair: one small file changes, the digest with it.
            (root / "nonce.txt").write_text(f"{i} {time.time_ns()}\n")
            order = ("plain", "first", "second") if i % 2 == 0 else ("first", "second", "plain")
            for kind in order:
                runs[kind].append(one(kind, fresh))
            log(
                f"  workdir pair {i}: plain {runs['plain'][-1]:.3f} s, first "
                f"{runs['first'][-1]:.3f} s (sent {sent['first'][-1]} B), second "
                f"{runs['second'][-1]:.3f} s (sent {sent['second'][-1]} B)"
            )
    first_added = [f - p for f, p in zip(runs["first"], runs["plain"], strict=True)]
    second_added = [s - p for s, p in zip(runs["second"], runs["plain"], strict=True)]

    def med(d: list[dict[str, float]]) -> dict[str, float]:
        keys = sorted({k for x in d for k in x})
        return {k: round(statistics.median(x.get(k, 0.0) for x in d), 4) for k in keys}

    details = {
        "runs_s": runs,
        "first_added_s": first_added,
        "second_added_s": second_added,
        "sent_bytes": sent,
        "workdir": (
            f"{WORKDIR_FILES} files of random bytes, {total} bytes in all, main.py, nonce.txt"
        ),
        "sdk_phases_median_s": {k: med(v) for k, v in sdk.items()},
        "cluster_phases_median_s": {k: med(v) for k, v in worker_side.items()},
        "measured": (
            "wall clock before Client.submit -> the clock the rank's script reads at its "
            "first step; plain: working_dir=the same directory on this machine"
        ),
        "order": "alternated (plain, first, second / first, second, plain); medians of pairs",
    }
    return [
        row("workdir_plain_s", "plain submit -> first step", statistics.median(runs["plain"]), "s"),
        row(
            "workdir_first_s",
            f"{cfg.workdir_mib} MiB upload submit -> first step",
            statistics.median(runs["first"]),
            "s",
        ),
        row(
            "workdir_first_added_s",
            f"{cfg.workdir_mib} MiB workdir, first submit: added over plain",
            statistics.median(first_added),
            "s",
            target="<= 3.0",
            details=details,
        ),
        row(
            "workdir_second_upload_bytes",
            "unchanged workdir, second submit: bytes uploaded",
            float(max(sent["second"])),
            "B",
            target="<= 0",
        ),
        row(
            "workdir_second_added_s",
            f"{cfg.workdir_mib} MiB workdir, second submit: added over plain",
            statistics.median(second_added),
            "s",
            target="<= 0.2",
            details=details,
        ),
    ]
