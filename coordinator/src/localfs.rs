//! A fast path for SubmitJob's file-system checks when they cannot block on a remote file
//! system: listing the job's dataset directory and checking its checkpoint directory on
//! the runtime thread instead of handing them to the blocking pool.
//!
//! Why: the leader runs its async work on one runtime thread (ARCHITECTURE.md, "write
//! path"), and a user's directory may sit on a hung network mount, so these checks run on
//! the blocking pool. That hand-off costs two cross-CPU wake-ups per submit; on session
//! 13's machine (a wake-up ~22 µs, `perf bench sched pipe` 43 µs per round trip) it was
//! 0.14 ms of a 1-client write's ~0.95 ms, and 10% of the throughput at 64 clients
//! (BENCHMARKS.md, session 13).
//!
//! When is a check safe on the runtime thread? When every lookup it makes stays on local
//! file systems, which answer from memory or a local disk. [`MountTable::all_local`] says
//! so for a path when every mount whose mount point is a prefix of the (absolute, `..`-free)
//! path has a local file-system type ([`LOCAL_FS_TYPES`]); the path is then opened with
//! `openat2(RESOLVE_NO_SYMLINKS)`, so that no symlink can lead the lookup elsewhere. The
//! listing itself reads one directory through that descriptor, and only when the directory
//! is small ([`INLINE_DIR_MAX_BYTES`]): a large listing is CPU the runtime thread must not
//! spend. Anything else (a remote or unknown file system, a symlink, a missing directory, an
//! entry whose type the file system does not report, a stale mount table) makes the fast
//! path answer `None`, and the caller runs the ordinary checks on the blocking pool, which
//! also produce every error message: the fast path only ever confirms success.
//!
//! The mount table is read from `/proc/self/mountinfo` on the blocking pool and used for at
//! most [`MOUNT_TABLE_TTL_MS`]; a submit that finds it older starts a refresh and takes the
//! blocking pool itself. A network file system mounted over a local path less than that
//! long ago is the window in which a check could still block the runtime thread.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::dir::{Dir, Type};
use nix::fcntl::{AT_FDCWD, OFlag, OpenHow, ResolveFlag, openat2};

/// File-system types whose lookups never wait on a network peer or a user-space daemon
/// (`mountinfo`'s type field; a `fuse.*`, `nfs*`, `cifs`, `autofs` or any other type is
/// treated as possibly remote).
pub const LOCAL_FS_TYPES: &[&str] = &[
    "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "tmpfs", "ramfs", "overlay",
];
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

