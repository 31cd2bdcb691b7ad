//! The client API's operations, shared by the gRPC `ClientService` and the REST mirror:
//! submit, get, list, cancel, cluster status, checkpoints.

use openraft::async_runtime::watch::WatchReceiver;
use std::path::Path;

use cumulus_api::v1;
use cumulus_ckpt::CheckpointStore;
use cumulus_raft_store::Command;
use cumulus_raft_store::Response;
use cumulus_raft_store::stage;
use cumulus_raft_store::state::submit_bytes;
use std::collections::BTreeSet;

use cumulus_raft_store::CumulusNode;
use cumulus_raft_store::TypeConfig;
use openraft::error::{ClientWriteError, RaftError};
use openraft::{ChangeMembers, ServerState};

use crate::convert::{job_to_proto, spec_from_proto, workers_to_proto};
use crate::error::ApiError;
use crate::localfs;
use crate::localfs::MAX_DATASET_FILES;
use crate::node::Node;
use crate::soft::now_ms;
use cumulus_api::Role;
use cumulus_api::users::{self, Principal};

/// Refuses `who` unless their role is at least `needed`; `what` names the action.
///
/// # Errors
/// `PermissionDenied` naming the user, their role and the action.
pub fn require_role(who: &Principal, needed: Role, what: &str) -> Result<(), ApiError> {
    if who.role >= needed {
        Ok(())
    } else {
        Err(ApiError::PermissionDenied(format!(
            "user {} (role {}) may not {what}: that needs role {needed} or above",
            who.name, who.role
        )))
    }
}

/// Refuses `who` unless they submitted job `job_id` or are an administrator; `what`
/// names the action. A job submitted before users existed (no owner) is an
/// administrator's.
///
/// # Errors
/// `NotFound` for an unknown job; `PermissionDenied` for another user's job.
pub fn require_owner(
    node: &Node,
    who: &Principal,
    job_id: &str,
    what: &str,
) -> Result<(), ApiError> {
    let owner = node
        .read_state(|s| s.jobs.get(job_id).map(|j| j.owner.clone()))
        .ok_or_else(|| ApiError::NotFound(format!("no job {job_id:?}")))?;
    if who.owns_or_administers(&owner) {
        Ok(())
    } else {
        Err(ApiError::PermissionDenied(format!(
            "user {} may not {what} {job_id}: it belongs to {}",
            who.name,
            if owner.is_empty() {
                "an administrator"
            } else {
                owner.as_str()
            }
        )))
    }
}

/// Lists a dataset directory's regular files (not hidden), sorted by name, as
/// absolute paths. Blocking; call it off the runtime thread.
///
/// # Errors
/// `InvalidArgument` when the directory is missing, unreadable, empty or too large.
pub fn list_dataset(dir: &str) -> Result<Vec<String>, ApiError> {
    let path = Path::new(dir);
    let entries = std::fs::read_dir(path).map_err(|e| {
        ApiError::InvalidArgument(format!(
            "dataset {dir} cannot be read: {e} (give an existing directory of shard files)"
        ))
    })?;
    let mut shards = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| ApiError::InvalidArgument(format!("dataset {dir}: {e}")))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            return Err(ApiError::InvalidArgument(format!(
                "dataset {dir} holds a file whose name is not UTF-8"
            )));
        };
        if name.starts_with('.') {
            continue;
        }
        // The type comes with the directory entry (`d_type`): no `stat` per shard on the
        // write path (std falls back to `lstat` where the filesystem leaves it unknown).
        // Like `lstat`, a symlink is not a file here.
        let file_type = entry
            .file_type()
            .map_err(|e| ApiError::InvalidArgument(format!("dataset {dir}/{name}: {e}")))?;
        if file_type.is_file() {
            shards.push(path.join(name).to_string_lossy().to_string());
        }
        if shards.len() > MAX_DATASET_FILES {
            return Err(ApiError::InvalidArgument(format!(
                "dataset {dir} has more than {MAX_DATASET_FILES} files"
            )));
        }
    }
    if shards.is_empty() {
        return Err(ApiError::InvalidArgument(format!(
            "dataset {dir} has no shard files"
        )));
    }
    shards.sort();
    Ok(shards)
}

/// Creates the checkpoint root `dir` unless it is already a directory: one `stat` in the
/// common case (every job of a user shares a root) instead of `create_dir_all`'s failing
/// `mkdir` then `stat`. Blocking; call it off the runtime thread.
///
/// # Errors
/// [`ApiError::InvalidArgument`] naming `dir` when it cannot be created.
fn ensure_ckpt_dir(dir: &str) -> Result<(), ApiError> {
    if Path::new(dir).is_dir() {
        return Ok(());
    }
    create_shared_dirs(Path::new(dir)).map_err(|e| {
        ApiError::InvalidArgument(format!("checkpoint dir {dir} cannot be created: {e}"))
    })
}

/// Mode of the checkpoint root and the parents [`ensure_ckpt_dir`] creates: ranks running
/// as other users (`--run-as`) pass through them to their job's directory, which the
/// worker gives the job's group alone.
const CKPT_ROOT_MODE: u32 = 0o755;

