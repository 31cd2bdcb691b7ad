//! Conversions between the gRPC/REST messages (`cumulus_api::v1`) and the replicated
//! state (`cumulus_raft_store::state`), with the validation and defaults of job specs.

use std::collections::{BTreeMap, HashMap};

use cumulus_api::{RankPhase, v1};
use cumulus_raft_store::state::{
    BlobRef, ClusterState, Environment, Job, JobSpec, JobState, RankState, RestartPolicy,
    RestartScope, ResumeFrom, StopAction,
};
use cumulus_raft_store::state::{
    DEFAULT_STRAGGLER_FRACTION_PERMILLE, DEFAULT_STRAGGLER_WINDOW_MS, StragglerAction,
    StragglerPolicy,
};

use crate::error::ApiError;
use crate::soft::ProgressSoft;
use cumulus_api::AttemptKey;

/// Default number of committed checkpoint steps kept.
pub use cumulus_raft_store::state::DEFAULT_CKPT_KEEP;

/// Builds a validated [`JobSpec`] from a request, filling the documented defaults.
///
/// # Errors
/// `InvalidArgument` naming the first bad field.
pub fn spec_from_proto(p: &v1::JobSpec, max_world_size: u32) -> Result<JobSpec, ApiError> {
    let defaults = RestartPolicy::default();
    let r = p.restart.clone().unwrap_or_default();
    let scope = RestartScope::from_spec(r.scope.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::InvalidArgument(e.to_string()))?;
    // A fraction implies one GPU per rank; a fraction of 1 is a whole GPU.
    let (gpus_per_rank, gpu_memory_permille) = match p.gpu_memory_fraction {
        None => (p.gpus_per_rank, 0),
        Some(f) => {
            let permille = cumulus_api::gpus::fraction_to_permille(f)
                .map_err(|e| ApiError::InvalidArgument(e.to_string()))?;
            let permille = if permille == cumulus_api::gpus::WHOLE_GPU_PERMILLE {
                0
            } else {
                permille
            };
            (p.gpus_per_rank.max(1), permille)
        }
    };
    let spec = JobSpec {
        name: p.name.clone(),
        world_size: p.world_size,
        command: p.command.clone(),
        env: p
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<BTreeMap<_, _>>(),
        dataset: p.dataset.clone(),
        ckpt_dir: p.ckpt_dir.clone(),
        ckpt_keep: p.ckpt_keep.unwrap_or(DEFAULT_CKPT_KEEP),
        restart: RestartPolicy {
            scope,
            max_restarts: r.max_restarts.unwrap_or(defaults.max_restarts),
            backoff_initial_ms: r.backoff_initial_ms.unwrap_or(defaults.backoff_initial_ms),
            backoff_max_ms: r.backoff_max_ms.unwrap_or(defaults.backoff_max_ms),
        },
        progress_timeout_ms: p.progress_timeout_ms,
        startup_timeout_ms: p.startup_timeout_ms,
        working_dir: p.working_dir.clone(),
        ckpt_url: p.ckpt_url.clone(),
        ckpt_commit_tier: p.ckpt_commit_tier.to_ascii_lowercase(),
        gpus_per_rank,
        gpu_memory_permille,
        stop_grace_ms: p.stop_grace_ms,
        time_limit_ms: p.time_limit_ms,
        signal_before_ms: p.signal_before_ms,
        priority: p.priority,
        resume_from: (!p.resume_from_job.is_empty()).then(|| ResumeFrom {
            job_id: p.resume_from_job.clone(),
            step: p.resume_from_step,
        }),
        preemptible: p.preemptible,
        workdir: p.workdir.as_ref().map(blob_from_proto),
        environment: p.environment.as_ref().map(environment_from_proto),
        no_fail_fast: p.fail_fast == Some(false),
        straggler: straggler_from_proto(p)?,
        warm_spares: p.warm_spares,
        warm_imports: p.warm_imports.clone(),
        min_world_size: p.min_world_size,
    };
    spec.validate(max_world_size)
        .map_err(|e| ApiError::InvalidArgument(e.to_string()))?;
    Ok(spec)
}

