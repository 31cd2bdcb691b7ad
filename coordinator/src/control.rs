//! The leader-only control loops: failure detector, scheduler, restart scheduler,
//! checkpoint finalizer and job completion.
//!
//! Following Nomad's scheduler, planning is a pure function ([`plan`]) from the
//! replicated state plus the leader's observations to a list of [`Action`]s; the
//! executor stamps time and jitter, does the checkpoint I/O and commits each action
//! through Raft. `apply` validates every command again, so an action planned on a
//! state that moved on is rejected harmlessly and re-planned on the next tick.

use openraft::async_runtime::watch::WatchReceiver;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cumulus_ckpt::{Manifest, PartRecord};
use cumulus_raft_store::Command;
use cumulus_raft_store::state::{
    ClusterState, Job, JobState, MAX_AGENT_FAULT_RESTARTS, PartInfo, RankState, RestartScope,
    WorkerState,
};
use rand::RngExt;
use shard_planner::WorkerSlots;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::node::Node;
use crate::soft::now_ms;
use cumulus_api::AttemptKey;

/// How often the loop runs when nothing wakes it.
pub const TICK: Duration = Duration::from_millis(100);
/// Shortest time between two planning passes: under a burst of commits (one wake per
/// applied batch) the planner, which walks every job, runs at most this often.
pub const MIN_PASS_INTERVAL: Duration = Duration::from_millis(20);
/// A running attempt absent from this many heartbeat intervals of its worker is lost.
pub const LOST_AFTER_HEARTBEATS: u64 = 5;
/// Longest failure cause recorded, in bytes.
pub const MAX_CAUSE_BYTES: usize = 1_024;

/// What the leader observed outside the replicated state (soft state), in the units
/// the planner needs.
#[derive(Debug, Default, Clone)]
pub struct Observations {
    /// Milliseconds since the last heartbeat of each worker the leader tracks.
    pub worker_silence_ms: HashMap<String, u64>,
    /// Milliseconds since each observed attempt's reported step last changed.
    pub progress_stall_ms: HashMap<AttemptKey, u64>,
    /// Running attempts their worker stopped reporting (lost by the agent).
    pub lost: HashSet<AttemptKey>,
}

/// One decision of the planner.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Expire a silent worker (its ranks fail).
    ExpireWorker {
        /// Worker.
        worker_id: String,
    },
    /// Declare a running attempt failed.
    FailRank {
        /// Job.
        job_id: String,
        /// Rank.
        rank: u32,
        /// Attempt.
        attempt: u32,
        /// Why.
        cause: String,
    },
    /// Gang-place a pending job.
    Place {
        /// Job.
        job_id: String,
        /// `(rank, worker)` for every rank.
        placements: Vec<(u32, String)>,
    },
    /// Restart failed ranks (or the group) after a delay.
    Restart {
        /// Job.
        job_id: String,
        /// `(rank, worker)` of every restarted rank.
        placements: Vec<(u32, String)>,
        /// Leader time of the failure.
        failed_at_ms: u64,
        /// Jittered delay.
        delay_ms: u64,
        /// Cause.
        cause: String,
        /// Every failed rank failed for an agent resource error: no budget is spent.
        agent_fault: bool,
    },
    /// Fail the job (budget exhausted).
    FailJob {
        /// Job.
        job_id: String,
        /// Cause.
        cause: String,
    },
    /// Every rank exited 0.
    Succeed {
        /// Job.
        job_id: String,
    },
    /// Every rank's part of `step` arrived: verify, write the manifest, commit.
    Finalize {
        /// Job.
        job_id: String,
        /// Step.
        step: u64,
    },
}

