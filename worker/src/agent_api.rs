//! The worker agent's HTTP API, for coordinators (docs/architecture.md "Worker agent HTTP
//! API").
//!
//! - `GET /health` → 200 `{"status":"ok","worker_id":..}` (no token needed).
//! - `GET /metrics` (the scrape token of `--metrics-token-file`, or the cluster token)
//!   → the agent's metrics in the Prometheus text format ([`crate::metrics`]).
//! - `GET /v1/logs/{job_id}/{rank}/{attempt}?offset=N&max_bytes=M` (cluster token) → 200
//!   with bytes `[N, N+k)` of the attempt's log (see [`crate::logs::read_log`]) and the
//!   headers `x-cumulus-log-size`, `x-cumulus-log-offset` and `x-cumulus-log-complete`.
//!   `since_ms=T` with `offset` 0 starts at the output written since T (the log's time
//!   index; `x-cumulus-log-offset` says where). `offset` defaults to 0,
//!   `max_bytes` to 64 KiB (at most 1 MiB). `offset == size` gives an empty 200;
//!   `offset > size` is 400; no log for that attempt is 404. Errors are `{"error": ..}`.

use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::http::{json_error, limit_concurrency, request_permits, request_token};
use crate::logs::{self, AttemptPaths, ReadLogError};
use cumulus_api::AttemptKey;
use cumulus_api::ids;
use cumulus_api::token::constant_time_eq;

/// Header with the log's current size in bytes.
pub const LOG_SIZE_HEADER: &str = "x-cumulus-log-size";
/// Response header: the offset the returned bytes start at (the `offset` asked, or for
/// a first read with `since_ms`, where the log's time index puts that time).
pub const LOG_OFFSET_HEADER: &str = "x-cumulus-log-offset";
/// Header saying whether the log is complete (`true`/`false`).
pub const LOG_COMPLETE_HEADER: &str = "x-cumulus-log-complete";
/// `max_bytes` when the query gives none.
pub const DEFAULT_MAX_BYTES: u64 = 64 * 1024;

/// State of the agent API.
#[derive(Debug, Clone)]
pub struct AgentApiState {
    /// The agent's data dir (logs live under `logs/`).
    pub data_dir: Arc<PathBuf>,
    /// The cluster bearer token.
    pub token: Arc<str>,
    /// This agent's worker id (shown by `/health`).
    pub worker_id: Arc<str>,
    /// The scrape token (`--metrics-token-file`): `/metrics` only.
    pub metrics_token: Option<Arc<str>>,
}

/// The router of the agent API, with its concurrency limit.
pub fn router(state: AgentApiState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(crate::metrics::scrape))
        .route("/v1/logs/{job_id}/{rank}/{attempt}", get(read_log))
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(
            request_permits(),
            limit_concurrency,
        ))
}

async fn health(State(state): State<AgentApiState>) -> Response {
    axum::Json(serde_json::json!({ "status": "ok", "worker_id": &*state.worker_id }))
        .into_response()
}

/// The query of a log read; absent fields take their defaults.
#[derive(Debug, serde::Deserialize)]
struct LogQuery {
    /// First byte to return (default 0).
    offset: Option<u64>,
    /// At most this many bytes (default [`DEFAULT_MAX_BYTES`]).
    max_bytes: Option<u64>,
    /// With `offset` 0 (or absent): start at the output written since this time (agent
    /// clock, ms since the Unix epoch), as the log's time index places it.
    since_ms: Option<u64>,
}

