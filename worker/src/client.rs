//! gRPC client to the coordinators, with leader following and bounded retries.
//!
//! Every call carries `authorization: Bearer <token>`. An answer UNAVAILABLE with the
//! metadata `x-cumulus-leader-grpc` (a follower naming the leader) is retried against that
//! address at once; other UNAVAILABLE answers and transport failures rotate to the next
//! configured coordinator after a backoff. Every call makes at most
//! [`RetryPolicy::max_attempts`] attempts, each bounded by the policy's attempt timeout
//! (≤ the 5 s request timeout; heartbeats use a shorter one, so that a dead or cut-off
//! leader costs a worker less than its heartbeat timeout) and a 1 s connect timeout, so a
//! call's worst case is `max_attempts × attempt_timeout + Σ backoffs`, and is also cut
//! short by the cancellation token. HTTP/2 keep-alive pings drop a dead connection
//! within [`KEEP_ALIVE_INTERVAL`] + [`KEEP_ALIVE_TIMEOUT`].

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use cumulus_proto::worker_service_client::WorkerServiceClient;
use thiserror::Error;
use tokio_util::sync::CancellationToken;
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Response, Status};

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
/// Channels to addresses other than the configured ones (learned leaders) kept cached.
const MAX_EXTRA_CHANNELS: usize = 8;
/// Longest leader address accepted from metadata.
const MAX_LEADER_ADDR_BYTES: usize = 256;

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
}

/// Why a call did not succeed.
#[derive(Debug, Error)]
pub enum ClientError {
    /// The coordinator answered with a definitive error (not retried): FAILED_PRECONDITION
    /// (stale attempt, unknown job or rank), INVALID_ARGUMENT, UNAUTHENTICATED, …
    #[error("{call} rejected by {addr}: {code:?}: {message}")]
    Rejected {
        /// The RPC name.
        call: &'static str,
        /// The coordinator that answered.
        addr: String,
        /// The gRPC status code.
        code: Code,
        /// The status message.
        message: String,
    },
    /// Every attempt failed with a retryable error.
    #[error("{call} failed after {attempts} attempts; last error: {last}")]
    Exhausted {
        /// The RPC name.
        call: &'static str,
        /// Attempts made.
        attempts: u32,
        /// The last error seen.
        last: String,
    },
    /// The agent is shutting down.
    #[error("{call} cancelled: the agent is shutting down")]
    Cancelled {
        /// The RPC name.
        call: &'static str,
    },
}

