//! The job lifecycle's arms of `apply`: submit (with the fork point of a resumed job and
//! the eviction of old finished jobs), cancel, pause, resume, the leader's stop requests
//! and their end, fail, succeed and delete.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::state::*;

impl ClusterState {
    /// `SubmitJob`: checks the request id (an id seen before answers its job again, or
    /// is rejected with a different spec), the spec, the shard count and plan, and the fork
    /// point of a resumed job; then creates the job `job-NNNNNN` (pending, every rank
    /// unplaced), records its request id and evicts old finished jobs past the bounds.
    /// Dirty: `Meta`, the job, the request id, and every evicted job and request id.
    pub(super) fn submit(
        &mut self,
        request_id: &str,
        (spec, owner): (&JobSpec, &str),
        shards: &[String],
        submitted_at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        if request_id.is_empty() || request_id.len() > MAX_REQUEST_ID_BYTES {
            return reject(format!(
                "request id must be 1..={MAX_REQUEST_ID_BYTES} bytes"
            ));
        }
        if let Some(job_id) = self.request_ids.get(request_id) {
            return match self.jobs.get(job_id) {
                Some(job) if job.spec != *spec => reject(format!(
                    "request id {request_id} was already used for {job_id} with a different spec"
                )),
                _ => Response::JobSubmitted {
                    job_id: job_id.clone(),
                    created: false,
                },
            };
        }
        if let Err(e) = spec.validate(MAX_WORLD_SIZE) {
            return reject(e.to_string());
        }
        if shards.len() > MAX_SHARDS {
            return reject(format!(
                "{} shards is above the limit of {MAX_SHARDS}",
                shards.len()
            ));
        }
        let plan = match shard_planner::assign_shards(shards, spec.world_size) {
            Ok(p) => p,
            Err(e) => return reject(format!("shard plan: {e}")),
        };
        let fork = match &spec.resume_from {
            Some(from) => match self.fork_point(spec, from, &plan) {
                Ok(fork) => Some(fork),
                Err(why) => return reject(format!("cannot resume from {}: {why}", from.job_id)),
            },
            None => None,
        };
        let seq = self.next_job_seq + 1;
        self.next_job_seq = seq;
        dirty.insert(DirtyKey::Meta);
        let job_id = format!("job-{seq:06}");
        let ranks = (0..spec.world_size)
            .map(|rank| RankRecord {
                rank,
                attempt: 0,
                worker_id: None,
                state: RankState::Unplaced,
                local_rank: 0,
                local_world_size: 0,
                exit_code: None,
                signal: None,
                failure: None,
                started_at_ms: 0,
                exited_at_ms: 0,
                pid: 0,
                not_before_ms: 0,
                resume_step: fork.as_ref().map(|f| f.step),
                resume_dir: fork
                    .as_ref()
                    .and_then(|f| f.dirs.get(rank as usize).cloned())
                    .unwrap_or_default(),
                resume_job_id: fork.as_ref().map(|f| f.job_id.clone()).unwrap_or_default(),
                attempt_workers: Vec::new(),
                agent_fault: false,
                exec_failed: false,
                exit_cause: None,
                last_progress: (0, 0),
                gpus: Vec::new(),
                in_process: false,
            })
            .collect();
        let job = Job {
            id: job_id.clone(),
            seq,
            request_id: request_id.to_string(),
            spec: spec.clone(),
            shard_plan: plan,
            shard_count: shards.len() as u32,
            state: JobState::Pending,
            submitted_at_ms,
            finished_at_ms: 0,
            failure_cause: None,
            ranks,
            restarts_used: 0,
            restarts: Vec::new(),
            agent_fault_restarts: 0,
            master_port: master_port(seq, 0),
            pending_parts: BTreeMap::new(),
            committed: BTreeMap::new(),
            committed_step: None,
            owner: owner.to_string(),
            stop: None,
            running_ms: 0,
            run_started_at_ms: 0,
            fork,
            paused_ms: 0,
            paused_at_ms: 0,
            state_changes: 0,
            stragglers: Vec::new(),
            avoided_workers: Vec::new(),
            artifacts: Vec::new(),
            resizes: Vec::new(),
            data_plans: Vec::new(),
            resize_count: 0,
            attempt_floor: 0,
            removed_rank_workers: BTreeMap::new(),
        };
        // Indexed now (its fixed size computed once, kept by the index), so that the
        // eviction below counts it.
        self.index.update(&job_id, Some(&job));
        self.jobs.insert(job_id.clone(), Arc::new(job));
        self.request_ids
            .insert(request_id.to_string(), job_id.clone());
        dirty.insert(DirtyKey::Job(job_id.clone()));
        dirty.insert(DirtyKey::RequestId(request_id.to_string()));
        self.evict_old_jobs(MAX_JOBS_RETAINED, MAX_STATE_BYTES, dirty);
        Response::JobSubmitted {
            job_id,
            created: true,
        }
    }

