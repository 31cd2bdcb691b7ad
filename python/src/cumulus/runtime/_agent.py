"""Client of the worker agent's rank-local HTTP API (docs/architecture.md, "Rank-local HTTP
API"), standard library only: ``POST /v1/progress``, ``POST /v1/checkpoint``, ``GET
/v1/control``, ``GET /v1/checkpoints`` and ``POST /v1/exception``, all with ``Authorization: Bearer
$CUMULUS_AGENT_TOKEN``, over TCP to ``CUMULUS_AGENT_URL`` or, when the agent sets
``CUMULUS_AGENT_SOCKET`` (ranks run as another user than the agent), over that Unix
domain socket.

It mirrors the Rust example trainer's client (``examples/src/agent.rs``): 2xx is success,
401 and 409 mean this attempt is stale (:class:`~cumulus.errors.StaleAttempt`), any other
status is an :class:`~cumulus.errors.AgentError` with the agent's message, and no answer
at all is an :class:`~cumulus.errors.AgentError` with ``status=None``.

A rank whose process ends on such an error, uncaught (or on a
:class:`~cumulus.errors.CheckpointFailed` caused by one), exits with
:data:`~cumulus._contract.EXIT_AGENT_UNREACHABLE` (75) instead of Python's 1 once the
process-wide runtime is made (:func:`install_unreachable_exit`): the agent then counts the
failure as its own when it saw its rank API turn connections away, and the job's restart
budget is not spent (docs/scheduling.md).
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from cumulus import _metrics
from cumulus._contract import (
    EXIT_AGENT_UNREACHABLE,
    RANK_ACTION_NONE,
    RANK_MAX_LISTED_STEPS,
    RANK_MAX_REPLY_BYTES,
)
from cumulus.errors import AgentError, CheckpointFailed, StaleAttempt

__all__ = [
    "ACTION_NONE",
    "CHECKPOINT_TIMEOUT_S",
    "CONTROL_TIMEOUT_S",
    "LIST_TIMEOUT_S",
    "MAX_ACTION_BYTES",
    "MAX_LISTED_STEPS",
    "MAX_REPLY_BYTES",
    "PROGRESS_TIMEOUT_S",
    "AgentClient",
    "agent_unreachable",
    "install_unreachable_exit",
    "parse_action",
]

#: Time limit of one progress request, in seconds.
PROGRESS_TIMEOUT_S = 2.0
#: Time limit of one ``GET /v1/checkpoints``, in seconds (the agent reads the step
#: manifests, from S3 for an S3 checkpoint target).
LIST_TIMEOUT_S = 30.0
#: Most steps one ``GET /v1/checkpoints`` reply may list.
MAX_LISTED_STEPS = RANK_MAX_LISTED_STEPS
#: Time limit of one checkpoint commit request, in seconds (the agent hashes and fsyncs
#: every file and waits for the leader before it answers).
CHECKPOINT_TIMEOUT_S = 60.0
#: Time limit of one ``GET /v1/control`` poll, in seconds: short, since the training loop
#: waits for it (see :func:`cumulus.runtime.should_stop`).
CONTROL_TIMEOUT_S = 0.5
#: Most bytes of a reply body that are read.
MAX_REPLY_BYTES = RANK_MAX_REPLY_BYTES
#: The control action that asks nothing ("keep going").
ACTION_NONE = RANK_ACTION_NONE
#: Longest action accepted in a reply, in bytes (the known ones are far shorter).
MAX_ACTION_BYTES = 64
_ACTION_NAME = re.compile(r"[a-z][a-z0-9_]*")


class _UnixHTTPConnection(http.client.HTTPConnection):
    """Plain HTTP/1.1 over a Unix domain socket. ``host``/``port`` only make the ``Host``
    header; the connection goes to ``socket_path``."""

    def __init__(self, socket_path: str, host: str, port: int | None, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _error_message(body: bytes) -> str:
    """The ``error`` field of a ``{"error": ...}`` body, else the body's start."""
    text = body.decode("utf-8", errors="replace")
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), str):
        return str(parsed["error"])
    return text.strip()[:500]