/// A request's straggler settings with the defaults filled in: `""` is `warn`, an absent
/// fraction 0.7 (rounded to thousandths), a window of 0 is 60 s.
///
/// # Errors
/// `InvalidArgument` naming the field: an unknown action, a fraction that is not a
/// finite number; the bounds are [`StragglerPolicy::validate`]'s, checked with the spec.
fn straggler_from_proto(p: &v1::JobSpec) -> Result<StragglerPolicy, ApiError> {
    let action = StragglerAction::from_spec(&p.straggler_action)
        .map_err(|e| ApiError::InvalidArgument(format!("straggler_action: {e}")))?;
    let fraction_permille = match p.straggler_fraction {
        None => DEFAULT_STRAGGLER_FRACTION_PERMILLE,
        Some(f) if f.is_finite() && (0.0..=1.0).contains(&f) => (f * 1000.0).round() as u32,
        Some(f) => {
            return Err(ApiError::InvalidArgument(format!(
                "straggler_fraction {f} must be a number between 0.1 and 0.95"
            )));
        }
    };
    Ok(StragglerPolicy {
        action,
        fraction_permille,
        window_ms: if p.straggler_window_ms == 0 {
            DEFAULT_STRAGGLER_WINDOW_MS
        } else {
            p.straggler_window_ms
        },
    })
}

/// The request form of a stored spec (used in job views).
pub fn spec_to_proto(s: &JobSpec) -> v1::JobSpec {
    v1::JobSpec {
        name: s.name.clone(),
        world_size: s.world_size,
        command: s.command.clone(),
        env: s
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<HashMap<_, _>>(),
        dataset: s.dataset.clone(),
        ckpt_dir: s.ckpt_dir.clone(),
        ckpt_keep: Some(s.ckpt_keep),
        restart: Some(v1::RestartPolicy {
            scope: Some(s.restart.scope.as_str().to_string()),
            max_restarts: Some(s.restart.max_restarts),
            backoff_initial_ms: Some(s.restart.backoff_initial_ms),
            backoff_max_ms: Some(s.restart.backoff_max_ms),
        }),
        progress_timeout_ms: s.progress_timeout_ms,
        startup_timeout_ms: s.startup_timeout_ms,
        working_dir: s.working_dir.clone(),
        ckpt_url: s.ckpt_url.clone(),
        ckpt_commit_tier: s.ckpt_commit_tier.clone(),
        gpus_per_rank: s.gpus_per_rank,
        gpu_memory_fraction: (s.gpu_memory_permille > 0)
            .then(|| f64::from(s.gpu_memory_permille) / 1000.0),
        stop_grace_ms: s.stop_grace_ms,
        time_limit_ms: s.time_limit_ms,
        signal_before_ms: s.signal_before_ms,
        priority: s.priority,
        resume_from_job: s
            .resume_from
            .as_ref()
            .map(|r| r.job_id.clone())
            .unwrap_or_default(),
        resume_from_step: s.resume_from.as_ref().and_then(|r| r.step),
        preemptible: s.preemptible,
        workdir: s.workdir.as_ref().map(blob_to_proto),
        environment: s.environment.as_ref().map(environment_to_proto),
        fail_fast: Some(!s.no_fail_fast),
        straggler_action: s.straggler.action.as_str().to_string(),
        straggler_fraction: Some(f64::from(s.straggler.fraction_permille) / 1000.0),
        straggler_window_ms: s.straggler.window_ms,
        warm_spares: s.warm_spares,
        warm_imports: s.warm_imports.clone(),
        min_world_size: s.min_world_size,
    }
}

/// A blob reference as the state holds it (validated with the spec or the exit).
pub fn blob_from_proto(b: &v1::BlobRef) -> BlobRef {
    BlobRef {
        digest: b.digest.clone(),
        size_bytes: b.size_bytes,
    }
}

/// The wire form of a stored blob reference.
pub fn blob_to_proto(b: &BlobRef) -> v1::BlobRef {
    v1::BlobRef {
        digest: b.digest.clone(),
        size_bytes: b.size_bytes,
    }
}

