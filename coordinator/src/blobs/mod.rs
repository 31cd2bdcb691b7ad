//! The coordinators' blob store: content-addressed blobs (a job's packed working
//! directory, an attempt's artifacts) kept on the coordinators themselves, each written to
//! a majority of the voters before an upload is acknowledged, or, with `--blob-url`, in
//! an S3 bucket every coordinator shares ([`Backend`]). The Raft log holds only their
//! digests and sizes (`BlobRef`); the bytes never enter it.
//!
//! - `store`: the local store under `<data-dir>/blobs/` (streamed, hashed, fsynced
//!   writes; reads verified as they stream; a sidecar per blob with its uploader).
//! - `peers`: `ReplicateBlob` and `FetchBlob` to and from the other coordinators.
//! - `ops`: what the services call: stat, put (with the per-user quota and the majority
//!   rule), read (fetching a missing blob from a peer first), receiving a replica.
//! - `s3`: the bucket of `--blob-url` (streamed and verified uploads, `HEAD`, reads
//!   re-hashed as they stream, the uploader in object metadata, the leader's sweep).
//! - `refs`: which blobs the applied state references (a job's workdir, its artifacts).
//! - `gc`: the background sweep of unreferenced blobs past `--blob-retention-ms`.
//!
//! The services call the same operations whichever the backend; with S3, `ops` hands
//! stat, put, read and admission to `s3` and the majority rule does not apply (peers'
//! `ReplicateBlob` and `FetchBlob` still work on the local store).
//!
//! Who may call what is checked by the adapters (`crate::api::blobs` for clients,
//! `worker_service`, `raft_service`); this module trusts its caller.

pub mod gc;
pub mod ops;
pub mod peers;
pub mod refs;
pub mod s3;
pub mod store;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cumulus_api::blobs::MAX_BLOB_BYTES;
use cumulus_raft_store::{NodeId, Raft, SharedState};
use tokio::sync::Semaphore;

use crate::error::ApiError;
pub use store::{BlobHeader, BlobMeta, BlobRead, LocalStore};

/// Uploads (clients' and agents' `PutBlob`) one coordinator receives at once; more are
/// refused with RESOURCE_EXHAUSTED (retry).
pub const MAX_CONCURRENT_UPLOADS: usize = 8;
/// Replicas (peers' `ReplicateBlob`) one coordinator receives at once; more wait up to
/// [`SLOT_WAIT_MS`].
pub const MAX_CONCURRENT_REPLICAS: usize = 8;
/// Blobs one coordinator fetches from its peers at once; more wait up to
/// [`SLOT_WAIT_MS`].
pub const MAX_CONCURRENT_FETCHES: usize = 8;
/// Blobs one coordinator streams out at once (reads by clients, agents and peers, and
/// its own replication sources); more wait up to [`SLOT_WAIT_MS`].
pub const MAX_CONCURRENT_READS: usize = 64;
/// Replication streams to peers one coordinator keeps open at once, those that finish in
/// the background after an acknowledgment included.
pub const MAX_OUTGOING_REPLICATIONS: usize = 32;
/// Longest wait for a slot above, in milliseconds.
pub const SLOT_WAIT_MS: u64 = 30_000;
/// Deadline of replicating one blob to one peer, before the allowance for its size, in
/// milliseconds; an upload fails when no majority holds it by then.
pub const REPLICATE_BASE_TIMEOUT_MS: u64 = 10_000;
/// Slowest transfer rate a replication's deadline allows for, in bytes per second.
pub const REPLICATE_MIN_BYTES_PER_S: u64 = 8 * 1024 * 1024;
/// Default of `--blob-quota-bytes-per-user`: 8 GiB.
pub const DEFAULT_QUOTA_BYTES_PER_USER: u64 = 8 * 1024 * 1024 * 1024;
/// Default of `--blob-retention-ms`: 24 hours.
pub const DEFAULT_RETENTION_MS: u64 = 24 * 60 * 60 * 1_000;

/// Deadline of moving `size_bytes` between two coordinators:
/// [`REPLICATE_BASE_TIMEOUT_MS`] plus a second per [`REPLICATE_MIN_BYTES_PER_S`].
pub fn transfer_deadline(size_bytes: u64) -> std::time::Duration {
    std::time::Duration::from_millis(
        REPLICATE_BASE_TIMEOUT_MS
            .saturating_add(size_bytes.saturating_mul(1_000) / REPLICATE_MIN_BYTES_PER_S),
    )
}

