//! The leader-only control loops: failure detector, scheduler, restart scheduler,
//! checkpoint finalizer and job completion.
//!
//! Following Nomad's scheduler, planning is a pure function ([`plan`]) from the
//! replicated state plus the leader's observations to a list of [`Action`]s; the
//! executor stamps time and jitter, does the checkpoint I/O and commits each action
//! through Raft. `apply` validates every command again, so an action planned on a
//! state that moved on is rejected harmlessly and re-planned on the next tick.
//!
//! Split along its seams: [`plan`] (pure), [`observe`] (soft state → observations),
//! [`execute`] (actions → Raft), [`ckpt_io`] (checkpoint I/O tasks); this module holds
//! the loop and its memory.

mod ckpt_io;
mod execute;
#[cfg(test)]
mod gpu_preemption_tests;
#[cfg(test)]
mod inprocess_tests;
mod observe;
mod plan;
mod straggler;
#[cfg(test)]
mod straggler_plan_tests;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::RngExt;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::node::Node;

pub use ckpt_io::*;
use execute::*;
use observe::*;
pub use plan::*;

/// How often the loop runs when nothing wakes it.
pub const TICK: Duration = Duration::from_millis(100);
/// Shortest time between two planning passes: under a burst of commits (one wake per
/// applied batch) the planner, which walks every job, runs at most this often.
pub const MIN_PASS_INTERVAL: Duration = Duration::from_millis(20);
/// A running attempt absent from this many heartbeat intervals of its worker is lost.
pub const LOST_AFTER_HEARTBEATS: u64 = 5;
/// Longest failure cause recorded, in bytes.
pub const MAX_CAUSE_BYTES: usize = 1_024;
/// Fail fast ([`plan`]'s `fail_fast_verdict`): a job whose first attempt's ranks all exit
/// non-zero within this long of their start, before any progress report, with the same
/// exit code and cause, fails at once without a restart; and the planner waits at most
/// this long after the first such exit for the other ranks to end the same way.
pub const FAIL_FAST_WINDOW_MS: u64 = 10_000;

/// The leader's memory between ticks (rebuilt on every election; dropping it aborts the
/// I/O tasks of the previous term).
#[derive(Default)]
struct LoopMemory {
    /// Steps whose parts failed verification: never finalized.
    bad_steps: HashSet<(String, u64)>,
    /// Jobs whose LATEST file is known to match the committed step.
    latest_ok: HashMap<String, u64>,
    /// Jobs committed at L1 whose L2 copy (manifest + LATEST in S3) is at this step.
    l2_mirrored: HashMap<String, u64>,
    /// Earliest next try of a job's periodic I/O (LATEST repair, L2 mirror).
    retry_at: HashMap<(String, IoKind), Instant>,
    /// Last prune of the soft progress map.
    last_progress_prune: Option<Instant>,
    /// Last pass of [`record_history`].
    last_history: Option<Instant>,
    /// Last pass of [`record_history`] that sampled the running jobs.
    last_history_sample: Option<Instant>,
    /// Checkpoint I/O runs in these tasks, off the loop, so that a slow disk or an S3
    /// outage (retried up to the store's retry deadline) never delays failure detection,
    /// placement or the other jobs. Each yields its job and what to remember.
    io_tasks: tokio::task::JoinSet<(String, IoOutcome)>,
    /// The job of every task in `io_tasks` (at most one task per job).
    io_jobs: HashMap<tokio::task::Id, String>,
    /// The straggler detector's memory of each running job it watches.
    stragglers: HashMap<String, straggler::JobMemory>,
    /// Last pass of [`detect_stragglers`].
    last_straggler_pass: Option<Instant>,
}

impl LoopMemory {
    /// True when `job_id` has an I/O task in flight.
    fn io_busy(&self, job_id: &str) -> bool {
        self.io_jobs.values().any(|j| j == job_id)
    }

    /// Runs `io` for `job_id` in a task unless the job already has one or
    /// [`MAX_IO_TASKS`] are in flight (the action is planned again on a later pass).
    fn spawn_io<F>(&mut self, job_id: &str, io: F)
    where
        F: std::future::Future<Output = IoOutcome> + Send + 'static,
    {
        if self.io_jobs.len() >= MAX_IO_TASKS || self.io_busy(job_id) {
            return;
        }
        let job = job_id.to_string();
        let handle = self.io_tasks.spawn(async move { (job, io.await) });
        self.io_jobs.insert(handle.id(), job_id.to_string());
    }

    /// Collects the finished I/O tasks and remembers their outcomes.
    fn reap_io(&mut self) {
        while let Some(done) = self.io_tasks.try_join_next_with_id() {
            match done {
                Ok((id, (job_id, outcome))) => {
                    self.io_jobs.remove(&id);
                    match outcome {
                        IoOutcome::Done => {}
                        IoOutcome::BadStep(step) => {
                            self.bad_steps.insert((job_id, step));
                        }
                        IoOutcome::LatestOk(step) => {
                            self.latest_ok.insert(job_id, step);
                        }
                        IoOutcome::MirroredToL2(step) => {
                            self.l2_mirrored.insert(job_id, step);
                        }
                    }
                }
                Err(e) => {
                    if let Some(job_id) = self.io_jobs.remove(&e.id()) {
                        warn!(job = %job_id, error = %e, "checkpoint I/O task failed");
                    }
                }
            }
        }
    }

    /// True (and the next try scheduled) when `job_id`'s `kind` I/O may run now.
    fn due(&mut self, job_id: &str, kind: IoKind) -> bool {
        let now = Instant::now();
        let key = (job_id.to_string(), kind);
        if self.retry_at.get(&key).is_some_and(|at| *at > now) {
            return false;
        }
        self.retry_at.insert(key, now + IO_RETRY_INTERVAL);
        true
    }
}

/// Runs the control loop until `cancel`; acts only while this node is the leader.
pub async fn run(node: Arc<Node>, cancel: CancellationToken) {
    let mut changes = node.shared.changes.subscribe();
    let mut memory = LoopMemory::default();
    let mut last_pass = Instant::now();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(TICK) => {}
            _ = changes.changed() => {}
        }
        // Coalesce bursts of wakes: the pass below sees every change made meanwhile.
        let since = last_pass.elapsed();
        if since < MIN_PASS_INTERVAL {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(MIN_PASS_INTERVAL - since) => {}
            }
        }
        changes.borrow_and_update();
        last_pass = Instant::now();
        if !node.is_leader() {
            node.soft().leader_term = None;
            memory = LoopMemory::default();
            continue;
        }
        memory.reap_io();
        let mut obs = observe(&node);
        detect_stragglers(&node, &mut memory, &mut obs);
        let actions = {
            let mut rng = rand::rng();
            let mut jitter = || rng.random_range(-1.0..=1.0);
            node.read_state(|s| plan(s, &obs, node.limits.heartbeat_timeout_ms, &mut jitter))
        };
        let mut planned = Vec::new();
        for action in actions {
            if cancel.is_cancelled() || !node.is_leader() {
                break;
            }
            planned.extend(execute(&node, action, &mut memory));
        }
        if !planned.is_empty() && !cancel.is_cancelled() && node.is_leader() {
            commit_batch(&node, planned).await;
        }
        ensure_latest(&node, &mut memory);
        mirror_to_l2(&node, &mut memory);
        if let Some(cmd) = record_history(&node, &mut memory)
            && !cancel.is_cancelled()
            && node.is_leader()
        {
            commit_planned(&node, cmd, "RecordProgress").await;
        }
        prune_progress(&node, &mut memory);
    }
}
