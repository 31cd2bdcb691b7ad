//! Users: an administrator creates, revokes and lists users; the state keeps each
//! token's digest, never the secret.

use cumulus_api::Role;
use cumulus_api::users::{self, Principal};
use cumulus_api::v1;
use cumulus_raft_store::Command;

use super::authorization::require_role;
use crate::error::ApiError;
use crate::node::Node;
use crate::soft::now_ms;

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
