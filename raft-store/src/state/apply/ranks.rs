//! The ranks' arms of `apply`: a job's placement, its ranks' starts, exits and
//! failures, and restarts with their new placements.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::state::*;

/// How a rank attempt ended, as a [`Command::RankExited`] reports it.
pub(super) struct RankExit<'a> {
    /// Exit code, when it exited.
    pub(super) exit_code: Option<i32>,
    /// Signal, when killed.
    pub(super) signal: Option<i32>,
    /// Non-empty when it could not start.
    pub(super) spawn_error: &'a str,
    /// The agent claims the fault (a resource error, or its API was unreachable).
    pub(super) agent_fault: bool,
    /// What the agent saw of its rank-local API, behind an unreachable-agent exit.
    pub(super) agent_evidence: &'a str,
    /// The agent says no restart can fix it ([`RankExit::cannot_run`] decides).
    pub(super) exec_failed: bool,
    /// The last `(step, total_steps)` the rank reported.
    pub(super) progress: (u64, u64),
    /// What the attempt left in its output directory, stored in the blob store.
    pub(super) artifacts: Option<&'a BlobRef>,
    /// What the attempt died of, as its agent tells ("" for nothing).
    pub(super) cause: &'a str,
}

impl RankExit<'_> {
    /// Whether no restart can fix this exit: the agent says so, with a spawn error (the
    /// program cannot be executed, its environment could not be built) or with the exit
    /// code [`cumulus_api::rank_env::EXIT_CANNOT_RUN`] of a rank that found it cannot
    /// run here. The agent's flag alone, on any other exit, is ignored.
    fn cannot_run(&self) -> bool {
        self.exec_failed
            && (!self.spawn_error.is_empty()
                || (self.exit_code == Some(cumulus_api::rank_env::EXIT_CANNOT_RUN)
                    && self.signal.is_none()))
    }
}

impl ClusterState {
    /// `PlaceJob`: a pending job gets its workers (and GPUs) for every rank, checked by
    /// [`ClusterState::check_placements`]; it becomes running and its ranks pending.
    pub(super) fn place_job(
        &mut self,
        job_id: &str,
        placements: &[(u32, String)],
        gpus: &[RankGpus],
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        let Some(job) = self.jobs.get(job_id) else {
            return reject(format!("unknown job {job_id}"));
        };
        if job.state != JobState::Pending {
            return reject(format!(
                "job {job_id} is {}, not pending",
                job.state.as_str()
            ));
        }
        if job.spec.is_elastic() && placements.len() != job.ranks.len() {
            return self.place_elastic(job_id, (placements, gpus), at_ms, dirty);
        }
        let all: BTreeSet<u32> = (0..job.world_size()).collect();
        if let Err(e) = self.check_placements(job_id, &all, placements, gpus) {
            return reject(e.to_string());
        }
        let job = Arc::make_mut(self.jobs.get_mut(job_id).expect("checked above"));
        job.state = JobState::Running;
        job.run_started_at_ms = at_ms;
        assign_placements(job, placements, gpus, 0);
        dirty.insert(DirtyKey::Job(job_id.to_string()));
        Response::Ok
    }

    /// `RankStarted`: the current attempt of a rank of a running job, placed on
    /// `worker_id` and still pending, is running with `pid` since `at_ms`.
    pub(super) fn rank_started(
        &mut self,
        job_id: &str,
        (rank, attempt): (u32, u32),
        worker_id: &str,
        pid: u32,
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        self.with_current_rank(job_id, rank, attempt, Some(worker_id), dirty, |_, r| {
            if r.state != RankState::Pending {
                return reject(format!(
                    "rank {} attempt {} is not pending",
                    r.rank, r.attempt
                ));
            }
            r.state = RankState::Running;
            r.pid = pid;
            r.started_at_ms = at_ms;
            Response::Ok
        })
    }

