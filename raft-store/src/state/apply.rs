//! [`ClusterState::apply`]: the pure, deterministic application of a [`Command`].
//!
//! Why one file of ~800 lines: `apply` is one match over every [`Command`]; each arm's
//! validation sits beside the change it guards.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::*;

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
            } => {
                if !cumulus_api::users::is_valid_user_name(name) {
                    return reject(format!("invalid user name {name:?}"));
                }
                if self.users.contains_key(name) {
                    return reject(format!(
                        "user {name} exists: revoke its token first to issue a new one"
                    ));
                }
                if self.users.len() >= cumulus_api::users::MAX_USERS {
                    return reject(format!(
                        "the cluster has {} users, the limit",
                        cumulus_api::users::MAX_USERS
                    ));
                }
                if secret_sha256.len() != 64
                    || !secret_sha256
                        .bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
                {
                    return reject("a token digest is 64 lowercase hex digits");
                }
                self.users.insert(
                    name.clone(),
                    UserRecord {
                        name: name.clone(),
                        role: *role,
                        secret_sha256: secret_sha256.clone(),
                        created_by: created_by.clone(),
                        created_at_ms: *at_ms,
                    },
                );
                Response::Ok
            }
            Command::RevokeUser { name } => {
                if self.users.remove(name).is_some() {
                    Response::Ok
                } else {
                    reject(format!("no user {name:?}"))
                }
            }
            Command::CancelJob { job_id, at_ms } => self.with_live_job(job_id, dirty, |job| {
                job.end_run(*at_ms);
                job.end_pause(*at_ms);
                job.stop = None;
                job.state = JobState::Cancelled;
                job.finished_at_ms = *at_ms;
                job.failure_cause = Some("cancelled by user".into());
                Response::Ok
            }),
            Command::PauseJob { job_id, at_ms } => self.with_live_job(job_id, dirty, |job| {
                if let Some(stop) = &job.stop {
                    return reject(format!(
                        "job {job_id} is already stopping ({}): one pause or resume at a time",
                        stop.action
                    ));
                }
                match job.state {
                    JobState::Paused => reject(format!("job {job_id} is already paused")),
                    JobState::Pending => {
                        job.state = JobState::Paused;
                        job.begin_pause(*at_ms);
                        Response::Ok
                    }
                    JobState::Running => {
                        job.stop = Some(StopRequest {
                            action: StopAction::Pause,
                            requested_at_ms: *at_ms,
                        });
                        Response::Ok
                    }
                    other => reject(format!("job {job_id} is {other}")),
                }
            }),
            Command::ResumeJob { job_id, at_ms } => self.with_live_job(job_id, dirty, |job| {
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
                job.end_pause(*at_ms);
                Response::Ok
            }),
            Command::RequestStop {
                job_id,
                action,
                at_ms,
            } => self.with_live_job(job_id, dirty, |job| {
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
                    action: *action,
                    requested_at_ms: *at_ms,
                });
                Response::Ok
            }),
            Command::JobStopped { job_id, at_ms } => self.with_live_job(job_id, dirty, |job| {
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
                job.end_run(*at_ms);
                job.stop = None;
                match stop.action {
                    StopAction::Pause | StopAction::Preempt => {
                        job.requeue_ranks();
                        job.state = if stop.action == StopAction::Pause {
                            job.begin_pause(*at_ms);
                            JobState::Paused
                        } else {
                            JobState::Pending
                        };
                    }
                    StopAction::TimeLimit | StopAction::Stop => {
                        job.state = JobState::TimedOut;
                        job.finished_at_ms = *at_ms;
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
            }),
            Command::DeleteJob { job_id } => {
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
                if self.request_ids.get(&request_id) == Some(job_id) {
                    self.request_ids.remove(&request_id);
                    dirty.insert(DirtyKey::RequestId(request_id));
                }
                dirty.insert(DirtyKey::Job(job_id.clone()));
                Response::Ok
            }
            Command::RegisterWorker {
                worker_id,
                host,
                http_addr,
                slots,
                gpus,
                at_ms,
            } => {
                if !valid_id(worker_id) || host.is_empty() || http_addr.is_empty() || *slots == 0 {
                    return reject("invalid worker registration");
                }
                if let Err(e) = self.check_gpus(worker_id, gpus) {
                    return reject(e.to_string());
                }
                self.workers.insert(
                    worker_id.clone(),
                    WorkerRecord {
                        worker_id: worker_id.clone(),
                        host: host.clone(),
                        http_addr: http_addr.clone(),
                        slots: *slots,
                        state: WorkerState::Alive,
                        registered_at_ms: *at_ms,
                        expired_at_ms: 0,
                        gpus: gpus.clone(),
                    },
                );
                dirty.insert(DirtyKey::Worker(worker_id.clone()));
                Response::Ok
            }
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
            } => self.with_current_rank(job_id, *rank, *attempt, Some(worker_id), dirty, |_, r| {
                if r.state != RankState::Pending {
                    return reject(format!(
                        "rank {} attempt {} is not pending",
                        r.rank, r.attempt
                    ));
                }
                r.state = RankState::Running;
                r.pid = *pid;
                r.started_at_ms = *at_ms;
                Response::Ok
            }),
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
                at_ms,
            } => {
                // A job that already ended still records its ranks' exits.
                if self.jobs.get(job_id).is_some_and(|j| j.state.is_terminal()) {
                    return self.final_exit(
                        job_id,
                        (*rank, *attempt),
                        worker_id,
                        (*exit_code, *signal),
                        (*step, *total_steps),
                        *at_ms,
                        dirty,
                    );
                }
                self.with_current_rank(job_id, *rank, *attempt, Some(worker_id), dirty, |_, r| {
                    if !matches!(r.state, RankState::Pending | RankState::Running) {
                        return reject(format!(
                            "rank {} attempt {} already ended",
                            r.rank, r.attempt
                        ));
                    }
                    r.exit_code = *exit_code;
                    r.signal = *signal;
                    r.exited_at_ms = *at_ms;
                    r.last_progress = (*step, *total_steps);
                    if *exit_code == Some(0) && spawn_error.is_empty() {
                        r.state = RankState::Exited;
                        r.failure = None;
                    } else {
                        r.state = RankState::Failed;
                        // A rank that could not reach its agent is the agent's fault only
                        // with the agent's own evidence of it.
                        let unreachable = *exit_code
                            == Some(cumulus_api::rank_env::EXIT_AGENT_UNREACHABLE)
                            && spawn_error.is_empty()
                            && !agent_evidence.is_empty();
                        r.agent_fault = *agent_fault && (!spawn_error.is_empty() || unreachable);
                        r.exec_failed = *exec_failed && !spawn_error.is_empty();
                        r.failure = Some(if r.agent_fault && unreachable {
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
                        });
                    }
                    Response::Ok
                })
            }
            Command::RankFailed {
                job_id,
                rank,
                attempt,
                cause,
                at_ms,
            } => self.with_current_rank(job_id, *rank, *attempt, None, dirty, |_, r| {
                if !matches!(r.state, RankState::Pending | RankState::Running) {
                    return reject(format!(
                        "rank {} attempt {} already ended",
                        r.rank, r.attempt
                    ));
                }
                r.state = RankState::Failed;
                r.exited_at_ms = *at_ms;
                r.failure = Some(format!("rank {} attempt {}: {cause}", r.rank, r.attempt));
                Response::Ok
            }),
            Command::ScheduleRestart {
                job_id,
                placements,
                gpus,
                failed_at_ms,
                delay_ms,
                cause,
                resume_step,
                agent_fault,
            } => self.schedule_restart(
                job_id,
                (placements, gpus),
                *failed_at_ms,
                *delay_ms,
                cause,
                *resume_step,
                *agent_fault,
                dirty,
            ),
            Command::FailJob {
                job_id,
                cause,
                at_ms,
            } => self.with_live_job(job_id, dirty, |job| {
                job.end_run(*at_ms);
                job.stop = None;
                job.state = JobState::Failed;
                job.finished_at_ms = *at_ms;
                job.failure_cause = Some(cause.clone());
                Response::Ok
            }),
            Command::CheckpointPartCommitted { job_id, step, part } => {
                self.part_committed(job_id, *step, part, dirty)
            }
            Command::CheckpointCommitted {
                job_id,
                step,
                at_ms: _,
            } => self.with_live_job(job_id, dirty, |job| {
                let Some(parts) = job.pending_parts.get(step) else {
                    return reject(format!("no parts of step {step} are pending"));
                };
                if parts.len() != job.spec.world_size as usize {
                    return reject(format!(
                        "step {step} has {} of {} parts",
                        parts.len(),
                        job.spec.world_size
                    ));
                }
                let parts: Vec<PartInfo> = parts.values().cloned().collect();
                job.committed.insert(*step, parts);
                job.committed_step = Some(job.committed_step.map_or(*step, |s| s.max(*step)));
                job.pending_parts.retain(|s, _| s > step);
                while job.committed.len() > job.spec.ckpt_keep as usize {
                    job.committed.pop_first();
                }
                Response::Ok
            }),
            Command::JobSucceeded { job_id, at_ms } => self.with_live_job(job_id, dirty, |job| {
                if job.state != JobState::Running || !job.all_ranks_succeeded() {
                    return reject("not every rank of the current attempt exited 0");
                }
                job.end_run(*at_ms);
                job.stop = None;
                job.state = JobState::Succeeded;
                job.finished_at_ms = *at_ms;
                Response::Ok
            }),
            Command::Batch { commands } => {
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
        }
    }

    fn submit(
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
                last_progress: (0, 0),
                gpus: Vec::new(),
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

    /// Steps of `job_id`'s checkpoint dir that jobs started from it still need, as
    /// `(that job, step)`: one for every unfinished job forked from it that has committed
    /// no step of its own.
    pub fn fork_references(&self, job_id: &str) -> Vec<(String, u64)> {
        self.index
            .forks
            .iter()
            .filter_map(|id| self.jobs.get(id))
            .filter_map(|j| j.fork.as_ref().map(|f| (j, f)))
            .filter(|(j, f)| f.job_id == job_id && !j.state.is_terminal() && j.committed.is_empty())
            .map(|(j, f)| (j.id.clone(), f.step))
            .collect()
    }

    /// Drops the oldest terminal jobs while more than `max_jobs` are kept or their
    /// estimated size ([`JobIndex::total_bytes`]) is above `max_bytes`: the bounded
    /// state ([`MAX_JOBS_RETAINED`], [`MAX_STATE_BYTES`]). Pending and running jobs are
    /// never dropped (the leader refuses submits instead).
    pub(super) fn evict_old_jobs(
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
            self.request_ids.remove(&request_id);
            dirty.insert(DirtyKey::Job(job_id));
            dirty.insert(DirtyKey::RequestId(request_id));
        }
    }

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

    /// Runs `f` on the current attempt of a rank; rejects a stale attempt, another
    /// worker's report, or a job that is not running.
    fn with_current_rank(
        &mut self,
        job_id: &str,
        rank: u32,
        attempt: u32,
        worker_id: Option<&String>,
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
                && r.worker_id.as_ref() != Some(w)
            {
                return reject(format!(
                    "rank {rank} attempt {attempt} of {job_id} is not placed on {w}"
                ));
            }
            f(&job.spec, r)
        })
    }

    fn expire_worker(
        &mut self,
        worker_id: &str,
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        let Some(w) = self.workers.get_mut(worker_id) else {
            return reject(format!("unknown worker {worker_id}"));
        };
        if w.state == WorkerState::Expired {
            return reject(format!("worker {worker_id} is already expired"));
        }
        w.state = WorkerState::Expired;
        w.expired_at_ms = at_ms;
        dirty.insert(DirtyKey::Worker(worker_id.to_string()));
        for job in self.jobs.values_mut() {
            let holds_live_rank = job.state == JobState::Running
                && job.ranks.iter().any(|r| {
                    r.worker_id.as_deref() == Some(worker_id)
                        && matches!(r.state, RankState::Pending | RankState::Running)
                });
            if !holds_live_rank {
                continue;
            }
            let job = Arc::make_mut(job);
            let mut touched = false;
            for r in &mut job.ranks {
                if r.worker_id.as_deref() == Some(worker_id)
                    && matches!(r.state, RankState::Pending | RankState::Running)
                {
                    r.state = RankState::Failed;
                    r.exited_at_ms = at_ms;
                    r.failure = Some(format!(
                        "rank {} attempt {}: worker {worker_id} expired (no heartbeat)",
                        r.rank, r.attempt
                    ));
                    touched = true;
                }
            }
            if touched {
                dirty.insert(DirtyKey::Job(job.id.clone()));
            }
        }
        Response::Ok
    }

    /// Validates a registration's GPUs: at most [`MAX_GPUS_PER_WORKER`], valid and
    /// distinct UUIDs that no other alive worker registered, printable names of at most
    /// [`MAX_GPU_NAME_BYTES`].
    fn check_gpus(&self, worker_id: &str, gpus: &[GpuDevice]) -> Result<(), PlacementError> {
        if gpus.len() > MAX_GPUS_PER_WORKER {
            return Err(PlacementError::BadGpu(format!(
                "{} GPUs, more than the limit of {MAX_GPUS_PER_WORKER}",
                gpus.len()
            )));
        }
        let mut seen = BTreeSet::new();
        for g in gpus {
            if !cumulus_api::gpus::is_valid_uuid(&g.uuid) {
                return Err(PlacementError::BadGpu(format!(
                    "GPU {} has an invalid UUID {:?}",
                    g.index,
                    cumulus_api::text::escape_control(&g.uuid)
                )));
            }
            if g.name.len() > MAX_GPU_NAME_BYTES || !cumulus_api::text::is_printable(&g.name) {
                return Err(PlacementError::BadGpu(format!(
                    "GPU {} has a name that is too long or not printable",
                    g.uuid
                )));
            }
            if !seen.insert(g.uuid.as_str()) {
                return Err(PlacementError::BadGpu(format!(
                    "GPU {} is listed twice",
                    g.uuid
                )));
            }
        }
        if let Some(other) = self.workers.values().find(|w| {
            w.worker_id != worker_id
                && w.state == WorkerState::Alive
                && w.gpus.iter().any(|g| seen.contains(g.uuid.as_str()))
        }) {
            return Err(PlacementError::BadGpu(format!(
                "a GPU of this registration is already registered by worker {}",
                other.worker_id
            )));
        }
        Ok(())
    }

    /// Slots of the alive workers in all (what a job may use at most).
    pub fn alive_slots(&self) -> u64 {
        self.workers
            .values()
            .filter(|w| w.state == WorkerState::Alive)
            .map(|w| u64::from(w.slots))
            .sum()
    }

    /// What the alive workers offer in all, computed once so that many jobs can be
    /// tested against it ([`AliveTotals::never_fits`]): O(workers + their GPUs).
    pub fn alive_totals(&self) -> AliveTotals {
        AliveTotals {
            slots: self.alive_slots(),
            gpus_all_free: self.gpu_capacity(true),
        }
    }

    /// Free capacity of every alive worker for the GPU planner: free slots and each
    /// GPU's free share (`all_free`: as if nothing ran, for "could it ever fit"). GPU
    /// health is soft state the replicated state does not hold: every GPU counts here.
    pub fn gpu_capacity(&self, all_free: bool) -> Vec<shard_planner::WorkerGpus> {
        let (slots, gpus) = if all_free {
            (BTreeMap::new(), BTreeMap::new())
        } else {
            (self.slots_used(None), self.gpus_used(None))
        };
        self.workers
            .values()
            .filter(|w| w.state == WorkerState::Alive)
            .map(|w| shard_planner::WorkerGpus {
                worker_id: w.worker_id.clone(),
                free_slots: w
                    .slots
                    .saturating_sub(slots.get(&w.worker_id).copied().unwrap_or(0)),
                gpus: w
                    .gpus
                    .iter()
                    .map(|g| shard_planner::GpuFree {
                        uuid: g.uuid.clone(),
                        free_permille: cumulus_api::gpus::WHOLE_GPU_PERMILLE
                            .saturating_sub(gpus.get(&g.uuid).copied().unwrap_or(0)),
                    })
                    .collect(),
            })
            .collect()
    }

    /// Why a pending job is not placed: what it needs against what the alive workers
    /// offer in all ("cannot be placed") or have free now ("waiting"). `None` for a job
    /// that is not pending, or one that would fit now (the leader places it at its next
    /// pass). O(workers + running ranks).
    pub fn pending_reason(&self, job: &Job) -> Option<String> {
        if job.state != JobState::Pending {
            return None;
        }
        match self.capacity_outlook(&job.spec) {
            // It fits, so a job ahead of it in the queue holds it back.
            Outlook::FitsNow => {
                let totals = self.alive_totals();
                self.index
                    .queue
                    .range(..(-job.spec.priority, job.id.clone()))
                    .find(|(_, id)| {
                        // One larger than the cluster holds no one up (the planner skips it).
                        self.jobs
                            .get(id)
                            .is_some_and(|j| !totals.never_fits(&j.spec))
                    })
                    .map(|(neg_priority, id)| {
                        format!(
                            "queued behind {id} (priority {}), which waits for capacity: a job \
                         behind it starts first only when it cannot delay it (its time limit \
                         ends before that job can start, or it fits in slots that job will \
                         not need)",
                            -neg_priority
                        )
                    })
            }
            Outlook::Waits(why) | Outlook::Never(why) => Some(why),
        }
    }

    /// Whether a job of `spec` fits the alive workers now, later (once running jobs end),
    /// or never (more than they offer in all), with the reason in words. GPU health is
    /// soft state the replicated state does not hold: every GPU counts here.
    pub fn capacity_outlook(&self, spec: &JobSpec) -> Outlook {
        let world = spec.world_size;
        let Some(demand) = spec.gpu_demand() else {
            let capacity = self.gpu_capacity(false);
            let total = self.alive_slots();
            let free: u64 = capacity.iter().map(|w| u64::from(w.free_slots)).sum();
            return if total < u64::from(world) {
                Outlook::Never(format!(
                    "cannot be placed: it needs {world} slots and the alive workers offer {total} in all"
                ))
            } else if free < u64::from(world) {
                Outlook::Waits(format!(
                    "waiting for {world} free slots: {free} of {total} are free now"
                ))
            } else {
                Outlook::FitsNow
            };
        };
        let need = if demand.permille == shard_planner::WHOLE_GPU_PERMILLE {
            format!(
                "{world} ranks x {} GPU{}",
                demand.gpus_per_rank,
                if demand.gpus_per_rank == 1 { "" } else { "s" }
            )
        } else {
            format!(
                "{world} ranks x {} of a GPU",
                cumulus_api::gpus::permille_to_fraction(demand.permille)
            )
        };
        let total_gpus: usize = self
            .workers
            .values()
            .filter(|w| w.state == WorkerState::Alive)
            .map(|w| w.gpus.len())
            .sum();
        let now = self.gpu_capacity(false);
        if !gpu_job_fits(spec, &self.gpu_capacity(true)) {
            return Outlook::Never(format!(
                "cannot be placed: it needs {need} (gang, each rank's GPUs on its worker) and \
                 the alive workers have {total_gpus} GPUs in all"
            ));
        }
        if gpu_job_fits(spec, &now) {
            return Outlook::FitsNow;
        }
        let free_gpus = now
            .iter()
            .flat_map(|w| &w.gpus)
            .filter(|g| g.free_permille >= demand.permille)
            .count();
        Outlook::Waits(format!(
            "waiting for GPUs: it needs {need}; {free_gpus} of {total_gpus} GPUs have room for a rank now"
        ))
    }

    /// Share of each GPU (by UUID) held by ranks of running jobs that are placed and not
    /// ended, in thousandths (a whole GPU: 1000), leaving out the ranks named in
    /// `except` (which are being re-placed).
    pub fn gpus_used(&self, except: Option<(&str, &BTreeSet<u32>)>) -> BTreeMap<String, u32> {
        let mut used: BTreeMap<String, u32> = BTreeMap::new();
        for job in self.index.running.iter().filter_map(|id| self.jobs.get(id)) {
            let share = job.spec.gpu_share_permille();
            if share == 0 {
                continue;
            }
            for r in &job.ranks {
                if let Some((j, ranks)) = except
                    && j == job.id
                    && ranks.contains(&r.rank)
                {
                    continue;
                }
                if r.worker_id.is_some()
                    && matches!(r.state, RankState::Pending | RankState::Running)
                {
                    for g in &r.gpus {
                        *used.entry(g.clone()).or_insert(0) += share;
                    }
                }
            }
        }
        used
    }

    /// The GPU half of [`ClusterState::check_placements`].
    fn check_gpu_placements(
        &self,
        job_id: &str,
        ranks: &BTreeSet<u32>,
        placements: &[(u32, String)],
        gpus: &[RankGpus],
    ) -> Result<(), PlacementError> {
        let demand = self.jobs.get(job_id).and_then(|j| j.spec.gpu_demand());
        let Some(demand) = demand else {
            return if gpus.is_empty() {
                Ok(())
            } else {
                Err(PlacementError::GpusMismatch)
            };
        };
        let by_rank: BTreeMap<u32, &Vec<String>> = gpus.iter().map(|(r, g)| (*r, g)).collect();
        if by_rank.len() != gpus.len() || by_rank.keys().ne(ranks.iter()) {
            return Err(PlacementError::GpusMismatch);
        }
        let mut wanted: BTreeMap<&str, u32> = BTreeMap::new();
        for (rank, worker_id) in placements {
            let Some(list) = by_rank.get(rank) else {
                return Err(PlacementError::GpusMismatch);
            };
            let distinct: BTreeSet<&String> = list.iter().collect();
            if list.len() != demand.gpus_per_rank as usize || distinct.len() != list.len() {
                return Err(PlacementError::GpusMismatch);
            }
            let inventory = self.workers.get(worker_id).map(|w| &w.gpus);
            for uuid in list.iter() {
                if !inventory.is_some_and(|inv| inv.iter().any(|g| &g.uuid == uuid)) {
                    return Err(PlacementError::ForeignGpu {
                        uuid: uuid.clone(),
                        worker_id: worker_id.clone(),
                    });
                }
                *wanted.entry(uuid.as_str()).or_default() += demand.permille;
            }
        }
        let used = self.gpus_used(Some((job_id, ranks)));
        for (uuid, wanted_permille) in wanted {
            let free_permille = cumulus_api::gpus::WHOLE_GPU_PERMILLE
                .saturating_sub(used.get(uuid).copied().unwrap_or(0));
            if wanted_permille > free_permille {
                return Err(PlacementError::GpuFull {
                    uuid: uuid.to_string(),
                    free_permille,
                    wanted_permille,
                });
            }
        }
        Ok(())
    }

    /// Validates that `placements` put each of `ranks` on an alive worker exactly once,
    /// that no worker gets more ranks than its free slots, and, for a job with GPUs,
    /// that `gpus` gives each rank as many distinct GPUs of its worker as it needs with
    /// no GPU shared past a whole one (none for a job without GPUs).
    fn check_placements(
        &self,
        job_id: &str,
        ranks: &BTreeSet<u32>,
        placements: &[(u32, String)],
        gpus: &[RankGpus],
    ) -> Result<(), PlacementError> {
        self.check_gpu_placements(job_id, ranks, placements, gpus)?;
        let placed: BTreeSet<u32> = placements.iter().map(|(r, _)| *r).collect();
        if placed != *ranks || placed.len() != placements.len() {
            return Err(PlacementError::RanksMismatch);
        }
        let mut wanted: BTreeMap<&str, u32> = BTreeMap::new();
        for (_, w) in placements {
            *wanted.entry(w.as_str()).or_default() += 1;
        }
        let used = self.slots_used(Some((job_id, ranks)));
        for (w, n) in wanted {
            let Some(rec) = self.workers.get(w) else {
                return Err(PlacementError::UnknownWorker(w.to_string()));
            };
            if rec.state != WorkerState::Alive {
                return Err(PlacementError::ExpiredWorker(w.to_string()));
            }
            let free = rec.slots.saturating_sub(used.get(w).copied().unwrap_or(0));
            if n > free {
                return Err(PlacementError::NoSlots {
                    worker_id: w.to_string(),
                    free,
                    wanted: n,
                });
            }
        }
        Ok(())
    }

    /// Slots in use per worker by ranks of running jobs that are placed and not ended,
    /// leaving out the ranks named in `except` (which are being re-placed). Visits only
    /// running jobs ([`JobIndex::running`]).
    pub fn slots_used(&self, except: Option<(&str, &BTreeSet<u32>)>) -> BTreeMap<String, u32> {
        let mut used = BTreeMap::new();
        // Only running jobs are placed (a job gets its workers when it leaves pending).
        for job in self.index.running.iter().filter_map(|id| self.jobs.get(id)) {
            for r in &job.ranks {
                if let Some((j, ranks)) = except
                    && j == job.id
                    && ranks.contains(&r.rank)
                {
                    continue;
                }
                if let (Some(w), RankState::Pending | RankState::Running) = (&r.worker_id, r.state)
                {
                    *used.entry(w.clone()).or_insert(0) += 1;
                }
            }
        }
        used
    }

    fn place_job(
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
        let all: BTreeSet<u32> = (0..job.spec.world_size).collect();
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

    #[allow(clippy::too_many_arguments)]
    fn schedule_restart(
        &mut self,
        job_id: &str,
        (placements, gpus): (&[(u32, String)], &[RankGpus]),
        failed_at_ms: u64,
        delay_ms: u64,
        cause: &str,
        resume_step: Option<u64>,
        agent_fault: bool,
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
            RestartScope::Group => (0..job.spec.world_size).collect(),
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
        }
        assign_placements(job, placements, gpus, not_before_ms);
        dirty.insert(DirtyKey::Job(job_id.to_string()));
        Response::Ok
    }

    fn part_committed(
        &mut self,
        job_id: &str,
        step: u64,
        part: &PartInfo,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        let rank = part.rank;
        let attempt = part.attempt;
        if let Some(job) = self.jobs.get(job_id)
            && job.committed_step.is_some_and(|c| step <= c)
        {
            // The same part again, already in its committed step: a retry whose first
            // try was committed but not acknowledged (the leader died before replying).
            // It succeeds and changes nothing; rejecting it would tell the agent that
            // its attempt is stale and end a healthy rank.
            if job
                .committed
                .get(&step)
                .is_some_and(|parts| parts.contains(part))
            {
                return Response::Ok;
            }
            return reject(format!("step {step} is not after the committed step"));
        }
        if part.files.len() > 4096 || part.state_json.len() > 64 * 1024 || part.dir.is_empty() {
            return reject("checkpoint part is too large or has no directory");
        }
        self.with_current_rank(job_id, rank, attempt, None, dirty, |_, r| {
            if !matches!(r.state, RankState::Pending | RankState::Running) {
                return reject(format!("rank {rank} attempt {attempt} is not running"));
            }
            Response::Ok
        })
        .and_then_ok(|| {
            let job = Arc::make_mut(
                self.jobs
                    .get_mut(job_id)
                    .expect("checked by with_current_rank"),
            );
            job.pending_parts
                .entry(step)
                .or_default()
                .insert(rank, part.clone());
            while job.pending_parts.len() > MAX_PENDING_CKPT_STEPS {
                job.pending_parts.pop_first();
            }
            dirty.insert(DirtyKey::Job(job_id.to_string()));
            Response::Ok
        })
    }
}

