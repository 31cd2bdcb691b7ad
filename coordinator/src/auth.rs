//! Bearer-token authentication for every gRPC and HTTP endpoint. Users present the
//! cluster token (an administrator's) or their own token (`cumulus_api::users`), which
//! names them and their role, or, over TLS and without a token, a client certificate
//! issued by the cluster CA naming a user (`cumulus://user/NAME`: `cumulusctl certs
//! issue user NAME`), which counts while the state holds that user; workers present the cluster token (and, with TLS, their
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

/// Who the bearer token in `header` names: the cluster token is the cluster's
/// administrator ([`Principal::cluster_admin`]); a user token (`cu.<name>.<secret>`)
/// is its user while the state holds that user with the secret's digest. Without an
/// `Authorization` header, the connection's verified client certificate (`certified`)
/// names a user ([`cumulus_tls::Identity::User`]) while the state holds that user: the
/// certificate proves the name, the state gives the role, and revoking the user revokes
/// the certificate. A token, when presented, decides alone. `None` for a missing,
/// malformed, unknown or revoked credential (the caller answers one message for all,
/// which tells nothing about which users exist).
pub fn authenticate(
    node: &Node,
    header: Option<&str>,
    certified: Option<cumulus_tls::Identity>,
) -> Option<Principal> {
    if bearer_matches(header, &node.token) {
        return Some(Principal::cluster_admin());
    }
    if header.is_none() {
        let cumulus_tls::Identity::User(name) = certified? else {
            return None;
        };
        return node.read_state(|s| {
            s.users.get(&name).map(|u| Principal {
                name: u.name.clone(),
                role: u.role,
            })
        });
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
            .and_then(|c| c.peer_identity());
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
}
