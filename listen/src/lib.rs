//! Bounded listeners for every Cumulus server (coordinator gRPC and HTTP, worker agent
//! HTTP, the rank-local API on TCP and on its Unix socket).
//!
//! Without bounds, a flood of idle or half-sent connections from anything that can reach
//! a port would hold file descriptors and the connection slots that peers, workers and
//! ranks need. Here each listener has
//! - a cap on its open connections ([`Limits::max_connections`]). A connection past it
//!   displaces the connection idle longest (no request in flight), or, when none is
//!   idle, is closed at accept: it costs a descriptor for microseconds, never holds one;
//! - a small pending pool: a connection that has not yet had a useful request answered
//!   draws from [`Limits::max_pending_connections`], and its source (an IP address on
//!   TCP, a uid on a Unix socket, from `SO_PEERCRED`) from
//!   [`Limits::max_pending_per_source`]; when a share is full, a new connection
//!   displaces the stalest idle pending one of the same share. A connection graduates
//!   at its first response that is not a refusal (HTTP 401/403, gRPC
//!   `UNAUTHENTICATED`/`PERMISSION_DENIED`: [`is_refusal`]). So a flood of connections
//!   that never send a request, or only get refused, holds at most the pending pool and
//!   never keeps a real client out;
//! - a deadline for a connection's first bytes ([`Limits::first_bytes_timeout_ms`]): a
//!   connection that sends fewer than [`FIRST_BYTES`] (the HTTP/2 preface) is closed;
//! - a deadline for its first request ([`Limits::first_request_timeout_ms`]): a
//!   connection that has started no HTTP/1 request, HTTP/2 stream or gRPC call by then
//!   (or, while pending, none since its last one ended) is closed. A TLS ClientHello,
//!   the HTTP/2 preface, SETTINGS and PINGs do not count;
//! - an idle timeout ([`Limits::idle_timeout_ms`]): a graduated connection with no
//!   request in flight that long is closed. A request is in flight from the moment the
//!   service is called until its response body has been handed to the connection in
//!   full, so SSE and gRPC streams are never cut; keepalive PINGs answered by the client
//!   do not count as activity;
//! - for HTTP/1, hyper's header-read deadline ([`HTTP_HEADER_READ_TIMEOUT_MS`]): a
//!   request whose headers trickle in (slowloris) is closed;
//! - for HTTP/2, keepalive PINGs with a deadline, a cap on streams per connection and on
//!   header bytes ([`HTTP2_KEEPALIVE_INTERVAL_MS`], [`HTTP2_MAX_CONCURRENT_STREAMS`],
//!   [`HTTP2_MAX_HEADER_LIST_BYTES`]; [`GRPC_MAX_CONCURRENT_STREAMS`] where a tonic
//!   server is built);
//! - and the process keeps [`FD_RESERVE`] descriptors that no listener may use
//!   ([`fd_budget`]), so a flood can never stop an agent from opening a rank's log or a
//!   coordinator from opening and syncing its raft log.
//!
//! How it works: each accepted connection takes a slot in its listener's pool and
//! shares an [`Activity`] (requests in flight, when it was last busy) between its
//! [`BoundedStream`] and the [`Track`] service wrapper that every server runs its
//! requests through ([`serve_http`] and [`serve_unix_http`] add it; a tonic server adds
//! [`TrackLayer`], which finds the activity in the [`ConnInfo`] tonic puts in every
//! request's extensions). The stream fails its next read once its deadline passes with
//! nothing in flight, or once its pool evicted it, which ends the connection; the
//! wrapper wakes the stream's task when the last request ends, so the deadline is armed
//! even on an HTTP/2 connection that is otherwise silent.
//!
//! With [`BoundedListener::with_tls`] a listener speaks TLS only: each accepted
//! connection's handshake runs in its own task (a slow client never holds up the next
//! accept) within [`TLS_HANDSHAKE_TIMEOUT_MS`], and every request carries a [`ConnInfo`]
//! in its extensions with the verified client certificate, when one was presented, so a
//! service can tell which coordinator or worker is calling ([`ConnInfo::peer_identity`]).
//! A connection whose verified certificate names a coordinator leaves the pending pool
//! at once and counts against [`Limits::reserved_connections`] (a coordinator's gRPC
//! listener reserves [`COORDINATOR_RESERVED_CONNECTIONS`]): Raft between coordinators
//! shares the gRPC port with clients but not their slots. While the general cap is full
//! of busy connections, a new TLS connection may wait for its handshake in the reserved
//! pool; if its certificate does not name a coordinator it is closed then.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use cumulus_tls::rustls::ServerConfig;
use cumulus_tls::rustls::pki_types::CertificateDer;
use cumulus_tls::{Identity, PeerCert};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;

