//! The leader's soft state: what it learns from heartbeats and progress reports, kept in
//! memory only and rebuilt after an election (docs/architecture.md, "The replicated
//! state": not in the Raft log), and the leader's clock that stamps commands. Only the
//! jobs' downsampled progress histories leave it, through `Command::RecordProgress`.

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
    /// When `step` last changed, or the attempt made its first report (or was first
    /// observed).
    pub changed_at: Instant,
    /// When the leader first saw that the attempt had made a progress report (`None`:
    /// not yet): its progress timeout counts from there, its startup timeout before.
    pub first_report_at: Option<Instant>,
    /// When the attempt was last seen in its worker's heartbeat.
    pub seen_at: Instant,
    /// The metrics of its latest report (bounded by the heartbeat's checks).
    pub metrics: std::collections::BTreeMap<String, f64>,
    /// Steps per second, an exponentially weighted mean of the rate between the
    /// reports that advanced `step` (0: not yet known).
    pub steps_per_s: f64,
    /// The rank listens for in-process restarts (`ObservedRank.in_process`).
    pub in_process: bool,
}

/// Weight of the newest rate in [`ProgressSoft::steps_per_s`].
pub const RATE_SMOOTHING: f64 = 0.3;

impl ProgressSoft {
    /// Takes the agent's word at `at` that the attempt has made a progress report
    /// (`reported`): the first time, the progress clock starts (`changed_at`).
    pub fn mark_reported(&mut self, at: Instant, reported: bool) {
        if reported && self.first_report_at.is_none() {
            self.first_report_at = Some(at);
            self.changed_at = at;
        }
    }

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
            first_report_at: None,
            metrics: std::collections::BTreeMap::new(),
            steps_per_s: 0.0,
            in_process: false,
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
    /// When this node last started acting as leader: no attempt's startup clock runs
    /// from before it (a new leader has seen no first report yet).
    pub leader_since: Option<Instant>,
    /// The newest progress per job id (bounded: [`MAX_HISTORY_JOBS`]).
    pub history: HashMap<String, JobHistory>,
}

/// Most jobs whose latest progress the leader keeps after they stop running (beyond
/// it, those not running that were seen longest ago are dropped first).
pub const MAX_HISTORY_JOBS: usize = 1_024;

/// The job's progress at one moment: its slowest rank's step, total and rate, and the
/// metrics of the lowest rank that reported any.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobProgress {
    /// Step of the slowest rank.
    pub step: u64,
    /// Total steps (the largest any rank reported; 0: unknown).
    pub total_steps: u64,
    /// The slowest rank's smoothed rate, in steps per second (0: unknown).
    pub steps_per_s: f64,
    /// Metrics of the lowest rank that reported any.
    pub metrics: std::collections::BTreeMap<String, f64>,
}

impl JobProgress {
    /// Milliseconds left to `total_steps` at `steps_per_s` (0: unknown).
    pub fn eta_ms(&self) -> u64 {
        if self.steps_per_s <= 0.0 || self.total_steps <= self.step {
            return 0;
        }
        ((self.total_steps - self.step) as f64 / self.steps_per_s * 1000.0) as u64
    }
}

/// The progress of a job whose current attempts are `attempts` (rank order), from the
/// soft progress map; `None` when none of them has reported.
pub fn job_progress<'a>(
    attempts: impl IntoIterator<Item = &'a AttemptKey>,
    progress: &HashMap<AttemptKey, ProgressSoft>,
) -> Option<JobProgress> {
    let mut out: Option<JobProgress> = None;
    for key in attempts {
        let Some(p) = progress.get(key) else {
            continue;
        };
        let out = out.get_or_insert_with(|| JobProgress {
            step: u64::MAX,
            ..JobProgress::default()
        });
        if p.step < out.step {
            out.step = p.step;
            out.steps_per_s = p.steps_per_s;
        }
        out.total_steps = out.total_steps.max(p.total_steps);
        if out.metrics.is_empty() {
            out.metrics = p.metrics.clone();
        }
    }
    out
}

/// The newest progress the leader saw of a job while it ran (soft state: lost on a
/// leader change). The samples over time are replicated: the state's
/// `ProgressHistory`, fed by `Command::RecordProgress` (`control::observe`).
#[derive(Clone, Debug)]
pub struct JobHistory {
    /// The newest progress seen (kept after the job stops running).
    pub latest: JobProgress,
    /// When it was seen.
    pub seen_at: Instant,
}

/// Upper bound on soft progress entries (stale ones are pruned by the control loop).
pub const MAX_PROGRESS_ENTRIES: usize = 1_000_000;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eta_is_the_steps_left_at_the_rate() {
        let p = JobProgress {
            step: 100,
            total_steps: 400,
            steps_per_s: 50.0,
            metrics: Default::default(),
        };
        assert_eq!(p.eta_ms(), 6_000);
        assert_eq!(JobProgress::default().eta_ms(), 0);
    }
}
