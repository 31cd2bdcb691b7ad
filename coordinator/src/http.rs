//! The coordinator's HTTP API (axum): `/health`, `/ready` ([`crate::ready`]), `/metrics`
//! ([`crate::metrics`]), the dashboard under `/ui` ([`crate::ui`]), the JSON mirror of the
//! client API under `/v1/jobs…` and `/v1/users…`, the blob store under
//! `/v1/blobs/{digest}` (`HEAD`, streamed `PUT` and `GET`), and the SSE log stream (see
//! [`crate::logs`]). Everything but `/health`, `/ready` and `/ui` requires a bearer token:
//! the cluster token or a user's (`crate::auth::authenticate`); what each role may do is
//! checked in `crate::api`.

use openraft::async_runtime::watch::WatchReceiver;
use std::sync::Arc;

use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cumulus_api::v1;
use serde::Deserialize;
use serde_json::json;

use crate::api;
use crate::error::{ApiError, HttpError};
use crate::node::Node;
use axum::Extension;
use cumulus_api::users::Principal;

/// Largest JSON request body accepted, in bytes.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// Builds the router of one node.
pub fn router(node: Arc<Node>) -> Router {
    let protected = Router::new()
        .route("/v1/jobs", get(list_jobs).post(submit))
        .route("/v1/jobs/{id}", get(get_job).delete(delete_job))
        .route("/v1/jobs/purge", post(purge))
        .route("/v1/jobs/summaries", get(summaries))
        .route("/v1/jobs/{id}/summary", get(summary))
        .route("/v1/jobs/{id}/cancel", post(cancel))
        .route("/v1/jobs/{id}/pause", post(pause))
        .route("/v1/jobs/{id}/resume", post(resume))
        .route("/v1/jobs/{id}/checkpoints", get(checkpoints))
        .route("/v1/jobs/{id}/logs", get(crate::logs::stream))
        .route("/v1/cluster", get(cluster))
        .route("/v1/users", get(list_users).post(create_user))
        .route("/v1/users/{name}", axum::routing::delete(revoke_user))
        .route("/v1/whoami", get(who_am_i))
        .route(
            "/v1/blobs/{digest}",
            get(get_blob)
                .head(head_blob)
                .put(put_blob)
                // A blob's body has its own limit, not the JSON bodies' 1 MiB.
                .layer(axum::extract::DefaultBodyLimit::max(
                    usize::try_from(node.blobs.store.max_blob_bytes()).unwrap_or(usize::MAX),
                )),
        )
        // Inner to the token check: only an authenticated request is forwarded.
        .layer(axum::middleware::from_fn_with_state(
            node.clone(),
            crate::ui::forward_to_leader,
        ))
        .layer(axum::middleware::from_fn_with_state(
            node.clone(),
            require_token,
        ));
    Router::new()
        .route("/health", get(health))
        .route("/ready", get(ready))
        // Its own check: the scrape token or any user (`crate::metrics`).
        .route("/metrics", get(crate::metrics::scrape))
        .route("/metrics/targets", get(crate::metrics::targets))
        .merge(crate::ui::routes())
        .merge(protected)
        .route_layer(axum::middleware::from_fn(crate::metrics::track_http))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(node)
}

async fn require_token(State(node): State<Arc<Node>>, mut req: Request, next: Next) -> Response {
    let header = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok());
    let certified = req
        .extensions()
        .get::<cumulus_listen::ConnInfo>()
        .and_then(|c| c.peer_cert());
    if let Some(principal) = crate::auth::authenticate(&node, header, certified) {
        req.extensions_mut().insert(principal);
        next.run(req).await
    } else {
        (
            StatusCode::UNAUTHORIZED,
            Json(json!({"error": "missing or wrong bearer token"})),
        )
            .into_response()
    }
}