/// `create_dir_all` with [`CKPT_ROOT_MODE`] set on every directory it creates, whatever
/// the process umask (the coordinator binary's is `0077`, for its data dir).
fn create_shared_dirs(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let missing: Vec<&Path> = dir
        .ancestors()
        .take_while(|p| !p.as_os_str().is_empty() && !p.is_dir())
        .collect();
    for path in missing.into_iter().rev() {
        match std::fs::create_dir(path) {
            Ok(()) => {
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(CKPT_ROOT_MODE))?
            }
            // Created meanwhile by another submit.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && path.is_dir() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The objects under an S3 dataset prefix whose names do not start with a dot, as
/// `s3://bucket/key` shard URLs (sorted).
///
/// # Errors
/// `InvalidArgument` when the prefix cannot be listed (with the S3 reason), is empty or
/// holds more than [`MAX_DATASET_FILES`] objects.
async fn list_s3_dataset(node: &Node, url: &str) -> Result<Vec<String>, ApiError> {
    let bad = |e: cumulus_ckpt::CkptError| {
        ApiError::InvalidArgument(format!("dataset {url} cannot be listed: {e}"))
    };
    let store = node.s3.store(url).await.map_err(bad)?;
    // As in a local dataset, an object whose name starts with a dot is not a shard (the
    // feature statistics `dataset split` writes, `.feature-stats.json`, is one).
    let keys: Vec<String> = store
        .list_objects()
        .await
        .map_err(bad)?
        .into_iter()
        .filter(|k| !k.rsplit('/').next().unwrap_or(k).starts_with('.'))
        .collect();
    if keys.is_empty() {
        return Err(ApiError::InvalidArgument(format!(
            "dataset {url} has no objects"
        )));
    }
    if keys.len() > MAX_DATASET_FILES {
        return Err(ApiError::InvalidArgument(format!(
            "dataset {url} has more than {MAX_DATASET_FILES} objects"
        )));
    }
    let bucket = &store.location().bucket;
    Ok(keys
        .into_iter()
        .map(|k| format!("s3://{bucket}/{k}"))
        .collect())
}

/// Admission checks a user would otherwise learn of only after the restart budget is
/// spent, or never: a dataset with fewer shards than ranks (a rank would get none), and,
/// unless `allow_pending`, a job larger than the alive workers offer in all (it would
/// stay pending for ever). A cluster with no alive worker (still starting) accepts it.
///
/// # Errors
/// `InvalidArgument` saying what is wrong and how to fix it.
fn check_fits(
    node: &Node,
    spec: &cumulus_raft_store::state::JobSpec,
    shard_count: usize,
    allow_pending: bool,
) -> Result<(), ApiError> {
    if !spec.dataset.is_empty() && shard_count < spec.world_size as usize {
        return Err(ApiError::InvalidArgument(format!(
            "the dataset {} has {shard_count} shard{} for {} ranks: ranks {}..{} would get \
             none; split it into at least {} shards (cumulusctl dataset split --shards N) \
             or lower --world-size",
            spec.dataset,
            if shard_count == 1 { "" } else { "s" },
            spec.world_size,
            shard_count,
            spec.world_size - 1,
            spec.world_size
        )));
    }
    if allow_pending {
        return Ok(());
    }
    let outlook = node.read_state(|s| {
        let any_alive = s
            .workers
            .values()
            .any(|w| w.state == cumulus_raft_store::state::WorkerState::Alive);
        any_alive.then(|| s.capacity_outlook(spec))
    });
    match outlook {
        Some(cumulus_raft_store::state::Outlook::Never(why)) => {
            Err(ApiError::InvalidArgument(format!(
                "the job is larger than the cluster: it {}; submit with --allow-pending (allow_pending) to queue it until workers join",
                why.trim_start_matches("cannot be placed: it ")
            )))
        }
        _ => Ok(()),
    }
}

/// Submits a job (idempotent by request id).
///
/// # Errors
/// `InvalidArgument` for a bad spec or dataset; `ResourceExhausted` past the state's
/// byte budget ([`Node::reserve_state_bytes`]); `NotLeader`/`Unavailable` from Raft.
pub async fn submit(
    node: &Node,
    who: &Principal,
    req: v1::SubmitJobRequest,
) -> Result<v1::SubmitJobResponse, ApiError> {
    require_role(who, Role::Submit, "submit jobs")?;
    let start_ns = stage::now_ns();
    let mut proposed_ns = None;
    let result = submit_checked(node, who, req, &mut proposed_ns).await;
    if let Some(proposed_ns) = proposed_ns {
        tracing::trace!(
            target: stage::TARGET,
            stage = "submit",
            start_ns,
            proposed_ns,
            end_ns = stage::now_ns(),
        );
    }
    result
}

/// [`submit`]'s checks and proposal; sets `proposed_ns` ([`stage::now_ns`]) when the
/// command goes to Raft.
async fn submit_checked(
    node: &Node,
    who: &Principal,
    mut req: v1::SubmitJobRequest,
    proposed_ns: &mut Option<u64>,
) -> Result<v1::SubmitJobResponse, ApiError> {
    let owner = who.name.as_str();
    node.require_leader()?;
    if req.request_id.is_empty() || req.request_id.len() > 128 {
        return Err(ApiError::InvalidArgument(
            "request_id must be 1..=128 bytes".into(),
        ));
    }
    let Some(spec) = req.spec.as_ref() else {
        return Err(ApiError::InvalidArgument(
            "the request has no job spec".into(),
        ));
    };
    // A retried request id returns its job before any validation against today's disk.
    let existing = node.read_state(|s| s.request_ids.get(&req.request_id).cloned());
    if !spec.resume_from_job.is_empty() {
        let mut spec = spec.clone();
        fill_from_resumed_job(node, who, &mut spec)?;
        req.spec = Some(spec);
    }
    let spec = spec_from_proto(
        req.spec.as_ref().expect("checked above"),
        node.limits.max_world_size,
    )?;
    let roots = &node.limits.roots;
    if existing.is_none() {
        // Checked at admission, not in `apply`: the log may hold older jobs' names.
        if !cumulus_api::text::is_printable(&spec.name) {
            return Err(ApiError::InvalidArgument(format!(
                "job name {} holds control or invisible characters",
                cumulus_api::text::escape_control(&spec.name)
            )));
        }
        roots.check_spec_lexical(&spec.dataset, &spec.ckpt_dir, &spec.working_dir)?;
    }
    let mut shards = if existing.is_some() || spec.dataset.is_empty() {
        node.read_state(|s| {
            existing
                .as_ref()
                .and_then(|id| s.jobs.get(id))
                .map(|j| j.shard_plan.concat())
                .unwrap_or_default()
        })
    } else if spec.dataset.starts_with("s3://") {
        list_s3_dataset(node, &spec.dataset).await?
    } else {
        // A local dataset is listed below, with the checkpoint dir check.
        Vec::new()
    };
    if !spec.ckpt_url.is_empty() && existing.is_none() {
        // Fail the submit, not the first commit, on a bad target: unreachable endpoint, bad
        // credentials, missing bucket, access denied.
        let store = node.s3.store(&spec.ckpt_url).await.map_err(|e| {
            ApiError::InvalidArgument(format!("checkpoint target {}: {e}", spec.ckpt_url))
        })?;
        store.check_access().await.map_err(|e| {
            ApiError::InvalidArgument(format!(
                "checkpoint target {} is not usable: {e}",
                spec.ckpt_url
            ))
        })?;
    }
    // The user's directories may sit on a slow or hung network mount: list and check them
    // on the blocking pool (one hand-off for both), never on the runtime thread, which
    // also runs Raft's heartbeats (one thread by default) — unless the fast path of
    // `localfs` can confirm both on local file systems without blocking.
    let list_local =
        existing.is_none() && !spec.dataset.is_empty() && !spec.dataset.starts_with("s3://");
    let check_ckpt_dir = existing.is_none() && !spec.ckpt_dir.is_empty();
    if list_local || check_ckpt_dir {
        let dataset = list_local.then_some(spec.dataset.as_str());
        let ckpt_dir = check_ckpt_dir.then_some(spec.ckpt_dir.as_str());
        let inline = node
            .local_fs
            .fresh_table()
            .and_then(|table| localfs::checks_inline(&table, dataset, ckpt_dir));
        let listed = match inline {
            Some(listed) => listed,
            None => {
                let dataset = dataset.map(str::to_owned);
                let ckpt_dir = ckpt_dir.map(str::to_owned);
                let roots = roots.clone();
                tokio::task::spawn_blocking(move || {
                    // The fast path above takes no symlinks; here every one is resolved
                    // and must stay under the roots before anything is listed or created.
                    let listed = dataset
                        .as_deref()
                        .map(|d| {
                            roots.dataset.check_resolved(d)?;
                            list_dataset(d)
                        })
                        .transpose()?;
                    if let Some(ckpt_dir) = &ckpt_dir {
                        roots.ckpt.check_resolved(ckpt_dir)?;
                        ensure_ckpt_dir(ckpt_dir)?;
                    }
                    Ok::<_, ApiError>(listed)
                })
                .await
                .map_err(|e| {
                    ApiError::Internal(format!("the dataset listing task failed: {e}"))
                })??
            }
        };
        if let Some(listed) = listed {
            shards = listed;
        }
    }
    shards.sort();
    if existing.is_none() {
        check_fits(node, &spec, shards.len(), req.allow_pending)?;
    }
    // A new job must fit the state's byte budget; a retried request id adds nothing.
    let _reservation = if existing.is_none() {
        Some(node.reserve_state_bytes(submit_bytes(&spec, &shards), who)?)
    } else {
        None
    };
    let cmd = Command::SubmitJob {
        request_id: req.request_id.clone(),
        spec,
        shards,
        submitted_at_ms: now_ms(),
        owner: owner.to_string(),
    };
    *proposed_ns = Some(stage::now_ns());
    match node.propose(cmd).await? {
        Response::JobSubmitted { job_id, created } => Ok(v1::SubmitJobResponse { job_id, created }),
        Response::Rejected { reason } => Err(ApiError::InvalidArgument(reason)),
        Response::Ok | Response::Batch { .. } => {
            Err(ApiError::Internal("submit produced no job".into()))
        }
    }
}

/// Completes a spec that resumes from an earlier job (`resume_from_job`): the step
/// defaults to that job's newest committed one, and the dataset and checkpoint target
/// (which must be the same) to that job's when left empty. Whether the step, world size
/// and shard plan fit is `apply`'s check.
///
/// # Errors
/// `InvalidArgument` for a malformed id; `NotFound` for an unknown job;
/// `PermissionDenied` when `who` may not read that job's checkpoints;
/// `FailedPrecondition` when it has no committed step.
fn fill_from_resumed_job(
    node: &Node,
    who: &Principal,
    spec: &mut v1::JobSpec,
) -> Result<(), ApiError> {
    let job_id = spec.resume_from_job.clone();
    if !cumulus_raft_store::state::is_job_id(&job_id) {
        return Err(ApiError::InvalidArgument(format!(
            "resume_from {} is not a job id (job-NNNNNN)",
            cumulus_api::text::escape_control(&job_id)
        )));
    }
    require_owner(node, who, &job_id, "resume from")?;
    let (source, newest) = node
        .read_state(|s| {
            s.jobs
                .get(&job_id)
                .map(|j| (j.spec.clone(), j.committed_step))
        })
        .ok_or_else(|| ApiError::NotFound(format!("no job {job_id:?}")))?;
    if spec.resume_from_step.is_none() {
        spec.resume_from_step = Some(newest.ok_or_else(|| {
            ApiError::FailedPrecondition(format!(
                "{job_id} has no committed checkpoint to resume from"
            ))
        })?);
    }
    if spec.dataset.is_empty() {
        spec.dataset = source.dataset;
    }
    if spec.ckpt_dir.is_empty() && spec.ckpt_url.is_empty() {
        spec.ckpt_dir = source.ckpt_dir;
        spec.ckpt_url = source.ckpt_url;
        if spec.ckpt_commit_tier.is_empty() {
            spec.ckpt_commit_tier = source.ckpt_commit_tier;
        }
    }
    Ok(())
}

/// Reads one job; with `linearizable` the read goes through the leader's read index.
///
/// # Errors
/// `NotFound` for an unknown id; `NotLeader` for a linearizable read on a follower.
pub async fn get_job(
    node: &Node,
    job_id: &str,
    linearizable: bool,
) -> Result<v1::JobResponse, ApiError> {
    if linearizable {
        node.linearizable_barrier().await?;
    }
    let progress = node.soft().progress.clone();
    let job = node
        .read_state(|s| {
            s.jobs
                .get(job_id)
                .map(|j| job_to_proto(j, &progress, now_ms(), s.pending_reason(j)))
        })
        .ok_or_else(|| {
            ApiError::NotFound(format!(
                "no job {job_id:?} (list jobs with `cumulusctl list`)"
            ))
        })?;
    Ok(v1::JobResponse {
        job: Some(job),
        linearizable,
    })
}

pub use cumulus_api::limits::{DEFAULT_SUMMARIES, MAX_SUMMARIES};

/// One job's summary with its progress history (the leader's soft state: ask the
/// leader for live figures).
///
/// # Errors
/// `NotFound` for an unknown id.
pub fn job_summary(node: &Node, job_id: &str) -> Result<v1::JobSummary, ApiError> {
    let job = node
        .read_state(|s| s.jobs.get(job_id).cloned())
        .ok_or_else(|| {
            ApiError::NotFound(format!(
                "no job {job_id:?} (list jobs with `cumulusctl list`)"
            ))
        })?;
    let soft = node.soft();
    Ok(crate::convert::job_summary(
        &job,
        &soft.progress,
        soft.history.get(job_id),
        now_ms(),
        true,
    ))
}

/// Summaries of the newest jobs (of `state`, or any), newest first, without history.
///
/// # Errors
/// `InvalidArgument` for an unknown state or a limit above [`MAX_SUMMARIES`].
pub fn job_summaries(
    node: &Node,
    req: &v1::ListJobSummariesRequest,
) -> Result<v1::ListJobSummariesResponse, ApiError> {
    let state = if req.state.is_empty() {
        None
    } else {
        Some(
            req.state
                .parse::<cumulus_api::JobState>()
                .map_err(|e| ApiError::InvalidArgument(e.to_string()))?,
        )
    };
    let limit = match req.limit as usize {
        0 => DEFAULT_SUMMARIES,
        n if n > MAX_SUMMARIES => {
            return Err(ApiError::InvalidArgument(format!(
                "limit {n} is above {MAX_SUMMARIES}"
            )));
        }
        n => n,
    };
    let jobs: Vec<_> = node.read_state(|s| {
        s.jobs
            .values()
            .rev()
            .filter(|j| state.is_none_or(|st| j.state == st))
            .take(limit)
            .cloned()
            .collect()
    });
    let soft = node.soft();
    let now = now_ms();
    let summaries = jobs
        .iter()
        .map(|j| {
            crate::convert::job_summary(j, &soft.progress, soft.history.get(&j.id), now, false)
        })
        .collect();
    Ok(v1::ListJobSummariesResponse { summaries })
}

/// Lists every job.
///
/// # Errors
/// `NotLeader` for a linearizable read on a follower.
pub async fn list_jobs(node: &Node, linearizable: bool) -> Result<v1::ListJobsResponse, ApiError> {
    if linearizable {
        node.linearizable_barrier().await?;
    }
    let progress = node.soft().progress.clone();
    let now = now_ms();
    let jobs = node.read_state(|s| {
        s.jobs
            .values()
            .map(|j| job_to_proto(j, &progress, now, None))
            .collect()
    });
    Ok(v1::ListJobsResponse { jobs })
}

/// Cancels a job.
///
/// # Errors
/// `NotFound`, `FailedPrecondition` (already finished), `NotLeader`.
pub async fn cancel(
    node: &Node,
    who: &Principal,
    job_id: &str,
) -> Result<v1::JobResponse, ApiError> {
    require_role(who, Role::Submit, "cancel jobs")?;
    node.require_leader()?;
    require_owner(node, who, job_id, "cancel")?;
    node.propose_ok(Command::CancelJob {
        job_id: job_id.to_string(),
        at_ms: now_ms(),
    })
    .await?;
    get_job(node, job_id, false).await
}

/// Pauses a job: a running job's ranks are asked to checkpoint and stop (then it is
/// `paused`, holding no slots); a pending job is parked at once.
///
/// # Errors
/// `NotFound`, `FailedPrecondition` (finished, already paused, a stop in flight),
/// `PermissionDenied` (not the owner), `NotLeader`.
pub async fn pause(
    node: &Node,
    who: &Principal,
    job_id: &str,
) -> Result<v1::JobResponse, ApiError> {
    require_role(who, Role::Submit, "pause jobs")?;
    node.require_leader()?;
    require_owner(node, who, job_id, "pause")?;
    node.propose_ok(Command::PauseJob {
        job_id: job_id.to_string(),
        at_ms: now_ms(),
    })
    .await?;
    get_job(node, job_id, false).await
}

/// Resumes a paused job: it is queued again and resumes from its newest committed step.
///
/// # Errors
/// `NotFound`, `FailedPrecondition` (not paused, or still pausing), `PermissionDenied`
/// (not the owner), `NotLeader`.
pub async fn resume(
    node: &Node,
    who: &Principal,
    job_id: &str,
) -> Result<v1::JobResponse, ApiError> {
    require_role(who, Role::Submit, "resume jobs")?;
    node.require_leader()?;
    require_owner(node, who, job_id, "resume")?;
    node.propose_ok(Command::ResumeJob {
        job_id: job_id.to_string(),
        at_ms: now_ms(),
    })
    .await?;
    get_job(node, job_id, false).await
}

/// Most jobs one purge deletes (a second purge takes the rest).
pub const MAX_PURGE_JOBS: usize = 4_096;

/// Deletes a job's checkpoints: its S3 prefix (`ckpt_url`) and its directory under
/// `ckpt_dir` as this leader sees it. Returns whether anything was there.
async fn delete_checkpoints(
    node: &Node,
    job_id: &str,
    spec: &cumulus_raft_store::state::JobSpec,
) -> Result<bool, ApiError> {
    let failed = |e: cumulus_ckpt::CkptError| {
        ApiError::Unavailable(format!(
            "the checkpoints of {job_id} could not be deleted (the job is kept; retry): {e}"
        ))
    };
    if let Some((fork, step)) = node
        .read_state(|s| s.fork_references(job_id))
        .into_iter()
        .next()
    {
        return Err(ApiError::FailedPrecondition(format!(
            "{fork} resumes from step {step} of {job_id} and has committed no step of its own yet: \
             delete {job_id} without its checkpoints, or once {fork} has committed"
        )));
    }
    let mut found = false;
    if !spec.ckpt_url.is_empty() {
        let store = node.s3.store(&spec.ckpt_url).await.map_err(failed)?;
        found |= cumulus_ckpt::CheckpointStore::delete_job(&store, job_id)
            .await
            .map_err(failed)?;
    }
    if !spec.ckpt_dir.is_empty() {
        let store = cumulus_ckpt::LocalStore::new(&spec.ckpt_dir);
        found |= cumulus_ckpt::CheckpointStore::delete_job(&store, job_id)
            .await
            .map_err(failed)?;
    }
    Ok(found)
}

/// Deletes a finished job's record, and first its checkpoints when `checkpoints`.
///
/// # Errors
/// `NotFound`, `FailedPrecondition` (not finished), `PermissionDenied` (not the
/// owner), `Unavailable` (the checkpoints could not be deleted: the job is kept),
/// `NotLeader`.
pub async fn delete(
    node: &Node,
    who: &Principal,
    job_id: &str,
    checkpoints: bool,
) -> Result<v1::DeleteJobResponse, ApiError> {
    require_role(who, Role::Submit, "delete jobs")?;
    node.require_leader()?;
    require_owner(node, who, job_id, "delete")?;
    let (state, spec) = node
        .read_state(|s| s.jobs.get(job_id).map(|j| (j.state, j.spec.clone())))
        .ok_or_else(|| ApiError::NotFound(format!("no job {job_id:?}")))?;
    if !state.is_terminal() {
        return Err(ApiError::FailedPrecondition(format!(
            "job {job_id} is {state}: cancel it before deleting it"
        )));
    }
    let checkpoints_deleted = checkpoints && delete_checkpoints(node, job_id, &spec).await?;
    node.propose_ok(Command::DeleteJob {
        job_id: job_id.to_string(),
    })
    .await?;
    Ok(v1::DeleteJobResponse {
        job_id: job_id.to_string(),
        checkpoints_deleted,
    })
}

/// Deletes every finished job (of `state`, or any finished state for "") that ended at
/// least `older_than_ms` ago and that `who` owns (an administrator: every one), at most
/// [`MAX_PURGE_JOBS`]; their checkpoints first when asked.
///
/// # Errors
/// `InvalidArgument` (a state that is not finished, `older_than_ms` 0), `Unavailable`
/// (checkpoints that could not be deleted: that job and the rest are kept; the jobs
/// deleted so far stay deleted), `NotLeader`.
pub async fn purge(
    node: &Node,
    who: &Principal,
    req: v1::PurgeJobsRequest,
) -> Result<v1::PurgeJobsResponse, ApiError> {
    require_role(who, Role::Submit, "delete jobs")?;
    node.require_leader()?;
    let state = if req.state.is_empty() {
        None
    } else {
        let s: cumulus_api::JobState = req
            .state
            .parse()
            .map_err(|e: cumulus_api::UnknownName| ApiError::InvalidArgument(e.to_string()))?;
        if !s.is_terminal() {
            return Err(ApiError::InvalidArgument(format!(
                "only finished jobs are purged; {s} is not a finished state"
            )));
        }
        Some(s)
    };
    if req.older_than_ms == 0 {
        return Err(ApiError::InvalidArgument(
            "older_than_ms must be above 0".into(),
        ));
    }
    let cutoff_ms = now_ms().saturating_sub(req.older_than_ms);
    let victims: Vec<(String, cumulus_raft_store::state::JobSpec)> = node.read_state(|s| {
        s.job_index()
            .terminal
            .iter()
            .filter_map(|id| s.jobs.get(id))
            .filter(|j| state.is_none_or(|st| j.state == st))
            .filter(|j| j.finished_at_ms <= cutoff_ms)
            .filter(|j| who.owns_or_administers(&j.owner))
            // A job another one still resumes from keeps its checkpoints, and so its record.
            .filter(|j| !req.checkpoints || s.fork_references(&j.id).is_empty())
            .take(MAX_PURGE_JOBS)
            .map(|j| (j.id.clone(), j.spec.clone()))
            .collect()
    });
    let mut deleted = Vec::new();
    for chunk in victims.chunks(cumulus_raft_store::state::MAX_BATCH_COMMANDS) {
        let mut commands = Vec::with_capacity(chunk.len());
        for (id, spec) in chunk {
            if req.checkpoints {
                delete_checkpoints(node, id, spec).await?;
            }
            commands.push(Command::DeleteJob { job_id: id.clone() });
        }
        let responses = match node.propose(Command::Batch { commands }).await? {
            cumulus_raft_store::Response::Batch { responses } => responses,
            other => {
                return Err(ApiError::Internal(format!(
                    "a purge batch was answered {other:?}"
                )));
            }
        };
        deleted.extend(
            chunk
                .iter()
                .zip(responses)
                .filter(|(_, r)| *r == cumulus_raft_store::Response::Ok)
                .map(|((id, _), _)| id.clone()),
        );
    }
    Ok(v1::PurgeJobsResponse { job_ids: deleted })
}

/// The cluster as this node sees it.
pub fn cluster_status(node: &Node) -> v1::ClusterStatusResponse {
    let m = node.raft.metrics().borrow_watched().clone();
    let membership = m.membership_config.membership();
    let voters: Vec<u64> = membership.voter_ids().collect();
    let members = membership
        .nodes()
        .map(|(id, n)| {
            let role = if m.current_leader == Some(*id) {
                "leader"
            } else if *id == node.id {
                match m.state {
                    ServerState::Candidate => "candidate",
                    ServerState::Learner => "learner",
                    ServerState::Follower => "follower",
                    ServerState::Leader => "leader",
                    ServerState::Shutdown => "shutdown",
                }
            } else if voters.contains(id) {
                "follower"
            } else {
                "learner"
            };
            v1::Member {
                node_id: *id,
                grpc_addr: n.grpc_addr.clone(),
                http_addr: n.http_addr.clone(),
                role: role.to_string(),
                voter: voters.contains(id),
            }
        })
        .collect();
    let soft_workers = node.soft().workers.clone();
    let workers = node.read_state(|s| workers_to_proto(s, &soft_workers));
    // openraft's committed log id as this node knows it: on the leader, acknowledged by
    // a quorum; on a follower, what the leader last told it.
    let commit_index = m.cluster_committed.or(m.local_committed).map(|l| l.index);
    v1::ClusterStatusResponse {
        node_id: node.id,
        leader_id: m.current_leader,
        term: m.current_term,
        commit_index: commit_index.or(m.last_applied.map(|l| l.index)),
        last_applied_index: m.last_applied.map(|l| l.index),
        members,
        workers,
        snapshot_index: m.snapshot.map(|l| l.index),
        purged_index: m.purged.map(|l| l.index),
        insecure: !node.tls,
    }
}

/// Longest an `add-learner` waits for the new learner to catch up before answering.
pub const ADD_LEARNER_TIMEOUT_MS: u64 = 60_000;
/// Longest address accepted for a new member, in bytes.
pub const MAX_MEMBER_ADDR_BYTES: usize = 256;

fn validate_member_addr(what: &str, addr: &str) -> Result<(), ApiError> {
    let ok = !addr.is_empty()
        && addr.len() <= MAX_MEMBER_ADDR_BYTES
        && addr.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
        })
        && !addr.contains(['/', ' ', '@']);
    if ok {
        Ok(())
    } else {
        Err(ApiError::InvalidArgument(format!(
            "{what} {addr:?} must be HOST:PORT (at most {MAX_MEMBER_ADDR_BYTES} bytes)"
        )))
    }
}

