"""In-process restarts: :func:`run` runs the training function, and when a peer rank fails
the surviving ranks re-enter it in the same process (docs/architecture.md, "Restart
paths").

Standard library only: ``torch.distributed`` is found in ``sys.modules`` (a training
function that formed a process group has imported it), never imported here.

The protocol with the worker agent (``GET``/``POST /v1/restart``):

1. While the function runs, a daemon thread long-polls ``GET /v1/restart`` with the
   attempt's token: the agent then knows the rank listens, and the leader may keep its
   process in a group restart.
2. When the leader restarts the group, the agent hands this process the rank's new
   attempt: the poll answers its :class:`RestartOffer` (the new contract variables). The
   old token is retired at once: a checkpoint or a progress report of the abandoned
   attempt is refused (:class:`~cumulus.errors.StaleAttempt`).
3. The function leaves its step: :func:`check` (called by ``report()``, the stop checks
   and checkpoints) raises :class:`RestartRequested` on the function's thread, a
   collective blocked on the dead peer fails on its own (gloo: the peer's connection
   closes, or the process group's timeout; NCCL: this module aborts the communicators
   from the poll thread), and a function that does neither for
   :data:`INTERRUPT_AFTER_S` gets :class:`RestartRequested` raised asynchronously.
4. :func:`run` tears the process group down (abort for NCCL, then destroy) within
   :data:`TEARDOWN_TIMEOUT_S`, drops the abandoned attempt's background checkpoint and
   progress sender, puts the new variables in ``os.environ``, makes a new process-wide
   runtime for them, acknowledges with ``POST /v1/restart`` under the new token (within
   the agent's bound, else the agent kills the process and the job restarts in full),
   waits out the rest of the restart's backoff, and calls the function again. The
   function restores the resume step as a fresh process would (``ckpt.load_checkpoint``,
   ``runtime.resume()``; from the host copy of this process's asynchronous checkpoint
   when it is the part resumed from) and forms a new process group at the new
   ``MASTER_PORT``.
5. When the abandoned attempt's process group had been formed through ``MASTER_ADDR`` /
   ``MASTER_PORT`` (its store a ``TCPStore`` there) and this rank does not host the new
   store (``RANK`` is not 0), :func:`run` first waits, polling every
   :data:`STORE_POLL_S`, until the new ``MASTER_PORT`` accepts connections (at most
   :data:`STORE_WAIT_S`): a ``TCPStore`` client that finds no listener sleeps a growing
   backoff (0.6 s, then more) before it tries again, and rank 0 is usually a replacement
   still starting.

An error of the function that is not a restart ends :func:`run` as it would end the
function, except that an error that looks like a lost peer (a failed collective, a
refused token) first waits up to :data:`PEER_FAILURE_WAIT_S` for the agent's offer.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from cumulus._contract import (
    RANK_ENV_CKPT_STAGING,
    RANK_ENV_MASTER_ADDR,
    RANK_ENV_MASTER_PORT,
    RANK_ENV_RANK,
    RANK_ENV_RESUME_DIR,
    RANK_ENV_RESUME_STEP,
    RANK_MAX_RESTART_POLL_MS,
)
from cumulus.errors import AgentError, StaleAttempt
from cumulus.runtime._failure import use_token

__all__ = [
    "INTERRUPT_AFTER_S",
    "PEER_FAILURE_WAIT_S",
    "TEARDOWN_TIMEOUT_S",
    "RestartOffer",
    "RestartRequested",
    "check",
    "in_run",
    "run",
]

T = TypeVar("T")

#: Longest wait, in seconds, for the agent's restart after the function failed with an
#: error that looks like a lost peer (the leader needs the peer's failure first: at once
#: for a process that died, after the job's progress timeout for one that hangs).
PEER_FAILURE_WAIT_S = 60.0
#: Longest time, in seconds, the process group's teardown may take; past it the process
#: cannot be reused and exits (the job then restarts in full).
TEARDOWN_TIMEOUT_S = 5.0
#: Seconds after an offer arrives before :class:`RestartRequested` is raised
#: asynchronously in a function that neither called the runtime nor failed meanwhile.
INTERRUPT_AFTER_S = 2.0
#: Longest wait, in seconds, for the new rendezvous store to listen before the function
#: is called again (it then connects as it would have: see the module doc, step 5).
STORE_WAIT_S = 60.0
#: Seconds between two tries to connect to the new rendezvous store.
STORE_POLL_S = 0.01
#: Exit code of a process whose process group could not be torn down in time.
EXIT_TEARDOWN_FAILED = 1
#: Variables removed before a new attempt's are set (it sets them again when it has them).
CLEARED_VARS = (RANK_ENV_CKPT_STAGING, RANK_ENV_RESUME_STEP, RANK_ENV_RESUME_DIR)
_POLL_TIMEOUT_S = RANK_MAX_RESTART_POLL_MS / 1000


class RestartRequested(BaseException):
    """Raised in the training function when an in-process restart abandons its step. A
    ``BaseException``, as ``KeyboardInterrupt``: an ``except Exception`` in the function
    does not swallow it. :func:`run` catches it and re-enters the function."""


@dataclass(frozen=True)
class RestartOffer:
    """The new attempt the agent hands this process (``GET /v1/restart``)."""

    #: The new attempt number.
    attempt: int
    #: Its rank contract variables by name (token, ``MASTER_PORT``, staging, resume...).
    env: Mapping[str, str]
    #: The rest of the restart's backoff, in ms: training resumes no earlier.
    hold_ms: int
    #: How long the agent waits for the acknowledgement, in ms.
    ack_timeout_ms: int
    #: ``time.monotonic()`` when it arrived.
    received_at: float

    @classmethod
    def parse(cls, data: bytes, received_at: float) -> RestartOffer:
        """Reads the agent's reply. :raises ValueError: not a restart offer."""
        d = json.loads(data)
        env = d.get("env") if isinstance(d, dict) else None
        if (
            not isinstance(env, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
            or not isinstance(d.get("attempt"), int)
        ):
            raise ValueError(f"not a restart offer: {data[:200]!r}")
        return cls(
            attempt=int(d["attempt"]),
            env=dict(env),
            hold_ms=max(0, int(d.get("hold_ms", 0))),
            ack_timeout_ms=max(0, int(d.get("ack_timeout_ms", 0))),
            received_at=received_at,
        )


class _Watcher:
    """The poll thread: waits for the agent's offer with the current token."""

    def __init__(self, token: Callable[[], Any]) -> None:
        #: Returns the current runtime's agent client (``None``: stop polling).
        self._agent = token
        self._lock = threading.Lock()
        self._offer: RestartOffer | None = None
        self._arrived = threading.Event()
        self._stopped = threading.Event()
        #: The thread running the function, and whether it is inside it now.
        self.target_ident: int | None = None
        self.inside = False
        self._thread = threading.Thread(target=self._run, name="cumulus-restart", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    @property
    def offer(self) -> RestartOffer | None:
        return self._offer

    def take(self) -> RestartOffer | None:
        """The offer, once; polling resumes with the new token."""
        with self._lock:
            offer, self._offer = self._offer, None
            self._arrived.clear()
        return offer

    def wait(self, timeout_s: float) -> RestartOffer | None:
        self._arrived.wait(timeout_s)
        return self._offer

    def _run(self) -> None:
        backoff = 0.1
        while not self._stopped.is_set():
            if self._arrived.is_set():  # taken by the function's thread first
                self._stopped.wait(0.05)
                continue
            agent = self._agent()
            if agent is None:
                return
            try:
                data = agent.restart_poll(timeout_s=_POLL_TIMEOUT_S)
            except AgentError:  # StaleAttempt too: the attempt is ending (no offer)
                self._stopped.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            if data is None:
                continue
            try:
                offer = RestartOffer.parse(data, time.monotonic())
            except ValueError as e:
                print(f"cumulus: ignoring a malformed restart offer: {e}", file=sys.stderr)
                continue
            with self._lock:
                self._offer = offer
                self._arrived.set()
            print(
                f"cumulus: in-process restart: this process is now attempt {offer.attempt}; "
                "leaving the step",
                file=sys.stderr,
                flush=True,
            )
            _abort_nccl()
            self._interrupt_later(offer)

    def _interrupt_later(self, offer: RestartOffer) -> None:
        """Raises :class:`RestartRequested` in the function's thread if it is still in the
        function, with the offer not taken, :data:`INTERRUPT_AFTER_S` from now."""
        deadline = time.monotonic() + INTERRUPT_AFTER_S
        while time.monotonic() < deadline:
            if self._offer is not offer or self._stopped.is_set():
                return
            time.sleep(0.05)
        ident = self.target_ident
        if self._offer is offer and self.inside and ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(ident), ctypes.py_object(RestartRequested)
            )


_watcher: _Watcher | None = None


def in_run() -> bool:
    """Whether the calling thread runs a training function under :func:`run`."""
    w = _watcher
    return w is not None and w.target_ident == threading.get_ident()


def check() -> None:
    """Raises :class:`RestartRequested` when the agent has handed this process a new
    attempt and the caller is the thread running the training function under
    :func:`run`; does nothing otherwise (a few hundred nanoseconds)."""
    w = _watcher
    if w is not None and w.offer is not None and w.target_ident == threading.get_ident():
        raise RestartRequested(f"in-process restart to attempt {w.offer.attempt}")


def _looks_like_lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) looks like a collective that failed on a lost
    peer, or a refusal of this attempt's token (the agent retired it)."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 8:
        seen += 1
        if isinstance(e, (RestartRequested, StaleAttempt, ConnectionError, TimeoutError)):
            return True
        name = type(e).__name__
        if name.startswith("Dist") and name.endswith("Error"):
            return True  # torch.distributed's DistError, DistBackendError...
        if isinstance(e, RuntimeError):
            text = str(e).lower()
            words = ("gloo", "nccl", "connection", "peer", "timed out", "timeout", "socket")
            if any(w in text for w in words):
                return True
        e = e.__cause__ or e.__context__
    return False