fn truncate(mut s: String) -> String {
    if s.len() > MAX_CAUSE_BYTES {
        let mut cut = MAX_CAUSE_BYTES;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

/// Plans the leader's next actions. Pure: the same inputs give the same plan;
/// `jitter` yields the random units in [−1, 1] the restart delays need.
pub fn plan(
    state: &ClusterState,
    obs: &Observations,
    heartbeat_timeout_ms: u64,
    jitter: &mut dyn FnMut() -> f64,
) -> Vec<Action> {
    let mut actions = Vec::new();
    let mut expiring: BTreeSet<&str> = BTreeSet::new();
    for w in state.workers.values() {
        if w.state != WorkerState::Alive {
            continue;
        }
        if obs
            .worker_silence_ms
            .get(&w.worker_id)
            .is_some_and(|s| *s > heartbeat_timeout_ms)
        {
            expiring.insert(&w.worker_id);
            actions.push(Action::ExpireWorker {
                worker_id: w.worker_id.clone(),
            });
        }
    }

    let alive = |id: &str| {
        !expiring.contains(id)
            && state
                .workers
                .get(id)
                .is_some_and(|w| w.state == WorkerState::Alive)
    };
    let mut used = state.slots_used(None);
    let mut free_slots = |used: &BTreeMap<String, u32>| -> Vec<WorkerSlots> {
        state
            .workers
            .values()
            .filter(|w| alive(&w.worker_id))
            .map(|w| WorkerSlots {
                worker_id: w.worker_id.clone(),
                free_slots: w
                    .slots
                    .saturating_sub(used.get(&w.worker_id).copied().unwrap_or(0)),
            })
            .collect()
    };

    // An upper bound on the free slots left: placements below only lower it (restarts
    // in `plan_running` may use slots it still counts, which costs an exact check, never
    // a wrong plan). Most pending jobs wait for capacity that is not there, and this
    // turns each of them into one comparison instead of a walk over every worker.
    let mut free_upper_bound: u64 = free_slots(&used)
        .iter()
        .map(|w| u64::from(w.free_slots))
        .sum();
    // Running jobs always; pending ones only when some capacity may be free (it only
    // shrinks during a pass). Both in id order, which is submission order.
    let index = state.job_index();
    let no_pending = BTreeSet::new();
    let pending = if free_upper_bound > 0 {
        &index.pending
    } else {
        &no_pending
    };
    for job in index
        .running
        .union(pending)
        .filter_map(|id| state.jobs.get(id))
    {
        match job.state {
            JobState::Pending => {
                if free_upper_bound < u64::from(job.spec.world_size) {
                    continue;
                }
                let ranks: Vec<u32> = (0..job.spec.world_size).collect();
                if let Ok(Some(placements)) = shard_planner::place_ranks(&ranks, &free_slots(&used))
                {
                    free_upper_bound -= placements.len() as u64;
                    for (_, w) in &placements {
                        *used.entry(w.clone()).or_insert(0) += 1;
                    }
                    actions.push(Action::Place {
                        job_id: job.id.clone(),
                        placements,
                    });
                }
            }
            JobState::Running => plan_running(
                job,
                obs,
                &mut used,
                &mut free_slots,
                &alive,
                jitter,
                &mut actions,
            ),
            _ => {}
        }
    }
    actions
}

#[allow(clippy::too_many_arguments)]
fn plan_running(
    job: &Job,
    obs: &Observations,
    used: &mut BTreeMap<String, u32>,
    free_slots: &mut dyn FnMut(&BTreeMap<String, u32>) -> Vec<WorkerSlots>,
    alive: &dyn Fn(&str) -> bool,
    jitter: &mut dyn FnMut() -> f64,
    actions: &mut Vec<Action>,
) {
    // Failure detection on running attempts.
    let mut newly_failed = false;
    for r in &job.ranks {
        if !matches!(r.state, RankState::Running | RankState::Pending) {
            continue;
        }
        let key = AttemptKey::new(job.id.clone(), r.rank, r.attempt);
        let cause = if obs.lost.contains(&key) {
            Some(if r.state == RankState::Pending {
                "lost: its worker neither prepares nor runs it".to_string()
            } else {
                "lost: its worker no longer reports the process".to_string()
            })
        } else if r.state != RankState::Running {
            None
        } else if job.spec.progress_timeout_ms > 0
            && obs
                .progress_stall_ms
                .get(&key)
                .is_some_and(|s| *s > job.spec.progress_timeout_ms)
        {
            Some(format!(
                "hung: no progress for more than {} ms",
                job.spec.progress_timeout_ms
            ))
        } else {
            None
        };
        if let Some(cause) = cause {
            newly_failed = true;
            actions.push(Action::FailRank {
                job_id: job.id.clone(),
                rank: r.rank,
                attempt: r.attempt,
                cause,
            });
        }
    }
    if newly_failed {
        return; // re-plan once the failures are committed
    }

    let failed: Vec<_> = job
        .ranks
        .iter()
        .filter(|r| r.state == RankState::Failed)
        .collect();
    if failed.is_empty() {
        if job.all_ranks_succeeded() {
            actions.push(Action::Succeed {
                job_id: job.id.clone(),
            });
        } else if let Some((step, _)) = job
            .pending_parts
            .iter()
            .rev()
            .find(|(_, parts)| parts.len() == job.spec.world_size as usize)
        {
            actions.push(Action::Finalize {
                job_id: job.id.clone(),
                step: *step,
            });
        }
        return;
    }
    let causes = truncate(
        failed
            .iter()
            .filter_map(|r| r.failure.clone())
            .collect::<Vec<_>>()
            .join("; "),
    );
    let policy = &job.spec.restart;
    // Attempts the agent could not start for its own lack of a resource are not the
    // ranks' failures: their restart spends no budget (a bounded number of them).
    let agent_fault =
        failed.iter().all(|r| r.agent_fault) && job.agent_fault_restarts < MAX_AGENT_FAULT_RESTARTS;
    if !agent_fault && job.restarts_used >= policy.max_restarts {
        actions.push(Action::FailJob {
            job_id: job.id.clone(),
            cause: truncate(format!(
                "restart budget of {} exhausted; last failure: {causes}",
                policy.max_restarts
            )),
        });
        return;
    }
    let to_restart: Vec<u32> = match policy.scope {
        RestartScope::Group => job.ranks.iter().map(|r| r.rank).collect(),
        RestartScope::Rank => failed.iter().map(|r| r.rank).collect(),
    };
    // Keep each restarted rank on its worker when that worker is alive (and could start
    // it); re-place the rest.
    let faulty: BTreeSet<&str> = failed
        .iter()
        .filter(|r| r.agent_fault)
        .filter_map(|r| r.worker_id.as_deref())
        .collect();
    let mut placements = Vec::new();
    let mut homeless = Vec::new();
    let restarting: BTreeSet<u32> = to_restart.iter().copied().collect();
    for r in job.ranks.iter().filter(|r| restarting.contains(&r.rank)) {
        match &r.worker_id {
            Some(w) if alive(w) && !faulty.contains(w.as_str()) => {
                placements.push((r.rank, w.clone()))
            }
            _ => homeless.push(r.rank),
        }
    }
    if !homeless.is_empty() {
        // Free the slots of the ranks being restarted before placing the homeless ones.
        let mut used_without = used.clone();
        for r in job.ranks.iter().filter(|r| restarting.contains(&r.rank)) {
            if let (Some(w), RankState::Pending | RankState::Running) = (&r.worker_id, r.state)
                && let Some(n) = used_without.get_mut(w)
            {
                *n = n.saturating_sub(1);
            }
        }
        for (_, w) in &placements {
            *used_without.entry(w.clone()).or_insert(0) += 1;
        }
        // Away from a worker that could not start its ranks, when others have room;
        // back on it otherwise (its trouble may have passed).
        let mut elsewhere = free_slots(&used_without);
        elsewhere.retain(|w| !faulty.contains(w.worker_id.as_str()));
        let placed = match shard_planner::place_ranks(&homeless, &elsewhere) {
            Ok(Some(more)) => Some(more),
            _ => match shard_planner::place_ranks(&homeless, &free_slots(&used_without)) {
                Ok(Some(more)) => Some(more),
                _ => None,
            },
        };
        match placed {
            Some(more) => placements.extend(more),
            None => return, // wait for capacity
        }
        placements.sort();
    }
    for (_, w) in &placements {
        *used.entry(w.clone()).or_insert(0) += 1;
    }
    let number = if agent_fault {
        job.agent_fault_restarts + 1
    } else {
        job.restarts_used + 1
    };
    let failed_at_ms = failed.iter().map(|r| r.exited_at_ms).max().unwrap_or(0);
    actions.push(Action::Restart {
        job_id: job.id.clone(),
        placements,
        failed_at_ms,
        delay_ms: policy.jittered_delay_ms(number, jitter()),
        cause: causes,
        agent_fault,
    });
}

/// Most checkpoint I/O tasks (finalize, the resume-step choice of a restart, LATEST
/// repair, the L2 mirror of an L1-committed step) in flight at once; at most one per job.
pub const MAX_IO_TASKS: usize = 32;
/// Shortest time between two LATEST repairs or L2 mirror checks of one job.
pub const IO_RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// What a finished checkpoint I/O task tells the loop to remember.
#[derive(Debug)]
enum IoOutcome {
    /// Nothing to remember.
    Done,
    /// The step's parts failed verification (a permanent error): never finalize it.
    BadStep(u64),
    /// LATEST of the commit tier names this committed step.
    LatestOk(u64),
    /// The L2 (S3) copy of a job committed at L1 holds this step's manifest and LATEST.
    MirroredToL2(u64),
}

/// Which kind of periodic I/O a retry time belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum IoKind {
    /// [`ensure_latest`].
    Latest,
    /// [`mirror_to_l2`].
    Mirror,
}

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
    /// Checkpoint I/O runs in these tasks, off the loop, so that a slow disk or an S3
    /// outage (retried up to the store's retry deadline) never delays failure detection,
    /// placement or the other jobs. Each yields its job and what to remember.
    io_tasks: tokio::task::JoinSet<(String, IoOutcome)>,
    /// The job of every task in `io_tasks` (at most one task per job).
    io_jobs: HashMap<tokio::task::Id, String>,
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
        let obs = observe(&node);
        let actions = {
            let mut rng = rand::rng();
            let mut jitter = || rng.random_range(-1.0..=1.0);
            node.read_state(|s| plan(s, &obs, node.limits.heartbeat_timeout_ms, &mut jitter))
        };
        for action in actions {
            if cancel.is_cancelled() || !node.is_leader() {
                break;
            }
            execute(&node, action, &mut memory).await;
        }
        ensure_latest(&node, &mut memory);
        mirror_to_l2(&node, &mut memory);
        prune_progress(&node, &mut memory);
    }
}

