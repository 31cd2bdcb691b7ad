//! The pure planner: from the replicated state and the leader's observations to the
//! [`Action`]s that move every job on. No clock, no I/O, no randomness but the jitter
//! it is given.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use cumulus_raft_store::state::{
    ClusterState, Job, JobState, MAX_AGENT_FAULT_RESTARTS, RankRecord, RankState, RestartScope,
    StopAction, WorkerState,
};
use cumulus_raft_store::state::{StragglerAction, StragglerFlag};
use shard_planner::{GpuFree, WorkerGpus, WorkerSlots};

use cumulus_api::AttemptKey;

use super::*;

mod elastic;

/// What the leader observed outside the replicated state (soft state), in the units
/// the planner needs.
#[derive(Debug, Default, Clone)]
pub struct Observations {
    /// Milliseconds since the last heartbeat of each worker the leader tracks.
    pub worker_silence_ms: HashMap<String, u64>,
    /// Milliseconds since each running attempt's reported step last changed, for the
    /// attempts that have made their first progress report (the clock starts there).
    pub progress_stall_ms: HashMap<AttemptKey, u64>,
    /// Milliseconds since each running attempt's process started, for the attempts
    /// that have not made their first progress report yet (the startup timeout's clock;
    /// a new leader counts from its own start at the latest).
    pub startup_ms: HashMap<AttemptKey, u64>,
    /// Running attempts their worker stopped reporting (lost by the agent).
    pub lost: HashSet<AttemptKey>,
    /// GPUs (by UUID) whose worker's last heartbeat reported them unhealthy, with why:
    /// nothing new is placed on them and the ranks using them fail.
    pub unhealthy_gpus: HashMap<String, String>,
    /// The leader's clock, in ms since the Unix epoch (time limits are measured with it).
    pub now_ms: u64,
    /// Live attempts whose rank listens for in-process restarts (`cumulus.runtime.run`,
    /// from their worker's last heartbeat).
    pub in_process: HashSet<AttemptKey>,
    /// Running attempts found to be stragglers ([`straggler`]: below their job's
    /// fraction of the other ranks' median steps/s for its window).
    pub stragglers: HashMap<AttemptKey, straggler::Verdict>,
}

/// Slots and GPU shares taken so far, as the planner places ranks in one pass.
#[derive(Debug, Clone, Default)]
pub(super) struct Used {
    /// Slots in use per worker.
    pub slots: BTreeMap<String, u32>,
    /// Share in use per GPU UUID, in thousandths.
    pub gpus: BTreeMap<String, u32>,
}

impl Used {
    /// Counts `placements` (and their GPUs, each holding `share` thousandths).
    fn add(&mut self, placements: &[(u32, String)], gpus: &[(u32, Vec<String>)], share: u32) {
        for (_, w) in placements {
            *self.slots.entry(w.clone()).or_insert(0) += 1;
        }
        for g in gpus.iter().flat_map(|(_, g)| g) {
            *self.gpus.entry(g.clone()).or_insert(0) += share;
        }
    }
}

/// The GPU planner's view of the alive workers (`alive`) given what is `used`: free
/// slots, and the free share of each GPU not reported unhealthy.
fn gpu_capacity(
    state: &ClusterState,
    obs: &Observations,
    alive: &dyn Fn(&str) -> bool,
    used: &Used,
) -> Vec<WorkerGpus> {
    state
        .workers
        .values()
        .filter(|w| alive(&w.worker_id) && !w.gpus.is_empty())
        .map(|w| WorkerGpus {
            worker_id: w.worker_id.clone(),
            free_slots: w
                .slots
                .saturating_sub(used.slots.get(&w.worker_id).copied().unwrap_or(0)),
            gpus: w
                .gpus
                .iter()
                .filter(|g| !obs.unhealthy_gpus.contains_key(&g.uuid))
                .map(|g| GpuFree {
                    uuid: g.uuid.clone(),
                    free_permille: shard_planner::WHOLE_GPU_PERMILLE
                        .saturating_sub(used.gpus.get(&g.uuid).copied().unwrap_or(0)),
                })
                .collect(),
        })
        .collect()
}

/// Splits a GPU plan into the commands' two lists.
#[allow(clippy::type_complexity)]
fn split_gpu_plan(
    plan: Vec<shard_planner::GpuPlacement>,
) -> (Vec<(u32, String)>, Vec<(u32, Vec<String>)>) {
    plan.into_iter()
        .map(|(rank, worker, gpus)| ((rank, worker), (rank, gpus)))
        .unzip()
}