def parse_action(data: bytes) -> str:
    """The ``action`` of an ``{"action": "..."}`` reply body.

    :raises ValueError: the body is not such a JSON object, or the action is empty, too
        long or not a plain lowercase name."""
    try:
        reply = json.loads(data)
    except ValueError as e:
        raise ValueError("not JSON") from e
    action = reply.get("action") if isinstance(reply, dict) else None
    if not isinstance(action, str):
        raise ValueError("no 'action' string")
    if not action or len(action) > MAX_ACTION_BYTES or not _ACTION_NAME.fullmatch(action):
        raise ValueError(f"action {action[:MAX_ACTION_BYTES]!r} is not a lowercase name")
    return action


class AgentClient:
    """A client of one agent, for one attempt's token.

    Each request opens its own connection (loopback TCP, or the agent's Unix socket):
    the agent closes keep-alive connections idle for 10 s, and a fresh connection never
    races that close. Proxies are never used (``http.client`` ignores ``HTTP_PROXY``).
    """

    def __init__(self, base_url: str, token: str, socket_path: str | None = None) -> None:
        """:param base_url: e.g. ``http://127.0.0.1:41234`` (``CUMULUS_AGENT_URL``).
        :param token: the attempt's bearer token (``CUMULUS_AGENT_TOKEN``).
        :param socket_path: the agent's Unix domain socket (``CUMULUS_AGENT_SOCKET``), or
            ``None``. When given, every request goes through it as plain HTTP/1.1: the
            path of ``base_url`` still prefixes each request, its scheme, host and port
            are not dialled (they only make the ``Host`` header).
        :raises ValueError: the URL is not ``http(s)://host:port``."""
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"agent URL {base_url!r} is not an http:// or https:// URL")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self._token = token
        self.base_url = base_url.rstrip("/")
        #: The agent's Unix socket, ``None`` over TCP.
        self.socket_path = socket_path
        self._where = (
            self.base_url if socket_path is None else f"{self.base_url} (Unix socket {socket_path})"
        )

    def __repr__(self) -> str:
        if self.socket_path is None:
            return f"AgentClient({self.base_url!r})"
        return f"AgentClient({self.base_url!r}, socket_path={self.socket_path!r})"

    def _request(
        self, method: str, path: str, body: Mapping[str, Any] | None, timeout_s: float
    ) -> tuple[int, bytes]:
        payload = (
            None
            if body is None
            else json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
        )
        headers = {"Authorization": f"Bearer {self._token}", "Connection": "close"}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        conn: http.client.HTTPConnection
        if self.socket_path is not None:
            conn = _UnixHTTPConnection(self.socket_path, self._host, self._port, timeout_s)
        elif self._https:
            conn = http.client.HTTPSConnection(self._host, self._port, timeout=timeout_s)
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
        try:
            conn.request(method, self._prefix + path, body=payload, headers=headers)
            resp = conn.getresponse()
            data = resp.read(MAX_REPLY_BYTES)
            return resp.status, data
        except (OSError, http.client.HTTPException) as e:
            kind = "timed out" if isinstance(e, (TimeoutError, socket.timeout)) else "failed"
            raise AgentError(
                f"{method} {path} to the agent at {self._where} {kind}: {e or type(e).__name__}",
                status=None,
            ) from e
        finally:
            conn.close()

    def _post(self, path: str, body: Mapping[str, Any], timeout_s: float) -> tuple[int, bytes]:
        return self._request("POST", path, body, timeout_s)

    @staticmethod
    def _check(path: str, status: int, body: bytes) -> None:
        if 200 <= status < 300:
            return
        message = _error_message(body)
        if status in (401, 409):
            raise StaleAttempt(
                f"the agent rejected this attempt as stale (HTTP {status} on {path}): {message}",
                status=status,
            )
        raise AgentError(f"the agent answered HTTP {status} on {path}: {message}", status=status)

    def progress(
        self,
        step: int,
        total_steps: int | None,
        metrics: Mapping[str, float],
        *,
        timeout_s: float = PROGRESS_TIMEOUT_S,
    ) -> str | None:
        """``POST /v1/progress``. Returns the action the agent asks of this rank (see
        :meth:`control`) when its reply carries one other than ``"none"`` (a 200 with
        ``{"action": ...}``), else ``None`` (204, or a reply without a readable action:
        any 2xx is a success).

        :raises StaleAttempt: 401/409.
        :raises AgentError: any other failure.
        """
        # NaN and the infinities travel as strings (cumulus_api::metric_json).
        body: dict[str, Any] = {
            "step": step,
            "metrics": {name: _metrics.encode(value) for name, value in metrics.items()},
        }
        if total_steps is not None:
            body["total_steps"] = total_steps
        status, data = self._post("/v1/progress", body, timeout_s)
        self._check("/v1/progress", status, data)
        if not data.strip():
            return None
        try:
            action = parse_action(data)
        except ValueError:
            return None
        return None if action == ACTION_NONE else action

    def control(self, *, timeout_s: float = CONTROL_TIMEOUT_S) -> str:
        """``GET /v1/control``: what the agent asks of this rank now, one of ``"none"``
        (keep going), ``"stop"`` (the attempt is no longer wanted: exit), ``"pause"``
        (checkpoint and exit 0: the job resumes later), ``"time_limit"`` (checkpoint and
        exit 0: the job's time limit is near) and ``"preempt"`` (as a pause; the
        scheduler requeues the job). A newer agent may answer other actions: each is a
        request to stop.

        :raises StaleAttempt: 401/409: the attempt has ended.
        :raises AgentError: any other failure, or a malformed reply.
        """
        status, data = self._request("GET", "/v1/control", None, timeout_s)
        self._check("/v1/control", status, data)
        try:
            return parse_action(data)
        except ValueError as e:
            raise AgentError(
                f"the agent's reply to GET /v1/control is malformed ({e}): {data[:200]!r}",
                status=status,
            ) from e

    def report_exception(self, report: Mapping[str, Any], *, timeout_s: float = 2.0) -> None:
        """``POST /v1/exception``: the uncaught exception this rank is about to die of
        (``{"type", "message", "frames", "origin"}``, see
        :func:`cumulus.runtime._failure.describe_exception`); the agent reports it as the
        cause of the attempt's exit.

        :raises StaleAttempt: 401/409: the attempt has ended.
        :raises AgentError: any other failure (400: a field past its bound).
        """
        status, data = self._post("/v1/exception", report, timeout_s)
        self._check("/v1/exception", status, data)

    def restart_poll(self, *, timeout_s: float) -> bytes | None:
        """``GET /v1/restart?timeout_ms=...``: waits up to ``timeout_s`` for an in-process
        restart to hand this process a new attempt (see
        :mod:`cumulus.runtime._inprocess`); returns the offer's JSON body, or ``None``
        when none came (204).

        :raises StaleAttempt: 401/409: the token names no live attempt (ended).
        :raises AgentError: any other failure (503: too many polls at once; retry later).
        """
        wait_ms = max(0, int(timeout_s * 1000))
        path = f"/v1/restart?timeout_ms={wait_ms}"
        status, data = self._request("GET", path, None, timeout_s + PROGRESS_TIMEOUT_S + 3.0)
        self._check("/v1/restart", status, data)
        return None if status == 204 else data

    def restart_ack(self, *, timeout_s: float = PROGRESS_TIMEOUT_S) -> None:
        """``POST /v1/restart`` under the new attempt's token: this process took the
        in-process restart (left its step, tore its process group down); the agent
        reports the attempt started.

        :raises StaleAttempt: 401/409: the token is unknown, or no restart was offered.
        :raises AgentError: any other failure.
        """
        status, data = self._post("/v1/restart", {}, timeout_s)
        self._check("/v1/restart", status, data)

    def checkpoints(self, *, timeout_s: float = LIST_TIMEOUT_S) -> list[int]:
        """``GET /v1/checkpoints``: the committed steps of this rank's job, ascending (the
        step ``LATEST`` names and every older one with a valid manifest; at most the
        newest :data:`MAX_LISTED_STEPS`; empty for a job without checkpoints).

        :raises StaleAttempt: 401/409: the attempt has ended.
        :raises AgentError: any other failure, or a malformed reply.
        """
        status, data = self._request("GET", "/v1/checkpoints", None, timeout_s)
        self._check("/v1/checkpoints", status, data)
        try:
            reply = json.loads(data)
        except ValueError:
            reply = None
        steps = reply.get("steps") if isinstance(reply, dict) else None
        if (
            not isinstance(steps, list)
            or len(steps) > MAX_LISTED_STEPS
            or not all(
                isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**64 for s in steps
            )
        ):
            raise AgentError(
                f"the agent's reply to GET /v1/checkpoints is malformed: {data[:200]!r}",
                status=status,
            )
        return sorted(set(steps))

    def commit_checkpoint(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        timeout_s: float = CHECKPOINT_TIMEOUT_S,
    ) -> str:
        """``POST /v1/checkpoint``: asks the agent to commit the staging dir as this
        attempt's part of ``step``. Returns the committed part's directory relative to the
        job's checkpoint dir, e.g. ``step-00000100/rank-0/attempt-1``.

        :raises StaleAttempt: 401/409: this attempt must stop.
        :raises AgentError: any other failure (``status`` 502/503 and ``None`` are worth
            retrying; see :class:`~cumulus.runtime.Checkpointer`).
        """
        status, data = self._post("/v1/checkpoint", {"step": step, "state": dict(state)}, timeout_s)
        self._check("/v1/checkpoint", status, data)
        try:
            reply = json.loads(data)
        except ValueError:
            reply = None
        if not isinstance(reply, dict) or not isinstance(reply.get("dir"), str):
            raise AgentError(
                f"the agent's reply to POST /v1/checkpoint is malformed: {data[:200]!r}",
                status=status,
            )
        return str(reply["dir"])


