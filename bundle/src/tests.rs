//! Packing and unpacking on real files in temporary directories; hostile archives built
//! header by header with the `tar` crate's low-level API.

use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, SystemTime};

use cumulus_api::blobs::{MAX_ENTRY_PATH_BYTES, is_valid_digest};

use crate::*;

fn write(root: &Path, rel: &str, bytes: &[u8]) {
    let path = root.join(rel);
    fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    fs::write(&path, bytes).expect("write");
}

fn chmod(root: &Path, rel: &str, mode: u32) {
    fs::set_permissions(root.join(rel), fs::Permissions::from_mode(mode)).expect("chmod");
}

/// A small project: sources, a script, an empty directory, nested files.
fn project(root: &Path) {
    write(root, "train.py", b"print('hello')\n");
    write(root, "run.sh", b"#!/bin/sh\necho run\n");
    chmod(root, "run.sh", 0o755);
    write(root, "pkg/__init__.py", b"");
    write(root, "pkg/model.py", b"W = [1, 2, 3]\n");
    write(root, "data/small.csv", b"1,2,3\n4,5,6\n");
    fs::create_dir_all(root.join("empty/inner")).expect("mkdir");
}

fn pack_default(dir: &Path) -> Packed {
    pack(dir, &PackOptions::default()).expect("pack")
}

/// Every file and directory under `root` (relative), with file bytes and exec bits.
/// A relative path, and for a file its bytes and exec bit.
type TreeEntry = (String, Option<(Vec<u8>, bool)>);

