//! The local file system backend.
//!
//! Durability: every file is fsynced (`File::sync_all`) before the name that exposes it is
//! created by rename, and every directory whose entries changed is fsynced afterwards.
//! Blocking file system work runs in `tokio::task::spawn_blocking`.
//!
//! Why one file of ~1,000 lines: it is the commit protocol, and its order (write, fsync
//! file, rename, fsync every changed directory, then the manifest and LATEST) is its
//! correctness; read top to bottom here it can be checked against the failpoint list in
//! [`crate::failpoints`], which a split across files would hide.

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::failpoints::{self, AtomicWritePoints, failpoint};
use crate::{
    CheckpointStore, CkptError, FileEntry, LATEST_FILE, MANIFEST_FILE, MAX_LATEST_BYTES,
    MAX_MANIFEST_BYTES, MAX_PART_DEPTH, MAX_PART_FILES, Manifest, PartRecord, WRITE_ALGORITHM,
    digest::hash_reader, parse_digest, parse_part_dir_rel, parse_step_dir_name, part_dir_rel,
    staging_dir_rel, step_dir_name, validate_job_id, validate_rel_path, validate_state,
};

/// Checkpoint store on a local (or locally mounted) file system, rooted at one directory.
/// Job `J` lives in `<root>/J/` with the layout of the crate documentation.
///
/// Atomicity relies on `rename(2)` within one file system: the staging directory, the part
/// directories, `MANIFEST.json` and `LATEST` of a job must share a file system (they do, as
/// all live under the job directory).
#[derive(Clone, Debug)]
pub struct LocalStore {
    /// Root directory holding one directory per job.
    root: PathBuf,
    /// What [`CheckpointStore::commit_part`] makes durable ([`Durability::Durable`] unless
    /// set with [`LocalStore::with_durability`]).
    durability: Durability,
    /// The ranks' identity when they run as another user than the agent
    /// ([`LocalStore::with_rank_access`]); `None`: no ownership changes.
    rank_access: Option<RankAccess>,
}

/// The user and group a job's ranks run as, when they are not the agent's own
/// (`cumulus-worker --run-as`). With it a store:
/// - makes the job directory `0750` with group `gid` (other jobs' ranks, with other
///   groups, cannot enter it), and the staging parent `.staging` likewise;
/// - gives each attempt's staging directory to `uid:gid`, mode `0700`;
/// - seals a part as it commits it: before any entry is read, every staged directory
///   becomes the agent's with group `gid`, mode `0750`, and every staged file the agent's
///   with group `gid`, mode `0640` (a file with more than one hard link is refused), so
///   the job's ranks can read their committed parts but not change them. A part that
///   fails to commit is cleared and its staging given back to the rank.
///
/// A descriptor the rank opened for writing before the seal stays writable: what it
/// writes afterwards is caught by the part's digests when a resume verifies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankAccess {
    /// The ranks' user id.
    pub uid: u32,
    /// The ranks' (and the job directory's) group id.
    pub gid: u32,
}

/// Mode of a staging directory given to a rank: only its user enters it.
const RANK_STAGING_MODE: u32 = 0o700;
/// Mode of the job directory, `.staging` and a sealed part's directories: the agent
/// writes, the job's group reads and enters, others nothing.
const SEALED_DIR_MODE: u32 = 0o750;
/// Mode of a sealed part's files: the agent's, readable by the job's group.
const SEALED_FILE_MODE: u32 = 0o640;

/// Whether a part commit makes the part durable before it returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// The protocol of the crate documentation: every file, directory and parent fsynced.
    /// A committed part survives a machine crash.
    Durable,
    /// Hash and rename, no fsync: the part is atomic against a process crash, and the
    /// kernel writes it back later. For a copy whose loss or tearing in a machine crash
    /// costs nothing but a download: the L1 copy of a part that counts as committed only
    /// in L2 ([`crate::TieredStore`] with [`crate::CommitTier::L2`]); a resume re-hashes
    /// every byte of it and restores it from L2 when it does not verify.
    Cache,
}

impl LocalStore {
    /// A store rooted at `root` (created on first use when absent).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            durability: Durability::Durable,
            rank_access: None,
        }
    }

    /// The same store for ranks that run as `access` (see [`RankAccess`]); `None` keeps
    /// every file and directory the agent's, with the process umask.
    pub fn with_rank_access(mut self, access: Option<RankAccess>) -> Self {
        self.rank_access = access;
        self
    }

    /// The same store with part commits of `durability` (see [`Durability::Cache`] for
    /// when skipping the fsyncs is right). Manifests and `LATEST` are always durable.
    pub fn with_durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory of `job_id`: `<root>/<job_id>`. The id is not validated here; every
    /// store operation validates it before touching the file system.
    pub fn job_dir(&self, job_id: &str) -> PathBuf {
        self.root.join(job_id)
    }

    /// The job directory after validating the id.
    fn checked_job_dir(&self, job_id: &str) -> Result<PathBuf, CkptError> {
        validate_job_id(job_id)?;
        Ok(self.job_dir(job_id))
    }
}

/// Files at least this large are fsynced on a second thread while this one hashes them
/// (the fsync waits on the disk, the hash on the CPU); smaller ones in sequence, where a
/// thread would cost more than it saves.
const OVERLAP_FSYNC_MIN_BYTES: u64 = 4 << 20;

