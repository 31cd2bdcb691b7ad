//! `GET /v1/jobs/{id}/logs?rank=R&follow=true`: every attempt's log lines of a job as
//! Server-Sent Events, read from the worker agents that ran the attempts.
//!
//! Each event's id is a cursor naming, for every streamed rank, the attempt and the
//! byte offset reached (`r0a1o2048.r1a0o977`). Offsets are byte offsets in the agent's
//! per-attempt log file, so a reconnect with `Last-Event-ID` — to this or any other
//! coordinator — resumes exactly after the last line received: no gap, no duplicate.
//! Attempts of a rank are streamed in order; an attempt moves on to the next once its
//! log is complete (the process exited) and drained.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use cumulus_raft_store::state::WorkerState;
use futures::Stream;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::error::{ApiError, HttpError};
use crate::node::Node;

/// Bytes asked of an agent per read.
pub const CHUNK_BYTES: u64 = 256 * 1024;
/// Events buffered per stream before the pump waits for the client.
pub const STREAM_BUFFER_EVENTS: usize = 256;
/// Pause between polls when no rank had new lines.
pub const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// Query of the log stream.
#[derive(Deserialize)]
pub struct LogParams {
    /// Only this rank (all ranks when absent).
    pub rank: Option<u32>,
    /// Keep streaming until the job ends (default false: stop at the current end).
    #[serde(default)]
    pub follow: bool,
    /// Only the output written since this time (ms since the Unix epoch, the workers'
    /// clocks): each attempt's log is read from where its time index places it (at most
    /// one second earlier; attempts that ended before it show nothing). A resumed stream
    /// (`Last-Event-ID`) goes on from its cursor.
    pub since_ms: Option<u64>,
}

/// Position of one rank in its logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RankCursor {
    /// Attempt being read.
    pub attempt: u32,
    /// Byte offset in that attempt's log.
    pub offset: u64,
}

/// Renders a cursor: `r<rank>a<attempt>o<offset>` joined by `.`.
pub fn format_cursor(c: &BTreeMap<u32, RankCursor>) -> String {
    c.iter()
        .map(|(r, p)| format!("r{r}a{}o{}", p.attempt, p.offset))
        .collect::<Vec<_>>()
        .join(".")
}

/// Parses a cursor made by [`format_cursor`].
///
/// # Errors
/// A message naming the malformed part.
pub fn parse_cursor(s: &str) -> Result<BTreeMap<u32, RankCursor>, String> {
    let mut out = BTreeMap::new();
    if s.trim().is_empty() {
        return Ok(out);
    }
    for part in s.trim().split('.') {
        let bad = || format!("malformed Last-Event-ID part {part:?}");
        let rest = part.strip_prefix('r').ok_or_else(bad)?;
        let (rank, rest) = rest.split_once('a').ok_or_else(bad)?;
        let (attempt, offset) = rest.split_once('o').ok_or_else(bad)?;
        let rank: u32 = rank.parse().map_err(|_| bad())?;
        let cursor = RankCursor {
            attempt: attempt.parse().map_err(|_| bad())?,
            offset: offset.parse().map_err(|_| bad())?,
        };
        if out.insert(rank, cursor).is_some() {
            return Err(format!("rank {rank} appears twice in Last-Event-ID"));
        }
    }
    Ok(out)
}

/// The SSE handler.
pub async fn stream(
    State(node): State<Arc<Node>>,
    axum::Extension(who): axum::Extension<cumulus_api::users::Principal>,
    Path(job_id): Path<String>,
    Query(p): Query<LogParams>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, HttpError> {
    // Readers and administrators read every job's logs; a submitter only their own.
    if who.role == cumulus_api::Role::Submit {
        crate::api::require_owner(&node, &who, &job_id, "read the logs of")?;
    }
    let world_size = node
        .read_state(|s| s.jobs.get(&job_id).map(|j| j.spec.world_size))
        .ok_or_else(|| ApiError::NotFound(format!("no job {job_id:?}")))?;
    let ranks: Vec<u32> = match p.rank {
        Some(r) if r < world_size => vec![r],
        Some(r) => {
            return Err(ApiError::InvalidArgument(format!(
                "rank {r} is out of range (world size {world_size})"
            ))
            .into());
        }
        None => (0..world_size).collect(),
    };
    let given = match headers.get("last-event-id").and_then(|v| v.to_str().ok()) {
        Some(s) => parse_cursor(s).map_err(ApiError::InvalidArgument)?,
        None => BTreeMap::new(),
    };
    let cursor: BTreeMap<u32, RankCursor> = ranks
        .iter()
        .map(|r| (*r, given.get(r).copied().unwrap_or_default()))
        .collect();
    let permit = node
        .log_streams
        .try_acquire(&who)
        .map_err(|refusal| match refusal {
            crate::shares::SlotRefusal::UserShare { .. } => ApiError::ResourceExhausted(format!(
                "{:?} holds its share of log streams on this coordinator ({refusal}); close one",
                who.name
            )),
            crate::shares::SlotRefusal::PoolFull { .. } => ApiError::Unavailable(format!(
                "too many log streams open on this coordinator ({refusal}); retry later"
            )),
        })?;
    let (tx, rx) = mpsc::channel(STREAM_BUFFER_EVENTS);
    tokio::spawn(async move {
        let _permit = permit;
        pump(node, job_id, cursor, (p.follow, p.since_ms), tx).await;
    });
    Ok(Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::default()))
}

