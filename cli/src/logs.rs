//! `logs`: a job's rank logs over Server-Sent Events from a coordinator's HTTP API.
//!
//! `GET /v1/jobs/{id}/logs?rank=R&follow=true|false` with the bearer token. Events:
//! `event: log`, `id: <cursor>`, `data: {"rank","attempt","offset","line"}`, and a final
//! `event: end`. A dropped connection is resumed on the next HTTP address with
//! `Last-Event-ID: <last cursor>`, so no line is lost or repeated; as a second guard,
//! a line whose offset is not past the last printed offset of its (rank, attempt) is
//! skipped. Only what a retry can mend is retried (a connection that fails or drops, a
//! 5xx, 408 or 429, see [`retryable_status`]); any other refusal (401, 403, 404, …) ends
//! the command at once with the coordinator's message.
//!
//! A line is a rank's output: [`escape_for_terminal`] makes its control and bidirectional
//! characters visible before it reaches a terminal.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

use eventsource_stream::{Event, Eventsource};
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use crate::config::Conn;

/// Consecutive failed connection attempts before giving up.
pub const MAX_CONSECUTIVE_FAILURES: u32 = 20;
/// Largest cursor accepted from the server (it is sent back in a header), bytes.
pub const MAX_CURSOR_BYTES: usize = 64 * 1024;
/// Most (rank, attempt) positions remembered for duplicate suppression.
pub const MAX_TRACKED_STREAMS: usize = 1 << 20;

/// One log line event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogLine {
    /// Global rank, `0..world_size`.
    pub rank: u32,
    /// Attempt of the rank.
    pub attempt: u32,
    /// Byte offset of the line in that attempt's log.
    pub offset: u64,
    /// The line, without its newline.
    pub line: String,
}

impl LogLine {
    /// `[rank R a A] line`, the line as it came.
    pub fn human(&self) -> String {
        format!("[rank {} a {}] {}", self.rank, self.attempt, self.line)
    }

    /// `[rank R a A] line` with the line's control and bidirectional characters made
    /// visible ([`escape_for_terminal`]), for a terminal.
    pub fn human_escaped(&self) -> String {
        format!(
            "[rank {} a {}] {}",
            self.rank,
            self.attempt,
            escape_for_terminal(&self.line)
        )
    }
}

/// The Unicode bidirectional controls: the Arabic letter mark, the left-to-right and
/// right-to-left marks, the embeddings and overrides (U+202A–U+202E) and the isolates
/// (U+2066–U+2069). They reorder how the text around them is shown ("Trojan Source").
const BIDI_CONTROLS: &[char] = &[
    '\u{061C}', '\u{200E}', '\u{200F}', '\u{202A}', '\u{202B}', '\u{202C}', '\u{202D}', '\u{202E}',
    '\u{2066}', '\u{2067}', '\u{2068}', '\u{2069}',
];

/// Whether a terminal would act on `c` rather than show it: a C0 control character other
/// than tab and newline, DEL, a C1 control character, or a bidirectional control.
fn acts_on_terminal(c: char) -> bool {
    (c.is_control() && c != '\t' && c != '\n') || BIDI_CONTROLS.contains(&c)
}