fn membership_error(
    node: &Node,
    e: RaftError<TypeConfig, ClientWriteError<TypeConfig>>,
) -> ApiError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => ApiError::NotLeader {
            leader: f.leader_node.clone().or_else(|| node.leader_node()),
        },
        RaftError::APIError(ClientWriteError::ChangeMembershipError(c)) => {
            ApiError::FailedPrecondition(format!("membership change refused: {c}"))
        }
        other => ApiError::Unavailable(format!("raft could not change the membership: {other}")),
    }
}

/// Adds coordinator `req.node_id` as a learner and waits (up to
/// [`ADD_LEARNER_TIMEOUT_MS`]) until it has caught up with the leader's log. Idempotent:
/// adding a member again with the same addresses succeeds.
///
/// # Errors
/// `InvalidArgument` for a bad id or address, or an id already used with other
/// addresses; `NotLeader`; `Unavailable` when Raft cannot commit or the learner did not
/// catch up in time (it stays a learner; retry or remove it).
pub async fn add_learner(
    node: &Node,
    who: &Principal,
    req: v1::AddLearnerRequest,
) -> Result<v1::ClusterStatusResponse, ApiError> {
    require_role(who, Role::Admin, "change the membership")?;
    node.require_leader()?;
    if req.node_id == 0 {
        return Err(ApiError::InvalidArgument("node_id must be >= 1".into()));
    }
    validate_member_addr("grpc_addr", &req.grpc_addr)?;
    validate_member_addr("http_addr", &req.http_addr)?;
    let new = CumulusNode {
        grpc_addr: req.grpc_addr.clone(),
        http_addr: req.http_addr.clone(),
    };
    let existing = node
        .raft
        .metrics()
        .borrow_watched()
        .membership_config
        .membership()
        .get_node(&req.node_id)
        .cloned();
    if let Some(old) = existing
        && old != new
    {
        return Err(ApiError::InvalidArgument(format!(
            "node {} is already a member at {} (HTTP {}); remove it first",
            req.node_id, old.grpc_addr, old.http_addr
        )));
    }
    let added = tokio::time::timeout(
        std::time::Duration::from_millis(ADD_LEARNER_TIMEOUT_MS),
        node.raft.add_learner(req.node_id, new, true),
    )
    .await
    .map_err(|_| {
        ApiError::Unavailable(format!(
            "node {} was added as a learner but has not caught up within {} ms; is it running?",
            req.node_id, ADD_LEARNER_TIMEOUT_MS
        ))
    })?;
    added.map_err(|e| membership_error(node, e))?;
    Ok(cluster_status(node))
}