/// Size and digest ([`WRITE_ALGORITHM`]) of a staged file, and the file fsynced: the two overlap for large
/// files. The bytes hashed are the bytes made durable: the staging directory belongs to
/// the committing agent, and nothing writes to it during the commit.
fn hash_and_fsync(
    file: &fs::File,
    path: &Path,
    durability: Durability,
) -> Result<(u64, String), CkptError> {
    if durability == Durability::Cache {
        return hash_reader(&mut &*file, path, WRITE_ALGORITHM);
    }
    let len = file.metadata().map_err(io_err("stat", path))?.len();
    failpoint!(failpoints::PART_FSYNC_FILE, "fsync", path);
    let (hashed, synced) = if len < OVERLAP_FSYNC_MIN_BYTES {
        (
            hash_reader(&mut &*file, path, WRITE_ALGORITHM),
            file.sync_all(),
        )
    } else {
        std::thread::scope(|scope| {
            let syncer = scope.spawn(|| file.sync_all());
            let hashed = hash_reader(&mut &*file, path, WRITE_ALGORITHM);
            let synced = syncer
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (hashed, synced)
        })
    };
    let (size_bytes, digest) = hashed?;
    synced.map_err(io_err("fsync", path))?;
    Ok((size_bytes, digest))
}

/// Runs blocking file system work off the async runtime; a panic in it is re-raised here.
pub(crate) async fn blocking<T, F>(work: F) -> Result<T, CkptError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, CkptError> + Send + 'static,
{
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => result,
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        Err(error) => Err(CkptError::Io {
            op: "spawn_blocking",
            path: PathBuf::new(),
            source: io::Error::other(error),
        }),
    }
}

/// Maps an I/O error to [`CkptError::Io`] naming the operation and path.
fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CkptError + 'a {
    move |source| CkptError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

fn corrupt(path: &Path, reason: impl Into<String>) -> CkptError {
    CkptError::Corrupt {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// fsync of a directory (makes its entries durable).
fn fsync_dir(path: &Path) -> Result<(), CkptError> {
    File::open(path)
        .and_then(|dir| dir.sync_all())
        .map_err(io_err("fsync dir", path))
}

/// Opens a file for reading without following a symlink in the last component.
fn open_nofollow(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
}

/// Makes sure `base/components...` exist as real directories (not symlinks), creating the
/// missing ones and fsyncing the parent of each created one. `base` must exist.
fn ensure_dirs(base: &Path, components: &[&str]) -> Result<PathBuf, CkptError> {
    let mut created_in = Vec::new();
    let path = create_dirs(base, components, &mut created_in)?;
    for parent in created_in.iter().rev() {
        fsync_dir(parent)?;
    }
    Ok(path)
}

/// [`ensure_dirs`] without the fsyncs: pushes onto `created_in` the parent of each
/// directory it created (outermost first), for the caller to fsync later.
fn create_dirs(
    base: &Path,
    components: &[&str],
    created_in: &mut Vec<PathBuf>,
) -> Result<PathBuf, CkptError> {
    let mut path = base.to_owned();
    for component in components {
        let parent = path.clone();
        path.push(component);
        match fs::symlink_metadata(&path) {
            Ok(metadata) if metadata.is_dir() => {}
            Ok(_) => {
                return Err(CkptError::Invalid(format!(
                    "{} exists but is not a directory (symlinks are refused)",
                    path.display()
                )));
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                match fs::create_dir(&path) {
                    Ok(()) => {}
                    Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {
                        let metadata =
                            fs::symlink_metadata(&path).map_err(io_err("stat", &path))?;
                        if !metadata.is_dir() {
                            return Err(CkptError::Invalid(format!(
                                "{} is not a directory",
                                path.display()
                            )));
                        }
                    }
                    Err(source) => {
                        return Err(CkptError::Io {
                            op: "create dir",
                            path,
                            source,
                        });
                    }
                }
                created_in.push(parent);
            }
            Err(source) => {
                return Err(CkptError::Io {
                    op: "stat",
                    path,
                    source,
                });
            }
        }
    }
    Ok(path)
}

/// Checks that `base/rel` is a chain of real directories below `base` (no symlink, nothing
/// missing); a missing or wrong component is [`CkptError::Corrupt`].
fn check_dir_chain(base: &Path, rel: &str) -> Result<PathBuf, CkptError> {
    let mut path = base.to_owned();
    for component in rel.split('/') {
        path.push(component);
        match fs::symlink_metadata(&path) {
            Ok(metadata) if metadata.is_dir() => {}
            Ok(_) => return Err(corrupt(&path, "is not a directory (symlinks are refused)")),
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                return Err(corrupt(&path, "is missing"));
            }
            Err(source) => {
                return Err(CkptError::Io {
                    op: "stat",
                    path,
                    source,
                });
            }
        }
    }
    Ok(path)
}

/// Writes `bytes` to `dir/name` atomically and durably: temp file `name.tmp-<nonce>` in
/// `dir`, write, fsync, rename over `name`, fsync `dir`. `points` names the failpoints of
/// the four steps (feature `failpoints`). On failure the temp file is removed (best effort).
#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
fn write_atomic(
    dir: &Path,
    name: &str,
    bytes: &[u8],
    points: &AtomicWritePoints,
) -> Result<(), CkptError> {
    let temp = dir.join(format!("{name}.tmp-{:016x}", rand::random::<u64>()));
    let target = dir.join(name);
    let write = || -> Result<(), CkptError> {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&temp)
            .map_err(io_err("create", &temp))?;
        // Two halves, so that a crash at the write failpoint leaves a torn temp file.
        let (first, second) = bytes.split_at(bytes.len() / 2);
        file.write_all(first).map_err(io_err("write", &temp))?;
        failpoint!(points.write, "write", &temp);
        file.write_all(second).map_err(io_err("write", &temp))?;
        failpoint!(points.fsync, "fsync", &temp);
        file.sync_all().map_err(io_err("fsync", &temp))?;
        drop(file);
        failpoint!(points.rename, "rename", &target);
        fs::rename(&temp, &target).map_err(io_err("rename", &target))
    };
    if let Err(error) = write() {
        // Best effort: a leftover is also removed by `prune`.
        let _ = fs::remove_file(&temp);
        return Err(error);
    }
    failpoint!(points.fsync_dir, "fsync dir", dir);
    fsync_dir(dir)
}