def _abort_nccl() -> None:
    """Aborts NCCL communicators, so that a collective blocked on a lost peer returns
    (from any thread); nothing without torch.distributed or NCCL."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        if str(dist.get_backend()) != "nccl":
            return
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        abort = getattr(c10d, "_abort_process_group", None)
        if abort is not None:
            abort()
        else:  # older PyTorch: the default group's NCCL backend
            pg = dist.group.WORLD
            backend = pg._get_backend(sys.modules["torch"].device("cuda"))
            backend.abort()
        print("cumulus: in-process restart: NCCL communicators aborted", file=sys.stderr)
    except Exception as e:
        print(f"cumulus: in-process restart: NCCL abort failed: {e}", file=sys.stderr)


def _store_at_master_port(dist: Any) -> bool:
    """Whether the default process group's store is a ``TCPStore`` at ``MASTER_PORT`` (the
    ``env://`` rendezvous, as ``init_process_group`` does by default and torchrun)."""
    try:
        c10d = sys.modules["torch.distributed.distributed_c10d"]
        store = c10d._get_default_store()
        while hasattr(store, "underlying_store"):  # PrefixStore
            store = store.underlying_store
        return isinstance(store, dist.TCPStore) and str(store.port) == os.environ.get(
            RANK_ENV_MASTER_PORT
        )
    except Exception:  # a PyTorch without these: no wait
        return False


