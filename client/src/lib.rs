//! How a process reaches the cluster: the one leader-following gRPC client the CLI, the
//! worker agents, the coordinators' peer channels, the end-to-end tests and the
//! benchmarks share. The names it reads on the wire are the contract's
//! ([`cumulus_api::leader`]); this crate does the I/O (connections, TLS, retries).
//!
//! Only the leader serves writes (and linearizable reads). A follower answers UNAVAILABLE
//! with the leader's address in [`LEADER_GRPC_METADATA`]: the call follows it (the first
//! redirect at once, a chain of redirects with backoff). A transport failure, a timeout,
//! or UNAVAILABLE without a leader (an election in progress) rotates to the next
//! configured coordinator after a backoff that doubles from
//! [`RetryPolicy::initial_backoff`] up to [`RetryPolicy::max_backoff`]. A call makes at
//! most [`RetryPolicy::max_attempts`] attempts, starts none after
//! [`RetryPolicy::max_total`], bounds each by [`RetryPolicy::attempt_timeout`], and ends
//! at once when its cancellation token fires. The address that answered last is where the
//! next call starts.
//!
//! Which failures are retried is the caller's choice ([`RetryPolicy::retry_server_errors`]):
//! an agent's calls are idempotent and must outlast an overloaded or failing leader, so
//! they retry RESOURCE_EXHAUSTED, ABORTED, UNKNOWN and INTERNAL too; a user's command
//! shows those at once (a full cluster refusing a submit is an answer, not an outage).
//!
//! With TLS, a channel connects through [`TlsConnector`]: it accepts a server only if its
//! certificate, issued by the cluster CA for the host dialled, names the identity the
//! client expects ([`cumulus_tls::ExpectedServer`]: any coordinator here, one coordinator
//! between Raft peers), and refuses it during the handshake, before a request or token
//! is sent. A server refused so is not dialled again before a backoff that doubles from
//! [`REFUSED_BACKOFF_MIN`] to [`REFUSED_BACKOFF_MAX`]; the refusal is logged at most every
//! [`REFUSED_LOG_EVERY`].

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use cumulus_tls::ExpectedServer;
use cumulus_tls::rustls::{self, ClientConfig};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tonic::codegen::Service;
use tonic::codegen::http::Uri;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Response, Status};

pub use cumulus_api::leader::{
    LEADER_GRPC_METADATA, LEADER_HTTP_HEADER, LEADER_HTTP_METADATA, MAX_LEADER_ADDR_BYTES,
};

/// Channels kept to addresses other than the configured ones (learned leaders).
pub const MAX_EXTRA_CHANNELS: usize = 8;

/// How often a call is tried, how long it waits between tries, and what it retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in total (≥ 1), redirects to the leader included.
    pub max_attempts: u32,
    /// No attempt starts (and no backoff waits) past this time since the call began.
    pub max_total: Duration,
    /// Wait after the first failure that rotates; doubled after each further one.
    pub initial_backoff: Duration,
    /// Upper bound of the wait.
    pub max_backoff: Duration,
    /// Longest wait for one attempt's answer; a coordinator that does not answer in time
    /// (dead, cut off, paused) counts as a failed attempt and the next goes elsewhere.
    pub attempt_timeout: Duration,
    /// Also retry (at the next coordinator) RESOURCE_EXHAUSTED, ABORTED, and UNKNOWN or
    /// INTERNAL without a transport message; see the module documentation.
    pub retry_server_errors: bool,
    /// Log one warning after this many failed attempts of one call (0 = never).
    pub warn_after_attempts: u32,
}

impl RetryPolicy {
    /// Backoff before retry number `retry` (1-based) after a rotation:
    /// `initial_backoff × 2^(retry-1)`, capped at `max_backoff`.
    pub fn backoff(&self, retry: u32) -> Duration {
        let factor = 1u32
            .checked_shl(retry.saturating_sub(1).min(16))
            .unwrap_or(u32::MAX);
        self.initial_backoff
            .saturating_mul(factor)
            .min(self.max_backoff)
    }
}

