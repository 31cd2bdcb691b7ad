"""Where the cluster is, its token and its TLS, resolved as ``cumulusctl`` does
(``cli/src/config.rs``): explicit arguments, then the environment (``CUMULUS_HTTP``,
``CUMULUS_TOKEN``, ``CUMULUS_TOKEN_FILE``, ``CUMULUS_TLS_CA``, ``CUMULUS_INSECURE``), then
the local cluster's ``cluster.json`` in ``CUMULUS_LOCAL_DIR`` (default ``.cumulus``), as
written by ``cumulusctl local up``. Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cumulus.errors import ConfigError

__all__ = [
    "CA_FILE",
    "CLUSTER_FILE",
    "DEFAULT_LOCAL_DIR",
    "MAX_PEM_FILE_BYTES",
    "MAX_TOKEN_BYTES",
    "Connection",
    "check_token",
    "load_ca",
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
#: The CA certificate's name in a local cluster's TLS directory (``tls_dir``).
CA_FILE = "ca.pem"
#: Largest CA certificate file read, in bytes (as ``cumulus_tls::MAX_PEM_FILE_BYTES``).
MAX_PEM_FILE_BYTES = 1024 * 1024

_TRUE = frozenset({"1", "true", "yes"})
_FALSE = frozenset({"", "0", "false", "no"})
_PEM_CERTIFICATE = re.compile(
    r"-----BEGIN CERTIFICATE-----\r?\n.*?-----END CERTIFICATE-----", re.DOTALL
)


@dataclass(frozen=True)
class Connection:
    """Where and how to reach the cluster: coordinator base URLs (at least one;
    ``https://host:port`` with TLS, ``http://host:port`` without), the cluster bearer
    token (never shown in ``repr``), and the CA certificate file that verifies the
    coordinators (``None``: plaintext, as ``cumulusctl --insecure``).

    :raises ConfigError: ``ca_file`` is missing, unreadable or not a PEM certificate (it
        is loaded once, here, into :attr:`ssl_context`).
    """

    addresses: tuple[str, ...]
    token: str = field(repr=False)
    ca_file: Path | None = None
    #: Verifies the coordinators against ``ca_file`` only; ``None`` without TLS.
    ssl_context: ssl.SSLContext | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.ca_file is not None:
            object.__setattr__(self, "ssl_context", load_ca(self.ca_file))

    @property
    def tls(self) -> bool:
        """Whether the coordinators are spoken to over TLS."""
        return self.ca_file is not None

    @property
    def scheme(self) -> str:
        """``https`` with TLS, else ``http``."""
        return "https" if self.tls else "http"


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


def load_ca(path: str | os.PathLike[str]) -> ssl.SSLContext:
    """The TLS context of a cluster client: it trusts only the CA certificate(s) in
    ``path`` (PEM, at most 1 MiB; not the system's CAs), and checks that the server's
    certificate names the host dialled (coordinators' name 127.0.0.1, ::1 and localhost).

    :raises ConfigError: naming the file: missing, unreadable, too large, or no usable
        PEM certificate."""
    p = Path(path)
    try:
        data = _read_limited(p, MAX_PEM_FILE_BYTES)
    except ConfigError as e:
        raise ConfigError(f"TLS CA certificate {e}") from e
    blocks = _PEM_CERTIFICATE.findall(data.decode("utf-8", errors="replace"))
    if not blocks:
        raise ConfigError(
            f"TLS CA certificate {p}: holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
        )
    try:
        return ssl.create_default_context(cadata="\n".join(blocks))
    except (ssl.SSLError, ValueError) as e:
        reason = getattr(e, "reason", None) or str(e)
        raise ConfigError(f"TLS CA certificate {p}: not a usable PEM certificate: {reason}") from e


def _host_port(raw: str, origin: str) -> str:
    s = raw.strip()
    for prefix in ("http://", "https://"):
        if s.startswith(prefix):
            s = s[len(prefix) :]
    s = s.rstrip("/")
    host, sep, port = s.rpartition(":")
    bad = ConfigError(f"bad address {raw!r} in {origin}: expected host:port")
    if not sep or not host or "/" in host or " " in host or not port.isdigit():
        raise bad
    if not 0 < int(port) <= 65535:
        raise bad
    return f"{host}:{int(port)}"


def normalize_address(raw: str, origin: str, *, scheme: str = "http") -> str:
    """``host:port``, ``http://host:port/`` or ``https://host:port`` → a base URL
    ``<scheme>://host:port``. A scheme written in ``raw`` is dropped, as ``cumulusctl``
    does: whether a cluster speaks TLS is decided by its CA (see :func:`resolve`).

    :raises ConfigError: not ``host:port`` with a port in 1..=65535."""
    return f"{scheme}://{_host_port(raw, origin)}"


def _split(value: str | Sequence[str]) -> list[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    return [a for a in items if a.strip()]


def _env_flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"bad {name}={raw!r}: expected 1, true or yes (or 0, false, no)")


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
    if not isinstance(parsed.get("tls_dir", ""), (str, type(None))):
        raise ConfigError(f"{path} is not a valid cluster file: tls_dir is not a path")
    return parsed


def resolve(
    addresses: str | Sequence[str] | None = None,
    *,
    token: str | None = None,
    token_file: str | os.PathLike[str] | None = None,
    tls_ca: str | os.PathLike[str] | None = None,
    insecure: bool | None = None,
    local_dir: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Connection:
    """Resolves the coordinator HTTP addresses, the token and TLS.

    Addresses: ``addresses`` (a list, or a comma-separated string), else
    ``$CUMULUS_HTTP``, else the ``http`` of every coordinator in
    ``<local_dir>/cluster.json`` (``local_dir`` defaults to ``$CUMULUS_LOCAL_DIR``, else
    ``.cumulus``). Token: ``token``, else ``token_file``, else ``$CUMULUS_TOKEN``, else
    ``$CUMULUS_TOKEN_FILE``, else the cluster file's ``token_file``.

    TLS (as ``cumulusctl --insecure`` / ``--tls-ca``):

    1. ``insecure`` (default ``$CUMULUS_INSECURE``: ``1``, ``true`` or ``yes``) →
       plaintext ``http://``;
    2. else ``tls_ca`` (default ``$CUMULUS_TLS_CA``) → ``https://``, the coordinators
       verified against that CA certificate only;
    3. else, with the addresses from the cluster file, ``https://`` verified against
       ``<tls_dir>/ca.pem`` when the file has a ``tls_dir``, plaintext when it has none
       (a cluster started with ``cumulusctl --insecure local up``);
    4. else (explicit addresses) a :class:`ConfigError`: say which CA, or that the
       cluster is plaintext.

    Both ``insecure`` and a CA is an error.

    :raises ConfigError: nothing says where the cluster is, what the token is or how to
        verify it, or a value is malformed (the message names where it came from).
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

    # The TLS settings conflict before anything else is looked at (cumulusctl's flags do).
    if insecure is not None:
        plaintext, insecure_origin = bool(insecure), "insecure=True"
    else:
        plaintext, insecure_origin = _env_flag(env, "CUMULUS_INSECURE"), "CUMULUS_INSECURE"
    if tls_ca is not None:
        ca: Path | None = Path(tls_ca)
        ca_origin = "tls_ca="
    elif env.get("CUMULUS_TLS_CA", "").strip():
        ca, ca_origin = Path(env["CUMULUS_TLS_CA"].strip()), "CUMULUS_TLS_CA"
    else:
        ca, ca_origin = None, ""
    if plaintext and ca is not None:
        raise ConfigError(
            f"both {insecure_origin} (plaintext) and {ca_origin} (TLS CA {ca}) are set: set "
            "only one (as cumulusctl requires)"
        )

    from_file = False
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
        from_file = True
    if not raw:
        raise ConfigError(
            "no coordinator HTTP address: pass addresses=[...], set CUMULUS_HTTP, or start "
            f"a local cluster with `cumulusctl local up` (looked for {cluster_path})"
        )
    host_ports = list(dict.fromkeys(_host_port(a, origin) for a in raw))

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

    if plaintext:
        ca_file = None
    elif ca is not None:
        ca_file = ca
    elif from_file:
        f = cluster_file()
        tls_dir = f.get("tls_dir") if f else None
        ca_file = Path(tls_dir) / CA_FILE if isinstance(tls_dir, str) and tls_dir else None
    else:
        raise ConfigError(
            f"no TLS CA certificate for the coordinators at {origin}: set CUMULUS_TLS_CA (or "
            "pass tls_ca=) to the cluster's CA certificate (a local cluster's is "
            "<local-dir>/tls/ca.pem), or CUMULUS_INSECURE=1 (insecure=True) for a cluster "
            "started with --insecure"
        )
    scheme = "http" if ca_file is None else "https"
    urls = tuple(f"{scheme}://{hp}" for hp in host_ports)
    return Connection(addresses=urls, token=tok, ca_file=ca_file)