/// Reads a small regular file (not a symlink) of at most `limit` bytes. `Ok(None)` when it
/// does not exist.
fn read_limited(path: &Path, limit: u64) -> Result<Option<Vec<u8>>, CkptError> {
    match fs::symlink_metadata(path) {
        Ok(metadata) if metadata.is_file() => {}
        Ok(_) => {
            return Err(corrupt(
                path,
                "is not a regular file (symlinks are refused)",
            ));
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(CkptError::Io {
                op: "stat",
                path: path.to_owned(),
                source,
            });
        }
    }
    let file = match open_nofollow(path) {
        Ok(file) => file,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(CkptError::Io {
                op: "open",
                path: path.to_owned(),
                source,
            });
        }
    };
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(io_err("read", path))?;
    if u64::try_from(bytes.len()).expect("a buffer length fits in u64") > limit {
        return Err(corrupt(path, format!("is larger than {limit} bytes")));
    }
    Ok(Some(bytes))
}

/// Renames `from` to `to` unless `to` exists (then `AlreadyExists`). Atomic with
/// `renameat2(RENAME_NOREPLACE)` where available; elsewhere (or on a file system without
/// it) a check followed by `rename`.
fn rename_no_replace(from: &Path, to: &Path) -> io::Result<()> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use nix::errno::Errno;
        use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
        match renameat2(AT_FDCWD, from, AT_FDCWD, to, RenameFlags::RENAME_NOREPLACE) {
            Ok(()) => return Ok(()),
            Err(Errno::EINVAL | Errno::ENOSYS) => {}
            Err(errno) => return Err(io::Error::from(errno)),
        }
    }
    match fs::symlink_metadata(to) {
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "target exists",
        )),
        Err(error) if error.kind() == io::ErrorKind::NotFound => fs::rename(from, to),
        Err(error) => Err(error),
    }
}

/// The staging tree: regular files (relative path, absolute path) and directories.
struct StagingTree {
    files: Vec<(String, PathBuf)>,
    dirs: Vec<PathBuf>,
}

/// Walks `staging` recursively (entries sorted by name), refusing symlinks, special files,
/// non-UTF-8 or invalid names, more than [`MAX_PART_FILES`] files or directories, and
/// nesting deeper than [`MAX_PART_DEPTH`].
fn walk_staging(staging: &Path, seal_gid: Option<u32>) -> Result<StagingTree, CkptError> {
    let mut tree = StagingTree {
        files: Vec::new(),
        dirs: vec![staging.to_owned()],
    };
    // (directory, its path relative to staging; empty for the root)
    let mut pending: Vec<(PathBuf, String)> = vec![(staging.to_owned(), String::new())];
    while let Some((dir, rel_dir)) = pending.pop() {
        if let Some(gid) = seal_gid {
            seal_dir(&dir, gid)?;
        }
        let mut entries = Vec::new();
        for entry in fs::read_dir(&dir).map_err(io_err("read dir", &dir))? {
            let entry = entry.map_err(io_err("read dir", &dir))?;
            if entries.len() >= MAX_PART_FILES {
                return Err(CkptError::Invalid(format!(
                    "staging directory {} holds more than {MAX_PART_FILES} entries",
                    dir.display()
                )));
            }
            let file_type = entry.file_type().map_err(io_err("stat", &entry.path()))?;
            entries.push((entry.file_name(), entry.path(), file_type));
        }
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, path, file_type) in entries {
            let name = name.to_str().ok_or_else(|| {
                CkptError::Invalid(format!("staging entry {} is not UTF-8", path.display()))
            })?;
            let rel = if rel_dir.is_empty() {
                name.to_owned()
            } else {
                format!("{rel_dir}/{name}")
            };
            validate_rel_path(&rel)?;
            if file_type.is_symlink() {
                return Err(CkptError::Invalid(format!(
                    "staging entry {} is a symlink; a part holds regular files only",
                    path.display()
                )));
            } else if file_type.is_dir() {
                if tree.dirs.len() >= MAX_PART_FILES {
                    return Err(CkptError::Invalid(format!(
                        "staging {} holds more than {MAX_PART_FILES} directories",
                        staging.display()
                    )));
                }
                if rel.split('/').count() >= MAX_PART_DEPTH {
                    return Err(CkptError::Invalid(format!(
                        "staging {} is nested deeper than {MAX_PART_DEPTH}",
                        staging.display()
                    )));
                }
                tree.dirs.push(path.clone());
                pending.push((path, rel));
            } else if file_type.is_file() {
                if tree.files.len() >= MAX_PART_FILES {
                    return Err(CkptError::Invalid(format!(
                        "staging {} holds more than {MAX_PART_FILES} files",
                        staging.display()
                    )));
                }
                tree.files.push((rel, path));
            } else {
                return Err(CkptError::Invalid(format!(
                    "staging entry {} is not a regular file or directory",
                    path.display()
                )));
            }
        }
    }
    tree.files.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(tree)
}