/// Builds the planner's observations from the soft state; on the first tick of a new
/// term, grants every worker a full heartbeat timeout of grace (as Nomad does).
fn observe(node: &Node) -> Observations {
    let term = node.raft.metrics().borrow_watched().current_term;
    let now = Instant::now();
    let now_wall = now_ms();
    // Running and pending (placed) attempts: (key, worker, started_at_ms, pending
    // not_before_ms or None when running).
    #[allow(clippy::type_complexity)]
    let (workers, running): (Vec<String>, Vec<(AttemptKey, String, u64, Option<u64>)>) = node
        .read_state(|s| {
            let workers = s
                .workers
                .values()
                .filter(|w| w.state == WorkerState::Alive)
                .map(|w| w.worker_id.clone())
                .collect();
            let running = s
                .job_index()
                .running
                .iter()
                .filter_map(|id| s.jobs.get(id))
                .filter(|j| j.state == JobState::Running)
                .flat_map(|j| {
                    j.ranks
                        .iter()
                        .filter(|r| matches!(r.state, RankState::Running | RankState::Pending))
                        .filter_map(|r| {
                            let pending =
                                (r.state == RankState::Pending).then_some(r.not_before_ms);
                            r.worker_id.clone().map(|w| {
                                (
                                    AttemptKey::new(j.id.clone(), r.rank, r.attempt),
                                    w,
                                    r.started_at_ms,
                                    pending,
                                )
                            })
                        })
                })
                .collect();
            (workers, running)
        });
    let mut soft = node.soft();
    if soft.leader_term != Some(term) {
        info!(
            term,
            "acting as leader: every worker gets one heartbeat timeout of grace"
        );
        soft.leader_term = Some(term);
        for w in &workers {
            soft.workers.insert(
                w.clone(),
                crate::soft::WorkerSoft {
                    last_seen: now,
                    observed: Vec::new(),
                    resources: Default::default(),
                },
            );
        }
        for p in soft.progress.values_mut() {
            p.changed_at = now;
            p.seen_at = now;
        }
        // A new leader has seen no heartbeat yet: a running attempt counts as seen now,
        // not at its start (else every attempt older than the lost threshold would be
        // declared lost on the first tick, and a failover would restart every job).
        for (key, _, _, _) in &running {
            soft.progress
                .entry(key.clone())
                .or_insert(crate::soft::ProgressSoft::observed_at(now, 0, 0));
        }
    }
    let mut obs = Observations::default();
    for w in &workers {
        let silence = soft
            .workers
            .get(w)
            .map_or(0, |s| now.duration_since(s.last_seen).as_millis() as u64);
        obs.worker_silence_ms.insert(w.clone(), silence);
    }
    let lost_after_ms = LOST_AFTER_HEARTBEATS * node.limits.heartbeat_interval_ms;
    for (key, worker, started_at_ms, pending) in running {
        // Only a worker that is heartbeating can tell that it no longer has the attempt.
        let worker_reporting = soft.workers.get(&worker).is_some_and(|w| {
            now.duration_since(w.last_seen).as_millis()
                < u128::from(node.limits.heartbeat_interval_ms) * 2
        });
        let unseen_ms = if let Some(not_before_ms) = pending {
            // A placed attempt: the clock starts when this leader first sees it pending (its
            // worker reports it, pid 0, from the moment it starts preparing it), and not
            // before its backoff ends. One that its reporting worker neither prepares nor
            // runs past the lost threshold was lost on the way (a dropped desired set or
            // start report) and would otherwise stay pending for ever.
            let p = soft
                .progress
                .entry(key.clone())
                .or_insert(crate::soft::ProgressSoft::observed_at(now, 0, 0));
            (now.duration_since(p.seen_at).as_millis() as u64)
                .min(now_wall.saturating_sub(not_before_ms))
        } else {
            let progress = soft.progress.get(&key);
            if let Some(p) = progress {
                obs.progress_stall_ms.insert(
                    key.clone(),
                    now.duration_since(p.changed_at).as_millis() as u64,
                );
            }
            match progress {
                Some(p) => now.duration_since(p.seen_at).as_millis() as u64,
                None => now_wall.saturating_sub(started_at_ms),
            }
        };
        if worker_reporting && unseen_ms > lost_after_ms {
            obs.lost.insert(key);
        }
    }
    obs
}