/// One decision of the planner.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Expire a silent worker (its ranks fail).
    ExpireWorker {
        /// The worker agent's id.
        worker_id: String,
    },
    /// Declare a running attempt failed.
    FailRank {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// Global rank, `0..world_size`.
        rank: u32,
        /// The rank's attempt number (0 for its first run).
        attempt: u32,
        /// Human-readable cause, shown to users.
        cause: String,
    },
    /// Gang-place a pending job.
    Place {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// `(rank, worker)` for every rank.
        placements: Vec<(u32, String)>,
        /// `(rank, GPU UUIDs)` for every rank of a job with GPUs (empty otherwise).
        gpus: Vec<(u32, Vec<String>)>,
    },
    /// Restart failed ranks (or the group) after a delay.
    Restart {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// `(rank, worker)` of every restarted rank.
        placements: Vec<(u32, String)>,
        /// `(rank, GPU UUIDs)` of every restarted rank of a job with GPUs (empty
        /// otherwise).
        gpus: Vec<(u32, Vec<String>)>,
        /// Leader time of the failure.
        failed_at_ms: u64,
        /// Restart delay with its ±20% jitter already drawn, in ms.
        delay_ms: u64,
        /// Human-readable cause, shown to users.
        cause: String,
        /// Every failed rank failed for an agent resource error: no budget is spent.
        agent_fault: bool,
        /// Ranks that keep their processes (an in-process restart; empty: a full one).
        in_process: Vec<u32>,
        /// Why that path ([`restart_path`]).
        path_reason: String,
    },
    /// Change a running elastic job's number of ranks to `placements.len()`, every rank
    /// restarted from the newest committed step that verifies ([`elastic`]).
    Resize {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// `(rank, worker)` for every rank `0..new world size`.
        placements: Vec<(u32, String)>,
        /// `(rank, GPU UUIDs)` for every rank of a job with GPUs (empty otherwise).
        gpus: Vec<(u32, Vec<String>)>,
        /// Why, in words (the resize event's cause).
        cause: String,
    },
    /// Fail the job (budget exhausted).
    FailJob {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// Human-readable cause, shown to users.
        cause: String,
    },
    /// Every rank exited 0: commit `finalize` first when its parts are all in (the last
    /// checkpoint the ranks took before they exited), then the success. A rank's
    /// checkpoint call returned once its part was recorded, so a job never succeeds
    /// with a complete step left uncommitted (or not yet found bad).
    Succeed {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// The newest step whose every part arrived and that is not committed yet.
        finalize: Option<u64>,
    },
    /// Flag a running attempt a straggler ([`StragglerFlag`], its `at_ms` the planner's
    /// `now_ms`; the executor stamps its own time).
    FlagStraggler {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// The flag: rank, attempt, worker, rates and the job's action.
        flag: StragglerFlag,
    },
    /// Every rank's part of `step` arrived: verify, write the manifest, commit.
    Finalize {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// Checkpoint step.
        step: u64,
    },
    /// Ask a running job's ranks to checkpoint and stop (its time limit is near, or it
    /// is preempted for a job of higher priority).
    RequestStop {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// Why.
        action: StopAction,
    },
    /// Ask a running elastic job's ranks to checkpoint and stop before it grows (the
    /// grow rule allows it now): [`Command::RequestGrow`]. Once they stopped, the job is
    /// resized from the step they committed ([`Action::Resize`]).
    RequestGrow {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// Why, in words (the grow the rule found room for).
        cause: String,
    },
    /// No rank of a stopping job runs any more: commit `finalize` first when its
    /// parts are all in (the checkpoint the ranks took on request), then complete the
    /// stop.
    Stopped {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// The newest step whose every part arrived and that is not committed yet.
        finalize: Option<u64>,
    },
}

pub(super) fn truncate(mut s: String) -> String {
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

/// `(rank, worker)` for each placed rank, and `(rank, GPU UUIDs)` for each when the job
/// has GPUs (empty otherwise): the two lists [`Action::Place`] and [`Action::Restart`]
/// carry.
type Placed = (Vec<(u32, String)>, Vec<(u32, Vec<String>)>);

/// Plans the leader's next actions. Pure: the same inputs give the same plan;
/// `jitter` yields the random units in [−1, 1] the restart delays need.
pub fn plan(
    state: &ClusterState,
    obs: &Observations,
    heartbeat_timeout_ms: u64,
    jitter: &mut dyn FnMut() -> f64,
) -> Vec<Action> {
    let mut actions = Vec::new();
    let expiring = expire_silent_workers(state, obs, heartbeat_timeout_ms, &mut actions);
    let alive = |id: &str| {
        !expiring.contains(id)
            && state
                .workers
                .get(id)
                .is_some_and(|w| w.state == WorkerState::Alive)
    };
    let mut used = Used {
        slots: state.slots_used(None),
        gpus: state.gpus_used(None),
    };

    // An upper bound on the free slots left: placements below only lower it (restarts
    // in `plan_running` may use slots it still counts, which costs an exact check, never
    // a wrong plan). Most pending jobs wait for capacity that is not there, and this
    // turns each of them into one comparison instead of a walk over every worker.
    let free_upper_bound: u64 = free_workers(state, &alive, &used.slots)
        .iter()
        .map(|w| u64::from(w.free_slots))
        .sum();
    // Running jobs first (their restarts keep the slots they hold), in id order; then
    // the queue: highest priority first, submission order within one priority; pending
    // jobs only when some capacity may be free (it only shrinks during a pass).
    let index = state.job_index();
    for job in index.running.iter().filter_map(|id| state.jobs.get(id)) {
        match job.state {
            JobState::Running if job.stop.is_some() => {
                plan_stopping(state, job, obs, (&mut used, &alive), &mut actions);
            }
            // A job whose ranks all finished succeeds, limit or not.
            JobState::Running if time_is_up(job, obs.now_ms) && !job.all_ranks_succeeded() => {
                actions.push(Action::RequestStop {
                    job_id: job.id.clone(),
                    action: StopAction::TimeLimit,
                });
            }
            JobState::Running => {
                plan_running(state, job, obs, &mut used, &alive, jitter, &mut actions);
            }
            _ => {}
        }
    }
    if free_upper_bound == 0 {
        plan_queue_without_room(state, obs, &used, &alive, &mut actions);
    } else {
        plan_queue(state, obs, &mut used, &alive, &mut actions);
    }
    actions
}

/// Expires every alive worker silent for more than `heartbeat_timeout_ms` (one
/// [`Action::ExpireWorker`] each, pushed onto `actions`) and returns their ids: the
/// rest of the pass treats them as gone.
fn expire_silent_workers<'a>(
    state: &'a ClusterState,
    obs: &Observations,
    heartbeat_timeout_ms: u64,
    actions: &mut Vec<Action>,
) -> BTreeSet<&'a str> {
    let mut expiring = BTreeSet::new();
    for w in state.workers.values() {
        if w.state != WorkerState::Alive {
            continue;
        }
        if obs
            .worker_silence_ms
            .get(&w.worker_id)
            .is_some_and(|s| *s > heartbeat_timeout_ms)
        {
            expiring.insert(w.worker_id.as_str());
            actions.push(Action::ExpireWorker {
                worker_id: w.worker_id.clone(),
            });
        }
    }
    expiring
}

/// The alive workers (`alive`) with their free slots, given the slots `used` per
/// worker (workers with none free included).
fn free_workers(
    state: &ClusterState,
    alive: &dyn Fn(&str) -> bool,
    used: &BTreeMap<String, u32>,
) -> Vec<WorkerSlots> {
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
}