/// Opens a part file for hashing, refusing symlinks and non-regular files.
fn open_regular(path: &Path, missing_is_corrupt: bool) -> Result<File, CkptError> {
    let file = match open_nofollow(path) {
        Ok(file) => file,
        Err(error) if missing_is_corrupt && error.kind() == io::ErrorKind::NotFound => {
            return Err(corrupt(path, "is missing"));
        }
        Err(error) if error.raw_os_error() == Some(nix::libc::ELOOP) => {
            return Err(corrupt(path, "is a symlink"));
        }
        Err(source) => {
            return Err(CkptError::Io {
                op: "open",
                path: path.to_owned(),
                source,
            });
        }
    };
    let metadata = file.metadata().map_err(io_err("stat", path))?;
    if !metadata.is_file() {
        return Err(corrupt(path, "is not a regular file"));
    }
    Ok(file)
}

/// Sets the owner (`None`: unchanged), group and mode of `path`, never through a
/// symlink: opened with `O_NOFOLLOW`, changed through the descriptor.
fn set_owner_and_mode(
    path: &Path,
    uid: Option<u32>,
    gid: Option<u32>,
    mode: u32,
) -> Result<(), CkptError> {
    use std::os::unix::fs::PermissionsExt;
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_DIRECTORY)
        .open(path)
        .map_err(io_err("open dir", path))?;
    std::os::unix::fs::fchown(&file, uid, gid).map_err(io_err("chown", path))?;
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(io_err("chmod", path))
}

/// The agent's effective user id: the owner of sealed entries.
fn agent_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Seals a staged directory: the agent's, group `gid`, [`SEALED_DIR_MODE`].
fn seal_dir(dir: &Path, gid: u32) -> Result<(), CkptError> {
    set_owner_and_mode(dir, Some(agent_uid()), Some(gid), SEALED_DIR_MODE)
}

/// Seals a staged regular file opened without following symlinks: the agent's, group
/// `gid`, [`SEALED_FILE_MODE`]. A file with another hard link is refused: the link
/// could be a file of someone else's that the seal would hand to the job's group.
fn seal_file(file: &File, path: &Path, gid: u32) -> Result<(), CkptError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let metadata = file.metadata().map_err(io_err("stat", path))?;
    if metadata.nlink() != 1 {
        return Err(CkptError::Invalid(format!(
            "staged file {} has {} hard links; a part holds files of its own only",
            path.display(),
            metadata.nlink()
        )));
    }
    std::os::unix::fs::fchown(file, Some(agent_uid()), Some(gid)).map_err(io_err("chown", path))?;
    file.set_permissions(fs::Permissions::from_mode(SEALED_FILE_MODE))
        .map_err(io_err("chmod", path))
}

/// Gives an (empty) staging directory to the rank: `uid:gid`, [`RANK_STAGING_MODE`].
fn give_staging_to_rank(staging: &Path, access: RankAccess) -> Result<(), CkptError> {
    set_owner_and_mode(
        staging,
        Some(access.uid),
        Some(access.gid),
        RANK_STAGING_MODE,
    )
}

/// Why [`LocalStore::hash_sync_rename`] failed.
enum RenameError {
    /// The part directory already exists.
    Already,
    /// Any other failure.
    Ckpt(CkptError),
}

impl From<CkptError> for RenameError {
    fn from(error: CkptError) -> Self {
        Self::Ckpt(error)
    }
}

/// Empties `staging` after a part commit failed on an I/O error (best effort: removes it and creates it
/// again empty; whatever remains is removed by the next failure or overwritten by the rank).
fn clear_staging(staging: &Path) {
    if let Err(error) = fs::remove_dir_all(staging)
        && error.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(staging = %staging.display(), %error, "cannot clear the staging directory");
    }
    if fs::create_dir(staging).is_ok()
        && let Some(parent) = staging.parent()
    {
        let _ = fsync_dir(parent);
    }
}

impl LocalStore {
    fn prepare_staging_sync(
        &self,
        job_id: &str,
        rank: u32,
        attempt: u32,
    ) -> Result<PathBuf, CkptError> {
        let job_dir = self.checked_job_dir(job_id)?;
        fs::create_dir_all(&self.root).map_err(io_err("create dir", &self.root))?;
        let staging_rel = staging_dir_rel(rank, attempt);
        let components: Vec<&str> = std::iter::once(job_id)
            .chain(staging_rel.split('/'))
            .collect();
        let staging = ensure_dirs(&self.root, &components)?;
        debug_assert_eq!(staging, job_dir.join(&staging_rel));
        if let Some(access) = self.rank_access {
            set_owner_and_mode(&job_dir, None, Some(access.gid), SEALED_DIR_MODE)?;
            if let Some(parent) = staging.parent() {
                set_owner_and_mode(parent, None, Some(access.gid), SEALED_DIR_MODE)?;
            }
            set_owner_and_mode(
                &staging,
                Some(access.uid),
                Some(access.gid),
                RANK_STAGING_MODE,
            )?;
        }
        Ok(staging)
    }

