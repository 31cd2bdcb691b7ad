//! Bounded TCP listeners for every Cumulus server (coordinator gRPC and HTTP, worker agent
//! HTTP, rank-local API).
//!
//! Without bounds, a flood of idle or half-sent connections from anything that can reach
//! a port held file descriptors and memory until the process could open nothing else: on
//! a worker agent every rank placed there failed ("cannot create log … Too many open
//! files") until the jobs had spent their restart budgets. Here each listener has
//! - a cap on its open connections ([`Limits::max_connections`]): past it a new
//!   connection is accepted and closed at once, so it costs a descriptor for
//!   microseconds, never holds one;
//! - a deadline for a connection's first bytes ([`Limits::first_bytes_timeout_ms`]): a
//!   connection that sends nothing (or less than the HTTP/2 preface) is closed;
//! - for HTTP/1, hyper's header-read deadline ([`HTTP_HEADER_READ_TIMEOUT_MS`]): a request
//!   whose headers trickle in (slowloris) or an idle keep-alive connection is closed;
//! - and the process keeps [`FD_RESERVE`] descriptors that no listener may use
//!   ([`fd_budget`]), so a flood can never stop an agent from opening a rank's log or a
//!   coordinator from opening and syncing its raft log.
//!
//! HTTP/2 connections (gRPC) are kept honest by the server's keepalive PINGs, set where
//! the tonic server is built.
//!
//! With [`BoundedListener::with_tls`] a listener speaks TLS only: each accepted
//! connection's handshake runs in its own task (a slow client never holds up the next
//! accept) within [`TLS_HANDSHAKE_TIMEOUT_MS`], and every request carries a [`ConnInfo`]
//! in its extensions with the verified client certificate, when one was presented, so a
//! service can tell which coordinator or worker is calling ([`ConnInfo::peer_identity`]).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use cumulus_tls::Identity;
use cumulus_tls::rustls::ServerConfig;
use cumulus_tls::rustls::pki_types::CertificateDer;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;

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

/// The bounds of one listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most connections open at once; more are closed at accept.
    pub max_connections: usize,
    /// A connection that has not sent [`FIRST_BYTES`] bytes by then is closed, in
    /// milliseconds.
    pub first_bytes_timeout_ms: u64,
}

impl Limits {
    /// `max_connections` open at once, the default first-bytes deadline.
    pub const fn connections(max_connections: usize) -> Limits {
        Limits {
            max_connections,
            first_bytes_timeout_ms: FIRST_BYTES_TIMEOUT_MS,
        }
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
    limits: Limits,
    slots: Arc<Semaphore>,
    /// Connections refused since the last warning.
    refused: Arc<AtomicU64>,
    last_warning: Option<Instant>,
    /// TLS for every connection (`None`: plaintext).
    tls: Option<tokio_rustls::TlsAcceptor>,
}

impl BoundedListener {
    /// Wraps `listener` (plaintext until [`BoundedListener::with_tls`]).
    pub fn new(listener: TcpListener, name: &'static str, limits: Limits) -> BoundedListener {
        BoundedListener {
            listener,
            name,
            limits,
            slots: Arc::new(Semaphore::new(limits.max_connections)),
            refused: Arc::default(),
            last_warning: None,
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
        self.limits.max_connections - self.slots.available_permits()
    }

    /// The next connection within the cap (`TCP_NODELAY` set). Connections past the cap
    /// are closed here; failed accepts are retried after [`ACCEPT_RETRY_MS`]; both are
    /// logged at most every [`WARN_INTERVAL_MS`].
    pub async fn accept_bounded(&mut self) -> (BoundedStream, SocketAddr) {
        loop {
            let (stream, peer) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    self.note_refused(Some(&e));
                    tokio::time::sleep(Duration::from_millis(ACCEPT_RETRY_MS)).await;
                    continue;
                }
            };
            let Ok(permit) = self.slots.clone().try_acquire_owned() else {
                drop(stream);
                self.note_refused(None);
                continue;
            };
            // Small replies must not wait for the peer's delayed ACK (Nagle).
            let _ = stream.set_nodelay(true);
            let stream = BoundedStream {
                inner: stream,
                _permit: permit,
                first_bytes_left: FIRST_BYTES,
                first_bytes_deadline: Some(Box::pin(tokio::time::sleep(Duration::from_millis(
                    self.limits.first_bytes_timeout_ms,
                )))),
            };
            return (stream, peer);
        }
    }

