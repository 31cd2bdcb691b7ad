//! Cumulus checkpoints: layout, manifest, atomic part commit, verification, `LATEST`,
//! listing and retention.
//!
//! # Layout (local backend, docs/architecture.md "Checkpoint layout (local backend)")
//! ```text
//! <root>/<job_id>/.staging/rank-<r>.attempt-<a>/        CUMULUS_CKPT_STAGING of one attempt
//! <root>/<job_id>/step-00000100/rank-0/attempt-1/…      one committed part
//! <root>/<job_id>/step-00000100/MANIFEST.json           written by the leader
//! <root>/<job_id>/LATEST                                "step-00000100\n"
//! ```
//! A part lives in `rank-<r>/attempt-<a>/` (not `rank-<r>/` as in DESIGN.md): a zombie
//! attempt can never rename over its replacement's part, and the manifest names the one part
//! per rank that the Raft log accepted.
//!
//! # Protocol
//! The protocol is the one of docs/architecture.md ("Checkpoint layout"), built on the
//! classic durable-replace pattern of POSIX file systems: *write to a temporary name, fsync
//! the data, rename onto the final name, fsync the directory that holds the name*. A rename
//! within one file system is atomic, so a reader sees either the old state or the new one,
//! and the fsyncs order the data before the name on disk, so a crash can never expose a
//! name whose content is missing.
//!
//! 1. A rank writes its files into its staging directory ([`CheckpointStore::prepare_staging`]).
//! 2. The worker agent commits them ([`CheckpointStore::commit_part`]): every file is hashed
//!    (BLAKE3, see [`digest`]) and fsynced, every directory fsynced, the parents
//!    `step-N/rank-r` created, the staging directory renamed to `step-N/rank-r/attempt-a`
//!    (never over an existing one) and created again empty, then every directory whose
//!    entries changed fsynced (those the parents were created in, the rank directory, the
//!    staging parent): all before the commit returns, and the data's fsync before the
//!    rename. The result is a [`PartRecord`] (files, sizes, hashes, the rank's resume
//!    state) that the agent reports to the leader.
//! 3. When every rank's part is in the Raft log, the leader checks every part's files and
//!    sizes ([`CheckpointStore::check_part`]: no content is re-read; the digests are the
//!    agent's, computed over the very bytes it fsynced), writes `MANIFEST.json`
//!    ([`CheckpointStore::write_manifest`], temp + fsync + rename + fsync dir), commits the
//!    step in Raft, writes `LATEST` the same way ([`CheckpointStore::write_latest`]) and
//!    prunes old steps ([`CheckpointStore::prune`]).
//! 4. A resume picks the newest step whose manifest and files verify, every byte hashed
//!    ([`newest_valid_step`], [`CheckpointStore::verify_part`]): a torn step (no manifest) or
//!    a corrupt one (bad size or digest, missing file, unreadable manifest) is skipped for
//!    the previous good one.
//!
//! Nothing read back from disk is trusted: manifests, `LATEST` and part files are size
//! limited, parsed strictly and validated (paths may not escape a part directory, symlinks
//! are refused).
//!
//! The trait [`CheckpointStore`] leaves room for an object-store backend: its contract only
//! promises that a committed part / manifest / `LATEST` appears complete or not at all;
//! rename and fsync are details of [`LocalStore`].

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

mod dataset;
pub mod digest;
pub mod failpoints;
mod local;
mod s3;
mod tiered;

pub use cumulus_api::FileEntry;
pub use cumulus_api::limits::{MAX_PART_FILES, MAX_STATE_JSON_BYTES};
pub use dataset::{DatasetCache, Fetched, ShardPin};
pub use digest::{DigestAlgorithm, HASH_BUFFER_BYTES, WRITE_ALGORITHM, parse_digest};
pub use local::{Durability, LocalStore, RankAccess};
#[cfg(feature = "clap")]
pub use s3::S3Args;
pub use s3::{
    DIGEST_METADATA_KEY, LEGACY_SHA256_METADATA_KEY, ListedObject, ObjectBody, ObjectInfo,
    RemoteKind, S3Connector, S3Location, S3Settings, S3Store, part_file_key,
};
pub use tiered::{CommitTier, TieredStore};

