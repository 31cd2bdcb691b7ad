//! gRPC client to the coordinators: the shared leader-following client
//! ([`cumulus_client::LeaderClient`]) with the agent's channel settings and retry
//! policies.
//!
//! Every call carries `authorization: Bearer <token>`, follows a follower's leader hint,
//! and rotates to the next configured coordinator after a transport failure, a timeout, or
//! a server error (an agent's calls are idempotent and must outlast an overloaded leader).
//! Every call makes at most [`RetryPolicy::max_attempts`] attempts, each bounded by the
//! policy's attempt timeout (≤ the 5 s request timeout; heartbeats use a shorter one, so
//! that a dead or cut-off leader costs a worker less than its heartbeat timeout) and a 1 s
//! connect timeout, so a call's worst case is `max_attempts × attempt_timeout + Σ
//! backoffs`, and is also cut short by the cancellation token. HTTP/2 keep-alive pings
//! drop a dead connection within [`KEEP_ALIVE_INTERVAL`] + [`KEEP_ALIVE_TIMEOUT`].
//!
//! Blob transfers (a job's workdir, an attempt's artifacts) stream for longer than one
//! request may take: they go through channels of their own whose request timeout is
//! [`TRANSFER_REQUEST_TIMEOUT`], each bounded by the caller ([`CoordinatorClient::call_transfer`];
//! the blob cache sets a deadline from the blob's size, [`crate::blobs`]).

use std::future::Future;
use std::time::Duration;

use cumulus_api::worker_service_client::WorkerServiceClient;
use cumulus_client::{self as leader, ChannelSettings, LeaderClient};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// Why a call did not succeed: rejected (FAILED_PRECONDITION is a stale attempt, job or
/// rank: [`ClientError::is_stale`]), exhausted, or cancelled by the agent's shutdown.
pub type ClientError = leader::CallError;
/// Errors building a client.
pub type ClientConfigError = leader::ConfigError;

/// Connect timeout of a channel.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Timeout of one request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Shortest per-attempt timeout a policy may set.
pub const MIN_ATTEMPT_TIMEOUT: Duration = Duration::from_millis(200);
/// HTTP/2 keep-alive ping interval of every channel: a connection to a coordinator that
/// died or was cut off is noticed (and the next call reconnects) within interval + timeout.
pub const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(1);
/// How long a keep-alive ping may go unanswered before the connection is dropped.
pub const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(2);
/// Whole-request timeout of the blob transfer channels: above any deadline the blob
/// cache sets ([`crate::blobs::transfer_deadline`] of the largest blob).
pub const TRANSFER_REQUEST_TIMEOUT: Duration = Duration::from_secs(4 * 3600);

/// How often a call is tried and how long it waits between tries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in total (≥ 1), redirects to the leader included.
    pub max_attempts: u32,
    /// Wait after the first failure; doubled after each further failure.
    pub initial_backoff: Duration,
    /// Upper bound of the wait.
    pub max_backoff: Duration,
    /// Longest wait for one attempt's answer (≤ [`REQUEST_TIMEOUT`]); a coordinator that
    /// does not answer in time (dead, cut off, paused) counts as a failed attempt and the
    /// next attempt goes to another coordinator.
    pub attempt_timeout: Duration,
}

impl RetryPolicy {
    /// Default for one-off calls (RankStarted, RankExited, Register rounds, checkpoint
    /// commits): 8 attempts, backoff 100 ms doubling up to 2 s (≤ 6.3 s of waiting).
    pub const STANDARD: RetryPolicy = RetryPolicy {
        max_attempts: 8,
        initial_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_secs(2),
        attempt_timeout: REQUEST_TIMEOUT,
    };

    /// One attempt per configured coordinator plus one redirect, short backoff: for calls
    /// repeated periodically anyway (heartbeats).
    pub fn one_round(coordinators: usize) -> RetryPolicy {
        RetryPolicy {
            max_attempts: u32::try_from(coordinators)
                .unwrap_or(u32::MAX)
                .saturating_add(1),
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(500),
            attempt_timeout: REQUEST_TIMEOUT,
        }
    }