fn tree(root: &Path) -> Vec<TreeEntry> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).expect("read_dir") {
            let e = e.expect("entry");
            let rel = e
                .path()
                .strip_prefix(root)
                .expect("under root")
                .to_str()
                .expect("utf8")
                .to_string();
            let meta = fs::symlink_metadata(e.path()).expect("meta");
            if meta.is_dir() {
                out.push((rel, None));
                stack.push(e.path());
            } else {
                assert!(meta.is_file(), "{rel} is not a regular file");
                let exec = meta.permissions().mode() & 0o111 != 0;
                out.push((rel, Some((fs::read(e.path()).expect("read"), exec))));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn the_same_tree_packs_to_the_same_bytes_whatever_its_times_modes_and_order() {
    let a = tempfile::tempdir().expect("tempdir");
    project(a.path());
    let first = pack_default(a.path());
    assert!(is_valid_digest(&first.digest), "{}", first.digest);
    assert_eq!(first.files, 5);
    assert_eq!(first.dirs, 4, "pkg, data, empty, empty/inner");
    assert_eq!(first.unpacked_bytes, 15 + 19 + 14 + 12);
    assert_eq!(
        digest_file(first.path()).expect("digest"),
        (first.digest.clone(), first.size_bytes)
    );

    // Times changed, a non-exec mode changed: nothing in the archive changes.
    let old = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
    for rel in ["train.py", "pkg/model.py", "run.sh"] {
        fs::File::options()
            .write(true)
            .open(a.path().join(rel))
            .expect("open")
            .set_modified(old)
            .expect("touch");
    }
    chmod(a.path(), "train.py", 0o600);
    let again = pack_default(a.path());
    assert_eq!(again.digest, first.digest);
    assert_eq!(
        fs::read(again.path()).expect("read"),
        fs::read(first.path()).expect("read")
    );

    // Another directory made in another order with the same content.
    let b = tempfile::tempdir().expect("tempdir");
    fs::create_dir_all(b.path().join("empty/inner")).expect("mkdir");
    write(b.path(), "data/small.csv", b"1,2,3\n4,5,6\n");
    write(b.path(), "pkg/model.py", b"W = [1, 2, 3]\n");
    write(b.path(), "run.sh", b"#!/bin/sh\necho run\n");
    chmod(b.path(), "run.sh", 0o700);
    write(b.path(), "pkg/__init__.py", b"");
    write(b.path(), "train.py", b"print('hello')\n");
    assert_eq!(pack_default(b.path()).digest, first.digest);

    // One byte, or the exec bit, makes another blob.
    write(b.path(), "train.py", b"print('hellO')\n");
    assert_ne!(pack_default(b.path()).digest, first.digest);
    write(b.path(), "train.py", b"print('hello')\n");
    chmod(b.path(), "run.sh", 0o644);
    assert_ne!(pack_default(b.path()).digest, first.digest);
}

#[test]
fn a_packed_tree_unpacks_to_the_same_files_dirs_and_exec_bits() {
    let src = tempfile::tempdir().expect("tempdir");
    project(src.path());
    let long = format!("{}/{}.txt", "d".repeat(120), "f".repeat(150));
    write(src.path(), &long, b"long path\n");
    write(src.path(), "ünïcode/名前.txt", b"utf-8 names\n");
    let packed = pack_default(src.path());
    let out = tempfile::tempdir().expect("tempdir");
    let dest = out.path().join("w");
    let done = unpack(packed.path(), &dest, &UnpackLimits::default()).expect("unpack");
    assert_eq!(tree(&dest), tree(src.path()));
    assert_eq!(done.files, packed.files);
    assert_eq!(done.bytes, packed.unpacked_bytes);
    assert!(
        fs::metadata(dest.join("run.sh"))
            .expect("meta")
            .permissions()
            .mode()
            & 0o100
            != 0
    );

    let listed = list(packed.path(), &UnpackLimits::default()).expect("list");
    let names: Vec<&str> = listed.iter().map(|e| e.path.as_str()).collect();
    let mut sorted = names.clone();
    sorted.sort_unstable();
    assert_eq!(names, sorted, "entries are sorted");
    assert!(names.contains(&long.as_str()), "{names:?}");
    let run = listed.iter().find(|e| e.path == "run.sh").expect("run.sh");
    assert_eq!(
        (run.kind, run.size, run.executable),
        (EntryKind::File, 19, true)
    );

    let mut bytes = Vec::new();
    let n = extract_file(
        packed.path(),
        "./pkg//model.py",
        &mut bytes,
        &UnpackLimits::default(),
    )
    .expect("extract");
    assert_eq!((n, bytes.as_slice()), (14, b"W = [1, 2, 3]\n".as_slice()));
    let err = extract_file(
        packed.path(),
        "pkg",
        &mut Vec::new(),
        &UnpackLimits::default(),
    )
    .expect_err("a directory is not a file");
    assert!(matches!(err, UnpackError::NotFound(_)), "{err}");

    let err = unpack(packed.path(), &dest, &UnpackLimits::default()).expect_err("exists");
    assert!(matches!(err, UnpackError::DestExists(_)), "{err}");
}

#[test]
fn gitignore_cumulusignore_and_git_are_left_out_unless_asked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    project(root);
    write(root, ".gitignore", b"*.log\n/build/\n");
    write(root, "x.log", b"log");
    write(root, "build/out.bin", b"bin");
    write(root, "pkg/.gitignore", b"cache/\n");
    write(root, "pkg/cache/c", b"cached");
    write(root, ".cumulusignore", b"data/\n!keep.log\n");
    write(root, "keep.log", b"kept by the negation");
    write(root, ".git/HEAD", b"ref: refs/heads/main\n");
    write(root, ".env.example", b"dotfiles are packed");

    let packed = pack_default(root);
    let names: Vec<String> = list(packed.path(), &UnpackLimits::default())
        .expect("list")
        .into_iter()
        .map(|e| e.path)
        .collect();
    for absent in [
        "x.log",
        "build",
        "build/out.bin",
        "pkg/cache/c",
        "data/small.csv",
        ".git/HEAD",
        ".git",
    ] {
        assert!(
            !names.iter().any(|n| n == absent),
            "{absent} packed: {names:?}"
        );
    }
    for present in [
        ".gitignore",
        ".cumulusignore",
        "pkg/.gitignore",
        "keep.log",
        ".env.example",
        "train.py",
        "empty/inner",
    ] {
        assert!(
            names.iter().any(|n| n == present),
            "{present} missing: {names:?}"
        );
    }

    let all = pack(
        root,
        &PackOptions {
            respect_ignore_files: false,
            ..PackOptions::default()
        },
    )
    .expect("pack all");
    let names: Vec<String> = list(all.path(), &UnpackLimits::default())
        .expect("list")
        .into_iter()
        .map(|e| e.path)
        .collect();
    for present in [
        "x.log",
        "build/out.bin",
        "pkg/cache/c",
        "data/small.csv",
        ".git/HEAD",
    ] {
        assert!(
            names.iter().any(|n| n == present),
            "{present} missing: {names:?}"
        );
    }
}

#[test]
fn links_inside_are_packed_as_their_files_and_links_outside_refused() {
    let outside = tempfile::tempdir().expect("tempdir");
    write(outside.path(), "secret", b"not yours");
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    project(root);
    std::os::unix::fs::symlink("pkg/model.py", root.join("model-link.py")).expect("symlink");
    std::os::unix::fs::symlink("pkg", root.join("pkg-link")).expect("symlink");
    let packed = pack_default(root);
    let out = tempfile::tempdir().expect("tempdir");
    let dest = out.path().join("w");
    unpack(packed.path(), &dest, &UnpackLimits::default()).expect("unpack");
    let meta = fs::symlink_metadata(dest.join("model-link.py")).expect("meta");
    assert!(meta.is_file(), "a regular file, not a link");
    assert_eq!(
        fs::read(dest.join("model-link.py")).expect("read"),
        b"W = [1, 2, 3]\n"
    );
    assert_eq!(
        fs::read(dest.join("pkg-link/model.py")).expect("read"),
        b"W = [1, 2, 3]\n"
    );

    std::os::unix::fs::symlink(outside.path().join("secret"), root.join("leak")).expect("symlink");
    let err = pack(root, &PackOptions::default()).expect_err("link outside");
    let text = err.to_string();
    assert!(
        matches!(err, PackError::LinkOutside { ref link, .. } if link == "leak"),
        "{text}"
    );
    assert!(text.contains("leak") && text.contains("secret"), "{text}");
    fs::remove_file(root.join("leak")).expect("rm");

    std::os::unix::fs::symlink("/etc", root.join("pkg/up")).expect("symlink");
    let err = pack(root, &PackOptions::default()).expect_err("dir link outside");
    // Found through pkg/ or through the link to it, whichever the walk reaches first.
    assert!(
        matches!(err, PackError::LinkOutside { ref link, ref target } if link.ends_with("/up") && target == "/etc"),
        "{err}"
    );
    fs::remove_file(root.join("pkg/up")).expect("rm");

    std::os::unix::fs::symlink("nowhere", root.join("dangling")).expect("symlink");
    let err = pack(root, &PackOptions::default()).expect_err("dangling link");
    assert!(err.to_string().contains("dangling"), "{err}");
}

#[test]
fn past_the_size_limit_the_error_names_the_largest_files_and_the_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    for i in 0..12u64 {
        write(
            root,
            &format!("f{i:02}.bin"),
            &vec![b'x'; (1000 + i * 100) as usize],
        );
    }
    write(root, "weights/big.pt", &vec![0u8; 50_000]);
    let err = pack(
        root,
        &PackOptions {
            max_bytes: 40_000,
            ..PackOptions::default()
        },
    )
    .expect_err("too large");
    let PackError::TooLarge {
        total_bytes,
        limit_bytes,
        ref largest,
    } = err
    else {
        panic!("not TooLarge: {err}");
    };
    assert_eq!(limit_bytes, 40_000);
    assert_eq!(
        total_bytes,
        50_000 + (0..12).map(|i| 1000 + i * 100).sum::<u64>()
    );
    assert_eq!(largest.len(), LARGEST_NAMED);
    assert_eq!(largest[0], ("weights/big.pt".to_string(), 50_000));
    assert_eq!(largest[1], ("f11.bin".to_string(), 2_100));
    assert_eq!(largest[9], ("f03.bin".to_string(), 1_300));
    let text = err.to_string();
    assert!(
        text.contains("weights/big.pt") && text.contains("48.8 KiB"),
        "{text}"
    );
    assert!(text.contains("39.1 KiB"), "the limit: {text}");
    assert!(!text.contains("f02.bin"), "only the largest ten: {text}");
    assert!(text.contains(CUMULUSIGNORE), "{text}");

    // Ignored files do not count.
    write(root, ".cumulusignore", b"weights/\n");
    pack(
        root,
        &PackOptions {
            max_bytes: 40_000,
            ..PackOptions::default()
        },
    )
    .expect("fits without the weights");
}