enum Fetch {
    Chunk {
        /// Where `body` starts (the cursor's offset, or where `since_ms` placed it).
        start: u64,
        body: Vec<u8>,
        complete: bool,
        size: u64,
    },
    NotFound,
    Failed(String),
}

async fn fetch(
    node: &Node,
    (worker, http_addr): (&str, &str),
    (job_id, rank): (&str, u32),
    c: RankCursor,
    since_ms: Option<u64>,
) -> Fetch {
    let scheme = if node.tls { "https" } else { "http" };
    let url = format!(
        "{scheme}://{http_addr}/v1/logs/{job_id}/{rank}/{}",
        c.attempt
    );
    let mut query = vec![("offset", c.offset), ("max_bytes", CHUNK_BYTES)];
    // A first read of an attempt starts where its output since that time begins.
    if let Some(since) = since_ms
        && c.offset == 0
    {
        query.push(("since_ms", since));
    }
    // With TLS, this client accepts only a certificate naming `worker`.
    let http = match node.http.client(worker) {
        Ok(http) => http,
        Err(e) => return Fetch::Failed(e),
    };
    let resp = http
        .get(&url)
        .bearer_auth(&*node.token)
        .query(&query)
        .send()
        .await;
    let resp = match resp {
        Ok(r) => r,
        Err(e) => return Fetch::Failed(e.to_string()),
    };
    if resp.status() == reqwest::StatusCode::NOT_FOUND {
        return Fetch::NotFound;
    }
    if !resp.status().is_success() {
        return Fetch::Failed(format!("agent answered {}", resp.status()));
    }
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let complete = header("x-cumulus-log-complete").as_deref() == Some("true");
    let size = header("x-cumulus-log-size")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    // An agent without the header starts where it was asked to; one past the end is
    // not believed.
    let start = header("x-cumulus-log-offset")
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|o| *o >= c.offset && *o <= size)
        .unwrap_or(c.offset);
    match resp.bytes().await {
        Ok(b) => Fetch::Chunk {
            start,
            body: b.to_vec(),
            complete,
            size,
        },
        Err(e) => Fetch::Failed(e.to_string()),
    }
}

struct RankView {
    current_attempt: u32,
    attempt_workers: Vec<(u32, String)>,
}

/// One `log` event; its id is the cursor after the line.
fn log_event(
    cursor: &BTreeMap<u32, RankCursor>,
    rank: u32,
    attempt: u32,
    offset: u64,
    line: &str,
) -> Event {
    let data = json!({ "rank": rank, "attempt": attempt, "offset": offset, "line": line });
    Event::default()
        .event("log")
        .id(format_cursor(cursor))
        .data(data.to_string())
}

/// What became of one rank in one poll.
#[derive(PartialEq)]
enum RankPoll {
    /// Lines were sent or the cursor moved to the next attempt.
    Progressed,
    /// Nothing new yet.
    Idle,
    /// The job is over and this rank's last attempt is drained.
    Done,
}

/// Moves past an attempt whose log is fully read: to the next attempt when a newer one
/// exists, or done when the job is over.
fn attempt_drained(
    cursor: &mut BTreeMap<u32, RankCursor>,
    rank: u32,
    c: RankCursor,
    superseded: bool,
    terminal: bool,
) -> RankPoll {
    if superseded {
        cursor.insert(
            rank,
            RankCursor {
                attempt: c.attempt + 1,
                offset: 0,
            },
        );
        RankPoll::Progressed
    } else if terminal {
        RankPoll::Done
    } else {
        RankPoll::Idle
    }
}