    fn commit_part_sync(
        &self,
        job_id: &str,
        step: u64,
        rank: u32,
        attempt: u32,
        staging: &Path,
        state: serde_json::Value,
    ) -> Result<PartRecord, CkptError> {
        let durability = self.durability;
        let job_dir = self.checked_job_dir(job_id)?;
        validate_state(&state)?;
        match fs::symlink_metadata(staging) {
            Ok(metadata) if metadata.is_dir() => {}
            Ok(_) => {
                return Err(CkptError::Invalid(format!(
                    "staging {} is not a directory (symlinks are refused)",
                    staging.display()
                )));
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                return Err(CkptError::NotFound {
                    what: format!("staging directory {}", staging.display()),
                });
            }
            Err(source) => {
                return Err(CkptError::Io {
                    op: "stat",
                    path: staging.to_owned(),
                    source,
                });
            }
        }
        let dir = part_dir_rel(step, rank, attempt);
        let target = job_dir.join(&dir);
        let already =
            || CkptError::Invalid(format!("part {dir} of job {job_id} is already committed"));
        match fs::symlink_metadata(&target) {
            Ok(_) => return Err(already()),
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(CkptError::Io {
                    op: "stat",
                    path: target,
                    source,
                });
            }
        }

        // 1.–3. When the storage fails (an I/O error: a full disk, a failed fsync) the
        // staging directory is emptied: the part is all or nothing (the rank writes it
        // whole again for its next checkpoint) and a full disk gets its space back. A
        // refused input (`Invalid`, e.g. a symlink) leaves it for the caller to fix.
        let (files, created_in) = match self
            .hash_sync_rename(job_id, step, rank, staging, &target, durability)
        {
            Ok(renamed) => renamed,
            Err(RenameError::Already) => return Err(already()),
            Err(RenameError::Ckpt(error)) => {
                if let Some(access) = self.rank_access {
                    // Sealing took the staging directory from the rank, which could
                    // not fix what was refused: it writes the part again.
                    clear_staging(staging);
                    if let Err(e) = give_staging_to_rank(staging, access) {
                        tracing::warn!(staging = %staging.display(), error = %e, "cannot give the staging directory back to the rank");
                    }
                } else if matches!(error, CkptError::Io { .. }) {
                    clear_staging(staging);
                }
                return Err(error);
            }
        };
        let rank_dir = job_dir
            .join(step_dir_name(step))
            .join(format!("rank-{rank}"));
        let staging_parent = staging.parent().ok_or_else(|| {
            CkptError::Invalid(format!("staging {} has no parent", staging.display()))
        })?;

        // 4. An empty staging directory for the next checkpoint (its durability is not
        // needed: prepare_staging creates it again when a crash lost it).
        failpoint!(
            failpoints::PART_RECREATE_STAGING,
            "recreate staging",
            staging
        );
        let recreated = match fs::create_dir(staging) {
            Ok(()) => Ok(()),
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(source) => Err(CkptError::Io {
                op: "recreate staging",
                path: staging.to_owned(),
                source,
            }),
        }
        .and_then(|()| match self.rank_access {
            Some(access) => give_staging_to_rank(staging, access),
            None => Ok(()),
        });

        // 5. Every directory whose entries changed, fsynced after all the changes: the
        // parents the part's `step-N` and `rank-r` were created in, the rank directory
        // (the rename's target side) and the staging parent (its source side, and the
        // new staging). On a journaling file system the first fsync commits all of
        // them; fsyncing each after its own change cost three more journal commits, and
        // a 4 KiB part took 2.9x an atomic file replace (docs/perf-notes.md, "Small parts").
        if durability == Durability::Durable {
            failpoint!(failpoints::PART_FSYNC_PARENT, "fsync dir", &rank_dir);
            for dir in created_in.iter().chain([&rank_dir]) {
                fsync_dir(dir)?;
            }
            fsync_dir(staging_parent)?;
        }
        recreated?;