    /// The fork point of a job submitted with `spec` (shard plan `plan`) resuming `from`:
    /// a kept committed step of that job, which has the same world size, shard plan and
    /// checkpoint target.
    ///
    /// # Errors
    /// Why it cannot resume there, as the user reads it.
    fn fork_point(
        &self,
        spec: &JobSpec,
        from: &ResumeFrom,
        plan: &[Vec<String>],
    ) -> Result<ForkPoint, String> {
        let Some(step) = from.step else {
            return Err("no step was named".into());
        };
        let source = self
            .jobs
            .get(&from.job_id)
            .ok_or_else(|| "there is no such job".to_string())?;
        let Some(parts) = source.committed.get(&step) else {
            let kept: Vec<String> = source.committed.keys().map(u64::to_string).collect();
            return Err(format!(
                "step {step} is not one of its committed steps (kept: {})",
                if kept.is_empty() {
                    "none".to_string()
                } else {
                    kept.join(", ")
                }
            ));
        };
        if source.spec.world_size != spec.world_size {
            return Err(format!(
                "it has world size {}, this job {}: a resumed job keeps the world size",
                source.spec.world_size, spec.world_size
            ));
        }
        if source.shard_plan != plan {
            return Err(format!(
                "its shard plan differs ({} shards of {}, this job {} of {}): a resumed job keeps the dataset",
                source.shard_count,
                if source.spec.dataset.is_empty() {
                    "no dataset"
                } else {
                    source.spec.dataset.as_str()
                },
                plan.iter().map(Vec::len).sum::<usize>(),
                if spec.dataset.is_empty() {
                    "no dataset"
                } else {
                    spec.dataset.as_str()
                },
            ));
        }
        if source.spec.ckpt_dir != spec.ckpt_dir || source.spec.ckpt_url != spec.ckpt_url {
            return Err(format!(
                "its checkpoints are at {:?} {:?}, this job's at {:?} {:?}: a resumed job keeps the checkpoint target",
                source.spec.ckpt_dir, source.spec.ckpt_url, spec.ckpt_dir, spec.ckpt_url
            ));
        }
        if parts.len() != spec.world_size as usize {
            return Err(format!(
                "step {step} has {} parts for {} ranks",
                parts.len(),
                spec.world_size
            ));
        }
        Ok(ForkPoint {
            job_id: source.id.clone(),
            step,
            dirs: parts.iter().map(|p| p.dir.clone()).collect(),
        })
    }

    /// Drops the oldest terminal jobs while more than `max_jobs` are kept or their
    /// estimated size ([`JobIndex::total_bytes`]) is above `max_bytes`: the bounded
    /// state ([`MAX_JOBS_RETAINED`], [`MAX_STATE_BYTES`]). Pending and running jobs are
    /// never dropped (the leader refuses submits instead).
    pub(in crate::state) fn evict_old_jobs(
        &mut self,
        max_jobs: usize,
        max_bytes: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) {
        let excess = self.jobs.len().saturating_sub(max_jobs);
        let mut bytes = self.index.total_bytes();
        if excess == 0 && bytes <= max_bytes {
            return;
        }
        let mut victims: Vec<(String, String)> = Vec::new();
        for id in &self.index.terminal {
            if victims.len() >= excess && bytes <= max_bytes {
                break;
            }
            let Some(job) = self.jobs.get(id) else {
                continue;
            };
            bytes = bytes.saturating_sub(self.index.job_bytes(id));
            victims.push((job.id.clone(), job.request_id.clone()));
        }
        for (job_id, request_id) in victims {
            self.jobs.remove(&job_id);
            self.histories.remove(&job_id);
            self.request_ids.remove(&request_id);
            dirty.insert(DirtyKey::Job(job_id));
            dirty.insert(DirtyKey::RequestId(request_id));
        }
    }

