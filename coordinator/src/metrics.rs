//! `GET /metrics`: this coordinator's metrics in the Prometheus text format (0.0.4),
//! through the `prometheus-client` crate.
//!
//! Who may scrape: the holder of the scrape token (`--metrics-token-file`, a credential
//! that grants nothing else), or any authenticated user, of any role (`read` is enough);
//! else 401. Metrics (names carry their unit, counters end in `_total`, every label has
//! a bounded set of values; no job id is a label):
//!
//! - Raft, read from openraft's metrics at scrape time: `cumulus_raft_term`,
//!   `cumulus_raft_is_leader`, `cumulus_raft_commit_index`,
//!   `cumulus_raft_applied_index`, `cumulus_raft_apply_lag_entries`,
//!   `cumulus_raft_log_bytes` (the write-ahead log's segments on disk),
//!   `cumulus_raft_snapshot_bytes`, and `cumulus_raft_leader_changes_total` (counted by
//!   a watcher of those metrics).
//! - The state, at scrape time: `cumulus_jobs{state}` (the 7 job states),
//!   `cumulus_workers{state}` (`alive`, `expired`).
//! - Counted where they happen: `cumulus_heartbeats_total` (accepted by this leader),
//!   `cumulus_restarts_total{cause}` (restarts this leader committed, by
//!   [`restart_cause`]), `cumulus_http_request_duration_seconds{route,method,code}`
//!   (the matched route template, never the raw path),
//!   `cumulus_grpc_request_duration_seconds{route,code}` (the method's path, or
//!   `unmatched` for one no service serves; time to the response's headers),
//!   `cumulus_checkpoint_part_commit_duration_seconds` and
//!   `cumulus_checkpoint_part_bytes_total` (parts committed through this leader),
//!   `cumulus_checkpoint_step_commit_duration_seconds` and
//!   `cumulus_checkpoint_step_bytes_total` (steps it verified and committed).
//!
//! One registry per process ([`metrics`]); a scrape renders it into one string (for
//! 10,000 jobs and 1,000 workers: docs/benchmarks.md, "Metrics scrape").
//!
//! `GET /metrics/targets` ([`targets`]) lists every coordinator and alive agent for
//! Prometheus's HTTP service discovery (compose/prometheus.yml uses it).

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use openraft::async_runtime::watch::WatchReceiver;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::node::Node;

/// Labels of the HTTP request histogram: bounded by the router's routes, the methods
/// they take and the status codes the API answers.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    /// The matched route template ([`route_label`]: `/v1/jobs/:id`), never the raw
    /// path.
    pub route: String,
    /// The request's method.
    pub method: String,
    /// The response's status code.
    pub code: u16,
}

/// One label, `state` or `cause`, of a fixed set of values.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    /// The value.
    pub state: &'static str,
}

/// The `cause` label of `cumulus_restarts_total` (values: [`restart_cause`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabel {
    /// The value.
    pub cause: &'static str,
}

/// A histogram's constructor in a [`Family`].
type HistogramOf = fn() -> Histogram;

/// Buckets of request and commit durations, in seconds: 0.5 ms to ~16 s.
fn duration_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// Labels of the gRPC request histogram: bounded by the services' methods (a path no
/// service serves is `unmatched`) and the gRPC status codes.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcLabels {
    /// `/package.Service/Method`, or `unmatched`.
    pub route: String,
    /// The gRPC status code (0: OK).
    pub code: u16,
}

/// Every metric of this coordinator and the registry that renders them.
pub struct Metrics {
    registry: Registry,
    raft_term: Gauge,
    raft_is_leader: Gauge,
    raft_commit_index: Gauge,
    raft_applied_index: Gauge,
    raft_apply_lag: Gauge,
    raft_log_bytes: Gauge,
    raft_snapshot_bytes: Gauge,
    jobs: Family<StateLabel, Gauge>,
    workers: Family<StateLabel, Gauge>,
    /// Changes of the leader this node saw (another node, or none, or itself).
    pub leader_changes: Counter,
    /// Heartbeats this node accepted as leader.
    pub heartbeats: Counter,
    /// Restarts this node committed as leader, by cause.
    pub restarts: Family<CauseLabel, Counter>,
    /// HTTP requests by route template, method and status, in seconds.
    pub http_requests: Family<RouteLabels, Histogram, HistogramOf>,
    /// gRPC calls by method and status, until the response's headers, in seconds.
    pub grpc_requests: Family<GrpcLabels, Histogram, HistogramOf>,
    /// Time from a part's report to its commit in the log, in seconds.
    pub part_commit_seconds: Histogram,
    /// Bytes of the parts committed.
    pub part_bytes: Counter,
    /// Time to verify a step's parts, write its manifest and commit it, in seconds.
    pub step_commit_seconds: Histogram,
    /// Bytes of the steps committed.
    pub step_bytes: Counter,
}