        Ok(PartRecord {
            rank,
            attempt,
            dir,
            files,
            state,
        })
    }

    /// Steps 1–3 of [`Self::commit_part_sync`]: hash and fsync every staged file, fsync every
    /// staged directory, create the parents `step-N/rank-r`, rename the staging directory
    /// to `target` (never over an existing one). Returns the file entries and the
    /// directories in which a parent was created (not fsynced yet: the caller's step 5
    /// does). With [`Durability::Cache`] the staged files and directories are hashed but
    /// not fsynced.
    fn hash_sync_rename(
        &self,
        job_id: &str,
        step: u64,
        rank: u32,
        staging: &Path,
        target: &Path,
        durability: Durability,
    ) -> Result<(Vec<FileEntry>, Vec<PathBuf>), RenameError> {
        // 1. Hash and fsync every file, then fsync every directory (deepest first). With
        // ranks running as another user, each directory is sealed before it is listed
        // and each file before it is hashed (see RankAccess).
        let seal_gid = self.rank_access.map(|a| a.gid);
        let tree = walk_staging(staging, seal_gid)?;
        let mut files = Vec::with_capacity(tree.files.len());
        for (rel, path) in &tree.files {
            let file = open_regular(path, false)?;
            if let Some(gid) = seal_gid {
                seal_file(&file, path, gid)?;
            }
            let (size_bytes, digest) = hash_and_fsync(&file, path, durability)?;
            files.push(FileEntry {
                path: rel.clone(),
                size_bytes,
                digest,
            });
        }
        if durability == Durability::Durable {
            failpoint!(failpoints::PART_FSYNC_DIRS, "fsync dir", staging);
            for dir_path in tree.dirs.iter().rev() {
                fsync_dir(dir_path)?;
            }
        }

        // 2. Parents step-N/rank-r; the caller fsyncs the directories they were created
        // in together with the rename's (one journal commit instead of three).
        failpoint!(failpoints::PART_MKDIR_PARENTS, "create dir", &self.root);
        let mut created_in = Vec::new();
        create_dirs(
            &self.root,
            &[job_id, &step_dir_name(step), &format!("rank-{rank}")],
            &mut created_in,
        )?;

        // 3. The atomic step: staging becomes the part, never over an existing one.
        failpoint!(failpoints::PART_RENAME, "rename", target);
        match rename_no_replace(staging, target) {
            Ok(()) => Ok((files, created_in)),
            Err(error)
                if matches!(
                    error.kind(),
                    io::ErrorKind::AlreadyExists | io::ErrorKind::DirectoryNotEmpty
                ) =>
            {
                Err(RenameError::Already)
            }
            Err(source) => Err(RenameError::Ckpt(CkptError::Io {
                op: "rename",
                path: target.to_owned(),
                source,
            })),
        }
    }

    /// [`CheckpointStore::verify_part`] when `read_content`, else
    /// [`CheckpointStore::check_part`] (layout and sizes only).
    fn verify_part_sync(
        &self,
        job_id: &str,
        part: &PartRecord,
        read_content: bool,
    ) -> Result<(), CkptError> {
        let job_dir = self.checked_job_dir(job_id)?;
        part.validate()?;
        let part_dir = check_dir_chain(&job_dir, &part.dir)?;
        let mut checked_dirs: BTreeSet<String> = BTreeSet::new();
        for entry in &part.files {
            // Intermediate directories must be real directories inside the part.
            if let Some((parent_rel, _)) = entry.path.rsplit_once('/')
                && !checked_dirs.contains(parent_rel)
            {
                check_dir_chain(&part_dir, parent_rel)?;
                checked_dirs.insert(parent_rel.to_owned());
            }
            let path = part_dir.join(&entry.path);
            let mut file = open_regular(&path, true)?;
            let size_on_disk = file.metadata().map_err(io_err("stat", &path))?.len();
            if size_on_disk != entry.size_bytes {
                return Err(corrupt(
                    &path,
                    format!(
                        "size is {size_on_disk} bytes, the record says {}",
                        entry.size_bytes
                    ),
                ));
            }
            if !read_content {
                continue;
            }
            let algorithm = parse_digest(&entry.digest)?;
            let (size_bytes, digest) = hash_reader(&mut file, &path, algorithm)?;
            if size_bytes != entry.size_bytes {
                return Err(corrupt(
                    &path,
                    format!(
                        "read {size_bytes} bytes, the record says {}",
                        entry.size_bytes
                    ),
                ));
            }
            if digest != entry.digest {
                return Err(corrupt(
                    &path,
                    format!("digest is {digest}, the record says {}", entry.digest),
                ));
            }
        }
        Ok(())
    }

    fn write_manifest_sync(&self, manifest: &Manifest) -> Result<(), CkptError> {
        manifest.validate()?;
        let job_dir = self.checked_job_dir(&manifest.job_id)?;
        let step_dir = job_dir.join(step_dir_name(manifest.step));
        match fs::symlink_metadata(&step_dir) {
            Ok(metadata) if metadata.is_dir() => {}
            Ok(_) => {
                return Err(corrupt(
                    &step_dir,
                    "is not a directory (symlinks are refused)",
                ));
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                return Err(CkptError::NotFound {
                    what: format!(
                        "step {} of job {} ({})",
                        manifest.step,
                        manifest.job_id,
                        step_dir.display()
                    ),
                });
            }
            Err(source) => {
                return Err(CkptError::Io {
                    op: "stat",
                    path: step_dir,
                    source,
                });
            }
        }
        let mut bytes = serde_json::to_vec_pretty(manifest)
            .map_err(|e| CkptError::Invalid(format!("manifest cannot be serialized: {e}")))?;
        bytes.push(b'\n');
        if u64::try_from(bytes.len()).expect("a buffer length fits in u64") > MAX_MANIFEST_BYTES {
            return Err(CkptError::Invalid(format!(
                "manifest of step {} is {} bytes, more than {MAX_MANIFEST_BYTES}",
                manifest.step,
                bytes.len()
            )));
        }
        write_atomic(&step_dir, MANIFEST_FILE, &bytes, &failpoints::MANIFEST)
    }

    fn read_manifest_sync(&self, job_id: &str, step: u64) -> Result<Manifest, CkptError> {
        let job_dir = self.checked_job_dir(job_id)?;
        let step_dir = job_dir.join(step_dir_name(step));
        let path = step_dir.join(MANIFEST_FILE);
        let not_found = || CkptError::NotFound {
            what: format!(
                "manifest of step {step} of job {job_id} ({})",
                path.display()
            ),
        };
        match fs::symlink_metadata(&step_dir) {
            Ok(metadata) if metadata.is_dir() => {}
            Ok(_) => {
                return Err(corrupt(
                    &step_dir,
                    "is not a directory (symlinks are refused)",
                ));
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Err(not_found()),
            Err(source) => {
                return Err(CkptError::Io {
                    op: "stat",
                    path: step_dir,
                    source,
                });
            }
        }
        let bytes = read_limited(&path, MAX_MANIFEST_BYTES)?.ok_or_else(not_found)?;
        let manifest: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| corrupt(&path, format!("is not a valid manifest: {e}")))?;
        manifest
            .validate()
            .map_err(|e| corrupt(&path, e.to_string()))?;
        if manifest.job_id != job_id || manifest.step != step {
            return Err(corrupt(
                &path,
                format!(
                    "names job {} step {}, but lies at job {job_id} step {step}",
                    manifest.job_id, manifest.step
                ),
            ));
        }
        Ok(manifest)
    }

    fn verify_step_sync(&self, job_id: &str, step: u64) -> Result<Manifest, CkptError> {
        let manifest = self.read_manifest_sync(job_id, step)?;
        for part in &manifest.parts {
            self.verify_part_sync(job_id, part, true)?;
        }
        Ok(manifest)
    }

    fn write_latest_sync(&self, job_id: &str, step: u64) -> Result<(), CkptError> {
        let job_dir = self.checked_job_dir(job_id)?;
        let step_dir = job_dir.join(step_dir_name(step));
        match fs::symlink_metadata(&step_dir) {
            Ok(metadata) if metadata.is_dir() => {}
            Ok(_) => {
                return Err(corrupt(
                    &step_dir,
                    "is not a directory (symlinks are refused)",
                ));
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                return Err(CkptError::NotFound {
                    what: format!("step {step} of job {job_id} ({})", step_dir.display()),
                });
            }
            Err(source) => {
                return Err(CkptError::Io {
                    op: "stat",
                    path: step_dir,
                    source,
                });
            }
        }
        write_atomic(
            &job_dir,
            LATEST_FILE,
            format!("{}\n", step_dir_name(step)).as_bytes(),
            &failpoints::LATEST,
        )
    }

    fn read_latest_sync(&self, job_id: &str) -> Result<Option<u64>, CkptError> {
        let path = self.checked_job_dir(job_id)?.join(LATEST_FILE);
        let Some(bytes) = read_limited(&path, MAX_LATEST_BYTES)? else {
            return Ok(None);
        };
        let text = std::str::from_utf8(&bytes).map_err(|_| corrupt(&path, "is not UTF-8"))?;
        let name = text.strip_suffix('\n').unwrap_or(text);
        parse_step_dir_name(name).map(Some).ok_or_else(|| {
            corrupt(
                &path,
                format!("content {text:?} is not a step directory name"),
            )
        })
    }

    fn list_steps_sync(&self, job_id: &str) -> Result<Vec<u64>, CkptError> {
        let job_dir = self.checked_job_dir(job_id)?;
        let entries = match fs::read_dir(&job_dir) {
            Ok(entries) => entries,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => {
                return Err(CkptError::Io {
                    op: "read dir",
                    path: job_dir,
                    source,
                });
            }
        };
        let mut steps = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io_err("read dir", &job_dir))?;
            let Some(step) = entry.file_name().to_str().and_then(parse_step_dir_name) else {
                continue;
            };
            if entry
                .file_type()
                .map_err(io_err("stat", &entry.path()))?
                .is_dir()
            {
                steps.push(step);
            }
        }
        steps.sort_unstable();
        Ok(steps)
    }

    fn prune_sync(&self, job_id: &str, keep: &[u64]) -> Result<Vec<u64>, CkptError> {
        let job_dir = self.checked_job_dir(job_id)?;
        let latest = self.read_latest_sync(job_id)?;
        let steps = self.list_steps_sync(job_id)?;
        let keep: BTreeSet<u64> = keep.iter().copied().collect();
        let Some(latest) = latest else {
            // Nothing committed yet: every step may still be in flight.
            return Ok(Vec::new());
        };
        let mut deleted = Vec::new();
        for &step in &steps {
            if step >= latest || keep.contains(&step) {
                continue;
            }
            // Rename first so that the step vanishes atomically; a crash during the removal
            // leaves a `*.tmp*` leftover that the next prune removes.
            let from = job_dir.join(step_dir_name(step));
            let doomed = job_dir.join(format!(
                "{}.tmp-prune-{:016x}",
                step_dir_name(step),
                rand::random::<u64>()
            ));
            fs::rename(&from, &doomed).map_err(io_err("rename", &from))?;
            fsync_dir(&job_dir)?;
            fs::remove_dir_all(&doomed).map_err(io_err("remove", &doomed))?;
            deleted.push(step);
        }

        // Stale leftovers: temp files and dirs in the job dir and in remaining committed steps.
        let mut scan_dirs = vec![job_dir.clone()];
        scan_dirs.extend(
            steps
                .iter()
                .filter(|step| **step <= latest && !deleted.contains(step))
                .map(|step| job_dir.join(step_dir_name(*step))),
        );
        for dir in &scan_dirs {
            let mut removed_any = false;
            for entry in fs::read_dir(dir).map_err(io_err("read dir", dir))? {
                let entry = entry.map_err(io_err("read dir", dir))?;
                let is_temp = entry
                    .file_name()
                    .to_str()
                    .is_some_and(|name| name.contains(".tmp"));
                if !is_temp {
                    continue;
                }
                let path = entry.path();
                let file_type = entry.file_type().map_err(io_err("stat", &path))?;
                if file_type.is_dir() {
                    fs::remove_dir_all(&path).map_err(io_err("remove", &path))?;
                } else {
                    fs::remove_file(&path).map_err(io_err("remove", &path))?;
                }
                removed_any = true;
            }
            if removed_any {
                fsync_dir(dir)?;
            }
        }
        Ok(deleted)
    }
}

