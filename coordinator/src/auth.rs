//! Bearer-token authentication for every gRPC and HTTP endpoint. Users present the
//! cluster token (an administrator's) or their own token (`cumulus_api::users`), which
//! names them and their role, or, over TLS and without a token, a client certificate
//! issued by the cluster CA naming a user (`cumulus://user/NAME`: `cumulusctl certs
//! issue user NAME`), which counts while the state holds that user and was issued after
//! that user was created ([`USER_CERT_SKEW_MS`]); workers present the cluster token (and, with TLS, their
//! certificate); coordinators present the peer token to each other's Raft service, which
//! refuses every other credential (a client holding the cluster token could otherwise
//! vote, append entries and install snapshots). A job runs arbitrary commands on
//! workers, so an unauthenticated API would be remote code execution. What each role may
//! do is checked in `crate::api`.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, bail};
use cumulus_api::token::{self, bearer_matches};
use cumulus_api::users::{self, Principal};
use cumulus_raft_store::state::ClusterState;
use cumulus_tls::{Identity, PeerCert};
use tonic::{Request, Status};

use crate::node::Node;

/// Loads the token from `file` (trimmed) or `value` (the environment); exactly one must
/// be given, and it must pass [`cumulus_api::token::check`].
///
/// # Errors
/// When neither or both are given, the file is unreadable or too large, or the token
/// breaks a rule of [`cumulus_api::token::check`].
pub fn load_token(file: Option<&Path>, value: Option<&str>) -> anyhow::Result<Arc<str>> {
    let token = match (file, value) {
        (Some(f), None) => read_token_file(f)?,
        (None, Some(v)) => v.trim().to_string(),
        (Some(_), Some(_)) => {
            bail!("give the cluster token with --token-file or CUMULUS_TOKEN, not both")
        }
        (None, None) => bail!("no cluster token: give --token-file FILE or set CUMULUS_TOKEN"),
    };
    token::check(&token)?;
    Ok(token.into())
}

/// Reads a token file (at most [`token::MAX_TOKEN_BYTES`] plus room for whitespace),
/// trimmed.
///
/// # Errors
/// The file cannot be read, or is larger than that.
pub fn read_token_file(path: &Path) -> anyhow::Result<String> {
    use std::io::Read;
    let limit = token::MAX_TOKEN_BYTES as u64 + 64;
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(limit + 1).read_to_string(&mut text))
        .with_context(|| format!("reading the token file {}", path.display()))?;
    if text.len() as u64 > limit {
        bail!(
            "the token file {} is larger than {limit} bytes",
            path.display()
        );
    }
    Ok(text.trim().to_string())
}

/// Loads the peer token (coordinator to coordinator, Raft only) from `file` (trimmed)
/// or `value`; exactly one must be given, with the rules of [`load_token`].
///
/// # Errors
/// When neither or both are given, the file is unreadable, or the token is too short.
pub fn load_peer_token(file: Option<&Path>, value: Option<&str>) -> anyhow::Result<Arc<str>> {
    if file.is_none() && value.is_none() {
        bail!(
            "no peer token: give --peer-token-file FILE or set CUMULUS_PEER_TOKEN (the \
             credential coordinators present to each other's Raft service; the same on \
             every coordinator, different from the cluster token)"
        );
    }
    load_token(file, value).context("the peer token")
}

/// A tonic interceptor that rejects calls without the cluster token.
#[derive(Clone)]
pub struct AuthInterceptor {
    /// The cluster token.
    pub token: Arc<str>,
}

impl tonic::service::Interceptor for AuthInterceptor {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let header = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        if bearer_matches(header, &self.token) {
            Ok(req)
        } else {
            Err(Status::unauthenticated("missing or wrong bearer token"))
        }
    }
}

/// How much earlier than its user's creation a user's certificate may say it was
/// issued and still authenticate as them, in milliseconds. The two times come from
/// different clocks: the user's creation from the leader's (`CreateUser`'s `at_ms`,
/// recorded as `created_at_ms`), the certificate's notBefore from the machine that ran
/// `cumulusctl certs issue user`, truncated to the second. A certificate issued right
/// after `token create` on a machine whose clock is behind the leader's by up to a
/// minute still works, where a refusal would be permanent (its notBefore never
/// changes). The price: a certificate issued less than this before its user was
/// re-created still authenticates as the new user; one issued earlier does not.
pub const USER_CERT_SKEW_MS: u64 = 60_000;