    /// `RankExited`: of a job that already ended, records the exit only
    /// ([`ClusterState::final_exit`]). Otherwise the current attempt of a rank of a
    /// running job, placed on `worker_id` and not ended yet, records its exit code,
    /// signal, time and last progress; exit 0 with no spawn error makes it exited, else
    /// it failed, with the agent's fault (a spawn error, or an unreachable agent with the
    /// agent's evidence), whether it cannot run ([`RankExit::cannot_run`]), and the
    /// failure in words. An accepted exit (either kind) records the attempt's artifacts
    /// when it names a valid blob ([`Job::record_artifact`]).
    pub(super) fn rank_exited(
        &mut self,
        job_id: &str,
        (rank, attempt): (u32, u32),
        worker_id: &str,
        exit: &RankExit<'_>,
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        // A job that already ended still records its ranks' exits.
        let resp = if self.jobs.get(job_id).is_some_and(|j| j.state.is_terminal()) {
            self.final_exit(
                job_id,
                (rank, attempt),
                worker_id,
                (exit.exit_code, exit.signal),
                exit.progress,
                at_ms,
                dirty,
            )
        } else {
            self.live_exit(job_id, (rank, attempt), worker_id, exit, at_ms, dirty)
        };
        if resp == Response::Ok
            && let Some(blob) = exit.artifacts.filter(|b| b.is_valid())
            && let Some(job) = self.jobs.get_mut(job_id)
        {
            Arc::make_mut(job).record_artifact(rank, attempt, blob);
            dirty.insert(DirtyKey::Job(job_id.to_string()));
        }
        resp
    }

    /// The exit of the current attempt of a rank of a live job ([`Self::rank_exited`]).
    fn live_exit(
        &mut self,
        job_id: &str,
        (rank, attempt): (u32, u32),
        worker_id: &str,
        exit: &RankExit<'_>,
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        self.with_current_rank(job_id, rank, attempt, Some(worker_id), dirty, |_, r| {
            if !matches!(r.state, RankState::Pending | RankState::Running) {
                return reject(format!(
                    "rank {} attempt {} already ended",
                    r.rank, r.attempt
                ));
            }
            r.exit_code = exit.exit_code;
            r.signal = exit.signal;
            r.exited_at_ms = at_ms;
            r.last_progress = exit.progress;
            if exit.exit_code == Some(0) && exit.spawn_error.is_empty() {
                r.state = RankState::Exited;
                r.failure = None;
                r.exit_cause = None;
            } else {
                r.state = RankState::Failed;
                // A rank that could not reach its agent is the agent's fault only
                // with the agent's own evidence of it.
                let unreachable = exit.exit_code
                    == Some(cumulus_api::rank_env::EXIT_AGENT_UNREACHABLE)
                    && exit.spawn_error.is_empty()
                    && !exit.agent_evidence.is_empty();
                r.agent_fault = exit.agent_fault && (!exit.spawn_error.is_empty() || unreachable);
                r.exec_failed = exit.cannot_run();
                let cause = cumulus_api::text::bounded_line(
                    exit.cause,
                    cumulus_api::limits::MAX_EXIT_CAUSE_BYTES,
                );
                r.exit_cause = (!cause.is_empty()).then_some(cause);
                r.failure = Some(exit_failure(r, worker_id, exit, unreachable));
            }
            Response::Ok
        })
    }