#[async_trait::async_trait]
impl CheckpointStore for LocalStore {
    async fn prepare_staging(
        &self,
        job_id: &str,
        rank: u32,
        attempt: u32,
    ) -> Result<PathBuf, CkptError> {
        let store = self.clone();
        let job_id = job_id.to_owned();
        blocking(move || store.prepare_staging_sync(&job_id, rank, attempt)).await
    }

    async fn commit_part(
        &self,
        job_id: &str,
        step: u64,
        rank: u32,
        attempt: u32,
        staging: &Path,
        state: serde_json::Value,
    ) -> Result<PartRecord, CkptError> {
        let store = self.clone();
        let job_id = job_id.to_owned();
        let staging = staging.to_owned();
        blocking(move || store.commit_part_sync(&job_id, step, rank, attempt, &staging, state))
            .await
    }

    async fn verify_part(&self, job_id: &str, part: &PartRecord) -> Result<(), CkptError> {
        let store = self.clone();
        let job_id = job_id.to_owned();
        let part = part.clone();
        blocking(move || store.verify_part_sync(&job_id, &part, true)).await
    }

    async fn check_part(&self, job_id: &str, part: &PartRecord) -> Result<(), CkptError> {
        let store = self.clone();
        let job_id = job_id.to_owned();
        let part = part.clone();
        blocking(move || store.verify_part_sync(&job_id, &part, false)).await
    }

