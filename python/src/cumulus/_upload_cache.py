"""The client's cache of uploaded directories' digests, so that submitting an unchanged
directory again costs a walk, a ``stat`` per file and a ``HEAD`` instead of a pack.

An entry maps a directory's absolute path to the digest its last pack had, with a
*fingerprint* of the tree it packed: every selected path (the packer's own walk and
ignore rules, :func:`cumulus._bundle.select_directory`) with, for a file, its size,
modification time (ns), inode, device and mode; plus the packer's format version, the
zlib it compressed with and the size limit. An entry is trusted only when the
fingerprint is the same, and, as git does for racily clean index entries, a file
modified less than :data:`RACY_NS` before the entry's listing began (its time cannot
tell a later change apart) is trusted only when its bytes still hash to what was packed
(the cache keeps those hashes). A trusted entry's digest is still checked with a
``HEAD`` by the caller: absent, the directory is packed and sent as before.

The cache is ``$XDG_CACHE_HOME/cumulus/upload-digests.json`` (``~/.cache/cumulus`` by
default): a JSON object of at most :data:`MAX_ENTRIES` entries (the oldest evicted),
written whole to a temporary file then renamed. A missing, unreadable or malformed cache
(or entry) is a miss, never an error. ``CUMULUS_NO_UPLOAD_CACHE=1`` turns it off.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from cumulus import _bundle
from cumulus.errors import BundleError

__all__ = [
    "CACHE_FILE_NAME",
    "DISABLE_ENV",
    "MAX_CACHE_FILE_BYTES",
    "MAX_ENTRIES",
    "MAX_RACY_FILES",
    "RACY_NS",
    "CachedDigest",
    "Listing",
    "cache_path",
    "enabled",
    "hash_files_for",
    "list_directory",
    "lookup",
    "record",
]

#: Set to ``1`` to turn the cache off.
DISABLE_ENV = "CUMULUS_NO_UPLOAD_CACHE"
#: The cache file's name under ``$XDG_CACHE_HOME/cumulus``.
CACHE_FILE_NAME = "upload-digests.json"
#: Directories remembered; past it the oldest entries are dropped.
MAX_ENTRIES = 256
#: Largest cache file read, in bytes (a larger one is ignored, then rewritten).
MAX_CACHE_FILE_BYTES = 16 * 1024 * 1024
#: A file whose modification time is less than this before the listing began (in ns)
#: is "racy": same status does not prove same bytes, so its bytes are hashed.
RACY_NS = 2_000_000_000
#: Most racy files an entry keeps hashes for; a tree with more is not cached.
MAX_RACY_FILES = 256
#: Version of the cache file's layout.
CACHE_VERSION = 1


def enabled() -> bool:
    """Whether the cache is on (``CUMULUS_NO_UPLOAD_CACHE`` is not ``1``)."""
    return os.environ.get(DISABLE_ENV, "").strip() != "1"


def cache_path() -> Path:
    """``$XDG_CACHE_HOME/cumulus/upload-digests.json`` (an unset or relative
    ``XDG_CACHE_HOME`` means ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "cumulus" / CACHE_FILE_NAME


@dataclass(frozen=True)
class Listing:
    """A directory listed for packing: its key (absolute path), what is packed, when the
    listing began (ns since the epoch) and the tree's fingerprint."""

    key: str
    selection: _bundle.Selection
    started_ns: int
    fingerprint: str
    limit_bytes: int

    def racy_files(self, written_at_ns: int) -> list[str]:
        """Archive paths of the files modified less than :data:`RACY_NS` before
        ``written_at_ns``."""
        return [e.rel for e in self.selection.files if e.mtime_ns >= written_at_ns - RACY_NS]


@dataclass(frozen=True)
class CachedDigest:
    """A trusted entry: the packed directory's digest and size, and what it held."""

    digest: str
    size_bytes: int
    file_count: int
    unpacked_bytes: int


def list_directory(root: str | os.PathLike[str], limit_bytes: int) -> Listing:
    """Lists ``root`` as the packer would, and fingerprints it.

    :raises BundleError: as :func:`cumulus._bundle.select_directory`."""
    started = time.time_ns()
    path = Path(root)
    if not path.is_dir():
        raise BundleError(f"{path} is not a directory")
    key = str(path.resolve())
    selection = _bundle.select_directory(path)
    h = blake3.blake3()
    head = {
        "format": _bundle.PACK_FORMAT_VERSION,
        "limit": limit_bytes,
        "zlib": zlib.ZLIB_RUNTIME_VERSION,
    }
    h.update(json.dumps(head, sort_keys=True).encode() + b"\n")
    for e in selection.entries:
        rel = e.rel.encode("utf-8")
        if e.source is None:
            h.update(b"D\0" + rel + b"\n")
        else:
            stat = f"{e.size}\0{e.mtime_ns}\0{e.ino}\0{e.dev}\0{e.mode}"
            h.update(b"F\0" + rel + b"\0" + stat.encode() + b"\n")
    return Listing(key, selection, started, h.hexdigest(), limit_bytes)


def _load(path: Path) -> dict[str, Any]:
    """The cache's entries; empty when the file is missing, unreadable or malformed."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CACHE_FILE_BYTES + 1)
        if len(data) > MAX_CACHE_FILE_BYTES:
            return {}
        doc = json.loads(data)
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("version") != CACHE_VERSION:
        return {}
    entries = doc.get("entries")
    return entries if isinstance(entries, dict) else {}


def _is_hex64(v: object) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _hash_file(path: Path) -> str | None:
    h = blake3.blake3()
    try:
        with path.open("rb") as f:
            while chunk := f.read(_bundle.COPY_CHUNK_BYTES):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


def lookup(listing: Listing) -> CachedDigest | None:
    """The cached digest of ``listing``'s tree when it can be trusted, else ``None``."""
    entry = _load(cache_path()).get(listing.key)
    if not isinstance(entry, dict) or entry.get("fingerprint") != listing.fingerprint:
        return None
    digest, size = entry.get("digest"), entry.get("size_bytes")
    files, unpacked = entry.get("file_count"), entry.get("unpacked_bytes")
    written_at, racy = entry.get("written_at_ns"), entry.get("racy")
    if not (
        _is_hex64(digest)
        and _is_count(size)
        and _is_count(files)
        and _is_count(unpacked)
        and _is_count(written_at)
        and isinstance(racy, dict)
    ):
        return None
    assert isinstance(digest, str) and isinstance(size, int) and isinstance(written_at, int)
    assert isinstance(files, int) and isinstance(unpacked, int) and isinstance(racy, dict)
    by_rel = {e.rel: e for e in listing.selection.files}
    for rel in listing.racy_files(written_at):
        want, source = racy.get(rel), by_rel[rel].source
        if not _is_hex64(want) or source is None or _hash_file(source) != want:
            return None
    return CachedDigest(digest, size, files, unpacked)


def hash_files_for(listing: Listing) -> frozenset[str] | None:
    """The files whose packed bytes must be hashed for ``listing`` to be recorded
    (:func:`cumulus._bundle.pack_selection`'s ``hash_files``); ``None`` when there are
    too many to record it."""
    racy = listing.racy_files(listing.started_ns)
    return frozenset(racy) if len(racy) <= MAX_RACY_FILES else None


def record(listing: Listing, packed: _bundle.PackedDir) -> None:
    """Remembers ``packed`` as the pack of ``listing``'s tree (an entry for a tree with
    more than :data:`MAX_RACY_FILES` racy files is not kept); errors are ignored."""
    racy = listing.racy_files(listing.started_ns)
    if len(racy) > MAX_RACY_FILES or any(r not in packed.file_hashes for r in racy):
        return
    path = cache_path()
    entries = _load(path)
    entries.pop(listing.key, None)
    entries[listing.key] = {
        "fingerprint": listing.fingerprint,
        "digest": packed.digest,
        "size_bytes": packed.size_bytes,
        "file_count": packed.file_count,
        "unpacked_bytes": packed.unpacked_bytes,
        "written_at_ns": listing.started_ns,
        "racy": {r: packed.file_hashes[r] for r in racy},
    }

    def age(item: tuple[str, Any]) -> int:
        at = item[1].get("written_at_ns") if isinstance(item[1], dict) else None
        return at if isinstance(at, int) and _is_count(at) else 0

    kept = dict(sorted(entries.items(), key=age)[-MAX_ENTRIES:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".upload-digests.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"version": CACHE_VERSION, "entries": kept}, f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        return
