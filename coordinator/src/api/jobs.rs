//! Reading jobs: one job, the summaries with their progress, every job; linearizable
//! through the leader's read index when asked.

use cumulus_api::v1;

use crate::convert::job_to_proto;
use crate::error::ApiError;
use crate::node::Node;
use crate::soft::now_ms;

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

/// One job's summary with its progress history (replicated: any coordinator serves the
/// samples; the live figures come from the leader's soft state, so ask the leader for
/// those).
///
/// # Errors
/// `NotFound` for an unknown id.
pub fn job_summary(node: &Node, job_id: &str) -> Result<v1::JobSummary, ApiError> {
    let (job, history) = node
        .read_state(|s| {
            s.jobs
                .get(job_id)
                .map(|j| (j.clone(), s.histories.get(job_id).cloned()))
        })
        .ok_or_else(|| {
            ApiError::NotFound(format!(
                "no job {job_id:?} (list jobs with `cumulusctl list`)"
            ))
        })?;
    let soft = node.soft();
    Ok(crate::convert::job_summary(
        &job,
        &soft.progress,
        (soft.history.get(job_id), history.as_deref()),
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
            .map(|j| (j.clone(), s.histories.get(&j.id).cloned()))
            .collect()
    });
    let soft = node.soft();
    let now = now_ms();
    let summaries = jobs
        .iter()
        .map(|(j, h)| {
            crate::convert::job_summary(
                j,
                &soft.progress,
                (soft.history.get(&j.id), h.as_deref()),
                now,
                false,
            )
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