    async fn write_manifest(&self, manifest: &Manifest) -> Result<(), CkptError> {
        let store = self.clone();
        let manifest = manifest.clone();
        blocking(move || store.write_manifest_sync(&manifest)).await
    }

    async fn read_manifest(&self, job_id: &str, step: u64) -> Result<Manifest, CkptError> {
        let store = self.clone();
        let job_id = job_id.to_owned();
        blocking(move || store.read_manifest_sync(&job_id, step)).await
    }

    async fn verify_step(&self, job_id: &str, step: u64) -> Result<Manifest, CkptError> {
        let store = self.clone();
        let job_id = job_id.to_owned();
        blocking(move || store.verify_step_sync(&job_id, step)).await
    }

    async fn write_latest(&self, job_id: &str, step: u64) -> Result<(), CkptError> {
        let store = self.clone();
        let job_id = job_id.to_owned();
        blocking(move || store.write_latest_sync(&job_id, step)).await
    }

    async fn read_latest(&self, job_id: &str) -> Result<Option<u64>, CkptError> {
        let store = self.clone();
        let job_id = job_id.to_owned();
        blocking(move || store.read_latest_sync(&job_id)).await
    }

    async fn list_steps(&self, job_id: &str) -> Result<Vec<u64>, CkptError> {
        let store = self.clone();
        let job_id = job_id.to_owned();
        blocking(move || store.list_steps_sync(&job_id)).await
    }

    async fn prune(&self, job_id: &str, keep: &[u64]) -> Result<Vec<u64>, CkptError> {
        let store = self.clone();
        let job_id = job_id.to_owned();
        let keep = keep.to_vec();
        blocking(move || store.prune_sync(&job_id, &keep)).await
    }

    async fn delete_job(&self, job_id: &str) -> Result<bool, CkptError> {
        let dir = self.checked_job_dir(job_id)?;
        blocking(move || {
            let io = |op: &'static str, path: &Path| {
                let path = path.to_path_buf();
                move |source| CkptError::Io { op, path, source }
            };
            if !dir.exists() {
                return Ok(false);
            }
            let latest = dir.join(LATEST_FILE);
            match std::fs::remove_file(&latest) {
                Ok(()) => fsync_dir(&dir)?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io("remove", &latest)(e)),
            }
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => Ok(true),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
                Err(e) => Err(io("remove", &dir)(e)),
            }
        })
        .await
    }

    fn local_part_path(&self, job_id: &str, part_dir: &str) -> Option<PathBuf> {
        validate_job_id(job_id).ok()?;
        parse_part_dir_rel(part_dir)?;
        Some(self.job_dir(job_id).join(part_dir))
    }

    fn describe(&self) -> String {
        let root = std::path::absolute(&self.root).unwrap_or_else(|_| self.root.clone());
        format!("file://{}", root.display())
    }
}