impl MountTable {
    /// Parses the text of `/proc/<pid>/mountinfo` (proc(5): `id parent major:minor root
    /// mount-point options [optional fields...] - fstype source super-options`).
    ///
    /// # Errors
    /// A line without a mount point or a ` - ` separator and type, or more than
    /// [`MAX_MOUNTS`] lines.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut mounts = Vec::new();
        for (number, line) in text.lines().enumerate().filter(|(_, l)| !l.is_empty()) {
            if mounts.len() >= MAX_MOUNTS {
                return Err(format!("more than {MAX_MOUNTS} mounts"));
            }
            let bad = || format!("mountinfo line {}: {line:?}", number + 1);
            let point = line.split(' ').nth(4).ok_or_else(bad)?;
            let (_, after) = line.split_once(" - ").ok_or_else(bad)?;
            let fstype = after
                .split(' ')
                .next()
                .filter(|t| !t.is_empty())
                .ok_or_else(bad)?;
            mounts.push(Mount {
                point: PathBuf::from(OsString::from_vec(unescape_octal(point))),
                local: LOCAL_FS_TYPES.contains(&fstype),
            });
        }
        Ok(Self { mounts })
    }

    /// Reads and parses `/proc/self/mountinfo`. Blocking.
    ///
    /// # Errors
    /// The file cannot be read or parsed.
    pub fn read() -> Result<Self, String> {
        let text = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
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
fn unescape_octal(field: &str) -> Vec<u8> {
    let bytes = field.as_bytes();
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

/// Opens `path` as a directory with `openat2(RESOLVE_NO_SYMLINKS)`, or `None` when it is
/// not one, a component is a symlink, or the kernel has no `openat2` (before Linux 5.6).
fn open_dir_no_symlinks(path: &Path, flags: OFlag) -> Option<std::os::fd::OwnedFd> {
    let how = OpenHow::new()
        .flags(flags | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_NO_SYMLINKS);
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
    let fd = open_dir_no_symlinks(path, OFlag::O_RDONLY)?;
    let size_bytes = nix::sys::stat::fstat(&fd).ok()?.st_size;
    if size_bytes > INLINE_DIR_MAX_BYTES {
        return None;
    }
    let mut listing = Dir::from_fd(fd).ok()?;
    let mut shards = Vec::new();
    for entry in listing.iter() {
        let entry = entry.ok()?;
        let name = std::str::from_utf8(entry.file_name().to_bytes()).ok()?;
        if name.starts_with('.') {
            continue;
        }
        match entry.file_type()? {
            Type::File => shards.push(path.join(name).to_string_lossy().to_string()),
            _ => continue,
        }
        if shards.len() > crate::api::MAX_DATASET_FILES {
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
    table.all_local(path) && open_dir_no_symlinks(path, OFlag::O_PATH).is_some()
}

/// The coordinator's cached mount table (one per process).
#[derive(Debug, Default)]
pub struct LocalFs {
    /// The table and when it was read.
    cache: Mutex<Option<(Instant, Arc<MountTable>)>>,
    /// True while a refresh runs on the blocking pool (one at a time).
    refreshing: Arc<AtomicBool>,
}

impl LocalFs {
    /// The mount table when it was read less than [`MOUNT_TABLE_TTL_MS`] ago; otherwise
    /// `None`, after starting a refresh on the blocking pool (unless one runs) that stores a
    /// fresh table for later calls. Must be called inside a tokio runtime.
    pub fn fresh_table(self: &Arc<Self>) -> Option<Arc<MountTable>> {
        let ttl = Duration::from_millis(MOUNT_TABLE_TTL_MS);
        {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((read_at, table)) = cache.as_ref()
                && read_at.elapsed() < ttl
            {
                return Some(Arc::clone(table));
            }
        }
        if !self.refreshing.swap(true, Ordering::AcqRel) {
            let this = Arc::clone(self);
            tokio::task::spawn_blocking(move || {
                let read_at = Instant::now();
                match MountTable::read() {
                    Ok(table) => {
                        *this.cache.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some((read_at, Arc::new(table)));
                    }
                    Err(error) => {
                        tracing::warn!(%error, "cannot read the mount table; SubmitJob's directory checks stay on the blocking pool");
                    }
                }
                this.refreshing.store(false, Ordering::Release);
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
        MountTable::parse("22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n")
            .expect("parses")
    }

    #[test]
    fn parses_mountinfo_with_optional_fields_and_escapes() {
        let text = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
40 22 0:35 / /mnt/nfs rw,relatime shared:20 master:3 - nfs4 host:/export rw,vers=4.2
41 40 8:2 / /mnt/nfs/scratch rw - xfs /dev/sdb1 rw
42 22 0:40 / /mnt/with\\040space rw - tmpfs tmpfs rw
";
        let table = MountTable::parse(text).expect("parses");
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
            ]
        );
        assert!(table.all_local(Path::new("/data/dataset")));
        assert!(
            table.all_local(Path::new("/mnt/nfsx/a")),
            "a prefix by string, not by path"
        );
        assert!(table.all_local(Path::new("/mnt/with space/d")));
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
        assert!(MountTable::parse("22 1 8:1 / / rw shared:1 ext4 /dev/sda1 rw\n").is_err());
        assert!(MountTable::parse("22 1\n").is_err());
        assert!(MountTable::parse("22 1 8:1 / / rw - \n").is_err());
    }

    #[test]
    fn reads_this_process_mount_table() {
        let table = MountTable::read().expect("/proc/self/mountinfo");
        assert!(table.mounts.iter().any(|m| m.point == Path::new("/")));
    }

    #[test]
    fn inline_listing_equals_the_blocking_one_and_declines_what_it_cannot_confirm() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("data");
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
        let link = dir.path().join("via-link");
        std::os::unix::fs::symlink(&data, &link).expect("symlink");
        assert_eq!(
            list_dataset_inline(&table, link.to_str().expect("utf-8")),
            None
        );
        let missing = dir.path().join("missing");
        assert_eq!(
            list_dataset_inline(&table, missing.to_str().expect("utf-8")),
            None
        );
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).expect("mkdir");
        assert_eq!(
            list_dataset_inline(&table, empty.to_str().expect("utf-8")),
            None
        );
        let remote = MountTable::parse(&format!(
            "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n40 22 0:35 / {} rw - nfs4 h:/e rw\n",
            dir.path().display()
        ))
        .expect("parses");
        assert_eq!(list_dataset_inline(&remote, data_str), None);
    }

    #[test]
    fn a_large_directory_is_left_to_the_blocking_pool() {
        let dir = tempfile::tempdir().expect("tempdir");
        // 5,000 entries: over INLINE_DIR_MAX_BYTES on ext4, xfs, btrfs and tmpfs alike.
        for i in 0..5_000 {
            std::fs::write(dir.path().join(format!("shard-{i:08}.bin")), b"").expect("write");
        }
        let size = std::fs::metadata(dir.path()).expect("stat").len();
        assert!(size > INLINE_DIR_MAX_BYTES as u64, "directory size {size}");
        let path = dir.path().to_str().expect("utf-8");
        assert_eq!(list_dataset_inline(&all_local_root(), path), None);
    }

    #[test]
    fn ckpt_dir_is_confirmed_only_when_it_is_a_directory_reached_without_symlinks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let table = all_local_root();
        let ckpt = dir.path().join("ckpt");
        let ckpt_str = ckpt.to_str().expect("utf-8").to_string();
        assert!(!ckpt_dir_exists_inline(&table, &ckpt_str), "missing");
        std::fs::create_dir(&ckpt).expect("mkdir");
        assert!(ckpt_dir_exists_inline(&table, &ckpt_str));
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&ckpt, &link).expect("symlink");
        assert!(!ckpt_dir_exists_inline(
            &table,
            link.to_str().expect("utf-8")
        ));
        let file = dir.path().join("file");
        std::fs::write(&file, b"").expect("write");
        assert!(!ckpt_dir_exists_inline(
            &table,
            file.to_str().expect("utf-8")
        ));
        assert!(!ckpt_dir_exists_inline(&MountTable::default(), &ckpt_str));
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
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}
