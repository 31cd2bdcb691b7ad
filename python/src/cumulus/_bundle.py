"""Packed directories: the format of the cluster's blob store (``cumulus_api::blobs``).

A packed directory is a gzip-compressed tar archive (PAX) of regular files and
directories with relative, normalized paths, named by the BLAKE3 hash of its bytes.
:func:`pack_directory` makes one from a directory the way ``cumulusctl submit --upload``
does: ``.git`` left out, ``.gitignore`` and ``.cumulusignore`` honoured (git's rules,
nested files included, a ``.cumulusignore`` pattern winning), links inside the tree
packed as what they point to, deterministic (sorted entries, mtime 0, uid/gid 0, modes 0o644 or
0o755, gzip header without name or time), so an unchanged directory has the same digest
and uploads nothing. :func:`read_archive` reads one back (a job's artifacts) in memory,
refusing what a packed directory may not hold.

The client SDK uses this module (it needs ``pathspec`` and ``blake3``); ranks never
import it.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

import blake3
from pathspec import GitIgnoreSpec

from cumulus import _contract
from cumulus.errors import BundleError, WorkdirTooLarge

__all__ = [
    "ALWAYS_EXCLUDED",
    "IGNORE_FILES",
    "LARGEST_NAMED",
    "PACK_FORMAT_VERSION",
    "ArchiveFile",
    "PackedDir",
    "Selection",
    "blob_digest",
    "check_entry_path",
    "pack_directory",
    "pack_selection",
    "read_archive",
    "select_directory",
]

#: Ignore files read in every directory, in precedence order (a later one wins).
IGNORE_FILES = (".gitignore", ".cumulusignore")
#: Names never packed, wherever they are.
ALWAYS_EXCLUDED = frozenset({".git"})
#: How many of the largest files a :class:`~cumulus.errors.WorkdirTooLarge` names.
LARGEST_NAMED = 10
#: Longest ignore file read, in bytes.
MAX_IGNORE_FILE_BYTES = 1024 * 1024
#: Packed bytes kept in memory before the archive spills to a temporary file.
SPOOL_BYTES = 16 * 1024 * 1024
#: Version of the packing rules (ignores, entry order, tar and gzip headers): a change
#: that alters the packed bytes of a tree bumps it (client digest caches key on it).
PACK_FORMAT_VERSION = 1
#: Read size when hashing and copying files.
COPY_CHUNK_BYTES = 1024 * 1024
#: Decompressed bytes :func:`read_archive` always allows, whatever the packed size (a
#: small archive's tar padding alone is 10 KiB).
MIN_UNPACK_ALLOWANCE_BYTES = 1024 * 1024


def blob_digest(data: bytes) -> str:
    """The blob name of ``data``: BLAKE3, 64 lowercase hex digits."""
    return blake3.blake3(data).hexdigest()


def check_entry_path(path: str, what: str) -> str:
    """``path`` if it can name an archive entry: relative, ``/``-separated, normalized
    (no empty, ``.`` or ``..`` component), valid UTF-8 and at most
    ``MAX_ENTRY_PATH_BYTES`` bytes.

    :raises BundleError: it cannot, naming ``what``."""
    try:
        size = len(path.encode("utf-8"))
    except UnicodeEncodeError:
        raise BundleError(f"{what}: the path {path!r} is not valid UTF-8") from None
    if not path or size > _contract.MAX_ENTRY_PATH_BYTES:
        raise BundleError(
            f"{what}: the path {path[:200]!r} must be 1..={_contract.MAX_ENTRY_PATH_BYTES} bytes"
        )
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in path:
        raise BundleError(
            f"{what}: the path {path[:200]!r} is not relative and normalized "
            "(no leading '/', no empty, '.' or '..' component)"
        )
    return path


@dataclass(frozen=True)
class _Entry:
    """One thing to pack: ``rel`` (``/``-separated), its source (``None`` for a
    directory), size and whether it is executable; for a file, the source's status as
    listed (modification time in ns, inode, device, mode: what a digest cache compares)."""

    rel: str
    source: Path | None
    size: int = 0
    executable: bool = False
    mtime_ns: int = 0
    ino: int = 0
    dev: int = 0
    mode: int = 0


_Rules = tuple[tuple[str, GitIgnoreSpec], ...]


class _Ignores:
    """The ignore rules that apply inside one directory: every ``.gitignore`` and every
    ``.cumulusignore`` from the root down, shallowest first, as the ``ignore`` crate
    (``cumulusctl submit --upload``) applies them: the deepest ``.cumulusignore`` pattern
    that matches a path decides; only when none does, the deepest ``.gitignore`` one."""

    def __init__(
        self,
        custom: _Rules = (),
        git: _Rules = (),
    ) -> None:
        self.custom = custom
        self.git = git

    @staticmethod
    def _read(path: Path) -> GitIgnoreSpec | None:
        try:
            st = path.lstat()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise BundleError(f"cannot read {path}: {e}") from e
        if not stat.S_ISREG(st.st_mode):
            return None
        if st.st_size > MAX_IGNORE_FILE_BYTES:
            raise BundleError(
                f"{path} is {st.st_size} bytes, at most {MAX_IGNORE_FILE_BYTES} are read"
            )
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise BundleError(f"cannot read {path}: {e}") from e
        return GitIgnoreSpec.from_lines(text.splitlines())

    def below(self, directory: Path, rel: str) -> _Ignores:
        """The rules inside ``directory`` (``rel`` from the root, ``""`` for the root)."""
        git = self._read(directory / IGNORE_FILES[0])
        custom = self._read(directory / IGNORE_FILES[1])
        if git is None and custom is None:
            return self
        return _Ignores(
            self.custom if custom is None else (*self.custom, (rel, custom)),
            self.git if git is None else (*self.git, (rel, git)),
        )

    @staticmethod
    def _decide(rules: _Rules, rel: str, is_dir: bool) -> bool | None:
        for base, spec in reversed(rules):
            sub = rel[len(base) + 1 :] if base else rel
            result = spec.check_file(sub + "/" if is_dir else sub)
            if result.include is not None:
                return bool(result.include)
        return None

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """Whether ``rel`` (from the root) is ignored (a ``!pattern`` re-includes)."""
        decision = self._decide(self.custom, rel, is_dir)
        if decision is None:
            decision = self._decide(self.git, rel, is_dir)
        return bool(decision)


def _source_of(child: os.DirEntry[str], root: Path) -> tuple[Path, os.stat_result]:
    """Where ``child``'s bytes are read and their status: the entry itself, or for a
    symbolic link its target, which must lie inside ``root`` (canonical).

    :raises BundleError: a link out of the tree, or one that leads nowhere."""
    path = Path(child.path)
    try:
        if not child.is_symlink():
            return path, child.stat(follow_symlinks=False)
        target = path.resolve(strict=True)
        if not target.is_relative_to(root):
            raise BundleError(
                f"{path} is a symbolic link out of the directory (to {target}): copy what it "
                "points to in, or list it in .cumulusignore"
            )
        return target, target.stat()
    except (OSError, RuntimeError) as e:
        raise BundleError(f"{path}: a symbolic link that leads nowhere ({e})") from e


def _walk(root: Path, prefix: str, apply_ignores: bool) -> list[_Entry]:
    """Every entry under ``root`` to pack, named ``prefix/...``; a symbolic link to a
    file or directory inside ``root`` is packed as what it points to.

    :raises BundleError: a link out of the tree or in a loop, a special file, a path that
        cannot name an entry, or an unreadable directory (each named)."""
    root = root.resolve()
    entries: list[_Entry] = []
    root_id = root.stat()
    stack: list[tuple[Path, str, _Ignores, tuple[tuple[int, int], ...]]] = [
        (root, "", _Ignores(), ((root_id.st_dev, root_id.st_ino),))
    ]
    while stack:
        directory, rel_dir, ignores, ancestors = stack.pop()
        if apply_ignores:
            ignores = ignores.below(directory, rel_dir)
        try:
            with os.scandir(directory) as it:
                children = list(it)
        except OSError as e:
            raise BundleError(f"cannot list {directory}: {e}") from e
        for child in children:
            rel = f"{rel_dir}/{child.name}" if rel_dir else child.name
            if child.name in ALWAYS_EXCLUDED:
                continue
            try:
                # Follows a link (false for one that leads nowhere): an ignored link is
                # never looked at further.
                is_dir = child.is_dir()
            except OSError:
                is_dir = False
            if apply_ignores and ignores.ignored(rel, is_dir):
                continue
            source, st = _source_of(child, root)
            is_dir = stat.S_ISDIR(st.st_mode)
            name = f"{prefix}/{rel}" if prefix else rel
            check_entry_path(name, child.path)
            if is_dir:
                key = (st.st_dev, st.st_ino)
                if key in ancestors:
                    raise BundleError(f"{child.path} is a symbolic link loop (to {source})")
                entries.append(_Entry(name, None))
                stack.append((source, rel, ignores, (*ancestors, key)))
            elif stat.S_ISREG(st.st_mode):
                executable = bool(st.st_mode & 0o111)
                entries.append(
                    _Entry(
                        name,
                        source,
                        st.st_size,
                        executable,
                        st.st_mtime_ns,
                        st.st_ino,
                        st.st_dev,
                        st.st_mode,
                    )
                )
            else:
                raise BundleError(
                    f"{child.path} is not a regular file or a directory (a socket, FIFO or "
                    "device): list it in .cumulusignore"
                )
            if len(entries) > _contract.MAX_ARCHIVE_ENTRIES:
                raise BundleError(
                    f"more than {_contract.MAX_ARCHIVE_ENTRIES} files and directories to "
                    "pack: list what the job does not need in .cumulusignore"
                )
    return entries


class _HashingWriter(io.RawIOBase):
    """Writes through to ``sink`` while hashing and counting the bytes."""

    def __init__(self, sink: IO[bytes]) -> None:
        super().__init__()
        self.sink = sink
        self.hasher = blake3.blake3()
        self.count = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        view = memoryview(data)
        self.sink.write(view)
        self.hasher.update(view)
        self.count += len(view)
        return len(view)


@dataclass
class PackedDir:
    """A packed directory, held in a temporary file (in memory while small). Close it
    (or use it as a context manager) when done."""

    #: BLAKE3 of the packed bytes, 64 lowercase hex digits.
    digest: str
    #: Size of the packed archive, in bytes.
    size_bytes: int
    #: Regular files in it.
    file_count: int
    #: Their total size, in bytes.
    unpacked_bytes: int
    file: IO[bytes] = field(repr=False)
    #: BLAKE3 of the bytes packed for each file named in ``pack_selection``'s
    #: ``hash_files`` (archive path -> 64 hex digits).
    file_hashes: dict[str, str] = field(default_factory=dict, repr=False)

    def chunks(self, size: int = _contract.BLOB_CHUNK_BYTES) -> Iterator[bytes]:
        """The packed bytes from the start, in chunks of at most ``size`` bytes."""
        self.file.seek(0)
        while chunk := self.file.read(size):
            yield chunk

    def read(self) -> bytes:
        """The whole packed archive."""
        return b"".join(self.chunks())

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> PackedDir:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _largest(entries: list[_Entry]) -> str:
    files = sorted((e for e in entries if e.source is not None), key=lambda e: (-e.size, e.rel))
    return ", ".join(f"{e.rel} ({_human(e.size)})" for e in files[:LARGEST_NAMED])


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _too_large(what: str, limit: int, entries: list[_Entry]) -> WorkdirTooLarge:
    return WorkdirTooLarge(
        f"{what}, over the limit of {_human(limit)} ({limit} bytes); the largest files: "
        f"{_largest(entries)}. List what the job does not need in .cumulusignore "
        "(gitignore syntax) or .gitignore, or raise the limit",
        limit_bytes=limit,
    )


def _tar_info(entry: _Entry) -> tarfile.TarInfo:
    info = tarfile.TarInfo(entry.rel)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.source is None:
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
    else:
        info.type = tarfile.REGTYPE
        info.size = entry.size
        info.mode = 0o755 if entry.executable else 0o644
    return info


def pack_directory(
    root: str | os.PathLike[str] | None,
    *,
    mounts: Mapping[str, str | os.PathLike[str]] | None = None,
    max_bytes: int = _contract.DEFAULT_MAX_WORKDIR_BYTES,
) -> PackedDir:
    """Packs ``root`` (``None``: nothing) and, under each name of ``mounts``, that
    directory (whole: no ignore rules apply to it), into a :class:`PackedDir`.

    ``.git`` is never packed; files and directories matched by a ``.gitignore`` or
    ``.cumulusignore`` (in any directory of ``root``, with git's rules; a
    ``.cumulusignore`` pattern wins over any ``.gitignore`` one, as for ``cumulusctl
    submit --upload``) are left out. A symbolic link to a file or directory inside the
    tree is packed as what it points to. Two packs of the same tree give the same bytes,
    whatever the files' times and owners.

    :param max_bytes: largest total size of the files to pack, in bytes.
    :raises WorkdirTooLarge: the files hold more than ``max_bytes`` (the message names
        the largest).
    :raises BundleError: ``root`` is not a directory, a mount's name is taken by a path
        of ``root`` or is not a plain relative path, an entry cannot be packed (a
        symbolic link out of the tree or in a loop, a special file, an unreadable file, a
        path too long, too many entries), or the files compress so well that a worker
        would refuse the archive as a decompression bomb.
    """
    return pack_selection(select_directory(root, mounts=mounts), max_bytes=max_bytes)


@dataclass(frozen=True)
class Selection:
    """What :func:`pack_directory` would pack, listed (paths and file status) but not
    read: :func:`select_directory` makes one, :func:`pack_selection` packs it."""

    entries: tuple[_Entry, ...]

    @property
    def files(self) -> Iterator[_Entry]:
        """The regular files, in archive order."""
        return (e for e in self.entries if e.source is not None)


def select_directory(
    root: str | os.PathLike[str] | None,
    *,
    mounts: Mapping[str, str | os.PathLike[str]] | None = None,
) -> Selection:
    """Lists what :func:`pack_directory` packs (same rules, same errors for the walk),
    without reading any file but the ignore files.

    :raises BundleError: as :func:`pack_directory` for the walk."""
    entries: list[_Entry] = []
    if root is not None:
        root_path = Path(root)
        if not root_path.is_dir():
            raise BundleError(f"{root_path} is not a directory")
        entries = _walk(root_path, "", apply_ignores=True)
    taken = {e.rel for e in entries}
    for name, directory in sorted((mounts or {}).items()):
        check_entry_path(name, f"mount {name!r}")
        if name in taken or any(t.startswith(name + "/") for t in taken):
            raise BundleError(
                f"{root}: {name!r} is reserved for Cumulus in an uploaded directory; "
                "rename it or list it in .cumulusignore"
            )
        entries.append(_Entry(name, None))
        entries.extend(_walk(Path(directory), name, apply_ignores=False))
    # Byte order of the paths, as cumulusctl sorts them (a directory before its files).
    entries.sort(key=lambda e: e.rel.encode())
    if len(entries) > _contract.MAX_ARCHIVE_ENTRIES:
        raise BundleError(
            f"{len(entries)} files and directories to pack, at most "
            f"{_contract.MAX_ARCHIVE_ENTRIES}: list what the job does not need in .cumulusignore"
        )
    return Selection(tuple(entries))


def pack_selection(
    selection: Selection,
    *,
    max_bytes: int = _contract.DEFAULT_MAX_WORKDIR_BYTES,
    hash_files: frozenset[str] = frozenset(),
) -> PackedDir:
    """Packs what :func:`select_directory` listed (see :func:`pack_directory`).

    :param hash_files: archive paths of files whose packed bytes are also hashed
        (:attr:`PackedDir.file_hashes`).
    :raises WorkdirTooLarge: as :func:`pack_directory`.
    :raises BundleError: as :func:`pack_directory`, for reading and compressing."""
    entries = list(selection.entries)
    unpacked = sum(e.size for e in entries)
    limit = min(max_bytes, _contract.MAX_UNPACKED_BYTES)
    if unpacked > limit:
        raise _too_large(f"the directory holds {_human(unpacked)} in files to pack", limit, entries)
    spool: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115
    try:
        hashes: dict[str, str] = {}
        writer = _write_archive(entries, spool, _contract.MAX_BLOB_BYTES, hash_files, hashes)
        size = writer.count
        # What a worker refuses to unpack is refused here, before anything is sent.
        if unpacked > max(MIN_UNPACK_ALLOWANCE_BYTES, _contract.MAX_EXPANSION_RATIO * size):
            raise BundleError(
                f"the directory's files ({unpacked} bytes) compress to {size} bytes, more "
                f"than {_contract.MAX_EXPANSION_RATIO}x: workers refuse such an archive as "
                f"a decompression bomb; the largest files: {_largest(entries)}"
            )
        return PackedDir(
            digest=writer.hasher.hexdigest(),
            size_bytes=size,
            file_count=sum(1 for e in entries if e.source is not None),
            unpacked_bytes=unpacked,
            file=spool,
            file_hashes=hashes,
        )
    except BaseException:
        spool.close()
        raise


def _write_archive(
    entries: list[_Entry],
    sink: IO[bytes],
    max_bytes: int,
    hash_files: frozenset[str] = frozenset(),
    hashes: dict[str, str] | None = None,
) -> _HashingWriter:
    """Writes ``entries`` as a deterministic tar.gz into ``sink``; returns the writer
    (packed size and hash). The BLAKE3 of each file of ``hash_files`` as packed goes into
    ``hashes``.

    :raises WorkdirTooLarge: past ``max_bytes`` packed bytes (checked after each file).
    :raises BundleError: a file cannot be read, or changed size while packed."""
    writer = _HashingWriter(sink)
    # No file name and time 0 in the gzip header: the bytes depend on the content only.
    with (
        gzip.GzipFile(filename="", mode="wb", fileobj=writer, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for entry in entries:
            info = _tar_info(entry)
            if entry.source is None:
                tar.addfile(info)
                continue
            try:
                hasher = blake3.blake3() if entry.rel in hash_files else None
                with entry.source.open("rb") as f:
                    tar.addfile(info, _ExactReader(f, entry.size, entry.source, hasher))
                if hasher is not None and hashes is not None:
                    hashes[entry.rel] = hasher.hexdigest()
            except OSError as e:
                raise BundleError(f"cannot read {entry.source}: {e}") from e
            if writer.count > max_bytes:
                raise _too_large("the packed directory is larger", max_bytes, entries)
    if writer.count > max_bytes:
        raise _too_large("the packed directory is larger", max_bytes, entries)
    return writer


class _ExactReader(io.RawIOBase):
    """Reads exactly ``size`` bytes of ``f``: a file that shrank or grew since it was
    listed is refused (its archive entry would be wrong)."""

    def __init__(
        self, f: IO[bytes], size: int, path: Path, hasher: blake3.blake3 | None = None
    ) -> None:
        super().__init__()
        self.f = f
        self.left = size
        self.path = path
        self.hasher = hasher

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        want = self.left if n < 0 else min(n, self.left)
        data = self.f.read(want) if want else b""
        if len(data) < want:
            raise BundleError(f"{self.path} shrank while it was being packed: pack it again")
        self.left -= len(data)
        if self.hasher is not None:
            self.hasher.update(data)
        if self.left == 0 and n != 0 and self.f.read(1):
            raise BundleError(f"{self.path} grew while it was being packed: pack it again")
        return data


@dataclass(frozen=True)
class ArchiveFile:
    """A regular file of a packed directory."""

    #: Its path in the archive (relative, ``/``-separated).
    path: str
    #: Its size, in bytes.
    size: int
    #: Its bytes (``None`` when the caller did not ask for them).
    data: bytes | None = field(default=None, repr=False)


class _CappedReader(io.RawIOBase):
    """Reads ``inner`` but refuses to hand out more than ``cap`` bytes in all (a
    decompression bomb, or a huge tar header, stops here before it is buffered)."""

    def __init__(self, inner: IO[bytes] | gzip.GzipFile, cap: int, what: str) -> None:
        super().__init__()
        self.inner = inner
        self.left = cap
        self.cap = cap
        self.what = what

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        want = len(buffer)
        if want > self.left:
            # Only fail when the bytes are really there.
            want = self.left + 1
        data = self.inner.read(min(want, len(buffer)))
        if len(data) > self.left:
            raise BundleError(
                f"{self.what} unpacks to more than {self.cap} bytes: refused as a "
                "decompression bomb"
            )
        self.left -= len(data)
        buffer[: len(data)] = data
        return len(data)


def read_archive(
    packed: IO[bytes],
    packed_size: int,
    *,
    what: str,
    want: str | frozenset[str] | None = None,
    read_all: bool = False,
) -> list[ArchiveFile]:
    """The regular files of the packed directory in ``packed`` (``packed_size`` bytes),
    in archive order, read in memory and never written anywhere.

    :param what: names the archive in errors.
    :param want: a path (or a set of paths) whose bytes are read.
    :param read_all: read every file's bytes (else only sizes, and ``want``'s bytes).
    :raises BundleError: the archive is not a gzip tar; an entry is not a regular file
        or a directory (a link, a device...), or its path is absolute, holds ``..`` or
        is not normalized, or repeats; more than ``MAX_ARCHIVE_ENTRIES`` entries; or it
        unpacks to more than ``MAX_UNPACKED_BYTES`` or ``MAX_EXPANSION_RATIO`` times
        ``packed_size``.
    """
    cap = min(
        _contract.MAX_UNPACKED_BYTES,
        max(MIN_UNPACK_ALLOWANCE_BYTES, _contract.MAX_EXPANSION_RATIO * packed_size),
    )
    wanted = frozenset([want]) if isinstance(want, str) else (want or frozenset())
    files: list[ArchiveFile] = []
    seen: set[str] = set()
    packed.seek(0)
    gz = gzip.GzipFile(fileobj=packed, mode="rb")
    stream = io.BufferedReader(_CappedReader(gz, cap, what))
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for count, member in enumerate(tar, start=1):
                if count > _contract.MAX_ARCHIVE_ENTRIES:
                    raise BundleError(
                        f"{what} has more than {_contract.MAX_ARCHIVE_ENTRIES} entries"
                    )
                name = member.name.rstrip("/") if member.isdir() else member.name
                check_entry_path(name, f"{what}: entry {member.name[:200]!r}")
                if name in seen:
                    raise BundleError(f"{what}: entry {name!r} appears twice")
                seen.add(name)
                if member.isdir():
                    continue
                if not member.isreg():
                    raise BundleError(
                        f"{what}: entry {name!r} is not a regular file or a directory "
                        f"(tar type {member.type!r}): refused"
                    )
                data = None
                if read_all or name in wanted:
                    f = tar.extractfile(member)
                    if f is None:
                        raise BundleError(f"{what}: entry {name!r} has no content")
                    data = f.read()
                    if len(data) != member.size:
                        raise BundleError(f"{what}: entry {name!r} is cut short")
                files.append(ArchiveFile(name, member.size, data))
    except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile) as e:
        raise BundleError(f"{what} is not a valid packed directory (tar.gz): {e}") from e
    return files