/// Makes learner `node_id` a voter. Idempotent for a node that already votes.
///
/// # Errors
/// `NotFound` for a node that is not a member; `NotLeader`; `FailedPrecondition` when
/// another membership change is in progress; `Unavailable` from Raft.
pub async fn promote_member(
    node: &Node,
    who: &Principal,
    node_id: u64,
) -> Result<v1::ClusterStatusResponse, ApiError> {
    require_role(who, Role::Admin, "change the membership")?;
    node.require_leader()?;
    let (is_member, is_voter) = {
        let m = node.raft.metrics().borrow_watched().clone();
        let ms = m.membership_config.membership();
        (
            ms.get_node(&node_id).is_some(),
            ms.voter_ids().any(|v| v == node_id),
        )
    };
    if !is_member {
        return Err(ApiError::NotFound(format!(
            "node {node_id} is not a member; add it with add-learner first"
        )));
    }
    if !is_voter {
        node.raft
            .change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([node_id])), false)
            .await
            .map_err(|e| membership_error(node, e))?;
    }
    Ok(cluster_status(node))
}

/// Removes voter or learner `node_id` from the cluster. Idempotent for a node that is not
/// a member. Removing the leader itself is allowed: it steps down once the new
/// configuration is committed.
///
/// # Errors
/// `FailedPrecondition` when it is the last voter or another change is in progress;
/// `NotLeader`; `Unavailable` from Raft.
pub async fn remove_member(
    node: &Node,
    who: &Principal,
    node_id: u64,
) -> Result<v1::ClusterStatusResponse, ApiError> {
    require_role(who, Role::Admin, "change the membership")?;
    node.require_leader()?;
    let (is_member, voters) = {
        let m = node.raft.metrics().borrow_watched().clone();
        let ms = m.membership_config.membership();
        (
            ms.get_node(&node_id).is_some(),
            ms.voter_ids().collect::<BTreeSet<_>>(),
        )
    };
    if is_member {
        let change = if voters.contains(&node_id) {
            if voters.len() == 1 {
                return Err(ApiError::FailedPrecondition(format!(
                    "node {node_id} is the last voter; a cluster cannot remove it"
                )));
            }
            ChangeMembers::RemoveVoters(BTreeSet::from([node_id]))
        } else {
            ChangeMembers::RemoveNodes(BTreeSet::from([node_id]))
        };
        node.raft
            .change_membership(change, false)
            .await
            .map_err(|e| membership_error(node, e))?;
    }
    Ok(cluster_status(node))
}