    /// Records the exit of a rank of a job that already ended (failed, cancelled, or
    /// succeeded while this rank was still stopping), so that its status stops showing
    /// a process that is gone. Changes nothing else of the job. Rejects a stale attempt,
    /// another worker's report, or a rank that already ended.
    #[allow(clippy::too_many_arguments)]
    fn final_exit(
        &mut self,
        job_id: &str,
        (rank, attempt): (u32, u32),
        worker_id: &str,
        (exit_code, signal): (Option<i32>, Option<i32>),
        last_progress: (u64, u64),
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return reject(format!("unknown job {job_id}"));
        };
        let Some(r) = job.ranks.get(rank as usize) else {
            return reject(format!("job {job_id} has no rank {rank}"));
        };
        if r.attempt != attempt
            || r.worker_id.as_deref() != Some(worker_id)
            || !matches!(r.state, RankState::Pending | RankState::Running)
        {
            return reject(format!(
                "job {job_id} is {}: rank {rank} attempt {attempt} is not live on {worker_id}",
                job.state.as_str()
            ));
        }
        let r = &mut Arc::make_mut(job).ranks[rank as usize];
        r.exit_code = exit_code;
        r.signal = signal;
        r.exited_at_ms = at_ms;
        r.last_progress = last_progress;
        r.state = if exit_code == Some(0) {
            RankState::Exited
        } else {
            RankState::Failed
        };
        dirty.insert(DirtyKey::Job(job_id.to_string()));
        Response::Ok
    }

    /// `RankFailed`: the leader declares the current attempt of a rank of a running job
    /// failed (hung, lost by its agent) for `cause`; rejected once the attempt ended.
    pub(super) fn rank_failed(
        &mut self,
        job_id: &str,
        (rank, attempt): (u32, u32),
        cause: &str,
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        self.with_current_rank(job_id, rank, attempt, None, dirty, |_, r| {
            if !matches!(r.state, RankState::Pending | RankState::Running) {
                return reject(format!(
                    "rank {} attempt {} already ended",
                    r.rank, r.attempt
                ));
            }
            r.state = RankState::Failed;
            r.exited_at_ms = at_ms;
            r.failure = Some(format!("rank {} attempt {}: {cause}", r.rank, r.attempt));
            Response::Ok
        })
    }

    /// `ScheduleRestart`: a running job with no stop in flight and a failed rank restarts
    /// the ranks its scope names, on new placements, after `delay_ms` (at least the policy's
    /// backoff), from a kept committed step or none. A budgeted restart needs budget left; one
    /// for agent faults needs every failed rank to be the agent's fault and stays within
    /// [`MAX_AGENT_FAULT_RESTARTS`]. Newer committed steps than the resume step and the
    /// replaced attempts' pending parts are forgotten; a group restart gets a new port.
    /// The `in_process` ranks (a group restart only) keep their processes
    /// ([`check_in_process`]): the restart's path is then [`RestartPath::InProcess`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn schedule_restart(
        &mut self,
        job_id: &str,
        (placements, gpus): (&[(u32, String)], &[RankGpus]),
        failed_at_ms: u64,
        delay_ms: u64,
        cause: &str,
        resume_step: Option<u64>,
        agent_fault: bool,
        (in_process, path_reason): (&[u32], &str),
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        let Some(job) = self.jobs.get(job_id) else {
            return reject(format!("unknown job {job_id}"));
        };
        if job.state != JobState::Running {
            return reject(format!(
                "job {job_id} is {}, not running",
                job.state.as_str()
            ));
        }
        if let Some(stop) = &job.stop {
            return reject(format!(
                "job {job_id} is stopping ({}): its ranks are not restarted",
                stop.action
            ));
        }
        if agent_fault {
            if job.agent_fault_restarts >= MAX_AGENT_FAULT_RESTARTS {
                return reject(format!(
                    "job {job_id} had its {MAX_AGENT_FAULT_RESTARTS} restarts for agent errors"
                ));
            }
            if !job
                .ranks
                .iter()
                .filter(|r| r.state == RankState::Failed)
                .all(|r| r.agent_fault)
            {
                return reject("a rank failed for its own reasons: the restart spends budget");
            }
        } else if job.restarts_used >= job.spec.restart.max_restarts {
            return reject(format!("job {job_id} has no restart budget left"));
        }
        // Budgeted restarts count in `restarts_used`, agent-fault ones apart; the backoff
        // grows with each kind's own count.
        let (number, backoff_number) = if agent_fault {
            (job.restarts_used, job.agent_fault_restarts + 1)
        } else {
            (job.restarts_used + 1, job.restarts_used + 1)
        };
        let policy = job.spec.restart.clone();
        if delay_ms < policy.min_delay_ms(backoff_number) {
            return reject(format!(
                "restart delay {delay_ms} ms is below the policy's minimum of {} ms",
                policy.min_delay_ms(backoff_number)
            ));
        }
        if !job.ranks.iter().any(|r| r.state == RankState::Failed) {
            return reject("no rank of the job has failed");
        }
        let ranks: BTreeSet<u32> = placements.iter().map(|(r, _)| *r).collect();
        let required: BTreeSet<u32> = match policy.scope {
            RestartScope::Group => (0..job.world_size()).collect(),
            RestartScope::Rank => job
                .ranks
                .iter()
                .filter(|r| r.state == RankState::Failed)
                .map(|r| r.rank)
                .collect(),
        };
        if ranks != required {
            return reject(format!(
                "restart must cover ranks {required:?} for scope {:?}",
                policy.scope
            ));
        }
        if let Some(step) = resume_step
            && !job.committed.contains_key(&step)
        {
            return reject(format!("step {step} is not a kept committed step"));
        }
        if let Err(e) = self.check_placements(job_id, &ranks, placements, gpus) {
            return reject(e.to_string());
        }
        if let Err(e) = check_in_process(job, policy.scope, placements, in_process) {
            return reject(e);
        }
        let in_process: BTreeSet<u32> = in_process.iter().copied().collect();
        let job = Arc::make_mut(self.jobs.get_mut(job_id).expect("checked above"));
        job.restarts_used = number;
        if agent_fault {
            job.agent_fault_restarts += 1;
        }
        // Resuming from an older step than the newest committed one means the newer
        // steps failed verification: forget them, so the step can be committed again.
        match resume_step {
            Some(step) => {
                job.committed.retain(|s, _| *s <= step);
                job.committed_step = Some(step);
            }
            None => {
                job.committed.clear();
                job.committed_step = None;
            }
        }
        // Parts written by the attempts being replaced never mix with the new attempts'.
        for parts in job.pending_parts.values_mut() {
            parts.retain(|rank, _| !ranks.contains(rank));
        }
        job.pending_parts.retain(|_, parts| !parts.is_empty());
        let not_before_ms = failed_at_ms.saturating_add(delay_ms);
        job.restarts.push(RestartRecord {
            number,
            failed_at_ms,
            delay_ms,
            not_before_ms,
            cause: cause.to_string(),
            ranks: ranks.iter().copied().collect(),
            resume_step,
            agent_fault,
            path: if in_process.is_empty() {
                RestartPath::Full
            } else {
                RestartPath::InProcess
            },
            path_reason: cumulus_api::text::bounded_line(
                path_reason,
                cumulus_api::limits::MAX_EXIT_CAUSE_BYTES,
            ),
            in_process_ranks: in_process.iter().copied().collect(),
        });
        if policy.scope == RestartScope::Group {
            // A new port per restart of either kind (the sum only grows).
            job.master_port = master_port(job.seq, number + job.agent_fault_restarts);
        }
        for i in 0..job.ranks.len() {
            if !ranks.contains(&job.ranks[i].rank) {
                continue;
            }
            let resume = job.resume_point(resume_step, job.ranks[i].rank);
            let r = &mut job.ranks[i];
            r.new_attempt(resume);
            r.not_before_ms = not_before_ms;
            r.in_process = in_process.contains(&r.rank);
        }
        assign_placements(job, placements, gpus, not_before_ms);
        dirty.insert(DirtyKey::Job(job_id.to_string()));
        Response::Ok
    }
}