/// The manifest record of a part the log holds for `step`. The worker service checked it
/// before proposing it, so an error here means a log entry that should not exist.
fn part_record(step: u64, p: &PartInfo) -> Result<PartRecord, cumulus_ckpt::CkptError> {
    PartRecord::from_reported(
        step,
        p.rank,
        p.attempt,
        p.dir.clone(),
        p.files.clone(),
        &p.state_json,
    )
}

async fn execute(node: &Arc<Node>, action: Action, memory: &mut LoopMemory) {
    let now = now_ms();
    let describe = format!("{action:?}");
    let cmd = match action {
        Action::ExpireWorker { worker_id } => {
            warn!(worker = %worker_id, "worker missed its heartbeats: expiring it");
            Command::ExpireWorker {
                worker_id,
                at_ms: now,
            }
        }
        Action::FailRank {
            job_id,
            rank,
            attempt,
            cause,
        } => {
            warn!(job = %job_id, rank, attempt, %cause, "rank failed");
            Command::RankFailed {
                job_id,
                rank,
                attempt,
                cause,
                at_ms: now,
            }
        }
        Action::Place { job_id, placements } => {
            info!(job = %job_id, ?placements, "placing job");
            Command::PlaceJob {
                job_id,
                placements,
                at_ms: now,
            }
        }
        Action::Restart {
            job_id,
            placements,
            failed_at_ms,
            delay_ms,
            cause,
            agent_fault,
        } => {
            // Choosing the resume step reads (and verifies) checkpoints: off the loop.
            let task_node = node.clone();
            let task_job = job_id.clone();
            memory.spawn_io(&job_id, async move {
                let node = task_node;
                let resume_step = choose_resume_step(&node, &task_job).await;
                info!(job = %task_job, delay_ms, ?resume_step, %cause, "scheduling restart");
                let cmd = Command::ScheduleRestart {
                    job_id: task_job,
                    placements,
                    failed_at_ms,
                    delay_ms,
                    cause,
                    resume_step,
                    agent_fault,
                };
                commit_planned(&node, cmd, &describe).await;
                IoOutcome::Done
            });
            return;
        }
        Action::FailJob { job_id, cause } => {
            warn!(job = %job_id, %cause, "job failed");
            Command::FailJob {
                job_id,
                cause,
                at_ms: now,
            }
        }
        Action::Succeed { job_id } => {
            info!(job = %job_id, "job succeeded");
            Command::JobSucceeded { job_id, at_ms: now }
        }
        Action::Finalize { job_id, step } => {
            if memory.bad_steps.contains(&(job_id.clone(), step)) {
                return;
            }
            let task_node = node.clone();
            let task_job = job_id.clone();
            memory.spawn_io(&job_id, async move {
                match finalize(&task_node, &task_job, step).await {
                    Ok(()) => IoOutcome::Done,
                    Err(e) => {
                        // An S3 outage is retried on a later pass; anything else marks the
                        // step bad (a later step commits instead).
                        let transient =
                            e.downcast_ref::<cumulus_ckpt::CkptError>().is_some_and(|c| {
                                matches!(c, cumulus_ckpt::CkptError::Remote { kind, .. } if kind.is_transient())
                            });
                        warn!(job = %task_job, step, error = %e, transient, "checkpoint step not committed");
                        if transient {
                            IoOutcome::Done
                        } else {
                            IoOutcome::BadStep(step)
                        }
                    }
                }
            });
            return;
        }
    };
    commit_planned(node, cmd, &describe).await;
}

/// Commits the command of a planned action; a rejection (the state moved on) or a lost
/// leadership is logged, and the next pass plans again.
async fn commit_planned(node: &Node, cmd: Command, describe: &str) {
    match node.propose(cmd).await {
        Ok(cumulus_raft_store::Response::Rejected { reason }) => {
            tracing::debug!(action = %describe, %reason, "planned action rejected (state moved on)")
        }
        Ok(_) => {}
        Err(e) => warn!(action = %describe, error = %e, "could not commit planned action"),
    }
}

/// Newest kept committed step whose manifest and files verify (the fallback for a
/// torn or corrupt newest step); None without checkpoints.
async fn choose_resume_step(node: &Node, job_id: &str) -> Option<u64> {
    let (spec, steps) = node.read_state(|s| {
        s.jobs.get(job_id).map(|j| {
            (
                j.spec.clone(),
                j.committed.keys().copied().collect::<Vec<_>>(),
            )
        })
    })?;
    if steps.is_empty() {
        return None;
    }
    let store = match node.ckpt_store(&spec).await {
        Ok(Some(store)) => store,
        Ok(None) => return None,
        Err(e) => {
            warn!(job = %job_id, error = %e, "cannot open the checkpoint store: restarting from scratch");
            return None;
        }
    };
    match cumulus_ckpt::newest_valid_step(&*store, job_id, &steps).await {
        Ok(Some(m)) => {
            if Some(&m.step) != steps.last() {
                warn!(job = %job_id, step = m.step, "newest checkpoint failed verification: resuming from an older step");
            }
            Some(m.step)
        }
        Ok(None) => {
            warn!(job = %job_id, "no kept checkpoint verifies: restarting from scratch");
            None
        }
        Err(e) => {
            warn!(job = %job_id, error = %e, "cannot verify checkpoints: restarting from scratch");
            None
        }
    }
}