/// True when every part of `manifest` verifies in `store`.
async fn all_parts_verify(
    store: &dyn CheckpointStore,
    job_id: &str,
    manifest: &cumulus_ckpt::Manifest,
) -> bool {
    for part in &manifest.parts {
        if store.verify_part(job_id, part).await.is_err() {
            return false;
        }
    }
    true
}

/// Lists a job's kept checkpoint steps, verifying each against its manifest (in the
/// commit tier) and reporting the tiers that hold a verified copy.
///
/// # Errors
/// `NotFound` for an unknown job.
pub async fn list_checkpoints(
    node: &Node,
    job_id: &str,
) -> Result<v1::ListCheckpointsResponse, ApiError> {
    let (spec, steps) = node
        .read_state(|s| {
            s.jobs.get(job_id).map(|j| {
                (
                    j.spec.clone(),
                    j.committed.keys().copied().collect::<Vec<_>>(),
                )
            })
        })
        .ok_or_else(|| ApiError::NotFound(format!("no job {job_id:?}")))?;
    let l1 = (!spec.ckpt_dir.is_empty()).then(|| cumulus_ckpt::LocalStore::new(&spec.ckpt_dir));
    let l2 =
        if spec.ckpt_url.is_empty() {
            None
        } else {
            Some(node.s3.store(&spec.ckpt_url).await.map_err(|e| {
                ApiError::Internal(format!("checkpoint target {}: {e}", spec.ckpt_url))
            })?)
        };
    // The commit tier holds manifests and LATEST.
    let l2_primary = l2.is_some() && (spec.ckpt_commit_tier != "l1" || l1.is_none());
    let primary: &dyn CheckpointStore = match (&l1, &l2) {
        (_, Some(l2)) if spec.ckpt_commit_tier != "l1" => l2,
        (Some(l1), _) => l1,
        (None, Some(l2)) => l2,
        (None, None) => {
            return Ok(v1::ListCheckpointsResponse {
                checkpoints: vec![],
            });
        }
    };
    let latest = primary.read_latest(job_id).await.ok().flatten();
    let mut checkpoints = Vec::new();
    for step in steps.into_iter().rev() {
        let verified = primary.verify_step(job_id, step).await;
        let mut tiers = Vec::new();
        if let Ok(manifest) = &verified {
            // L1 as the coordinator sees ckpt_dir (shared, or this machine's); L2 in S3.
            if let Some(l1) = &l1
                && all_parts_verify(l1, job_id, manifest).await
            {
                tiers.push(cumulus_api::states::CheckpointTier::L1.to_string());
            }
            if let Some(l2) = &l2
                && all_parts_verify(l2, job_id, manifest).await
            {
                tiers.push(cumulus_api::states::CheckpointTier::L2.to_string());
            }
        }
        let path = match (&l2, &l1) {
            (Some(l2), _) if l2_primary => format!(
                "s3://{}/{}",
                l2.location().bucket,
                l2.location()
                    .key(&format!("{job_id}/{}", cumulus_ckpt::step_dir_name(step)))
            ),
            (_, Some(l1)) => l1
                .job_dir(job_id)
                .join(cumulus_ckpt::step_dir_name(step))
                .to_string_lossy()
                .to_string(),
            _ => String::new(),
        };
        checkpoints.push(v1::CheckpointInfo {
            step,
            path,
            verified: verified.is_ok(),
            bytes: verified.as_ref().map_or(0, |m| m.total_bytes()),
            latest: latest == Some(step),
            tiers,
        });
    }
    Ok(v1::ListCheckpointsResponse { checkpoints })
}

