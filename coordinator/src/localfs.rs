//! A fast path for SubmitJob's file-system checks when they cannot block on a remote file
//! system: listing the job's dataset directory and checking its checkpoint directory on
//! the runtime thread instead of handing them to the blocking pool.
//!
//! Why: the leader runs its async work on one runtime thread (docs/architecture.md, "The
//! write path"), and a user's directory may sit on a hung network mount, so these checks
//! run on the blocking pool. That hand-off costs two cross-CPU wake-ups per submit; on one
//! benchmark VM (a wake-up ~22 µs, `perf bench sched pipe` 43 µs per round trip) it was
//! 0.14 ms of a 1-client write's ~0.95 ms, and 10% of the throughput at 64 clients
//! (docs/perf-notes.md, "SubmitJob's file-system checks").
//!
//! When is a check safe on the runtime thread? When every lookup it makes stays on local
//! file systems, which answer from memory or a local disk. [`MountTable::all_local`] says
//! so for a path when every mount whose mount point is a prefix of the (absolute, `..`-free)
//! path has a local file-system type ([`LOCAL_FS_TYPES`]) on a device that is not a loop,
//! NBD or RBD device (those may sit on the network); the path is then opened with
//! `openat2(RESOLVE_NO_SYMLINKS | RESOLVE_CACHED)`: no symlink can lead the lookup
//! elsewhere, and the lookup fails with `EAGAIN` instead of doing any I/O unless every
//! component is in the kernel's dentry cache (openat2(2): "a fast-path open that can be
//! performed without resorting to thread offload"). The listing itself reads one directory
//! through that descriptor, and only a small one ([`INLINE_DIR_MAX_BYTES`],
//! [`INLINE_DIR_MAX_ENTRIES`]): a large listing is CPU the runtime thread must not spend.
//! What is left that can wait on a device is reading a directory whose blocks are not
//! cached, from a local disk (the same disk class the coordinator's own log `fdatasync`s
//! on). Anything else (a remote or unknown file system, a symlink, a missing directory, an
//! entry whose type the file system does not report, a stale mount table) makes the fast
//! path answer `None`, and the caller runs the ordinary checks on the blocking pool, which
//! also produce every error message: the fast path only ever confirms success.
//!
//! The mount table is read from `/proc/self/mountinfo` on the blocking pool and used for at
//! most [`MOUNT_TABLE_TTL_MS`] (a failed read is remembered as long); a submit that finds it
//! older starts a refresh and takes the blocking pool itself. A network file system mounted over a local path less than that
//! long ago is the window in which a check could still block the runtime thread.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::dir::{Dir, Type};
use nix::fcntl::{AT_FDCWD, OFlag, OpenHow, ResolveFlag, openat2};

/// Most regular files a dataset directory may hold (shards).
pub const MAX_DATASET_FILES: usize = cumulus_raft_store::state::MAX_SHARDS;

/// File-system types whose lookups never wait on a network peer or a user-space daemon
/// (`mountinfo`'s type field; a `fuse.*`, `nfs*`, `cifs`, `autofs` or any other type is
/// treated as possibly remote).
/// (`overlay` is not listed: its layers may sit on any file system.) `devtmpfs` is listed
/// because `/dev` is one on most systems and `/dev/shm`, a common home for datasets kept
/// in memory, lies under it: without it a dataset there always took the blocking pool.
pub const LOCAL_FS_TYPES: &[&str] = &[
    "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "tmpfs", "ramfs", "devtmpfs",
];
/// Mount sources (devices) that may be backed by the network even under a local file-system
/// type: a loop device (its file may be on NFS), a network block device, a Ceph RBD.
const REMOTE_BACKED_SOURCES: &[&str] = &["/dev/loop", "/dev/nbd", "/dev/rbd"];
/// Most directory entries (of any type) read on the runtime thread; a larger directory is
/// listed on the blocking pool (some file systems, ZFS for one, report a directory's
/// `st_size` as its entry count, so the size alone does not bound the entries).
pub const INLINE_DIR_MAX_ENTRIES: usize = 4096;
/// Largest directory (its `st_size`, in bytes) listed on the runtime thread: ~1,000 entries
/// on ext4 (4 KiB blocks of ~100 entries), ~3,000 on tmpfs (20 bytes per entry); a listing of
/// that size takes well under a millisecond.
pub const INLINE_DIR_MAX_BYTES: i64 = 64 * 1024;
/// How long a mount table read from `/proc/self/mountinfo` is used, in milliseconds.
pub const MOUNT_TABLE_TTL_MS: u64 = 1_000;
/// Most mounts read from `/proc/self/mountinfo` (a larger table is refused: every check then
/// takes the blocking pool).
pub const MAX_MOUNTS: usize = 100_000;