/// Checks the ranks an in-process restart keeps in their processes: only a group
/// restart keeps any, and each one is a rank it restarts, placed again on its current
/// worker, whose current attempt is running, or was failed by the leader (hung) without
/// an exit of its process.
fn check_in_process(
    job: &Job,
    scope: RestartScope,
    placements: &[(u32, String)],
    in_process: &[u32],
) -> Result<(), String> {
    if in_process.is_empty() {
        return Ok(());
    }
    if scope != RestartScope::Group {
        return Err("only a group restart keeps ranks in their processes".into());
    }
    let placed: BTreeMap<u32, &str> = placements.iter().map(|(r, w)| (*r, w.as_str())).collect();
    let mut seen = BTreeSet::new();
    for &rank in in_process {
        if !seen.insert(rank) {
            return Err(format!("rank {rank} is named twice as kept in its process"));
        }
        let Some(r) = job.ranks.get(rank as usize) else {
            return Err(format!("job {} has no rank {rank}", job.id));
        };
        if r.worker_id.as_deref().is_none() || placed.get(&rank).copied() != r.worker_id.as_deref()
        {
            return Err(format!(
                "rank {rank} is kept in its process but not placed again on its worker"
            ));
        }
        let alive = match r.state {
            RankState::Running => true,
            RankState::Failed => r.exit_code.is_none() && r.signal.is_none() && r.started_at_ms > 0,
            _ => false,
        };
        if !alive {
            return Err(format!(
                "rank {rank} attempt {} has no live process to keep",
                r.attempt
            ));
        }
    }
    Ok(())
}

