//! Fault injection in front of a real S3 server: [`FaultProxy`] is an HTTP server on a
//! loopback port that forwards every request (method, path and query, all headers including
//! `Host`, body) to the upstream `s3s-fs` and its response back, unless a [`Rule`] the test
//! installed matches the request first. A rule answers with a real S3 error document (503
//! `SlowDown`, 403 `AccessDenied`, …) instead of forwarding, or holds the request until the
//! test releases it (then forwards it). Every request is logged with the status returned.
//!
//! SigV4 signs the `Host` header: the client is pointed at the proxy, signs the proxy's
//! `host:port`, and the proxy forwards that header unchanged, so `s3s-fs` verifies the same
//! string the client signed.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::Response;
use tokio::sync::Notify;

/// Largest request body the proxy buffers (checkpoint parts in tests are ≤ 16 MiB).
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// One request the proxy saw, and the status it answered with.
#[derive(Clone, Debug)]
pub struct Seen {
    /// HTTP method.
    pub method: Method,
    /// Path and query, as sent by the client.
    pub path_and_query: String,
    /// The status returned to the client (injected or the upstream's).
    pub status: u16,
    /// True when a rule answered instead of the upstream.
    pub injected: bool,
}

/// What a matching rule does with a request.
#[derive(Clone)]
enum Action {
    /// Answer with this S3 error document; the upstream never sees the request.
    Error {
        status: u16,
        code: &'static str,
        message: &'static str,
    },
    /// Signal `arrived`, wait for `release`, then forward.
    Hold(Arc<Gate>),
}

/// The two sides of a [`Rule::hold`]: the proxy signals `arrived`, the test `release`s.
pub struct Gate {
    arrived: Notify,
    release: Notify,
}

impl Gate {
    /// Waits until a held request has arrived at the proxy (panics after `timeout`).
    pub async fn wait_arrived(&self, timeout: Duration) {
        tokio::time::timeout(timeout, self.arrived.notified())
            .await
            .expect("the held request did not reach the proxy in time");
    }

    /// Lets the held request go on to the upstream.
    pub fn release(&self) {
        self.release.notify_one();
    }
}

/// Which requests a rule applies to and what it does, `remaining` times (`None`: always).
#[derive(Clone)]
pub struct Rule {
    method: Method,
    path_contains: String,
    remaining: Option<usize>,
    action: Action,
}

impl Rule {
    /// Requests with `method` whose path-and-query contains `path_contains`, answered with
    /// 503 `SlowDown` (S3's throttling error).
    pub fn slow_down(method: Method, path_contains: &str) -> Self {
        Self::error(
            method,
            path_contains,
            503,
            "SlowDown",
            "Please reduce your request rate.",
        )
    }

    /// As [`Rule::slow_down`], answered with 403 `AccessDenied`.
    pub fn access_denied(method: Method, path_contains: &str) -> Self {
        Self::error(method, path_contains, 403, "AccessDenied", "Access Denied")
    }

    /// As [`Rule::slow_down`], answered with `status` and an error document of `code`.
    pub fn error(
        method: Method,
        path_contains: &str,
        status: u16,
        code: &'static str,
        message: &'static str,
    ) -> Self {
        Self {
            method,
            path_contains: path_contains.into(),
            remaining: None,
            action: Action::Error {
                status,
                code,
                message,
            },
        }
    }

    /// Holds the first matching request until [`Gate::release`], then forwards it.
    pub fn hold(method: Method, path_contains: &str) -> (Self, Arc<Gate>) {
        let gate = Arc::new(Gate {
            arrived: Notify::new(),
            release: Notify::new(),
        });
        let rule = Self {
            method,
            path_contains: path_contains.into(),
            remaining: Some(1),
            action: Action::Hold(gate.clone()),
        };
        (rule, gate)
    }

    /// Applies to the first `n` matching requests only.
    pub fn times(mut self, n: usize) -> Self {
        self.remaining = Some(n);
        self
    }
}

struct Shared {
    upstream: String,
    client: reqwest::Client,
    rules: Mutex<Vec<Rule>>,
    seen: Mutex<Vec<Seen>>,
}