/// TLS of a client's channels: the CA that verifies the coordinators, and the client's
/// own certificate for mutual TLS (coordinators and workers; users have none).
#[derive(Clone, PartialEq, Eq)]
pub struct ClientTls {
    /// The cluster CA certificate(s), PEM.
    pub ca_pem: Arc<[u8]>,
    /// This client's certificate chain and key (`None`: no client certificate).
    pub identity_pem: Option<IdentityPem>,
}

/// A client certificate chain and its private key, PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct IdentityPem {
    /// The certificate chain.
    pub cert: Arc<[u8]>,
    /// The private key.
    pub key: Arc<[u8]>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("client_certificate", &self.identity_pem.is_some())
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    /// The rustls configuration of these PEMs accepting only a server that names
    /// `expected` ([`cumulus_tls::client_config_from_pem`]).
    ///
    /// # Errors
    /// The PEMs hold no usable CA, certificate or key.
    pub fn rustls_config(
        &self,
        expected: ExpectedServer,
    ) -> Result<Arc<ClientConfig>, cumulus_tls::TlsError> {
        let identity = self.identity_pem.as_ref().map(|id| (&*id.cert, &*id.key));
        cumulus_tls::client_config_from_pem(&self.ca_pem, identity, expected)
    }
}

/// Shortest wait before dialling again a server whose certificate was refused.
pub const REFUSED_BACKOFF_MIN: Duration = Duration::from_millis(500);
/// Longest such wait.
pub const REFUSED_BACKOFF_MAX: Duration = Duration::from_secs(10);
/// A server's refusals are logged at most this often.
pub const REFUSED_LOG_EVERY: Duration = Duration::from_secs(5);

/// The refusals of one server's certificate: when it may be dialled again, and when the
/// last was logged. Shared by the connectors of every channel to that server (a Raft peer
/// gets a new channel per openraft client).
#[derive(Clone, Debug, Default)]
pub struct Refusals(Arc<Mutex<RefusalState>>);

#[derive(Debug, Default)]
struct RefusalState {
    /// Refusals since the last handshake that passed.
    count: u32,
    /// No dialling before this.
    retry_at: Option<Instant>,
    /// The last refusal's reason.
    reason: String,
    /// When a refusal was last logged.
    logged_at: Option<Instant>,
}

impl Refusals {
    fn lock(&self) -> std::sync::MutexGuard<'_, RefusalState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How long the server is still not dialled after a refusal; `None` when it may be.
    /// A caller that retries on its own (a Raft peer's replication) waits this out
    /// rather than fail at once in a loop.
    pub fn backoff_left(&self) -> Option<Duration> {
        let st = self.lock();
        st.retry_at?.checked_duration_since(Instant::now())
    }

    /// Why `addr` is not dialled now, while its backoff runs.
    fn holding(&self, addr: &str) -> Option<std::io::Error> {
        let st = self.lock();
        let left = st.retry_at?.checked_duration_since(Instant::now())?;
        Some(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            format!(
                "{addr} was refused ({}); not dialled again for {} ms",
                st.reason,
                left.as_millis()
            ),
        ))
    }

    /// Records a refused certificate and logs it (at most every [`REFUSED_LOG_EVERY`]).
    fn refused(&self, addr: &str, reason: String) {
        let mut st = self.lock();
        st.count = st.count.saturating_add(1);
        let factor = 1u32 << st.count.saturating_sub(1).min(16);
        let wait = REFUSED_BACKOFF_MIN
            .saturating_mul(factor)
            .min(REFUSED_BACKOFF_MAX);
        let now = Instant::now();
        st.retry_at = Some(now + wait);
        if st
            .logged_at
            .is_none_or(|t| now.duration_since(t) >= REFUSED_LOG_EVERY)
        {
            st.logged_at = Some(now);
            tracing::warn!(
                server = addr,
                refusals = st.count,
                retry_in_ms = wait.as_millis() as u64,
                "refused the server's TLS certificate: {reason}"
            );
        }
        st.reason = reason;
    }

    fn passed(&self) {
        let mut st = self.lock();
        st.count = 0;
        st.retry_at = None;
    }
}