/// Reads what is new for one rank and sends it; `None` when the client went away.
#[allow(clippy::too_many_arguments)]
async fn poll_rank(
    node: &Node,
    job_id: &str,
    rank: u32,
    view: &RankView,
    workers: &BTreeMap<String, (String, WorkerState)>,
    (terminal, since_ms): (bool, Option<u64>),
    cursor: &mut BTreeMap<u32, RankCursor>,
    tx: &mpsc::Sender<Result<Event, Infallible>>,
) -> Option<RankPoll> {
    let c = cursor[&rank];
    let superseded = c.attempt < view.current_attempt;
    let worker = view
        .attempt_workers
        .iter()
        .rev()
        .find(|(a, _)| *a == c.attempt)
        .map(|(_, w)| w.clone());
    let Some(worker) = worker else {
        // This attempt was never placed: nothing to read.
        return Some(attempt_drained(cursor, rank, c, superseded, terminal));
    };
    let Some((http_addr, wstate)) = workers.get(&worker).cloned() else {
        return Some(RankPoll::Idle);
    };
    match fetch(node, (&worker, &http_addr), (job_id, rank), c, since_ms).await {
        Fetch::Chunk {
            start,
            body,
            complete,
            size,
        } => {
            let mut offset = start;
            if start != c.offset {
                // The output before `since_ms` is skipped: the cursor moves past it.
                cursor.insert(
                    rank,
                    RankCursor {
                        attempt: c.attempt,
                        offset,
                    },
                );
            }
            let mut rest: &[u8] = &body;
            let mut sent = false;
            while !rest.is_empty() {
                let (line, consumed) = match rest.iter().position(|b| *b == b'\n') {
                    Some(i) => (&rest[..i], i + 1),
                    None => (rest, rest.len()),
                };
                let start = offset;
                offset += consumed as u64;
                rest = &rest[consumed..];
                cursor.insert(
                    rank,
                    RankCursor {
                        attempt: c.attempt,
                        offset,
                    },
                );
                let event = log_event(
                    cursor,
                    rank,
                    c.attempt,
                    start,
                    &String::from_utf8_lossy(line),
                );
                tx.send(Ok(event)).await.ok()?;
                sent = true;
            }
            let after = RankCursor {
                attempt: c.attempt,
                offset,
            };
            let poll = if complete && offset >= size {
                attempt_drained(cursor, rank, after, superseded, terminal)
            } else {
                RankPoll::Idle
            };
            Some(if sent && poll == RankPoll::Idle {
                RankPoll::Progressed
            } else {
                poll
            })
        }
        // The attempt never started on that worker.
        Fetch::NotFound => Some(attempt_drained(cursor, rank, c, superseded, terminal)),
        Fetch::Failed(reason) if wstate == WorkerState::Expired && (superseded || terminal) => {
            let poll = attempt_drained(cursor, rank, c, superseded, terminal);
            let line = format!(
                "[cumulus: the rest of rank {rank} attempt {} is on expired worker {worker} and cannot be read now: {reason}]",
                c.attempt
            );
            tx.send(Ok(log_event(cursor, rank, c.attempt, c.offset, &line)))
                .await
                .ok()?;
            Some(poll)
        }
        Fetch::Failed(_) => Some(RankPoll::Idle),
    }
}

async fn pump(
    node: Arc<Node>,
    job_id: String,
    mut cursor: BTreeMap<u32, RankCursor>,
    (follow, since_ms): (bool, Option<u64>),
    tx: mpsc::Sender<Result<Event, Infallible>>,
) {
    let ranks: Vec<u32> = cursor.keys().copied().collect();
    loop {
        let Some((terminal, views, workers)) = node.read_state(|s| {
            s.jobs.get(&job_id).map(|j| {
                let views: BTreeMap<u32, RankView> = j
                    .ranks
                    .iter()
                    .map(|r| {
                        (
                            r.rank,
                            RankView {
                                current_attempt: r.attempt,
                                attempt_workers: r.attempt_workers.clone(),
                            },
                        )
                    })
                    .collect();
                let workers: BTreeMap<String, (String, WorkerState)> = s
                    .workers
                    .values()
                    .map(|w| (w.worker_id.clone(), (w.http_addr.clone(), w.state)))
                    .collect();
                (j.state.is_terminal(), views, workers)
            })
        }) else {
            return;
        };
        let mut progressed = false;
        let mut done = 0usize;
        for rank in &ranks {
            match poll_rank(
                &node,
                &job_id,
                *rank,
                &views[rank],
                &workers,
                (terminal, since_ms),
                &mut cursor,
                &tx,
            )
            .await
            {
                None => return,
                Some(RankPoll::Progressed) => progressed = true,
                Some(RankPoll::Done) => done += 1,
                Some(RankPoll::Idle) => {}
            }
        }
        if done == ranks.len() || (!follow && !progressed) {
            let _ = tx
                .send(Ok(Event::default()
                    .event("end")
                    .id(format_cursor(&cursor))
                    .data("{}")))
                .await;
            return;
        }
        if !progressed {
            tokio::select! {
                _ = tokio::time::sleep(POLL_INTERVAL) => {}
                _ = tx.closed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_round_trip_and_errors() {
        let mut c = BTreeMap::new();
        c.insert(
            0,
            RankCursor {
                attempt: 1,
                offset: 2048,
            },
        );
        c.insert(
            3,
            RankCursor {
                attempt: 0,
                offset: 0,
            },
        );
        let s = format_cursor(&c);
        assert_eq!(s, "r0a1o2048.r3a0o0");
        assert_eq!(parse_cursor(&s), Ok(c));
        assert_eq!(parse_cursor(""), Ok(BTreeMap::new()));
        for bad in ["x", "r0a1", "r0a1o", "r0ao1", "r0a1o2.r0a1o3", "r-1a0o0"] {
            assert!(parse_cursor(bad).is_err(), "{bad}");
        }
    }
}
