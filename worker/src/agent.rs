//! The control loop: register, heartbeat, reconcile.

use std::sync::Arc;
use std::time::Duration;

use cumulus_api::{
    HeartbeatRequest, HeartbeatResponse, RegisterWorkerRequest, RegisterWorkerResponse,
    WatchDesiredRequest,
};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tonic::Code;

use crate::client::{CoordinatorClient, RetryPolicy};
use crate::resources::ResourceSampler;
use crate::supervisor::Supervisor;

/// First wait between two failed registration rounds; doubled up to [`REGISTER_MAX_BACKOFF`].
pub const REGISTER_INITIAL_BACKOFF: Duration = Duration::from_millis(200);
/// Longest wait between two registration rounds (registration itself retries forever).
pub const REGISTER_MAX_BACKOFF: Duration = Duration::from_secs(5);
/// First wait after a failed `WatchDesired`.
pub const WATCH_INITIAL_BACKOFF: Duration = Duration::from_millis(100);
/// Longest wait between failed `WatchDesired` calls.
pub const WATCH_MAX_BACKOFF: Duration = Duration::from_secs(2);

/// What the control loop needs.
#[derive(Debug, Clone)]
pub struct ControlLoop {
    /// Client of the coordinators.
    pub client: Arc<CoordinatorClient>,
    /// The rank supervisor.
    pub supervisor: Supervisor,
    /// What this agent registers as.
    pub registration: RegisterWorkerRequest,
    /// The agent's GPUs, sampled at every heartbeat.
    pub gpus: Arc<std::sync::Mutex<crate::gpus::GpuMonitor>>,
    /// Time between heartbeats.
    pub heartbeat_interval: Duration,
    /// Version `(applied log index, leader ms)` of the newest desired set applied; replies
    /// from heartbeats and watches may arrive out of order, and an older one must never
    /// be applied after a newer one (it could stop a just-started replacement attempt,
    /// which could then never run again).
    pub applied: Arc<std::sync::Mutex<(u64, u64)>>,
}

impl ControlLoop {
    /// Registers, then heartbeats and reconciles, until `cancel` is cancelled.
    ///
    /// - A heartbeat answered `registered == false` (the leader expired or forgot this
    ///   worker) stops every rank and registers again.
    /// - When no heartbeat has been acknowledged for the `heartbeat_timeout_ms` the leader
    ///   announced at registration, the leader has (or will have) expired this worker and
    ///   placed its ranks elsewhere: every rank is stopped (self-fencing, so that two live
    ///   attempts of a rank do not compete for long) and the agent registers again.
    pub async fn run(self, cancel: CancellationToken) {
        let watch = tokio::spawn(self.clone().watch_desired(cancel.clone()));
        self.register_and_heartbeat(&cancel).await;
        watch.abort();
    }

    /// Applies `reply`'s desired set unless a newer one was applied already; returns
    /// whether it was applied.
    fn apply_if_newer(&self, reply: &HeartbeatResponse) -> bool {
        let version = (reply.desired_index, reply.desired_at_ms);
        {
            let mut applied = self.applied.lock().unwrap_or_else(|p| p.into_inner());
            if version < *applied {
                return false;
            }
            *applied = version;
        }
        self.supervisor.keep_spares_of(&reply.spare_jobs);
        let actions = self.supervisor.apply_desired(&reply.desired);
        if !actions.is_empty() {
            tracing::debug!(term = reply.term, ?actions, "reconciled");
        }
        true
    }

    /// Long-polls the leader for desired-state changes (`WatchDesired`), so a restart or
    /// a placement reaches this agent at once instead of at its next heartbeat.
    /// Registration and liveness stay with the heartbeat loop.
    async fn watch_desired(self, cancel: CancellationToken) {
        let timeout_ms = (2 * self.heartbeat_interval.as_millis() as u64).clamp(500, 4_000);
        // The leader holds the watch up to timeout_ms: give each attempt 1 s more.
        let policy = RetryPolicy::one_round(self.client.coordinator_count())
            .with_attempt_timeout(Duration::from_millis(timeout_ms + 1_000));
        let mut known_digest = 0u64;
        let mut backoff = WATCH_INITIAL_BACKOFF;
        while !cancel.is_cancelled() {
            let request = WatchDesiredRequest {
                worker_id: self.registration.worker_id.clone(),
                known_digest,
                timeout_ms,
            };
            let call = self
                .client
                .call("WatchDesired", policy, &request, |mut c, r| async move {
                    c.watch_desired(r).await
                });
            let result = tokio::select! {
                r = call => r,
                _ = cancel.cancelled() => return,
            };
            match result {
                Ok(reply) if reply.registered => {
                    self.apply_if_newer(&reply);
                    known_digest = reply.desired_digest;
                    backoff = WATCH_INITIAL_BACKOFF;
                    continue;
                }
                // Not registered (the heartbeat loop registers again) or no leader now.
                Ok(_) => known_digest = 0,
                Err(e) => tracing::debug!("watch failed, retrying: {e}"),
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = cancel.cancelled() => return,
            }
            backoff = (backoff * 2).min(WATCH_MAX_BACKOFF);
        }
    }

