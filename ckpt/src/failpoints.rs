//! Named failpoints of the local commit protocol (crash and disk-full tests).
//!
//! They are compiled in only with the cargo feature `failpoints` (off by default; in a
//! default build every failpoint expands to nothing and the `fail` crate is not linked).
//! With the feature, a process configures them through the `fail` crate: the environment
//! variable `FAILPOINTS="name=action;…"` read by `fail::FailScenario::setup()`, or
//! `fail::cfg(name, action)`. The actions used by the tests:
//! - `panic`: the process dies at that point (the test runs the commit in a child process,
//!   so the file system is left exactly as a crash there leaves it);
//! - `return(enospc)`: the operation fails there with `ENOSPC` ("No space left on device"),
//!   a full disk; `return(eio)` or a bare `return` fail it with `EIO`.
//!
//! The points, in protocol order. A part commit by the worker agent:
//! [`PART_FSYNC_FILE`] (before each file's fsync), [`PART_FSYNC_DIRS`],
//! [`PART_MKDIR_PARENTS`] (`step-N/rank-r`), [`PART_RENAME`] (staging → part directory),
//! [`PART_RECREATE_STAGING`], [`PART_FSYNC_PARENT`] (the changed directories). The leader's
//! `MANIFEST.json` and `LATEST` writes (temp file, fsync, rename, directory fsync):
//! [`MANIFEST_WRITE`] (after half of the temp file is written), [`MANIFEST_FSYNC`],
//! [`MANIFEST_RENAME`], [`MANIFEST_FSYNC_DIR`], and the same four for `LATEST`. The Raft
//! commit between the manifest and `LATEST` lives in the coordinator (its own feature
//! `failpoints`: `coordinator-finalize-before-raft-commit`,
//! `coordinator-finalize-after-raft-commit`).

/// Before fsyncing one file of the staging directory (after hashing it).
pub const PART_FSYNC_FILE: &str = "ckpt-part-fsync-file";
/// Before fsyncing the staging directories.
pub const PART_FSYNC_DIRS: &str = "ckpt-part-fsync-dirs";
/// Before creating the parents `step-N/rank-r` of the part (fsynced at
/// [`PART_FSYNC_PARENT`]).
pub const PART_MKDIR_PARENTS: &str = "ckpt-part-mkdir-parents";
/// Before renaming the staging directory to `step-N/rank-r/attempt-a`.
pub const PART_RENAME: &str = "ckpt-part-rename";
/// After the rename, before recreating the empty staging directory.
pub const PART_RECREATE_STAGING: &str = "ckpt-part-recreate-staging";
/// After the staging directory is recreated, before fsyncing every directory whose
/// entries changed (the parents' parents, the rank directory, the staging parent).
pub const PART_FSYNC_PARENT: &str = "ckpt-part-fsync-parent";
/// After half of `MANIFEST.json`'s temp file is written.
pub const MANIFEST_WRITE: &str = "ckpt-manifest-write";
/// Before fsyncing `MANIFEST.json`'s temp file.
pub const MANIFEST_FSYNC: &str = "ckpt-manifest-fsync";
/// Before renaming the temp file to `MANIFEST.json`.
pub const MANIFEST_RENAME: &str = "ckpt-manifest-rename";
/// After the rename, before fsyncing the step directory.
pub const MANIFEST_FSYNC_DIR: &str = "ckpt-manifest-fsync-dir";
/// After half of `LATEST`'s temp file is written.
pub const LATEST_WRITE: &str = "ckpt-latest-write";
/// Before fsyncing `LATEST`'s temp file.
pub const LATEST_FSYNC: &str = "ckpt-latest-fsync";
/// Before renaming the temp file to `LATEST`.
pub const LATEST_RENAME: &str = "ckpt-latest-rename";
/// After the rename, before fsyncing the job directory.
pub const LATEST_FSYNC_DIR: &str = "ckpt-latest-fsync-dir";

/// Every failpoint of the part commit, in protocol order.
pub const PART_POINTS: &[&str] = &[
    PART_FSYNC_FILE,
    PART_FSYNC_DIRS,
    PART_MKDIR_PARENTS,
    PART_RENAME,
    PART_RECREATE_STAGING,
    PART_FSYNC_PARENT,
];
/// Every failpoint of the manifest and `LATEST` writes, in protocol order.
pub const FINALIZE_POINTS: &[&str] = &[
    MANIFEST_WRITE,
    MANIFEST_FSYNC,
    MANIFEST_RENAME,
    MANIFEST_FSYNC_DIR,
    LATEST_WRITE,
    LATEST_FSYNC,
    LATEST_RENAME,
    LATEST_FSYNC_DIR,
];

/// The four points of one atomic small-file write (temp file, fsync, rename, dir fsync).
/// (Read only inside `failpoint!`, which expands to nothing without the feature.)
#[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
pub(crate) struct AtomicWritePoints {
    pub(crate) write: &'static str,
    pub(crate) fsync: &'static str,
    pub(crate) rename: &'static str,
    pub(crate) fsync_dir: &'static str,
}

/// The points of the `MANIFEST.json` write.
pub(crate) const MANIFEST: AtomicWritePoints = AtomicWritePoints {
    write: MANIFEST_WRITE,
    fsync: MANIFEST_FSYNC,
    rename: MANIFEST_RENAME,
    fsync_dir: MANIFEST_FSYNC_DIR,
};

/// The points of the `LATEST` write.
pub(crate) const LATEST: AtomicWritePoints = AtomicWritePoints {
    write: LATEST_WRITE,
    fsync: LATEST_FSYNC,
    rename: LATEST_RENAME,
    fsync_dir: LATEST_FSYNC_DIR,
};

/// The I/O error a `return(ARG)` action injects: `enospc` → `ENOSPC`, anything else → `EIO`.
#[cfg(feature = "failpoints")]
pub(crate) fn injected_io_error(arg: Option<String>) -> std::io::Error {
    let errno = match arg.as_deref() {
        Some("enospc") => nix::libc::ENOSPC,
        _ => nix::libc::EIO,
    };
    std::io::Error::from_raw_os_error(errno)
}

/// `failpoint!(NAME, "op", path)`: with the feature `failpoints`, evaluates the failpoint
/// `NAME`; its `return(ARG)` action makes the enclosing function return
/// `Err(CkptError::Io { op, path, source: injected_io_error(ARG) }.into())`. Without the feature it
/// expands to nothing.
macro_rules! failpoint {
    ($name:expr, $op:expr, $path:expr) => {
        #[cfg(feature = "failpoints")]
        fail::fail_point!($name, |arg| Err($crate::CkptError::Io {
            op: $op,
            path: ::std::path::Path::to_path_buf($path),
            source: $crate::failpoints::injected_io_error(arg),
        }
        .into()));
    };
}
pub(crate) use failpoint;