/// A connector of tonic channels (`Endpoint::connect_with_connector`): TCP (no delay),
/// then a TLS handshake with a rustls configuration whose verifier checks the server's
/// identity ([`ClientTls::rustls_config`], `cumulus_tls::Credentials::client_config`),
/// with ALPN `h2`. tonic's own TLS takes no such verifier. The endpoint's URI must be
/// `http://` (tonic would do its own TLS on `https://`): see [`endpoint`].
#[derive(Clone)]
pub struct TlsConnector {
    config: Arc<ClientConfig>,
    refusals: Refusals,
}

impl std::fmt::Debug for TlsConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConnector").finish_non_exhaustive()
    }
}

impl TlsConnector {
    /// Connects with `config` (its ALPN is set to `h2`), backing off from the server
    /// while `refusals` says so.
    pub fn new(config: Arc<ClientConfig>, refusals: Refusals) -> TlsConnector {
        let mut config = (*config).clone();
        config.alpn_protocols = vec![b"h2".to_vec()];
        TlsConnector {
            config: Arc::new(config),
            refusals,
        }
    }

    /// The refusals of its server.
    pub fn refusals(&self) -> &Refusals {
        &self.refusals
    }
}

/// Whether a failed handshake's error is the server's certificate being refused (not a
/// network failure, nor the server refusing ours).
fn certificate_refused(err: &std::io::Error) -> bool {
    matches!(
        err.get_ref()
            .and_then(|e| e.downcast_ref::<rustls::Error>()),
        Some(rustls::Error::InvalidCertificate(_))
            | Some(rustls::Error::Other(_))
            | Some(rustls::Error::NoCertificatesPresented)
    )
}

impl Service<Uri> for TlsConnector {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, std::io::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let config = self.config.clone();
        let refusals = self.refusals.clone();
        Box::pin(async move {
            let bad = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, why);
            let host = uri.host().ok_or_else(|| bad("no host in the address"))?;
            let port = uri
                .port_u16()
                .ok_or_else(|| bad("no port in the address"))?;
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let addr = format!("{host}:{port}");
            if let Some(err) = refusals.holding(&addr) {
                return Err(err);
            }
            let name = rustls::pki_types::ServerName::try_from(host.clone())
                .map_err(|e| bad(&format!("{host} is not a server name: {e}")))?;
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            match tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await
            {
                Ok(tls) => {
                    refusals.passed();
                    Ok(TokioIo::new(tls))
                }
                Err(e) => {
                    let reason = format!("TLS handshake with {addr}: {e}");
                    if certificate_refused(&e) {
                        refusals.refused(&addr, e.to_string());
                    }
                    Err(std::io::Error::new(e.kind(), reason))
                }
            }
        })
    }
}

/// The endpoint of `addr` (`host:port`): `http://addr`, and with `tls` the origin
/// `https://addr` that requests carry, for a channel made by [`connect_lazy`] or
/// [`connect`] with a [`TlsConnector`].
///
/// # Errors
/// `addr` is not a valid URI authority.
pub fn endpoint(addr: &str, tls: bool) -> Result<Endpoint, tonic::transport::Error> {
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))?;
    if !tls {
        return Ok(endpoint);
    }
    let origin = Endpoint::from_shared(format!("https://{addr}"))?
        .uri()
        .clone();
    Ok(endpoint.origin(origin))
}

/// A lazily connected channel of `endpoint` ([`endpoint`]), through `tls` when given.
pub fn connect_lazy(endpoint: &Endpoint, tls: Option<TlsConnector>) -> Channel {
    match tls {
        Some(connector) => endpoint.connect_with_connector_lazy(connector),
        None => endpoint.connect_lazy(),
    }
}