mod pool;
mod track;

pub use pool::{Activity, Counts, Source, TurnedAway};
use pool::{Due, Pool, Refused, Slot};
pub use track::{Track, TrackLayer, TrackedBody, is_refusal};

/// File descriptors no listener may use: room for raft log segments, the sled database,
/// rank logs and pipes, checkpoint files and outgoing connections, whatever the
/// listeners hold.
pub const FD_RESERVE: u64 = 512;
/// Deadline for an HTTP/1 request's headers (and for the next request on an idle
/// keep-alive connection), in milliseconds.
pub const HTTP_HEADER_READ_TIMEOUT_MS: u64 = 10_000;
/// Default deadline for a connection's first bytes, in milliseconds.
pub const FIRST_BYTES_TIMEOUT_MS: u64 = 10_000;
/// Bytes a connection must send before [`Limits::first_bytes_timeout_ms`]: the HTTP/2
/// client preface is 24 bytes, and no HTTP/1 request line is shorter.
pub const FIRST_BYTES: usize = 24;
/// How long the accept loop waits after a failed `accept` (descriptors exhausted, say)
/// before it tries again, in milliseconds.
pub const ACCEPT_RETRY_MS: u64 = 50;
/// Deadline for a TLS handshake after accept, in milliseconds.
pub const TLS_HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// Least interval between two warnings of one listener about refused connections, in
/// milliseconds (a flood must not flood the log too).
pub const WARN_INTERVAL_MS: u64 = 5_000;

/// Default deadline for a connection's first request (an HTTP/1 request's headers
/// parsed, an HTTP/2 stream opened, a gRPC call begun), in milliseconds; also how long a
/// connection that has not yet graduated from the pending pool may stay idle after a
/// request.
pub const FIRST_REQUEST_TIMEOUT_MS: u64 = 10_000;
/// Default idle timeout: a graduated connection with no request in flight for this long
/// is closed, in milliseconds. Longer than the 90 s for which the HTTP clients here
/// (reqwest, hyper-util's pooled client) keep an idle connection, so a client normally
/// closes an idle connection before the server does and never sends a request on one
/// the server is closing.
pub const IDLE_TIMEOUT_MS: u64 = 120_000;
/// HTTP/2 keepalive of the HTTP servers ([`serve_http`], [`serve_unix_http`]): a PING
/// after this long without frames from the peer, in milliseconds. It detects a peer
/// that vanished under a long response (SSE); it keeps nothing open: answered PINGs do
/// not count as activity for [`Limits::idle_timeout_ms`].
pub const HTTP2_KEEPALIVE_INTERVAL_MS: u64 = 30_000;
/// How long an HTTP/2 keepalive PING may go unanswered before the connection is closed,
/// in milliseconds.
pub const HTTP2_KEEPALIVE_TIMEOUT_MS: u64 = 20_000;
/// Most HTTP/2 streams (requests) open at once on one connection of an HTTP server; a
/// client that opens more gets `REFUSED_STREAM` for them. Far above what a CLI, an SDK
/// or a rank opens (a few), well under hyper's default of 200.
pub const HTTP2_MAX_CONCURRENT_STREAMS: u32 = 64;
/// Most HTTP/2 streams (calls) open at once on one connection of a gRPC server: as many
/// as its per-connection concurrency limit (a worker's watches, heartbeats and reports,
/// a leader's appends and votes share one connection).
pub const GRPC_MAX_CONCURRENT_STREAMS: u32 = 256;
/// Largest header list (HTTP/2 `SETTINGS_MAX_HEADER_LIST_SIZE`, decoded bytes) a server
/// accepts in one request, for HTTP and gRPC: a bearer token, a path and a few gRPC
/// metadata entries need well under 1 KiB; hyper's default for HTTP is the same.
pub const HTTP2_MAX_HEADER_LIST_BYTES: u32 = 16 * 1024;
/// Connections reserved on a coordinator's gRPC listener for the other coordinators
/// (TLS client certificates naming `Identity::Coordinator`): Raft replication and votes
/// get in while clients hold the rest of the cap. A few channels per peer, up to 7
/// coordinators.
pub const COORDINATOR_RESERVED_CONNECTIONS: usize = 32;

