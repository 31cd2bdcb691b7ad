//! [`JobIndex`]: the indexes derived from the jobs that let the planner and the eviction
//! visit only what can change.

use std::collections::{BTreeSet, HashMap};

use super::*;

/// Job ids by lifecycle class, in id order (which is submission order: ids are
/// zero-padded sequence numbers). Derived from [`ClusterState::jobs`]: it lets the
/// leader's planner visit only the jobs that can change (pending ones only while there
/// is capacity) and the bounded-state eviction find the oldest terminal jobs without a
/// scan of every retained job, which cost O(jobs) per submit and per planner pass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobIndex {
    /// Pending jobs (waiting for a placement).
    pub pending: BTreeSet<String>,
    /// Pending jobs in queue order: highest priority first, then submission order, as
    /// `(-priority, id)`.
    pub queue: BTreeSet<(i32, String)>,
    /// Running jobs (placed).
    pub running: BTreeSet<String>,
    /// Paused jobs (neither placed nor queued; never evicted).
    pub paused: BTreeSet<String>,
    /// Succeeded, failed or cancelled jobs.
    pub terminal: BTreeSet<String>,
    /// Jobs started from another job's step ([`Job::fork`]), whatever their state.
    pub forks: BTreeSet<String>,
    /// The placed ranks of running jobs by worker: worker id → `(job id, rank)`, in job
    /// and rank order. A worker's desired set is built from it in O(its ranks), not
    /// O(running jobs) (every heartbeat and `WatchDesired` reply builds one).
    placed: HashMap<String, BTreeSet<(String, u32)>>,
    /// Each running job's entries in `placed`, to take them out when it changes.
    job_placements: HashMap<String, Vec<(String, u32)>>,
    /// Each job's estimated encoded size ([`Job::approx_encoded_bytes`]), as of the last
    /// command that touched it.
    bytes: HashMap<String, JobBytes>,
    /// Sum of `bytes`, in bytes.
    total_bytes: u64,
    /// Sum of `bytes` over terminal jobs, in bytes.
    terminal_bytes: u64,
    /// Sum of `bytes` over each owner's unfinished (not terminal) jobs, in bytes; owners
    /// with none are absent.
    unfinished_by_owner: HashMap<String, u64>,
    /// The owner of each unfinished job, to take its bytes off when it finishes or goes.
    unfinished_owner: HashMap<String, String>,
}

/// One job's estimated encoded size, in bytes, and its queue priority (both fixed at
/// submit but the dynamic size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct JobBytes {
    /// The spec's priority.
    priority: i32,
    /// [`Job::approx_static_bytes`], computed once: it cannot change.
    fixed: u64,
    /// Fixed plus [`Job::approx_dynamic_bytes`].
    total: u64,
    /// Whether the job was unfinished (so counted in its owner's
    /// [`JobIndex::unfinished_bytes_of`]) when last indexed.
    unfinished: bool,
}