fn environment_from_proto(e: &v1::EnvironmentSpec) -> Environment {
    Environment {
        requirements: e.requirements.clone(),
        python: e.python.clone(),
        index_url: e.index_url.clone(),
        find_links: e.find_links.clone(),
        no_index: e.no_index,
    }
}

fn environment_to_proto(e: &Environment) -> v1::EnvironmentSpec {
    v1::EnvironmentSpec {
        requirements: e.requirements.clone(),
        python: e.python.clone(),
        index_url: e.index_url.clone(),
        find_links: e.find_links.clone(),
        no_index: e.no_index,
    }
}

/// The phase the APIs show for rank record `r` of `job` at leader time `now_ms`. A
/// rank of a job that has ended never shows `running` or `pending`: its attempt ended
/// with the job ([`RankPhase::Stopped`]) until its exit is recorded.
fn rank_phase(job: &Job, r: &cumulus_raft_store::state::RankRecord, now_ms: u64) -> RankPhase {
    match r.state {
        RankState::Unplaced | RankState::Pending | RankState::Running
            if job.state.is_terminal() =>
        {
            RankPhase::Stopped
        }
        RankState::Pending if r.not_before_ms > now_ms && job.state == JobState::Running => {
            RankPhase::Waiting
        }
        RankState::Unplaced | RankState::Pending => RankPhase::Pending,
        RankState::Running => RankPhase::Running,
        RankState::Exited => RankPhase::Exited,
        RankState::Failed => RankPhase::Failed,
    }
}

/// The API view of a job; `progress` is the leader's soft progress (empty on followers).
/// `pending_reason` is [`ClusterState::pending_reason`] where the caller computed it
/// (one job's view: it costs a pass over the workers).
pub fn job_to_proto(
    job: &Job,
    progress: &HashMap<AttemptKey, ProgressSoft>,
    now_ms: u64,
    pending_reason: Option<String>,
) -> v1::Job {
    v1::Job {
        id: job.id.clone(),
        spec: Some(spec_to_proto(&job.spec)),
        state: job.state.as_str().to_string(),
        submitted_at_ms: job.submitted_at_ms,
        finished_at_ms: job.finished_at_ms,
        restarts_used: job.restarts_used,
        failure_cause: job.failure_cause.clone().unwrap_or_default(),
        ranks: job
            .ranks
            .iter()
            .map(|r| {
                let p = progress.get(&AttemptKey::new(job.id.clone(), r.rank, r.attempt));
                v1::RankStatus {
                    rank: r.rank,
                    attempt: r.attempt,
                    worker_id: r.worker_id.clone().unwrap_or_default(),
                    state: rank_phase(job, r, now_ms).to_string(),
                    exit_code: r.exit_code,
                    signal: r.signal,
                    started_at_ms: r.started_at_ms,
                    exited_at_ms: r.exited_at_ms,
                    // The leader's live view while the attempt runs; once it has exited,
                    // the last report it made (replicated with its exit).
                    step: p.map_or(r.last_progress.0, |p| p.step.max(r.last_progress.0)),
                    total_steps: p
                        .map_or(r.last_progress.1, |p| p.total_steps.max(r.last_progress.1)),
                    local_rank: r.local_rank,
                    shard_count: job
                        .shard_plan
                        .get(r.rank as usize)
                        .map_or(0, |s| s.len() as u32),
                    not_before_ms: r.not_before_ms,
                    pid: r.pid,
                    gpus: r.gpus.clone(),
                    metrics: p
                        .map(|p| p.metrics.iter().map(|(k, v)| (k.clone(), *v)).collect())
                        .unwrap_or_default(),
                    steps_per_s: p.map_or(0.0, |p| p.steps_per_s),
                    eta_ms: p.map_or(0, ProgressSoft::eta_ms),
                    resume_step: r.resume_step,
                    resume_job_id: r.resume_job_id.clone(),
                    exit_cause: r.exit_cause.clone().unwrap_or_default(),
                    straggler: job.is_straggler(r.rank),
                    in_process: p.is_some_and(|p| p.in_process),
                }
            })
            .collect(),
        committed_step: job.committed_step,
        restarts: job
            .restarts
            .iter()
            .map(|x| v1::RestartRecord {
                number: x.number,
                failed_at_ms: x.failed_at_ms,
                delay_ms: x.delay_ms,
                not_before_ms: x.not_before_ms,
                cause: x.cause.clone(),
                ranks: x.ranks.clone(),
                resume_step: x.resume_step,
                path: x.path.as_str().to_string(),
                path_reason: x.path_reason.clone(),
                in_process_ranks: x.in_process_ranks.clone(),
            })
            .collect(),
        request_id: job.request_id.clone(),
        shard_count: job.shard_count,
        pending_reason: pending_reason.unwrap_or_default(),
        owner: job.owner.clone(),
        stop_action: job
            .stop
            .as_ref()
            .map_or("", |s| s.action.as_str())
            .to_string(),
        running_ms: job.running_ms_at(now_ms),
        paused_ms: job.paused_ms_at(now_ms),
        state_changes: job.state_changes,
        artifacts: job
            .artifacts
            .iter()
            .map(|a| v1::Artifact {
                rank: a.rank,
                attempt: a.attempt,
                blob: Some(blob_to_proto(&a.blob)),
            })
            .collect(),
        stragglers: job
            .stragglers
            .iter()
            .map(|f| v1::StragglerFlag {
                rank: f.rank,
                attempt: f.attempt,
                worker_id: f.worker_id.clone(),
                steps_per_s: f.millisteps_per_s as f64 / 1000.0,
                median_steps_per_s: f.median_millisteps_per_s as f64 / 1000.0,
                action: f.action.as_str().to_string(),
                at_ms: f.at_ms,
            })
            .collect(),
        avoided_workers: job.avoided_workers.clone(),
        world_size_now: job.world_size(),
        resizes: job
            .resizes
            .iter()
            .map(|r| v1::ResizeEvent {
                at_ms: r.at_ms,
                from_world_size: r.from,
                to_world_size: r.to,
                resume_step: r.resume_step,
                cause: r.cause.clone(),
            })
            .collect(),
    }
}