#[test]
fn special_files_are_refused_when_packing() {
    let dir = tempfile::tempdir().expect("tempdir");
    project(dir.path());
    nix::unistd::mkfifo(&dir.path().join("pipe"), nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
    let err = pack(dir.path(), &PackOptions::default()).expect_err("fifo");
    assert!(
        matches!(err, PackError::Special { ref path, kind: "FIFO" } if path == "pipe"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------
// Hostile archives.

/// A header whose path bytes are written as they are (absolute, `..`: what `set_path`
/// refuses to write).
fn raw_header(path: &[u8], ty: tar::EntryType, size: u64) -> tar::Header {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(ty);
    h.set_size(size);
    h.set_mode(0o644);
    h.as_old_mut().name[..path.len()].copy_from_slice(path);
    h.set_cksum();
    h
}

/// Writes a tar.gz of `entries` (header, data) into `dir/name`.
fn archive(dir: &Path, name: &str, entries: &[(tar::Header, Vec<u8>)]) -> std::path::PathBuf {
    let path = dir.join(name);
    let gz = flate2::write::GzEncoder::new(
        fs::File::create(&path).expect("create"),
        flate2::Compression::default(),
    );
    let mut b = tar::Builder::new(gz);
    for (h, data) in entries {
        b.append(h, data.as_slice()).expect("append");
    }
    b.into_inner().expect("tar").finish().expect("gz");
    path
}

fn file(path: &str, data: &[u8]) -> (tar::Header, Vec<u8>) {
    (
        raw_header(path.as_bytes(), tar::EntryType::Regular, data.len() as u64),
        data.to_vec(),
    )
}

fn link(path: &str, ty: tar::EntryType, target: &str) -> (tar::Header, Vec<u8>) {
    let mut h = raw_header(path.as_bytes(), ty, 0);
    h.set_link_name(target).expect("link name");
    h.set_cksum();
    (h, Vec::new())
}

/// Unpacks `archive` into a new `dest` and expects a refusal naming `entry`; nothing is
/// left behind.
fn refused(archive: &Path, entry: &str, reason: &str) {
    let out = tempfile::tempdir().expect("tempdir");
    let dest = out.path().join("w");
    let err = unpack(archive, &dest, &UnpackLimits::default()).expect_err("refused");
    let text = err.to_string();
    assert!(matches!(err, UnpackError::Refused { .. }), "{text}");
    assert!(text.contains(entry), "{text} should name {entry}");
    assert!(text.contains(reason), "{text} should say {reason}");
    assert!(!dest.exists(), "what was unpacked is removed");
    let err = list(archive, &UnpackLimits::default()).expect_err("list refuses too");
    assert!(err.to_string().contains(entry), "{err}");
}

#[test]
fn hostile_entries_are_refused_with_the_entry_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let ok = file("ok.txt", b"fine");
    // (archive name, entries, the entry named, the reason given)
    type Case<'a> = (&'a str, Vec<(tar::Header, Vec<u8>)>, &'a str, &'a str);
    let cases: Vec<Case> = vec![
        (
            "abs",
            vec![ok.clone(), file("/etc/cron.d/x", b"pwn")],
            "/etc/cron.d/x",
            "absolute path",
        ),
        (
            "dotdot",
            vec![ok.clone(), file("a/../../escape", b"pwn")],
            "a/../../escape",
            "`..`",
        ),
        (
            "dotdot-dir",
            vec![(raw_header(b"../up/", tar::EntryType::Directory, 0), vec![])],
            "../up/",
            "`..`",
        ),
        (
            "symlink",
            vec![link("s", tar::EntryType::Symlink, "/etc/passwd")],
            "archive entry s",
            "symbolic link (to /etc/passwd)",
        ),
        (
            "hardlink",
            vec![ok.clone(), link("h", tar::EntryType::Link, "ok.txt")],
            "archive entry h",
            "hard link",
        ),
        (
            "chardev",
            vec![(raw_header(b"null", tar::EntryType::Char, 0), vec![])],
            "archive entry null",
            "character device",
        ),
        (
            "blockdev",
            vec![(raw_header(b"sda", tar::EntryType::Block, 0), vec![])],
            "archive entry sda",
            "block device",
        ),
        (
            "fifo",
            vec![(raw_header(b"pipe", tar::EntryType::Fifo, 0), vec![])],
            "archive entry pipe",
            "FIFO",
        ),
        (
            "dup",
            vec![ok.clone(), file("ok.txt", b"again")],
            "ok.txt",
            "same path",
        ),
        (
            "file-then-dir",
            vec![ok.clone(), file("ok.txt/inner", b"x")],
            "ok.txt/inner",
            "a file of the archive",
        ),
        (
            "dir-with-data",
            vec![(
                raw_header(b"d/", tar::EntryType::Directory, 3),
                b"abc".to_vec(),
            )],
            "d/",
            "bytes of data",
        ),
        (
            "non-utf8",
            vec![file_bytes(b"bad\xff", b"x")],
            "bad",
            "not UTF-8",
        ),
    ];
    for (name, entries, entry, reason) in cases {
        let path = archive(d, name, &entries);
        refused(&path, entry, reason);
    }
}

fn file_bytes(path: &[u8], data: &[u8]) -> (tar::Header, Vec<u8>) {
    (
        raw_header(path, tar::EntryType::Regular, data.len() as u64),
        data.to_vec(),
    )
}

#[test]
fn long_names_and_pax_paths_are_checked_like_any_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    // A GNU long name that escapes.
    let escape = format!("{}/../../../../etc/x", "a".repeat(120));
    let mut long = raw_header(
        b"././@LongLink",
        tar::EntryType::GNULongName,
        escape.len() as u64 + 1,
    );
    long.set_cksum();
    let mut name = escape.clone().into_bytes();
    name.push(0);
    let path = archive(d, "gnu-long", &[(long, name), file("placeholder", b"x")]);
    refused(&path, "../../../../etc/x", "`..`");

    // A PAX path past the limit.
    let too_long = "p/".repeat(MAX_ENTRY_PATH_BYTES / 2 + 1);
    let record = pax(&[("path", too_long.as_bytes())]);
    let path = archive(
        d,
        "pax-long",
        &[
            (
                raw_header(b"pax", tar::EntryType::XHeader, record.len() as u64),
                record,
            ),
            file("placeholder", b"x"),
        ],
    );
    refused(&path, "p/p/", "over the limit");

    // A PAX size that disagrees with the header (parsers that differ see different files).
    let record = pax(&[("size", b"1")]);
    let path = archive(
        d,
        "pax-size",
        &[
            (
                raw_header(b"pax", tar::EntryType::XHeader, record.len() as u64),
                record,
            ),
            file("sized", b"xyz"),
        ],
    );
    refused(&path, "sized", "disagrees");

    // A PAX absolute path over a harmless header name.
    let record = pax(&[("path", b"/tmp/evil")]);
    let path = archive(
        d,
        "pax-abs",
        &[
            (
                raw_header(b"pax", tar::EntryType::XHeader, record.len() as u64),
                record,
            ),
            file("harmless", b"x"),
        ],
    );
    refused(&path, "/tmp/evil", "absolute path");

    // An oversized extension header is not read into memory.
    let huge = MAX_PAX_HEADER_BYTES + 1;
    let path = archive(
        d,
        "pax-huge",
        &[(
            raw_header(b"pax", tar::EntryType::XHeader, huge),
            vec![b'x'; huge as usize],
        )],
    );
    refused(&path, "extension header", "over the limit");
}

/// PAX records as `tar` writes them.
fn pax(records: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (key, value) in records {
        let rest = key.len() + value.len() + 3;
        let mut len = rest + 1;
        while rest + len.to_string().len() != len {
            len = rest + len.to_string().len();
        }
        out.extend_from_slice(format!("{len} {key}=").as_bytes());
        out.extend_from_slice(value);
        out.push(b'\n');
    }
    out
}

#[test]
fn a_decompression_bomb_stops_at_the_ratio_and_the_callers_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    // 64 MiB of zeros packs to about 64 KiB: a ratio near 1000, over 200.
    let zeros = vec![0u8; 64 << 20];
    let path = archive(d, "bomb", &[file("a", b"ok"), file("zeros", &zeros)]);
    let packed = fs::metadata(&path).expect("meta").len();
    assert!(packed < (64 << 20) / 200, "{packed} bytes");
    let out = tempfile::tempdir().expect("tempdir");
    let dest = out.path().join("w");
    let err = unpack(&path, &dest, &UnpackLimits::default()).expect_err("bomb");
    let text = err.to_string();
    assert!(
        matches!(err, UnpackError::TooLarge { ref entry, limit_bytes } if entry == "zeros" && limit_bytes == packed * 200),
        "{text}"
    );
    assert!(!dest.exists());

    // Compressible but under the ratio, over a caller's limit.
    let path = archive(
        d,
        "big",
        &[file("a", &[7u8; 1000]), file("b", &[9u8; 1000])],
    );
    let err = unpack(
        &path,
        &out.path().join("w2"),
        &UnpackLimits {
            max_bytes: 1500,
            ..UnpackLimits::default()
        },
    )
    .expect_err("over the caller's limit");
    assert!(
        matches!(err, UnpackError::TooLarge { ref entry, limit_bytes: 1500 } if entry == "b"),
        "{err}"
    );
}