/// One line of `/proc/self/mountinfo`, reduced to what the fast path needs.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    /// The mount point (field 5, octal escapes decoded).
    point: PathBuf,
    /// Whether its file-system type (after the ` - ` separator) is in [`LOCAL_FS_TYPES`].
    local: bool,
}

/// The mounts of this process's mount namespace.
#[derive(Debug, Clone, Default)]
pub struct MountTable {
    /// Every mount, in the file's order.
    mounts: Vec<Mount>,
}

/// Why the mount table could not be had.
#[derive(Debug, thiserror::Error)]
pub enum MountTableError {
    /// `/proc/self/mountinfo` could not be read.
    #[error("/proc/self/mountinfo: {0}")]
    Read(#[from] std::io::Error),
    /// A line is not `id parent major:minor root mount-point options ... - fstype source
    /// ...`.
    #[error("mountinfo line {number}: {text:?}")]
    BadLine {
        /// 1-based line number.
        number: usize,
        /// The line (lossy UTF-8).
        text: String,
    },
    /// More than [`MAX_MOUNTS`] mounts.
    #[error("more than {MAX_MOUNTS} mounts")]
    TooMany,
}

impl MountTable {
    /// Parses the text of `/proc/<pid>/mountinfo` (proc(5): `id parent major:minor root
    /// mount-point options [optional fields...] - fstype source super-options`).
    ///
    /// # Errors
    /// A line without a mount point or a ` - ` separator and type, or more than
    /// [`MAX_MOUNTS`] lines.
    pub fn parse(text: &[u8]) -> Result<Self, MountTableError> {
        let mut mounts = Vec::new();
        for (number, line) in text
            .split(|&b| b == b'\n')
            .enumerate()
            .filter(|(_, l)| !l.is_empty())
        {
            if mounts.len() >= MAX_MOUNTS {
                return Err(MountTableError::TooMany);
            }
            let bad = || MountTableError::BadLine {
                number: number + 1,
                text: String::from_utf8_lossy(line).into_owned(),
            };
            let point = line.split(|&b| b == b' ').nth(4).ok_or_else(bad)?;
            let separator = line.windows(3).position(|w| w == b" - ").ok_or_else(bad)?;
            let mut after = line[separator + 3..].split(|&b| b == b' ');
            let fstype = after.next().filter(|t| !t.is_empty()).ok_or_else(bad)?;
            let source = after.next().unwrap_or_default();
            let local_type = LOCAL_FS_TYPES.iter().any(|t| t.as_bytes() == fstype);
            let remote_backed = REMOTE_BACKED_SOURCES
                .iter()
                .any(|prefix| source.starts_with(prefix.as_bytes()));
            mounts.push(Mount {
                point: PathBuf::from(OsString::from_vec(unescape_octal(point))),
                local: local_type && !remote_backed,
            });
        }
        Ok(Self { mounts })
    }

    /// Reads and parses `/proc/self/mountinfo`. Blocking.
    ///
    /// # Errors
    /// The file cannot be read or parsed.
    pub fn read() -> Result<Self, MountTableError> {
        let text = std::fs::read("/proc/self/mountinfo")?;
        Self::parse(&text)
    }