/// The failure of a rank attempt that did not exit cleanly, in words: an unreachable
/// agent, a resource error of the agent, a spawn error, a signal or an exit code; the
/// last three followed by what it died of (`r.exit_cause`) when its agent could tell.
fn exit_failure(r: &RankRecord, worker_id: &str, exit: &RankExit<'_>, unreachable: bool) -> String {
    let how = exit_how(r, worker_id, exit, unreachable);
    match &r.exit_cause {
        Some(cause) if !r.agent_fault && exit.spawn_error.is_empty() => format!("{how}: {cause}"),
        _ => how,
    }
}

/// [`exit_failure`] without the cause.
fn exit_how(r: &RankRecord, worker_id: &str, exit: &RankExit<'_>, unreachable: bool) -> String {
    let spawn_error = exit.spawn_error;
    let agent_evidence = exit.agent_evidence;
    let (exit_code, signal) = (exit.exit_code, exit.signal);
    if r.agent_fault && unreachable {
        format!(
            "rank {} attempt {} exited with code {} on {worker_id}: it \
             could not reach its agent, for the agent's fault (not the \
             rank's): {agent_evidence}",
            r.rank,
            r.attempt,
            cumulus_api::rank_env::EXIT_AGENT_UNREACHABLE
        )
    } else if r.agent_fault {
        format!(
            "rank {} attempt {} could not start on {worker_id}, for a \
         resource error of the agent (not the rank's): {spawn_error}",
            r.rank, r.attempt
        )
    } else if !spawn_error.is_empty() {
        format!(
            "rank {} attempt {} could not start: {spawn_error}",
            r.rank, r.attempt
        )
    } else if r.exec_failed {
        format!(
            "rank {} attempt {} exited with code {} on {worker_id}: it cannot run there",
            r.rank,
            r.attempt,
            cumulus_api::rank_env::EXIT_CANNOT_RUN
        )
    } else if let Some(sig) = signal {
        format!(
            "rank {} attempt {} was killed by signal {sig}",
            r.rank, r.attempt
        )
    } else {
        format!(
            "rank {} attempt {} exited with code {}",
            r.rank,
            r.attempt,
            exit_code.map_or("?".to_string(), |c| c.to_string())
        )
    }
}

/// Places the given ranks (a fresh attempt, state Pending) and recomputes local ranks
/// of the whole job.
pub(in crate::state) fn assign_placements(
    job: &mut Job,
    placements: &[(u32, String)],
    gpus: &[RankGpus],
    not_before_ms: u64,
) {
    let gpus: BTreeMap<u32, &Vec<String>> = gpus.iter().map(|(r, g)| (*r, g)).collect();
    for (rank, worker) in placements {
        let r = &mut job.ranks[*rank as usize];
        r.gpus = gpus.get(rank).map(|g| (*g).clone()).unwrap_or_default();
        r.worker_id = Some(worker.clone());
        r.state = RankState::Pending;
        r.not_before_ms = not_before_ms;
        r.attempt_workers.push((r.attempt, worker.clone()));
    }
    let current: Vec<(u32, String)> = job
        .ranks
        .iter()
        .filter_map(|r| r.worker_id.clone().map(|w| (r.rank, w)))
        .collect();
    if current.len() == job.ranks.len()
        && let Ok(locals) = shard_planner::local_ranks(&current)
    {
        for (r, (local_rank, local_world_size)) in job.ranks.iter_mut().zip(locals) {
            r.local_rank = local_rank;
            r.local_world_size = local_world_size;
        }
    }
}
