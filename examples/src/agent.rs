//! Client of the worker agent's rank-local HTTP API (docs/architecture.md, "Rank-local HTTP
//! API"): `POST /v1/progress` and `POST /v1/checkpoint`, both with
//! `Authorization: Bearer $CUMULUS_AGENT_TOKEN`. A progress reply carries the agent's
//! request to stop, when there is one.

use std::io::Read;
use std::time::Duration;

use cumulus_api::StopAction;
pub use cumulus_api::rank_local::{CheckpointRequest, CommitReply, ProgressReport};
use cumulus_api::rank_local::{ControlReply, ErrorReply};
use serde::Serialize;
use thiserror::Error;

/// The action of a control reply `{"action": "pause"}`: `None` for `"none"` or a body
/// that is not a control reply; an unknown action is a plain stop.
fn parse_action(body: &str) -> Option<StopAction> {
    serde_json::from_str::<ControlReply>(body)
        .ok()?
        .stop_action()
}

/// Time limit of one progress request, in milliseconds.
pub const PROGRESS_TIMEOUT_MS: u64 = 2_000;
/// Time limit of one checkpoint commit request, in milliseconds (the agent fsyncs and
/// waits for the leader before answering).
pub const CHECKPOINT_TIMEOUT_MS: u64 = 60_000;
/// Most bytes of a reply body that are read.
pub const MAX_REPLY_BYTES: u64 = cumulus_api::rank_local::MAX_REPLY_BYTES as u64;

/// A request to the agent failed.
#[derive(Debug, Error)]
pub enum AgentError {
    /// The agent says this attempt is stale: 409 (the leader rejected the attempt) or
    /// 401 (the agent no longer knows this attempt's token). Retrying cannot help.
    #[error("the agent rejected this attempt as stale (HTTP {status}): {message}")]
    Stale {
        /// 409 or 401.
        status: u16,
        /// The agent's error message.
        message: String,
    },
    /// Another non-success status.
    #[error("the agent answered HTTP {status}: {message}")]
    Status {
        /// The status code.
        status: u16,
        /// The agent's error message.
        message: String,
    },
    /// The request could not be sent or the reply not read (refused, timeout, …).
    #[error("request to the agent failed: {0}")]
    Transport(String),
    /// A success reply whose body is not what the API promises.
    #[error("the agent's reply is malformed: {0}")]
    BadReply(String),
}

/// A client of one agent, for one attempt's token.
#[derive(Debug, Clone)]
pub struct AgentClient {
    base_url: String,
    token: String,
    http: reqwest::blocking::Client,
}

fn read_body(resp: reqwest::blocking::Response) -> String {
    let mut body = Vec::new();
    // A body that cannot be read is reported as empty: the status says enough.
    let _ = resp.take(MAX_REPLY_BYTES).read_to_end(&mut body);
    String::from_utf8_lossy(&body).into_owned()
}

fn error_message(body: &str) -> String {
    match serde_json::from_str::<ErrorReply>(body) {
        Ok(e) => e.error,
        Err(_) => body.trim().chars().take(500).collect(),
    }
}

impl AgentClient {
    /// A client for the agent at `base_url` (e.g. `http://127.0.0.1:41234`) with the
    /// attempt's bearer `token`. Proxies from the environment are ignored: the agent is
    /// on loopback. With `socket` (`CUMULUS_AGENT_SOCKET`) every request goes through
    /// that Unix socket instead (the path of `base_url` still applies).
    pub fn new(
        base_url: &str,
        token: &str,
        socket: Option<&std::path::Path>,
    ) -> Result<Self, AgentError> {
        let mut builder = reqwest::blocking::Client::builder();
        if let Some(socket) = socket {
            builder = builder.unix_socket(socket.to_owned());
        }
        let http = builder
            .no_proxy()
            // The agent closes a keep-alive connection idle for 10 s (its HTTP header
            // deadline); drop it before, so no report is sent on a closing connection.
            .pool_idle_timeout(Duration::from_secs(5))
            .connect_timeout(Duration::from_millis(PROGRESS_TIMEOUT_MS))
            .build()
            .map_err(|e| AgentError::Transport(format!("cannot build HTTP client: {e}")))?;
        Ok(Self {
            base_url: base_url.trim_end_matches('/').to_string(),
            token: token.to_string(),
            http,
        })
    }