/// A channel of `endpoint` ([`endpoint`]), connected now, through `tls` when given.
///
/// # Errors
/// The connection or the handshake fails (the TLS error names the identity found when
/// the server's certificate names another than expected).
pub async fn connect(
    endpoint: &Endpoint,
    tls: Option<TlsConnector>,
) -> Result<Channel, tonic::transport::Error> {
    match tls {
        Some(connector) => endpoint.connect_with_connector(connector).await,
        None => endpoint.connect().await,
    }
}

/// How the channels to the coordinators are made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelSettings {
    /// TCP connect timeout.
    pub connect_timeout: Duration,
    /// Whole-request timeout set on the channel (the policy's attempt timeout may be
    /// shorter).
    pub request_timeout: Duration,
    /// HTTP/2 keep-alive `(interval, timeout)`: a connection to a coordinator that died
    /// or was cut off is dropped within their sum. `None` = no pings (short-lived CLI).
    pub keep_alive: Option<(Duration, Duration)>,
    /// TLS (`https://`); `None`: plaintext (`--insecure`).
    pub tls: Option<ClientTls>,
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Retry at this leader address (`host:port`).
    Leader(String),
    /// Retry at the next configured address, after backoff.
    Rotate,
    /// Give up: the answer is definitive.
    Fail,
}

/// Classifies a failed attempt (pure: unit-tested on constructed statuses).
pub fn classify(status: &Status, retry_server_errors: bool) -> Next {
    match status.code() {
        Code::Unavailable => match leader_hint(status.metadata()) {
            Some(addr) => Next::Leader(addr),
            None => Next::Rotate,
        },
        // Endpoint timeouts surface as CANCELLED ("Timeout expired").
        Code::Cancelled | Code::DeadlineExceeded => Next::Rotate,
        // A connection reset mid-call surfaces as UNKNOWN/INTERNAL with a transport message.
        Code::Unknown | Code::Internal if is_transport_message(status.message()) => Next::Rotate,
        Code::Unknown | Code::Internal | Code::Aborted | Code::ResourceExhausted
            if retry_server_errors =>
        {
            Next::Rotate
        }
        _ => Next::Fail,
    }
}

fn is_transport_message(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("transport error") || m.contains("h2 protocol error") || m.contains("connection")
}

/// The leader address named by an UNAVAILABLE answer, as `host:port` (a scheme and a
/// trailing `/` are dropped); `None` when absent, not ASCII, too long or not an address.
pub fn leader_hint(md: &MetadataMap) -> Option<String> {
    let v = md.get(LEADER_GRPC_METADATA)?.to_str().ok()?.trim();
    let v = v.strip_prefix("http://").unwrap_or(v);
    let v = v.strip_suffix('/').unwrap_or(v);
    if v.is_empty() || v.len() > MAX_LEADER_ADDR_BYTES || !v.contains(':') {
        return None;
    }
    Some(v.to_string())
}

/// `host:port` from a configured address that may carry an `http://` scheme.
fn host_port(addr: &str) -> &str {
    let a = addr.trim();
    let a = a
        .strip_prefix("http://")
        .or_else(|| a.strip_prefix("https://"))
        .unwrap_or(a);
    a.strip_suffix('/').unwrap_or(a)
}

/// The address choice of one call: a leader hint when there is one, else the configured
/// addresses in rotation, starting at the one that answered last.
#[derive(Debug, Clone)]
pub struct Rotation<'a> {
    addrs: &'a [String],
    index: usize,
    hint: Option<String>,
}

impl<'a> Rotation<'a> {
    /// Starts at `preferred` (a leader learned by an earlier call) or `addrs[start]`.
    /// `addrs` must not be empty.
    pub fn new(addrs: &'a [String], start: usize, preferred: Option<String>) -> Self {
        assert!(!addrs.is_empty(), "a rotation needs an address");
        let index = start % addrs.len();
        Rotation {
            addrs,
            index,
            hint: preferred,
        }
    }

    /// The address of the next attempt.
    pub fn current(&self) -> &str {
        self.hint
            .as_deref()
            .unwrap_or_else(|| &self.addrs[self.index])
    }