/// A job's summary at leader time `now_ms`: the record's facts, with the live progress
/// of its current attempts (`progress`) while it runs, and else the latest this leader
/// saw (`latest`), else the newest sample of the replicated `history`; that history's
/// samples when `with_history`.
pub fn job_summary(
    job: &Job,
    progress: &HashMap<AttemptKey, ProgressSoft>,
    (latest, history): (
        Option<&crate::soft::JobHistory>,
        Option<&cumulus_raft_store::state::ProgressHistory>,
    ),
    now_ms: u64,
    with_history: bool,
) -> v1::JobSummary {
    let attempts: Vec<AttemptKey> = job
        .ranks
        .iter()
        .map(|r| AttemptKey::new(job.id.clone(), r.rank, r.attempt))
        .collect();
    let running = job.state == JobState::Running;
    let live = running
        .then(|| crate::soft::job_progress(&attempts, progress))
        .flatten();
    // The replicated record: the step each rank reported with its exit, the slowest.
    let recorded = (
        job.ranks
            .iter()
            .map(|r| r.last_progress.0)
            .min()
            .unwrap_or(0),
        job.ranks
            .iter()
            .map(|r| r.last_progress.1)
            .max()
            .unwrap_or(0),
    );
    let sampled = || {
        let h = history?;
        let p = h.points.last()?;
        Some(crate::soft::JobProgress {
            step: p.step,
            total_steps: p.total_steps,
            steps_per_s: p.steps_per_s(),
            metrics: h.metrics_of(p).map(|(k, v)| (k.to_string(), v)).collect(),
        })
    };
    let seen = live
        .clone()
        .or_else(|| latest.map(|h| h.latest.clone()))
        .or_else(sampled);
    let (step, total_steps) = match (&live, &seen) {
        (Some(p), _) => (p.step.max(recorded.0), p.total_steps.max(recorded.1)),
        // After the run, the exits' reports are the newest facts.
        (None, Some(p)) if recorded.1 > 0 => (recorded.0.max(p.step), recorded.1),
        (None, Some(p)) => (p.step, p.total_steps),
        (None, None) => recorded,
    };
    let steps_per_s = seen.as_ref().map_or(0.0, |p| p.steps_per_s);
    let eta_ms = live.as_ref().map_or(0, |p| {
        crate::soft::JobProgress {
            step,
            total_steps,
            steps_per_s: p.steps_per_s,
            metrics: Default::default(),
        }
        .eta_ms()
    });
    let history_samples = match (with_history, history) {
        (true, Some(h)) => h
            .points
            .iter()
            .map(|x| v1::ProgressSample {
                at_ms: x.at_ms,
                step: x.step,
                total_steps: x.total_steps,
                steps_per_s: x.steps_per_s(),
                metrics: h.metrics_of(x).map(|(k, v)| (k.to_string(), v)).collect(),
            })
            .collect(),
        _ => Vec::new(),
    };
    v1::JobSummary {
        job_id: job.id.clone(),
        name: job.spec.name.clone(),
        owner: job.owner.clone(),
        state: job.state.as_str().to_string(),
        step,
        total_steps,
        steps_per_s,
        eta_ms,
        metrics: seen
            .map(|p| p.metrics.into_iter().collect())
            .unwrap_or_default(),
        restarts_used: job.restarts_used,
        running_ms: job.running_ms_at(now_ms),
        paused_ms: job.paused_ms_at(now_ms),
        committed_step: job.committed_step,
        submitted_at_ms: job.submitted_at_ms,
        finished_at_ms: job.finished_at_ms,
        history: history_samples,
        live: live.is_some() || (!running && latest.is_some()),
    }
}