#[test]
fn too_many_entries_corrupt_and_truncated_archives_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let entries: Vec<_> = (0..20).map(|i| file(&format!("f{i}"), b"x")).collect();
    let path = archive(d, "many", &entries);
    let err = unpack(
        &path,
        &d.join("w"),
        &UnpackLimits {
            max_entries: 10,
            ..UnpackLimits::default()
        },
    )
    .expect_err("too many");
    assert!(
        matches!(err, UnpackError::TooManyEntries { limit: 10 }),
        "{err}"
    );

    fs::write(d.join("plain"), b"not gzip at all").expect("write");
    let err = list(&d.join("plain"), &UnpackLimits::default()).expect_err("not gzip");
    assert!(matches!(err, UnpackError::Corrupt(_)), "{err}");

    let bytes = fs::read(&path).expect("read");
    fs::write(d.join("cut"), &bytes[..bytes.len() / 2]).expect("write");
    let err = unpack(&d.join("cut"), &d.join("w3"), &UnpackLimits::default()).expect_err("cut");
    assert!(matches!(err, UnpackError::Corrupt(_)), "{err}");
    assert!(!d.join("w3").exists());
}

#[test]
fn archives_of_other_tools_with_dot_prefixes_and_missing_parents_unpack() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let mut exec = raw_header(b"./bin/tool", tar::EntryType::Regular, 3);
    exec.set_mode(0o700);
    exec.set_cksum();
    let path = archive(
        d,
        "other",
        &[
            (raw_header(b"./", tar::EntryType::Directory, 0), vec![]),
            (exec, b"abc".to_vec()),
            (
                raw_header(b"deep/er/", tar::EntryType::Directory, 0),
                vec![],
            ),
            file("deep/er/f", b"f"),
        ],
    );
    let dest = d.join("w");
    let done = unpack(&path, &dest, &UnpackLimits::default()).expect("unpack");
    assert_eq!(
        done,
        Unpacked {
            files: 2,
            dirs: 3,
            bytes: 4
        }
    );
    assert_eq!(fs::read(dest.join("bin/tool")).expect("read"), b"abc");
    let mode = fs::metadata(dest.join("bin/tool"))
        .expect("meta")
        .permissions()
        .mode();
    assert!(mode & 0o100 != 0, "{mode:o}");
    let mode = fs::metadata(dest.join("deep/er/f"))
        .expect("meta")
        .permissions()
        .mode();
    assert_eq!(mode & 0o111, 0, "{mode:o}");
}

