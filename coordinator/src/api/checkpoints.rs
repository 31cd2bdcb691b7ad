//! A job's checkpoints: listing its kept steps, each verified against its manifest with
//! the tiers that hold a verified copy, and deleting them (for `delete` and `purge`).

use cumulus_api::v1;
use cumulus_ckpt::CheckpointStore;

use crate::error::ApiError;
use crate::node::Node;

/// Deletes a job's checkpoints: its S3 prefix (`ckpt_url`) and its directory under
/// `ckpt_dir` as this leader sees it. Returns whether anything was there.
pub(super) async fn delete_checkpoints(
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