    /// Follows a leader hint. Returns false when the hint is the address just tried
    /// (a confused node): the caller then rotates instead.
    pub fn follow(&mut self, leader: String) -> bool {
        if leader == self.current() {
            return false;
        }
        self.hint = Some(leader);
        true
    }

    /// Moves on after a failed attempt: from a leader hint back to the configured address
    /// in use (it may know the new leader by now), else to the next configured address.
    pub fn rotate(&mut self) {
        if self.hint.take().is_none() {
            self.index = (self.index + 1) % self.addrs.len();
        }
    }

    /// Index of the configured address in use.
    pub fn index(&self) -> usize {
        self.index
    }
}

/// Why a call did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// A coordinator answered definitively (not retried under the policy).
    #[error("{method}: {addr} answered {code:?}: {message}")]
    Rejected {
        /// The RPC.
        method: &'static str,
        /// The coordinator that answered (`host:port`).
        addr: String,
        /// The gRPC status code.
        code: Code,
        /// The status message.
        message: String,
    },
    /// Every attempt failed with a retryable error.
    #[error(
        "{method}: no coordinator answered after {attempts} tries in {elapsed_ms} ms (last, from {last_addr}: {last})"
    )]
    Exhausted {
        /// The RPC.
        method: &'static str,
        /// Attempts made.
        attempts: u32,
        /// Time spent, in milliseconds.
        elapsed_ms: u64,
        /// Address of the last attempt.
        last_addr: String,
        /// The last error seen.
        last: String,
    },
    /// The caller's cancellation token fired (the process is shutting down).
    #[error("{method} cancelled: shutting down")]
    Cancelled {
        /// The RPC.
        method: &'static str,
    },
}

impl CallError {
    /// The status code of a definitive rejection.
    pub fn code(&self) -> Option<Code> {
        match self {
            CallError::Rejected { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// true when a coordinator refused the request as no longer current
    /// (FAILED_PRECONDITION: a stale attempt, a finished job, a rank placed elsewhere):
    /// retrying cannot help.
    pub fn is_stale(&self) -> bool {
        self.code() == Some(Code::FailedPrecondition)
    }
}

/// Errors building a [`LeaderClient`].
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// No coordinator address was given.
    #[error("no coordinator address given")]
    NoCoordinators,
    /// An address cannot be made into an endpoint.
    #[error("invalid coordinator address {addr:?}: {reason}")]
    BadAddress {
        /// The address.
        addr: String,
        /// What was wrong.
        reason: String,
    },
    /// The token cannot be sent as gRPC metadata.
    #[error("the token must be visible ASCII without spaces")]
    BadToken,
}

#[derive(Debug, Default)]
struct State {
    /// The leader learned from a hint, or the address that answered last.
    preferred: Option<String>,
    /// Rotation start of the next call.
    next_index: usize,
    /// Lazily connected channels by `host:port`: every configured address, and at most
    /// [`MAX_EXTRA_CHANNELS`] others.
    channels: HashMap<String, Channel>,
}

/// A gRPC client of the coordinators that follows the leader (see the module
/// documentation). Every request carries `authorization: Bearer <token>` (none for a
/// client that authenticates with its certificate alone). Channels connect lazily, so
/// building one does no I/O, but it must happen inside a tokio runtime.
pub struct LeaderClient {
    addrs: Vec<String>,
    auth: Option<AsciiMetadataValue>,
    settings: ChannelSettings,
    state: Mutex<State>,
}

impl std::fmt::Debug for LeaderClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderClient")
            .field("addrs", &self.addrs)
            .finish_non_exhaustive()
    }
}