/// Verifies every part of `step`, writes its manifest, commits the step in Raft, then
/// writes LATEST and prunes to the kept steps.
async fn finalize(node: &Node, job_id: &str, step: u64) -> anyhow::Result<()> {
    let Some((spec, world_size, parts)) = node.read_state(|s| {
        s.jobs.get(job_id).and_then(|j| {
            j.pending_parts.get(&step).map(|p| {
                (
                    j.spec.clone(),
                    j.spec.world_size,
                    p.values().cloned().collect::<Vec<_>>(),
                )
            })
        })
    }) else {
        return Ok(());
    };
    let Some(store) = node.ckpt_store(&spec).await? else {
        return Ok(());
    };
    let records = parts
        .iter()
        .map(|p| part_record(step, p))
        .collect::<Result<Vec<PartRecord>, _>>()
        .map_err(|e| anyhow::anyhow!("step {step} of {job_id} holds an invalid part: {e}"))?;
    // Every part is checked (files present, regular, of the recorded sizes; for S3 the
    // size and digest metadata by HEAD) without re-reading content: each digest was computed
    // by the agent over the bytes it fsynced before the rename, and every resume hashes every
    // byte again (docs/architecture.md, invariant 3). In parallel, at most one per core.
    {
        use futures::StreamExt;
        let parallel = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 16));
        let checks: Vec<_> = records
            .iter()
            .map(|p| store.check_part(job_id, p))
            .collect();
        let mut verified = futures::stream::iter(checks).buffer_unordered(parallel);
        while let Some(result) = verified.next().await {
            result?;
        }
    }
    let manifest = Manifest {
        format_version: cumulus_ckpt::MANIFEST_FORMAT_VERSION,
        job_id: job_id.to_string(),
        step,
        world_size,
        committed_at_ms: now_ms(),
        parts: records,
    };
    store.write_manifest(&manifest).await?;
    if let cumulus_raft_store::Response::Rejected { reason } = node
        .propose(Command::CheckpointCommitted {
            job_id: job_id.to_string(),
            step,
            at_ms: now_ms(),
        })
        .await?
    {
        anyhow::bail!("commit rejected: {reason}")
    }
    store.write_latest(job_id, step).await?;
    let keep: Vec<u64> = node.read_state(|s| {
        s.jobs
            .get(job_id)
            .map(|j| j.committed.keys().copied().collect())
            .unwrap_or_default()
    });
    if let Err(e) = store.prune(job_id, &keep).await {
        warn!(job = %job_id, error = %e, "pruning old checkpoints failed");
    }
    info!(job = %job_id, step, "checkpoint committed");
    Ok(())
}

/// Jobs that were ever placed (running or terminal), in id order: only they can have
/// committed checkpoints. Leaves out pending jobs, however many are queued.
fn placed_jobs(s: &ClusterState) -> impl Iterator<Item = &Job> {
    let index = s.job_index();
    index
        .running
        .union(&index.terminal)
        .filter_map(|id| s.jobs.get(id).map(|j| &**j))
}

/// Makes LATEST name the committed step of every job (a leader may have died between
/// the Raft commit and the LATEST write). One I/O task per job, at most every
/// [`IO_RETRY_INTERVAL`] until it succeeds.
fn ensure_latest(node: &Arc<Node>, memory: &mut LoopMemory) {
    let jobs: Vec<(String, cumulus_raft_store::state::JobSpec, u64)> = node.read_state(|s| {
        placed_jobs(s)
            .filter(|j| j.spec.ckpt_enabled())
            .filter_map(|j| j.committed_step.map(|c| (j.id.clone(), j.spec.clone(), c)))
            .filter(|(id, _, c)| memory.latest_ok.get(id) != Some(c))
            .collect()
    });
    for (job_id, spec, step) in jobs {
        if memory.io_busy(&job_id) || !memory.due(&job_id, IoKind::Latest) {
            continue;
        }
        let node = node.clone();
        let task_job = job_id.clone();
        memory.spawn_io(&job_id, async move {
            let job_id = task_job;
            let store = match node.ckpt_store(&spec).await {
                Ok(Some(store)) => store,
                Ok(None) => return IoOutcome::Done,
                Err(e) => {
                    warn!(job = %job_id, error = %e, "cannot open the checkpoint store");
                    return IoOutcome::Done;
                }
            };
            match store.read_latest(&job_id).await {
                Ok(Some(s)) if s == step => IoOutcome::LatestOk(step),
                _ => {
                    if store.verify_step(&job_id, step).await.is_ok()
                        && store.write_latest(&job_id, step).await.is_ok()
                    {
                        info!(job = %job_id, step, "LATEST repaired to the committed step");
                        IoOutcome::LatestOk(step)
                    } else {
                        IoOutcome::Done
                    }
                }
            }
        });
    }
}

/// For jobs that commit at L1 with an S3 target (`--ckpt-commit-tier l1`): once every
/// part of the committed step is in L2 (the agents upload them in the background),
/// writes the manifests of the kept steps, then LATEST, to L2 and prunes L2 to them, so
/// that the bucket alone is a complete, verifiable checkpoint (the same layout as an
/// L2-committed job). Checked at most every [`IO_RETRY_INTERVAL`] per job.
fn mirror_to_l2(node: &Arc<Node>, memory: &mut LoopMemory) {
    let jobs: Vec<(String, cumulus_raft_store::state::JobSpec, u64, Vec<u64>)> =
        node.read_state(|s| {
            placed_jobs(s)
                .filter(|j| !j.spec.ckpt_url.is_empty() && j.spec.ckpt_commit_tier == "l1")
                .filter_map(|j| {
                    j.committed_step.map(|c| {
                        (
                            j.id.clone(),
                            j.spec.clone(),
                            c,
                            j.committed.keys().copied().collect(),
                        )
                    })
                })
                .filter(|(id, _, c, _)| memory.l2_mirrored.get(id).is_none_or(|m| m < c))
                .collect()
        });
    for (job_id, spec, step, keep) in jobs {
        if memory.io_busy(&job_id) || !memory.due(&job_id, IoKind::Mirror) {
            continue;
        }
        let mirrored = memory.l2_mirrored.get(&job_id).copied();
        let node = node.clone();
        let task_job = job_id.clone();
        memory.spawn_io(&job_id, async move {
            let job_id = task_job;
            match mirror_steps(&node, &spec, &job_id, mirrored, &keep).await {
                Ok(Some(done)) => {
                    info!(job = %job_id, step = done, committed = step, "L1-committed steps mirrored to L2 (manifests, LATEST)");
                    IoOutcome::MirroredToL2(done)
                }
                Ok(None) => IoOutcome::Done, // parts still uploading
                Err(e) => {
                    warn!(job = %job_id, step, error = %e, "cannot mirror the step to L2 yet");
                    IoOutcome::Done
                }
            }
        });
    }
}