/// The rank attempts the leader wants running on `worker_id` at `now_ms`, as `(job,
/// rank)`, in job and rank order: every placed rank of a running job whose current
/// attempt is running, or pending and past its backoff while the job is not stopping
/// (an attempt that continues its predecessor's process in-process is wanted during its
/// backoff too: the live rank leaves its step at once, and re-enters training once the
/// backoff is over, `DesiredRank.hold_ms`), or failed by the leader (hung) while its
/// process has not exited: it is stopped, or kept in-process, when its restart comes.
/// O(the worker's ranks): the index keeps placements by worker.
pub fn wanted_on<'a>(
    state: &'a ClusterState,
    worker_id: &'a str,
    now_ms: u64,
) -> impl Iterator<Item = (&'a Job, &'a cumulus_raft_store::state::RankRecord)> + 'a {
    state
        .job_index()
        .placed_on(worker_id)
        .filter_map(move |(job_id, rank)| {
            let job = state.jobs.get(job_id)?;
            let r = job.ranks.get(*rank as usize)?;
            if job.state != JobState::Running || r.worker_id.as_deref() != Some(worker_id) {
                return None;
            }
            let wanted = match r.state {
                RankState::Running => true,
                RankState::Pending => {
                    job.stop.is_none() && (r.not_before_ms <= now_ms || r.in_process)
                }
                // Failed by the leader as hung (`RankFailed`'s cause) with its process still
                // there: kept until the restart replaces it, which may keep the process
                // (in-process). Never a lost attempt: its agent no longer has it.
                RankState::Failed => {
                    job.stop.is_none()
                        && r.started_at_ms > 0
                        && r.exit_code.is_none()
                        && r.signal.is_none()
                        && r.failure.as_deref().is_some_and(|f| f.contains(": hung: "))
                }
                _ => false,
            };
            wanted.then_some((&**job, r))
        })
}

/// [`desired_digest`] of [`desired_for_worker`], without building the desired set.
pub fn wanted_digest(state: &ClusterState, worker_id: &str, now_ms: u64) -> u64 {
    digest_of(wanted_on(state, worker_id, now_ms).map(|(job, r)| {
        (
            job.id.as_str(),
            r.rank,
            r.attempt,
            job.stop.as_ref().map_or("", |s| s.action.as_str()),
        )
    }))
}