    /// This policy with each attempt bounded by `timeout` (clamped to
    /// `[MIN_ATTEMPT_TIMEOUT, REQUEST_TIMEOUT]`).
    pub fn with_attempt_timeout(mut self, timeout: Duration) -> RetryPolicy {
        self.attempt_timeout = timeout.clamp(MIN_ATTEMPT_TIMEOUT, REQUEST_TIMEOUT);
        self
    }

    /// The shared client's policy: server errors are retried, no overall deadline but the
    /// attempts' own, no warning (the agent logs what fails once).
    fn leader_policy(self) -> leader::RetryPolicy {
        leader::RetryPolicy {
            max_attempts: self.max_attempts.max(1),
            max_total: Duration::MAX,
            initial_backoff: self.initial_backoff,
            max_backoff: self.max_backoff,
            attempt_timeout: self.attempt_timeout,
            retry_server_errors: true,
            warn_after_attempts: 0,
        }
    }
}

/// Client of the coordinators' `WorkerService`.
#[derive(Debug)]
pub struct CoordinatorClient {
    inner: LeaderClient,
    /// The same coordinators over channels for blob transfers (a longer request timeout).
    transfers: LeaderClient,
    cancel: CancellationToken,
}

impl CoordinatorClient {
    /// A client of `coordinators` (`host:port` each) authenticating with `token`; every
    /// call returns [`ClientError::Cancelled`] once `cancel` is cancelled. Channels connect
    /// lazily, so this does no I/O, but it must run inside a tokio runtime (each channel
    /// spawns its buffer task).
    pub fn new(
        coordinators: &[String],
        token: &str,
        cancel: CancellationToken,
    ) -> Result<Self, ClientConfigError> {
        Self::with_tls(coordinators, token, None, cancel)
    }

    /// [`CoordinatorClient::new`] over TLS (`tls`: the CA and this worker's certificate,
    /// which the coordinators check against the worker id of every call).
    pub fn with_tls(
        coordinators: &[String],
        token: &str,
        tls: Option<cumulus_client::ClientTls>,
        cancel: CancellationToken,
    ) -> Result<Self, ClientConfigError> {
        let settings = ChannelSettings {
            connect_timeout: CONNECT_TIMEOUT,
            request_timeout: REQUEST_TIMEOUT,
            keep_alive: Some((KEEP_ALIVE_INTERVAL, KEEP_ALIVE_TIMEOUT)),
            tls,
        };
        let transfer_settings = ChannelSettings {
            request_timeout: TRANSFER_REQUEST_TIMEOUT,
            ..settings.clone()
        };
        Ok(Self {
            inner: LeaderClient::new(coordinators, token, settings)?,
            transfers: LeaderClient::new(coordinators, token, transfer_settings)?,
            cancel,
        })
    }

    /// The number of configured coordinators.
    pub fn coordinator_count(&self) -> usize {
        self.inner.coordinators().len()
    }

    /// Calls one RPC with leader following and retries (see the module documentation).
    /// `rpc` is given a fresh client and the authenticated request for each attempt.
    pub async fn call<Req, Resp, F, Fut>(
        &self,
        call: &'static str,
        policy: RetryPolicy,
        message: &Req,
        rpc: F,
    ) -> Result<Resp, ClientError>
    where
        Req: Clone,
        F: Fn(WorkerServiceClient<Channel>, Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        self.inner
            .call(
                call,
                &policy.leader_policy(),
                Some(&self.cancel),
                message,
                |channel, request| rpc(WorkerServiceClient::new(channel), request),
            )
            .await
    }

