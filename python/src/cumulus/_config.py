"""Where the cluster is and its token, resolved as ``cumulusctl`` does
(``cli/src/config.rs``): explicit arguments, then the environment (``CUMULUS_HTTP``,
``CUMULUS_TOKEN``, ``CUMULUS_TOKEN_FILE``), then the local cluster's ``cluster.json`` in
``CUMULUS_LOCAL_DIR`` (default ``.cumulus``), as written by ``cumulusctl local up``.
Standard library only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cumulus.errors import ConfigError

__all__ = [
    "CLUSTER_FILE",
    "DEFAULT_LOCAL_DIR",
    "MAX_TOKEN_BYTES",
    "Connection",
    "check_token",
    "normalize_address",
    "read_token_file",
    "resolve",
]

#: Name of the cluster description inside the local cluster's directory.
CLUSTER_FILE = "cluster.json"
#: ``--local-dir`` default of ``cumulusctl``.
DEFAULT_LOCAL_DIR = ".cumulus"
#: Largest ``cluster.json`` read, in bytes.
MAX_CLUSTER_FILE_BYTES = 1024 * 1024
#: Largest token accepted, in bytes.
MAX_TOKEN_BYTES = 4096


@dataclass(frozen=True)
class Connection:
    """Coordinator HTTP base URLs (``http://host:port``, at least one) and the cluster
    bearer token (never shown in ``repr``)."""

    addresses: tuple[str, ...]
    token: str = field(repr=False)


def _read_limited(path: Path, limit: int) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror or e}") from e
    if len(data) > limit:
        raise ConfigError(f"{path}: larger than {limit} bytes")
    return data


def check_token(token: str, origin: str) -> str:
    """Validates a token (it travels in an HTTP header): non-empty, at most 4096 bytes,
    visible ASCII without spaces.

    :raises ConfigError: naming ``origin`` (an argument, variable or file)."""
    if not token:
        raise ConfigError(f"bad token ({origin}): empty")
    if len(token) > MAX_TOKEN_BYTES:
        raise ConfigError(f"bad token ({origin}): longer than {MAX_TOKEN_BYTES} bytes")
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ConfigError(f"bad token ({origin}): must be visible ASCII without spaces")
    return token


def read_token_file(path: str | os.PathLike[str]) -> str:
    """Reads a token file (surrounding whitespace ignored).

    :raises ConfigError: unreadable, or not a valid token."""
    p = Path(path)
    data = _read_limited(p, MAX_TOKEN_BYTES + 64)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"bad token ({p}): not UTF-8") from e
    return check_token(text.strip(), str(p))


def normalize_address(raw: str, origin: str) -> str:
    """``host:port``, ``http://host:port/`` or ``https://host:port`` → a base URL
    ``http(s)://host:port``.

    :raises ConfigError: not ``host:port`` with a port in 1..=65535."""
    s = raw.strip()
    scheme = "http"
    for prefix in ("http://", "https://"):
        if s.startswith(prefix):
            scheme = prefix[:-3]
            s = s[len(prefix) :]
    s = s.rstrip("/")
    host, sep, port = s.rpartition(":")
    bad = ConfigError(f"bad address {raw!r} in {origin}: expected host:port")
    if not sep or not host or "/" in host or " " in host or not port.isdigit():
        raise bad
    if not 0 < int(port) <= 65535:
        raise bad
    return f"{scheme}://{host}:{int(port)}"


def _split(value: str | Sequence[str]) -> list[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    return [a for a in items if a.strip()]


def _load_cluster_file(local_dir: Path) -> Mapping[str, object] | None:
    path = local_dir / CLUSTER_FILE
    if not path.exists():
        return None
    data = _read_limited(path, MAX_CLUSTER_FILE_BYTES)
    try:
        parsed = json.loads(data)
    except ValueError as e:
        raise ConfigError(f"{path} is not a valid cluster file: {e}") from e
    if not isinstance(parsed, dict) or not isinstance(parsed.get("coordinators"), list):
        raise ConfigError(f"{path} is not a valid cluster file: no coordinators list")
    return parsed


def resolve(
    addresses: str | Sequence[str] | None = None,
    *,
    token: str | None = None,
    token_file: str | os.PathLike[str] | None = None,
    local_dir: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Connection:
    """Resolves the coordinator HTTP addresses and the token.

    Addresses: ``addresses`` (a list, or a comma-separated string), else
    ``$CUMULUS_HTTP``, else the ``http`` of every coordinator in
    ``<local_dir>/cluster.json`` (``local_dir`` defaults to ``$CUMULUS_LOCAL_DIR``, else
    ``.cumulus``). Token: ``token``, else ``token_file``, else ``$CUMULUS_TOKEN``, else
    ``$CUMULUS_TOKEN_FILE``, else the cluster file's ``token_file``.

    :raises ConfigError: nothing says where the cluster is or what the token is, or a
        value is malformed (the message names where it came from).
    """
    env = os.environ if environ is None else environ
    local = Path(
        local_dir if local_dir is not None else env.get("CUMULUS_LOCAL_DIR") or DEFAULT_LOCAL_DIR
    )
    cluster_path = local / CLUSTER_FILE
    file: Mapping[str, object] | None = None

    def cluster_file() -> Mapping[str, object] | None:
        nonlocal file
        if file is None:
            file = _load_cluster_file(local)
        return file

    if addresses is not None:
        raw, origin = _split(addresses), "addresses"
    elif env.get("CUMULUS_HTTP", "").strip():
        raw, origin = _split(env["CUMULUS_HTTP"]), "CUMULUS_HTTP"
    elif env.get("CUMULUS_ADDR", "").strip():
        # cumulusctl: explicit gRPC addresses of another cluster; the local file's HTTP
        # ports would be wrong.
        raise ConfigError(
            "CUMULUS_ADDR names coordinator gRPC addresses, but the Python client speaks "
            "HTTP: set CUMULUS_HTTP (or pass addresses=[...]) to the coordinators' HTTP "
            "host:port"
        )
    else:
        f = cluster_file()
        coordinators = f.get("coordinators") if f else None
        raw = [
            str(c["http"])
            for c in (coordinators if isinstance(coordinators, list) else [])
            if isinstance(c, dict) and isinstance(c.get("http"), str)
        ]
        origin = str(cluster_path)
    if not raw:
        raise ConfigError(
            "no coordinator HTTP address: pass addresses=[...], set CUMULUS_HTTP, or start "
            f"a local cluster with `cumulusctl local up` (looked for {cluster_path})"
        )
    urls = tuple(dict.fromkeys(normalize_address(a, origin) for a in raw))

    if token is not None:
        tok = check_token(token.strip(), "token argument")
    elif token_file is not None:
        tok = read_token_file(token_file)
    elif env.get("CUMULUS_TOKEN") and env.get("CUMULUS_TOKEN_FILE"):
        raise ConfigError(
            "both CUMULUS_TOKEN and CUMULUS_TOKEN_FILE are set; set only one (as cumulusctl "
            "requires)"
        )
    elif env.get("CUMULUS_TOKEN"):
        tok = check_token(env["CUMULUS_TOKEN"].strip(), "CUMULUS_TOKEN")
    elif env.get("CUMULUS_TOKEN_FILE"):
        tok = read_token_file(env["CUMULUS_TOKEN_FILE"])
    else:
        f = cluster_file()
        token_path = f.get("token_file") if f else None
        if not isinstance(token_path, str) or not token_path:
            raise ConfigError(
                "no token: pass token=/token_file=, set CUMULUS_TOKEN_FILE, or start a "
                f"local cluster with `cumulusctl local up` (looked for {cluster_path})"
            )
        tok = read_token_file(token_path)
    return Connection(addresses=urls, token=tok)