def _teardown_distributed() -> tuple[float, bool]:
    """Tears the default process group down (NCCL aborted first) within
    :data:`TEARDOWN_TIMEOUT_S`; returns the seconds it took and whether the group had
    been formed through ``MASTER_PORT``. A teardown that does not finish in time ends the
    process (:data:`EXIT_TEARDOWN_FAILED`): it cannot be reused."""
    start = time.monotonic()
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0.0, False
    env_rendezvous = _store_at_master_port(dist)
    _abort_nccl()
    errors: list[BaseException] = []

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=destroy, name="cumulus-teardown", daemon=True)
    t.start()
    t.join(TEARDOWN_TIMEOUT_S)
    if t.is_alive():
        print(
            f"cumulus: in-process restart: the process group was not torn down within "
            f"{TEARDOWN_TIMEOUT_S:.0f} s: exiting (the job restarts in full)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_TEARDOWN_FAILED)
    if errors and dist.is_initialized():
        print(
            f"cumulus: in-process restart: destroying the process group failed: {errors[0]}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_TEARDOWN_FAILED)
    return time.monotonic() - start, env_rendezvous


def _wait_for_store(watcher: _Watcher) -> float | None:
    """Waits until ``MASTER_ADDR:MASTER_PORT`` (the new attempt's) accepts a connection,
    for at most :data:`STORE_WAIT_S`, or until a newer offer arrives; returns the seconds
    waited, ``None`` when it never listened meanwhile. Nothing to wait for on rank 0,
    which hosts the store."""
    host, port = os.environ.get(RANK_ENV_MASTER_ADDR), os.environ.get(RANK_ENV_MASTER_PORT, "")
    if not host or not port.isdigit() or os.environ.get(RANK_ENV_RANK, "0") == "0":
        return 0.0
    start = time.monotonic()
    while watcher.offer is None:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return time.monotonic() - start
        except OSError:
            pass
        if time.monotonic() - start > STORE_WAIT_S:
            break
        time.sleep(STORE_POLL_S)
    return None


def _apply_env(offer: RestartOffer) -> None:
    for name in CLEARED_VARS:
        os.environ.pop(name, None)
    os.environ.update(offer.env)


def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """See :func:`cumulus.runtime.run`."""
    global _watcher
    from cumulus import runtime as rt_mod  # the package imports this module

    rt = rt_mod.get_runtime()
    if rt.agent is None:  # standalone: nothing restarts in-process
        return fn(*args, **kwargs)
    if _watcher is not None:
        raise RuntimeError("cumulus.runtime.run() is already running in this process")

    def agent() -> Any:
        w = _watcher
        if w is None or w._stopped.is_set():
            return None
        return rt_mod.get_runtime().agent

    watcher = _Watcher(agent)
    watcher.target_ident = threading.get_ident()
    _watcher = watcher
    watcher.start()
    try:
        while True:
            if watcher.offer is not None:  # a newer attempt came while re-entering
                _restart(watcher)
                continue
            try:
                watcher.inside = True
                try:
                    result = fn(*args, **kwargs)
                finally:
                    watcher.inside = False
            except BaseException as e:
                offer = watcher.offer
                if offer is None and isinstance(e, Exception) and _looks_like_lost_peer(e):
                    print(
                        f"cumulus: {type(e).__name__} in the training function looks like a "
                        f"lost peer: waiting up to {PEER_FAILURE_WAIT_S:.0f} s for an "
                        "in-process restart",
                        file=sys.stderr,
                        flush=True,
                    )
                    offer = watcher.wait(PEER_FAILURE_WAIT_S)
                if offer is None:
                    raise
                if not isinstance(e, RestartRequested):
                    print(
                        f"cumulus: in-process restart: the step ended with "
                        f"{type(e).__name__}: {str(e)[:300]}",
                        file=sys.stderr,
                        flush=True,
                    )
            else:
                if watcher.offer is None:
                    return result
                # Handed a new attempt as the function ended: that attempt must run too.
            _restart(watcher)
    finally:
        watcher.stop()
        _watcher = None


def _restart(watcher: _Watcher) -> None:
    """Moves this process to the offered attempt (see the module doc)."""
    from cumulus import runtime as rt_mod

    offer = watcher.offer
    assert offer is not None
    left_s = time.monotonic() - offer.received_at
    teardown_s, env_rendezvous = _teardown_distributed()
    old = rt_mod.get_runtime()
    old._abandon()
    _apply_env(offer)
    new = rt_mod._replace_runtime(old)
    if new.context.agent_token:
        use_token(new.context.agent_token)
    watcher.take()
    assert new.agent is not None
    new.agent.restart_ack()
    hold_s = offer.hold_ms / 1000 - (time.monotonic() - offer.received_at)
    if hold_s > 0:
        time.sleep(hold_s)
    store = ""
    if env_rendezvous:
        waited_s = _wait_for_store(watcher)
        store = (
            f", the new rendezvous store listening after {waited_s * 1000:.0f} ms"
            if waited_s is not None
            else f", the new rendezvous store not listening (waited {STORE_WAIT_S:.0f} s)"
        )
    total_s = time.monotonic() - offer.received_at
    print(
        f"cumulus: in-process restart to attempt {offer.attempt}: left the step in "
        f"{left_s * 1000:.0f} ms, process group torn down in {teardown_s * 1000:.0f} ms, "
        f"re-entering the training function {total_s * 1000:.0f} ms after the restart "
        f"reached this rank (resume step {new.context.resume_step}){store}",
        file=sys.stderr,
        flush=True,
    )