    async fn register_and_heartbeat(&self, cancel: &CancellationToken) {
        let cancel = cancel.clone();
        let mut resources = ResourceSampler::new();
        loop {
            let Some(registered) = self.register(&cancel).await else {
                return;
            };
            let timeout = Duration::from_millis(registered.heartbeat_timeout_ms);
            tracing::info!(
                worker_id = %self.registration.worker_id,
                heartbeat_timeout_ms = registered.heartbeat_timeout_ms,
                "registered with the leader"
            );
            if !self
                .heartbeat_until_lost(&cancel, timeout, &mut resources)
                .await
            {
                return;
            }
        }
    }

    /// Registers until it succeeds; `None` when cancelled first.
    async fn register(&self, cancel: &CancellationToken) -> Option<RegisterWorkerResponse> {
        let mut backoff = REGISTER_INITIAL_BACKOFF;
        loop {
            let call = self.client.call(
                "Register",
                RetryPolicy::STANDARD,
                &self.registration,
                |mut c, r| async move { c.register(r).await },
            );
            let result = tokio::select! {
                r = call => r,
                _ = cancel.cancelled() => return None,
            };
            match result {
                Ok(response) => return Some(response),
                Err(e) if e.code() == Some(Code::Unauthenticated) => {
                    tracing::error!("registration refused, check the cluster token: {e}");
                }
                Err(e) => tracing::warn!("registration failed, will retry: {e}"),
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = cancel.cancelled() => return None,
            }
            backoff = (backoff * 2).min(REGISTER_MAX_BACKOFF);
        }
    }

    /// Heartbeats until the registration is lost (returns true) or `cancel` (false).
    async fn heartbeat_until_lost(
        &self,
        cancel: &CancellationToken,
        timeout: Duration,
        resources: &mut ResourceSampler,
    ) -> bool {
        let mut ticker = tokio::time::interval(self.heartbeat_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut last_ack = Instant::now();
        // A heartbeat is answered from memory: a coordinator that has not answered in two
        // intervals (at least 1 s) is treated as down and the next one is tried, so that
        // one dead or cut-off leader does not use up the worker's heartbeat timeout (which
        // a new leader grants as grace from its takeover).
        let policy = RetryPolicy::one_round(self.client.coordinator_count())
            .with_attempt_timeout((2 * self.heartbeat_interval).max(Duration::from_secs(1)));
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = cancel.cancelled() => return false,
            }
            let request = HeartbeatRequest {
                worker_id: self.registration.worker_id.clone(),
                observed: self.supervisor.observed(),
                resources: Some(cumulus_api::Resources {
                    gpus: self
                        .gpus
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .sample(),
                    warm_spares: self.supervisor.warm_spares(),
                    ..resources.sample()
                }),
            };
            crate::metrics::metrics().record_heartbeat(&request);
            let call = self
                .client
                .call("Heartbeat", policy, &request, |mut c, r| async move {
                    c.heartbeat(r).await
                });
            let result = tokio::select! {
                r = call => r,
                _ = cancel.cancelled() => return false,
            };
            crate::metrics::metrics().heartbeat_result(result.is_ok());
            match result {
                Ok(reply) if !reply.registered => {
                    tracing::warn!(
                        "the leader does not know this worker: stopping every rank and registering again"
                    );
                    self.supervisor.stop_all();
                    return true;
                }
                Ok(reply) => {
                    last_ack = Instant::now();
                    self.apply_if_newer(&reply);
                }
                Err(e) => {
                    tracing::warn!("heartbeat failed: {e}");
                    if !timeout.is_zero() && last_ack.elapsed() >= timeout {
                        tracing::warn!(
                            "no heartbeat acknowledged for {} ms: stopping every rank and registering again",
                            last_ack.elapsed().as_millis()
                        );
                        self.supervisor.stop_all();
                        return true;
                    }
                }
            }
        }
    }
}
