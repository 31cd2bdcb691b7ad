"""A real local Cumulus cluster for the integration tests: ``cumulusctl local up`` in a
temp dir (TLS, with a CA in ``<dir>/tls``, unless ``insecure``), torn down with ``local
down --purge``. Every process it starts is recorded in that dir's ``cluster.json``;
teardown stops them all, and SIGKILLs any left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import cumulus
from cumulus import errors

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The bundled digits data set (64 features, then the label), gzip-compressed CSV.
DIGITS = REPO_ROOT / "data" / "digits" / "digits.csv.gz"
T = TypeVar("T")


def bin_dir() -> Path:
    """Where the Cumulus binaries are: ``$CUMULUS_BIN_DIR``, else ``target/debug``."""
    return Path(os.environ.get("CUMULUS_BIN_DIR") or REPO_ROOT / "target" / "debug")


def binaries_missing() -> str | None:
    """Why the cluster tests cannot run, or ``None``."""
    d = bin_dir()
    missing = [
        n
        for n in ("cumulusctl", "cumulus-coordinator", "cumulus-worker")
        if not os.access(d / n, os.X_OK)
    ]
    if missing:
        return f"{', '.join(missing)} not found in {d} (run `cargo build`, or set CUMULUS_BIN_DIR)"
    return None


def wait_for(predicate: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """Polls ``predicate`` (every 50 ms) until it returns a true value, which is returned.

    :raises AssertionError: ``timeout_s`` passed first."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (killed, not yet reaped by its parent) counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class LocalCluster:
    """``cumulusctl local up`` under ``directory`` (``cumulusctl --insecure local up`` with
    ``insecure``: plaintext); use as a context manager.

    ``env``: extra environment of ``local up``, which the coordinators and workers it
    starts inherit (e.g. ``CUMULUS_GPUS``: every worker's ``--gpus``); otherwise no
    ``CUMULUS_*`` variable of the test process reaches them."""

    def __init__(
        self,
        directory: Path,
        *,
        coordinators: int = 1,
        workers: int = 1,
        slots: int = 4,
        insecure: bool = False,
        env: Mapping[str, str] | None = None,
    ):
        self.dir = directory
        self.coordinators = coordinators
        self.workers = workers
        self.slots = slots
        self.insecure = insecure
        self.env = dict(env or {})
        self.ctl = bin_dir() / "cumulusctl"
        self._pids: list[int] = []

    # -- lifecycle ---------------------------------------------------------------------

    def cumulusctl(
        self, *args: str, timeout_s: float = 60, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``cumulusctl --local-dir <dir> args...`` without the test process's
        ``CUMULUS_*`` variables (plus ``env``)."""
        environ = {k: v for k, v in os.environ.items() if not k.startswith("CUMULUS_")}
        environ.update(env or {})
        return subprocess.run(
            [str(self.ctl), "--local-dir", str(self.dir), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=environ,
            check=False,
        )

    def up(self) -> LocalCluster:
        self.dir.mkdir(parents=True, exist_ok=True)
        # As root, `local up` runs ranks as other users (uids 60000-60999), who can reach
        # neither pytest's temp dirs (0700) nor an interpreter under /root: these tests'
        # ranks run this interpreter, so they ask for root ranks. The isolation itself is
        # tested in cli/tests/local_isolation.rs.
        root_ranks = ["--allow-root"] if os.geteuid() == 0 else []
        r = self.cumulusctl(
            *(["--insecure"] if self.insecure else []),
            "local",
            "up",
            *root_ranks,
            "--coordinators",
            str(self.coordinators),
            "--workers",
            str(self.workers),
            "--slots",
            str(self.slots),
            "--bin-dir",
            str(bin_dir()),
            env=self.env,
        )
        self._pids = self._recorded_pids()
        if r.returncode != 0:
            self.down()
            raise RuntimeError(
                f"cumulusctl local up failed ({r.returncode}):\n{r.stderr}{r.stdout}"
            )
        return self

    def down(self) -> None:
        r = self.cumulusctl("local", "down", "--purge")
        # Whatever `local down` could not stop (or never knew of) is killed here.
        for pid in self._pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if r.returncode != 0 and (self.dir / "cluster.json").exists():
            raise RuntimeError(f"cumulusctl local down failed:\n{r.stderr}{r.stdout}")

    def __enter__(self) -> LocalCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- what it is --------------------------------------------------------------------

    @property
    def file(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.dir / "cluster.json").read_text())
        return data

    def _recorded_pids(self) -> list[int]:
        try:
            f = self.file
        except FileNotFoundError:
            return []
        return [p["pid"] for p in f["coordinators"] + f["workers"] if p.get("pid")]

    @property
    def token_file(self) -> Path:
        return Path(self.file["token_file"])

    @property
    def http_addrs(self) -> list[str]:
        """The coordinators' HTTP ``host:port`` (HTTPS unless the cluster is insecure)."""
        return [c["http"] for c in self.file["coordinators"]]

    @property
    def ca_file(self) -> Path | None:
        """The cluster CA certificate (``<tls_dir>/ca.pem``), ``None`` when plaintext."""
        tls_dir = self.file.get("tls_dir")
        return Path(tls_dir) / "ca.pem" if tls_dir else None

    @property
    def scheme(self) -> str:
        """``https``, or ``http`` for an insecure cluster."""
        return "http" if self.ca_file is None else "https"

    def client(self, **kwargs: Any) -> cumulus.Client:
        """An SDK client of this cluster by its explicit addresses, token file and TLS
        settings (``kwargs`` override or add :class:`cumulus.Client` arguments)."""
        ca = self.ca_file
        args: dict[str, Any] = {
            "token_file": self.token_file,
            "tls_ca": ca,
            "insecure": ca is None,
            "retry_total_s": 30,
        }
        return cumulus.Client(self.http_addrs, **{**args, **kwargs})

    def coordinator_pid(self, http_addr: str) -> int:
        for c in self.file["coordinators"]:
            if c["http"] == http_addr:
                return int(c["pid"])
        raise KeyError(http_addr)

    def kill_coordinator(self, http_addr: str) -> None:
        """SIGKILLs the coordinator serving ``http_addr`` and waits until it is gone."""
        pid = self.coordinator_pid(http_addr)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), 10, f"coordinator pid {pid} to die")

    def logs(self) -> str:
        """The tail of every process log (for assertion messages)."""
        out = []
        for p in sorted(self.dir.glob("*.log")):
            text = p.read_text(errors="replace")
            out.append(f"--- {p.name} ---\n{text[-4000:]}")
        return "\n".join(out)


def explain(job: cumulus.Job, cluster: LocalCluster) -> str:
    """Everything worth seeing when a job did not do what a test expected: its status,
    its ranks' logs, and the cluster's process logs."""
    try:
        logs = "\n".join(f"[r{x.rank} a{x.attempt}] {x.line}" for x in job.logs(follow=False))
    except errors.CumulusError as e:
        logs = f"(logs unavailable: {e})"
    return f"{job.status()!r}\n--- rank logs ---\n{logs}\n{cluster.logs()}"
