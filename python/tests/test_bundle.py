"""The packer of uploaded directories (``cumulus._bundle``): ignore rules, determinism,
the size limit, and reading archives back as hostile input."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import blake3
import pytest

from cumulus import _bundle, _contract
from cumulus.errors import BundleError, WorkdirTooLarge


def write(root: Path, rel: str, data: str | bytes = "x") -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    return path


def members(packed: _bundle.PackedDir) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(packed.read()), mode="r:gz") as tar:
        return tar.getmembers()


def paths(packed: _bundle.PackedDir) -> list[str]:
    return [f.path for f in _bundle.read_archive(packed.file, packed.size_bytes, what="test")]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    write(root, "train.py", "print('hi')\n")
    write(root, "README.md", "readme\n")
    write(root, ".gitignore", "*.log\n!keep.log\nbuild/\n/data.bin\n")
    write(root, "run.log", "noise")
    write(root, "keep.log", "kept")
    write(root, "build/out.o", "object")
    write(root, "data.bin", "big")
    write(root, "src/data.bin", "not at the root: kept")
    write(root, "src/pkg/__init__.py", "")
    write(root, "src/.gitignore", "*.tmp\n!important.tmp\n")
    write(root, "src/a.tmp", "tmp")
    write(root, "src/important.tmp", "kept by negation")
    write(root, "src/pkg/b.tmp", "tmp below: still ignored")
    write(root, ".cumulusignore", "README.md\nsecrets/\n")
    write(root, "secrets/key", "k")
    write(root, ".git/HEAD", "ref: refs/heads/main\n")
    write(root, ".git/objects/ab/cdef", "blob")
    return root


def test_ignore_rules_and_git_are_honoured(project: Path) -> None:
    with _bundle.pack_directory(project) as packed:
        assert paths(packed) == [
            ".cumulusignore",
            ".gitignore",
            "keep.log",
            "src/.gitignore",
            "src/data.bin",
            "src/important.tmp",
            "src/pkg/__init__.py",
            "train.py",
        ]
        dirs = [m.name for m in members(packed) if m.isdir()]
        assert dirs == ["src", "src/pkg"]
        assert packed.file_count == 8


def test_cumulusignore_wins_over_the_gitignore_beside_it(tmp_path: Path) -> None:
    write(tmp_path, ".gitignore", "*.csv\n")
    write(tmp_path, ".cumulusignore", "!needed.csv\n")
    write(tmp_path, "needed.csv", "1,2\n")
    write(tmp_path, "other.csv", "3,4\n")
    with _bundle.pack_directory(tmp_path) as packed:
        assert "needed.csv" in paths(packed) and "other.csv" not in paths(packed)


def test_packing_is_deterministic_whatever_the_times_and_modes(
    project: Path, tmp_path: Path
) -> None:
    with _bundle.pack_directory(project) as first:
        digest, data = first.digest, first.read()
    assert digest == blake3.blake3(data).hexdigest() and len(digest) == 64
    for p in project.rglob("*"):
        os.utime(p, (12345, 67890))
    os.chmod(project / "train.py", 0o600)
    with _bundle.pack_directory(project) as second:
        assert (second.digest, second.read()) == (digest, data)
    # Header fields carry nothing of the machine: times 0, owner 0, fixed modes, no gzip
    # name or time.
    assert data[4:8] == b"\0\0\0\0" and not data[3] & 0x08  # gzip MTIME 0, no FNAME
    with _bundle.pack_directory(project) as packed:
        for m in members(packed):
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
            assert m.mode == (0o755 if m.isdir() else 0o644), m.name
    # An edit changes the digest; an executable bit is kept.
    os.chmod(project / "train.py", 0o755)
    with _bundle.pack_directory(project) as packed:
        assert packed.digest != digest
        (train,) = [m for m in members(packed) if m.name == "train.py"]
        assert train.mode == 0o755


def test_past_the_limit_the_error_names_the_largest_files(tmp_path: Path) -> None:
    write(tmp_path, "small.txt", "s")
    write(tmp_path, "weights/huge.bin", os.urandom(300_000))
    write(tmp_path, "medium.bin", os.urandom(100_000))
    with pytest.raises(WorkdirTooLarge) as e:
        _bundle.pack_directory(tmp_path, max_bytes=400_000)
    message = str(e.value)
    assert e.value.limit_bytes == 400_000 and "holds 390.6 KiB in files" in message
    assert "weights/huge.bin (293.0 KiB)" in message and "medium.bin" in message
    assert message.index("weights/huge.bin") < message.index("medium.bin")
    assert ".cumulusignore" in message
    # The default limit is the contract's.
    with _bundle.pack_directory(tmp_path, max_bytes=400_001) as packed:
        assert packed.unpacked_bytes == 400_001
    assert _contract.DEFAULT_MAX_WORKDIR_BYTES == 512 * 1024 * 1024


def test_a_decompression_bomb_is_refused_before_upload(tmp_path: Path) -> None:
    write(tmp_path, "zeros.bin", bytes(4 * 1024 * 1024))
    with pytest.raises(BundleError, match=r"decompression bomb.*zeros\.bin"):
        _bundle.pack_directory(tmp_path)


def test_links_inside_are_packed_as_their_targets(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write(root, "target.txt", "t")
    write(root, "lib/m.py", "m")
    os.symlink("target.txt", root / "link.txt")
    os.symlink("lib", root / "lib2")
    with _bundle.pack_directory(root) as packed:
        files = {
            f.path: f.data
            for f in _bundle.read_archive(packed.file, packed.size_bytes, what="t", read_all=True)
        }
        assert files == {
            "lib/m.py": b"m",
            "lib2/m.py": b"m",
            "link.txt": b"t",
            "target.txt": b"t",
        }
        assert all(m.isreg() or m.isdir() for m in members(packed))


def test_links_out_of_the_tree_loops_and_special_files_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write(tmp_path, "outside.txt", "secret")
    write(root, "ok.txt", "ok")
    os.symlink(tmp_path / "outside.txt", root / "out.txt")
    with pytest.raises(BundleError, match=r"out\.txt is a symbolic link out of the directory"):
        _bundle.pack_directory(root)
    write(root, ".cumulusignore", "out.txt\n")
    os.symlink(".", root / "sub-loop")
    write(root, "sub/x", "x")
    os.symlink("..", root / "sub" / "up")
    with pytest.raises(BundleError, match="loop"):
        _bundle.pack_directory(root)
    write(root, ".cumulusignore", "out.txt\nsub-loop\nup\n")
    os.mkfifo(root / "pipe")
    with pytest.raises(BundleError, match="pipe is not a regular file"):
        _bundle.pack_directory(root)
    write(root, ".cumulusignore", "out.txt\nsub-loop\nup\npipe\n")
    os.symlink("absent", root / "dangling")
    with pytest.raises(BundleError, match="dangling: a symbolic link that leads nowhere"):
        _bundle.pack_directory(root)
    (root / "dangling").unlink()
    with _bundle.pack_directory(root) as packed:
        assert paths(packed) == [".cumulusignore", "ok.txt", "sub/x"]


def test_a_cumulusignore_pattern_wins_over_a_deeper_gitignore(tmp_path: Path) -> None:
    write(tmp_path, ".cumulusignore", "!needed.csv\n")
    write(tmp_path, "data/.gitignore", "*.csv\n")
    write(tmp_path, "data/needed.csv", "1")
    write(tmp_path, "data/other.csv", "2")
    with _bundle.pack_directory(tmp_path) as packed:
        assert paths(packed) == [".cumulusignore", "data/.gitignore", "data/needed.csv"]


def test_mounts_are_packed_whole_under_their_name(project: Path, tmp_path: Path) -> None:
    extra = tmp_path / "extra"
    write(extra, "run.log", "not subject to the project's rules")
    write(extra, "lib/m.py", "")
    with _bundle.pack_directory(project, mounts={"_cumulus_run": extra}) as packed:
        got = paths(packed)
        assert {"_cumulus_run/run.log", "_cumulus_run/lib/m.py", "train.py"} <= set(got)
    with _bundle.pack_directory(None, mounts={"_cumulus_run": extra}) as packed:
        assert paths(packed) == ["_cumulus_run/lib/m.py", "_cumulus_run/run.log"]
    write(project, "_cumulus_run/mine.py", "")
    with pytest.raises(BundleError, match="reserved"):
        _bundle.pack_directory(project, mounts={"_cumulus_run": extra})


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="not a directory"):
        _bundle.pack_directory(tmp_path / "absent")


# -- reading archives back ---------------------------------------------------------------


def archive(*entries: tarfile.TarInfo, data: dict[str, bytes] | None = None) -> io.BytesIO:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info in entries:
            content = (data or {}).get(info.name)
            tar.addfile(info, io.BytesIO(content) if content is not None else None)
    return io.BytesIO(gzip.compress(raw.getvalue()))


def entry(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = size
    if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
        info.linkname = "/etc/passwd"
    return info


def read(buf: io.BytesIO, **kwargs: object) -> list[_bundle.ArchiveFile]:
    return _bundle.read_archive(buf, len(buf.getvalue()), what="artifacts", **kwargs)  # type: ignore[arg-type]


def test_reading_back_gives_files_and_their_bytes(project: Path) -> None:
    with _bundle.pack_directory(project) as packed:
        files = _bundle.read_archive(
            packed.file, packed.size_bytes, what="t", want="src/important.tmp"
        )
        by_path = {f.path: f for f in files}
        assert by_path["src/important.tmp"].data == b"kept by negation"
        assert by_path["train.py"].data is None and by_path["train.py"].size == 12
        everything = _bundle.read_archive(packed.file, packed.size_bytes, what="t", read_all=True)
        assert all(f.data is not None and len(f.data) == f.size for f in everything)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (entry("/etc/passwd", size=1), "not relative"),
        (entry("../escape", size=1), "not relative"),
        (entry("a/../../escape", size=1), "not relative"),
        (entry("a/./b", size=1), "not relative"),
        (entry("link", tarfile.SYMTYPE), "not a regular file or a directory"),
        (entry("hard", tarfile.LNKTYPE), "not a regular file or a directory"),
        (entry("dev", tarfile.CHRTYPE), "not a regular file or a directory"),
        (entry("fifo", tarfile.FIFOTYPE), "not a regular file or a directory"),
        (entry("x" * (_contract.MAX_ENTRY_PATH_BYTES + 1), size=1), "must be 1..="),
    ],
)
def test_hostile_entries_are_refused_with_their_name(bad: tarfile.TarInfo, match: str) -> None:
    buf = archive(bad, data={bad.name: b"x"} if bad.size else None)
    with pytest.raises(BundleError, match=match):
        read(buf)


def test_a_repeated_entry_is_refused() -> None:
    buf = archive(entry("a", size=1), entry("a", size=1), data={"a": b"x"})
    with pytest.raises(BundleError, match="'a' appears twice"):
        read(buf)


def test_a_bomb_is_refused_while_reading() -> None:
    size = 8 * 1024 * 1024
    buf = archive(entry("zeros", size=size), data={"zeros": bytes(size)})
    assert len(buf.getvalue()) * _contract.MAX_EXPANSION_RATIO < size
    with pytest.raises(BundleError, match="decompression bomb"):
        read(buf, read_all=True)


def test_garbage_is_not_an_archive() -> None:
    with pytest.raises(BundleError, match="not a valid packed directory"):
        read(io.BytesIO(b"definitely not gzip"))