    /// `CancelJob`: ends a job that is not finished yet: its running and paused time
    /// stop counting, a stop in flight is dropped, and it is cancelled "by user".
    pub(super) fn cancel_job(
        &mut self,
        job_id: &str,
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        self.with_live_job(job_id, dirty, |job| {
            job.end_run(at_ms);
            job.end_pause(at_ms);
            job.stop = None;
            job.state = JobState::Cancelled;
            job.finished_at_ms = at_ms;
            job.failure_cause = Some("cancelled by user".into());
            Response::Ok
        })
    }

    /// `PauseJob`: rejects a job with a stop in flight (but a grow's, which the pause
    /// replaces) or one already paused; a pending job is paused at once, a running one
    /// gets a `Pause` stop request (its ranks stop, then [`ClusterState::job_stopped`]
    /// pauses it); any other state is rejected.
    pub(super) fn pause_job(
        &mut self,
        job_id: &str,
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        self.with_live_job(job_id, dirty, |job| {
            if let Some(stop) = job.stop.as_ref().filter(|s| !s.grow) {
                return reject(format!(
                    "job {job_id} is already stopping ({}): one pause or resume at a time",
                    stop.action
                ));
            }
            match job.state {
                JobState::Paused => reject(format!("job {job_id} is already paused")),
                JobState::Pending => {
                    job.state = JobState::Paused;
                    job.begin_pause(at_ms);
                    Response::Ok
                }
                JobState::Running => {
                    job.stop = Some(StopRequest {
                        action: StopAction::Pause,
                        requested_at_ms: at_ms,
                        grow: false,
                    });
                    Response::Ok
                }
                other => reject(format!("job {job_id} is {other}")),
            }
        })
    }

    /// `ResumeJob`: rejects a job still pausing or not paused; requeues its ranks,
    /// makes it pending again and ends its paused time.
    pub(super) fn resume_job(
        &mut self,
        job_id: &str,
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        self.with_live_job(job_id, dirty, |job| {
            if job
                .stop
                .as_ref()
                .is_some_and(|s| s.action == StopAction::Pause)
            {
                return reject(format!(
                    "job {job_id} is still pausing: resume it once it is paused"
                ));
            }
            if job.state != JobState::Paused {
                return reject(format!("job {job_id} is {}, not paused", job.state));
            }
            job.requeue_ranks();
            job.state = JobState::Pending;
            job.end_pause(at_ms);
            Response::Ok
        })
    }

    /// `RequestStop`: the leader asks a running job's ranks to stop for its time limit
    /// or a preemption (no other action); rejects a job that is not running or already
    /// stopping, else records the stop request.
    pub(super) fn request_stop(
        &mut self,
        job_id: &str,
        action: StopAction,
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        self.with_live_job(job_id, dirty, |job| {
            if !matches!(action, StopAction::TimeLimit | StopAction::Preempt) {
                return reject(format!("the leader cannot request a {action} stop"));
            }
            if job.state != JobState::Running {
                return reject(format!("job {job_id} is {}, not running", job.state));
            }
            if let Some(stop) = &job.stop {
                return reject(format!(
                    "job {job_id} is already stopping ({})",
                    stop.action
                ));
            }
            job.stop = Some(StopRequest {
                action,
                requested_at_ms: at_ms,
                grow: false,
            });
            Response::Ok
        })
    }

    /// `RequestGrow`: a running elastic job below its most ranks, with no stop in flight,
    /// is asked to checkpoint and stop before it grows ([`StopRequest::grow`]).
    pub(super) fn request_grow(
        &mut self,
        job_id: &str,
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        self.with_live_job(job_id, dirty, |job| {
            if job.state != JobState::Running {
                return reject(format!("job {job_id} is {}, not running", job.state));
            }
            if !job.spec.is_elastic() || job.world_size() >= job.spec.world_size {
                return reject(format!(
                    "job {job_id} cannot grow: it runs {} of at most {} ranks",
                    job.world_size(),
                    job.spec.world_size
                ));
            }
            if let Some(stop) = &job.stop {
                return reject(format!(
                    "job {job_id} is already stopping ({})",
                    stop.action
                ));
            }
            job.stop = Some(StopRequest {
                action: StopAction::Preempt,
                requested_at_ms: at_ms,
                grow: true,
            });
            Response::Ok
        })
    }

