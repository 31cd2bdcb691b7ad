//! `GET /metrics` on the agent API: this agent's metrics in the Prometheus text format
//! (0.0.4), through the `prometheus-client` crate.
//!
//! Who may scrape: the holder of the scrape token (`--metrics-token-file`, which grants
//! nothing else) or of the cluster token; else 401. Metrics (units in the names,
//! counters end in `_total`, bounded labels: a GPU's UUID, at most
//! [`cumulus_api::limits::MAX_GPUS_PER_WORKER`]; `result` of two values):
//!
//! - `cumulus_agent_live_ranks`: rank processes alive (stopping ones included), as of
//!   the last heartbeat;
//! - `cumulus_agent_heartbeats_total{result}`: heartbeats acknowledged (`ok`) or not
//!   (`failed`);
//! - `cumulus_agent_log_bytes_total`: bytes written to ranks' logs;
//! - `cumulus_agent_checkpoint_commit_duration_seconds` and
//!   `cumulus_agent_checkpoint_bytes_total`: parts committed (files sealed, hashed and
//!   stored, then acknowledged by the leader), and their bytes;
//! - `cumulus_agent_dataset_cache_requests_total{result}` (`hit`, `miss`) and
//!   `cumulus_agent_dataset_cache_fetched_bytes_total` (downloaded on a miss);
//! - with GPUs: `cumulus_agent_gpu_utilization_ratio{gpu}` and
//!   `cumulus_agent_gpu_memory_used_bytes{gpu}` from the last heartbeat's reading.

use std::sync::{Arc, OnceLock};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::agent_api::AgentApiState;
use crate::http::{json_error, request_token};
use cumulus_api::token::constant_time_eq;

/// A `result` label of a fixed set of values.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// The value.
    pub result: &'static str,
}

/// A GPU's label: its UUID (at most [`cumulus_api::limits::MAX_GPUS_PER_WORKER`] per
/// agent).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GpuLabel {
    /// The GPU's UUID.
    pub gpu: String,
}

/// Every metric of this agent and the registry that renders them.
pub struct Metrics {
    registry: Registry,
    /// Rank processes alive, as of the last heartbeat.
    pub live_ranks: Gauge,
    /// Heartbeats by `ok` or `failed`.
    pub heartbeats: Family<ResultLabel, Counter>,
    /// Bytes written to ranks' logs.
    pub log_bytes: Counter,
    /// Part commits, in seconds.
    pub checkpoint_seconds: Histogram,
    /// Bytes of the parts committed.
    pub checkpoint_bytes: Counter,
    /// Dataset cache requests by `hit` or `miss`.
    pub dataset_cache: Family<ResultLabel, Counter>,
    /// Bytes the dataset cache downloaded.
    pub dataset_cache_bytes: Counter,
    gpu_utilization: Family<GpuLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    gpu_memory_used: Family<GpuLabel, Gauge>,
}

impl Metrics {
    fn new() -> Metrics {
        let mut m = Metrics {
            registry: Registry::default(),
            live_ranks: Gauge::default(),
            heartbeats: Family::default(),
            log_bytes: Counter::default(),
            checkpoint_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            checkpoint_bytes: Counter::default(),
            dataset_cache: Family::default(),
            dataset_cache_bytes: Counter::default(),
            gpu_utilization: Family::default(),
            gpu_memory_used: Family::default(),
        };
        let r = &mut m.registry;
        r.register(
            "cumulus_agent_live_ranks",
            "Rank processes alive on this agent (stopping ones included)",
            m.live_ranks.clone(),
        );
        r.register(
            "cumulus_agent_heartbeats",
            "Heartbeats sent, by whether a coordinator acknowledged them",
            m.heartbeats.clone(),
        );
        r.register(
            "cumulus_agent_log_bytes",
            "Bytes written to ranks' logs",
            m.log_bytes.clone(),
        );
        r.register(
            "cumulus_agent_checkpoint_commit_duration_seconds",
            "Checkpoint parts: stored and acknowledged by the leader, in seconds",
            m.checkpoint_seconds.clone(),
        );
        r.register(
            "cumulus_agent_checkpoint_bytes",
            "Bytes of the checkpoint parts committed",
            m.checkpoint_bytes.clone(),
        );
        r.register(
            "cumulus_agent_dataset_cache_requests",
            "Shards asked of the dataset cache, by hit or miss",
            m.dataset_cache.clone(),
        );
        r.register(
            "cumulus_agent_dataset_cache_fetched_bytes",
            "Bytes the dataset cache downloaded",
            m.dataset_cache_bytes.clone(),
        );
        r.register(
            "cumulus_agent_gpu_utilization_ratio",
            "A GPU's utilization (0..1) at the last heartbeat",
            m.gpu_utilization.clone(),
        );
        r.register(
            "cumulus_agent_gpu_memory_used_bytes",
            "A GPU's memory in use at the last heartbeat",
            m.gpu_memory_used.clone(),
        );
        for result in ["ok", "failed"] {
            let _ = m.heartbeats.get_or_create(&ResultLabel { result });
        }
        for result in ["hit", "miss"] {
            let _ = m.dataset_cache.get_or_create(&ResultLabel { result });
        }
        m
    }