    fn note_refused(&mut self, error: Option<&io::Error>) {
        let refused = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        let due = self
            .last_warning
            .is_none_or(|t| t.elapsed() >= Duration::from_millis(WARN_INTERVAL_MS));
        if due {
            self.last_warning = Some(Instant::now());
            self.refused.store(0, Ordering::Relaxed);
            match error {
                Some(e) => tracing::warn!(
                    listener = self.name,
                    failed = refused,
                    error = %e,
                    "accept failed; retrying"
                ),
                None => tracing::warn!(
                    listener = self.name,
                    refused,
                    max_connections = self.limits.max_connections,
                    "connections refused: the listener is at its cap"
                ),
            }
        }
    }

    /// The accepted connections as a stream, for tonic's `serve_with_incoming*`. With
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

/// Completes a connection: the TLS handshake (within [`TLS_HANDSHAKE_TIMEOUT_MS`]) when
/// `tls` is set. `None` when the handshake fails or times out (logged at debug: a
/// scanner or a client of another cluster is not the server's error).
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
        Ok(Ok(tls)) => Some(ServedStream::Tls(Box::new(tls))),
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
    /// Who the verified client certificate names, parsed once per connection (not per
    /// request: a worker's heartbeats arrive every second on the same connection).
    pub identity: Option<Identity>,
}

