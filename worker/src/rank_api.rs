//! The rank-local HTTP API (docs/architecture.md "Rank-local HTTP API"), bound to loopback.
//!
//! Every request carries `Authorization: Bearer $CUMULUS_AGENT_TOKEN`; the token names the
//! attempt, and is unknown (401) once the attempt has ended.
//!
//! When ranks run as another user (`--run-as`), ranks of one job share a user and could
//! read each other's tokens from `/proc/<pid>/environ`. The API is then served on a Unix
//! socket (`$CUMULUS_AGENT_SOCKET`) and a token is honoured only from a process of its
//! own rank's session (the caller's `SO_PEERCRED` pid, whose session id must be the
//! rank's pid: each rank is a session leader): another rank's token answers 403, and so
//! does every token over TCP, which cannot say who calls.
//! - `POST /v1/progress` `{"step": u64, "total_steps": u64, "metrics": {"name": f64}}` →
//!   204 while the rank may go on, 200 `{"action": A}` once it has been asked to stop
//!   (`total_steps` and `metrics` may be left out; ≤ 64 metrics, names ≤ 128 bytes; NaN
//!   and the infinities as `"NaN"`, `"Infinity"`, `"-Infinity"`: `cumulus_api::metric_json`).
//! - `GET /v1/control` → 200 `{"action": A}`: `none` (go on), `stop` (no longer wanted:
//!   exit), `pause` or `preempt` (commit a checkpoint at this step and exit 0; the job
//!   resumes from it), `time_limit` (commit a checkpoint and exit 0; the job ends). SIGTERM
//!   to the rank's group follows the request after a notice (docs/architecture.md,
//!   "Stopping a rank").
//! - `POST /v1/checkpoint` `{"step": u64, "state": {..}}` (state: a JSON object of at most
//!   64 KiB) → 200 `{"dir": "step-00000100/rank-0/attempt-1"}` once the leader
//!   acknowledged the part; 409 when the attempt is no longer desired or the leader rejects
//!   it as stale; 400 for a bad body or a job without checkpoints; 502/503 when the leader
//!   failed or could not be reached (a retry of the same step re-reports the part already
//!   committed locally).
//! - `GET /v1/checkpoints` → 200 `{"steps": [u64]}`: the committed steps of the rank's job,
//!   ascending (at most the newest 1,024; empty without checkpoints); 503 while the
//!   attempt's checkpoint target is being prepared, 500 when the store cannot be read.
//! - `POST /v1/exception` `{"type": str, "message": str, "frames": [str], "origin": str}`
//!   → 204: the uncaught exception the rank's process is about to die of (sent by its
//!   runtime's exception hook); a non-zero exit of the attempt then reports it as its
//!   cause (`ValueError: bad lr (train.py:42)`). 400 past the bounds of
//!   [`cumulus_api::rank_local::ExceptionReport`].
//! - `GET /v1/restart?timeout_ms=N` → 200 [`cumulus_api::rank_local::RestartOffer`] once an
//!   in-process restart hands this rank's live process a newer attempt (the token may be
//!   the retired one of an earlier attempt of the process), 204 when none came within N
//!   ms (default and at most [`MAX_RESTART_POLL_MS`]). Polling marks the rank as
//!   listening: a group restart may keep its process (`cumulus.runtime.run`).
//! - `POST /v1/restart` (the new attempt's token) → 204: the rank took the offer (left its
//!   step, tore its process group down); the agent reports the attempt started. 409 when
//!   no offer was made to it.
//!
//! Errors are `{"error": ..}`.

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use cumulus_ckpt::CkptError;

use crate::client::ClientError;
use crate::http::{json_error, limit_concurrency, request_permits, request_token};
use crate::supervisor::{CommitError, Progress, RestartAck, RestartPoll, Supervisor};
use cumulus_api::limits::{MAX_METRIC_NAME_BYTES, MAX_METRICS, MAX_STATE_JSON_BYTES};
use cumulus_api::rank_local::{
    CheckpointRequest, CheckpointsReply, CommitReply, ControlReply, ExceptionReport,
    MAX_RESTART_POLL_MS, ProgressReport,
};

/// Largest request body, in bytes (the state plus room for the envelope).
pub const MAX_BODY_BYTES: usize = MAX_STATE_JSON_BYTES + 4 * 1024;
/// Most `/v1/restart` requests served at once (long polls, one per listening rank);
/// past it a poll is answered 503 and the rank polls again later.
pub const MAX_RESTART_POLLS: usize = 128;

