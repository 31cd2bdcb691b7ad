//! A job's lifecycle after admission: cancel, pause, resume, delete and purge, each
//! checked against the caller's role and ownership.

use cumulus_api::Role;
use cumulus_api::users::Principal;
use cumulus_api::v1;
use cumulus_raft_store::Command;

use super::authorization::{require_owner, require_role};
use super::checkpoints::delete_checkpoints;
use super::jobs::get_job;
use crate::error::ApiError;
use crate::node::Node;
use crate::soft::now_ms;

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