    /// `JobStopped`: the ranks of a running job with a stop in flight have all stopped
    /// (rejected while one still runs). Its running time ends and the stop is cleared; a pause
    /// requeues the ranks and pauses the job, a preemption requeues them and makes it pending,
    /// a time limit (or stop) ends it as timed out, naming its newest committed step.
    pub(super) fn job_stopped(
        &mut self,
        job_id: &str,
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        self.with_live_job(job_id, dirty, |job| {
            let Some(stop) = job.stop.clone() else {
                return reject(format!("job {job_id} has no stop in flight"));
            };
            if job.state != JobState::Running {
                return reject(format!("job {job_id} is {}, not running", job.state));
            }
            if let Some(r) = job.ranks.iter().find(|r| r.state == RankState::Running) {
                return reject(format!(
                    "rank {} attempt {} of {job_id} still runs",
                    r.rank, r.attempt
                ));
            }
            job.end_run(at_ms);
            job.stop = None;
            match stop.action {
                StopAction::Pause | StopAction::Preempt => {
                    job.requeue_ranks();
                    job.state = if stop.action == StopAction::Pause {
                        job.begin_pause(at_ms);
                        JobState::Paused
                    } else {
                        JobState::Pending
                    };
                }
                StopAction::TimeLimit | StopAction::Stop => {
                    job.state = JobState::TimedOut;
                    job.finished_at_ms = at_ms;
                    job.failure_cause = Some(format!(
                        "time limit of {} ms reached (ran {} ms); newest committed step: {}",
                        job.spec.time_limit_ms,
                        job.running_ms,
                        job.committed_step
                            .map_or_else(|| "none".to_string(), |s| s.to_string())
                    ));
                }
            }
            Response::Ok
        })
    }

    /// `FailJob`: ends a job that is not finished yet as failed, for `cause`; its
    /// running time ends and a stop in flight is dropped.
    pub(super) fn fail_job(
        &mut self,
        job_id: &str,
        cause: &str,
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        self.with_live_job(job_id, dirty, |job| {
            job.end_run(at_ms);
            job.stop = None;
            job.state = JobState::Failed;
            job.finished_at_ms = at_ms;
            job.failure_cause = Some(cause.to_string());
            Response::Ok
        })
    }

    /// `JobSucceeded`: ends a running job whose current attempt's ranks all exited 0
    /// (else rejected) as succeeded; its running time ends and a stop in flight is dropped.
    pub(super) fn job_succeeded(
        &mut self,
        job_id: &str,
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        self.with_live_job(job_id, dirty, |job| {
            if job.state != JobState::Running || !job.all_ranks_succeeded() {
                return reject("not every rank of the current attempt exited 0");
            }
            job.end_run(at_ms);
            job.stop = None;
            job.state = JobState::Succeeded;
            job.finished_at_ms = at_ms;
            Response::Ok
        })
    }

    /// `DeleteJob`: removes a finished job (rejects an unknown or unfinished one), and
    /// its request id when that still names it. Dirty: the job, and the request id if removed.
    pub(super) fn delete_job(&mut self, job_id: &str, dirty: &mut BTreeSet<DirtyKey>) -> Response {
        let Some(job) = self.jobs.get(job_id) else {
            return reject(format!("unknown job {job_id}"));
        };
        if !job.state.is_terminal() {
            return reject(format!(
                "job {job_id} is {}: cancel it before deleting it",
                job.state
            ));
        }
        let request_id = job.request_id.clone();
        self.jobs.remove(job_id);
        self.histories.remove(job_id);
        if self.request_ids.get(&request_id).map(String::as_str) == Some(job_id) {
            self.request_ids.remove(&request_id);
            dirty.insert(DirtyKey::RequestId(request_id));
        }
        dirty.insert(DirtyKey::Job(job_id.to_string()));
        Response::Ok
    }
}

/// MASTER_PORT of a job's `restart`-th group attempt: spread over
/// [`MASTER_PORT_BASE`, `MASTER_PORT_BASE + MASTER_PORT_SPAN`) so a restarted group
/// does not collide with the port its predecessor may still hold.
pub fn master_port(seq: u64, restart: u32) -> u32 {
    let offset =
        (seq.wrapping_mul(97).wrapping_add(u64::from(restart) * 13)) % u64::from(MASTER_PORT_SPAN);
    MASTER_PORT_BASE + offset as u32
}
