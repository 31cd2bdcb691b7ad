"""Early writeback of a checkpoint part while the rank writes it.

A part's bytes reach the disk when the agent ``fsync``s them at commit (docs/checkpoints.md,
"The local backend"). Until then the kernel keeps them as dirty pages, so the ``fsync``
waits for the whole part to travel to the disk after the last byte was written, and the
agent's hash waits beside it. :class:`Writeback` starts that travel while the part is
still being written: a thread looks at the staging dir every :data:`INTERVAL_S` and
asks the kernel (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: start writeback, do not
wait) to write out what each file gained since. The agent's ``fsync`` then only waits
for the last stretch (and the disk's cache flush); it stays the one that makes the part
durable, and the agent still hashes every byte. Measurements: docs/perf-notes.md,
"Writeback while the rank writes".

Linux only (elsewhere, and when the call is refused, nothing is done); standard library
only (``ctypes``), as the rest of :mod:`cumulus.runtime`.
"""

from __future__ import annotations

import functools
import os
import stat
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["Writeback", "available"]

#: ``SYNC_FILE_RANGE_WRITE`` (linux/fs.h): start writeback of the range's dirty pages,
#: without waiting for them.
_SYNC_FILE_RANGE_WRITE = 2
#: How often the staging dir is looked at, in seconds (at ~2 GB/s, ~40 MB per look).
INTERVAL_S = 0.02
#: Files smaller than this are left to the agent's ``fsync`` (a call costs more than it
#: saves).
MIN_BYTES = 4 << 20
#: Most files watched at once (each holds a descriptor until the part is written).
MAX_FILES = 256
#: Deepest directory looked into, below the staging dir (a TensorFlow part has one level).
_MAX_DEPTH = 8


@functools.cache
def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (loaded at the first checkpoint, not at import: a
    rank that never checkpoints does not pay for ``ctypes``), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def available() -> bool:
    """Whether this platform can start a file's writeback (Linux with
    ``sync_file_range``)."""
    return _sync_file_range() is not None


class _File:
    __slots__ = ("fd", "handed_size", "seen")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        #: The file's size at its last hand-over.
        self.handed_size = 0
        #: (size, allocated blocks) when last handed to the kernel: unchanged, nothing
        #: new was written since.
        self.seen = (-1, -1)


class Writeback:
    """Context manager: while its block writes files into ``directory``, a daemon thread
    hands every file of :data:`MIN_BYTES` or more that changed to the kernel's writeback
    every :data:`INTERVAL_S` seconds. When the block ends the thread hands over every
    file it watches once more, closes its descriptors and ends, without the block's exit
    waiting for it: a hand-over waits for room in the disk's queue, and the agent's
    ``fsync`` (with its hash beside it) waits for that same I/O. Best effort: a file that
    cannot be opened or a call that fails is skipped, and nothing it does changes a byte
    or raises into the block. Does nothing where :func:`available` is false."""

    def __init__(self, directory: str | os.PathLike[str], *, interval_s: float = INTERVAL_S):
        self.directory = Path(directory)
        self.interval_s = interval_s
        #: Bytes of the watched files handed to the kernel so far (each file counted up to
        #: its size at its last hand-over).
        self.handed_bytes = 0
        #: ``sync_file_range`` calls made while the block ran.
        self.early_calls = 0
        #: Watched files by (device, inode): a file renamed while written is one file.
        self._files: dict[tuple[int, int], _File] = {}
        self._stop = threading.Event()
        self._failed = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Writeback:
        if available():
            self._thread = threading.Thread(
                target=self._run, name="cumulus-ckpt-writeback", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._failed = exc_type is not None
        self._stop.set()

    def join(self, timeout_s: float | None = None) -> bool:
        """Waits for the thread to end (after the block); whether it has."""
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                self._scan(final=False)
            if not self._failed:
                self._scan(final=True)
        finally:
            for f in self._files.values():
                os.close(f.fd)
            self._files.clear()

    def _scan(self, *, final: bool) -> None:
        """Opens files of :data:`MIN_BYTES` or more, then hands every watched file that
        changed since its last hand-over to the kernel, whole: the dirty pages not yet
        under writeback are started. Whole files, because a writer may set the size
        first and fill it in after (``safetensors``: ``ftruncate``, then the writes,
        into a temp file renamed at the end), or go back to patch a header."""
        self._discover(self.directory, 0)
        for f in self._files.values():
            try:
                st = os.fstat(f.fd)
            except OSError:
                continue
            seen = (st.st_size, st.st_blocks)
            if seen == f.seen:
                continue
            if _sync_file_range()(f.fd, 0, 0, _SYNC_FILE_RANGE_WRITE) == 0:
                f.seen = seen
                self.handed_bytes += st.st_size - max(f.handed_size, 0)
                f.handed_size = st.st_size
                if not final:
                    self.early_calls += 1

    def _discover(self, directory: Path, depth: int) -> None:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            return
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if depth < _MAX_DEPTH:
                    self._discover(Path(entry.path), depth + 1)
            elif (
                stat.S_ISREG(st.st_mode)
                and st.st_size >= MIN_BYTES
                and (st.st_dev, st.st_ino) not in self._files
                and len(self._files) < MAX_FILES
            ):
                try:
                    fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError:
                    continue
                self._files[(st.st_dev, st.st_ino)] = _File(fd)
