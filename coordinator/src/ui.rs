//! The web dashboard at `/ui`, served by every coordinator, and the forwarding of its
//! requests from a follower to the leader.
//!
//! The dashboard is plain HTML, CSS and JavaScript modules under `coordinator/ui/`,
//! embedded in the binary ([`ASSETS`]): no build step, nothing fetched from elsewhere.
//! The page itself needs no token; it reads the REST API and the SSE log stream with the
//! token the user pastes, kept in the tab's `sessionStorage` and sent as the
//! `Authorization` header (never a cookie, so no other site can act for the user). Every
//! asset is sent with a Content-Security-Policy that allows scripts, styles and
//! connections to this origin only (no inline script), forbids framing, and with
//! `nosniff`.
//!
//! A request carrying [`FORWARD_HEADER`]` : leader` that reaches a follower (after its
//! token was checked here) is sent on to the leader, with the same method, path and
//! `Authorization` header, and the leader's answer relayed ([`forward_to_leader`]): a
//! follower's page shows the leader's live figures (progress, heartbeats are the
//! leader's soft state) and its writes reach the leader. Only reads of jobs and the
//! cluster and the body-less writes `cancel`, `pause` and `resume` are forwarded; when
//! no leader is known or it does not answer, the follower answers itself (a read from
//! its replica; a write `503` naming the leader, as without the header).

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use openraft::async_runtime::watch::WatchReceiver;

use crate::node::Node;

/// The request header that asks a follower to forward the request to the leader; its one
/// value is `leader`.
pub const FORWARD_HEADER: &str = "x-cumulus-forward";

/// Largest answer relayed from the leader, in bytes (10,000 job summaries fit).
pub const MAX_FORWARDED_BYTES: usize = 32 * 1024 * 1024;

/// The Content-Security-Policy of the dashboard's assets: everything from this origin
/// only, no inline script or style, no framing, no form posts, no plugins.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// The dashboard's files: (name under `/ui/`, content type, content).
pub const ASSETS: &[(&str, &str, &str)] = &[
    (
        "index.html",
        "text/html; charset=utf-8",
        include_str!("../ui/index.html"),
    ),
    (
        "style.css",
        "text/css; charset=utf-8",
        include_str!("../ui/style.css"),
    ),
    ("app.js", JS, include_str!("../ui/app.js")),
    ("api.js", JS, include_str!("../ui/api.js")),
    ("dom.js", JS, include_str!("../ui/dom.js")),
    ("chart.js", JS, include_str!("../ui/chart.js")),
    ("jobs.js", JS, include_str!("../ui/jobs.js")),
    ("cluster.js", JS, include_str!("../ui/cluster.js")),
    ("job.js", JS, include_str!("../ui/job.js")),
    ("logs.js", JS, include_str!("../ui/logs.js")),
];

const JS: &str = "text/javascript; charset=utf-8";

/// The dashboard's routes: `/ui` and `/ui/` (the page), `/ui/{file}` (its assets). No
/// token: they hold no data.
pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route("/ui", get(index))
        .route("/ui/", get(index))
        .route("/ui/{file}", get(asset))
}

async fn index() -> Response {
    asset(Path("index.html".to_string())).await
}

async fn asset(Path(file): Path<String>) -> Response {
    let Some((_, content_type, body)) = ASSETS.iter().find(|(name, _, _)| *name == file) else {
        return with_security_headers((StatusCode::NOT_FOUND, "no such file").into_response());
    };
    let mut resp = (StatusCode::OK, *body).into_response();
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    // The assets change with the binary: a browser revalidates rather than mixing
    // versions across an upgrade.
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    with_security_headers(resp)
}

/// `resp` with the dashboard's security headers.
fn with_security_headers(mut resp: Response) -> Response {
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    resp
}

/// Whether a request of `method` on `path` may be forwarded: reads of jobs (not their
/// log streams) and of the cluster, and cancel, pause and resume.
pub fn forwardable(method: &Method, path: &str) -> bool {
    let read = *method == Method::GET
        && (path == "/v1/cluster"
            || path == "/v1/whoami"
            || (path.starts_with("/v1/jobs") && !path.ends_with("/logs")));
    let action = *method == Method::POST
        && path.starts_with("/v1/jobs/")
        && ["/cancel", "/pause", "/resume"]
            .iter()
            .any(|verb| path.ends_with(verb));
    read || action
}

