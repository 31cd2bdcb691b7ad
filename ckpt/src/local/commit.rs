//! The commit protocol, in its order. A part: hash and fsync every staged file, fsync
//! every staged directory, create the parents `step-N/rank-r`, rename the staging
//! directory into place (never over an existing part), recreate the staging directory,
//! fsync every directory whose entries changed. Then the step's `MANIFEST.json` and the
//! job's `LATEST`, each written atomically: temp file, write, fsync, rename, fsync the
//! directory. The failpoints of [`crate::failpoints`] mark each step.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::seal::{give_staging_to_rank, seal_dir, seal_file, set_owner_and_mode};
use super::{
    Durability, LocalStore, RANK_STAGING_MODE, SEALED_DIR_MODE, corrupt, fsync_dir, io_err,
    open_regular,
};
use crate::failpoints::{self, AtomicWritePoints, failpoint};
use crate::{
    CkptError, FileEntry, LATEST_FILE, MANIFEST_FILE, MAX_MANIFEST_BYTES, MAX_PART_DEPTH,
    MAX_PART_FILES, Manifest, PartRecord, WRITE_ALGORITHM,
    digest::{hash_file_blake3_parallel, hash_reader},
    part_dir_rel, staging_dir_rel, step_dir_name, validate_rel_path, validate_state,
};

/// Files at least this large are fsynced on a second thread while this one hashes them
/// (the fsync waits on the disk, the hash on the CPU); smaller ones in sequence, where a
/// thread would cost more than it saves.
const OVERLAP_FSYNC_MIN_BYTES: u64 = 4 << 20;

/// Most threads one large file is hashed with ([`hash_large`]).
const MAX_HASH_THREADS: usize = 4;

/// Size and digest ([`WRITE_ALGORITHM`]) of a large staged file of `len` bytes: BLAKE3
/// on as many threads as the machine has cores (at most [`MAX_HASH_THREADS`]), cut
/// along its tree ([`hash_file_blake3_parallel`]), so that the hash no longer outlasts
/// the `fsync` beside it on a fast disk; the same digest as one thread's.
fn hash_large(file: &fs::File, len: u64, path: &Path) -> Result<(u64, String), CkptError> {
    if WRITE_ALGORITHM != crate::DigestAlgorithm::Blake3 {
        return hash_reader(&mut &*file, path, WRITE_ALGORITHM);
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .min(MAX_HASH_THREADS);
    let digest = hash_file_blake3_parallel(file, len, path, threads)?;
    Ok((len, digest))
}

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
        let started = std::time::Instant::now();
        let (hashed, synced, hash_ms, fsync_ms) = std::thread::scope(|scope| {
            let syncer = scope.spawn(|| {
                let synced = file.sync_all();
                (synced, started.elapsed().as_secs_f64() * 1e3)
            });
            let hashed = hash_large(file, len, path);
            let hash_ms = started.elapsed().as_secs_f64() * 1e3;
            let (synced, fsync_ms) = syncer
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (hashed, synced, hash_ms, fsync_ms)
        });
        tracing::debug!(path = %path.display(), len, hash_ms, fsync_ms, "staged file hashed beside its fsync");
        (hashed, synced)
    };
    let (size_bytes, digest) = hashed?;
    synced.map_err(io_err("fsync", path))?;
    Ok((size_bytes, digest))
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
    pub(super) fn prepare_staging_sync(
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

    pub(super) fn commit_part_sync(
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
        let started = std::time::Instant::now();
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
        let renamed_ms = started.elapsed().as_secs_f64() * 1e3;

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
        tracing::debug!(
            job_id,
            step,
            rank,
            files = files.len(),
            renamed_ms,
            total_ms = started.elapsed().as_secs_f64() * 1e3,
            "part committed locally (hash + fsync + rename, then the directories)"
        );

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
        // Largest first: its fsync, overlapped with its hash, waits for the journal
        // commit that (ext4 data=ordered) also flushes every block already allocated
        // in the transaction, e.g. a large file whose writeback the rank started while
        // writing it (`cumulus.runtime`'s `Writeback`). Behind a small file's fsync,
        // that wait came before the large file's hash instead of beside it (~0.45 s for
        // 1 GiB, docs/perf-notes.md "Writeback while the rank writes"). The sizes only
        // order the work: what is recorded is read from the opened file.
        let mut order: Vec<&(String, PathBuf)> = tree.files.iter().collect();
        order.sort_by_cached_key(|(_, path)| {
            std::cmp::Reverse(fs::symlink_metadata(path).map_or(0, |m| m.len()))
        });
        let mut files = Vec::with_capacity(tree.files.len());
        for (rel, path) in order {
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
        files.sort_by(|a, b| a.path.cmp(&b.path));
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

    pub(super) fn write_manifest_sync(&self, manifest: &Manifest) -> Result<(), CkptError> {
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

    pub(super) fn write_latest_sync(&self, job_id: &str, step: u64) -> Result<(), CkptError> {
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
}