/// `line` as text a terminal shows rather than obeys: every control character but tab
/// and newline, and every bidirectional control, is replaced by a visible escape: `\r`
/// for a carriage return,
/// `\xNN` for the other ASCII controls (`\x1b` for ESC, `\x7f` for DEL), `\u{NN}` for C1
/// and bidirectional controls (`\u{9b}`, `\u{202e}`). Tabs, newlines and every other
/// character (accents, CJK, emoji) are kept; the line itself is returned when nothing needs
/// escaping.
pub fn escape_for_terminal(line: &str) -> Cow<'_, str> {
    if !line.chars().any(acts_on_terminal) {
        return Cow::Borrowed(line);
    }
    let mut out = String::with_capacity(line.len() + 16);
    for c in line.chars() {
        match c {
            '\r' => out.push_str("\\r"),
            c if acts_on_terminal(c) && c.is_ascii() => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if acts_on_terminal(c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// A line of JSON (`serde_json` output) with the characters [`escape_for_terminal`]
/// escapes written as JSON escapes (`\u007f`, `\u202e`) instead: the same JSON value,
/// shown rather than obeyed by a terminal. `serde_json` already escapes C0 controls; DEL,
/// C1 and the bidirectional controls it writes as they are.
pub fn escape_json_for_terminal(json: &str) -> Cow<'_, str> {
    if !json.chars().any(acts_on_terminal) {
        return Cow::Borrowed(json);
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if acts_on_terminal(c) {
            // Every such character is in the Basic Multilingual Plane: one `\uXXXX`.
            let _ = write!(out, "\\u{:04x}", c as u32);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Errors of following logs.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// 401 from the coordinator.
    #[error("the coordinator rejected the token (check --token/--token-file)")]
    Unauthenticated,
    /// A refusal that retrying cannot change (403: not allowed to read these logs, 404:
    /// unknown job, 400: bad request, …), with the coordinator's message.
    #[error("{0}")]
    Rejected(String),
    /// No HTTP address is known.
    #[error(
        "no coordinator HTTP address: pass --http (or CUMULUS_HTTP), or use the local cluster's cluster.json"
    )]
    NoHttpAddress,
    /// The server sent something that breaks the protocol.
    #[error("bad log event from {addr}: {reason}")]
    Protocol {
        /// Where it came from.
        addr: String,
        /// What was wrong.
        reason: String,
    },
    /// Too many consecutive failed tries (connections that failed or dropped, answers
    /// of [`retryable_status`]).
    #[error("lost the log stream: {failures} consecutive failed tries (last, from {addr}: {last})")]
    Exhausted {
        /// Failures counted.
        failures: u32,
        /// Address of the last try.
        addr: String,
        /// Last error.
        last: String,
    },
}

/// Resume state: the cursor and the last offset printed per (rank, attempt).
#[derive(Debug, Clone, Default)]
pub struct CursorState {
    cursor: Option<String>,
    last_offset: HashMap<(u32, u32), u64>,
}

/// What an event means to the follower.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A new line to show.
    Line(LogLine),
    /// A line already shown (suppressed).
    Duplicate,
    /// `event: end`: the stream is complete.
    End,
    /// Another event type (ignored).
    Other,
}

impl CursorState {
    /// Starts with an optional cursor (e.g. from a previous run).
    pub fn new(cursor: Option<String>) -> Self {
        CursorState {
            cursor,
            last_offset: HashMap::new(),
        }
    }

    /// The cursor to send as `Last-Event-ID` on reconnect.
    pub fn cursor(&self) -> Option<&str> {
        self.cursor.as_deref()
    }

    /// Applies one SSE event: validates it, advances the cursor, suppresses duplicates.
    ///
    /// # Errors
    /// [`BadEvent`] when the data is not a log line or the id not a usable cursor.
    pub fn accept(&mut self, ev: &Event) -> Result<Outcome, BadEvent> {
        match ev.event.as_str() {
            "end" => return Ok(Outcome::End),
            "log" | "" | "message" => {}
            _ => return Ok(Outcome::Other),
        }
        let line: LogLine = serde_json::from_str(&ev.data).map_err(|error| BadEvent::Data {
            error,
            data: truncate(&ev.data, 200).to_owned(),
        })?;
        if !ev.id.is_empty() {
            if ev.id.len() > MAX_CURSOR_BYTES || !ev.id.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(BadEvent::Cursor(truncate(&ev.id, 200).to_owned()));
            }
            self.cursor = Some(ev.id.clone());
        }
        let key = (line.rank, line.attempt);
        if let Some(&last) = self.last_offset.get(&key)
            && line.offset <= last
        {
            return Ok(Outcome::Duplicate);
        }
        if self.last_offset.len() >= MAX_TRACKED_STREAMS && !self.last_offset.contains_key(&key) {
            self.last_offset.clear();
        }
        self.last_offset.insert(key, line.offset);
        Ok(Outcome::Line(line))
    }
}

