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
    /// The metrics of its latest report (bounded by the heartbeat's checks).
    pub metrics: std::collections::BTreeMap<String, f64>,
    /// Steps per second, an exponentially weighted mean of the rate between the
    /// reports that advanced `step` (0: not yet known).
    pub steps_per_s: f64,
}

/// Weight of the newest rate in [`ProgressSoft::steps_per_s`].
pub const RATE_SMOOTHING: f64 = 0.3;

impl ProgressSoft {
    /// Takes a report of `step` seen at `at`: updates the rate when the step advanced.
    pub fn advance(&mut self, at: Instant, step: u64) {
        if step > self.step {
            let secs = at.duration_since(self.changed_at).as_secs_f64();
            if secs > 0.0 && self.step > 0 {
                let rate = (step - self.step) as f64 / secs;
                self.steps_per_s = if self.steps_per_s > 0.0 {
                    RATE_SMOOTHING * rate + (1.0 - RATE_SMOOTHING) * self.steps_per_s
                } else {
                    rate
                };
            }
        }
        if step != self.step {
            self.changed_at = at;
        }
        self.step = step;
    }

    /// Milliseconds left to `total_steps` at the current rate (0: unknown).
    pub fn eta_ms(&self) -> u64 {
        if self.steps_per_s <= 0.0 || self.total_steps <= self.step {
            return 0;
        }
        ((self.total_steps - self.step) as f64 / self.steps_per_s * 1000.0) as u64
    }
}

impl ProgressSoft {
    /// An attempt first observed at `now` at `step` of `total_steps`.
    pub fn observed_at(now: Instant, step: u64, total_steps: u64) -> Self {
        Self {
            step,
            total_steps,
            changed_at: now,
            seen_at: now,
            metrics: std::collections::BTreeMap::new(),
            steps_per_s: 0.0,
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