/// The bounds of one listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most connections open at once, not counting [`Limits::reserved_connections`];
    /// when full, a new connection displaces the one idle longest, or is closed at
    /// accept when none is idle.
    pub max_connections: usize,
    /// A connection that has not sent [`FIRST_BYTES`] bytes by then is closed, in
    /// milliseconds.
    pub first_bytes_timeout_ms: u64,
    /// A pending connection (no useful request answered yet) that has no request in
    /// flight this long after its accept or its last request is closed, in
    /// milliseconds. HTTP/2 frames other than a new stream (PINGs, SETTINGS) do not count.
    pub first_request_timeout_ms: u64,
    /// A graduated connection with no request in flight for this long is closed, in
    /// milliseconds (a long response, SSE or a gRPC stream, is in flight until it ends).
    pub idle_timeout_ms: u64,
    /// Most pending connections at once (the small share of the cap that connections
    /// not yet useful draw from); when full, a new connection displaces the pending one
    /// idle longest, or is refused when all are busy.
    pub max_pending_connections: usize,
    /// Most pending connections from one source at once (an IP address on TCP, a uid on
    /// a Unix socket); when full, a new connection from that source displaces its
    /// source's pending one idle longest, or is refused.
    pub max_pending_per_source: usize,
    /// Connections beyond [`Limits::max_connections`] for peers whose verified TLS client
    /// certificate names a coordinator (0: none; only with TLS).
    pub reserved_connections: usize,
}

impl Limits {
    /// `max_connections` open at once, the default deadlines, an eighth of the cap (at
    /// least 8) for pending connections and half of that (at least 4) per source, no
    /// reserved connections.
    pub const fn connections(max_connections: usize) -> Limits {
        let pending = if max_connections / 8 > 8 {
            max_connections / 8
        } else {
            8
        };
        let per_source = if pending / 2 > 4 { pending / 2 } else { 4 };
        Limits {
            max_connections,
            first_bytes_timeout_ms: FIRST_BYTES_TIMEOUT_MS,
            first_request_timeout_ms: FIRST_REQUEST_TIMEOUT_MS,
            idle_timeout_ms: IDLE_TIMEOUT_MS,
            max_pending_connections: pending,
            max_pending_per_source: per_source,
            reserved_connections: 0,
        }
    }

    /// These limits with `n` connections reserved for coordinators.
    pub const fn with_reserved(mut self, n: usize) -> Limits {
        self.reserved_connections = n;
        self
    }
}

/// Raises the soft limit on open files to the hard limit (as Go's runtime does at
/// start) and returns the descriptors the listeners may share: the limit less
/// [`FD_RESERVE`] and less `already_open` (the process's descriptors in use now).
///
/// # Errors
/// The limit cannot be read. A refused raise is not an error: the old limit is used.
pub fn fd_budget(already_open: u64) -> io::Result<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(io::Error::from)?;
    let soft = if soft < hard {
        match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(e) => {
                tracing::warn!(soft, hard, error = %e, "cannot raise the open-file limit");
                soft
            }
        }
    } else {
        soft
    };
    Ok(soft.saturating_sub(FD_RESERVE).saturating_sub(already_open))
}

/// Descriptors this process has open now (entries of `/proc/self/fd`; 64 where that
/// cannot be read).
pub fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(64, |d| d.count() as u64)
}

/// Scales the wanted connection caps of several listeners down, in proportion, until
/// they fit `budget` descriptors together; each keeps at least 16.
pub fn fit_caps(wanted: &[usize], budget: u64) -> Vec<usize> {
    let total: u64 = wanted.iter().map(|w| *w as u64).sum();
    if total <= budget || total == 0 {
        return wanted.to_vec();
    }
    wanted
        .iter()
        .map(|w| ((*w as u64).saturating_mul(budget) / total).max(16) as usize)
        .collect()
}