/// The router of the rank-local API, with its body and concurrency limits. With
/// `check_caller`, a token is honoured only from a process of its rank's session on the
/// Unix socket (see the module documentation).
pub fn router(supervisor: Supervisor, check_caller: bool) -> Router {
    // Restart long polls (one per listening rank) have their own permits: they never
    // take those of the other requests.
    let polls = Router::new()
        .route("/v1/restart", get(restart_poll).post(restart_ack))
        .layer(axum::middleware::from_fn_with_state(
            std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_RESTART_POLLS)),
            limit_concurrency,
        ));
    let router = Router::new()
        .route("/v1/progress", post(progress))
        .route("/v1/checkpoint", post(checkpoint))
        .route("/v1/control", get(control))
        .route("/v1/checkpoints", get(checkpoints))
        .route("/v1/exception", post(exception))
        .layer(axum::middleware::from_fn_with_state(
            request_permits(),
            limit_concurrency,
        ))
        .merge(polls);
    let router = if check_caller {
        router.layer(axum::middleware::from_fn_with_state(
            supervisor.clone(),
            caller_is_the_rank,
        ))
    } else {
        router
    };
    router
        .with_state(supervisor)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
}

/// Middleware: a request whose token names a live attempt passes only when it came over
/// the Unix socket from a process in that attempt's session. Requests without a known
/// token pass on to the handlers, which answer 401.
async fn caller_is_the_rank(
    State(sup): State<Supervisor>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(key) = request_token(request.headers()).and_then(|t| {
        sup.attempt_for_token(t)
            .or_else(|| sup.attempt_for_retired_token(t))
    }) else {
        return next.run(request).await;
    };
    let Some(peer) = request
        .extensions()
        .get::<cumulus_listen::UnixPeer>()
        .copied()
    else {
        drain(request).await;
        return json_error(
            StatusCode::FORBIDDEN,
            format!(
                "ranks on this worker run as another user: use the rank-local API on the Unix \
                 socket ${} (a TCP caller cannot be identified)",
                cumulus_api::rank_env::AGENT_SOCKET
            ),
        );
    };
    let Some(rank_pid) = sup.attempt_pid(&key) else {
        drain(request).await;
        return json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the attempt is still starting; retry",
        );
    };
    let session = peer.pid.and_then(|pid| session_of(pid as u32));
    if session == Some(rank_pid) {
        return next.run(request).await;
    }
    tracing::warn!(attempt = %key, caller_pid = ?peer.pid, caller_uid = peer.uid, ?session, "a process outside the rank presented its token");
    drain(request).await;
    json_error(
        StatusCode::FORBIDDEN,
        format!(
            "this token belongs to another rank: process {} (session {}) is not in it; each rank \
             may use only its own ${}",
            peer.pid.map_or("?".to_string(), |p| p.to_string()),
            session.map_or("?".to_string(), |s| s.to_string()),
            cumulus_api::rank_env::AGENT_TOKEN
        ),
    )
}

/// Reads (and drops) a refused request's body, at most [`MAX_BODY_BYTES`]: a client still
/// sending it when the reply comes would otherwise see its connection reset instead of
/// the reply.
async fn drain(request: axum::extract::Request) {
    let _ = axum::body::to_bytes(request.into_body(), MAX_BODY_BYTES).await;
}

/// The session id of process `pid` (field 6 of `/proc/<pid>/stat`), `None` when it is
/// gone or its stat cannot be parsed.
fn session_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces or ')'.
    let (_, rest) = stat.rsplit_once(") ")?;
    rest.split_whitespace().nth(3)?.parse().ok()
}

fn missing_token() -> Response {
    json_error(
        StatusCode::UNAUTHORIZED,
        "missing bearer token (use $CUMULUS_AGENT_TOKEN)",
    )
}

fn unknown_token() -> Response {
    json_error(
        StatusCode::UNAUTHORIZED,
        "unknown agent token: the attempt has ended or never ran here",
    )
}

async fn progress(State(sup): State<Supervisor>, headers: HeaderMap, body: Bytes) -> Response {
    let Some(token) = request_token(&headers) else {
        return missing_token();
    };
    if sup.attempt_for_token(token).is_none() {
        return unknown_token();
    }
    let body: ProgressReport = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => {
            return json_error(
                StatusCode::BAD_REQUEST,
                format!("invalid progress body: {e}"),
            );
        }
    };
    if body.metrics.len() > MAX_METRICS {
        return json_error(
            StatusCode::BAD_REQUEST,
            format!("at most {MAX_METRICS} metrics, got {}", body.metrics.len()),
        );
    }
    if let Some(name) = body
        .metrics
        .keys()
        .find(|n| n.is_empty() || n.len() > MAX_METRIC_NAME_BYTES)
    {
        return json_error(
            StatusCode::BAD_REQUEST,
            format!("metric names must be 1..={MAX_METRIC_NAME_BYTES} bytes, got {name:?}"),
        );
    }
    let progress = Progress {
        step: body.step,
        total_steps: body.total_steps,
        metrics: body.metrics,
    };
    match sup.record_progress(token, progress) {
        Some(None) => StatusCode::NO_CONTENT.into_response(),
        Some(Some(action)) => action_response(Some(action)),
        None => unknown_token(),
    }
}