/// Whether a user's certificate valid from `not_before_unix_ms` was issued for the user
/// created at `created_at_ms` (leader ms since the Unix epoch) and not for an earlier
/// user of that name: its notBefore is at or after `created_at_ms -`
/// [`USER_CERT_SKEW_MS`]. A `created_at_ms` of 0 (no creation time known) accepts every
/// certificate.
pub fn issued_after_creation(not_before_unix_ms: i64, created_at_ms: u64) -> bool {
    created_at_ms == 0
        || i128::from(not_before_unix_ms)
            >= i128::from(created_at_ms) - i128::from(USER_CERT_SKEW_MS)
}

/// Who the bearer token in `header` names: the cluster token is the cluster's
/// administrator ([`Principal::cluster_admin`]); a user token (`cu.<name>.<secret>`)
/// is its user while the state holds that user with the secret's digest. Without an
/// `Authorization` header, the connection's verified client certificate (`certified`)
/// names a user ([`cumulus_tls::Identity::User`]) while the state holds that user and
/// the certificate was issued after the user was created ([`certified_user`]): the
/// certificate proves the name, the state gives the role, and revoking the user revokes
/// the certificate, also once the name is given to a user again. A token, when
/// presented, decides alone. `None` for a missing, malformed, unknown or revoked
/// credential (the caller answers one message for all, which tells nothing about which
/// users exist).
pub fn authenticate(
    node: &Node,
    header: Option<&str>,
    certified: Option<&PeerCert>,
) -> Option<Principal> {
    if bearer_matches(header, &node.token) {
        return Some(Principal::cluster_admin());
    }
    if header.is_none() {
        let cert = certified?;
        return node.read_state(|s| certified_user(s, cert));
    }
    let presented = header.and_then(token::bearer_token)?;
    let (name, secret) = users::parse_user_token(presented)?;
    let digest = users::secret_digest(secret);
    node.read_state(|s| {
        s.users
            .get(name)
            .filter(|u| token::constant_time_eq(u.secret_sha256.as_bytes(), digest.as_bytes()))
            .map(|u| Principal {
                name: u.name.clone(),
                role: u.role,
            })
    })
}

/// The user a verified client certificate names, with the role `state` gives them: `None`
/// when it names no user, the state holds no user of that name, or the certificate was
/// issued before that user was created ([`issued_after_creation`]: it was issued for an
/// earlier user of the name, who was revoked). The last is logged with its reason (at
/// info at most once per [`REFUSAL_LOG_EVERY_MS`], else at debug); the caller answers it
/// like any other bad credential.
pub fn certified_user(state: &ClusterState, cert: &PeerCert) -> Option<Principal> {
    let Identity::User(name) = &cert.identity else {
        return None;
    };
    let user = state.users.get(name)?;
    if !issued_after_creation(cert.not_before_unix_ms, user.created_at_ms) {
        log_refusal(name, cert.not_before_unix_ms, user.created_at_ms);
        return None;
    }
    Some(Principal {
        name: user.name.clone(),
        role: user.role,
    })
}

/// At most one refused certificate per this many milliseconds is logged at info (the rest
/// at debug): a client retrying in a loop cannot flood the log.
pub const REFUSAL_LOG_EVERY_MS: u64 = 10_000;

fn log_refusal(name: &str, not_before_unix_ms: i64, created_at_ms: u64) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST_INFO_MS: AtomicU64 = AtomicU64::new(0);
    let now = crate::soft::now_ms();
    let last = LAST_INFO_MS.load(Ordering::Relaxed);
    let why = "refused a user's certificate issued before the user was created (it was \
               issued for an earlier user of that name; issue a new one)";
    if now.saturating_sub(last) >= REFUSAL_LOG_EVERY_MS
        && LAST_INFO_MS
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        tracing::info!(
            user = name,
            not_before_unix_ms,
            created_at_ms,
            skew_ms = USER_CERT_SKEW_MS,
            "{why}"
        );
    } else {
        tracing::debug!(
            user = name,
            not_before_unix_ms,
            created_at_ms,
            skew_ms = USER_CERT_SKEW_MS,
            "{why}"
        );
    }
}

/// A tonic interceptor for the client API: authenticates the bearer token (the cluster
/// token or a user's) or the user's client certificate, and puts the [`Principal`] into the request's extensions, where
/// [`principal_of`] finds it.
#[derive(Clone)]
pub struct UserAuth {
    /// The node whose state holds the users.
    pub node: Arc<Node>,
}

impl tonic::service::Interceptor for UserAuth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let header = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        let certified = req
            .extensions()
            .get::<cumulus_listen::ConnInfo>()
            .and_then(|c| c.peer_cert());
        match authenticate(&self.node, header, certified) {
            Some(principal) => {
                req.extensions_mut().insert(principal);
                Ok(req)
            }
            None => Err(Status::unauthenticated("missing or wrong bearer token")),
        }
    }
}