/// The blob store's flags.
#[derive(clap::Args, Debug, Clone)]
pub struct BlobArgs {
    /// Largest blob this coordinator accepts (a packed working directory, an attempt's
    /// artifacts), in bytes: 1..=2 GiB (`cumulus_api::blobs::MAX_BLOB_BYTES`).
    #[arg(long, default_value_t = MAX_BLOB_BYTES)]
    pub max_blob_bytes: u64,
    /// Most bytes of blobs one user (not an administrator) may have uploaded and still
    /// held on this coordinator; an upload past it is refused with RESOURCE_EXHAUSTED
    /// naming the usage. Blobs collected (see `--blob-retention-ms`) stop counting.
    #[arg(long, default_value_t = DEFAULT_QUOTA_BYTES_PER_USER)]
    pub blob_quota_bytes_per_user: u64,
    /// A blob no job in the state references (as its workdir or an artifact) is removed
    /// once it was neither stored nor used for this long, in milliseconds (24 h by
    /// default). Keep it well above the time between an upload and its submit.
    #[arg(long, default_value_t = DEFAULT_RETENTION_MS)]
    pub blob_retention_ms: u64,
    /// Keep blobs in this S3 bucket and prefix (`s3://bucket/prefix`: blob D is the
    /// object `prefix/blobs/D`, reached with the `--s3-*` settings) instead of on the
    /// coordinators. Give every coordinator of a cluster the same. An upload is verified
    /// here, then acknowledged once S3 holds it (`replicas` 0); reads are re-hashed as
    /// they stream; only the leader removes unreferenced blobs. Unset: on the
    /// coordinators, each upload on a majority of them.
    #[arg(long, env = "CUMULUS_BLOB_URL")]
    pub blob_url: Option<String>,
}

impl BlobArgs {
    /// Checks the flags' ranges.
    ///
    /// # Errors
    /// A message naming the flag out of range.
    pub fn validate(&self) -> anyhow::Result<()> {
        if !(1..=MAX_BLOB_BYTES).contains(&self.max_blob_bytes) {
            anyhow::bail!("need 1 <= --max-blob-bytes <= {MAX_BLOB_BYTES}");
        }
        if self.blob_retention_ms == 0 {
            anyhow::bail!("--blob-retention-ms must be at least 1");
        }
        if let Some(url) = &self.blob_url {
            cumulus_ckpt::S3Location::parse(url)
                .map_err(|e| anyhow::anyhow!("--blob-url {url:?}: {e}"))?;
        }
        Ok(())
    }
}

/// Why a blob operation failed, before it is mapped to an API error.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BlobError {
    /// A bad digest, a size or digest mismatch, a blob past the limit.
    #[error("{0}")]
    Invalid(String),
    /// Neither this node nor (where asked) its peers hold the blob.
    #[error("{0}")]
    NotFound(String),
    /// A bound is reached (uploads in progress, blobs held, a user's quota).
    #[error("{0}")]
    Exhausted(String),
    /// Peers cannot be reached, or no majority holds the blob in time.
    #[error("{0}")]
    Unavailable(String),
    /// The sender's stream broke or stalled.
    #[error("{0}")]
    Aborted(String),
    /// A stored blob's bytes are not its digest's (it was removed).
    #[error("{0}")]
    Corrupt(String),
    /// The disk failed.
    #[error("{0}")]
    Io(String),
}

impl From<BlobError> for ApiError {
    fn from(e: BlobError) -> ApiError {
        match e {
            BlobError::Invalid(m) => ApiError::InvalidArgument(m),
            BlobError::NotFound(m) => ApiError::NotFound(m),
            BlobError::Exhausted(m) => ApiError::ResourceExhausted(m),
            BlobError::Unavailable(m) | BlobError::Aborted(m) | BlobError::Corrupt(m) => {
                ApiError::Unavailable(m)
            }
            BlobError::Io(m) => ApiError::Internal(m),
        }
    }
}

impl From<BlobError> for tonic::Status {
    /// As [`ApiError`] maps it, but a corrupt blob is DATA_LOSS and a broken stream
    /// ABORTED.
    fn from(e: BlobError) -> tonic::Status {
        match e {
            BlobError::Corrupt(m) => tonic::Status::data_loss(m),
            BlobError::Aborted(m) => tonic::Status::aborted(m),
            e => crate::error::to_status(e.into()),
        }
    }
}

/// Where blobs live.
pub enum Backend {
    /// On the coordinators (`<data-dir>/blobs`), each upload on a majority of the voters.
    Coordinators,
    /// In the S3 bucket of `--blob-url`, shared by every coordinator.
    S3(Box<s3::S3Blobs>),
}

impl Backend {
    /// The backend `args` name, S3 reached with `s3`'s settings.
    ///
    /// # Errors
    /// A malformed `--blob-url` or invalid S3 settings.
    pub async fn open(args: &BlobArgs, s3: &cumulus_ckpt::S3Args) -> anyhow::Result<Backend> {
        Ok(match &args.blob_url {
            None => Backend::Coordinators,
            Some(url) => Backend::S3(Box::new(
                s3::S3Blobs::connect(url, s3, args.max_blob_bytes, args.blob_retention_ms).await?,
            )),
        })
    }
}