/// A TCP listener with [`Limits`]; serves axum routers ([`serve_http`]) and tonic
/// servers ([`BoundedListener::into_incoming`]).
pub struct BoundedListener {
    listener: TcpListener,
    /// Names the listener in logs ("coordinator gRPC", "rank API", …).
    name: &'static str,
    pool: Arc<Pool>,
    warnings: Warnings,
    /// TLS for every connection (`None`: plaintext).
    tls: Option<tokio_rustls::TlsAcceptor>,
}

/// Refused connections counted between two warnings, at most one every
/// [`WARN_INTERVAL_MS`] (a flood must not flood the log too).
#[derive(Default)]
struct Warnings {
    refused: AtomicU64,
    last_warning: Option<Instant>,
}

impl Warnings {
    fn note(&mut self, name: &'static str, error: Option<&io::Error>, why: Option<Refused>) {
        let refused = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        let due = self
            .last_warning
            .is_none_or(|t| t.elapsed() >= Duration::from_millis(WARN_INTERVAL_MS));
        if !due {
            return;
        }
        self.last_warning = Some(Instant::now());
        self.refused.store(0, Ordering::Relaxed);
        match (error, why) {
            (Some(e), _) => tracing::warn!(
                listener = name,
                failed = refused,
                error = %e,
                "accept failed; retrying"
            ),
            (None, Some(Refused::SourceShare)) => tracing::warn!(
                listener = name,
                refused,
                "connections refused: their source's share of the pending pool is busy"
            ),
            (None, Some(Refused::Pending)) => tracing::warn!(
                listener = name,
                refused,
                "connections refused: the pending pool is busy"
            ),
            (None, _) => tracing::warn!(
                listener = name,
                refused,
                "connections refused: the listener is at its cap with no idle connection"
            ),
        }
    }
}

impl BoundedListener {
    /// Wraps `listener` (plaintext until [`BoundedListener::with_tls`]).
    pub fn new(listener: TcpListener, name: &'static str, limits: Limits) -> BoundedListener {
        BoundedListener {
            listener,
            name,
            pool: Pool::new(limits),
            warnings: Warnings::default(),
            tls: None,
        }
    }

    /// Makes every connection TLS with `config` (`None` keeps plaintext).
    pub fn with_tls(mut self, config: Option<Arc<ServerConfig>>) -> BoundedListener {
        self.tls = config.map(tokio_rustls::TlsAcceptor::from);
        self
    }

    /// The listener's name, for logs.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The bound address.
    ///
    /// # Errors
    /// As [`TcpListener::local_addr`].
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Connections open now.
    pub fn open_connections(&self) -> usize {
        self.pool.counts().open
    }

    /// A handle that reads the listener's connection counts after it has been moved
    /// into a server.
    pub fn counter(&self) -> Counter {
        Counter(self.pool.clone())
    }

    /// The next connection admitted by the listener's pool (`TCP_NODELAY` set).
    /// Connections refused are closed here; failed accepts are retried after
    /// [`ACCEPT_RETRY_MS`]; both are logged at most every [`WARN_INTERVAL_MS`].
    pub async fn accept_bounded(&mut self) -> (BoundedStream, SocketAddr) {
        loop {
            let (stream, peer) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    self.pool.note_accept_error();
                    self.warnings.note(self.name, Some(&e), None);
                    tokio::time::sleep(Duration::from_millis(ACCEPT_RETRY_MS)).await;
                    continue;
                }
            };
            let slot = match self
                .pool
                .admit(Source::Ip(peer.ip().to_canonical()), self.tls.is_some())
            {
                Ok(slot) => slot,
                Err(why) => {
                    drop(stream);
                    self.warnings.note(self.name, None, Some(why));
                    continue;
                }
            };
            // Small replies must not wait for the peer's delayed ACK (Nagle).
            let _ = stream.set_nodelay(true);
            return (BoundedStream::new(stream, slot, self.pool.limits()), peer);
        }
    }

    /// The accepted connections as a stream, for tonic's `serve_with_incoming*` (add
    /// [`TrackLayer`] to the server, so the connections' requests are counted). With
    /// TLS, handshakes run in their own tasks and only completed ones are yielded; the
    /// accept loop ends when the stream is dropped.
    pub fn into_incoming(
        mut self,
    ) -> impl futures::Stream<Item = Result<ServedStream, io::Error>> + Send + 'static {
        let (tx, rx) = tokio::sync::mpsc::channel::<ServedStream>(64);
        tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    accepted = self.accept_bounded() => accepted,
                    () = tx.closed() => return,
                };
                let tls = self.tls.clone();
                let name = self.name;
                let tx = tx.clone();
                tokio::spawn(async move {
                    if let Some(served) = handshake(name, tls.as_ref(), stream).await {
                        let _ = tx.send(served).await;
                    }
                });
            }
        });
        futures::stream::unfold(rx, |mut rx| async move {
            let served = rx.recv().await?;
            Some((Ok(served), rx))
        })
    }
}