/// The queue when no slot is free at the start of the pass: only preemption can start
/// its first job that could ever fit, and only when a running job may be preempted at
/// all; otherwise the queue is not walked.
fn plan_queue_without_room(
    state: &ClusterState,
    obs: &Observations,
    used: &Used,
    alive: &dyn Fn(&str) -> bool,
    actions: &mut Vec<Action>,
) {
    let index = state.job_index();
    let preemptible = index
        .running
        .iter()
        .filter_map(|id| state.jobs.get(id))
        .any(|j| j.spec.preemptible && j.stop.is_none());
    if !preemptible {
        return;
    }
    // Computed once per pass: a queue of jobs larger than the cluster (queued with
    // `--allow-pending`) costs one comparison per job, not a walk over every worker.
    let totals = state.alive_totals();
    if let Some(first) = index
        .queue
        .iter()
        .filter_map(|(_, id)| state.jobs.get(id))
        .find(|j| j.state == JobState::Pending && !totals.never_fits(&j.spec))
    {
        plan_preemption(state, obs, first, used, alive, actions);
    }
}

/// Walks the queue (highest priority first, submission order within one priority) and
/// places each pending job that fits ([`Action::Place`], its slots and GPUs added to
/// `used`). The first job that does not fit holds a reservation; a job behind it is
/// placed only when that cannot delay it (EASY backfill), and preemption is then
/// planned for it.
fn plan_queue(
    state: &ClusterState,
    obs: &Observations,
    used: &mut Used,
    alive: &dyn Fn(&str) -> bool,
    actions: &mut Vec<Action>,
) {
    // Computed once per pass: a queue of jobs larger than the cluster (queued with
    // `--allow-pending`) costs one comparison per job, not a walk over every worker.
    let totals = state.alive_totals();
    let never = |job: &Job| totals.never_fits(&job.spec);
    let mut head: Option<Reservation> = None;
    let mut head_job: Option<&Job> = None;
    // The workers with a free slot, kept up to date as jobs are placed below: a
    // placement costs O(those workers), not O(every worker).
    let mut free: Vec<WorkerSlots> = free_workers(state, alive, &used.slots)
        .into_iter()
        .filter(|w| w.free_slots > 0)
        .collect();
    let mut free_upper_bound: u64 = free.iter().map(|w| u64::from(w.free_slots)).sum();
    for job in state
        .job_index()
        .queue
        .iter()
        .filter_map(|(_, id)| state.jobs.get(id))
    {
        // Nothing is free any more and the queue's first waiting job is known: no job
        // further back can start (O(placed jobs) per pass, not O(queued jobs)).
        if free_upper_bound == 0 && head.is_some() {
            break;
        }
        if job.state != JobState::Pending {
            continue;
        }
        let Some(uses_extra) = backfill_fit(head.as_ref(), job) else {
            continue;
        };
        let planned = if free_upper_bound < u64::from(job.spec.min_ranks()) {
            None
        } else {
            place_job(state, obs, job, &free, used, alive)
        };
        match planned {
            Some((placements, gpus)) => {
                free_upper_bound = free_upper_bound.saturating_sub(placements.len() as u64);
                take_slots(&mut free, &placements);
                if uses_extra && let Some(h) = &mut head {
                    h.extra_slots -= u64::from(job.spec.world_size);
                }
                used.add(&placements, &gpus, job.spec.gpu_share_permille());
                actions.push(Action::Place {
                    job_id: job.id.clone(),
                    placements,
                    gpus,
                });
            }
            // A job larger than the alive workers in all waits for workers to join, not
            // for running jobs to end: it holds no reservation (it would hold the queue
            // for ever).
            None if head.is_none() && !never(job) => {
                head = Some(reserve(state, job, obs.now_ms, used, alive));
                head_job = Some(job);
            }
            None => {}
        }
    }
    if let Some(first) = head_job {
        plan_preemption(state, obs, first, used, alive, actions);
    }
}

/// Whether the pending `job` may start ahead of the queue's waiting `head` (`None`
/// while no job waits): `None` when it may not, `Some(uses_extra)` when it may, where
/// `uses_extra` says it must fit in the head's extra slots because it may still run
/// when the head's reservation starts. Jobs with GPUs are never backfilled, nor
/// backfilled past.
fn backfill_fit(head: Option<&Reservation>, job: &Job) -> Option<bool> {
    let Some(h) = head else {
        return Some(false);
    };
    if h.gpus || job.spec.gpu_demand().is_some() {
        return None; // GPUs: no backfill past a job that waits
    }
    let ends_in_time =
        job.spec.time_limit_ms > 0 && h.shadow_ms.is_some_and(|s| job.spec.time_limit_ms <= s);
    if ends_in_time {
        Some(false)
    } else if u64::from(job.spec.world_size) > h.extra_slots {
        None
    } else {
        Some(true)
    }
}

/// A gang placement of every rank of the pending `job` on the workers with free slots
/// (`free`) or, for a job with GPUs, on the alive workers' free GPUs given `used`;
/// `None` when it does not fit.
fn place_job(
    state: &ClusterState,
    obs: &Observations,
    job: &Job,
    free: &[WorkerSlots],
    used: &Used,
    alive: &dyn Fn(&str) -> bool,
) -> Option<Placed> {
    if job.spec.is_elastic() {
        // As many ranks as fit, from the most down to the fewest.
        return elastic::largest_fit(state, obs, &job.spec, free, used, alive, u32::MAX);
    }
    // The workers the job avoids (its stragglers'), as long as the others have room.
    if !job.avoided_workers.is_empty() {
        let avoided = |w: &str| job.avoided_workers.iter().any(|a| a == w);
        let elsewhere: Vec<WorkerSlots> = free
            .iter()
            .filter(|w| !avoided(&w.worker_id))
            .cloned()
            .collect();
        let alive_elsewhere = |w: &str| alive(w) && !avoided(w);
        if let Some(placed) = gang_place(state, obs, job, &elsewhere, used, &alive_elsewhere) {
            return Some(placed);
        }
    }
    gang_place(state, obs, job, free, used, alive)
}

/// [`place_job`] for a job of a fixed world size on the workers `free` (and, with GPUs,
/// the `alive` workers' free GPUs given `used`).
fn gang_place(
    state: &ClusterState,
    obs: &Observations,
    job: &Job,
    free: &[WorkerSlots],
    used: &Used,
    alive: &dyn Fn(&str) -> bool,
) -> Option<Placed> {
    let ranks: Vec<u32> = (0..job.spec.world_size).collect();
    match job.spec.gpu_demand() {
        None => shard_planner::place_ranks(&ranks, free)
            .ok()
            .flatten()
            .map(|placements| (placements, Vec::new())),
        Some(demand) => {
            shard_planner::place_gpu_ranks(&ranks, &gpu_capacity(state, obs, alive, used), demand)
                .ok()
                .flatten()
                .map(split_gpu_plan)
        }
    }
}

