//! The users' arms of `apply`: `CreateUser` and `RevokeUser`.

use crate::state::*;

impl ClusterState {
    /// `CreateUser`: checks the name (the rule of [`cumulus_api::users`]), that no
    /// user of that name exists, the [`cumulus_api::users::MAX_USERS`] bound and the token
    /// digest (64 lowercase hex digits), in that order; then records the user. Touches
    /// no job or worker, so it records no dirty key.
    pub(super) fn create_user(
        &mut self,
        name: &str,
        role: cumulus_api::Role,
        secret_sha256: &str,
        created_by: &str,
        at_ms: u64,
    ) -> Response {
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
            name.to_string(),
            UserRecord {
                name: name.to_string(),
                role,
                secret_sha256: secret_sha256.to_string(),
                created_by: created_by.to_string(),
                created_at_ms: at_ms,
            },
        );
        Response::Ok
    }

    /// `RevokeUser`: removes the user; rejects a name the state does not hold.
    pub(super) fn revoke_user(&mut self, name: &str) -> Response {
        if self.users.remove(name).is_some() {
            Response::Ok
        } else {
            reject(format!("no user {name:?}"))
        }
    }
}