#[test]
fn digest_file_is_blake3_of_the_bytes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("f");
    let mut f = fs::File::create(&path).expect("create");
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    f.write_all(&data).expect("write");
    drop(f);
    let (digest, size) = digest_file(&path).expect("digest");
    assert_eq!(digest, blake3::hash(&data).to_hex().to_string());
    assert_eq!(size, 1_000_000);
}

#[test]
fn packed_archives_persist_beside_their_destination() {
    let src = tempfile::tempdir().expect("tempdir");
    project(src.path());
    let out = tempfile::tempdir().expect("tempdir");
    let packed = pack(
        src.path(),
        &PackOptions {
            temp_dir: Some(out.path().to_path_buf()),
            ..PackOptions::default()
        },
    )
    .expect("pack");
    let digest = packed.digest.clone();
    let dest = out.path().join(format!("{digest}.tar.gz"));
    packed.persist(&dest).expect("persist");
    assert_eq!(digest_file(&dest).expect("digest").0, digest);
    assert_eq!(
        fs::read_dir(out.path()).expect("ls").count(),
        1,
        "no temp file left"
    );
}

fn fp(dir: &Path) -> Fingerprint {
    fingerprint(dir, &PackOptions::default()).expect("fingerprint")
}

/// Sets the mtime of `rel` to `secs` after the epoch.
fn set_mtime(root: &Path, rel: &str, secs: u64) {
    fs::File::options()
        .write(true)
        .open(root.join(rel))
        .expect("open")
        .set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
        .expect("set mtime");
}

