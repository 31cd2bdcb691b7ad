//! The shared context of one coordinator: its Raft handle, the applied state, the
//! leader's soft state (heartbeats, progress), and the operations every API uses
//! (propose, linearizable read, leader lookup). gRPC and HTTP handlers are thin
//! adapters over these.

use std::sync::{Arc, Mutex};

pub use cumulus_raft_store::Raft;
use cumulus_raft_store::state::ClusterState;
use cumulus_raft_store::{Command, CumulusNode, NodeId, Response, SharedState};
use openraft::ReadPolicy;
use openraft::async_runtime::watch::WatchReceiver;
use openraft::error::{LinearizableReadError, RaftError};

use cumulus_api::users::Principal;

use crate::error::{ApiError, leader_node};
use crate::soft::SoftState;

/// Limits and timeouts of this coordinator.
#[derive(Clone, Debug)]
pub struct NodeLimits {
    /// Heartbeat interval told to workers, in milliseconds.
    pub heartbeat_interval_ms: u64,
    /// A worker silent this long is expired, in milliseconds.
    pub heartbeat_timeout_ms: u64,
    /// Largest accepted world size.
    pub max_world_size: u32,
    /// Most estimated bytes the unfinished jobs may hold before submits are refused
    /// (`--max-state-bytes`, at most [`cumulus_raft_store::state::MAX_STATE_BYTES`]).
    pub max_state_bytes: u64,
    /// Where a job's local dataset and checkpoint root may lie
    /// (`--allowed-dataset-roots`, `--allowed-ckpt-roots`; empty: anywhere).
    pub roots: cumulus_api::paths::JobRoots,
}

/// One coordinator's shared context.
pub struct Node {
    /// Raft node id.
    pub id: NodeId,
    /// The openraft handle.
    pub raft: Raft,
    /// The applied replicated state.
    pub shared: Arc<SharedState>,
    /// The leader's soft state.
    pub soft: Mutex<SoftState>,
    /// Limits and timeouts.
    pub limits: NodeLimits,
    /// The cluster bearer token.
    pub token: Arc<str>,
    /// Whether every connection is TLS (`false`: `--insecure`). With TLS, the Raft and
    /// worker services check the caller's certificate, and agents are reached over HTTPS.
    pub tls: bool,
    /// HTTP clients of the worker agents (log retrieval): with TLS, one per worker that
    /// accepts only that worker's certificate.
    pub http: crate::network::AgentHttp,
    /// Bounds concurrent SSE log streams, with a share per user and a reserve for
    /// administrators.
    pub log_streams: crate::shares::SharedSlots,
    /// S3 client factory for jobs with an S3 checkpoint target.
    pub s3: cumulus_ckpt::S3Connector,
    /// Group commit of this node's Raft writes (see [`crate::proposer`]).
    pub proposer: crate::proposer::Proposer,
    /// The cached mount table that lets SubmitJob check local directories on the runtime
    /// thread (see [`crate::localfs`]).
    pub local_fs: Arc<crate::localfs::LocalFs>,
    /// Estimated bytes of the submits admitted and not yet applied, in bytes (see
    /// [`Node::reserve_state_bytes`]).
    pub state_reserved_bytes: std::sync::atomic::AtomicU64,
    /// The blob store on this coordinator's data dir (see [`crate::blobs`]).
    pub blobs: Arc<crate::blobs::Blobs>,
}

/// One user's (not an administrator's) share of the state byte budget: at most
/// `1 / STATE_SHARE_DIVISOR` of `--max-state-bytes` in its unfinished jobs, so one user's
/// submits cannot refuse everyone else's. Submits of one user still being applied are
/// not counted against the share (the cluster-wide check counts them).
pub const STATE_SHARE_DIVISOR: u64 = 4;

/// Estimated state bytes held for one admitted submit until it is applied or fails;
/// released on drop.
pub struct StateReservation<'a> {
    /// Whose reservation it is.
    node: &'a Node,
    /// Estimated bytes held.
    bytes: u64,
}

impl Drop for StateReservation<'_> {
    fn drop(&mut self) {
        self.node
            .state_reserved_bytes
            .fetch_sub(self.bytes, std::sync::atomic::Ordering::AcqRel);
    }
}