/// One try of [`mirror_to_l2`]: writes the L2 manifest of every kept committed step
/// after `mirrored` (oldest first) whose parts are all in L2, stopping at the first that
/// is not complete yet, then moves L2's LATEST to the newest step written. Returns that
/// step, or `None` when none was complete.
async fn mirror_steps(
    node: &Node,
    spec: &cumulus_raft_store::state::JobSpec,
    job_id: &str,
    mirrored: Option<u64>,
    keep: &[u64],
) -> Result<Option<u64>, cumulus_ckpt::CkptError> {
    use cumulus_ckpt::CheckpointStore;
    let Some(l1) = node.ckpt_store(spec).await? else {
        return Ok(None);
    };
    let l2 = node.s3.store(&spec.ckpt_url).await?;
    let mut newest = None;
    'steps: for &step in keep.iter().filter(|s| mirrored.is_none_or(|m| **s > m)) {
        let manifest = l1.read_manifest(job_id, step).await?;
        for part in &manifest.parts {
            if let Err(e) = l2.verify_part(job_id, part).await {
                tracing::debug!(job = %job_id, step, part = %part.dir, error = %e, "part not in L2 yet");
                break 'steps;
            }
        }
        l2.write_manifest(&manifest).await?;
        newest = Some(step);
    }
    let Some(step) = newest else {
        return Ok(None);
    };
    l2.write_latest(job_id, step).await?;
    if let Err(e) = l2.prune(job_id, keep).await {
        warn!(job = %job_id, error = %e, "pruning old L2 checkpoints failed");
    }
    Ok(Some(step))
}