/// `200` with the node's id, leader and term; `503` naming the error once the node's Raft
/// core has stopped (the process is exiting: it never reports an old leadership).
async fn health(State(node): State<Arc<Node>>) -> Response {
    let m = node.raft.metrics().borrow_watched().clone();
    if let Err(fatal) = &m.running_state {
        let body =
            json!({ "node_id": node.id, "error": format!("the raft core stopped: {fatal}") });
        return (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    }
    Json(json!({ "node_id": node.id, "leader_id": m.current_leader, "term": m.current_term }))
        .into_response()
}

/// `200` `{"node_id", "ready": true, "leader_id", "term"}` while this node's applied
/// state is current, else `503` `{"node_id", "ready": false, "reason"}`
/// ([`crate::ready`]): the readiness probe, no token needed.
async fn ready(State(node): State<Arc<Node>>) -> Response {
    let m = node.raft.metrics().borrow_watched().clone();
    let max_age = crate::ready::max_leader_ack_age(node.raft.config().election_timeout_max);
    let contact = crate::ready::LeaderContact {
        commit_seen: node.blobs.leader_commit_seen(),
        age: node.blobs.leader_contact_age(),
    };
    match crate::ready::readiness(&m, contact, max_age) {
        Ok(()) => Json(json!({
            "node_id": node.id,
            "ready": true,
            "leader_id": m.current_leader,
            "term": m.current_term,
        }))
        .into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "node_id": node.id, "ready": false, "reason": reason })),
        )
            .into_response(),
    }
}

/// `?linearizable=true|false` on reads.
#[derive(Deserialize, Default)]
struct ReadParams {
    #[serde(default)]
    linearizable: bool,
}

async fn list_jobs(
    State(node): State<Arc<Node>>,
    Query(p): Query<ReadParams>,
) -> Result<Json<v1::ListJobsResponse>, HttpError> {
    Ok(Json(api::list_jobs(&node, p.linearizable).await?))
}

async fn get_job(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    Query(p): Query<ReadParams>,
) -> Result<Json<v1::JobResponse>, HttpError> {
    Ok(Json(api::get_job(&node, &id, p.linearizable).await?))
}