impl Node {
    /// Admits a submit that adds an estimated `bytes` to the state
    /// ([`cumulus_raft_store::state::submit_bytes`]) when the unfinished jobs' estimated
    /// size, the submits admitted and not applied yet, and `bytes` stay within
    /// `--max-state-bytes`, like Slurm's `MaxJobCount`, which refuses submits rather than
    /// grow without bound. Finished jobs do not count: `apply` drops the oldest of them to
    /// stay within [`cumulus_raft_store::state::MAX_STATE_BYTES`]. The returned reservation
    /// holds `bytes` until it is dropped (after the proposal is applied, or failed).
    /// A user who is not an administrator (`who`) may hold at most a
    /// [`STATE_SHARE_DIVISOR`]th of the budget in unfinished jobs.
    ///
    /// # Errors
    /// [`ApiError::ResourceExhausted`] naming the sizes and the limit.
    pub fn reserve_state_bytes(
        &self,
        bytes: u64,
        who: &Principal,
    ) -> Result<StateReservation<'_>, ApiError> {
        use std::sync::atomic::Ordering;
        let max = self.limits.max_state_bytes;
        let (unfinished, mine) = self.read_state(|s| {
            let index = s.job_index();
            (
                index.unfinished_bytes(),
                index.unfinished_bytes_of(&who.name),
            )
        });
        let share = max / STATE_SHARE_DIVISOR;
        if who.role != cumulus_api::Role::Admin && mine.saturating_add(bytes) > share {
            return Err(ApiError::ResourceExhausted(format!(
                "{:?}'s unfinished jobs hold ~{mine} bytes of state (estimated), and this job \
                 would add ~{bytes}: above the share of one user, {share} bytes (1/{STATE_SHARE_DIVISOR} \
                 of --max-state-bytes); retry once your jobs finish, or cancel some",
                who.name
            )));
        }
        let mut reserved = self.state_reserved_bytes.load(Ordering::Acquire);
        loop {
            let after = unfinished.saturating_add(reserved).saturating_add(bytes);
            if after > max {
                return Err(ApiError::ResourceExhausted(format!(
                    "the cluster's unfinished jobs hold ~{unfinished} bytes of state \
                     (estimated; {reserved} more being submitted), and this job would add \
                     ~{bytes}: above the {max} bytes allowed (--max-state-bytes); retry \
                     once jobs finish, or cancel some"
                )));
            }
            match self.state_reserved_bytes.compare_exchange_weak(
                reserved,
                reserved + bytes,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(StateReservation { node: self, bytes }),
                Err(now) => reserved = now,
            }
        }
    }

    /// The store where the leader verifies parts and writes manifests and LATEST for a job:
    /// the S3 target (L2) when the job has `ckpt_url` and commits at L2 (the default), else
    /// [`cumulus_ckpt::LocalStore`] on the shared `ckpt_dir` (commit tier `l1`, or no S3).
    /// `None` when the job does not checkpoint.
    ///
    /// # Errors
    /// An invalid `ckpt_url` or S3 settings (the client cannot be built).
    pub async fn ckpt_store(
        &self,
        spec: &cumulus_raft_store::state::JobSpec,
    ) -> Result<Option<Arc<dyn cumulus_ckpt::CheckpointStore>>, cumulus_ckpt::CkptError> {
        if !spec.ckpt_url.is_empty() && spec.ckpt_commit_tier != "l1" {
            let store = self.s3.store(&spec.ckpt_url).await?;
            Ok(Some(Arc::new(store)))
        } else if !spec.ckpt_dir.is_empty() {
            Ok(Some(Arc::new(cumulus_ckpt::LocalStore::new(
                &spec.ckpt_dir,
            ))))
        } else {
            Ok(None)
        }
    }

    /// Runs `f` on the applied state.
    pub fn read_state<T>(&self, f: impl FnOnce(&ClusterState) -> T) -> T {
        self.shared.read(|d| f(&d.state))
    }

    /// Locks the soft state (never held across an `.await`).
    pub fn soft(&self) -> std::sync::MutexGuard<'_, SoftState> {
        self.soft.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// True when this node currently believes it is the leader.
    pub fn is_leader(&self) -> bool {
        self.raft.metrics().borrow_watched().current_leader == Some(self.id)
    }

    /// The leader's addresses from this node's view of the membership.
    pub fn leader_node(&self) -> Option<CumulusNode> {
        leader_node(&self.raft)
    }

    /// Fails with [`ApiError::NotLeader`] unless this node is the leader.
    pub fn require_leader(&self) -> Result<(), ApiError> {
        if self.is_leader() {
            Ok(())
        } else {
            Err(ApiError::NotLeader {
                leader: self.leader_node(),
            })
        }
    }

    /// Commits `cmd` through Raft, possibly in one entry with other writes queued at the
    /// same time ([`crate::proposer`]), and returns its own response (which may be
    /// `Rejected`).
    ///
    /// # Errors
    /// `NotLeader` on a follower; `Unavailable` when Raft cannot commit now.
    pub async fn propose(&self, cmd: Command) -> Result<Response, ApiError> {
        // The control loop wakes on the applied-state change itself.
        self.proposer.propose(cmd).await
    }

    /// Like [`Node::propose`], but maps `Rejected` to `FailedPrecondition`.
    pub async fn propose_ok(&self, cmd: Command) -> Result<(), ApiError> {
        match self.propose(cmd).await? {
            Response::Rejected { reason } => Err(ApiError::FailedPrecondition(reason)),
            _ => Ok(()),
        }
    }

    /// Waits until this node's state reflects everything committed before the call, as
    /// confirmed by a quorum (openraft's read index, `ReadPolicy::ReadIndex`: no lease,
    /// so no assumption about clock drift). Only the leader can do this.
    ///
    /// # Errors
    /// `NotLeader` on a follower; `Unavailable` without a quorum.
    pub async fn linearizable_barrier(&self) -> Result<(), ApiError> {
        match self.raft.ensure_linearizable(ReadPolicy::ReadIndex).await {
            Ok(_) => Ok(()),
            Err(RaftError::APIError(LinearizableReadError::ForwardToLeader(f))) => {
                Err(ApiError::NotLeader {
                    leader: f.leader_node.clone().or_else(|| self.leader_node()),
                })
            }
            Err(e) => Err(ApiError::Unavailable(format!(
                "linearizable read failed: {e}"
            ))),
        }
    }
}