/// Creates user `req.name` with `req.role` and a token drawn here (32 random bytes); the
/// state keeps the secret's SHA-256 only. Administrators only.
///
/// # Errors
/// `PermissionDenied`; `InvalidArgument` for a bad name or role; `FailedPrecondition`
/// when the user exists (revoke first) or the cluster has [`users::MAX_USERS`];
/// `NotLeader`/`Unavailable` from Raft.
pub async fn create_user(
    node: &Node,
    who: &Principal,
    req: v1::CreateUserRequest,
) -> Result<v1::CreateUserResponse, ApiError> {
    require_role(who, Role::Admin, "create users")?;
    node.require_leader()?;
    if !users::is_valid_user_name(&req.name) {
        return Err(ApiError::InvalidArgument(format!(
            "user name {:?}: 1..={} bytes of [a-z0-9-] starting with a letter, not {:?}",
            cumulus_api::text::escape_control(&req.name),
            users::MAX_USER_NAME_BYTES,
            users::CLUSTER_ADMIN
        )));
    }
    let role: Role = req
        .role
        .parse()
        .map_err(|e: cumulus_api::UnknownName| ApiError::InvalidArgument(e.to_string()))?;
    let secret = {
        use base64::Engine;
        let mut bytes = [0u8; 32];
        rand::fill(&mut bytes);
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    };
    node.propose_ok(Command::CreateUser {
        name: req.name.clone(),
        role,
        secret_sha256: users::secret_digest(&secret),
        created_by: who.name.clone(),
        at_ms: now_ms(),
    })
    .await?;
    tracing::info!(user = %req.name, %role, by = %who.name, "user created");
    Ok(v1::CreateUserResponse {
        token: users::format_user_token(&req.name, &secret),
        name: req.name,
        role: role.to_string(),
    })
}