impl Metrics {
    fn new() -> Metrics {
        let mut m = Metrics {
            registry: Registry::default(),
            raft_term: Gauge::default(),
            raft_is_leader: Gauge::default(),
            raft_commit_index: Gauge::default(),
            raft_applied_index: Gauge::default(),
            raft_apply_lag: Gauge::default(),
            raft_log_bytes: Gauge::default(),
            raft_snapshot_bytes: Gauge::default(),
            jobs: Family::default(),
            workers: Family::default(),
            leader_changes: Counter::default(),
            heartbeats: Counter::default(),
            restarts: Family::default(),
            http_requests: Family::new_with_constructor(duration_buckets as HistogramOf),
            grpc_requests: Family::new_with_constructor(duration_buckets as HistogramOf),
            part_commit_seconds: duration_buckets(),
            part_bytes: Counter::default(),
            step_commit_seconds: duration_buckets(),
            step_bytes: Counter::default(),
        };
        let r = &mut m.registry;
        r.register(
            "cumulus_raft_term",
            "This node's current Raft term",
            m.raft_term.clone(),
        );
        r.register(
            "cumulus_raft_is_leader",
            "1 while this node is the Raft leader",
            m.raft_is_leader.clone(),
        );
        r.register(
            "cumulus_raft_commit_index",
            "Index of the newest committed Raft entry this node knows of",
            m.raft_commit_index.clone(),
        );
        r.register(
            "cumulus_raft_applied_index",
            "Index of the newest Raft entry this node applied",
            m.raft_applied_index.clone(),
        );
        r.register(
            "cumulus_raft_apply_lag_entries",
            "Committed Raft entries this node has not applied yet",
            m.raft_apply_lag.clone(),
        );
        r.register(
            "cumulus_raft_log_bytes",
            "Bytes of the Raft write-ahead log's segments on disk",
            m.raft_log_bytes.clone(),
        );
        r.register(
            "cumulus_raft_snapshot_bytes",
            "Bytes of the newest Raft snapshot",
            m.raft_snapshot_bytes.clone(),
        );
        r.register(
            "cumulus_raft_leader_changes",
            "Changes of the Raft leader this node saw",
            m.leader_changes.clone(),
        );
        r.register(
            "cumulus_jobs",
            "Jobs in the replicated state, by state",
            m.jobs.clone(),
        );
        r.register(
            "cumulus_workers",
            "Workers in the replicated state, by state",
            m.workers.clone(),
        );
        r.register(
            "cumulus_heartbeats",
            "Worker heartbeats this node accepted as leader",
            m.heartbeats.clone(),
        );
        r.register(
            "cumulus_restarts",
            "Job restarts this node committed as leader, by cause",
            m.restarts.clone(),
        );
        r.register(
            "cumulus_http_request_duration_seconds",
            "HTTP API requests by route template, method and status code, in seconds",
            m.http_requests.clone(),
        );
        r.register(
            "cumulus_grpc_request_duration_seconds",
            "gRPC calls by method and status code, until the response starts, in seconds",
            m.grpc_requests.clone(),
        );
        r.register(
            "cumulus_checkpoint_part_commit_duration_seconds",
            "Checkpoint parts: from an agent's report to the commit in the log, in seconds",
            m.part_commit_seconds.clone(),
        );
        r.register(
            "cumulus_checkpoint_part_bytes",
            "Bytes of the checkpoint parts committed",
            m.part_bytes.clone(),
        );
        r.register(
            "cumulus_checkpoint_step_commit_duration_seconds",
            "Checkpoint steps: verifying every part, the manifest and the commit, in seconds",
            m.step_commit_seconds.clone(),
        );
        r.register(
            "cumulus_checkpoint_step_bytes",
            "Bytes of the checkpoint steps committed",
            m.step_bytes.clone(),
        );
        // Every job state and both worker states are always present (0 when none).
        for state in cumulus_api::JobState::ALL {
            let _ = m.jobs.get_or_create(&StateLabel {
                state: state.as_str(),
            });
        }
        for cause in RESTART_CAUSES {
            let _ = m.restarts.get_or_create(&CauseLabel { cause });
        }
        m
    }
}