    fn post<T: Serialize>(
        &self,
        path: &str,
        body: &T,
        timeout_ms: u64,
    ) -> Result<(u16, String), AgentError> {
        let resp = self
            .http
            .post(format!("{}{path}", self.base_url))
            .bearer_auth(&self.token)
            .timeout(Duration::from_millis(timeout_ms))
            .json(body)
            .send()
            .map_err(|e| AgentError::Transport(format!("POST {path}: {e}")))?;
        let status = resp.status().as_u16();
        Ok((status, read_body(resp)))
    }

    /// `POST /v1/progress` (time limit [`PROGRESS_TIMEOUT_MS`]); any 2xx is success.
    /// Returns what the agent asks of the rank: `None` to go on (204), or the stop
    /// action of a 200 reply `{"action": ..}` (an action this client does not know is
    /// taken for a plain [`StopAction::Stop`]).
    pub fn progress(&self, report: &ProgressReport) -> Result<Option<StopAction>, AgentError> {
        let (status, body) = self.post("/v1/progress", report, PROGRESS_TIMEOUT_MS)?;
        match status {
            200 => Ok(parse_action(&body)),
            201..=299 => Ok(None),
            401 | 409 => Err(AgentError::Stale {
                status,
                message: error_message(&body),
            }),
            _ => Err(AgentError::Status {
                status,
                message: error_message(&body),
            }),
        }
    }

    /// `POST /v1/checkpoint` (time limit [`CHECKPOINT_TIMEOUT_MS`]): asks the agent to
    /// commit the staging dir as this attempt's part of `step`.
    pub fn commit_checkpoint(
        &self,
        step: u64,
        state: &serde_json::Value,
    ) -> Result<CommitReply, AgentError> {
        let request = CheckpointRequest {
            step,
            state: state.clone(),
        };
        let (status, body) = self.post("/v1/checkpoint", &request, CHECKPOINT_TIMEOUT_MS)?;
        match status {
            200 => serde_json::from_str(&body)
                .map_err(|e| AgentError::BadReply(format!("{e}: {:?}", error_message(&body)))),
            401 | 409 => Err(AgentError::Stale {
                status,
                message: error_message(&body),
            }),
            _ => Err(AgentError::Status {
                status,
                message: error_message(&body),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn stop_actions_are_read_from_replies() {
        assert_eq!(
            parse_action(r#"{"action":"pause"}"#),
            Some(StopAction::Pause)
        );
        assert_eq!(parse_action(r#"{"action":"none"}"#), None);
        assert_eq!(parse_action(""), None);
        assert_eq!(
            parse_action(r#"{"action":"drain"}"#),
            Some(StopAction::Stop)
        );
    }

    #[test]
    fn error_bodies_are_read() {
        assert_eq!(
            error_message(r#"{"error":"stale attempt"}"#),
            "stale attempt"
        );
        assert_eq!(error_message("  plain text \n"), "plain text");
    }

    #[test]
    fn refused_connection_is_a_transport_error() {
        // Bind then drop a listener to get a loopback port with nobody listening.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let c = AgentClient::new(&format!("http://127.0.0.1:{port}/"), "t", None)
            .expect("a client of a loopback URL");
        let err = c
            .progress(&ProgressReport {
                step: 1,
                total_steps: 2,
                metrics: BTreeMap::new(),
            })
            .unwrap_err();
        assert!(matches!(err, AgentError::Transport(_)), "{err}");
    }
}