/// Revokes user `name`'s token. Administrators only.
///
/// # Errors
/// `PermissionDenied`; `NotFound` for an unknown user; `NotLeader`/`Unavailable`.
pub async fn revoke_user(node: &Node, who: &Principal, name: &str) -> Result<(), ApiError> {
    require_role(who, Role::Admin, "revoke users")?;
    node.require_leader()?;
    if !node.read_state(|s| s.users.contains_key(name)) {
        return Err(ApiError::NotFound(format!(
            "no user {:?}",
            cumulus_api::text::escape_control(name)
        )));
    }
    node.propose_ok(Command::RevokeUser {
        name: name.to_string(),
    })
    .await?;
    tracing::info!(user = %name, by = %who.name, "user revoked");
    Ok(())
}

/// Every user (names, roles, who created them; never a secret). Administrators only.
///
/// # Errors
/// `PermissionDenied`.
pub fn list_users(node: &Node, who: &Principal) -> Result<v1::ListUsersResponse, ApiError> {
    require_role(who, Role::Admin, "list users")?;
    let users = node.read_state(|s| {
        s.users
            .values()
            .map(|u| v1::UserInfo {
                name: u.name.clone(),
                role: u.role.to_string(),
                created_by: u.created_by.clone(),
                created_at_ms: u.created_at_ms,
            })
            .collect()
    });
    Ok(v1::ListUsersResponse { users })
}