/// Middleware of the authenticated routes: a [`forwardable`] request with
/// [`FORWARD_HEADER`]` : leader` that reaches a follower knowing the leader is sent to
/// the leader and its answer relayed; anything else, or a leader that does not answer,
/// is served here.
pub async fn forward_to_leader(
    State(node): State<Arc<Node>>,
    req: Request,
    next: Next,
) -> Response {
    let asked = req
        .headers()
        .get(FORWARD_HEADER)
        .is_some_and(|v| v.as_bytes() == b"leader");
    if !asked || node.is_leader() || !forwardable(req.method(), req.uri().path()) {
        return next.run(req).await;
    }
    let leader = {
        let m = node.raft.metrics();
        let m = m.borrow_watched();
        m.current_leader.and_then(|id| {
            m.membership_config
                .membership()
                .get_node(&id)
                .map(|n| (id, n.http_addr.clone()))
        })
    };
    let Some((leader_id, http_addr)) = leader else {
        return next.run(req).await;
    };
    let path = req
        .uri()
        .path_and_query()
        .map_or_else(|| "/".to_string(), |p| p.as_str().to_string());
    let auth = req.headers().get(header::AUTHORIZATION).cloned();
    let method = req.method().clone();
    match relay(&node, leader_id, &http_addr, (method, &path, auth)).await {
        Ok(resp) => resp,
        Err(e) => {
            tracing::debug!(leader_id, error = %e, "forwarding a dashboard request failed; answering here");
            next.run(req).await
        }
    }
}

/// Sends a request without body (`method`, `path` with its query, `auth`: the caller's
/// `Authorization`) to the leader's HTTP API and returns its answer: status, content
/// type, leader header and body.
async fn relay(
    node: &Node,
    leader_id: u64,
    http_addr: &str,
    (method, path, auth): (Method, &str, Option<HeaderValue>),
) -> Result<Response, String> {
    let scheme = if node.tls { "https" } else { "http" };
    let url = format!("{scheme}://{http_addr}{path}");
    let client = node.http.coordinator(leader_id)?;
    let mut out = client.request(method, &url);
    if let Some(auth) = auth {
        out = out.header(header::AUTHORIZATION, auth);
    }
    let mut answer = out.send().await.map_err(|e| e.to_string())?;
    if answer
        .content_length()
        .is_some_and(|n| n > MAX_FORWARDED_BYTES as u64)
    {
        return Err(format!(
            "the leader's answer is above {MAX_FORWARDED_BYTES} bytes"
        ));
    }
    let status = answer.status();
    let mut relayed = Response::builder().status(status.as_u16());
    for name in [
        header::CONTENT_TYPE.as_str(),
        cumulus_api::leader::LEADER_HTTP_HEADER,
    ] {
        if let Some(v) = answer.headers().get(name) {
            relayed = relayed.header(name, v.clone());
        }
    }
    let mut body = Vec::new();
    while let Some(chunk) = answer.chunk().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > MAX_FORWARDED_BYTES {
            return Err(format!(
                "the leader's answer is above {MAX_FORWARDED_BYTES} bytes"
            ));
        }
        body.extend_from_slice(&chunk);
    }
    relayed
        .header("x-cumulus-answered-by", leader_id.to_string())
        .body(Body::from(body))
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_reads_and_body_less_actions_are_forwarded() {
        assert!(forwardable(&Method::GET, "/v1/jobs/summaries"));
        assert!(forwardable(&Method::GET, "/v1/jobs/j-1"));
        assert!(forwardable(&Method::GET, "/v1/cluster"));
        assert!(forwardable(&Method::POST, "/v1/jobs/j-1/cancel"));
        assert!(forwardable(&Method::POST, "/v1/jobs/j-1/resume"));
        // A stream, a submit (a body), users, blobs: served where they arrive.
        assert!(!forwardable(&Method::GET, "/v1/jobs/j-1/logs"));
        assert!(!forwardable(&Method::POST, "/v1/jobs"));
        assert!(!forwardable(&Method::POST, "/v1/jobs/purge"));
        assert!(!forwardable(&Method::DELETE, "/v1/jobs/j-1"));
        assert!(!forwardable(&Method::POST, "/v1/users"));
        assert!(!forwardable(&Method::GET, "/v1/blobs/abc"));
    }

    #[test]
    fn every_asset_the_page_imports_is_served() {
        let served: Vec<&str> = ASSETS.iter().map(|(n, _, _)| *n).collect();
        for (_, _, body) in ASSETS {
            for part in body
                .split("\"./")
                .skip(1)
                .chain(body.split("\"/ui/").skip(1))
            {
                let name = part.split('"').next().unwrap_or_default();
                assert!(served.contains(&name), "{name} is imported but not served");
            }
        }
    }

    #[test]
    fn no_asset_has_inline_script_or_a_remote_url() {
        for (name, _, body) in ASSETS {
            let body = body.replace("http://www.w3.org/2000/svg", "");
            assert!(
                !body.contains("http://") && !body.contains("https://"),
                "{name}"
            );
            assert!(
                !body.contains("innerHTML"),
                "{name} writes HTML from strings"
            );
            if name.ends_with(".html") {
                assert!(!body.contains("<script>"), "{name} has an inline script");
                assert!(!body.contains("style="), "{name} has an inline style");
            }
        }
    }
}