async fn exception(State(sup): State<Supervisor>, headers: HeaderMap, body: Bytes) -> Response {
    let Some(token) = request_token(&headers) else {
        return missing_token();
    };
    if sup.attempt_for_token(token).is_none() {
        return unknown_token();
    }
    let report: ExceptionReport = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return json_error(
                StatusCode::BAD_REQUEST,
                format!("invalid exception body: {e}"),
            );
        }
    };
    if let Err(why) = report.validate() {
        return json_error(
            StatusCode::BAD_REQUEST,
            format!("invalid exception body: {why}"),
        );
    }
    match sup.record_exception(token, &report) {
        Some(()) => StatusCode::NO_CONTENT.into_response(),
        None => unknown_token(),
    }
}

fn action_response(action: Option<cumulus_api::StopAction>) -> Response {
    axum::Json(ControlReply::new(action)).into_response()
}

async fn control(State(sup): State<Supervisor>, headers: HeaderMap) -> Response {
    let Some(token) = request_token(&headers) else {
        return missing_token();
    };
    match sup.control(token) {
        Some(action) => action_response(action),
        None => unknown_token(),
    }
}

async fn checkpoint(State(sup): State<Supervisor>, headers: HeaderMap, body: Bytes) -> Response {
    let Some(token) = request_token(&headers) else {
        return missing_token();
    };
    if sup.attempt_for_token(token).is_none() {
        return unknown_token();
    }
    let body: CheckpointRequest = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => {
            return json_error(
                StatusCode::BAD_REQUEST,
                format!("invalid checkpoint body: {e}"),
            );
        }
    };
    if !body.state.is_object() {
        return json_error(StatusCode::BAD_REQUEST, "state must be a JSON object");
    }
    let state_len = serde_json::to_vec(&body.state)
        .map(|v| v.len())
        .unwrap_or(usize::MAX);
    if state_len > MAX_STATE_JSON_BYTES {
        return json_error(
            StatusCode::BAD_REQUEST,
            format!("state is {state_len} bytes, at most {MAX_STATE_JSON_BYTES}"),
        );
    }
    match sup.commit_checkpoint(token, body.step, body.state).await {
        Ok(dir) => axum::Json(CommitReply { dir }).into_response(),
        Err(e) => commit_error_response(e),
    }
}

async fn checkpoints(State(sup): State<Supervisor>, headers: HeaderMap) -> Response {
    let Some(token) = request_token(&headers) else {
        return missing_token();
    };
    match sup.committed_steps(token).await {
        Ok(steps) => axum::Json(CheckpointsReply { steps }).into_response(),
        Err(e) => commit_error_response(e),
    }
}

/// The query of `GET /v1/restart`.
#[derive(Debug, serde::Deserialize)]
struct RestartQuery {
    /// How long to wait for an offer, in ms (capped to [`MAX_RESTART_POLL_MS`]).
    timeout_ms: Option<u64>,
}

async fn restart_poll(
    State(sup): State<Supervisor>,
    headers: HeaderMap,
    axum::extract::Query(query): axum::extract::Query<RestartQuery>,
) -> Response {
    let Some(token) = request_token(&headers) else {
        return missing_token();
    };
    let wait_ms = query
        .timeout_ms
        .unwrap_or(MAX_RESTART_POLL_MS)
        .min(MAX_RESTART_POLL_MS);
    match sup
        .restart_poll(token, std::time::Duration::from_millis(wait_ms))
        .await
    {
        RestartPoll::Unknown => unknown_token(),
        RestartPoll::Nothing => StatusCode::NO_CONTENT.into_response(),
        RestartPoll::Offer(offer) => axum::Json(&*offer).into_response(),
    }
}

async fn restart_ack(State(sup): State<Supervisor>, headers: HeaderMap) -> Response {
    let Some(token) = request_token(&headers) else {
        return missing_token();
    };
    match sup.restart_ack(token) {
        RestartAck::Unknown => unknown_token(),
        RestartAck::NotOffered => json_error(
            StatusCode::CONFLICT,
            "no in-process restart was offered to this attempt",
        ),
        RestartAck::Done => StatusCode::NO_CONTENT.into_response(),
    }
}

fn commit_error_response(e: CommitError) -> Response {
    let status = match &e {
        CommitError::UnknownToken => StatusCode::UNAUTHORIZED,
        CommitError::NotDesired(_) | CommitError::Stale(_) => StatusCode::CONFLICT,
        CommitError::Disabled(_) => StatusCode::BAD_REQUEST,
        CommitError::NotReady(_) => StatusCode::SERVICE_UNAVAILABLE,
        CommitError::Store(CkptError::Invalid(_))
        | CommitError::Store(CkptError::NotFound { .. }) => StatusCode::BAD_REQUEST,
        CommitError::Store(_) => StatusCode::INTERNAL_SERVER_ERROR,
        CommitError::Coordinator(ClientError::Rejected { .. }) => StatusCode::BAD_GATEWAY,
        CommitError::Coordinator(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    if status.is_server_error() {
        tracing::warn!("checkpoint commit failed: {e}");
    }
    json_error(status, e.to_string())
}