/// Reads a listener's connection counts ([`BoundedListener::counter`]).
#[derive(Clone)]
pub struct Counter(Arc<Pool>);

impl Counter {
    /// The connection pool of a Unix socket listener not serving yet, with `limits`:
    /// hand it to [`serve_unix_http_counted`] and keep a clone to read it.
    pub fn unix(limits: Limits) -> Counter {
        Counter(Pool::new(limits))
    }

    /// The counts now.
    pub fn counts(&self) -> Counts {
        self.0.counts()
    }

    /// The connections the listener turned away so far (cheap: two atomic loads).
    pub fn turned_away(&self) -> TurnedAway {
        self.0.turned_away()
    }

    /// Whether the listener's accept loop runs ([`serve_http`], [`serve_unix_http`]):
    /// false before it starts and once it ended.
    pub fn serving(&self) -> bool {
        self.0.serving()
    }
}

/// Completes a connection: the TLS handshake (within [`TLS_HANDSHAKE_TIMEOUT_MS`]) when
/// `tls` is set, then the pool learns whether the client certificate names a
/// coordinator ([`Limits::reserved_connections`]). `None` when the handshake fails or
/// times out (logged at debug: a scanner or a client of another cluster is not the
/// server's error), or the connection has no room after it.
async fn handshake(
    name: &'static str,
    tls: Option<&tokio_rustls::TlsAcceptor>,
    stream: BoundedStream,
) -> Option<ServedStream> {
    let Some(acceptor) = tls else {
        return Some(ServedStream::Plain(stream));
    };
    let remote = stream.peer_addr().ok();
    match tokio::time::timeout(
        Duration::from_millis(TLS_HANDSHAKE_TIMEOUT_MS),
        acceptor.accept(stream),
    )
    .await
    {
        Ok(Ok(tls)) => {
            let served = ServedStream::Tls(Box::new(tls));
            let coordinator = matches!(
                served.client_cert(),
                Some(PeerCert {
                    identity: Identity::Coordinator(_),
                    ..
                })
            );
            let ServedStream::Tls(t) = &served else {
                unreachable!("built as TLS above")
            };
            if t.get_ref().0.slot.identify(coordinator) {
                Some(served)
            } else {
                tracing::debug!(listener = name, ?remote, "no room after the TLS handshake");
                None
            }
        }
        Ok(Err(e)) => {
            tracing::debug!(listener = name, ?remote, error = %e, "TLS handshake failed");
            None
        }
        Err(_) => {
            tracing::debug!(listener = name, ?remote, "TLS handshake timed out");
            None
        }
    }
}

/// What a service knows of the connection a request came on; in every request's
/// extensions (tonic puts it there for gRPC, [`serve_http`] for HTTP).
#[derive(Clone, Debug, Default)]
pub struct ConnInfo {
    /// The peer's address.
    pub remote_addr: Option<SocketAddr>,
    /// The client's certificate chain, verified against the cluster CA, when the
    /// connection is TLS and the client presented one.
    pub peer_certs: Option<Arc<Vec<CertificateDer<'static>>>>,
    /// Whether the connection is TLS.
    pub tls: bool,
    /// Who the verified client certificate names and since when it is valid, parsed
    /// once per connection (not per request: a worker's heartbeats arrive every second
    /// on the same connection).
    pub peer: Option<PeerCert>,
    /// The connection's requests in flight and idle time, which [`Track`] updates
    /// (`None` outside a [`BoundedListener`]).
    pub activity: Option<Arc<Activity>>,
}