#[test]
fn the_fingerprint_stays_for_the_same_tree_and_changes_with_size_mtime_and_entries() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    project(root);
    write(root, ".gitignore", b"*.log\n");
    let first = fp(root);
    assert!(is_valid_digest(&first.digest), "{}", first.digest);
    assert_eq!(first, fp(root), "the same tree, walked twice");
    assert!(first.newest_change_ns > 0);

    // An ignored file comes and goes: the selection, and so the fingerprint, stays.
    write(root, "debug.log", b"noise");
    assert_eq!(fp(root).digest, first.digest, "an ignored file was listed");
    fs::remove_file(root.join("debug.log")).expect("rm");

    // The same size, another mtime.
    let before = fp(root);
    write(root, "pkg/model.py", b"W = [9, 9, 9]\n");
    set_mtime(root, "pkg/model.py", 1_000_000);
    let changed = fp(root);
    assert_ne!(
        changed.digest, before.digest,
        "an mtime change was not seen"
    );
    assert_eq!(changed.unpacked_bytes, before.unpacked_bytes);

    // Another size.
    write(root, "train.py", b"print('hello, world')\n");
    let grown = fp(root);
    assert_ne!(grown.digest, changed.digest, "a size change was not seen");

    // An added file, then removed.
    write(root, "pkg/extra.py", b"");
    let added = fp(root);
    assert_ne!(added.digest, grown.digest, "an added file was not seen");
    assert_eq!(added.files, grown.files + 1);
    fs::remove_file(root.join("pkg/extra.py")).expect("rm");
    let removed = fp(root);
    assert_ne!(removed.digest, added.digest, "a removed file was not seen");
    assert_eq!(removed.files, grown.files);

    // A rule that now ignores a packed file: the selection changes.
    write(root, ".cumulusignore", b"data/\n");
    let ignored = fp(root);
    assert_ne!(
        ignored.digest, removed.digest,
        "a newly ignored file was listed"
    );

    // The options that change the bytes are part of it.
    let all = fingerprint(
        root,
        &PackOptions {
            respect_ignore_files: false,
            ..PackOptions::default()
        },
    )
    .expect("fingerprint");
    assert_ne!(all.digest, ignored.digest);
}