/// Takes one slot in `free` for each of `placements`, dropping the workers left with
/// none.
fn take_slots(free: &mut Vec<WorkerSlots>, placements: &[(u32, String)]) {
    for (_, worker) in placements {
        if let Some(w) = free.iter_mut().find(|w| w.worker_id == *worker) {
            w.free_slots = w.free_slots.saturating_sub(1);
        }
    }
    free.retain(|w| w.free_slots > 0);
}

/// Preemption for `head`, the queue's first job, which does not fit now: when running
/// jobs submitted `--preemptible` with a lower priority hold enough for it, the fewest
/// of them are asked to checkpoint and stop (lowest priority first, the newest first
/// within one priority, as Slurm's `PreemptType=preempt/qos` picks), and they are queued
/// again when they have stopped ([`StopAction::Preempt`]; no restart budget is spent).
/// Nothing is preempted while stops already in flight would free enough, nor when
/// preempting every candidate would still not make room. A job without GPUs counts
/// slots; a job with GPUs is tried against the GPU planner with the candidates' slots
/// and GPU shares (fractional ones included) given back ([`plan_gpu_preemption`]).
fn plan_preemption(
    state: &ClusterState,
    obs: &Observations,
    head: &Job,
    used: &Used,
    alive: &dyn Fn(&str) -> bool,
    actions: &mut Vec<Action>,
) {
    if let Some(demand) = head.spec.gpu_demand() {
        plan_gpu_preemption(state, obs, head, demand, used, alive, actions);
        return;
    }
    let need = u64::from(head.spec.world_size);
    let free = free_slot_count(state, used, alive);
    let held = |j: &Job| held_slot_count(j, alive);
    let mut freeing = 0;
    let mut candidates: Vec<(i32, std::cmp::Reverse<&str>, u64)> = Vec::new();
    for j in state
        .job_index()
        .running
        .iter()
        .filter_map(|id| state.jobs.get(id))
    {
        if j.stop.is_some() {
            freeing += held(j);
        } else if may_preempt(head, j) {
            candidates.push((j.spec.priority, std::cmp::Reverse(j.id.as_str()), held(j)));
        }
    }
    let mut gained = free + freeing;
    if gained >= need || candidates.is_empty() {
        return;
    }
    candidates.sort_unstable();
    let mut victims = Vec::new();
    for (_, std::cmp::Reverse(id), slots) in candidates {
        if slots == 0 {
            continue;
        }
        victims.push(id);
        gained += slots;
        if gained >= need {
            break;
        }
    }
    if gained < need {
        return;
    }
    for id in victims {
        actions.push(Action::RequestStop {
            job_id: id.to_string(),
            action: StopAction::Preempt,
        });
    }
}

/// Whether the running job `j` may be preempted for `head`: submitted `--preemptible`,
/// of a lower priority, no stop in flight, and not done.
fn may_preempt(head: &Job, j: &Job) -> bool {
    j.stop.is_none()
        && j.spec.preemptible
        && j.spec.priority < head.spec.priority
        && !j.all_ranks_succeeded()
}

/// `used` less what `jobs` hold: the slots of their pending and running ranks on alive
/// workers, and their share of each of those ranks' GPUs.
fn used_less(used: &Used, jobs: &[&Job], alive: &dyn Fn(&str) -> bool) -> Used {
    let mut out = used.clone();
    for j in jobs {
        let share = j.spec.gpu_share_permille();
        for r in j
            .ranks
            .iter()
            .filter(|r| matches!(r.state, RankState::Pending | RankState::Running))
        {
            let Some(w) = r.worker_id.as_deref().filter(|w| alive(w)) else {
                continue;
            };
            if let Some(n) = out.slots.get_mut(w) {
                *n = n.saturating_sub(1);
            }
            for g in &r.gpus {
                if let Some(n) = out.gpus.get_mut(g) {
                    *n = n.saturating_sub(share);
                }
            }
        }
    }
    out
}

/// [`plan_preemption`] for a `head` that needs GPUs (`demand`): whether it fits is the
/// GPU planner's answer on the alive workers' healthy GPUs, given `used` less what the
/// jobs stopping already and the chosen victims hold. Candidates are taken in
/// preemption order until it fits, then each one the others make unnecessary is dropped
/// again (the first taken first), so the fewest jobs stop. Candidates holding nothing on
/// a worker with GPUs are skipped: stopping them frees nothing the head can use.
fn plan_gpu_preemption(
    state: &ClusterState,
    obs: &Observations,
    head: &Job,
    demand: shard_planner::GpuDemand,
    used: &Used,
    alive: &dyn Fn(&str) -> bool,
    actions: &mut Vec<Action>,
) {
    let ranks: Vec<u32> = (0..head.spec.world_size).collect();
    let fits = |freed: &[&Job]| {
        let capacity = gpu_capacity(state, obs, alive, &used_less(used, freed, alive));
        matches!(
            shard_planner::place_gpu_ranks(&ranks, &capacity, demand),
            Ok(Some(_))
        )
    };
    let gpu_worker = |w: &str| state.workers.get(w).is_some_and(|w| !w.gpus.is_empty());
    let running: Vec<&Job> = state
        .job_index()
        .running
        .iter()
        .filter_map(|id| state.jobs.get(id))
        .map(|j| &**j)
        .collect();
    let stopping: Vec<&Job> = running
        .iter()
        .copied()
        .filter(|j| j.stop.is_some())
        .collect();
    if fits(&stopping) {
        return; // the stops in flight make room (or something else holds the head back)
    }
    let mut candidates: Vec<&Job> = running
        .iter()
        .copied()
        .filter(|j| may_preempt(head, j))
        .filter(|j| {
            j.ranks.iter().any(|r| {
                matches!(r.state, RankState::Pending | RankState::Running)
                    && r.worker_id
                        .as_deref()
                        .is_some_and(|w| alive(w) && gpu_worker(w))
            })
        })
        .collect();
    candidates.sort_by(|a, b| {
        (a.spec.priority, std::cmp::Reverse(&a.id))
            .cmp(&(b.spec.priority, std::cmp::Reverse(&b.id)))
    });
    let mut victims: Vec<&Job> = Vec::new();
    let mut enough = false;
    for c in candidates {
        victims.push(c);
        let freed: Vec<&Job> = stopping.iter().chain(&victims).copied().collect();
        if fits(&freed) {
            enough = true;
            break;
        }
    }
    if !enough {
        return;
    }
    let mut i = 0;
    while i < victims.len() {
        let others: Vec<&Job> = stopping
            .iter()
            .copied()
            .chain(
                victims
                    .iter()
                    .enumerate()
                    .filter(|(k, _)| *k != i)
                    .map(|(_, j)| *j),
            )
            .collect();
        if fits(&others) {
            victims.remove(i);
        } else {
            i += 1;
        }
    }
    for j in victims {
        actions.push(Action::RequestStop {
            job_id: j.id.clone(),
            action: StopAction::Preempt,
        });
    }
}

