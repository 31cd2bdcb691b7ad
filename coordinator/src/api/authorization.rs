//! Authorization: the role and ownership checks every other concern of the client API
//! runs before acting.

use crate::error::ApiError;
use crate::node::Node;
use cumulus_api::Role;
use cumulus_api::users::Principal;

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
