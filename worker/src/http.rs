//! Helpers shared by the agent's two HTTP servers: JSON errors, bearer-token checks and a
//! bound on concurrent requests.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::sync::Semaphore;

/// Requests one server handles at once; more are answered 503 at once (no queue).
pub const MAX_CONCURRENT_REQUESTS: usize = 64;

/// `{"error": message}` with `status`.
pub fn json_error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(serde_json::json!({ "error": message.into() }))).into_response()
}

/// The bearer token of a request, if it has a well-formed `Authorization` header.
pub fn request_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    cumulus_api::token::bearer_token(value)
}

/// Middleware: lets at most [`MAX_CONCURRENT_REQUESTS`] requests run at once (the
/// semaphore in the state), answering 503 beyond.
pub async fn limit_concurrency(
    State(permits): State<Arc<Semaphore>>,
    request: Request,
    next: Next,
) -> Response {
    match permits.try_acquire_owned() {
        Ok(_permit) => next.run(request).await,
        Err(_) => json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("too many concurrent requests (limit {MAX_CONCURRENT_REQUESTS})"),
        ),
    }
}

/// A fresh permit pool of [`MAX_CONCURRENT_REQUESTS`].
pub fn request_permits() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(MAX_CONCURRENT_REQUESTS))
}