/// The principal [`UserAuth`] put into a request.
///
/// # Errors
/// `Unauthenticated` when there is none (a service mounted without [`UserAuth`]: a
/// programming error, answered safely).
pub fn principal_of<T>(req: &Request<T>) -> Result<Principal, Status> {
    req.extensions()
        .get::<Principal>()
        .cloned()
        .ok_or_else(|| Status::unauthenticated("no authenticated user"))
}

/// Adds `authorization: Bearer <token>` to outgoing gRPC calls (peer RPCs).
#[derive(Clone)]
pub struct AddToken {
    /// Pre-built header value.
    pub value: tonic::metadata::MetadataValue<tonic::metadata::Ascii>,
}

impl AddToken {
    /// Builds the interceptor for `token`.
    ///
    /// # Errors
    /// When the token is not a valid header value.
    pub fn new(token: &str) -> anyhow::Result<Self> {
        Ok(Self {
            value: format!("Bearer {token}")
                .parse()
                .context("token is not a valid header value")?,
        })
    }
}

impl tonic::service::Interceptor for AddToken {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        req.metadata_mut()
            .insert("authorization", self.value.clone());
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_loading_validates() {
        assert!(load_token(None, None).is_err());
        assert!(load_token(None, Some("short")).is_err());
        assert_eq!(
            &*load_token(None, Some(" 0123456789abcdef0123 ")).expect("valid"),
            "0123456789abcdef0123"
        );
        let dir = tempfile::tempdir().expect("tmp");
        let f = dir.path().join("t");
        std::fs::write(&f, "0123456789abcdef0123\n").expect("write");
        assert_eq!(
            &*load_token(Some(&f), None).expect("valid"),
            "0123456789abcdef0123"
        );
        assert!(load_token(Some(&f), Some("0123456789abcdef0123")).is_err());
    }

    /// A certificate counts for the user created at `created_at_ms` from `created_at_ms -
    /// USER_CERT_SKEW_MS` on (inclusive); a creation time of 0 accepts every certificate.
    #[test]
    fn a_certificate_counts_only_if_issued_after_its_user_was_created() {
        let created: u64 = 1_800_000_000_000;
        let at = |ms: u64| i64::try_from(ms).expect("fits");
        assert!(issued_after_creation(at(created), created));
        assert!(issued_after_creation(at(created + 3_600_000), created));
        let edge = at(created - USER_CERT_SKEW_MS);
        assert!(issued_after_creation(edge, created));
        assert!(!issued_after_creation(edge - 1, created));
        assert!(!issued_after_creation(edge - 1000, created));
        assert!(!issued_after_creation(at(created - 86_400_000), created));
        assert!(!issued_after_creation(i64::MIN, created));
        // No creation time known: as before the rule.
        assert!(issued_after_creation(0, 0));
        assert!(issued_after_creation(-1_000, 0));
        // A user created in the first minute after the epoch, a certificate from 1970.
        assert!(issued_after_creation(0, 30_000));
    }

    /// Through the state: the user's role for a certificate issued after the user was
    /// created; nothing for one issued before (an earlier user of the name), for an
    /// unknown user, or for a certificate that names no user.
    #[test]
    fn certified_user_follows_the_users_creation() {
        let created: u64 = 1_800_000_000_000;
        let mut state = ClusterState::default();
        state.users.insert(
            "alice".into(),
            cumulus_raft_store::state::UserRecord {
                name: "alice".into(),
                role: cumulus_api::Role::Read,
                secret_sha256: "ab".repeat(32),
                created_by: "admin".into(),
                created_at_ms: created,
            },
        );
        let cert = |identity: Identity, not_before_unix_ms: i64| PeerCert {
            identity,
            not_before_unix_ms,
        };
        let alice = |ms: i64| cert(Identity::User("alice".into()), ms);
        let new = i64::try_from(created).expect("fits") + 1_000;
        let old = i64::try_from(created - USER_CERT_SKEW_MS - 1_000).expect("fits");
        assert_eq!(
            certified_user(&state, &alice(new)),
            Some(Principal {
                name: "alice".into(),
                role: cumulus_api::Role::Read
            })
        );
        assert_eq!(certified_user(&state, &alice(old)), None);
        assert_eq!(
            certified_user(&state, &cert(Identity::User("bob".into()), new)),
            None
        );
        assert_eq!(
            certified_user(&state, &cert(Identity::Worker("alice".into()), new)),
            None
        );
        assert_eq!(
            certified_user(&state, &cert(Identity::Coordinator(1), new)),
            None
        );
    }
}