impl ClientError {
    /// The status code of a definitive rejection.
    pub fn code(&self) -> Option<Code> {
        match self {
            ClientError::Rejected { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// true when the coordinator rejected the request as stale (FAILED_PRECONDITION): the
    /// attempt, job or rank is not current any more, retrying cannot help.
    pub fn is_stale(&self) -> bool {
        self.code() == Some(Code::FailedPrecondition)
    }
}

/// Errors building a client.
#[derive(Debug, Error)]
pub enum ClientConfigError {
    /// No coordinator address was given.
    #[error("no coordinator address given")]
    NoCoordinators,
    /// An address is not a valid URI.
    #[error("invalid coordinator address {addr:?}: {reason}")]
    BadAddress {
        /// The address.
        addr: String,
        /// What was wrong.
        reason: String,
    },
    /// The token cannot be sent as gRPC metadata.
    #[error("the cluster token must be visible ASCII without spaces")]
    BadToken,
}

fn retryable(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Unknown
            | Code::Aborted
            | Code::ResourceExhausted
            | Code::Internal
    )
}

/// Turns `host:port` (or a full `http://host:port`) into a URI string.
fn normalize(addr: &str) -> String {
    let addr = addr.trim();
    if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    }
}

fn endpoint(uri: &str) -> Result<Channel, String> {
    let endpoint = Endpoint::from_shared(uri.to_string()).map_err(|e| e.to_string())?;
    Ok(endpoint
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(REQUEST_TIMEOUT)
        .http2_keep_alive_interval(KEEP_ALIVE_INTERVAL)
        .keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
        .connect_lazy())
}

struct State {
    /// URI calls go to now.
    current: String,
    /// Index into the seeds of the last rotation.
    next_seed: usize,
    channels: HashMap<String, Channel>,
}

/// Client of the coordinators' `WorkerService`.
pub struct CoordinatorClient {
    seeds: Vec<String>,
    auth: AsciiMetadataValue,
    state: Mutex<State>,
    cancel: CancellationToken,
}

impl std::fmt::Debug for CoordinatorClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoordinatorClient")
            .field("seeds", &self.seeds)
            .finish_non_exhaustive()
    }
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
        let seeds: Vec<String> = coordinators
            .iter()
            .filter(|a| !a.trim().is_empty())
            .map(|a| normalize(a))
            .collect();
        if seeds.is_empty() {
            return Err(ClientConfigError::NoCoordinators);
        }
        let mut channels = HashMap::new();
        for uri in &seeds {
            let channel = endpoint(uri).map_err(|reason| ClientConfigError::BadAddress {
                addr: uri.clone(),
                reason,
            })?;
            channels.insert(uri.clone(), channel);
        }
        if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ClientConfigError::BadToken);
        }
        let auth: AsciiMetadataValue = MetadataValue::try_from(format!("Bearer {token}"))
            .map_err(|_| ClientConfigError::BadToken)?;
        Ok(Self {
            state: Mutex::new(State {
                current: seeds[0].clone(),
                next_seed: 0,
                channels,
            }),
            seeds,
            auth,
            cancel,
        })
    }

    /// The number of configured coordinators.
    pub fn coordinator_count(&self) -> usize {
        self.seeds.len()
    }

    fn current(&self) -> (String, Channel) {
        let state = self.state.lock().expect("client state lock poisoned");
        let channel = state
            .channels
            .get(&state.current)
            .expect("the current address always has a channel")
            .clone();
        (state.current.clone(), channel)
    }

    fn rotate(&self, failed: &str) {
        let mut state = self.state.lock().expect("client state lock poisoned");
        if state.current != failed {
            return; // another call already moved on
        }
        state.next_seed = (state.next_seed + 1) % self.seeds.len();
        state.current = self.seeds[state.next_seed].clone();
    }

    /// Points calls at `leader` (from metadata). Returns false when it is unusable.
    fn follow(&self, leader: &str) -> bool {
        if leader.is_empty() || leader.len() > MAX_LEADER_ADDR_BYTES {
            return false;
        }
        let uri = normalize(leader);
        let mut state = self.state.lock().expect("client state lock poisoned");
        if !state.channels.contains_key(&uri) {
            let Ok(channel) = endpoint(&uri) else {
                return false;
            };
            let extra: Vec<String> = state
                .channels
                .keys()
                .filter(|k| !self.seeds.contains(k) && **k != state.current)
                .cloned()
                .collect();
            if extra.len() >= MAX_EXTRA_CHANNELS {
                for k in extra {
                    state.channels.remove(&k);
                }
            }
            state.channels.insert(uri.clone(), channel);
        }
        state.current = uri;
        true
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
        let max_attempts = policy.max_attempts.max(1);
        let mut backoff = policy.initial_backoff;
        let mut last = String::from("no attempt made");
        let mut redirected = false;
        for attempt in 1..=max_attempts {
            if self.cancel.is_cancelled() {
                return Err(ClientError::Cancelled { call });
            }
            let (addr, channel) = self.current();
            let mut request = Request::new(message.clone());
            request
                .metadata_mut()
                .insert("authorization", self.auth.clone());
            let bounded = tokio::time::timeout(
                policy.attempt_timeout,
                rpc(WorkerServiceClient::new(channel), request),
            );
            let result = tokio::select! {
                r = bounded => r.unwrap_or_else(|_| Err(Status::deadline_exceeded(format!(
                    "no answer within {} ms",
                    policy.attempt_timeout.as_millis()
                )))),
                _ = self.cancel.cancelled() => return Err(ClientError::Cancelled { call }),
            };
            let status = match result {
                Ok(response) => return Ok(response.into_inner()),
                Err(status) => status,
            };
            if !retryable(status.code()) {
                return Err(ClientError::Rejected {
                    call,
                    addr,
                    code: status.code(),
                    message: status.message().to_string(),
                });
            }
            last = format!("{addr}: {:?}: {}", status.code(), status.message());
            if attempt == max_attempts {
                // The next call starts at another coordinator.
                self.rotate(&addr);
                break;
            }
            let leader = (status.code() == Code::Unavailable)
                .then(|| status.metadata().get(cumulus_proto::LEADER_GRPC_METADATA))
                .flatten()
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            if let Some(leader) = leader
                && normalize(&leader) != addr
                && self.follow(&leader)
            {
                tracing::debug!(call, from = %addr, to = %leader, "following the leader");
                // A first redirect is retried at once; a chain of redirects backs off.
                if !redirected {
                    redirected = true;
                    continue;
                }
            } else {
                redirected = false;
                self.rotate(&addr);
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = self.cancel.cancelled() => return Err(ClientError::Cancelled { call }),
            }
            backoff = (backoff * 2).min(policy.max_backoff);
        }
        Err(ClientError::Exhausted {
            call,
            attempts: max_attempts,
            last,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cumulus_proto::RegisterWorkerRequest;

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
        // Each of the three failed attempts rotated: 0 -> 1 -> 0 -> 1.
        assert_eq!(client.current().0, "http://localhost:1");
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
                &cumulus_proto::HeartbeatRequest::default(),
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

    #[tokio::test]
    async fn following_bounds_the_channel_cache() {
        let client =
            CoordinatorClient::new(&["127.0.0.1:1".into()], "secret", CancellationToken::new())
                .expect("client");
        for port in 2..40 {
            assert!(client.follow(&format!("127.0.0.1:{port}")));
        }
        assert_eq!(client.current().0, "http://127.0.0.1:39");
        let n = client.state.lock().expect("lock").channels.len();
        assert!(n <= 1 + MAX_EXTRA_CHANNELS + 1, "{n} channels cached");
        assert!(!client.follow(""));
        assert!(!client.follow(&"x".repeat(300)));
    }
}