/// The reservation of the first queued job that does not fit (EASY backfill, as in
/// Slurm's backfill scheduler and Mu'alem & Feitelson 2001): when it can start at the
/// latest, and how many slots will be left over then.
#[derive(Debug, Clone)]
struct Reservation {
    /// Milliseconds from now until enough running jobs have ended, by their time
    /// limits, for it to fit (`None`: a job without a time limit must end first, so no
    /// start can be promised).
    shadow_ms: Option<u64>,
    /// Slots free at that time beyond what it needs: a job that fits in them never
    /// delays it, whenever it ends.
    extra_slots: u64,
    /// It needs GPUs: nothing is backfilled past it.
    gpus: bool,
}

/// The reservation of `head` (pending, not placeable now): running jobs end, at the
/// latest, when their time limits run out; the start is the first end after which
/// the free slots cover it.
fn reserve(
    state: &ClusterState,
    head: &Job,
    now_ms: u64,
    used: &Used,
    alive: &dyn Fn(&str) -> bool,
) -> Reservation {
    let need = u64::from(head.spec.world_size);
    let mut free = free_slot_count(state, used, alive);
    let mut ends: Vec<(u64, u64)> = state
        .job_index()
        .running
        .iter()
        .filter_map(|id| state.jobs.get(id))
        .filter(|j| j.spec.time_limit_ms > 0)
        .map(|j| {
            let left = j.spec.time_limit_ms.saturating_sub(j.running_ms_at(now_ms));
            let slots = held_slot_count(j, alive);
            (left, slots)
        })
        .collect();
    ends.sort_unstable();
    let mut shadow_ms = None;
    if free < need {
        for (left, slots) in ends {
            free += slots;
            if free >= need {
                shadow_ms = Some(left);
                break;
            }
        }
    } else {
        shadow_ms = Some(0); // it fits by count, not by shape (GPUs): no promise beyond now
    }
    Reservation {
        shadow_ms,
        extra_slots: if shadow_ms.is_some() {
            free.saturating_sub(need)
        } else {
            0
        },
        gpus: head.spec.gpu_demand().is_some(),
    }
}

/// Slots free on the alive workers, given what `used` holds.
fn free_slot_count(state: &ClusterState, used: &Used, alive: &dyn Fn(&str) -> bool) -> u64 {
    state
        .workers
        .values()
        .filter(|w| alive(&w.worker_id))
        .map(|w| {
            u64::from(
                w.slots
                    .saturating_sub(used.slots.get(&w.worker_id).copied().unwrap_or(0)),
            )
        })
        .sum()
}

/// Slots a running job holds on alive workers (its pending and running ranks there).
fn held_slot_count(job: &Job, alive: &dyn Fn(&str) -> bool) -> u64 {
    job.ranks
        .iter()
        .filter(|r| {
            matches!(r.state, RankState::Pending | RankState::Running)
                && r.worker_id.as_deref().is_some_and(alive)
        })
        .count() as u64
}

/// True when a running job's time limit, less its `signal_before_ms`, has run out at
/// leader time `now_ms`.
fn time_is_up(job: &Job, now_ms: u64) -> bool {
    job.spec.time_limit_ms > 0
        && job.running_ms_at(now_ms) + job.spec.signal_before_ms >= job.spec.time_limit_ms
}

/// A job whose ranks were asked to stop ([`Job::stop`]): nothing restarts; once no rank
/// runs, the stop completes (after the step the ranks completed is committed): a grow's
/// by the resize ([`elastic::plan_grown`]), when the room is still there.
fn plan_stopping(
    state: &ClusterState,
    job: &Job,
    obs: &Observations,
    (used, alive): (&mut Used, &dyn Fn(&str) -> bool),
    actions: &mut Vec<Action>,
) {
    let mut running = false;
    for r in job.ranks.iter().filter(|r| r.state == RankState::Running) {
        running = true;
        let key = AttemptKey::new(job.id.clone(), r.rank, r.attempt);
        // A stopping rank may well make no progress: only a lost one is failed (its
        // agent's stop escalation ends one that does not stop).
        if obs.lost.contains(&key) {
            actions.push(Action::FailRank {
                job_id: job.id.clone(),
                rank: r.rank,
                attempt: r.attempt,
                cause: "lost: its worker no longer reports the process".to_string(),
            });
        }
    }
    if running {
        return;
    }
    let finalize = newest_complete_step(job);
    if finalize.is_none()
        && job.stop.as_ref().is_some_and(|s| s.grow)
        && elastic::plan_grown(state, job, obs, used, alive, actions)
    {
        return;
    }
    actions.push(Action::Stopped {
        job_id: job.id.clone(),
        finalize,
    });
}

/// The newest pending checkpoint step of `job` whose every rank's part arrived.
fn newest_complete_step(job: &Job) -> Option<u64> {
    job.pending_parts
        .iter()
        .rev()
        .find(|(_, parts)| parts.len() == job.world_size() as usize)
        .map(|(step, _)| *step)
}