/// An SSE event of the log stream that breaks the protocol.
#[derive(Debug, thiserror::Error)]
pub enum BadEvent {
    /// Its data is not a log line's JSON (`data`: its first 200 characters).
    #[error("log data is not the expected JSON ({error}): {data:?}")]
    Data {
        /// The parse error.
        error: serde_json::Error,
        /// The data's first 200 characters.
        data: String,
    },
    /// Its id is too long or not printable ASCII (its first 200 characters).
    #[error("event id is not a usable cursor: {0:?}")]
    Cursor(String),
}

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// How to follow.
#[derive(Debug, Clone)]
pub struct LogRequest {
    /// Job id.
    pub job_id: String,
    /// Only this rank.
    pub rank: Option<u32>,
    /// Keep streaming until `end` (else stop at the current end).
    pub follow: bool,
    /// Only output written since this time (ms since the Unix epoch).
    pub since_ms: Option<u64>,
}

/// Whether a non-success HTTP answer of the log endpoint may succeed when tried again
/// (on this or another coordinator): a server error (5xx: a follower not ready, the
/// stream cap reached, …), 408 (request timeout) or 429 (too many requests). Every other
/// answer is final.
pub fn retryable_status(status: reqwest::StatusCode) -> bool {
    status.is_server_error()
        || status == reqwest::StatusCode::REQUEST_TIMEOUT
        || status == reqwest::StatusCode::TOO_MANY_REQUESTS
}

/// Backoff before reconnect number `n` (1-based): 200 ms doubling, capped at 5 s.
pub fn reconnect_backoff(n: u32) -> Duration {
    let ms = 200u64.saturating_mul(1u64 << n.saturating_sub(1).min(10));
    Duration::from_millis(ms.min(5000))
}

/// Streams the logs, calling `sink` for every new line, until `end` (returns `Ok`).
/// A clean close without `end` counts as a dropped connection and is resumed.
pub async fn follow_logs<F>(
    conn: &Conn,
    req: &LogRequest,
    state: &mut CursorState,
    mut sink: F,
) -> Result<(), LogError>
where
    F: FnMut(&LogLine),
{
    if conn.http.is_empty() {
        return Err(LogError::NoHttpAddress);
    }
    let mut client = reqwest::Client::builder();
    if let Some(tls) = &conn.tls {
        // The CA, the user's certificate if any, and only a coordinator as the server.
        let config = tls
            .rustls_config(cumulus_tls::ExpectedServer::AnyCoordinator)
            .map_err(|e| LogError::Protocol {
                addr: String::new(),
                reason: format!("the TLS configuration: {e}"),
            })?;
        client = client.tls_backend_preconfigured((*config).clone());
    }
    let client = client
        .connect_timeout(Duration::from_secs(2))
        // A healthy follow stream may be silent; the coordinator's keep-alives (if any)
        // and this bound decide when a silent connection is presumed dead and resumed.
        .read_timeout(Duration::from_secs(30))
        .build()
        .map_err(|e| LogError::Protocol {
            addr: String::new(),
            reason: format!("cannot build HTTP client: {e}"),
        })?;
    let mut index = 0usize;
    let mut failures = 0u32;
    // Since when the stream has failed without a line in between (`--timeout` bounds it).
    let mut failing_since: Option<std::time::Instant> = None;
    loop {
        let addr = conn.http[index % conn.http.len()].clone();
        let url = format!("{}://{addr}/v1/jobs/{}/logs", conn.scheme(), req.job_id);
        let mut query: Vec<(&str, String)> = vec![("follow", req.follow.to_string())];
        if let Some(r) = req.rank {
            query.push(("rank", r.to_string()));
        }
        if let Some(since) = req.since_ms {
            query.push(("since_ms", since.to_string()));
        }
        let mut rb = client
            .get(&url)
            .query(&query)
            .header("accept", "text/event-stream");
        if !conn.token.is_empty() {
            // Without a token the client certificate names the user.
            rb = rb.bearer_auth(&conn.token);
        }
        if let Some(c) = state.cursor() {
            rb = rb.header("last-event-id", c);
        }
        let failure: String = match rb.send().await {
            Err(e) => format!("request failed: {e}"),
            Ok(resp) => {
                let status = resp.status();
                if status == reqwest::StatusCode::UNAUTHORIZED {
                    return Err(LogError::Unauthenticated);
                }
                if !status.is_success() {
                    let body = resp.text().await.unwrap_or_default();
                    let message = error_message(&body);
                    if !retryable_status(status) {
                        return Err(LogError::Rejected(
                            message.unwrap_or_else(|| format!("{status} from {addr}")),
                        ));
                    }
                    format!("{status}: {}", message.unwrap_or_default())
                } else {
                    failures = 0;
                    failing_since = None;
                    let mut events = resp.bytes_stream().eventsource();
                    let mut dropped = "the stream closed without an end event".to_string();
                    while let Some(item) = events.next().await {
                        match item {
                            Ok(ev) => match state.accept(&ev) {
                                Ok(Outcome::Line(l)) => sink(&l),
                                Ok(Outcome::End) => return Ok(()),
                                Ok(Outcome::Duplicate | Outcome::Other) => {}
                                Err(e) => {
                                    return Err(LogError::Protocol {
                                        addr,
                                        reason: e.to_string(),
                                    });
                                }
                            },
                            Err(e) => {
                                dropped = format!("stream error: {e}");
                                break;
                            }
                        }
                    }
                    dropped
                }
            }
        };
        failures += 1;
        let since = *failing_since.get_or_insert_with(std::time::Instant::now);
        tracing::debug!(%addr, failures, %failure, "log stream interrupted; resuming elsewhere");
        if failures >= MAX_CONSECUTIVE_FAILURES || since.elapsed() >= conn.retry_total {
            return Err(LogError::Exhausted {
                failures,
                addr,
                last: failure,
            });
        }
        index += 1;
        tokio::time::sleep(reconnect_backoff(failures)).await;
    }
}