impl ConnInfo {
    /// Who the client's verified certificate names (`None`: plaintext, no certificate,
    /// or a certificate naming no identity).
    pub fn peer_identity(&self) -> Option<Identity> {
        self.identity.clone()
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
    /// The connection's [`ConnInfo`].
    pub fn conn_info(&self) -> ConnInfo {
        match self {
            ServedStream::Plain(s) => ConnInfo {
                remote_addr: s.peer_addr().ok(),
                peer_certs: None,
                tls: false,
                identity: None,
            },
            ServedStream::Tls(t) => {
                let (s, session) = t.get_ref();
                let certs = session.peer_certificates();
                ConnInfo {
                    remote_addr: s.peer_addr().ok(),
                    peer_certs: certs.map(|c| Arc::new(c.to_vec())),
                    tls: true,
                    identity: certs
                        .and_then(|c| c.first())
                        .and_then(|c| cumulus_tls::identity_of(c).ok()),
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

/// A connection accepted by a [`BoundedListener`]: holds one of its slots until dropped,
/// and fails its reads once the first-bytes deadline passes before [`FIRST_BYTES`] bytes
/// arrived.
pub struct BoundedStream {
    inner: TcpStream,
    _permit: OwnedSemaphorePermit,
    /// Bytes still expected before the deadline is lifted.
    first_bytes_left: usize,
    /// `None` once the first bytes arrived.
    first_bytes_deadline: Option<Pin<Box<Sleep>>>,
}

impl BoundedStream {
    /// The peer's address.
    ///
    /// # Errors
    /// As [`TcpStream::peer_addr`].
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.inner.peer_addr()
    }
}

impl AsyncRead for BoundedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
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

impl AsyncWrite for BoundedStream {
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

/// The HTTP/1 and HTTP/2 connection builder of every server here: hyper's header-read
/// deadline of [`HTTP_HEADER_READ_TIMEOUT_MS`] on HTTP/1.
fn http_builder() -> Builder<TokioExecutor> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_millis(HTTP_HEADER_READ_TIMEOUT_MS));
    builder
}

/// Serves `router` on `listener` (HTTP/1 and HTTP/2; TLS when the listener has it) until
/// `shutdown` is cancelled, then lets open requests finish. HTTP/1 headers must arrive
/// within [`HTTP_HEADER_READ_TIMEOUT_MS`]. Every request carries the connection's
/// [`ConnInfo`] as an `axum::Extension`.
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
            serve_connection(&builder, watcher, router, info, stream).await;
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Serves one accepted connection with `router`, every request carrying `extension`
/// (what the server knows of the connection), until it closes or the graceful
/// shutdown that `watcher` belongs to ends it.
async fn serve_connection<E, I>(
    builder: &Builder<TokioExecutor>,
    watcher: hyper_util::server::graceful::Watcher,
    router: axum::Router,
    extension: E,
    io: I,
) where
    E: Clone + Send + Sync + 'static,
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = TowerToHyperService::new(router.layer(axum::Extension(extension)));
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

/// Serves `router` over HTTP/1 and HTTP/2 on a Unix socket until `shutdown`, with at
/// most `max_connections` open at once (more are closed at accept and logged at most
/// every [`WARN_INTERVAL_MS`]) and hyper's header-read deadline
/// ([`HTTP_HEADER_READ_TIMEOUT_MS`]). Every request carries the connection's
/// [`UnixPeer`]; a connection whose peer cannot be read is closed. In-flight connections
/// are drained on shutdown.
///
/// # Errors
/// None today: failed accepts are retried after [`ACCEPT_RETRY_MS`].
pub async fn serve_unix_http(
    listener: tokio::net::UnixListener,
    name: &'static str,
    max_connections: usize,
    router: axum::Router,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let builder = http_builder();
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(max_connections));
    let mut last_warning: Option<Instant> = None;
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(listener = name, error = %e, "accept failed; retrying");
                    tokio::time::sleep(Duration::from_millis(ACCEPT_RETRY_MS)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            drop(stream);
            if last_warning.is_none_or(|t| t.elapsed() >= Duration::from_millis(WARN_INTERVAL_MS)) {
                last_warning = Some(Instant::now());
                tracing::warn!(
                    listener = name,
                    max_connections,
                    "connections refused: the listener is at its cap"
                );
            }
            continue;
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
        let router = router.clone();
        let builder = builder.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let _permit = permit;
            serve_connection(&builder, watcher, router, peer, stream).await;
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Polls `f` to completion or until `timeout`.
    async fn within<F: Future>(timeout: Duration, f: F) -> Option<F::Output> {
        tokio::time::timeout(timeout, f).await.ok()
    }

    #[test]
    fn caps_are_scaled_to_the_budget() {
        assert_eq!(fit_caps(&[1024, 1024], 1_000_000), vec![1024, 1024]);
        assert_eq!(fit_caps(&[1024, 1024], 1024), vec![512, 512]);
        assert_eq!(fit_caps(&[100, 300], 40), vec![16, 30]);
        assert_eq!(fit_caps(&[], 10), Vec::<usize>::new());
    }

    #[test]
    fn the_fd_budget_leaves_the_reserve() {
        let budget = fd_budget(open_fds()).expect("getrlimit");
        let (soft, _) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
            .expect("getrlimit");
        assert!(
            budget + FD_RESERVE <= soft,
            "{budget} + {FD_RESERVE} > {soft}"
        );
    }

    async fn http_server(limits: Limits) -> (SocketAddr, CancellationToken) {
        let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let listener = BoundedListener::new(tcp, "test", limits);
        let addr = listener.local_addr().expect("addr");
        let router = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let stop = CancellationToken::new();
        tokio::spawn(serve_http(listener, router, stop.clone()));
        (addr, stop)
    }

    /// Reads until EOF or an error; true when the server closed the connection.
    async fn closed_by_server(conn: &mut TcpStream) -> bool {
        let mut buf = [0u8; 256];
        loop {
            match conn.read(&mut buf).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => {}
            }
        }
    }

    #[tokio::test]
    async fn connections_past_the_cap_are_closed_at_accept_and_slots_come_back() {
        let (addr, stop) = http_server(Limits::connections(4)).await;
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(TcpStream::connect(addr).await.expect("connect"));
        }
        // The fifth is accepted and closed at once (it waits on nothing).
        let mut fifth = TcpStream::connect(addr).await.expect("connect");
        let closed = within(Duration::from_secs(5), closed_by_server(&mut fifth)).await;
        assert_eq!(closed, Some(true), "a connection past the cap is closed");
        // Freed slots take new connections, which are served.
        held.clear();
        let body = within(Duration::from_secs(30), async {
            loop {
                match reqwest::get(format!("http://{addr}/")).await {
                    Ok(r) => return r.text().await.expect("body"),
                    Err(_) => tokio::task::yield_now().await,
                }
            }
        })
        .await;
        assert_eq!(body.as_deref(), Some("ok"));
        stop.cancel();
    }

    #[tokio::test]
    async fn tls_listeners_serve_only_tls_and_name_the_client_certificate() {
        use cumulus_tls::generate::ClusterCa;
        cumulus_tls::install_default_provider();
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = ClusterCa::generate("listen test").expect("ca");
        ca.write(dir.path()).expect("write ca");
        let ca_file = dir.path().join(cumulus_tls::generate::CA_FILE);
        let issue = |identity: Identity, name: &str| {
            let files = ca
                .issue(&identity, &[])
                .expect("issue")
                .write(dir.path(), name)
                .expect("write");
            cumulus_tls::Credentials::load(&files.cert, &files.key, &ca_file).expect("load")
        };
        let server = issue(Identity::Coordinator(1), "server");
        let worker = issue(Identity::Worker("w-9".into()), "worker");

        let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let listener = BoundedListener::new(tcp, "test", Limits::connections(8))
            .with_tls(Some(server.server_config().expect("config")));
        let addr = listener.local_addr().expect("addr");
        let router = axum::Router::new().route(
            "/",
            axum::routing::get(
                |axum::Extension(info): axum::Extension<ConnInfo>| async move {
                    format!("tls={} peer={:?}", info.tls, info.peer_identity())
                },
            ),
        );
        let stop = CancellationToken::new();
        tokio::spawn(serve_http(listener, router, stop.clone()));
        let url = format!("https://127.0.0.1:{}/", addr.port());
        let ca_cert = reqwest::Certificate::from_pem(server.trust().ca_pem()).expect("ca");

        let user = reqwest::Client::builder()
            .tls_certs_only([ca_cert.clone()])
            .build()
            .expect("client");
        let body = |client: reqwest::Client| {
            let url = url.clone();
            async move {
                let resp = client.get(&url).send().await.expect("get");
                resp.text().await.expect("body")
            }
        };
        assert_eq!(body(user).await, "tls=true peer=None");

        let mut pem = worker.cert_pem().to_vec();
        pem.extend_from_slice(worker.key_pem());
        let member = reqwest::Client::builder()
            .tls_certs_only([ca_cert])
            .identity(reqwest::Identity::from_pem(&pem).expect("identity"))
            .build()
            .expect("client");
        assert_eq!(body(member).await, "tls=true peer=Some(Worker(\"w-9\"))");

        // Plaintext to a TLS listener, and TLS without the cluster CA, get nothing.
        let plain = format!("http://127.0.0.1:{}/", addr.port());
        assert!(reqwest::get(&plain).await.is_err());
        let stranger = reqwest::Client::builder()
            .tls_certs_only([])
            .build()
            .expect("client");
        assert!(stranger.get(&url).send().await.is_err());
        stop.cancel();
    }

    #[tokio::test]
    async fn a_silent_connection_is_closed_after_its_first_bytes_deadline() {
        let limits = Limits {
            max_connections: 8,
            first_bytes_timeout_ms: 200,
        };
        let (addr, stop) = http_server(limits).await;
        let mut silent = TcpStream::connect(addr).await.expect("connect");
        let started = Instant::now();
        let closed = within(Duration::from_secs(30), closed_by_server(&mut silent)).await;
        assert_eq!(closed, Some(true));
        assert!(started.elapsed() >= Duration::from_millis(200));
        stop.cancel();
    }

    #[tokio::test]
    async fn trickled_headers_are_cut_by_the_header_deadline() {
        let (addr, stop) = http_server(Limits::connections(8)).await;
        let mut slow = TcpStream::connect(addr).await.expect("connect");
        // Enough bytes to pass the first-bytes deadline, but never the end of the headers.
        slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: 1")
            .await
            .expect("write");
        let started = Instant::now();
        let closed = within(
            Duration::from_millis(HTTP_HEADER_READ_TIMEOUT_MS * 3),
            closed_by_server(&mut slow),
        )
        .await;
        assert_eq!(closed, Some(true), "half-sent headers are cut");
        assert!(started.elapsed() >= Duration::from_millis(HTTP_HEADER_READ_TIMEOUT_MS / 2));
        stop.cancel();
    }
}