def agent_unreachable(exc: BaseException | None) -> bool:
    """Whether ``exc`` says the agent never answered: an
    :class:`~cumulus.errors.AgentError` with ``status`` ``None`` (connection refused or
    reset, timeout, a missing socket), or a :class:`~cumulus.errors.CheckpointFailed`
    whose ``__cause__`` is one (every retry of a commit got no answer, the last one
    included)."""
    if isinstance(exc, CheckpointFailed):
        exc = exc.__cause__
    return isinstance(exc, AgentError) and not isinstance(exc, StaleAttempt) and exc.status is None


_ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]
_installed_hook: _ExceptHook | None = None


def install_unreachable_exit() -> None:
    """Chains a :data:`sys.excepthook` (once per process) that, after the hook before it
    (the traceback is printed as usual), ends a process whose uncaught exception is
    :func:`agent_unreachable` with :data:`~cumulus._contract.EXIT_AGENT_UNREACHABLE`
    instead of Python's 1: the exit handlers run, then :func:`os._exit`. An exception the
    script catches is left alone, and so is every other uncaught one. The process-wide
    runtime installs it when it is made in a Cumulus rank."""
    global _installed_hook
    if _installed_hook is not None and sys.excepthook is _installed_hook:
        return
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        previous(exc_type, exc, tb)
        if not agent_unreachable(exc):
            return
        try:
            print(
                f"cumulus: the worker agent's rank-local API never answered; exiting with "
                f"code {EXIT_AGENT_UNREACHABLE} (the agent counts it as its own failure "
                "when it turned this rank's connections away)",
                file=sys.stderr,
            )
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            os._exit(EXIT_AGENT_UNREACHABLE)

    sys.excepthook = hook
    _installed_hook = hook
