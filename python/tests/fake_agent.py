"""A stand-in for the worker agent's rank-local API on 127.0.0.1 (or on a Unix domain
socket, as an agent whose ranks run as another user serves it), for unit tests of the
runtime: records every request and answers from a script of responses."""

from __future__ import annotations

import json
import os
import socket
import socketserver
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


@dataclass
class Request:
    path: str
    authorization: str | None
    body: Any
    method: str = "POST"
    #: The calling process (``SO_PEERCRED``), for a request over the Unix socket on Linux.
    peer_pid: int | None = None


#: (status, JSON body or None). A callable gets the request and returns one.
Response = tuple[int, Any]


def _peer_pid(conn: object) -> int | None:
    """The pid of the process at the other end of a Unix socket, where the OS tells."""
    if not isinstance(conn, socket.socket) or conn.family != getattr(socket, "AF_UNIX", None):
        return None
    peercred = getattr(socket, "SO_PEERCRED", None)
    if peercred is None:
        return None
    pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, peercred, 12))
    return int(pid)


class _ThreadingUnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class FakeAgent:
    """Answers ``POST /v1/progress`` with 204 (200 ``{"action": ...}`` once
    :attr:`action` is set to anything but ``"none"``), ``GET /v1/control`` with 200
    ``{"action": <action>}``, and ``POST /v1/checkpoint`` by "committing" the staging dir
    (moving its files to ``<job dir>/<part>``), unless a scripted response is queued for
    the path.

    With ``socket_path`` it serves on that Unix domain socket instead of TCP (and records
    each caller's pid, :attr:`Request.peer_pid`)."""

    def __init__(
        self,
        staging: Path | None = None,
        *,
        rank: int = 0,
        attempt: int = 0,
        socket_path: Path | None = None,
    ) -> None:
        self.staging = staging
        self.socket_path = socket_path
        self.rank = rank
        self.attempt = attempt
        self.requests: list[Request] = []
        self.script: dict[str, list[Response | Callable[[Request], Response]]] = {}
        self.lock = threading.Lock()
        self.progress_delay_s = 0.0
        self.control_delay_s = 0.0
        #: The control action asked of the rank: ``"none"``, ``"stop"``, ``"pause"``...
        self.action = "none"
        agent = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                req = Request(
                    self.path,
                    self.headers.get("Authorization"),
                    json.loads(raw),
                    peer_pid=_peer_pid(self.connection),
                )
                self.reply(agent.answer(req))

            def do_GET(self) -> None:
                req = Request(
                    self.path,
                    self.headers.get("Authorization"),
                    None,
                    "GET",
                    peer_pid=_peer_pid(self.connection),
                )
                self.reply(agent.answer(req))

            def reply(self, response: Response) -> None:
                status, body = response
                if isinstance(body, bytes):  # a raw (e.g. malformed) body
                    data = body
                else:
                    data = b"" if body is None else json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting (a slow answer, on purpose)

        self.server: socketserver.BaseServer
        if socket_path is None:
            tcp = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            tcp.daemon_threads = True
            self.server = tcp
        else:
            self.server = _ThreadingUnixServer(os.fspath(socket_path), Handler)
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def url(self) -> str:
        """The agent's TCP URL (a TCP agent only)."""
        assert isinstance(self.server, ThreadingHTTPServer), "this agent serves a Unix socket"
        return f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> FakeAgent:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self.socket_path is not None:
            self.socket_path.unlink(missing_ok=True)

    def queue(self, path: str, *responses: Response | Callable[[Request], Response]) -> None:
        with self.lock:
            self.script.setdefault(path, []).extend(responses)

    def of(self, path: str) -> list[Request]:
        with self.lock:
            return [r for r in self.requests if r.path == path]

    def answer(self, req: Request) -> Response:
        with self.lock:
            self.requests.append(req)
            scripted = self.script.get(req.path)
            response = scripted.pop(0) if scripted else None
        if callable(response):
            return response(req)
        if response is not None:
            return response
        if req.path == "/v1/progress" and req.method == "POST":
            if self.progress_delay_s:
                threading.Event().wait(self.progress_delay_s)
            action = self.action
            return (204, None) if action == "none" else (200, {"action": action})
        if req.path == "/v1/control" and req.method == "GET":
            if self.control_delay_s:
                threading.Event().wait(self.control_delay_s)
            return 200, {"action": self.action}
        if req.path == "/v1/checkpoint" and req.method == "POST":
            return self.commit(req)
        return 404, {"error": "no such route"}

    def commit(self, req: Request) -> Response:
        """What the agent does: rename staging to the part dir, re-create staging."""
        assert self.staging is not None
        rel = f"step-{req.body['step']:08d}/rank-{self.rank}/attempt-{self.attempt}"
        target = self.staging.parent.parent / rel
        if target.exists():
            return 400, {"error": f"part {rel} is already committed"}
        target.parent.mkdir(parents=True, exist_ok=True)
        self.staging.rename(target)
        self.staging.mkdir()
        return 200, {"dir": rel}