    /// Calls one blob transfer RPC (`GetBlob`, `PutBlob`) on the transfer channels with
    /// leader following: at most `max_attempts` attempts, each bounded by
    /// `attempt_timeout` (for `GetBlob`, until the stream's first answer; for `PutBlob`,
    /// the whole upload), backoff 100 ms doubling up to 2 s.
    pub async fn call_transfer<Req, Resp, F, Fut>(
        &self,
        call: &'static str,
        (max_attempts, attempt_timeout): (u32, Duration),
        message: &Req,
        rpc: F,
    ) -> Result<Resp, ClientError>
    where
        Req: Clone,
        F: Fn(WorkerServiceClient<Channel>, Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        let policy = leader::RetryPolicy {
            max_attempts: max_attempts.max(1),
            max_total: Duration::MAX,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            attempt_timeout,
            retry_server_errors: true,
            warn_after_attempts: 0,
        };
        self.transfers
            .call(
                call,
                &policy,
                Some(&self.cancel),
                message,
                |channel, request| rpc(WorkerServiceClient::new(channel), request),
            )
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cumulus_api::RegisterWorkerRequest;

    #[tokio::test]
    async fn rejects_bad_configuration() {
        let cancel = CancellationToken::new();
        assert!(matches!(
            CoordinatorClient::new(&[], "t", cancel.clone()),
            Err(ClientConfigError::NoCoordinators)
        ));
        assert!(matches!(
            CoordinatorClient::new(&["127.0.0.1:1".into()], "with space", cancel.clone()),
            Err(ClientConfigError::BadToken)
        ));
        assert!(matches!(
            CoordinatorClient::new(&["bad addr:1".into()], "t", cancel.clone()),
            Err(ClientConfigError::BadAddress { .. })
        ));
        let c = CoordinatorClient::new(&["127.0.0.1:1".into(), "127.0.0.1:2".into()], "t", cancel)
            .expect("client");
        assert_eq!(c.coordinator_count(), 2);
    }

    #[tokio::test]
    async fn unreachable_coordinators_exhaust_the_retries_and_rotate() {
        // Port 1 on loopback refuses connections.
        let client = CoordinatorClient::new(
            &["127.0.0.1:1".into(), "localhost:1".into()],
            "secret",
            CancellationToken::new(),
        )
        .expect("client");
        let policy = RetryPolicy {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(2),
            attempt_timeout: REQUEST_TIMEOUT,
        };
        let req = RegisterWorkerRequest::default();
        let err = client
            .call("Register", policy, &req, |mut c, r| async move {
                c.register(r).await
            })
            .await
            .expect_err("nothing listens");
        match err {
            ClientError::Exhausted { attempts, .. } => assert_eq!(attempts, 3),
            other => panic!("unexpected {other}"),
        }
    }

    #[tokio::test]
    async fn a_silent_coordinator_costs_one_attempt_timeout_then_the_next_is_tried() {
        // A coordinator that accepts connections and never answers (paused, or cut off
        // after the handshake): held open by this listener until the test ends.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = silent.local_addr().expect("addr");
        let held = tokio::spawn(async move {
            let mut conns = Vec::new();
            while let Ok((c, _)) = silent.accept().await {
                conns.push(c);
            }
        });
        let client = CoordinatorClient::new(
            &[addr.to_string(), "127.0.0.1:1".into()],
            "secret",
            CancellationToken::new(),
        )
        .expect("client");
        let policy = RetryPolicy::one_round(2).with_attempt_timeout(Duration::from_millis(300));
        assert_eq!(policy.attempt_timeout, Duration::from_millis(300));
        let err = client
            .call(
                "Heartbeat",
                policy,
                &cumulus_api::HeartbeatRequest::default(),
                |mut c, r| async move { c.heartbeat(r).await },
            )
            .await
            .expect_err("nobody answers");
        let ClientError::Exhausted { attempts, last, .. } = &err else {
            panic!("unexpected {err}");
        };
        // silent (timed out) → refused → silent again (timed out): the last error is the
        // attempt timeout's, not the channel's 5 s request timeout.
        assert_eq!(*attempts, 3);
        assert!(last.contains("no answer within 300 ms"), "{last}");
        held.abort();
        // Bounds of the setter.
        let p = RetryPolicy::STANDARD.with_attempt_timeout(Duration::from_secs(60));
        assert_eq!(p.attempt_timeout, REQUEST_TIMEOUT);
        let p = RetryPolicy::STANDARD.with_attempt_timeout(Duration::ZERO);
        assert_eq!(p.attempt_timeout, MIN_ATTEMPT_TIMEOUT);
    }

    #[tokio::test]
    async fn cancellation_stops_a_call() {
        let cancel = CancellationToken::new();
        let client =
            CoordinatorClient::new(&["127.0.0.1:1".into()], "secret", cancel.clone()).expect("c");
        cancel.cancel();
        let err = client
            .call(
                "Register",
                RetryPolicy::STANDARD,
                &RegisterWorkerRequest::default(),
                |mut c, r| async move { c.register(r).await },
            )
            .await
            .expect_err("cancelled");
        assert!(matches!(err, ClientError::Cancelled { .. }));
    }
}
