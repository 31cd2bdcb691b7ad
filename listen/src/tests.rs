//! The listeners' tests, over real sockets: caps fitted to the descriptor budget,
//! displacement at the cap, TLS, the deadlines (first bytes, headers, first request,
//! idle), refusals and the pending pool per source, the Unix socket.

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
async fn a_connection_past_the_cap_displaces_the_idle_longest_and_is_served() {
    let (addr, stop) = http_server(Limits::connections(4)).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        // Accepted in connect order (the backlog is FIFO), so the first is the idle
        // longest: by its accept instant, and by its id on a tie.
        held.push(TcpStream::connect(addr).await.expect("connect"));
    }
    // A fifth is served; the first held one was closed to make room.
    let body = within(Duration::from_secs(30), async {
        reqwest::get(format!("http://{addr}/"))
            .await
            .expect("get")
            .text()
            .await
            .expect("body")
    })
    .await;
    assert_eq!(body.as_deref(), Some("ok"));
    let closed = within(Duration::from_secs(5), closed_by_server(&mut held[0])).await;
    assert_eq!(closed, Some(true), "the idle longest was displaced");
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
async fn connections_turned_away_by_busy_requests_are_counted() {
    // A source's share of the pending pool held by requests whose bodies never end:
    // busy, so never evicted; the next connection of that source is turned away.
    let limits = Limits {
        max_pending_per_source: 2,
        ..Limits::connections(16)
    };
    let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let listener = BoundedListener::new(tcp, "test", limits);
    let addr = listener.local_addr().expect("addr");
    let counter = listener.counter();
    assert!(!counter.serving());
    let router = axum::Router::new().route(
        "/",
        axum::routing::post(|body: bytes::Bytes| async move { body.len().to_string() }),
    );
    let stop = CancellationToken::new();
    let server = tokio::spawn(serve_http(listener, router, stop.clone()));
    until("the listener serves", || counter.serving()).await;
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut c = TcpStream::connect(addr).await.expect("connect");
        c.write_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            .await
            .expect("write");
        held.push(c);
    }
    until("both requests in flight", || counter.counts().pending == 2).await;
    let before = counter.turned_away();
    let mut turned = TcpStream::connect(addr).await.expect("connect");
    turned
        .write_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        .await
        .ok();
    let mut reply = Vec::new();
    let _ = within(Duration::from_secs(30), turned.read_to_end(&mut reply)).await;
    assert!(
        reply.is_empty(),
        "no answer: {}",
        String::from_utf8_lossy(&reply)
    );
    let turned_away = counter.turned_away().since(before);
    assert_eq!((turned_away.refused, turned_away.accept_errors), (1, 0));
    // The held requests were never evicted; once they end, a request is served.
    drop(held);
    until("the held slots back", || counter.counts().open == 0).await;
    let mut c = TcpStream::connect(addr).await.expect("connect");
    c.write_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        .await
        .expect("write");
    let mut reply = Vec::new();
    let _ = within(Duration::from_secs(30), c.read_to_end(&mut reply)).await;
    assert!(
        reply.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&reply)
    );
    stop.cancel();
    server.await.expect("join").expect("serve");
    assert!(!counter.serving(), "a stopped listener does not serve");
}