/// The rank attempts the leader wants running on `worker_id` at `now_ms`
/// ([`wanted_on`]), as the agent gets them. A stopping job's ranks carry its stop
/// action (and, for a time limit, the notice before SIGTERM: its `signal_before_ms`).
pub fn desired_for_worker(
    state: &ClusterState,
    worker_id: &str,
    now_ms: u64,
) -> Vec<v1::DesiredRank> {
    wanted_on(state, worker_id, now_ms)
        .map(|(job, r)| {
            let master_addr = job.ranks[0]
                .worker_id
                .as_ref()
                .and_then(|w| state.workers.get(w))
                .map(|w| w.host.clone())
                .unwrap_or_default();
            let mut d = desired_rank(job, r, master_addr);
            if r.in_process && r.state == RankState::Pending {
                d.in_process = true;
                d.hold_ms = r.not_before_ms.saturating_sub(now_ms);
            }
            d
        })
        .collect()
}

/// One desired attempt: rank `r` of `job`, its group's master on `master_addr`.
fn desired_rank(
    job: &Job,
    r: &cumulus_raft_store::state::RankRecord,
    master_addr: String,
) -> v1::DesiredRank {
    v1::DesiredRank {
        job_id: job.id.clone(),
        rank: r.rank,
        attempt: r.attempt,
        world_size: job.world_size(),
        local_rank: r.local_rank,
        local_world_size: r.local_world_size,
        master_addr,
        master_port: job.master_port,
        command: job.spec.command.clone(),
        env: job
            .spec
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        shards: job
            .shard_plan
            .get(r.rank as usize)
            .cloned()
            .unwrap_or_default(),
        ckpt_dir: job.spec.ckpt_dir.clone(),
        resume_step: r.resume_step,
        resume_dir: r.resume_dir.clone(),
        resume_job_id: r.resume_job_id.clone(),
        working_dir: job.spec.working_dir.clone(),
        ckpt_url: job.spec.ckpt_url.clone(),
        ckpt_commit_tier: job.spec.ckpt_commit_tier.clone(),
        gpus: r.gpus.clone(),
        gpu_memory_permille: job.spec.gpu_memory_permille,
        stop_grace_ms: job.spec.stop_grace_ms,
        stop_action: job
            .stop
            .as_ref()
            .map_or("", |s| s.action.as_str())
            .to_string(),
        stop_notice_ms: match job.stop.as_ref().map(|s| s.action) {
            Some(StopAction::TimeLimit) => job.spec.signal_before_ms,
            _ => 0,
        },
        workdir: job.spec.workdir.as_ref().map(blob_to_proto),
        environment: job.spec.environment.as_ref().map(environment_to_proto),
        warm_spares: job.spec.warm_spares,
        warm_imports: job.spec.warm_imports.clone(),
        in_process: false,
        hold_ms: 0,
        resume_rank: resume_rank(job, r),
        data_plan_json: data_plan_json(job, r.rank),
    }
}

/// The rank whose part of its resume step `r` resumes from, when not its own (an
/// elastic job resized: rank `r mod` the step's world size, `Job::resume_point`).
fn resume_rank(job: &Job, r: &cumulus_raft_store::state::RankRecord) -> Option<u32> {
    let step = r.resume_step?;
    if !r.resume_job_id.is_empty() {
        return None;
    }
    let parts = job.committed.get(&step)?;
    let from = r.rank as usize % parts.len().max(1);
    (from != r.rank as usize).then_some(from as u32)
}

/// An elastic job's data plan for `rank` as the rank reads it
/// ([`cumulus_api::rank_env::RankDataPlan`], JSON): before its first resize the standard
/// plan (every epoch the rank's shards file); "" for a job with a fixed world size.
fn data_plan_json(job: &Job, rank: u32) -> String {
    use cumulus_api::rank_env::{DataSegment, RankDataPlan};
    let Some(record) = job.data_plan() else {
        if !job.spec.is_elastic() {
            return String::new();
        }
        // So that a trainer knows from its first attempt on that it is an elastic job's
        // rank and saves its data position (the Rust example trainer needs it to).
        let standard = RankDataPlan {
            world_size: job.world_size(),
            previous_world_size: job.world_size(),
            ..RankDataPlan::default()
        };
        return serde_json::to_string(&standard).unwrap_or_default();
    };
    let previous_world_size = job.resizes.last().map_or(job.world_size(), |r| r.from);
    let plan = RankDataPlan {
        world_size: job.world_size(),
        previous_world_size,
        from_step: record.from_step,
        start_epoch: record.start_epoch,
        epochs: record
            .plan
            .for_rank(rank)
            .into_iter()
            .map(|(epoch, segments)| {
                let segments = segments
                    .into_iter()
                    .map(|s| DataSegment {
                        shard: s.shard,
                        first_record: s.first_record,
                    })
                    .collect();
                (epoch, segments)
            })
            .collect(),
        carry: record
            .carry
            .get(rank as usize)
            .map(|c| {
                c.iter()
                    .map(|v| serde_json::from_str(v).unwrap_or(serde_json::Value::Null))
                    .collect()
            })
            .unwrap_or_default(),
    };
    serde_json::to_string(&plan).unwrap_or_default()
}