impl LeaderClient {
    /// A client of `coordinators` (`host:port`, or `http://host:port`; blank entries are
    /// skipped) authenticating with `token` (visible ASCII), or, with an empty `token`,
    /// with the client certificate of `settings.tls` alone (calls then carry no
    /// `authorization` header; a user's certificate names the user).
    pub fn new(
        coordinators: &[String],
        token: &str,
        settings: ChannelSettings,
    ) -> Result<Self, ConfigError> {
        let addrs: Vec<String> = coordinators
            .iter()
            .filter(|a| !a.trim().is_empty())
            .map(|a| host_port(a).to_string())
            .collect();
        if addrs.is_empty() {
            return Err(ConfigError::NoCoordinators);
        }
        let certified = settings
            .tls
            .as_ref()
            .is_some_and(|t| t.identity_pem.is_some());
        let auth = if token.is_empty() && certified {
            None
        } else {
            if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(ConfigError::BadToken);
            }
            Some(
                AsciiMetadataValue::try_from(format!("Bearer {token}"))
                    .map_err(|_| ConfigError::BadToken)?,
            )
        };
        let mut channels = HashMap::new();
        for a in &addrs {
            let channel = channel(a, &settings).map_err(|reason| ConfigError::BadAddress {
                addr: a.clone(),
                reason,
            })?;
            channels.insert(a.clone(), channel);
        }
        Ok(Self {
            addrs,
            auth,
            settings,
            state: Mutex::new(State {
                channels,
                ..State::default()
            }),
        })
    }

    /// The configured coordinators, as `host:port`.
    pub fn coordinators(&self) -> &[String] {
        &self.addrs
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .expect("client state lock is never poisoned: no panics while held")
    }

    /// The channel to `addr`, made (lazily connected) when new; `None` when `addr` is not
    /// a usable address.
    fn channel_to(&self, addr: &str) -> Option<Channel> {
        let mut st = self.lock();
        if let Some(c) = st.channels.get(addr) {
            return Some(c.clone());
        }
        let c = channel(addr, &self.settings).ok()?;
        let extra: Vec<String> = st
            .channels
            .keys()
            .filter(|k| !self.addrs.contains(k))
            .cloned()
            .collect();
        if extra.len() >= MAX_EXTRA_CHANNELS {
            for k in extra {
                st.channels.remove(&k);
            }
        }
        st.channels.insert(addr.to_string(), c.clone());
        Some(c)
    }

    /// Calls one RPC with leader following and retries under `policy`; `cancel`, when
    /// given, ends the call at once ([`CallError::Cancelled`]). `rpc` gets a channel to
    /// the attempt's coordinator and a request already carrying the token.
    pub async fn call<M, T, F, Fut>(
        &self,
        method: &'static str,
        policy: &RetryPolicy,
        cancel: Option<&CancellationToken>,
        msg: &M,
        mut rpc: F,
    ) -> Result<T, CallError>
    where
        M: Clone,
        F: FnMut(Channel, Request<M>) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let never = CancellationToken::new();
        let cancel = cancel.unwrap_or(&never);
        let start = Instant::now();
        let mut rotation = {
            let st = self.lock();
            Rotation::new(&self.addrs, st.next_index, st.preferred.clone())
        };
        let max_attempts = policy.max_attempts.max(1);
        let mut attempts = 0u32;
        let mut rotations = 0u32;
        let mut redirected = false;
        loop {
            if cancel.is_cancelled() {
                return Err(CallError::Cancelled { method });
            }
            attempts += 1;
            let addr = rotation.current().to_string();
            let status = match self.channel_to(&addr) {
                None => Status::unavailable(format!("{addr} is not a usable address")),
                Some(channel) => {
                    let mut request = Request::new(msg.clone());
                    if let Some(auth) = &self.auth {
                        request.metadata_mut().insert("authorization", auth.clone());
                    }
                    let bounded =
                        tokio::time::timeout(policy.attempt_timeout, rpc(channel, request));
                    let answer = tokio::select! {
                        r = bounded => r.unwrap_or_else(|_| Err(Status::deadline_exceeded(format!(
                            "no answer within {} ms",
                            policy.attempt_timeout.as_millis()
                        )))),
                        _ = cancel.cancelled() => return Err(CallError::Cancelled { method }),
                    };
                    match answer {
                        Ok(response) => {
                            let mut st = self.lock();
                            st.preferred = Some(addr);
                            st.next_index = rotation.index();
                            return Ok(response.into_inner());
                        }
                        Err(status) => status,
                    }
                }
            };
            let next = classify(&status, policy.retry_server_errors);
            tracing::debug!(method, %addr, code = ?status.code(), message = status.message(), ?next, "attempt failed");
            let wait = match next {
                Next::Fail => {
                    // This coordinator answered: the next call starts here (unless it
                    // refused the token, which says nothing of who leads).
                    if status.code() != Code::Unauthenticated {
                        self.lock().preferred = Some(addr.clone());
                    }
                    return Err(CallError::Rejected {
                        method,
                        addr,
                        code: status.code(),
                        message: status.message().to_string(),
                    });
                }
                // A first redirect is retried at once; a chain of redirects backs off.
                Next::Leader(leader) if rotation.follow(leader.clone()) => {
                    if redirected {
                        rotations += 1;
                        policy.backoff(rotations)
                    } else {
                        redirected = true;
                        Duration::ZERO
                    }
                }
                Next::Leader(_) | Next::Rotate => {
                    redirected = false;
                    rotations += 1;
                    rotation.rotate();
                    policy.backoff(rotations)
                }
            };
            if attempts >= max_attempts || start.elapsed() + wait >= policy.max_total {
                let mut st = self.lock();
                st.preferred = None;
                st.next_index = rotation.index();
                return Err(CallError::Exhausted {
                    method,
                    attempts,
                    elapsed_ms: u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX),
                    last_addr: addr,
                    last: format!("{:?}: {}", status.code(), status.message()),
                });
            }
            if attempts == policy.warn_after_attempts {
                tracing::warn!(
                    "{method}: no coordinator has answered after {attempts} tries (last, from {addr}: {}); still trying for up to {} s",
                    status.message(),
                    policy.max_total.saturating_sub(start.elapsed()).as_secs()
                );
            }
            if !wait.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = cancel.cancelled() => return Err(CallError::Cancelled { method }),
                }
            }
        }
    }
}

