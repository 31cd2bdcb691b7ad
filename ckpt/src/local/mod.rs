//! The local file system backend.
//!
//! Durability: every file is fsynced (`File::sync_all`) before the name that exposes it is
//! created by rename, and every directory whose entries changed is fsynced afterwards.
//! Blocking file system work runs in `tokio::task::spawn_blocking`.
//!
//! One module per concern:
//! - `commit`: the commit protocol, whose order (write, fsync file, rename, fsync every
//!   changed directory, then the manifest and LATEST) is its correctness: a part commit,
//!   then the manifest and `LATEST`, each written atomically. Read top to bottom it can be
//!   checked against the failpoint list in [`crate::failpoints`];
//! - `read`: reading back and verifying parts, manifests, `LATEST` and the list of steps;
//! - `retention`: pruning old steps and stale leftovers, deleting a job;
//! - `seal`: owners and modes for ranks that run as another user ([`RankAccess`]);
//! - here: the store and its options, the file helpers the others share, and
//!   [`CheckpointStore`] over the blocking pool.

mod commit;
mod read;
mod retention;
mod seal;

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::{
    CheckpointStore, CkptError, Manifest, PartRecord, parse_part_dir_rel, validate_job_id,
};
use retention::delete_job_sync;

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
        blocking(move || delete_job_sync(&dir)).await
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