// The manifest's and `LATEST`'s file names, the manifest formats written ([`digest`]: format
// 2 records `<algorithm>:<hex>`) and still read, and the largest manifest: the contract's
// (a rank reads a manifest back too), with the fields [`Manifest`] writes.
pub use cumulus_api::manifest::{
    LATEST_FILE, MANIFEST_FILE, MANIFEST_FORMAT_VERSION, MAX_MANIFEST_BYTES,
    MIN_MANIFEST_FORMAT_VERSION,
};
/// Largest `LATEST` file read back, in bytes.
pub const MAX_LATEST_BYTES: u64 = 64;
pub use cumulus_api::ids::MAX_JOB_ID_BYTES;
/// Longest relative file path inside a part, in bytes.
pub const MAX_REL_PATH_BYTES: usize = 4096;
/// Longest single path component inside a part, in bytes (the usual file system limit).
pub const MAX_PATH_COMPONENT_BYTES: usize = 255;
/// Deepest directory nesting inside a part (number of path components of a file).
pub const MAX_PART_DEPTH: usize = 64;

/// Name of the directory of `step`: `step-` + the step zero-padded to 8 digits (longer when
/// the step needs more digits), e.g. `step-00000100`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Strict inverse of [`step_dir_name`]: `Some(step)` only when `name` is exactly
/// `step_dir_name(step)` (no sign, no extra leading zero beyond the padding, no suffix).
pub fn parse_step_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.len() < 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let step: u64 = digits.parse().ok()?;
    (step_dir_name(step) == name).then_some(step)
}

/// Directory of a committed part, relative to the job directory:
/// `step-00000100/rank-0/attempt-1`.
pub fn part_dir_rel(step: u64, rank: u32, attempt: u32) -> String {
    format!("{}/rank-{rank}/attempt-{attempt}", step_dir_name(step))
}

/// Strict inverse of [`part_dir_rel`]: `Some((step, rank, attempt))` only for a canonical
/// part directory name.
pub fn parse_part_dir_rel(dir: &str) -> Option<(u64, u32, u32)> {
    let mut components = dir.split('/');
    let step = parse_step_dir_name(components.next()?)?;
    let rank = parse_canonical_u32(components.next()?.strip_prefix("rank-")?)?;
    let attempt = parse_canonical_u32(components.next()?.strip_prefix("attempt-")?)?;
    if components.next().is_some() {
        return None;
    }
    Some((step, rank, attempt))
}

/// Staging directory of one attempt, relative to the job directory:
/// `.staging/rank-0.attempt-1`.
pub fn staging_dir_rel(rank: u32, attempt: u32) -> String {
    format!(".staging/rank-{rank}.attempt-{attempt}")
}

/// Decimal `u32` with no sign and no leading zero (except `"0"` itself).
fn parse_canonical_u32(text: &str) -> Option<u32> {
    if text.is_empty()
        || !text.bytes().all(|b| b.is_ascii_digit())
        || (text.len() > 1 && text.starts_with('0'))
    {
        return None;
    }
    text.parse().ok()
}

/// One rank's committed part of a step.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct PartRecord {
    /// The rank (0-based) this part belongs to.
    pub rank: u32,
    /// The attempt (epoch) of the rank that committed it.
    pub attempt: u32,
    /// Part directory relative to the job directory; equals `part_dir_rel(step, rank, attempt)`.
    pub dir: String,
    /// Every regular file of the part, sorted by path; at most [`MAX_PART_FILES`].
    pub files: Vec<FileEntry>,
    /// The rank's resume state (e.g. shard and record position): a JSON object of at most
    /// [`MAX_STATE_JSON_BYTES`] bytes when serialized compactly.
    pub state: serde_json::Value,
}

/// The manifest of a committed step, stored as `step-N/MANIFEST.json`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Manifest {
    /// Always [`MANIFEST_FORMAT_VERSION`].
    pub format_version: u32,
    /// The job the step belongs to (a valid job id, see [`validate_job_id`]).
    pub job_id: String,
    /// The training step of the checkpoint.
    pub step: u64,
    /// Number of ranks of the job (≥ 1).
    pub world_size: u32,
    /// When the leader committed the step, milliseconds since the Unix epoch (stamped by the
    /// leader; informational).
    pub committed_at_ms: u64,
    /// Exactly one part per rank `0..world_size`, sorted by rank.
    pub parts: Vec<PartRecord>,
}