/// A lazily connected channel to `addr` (`host:port`); with TLS it accepts only a
/// coordinator ([`TlsConnector`], [`ExpectedServer::AnyCoordinator`]).
///
/// # Errors
/// `http://{addr}` is not a valid URI, or the TLS PEMs are unusable.
fn channel(addr: &str, settings: &ChannelSettings) -> Result<Channel, String> {
    let mut endpoint = endpoint(addr, settings.tls.is_some())
        .map_err(|e| e.to_string())?
        .connect_timeout(settings.connect_timeout)
        .timeout(settings.request_timeout);
    if let Some((interval, timeout)) = settings.keep_alive {
        endpoint = endpoint
            .http2_keep_alive_interval(interval)
            .keep_alive_timeout(timeout)
            .keep_alive_while_idle(true);
    }
    let tls = match &settings.tls {
        Some(tls) => Some(TlsConnector::new(
            tls.rustls_config(ExpectedServer::AnyCoordinator)
                .map_err(|e| e.to_string())?,
            Refusals::default(),
        )),
        None => None,
    };
    Ok(connect_lazy(&endpoint, tls))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unavailable_with_leader(addr: &str) -> Status {
        let mut s = Status::unavailable("not the leader");
        s.metadata_mut()
            .insert(LEADER_GRPC_METADATA, addr.parse().expect("ascii"));
        s
    }

    #[test]
    fn classify_follows_leader_hints_and_rotates_on_transport_failures() {
        assert_eq!(
            classify(&unavailable_with_leader("http://10.0.0.2:7000/"), false),
            Next::Leader("10.0.0.2:7000".into())
        );
        assert_eq!(
            classify(&Status::unavailable("election"), false),
            Next::Rotate
        );
        assert_eq!(
            classify(&Status::cancelled("Timeout expired"), false),
            Next::Rotate
        );
        assert_eq!(
            classify(&Status::unknown("transport error: connection reset"), false),
            Next::Rotate
        );
        assert_eq!(classify(&Status::invalid_argument("bad"), true), Next::Fail);
        assert_eq!(
            classify(&Status::unauthenticated("token"), true),
            Next::Fail
        );
        assert_eq!(
            classify(&Status::failed_precondition("stale"), true),
            Next::Fail
        );
        let hint = "x".repeat(MAX_LEADER_ADDR_BYTES) + ":1";
        assert_eq!(
            classify(&unavailable_with_leader(&hint), false),
            Next::Rotate
        );
    }

    #[test]
    fn server_errors_are_retried_only_when_the_policy_says_so() {
        for s in [
            Status::resource_exhausted("full"),
            Status::aborted("raced"),
            Status::internal("apply failed"),
        ] {
            assert_eq!(classify(&s, false), Next::Fail, "{s:?}");
            assert_eq!(classify(&s, true), Next::Rotate, "{s:?}");
        }
    }

    #[test]
    fn rotation_visits_every_address_and_follows_hints() {
        let addrs: Vec<String> = vec!["a:1".into(), "b:1".into(), "c:1".into()];
        let mut r = Rotation::new(&addrs, 1, None);
        assert_eq!(r.current(), "b:1");
        assert!(r.follow("z:9".into()));
        assert_eq!(r.current(), "z:9");
        assert!(
            !r.follow("z:9".into()),
            "a hint naming itself is not followed"
        );
        r.rotate();
        assert_eq!(
            r.current(),
            "b:1",
            "from a hint back to the configured address"
        );
        r.rotate();
        r.rotate();
        assert_eq!(r.current(), "a:1");
        assert_eq!(r.index(), 0);
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        let p = RetryPolicy {
            max_attempts: 10,
            max_total: Duration::from_secs(30),
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            attempt_timeout: Duration::from_secs(5),
            retry_server_errors: false,
            warn_after_attempts: 0,
        };
        assert_eq!(p.backoff(1), Duration::from_millis(100));
        assert_eq!(p.backoff(2), Duration::from_millis(200));
        assert_eq!(
            p.backoff(5),
            Duration::from_secs(1) + Duration::from_millis(600)
        );
        assert_eq!(p.backoff(6), Duration::from_secs(2));
        assert_eq!(p.backoff(1_000), Duration::from_secs(2));
    }

    #[tokio::test]
    async fn bad_configuration_is_refused() {
        let s = ChannelSettings {
            connect_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(5),
            keep_alive: None,
            tls: None,
        };
        assert!(matches!(
            LeaderClient::new(&[], "t", s.clone()),
            Err(ConfigError::NoCoordinators)
        ));
        assert!(matches!(
            LeaderClient::new(&["127.0.0.1:1".into()], "with space", s.clone()),
            Err(ConfigError::BadToken)
        ));
        assert!(matches!(
            LeaderClient::new(&["bad addr:1".into()], "t", s.clone()),
            Err(ConfigError::BadAddress { .. })
        ));
        let c =
            LeaderClient::new(&["http://127.0.0.1:1/".into(), " ".into()], "t", s).expect("client");
        assert_eq!(c.coordinators(), ["127.0.0.1:1"]);
    }

    #[tokio::test]
    async fn learned_leaders_keep_a_bounded_channel_cache() {
        let s = ChannelSettings {
            connect_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(5),
            keep_alive: None,
            tls: None,
        };
        let c = LeaderClient::new(&["127.0.0.1:1".into()], "t", s).expect("client");
        for port in 2..40 {
            assert!(c.channel_to(&format!("127.0.0.1:{port}")).is_some());
        }
        let n = c.lock().channels.len();
        assert!(n <= 1 + MAX_EXTRA_CHANNELS, "{n} channels cached");
        assert!(
            c.lock().channels.contains_key("127.0.0.1:1"),
            "configured ones stay"
        );
        assert!(c.channel_to("not an address").is_none());
    }
}