/// The `error` field of a `{"error": "..."}` body.
fn error_message(body: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct E {
        error: String,
    }
    serde_json::from_str::<E>(body).ok().map(|e| e.error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    use tokio::net::TcpListener;

    fn ev(event: &str, id: &str, data: &str) -> Event {
        Event {
            event: event.into(),
            data: data.into(),
            id: id.into(),
            retry: None,
        }
    }

    fn data(rank: u32, attempt: u32, offset: u64, line: &str) -> String {
        serde_json::to_string(&LogLine {
            rank,
            attempt,
            offset,
            line: line.into(),
        })
        .expect("json")
    }

    #[test]
    fn cursor_advances_and_duplicates_are_suppressed() {
        let mut st = CursorState::new(None);
        assert_eq!(st.cursor(), None);
        let o = st
            .accept(&ev("log", "r0a0o10", &data(0, 0, 0, "hello")))
            .expect("ok");
        assert_eq!(
            o,
            Outcome::Line(LogLine {
                rank: 0,
                attempt: 0,
                offset: 0,
                line: "hello".into()
            })
        );
        assert_eq!(st.cursor(), Some("r0a0o10"));
        st.accept(&ev("log", "r0a0o20.r1a0o5", &data(0, 0, 10, "second")))
            .expect("ok");
        assert_eq!(st.cursor(), Some("r0a0o20.r1a0o5"));
        // A replayed line of the same attempt is suppressed; a new attempt starts over.
        assert_eq!(
            st.accept(&ev("log", "", &data(0, 0, 10, "second")))
                .expect("ok"),
            Outcome::Duplicate
        );
        assert_eq!(
            st.cursor(),
            Some("r0a0o20.r1a0o5"),
            "an event without id keeps the cursor"
        );
        assert!(matches!(
            st.accept(&ev("log", "c", &data(0, 1, 0, "again")))
                .expect("ok"),
            Outcome::Line(_)
        ));
        assert_eq!(st.accept(&ev("end", "", "")).expect("ok"), Outcome::End);
        assert_eq!(st.accept(&ev("ping", "", "")).expect("ok"), Outcome::Other);
        assert!(st.accept(&ev("log", "x", "not json")).is_err());
        assert!(
            st.accept(&ev("log", "bad id", &data(0, 2, 0, "x")))
                .is_err()
        );
    }

    #[test]
    fn human_format_and_backoff() {
        let l = LogLine {
            rank: 2,
            attempt: 1,
            offset: 0,
            line: "step 10".into(),
        };
        assert_eq!(l.human(), "[rank 2 a 1] step 10");
        assert_eq!(reconnect_backoff(1), Duration::from_millis(200));
        assert_eq!(reconnect_backoff(3), Duration::from_millis(800));
        assert_eq!(reconnect_backoff(50), Duration::from_secs(5));
    }

    /// One scripted HTTP/1.1 answer of the loopback SSE server below.
    struct Script {
        /// Raw SSE body to send.
        body: String,
        /// Send `event: end` and close cleanly, or just drop the connection.
        end: bool,
    }

    /// A loopback HTTP server speaking the SSE wire format: it answers each connection
    /// with the next script and records the request head (to check Last-Event-ID).
    async fn sse_server(scripts: Vec<Script>) -> (String, Arc<Mutex<Vec<String>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let heads2 = heads.clone();
        tokio::spawn(async move {
            for script in scripts {
                let (sock, _) = listener.accept().await.expect("accept");
                let mut reader = BufReader::new(sock);
                let mut head = String::new();
                loop {
                    let mut l = String::new();
                    if reader.read_line(&mut l).await.expect("read") == 0 || l == "\r\n" {
                        break;
                    }
                    head.push_str(&l);
                }
                heads2.lock().expect("lock").push(head);
                let mut sock = reader.into_inner();
                let mut body = script.body;
                if script.end {
                    body.push_str("event: end\ndata: {}\n\n");
                }
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{}\r\n",
                    body.len(),
                    body
                );
                sock.write_all(resp.as_bytes()).await.expect("write");
                if script.end {
                    sock.write_all(b"0\r\n\r\n").await.expect("write");
                }
                sock.flush().await.expect("flush");
                // Dropping the socket without the final chunk is an interrupted stream.
            }
        });
        (addr, heads)
    }

    fn sse(event_id: &str, rank: u32, offset: u64, line: &str) -> String {
        format!(
            "event: log\nid: {event_id}\ndata: {}\n\n",
            data(rank, 0, offset, line)
        )
    }

    #[tokio::test]
    async fn reconnects_with_last_event_id_and_prints_each_line_once() {
        let first = format!("{}{}", sse("c1", 0, 0, "one"), sse("c2", 1, 0, "two"));
        // The second server replays "two" (as a buggy server might) and continues.
        let second = format!("{}{}", sse("c2", 1, 0, "two"), sse("c3", 0, 4, "three"));
        let (addr, heads) = sse_server(vec![
            Script {
                body: first,
                end: false,
            },
            Script {
                body: second,
                end: true,
            },
        ])
        .await;
        let conn = Conn {
            retry_total: std::time::Duration::from_secs(30),
            grpc: vec!["127.0.0.1:1".into()],
            http: vec![addr],
            token: "secret".into(),
            tls: None,
        };
        let req = LogRequest {
            job_id: "job-000001".into(),
            rank: None,
            follow: true,
            since_ms: None,
        };
        let mut state = CursorState::default();
        let mut lines = Vec::new();
        tokio::time::timeout(
            Duration::from_secs(20),
            follow_logs(&conn, &req, &mut state, |l| lines.push(l.human())),
        )
        .await
        .expect("finishes")
        .expect("ok");
        assert_eq!(
            lines,
            vec!["[rank 0 a 0] one", "[rank 1 a 0] two", "[rank 0 a 0] three"]
        );
        let heads = heads.lock().expect("lock").clone();
        assert_eq!(heads.len(), 2);
        assert!(
            heads[0].starts_with("GET /v1/jobs/job-000001/logs?follow=true "),
            "{}",
            heads[0]
        );
        assert!(
            heads[0]
                .to_ascii_lowercase()
                .contains("authorization: bearer secret"),
            "{}",
            heads[0]
        );
        assert!(
            !heads[0].to_ascii_lowercase().contains("last-event-id"),
            "{}",
            heads[0]
        );
        assert!(
            heads[1]
                .to_ascii_lowercase()
                .contains("last-event-id: c2\r\n"),
            "{}",
            heads[1]
        );
    }

    #[test]
    fn only_server_errors_timeouts_and_throttling_are_retried() {
        for code in [500, 502, 503, 504, 408, 429] {
            let status = reqwest::StatusCode::from_u16(code).expect("status");
            assert!(retryable_status(status), "{code}");
        }
        for code in [400, 401, 403, 404, 405, 409, 410, 413, 422] {
            let status = reqwest::StatusCode::from_u16(code).expect("status");
            assert!(!retryable_status(status), "{code}");
        }
    }

    #[test]
    fn control_and_bidi_characters_are_escaped_for_a_terminal() {
        for plain in ["step 10 loss=0.25", "résumé 東京 👩‍💻", "a\tb", ""] {
            assert!(
                matches!(escape_for_terminal(plain), Cow::Borrowed(_)),
                "{plain:?}"
            );
        }
        for (raw, shown) in [
            ("\u{1b}[2Jcleared", "\\x1b[2Jcleared"),
            ("\u{1b}]0;title\u{7}", "\\x1b]0;title\\x07"),
            ("50%\r100%", "50%\\r100%"),
            ("back\u{8}space", "back\\x08space"),
            ("del\u{7f}", "del\\x7f"),
            ("csi\u{9b}2J", "csi\\u{9b}2J"),
            ("admin\u{202e}txt.exe", "admin\\u{202e}txt.exe"),
            ("\u{2066}x\u{2069}", "\\u{2066}x\\u{2069}"),
            ("\u{200e}\u{200f}\u{61c}", "\\u{200e}\\u{200f}\\u{61c}"),
            (
                "keeps\ttabs\nand newlines\u{1b}",
                "keeps\ttabs\nand newlines\\x1b",
            ),
        ] {
            let got = escape_for_terminal(raw);
            assert_eq!(got, shown, "{raw:?}");
            assert!(!got.chars().any(acts_on_terminal), "{got:?}");
        }
        let line = LogLine {
            rank: 1,
            attempt: 0,
            offset: 0,
            line: "\u{1b}[2J".into(),
        };
        assert_eq!(line.human_escaped(), "[rank 1 a 0] \\x1b[2J");
        assert_eq!(
            line.human(),
            "[rank 1 a 0] \u{1b}[2J",
            "raw keeps the bytes"
        );
    }

    #[test]
    fn json_lines_keep_their_value_and_lose_what_a_terminal_obeys() {
        let line = LogLine {
            rank: 0,
            attempt: 0,
            offset: 0,
            line: "a\u{1b}b\u{7f}c\u{9b}d\u{202e}e é".into(),
        };
        let json = serde_json::to_string(&line).expect("json");
        let shown = escape_json_for_terminal(&json);
        assert!(!shown.chars().any(acts_on_terminal), "{shown}");
        let back: LogLine = serde_json::from_str(&shown).expect("still JSON");
        assert_eq!(back, line);
        assert!(matches!(
            escape_json_for_terminal("{\"line\":\"plain é\"}"),
            Cow::Borrowed(_)
        ));
    }

    #[tokio::test]
    async fn refusals_a_retry_cannot_change_are_final() {
        for (status, body, expect) in [
            (
                "401 Unauthorized",
                "{\"error\":\"bad token\"}",
                "rejected the token",
            ),
            (
                "404 Not Found",
                "{\"error\":\"no job job-000042\"}",
                "no job job-000042",
            ),
            (
                "403 Forbidden",
                "{\"error\":\"job-000042 belongs to alice\"}",
                "belongs to alice",
            ),
            ("409 Conflict", "", "409 Conflict from 127.0.0.1:"),
        ] {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr").to_string();
            let resp = format!(
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let server = tokio::spawn(async move {
                let (sock, _) = listener.accept().await.expect("accept");
                let mut reader = BufReader::new(sock);
                loop {
                    let mut l = String::new();
                    if reader.read_line(&mut l).await.expect("read") == 0 || l == "\r\n" {
                        break;
                    }
                }
                let mut sock = reader.into_inner();
                sock.write_all(resp.as_bytes()).await.expect("write");
                sock.flush().await.expect("flush");
            });
            let conn = Conn {
                retry_total: std::time::Duration::from_secs(30),
                grpc: vec![],
                http: vec![addr],
                token: "t".into(),
                tls: None,
            };
            let req = LogRequest {
                job_id: "job-000042".into(),
                rank: Some(1),
                follow: false,
                since_ms: None,
            };
            // One answer, no retry: the server accepts once, and a retry would wait for
            // `retry_total` (30 s) on a refused connection.
            let err = tokio::time::timeout(
                Duration::from_secs(10),
                follow_logs(&conn, &req, &mut CursorState::default(), |_| {}),
            )
            .await
            .unwrap_or_else(|_| panic!("{status} was retried"))
            .expect_err("rejected");
            assert!(err.to_string().contains(expect), "{status}: {err}");
            server.await.expect("server");
        }
    }
}