/// A running job with no stop requested and time left: fails the attempts found lost,
/// on an unhealthy GPU or hung (and re-plans next pass, once that is committed);
/// otherwise succeeds the job, finalizes a complete checkpoint step, or restarts its
/// failed ranks ([`plan_restart`]). Slots and GPUs a restart takes are added to `used`.
fn plan_running(
    state: &ClusterState,
    job: &Job,
    obs: &Observations,
    used: &mut Used,
    alive: &dyn Fn(&str) -> bool,
    jitter: &mut dyn FnMut() -> f64,
    actions: &mut Vec<Action>,
) {
    if fail_unhealthy_attempts(job, obs, actions) {
        return; // re-plan once the failures are committed
    }
    if flag_stragglers(job, obs, actions) {
        return; // a straggler's attempt fails: re-plan once that is committed
    }
    let failed: Vec<&RankRecord> = job
        .ranks
        .iter()
        .filter(|r| r.state == RankState::Failed)
        .collect();
    if !failed.is_empty() {
        plan_restart(state, job, obs, &failed, used, alive, jitter, actions);
    } else if job.all_ranks_succeeded() {
        actions.push(Action::Succeed {
            job_id: job.id.clone(),
            finalize: newest_complete_step(job),
        });
    } else if let Some(step) = newest_complete_step(job) {
        actions.push(Action::Finalize {
            job_id: job.id.clone(),
            step,
        });
    } else {
        elastic::plan_grow(state, job, obs, used, alive, actions);
    }
}

/// Pushes an [`Action::FlagStraggler`] for each running attempt of `job` found to be a
/// straggler and not flagged yet (with the job's action, never `off`); returns whether
/// one of them fails its attempt ([`StragglerAction::Restart`]).
fn flag_stragglers(job: &Job, obs: &Observations, actions: &mut Vec<Action>) -> bool {
    let action = job.spec.straggler.action;
    if obs.stragglers.is_empty() || action == StragglerAction::Off {
        return false;
    }
    let mut failing = false;
    for r in job
        .ranks
        .iter()
        .filter(|r| r.state == RankState::Running && !job.is_straggler(r.rank))
    {
        let (Some(worker_id), Some(v)) = (
            &r.worker_id,
            obs.stragglers
                .get(&AttemptKey::new(job.id.clone(), r.rank, r.attempt)),
        ) else {
            continue;
        };
        failing |= action == StragglerAction::Restart;
        actions.push(Action::FlagStraggler {
            job_id: job.id.clone(),
            flag: StragglerFlag {
                rank: r.rank,
                attempt: r.attempt,
                worker_id: worker_id.clone(),
                millisteps_per_s: v.millisteps_per_s,
                median_millisteps_per_s: v.median_millisteps_per_s,
                action,
                at_ms: obs.now_ms,
            },
        });
    }
    failing
}

/// Failure detection on a running job's pending and running attempts: pushes an
/// [`Action::FailRank`] for each one [`failure_cause`] finds a cause for, and returns
/// whether there was any.
fn fail_unhealthy_attempts(job: &Job, obs: &Observations, actions: &mut Vec<Action>) -> bool {
    let mut newly_failed = false;
    for r in &job.ranks {
        if !matches!(r.state, RankState::Running | RankState::Pending) {
            continue;
        }
        if let Some(cause) = failure_cause(job, r, obs) {
            newly_failed = true;
            actions.push(Action::FailRank {
                job_id: job.id.clone(),
                rank: r.rank,
                attempt: r.attempt,
                cause,
            });
        }
    }
    newly_failed
}

/// Why the pending or running attempt `r` of `job` has failed, as shown to users:
/// lost by its worker, placed on a GPU reported unhealthy, or (running only) without
/// progress for longer than the job's progress timeout since its first report, or
/// without a first report for longer than its startup timeout since its process
/// started; `None` when it has not.
fn failure_cause(job: &Job, r: &RankRecord, obs: &Observations) -> Option<String> {
    let key = AttemptKey::new(job.id.clone(), r.rank, r.attempt);
    if obs.lost.contains(&key) {
        Some(if r.state == RankState::Pending {
            "lost: its worker neither prepares nor runs it".to_string()
        } else {
            "lost: its worker no longer reports the process".to_string()
        })
    } else if let Some((uuid, why)) = r
        .gpus
        .iter()
        .find_map(|g| obs.unhealthy_gpus.get(g).map(|why| (g, why)))
    {
        Some(format!("GPU {uuid} is unhealthy {why}"))
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
        let startup_timeout_ms = job.spec.effective_startup_timeout_ms();
        (startup_timeout_ms > 0
            && obs
                .startup_ms
                .get(&key)
                .is_some_and(|s| *s > startup_timeout_ms))
        .then(|| {
            format!("no first report within {startup_timeout_ms} ms of start (startup timeout)")
        })
    }
}

/// A running job with `failed` ranks (not empty): fails the job when a program cannot
/// be executed or the restart budget is spent; otherwise restarts the ranks its policy's
/// scope names ([`Action::Restart`], their slots and GPUs added to `used`) once
/// [`restart_placements`] finds room for them, and plans nothing while it does not.
#[allow(clippy::too_many_arguments)]
fn plan_restart(
    state: &ClusterState,
    job: &Job,
    obs: &Observations,
    failed: &[&RankRecord],
    used: &mut Used,
    alive: &dyn Fn(&str) -> bool,
    jitter: &mut dyn FnMut() -> f64,
    actions: &mut Vec<Action>,
) {
    let causes = truncate(
        failed
            .iter()
            .filter_map(|r| r.failure.clone())
            .collect::<Vec<_>>()
            .join("; "),
    );
    // A program that cannot be executed (or an environment that cannot be built, or a
    // rank that exited EXIT_CANNOT_RUN) fails the same way on every restart: the job
    // fails now instead of spending its budget on it.
    if let Some(r) = failed.iter().find(|r| r.exec_failed) {
        let why = if r.exit_code == Some(cumulus_api::rank_env::EXIT_CANNOT_RUN) {
            "the rank found it cannot run on this cluster, and no restart can fix that \
             (its log says why)"
        } else {
            "the program cannot be executed, and no restart can fix that (check the \
             command, its path and permissions on the workers, or the job's environment, \
             then submit again)"
        };
        actions.push(Action::FailJob {
            job_id: job.id.clone(),
            cause: truncate(format!("{}: {why}", r.failure.clone().unwrap_or_default())),
        });
        return;
    }
    match fail_fast_verdict(job, obs, failed) {
        FailFast::No => {}
        FailFast::Wait => return, // the other ranks may still fail the same way
        FailFast::Fail(cause) => {
            actions.push(Action::FailJob {
                job_id: job.id.clone(),
                cause: truncate(cause),
            });
            return;
        }
    }
    // An elastic job whose failed ranks have no room continues with fewer ranks
    // (no budget spent; it waits when even its minimum does not fit).
    if job.spec.is_elastic() && restart_placements(state, job, obs, failed, used, alive).is_none() {
        elastic::plan_shrink(state, job, obs, &causes, used, alive, actions);
        return;
    }
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
    let Some((placements, gpus)) = restart_placements(state, job, obs, failed, used, alive) else {
        return; // wait for capacity
    };
    used.add(&placements, &gpus, job.spec.gpu_share_permille());
    let number = if agent_fault {
        job.agent_fault_restarts + 1
    } else {
        job.restarts_used + 1
    };
    let failed_at_ms = failed.iter().map(|r| r.exited_at_ms).max().unwrap_or(0);
    let (in_process, path_reason) = restart_path(job, obs, &placements);
    actions.push(Action::Restart {
        job_id: job.id.clone(),
        placements,
        gpus,
        failed_at_ms,
        delay_ms: policy.jittered_delay_ms(number, jitter()),
        cause: causes,
        agent_fault,
        in_process,
        path_reason,
    });
}