/// Errors of checkpoint operations. Callers branch on the variant: [`CkptError::Corrupt`]
/// and [`CkptError::NotFound`] mean "this checkpoint is unusable", [`CkptError::Invalid`]
/// means the caller's input was wrong, [`CkptError::Io`] that the storage itself failed.
#[derive(Debug, thiserror::Error)]
pub enum CkptError {
    /// A storage operation failed.
    #[error("checkpoint I/O error: {op} {path}: {source}")]
    Io {
        /// The operation, e.g. `"open"`, `"rename"`, `"fsync"`.
        op: &'static str,
        /// The path it was applied to.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Data read back is damaged, incomplete or does not match its record.
    #[error("corrupt checkpoint data at {path}: {reason}")]
    Corrupt {
        /// The file or directory that is wrong.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The named object does not exist.
    #[error("not found: {what}")]
    NotFound {
        /// What was looked for (names job, step and path).
        what: String,
    },
    /// Invalid input from the caller.
    #[error("invalid checkpoint input: {0}")]
    Invalid(String),
    /// An S3 request failed (after retrying transient failures until the deadline).
    #[error("S3 {op} {url} at {endpoint}: {kind}: {detail}")]
    Remote {
        /// The operation, e.g. `"put"`, `"upload part"`, `"put LATEST"`.
        op: &'static str,
        /// The object or prefix, `s3://bucket/key`.
        url: String,
        /// The endpoint URL (or `AWS <region>`).
        endpoint: String,
        /// What kind of failure (callers branch on it).
        kind: RemoteKind,
        /// The server's error code and message, or the transport error.
        detail: String,
    },
}

impl CkptError {
    /// True for errors that mean "this checkpoint is unusable" ([`CkptError::Corrupt`],
    /// [`CkptError::NotFound`]), as opposed to storage or caller failures.
    pub fn is_unusable_checkpoint(&self) -> bool {
        matches!(self, CkptError::Corrupt { .. } | CkptError::NotFound { .. })
    }
}

/// Checks a job id used as a directory name or key component, by the one rule of
/// [`cumulus_api::ids::check_job_id`].
///
/// # Errors
/// [`CkptError::Invalid`] naming what is wrong.
pub fn validate_job_id(job_id: &str) -> Result<(), CkptError> {
    cumulus_api::ids::check_job_id(job_id).map_err(|e| CkptError::Invalid(e.to_string()))
}

/// Checks a file path relative to a part directory: non-empty, at most
/// [`MAX_REL_PATH_BYTES`] bytes and [`MAX_PART_DEPTH`] components, `/`-separated, not
/// absolute, no empty, `.` or `..` component, no `\` or NUL, each component at most
/// [`MAX_PATH_COMPONENT_BYTES`] bytes. Such a path can never escape the part directory by
/// name (symlinks are refused separately when the files are read).
pub fn validate_rel_path(path: &str) -> Result<(), CkptError> {
    let invalid = |why: &str| Err(CkptError::Invalid(format!("file path {path:?} {why}")));
    if path.is_empty() {
        return invalid("is empty");
    }
    if path.len() > MAX_REL_PATH_BYTES {
        return invalid("is too long");
    }
    if path.starts_with('/') {
        return invalid("is absolute");
    }
    if path.contains('\\') || path.contains('\0') {
        return invalid("contains a backslash or NUL");
    }
    let mut depth = 0usize;
    for component in path.split('/') {
        depth += 1;
        match component {
            "" => return invalid("has an empty component"),
            "." | ".." => return invalid("has a '.' or '..' component"),
            _ if component.len() > MAX_PATH_COMPONENT_BYTES => {
                return invalid("has a too long component");
            }
            _ => {}
        }
    }
    if depth > MAX_PART_DEPTH {
        return invalid("is nested too deeply");
    }
    Ok(())
}

/// Checks a resume state: a JSON object of at most [`MAX_STATE_JSON_BYTES`] bytes
/// serialized compactly.
pub fn validate_state(state: &serde_json::Value) -> Result<(), CkptError> {
    if !state.is_object() {
        return Err(CkptError::Invalid("state must be a JSON object".into()));
    }
    let size = serde_json::to_vec(state)
        .map_err(|e| CkptError::Invalid(format!("state cannot be serialized: {e}")))?
        .len();
    if size > MAX_STATE_JSON_BYTES {
        return Err(CkptError::Invalid(format!(
            "state is {size} bytes of JSON, more than {MAX_STATE_JSON_BYTES}"
        )));
    }
    Ok(())
}

impl PartRecord {
    /// Checks the record on its own: `dir` is a canonical part directory of this record's
    /// rank and attempt, at most [`MAX_PART_FILES`] files with valid, distinct paths and
    /// valid digests ([`parse_digest`]), and a valid state ([`validate_state`]). Returns the step named
    /// by `dir`.
    pub fn validate(&self) -> Result<u64, CkptError> {
        let (step, rank, attempt) = parse_part_dir_rel(&self.dir).ok_or_else(|| {
            CkptError::Invalid(format!(
                "part dir {:?} is not step-N/rank-R/attempt-A",
                self.dir
            ))
        })?;
        if rank != self.rank || attempt != self.attempt {
            return Err(CkptError::Invalid(format!(
                "part dir {:?} does not match rank {} attempt {}",
                self.dir, self.rank, self.attempt
            )));
        }
        if self.files.len() > MAX_PART_FILES {
            return Err(CkptError::Invalid(format!(
                "part {:?} lists {} files, more than {MAX_PART_FILES}",
                self.dir,
                self.files.len()
            )));
        }
        let mut seen = BTreeSet::new();
        for file in &self.files {
            validate_rel_path(&file.path)?;
            if !seen.insert(file.path.as_str()) {
                return Err(CkptError::Invalid(format!(
                    "part {:?} lists {:?} twice",
                    self.dir, file.path
                )));
            }
            parse_digest(&file.digest).map_err(|error| {
                CkptError::Invalid(format!(
                    "file {:?} of part {:?}: {error}",
                    file.path, self.dir
                ))
            })?;
        }
        validate_state(&self.state)?;
        Ok(step)
    }

    /// The record of a part a rank attempt reports committed at `step`, from the fields it
    /// travels in (the gRPC `CommitCheckpointPartRequest`, the Raft log's `PartInfo`):
    /// `state_json` parsed, everything checked as [`PartRecord::validate`] does, and `dir`
    /// the part directory of exactly this step, rank and attempt.
    ///
    /// # Errors
    /// [`CkptError::Invalid`] naming the first field that is wrong.
    pub fn from_reported(
        step: u64,
        rank: u32,
        attempt: u32,
        dir: String,
        files: Vec<FileEntry>,
        state_json: &str,
    ) -> Result<Self, CkptError> {
        if state_json.len() > MAX_STATE_JSON_BYTES {
            return Err(CkptError::Invalid(format!(
                "state is {} bytes of JSON, more than {MAX_STATE_JSON_BYTES}",
                state_json.len()
            )));
        }
        let state = serde_json::from_str(state_json)
            .map_err(|e| CkptError::Invalid(format!("state is not JSON: {e}")))?;
        let record = PartRecord {
            rank,
            attempt,
            dir,
            files,
            state,
        };
        let named_step = record.validate()?;
        if named_step != step {
            return Err(CkptError::Invalid(format!(
                "part dir must be {}, not {}",
                part_dir_rel(step, rank, attempt),
                record.dir
            )));
        }
        Ok(record)
    }

    /// Sum of the part's file sizes, in bytes (saturating).
    pub fn total_bytes(&self) -> u64 {
        self.files
            .iter()
            .fold(0u64, |sum, file| sum.saturating_add(file.size_bytes))
    }
}

impl Manifest {
    /// Checks the manifest: format version, job id, `world_size ≥ 1`, exactly one part per
    /// rank `0..world_size` sorted by rank, each part valid ([`PartRecord::validate`]) and of
    /// this manifest's step.
    pub fn validate(&self) -> Result<(), CkptError> {
        if !(MIN_MANIFEST_FORMAT_VERSION..=MANIFEST_FORMAT_VERSION).contains(&self.format_version) {
            return Err(CkptError::Invalid(format!(
                "manifest format version {} is not in {MIN_MANIFEST_FORMAT_VERSION}..={MANIFEST_FORMAT_VERSION}",
                self.format_version
            )));
        }
        validate_job_id(&self.job_id)?;
        if self.world_size == 0 {
            return Err(CkptError::Invalid("manifest world size is 0".into()));
        }
        if u64::try_from(self.parts.len()).ok() != Some(u64::from(self.world_size)) {
            return Err(CkptError::Invalid(format!(
                "manifest has {} parts for world size {}",
                self.parts.len(),
                self.world_size
            )));
        }
        for (index, part) in self.parts.iter().enumerate() {
            if u64::try_from(index).ok() != Some(u64::from(part.rank)) {
                return Err(CkptError::Invalid(format!(
                    "manifest part {index} is of rank {}; parts must be ranks 0..{} in order",
                    part.rank, self.world_size
                )));
            }
            let step = part.validate()?;
            if step != self.step {
                return Err(CkptError::Invalid(format!(
                    "part dir {:?} is not of manifest step {}",
                    part.dir, self.step
                )));
            }
        }
        Ok(())
    }

    /// Sum of every part's file sizes, in bytes (saturating).
    pub fn total_bytes(&self) -> u64 {
        self.parts
            .iter()
            .fold(0u64, |sum, part| sum.saturating_add(part.total_bytes()))
    }
}

/// A checkpoint backend. Every method validates its input and everything it reads back.
///
/// Contract common to all backends: a committed part, a manifest and `LATEST` each become
/// visible complete or not at all; a step is usable only with a valid manifest whose parts
/// verify. How atomicity is achieved (rename, conditional writes) is the backend's business.
#[async_trait::async_trait]
pub trait CheckpointStore: Send + Sync + 'static {
    /// Creates (if absent) and returns the local staging directory of (job, rank, attempt):
    /// `<root>/<job>/.staging/rank-<r>.attempt-<a>`. Existing content is left as is.
    async fn prepare_staging(
        &self,
        job_id: &str,
        rank: u32,
        attempt: u32,
    ) -> Result<PathBuf, CkptError>;

    /// Atomically commits the content of `staging` as part (step, rank, attempt) and returns
    /// its record; afterwards `staging` exists again, empty. Fails with
    /// [`CkptError::Invalid`] and changes nothing when that part already exists, when the
    /// staging tree holds a symlink or special file, more than [`MAX_PART_FILES`] files, or
    /// when `state` is not a JSON object of at most [`MAX_STATE_JSON_BYTES`] bytes.
    async fn commit_part(
        &self,
        job_id: &str,
        step: u64,
        rank: u32,
        attempt: u32,
        staging: &Path,
        state: serde_json::Value,
    ) -> Result<PartRecord, CkptError>;

    /// Checks that every file of the part exists as a regular file inside the part directory
    /// (no symlink on the way) with the recorded size and digest, reading every byte (an
    /// object store may check the digest its upload recorded instead, see [`S3Store`]).
    /// [`CkptError::Corrupt`] names the first mismatch; [`CkptError::Invalid`] when the
    /// record itself is invalid.
    async fn verify_part(&self, job_id: &str, part: &PartRecord) -> Result<(), CkptError>;

    /// The cheap check of the leader's finalize: like [`CheckpointStore::verify_part`] but
    /// without reading content: every file is present, regular, inside the part, and of the
    /// recorded size. Content digests are verified where the bytes are used (a resume). The
    /// default is the full [`CheckpointStore::verify_part`].
    async fn check_part(&self, job_id: &str, part: &PartRecord) -> Result<(), CkptError> {
        self.verify_part(job_id, part).await
    }

    /// Validates `manifest` and writes it as `step-N/MANIFEST.json` atomically (replacing an
    /// older one). [`CkptError::NotFound`] when the step has no directory (no part).
    async fn write_manifest(&self, manifest: &Manifest) -> Result<(), CkptError>;

    /// Reads `step-N/MANIFEST.json` (at most [`MAX_MANIFEST_BYTES`]), parses and validates it;
    /// its job id and step must match the path. [`CkptError::NotFound`] when absent,
    /// [`CkptError::Corrupt`] when unreadable or invalid.
    async fn read_manifest(&self, job_id: &str, step: u64) -> Result<Manifest, CkptError>;

    /// [`CheckpointStore::read_manifest`] then [`CheckpointStore::verify_part`] of every part.
    async fn verify_step(&self, job_id: &str, step: u64) -> Result<Manifest, CkptError>;

    /// Points `LATEST` at `step` (`"step-0000000N\n"`) atomically. [`CkptError::NotFound`]
    /// when the step has no directory.
    async fn write_latest(&self, job_id: &str, step: u64) -> Result<(), CkptError>;

    /// The step `LATEST` names; `None` when there is no `LATEST`, [`CkptError::Corrupt`] when
    /// it cannot be parsed.
    async fn read_latest(&self, job_id: &str) -> Result<Option<u64>, CkptError>;

    /// Steps that have a `step-N` directory, ascending (other names are ignored; an absent
    /// job directory gives an empty list).
    async fn list_steps(&self, job_id: &str) -> Result<Vec<u64>, CkptError>;

    /// Deletes every step directory that is not in `keep` and older than the step `LATEST`
    /// names — never the `LATEST` step itself, never a newer (possibly in-flight) step, and
    /// nothing at all while there is no `LATEST` — plus stale `*.tmp*` leftovers. A corrupt
    /// `LATEST` is an error and deletes nothing. Returns the deleted steps, ascending.
    async fn prune(&self, job_id: &str, keep: &[u64]) -> Result<Vec<u64>, CkptError>;

    /// Deletes every checkpoint of the job (`cumulusctl delete --checkpoints`): `LATEST`
    /// first, so that a deletion cut short never leaves a `LATEST` naming a step that is
    /// partly gone, then everything else under the job. An absent job is not an error.
    /// Returns whether anything was there.
    async fn delete_job(&self, job_id: &str) -> Result<bool, CkptError>;

    /// Local path of a part directory (`part_dir` as in [`PartRecord::dir`]) for a resume:
    /// `Some` for a local backend when job id and `part_dir` are valid, `None` otherwise.
    fn local_part_path(&self, job_id: &str, part_dir: &str) -> Option<PathBuf>;

    /// Verified local directory of `part` for a resume (`CUMULUS_RESUME_DIR`). The default
    /// verifies the part in place ([`CheckpointStore::verify_part`]) and returns
    /// [`CheckpointStore::local_part_path`]; a tiered store restores a missing or damaged
    /// local copy from its remote tier first.
    async fn resume_part_path(
        &self,
        job_id: &str,
        part: &PartRecord,
    ) -> Result<PathBuf, CkptError> {
        self.verify_part(job_id, part).await?;
        self.local_part_path(job_id, &part.dir).ok_or_else(|| {
            CkptError::Invalid(format!(
                "part {:?} has no local path in {}",
                part.dir,
                self.describe()
            ))
        })
    }

    /// Human-readable location of the store for messages, e.g. `file:///abs/root`.
    fn describe(&self) -> String;
}

/// The newest of `candidates` (any order, duplicates allowed) whose step verifies (manifest
/// and every part's files); `None` when none does. Steps that are unusable (torn, corrupt,
/// absent: [`CkptError::is_unusable_checkpoint`]) are skipped for older ones; storage and
/// input errors are returned, so an unreadable store never silently restarts a job from
/// scratch.
pub async fn newest_valid_step(
    store: &dyn CheckpointStore,
    job_id: &str,
    candidates: &[u64],
) -> Result<Option<Manifest>, CkptError> {
    validate_job_id(job_id)?;
    let ordered: BTreeSet<u64> = candidates.iter().copied().collect();
    for &step in ordered.iter().rev() {
        match store.verify_step(job_id, step).await {
            Ok(manifest) => return Ok(Some(manifest)),
            Err(error) if error.is_unusable_checkpoint() => continue,
            Err(error) => return Err(error),
        }
    }
    Ok(None)
}

/// Size in bytes and digest ([`WRITE_ALGORITHM`], `<algorithm>:<hex>`) of the regular file
/// at `path`, read in [`HASH_BUFFER_BYTES`] chunks.
pub fn hash_file(path: &Path) -> Result<(u64, String), CkptError> {
    let mut file = File::open(path).map_err(|source| CkptError::Io {
        op: "open",
        path: path.to_owned(),
        source,
    })?;
    let metadata = file.metadata().map_err(|source| CkptError::Io {
        op: "stat",
        path: path.to_owned(),
        source,
    })?;
    if !metadata.is_file() {
        return Err(CkptError::Invalid(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    digest::hash_reader(&mut file, path, WRITE_ALGORITHM)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(dir: &str, rank: u32, attempt: u32) -> PartRecord {
        PartRecord {
            rank,
            attempt,
            dir: dir.into(),
            files: vec![FileEntry {
                path: "model.bin".into(),
                size_bytes: 3,
                digest: format!("blake3:{}", "a".repeat(64)),
            }],
            state: serde_json::json!({"shard": 0}),
        }
    }

    /// The keys of a JSON object, as a set.
    fn keys(v: &serde_json::Value) -> std::collections::BTreeSet<String> {
        v.as_object().expect("an object").keys().cloned().collect()
    }

    fn shape_keys(shape: &cumulus_api::shape::Shape) -> std::collections::BTreeSet<String> {
        shape.field_names().into_iter().map(String::from).collect()
    }

    #[test]
    fn the_manifest_writes_the_contract_fields() {
        use cumulus_api::manifest::{MANIFEST, MANIFEST_FILE_ENTRY, MANIFEST_PART};
        let v = serde_json::to_value(manifest(2)).expect("json");
        assert_eq!(keys(&v), shape_keys(&MANIFEST));
        assert_eq!(keys(&v["parts"][0]), shape_keys(&MANIFEST_PART));
        assert_eq!(
            keys(&v["parts"][0]["files"][0]),
            shape_keys(&MANIFEST_FILE_ENTRY)
        );
    }

    fn manifest(world_size: u32) -> Manifest {
        Manifest {
            format_version: MANIFEST_FORMAT_VERSION,
            job_id: "job-000001".into(),
            step: 7,
            world_size,
            committed_at_ms: 1,
            parts: (0..world_size)
                .map(|rank| part(&part_dir_rel(7, rank, 1), rank, 1))
                .collect(),
        }
    }

    #[test]
    fn names() {
        assert_eq!(step_dir_name(100), "step-00000100");
        assert_eq!(step_dir_name(123_456_789), "step-123456789");
        assert_eq!(part_dir_rel(100, 0, 1), "step-00000100/rank-0/attempt-1");
        assert_eq!(staging_dir_rel(0, 1), ".staging/rank-0.attempt-1");
        assert_eq!(
            parse_part_dir_rel("step-00000100/rank-3/attempt-12"),
            Some((100, 3, 12))
        );
        for bad in [
            "step-00000100/rank-03/attempt-1",
            "step-00000100/rank-3",
            "step-00000100/rank-3/attempt-1/x",
            "step-100/rank-3/attempt-1",
            "step-00000100/rank-+3/attempt-1",
            "step-00000100/rank-3/attempt-",
        ] {
            assert_eq!(parse_part_dir_rel(bad), None, "{bad}");
        }
        for bad in [
            "step-1",
            "step-000000001",
            "step-+0000001",
            "Step-00000001",
            "step-00000001 ",
            "step-",
            "step-18446744073709551616",
        ] {
            assert_eq!(parse_step_dir_name(bad), None, "{bad}");
        }
        assert_eq!(
            parse_step_dir_name("step-18446744073709551615"),
            Some(u64::MAX)
        );
    }

    #[test]
    fn job_ids() {
        assert!(validate_job_id("job-000001").is_ok());
        assert!(validate_job_id("a.b_c-D9").is_ok());
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "a b",
            "é",
            &"x".repeat(MAX_JOB_ID_BYTES + 1),
        ] {
            assert!(
                matches!(validate_job_id(bad), Err(CkptError::Invalid(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn rel_paths() {
        for good in ["a", "a/b.c", "..a/b..", ".hidden/x"] {
            assert!(validate_rel_path(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../b",
            "a/./b",
            "a//b",
            "a/",
            "a\\b",
            "a\0b",
        ] {
            assert!(
                matches!(validate_rel_path(bad), Err(CkptError::Invalid(_))),
                "{bad:?}"
            );
        }
        let deep = vec!["d"; MAX_PART_DEPTH + 1].join("/");
        assert!(validate_rel_path(&deep).is_err());
    }

    #[test]
    fn manifest_validation() {
        let good = manifest(2);
        good.validate().expect("valid manifest");
        assert_eq!(good.total_bytes(), 6);

        let mut bad = good.clone();
        bad.parts.swap(0, 1);
        assert!(bad.validate().is_err(), "parts out of order");

        let mut bad = good.clone();
        bad.parts.pop();
        assert!(bad.validate().is_err(), "missing rank");

        let mut bad = good.clone();
        bad.parts[1].dir = part_dir_rel(8, 1, 1);
        assert!(bad.validate().is_err(), "part of another step");

        let mut bad = good.clone();
        bad.parts[1].dir = part_dir_rel(7, 1, 2);
        assert!(bad.validate().is_err(), "dir of another attempt");

        let mut bad = good.clone();
        bad.parts[0].files[0].path = "../../etc/passwd".into();
        assert!(bad.validate().is_err(), "path traversal");

        let mut bad = good.clone();
        bad.parts[0].files[0].digest = format!("blake3:{}", "A".repeat(64));
        assert!(bad.validate().is_err(), "uppercase hash");

        let mut bad = good.clone();
        let copy = bad.parts[0].files[0].clone();
        bad.parts[0].files.push(copy);
        assert!(bad.validate().is_err(), "duplicate path");

        let mut bad = good.clone();
        bad.parts[0].state = serde_json::json!([1, 2]);
        assert!(bad.validate().is_err(), "state not an object");

        let mut bad = good.clone();
        bad.parts[0].state = serde_json::json!({"blob": "x".repeat(MAX_STATE_JSON_BYTES)});
        assert!(bad.validate().is_err(), "state too large");

        for version in [0, MANIFEST_FORMAT_VERSION + 1] {
            let mut bad = good.clone();
            bad.format_version = version;
            assert!(bad.validate().is_err(), "format version {version}");
        }

        let mut bad = manifest(1);
        bad.world_size = 0;
        bad.parts.clear();
        assert!(bad.validate().is_err(), "world size 0");

        let mut bad = good;
        bad.job_id = "../x".into();
        assert!(bad.validate().is_err(), "job id");
    }

    #[test]
    fn a_format_1_manifest_reads_as_sha256_digests_and_serializes_as_format_2_fields() {
        let hex = "ab".repeat(32);
        let text = format!(
            r#"{{"format_version":1,"job_id":"j1","step":1,"world_size":1,"committed_at_ms":5,
            "parts":[{{"rank":0,"attempt":1,"dir":"step-00000001/rank-0/attempt-1",
            "files":[{{"path":"w.bin","size_bytes":3,"sha256":"{hex}"}}],"state":{{}}}}]}}"#
        );
        let manifest: Manifest = serde_json::from_str(&text).expect("format 1 parses");
        manifest.validate().expect("format 1 is valid");
        assert_eq!(manifest.parts[0].files[0].digest, format!("sha256:{hex}"));
        let written = serde_json::to_string(&manifest.parts[0].files[0]).expect("serialize");
        assert_eq!(
            written,
            format!(r#"{{"path":"w.bin","size_bytes":3,"digest":"sha256:{hex}"}}"#)
        );

        let both = text.replace(
            r#""sha256":"#,
            &format!(r#""digest":"sha256:{hex}","sha256":"#),
        );
        assert!(
            serde_json::from_str::<Manifest>(&both).is_err(),
            "two digests"
        );
        let none = text.replace(&format!(r#","sha256":"{hex}""#), "");
        assert!(
            serde_json::from_str::<Manifest>(&none).is_err(),
            "no digest"
        );
    }

    #[test]
    fn hash_of_known_content() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("abc");
        std::fs::write(&path, b"abc").expect("write");
        let (size, digest) = hash_file(&path).expect("hash");
        assert_eq!(size, 3);
        assert_eq!(
            digest,
            "blake3:6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
        );
        assert!(matches!(hash_file(dir.path()), Err(CkptError::Invalid(_))));
        assert!(matches!(
            hash_file(&dir.path().join("none")),
            Err(CkptError::Io { .. })
        ));
    }
}