#[test]
fn the_fingerprint_selects_exactly_what_pack_packs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    project(root);
    write(root, ".gitignore", b"*.log\n/build/\n");
    write(root, "x.log", b"log");
    write(root, "build/out.bin", b"bin");
    write(root, ".cumulusignore", b"data/\n!keep.log\n");
    write(root, "keep.log", b"kept");
    write(root, ".git/HEAD", b"ref: refs/heads/main\n");
    std::os::unix::fs::symlink("train.py", root.join("alias.py")).expect("symlink");
    for respect_ignore_files in [true, false] {
        let options = PackOptions {
            respect_ignore_files,
            ..PackOptions::default()
        };
        let packed = pack(root, &options).expect("pack");
        let print = fingerprint(root, &options).expect("fingerprint");
        assert_eq!(
            (print.files, print.dirs, print.unpacked_bytes),
            (packed.files, packed.dirs, packed.unpacked_bytes),
            "respect_ignore_files {respect_ignore_files}"
        );
        let listed: Vec<String> = crate::pack::selected(root, &options)
            .expect("selected")
            .into_iter()
            .map(|i| i.rel)
            .collect();
        let names: Vec<String> = list(packed.path(), &UnpackLimits::default())
            .expect("list")
            .into_iter()
            .map(|e| e.path)
            .collect();
        assert_eq!(listed, names, "respect_ignore_files {respect_ignore_files}");
    }

    // What pack refuses before reading, fingerprint refuses too.
    let outside = tempfile::tempdir().expect("tempdir");
    std::os::unix::fs::symlink(outside.path(), root.join("out")).expect("symlink");
    assert!(matches!(
        fingerprint(root, &PackOptions::default()),
        Err(PackError::LinkOutside { .. })
    ));
}