/// This process's metrics.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

/// The values of `cumulus_restarts_total`'s `cause` label.
pub const RESTART_CAUSES: [&str; 6] = [
    "exit",
    "worker_lost",
    "hung",
    "startup_timeout",
    "gpu_unhealthy",
    "agent_fault",
];

/// The `cause` label of a restart from its cause as the planner wrote it (the failed
/// ranks' causes joined, the first one deciding) and whether it was the agent's fault.
pub fn restart_cause(cause: &str, agent_fault: bool) -> &'static str {
    if agent_fault {
        "agent_fault"
    } else if cause.starts_with("lost:") {
        "worker_lost"
    } else if cause.starts_with("hung:") {
        "hung"
    } else if cause.starts_with("no first report") {
        "startup_timeout"
    } else if cause.starts_with("GPU ") {
        "gpu_unhealthy"
    } else {
        "exit"
    }
}

/// Counts leader changes from this node's Raft metrics until `cancel`.
pub async fn watch_leader(node: Arc<Node>, cancel: tokio_util::sync::CancellationToken) {
    let mut rx = node.raft.metrics();
    let mut leader = rx.borrow_watched().current_leader;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            changed = rx.changed() => if changed.is_err() { return },
        }
        let now = rx.borrow_watched().current_leader;
        if now != leader {
            leader = now;
            metrics().leader_changes.inc();
        }
    }
}

/// The scrape token (`--metrics-token-file`), set once at start.
static SCRAPE_TOKEN: OnceLock<Arc<str>> = OnceLock::new();
/// The write-ahead log's directory (`<data-dir>/raft/wal`), set once at start.
static WAL_DIR: OnceLock<std::path::PathBuf> = OnceLock::new();

/// Sets up `/metrics` for a coordinator whose data dir is `data_dir`: with
/// `scrape_token_file`, loads the scrape token (trimmed; the rules of
/// [`cumulus_api::token::check`]), which must differ from the `others` (the cluster
/// and peer tokens, which grant far more).
///
/// # Errors
/// The file cannot be read, the token breaks a rule, or equals another token.
pub fn init(
    data_dir: &Path,
    scrape_token_file: Option<&Path>,
    others: &[&str],
) -> anyhow::Result<()> {
    let _ = WAL_DIR.set(data_dir.join("raft").join("wal"));
    let Some(file) = scrape_token_file else {
        return Ok(());
    };
    let token = crate::auth::read_token_file(file)?;
    cumulus_api::token::check(&token)?;
    if others.contains(&token.as_str()) {
        anyhow::bail!(
            "the metrics token ({}) must differ from the cluster and peer tokens: it is \
             meant for a scraper, which should hold nothing else",
            file.display()
        );
    }
    let _ = SCRAPE_TOKEN.set(token.into());
    Ok(())
}

/// Whether a request may read `/metrics`: the scrape token, or any authenticated user.
fn may_scrape(node: &Node, headers: &HeaderMap, req_cert: Option<&cumulus_tls::PeerCert>) -> bool {
    let header = headers.get("authorization").and_then(|v| v.to_str().ok());
    if let Some(token) = SCRAPE_TOKEN.get()
        && cumulus_api::token::bearer_matches(header, token)
    {
        return true;
    }
    crate::auth::authenticate(node, header, req_cert).is_some()
}

