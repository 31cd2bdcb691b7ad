//! The coordinator's API errors and their two renderings: a gRPC status (with the
//! leader's addresses in metadata) and an HTTP response (with the leader's address in a
//! header). Every service adapter maps errors through here, so a follower's answer names
//! the leader the same way on both transports.

use axum::Json;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use cumulus_api::leader::{LEADER_GRPC_METADATA, LEADER_HTTP_HEADER, LEADER_HTTP_METADATA};
use cumulus_raft_store::{CumulusNode, Raft};
use openraft::async_runtime::watch::WatchReceiver;
use serde_json::json;
use tonic::Status;

/// Errors of the coordinator's APIs, mapped to gRPC codes and HTTP statuses by the
/// service adapters.
#[derive(Clone, Debug, thiserror::Error)]
pub enum ApiError {
    /// This node is not the leader; `leader` is the leader when known.
    #[error("this coordinator is not the leader{}", leader_hint(.leader))]
    NotLeader {
        /// The leader's addresses, when known.
        leader: Option<CumulusNode>,
    },
    /// The request is malformed or violates a limit.
    #[error("{0}")]
    InvalidArgument(String),
    /// The request names something this cluster's policy does not allow (a path outside
    /// the allowed roots).
    #[error("{0}")]
    PermissionDenied(String),
    /// The named job does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The request is valid but the state does not allow it (e.g. a stale attempt).
    #[error("{0}")]
    FailedPrecondition(String),
    /// Raft could not serve the request now (no quorum, shutting down); retry later.
    #[error("{0}")]
    Unavailable(String),
    /// A cluster-wide limit is reached (the state's byte budget); retry once jobs finish.
    #[error("{0}")]
    ResourceExhausted(String),
    /// A bug or an I/O failure on this node.
    #[error("{0}")]
    Internal(String),
}

fn leader_hint(leader: &Option<CumulusNode>) -> String {
    match leader {
        Some(n) => format!("; the leader is at {} (HTTP {})", n.grpc_addr, n.http_addr),
        None => "; no leader is known yet, retry shortly".to_string(),
    }
}

/// The leader's addresses from `raft`'s view of the membership, when a leader is known.
pub fn leader_node(raft: &Raft) -> Option<CumulusNode> {
    let m = raft.metrics();
    let m = m.borrow_watched();
    let leader = m.current_leader?;
    m.membership_config.membership().get_node(&leader).cloned()
}

/// Maps an [`ApiError`] to a gRPC status. `NotLeader` becomes UNAVAILABLE with the
/// leader's addresses in metadata, so clients and workers can follow it.
pub fn to_status(e: ApiError) -> Status {
    let msg = e.to_string();
    match e {
        ApiError::NotLeader { leader } => {
            let mut status = Status::unavailable(msg);
            if let Some(n) = leader {
                if let Ok(v) = n.grpc_addr.parse() {
                    status.metadata_mut().insert(LEADER_GRPC_METADATA, v);
                }
                if let Ok(v) = n.http_addr.parse() {
                    status.metadata_mut().insert(LEADER_HTTP_METADATA, v);
                }
            }
            status
        }
        ApiError::InvalidArgument(_) => Status::invalid_argument(msg),
        ApiError::PermissionDenied(_) => Status::permission_denied(msg),
        ApiError::NotFound(_) => Status::not_found(msg),
        ApiError::FailedPrecondition(_) => Status::failed_precondition(msg),
        ApiError::Unavailable(_) => Status::unavailable(msg),
        ApiError::ResourceExhausted(_) => Status::resource_exhausted(msg),
        ApiError::Internal(_) => Status::internal(msg),
    }
}

/// An [`ApiError`] as an HTTP response: `{"error": "..."}` with a matching status; a
/// follower answers writes with 503 and the leader's HTTP address in a header.
pub struct HttpError(pub ApiError);

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let msg = self.0.to_string();
        let (status, leader) = match &self.0 {
            ApiError::NotLeader { leader } => (StatusCode::SERVICE_UNAVAILABLE, leader.clone()),
            ApiError::InvalidArgument(_) => (StatusCode::BAD_REQUEST, None),
            ApiError::PermissionDenied(_) => (StatusCode::FORBIDDEN, None),
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, None),
            ApiError::FailedPrecondition(_) => (StatusCode::CONFLICT, None),
            ApiError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, None),
            ApiError::ResourceExhausted(_) => (StatusCode::TOO_MANY_REQUESTS, None),
            ApiError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, None),
        };
        let mut resp = (status, Json(json!({ "error": msg }))).into_response();
        if let Some(value) = leader.and_then(|n| HeaderValue::from_str(&n.http_addr).ok()) {
            resp.headers_mut().insert(LEADER_HTTP_HEADER, value);
        }
        resp
    }
}

impl From<ApiError> for HttpError {
    fn from(e: ApiError) -> Self {
        HttpError(e)
    }
}

impl From<cumulus_api::paths::PathError> for ApiError {
    /// A path outside the allowed roots is `PermissionDenied`; a malformed one
    /// `InvalidArgument`.
    fn from(e: cumulus_api::paths::PathError) -> Self {
        match e {
            cumulus_api::paths::PathError::OutsideRoots { .. } => {
                ApiError::PermissionDenied(e.to_string())
            }
            _ => ApiError::InvalidArgument(e.to_string()),
        }
    }
}