#[tokio::test]
async fn a_silent_connection_is_closed_after_its_first_bytes_deadline() {
    let limits = Limits {
        first_bytes_timeout_ms: 200,
        ..Limits::connections(8)
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

/// The HTTP/2 client preface and an empty SETTINGS frame: all a flood connection
/// sends.
const H2C_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

/// Small deadlines for tests, in milliseconds.
fn quick(first_request_ms: u64, idle_ms: u64) -> Limits {
    Limits {
        first_request_timeout_ms: first_request_ms,
        idle_timeout_ms: idle_ms,
        ..Limits::connections(64)
    }
}

/// A router with `/` ("ok"), `/deny` (401) and `/stream` (15 chunks, 100 ms apart).
fn router() -> axum::Router {
    use axum::routing::get;
    axum::Router::new()
        .route("/", get(|| async { "ok" }))
        .route(
            "/deny",
            get(|| async { (axum::http::StatusCode::UNAUTHORIZED, "no") }),
        )
        .route(
            "/stream",
            get(|| async {
                let chunks = futures::stream::unfold(0u32, |i| async move {
                    if i == 15 {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Some((Ok::<_, io::Error>(format!("data: {i}\n\n")), i + 1))
                });
                axum::body::Body::from_stream(chunks)
            }),
        )
}

async fn served(limits: Limits) -> (SocketAddr, Counter, CancellationToken) {
    let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let listener = BoundedListener::new(tcp, "test", limits);
    let addr = listener.local_addr().expect("addr");
    let counter = listener.counter();
    let stop = CancellationToken::new();
    tokio::spawn(serve_http(listener, router(), stop.clone()));
    (addr, counter, stop)
}

/// Waits until `f` holds, polling every 10 ms, for at most 30 s.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "not within 30 s: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

type H2Sender = hyper::client::conn::http2::SendRequest<http_body_util::Empty<bytes::Bytes>>;

/// An HTTP/2 (h2c) client connection that sends a keepalive PING every 50 ms even
/// while idle; the task ends when the connection does.
async fn h2_client<I>(io: I) -> (H2Sender, tokio::task::JoinHandle<()>)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .keep_alive_interval(Duration::from_millis(50))
        .keep_alive_while_idle(true)
        .handshake(TokioIo::new(io))
        .await
        .expect("h2 handshake");
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    (sender, task)
}

async fn h2_get(sender: &mut H2Sender, path: &str) -> (u16, String) {
    use http_body_util::BodyExt;
    let req = http::Request::get(format!("http://test{path}"))
        .body(http_body_util::Empty::new())
        .expect("request");
    let resp = sender.send_request(req).await.expect("response");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn preface_only_h2c_connections_are_closed_by_the_first_request_deadline() {
    let (addr, counter, stop) = served(quick(300, 60_000)).await;
    let started = Instant::now();
    let mut conns = Vec::new();
    for _ in 0..20 {
        let mut c = TcpStream::connect(addr).await.expect("connect");
        c.write_all(H2C_PREFACE).await.expect("preface");
        conns.push(c);
    }
    for c in &mut conns {
        let closed = within(Duration::from_secs(30), closed_by_server(c)).await;
        assert_eq!(closed, Some(true), "a preface-only connection is closed");
    }
    assert!(started.elapsed() >= Duration::from_millis(300));
    until("every slot back", || counter.counts().open == 0).await;
    stop.cancel();
}

#[tokio::test]
async fn an_idle_http2_connection_that_answers_pings_is_closed_by_the_idle_timeout() {
    let (addr, counter, stop) = served(quick(10_000, 400)).await;
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = h2_client(tcp).await;
    assert_eq!(h2_get(&mut sender, "/").await, (200, "ok".into()));
    let answered = Instant::now();
    assert_eq!(counter.counts().pending, 0, "a useful request graduates");
    // The client PINGs every 50 ms and answers the server's PINGs; none of it is a
    // request, so the connection is closed once idle for 400 ms.
    within(Duration::from_secs(30), conn)
        .await
        .expect("the server closes the idle connection")
        .expect("connection task");
    assert!(answered.elapsed() >= Duration::from_millis(400));
    until("the slot back", || counter.counts().open == 0).await;
    stop.cancel();
}

#[tokio::test]
async fn a_long_response_is_in_flight_and_never_cut() {
    // Deadlines of 200 ms against a response that streams for 1.5 s.
    let (addr, _counter, stop) = served(quick(200, 200)).await;
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, _conn) = h2_client(tcp).await;
    let (status, body) = h2_get(&mut sender, "/stream").await;
    assert_eq!(status, 200);
    assert_eq!(body.matches("data: ").count(), 15, "HTTP/2: {body}");
    let body = reqwest::get(format!("http://{addr}/stream"))
        .await
        .expect("get")
        .text()
        .await
        .expect("HTTP/1 body");
    assert_eq!(body.matches("data: ").count(), 15, "HTTP/1: {body}");
    stop.cancel();
}

#[tokio::test]
async fn refused_requests_do_not_graduate_a_connection() {
    let (addr, counter, stop) = served(quick(10_000, 10_000)).await;
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, _conn) = h2_client(tcp).await;
    assert_eq!(h2_get(&mut sender, "/deny").await.0, 401);
    assert_eq!(h2_get(&mut sender, "/deny").await.0, 401);
    assert_eq!(
        counter.counts().pending,
        1,
        "answered only 401s: still pending"
    );
    assert_eq!(h2_get(&mut sender, "/").await.0, 200);
    assert_eq!(counter.counts().pending, 0);
    stop.cancel();
}

/// Keeps opening connections to `connect()` that send `hello` and then nothing (at
/// most `hold` open, those the server closed dropped) until `stop`; returns how
/// many it opened.
async fn flood<S, F, Fut>(
    connect: F,
    hello: &'static [u8],
    hold: usize,
    stop: CancellationToken,
) -> usize
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: Fn() -> Fut,
    Fut: Future<Output = io::Result<S>>,
{
    let mut open: Vec<S> = Vec::new();
    let mut opened = 0;
    while !stop.is_cancelled() {
        let mut kept = Vec::new();
        for mut c in open.drain(..) {
            let mut buf = [0u8; 64];
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            let mut rb = ReadBuf::new(&mut buf);
            match Pin::new(&mut c).poll_read(&mut cx, &mut rb) {
                Poll::Ready(Ok(())) if rb.filled().is_empty() => {} // EOF
                Poll::Ready(Err(_)) => {}
                _ => kept.push(c),
            }
        }
        open = kept;
        while open.len() < hold {
            let Ok(mut c) = connect().await else { break };
            opened += 1;
            let _ = c.write_all(hello).await;
            open.push(c);
        }
        tokio::task::yield_now().await;
    }
    opened
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_pending_connections_from_one_source_cannot_keep_a_client_out() {
    let limits = Limits {
        max_connections: 64,
        max_pending_connections: 32,
        max_pending_per_source: 16,
        // Never expires during the test: only the pool keeps the flood in bounds.
        first_request_timeout_ms: 600_000,
        ..Limits::connections(64)
    };
    let (addr, counter, stop) = served(limits).await;
    let flooding = CancellationToken::new();
    let flooder = tokio::spawn(flood(
        move || TcpStream::connect(addr),
        H2C_PREFACE,
        300,
        flooding.clone(),
    ));
    until("the flood fills its share", || {
        counter.counts().pending >= 16
    })
    .await;
    // From another address (127.0.0.2 is loopback too), every request gets through at
    // once: the flood holds only its own source's share of the pending pool.
    let get = |from: &str| {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .local_address(from.parse::<std::net::IpAddr>().expect("ip"))
            .build()
            .expect("client");
        let url = format!("http://{addr}/");
        async move { client.get(url).send().await?.text().await }
    };
    for i in 0..5 {
        let body = get("127.0.0.2").await;
        assert_eq!(
            body.ok().as_deref(),
            Some("ok"),
            "request {i} during the flood"
        );
        let counts = counter.counts();
        assert!(counts.pending <= 32, "{counts:?}");
        assert!(counts.open <= 64, "{counts:?}");
    }
    // From the flood's own address, a new connection displaces the flood's stalest
    // and is itself displaced only if 16 more flood connections arrive before its
    // request does: against this loop, which reconnects as fast as the CPU allows,
    // a few attempts.
    for i in 0..5 {
        let mut failed = 0;
        while get("127.0.0.1").await.ok().as_deref() != Some("ok") {
            failed += 1;
            assert!(
                failed < 50,
                "request {i} from the flood's address: 50 attempts failed"
            );
        }
    }
    flooding.cancel();
    let opened = flooder.await.expect("flood");
    assert!(opened >= 300, "the flood opened {opened} connections");
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unix_socket_bounds_idle_connections_and_a_uid_gets_only_its_share() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("api.sock");
    let listener = tokio::net::UnixListener::bind(&path).expect("bind");
    let limits = Limits {
        max_connections: 64,
        max_pending_connections: 32,
        max_pending_per_source: 8,
        first_request_timeout_ms: 300,
        ..Limits::connections(64)
    };
    let pool = Counter::unix(limits);
    let stop = CancellationToken::new();
    tokio::spawn(serve_unix_http_counted(
        listener,
        "test socket",
        pool.clone(),
        router(),
        stop.clone(),
    ));
    // Zero bytes, and the preface alone, are closed by the deadlines.
    let mut silent = tokio::net::UnixStream::connect(&path)
        .await
        .expect("connect");
    let mut preface = tokio::net::UnixStream::connect(&path)
        .await
        .expect("connect");
    preface.write_all(H2C_PREFACE).await.expect("preface");
    for c in [&mut silent, &mut preface] {
        let mut buf = [0u8; 256];
        let closed = within(Duration::from_secs(30), async {
            loop {
                match c.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(closed.is_some(), "an idle Unix connection is closed");
    }
    // A flood from this uid holds at most its share; a request still gets through.
    let flooding = CancellationToken::new();
    let flood_path = path.clone();
    let flooder = tokio::spawn(flood(
        move || tokio::net::UnixStream::connect(flood_path.clone()),
        H2C_PREFACE,
        200,
        flooding.clone(),
    ));
    until("the flood fills its share", || pool.counts().pending >= 8).await;
    // The same uid as the flood (other uids have shares of their own; the pool's
    // tests show it): a request gets through within a few attempts.
    for i in 0..5 {
        let mut failed = 0;
        loop {
            let io = tokio::net::UnixStream::connect(&path)
                .await
                .expect("connect");
            let mut sender = match tokio::time::timeout(
                Duration::from_secs(30),
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io)),
            )
            .await
            {
                Ok(Ok((sender, conn))) => {
                    tokio::spawn(conn);
                    sender
                }
                _ => {
                    failed += 1;
                    continue;
                }
            };
            let req = http::Request::get("http://test/")
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .expect("request");
            if let Ok(Ok(resp)) =
                tokio::time::timeout(Duration::from_secs(30), sender.send_request(req)).await
                && resp.status() == 200
            {
                break;
            }
            failed += 1;
            assert!(failed < 50, "request {i}: 50 attempts failed");
        }
        assert!(pool.counts().pending <= 8, "{:?}", pool.counts());
    }
    flooding.cancel();
    flooder.await.expect("flood");
    stop.cancel();
}
