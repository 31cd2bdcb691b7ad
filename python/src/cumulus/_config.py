"""Where the cluster is, its token and its TLS, resolved as ``cumulusctl`` does
(``cli/src/config.rs``): explicit arguments, then the environment (``CUMULUS_HTTP``,
``CUMULUS_TOKEN``, ``CUMULUS_TOKEN_FILE``, ``CUMULUS_TLS_CA``, ``CUMULUS_TLS_CERT``,
``CUMULUS_TLS_KEY``, ``CUMULUS_INSECURE``), then the local cluster's ``cluster.json`` in
``CUMULUS_LOCAL_DIR`` (default ``.cumulus``), as written by ``cumulusctl local up``.
Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from cumulus import _contract
from cumulus._contract import (
    CLIENT_ENV_ADDR,
    CLIENT_ENV_HTTP,
    CLIENT_ENV_INSECURE,
    CLIENT_ENV_LOCAL_DIR,
    CLIENT_ENV_TLS_CA,
    CLIENT_ENV_TLS_CERT,
    CLIENT_ENV_TLS_KEY,
    CLIENT_ENV_TOKEN,
    CLIENT_ENV_TOKEN_FILE,
    ClusterFileJson,
)
from cumulus.errors import ConfigError, NotACoordinator

__all__ = [
    "CA_FILE",
    "CLUSTER_FILE",
    "DEFAULT_LOCAL_DIR",
    "IDENTITY_SCHEME",
    "MAX_PEM_FILE_BYTES",
    "MAX_TOKEN_BYTES",
    "Connection",
    "check_coordinator",
    "check_token",
    "load_ca",
    "load_client_certificate",
    "normalize_address",
    "read_token_file",
    "resolve",
]

#: Name of the cluster description inside the local cluster's directory.
CLUSTER_FILE = _contract.CLUSTER_FILE
#: ``--local-dir`` default of ``cumulusctl``.
DEFAULT_LOCAL_DIR = _contract.DEFAULT_LOCAL_DIR
#: Largest ``cluster.json`` read, in bytes.
MAX_CLUSTER_FILE_BYTES = _contract.MAX_CLUSTER_FILE_BYTES
#: Largest token accepted, in bytes.
MAX_TOKEN_BYTES = _contract.MAX_TOKEN_BYTES
#: The CA certificate's name in a local cluster's TLS directory (``tls_dir``).
CA_FILE = _contract.CA_FILE
#: Largest CA certificate file read, in bytes (as ``cumulus_tls::MAX_PEM_FILE_BYTES``).
MAX_PEM_FILE_BYTES = _contract.MAX_PEM_FILE_BYTES

_TRUE = frozenset({"1", "true", "yes"})
_FALSE = frozenset({"", "0", "false", "no"})
_PEM_CERTIFICATE = re.compile(
    r"-----BEGIN CERTIFICATE-----\r?\n.*?-----END CERTIFICATE-----", re.DOTALL
)
_PEM_PRIVATE_KEY = re.compile(r"-----BEGIN ((?:[A-Z0-9]+ )*)PRIVATE KEY-----")
#: A certificate's identity: ``cumulus://KIND/NAME`` (``cumulus_tls::Identity``).
IDENTITY_SCHEME = _contract.IDENTITY_SCHEME
_IDENTITY_NAME = re.compile(r"[A-Za-z0-9._\-@]{1,128}")


@dataclass(frozen=True)
class Connection:
    """Where and how to reach the cluster: coordinator base URLs (at least one;
    ``https://host:port`` with TLS, ``http://host:port`` without), the bearer token (the
    cluster's or a user's; never shown in ``repr``; ``None``: no ``Authorization`` header,
    the client certificate authenticates), the CA certificate file that verifies the
    coordinators (``None``: plaintext, as ``cumulusctl --insecure``), and a user's client
    certificate and its private key (PEM files, as ``cumulusctl --tls-cert/--tls-key``;
    both or neither, and only with a CA).

    :raises ConfigError: ``ca_file`` is missing, unreadable or not a PEM certificate, or
        the client certificate or key cannot be used (see
        :func:`load_client_certificate`): they are loaded once, here, into
        :attr:`ssl_context`; or there is neither a token nor a client certificate.
    """

    addresses: tuple[str, ...]
    token: str | None = field(repr=False)
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    #: Verifies the coordinators against ``ca_file`` only, and presents the client
    #: certificate when there is one; ``None`` without TLS.
    ssl_context: ssl.SSLContext | None = field(default=None, init=False, repr=False, compare=False)
    #: The user the client certificate names (``cumulus://user/NAME``), ``None`` without
    #: one (or when this Python cannot read certificates' names).
    cert_user: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            given, missing = (
                (f"cert_file {self.cert_file}", "key_file")
                if self.key_file is None
                else (f"key_file {self.key_file}", "cert_file")
            )
            raise ConfigError(
                f"a TLS client certificate needs both files: {given} without {missing}"
            )
        if self.token is None and self.cert_file is None:
            raise ConfigError("no credential: neither a token nor a TLS client certificate")
        if self.cert_file is not None and self.ca_file is None:
            raise ConfigError(
                f"the TLS client certificate {self.cert_file} needs TLS: a CA certificate "
                "(ca_file) to verify the coordinators with"
            )
        if self.ca_file is not None:
            context = load_ca(self.ca_file)
            if self.cert_file is not None and self.key_file is not None:
                user = load_client_certificate(context, self.cert_file, self.key_file)
                object.__setattr__(self, "cert_user", user)
            object.__setattr__(self, "ssl_context", context)

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


def check_coordinator(peer_cert: Mapping[str, Any] | None, address: str) -> None:
    """Checks that a verified server certificate (``SSLSocket.getpeercert()``) names a
    coordinator: exactly one ``cumulus://`` URI subject alternative name, of the form
    ``cumulus://coordinator/N`` (N ≥ 1).

    :raises NotACoordinator: naming ``address`` and what the certificate names."""
    names = (peer_cert or {}).get("subjectAltName", ())
    uris = [
        str(value)
        for kind, value in names
        if kind == "URI" and str(value).startswith(IDENTITY_SCHEME)
    ]
    if len(uris) == 1:
        kind, _, node = uris[0][len(IDENTITY_SCHEME) :].partition("/")
        if kind == "coordinator" and node.isdigit() and int(node) > 0:
            return
    found = ", ".join(uris) if uris else "no cumulus:// identity"
    raise NotACoordinator(
        f"{address} is not a coordinator (cumulus://coordinator/N): its certificate, "
        f"issued by the cluster CA, names {found}; nothing was sent to it",
        address=address,
        found=found,
    )


class _CoordinatorSocket(ssl.SSLSocket):
    """A client TLS socket that accepts only a coordinator: :func:`check_coordinator`
    right after the handshake, before a byte of the request is written."""

    def do_handshake(self, block: bool = False) -> None:
        super().do_handshake(block)
        try:
            host, port = self.getpeername()[:2]
            check_coordinator(self.getpeercert(), f"{self.server_hostname or host}:{port}")
        except NotACoordinator:
            self.close()
            raise


def load_ca(path: str | os.PathLike[str]) -> ssl.SSLContext:
    """The TLS context of a cluster client: it trusts only the CA certificate(s) in
    ``path`` (PEM, at most 1 MiB; not the system's CAs), and checks that the server's
    certificate names the host dialled (coordinators' name 127.0.0.1, ::1 and localhost)
    and a coordinator (:func:`check_coordinator`: a worker's or a user's certificate,
    though issued by the same CA, is refused with :class:`NotACoordinator`).

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
        context = ssl.create_default_context(cadata="\n".join(blocks))
        context.sslsocket_class = _CoordinatorSocket
        return context
    except (ssl.SSLError, ValueError) as e:
        reason = getattr(e, "reason", None) or str(e)
        raise ConfigError(f"TLS CA certificate {p}: not a usable PEM certificate: {reason}") from e


def _certificate_identities(path: Path) -> list[str] | None:
    """The ``cumulus://`` URI subject alternative names of the PEM certificate in
    ``path``; ``None`` when this Python cannot tell (CPython's certificate decoder is
    missing, or the file does not decode: loading it reports that)."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None
    try:
        decoded = decode(os.fspath(path))
    except (ssl.SSLError, OSError, ValueError):
        return None
    names = decoded.get("subjectAltName", ()) if isinstance(decoded, dict) else ()
    return [
        str(value)
        for kind, value in names
        if kind == "URI" and str(value).startswith(IDENTITY_SCHEME)
    ]


def load_client_certificate(
    context: ssl.SSLContext,
    cert: str | os.PathLike[str],
    key: str | os.PathLike[str],
) -> str | None:
    """Loads a user's client certificate and its private key (PEM files, each at most
    1 MiB, as ``cumulusctl certs issue user NAME`` writes them: ``user-NAME.pem`` and
    ``user-NAME-key.pem``) into ``context``, which then presents them to the
    coordinators. Without a token, the coordinators take the request as that user's.

    :returns: the user the certificate names (``cumulus://user/NAME``), or ``None`` when
        this Python cannot read certificates' names.
    :raises ConfigError: naming the file: missing, unreadable, too large, no PEM
        certificate (or private key), an encrypted key (a passphrase is never asked
        for), a key that does not match the certificate, or a certificate that names a
        coordinator or a worker rather than a user."""
    cert_path, key_path = Path(cert), Path(key)
    try:
        cert_data = _read_limited(cert_path, MAX_PEM_FILE_BYTES)
    except ConfigError as e:
        raise ConfigError(f"TLS client certificate {e}") from e
    if not _PEM_CERTIFICATE.search(cert_data.decode("utf-8", errors="replace")):
        raise ConfigError(
            f"TLS client certificate {cert_path}: holds no PEM certificate "
            "(-----BEGIN CERTIFICATE-----)"
        )
    try:
        key_data = _read_limited(key_path, MAX_PEM_FILE_BYTES)
    except ConfigError as e:
        raise ConfigError(f"TLS client key {e}") from e
    key_text = key_data.decode("utf-8", errors="replace")
    key_block = _PEM_PRIVATE_KEY.search(key_text)
    if key_block is None:
        raise ConfigError(
            f"TLS client key {key_path}: holds no PEM private key (-----BEGIN PRIVATE KEY-----)"
        )
    if "ENCRYPTED" in key_block.group(1) or "Proc-Type: 4,ENCRYPTED" in key_text:
        raise ConfigError(
            f"TLS client key {key_path}: is encrypted; a passphrase-protected key is not "
            "supported (use the unencrypted key `cumulusctl certs issue user` writes)"
        )

    identities = _certificate_identities(cert_path)
    user: str | None = None
    if identities is not None:
        issue = "issue one with `cumulusctl certs issue user NAME --dir CA_DIR`"
        if len(identities) != 1:
            what = "no" if not identities else "more than one"
            raise ConfigError(
                f"TLS client certificate {cert_path}: names {what} cumulus:// identity, "
                f"not one user (cumulus://user/NAME): {issue}"
            )
        kind, _, name = identities[0][len(IDENTITY_SCHEME) :].partition("/")
        if kind != "user" or not _IDENTITY_NAME.fullmatch(name):
            raise ConfigError(
                f"TLS client certificate {cert_path}: names {identities[0]}, not a user "
                f"(cumulus://user/NAME): {issue}"
            )
        user = name

    def no_passphrase() -> bytes:
        # Never let OpenSSL prompt on the terminal for a passphrase.
        raise ConfigError(f"TLS client key {key_path}: is encrypted; not supported")

    try:
        context.load_cert_chain(cert_path, key_path, password=no_passphrase)
    except ConfigError:
        raise
    except ssl.SSLError as e:
        if getattr(e, "reason", None) == "KEY_VALUES_MISMATCH":
            raise ConfigError(
                f"TLS client key {key_path} does not match the certificate {cert_path}"
            ) from e
        reason = getattr(e, "reason", None) or str(e)
        raise ConfigError(
            f"TLS client certificate {cert_path} (key {key_path}): not a usable PEM "
            f"certificate and key: {reason}"
        ) from e
    except OSError as e:  # replaced or removed since it was read
        raise ConfigError(
            f"TLS client certificate {cert_path} (key {key_path}): {e.strerror or e}"
        ) from e
    return user


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


def _path_setting(
    value: str | os.PathLike[str] | None, argument: str, env: Mapping[str, str], variable: str
) -> tuple[Path | None, str]:
    """A file setting and where it came from: the argument, else the (non-blank)
    variable, else ``(None, "")``."""
    if value is not None:
        return Path(value), argument
    raw = env.get(variable, "").strip()
    return (Path(raw), variable) if raw else (None, "")


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


def _load_cluster_file(local_dir: Path) -> ClusterFileJson | None:
    """The local cluster's ``cluster.json``, its shape checked as far as this module reads
    it (``None`` when there is none)."""
    path = local_dir / CLUSTER_FILE
    if not path.exists():
        return None
    data = _read_limited(path, MAX_CLUSTER_FILE_BYTES)
    try:
        parsed = json.loads(data)
    except ValueError as e:
        raise ConfigError(f"{path} is not a valid cluster file: {e}") from e
    # Typed as the contract's shape (mypy checks the field names); the values are checked
    # here and where they are read.
    cluster = cast(ClusterFileJson, parsed) if isinstance(parsed, dict) else None
    if cluster is None or not isinstance(cluster.get("coordinators"), list):
        raise ConfigError(f"{path} is not a valid cluster file: no coordinators list")
    tls_dir: object = cluster.get("tls_dir", "")
    if not isinstance(tls_dir, (str, type(None))):
        raise ConfigError(f"{path} is not a valid cluster file: tls_dir is not a path")
    return cluster


class _LocalCluster:
    """The local cluster's directory and its ``cluster.json``, read the first time a
    setting needs it (never when the arguments and the environment say it all)."""

    def __init__(self, local_dir: Path) -> None:
        self.dir = local_dir
        #: Where ``cluster.json`` is looked for (named in error messages).
        self.path = local_dir / CLUSTER_FILE
        self._file: ClusterFileJson | None = None

    def file(self) -> ClusterFileJson | None:
        """The parsed ``cluster.json``, ``None`` when there is none.

        :raises ConfigError: it is malformed (see :func:`_load_cluster_file`)."""
        if self._file is None:
            self._file = _load_cluster_file(self.dir)
        return self._file


@dataclass(frozen=True)
class _TlsSettings:
    """The TLS choices of :func:`resolve`'s arguments and the environment, each with
    where it came from (for error messages); they do not conflict."""

    plaintext: bool
    insecure_origin: str
    ca: Path | None
    ca_origin: str
    cert: Path | None
    cert_origin: str
    key: Path | None

    @property
    def certified(self) -> bool:
        """A client certificate (and its key) is given."""
        return self.cert is not None


def _ca_setting(
    tls_ca: str | os.PathLike[str] | None, env: Mapping[str, str]
) -> tuple[Path | None, str]:
    """The CA certificate setting and where it came from: ``tls_ca``, else
    ``$CUMULUS_TLS_CA``, else ``(None, "")``."""
    if tls_ca is not None:
        return Path(tls_ca), "tls_ca="
    if env.get(CLIENT_ENV_TLS_CA, "").strip():
        return Path(env[CLIENT_ENV_TLS_CA].strip()), CLIENT_ENV_TLS_CA
    return None, ""


def _tls_settings(
    tls_ca: str | os.PathLike[str] | None,
    tls_cert: str | os.PathLike[str] | None,
    tls_key: str | os.PathLike[str] | None,
    insecure: bool | None,
    env: Mapping[str, str],
) -> _TlsSettings:
    """:func:`resolve`'s TLS settings from its arguments, else the environment, checked
    against each other before anything else is looked at (as cumulusctl's flags are).

    :raises ConfigError: plaintext with a CA or a client certificate, a client
        certificate without its key or a key without its certificate, or a malformed
        ``$CUMULUS_INSECURE``."""
    if insecure is not None:
        plaintext, insecure_origin = bool(insecure), "insecure=True"
    else:
        plaintext, insecure_origin = _env_flag(env, CLIENT_ENV_INSECURE), CLIENT_ENV_INSECURE
    ca, ca_origin = _ca_setting(tls_ca, env)
    if plaintext and ca is not None:
        raise ConfigError(
            f"both {insecure_origin} (plaintext) and {ca_origin} (TLS CA {ca}) are set: set "
            "only one (as cumulusctl requires)"
        )
    cert, cert_origin = _path_setting(tls_cert, "tls_cert=", env, CLIENT_ENV_TLS_CERT)
    key, key_origin = _path_setting(tls_key, "tls_key=", env, CLIENT_ENV_TLS_KEY)
    if cert is not None and key is None:
        raise ConfigError(
            f"{cert_origin} (TLS client certificate {cert}) is set without its private key: "
            f"pass tls_key= (or set {CLIENT_ENV_TLS_KEY}) too"
        )
    if key is not None and cert is None:
        raise ConfigError(
            f"{key_origin} (TLS client key {key}) is set without its certificate: pass "
            f"tls_cert= (or set {CLIENT_ENV_TLS_CERT}) too"
        )
    if plaintext and cert is not None:
        raise ConfigError(
            f"both {insecure_origin} (plaintext) and {cert_origin} (TLS client certificate "
            f"{cert}) are set: a client certificate needs TLS; set only one (as cumulusctl "
            "requires)"
        )
    return _TlsSettings(plaintext, insecure_origin, ca, ca_origin, cert, cert_origin, key)


def _coordinator_addresses(
    addresses: str | Sequence[str] | None, env: Mapping[str, str], local: _LocalCluster
) -> tuple[list[str], str, bool]:
    """The coordinators' ``host:port`` list (duplicates dropped), where it came from, and
    whether that is the local cluster's file: ``addresses``, else ``$CUMULUS_HTTP``, else
    the ``http`` of every coordinator in ``cluster.json``.

    :raises ConfigError: ``$CUMULUS_ADDR`` (gRPC addresses) is set instead, no address
        is found, or one is malformed."""
    from_file = False
    if addresses is not None:
        raw, origin = _split(addresses), "addresses"
    elif env.get(CLIENT_ENV_HTTP, "").strip():
        raw, origin = _split(env[CLIENT_ENV_HTTP]), CLIENT_ENV_HTTP
    elif env.get(CLIENT_ENV_ADDR, "").strip():
        # cumulusctl: explicit gRPC addresses of another cluster; the local file's HTTP
        # ports would be wrong.
        raise ConfigError(
            f"{CLIENT_ENV_ADDR} names coordinator gRPC addresses, but the Python client speaks "
            f"HTTP: set {CLIENT_ENV_HTTP} (or pass addresses=[...]) to the coordinators' HTTP "
            "host:port"
        )
    else:
        f = local.file()
        coordinators = f.get("coordinators") if f else None
        raw = [
            str(c["http"])
            for c in (coordinators if isinstance(coordinators, list) else [])
            if isinstance(c, dict) and isinstance(c.get("http"), str)
        ]
        origin = str(local.path)
        from_file = True
    if not raw:
        raise ConfigError(
            f"no coordinator HTTP address: pass addresses=[...], set {CLIENT_ENV_HTTP}, or start "
            f"a local cluster with `cumulusctl local up` (looked for {local.path})"
        )
    return list(dict.fromkeys(_host_port(a, origin) for a in raw)), origin, from_file


def _token(
    token: str | None,
    token_file: str | os.PathLike[str] | None,
    *,
    certified: bool,
    env: Mapping[str, str],
    local: _LocalCluster,
) -> str | None:
    """The bearer token: ``token``, else ``token_file``, else (with a client certificate)
    none, else ``$CUMULUS_TOKEN``, else ``$CUMULUS_TOKEN_FILE``, else the cluster file's
    ``token_file``.

    :raises ConfigError: both variables are set, none of these gives a token, or the
        token (or its file) is malformed."""
    if token is not None:
        return check_token(token.strip(), "token argument")
    if token_file is not None:
        return read_token_file(token_file)
    if certified:
        # A user's certificate alone: never the environment's or the local cluster's
        # (administrator) token, which would decide alone.
        return None
    if env.get(CLIENT_ENV_TOKEN) and env.get(CLIENT_ENV_TOKEN_FILE):
        raise ConfigError(
            f"both {CLIENT_ENV_TOKEN} and {CLIENT_ENV_TOKEN_FILE} are set; set only one (as "
            "cumulusctl requires)"
        )
    if env.get(CLIENT_ENV_TOKEN):
        return check_token(env[CLIENT_ENV_TOKEN].strip(), CLIENT_ENV_TOKEN)
    if env.get(CLIENT_ENV_TOKEN_FILE):
        return read_token_file(env[CLIENT_ENV_TOKEN_FILE])
    f = local.file()
    token_path = f.get("token_file") if f else None
    if not isinstance(token_path, str) or not token_path:
        raise ConfigError(
            f"no token: pass token=/token_file=, set {CLIENT_ENV_TOKEN_FILE}, or start a "
            f"local cluster with `cumulusctl local up` (looked for {local.path})"
        )
    return read_token_file(token_path)


def _ca_file(tls: _TlsSettings, origin: str, from_file: bool, local: _LocalCluster) -> Path | None:
    """The CA certificate that verifies the coordinators (``None``: plaintext), as the
    numbered list of :func:`resolve` says.

    :raises ConfigError: explicit addresses with neither a CA nor plaintext chosen, or a
        client certificate for a plaintext local cluster."""
    if tls.plaintext:
        ca_file = None
    elif tls.ca is not None:
        ca_file = tls.ca
    elif from_file:
        f = local.file()
        tls_dir = f.get("tls_dir") if f else None
        ca_file = Path(tls_dir) / CA_FILE if isinstance(tls_dir, str) and tls_dir else None
    elif tls.certified:
        raise ConfigError(
            f"no TLS CA certificate for the coordinators at {origin}: the TLS client "
            f"certificate ({tls.cert_origin} {tls.cert}) needs one: set {CLIENT_ENV_TLS_CA} "
            "(or pass tls_ca=) to the cluster's CA certificate (a local cluster's is "
            "<local-dir>/tls/ca.pem)"
        )
    else:
        raise ConfigError(
            f"no TLS CA certificate for the coordinators at {origin}: set {CLIENT_ENV_TLS_CA} (or "
            "pass tls_ca=) to the cluster's CA certificate (a local cluster's is "
            f"<local-dir>/tls/ca.pem), or {CLIENT_ENV_INSECURE}=1 (insecure=True) for a cluster "
            "started with --insecure"
        )
    if tls.certified and ca_file is None:
        raise ConfigError(
            f"the TLS client certificate ({tls.cert_origin} {tls.cert}) needs TLS, but the "
            f"local cluster of {local.path} is plaintext (started with --insecure): pass "
            f"tls_ca= (or set {CLIENT_ENV_TLS_CA}) for a TLS cluster, or leave the certificate "
            "out"
        )
    return ca_file


def resolve(
    addresses: str | Sequence[str] | None = None,
    *,
    token: str | None = None,
    token_file: str | os.PathLike[str] | None = None,
    tls_ca: str | os.PathLike[str] | None = None,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
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

    A user's client certificate: ``tls_cert`` and ``tls_key`` (defaults
    ``$CUMULUS_TLS_CERT`` and ``$CUMULUS_TLS_KEY``; both or neither), as ``cumulusctl
    --tls-cert/--tls-key``. With one, the token is only ``token`` or ``token_file``
    (never the environment's nor the local cluster's: those are usually the cluster
    administrator's); without either, requests carry no ``Authorization`` header and the
    coordinators take them as the certificate's user's. It needs TLS (a CA, below).

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

    Both ``insecure`` and a CA (or a client certificate) is an error.

    :raises ConfigError: nothing says where the cluster is, what the token is or how to
        verify it, only one of the client certificate and key is given, or a value or
        file is malformed (the message names where it came from).
    """
    env = os.environ if environ is None else environ
    local = _LocalCluster(
        Path(
            local_dir
            if local_dir is not None
            else env.get(CLIENT_ENV_LOCAL_DIR) or DEFAULT_LOCAL_DIR
        )
    )
    tls = _tls_settings(tls_ca, tls_cert, tls_key, insecure, env)
    host_ports, origin, from_file = _coordinator_addresses(addresses, env, local)
    tok = _token(token, token_file, certified=tls.certified, env=env, local=local)
    ca_file = _ca_file(tls, origin, from_file, local)
    scheme = "http" if ca_file is None else "https"
    urls = tuple(f"{scheme}://{hp}" for hp in host_ports)
    return Connection(
        addresses=urls, token=tok, ca_file=ca_file, cert_file=tls.cert, key_file=tls.key
    )