async fn read_log(
    State(state): State<AgentApiState>,
    headers: HeaderMap,
    Path((job_id, rank, attempt)): Path<(String, String, String)>,
    query: Result<Query<LogQuery>, QueryRejection>,
) -> Response {
    match request_token(&headers) {
        Some(t) if constant_time_eq(t.as_bytes(), state.token.as_bytes()) => {}
        _ => return json_error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token"),
    }
    if let Err(e) = ids::check_job_id(&job_id) {
        return json_error(StatusCode::BAD_REQUEST, e.to_string());
    }
    let Ok(rank) = rank.parse::<u32>() else {
        return json_error(StatusCode::BAD_REQUEST, format!("invalid rank {rank:?}"));
    };
    let Ok(attempt) = attempt.parse::<u32>() else {
        return json_error(
            StatusCode::BAD_REQUEST,
            format!("invalid attempt {attempt:?}"),
        );
    };
    // offset and max_bytes must be non-negative integers.
    let query = match query {
        Ok(Query(q)) => q,
        Err(rejection) => return json_error(StatusCode::BAD_REQUEST, rejection.body_text()),
    };
    let offset = query.offset.unwrap_or(0);
    let max_bytes = query.max_bytes.unwrap_or(DEFAULT_MAX_BYTES);
    let key = AttemptKey::new(job_id, rank, attempt);
    let paths = match AttemptPaths::new(&state.data_dir, &key) {
        Ok(p) => p,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    match logs::read_log(&paths, offset, max_bytes, query.since_ms).await {
        Ok(chunk) => Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .header(LOG_SIZE_HEADER, chunk.size_bytes)
            .header(LOG_OFFSET_HEADER, chunk.offset)
            .header(
                LOG_COMPLETE_HEADER,
                if chunk.complete { "true" } else { "false" },
            )
            .body(Body::from(chunk.data))
            .unwrap_or_else(|e| json_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())),
        Err(ReadLogError::NotFound) => {
            json_error(StatusCode::NOT_FOUND, format!("no log for {key}"))
        }
        Err(e @ (ReadLogError::OffsetPastEnd { .. } | ReadLogError::BadMaxBytes(_))) => {
            json_error(StatusCode::BAD_REQUEST, e.to_string())
        }
        Err(e @ ReadLogError::Io(_)) => {
            tracing::error!(attempt = %key, "log read failed: {e}");
            json_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logs::{ExitRecord, write_exit_record};

    struct Server {
        _dir: tempfile::TempDir,
        data: PathBuf,
        base: String,
        http: reqwest::Client,
    }

    async fn server() -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("data");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let router = router(AgentApiState {
            data_dir: Arc::new(data.clone()),
            token: Arc::from("cluster-secret"),
            worker_id: Arc::from("w-1"),
            metrics_token: Some(Arc::from("scrape-secret")),
        });
        tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
        Server {
            _dir: dir,
            data,
            base,
            http: reqwest::Client::new(),
        }
    }

    impl Server {
        async fn get(&self, path: &str) -> reqwest::Response {
            self.http
                .get(format!("{}{path}", self.base))
                .bearer_auth("cluster-secret")
                .send()
                .await
                .expect("send")
        }
    }

    fn header<'a>(r: &'a reqwest::Response, name: &str) -> &'a str {
        r.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .expect("header")
    }

    #[tokio::test]
    async fn health_needs_no_token() {
        let s = server().await;
        let r = s
            .http
            .get(format!("{}/health", s.base))
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 200);
        let body: serde_json::Value = r.json().await.expect("json");
        assert_eq!(body["worker_id"], "w-1");
    }

    #[tokio::test]
    async fn metrics_take_the_scrape_or_the_cluster_token_and_nothing_else() {
        let s = server().await;
        let url = format!("{}/metrics", s.base);
        for token in [None, Some("wrong"), Some("cu.someone.secret")] {
            let mut req = s.http.get(&url);
            if let Some(t) = token {
                req = req.bearer_auth(t);
            }
            assert_eq!(req.send().await.expect("send").status(), 401, "{token:?}");
        }
        crate::metrics::metrics().dataset_fetch(false, 7);
        for token in ["scrape-secret", "cluster-secret"] {
            let r = s
                .http
                .get(&url)
                .bearer_auth(token)
                .send()
                .await
                .expect("send");
            assert_eq!(r.status(), 200);
            let kind = header(&r, "content-type").to_string();
            assert!(kind.starts_with("text/plain; version=0.0.4"), "{kind}");
            let text = r.text().await.expect("body");
            assert!(
                text.contains("# TYPE cumulus_agent_live_ranks gauge"),
                "{text}"
            );
            assert!(
                text.contains("cumulus_agent_dataset_cache_requests_total{result=\"miss\"}"),
                "{text}"
            );
        }
    }

    #[tokio::test]
    async fn logs_require_the_cluster_token() {
        let s = server().await;
        let url = format!("{}/v1/logs/job-000001/0/0", s.base);
        let r = s.http.get(&url).send().await.expect("send");
        assert_eq!(r.status(), 401);
        let r = s
            .http
            .get(&url)
            .bearer_auth("wrong")
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 401);
        let body: serde_json::Value = r.json().await.expect("json");
        assert!(body["error"].is_string());
    }

    #[tokio::test]
    async fn logs_page_cut_and_complete() {
        let s = server().await;
        let key = AttemptKey::new("job-000001", 1, 2);
        let paths = AttemptPaths::new(&s.data, &key).expect("paths");
        let base = "/v1/logs/job-000001/1/2";

        let r = s.get(base).await;
        assert_eq!(r.status(), 404);

        std::fs::create_dir_all(&paths.dir).expect("mkdir");
        std::fs::write(&paths.log, b"alpha\nbeta\ngam").expect("write");

        let r = s.get(base).await;
        assert_eq!(r.status(), 200);
        assert_eq!(header(&r, LOG_SIZE_HEADER), "14");
        assert_eq!(header(&r, LOG_COMPLETE_HEADER), "false");
        assert_eq!(r.bytes().await.expect("body").as_ref(), b"alpha\nbeta\n");

        // Paging with offset and max_bytes.
        let r = s.get(&format!("{base}?offset=0&max_bytes=8")).await;
        assert_eq!(r.bytes().await.expect("body").as_ref(), b"alpha\n");
        let r = s.get(&format!("{base}?offset=6&max_bytes=100")).await;
        assert_eq!(r.bytes().await.expect("body").as_ref(), b"beta\n");
        // The partial last line is held back until complete.
        let r = s.get(&format!("{base}?offset=11")).await;
        assert_eq!(r.status(), 200);
        assert!(r.bytes().await.expect("body").is_empty());
        let r = s.get(&format!("{base}?offset=14")).await;
        assert_eq!(r.status(), 200);
        assert!(r.bytes().await.expect("body").is_empty());

        write_exit_record(
            &paths.exit,
            &ExitRecord {
                exec_failed: false,
                cause: None,
                exit_code: Some(1),
                signal: None,
                spawn_error: None,
                agent_fault: false,
                agent_evidence: None,
            },
        )
        .await
        .expect("exit");
        let r = s.get(&format!("{base}?offset=11")).await;
        assert_eq!(header(&r, LOG_COMPLETE_HEADER), "true");
        assert_eq!(r.bytes().await.expect("body").as_ref(), b"gam");

        for bad in [
            format!("{base}?offset=15"),
            format!("{base}?offset=-1"),
            format!("{base}?max_bytes=0"),
            format!("{base}?max_bytes=1048577"),
            "/v1/logs/job-000001/x/2".to_string(),
            "/v1/logs/job-000001/1/-2".to_string(),
            "/v1/logs/.hidden/1/2".to_string(),
        ] {
            let r = s.get(&bad).await;
            assert_eq!(r.status(), 400, "{bad}");
            let body: serde_json::Value = r.json().await.expect("json");
            assert!(body["error"].is_string(), "{bad}");
        }
        let r = s.get(&format!("{base}?max_bytes=1048576")).await;
        assert_eq!(r.status(), 200);
        // Another attempt of the same rank has no log.
        assert_eq!(s.get("/v1/logs/job-000001/1/3").await.status(), 404);
    }
}
