//! Users and their tokens: the names a user may have, what a user's bearer token looks
//! like, and the digest the cluster stores instead of it.
//!
//! A user token is `cu.<name>.<secret>`: the user's name (so the coordinator finds the
//! user without trying every stored digest) and a secret of 32 random bytes in unpadded
//! base64url (43 characters), drawn by the leader. The replicated state keeps only the
//! SHA-256 of the secret. A plain hash suffices here, unlike for passwords: the secret is
//! 256 bits of randomness, so no dictionary or brute-force attack on the digest is
//! feasible, and checking a request costs one SHA-256 (a slow password hash such as
//! argon2 would cost tens of milliseconds on every call). The cluster token (given to
//! the coordinators with `--token-file`) stays an administrator's credential.

use sha2::{Digest, Sha256};

use crate::Role;

/// First characters of every user token.
pub const TOKEN_PREFIX: &str = "cu.";
/// Longest user name, in bytes.
pub const MAX_USER_NAME_BYTES: usize = 32;
/// Length of a token's secret: 32 bytes in unpadded base64url.
pub const SECRET_CHARS: usize = 43;
/// Most user tokens a cluster holds.
pub const MAX_USERS: usize = 1_000;
/// The name jobs submitted with the cluster token are recorded under; no user may take
/// it.
pub const CLUSTER_ADMIN: &str = "admin";

/// True for a user name: 1..=[`MAX_USER_NAME_BYTES`] bytes of `[a-z0-9-]`, starting with
/// a letter, and not [`CLUSTER_ADMIN`].
pub fn is_valid_user_name(name: &str) -> bool {
    name.len() <= MAX_USER_NAME_BYTES
        && name.as_bytes().first().is_some_and(u8::is_ascii_lowercase)
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && name != CLUSTER_ADMIN
}

/// A user token split into its name and secret, or `None` when `token` does not have
/// the shape of one (then it may be the cluster token).
pub fn parse_user_token(token: &str) -> Option<(&str, &str)> {
    let rest = token.strip_prefix(TOKEN_PREFIX)?;
    let (name, secret) = rest.split_once('.')?;
    let secret_ok = secret.len() == SECRET_CHARS
        && secret
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    (is_valid_user_name(name) && secret_ok).then_some((name, secret))
}

/// The token a user presents, from its name and secret.
pub fn format_user_token(name: &str, secret: &str) -> String {
    format!("{TOKEN_PREFIX}{name}.{secret}")
}

/// What the cluster stores of a secret: its SHA-256, in lowercase hex (64 characters).
pub fn secret_digest(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// Who made a request, once its bearer token was checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// The user's name ([`CLUSTER_ADMIN`] for the cluster token).
    pub name: String,
    /// What the user may do.
    pub role: Role,
}

impl Principal {
    /// The holder of the cluster token: an administrator named [`CLUSTER_ADMIN`].
    pub fn cluster_admin() -> Self {
        Self {
            name: CLUSTER_ADMIN.to_string(),
            role: Role::Admin,
        }
    }

    /// True when this principal may act on a job `owner` submitted: an administrator
    /// on any job, anyone on their own.
    pub fn owns_or_administers(&self, owner: &str) -> bool {
        self.role == Role::Admin || self.name == owner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_bad_shapes_are_not_user_tokens() {
        let secret = "A".repeat(SECRET_CHARS);
        let token = format_user_token("alice-2", &secret);
        assert_eq!(parse_user_token(&token), Some(("alice-2", secret.as_str())));
        assert!(crate::token::check(&token).is_ok(), "a valid bearer token");
        for bad in [
            "cu.alice".to_string(),
            format!("cu.Alice.{secret}"),
            format!("cu.admin.{secret}"),
            format!("cu.alice.{}", "A".repeat(42)),
            format!("cu.alice.{}", "=".repeat(43)),
            format!("xx.alice.{secret}"),
            "a-cluster-token-0123456789".to_string(),
        ] {
            assert_eq!(parse_user_token(&bad), None, "{bad}");
        }
    }

    #[test]
    fn names_and_digests() {
        for ok in ["a", "alice", "ci-bot-7", &"a".repeat(32)] {
            assert!(is_valid_user_name(ok), "{ok}");
        }
        for bad in [
            "",
            "7up",
            "-x",
            "Alice",
            "a_b",
            "admin",
            &"a".repeat(33),
            "a.b",
        ] {
            assert!(!is_valid_user_name(bad), "{bad}");
        }
        assert_eq!(
            secret_digest("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn only_admins_act_on_other_users_jobs() {
        let alice = Principal {
            name: "alice".into(),
            role: Role::Submit,
        };
        assert!(alice.owns_or_administers("alice"));
        assert!(!alice.owns_or_administers("bob"));
        assert!(Principal::cluster_admin().owns_or_administers("bob"));
    }
}