impl JobIndex {
    /// Files `job_id` under the class of its state and records its estimated size
    /// (`None`: the job is gone).
    pub(super) fn update(&mut self, job_id: &str, job: Option<&Job>) {
        if self.pending.remove(job_id)
            && let Some(old) = self.bytes.get(job_id)
        {
            self.queue.remove(&(-old.priority, job_id.to_string()));
        }
        self.running.remove(job_id);
        self.paused.remove(job_id);
        let was_terminal = self.terminal.remove(job_id);
        self.forks.remove(job_id);
        for (worker, rank) in self.job_placements.remove(job_id).unwrap_or_default() {
            if let Some(set) = self.placed.get_mut(&worker) {
                set.remove(&(job_id.to_string(), rank));
                if set.is_empty() {
                    self.placed.remove(&worker);
                }
            }
        }
        let old = self.bytes.get(job_id).copied();
        if let Some(old) = old {
            self.total_bytes -= old.total;
            if was_terminal {
                self.terminal_bytes -= old.total;
            }
        }
        // Bytes this job counted in its owner's unfinished bytes until now.
        let was_unfinished = old.filter(|o| o.unfinished).map_or(0, |o| o.total);
        let Some(job) = job else {
            self.bytes.remove(job_id);
            if let Some(owner) = self.unfinished_owner.remove(job_id) {
                self.shift_owner_bytes(&owner, was_unfinished, 0);
            }
            return;
        };
        let fixed = old.map_or_else(|| job.approx_static_bytes(), |o| o.fixed);
        let total = fixed + job.approx_dynamic_bytes();
        let priority = job.spec.priority;
        let unfinished = !job.state.is_terminal();
        self.bytes.insert(
            job_id.to_string(),
            JobBytes {
                priority,
                fixed,
                total,
                unfinished,
            },
        );
        // The owner never changes: only a change of size or of class touches the maps.
        self.shift_owner_bytes(
            &job.owner,
            was_unfinished,
            if unfinished { total } else { 0 },
        );
        match (old.is_some_and(|o| o.unfinished), unfinished) {
            (false, true) => {
                self.unfinished_owner
                    .insert(job_id.to_string(), job.owner.clone());
            }
            (true, false) => {
                self.unfinished_owner.remove(job_id);
            }
            _ => {}
        }
        self.total_bytes += total;
        if job.fork.is_some() {
            self.forks.insert(job_id.to_string());
        }
        if job.state == JobState::Running {
            let placements: Vec<(String, u32)> = job
                .ranks
                .iter()
                .filter_map(|r| r.worker_id.as_ref().map(|w| (w.clone(), r.rank)))
                .collect();
            for (worker, rank) in &placements {
                self.placed
                    .entry(worker.clone())
                    .or_default()
                    .insert((job_id.to_string(), *rank));
            }
            if !placements.is_empty() {
                self.job_placements.insert(job_id.to_string(), placements);
            }
        }
        if job.state == JobState::Pending {
            self.queue.insert((-priority, job_id.to_string()));
        }
        let class = match job.state {
            JobState::Pending => &mut self.pending,
            JobState::Running => &mut self.running,
            JobState::Paused => &mut self.paused,
            JobState::Succeeded | JobState::Failed | JobState::Cancelled | JobState::TimedOut => {
                self.terminal_bytes += total;
                &mut self.terminal
            }
        };
        class.insert(job_id.to_string());
    }

    /// True when `job_id` is indexed under another class than `state`'s (its state
    /// changed since the index last saw it); false for a job not indexed yet.
    pub(super) fn class_changed(&self, job_id: &str, state: JobState) -> bool {
        let class = match state {
            JobState::Pending => &self.pending,
            JobState::Running => &self.running,
            JobState::Paused => &self.paused,
            JobState::Succeeded | JobState::Failed | JobState::Cancelled | JobState::TimedOut => {
                &self.terminal
            }
        };
        self.bytes.contains_key(job_id) && !class.contains(job_id)
    }

    /// The `(job id, rank)` of every placed rank of a running job on `worker_id`, in job
    /// and rank order.
    pub fn placed_on(&self, worker_id: &str) -> impl Iterator<Item = &(String, u32)> {
        self.placed.get(worker_id).into_iter().flatten()
    }

    /// Estimated encoded size of every job, in bytes.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Estimated encoded size of the pending, running and paused jobs, in bytes.
    pub fn unfinished_bytes(&self) -> u64 {
        self.total_bytes - self.terminal_bytes
    }

    /// Estimated encoded size of `owner`'s pending, running and paused jobs, in bytes.
    pub fn unfinished_bytes_of(&self, owner: &str) -> u64 {
        self.unfinished_by_owner.get(owner).copied().unwrap_or(0)
    }

    /// Replaces `was` bytes of `owner`'s unfinished bytes with `now`, dropping the owner
    /// at zero (no allocation unless the owner is new).
    fn shift_owner_bytes(&mut self, owner: &str, was: u64, now: u64) {
        if was == now {
            return;
        }
        match self.unfinished_by_owner.get_mut(owner) {
            Some(held) => {
                *held = held.saturating_sub(was).saturating_add(now);
                if *held == 0 {
                    self.unfinished_by_owner.remove(owner);
                }
            }
            None if now > 0 => {
                self.unfinished_by_owner.insert(owner.to_string(), now);
            }
            None => {}
        }
    }

    /// Estimated encoded size of `job_id` (0 for an unknown job), in bytes.
    pub fn job_bytes(&self, job_id: &str) -> u64 {
        self.bytes.get(job_id).map_or(0, |b| b.total)
    }
}