/// The path of a restart of `job` whose ranks go to `placements`: which ranks keep their
/// processes (an in-process restart: they re-enter their training function with the new
/// attempt) and why, or none (a full restart) and why not.
///
/// A group restart keeps every rank that is running in `cumulus.runtime.run` (it listens
/// for restarts: [`Observations::in_process`]), has reported progress in its current
/// attempt (so it has recovered from any earlier restart) and stays on its worker, plus
/// a failed rank the leader failed as hung while its process still listens. Any
/// other live rank rules it out: one that does not listen, or one still starting or
/// recovering (a failure during an in-process recovery falls back to a full restart).
/// A rank that exited gets a new process either way.
pub(super) fn restart_path(
    job: &Job,
    obs: &Observations,
    placements: &[(u32, String)],
) -> (Vec<u32>, String) {
    let full = |why: String| (Vec::new(), why);
    if job.spec.restart.scope != RestartScope::Group {
        return full("the job restarts only its failed ranks (restart scope rank)".into());
    }
    let placed: HashMap<u32, &str> = placements.iter().map(|(r, w)| (*r, w.as_str())).collect();
    let mut keep = Vec::new();
    let mut fresh = Vec::new();
    for r in &job.ranks {
        let key = AttemptKey::new(job.id.clone(), r.rank, r.attempt);
        let listening = obs.in_process.contains(&key);
        let stays = r.worker_id.is_some() && placed.get(&r.rank).copied() == r.worker_id.as_deref();
        match r.state {
            RankState::Running => {
                if !obs.progress_stall_ms.contains_key(&key) {
                    return full(format!(
                        "rank {} attempt {} had not reported progress yet (still starting or \
                         recovering from the previous restart)",
                        r.rank, r.attempt
                    ));
                }
                if !listening {
                    return full(format!(
                        "rank {} attempt {} does not run in cumulus.runtime.run",
                        r.rank, r.attempt
                    ));
                }
                if !stays {
                    return full(format!("rank {} moves to another worker", r.rank));
                }
                keep.push(r.rank);
            }
            RankState::Failed => {
                // Failed by the leader as hung, its process still there and listening.
                let hung = r.exit_code.is_none()
                    && r.signal.is_none()
                    && r.started_at_ms > 0
                    && r.failure.as_deref().is_some_and(|f| f.contains(": hung: "));
                if hung && listening && stays {
                    keep.push(r.rank);
                } else {
                    fresh.push(r.rank);
                }
            }
            RankState::Exited => {
                return full(format!(
                    "rank {} attempt {} has exited: no live process to keep",
                    r.rank, r.attempt
                ));
            }
            _ => {
                return full(format!(
                    "rank {} attempt {} had not started yet (still starting or recovering \
                     from the previous restart)",
                    r.rank, r.attempt
                ));
            }
        }
    }
    if keep.is_empty() {
        return full("no rank has a live process to keep".into());
    }
    let why = if fresh.is_empty() {
        format!("ranks {keep:?} keep their processes (cumulus.runtime.run)")
    } else {
        format!(
            "ranks {keep:?} keep their processes (cumulus.runtime.run); ranks {fresh:?} get new \
             ones"
        )
    };
    (keep, truncate(why))
}

/// What [`fail_fast_verdict`] decides for a job with failed ranks.
#[derive(Debug, PartialEq)]
enum FailFast {
    /// Restart (or fail for the budget) as usual.
    No,
    /// Plan nothing yet: the failed ranks fail fast so far, and a rank still live may
    /// end the same way within [`FAIL_FAST_WINDOW_MS`].
    Wait,
    /// Fail the job now, for this cause: no restart would end differently.
    Fail(String),
}

