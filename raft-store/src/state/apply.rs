//! [`ClusterState::apply`]: the pure, deterministic application of a [`Command`].
//!
//! This file is the dispatch: [`ClusterState::apply`] (which keeps the job index
//! current), `apply_one`'s match with one named method per command, `Batch`, and the two
//! guards most arms go through (`with_live_job`, `with_current_rank`). The arms live by
//! concern under `apply/`: `jobs.rs` (submit and the job lifecycle), `users.rs`,
//! `workers.rs`, `ranks.rs` (placement, rank starts, exits and failures, restarts) and
//! `checkpoints.rs`. Each arm validates before it changes anything and records the keys
//! it touched in `dirty`. The read-only capacity queries that placement checks share with
//! the leader are in `capacity.rs`.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::*;

mod checkpoints;
mod jobs;
pub(super) mod ranks;
mod stragglers;
mod users;
mod workers;

pub use jobs::master_port;
use ranks::RankExit;

impl ClusterState {
    /// Job ids by lifecycle class.
    pub fn job_index(&self) -> &JobIndex {
        &self.index
    }

    /// Rebuilds the job index from `jobs` (after filling `jobs` other than by `apply`).
    pub fn rebuild_index(&mut self) {
        let mut index = JobIndex::default();
        for (id, job) in &self.jobs {
            index.update(id, Some(job));
        }
        self.index = index;
    }

    /// Applies one command; returns the response and records touched keys in `dirty`.
    /// Deterministic: the same state and command give the same result on every replica.
    pub fn apply(&mut self, cmd: &Command, dirty: &mut BTreeSet<DirtyKey>) -> Response {
        if matches!(cmd, Command::Batch { .. }) {
            // Each command of the batch updates the index itself.
            return self.apply_one(cmd, dirty);
        }
        let mut touched = BTreeSet::new();
        let response = self.apply_one(cmd, &mut touched);
        for key in &touched {
            if let DirtyKey::Job(id) = key {
                if let Some(job) = self.jobs.get_mut(id)
                    && self.index.class_changed(id, job.state)
                {
                    let job = Arc::make_mut(job);
                    job.state_changes = job.state_changes.saturating_add(1);
                }
                self.index.update(id, self.jobs.get(id).map(|j| &**j));
            }
        }
        dirty.append(&mut touched);
        response
    }

    fn apply_one(&mut self, cmd: &Command, dirty: &mut BTreeSet<DirtyKey>) -> Response {
        match cmd {
            Command::SubmitJob {
                request_id,
                spec,
                shards,
                submitted_at_ms,
                owner,
            } => self.submit(request_id, (spec, owner), shards, *submitted_at_ms, dirty),
            Command::CreateUser {
                name,
                role,
                secret_sha256,
                created_by,
                at_ms,
            } => self.create_user(name, *role, secret_sha256, created_by, *at_ms),
            Command::RevokeUser { name } => self.revoke_user(name),
            Command::CancelJob { job_id, at_ms } => self.cancel_job(job_id, *at_ms, dirty),
            Command::PauseJob { job_id, at_ms } => self.pause_job(job_id, *at_ms, dirty),
            Command::ResumeJob { job_id, at_ms } => self.resume_job(job_id, *at_ms, dirty),
            Command::RequestStop {
                job_id,
                action,
                at_ms,
            } => self.request_stop(job_id, *action, *at_ms, dirty),
            Command::RequestGrow { job_id, at_ms } => self.request_grow(job_id, *at_ms, dirty),
            Command::JobStopped { job_id, at_ms } => self.job_stopped(job_id, *at_ms, dirty),
            Command::DeleteJob { job_id } => self.delete_job(job_id, dirty),
            Command::RegisterWorker {
                worker_id,
                host,
                http_addr,
                slots,
                gpus,
                at_ms,
            } => self.register_worker(worker_id, (host, http_addr), (*slots, gpus), *at_ms, dirty),
            Command::ExpireWorker { worker_id, at_ms } => {
                self.expire_worker(worker_id, *at_ms, dirty)
            }
            Command::PlaceJob {
                job_id,
                placements,
                gpus,
                at_ms,
            } => self.place_job(job_id, placements, gpus, *at_ms, dirty),
            Command::RankStarted {
                job_id,
                rank,
                attempt,
                worker_id,
                pid,
                at_ms,
            } => self.rank_started(job_id, (*rank, *attempt), worker_id, *pid, *at_ms, dirty),
            Command::RankExited {
                job_id,
                rank,
                attempt,
                worker_id,
                exit_code,
                signal,
                spawn_error,
                agent_fault,
                agent_evidence,
                exec_failed,
                step,
                total_steps,
                artifacts,
                cause,
                at_ms,
            } => {
                let exit = RankExit {
                    exit_code: *exit_code,
                    signal: *signal,
                    spawn_error,
                    agent_fault: *agent_fault,
                    agent_evidence,
                    exec_failed: *exec_failed,
                    progress: (*step, *total_steps),
                    artifacts: artifacts.as_ref(),
                    cause,
                };
                self.rank_exited(job_id, (*rank, *attempt), worker_id, &exit, *at_ms, dirty)
            }
            Command::RankFailed {
                job_id,
                rank,
                attempt,
                cause,
                at_ms,
            } => self.rank_failed(job_id, (*rank, *attempt), cause, *at_ms, dirty),
            Command::ScheduleRestart {
                job_id,
                placements,
                gpus,
                failed_at_ms,
                delay_ms,
                cause,
                resume_step,
                agent_fault,
                in_process,
                path_reason,
            } => self.schedule_restart(
                job_id,
                (placements, gpus),
                *failed_at_ms,
                *delay_ms,
                cause,
                *resume_step,
                *agent_fault,
                (in_process, path_reason),
                dirty,
            ),
            Command::ResizeJob {
                job_id,
                placements,
                gpus,
                resume_step,
                cause,
                at_ms,
            } => self.resize_job(
                job_id,
                (placements, gpus),
                *resume_step,
                cause,
                *at_ms,
                dirty,
            ),
            Command::FailJob {
                job_id,
                cause,
                at_ms,
            } => self.fail_job(job_id, cause, *at_ms, dirty),
            Command::CheckpointPartCommitted { job_id, step, part } => {
                self.part_committed(job_id, *step, part, dirty)
            }
            Command::CheckpointCommitted {
                job_id,
                step,
                at_ms: _,
            } => self.checkpoint_committed(job_id, *step, dirty),
            Command::JobSucceeded { job_id, at_ms } => self.job_succeeded(job_id, *at_ms, dirty),
            Command::FlagStraggler { job_id, flag } => self.flag_straggler(job_id, flag, dirty),
            Command::RecordProgress { samples } => self.record_progress(samples, dirty),
            Command::Batch { commands } => self.batch(commands, dirty),
        }
    }

