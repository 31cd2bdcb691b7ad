"""The SDK talks only to coordinators: a process on a free loopback port serving a
certificate that the cluster CA issued to a worker (made by ``cumulusctl certs init``) is
refused right after the TLS handshake, before the request and its token are written;
the same process serving a coordinator's certificate is answered."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import cumulus
from localcluster import bin_dir


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cluster CA with certificates for coordinator 1 and worker ``w-imp``."""
    ctl = bin_dir() / "cumulusctl"
    if not os.access(ctl, os.X_OK):
        pytest.skip(f"cumulusctl not found in {bin_dir()} (run `cargo build`)")
    d = tmp_path_factory.mktemp("pki") / "tls"
    args = ["certs", "init", "--dir", str(d), "--coordinators", "1", "--workers", "w-imp"]
    subprocess.run([str(ctl), *args], check=True, capture_output=True, timeout=60)
    return d


@dataclass
class Server:
    """A TLS server on 127.0.0.1 that answers every request with ``/health``'s JSON."""

    port: int
    received: bytearray = field(default_factory=bytearray)


@pytest.fixture
def serve(pki: Path) -> Iterator[Callable[[str], Server]]:
    """Starts a one-connection server presenting ``<name>.pem``; stopped at teardown."""
    started: list[tuple[socket.socket, threading.Thread]] = []

    def start(name: str) -> Server:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki / f"{name}.pem", pki / f"{name}-key.pem")
        listener = socket.create_server(("127.0.0.1", 0))
        server = Server(port=listener.getsockname()[1])

        def run() -> None:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed at teardown without a client
            try:
                with context.wrap_socket(conn, server_side=True) as tls:
                    tls.settimeout(10)
                    while b"\r\n\r\n" not in server.received:
                        chunk = tls.recv(4096)
                        if not chunk:
                            return
                        server.received += chunk
                    body = b'{"node_id": 1, "leader_id": 1, "term": 2}'
                    tls.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
                    )
            except OSError:
                return  # the client refused the handshake or went away

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        started.append((listener, thread))
        return server

    yield start
    for listener, thread in started:
        listener.close()
        thread.join(timeout=10)


def client(pki: Path, port: int) -> cumulus.Client:
    return cumulus.Client(
        f"127.0.0.1:{port}",
        token="cu.test.token",
        tls_ca=pki / "ca.pem",
        retry_max_tries=1,
    )


def test_a_worker_certificate_on_a_coordinator_address_gets_no_request(
    pki: Path, serve: Callable[[str], Server]
) -> None:
    server = serve("w-imp")
    with client(pki, server.port) as c, pytest.raises(cumulus.NotACoordinator) as refused:
        c.cluster()
    assert refused.value.found == "cumulus://worker/w-imp"
    assert refused.value.address == f"127.0.0.1:{server.port}"
    assert "cumulus://worker/w-imp" in str(refused.value)
    assert "is not a coordinator" in str(refused.value)
    assert bytes(server.received) == b"", "nothing (no token) was sent"


def test_a_coordinator_certificate_is_answered(pki: Path, serve: Callable[[str], Server]) -> None:
    server = serve("coordinator-1")
    with client(pki, server.port) as c:
        assert c.health(f"127.0.0.1:{server.port}")["node_id"] == 1
    assert bytes(server.received).startswith(b"GET /health ")