/// Whether `job`'s `failed` ranks (not empty) are a start no restart can fix: the job
/// did not opt out (`fail_fast: false`), it never restarted, and every rank of its
/// first attempt exited non-zero (no signal, no agent fault) within
/// [`FAIL_FAST_WINDOW_MS`] of its start, before any progress report, with the same
/// exit code and the same cause its agent reported (e.g. Python's "can't open file").
/// While the failed ranks qualify and another rank is still live and has not reported,
/// waits, at most [`FAIL_FAST_WINDOW_MS`] after the first of these exits.
fn fail_fast_verdict(job: &Job, obs: &Observations, failed: &[&RankRecord]) -> FailFast {
    if job.spec.no_fail_fast
        || job.restarts_used > 0
        || job.agent_fault_restarts > 0
        || job.ranks.iter().any(|r| r.attempt > 0)
    {
        return FailFast::No;
    }
    let quick = |r: &RankRecord| {
        r.signal.is_none()
            && !r.agent_fault
            && r.exit_code.is_some_and(|c| c != 0)
            && r.exit_cause.as_deref().is_some_and(|c| !c.is_empty())
            && r.last_progress == (0, 0)
            // A start not recorded yet means the process ended right after it.
            && (r.started_at_ms == 0
                || r.exited_at_ms.saturating_sub(r.started_at_ms) <= FAIL_FAST_WINDOW_MS)
    };
    let first = failed[0];
    let same = |r: &RankRecord| r.exit_code == first.exit_code && r.exit_cause == first.exit_cause;
    if !failed.iter().all(|r| quick(r) && same(r)) {
        return FailFast::No;
    }
    let live: Vec<&RankRecord> = job
        .ranks
        .iter()
        .filter(|r| r.state != RankState::Failed)
        .collect();
    if !live.is_empty() {
        let first_exit_ms = failed.iter().map(|r| r.exited_at_ms).min().unwrap_or(0);
        let waiting = live.iter().all(|r| {
            matches!(r.state, RankState::Pending | RankState::Running)
                && !obs.progress_stall_ms.contains_key(&AttemptKey::new(
                    job.id.clone(),
                    r.rank,
                    r.attempt,
                ))
        }) && obs.now_ms < first_exit_ms.saturating_add(FAIL_FAST_WINDOW_MS);
        return if waiting {
            FailFast::Wait
        } else {
            FailFast::No
        };
    }
    let world = job.world_size();
    let ranks = if world == 1 {
        "its only rank".to_string()
    } else {
        format!("all {world} ranks")
    };
    FailFast::Fail(format!(
        "{}; {ranks} of its first attempt exited this way within {} s of their start, \
         before any progress report, so a restart would fail the same way: the job failed \
         without one (submit with --no-fail-fast to restart such failures under the budget)",
        first.failure.clone().unwrap_or_default(),
        FAIL_FAST_WINDOW_MS / 1000
    ))
}

/// Where the ranks a restart of `job` covers (every rank for a group restart, the
/// `failed` ones for a rank restart) run next, sorted by rank: each stays on its worker
/// (and its GPUs) when that worker is alive, could start it, and its GPUs are healthy;
/// the rest are re-placed given `used`. `None` when there is no room for them yet.
fn restart_placements(
    state: &ClusterState,
    job: &Job,
    obs: &Observations,
    failed: &[&RankRecord],
    used: &Used,
    alive: &dyn Fn(&str) -> bool,
) -> Option<Placed> {
    let restarting: BTreeSet<u32> = match job.spec.restart.scope {
        RestartScope::Group => job.ranks.iter().map(|r| r.rank).collect(),
        RestartScope::Rank => failed.iter().map(|r| r.rank).collect(),
    };
    // Workers to move away from when others have room: those that could not start the
    // failed ranks, and those the job avoids (its stragglers').
    let faulty: BTreeSet<&str> = failed
        .iter()
        .filter(|r| r.agent_fault)
        .filter_map(|r| r.worker_id.as_deref())
        .chain(job.avoided_workers.iter().map(String::as_str))
        .collect();
    let demand = job.spec.gpu_demand();
    let share = job.spec.gpu_share_permille();
    let mut placements = Vec::new();
    let mut gpus = Vec::new();
    let mut homeless = Vec::new();
    for r in job.ranks.iter().filter(|r| restarting.contains(&r.rank)) {
        let gpus_ok = demand.is_none()
            || (r.gpus.len() == job.spec.gpus_per_rank as usize
                && r.gpus.iter().all(|g| !obs.unhealthy_gpus.contains_key(g)));
        match &r.worker_id {
            Some(w) if alive(w) && !faulty.contains(w.as_str()) && gpus_ok => {
                placements.push((r.rank, w.clone()));
                if demand.is_some() {
                    gpus.push((r.rank, r.gpus.clone()));
                }
            }
            _ => homeless.push(r.rank),
        }
    }
    if homeless.is_empty() {
        return Some((placements, gpus));
    }
    // Free the slots and GPUs of the ranks being restarted before placing the homeless
    // ones; count those of the ranks that stay.
    let mut used_without = used.clone();
    for r in job.ranks.iter().filter(|r| restarting.contains(&r.rank)) {
        if let (Some(w), RankState::Pending | RankState::Running) = (&r.worker_id, r.state) {
            if let Some(n) = used_without.slots.get_mut(w) {
                *n = n.saturating_sub(1);
            }
            for g in &r.gpus {
                if let Some(n) = used_without.gpus.get_mut(g) {
                    *n = n.saturating_sub(share);
                }
            }
        }
    }
    used_without.add(&placements, &gpus, share);
    let (more, more_gpus) =
        place_homeless(state, obs, job, &homeless, &faulty, &used_without, alive)?;
    placements.extend(more);
    gpus.extend(more_gpus);
    placements.sort();
    gpus.sort();
    Some((placements, gpus))
}

/// Places the `homeless` ranks of `job`'s restart given `used`: away from the `faulty`
/// workers (those that could not start its ranks) when others have room, back on them
/// otherwise (their trouble may have passed). `None` when neither fits.
fn place_homeless(
    state: &ClusterState,
    obs: &Observations,
    job: &Job,
    homeless: &[u32],
    faulty: &BTreeSet<&str>,
    used: &Used,
    alive: &dyn Fn(&str) -> bool,
) -> Option<Placed> {
    match job.spec.gpu_demand() {
        None => {
            let all = free_workers(state, alive, &used.slots);
            let mut elsewhere = all.clone();
            elsewhere.retain(|w| !faulty.contains(w.worker_id.as_str()));
            match shard_planner::place_ranks(homeless, &elsewhere) {
                Ok(Some(more)) => Some((more, Vec::new())),
                _ => match shard_planner::place_ranks(homeless, &all) {
                    Ok(Some(more)) => Some((more, Vec::new())),
                    _ => None,
                },
            }
        }
        Some(demand) => {
            let all = gpu_capacity(state, obs, alive, used);
            let mut elsewhere = all.clone();
            elsewhere.retain(|w| !faulty.contains(w.worker_id.as_str()));
            match shard_planner::place_gpu_ranks(homeless, &elsewhere, demand) {
                Ok(Some(more)) => Some(split_gpu_plan(more)),
                _ => match shard_planner::place_gpu_ranks(homeless, &all, demand) {
                    Ok(Some(more)) => Some(split_gpu_plan(more)),
                    _ => None,
                },
            }
        }
    }
}
