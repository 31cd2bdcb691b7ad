//! The leader's soft state: what it learns from heartbeats and progress reports, kept in
//! memory only and rebuilt after an election (docs/architecture.md, "The replicated
//! state": not in the Raft log), and the leader's clock that stamps commands.

use std::collections::HashMap;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use cumulus_api::{AttemptKey, v1};

/// Milliseconds since the Unix epoch, from the system clock. Only the leader reads it,
/// to stamp commands; `apply` never does.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What the leader knows of a worker from its heartbeats (not replicated).
#[derive(Clone, Debug)]
pub struct WorkerSoft {
    /// When the last heartbeat (or registration, or the leader's grace) was seen.
    pub last_seen: Instant,
    /// Rank attempts the agent reported running in its last heartbeat.
    pub observed: Vec<v1::ObservedRank>,
    /// Resources in its last heartbeat.
    pub resources: v1::Resources,
}

/// Progress of one rank attempt as seen by the leader.
#[derive(Clone, Debug)]
pub struct ProgressSoft {
    /// Latest reported step.
    pub step: u64,
    /// Latest reported total steps.
    pub total_steps: u64,
    /// When `step` last changed (or the attempt was first observed).
    pub changed_at: Instant,
    /// When the attempt was last seen in its worker's heartbeat.
    pub seen_at: Instant,
}

impl ProgressSoft {
    /// An attempt first observed at `now` at `step` of `total_steps`.
    pub fn observed_at(now: Instant, step: u64, total_steps: u64) -> Self {
        Self {
            step,
            total_steps,
            changed_at: now,
            seen_at: now,
        }
    }
}

/// The leader's soft state: rebuilt from heartbeats after an election, never in Raft.
#[derive(Debug, Default)]
pub struct SoftState {
    /// Per worker id.
    pub workers: HashMap<String, WorkerSoft>,
    /// Per rank attempt.
    pub progress: HashMap<AttemptKey, ProgressSoft>,
    /// Term in which this node last started acting as leader (grace is granted then).
    pub leader_term: Option<u64>,
}

/// Upper bound on soft progress entries (stale ones are pruned by the control loop).
pub const MAX_PROGRESS_ENTRIES: usize = 1_000_000;