/// The API view of the workers, with the leader's soft heartbeat ages when known.
pub fn workers_to_proto(
    state: &ClusterState,
    soft: &HashMap<String, crate::soft::WorkerSoft>,
) -> Vec<v1::WorkerInfo> {
    let used = state.slots_used(None);
    let gpus_used = state.gpus_used(None);
    state
        .workers
        .values()
        .map(|w| {
            let s = soft.get(&w.worker_id);
            let res = s.map(|s| s.resources.clone()).unwrap_or_default();
            let gpus = w
                .gpus
                .iter()
                .map(|g| v1::GpuInfo {
                    device: Some(v1::GpuDevice {
                        index: g.index,
                        uuid: g.uuid.clone(),
                        name: g.name.clone(),
                        memory_total_bytes: g.memory_total_bytes,
                    }),
                    status: res.gpus.iter().find(|st| st.uuid == g.uuid).cloned(),
                    allocated: f64::from(gpus_used.get(&g.uuid).copied().unwrap_or(0)) / 1000.0,
                })
                .collect();
            v1::WorkerInfo {
                worker_id: w.worker_id.clone(),
                host: w.host.clone(),
                http_addr: w.http_addr.clone(),
                slots: w.slots,
                slots_used: used.get(&w.worker_id).copied().unwrap_or(0),
                state: w.state.to_string(),
                last_heartbeat_age_ms: s.map_or(0, |s| s.last_seen.elapsed().as_millis() as u64),
                cpu_percent: res.cpu_percent,
                memory_used_bytes: res.memory_used_bytes,
                memory_total_bytes: res.memory_total_bytes,
                gpus,
                warm_spares: res.warm_spares,
            }
        })
        .collect()
}

/// Digest of a desired set: a hash of its sorted `(job, rank, attempt, stop action)`
/// tuples (nothing else of a desired attempt changes for the same key). `WatchDesired`
/// compares it with the agent's to tell whether the agent is current. Never 0 (0 means
/// "none known").
pub fn desired_digest(desired: &[v1::DesiredRank]) -> u64 {
    digest_of(
        desired
            .iter()
            .map(|d| (d.job_id.as_str(), d.rank, d.attempt, d.stop_action.as_str())),
    )
}

/// The digest of `(job, rank, attempt, stop action)` keys, in any order.
fn digest_of<'a>(keys: impl Iterator<Item = (&'a str, u32, u32, &'a str)>) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut keys: Vec<(&str, u32, u32, &str)> = keys.collect();
    keys.sort_unstable();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    keys.hash(&mut h);
    h.finish().max(1)
}

/// The earliest backoff end (leader clock, ms) after `now_ms` among the pending attempts
/// placed on `worker_id`: when its desired set changes without a new command.
pub fn next_backoff_end_ms(state: &ClusterState, worker_id: &str, now_ms: u64) -> Option<u64> {
    state
        .job_index()
        .placed_on(worker_id)
        .filter_map(|(job_id, rank)| {
            let job = state.jobs.get(job_id)?;
            let r = job.ranks.get(*rank as usize)?;
            (job.state == JobState::Running
                && r.worker_id.as_deref() == Some(worker_id)
                && r.state == RankState::Pending
                && r.not_before_ms > now_ms)
                .then_some(r.not_before_ms)
        })
        .min()
}