trait ResponseExt {
    fn and_then_ok(self, f: impl FnOnce() -> Response) -> Response;
}

impl ResponseExt for Response {
    fn and_then_ok(self, f: impl FnOnce() -> Response) -> Response {
        match self {
            Response::Ok => f(),
            other => other,
        }
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

/// Places the given ranks (a fresh attempt, state Pending) and recomputes local ranks
/// of the whole job.
fn assign_placements(
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

/// Why a `PlaceJob` or `RestartRanks` command's placements were refused by `apply`: a
/// leader planned against a view that the log has since overtaken.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// The placements do not name each rank to place exactly once.
    #[error("placement does not cover exactly the ranks to place")]
    RanksMismatch,
    /// A worker the state does not know.
    #[error("unknown worker {0}")]
    UnknownWorker(String),
    /// A worker whose heartbeats have expired.
    #[error("worker {0} is expired")]
    ExpiredWorker(String),
    /// A worker given more ranks than it has free slots.
    #[error("worker {worker_id} has {free} free slots, not {wanted}")]
    NoSlots {
        /// The worker.
        worker_id: String,
        /// Its slots not used by other running ranks.
        free: u32,
        /// Ranks the placements give it.
        wanted: u32,
    },
    /// A registration's GPU inventory broke a rule.
    #[error("invalid GPU inventory: {0}")]
    BadGpu(String),
    /// GPUs given to a job without GPUs, or not exactly the placed ranks of a job with.
    #[error("the GPUs do not match the job's ranks and gpus_per_rank")]
    GpusMismatch,
    /// A GPU that is not its rank's worker's.
    #[error("GPU {uuid} is not a GPU of worker {worker_id}")]
    ForeignGpu {
        /// The GPU's UUID.
        uuid: String,
        /// The worker the rank is placed on.
        worker_id: String,
    },
    /// A GPU whose shares would add up past a whole GPU.
    #[error("GPU {uuid} has {free_permille}/1000 free, not {wanted_permille}/1000")]
    GpuFull {
        /// The GPU's UUID.
        uuid: String,
        /// Its share not held by other running ranks, in thousandths.
        free_permille: u32,
        /// What the placements give out of it, in thousandths.
        wanted_permille: u32,
    },
}

/// The alive workers' capacity in all, as if nothing ran ([`ClusterState::alive_totals`]):
/// a snapshot for one planning pass or one listing, not kept across state changes.
#[derive(Clone, Debug)]
pub struct AliveTotals {
    /// Slots of the alive workers in all.
    slots: u64,
    /// Every alive worker with all its slots and GPUs free.
    gpus_all_free: Vec<shard_planner::WorkerGpus>,
}

impl AliveTotals {
    /// True when a job of `spec` needs more than the alive workers offer in all: the
    /// test behind [`Outlook::Never`] without its words. O(1) for a job without GPUs,
    /// one run of the GPU planner for a job with them.
    pub fn never_fits(&self, spec: &JobSpec) -> bool {
        if spec.gpu_demand().is_some() {
            !gpu_job_fits(spec, &self.gpus_all_free)
        } else {
            self.slots < u64::from(spec.world_size)
        }
    }
}

/// True when every rank of `spec` finds its GPUs on `capacity` (a job without GPUs:
/// always).
fn gpu_job_fits(spec: &JobSpec, capacity: &[shard_planner::WorkerGpus]) -> bool {
    let Some(demand) = spec.gpu_demand() else {
        return true;
    };
    let ranks: Vec<u32> = (0..spec.world_size).collect();
    matches!(
        shard_planner::place_gpu_ranks(&ranks, capacity, demand),
        Ok(Some(_))
    )
}

/// Whether a job fits the cluster's alive workers ([`ClusterState::capacity_outlook`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outlook {
    /// It would be placed at the leader's next pass.
    FitsNow,
    /// It fits the alive workers, once running jobs free slots or GPUs (why, in words).
    Waits(String),
    /// It needs more than the alive workers offer in all (why, in words).
    Never(String),
}