/// `GET /metrics`.
pub async fn scrape(State(node): State<Arc<Node>>, req: Request) -> Response {
    let cert = req
        .extensions()
        .get::<cumulus_listen::ConnInfo>()
        .and_then(|c| c.peer_cert());
    if !may_scrape(&node, req.headers(), cert) {
        return (
            StatusCode::UNAUTHORIZED,
            axum::Json(serde_json::json!({"error": "missing or wrong bearer token"})),
        )
            .into_response();
    }
    let log_bytes = match WAL_DIR.get() {
        Some(dir) => wal_bytes(dir.clone()).await,
        None => 0,
    };
    match render(&node, log_bytes) {
        Ok(text) => (
            [(
                axum::http::header::CONTENT_TYPE,
                prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            )],
            text,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// `GET /metrics/targets`: every scrape target of the cluster in the format of
/// Prometheus's HTTP service discovery (`http_sd_configs`): the coordinators' HTTP
/// addresses (the Raft membership) with `cumulus_role="coordinator"`, and the alive
/// workers' agent addresses with `cumulus_role="worker"`. Taken by whoever may scrape.
pub async fn targets(State(node): State<Arc<Node>>, req: Request) -> Response {
    let cert = req
        .extensions()
        .get::<cumulus_listen::ConnInfo>()
        .and_then(|c| c.peer_cert());
    if !may_scrape(&node, req.headers(), cert) {
        return (
            StatusCode::UNAUTHORIZED,
            axum::Json(serde_json::json!({"error": "missing or wrong bearer token"})),
        )
            .into_response();
    }
    let raft = node.raft.metrics().borrow_watched().clone();
    let coordinators: Vec<String> = raft
        .membership_config
        .membership()
        .nodes()
        .map(|(_, n)| n.http_addr.clone())
        .collect();
    let workers: Vec<String> = node.read_state(|s| {
        s.workers
            .values()
            .filter(|w| w.state == cumulus_raft_store::state::WorkerState::Alive)
            .map(|w| w.http_addr.clone())
            .collect()
    });
    axum::Json(serde_json::json!([
        {"targets": coordinators, "labels": {"cumulus_role": "coordinator"}},
        {"targets": workers, "labels": {"cumulus_role": "worker"}},
    ]))
    .into_response()
}

/// Bytes of the files in `dir` (the WAL's segments; a handful of files), off the
/// runtime thread.
async fn wal_bytes(dir: std::path::PathBuf) -> u64 {
    tokio::task::spawn_blocking(move || {
        std::fs::read_dir(dir).map_or(0, |entries| {
            entries
                .filter_map(|e| e.ok()?.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
    })
    .await
    .unwrap_or(0)
}

/// Sets the scrape-time gauges from `node` and renders every metric.
///
/// # Errors
/// Only when formatting into a string fails.
pub fn render(node: &Node, log_bytes: u64) -> Result<String, std::fmt::Error> {
    let m = metrics();
    let raft = node.raft.metrics().borrow_watched().clone();
    let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let committed = raft
        .cluster_committed
        .or(raft.local_committed)
        .map_or(0, |l| l.index);
    let applied = raft.last_applied.map_or(0, |l| l.index);
    m.raft_term.set(gauge(raft.current_term));
    m.raft_is_leader
        .set(i64::from(raft.current_leader == Some(node.id)));
    m.raft_commit_index.set(gauge(committed));
    m.raft_applied_index.set(gauge(applied));
    m.raft_apply_lag
        .set(gauge(committed.saturating_sub(applied)));
    m.raft_log_bytes.set(gauge(log_bytes));
    m.raft_snapshot_bytes.set(gauge(
        node.shared
            .snapshot_bytes
            .load(std::sync::atomic::Ordering::Relaxed),
    ));
    let (jobs, alive, expired) = node.read_state(|s| {
        let mut jobs = vec![0i64; cumulus_api::JobState::ALL.len()];
        for j in s.jobs.values() {
            if let Some(i) = cumulus_api::JobState::ALL
                .iter()
                .position(|x| *x == j.state)
            {
                jobs[i] += 1;
            }
        }
        let alive = s
            .workers
            .values()
            .filter(|w| w.state == cumulus_raft_store::state::WorkerState::Alive)
            .count();
        (jobs, alive, s.workers.len() - alive)
    });
    for (state, n) in cumulus_api::JobState::ALL.iter().zip(jobs) {
        m.jobs
            .get_or_create(&StateLabel {
                state: state.as_str(),
            })
            .set(n);
    }
    m.workers
        .get_or_create(&StateLabel { state: "alive" })
        .set(gauge(alive as u64));
    m.workers
        .get_or_create(&StateLabel { state: "expired" })
        .set(gauge(expired as u64));
    let mut out = String::with_capacity(16 * 1024);
    prometheus_client::encoding::prometheus_text::encode(&mut out, &m.registry)?;
    Ok(out)
}

/// Middleware (a route layer, so the route is matched): observes each request's time
/// to its response in `cumulus_http_request_duration_seconds`.
pub async fn track_http(req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| route_label(p.as_str()));
    // A fixed set: a client may send any token as a method.
    let method = match req.method().as_str() {
        m @ ("GET" | "HEAD" | "POST" | "PUT" | "DELETE" | "PATCH" | "OPTIONS") => m,
        _ => "other",
    }
    .to_string();
    let started = Instant::now();
    let response = next.run(req).await;
    observe_http(route, method, response.status().as_u16(), started.elapsed());
    response
}

/// A route template as a label: `/v1/jobs/{id}` as `/v1/jobs/:id`, `/ui/{*path}` as
/// `/ui/*path` (braces inside label values trip some text-format parsers).
pub fn route_label(template: &str) -> String {
    template
        .replace("{*", "*")
        .replace('{', ":")
        .replace('}', "")
}

fn observe_http(route: String, method: String, code: u16, took: Duration) {
    metrics()
        .http_requests
        .get_or_create(&RouteLabels {
            route,
            method,
            code,
        })
        .observe(took.as_secs_f64());
}

/// Adds [`GrpcTiming`] to a tonic server (`Server::builder().layer(GrpcTimingLayer)`).
#[derive(Clone, Copy, Debug, Default)]
pub struct GrpcTimingLayer;

impl<S> tower_layer::Layer<S> for GrpcTimingLayer {
    type Service = GrpcTiming<S>;

    fn layer(&self, inner: S) -> GrpcTiming<S> {
        GrpcTiming { inner }
    }
}

/// Observes each gRPC call's time to its response headers in
/// `cumulus_grpc_request_duration_seconds`, with the status the headers carry (tonic
/// sends an error of a unary call as a trailers-only response: the status in the
/// headers; none there means the call went on to succeed or stream).
#[derive(Clone, Debug)]
pub struct GrpcTiming<S> {
    inner: S,
}

/// The gRPC status `UNIMPLEMENTED`: the answer to a path no service serves.
const GRPC_UNIMPLEMENTED: u16 = 12;

impl<S, ReqBody, ResBody> tower_service::Service<axum::http::Request<ReqBody>> for GrpcTiming<S>
where
    S: tower_service::Service<
            axum::http::Request<ReqBody>,
            Response = axum::http::Response<ResBody>,
        >,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: axum::http::Request<ReqBody>) -> Self::Future {
        let path = req.uri().path().to_string();
        let started = Instant::now();
        let response = self.inner.call(req);
        Box::pin(async move {
            let response = response.await?;
            let code = response
                .headers()
                .get("grpc-status")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u16>().ok())
                .unwrap_or(0);
            let route = if code == GRPC_UNIMPLEMENTED || path.len() > 128 {
                "unmatched".to_string()
            } else {
                path
            };
            metrics()
                .grpc_requests
                .get_or_create(&GrpcLabels { route, code })
                .observe(started.elapsed().as_secs_f64());
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_labels_name_the_template_without_braces() {
        assert_eq!(route_label("/v1/jobs/{id}/summary"), "/v1/jobs/:id/summary");
        assert_eq!(route_label("/ui/{*path}"), "/ui/*path");
        assert_eq!(route_label("/v1/jobs"), "/v1/jobs");
    }

    #[test]
    fn restart_causes_are_a_fixed_set() {
        for (cause, fault, label) in [
            ("exit code 1: ValueError: x (t.py:1)", false, "exit"),
            ("killed by signal 9", false, "exit"),
            (
                "lost: its worker no longer reports the process",
                false,
                "worker_lost",
            ),
            ("hung: no progress for more than 1000 ms", false, "hung"),
            (
                "no first report within 5 ms of start (startup timeout)",
                false,
                "startup_timeout",
            ),
            ("GPU GPU-1 is unhealthy (xid 79)", false, "gpu_unhealthy"),
            ("lost: whatever", true, "agent_fault"),
        ] {
            assert_eq!(restart_cause(cause, fault), label, "{cause}");
            assert!(RESTART_CAUSES.contains(&label));
        }
    }
}