/// Drops soft progress of attempts that are no longer current (bounded memory).
fn prune_progress(node: &Node, memory: &mut LoopMemory) {
    if memory
        .last_progress_prune
        .is_some_and(|t| t.elapsed() < Duration::from_secs(5))
    {
        return;
    }
    memory.last_progress_prune = Some(Instant::now());
    // Progress is only reported by attempts of running jobs.
    let current: HashSet<AttemptKey> = node.read_state(|s| {
        s.job_index()
            .running
            .iter()
            .filter_map(|id| s.jobs.get(id))
            .flat_map(|j| {
                j.ranks
                    .iter()
                    .map(|r| AttemptKey::new(j.id.clone(), r.rank, r.attempt))
            })
            .collect()
    });
    let mut soft = node.soft();
    soft.progress.retain(|k, _| current.contains(k));
    if soft.progress.len() > crate::soft::MAX_PROGRESS_ENTRIES {
        soft.progress.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cumulus_raft_store::state::{JobSpec, RestartPolicy};
    use cumulus_raft_store::{Command, Response};

    #[tokio::test]
    async fn checkpoint_io_runs_one_task_per_job_off_the_loop_and_remembers_outcomes() {
        let mut memory = LoopMemory::default();
        let (release, gate) = tokio::sync::oneshot::channel::<()>();
        // A slow task (an S3 outage being retried) for job a ...
        memory.spawn_io("a", async move {
            let _ = gate.await;
            IoOutcome::BadStep(7)
        });
        assert!(memory.io_busy("a"));
        // ... does not let a second task of job a start, nor block job b.
        memory.spawn_io("a", async { IoOutcome::LatestOk(1) });
        memory.spawn_io("b", async { IoOutcome::LatestOk(3) });
        assert_eq!(memory.io_jobs.len(), 2);
        let deadline = Instant::now() + Duration::from_secs(30);
        while memory.io_busy("b") {
            assert!(Instant::now() < deadline, "job b's task did not finish");
            tokio::task::yield_now().await;
            memory.reap_io();
        }
        assert_eq!(memory.latest_ok.get("b"), Some(&3));
        assert!(memory.io_busy("a"), "job a's task is still waiting");
        release.send(()).expect("task a waits");
        while memory.io_busy("a") {
            assert!(Instant::now() < deadline, "job a's task did not finish");
            tokio::task::yield_now().await;
            memory.reap_io();
        }
        assert!(memory.bad_steps.contains(&("a".to_string(), 7)));
        assert!(
            !memory.latest_ok.contains_key("a"),
            "the refused task never ran"
        );
        // A panicking task frees its job.
        memory.spawn_io("c", async { panic!("boom") });
        while memory.io_busy("c") {
            assert!(Instant::now() < deadline, "job c's task did not end");
            tokio::task::yield_now().await;
            memory.reap_io();
        }
        // The number of tasks in flight is bounded.
        let mut gates = Vec::new();
        for i in 0..MAX_IO_TASKS + 5 {
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            gates.push(tx);
            memory.spawn_io(&format!("j{i}"), async move {
                let _ = rx.await;
                IoOutcome::Done
            });
        }
        assert_eq!(memory.io_jobs.len(), MAX_IO_TASKS);
    }

    #[test]
    fn periodic_io_is_due_at_most_once_per_interval() {
        let mut memory = LoopMemory::default();
        assert!(memory.due("a", IoKind::Latest));
        assert!(!memory.due("a", IoKind::Latest));
        assert!(memory.due("a", IoKind::Mirror), "kinds are independent");
        assert!(memory.due("b", IoKind::Latest), "jobs are independent");
    }

    fn state_with_running_job(world_size: u32, scope: RestartScope) -> (ClusterState, String) {
        let mut s = ClusterState::default();
        let mut d = BTreeSet::new();
        for w in ["w1", "w2"] {
            s.apply(
                &Command::RegisterWorker {
                    worker_id: w.into(),
                    host: "h".into(),
                    http_addr: "h:1".into(),
                    slots: 4,
                    at_ms: 0,
                },
                &mut d,
            );
        }
        let spec = JobSpec {
            name: String::new(),
            world_size,
            command: vec!["x".into()],
            env: Default::default(),
            dataset: String::new(),
            ckpt_dir: String::new(),
            ckpt_keep: 3,
            restart: RestartPolicy {
                scope,
                max_restarts: 1,
                ..RestartPolicy::default()
            },
            progress_timeout_ms: 1_000,
            working_dir: String::new(),
            ckpt_url: String::new(),
            ckpt_commit_tier: String::new(),
        };
        let Response::JobSubmitted { job_id, .. } = s.apply(
            &Command::SubmitJob {
                request_id: "r".into(),
                spec,
                shards: vec![],
                submitted_at_ms: 0,
            },
            &mut d,
        ) else {
            panic!("submit")
        };
        let mut zero = || 0.0;
        let actions = plan(&s, &Observations::default(), 5_000, &mut zero);
        let [Action::Place { placements, .. }] = actions.as_slice() else {
            panic!("{actions:?}")
        };
        // Least-loaded placement alternates workers.
        assert_eq!(
            placements.iter().filter(|(_, w)| w == "w1").count() as u32,
            world_size.div_ceil(2)
        );
        s.apply(
            &Command::PlaceJob {
                job_id: job_id.clone(),
                placements: placements.clone(),
                at_ms: 1,
            },
            &mut d,
        );
        for r in 0..world_size {
            let w = s.jobs[&job_id].ranks[r as usize]
                .worker_id
                .clone()
                .expect("placed");
            s.apply(
                &Command::RankStarted {
                    job_id: job_id.clone(),
                    rank: r,
                    attempt: 0,
                    worker_id: w,
                    pid: 1,
                    at_ms: 2,
                },
                &mut d,
            );
        }
        (s, job_id)
    }

    #[test]
    fn silent_worker_is_expired_only_after_the_timeout() {
        let (s, _) = state_with_running_job(2, RestartScope::Group);
        let mut zero = || 0.0;
        let mut obs = Observations::default();
        obs.worker_silence_ms.insert("w1".into(), 5_000);
        assert!(plan(&s, &obs, 5_000, &mut zero).is_empty());
        obs.worker_silence_ms.insert("w1".into(), 5_001);
        assert_eq!(
            plan(&s, &obs, 5_000, &mut zero),
            vec![Action::ExpireWorker {
                worker_id: "w1".into()
            }]
        );
    }

    #[test]
    fn group_restart_then_budget_exhaustion() {
        let (mut s, job_id) = state_with_running_job(4, RestartScope::Group);
        let mut d = BTreeSet::new();
        let w = s.jobs[&job_id].ranks[2].worker_id.clone().expect("placed");
        s.apply(
            &Command::RankExited {
                job_id: job_id.clone(),
                rank: 2,
                attempt: 0,
                worker_id: w,
                exit_code: Some(1),
                signal: None,
                spawn_error: String::new(),
                at_ms: 50,
                agent_fault: false,
            },
            &mut d,
        );
        let mut plus = || 1.0;
        let actions = plan(&s, &Observations::default(), 5_000, &mut plus);
        let [
            Action::Restart {
                placements,
                failed_at_ms,
                delay_ms,
                cause,
                ..
            },
        ] = actions.as_slice()
        else {
            panic!("{actions:?}")
        };
        assert_eq!(placements.len(), 4, "group scope restarts every rank");
        assert_eq!((*failed_at_ms, *delay_ms), (50, 600));
        assert!(cause.contains("exited with code 1"), "{cause}");
        let cmd = Command::ScheduleRestart {
            job_id: job_id.clone(),
            placements: placements.clone(),
            failed_at_ms: 50,
            delay_ms: 600,
            cause: cause.clone(),
            resume_step: None,
            agent_fault: false,
        };
        assert_eq!(s.apply(&cmd, &mut d), Response::Ok);
        // Second failure: the budget of 1 is used up.
        let w = s.jobs[&job_id].ranks[0].worker_id.clone().expect("placed");
        s.apply(
            &Command::RankStarted {
                job_id: job_id.clone(),
                rank: 0,
                attempt: 1,
                worker_id: w.clone(),
                pid: 9,
                at_ms: 700,
            },
            &mut d,
        );
        s.apply(
            &Command::RankExited {
                job_id: job_id.clone(),
                rank: 0,
                attempt: 1,
                worker_id: w,
                exit_code: None,
                signal: Some(9),
                spawn_error: String::new(),
                at_ms: 800,
                agent_fault: false,
            },
            &mut d,
        );
        let actions = plan(&s, &Observations::default(), 5_000, &mut plus);
        let [Action::FailJob { cause, .. }] = actions.as_slice() else {
            panic!("{actions:?}")
        };
        assert!(
            cause.contains("budget of 1 exhausted") && cause.contains("signal 9"),
            "{cause}"
        );
    }

    /// An attempt its agent could not start for lack of a resource of its own (here:
    /// descriptors) is the worker's failure: the restart spends no budget, even with the
    /// budget used up, moves the rank to another worker with room, and is itself bounded
    /// by `MAX_AGENT_FAULT_RESTARTS`; a rank's own failure after it spends budget again.
    #[test]
    fn agent_resource_errors_restart_elsewhere_without_spending_budget() {
        let (mut s, job_id) = state_with_running_job(1, RestartScope::Group);
        let mut d = BTreeSet::new();
        Arc::make_mut(s.jobs.get_mut(&job_id).expect("job")).restarts_used = 1; // budget spent
        let w = s.jobs[&job_id].ranks[0].worker_id.clone().expect("placed");
        let mut attempt = 0;
        let mut agent_fails = |s: &mut ClusterState, attempt: u32, worker: &str| {
            s.apply(
                &Command::RankExited {
                    job_id: job_id.clone(),
                    rank: 0,
                    attempt,
                    worker_id: worker.into(),
                    exit_code: None,
                    signal: None,
                    spawn_error: "cannot create log …: Too many open files (os error 24)".into(),
                    agent_fault: true,
                    at_ms: 50,
                },
                &mut d,
            )
        };
        assert_eq!(agent_fails(&mut s, attempt, &w), Response::Ok);
        let mut zero = || 0.0;
        let actions = plan(&s, &Observations::default(), 5_000, &mut zero);
        let [
            Action::Restart {
                placements,
                delay_ms,
                agent_fault: true,
                cause,
                ..
            },
        ] = actions.as_slice()
        else {
            panic!("{actions:?}")
        };
        assert!(cause.contains("resource error of the agent"), "{cause}");
        assert_ne!(
            placements[0].1, w,
            "moved off the worker that could not start it"
        );
        // Later restarts back off further; a long delay passes every minimum.
        let mut delay = *delay_ms;
        let mut restart = |s: &mut ClusterState, placements: Vec<(u32, String)>, agent_fault| {
            let delay_ms = delay;
            delay = 3_600_000;
            s.apply(
                &Command::ScheduleRestart {
                    job_id: job_id.clone(),
                    placements,
                    failed_at_ms: 50,
                    delay_ms,
                    cause: cause.clone(),
                    resume_step: None,
                    agent_fault,
                },
                &mut BTreeSet::new(),
            )
        };
        assert_eq!(restart(&mut s, placements.clone(), true), Response::Ok);
        let job = &s.jobs[&job_id];
        assert_eq!((job.restarts_used, job.agent_fault_restarts), (1, 1));
        // Bounded: after MAX_AGENT_FAULT_RESTARTS such restarts the budget rules again.
        for _ in 1..MAX_AGENT_FAULT_RESTARTS {
            attempt += 1;
            let w = s.jobs[&job_id].ranks[0].worker_id.clone().expect("placed");
            assert_eq!(agent_fails(&mut s, attempt, &w), Response::Ok);
            let p = vec![(0, w)];
            assert_eq!(restart(&mut s, p, true), Response::Ok);
        }
        attempt += 1;
        let w = s.jobs[&job_id].ranks[0].worker_id.clone().expect("placed");
        assert_eq!(agent_fails(&mut s, attempt, &w), Response::Ok);
        assert!(matches!(
            restart(&mut s, vec![(0, w.clone())], true),
            Response::Rejected { .. }
        ));
        let actions = plan(&s, &Observations::default(), 5_000, &mut zero);
        assert!(
            matches!(actions.as_slice(), [Action::FailJob { .. }]),
            "{actions:?}"
        );
    }

    #[test]
    fn ranks_of_an_expired_worker_move_to_a_live_one() {
        let (mut s, _job_id) = state_with_running_job(4, RestartScope::Group);
        let mut d = BTreeSet::new();
        s.apply(
            &Command::ExpireWorker {
                worker_id: "w2".into(),
                at_ms: 100,
            },
            &mut d,
        );
        let mut zero = || 0.0;
        let actions = plan(&s, &Observations::default(), 5_000, &mut zero);
        let [Action::Restart { placements, .. }] = actions.as_slice() else {
            panic!("{actions:?}")
        };
        assert!(placements.iter().all(|(_, w)| w == "w1"), "{placements:?}");
        assert_eq!(
            placements.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
    }

    #[test]
    fn hung_and_lost_ranks_fail_and_rank_scope_restarts_one() {
        let (s, job_id) = state_with_running_job(2, RestartScope::Rank);
        let mut zero = || 0.0;
        let mut obs = Observations::default();
        obs.progress_stall_ms
            .insert(AttemptKey::new(job_id.clone(), 0, 0), 1_001);
        obs.lost.insert(AttemptKey::new(job_id.clone(), 1, 0));
        let actions = plan(&s, &obs, 5_000, &mut zero);
        assert_eq!(actions.len(), 2);
        assert!(
            matches!(&actions[0], Action::FailRank { rank: 0, cause, .. } if cause.starts_with("hung"))
        );
        assert!(
            matches!(&actions[1], Action::FailRank { rank: 1, cause, .. } if cause.starts_with("lost"))
        );
    }

    #[test]
    fn a_lost_pending_attempt_fails_and_a_stalled_one_is_not_hung() {
        let (mut s, job_id) = state_with_running_job(2, RestartScope::Rank);
        for r in &mut Arc::make_mut(s.jobs.get_mut(&job_id).expect("job")).ranks {
            r.state = RankState::Pending; // placed, not started yet
        }
        let mut zero = || 0.0;
        let mut obs = Observations::default();
        // Rank 0 prepares for long (no progress) and is reported: not hung, not lost.
        obs.progress_stall_ms
            .insert(AttemptKey::new(job_id.clone(), 0, 0), 60_000);
        // Rank 1 is neither prepared nor run by its reporting worker.
        obs.lost.insert(AttemptKey::new(job_id.clone(), 1, 0));
        let actions = plan(&s, &obs, 5_000, &mut zero);
        assert_eq!(actions.len(), 1, "{actions:?}");
        assert!(
            matches!(&actions[0], Action::FailRank { rank: 1, attempt: 0, cause, .. } if cause == "lost: its worker neither prepares nor runs it"),
            "{actions:?}"
        );
    }

    #[test]
    fn gang_placement_waits_for_capacity() {
        let mut s = ClusterState::default();
        let mut d = BTreeSet::new();
        s.apply(
            &Command::RegisterWorker {
                worker_id: "w1".into(),
                host: "h".into(),
                http_addr: "h:1".into(),
                slots: 2,
                at_ms: 0,
            },
            &mut d,
        );
        let spec = JobSpec {
            name: String::new(),
            world_size: 3,
            command: vec!["x".into()],
            env: Default::default(),
            dataset: String::new(),
            ckpt_dir: String::new(),
            ckpt_keep: 3,
            restart: RestartPolicy::default(),
            progress_timeout_ms: 0,
            working_dir: String::new(),
            ckpt_url: String::new(),
            ckpt_commit_tier: String::new(),
        };
        s.apply(
            &Command::SubmitJob {
                request_id: "r".into(),
                spec,
                shards: vec![],
                submitted_at_ms: 0,
            },
            &mut d,
        );
        let mut zero = || 0.0;
        assert!(plan(&s, &Observations::default(), 5_000, &mut zero).is_empty());
    }
}