    /// True when `path` is absolute, has no `.` or `..` component, and every mount whose
    /// mount point is `path` or one of its ancestors is local (and at least the root is
    /// mounted): resolving it, without symlinks, touches only local file systems.
    pub fn all_local(&self, path: &Path) -> bool {
        if !path.is_absolute()
            || path
                .components()
                .any(|c| matches!(c, Component::CurDir | Component::ParentDir))
        {
            return false;
        }
        let mut covered = false;
        for mount in &self.mounts {
            if path.starts_with(&mount.point) {
                if !mount.local {
                    return false;
                }
                covered = true;
            }
        }
        covered
    }
}

/// Decodes mountinfo's `\ooo` octal escapes (space, tab, newline and backslash).
fn unescape_octal(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let value = bytes[i + 1..i + 4]
                .iter()
                .fold(0u32, |acc, b| acc * 8 + u32::from(b - b'0'));
            if let Ok(byte) = u8::try_from(value) {
                out.push(byte);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

/// Opens `path` as a directory with `openat2(RESOLVE_NO_SYMLINKS | RESOLVE_CACHED)`, or
/// `None` when it is not one, a component is a symlink, a component is not in the dentry
/// cache (`EAGAIN`: the lookup would need I/O), or the kernel lacks either flag
/// (`RESOLVE_CACHED` is Linux 5.12+).
fn open_dir_cached_no_symlinks(path: &Path, flags: OFlag) -> Option<std::os::fd::OwnedFd> {
    let how = OpenHow::new()
        .flags(flags | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC)
        .resolve(
            ResolveFlag::RESOLVE_NO_SYMLINKS
                | ResolveFlag::from_bits_retain(nix::libc::RESOLVE_CACHED),
        );
    openat2(AT_FDCWD, path, how).ok()
}

/// The dataset listing of [`crate::api::list_dataset`] for `dir`, made on the calling thread
/// when that is safe and cheap (see the module doc), else `None`: the caller then lists on
/// the blocking pool. Equal to `list_dataset`'s answer whenever it is `Some`.
pub fn list_dataset_inline(table: &MountTable, dir: &str) -> Option<Vec<String>> {
    let path = Path::new(dir);
    if !table.all_local(path) {
        return None;
    }
    let fd = open_dir_cached_no_symlinks(path, OFlag::O_RDONLY)?;
    let size_bytes = nix::sys::stat::fstat(&fd).ok()?.st_size;
    if size_bytes > INLINE_DIR_MAX_BYTES {
        return None;
    }
    let mut listing = Dir::from_fd(fd).ok()?;
    let mut shards = Vec::new();
    for (read, entry) in listing.iter().enumerate() {
        if read >= INLINE_DIR_MAX_ENTRIES {
            return None;
        }
        let entry = entry.ok()?;
        let name = std::str::from_utf8(entry.file_name().to_bytes()).ok()?;
        if name.starts_with('.') {
            continue;
        }
        match entry.file_type()? {
            Type::File => shards.push(path.join(name).to_string_lossy().to_string()),
            _ => continue,
        }
        if shards.len() > MAX_DATASET_FILES {
            return None;
        }
    }
    if shards.is_empty() {
        return None;
    }
    shards.sort();
    Some(shards)
}

/// True when the checkpoint root `dir` is already a directory, checked on the calling thread
/// when that is safe; `false` means "not confirmed" (the caller runs the full check, which
/// creates a missing directory, on the blocking pool).
pub fn ckpt_dir_exists_inline(table: &MountTable, dir: &str) -> bool {
    let path = Path::new(dir);
    table.all_local(path) && open_dir_cached_no_symlinks(path, OFlag::O_PATH).is_some()
}

/// SubmitJob's two directory checks on the calling thread: `Some(listing)` (the listing of
/// `dataset`, or `None` when there is none to list) when every check asked for is confirmed
/// here ([`list_dataset_inline`], [`ckpt_dir_exists_inline`]), else `None`: the caller runs
/// both on the blocking pool. The checkpoint dir goes first (the cheap check): one that must
/// be created sends both to the blocking pool without listing the dataset twice.
pub fn checks_inline(
    table: &MountTable,
    dataset: Option<&str>,
    ckpt_dir: Option<&str>,
) -> Option<Option<Vec<String>>> {
    if let Some(ckpt_dir) = ckpt_dir
        && !ckpt_dir_exists_inline(table, ckpt_dir)
    {
        return None;
    }
    match dataset {
        Some(dataset) => list_dataset_inline(table, dataset).map(Some),
        None => Some(None),
    }
}

/// The coordinator's cached mount table (one per process).
#[derive(Debug, Default)]
pub struct LocalFs {
    /// When the table was last read, and the table (`None`: that read failed).
    cache: Mutex<Option<(Instant, Option<Arc<MountTable>>)>>,
    /// True while a refresh runs on the blocking pool (one at a time).
    refreshing: Arc<AtomicBool>,
}

/// Clears [`LocalFs::refreshing`] when the refresh ends, also by panic or cancellation.
struct RefreshDone(Arc<AtomicBool>);

impl Drop for RefreshDone {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl LocalFs {
    /// The mount table when it was read less than [`MOUNT_TABLE_TTL_MS`] ago; otherwise
    /// `None`, after starting a refresh on the blocking pool (unless one runs) that stores a
    /// fresh table (or the failure, logged once per refresh) for later calls. Must be called
    /// inside a tokio runtime.
    pub fn fresh_table(self: &Arc<Self>) -> Option<Arc<MountTable>> {
        let ttl = Duration::from_millis(MOUNT_TABLE_TTL_MS);
        {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((read_at, table)) = cache.as_ref()
                && read_at.elapsed() < ttl
            {
                return table.clone();
            }
        }
        if !self.refreshing.swap(true, Ordering::AcqRel) {
            let this = Arc::clone(self);
            let done = RefreshDone(Arc::clone(&self.refreshing));
            tokio::task::spawn_blocking(move || {
                let _done = done;
                let read_at = Instant::now();
                let table = match MountTable::read() {
                    Ok(table) => Some(Arc::new(table)),
                    Err(error) => {
                        tracing::warn!(%error, "cannot read the mount table; SubmitJob's directory checks stay on the blocking pool");
                        None
                    }
                };
                *this.cache.lock().unwrap_or_else(|p| p.into_inner()) = Some((read_at, table));
            });
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table where `/` is local (so the fast path runs for real under any temp dir).
    fn all_local_root() -> MountTable {
        MountTable::parse(b"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n")
            .expect("parses")
    }

    /// A temp dir and its path without symlinks (`TMPDIR` may hold one), or `None` where this
    /// kernel or sandbox refuses `openat2` with `RESOLVE_CACHED` (before Linux 5.12, or a
    /// seccomp profile that blocks the call): the fast path then always declines, which the
    /// other tests cover.
    fn temp_dir_with_fast_path() -> Option<(tempfile::TempDir, PathBuf)> {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().canonicalize().expect("canonicalize");
        if open_dir_cached_no_symlinks(&base, OFlag::O_PATH).is_none() {
            eprintln!("openat2(RESOLVE_CACHED) unavailable here: fast path not exercised");
            return None;
        }
        Some((dir, base))
    }

    #[test]
    fn parses_mountinfo_with_optional_fields_and_escapes() {
        let text = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
40 22 0:35 / /mnt/nfs rw,relatime shared:20 master:3 - nfs4 host:/export rw,vers=4.2
41 40 8:2 / /mnt/nfs/scratch rw - xfs /dev/sdb1 rw
42 22 0:40 / /mnt/with\\040space rw - tmpfs tmpfs rw
43 22 7:0 / /mnt/image rw - ext4 /dev/loop0 rw
44 22 0:50 / /var/lib/docker/x rw - overlay overlay rw,lowerdir=/a,upperdir=/b
24 22 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw,size=12334432k,mode=755
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw
";
        let table = MountTable::parse(text.as_bytes()).expect("parses");
        assert_eq!(
            table.mounts,
            vec![
                Mount {
                    point: "/".into(),
                    local: true
                },
                Mount {
                    point: "/mnt/nfs".into(),
                    local: false
                },
                Mount {
                    point: "/mnt/nfs/scratch".into(),
                    local: true
                },
                Mount {
                    point: "/mnt/with space".into(),
                    local: true
                },
                Mount {
                    point: "/mnt/image".into(),
                    local: false
                },
                Mount {
                    point: "/var/lib/docker/x".into(),
                    local: false
                },
                Mount {
                    point: "/dev".into(),
                    local: true
                },
                Mount {
                    point: "/dev/shm".into(),
                    local: true
                },
            ]
        );
        // A mount point that is not UTF-8 is kept as bytes.
        let raw = MountTable::parse(
            b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n45 22 0:1 / /mnt/\xff rw - nfs h:/e rw\n",
        )
        .expect("parses");
        assert_eq!(
            raw.mounts[1].point,
            PathBuf::from(OsString::from_vec(b"/mnt/\xff".to_vec()))
        );
        assert!(table.all_local(Path::new("/data/dataset")));
        assert!(
            table.all_local(Path::new("/mnt/nfsx/a")),
            "a prefix by string, not by path"
        );
        assert!(table.all_local(Path::new("/mnt/with space/d")));
        assert!(
            table.all_local(Path::new("/dev/shm/dataset")),
            "a tmpfs under devtmpfs is local"
        );
        assert!(!table.all_local(Path::new("/mnt/nfs")));
        assert!(!table.all_local(Path::new("/mnt/nfs/a/b")));
        // Local itself, but reached through the NFS mount's root.
        assert!(!table.all_local(Path::new("/mnt/nfs/scratch/d")));
        assert!(!table.all_local(Path::new("relative/d")));
        assert!(!table.all_local(Path::new("/data/../mnt/nfs/a")));
        assert!(!MountTable::default().all_local(Path::new("/data")));
    }

    #[test]
    fn refuses_malformed_mountinfo() {
        assert!(MountTable::parse(b"22 1 8:1 / / rw shared:1 ext4 /dev/sda1 rw\n").is_err());
        assert!(MountTable::parse(b"22 1\n").is_err());
        assert!(MountTable::parse(b"22 1 8:1 / / rw - \n").is_err());
    }

    #[test]
    fn reads_this_process_mount_table() {
        let table = MountTable::read().expect("/proc/self/mountinfo");
        assert!(table.mounts.iter().any(|m| m.point == Path::new("/")));
    }

    #[test]
    fn inline_listing_equals_the_blocking_one_and_declines_what_it_cannot_confirm() {
        let Some((_dir, base)) = temp_dir_with_fast_path() else {
            return;
        };
        let data = base.join("data");
        std::fs::create_dir(&data).expect("mkdir");
        for name in ["shard-2.csv", "shard-0.csv", "shard-1.csv", ".hidden"] {
            std::fs::write(data.join(name), b"x\n").expect("write");
        }
        std::fs::create_dir(data.join("subdir")).expect("mkdir");
        std::os::unix::fs::symlink(data.join("shard-0.csv"), data.join("link.csv"))
            .expect("symlink");
        let table = all_local_root();
        let data_str = data.to_str().expect("utf-8 temp dir");
        let inline = list_dataset_inline(&table, data_str).expect("confirmed inline");
        let blocking = crate::api::list_dataset(data_str).expect("lists");
        assert_eq!(inline, blocking);
        assert_eq!(inline.len(), 3);

        // Declined: a symlink in the path, a missing or empty dir, a remote mount.
        let link = base.join("via-link");
        std::os::unix::fs::symlink(&data, &link).expect("symlink");
        assert_eq!(
            list_dataset_inline(&table, link.to_str().expect("utf-8")),
            None
        );
        let missing = base.join("missing");
        assert_eq!(
            list_dataset_inline(&table, missing.to_str().expect("utf-8")),
            None
        );
        let empty = base.join("empty");
        std::fs::create_dir(&empty).expect("mkdir");
        assert_eq!(
            list_dataset_inline(&table, empty.to_str().expect("utf-8")),
            None
        );
        let remote = MountTable::parse(
            format!(
                "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n40 22 0:35 / {} rw - nfs4 h:/e rw\n",
                base.display()
            )
            .as_bytes(),
        )
        .expect("parses");
        assert_eq!(list_dataset_inline(&remote, data_str), None);
    }

    #[test]
    fn a_large_directory_is_left_to_the_blocking_pool() {
        let Some((_dir, base)) = temp_dir_with_fast_path() else {
            return;
        };
        // Just under the entry cap (and the size cap on ext4, xfs, btrfs and tmpfs, whose
        // directories of 2,000 short names stay under 64 KiB): listed inline.
        for i in 0..2_000 {
            std::fs::write(base.join(format!("s{i:05}")), b"").expect("write");
        }
        let path = base.to_str().expect("utf-8");
        let small = std::fs::metadata(&base).expect("stat").len();
        if small <= INLINE_DIR_MAX_BYTES as u64 {
            assert_eq!(
                list_dataset_inline(&all_local_root(), path).map(|l| l.len()),
                Some(2_000)
            );
        }
        // Past the entry cap (whatever the file system reports as the directory's size).
        for i in 2_000..(INLINE_DIR_MAX_ENTRIES + 10) {
            std::fs::write(base.join(format!("s{i:05}")), b"").expect("write");
        }
        assert_eq!(list_dataset_inline(&all_local_root(), path), None);
        assert_eq!(
            crate::api::list_dataset(path).expect("lists").len(),
            INLINE_DIR_MAX_ENTRIES + 10
        );
    }

    #[test]
    fn ckpt_dir_is_confirmed_only_when_it_is_a_directory_reached_without_symlinks() {
        let Some((_dir, base)) = temp_dir_with_fast_path() else {
            return;
        };
        let table = all_local_root();
        let ckpt = base.join("ckpt");
        let ckpt_str = ckpt.to_str().expect("utf-8").to_string();
        assert!(!ckpt_dir_exists_inline(&table, &ckpt_str), "missing");
        std::fs::create_dir(&ckpt).expect("mkdir");
        assert!(ckpt_dir_exists_inline(&table, &ckpt_str));
        let link = base.join("link");
        std::os::unix::fs::symlink(&ckpt, &link).expect("symlink");
        assert!(!ckpt_dir_exists_inline(
            &table,
            link.to_str().expect("utf-8")
        ));
        let file = base.join("file");
        std::fs::write(&file, b"").expect("write");
        assert!(!ckpt_dir_exists_inline(
            &table,
            file.to_str().expect("utf-8")
        ));
        assert!(!ckpt_dir_exists_inline(&MountTable::default(), &ckpt_str));
    }

    #[test]
    fn both_checks_are_confirmed_inline_or_neither() {
        let Some((_dir, base)) = temp_dir_with_fast_path() else {
            return;
        };
        let table = all_local_root();
        let data = base.join("data");
        std::fs::create_dir(&data).expect("mkdir");
        std::fs::write(data.join("shard-0"), b"x\n").expect("write");
        let data = data.to_str().expect("utf-8");
        let ckpt = base.join("ckpt");
        let ckpt = ckpt.to_str().expect("utf-8");
        // A checkpoint dir still to be created: both go to the blocking pool.
        assert_eq!(checks_inline(&table, Some(data), Some(ckpt)), None);
        std::fs::create_dir(ckpt).expect("mkdir");
        let listing = checks_inline(&table, Some(data), Some(ckpt))
            .expect("confirmed")
            .expect("listed");
        assert_eq!(listing, crate::api::list_dataset(data).expect("lists"));
        assert_eq!(checks_inline(&table, None, Some(ckpt)), Some(None));
        assert_eq!(
            checks_inline(&MountTable::default(), Some(data), None),
            None
        );
    }

    #[tokio::test]
    async fn the_cached_table_is_refreshed_off_the_runtime_thread() {
        let local_fs = Arc::new(LocalFs::default());
        // The first call finds no table and starts the refresh.
        assert!(local_fs.fresh_table().is_none());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if local_fs.fresh_table().is_some() {
                break;
            }
            assert!(Instant::now() < deadline, "no table within 30 s");
            // One trip through the blocking pool per look: the refresh runs there.
            tokio::task::spawn_blocking(|| ())
                .await
                .expect("blocking pool");
        }
    }
}
