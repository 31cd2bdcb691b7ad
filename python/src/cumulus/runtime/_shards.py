"""``ShardReader``: this rank's records over its shards, in order, resumable exactly.

A shard's format follows its name (after an optional ``.gz``, which is decompressed):

* ``.csv`` / ``.tsv``: one record per CSV row (a ``list[str]``), no header (the Cumulus
  convention; ``csv_header=True`` skips one per shard); blank lines are not records;
* ``.jsonl`` / ``.ndjson``: one record per non-blank line, parsed as JSON;
* anything else: one record per file, its bytes (one-file-per-record data sets).

``state()`` is a small JSON object naming the next record (shard index, record index in
that shard); commit it with a checkpoint and ``restore()`` it on resume, and every
record is consumed exactly once over the life of the job.

A file whose name starts with a dot is not a shard, as when the coordinator lists a data
set: ``cumulusctl dataset split`` writes its feature statistics, ``.feature-stats.json``,
beside the shards. :func:`list_shards` lists a directory that way, and a directory or a
dot-file among a :class:`ShardReader`'s paths is expanded or skipped the same way.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal

__all__ = ["ShardFormat", "ShardReader", "list_shards", "shard_format"]

ShardFormat = Literal["csv", "tsv", "jsonl", "file"]


def shard_format(path: Path) -> ShardFormat:
    """The format of a shard, from its name (``.gz`` stripped first)."""
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith(".csv"):
        return "csv"
    if name.endswith(".tsv"):
        return "tsv"
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    return "file"


def is_hidden(path: Path) -> bool:
    """Whether ``path`` names a dot-file (never a shard)."""
    return path.name.startswith(".")


def list_shards(directory: str | os.PathLike[str]) -> list[Path]:
    """The shards of a data set directory as the coordinator lists them: its regular
    files (symbolic links to them included), sorted by name, without those whose name
    starts with a dot (``.feature-stats.json`` of ``cumulusctl dataset split``).

    :raises NotADirectoryError: ``directory`` is not a directory.
    """
    root = Path(directory)
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    return sorted(
        (p for p in root.iterdir() if not is_hidden(p) and p.is_file()), key=lambda p: p.name
    )


def _expand(paths: Sequence[str | os.PathLike[str]]) -> tuple[Path, ...]:
    """``paths`` with each directory replaced by :func:`list_shards` of it and dot-files
    left out."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(list_shards(p))
        elif not is_hidden(p):
            out.append(p)
    return tuple(out)


def _open_binary(path: Path) -> IO[bytes]:
    if path.name.lower().endswith(".gz"):
        return gzip.GzipFile(path, "rb")  # type: ignore[return-value]  # a BinaryIO
    return open(path, "rb")


_END = object()


def _fingerprint(paths: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(os.fsencode(p.name))
        h.update(b"\0")
    return h.hexdigest()[:16]


class ShardReader(Iterator[Any]):
    """Iterates the records of ``paths`` in order (see the module doc for formats).

    :param paths: the shard files (default: ``get_context(standalone=True).shard_paths``);
        a directory stands for its shards (:func:`list_shards`), and a dot-file is not
        a shard: skipped (``.feature-stats.json`` from ``os.listdir`` of a
        ``dataset split`` output).
    :param format: force one format for every shard instead of choosing by name.
    :param csv_header: skip the first row of every CSV/TSV shard.
    :param first_records: with ``paths`` naming files only, records of each shard that are
        not part of it (an elastic job's segments, :class:`ElasticData`): shard ``i`` is
        read from record ``first_records[i]`` on, and :meth:`state` counts from there.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]] | None = None,
        *,
        format: ShardFormat | None = None,
        csv_header: bool = False,
        first_records: Sequence[int] | None = None,
    ) -> None:
        if paths is None:
            from cumulus.runtime._env import get_context

            paths = get_context(standalone=True).shard_paths
        #: The shards read, in order (directories expanded, dot-files left out).
        self.paths: tuple[Path, ...] = _expand(paths)
        if first_records is not None and (
            len(first_records) != len(self.paths)
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in first_records)
        ):
            raise ValueError(
                f"first_records must hold one int >= 0 per shard ({len(self.paths)} shards), "
                f"got {list(first_records)!r}"
            )
        self._skip: tuple[int, ...] = tuple(first_records or (0,) * len(self.paths))
        self._format = format
        self._csv_header = csv_header
        self._shard = 0
        self._record = 0
        self._records: Iterator[Any] | None = None
        self._file: IO[Any] | None = None

    # -- position ---------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The position of the next record, as a JSON-able dict: ``shard`` (index into
        :attr:`paths`), ``record`` (records of that shard already consumed), ``shards``
        (number of shards) and ``fingerprint`` (of the shard names)."""
        return {
            "shard": self._shard,
            "record": self._record,
            "shards": len(self.paths),
            "fingerprint": _fingerprint(self.paths),
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Moves to the position ``state`` (from :meth:`state`), skipping the records
        before it.

        :raises ValueError: ``state`` is malformed, was taken over other shards, or points
            past the end of its shard.
        """
        try:
            shard = int(state["shard"])
            record = int(state["record"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a ShardReader state: {state!r}") from e
        if state.get("shards", len(self.paths)) != len(self.paths) or state.get(
            "fingerprint", _fingerprint(self.paths)
        ) != _fingerprint(self.paths):
            raise ValueError(
                "the ShardReader state was taken over other shards "
                f"({state.get('shards')} shards, fingerprint {state.get('fingerprint')}) "
                f"than this reader's ({len(self.paths)}, {_fingerprint(self.paths)})"
            )
        if not 0 <= shard <= len(self.paths) or record < 0:
            raise ValueError(f"ShardReader state out of range: {state!r}")
        self._close_shard()
        self._shard, self._record = shard, 0
        if shard == len(self.paths):
            if record:
                raise ValueError(f"ShardReader state out of range: {state!r}")
            return
        records = self._open_shard()
        for _ in range(record):
            try:
                next(records)
            except StopIteration:
                raise ValueError(
                    f"shard {self.paths[shard]} has fewer than {record} records"
                ) from None
            self._record += 1

    # -- iteration --------------------------------------------------------------------

    def __iter__(self) -> ShardReader:
        return self

    def __next__(self) -> Any:
        while self._shard < len(self.paths):
            records = self._records if self._records is not None else self._open_shard()
            try:
                value = next(records)
            except StopIteration:
                self._close_shard()
                self._shard += 1
                self._record = 0
                continue
            self._record += 1
            return value
        raise StopIteration

    def close(self) -> None:
        """Closes the open shard file (iteration may go on: it is opened again)."""
        self._close_shard()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- shards -----------------------------------------------------------------------

    def _close_shard(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = None
        self._records = None

    def _open_shard(self) -> Iterator[Any]:
        path = self.paths[self._shard]
        fmt = self._format or shard_format(path)
        raw = _open_binary(path)
        if fmt == "file":
            self._file = raw
            self._records = iter((raw.read(),))
        elif fmt == "jsonl":
            self._file = raw
            self._records = (json.loads(line) for line in raw if line.strip())
        else:
            text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
            self._file = text
            rows = csv.reader(text, delimiter="\t" if fmt == "tsv" else ",")
            if self._csv_header:
                next(rows, None)
            self._records = (row for row in rows if row and any(f.strip() for f in row))
        for _ in range(self._skip[self._shard]):
            if next(self._records, _END) is _END:
                break
        return self._records