impl ConnInfo {
    /// Who the client's verified certificate names (`None`: plaintext, no certificate,
    /// or a certificate naming no identity).
    pub fn peer_identity(&self) -> Option<Identity> {
        self.peer.as_ref().map(|p| p.identity.clone())
    }

    /// The client's verified certificate: whom it names and its notBefore (`None` as
    /// for [`ConnInfo::peer_identity`]).
    pub fn peer_cert(&self) -> Option<&PeerCert> {
        self.peer.as_ref()
    }
}

/// A served connection: plaintext or TLS over a [`BoundedStream`].
pub enum ServedStream {
    /// Plaintext.
    Plain(BoundedStream),
    /// TLS, handshake done.
    Tls(Box<tokio_rustls::server::TlsStream<BoundedStream>>),
}

impl ServedStream {
    /// Who the verified client certificate names and since when (`None`: plaintext,
    /// none, or one naming no identity).
    fn client_cert(&self) -> Option<PeerCert> {
        match self {
            ServedStream::Plain(_) => None,
            ServedStream::Tls(t) => t
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .and_then(|c| cumulus_tls::peer_cert_of(c).ok()),
        }
    }

    /// The connection's [`ConnInfo`].
    pub fn conn_info(&self) -> ConnInfo {
        match self {
            ServedStream::Plain(s) => ConnInfo {
                remote_addr: s.peer_addr().ok(),
                peer_certs: None,
                tls: false,
                peer: None,
                activity: Some(s.slot.activity().clone()),
            },
            ServedStream::Tls(t) => {
                let (s, session) = t.get_ref();
                let certs = session.peer_certificates();
                ConnInfo {
                    remote_addr: s.peer_addr().ok(),
                    peer_certs: certs.map(|c| Arc::new(c.to_vec())),
                    tls: true,
                    peer: self.client_cert(),
                    activity: Some(s.slot.activity().clone()),
                }
            }
        }
    }
}

impl AsyncRead for ServedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ServedStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ServedStream::Tls(t) => Pin::new(t.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for ServedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ServedStream::Plain(s) => Pin::new(s).poll_write(cx, data),
            ServedStream::Tls(t) => Pin::new(t.as_mut()).poll_write(cx, data),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ServedStream::Plain(s) => Pin::new(s).poll_flush(cx),
            ServedStream::Tls(t) => Pin::new(t.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ServedStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ServedStream::Tls(t) => Pin::new(t.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ServedStream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            ServedStream::Tls(t) => Pin::new(t.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            ServedStream::Plain(s) => s.is_write_vectored(),
            ServedStream::Tls(t) => t.is_write_vectored(),
        }
    }
}

impl tonic::transport::server::Connected for ServedStream {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.conn_info()
    }
}

/// A connection admitted by a [`BoundedListener`] or [`serve_unix_http`]: holds its slot
/// in the listener's pool until dropped, and fails its reads (which ends the connection)
/// once
/// - the first-bytes deadline passes before [`FIRST_BYTES`] bytes arrived;
/// - it is idle (no request in flight, as [`Track`] counts them) past its deadline:
///   [`Limits::first_request_timeout_ms`] while pending, [`Limits::idle_timeout_ms`]
///   once graduated; bytes alone (HTTP/2 PINGs, SETTINGS, a half-sent request) never
///   move the deadline;
/// - or its pool evicted it to make room for a new connection.
pub struct BoundedStream<S = TcpStream> {
    inner: S,
    slot: Slot,
    /// Bytes still expected before the first-bytes deadline is lifted.
    first_bytes_left: usize,
    /// `None` once the first bytes arrived.
    first_bytes_deadline: Option<Pin<Box<Sleep>>>,
    first_request: Duration,
    idle: Duration,
    /// The idle deadline's timer and the instant it is armed for.
    idle_timer: Pin<Box<Sleep>>,
    idle_armed: Option<Instant>,
}

