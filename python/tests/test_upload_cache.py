"""The client's digest cache of uploaded directories (``cumulus._upload_cache``): what
makes an entry trusted, what makes it a miss, and that a broken cache file is ignored."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from cumulus import _bundle, _contract, _upload_cache

LIMIT = _contract.DEFAULT_MAX_WORKDIR_BYTES
#: A modification time well before any listing (so no file is racy).
OLD_NS = 1_000_000_000_000_000_000


def tree(root: Path, files: dict[str, bytes], mtime_ns: int | None = OLD_NS) -> Path:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        if mtime_ns is not None:
            os.utime(path, ns=(mtime_ns, mtime_ns))
    return root


def pack_and_record(root: Path) -> _bundle.PackedDir:
    """What the SDK does on a miss: list, pack with the racy files hashed, record."""
    listing = _upload_cache.list_directory(root, LIMIT)
    hash_files = _upload_cache.hash_files_for(listing)
    assert hash_files is not None
    packed = _bundle.pack_selection(listing.selection, max_bytes=LIMIT, hash_files=hash_files)
    _upload_cache.record(listing, packed)
    return packed


def lookup(root: Path) -> _upload_cache.CachedDigest | None:
    return _upload_cache.lookup(_upload_cache.list_directory(root, LIMIT))


def test_an_unchanged_tree_hits_with_the_digest_of_its_pack(tmp_path: Path) -> None:
    root = tree(tmp_path / "p", {"a.py": b"print(1)\n", "sub/b.bin": b"x" * 1000})
    (root / ".gitignore").write_text("*.log\n")
    os.utime(root / ".gitignore", ns=(OLD_NS, OLD_NS))
    assert lookup(root) is None
    with pack_and_record(root) as packed:
        assert lookup(root) == _upload_cache.CachedDigest(
            packed.digest, packed.size_bytes, packed.file_count, packed.unpacked_bytes
        )
        # The digest is the same one a pack from scratch gives.
        with _bundle.pack_directory(root) as again:
            assert again.digest == packed.digest
    # An ignored file changing does not matter; a limit of another size does.
    (root / "noise.log").write_text("ignored")
    assert lookup(root) is not None
    assert _upload_cache.lookup(_upload_cache.list_directory(root, LIMIT - 1)) is None
    entry = json.loads(_upload_cache.cache_path().read_text())["entries"][str(root.resolve())]
    assert entry["racy"] == {}


@pytest.mark.parametrize(
    "change",
    ["size", "mtime", "new file", "removed file", "mode", "ignore rule", "replaced"],
)
def test_a_changed_tree_misses(tmp_path: Path, change: str) -> None:
    root = tree(tmp_path / "p", {"a.py": b"one", "b.py": b"two"})
    pack_and_record(root).close()
    assert lookup(root) is not None
    a = root / "a.py"
    if change == "size":
        a.write_bytes(b"three")
        os.utime(a, ns=(OLD_NS, OLD_NS))
    elif change == "mtime":
        os.utime(a, ns=(OLD_NS + 1, OLD_NS + 1))
    elif change == "new file":
        tree(root, {"c.py": b""})
    elif change == "removed file":
        a.unlink()
    elif change == "mode":
        a.chmod(0o755)
    elif change == "ignore rule":
        tree(root, {".cumulusignore": b"b.py\n"})
        # The ignore file itself is in the listing; what it selects changes too.
        (root / ".cumulusignore").unlink()
        tree(root, {".gitignore": b"b.py\n"})
    elif change == "replaced":
        # Same size, same time, another inode (made before the old one is freed).
        tree(root, {"x": b"ONE"})
        (root / "x").rename(a)
    assert lookup(root) is None


def test_a_racy_file_is_trusted_only_when_its_bytes_are_the_packed_ones(
    tmp_path: Path,
) -> None:
    root = tree(tmp_path / "p", {"old.py": b"old"})
    tree(root, {"new.py": b"fresh"}, mtime_ns=None)  # modified "now": racy
    with pack_and_record(root) as packed:
        entry = json.loads(_upload_cache.cache_path().read_text())["entries"]
        assert list(entry[str(root.resolve())]["racy"]) == ["new.py"]
        assert lookup(root) is not None and lookup(root).digest == packed.digest  # type: ignore[union-attr]
    # Changed within the timestamp's granularity: the same status, other bytes.
    new = root / "new.py"
    st = new.stat()
    new.write_bytes(b"FRESH")
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert new.stat().st_mtime_ns == st.st_mtime_ns and new.stat().st_size == st.st_size
    assert lookup(root) is None


def test_a_corrupt_or_unreadable_cache_is_ignored(tmp_path: Path) -> None:
    root = tree(tmp_path / "p", {"a.py": b"one"})
    path = _upload_cache.cache_path()
    path.parent.mkdir(parents=True)
    good = None
    for junk in (
        b"\xff\x00 not json",
        b"[]",
        b'{"version": 1, "entries": []}',
        b'{"version": 99, "entries": {}}',
        json.dumps(
            {"version": 1, "entries": {str(root.resolve()): {"fingerprint": 1, "digest": "x"}}}
        ).encode(),
    ):
        path.write_bytes(junk)
        assert lookup(root) is None
        with pack_and_record(root) as packed:  # the broken file is replaced
            good = packed.digest
        assert lookup(root) is not None
    # An entry whose digest is not one is not trusted.
    doc = json.loads(path.read_text())
    doc["entries"][str(root.resolve())]["digest"] = "A" * 64
    path.write_text(json.dumps(doc))
    assert lookup(root) is None
    # A cache path that cannot be written: no entry, no error.
    path.unlink()
    path.parent.rmdir()
    path.parent.write_text("a file where the directory should be")
    with pack_and_record(root) as packed:
        assert packed.digest == good
    assert lookup(root) is None


def test_the_cache_is_bounded_and_drops_the_oldest(tmp_path: Path) -> None:
    roots = [
        tree(tmp_path / f"p{i}", {"a.py": str(i).encode()})
        for i in range(_upload_cache.MAX_ENTRIES + 3)
    ]
    for root in roots:
        pack_and_record(root).close()
    entries = json.loads(_upload_cache.cache_path().read_text())["entries"]
    assert len(entries) == _upload_cache.MAX_ENTRIES
    assert all(str(r.resolve()) not in entries for r in roots[:3])
    assert lookup(roots[3]) is not None and lookup(roots[-1]) is not None
    assert not list(_upload_cache.cache_path().parent.glob("*.tmp"))


def test_the_environment_variable_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _upload_cache.enabled()
    monkeypatch.setenv(_upload_cache.DISABLE_ENV, "1")
    assert not _upload_cache.enabled()


def test_the_cache_lives_under_xdg_cache_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _upload_cache.cache_path() == tmp_path / "cumulus" / "upload-digests.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    assert _upload_cache.cache_path() == Path.home() / ".cache/cumulus/upload-digests.json"
    assert time.time_ns() > OLD_NS