async fn submit(
    State(node): State<Arc<Node>>,
    Extension(who): Extension<Principal>,
    _headers: HeaderMap,
    body: Result<Json<v1::SubmitJobRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<v1::SubmitJobResponse>, HttpError> {
    let Json(req) =
        body.map_err(|e| ApiError::InvalidArgument(format!("invalid JSON body: {e}")))?;
    Ok(Json(api::submit(&node, &who, req).await?))
}

async fn cancel(
    State(node): State<Arc<Node>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<v1::JobResponse>, HttpError> {
    Ok(Json(api::cancel(&node, &who, &id).await?))
}

async fn pause(
    State(node): State<Arc<Node>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<v1::JobResponse>, HttpError> {
    Ok(Json(api::pause(&node, &who, &id).await?))
}

async fn resume(
    State(node): State<Arc<Node>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<v1::JobResponse>, HttpError> {
    Ok(Json(api::resume(&node, &who, &id).await?))
}

#[derive(serde::Deserialize)]
struct DeleteQuery {
    #[serde(default)]
    checkpoints: bool,
}

async fn delete_job(
    State(node): State<Arc<Node>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    axum::extract::Query(q): axum::extract::Query<DeleteQuery>,
) -> Result<Json<v1::DeleteJobResponse>, HttpError> {
    Ok(Json(api::delete(&node, &who, &id, q.checkpoints).await?))
}

async fn purge(
    State(node): State<Arc<Node>>,
    Extension(who): Extension<Principal>,
    body: Result<Json<v1::PurgeJobsRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<v1::PurgeJobsResponse>, HttpError> {
    let Json(req) =
        body.map_err(|e| ApiError::InvalidArgument(format!("invalid JSON body: {e}")))?;
    Ok(Json(api::purge(&node, &who, req).await?))
}

async fn create_user(
    State(node): State<Arc<Node>>,
    Extension(who): Extension<Principal>,
    body: Result<Json<v1::CreateUserRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<v1::CreateUserResponse>, HttpError> {
    let Json(req) =
        body.map_err(|e| ApiError::InvalidArgument(format!("invalid JSON body: {e}")))?;
    Ok(Json(api::create_user(&node, &who, req).await?))
}

async fn revoke_user(
    State(node): State<Arc<Node>>,
    Extension(who): Extension<Principal>,
    Path(name): Path<String>,
) -> Result<Json<v1::Ack>, HttpError> {
    api::revoke_user(&node, &who, &name).await?;
    Ok(Json(v1::Ack {}))
}

async fn list_users(
    State(node): State<Arc<Node>>,
    Extension(who): Extension<Principal>,
) -> Result<Json<v1::ListUsersResponse>, HttpError> {
    Ok(Json(api::list_users(&node, &who)?))
}

async fn who_am_i(Extension(who): Extension<Principal>) -> Json<v1::WhoAmIResponse> {
    Json(v1::WhoAmIResponse {
        name: who.name,
        role: who.role.to_string(),
    })
}

async fn summary(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
) -> Result<Json<v1::JobSummary>, HttpError> {
    Ok(Json(api::job_summary(&node, &id)?))
}

/// `?state=running&limit=100` on `GET /v1/jobs/summaries`.
#[derive(Deserialize, Default)]
struct SummaryParams {
    #[serde(default)]
    state: String,
    #[serde(default)]
    limit: u32,
}

async fn summaries(
    State(node): State<Arc<Node>>,
    Query(p): Query<SummaryParams>,
) -> Result<Json<v1::ListJobSummariesResponse>, HttpError> {
    Ok(Json(api::job_summaries(
        &node,
        &v1::ListJobSummariesRequest {
            state: p.state,
            limit: p.limit,
        },
    )?))
}

async fn checkpoints(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
) -> Result<Json<v1::ListCheckpointsResponse>, HttpError> {
    Ok(Json(api::list_checkpoints(&node, &id).await?))
}

async fn cluster(State(node): State<Arc<Node>>) -> Json<v1::ClusterStatusResponse> {
    Json(api::cluster_status(&node))
}

/// `HEAD /v1/blobs/{digest}`: 200 with the blob's size as Content-Length when this
/// coordinator holds it, else 404 (any authenticated principal).
async fn head_blob(
    State(node): State<Arc<Node>>,
    Path(digest): Path<String>,
) -> Result<Response, HttpError> {
    let stat = api::stat_blob(&node, &digest).await?;
    if !stat.present {
        return Ok(StatusCode::NOT_FOUND.into_response());
    }
    Ok((
        StatusCode::OK,
        [(
            axum::http::header::CONTENT_LENGTH,
            stat.size_bytes.to_string(),
        )],
    )
        .into_response())
}

/// `PUT /v1/blobs/{digest}`: the body is the blob, streamed (its Content-Length is its
/// size: required, and the bytes must match it and the digest); 201 with the
/// `PutBlobResponse` once a majority of the voting coordinators hold it. An answer given
/// before the body was read to its end (a refusal, or a blob already held) closes the
/// connection (`Connection: close`): the unread rest cannot precede a next request.
async fn put_blob(
    State(node): State<Arc<Node>>,
    Extension(who): Extension<Principal>,
    Path(digest): Path<String>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    use futures::StreamExt;
    use std::sync::atomic::{AtomicBool, Ordering};
    let Some(size_bytes) = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    else {
        let refusal = ApiError::InvalidArgument(
            "PUT /v1/blobs/{digest} needs a Content-Length header: the blob's size in bytes \
             (a chunked body is refused)"
                .into(),
        );
        return closing(HttpError(refusal).into_response());
    };
    let read_to_end = Arc::new(AtomicBool::new(false));
    let ended = read_to_end.clone();
    let chunks = body
        .into_data_stream()
        .map(|r| {
            r.map_err(|e| crate::blobs::BlobError::Aborted(format!("the request body broke: {e}")))
        })
        .chain(futures::stream::poll_fn(move |_| {
            ended.store(true, Ordering::Relaxed);
            std::task::Poll::Ready(None)
        }));
    let header = crate::blobs::BlobHeader { digest, size_bytes };
    let response = match api::put_blob(&node, &who, header, Box::pin(chunks)).await {
        Ok(answer) => (StatusCode::CREATED, Json(answer)).into_response(),
        Err(e) => HttpError(e).into_response(),
    };
    if read_to_end.load(Ordering::Relaxed) {
        response
    } else {
        closing(response)
    }
}

/// `response` with `Connection: close`.
fn closing(mut response: Response) -> Response {
    response.headers_mut().insert(
        axum::http::header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    response
}

/// `GET /v1/blobs/{digest}`: the blob's bytes, streamed with its Content-Length (who may
/// read which blob: `api::get_blob`). A copy found corrupt as it streams breaks the
/// response (the client sees a short body) and is fetched again by the next read.
async fn get_blob(
    State(node): State<Arc<Node>>,
    Extension(who): Extension<Principal>,
    Path(digest): Path<String>,
) -> Result<Response, HttpError> {
    use futures::StreamExt;
    let read = api::get_blob(&node, &who, &digest).await?;
    let body = axum::body::Body::from_stream(read.chunks.map(|r| r.map_err(std::io::Error::other)));
    Ok((
        StatusCode::OK,
        [
            (
                axum::http::header::CONTENT_TYPE,
                "application/octet-stream".to_string(),
            ),
            (
                axum::http::header::CONTENT_LENGTH,
                read.size_bytes.to_string(),
            ),
        ],
        body,
    )
        .into_response())
}