/// The proxy; its server task ends when this is dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FaultProxy {
    /// Starts a proxy on `127.0.0.1:0` forwarding to `http://127.0.0.1:<upstream_port>`.
    pub async fn start(upstream_port: u16) -> Self {
        let shared = Arc::new(Shared {
            upstream: format!("http://127.0.0.1:{upstream_port}"),
            client: reqwest::Client::builder()
                .no_proxy()
                .build()
                .expect("reqwest client"),
            rules: Mutex::new(Vec::new()),
            seen: Mutex::new(Vec::new()),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(shared.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.expect("proxy serves");
        });
        Self { addr, shared, task }
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Adds a rule (rules are tried in the order added; the first live match applies).
    pub fn add(&self, rule: Rule) {
        self.shared.rules.lock().expect("rules").push(rule);
    }

    /// Removes every rule: pass-through from now on.
    pub fn clear(&self) {
        self.shared.rules.lock().expect("rules").clear();
    }

    /// Every request seen so far, in arrival order of their answers.
    pub fn seen(&self) -> Vec<Seen> {
        self.shared.seen.lock().expect("seen").clone()
    }

    /// How many requests seen so far satisfy `filter`.
    pub fn count(&self, filter: impl Fn(&Seen) -> bool) -> usize {
        self.seen().iter().filter(|s| filter(s)).count()
    }
}

/// Headers that describe one hop's connection, not the message; not forwarded.
fn is_hop_by_hop(name: &header::HeaderName) -> bool {
    [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::TE,
        header::TRAILER,
        header::UPGRADE,
        header::PROXY_AUTHORIZATION,
        header::PROXY_AUTHENTICATE,
    ]
    .contains(name)
        || name.as_str() == "keep-alive"
}

fn copy_headers(from: &HeaderMap) -> HeaderMap {
    let mut to = HeaderMap::new();
    for (name, value) in from {
        if !is_hop_by_hop(name) {
            to.append(name.clone(), value.clone());
        }
    }
    to
}

/// The live rule matching this request, if any (its count is taken).
fn take_rule(shared: &Shared, method: &Method, path_and_query: &str) -> Option<Action> {
    let mut rules = shared.rules.lock().expect("rules");
    let rule = rules.iter_mut().find(|r| {
        r.method == method && path_and_query.contains(&r.path_contains) && r.remaining != Some(0)
    })?;
    if let Some(n) = &mut rule.remaining {
        *n -= 1;
    }
    Some(rule.action.clone())
}

async fn handle(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let method = parts.method.clone();
    let path_and_query = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "/".into());
    // The whole body is read first, as a server does before it answers: the client never
    // sees its upload cut off by an early answer.
    let body = match axum::body::to_bytes(body, MAX_BODY_BYTES).await {
        Ok(body) => body,
        Err(e) => return plain(StatusCode::BAD_REQUEST, format!("proxy: body: {e}")),
    };
    let action = take_rule(&shared, &method, &path_and_query);
    let (response, injected) = match action {
        Some(Action::Error {
            status,
            code,
            message,
        }) => (
            error_document(&method, &path_and_query, status, code, message),
            true,
        ),
        Some(Action::Hold(gate)) => {
            gate.arrived.notify_one();
            gate.release.notified().await;
            (forward(&shared, &parts, &path_and_query, body).await, false)
        }
        None => (forward(&shared, &parts, &path_and_query, body).await, false),
    };
    shared.seen.lock().expect("seen").push(Seen {
        method,
        path_and_query,
        status: response.status().as_u16(),
        injected,
    });
    response
}

async fn forward(
    shared: &Shared,
    parts: &axum::http::request::Parts,
    path_and_query: &str,
    body: bytes::Bytes,
) -> Response {
    let url = format!("{}{path_and_query}", shared.upstream);
    // `Host` is among the copied headers and is kept as the client signed it.
    let upstream = shared
        .client
        .request(parts.method.clone(), url)
        .headers(copy_headers(&parts.headers))
        .body(body)
        .send()
        .await;
    let upstream = match upstream {
        Ok(response) => response,
        Err(e) => return plain(StatusCode::BAD_GATEWAY, format!("proxy: upstream: {e}")),
    };
    let status = upstream.status();
    let headers = copy_headers(upstream.headers());
    let bytes = match upstream.bytes().await {
        Ok(bytes) => bytes,
        Err(e) => {
            return plain(
                StatusCode::BAD_GATEWAY,
                format!("proxy: upstream body: {e}"),
            );
        }
    };
    let mut response = Response::new(Body::from(bytes));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

/// An S3 error response: XML document with `code` (no body for `HEAD`, as S3 does).
fn error_document(
    method: &Method,
    path_and_query: &str,
    status: u16,
    code: &str,
    message: &str,
) -> Response {
    let resource = path_and_query.split('?').next().unwrap_or("/");
    let body = if method == Method::HEAD {
        Body::empty()
    } else {
        Body::from(format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>\
             <Message>{message}</Message><Resource>{resource}</Resource>\
             <RequestId>cumulus-fault-proxy</RequestId></Error>"
        ))
    };
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::from_u16(status).expect("valid status");
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/xml"),
    );
    response
}

fn plain(status: StatusCode, text: String) -> Response {
    let mut response = Response::new(Body::from(text));
    *response.status_mut() = status;
    response
}