/// The blob store of one coordinator: where blobs live, its local store, its peers, and
/// the bounds on concurrent transfers.
pub struct Blobs {
    /// Where blobs live.
    pub backend: Backend,
    /// This node's id.
    pub id: NodeId,
    /// The local store.
    pub store: LocalStore,
    /// The other coordinators.
    pub peers: peers::BlobPeers,
    /// The Raft handle (the membership: who the voters are and where).
    pub raft: Raft,
    /// The applied state (which blobs jobs reference).
    pub shared: Arc<SharedState>,
    /// Most bytes of blobs one user may hold here (`--blob-quota-bytes-per-user`).
    pub quota_bytes_per_user: u64,
    /// How long an unreferenced blob is kept, in milliseconds (`--blob-retention-ms`).
    pub retention_ms: u64,
    uploads: Arc<Semaphore>,
    replicas: Arc<Semaphore>,
    fetches: Arc<Semaphore>,
    reads: Arc<Semaphore>,
    outgoing: Arc<Semaphore>,
    /// One lock per blob being fetched from a peer: concurrent reads of a missing blob
    /// fetch it once.
    fetching: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Bytes of uploads in progress per uploader, counted against their quota.
    reserved: Mutex<HashMap<String, u64>>,
    /// The highest commit index a leader's append told this node since it started, plus
    /// one (0: none yet): a follower's applied state is current once it reaches it
    /// (see `gc`).
    leader_commit_seen: std::sync::atomic::AtomicU64,
    /// When the last of those appends arrived (`None`: none since this process started);
    /// `/ready` reads its age (`crate::ready`).
    leader_contact_at: Mutex<Option<std::time::Instant>>,
}

impl Blobs {
    /// Opens the store under `data_dir` (blocking; at start) for node `id` of `raft`,
    /// reaching peers with `peers`, blobs kept in `backend`.
    ///
    /// # Errors
    /// The store's directory cannot be created or listed.
    pub fn load(
        data_dir: &std::path::Path,
        args: &BlobArgs,
        (id, raft, shared): (NodeId, Raft, Arc<SharedState>),
        (peers, backend): (peers::BlobPeers, Backend),
    ) -> anyhow::Result<Blobs> {
        Ok(Blobs {
            backend,
            id,
            store: LocalStore::open(data_dir, args.max_blob_bytes)?,
            peers,
            raft,
            shared,
            quota_bytes_per_user: args.blob_quota_bytes_per_user,
            retention_ms: args.blob_retention_ms,
            uploads: Arc::new(Semaphore::new(MAX_CONCURRENT_UPLOADS)),
            replicas: Arc::new(Semaphore::new(MAX_CONCURRENT_REPLICAS)),
            fetches: Arc::new(Semaphore::new(MAX_CONCURRENT_FETCHES)),
            reads: Arc::new(Semaphore::new(MAX_CONCURRENT_READS)),
            outgoing: Arc::new(Semaphore::new(MAX_OUTGOING_REPLICATIONS)),
            fetching: Mutex::default(),
            reserved: Mutex::default(),
            leader_commit_seen: std::sync::atomic::AtomicU64::new(0),
            leader_contact_at: Mutex::default(),
        })
    }

    /// Notes the commit index (`None`: nothing committed yet) an append from a leader of
    /// this node's term (or a later one) carried.
    pub fn note_leader_commit(&self, index: Option<u64>) {
        let seen = index.map_or(0, |i| i.saturating_add(1));
        self.leader_commit_seen
            .fetch_max(seen.max(1), std::sync::atomic::Ordering::Relaxed);
        *self
            .leader_contact_at
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(std::time::Instant::now());
    }

    /// How long ago the last append from a leader arrived; `None` before the first.
    pub fn leader_contact_age(&self) -> Option<std::time::Duration> {
        self.leader_contact_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map(|at| at.elapsed())
    }

    /// [`Blobs::note_leader_commit`]'s highest index plus one; 0 before any append.
    pub fn leader_commit_seen(&self) -> u64 {
        self.leader_commit_seen
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Takes a slot of `pool` (`what` names it), waiting at most [`SLOT_WAIT_MS`].
///
/// # Errors
/// [`BlobError::Exhausted`] when none frees up in time.
async fn slot(
    pool: &Arc<Semaphore>,
    what: &str,
) -> Result<tokio::sync::OwnedSemaphorePermit, BlobError> {
    let wait = std::time::Duration::from_millis(SLOT_WAIT_MS);
    match tokio::time::timeout(wait, pool.clone().acquire_owned()).await {
        Ok(Ok(permit)) => Ok(permit),
        _ => Err(BlobError::Exhausted(format!(
            "too many {what} in progress on this coordinator (waited {SLOT_WAIT_MS} ms); retry"
        ))),
    }
}