    /// `Batch`: at most [`MAX_BATCH_COMMANDS`] commands and no batch among them (else
    /// nothing is applied); applies each in order, each with its own response.
    fn batch(&mut self, commands: &[Command], dirty: &mut BTreeSet<DirtyKey>) -> Response {
        if commands.len() > MAX_BATCH_COMMANDS {
            return reject(format!(
                "a batch of {} commands is above the limit of {MAX_BATCH_COMMANDS}",
                commands.len()
            ));
        }
        if commands.iter().any(|c| matches!(c, Command::Batch { .. })) {
            return reject("a batch must not contain a batch");
        }
        Response::Batch {
            responses: commands.iter().map(|c| self.apply(c, dirty)).collect(),
        }
    }

    /// Runs `f` on a job that is not finished; rejects an unknown or finished job.
    /// Records the job in `dirty` only when `f` changed it.
    fn with_live_job(
        &mut self,
        job_id: &str,
        dirty: &mut BTreeSet<DirtyKey>,
        f: impl FnOnce(&mut Job) -> Response,
    ) -> Response {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return reject(format!("unknown job {job_id}"));
        };
        if job.state.is_terminal() {
            return reject(format!("job {job_id} is already {}", job.state.as_str()));
        }
        // A pointer to the job as it was: `make_mut` copies the job only while a snapshot
        // (or this comparison) still shares it.
        let before = Arc::clone(job);
        let resp = f(Arc::make_mut(job));
        if **job != *before {
            dirty.insert(DirtyKey::Job(job_id.to_string()));
        }
        resp
    }

    /// Runs `f` on the current attempt of a rank; rejects a stale attempt, another
    /// worker's report, or a job that is not running.
    fn with_current_rank(
        &mut self,
        job_id: &str,
        rank: u32,
        attempt: u32,
        worker_id: Option<&str>,
        dirty: &mut BTreeSet<DirtyKey>,
        f: impl FnOnce(&JobSpec, &mut RankRecord) -> Response,
    ) -> Response {
        self.with_live_job(job_id, dirty, |job| {
            if job.state != JobState::Running {
                return reject(format!("job {job_id} is {}", job.state.as_str()));
            }
            let Some(r) = job.ranks.get_mut(rank as usize) else {
                return reject(format!("job {job_id} has no rank {rank}"));
            };
            if r.attempt != attempt {
                return reject(format!(
                    "stale attempt: rank {rank} of {job_id} is at attempt {}, not {attempt}",
                    r.attempt
                ));
            }
            if let Some(w) = worker_id
                && r.worker_id.as_deref() != Some(w)
            {
                return reject(format!(
                    "rank {rank} attempt {attempt} of {job_id} is not placed on {w}"
                ));
            }
            f(&job.spec, r)
        })
    }
}