    /// Records what a heartbeat carries: the live ranks and the GPUs' reading.
    pub fn record_heartbeat(&self, request: &cumulus_api::HeartbeatRequest) {
        self.live_ranks
            .set(i64::try_from(request.observed.len()).unwrap_or(i64::MAX));
        let gpus = request.resources.as_ref().map_or(&[][..], |r| &r.gpus[..]);
        for g in gpus.iter().take(cumulus_api::limits::MAX_GPUS_PER_WORKER) {
            let label = GpuLabel {
                gpu: g.uuid.clone(),
            };
            self.gpu_utilization
                .get_or_create(&label)
                .set(f64::from(g.utilization_percent.min(100)) / 100.0);
            self.gpu_memory_used
                .get_or_create(&label)
                .set(i64::try_from(g.memory_used_bytes).unwrap_or(i64::MAX));
        }
    }

    /// Counts a heartbeat, acknowledged or not.
    pub fn heartbeat_result(&self, ok: bool) {
        let result = if ok { "ok" } else { "failed" };
        self.heartbeats.get_or_create(&ResultLabel { result }).inc();
    }

    /// Counts a dataset cache request, and on a miss the bytes it downloaded.
    pub fn dataset_fetch(&self, hit: bool, size_bytes: u64) {
        let result = if hit { "hit" } else { "miss" };
        self.dataset_cache
            .get_or_create(&ResultLabel { result })
            .inc();
        if !hit {
            self.dataset_cache_bytes.inc_by(size_bytes);
        }
    }

    /// Renders every metric.
    ///
    /// # Errors
    /// Only when formatting into a string fails.
    pub fn render(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::with_capacity(4 * 1024);
        prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// This process's metrics.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

/// Whether `headers` carry the scrape token or the cluster token of `state`.
fn may_scrape(state: &AgentApiState, headers: &HeaderMap) -> bool {
    let Some(presented) = request_token(headers) else {
        return false;
    };
    let matches = |t: &Arc<str>| constant_time_eq(presented.as_bytes(), t.as_bytes());
    matches(&state.token) || state.metrics_token.as_ref().is_some_and(matches)
}

/// `GET /metrics`.
pub async fn scrape(State(state): State<AgentApiState>, headers: HeaderMap) -> Response {
    if !may_scrape(&state, &headers) {
        return json_error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
    }
    match metrics().render() {
        Ok(text) => (
            [(
                axum::http::header::CONTENT_TYPE,
                prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            )],
            text,
        )
            .into_response(),
        Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heartbeat_sets_the_live_ranks_and_each_gpus_reading() {
        let m = Metrics::new();
        let request = cumulus_api::HeartbeatRequest {
            worker_id: "w".into(),
            observed: vec![cumulus_api::ObservedRank::default(); 3],
            resources: Some(cumulus_api::Resources {
                gpus: vec![cumulus_api::GpuStatus {
                    uuid: "GPU-a".into(),
                    memory_used_bytes: 1 << 30,
                    utilization_percent: 50,
                    healthy: true,
                    ..Default::default()
                }],
                ..Default::default()
            }),
        };
        m.record_heartbeat(&request);
        m.heartbeat_result(false);
        let text = m.render().expect("render");
        for line in [
            "cumulus_agent_live_ranks 3",
            "cumulus_agent_gpu_utilization_ratio{gpu=\"GPU-a\"} 0.5",
            "cumulus_agent_gpu_memory_used_bytes{gpu=\"GPU-a\"} 1073741824",
            "cumulus_agent_heartbeats_total{result=\"failed\"} 1",
            "cumulus_agent_heartbeats_total{result=\"ok\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
        }
    }
}