impl<S> BoundedStream<S> {
    fn new(inner: S, slot: Slot, limits: Limits) -> BoundedStream<S> {
        let first_bytes = Duration::from_millis(limits.first_bytes_timeout_ms);
        BoundedStream {
            inner,
            slot,
            first_bytes_left: FIRST_BYTES,
            first_bytes_deadline: Some(Box::pin(tokio::time::sleep(first_bytes))),
            first_request: Duration::from_millis(limits.first_request_timeout_ms),
            idle: Duration::from_millis(limits.idle_timeout_ms),
            idle_timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
            idle_armed: None,
        }
    }

    /// The connection's activity, for [`Track`].
    fn activity(&self) -> Arc<Activity> {
        self.slot.activity().clone()
    }

    /// `Err` when the connection must be closed now: evicted, or idle past its
    /// deadline. Otherwise arms the idle timer (the task is woken when it fires, when a
    /// request ends and when the connection is evicted).
    fn check_idle(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let activity = self.slot.activity();
        activity.waker.register(cx.waker());
        match activity.due(self.first_request, self.idle) {
            Due::Evicted => Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed to make room for a new connection: idle longest",
            )),
            Due::Busy => Ok(()),
            Due::At(at) => {
                let expired = || {
                    io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the connection was idle (no request in flight) past its deadline",
                    )
                };
                if Instant::now() >= at {
                    return Err(expired());
                }
                if self.idle_armed != Some(at) {
                    self.idle_timer.as_mut().reset(at.into());
                    self.idle_armed = Some(at);
                }
                match self.idle_timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Err(expired()),
                    Poll::Pending => Ok(()),
                }
            }
        }
    }
}

impl BoundedStream<TcpStream> {
    /// The peer's address.
    ///
    /// # Errors
    /// As [`TcpStream::peer_addr`].
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.inner.peer_addr()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for BoundedStream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Err(e) = this.check_idle(cx) {
            return Poll::Ready(Err(e));
        }
        let before = buf.filled().len();
        let result = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Some(deadline) = this.first_bytes_deadline.as_mut() {
            if let Poll::Ready(Ok(())) = &result {
                let got = buf.filled().len() - before;
                this.first_bytes_left = this.first_bytes_left.saturating_sub(got);
                if this.first_bytes_left == 0 {
                    this.first_bytes_deadline = None;
                    return result;
                }
            }
            if deadline.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the connection sent too little before its first-bytes deadline",
                )));
            }
        }
        result
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for BoundedStream<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// The HTTP/1 and HTTP/2 connection builder of every HTTP server here: hyper's
/// header-read deadline of [`HTTP_HEADER_READ_TIMEOUT_MS`] on HTTP/1; on HTTP/2 a
/// keepalive PING every [`HTTP2_KEEPALIVE_INTERVAL_MS`] answered within
/// [`HTTP2_KEEPALIVE_TIMEOUT_MS`], at most [`HTTP2_MAX_CONCURRENT_STREAMS`] streams and
/// [`HTTP2_MAX_HEADER_LIST_BYTES`] of headers.
fn http_builder() -> Builder<TokioExecutor> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_millis(HTTP_HEADER_READ_TIMEOUT_MS));
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Duration::from_millis(HTTP2_KEEPALIVE_INTERVAL_MS))
        .keep_alive_timeout(Duration::from_millis(HTTP2_KEEPALIVE_TIMEOUT_MS))
        .max_concurrent_streams(HTTP2_MAX_CONCURRENT_STREAMS)
        .max_header_list_size(HTTP2_MAX_HEADER_LIST_BYTES);
    builder
}

/// Serves `router` on `listener` (HTTP/1 and HTTP/2; TLS when the listener has it) until
/// `shutdown` is cancelled, then lets open requests finish. Connections are bounded as
/// [`BoundedStream`] says, HTTP/1 headers must arrive within
/// [`HTTP_HEADER_READ_TIMEOUT_MS`], HTTP/2 keepalive and limits as
/// [`HTTP2_KEEPALIVE_INTERVAL_MS`], [`HTTP2_MAX_CONCURRENT_STREAMS`] and
/// [`HTTP2_MAX_HEADER_LIST_BYTES`] say. Every request
/// carries the connection's [`ConnInfo`] as an `axum::Extension`.
///
/// # Errors
/// None today (accept errors are retried); the `Result` is for the callers' task sets.
pub async fn serve_http(
    mut listener: BoundedListener,
    router: axum::Router,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let builder = http_builder();
    let graceful = GracefulShutdown::new();
    let serving = listener.pool.serve();
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept_bounded() => accepted,
            () = shutdown.cancelled() => break,
        };
        let router = router.clone();
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let tls = listener.tls.clone();
        let name = listener.name;
        tokio::spawn(async move {
            let Some(stream) = handshake(name, tls.as_ref(), stream).await else {
                return;
            };
            let info = stream.conn_info();
            let activity = info.activity.clone().expect("a bounded stream's activity");
            serve_connection(&builder, watcher, router, info, activity, stream).await;
        });
    }
    drop(serving);
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Serves one accepted connection with `router`, every request carrying `extension`
/// (what the server knows of the connection) and counted in `activity`, until it closes
/// or the graceful shutdown that `watcher` belongs to ends it.
async fn serve_connection<E, I>(
    builder: &Builder<TokioExecutor>,
    watcher: hyper_util::server::graceful::Watcher,
    router: axum::Router,
    extension: E,
    activity: Arc<Activity>,
    io: I,
) where
    E: Clone + Send + Sync + 'static,
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = TowerToHyperService::new(Track::new(
        router.layer(axum::Extension(extension)),
        activity,
    ));
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    if let Err(e) = watcher.watch(conn).await {
        tracing::trace!(error = %e, "HTTP connection ended with an error");
    }
}

/// Who is on the other end of a Unix socket connection (`SO_PEERCRED`: the process
/// that connected, as of `connect`). In every request's extensions on a server of
/// [`serve_unix_http`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnixPeer {
    /// The peer's process id (`None` when the kernel gave none).
    pub pid: Option<i32>,
    /// Its user id.
    pub uid: u32,
    /// Its group id.
    pub gid: u32,
}

/// Serves `router` over HTTP/1 and HTTP/2 on a Unix socket until `shutdown`, with the
/// same bounds as [`serve_http`] (`limits`; the pending pool's share is per uid, from
/// `SO_PEERCRED`; refusals logged at most every [`WARN_INTERVAL_MS`]). Every request
/// carries the connection's [`UnixPeer`]; a connection whose peer cannot be read is
/// closed. In-flight connections are drained on shutdown.
///
/// # Errors
/// None today: failed accepts are retried after [`ACCEPT_RETRY_MS`].
pub async fn serve_unix_http(
    listener: tokio::net::UnixListener,
    name: &'static str,
    limits: Limits,
    router: axum::Router,
    shutdown: CancellationToken,
) -> io::Result<()> {
    serve_unix_http_counted(listener, name, Counter::unix(limits), router, shutdown).await
}

/// [`serve_unix_http`] with the connection pool of `counter` ([`Counter::unix`]), so the
/// caller can read its counts and what it turned away.
///
/// # Errors
/// None today: failed accepts are retried after [`ACCEPT_RETRY_MS`].
pub async fn serve_unix_http_counted(
    listener: tokio::net::UnixListener,
    name: &'static str,
    counter: Counter,
    router: axum::Router,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let pool = counter.0;
    let builder = http_builder();
    let graceful = GracefulShutdown::new();
    let mut warnings = Warnings::default();
    let serving = pool.serve();
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    pool.note_accept_error();
                    warnings.note(name, Some(&e), None);
                    tokio::time::sleep(Duration::from_millis(ACCEPT_RETRY_MS)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let peer = match stream.peer_cred() {
            Ok(cred) => UnixPeer {
                pid: cred.pid(),
                uid: cred.uid(),
                gid: cred.gid(),
            },
            Err(e) => {
                tracing::debug!(listener = name, error = %e, "cannot read the peer's credentials");
                continue;
            }
        };
        let slot = match pool.admit(Source::Uid(peer.uid), false) {
            Ok(slot) => slot,
            Err(why) => {
                drop(stream);
                warnings.note(name, None, Some(why));
                continue;
            }
        };
        let stream = BoundedStream::new(stream, slot, pool.limits());
        let activity = stream.activity();
        let router = router.clone();
        let builder = builder.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            serve_connection(&builder, watcher, router, peer, activity, stream).await;
        });
    }
    drop(serving);
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests;
