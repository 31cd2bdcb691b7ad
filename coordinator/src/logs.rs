//! `GET /v1/jobs/{id}/logs?rank=R&follow=true`: every attempt's log lines of a job as
//! Server-Sent Events, read from the worker agents that ran the attempts.
//!
//! Each event's id is a cursor naming, for every streamed rank, the attempt and the
//! byte offset reached (`r0a1o2048.r1a0o977`). Offsets are byte offsets in the agent's
//! per-attempt log file, so a reconnect with `Last-Event-ID` — to this or any other
//! coordinator — resumes exactly after the last line received: no gap, no duplicate.
//! Attempts of a rank are streamed in order; an attempt moves on to the next once its
//! log is complete (the process exited) and drained.
//!
//! `?tail=N` starts each streamed rank at its last N lines so far (of its newest
//! attempts, read backwards from the agents: at most [`MAX_TAIL_LINES`] lines and
//! [`MAX_TAIL_SCAN_BYTES`] per rank) instead of the beginning; a resumed stream
//! (`Last-Event-ID`) goes on from its cursor.

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
    /// Start each rank at its last N lines so far (`0..=`[`MAX_TAIL_LINES`]; 0: at the
    /// current end); not with `since_ms`. Ignored when resuming (`Last-Event-ID`).
    pub tail: Option<u32>,
}

/// Most lines `?tail=N` may ask for.
pub const MAX_TAIL_LINES: u32 = 10_000;
/// Most bytes read backwards per rank to find its last lines for `?tail=N`; a rank whose
/// last N lines are longer starts where the scan stopped (a line's start).
pub const MAX_TAIL_SCAN_BYTES: u64 = 16 * 1024 * 1024;

/// What a pump streams besides the cursor: follow, since when, how many last lines.
#[derive(Clone, Copy, Debug)]
struct PumpOpts {
    follow: bool,
    since_ms: Option<u64>,
    /// `?tail=N` on a stream that does not resume.
    tail: Option<u32>,
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
    if let Some(n) = p.tail {
        if n > MAX_TAIL_LINES {
            return Err(ApiError::InvalidArgument(format!(
                "tail={n} is more than the {MAX_TAIL_LINES} lines a stream may start with"
            ))
            .into());
        }
        if p.since_ms.is_some() {
            return Err(ApiError::InvalidArgument(
                "tail and since_ms cannot be combined: give one".into(),
            )
            .into());
        }
    }
    let resumed = headers.get("last-event-id").and_then(|v| v.to_str().ok());
    let opts = PumpOpts {
        follow: p.follow,
        since_ms: p.since_ms,
        tail: p.tail.filter(|_| resumed.is_none()),
    };
    let given = match resumed {
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
        pump(node, job_id, cursor, opts, tx).await;
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
    at: (&str, &str),
    job_rank: (&str, u32),
    c: RankCursor,
    since_ms: Option<u64>,
) -> Fetch {
    fetch_page(node, at, job_rank, c, (CHUNK_BYTES, since_ms)).await
}

/// Reads `max_bytes` (at most [`CHUNK_BYTES`]) of a log from `c`.
async fn fetch_bounded(
    node: &Node,
    at: (&str, &str),
    job_rank: (&str, u32),
    c: RankCursor,
    max_bytes: u64,
) -> Fetch {
    let max_bytes = max_bytes.clamp(1, CHUNK_BYTES);
    fetch_page(node, at, job_rank, c, (max_bytes, None)).await
}

/// Reads up to `max_bytes` of an attempt's log from `c` (from where `since_ms` places a
/// first read).
async fn fetch_page(
    node: &Node,
    (worker, http_addr): (&str, &str),
    (job_id, rank): (&str, u32),
    c: RankCursor,
    (max_bytes, since_ms): (u64, Option<u64>),
) -> Fetch {
    let scheme = if node.tls { "https" } else { "http" };
    let url = format!(
        "{scheme}://{http_addr}/v1/logs/{job_id}/{rank}/{}",
        c.attempt
    );
    let mut query = vec![("offset", c.offset), ("max_bytes", max_bytes)];
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

/// Where a rank's last `n` lines so far begin: read backwards from its newest placed
/// attempt (older attempts when that one has fewer), at most [`MAX_TAIL_SCAN_BYTES`].
/// A still-running attempt's unfinished last line does not count (the stream shows it
/// once it is complete). A log that cannot be read starts at its beginning.
async fn tail_start(
    node: &Node,
    job_id: &str,
    rank: u32,
    view: &RankView,
    workers: &BTreeMap<String, (String, WorkerState)>,
    n: u32,
) -> RankCursor {
    let mut need = u64::from(n);
    let mut budget = MAX_TAIL_SCAN_BYTES;
    let mut start = RankCursor::default();
    let mut seen = std::collections::BTreeSet::new();
    for (attempt, worker) in view.attempt_workers.iter().rev() {
        if !seen.insert(*attempt) {
            continue;
        }
        let Some((http_addr, _)) = workers.get(worker) else {
            continue;
        };
        let at = (worker.as_str(), http_addr.as_str());
        let probe = RankCursor {
            attempt: *attempt,
            offset: 0,
        };
        let (size, complete) = match fetch_bounded(node, at, (job_id, rank), probe, 1).await {
            Fetch::Chunk { size, complete, .. } => (size, complete),
            Fetch::NotFound => continue,
            Fetch::Failed(_) => return probe,
        };
        match scan_back(
            node,
            at,
            (job_id, rank),
            *attempt,
            (size, complete),
            &mut need,
            &mut budget,
        )
        .await
        {
            Some(offset) => {
                return RankCursor {
                    attempt: *attempt,
                    offset,
                };
            }
            None => start = probe,
        }
        if need == 0 || budget == 0 {
            break;
        }
    }
    if need == u64::from(n) && n == 0 {
        // tail=0 with no log yet: from the current attempt's beginning.
        return RankCursor {
            attempt: view.current_attempt,
            offset: 0,
        };
    }
    start
}

/// The backward search for the start of a log's last lines, fed the log's pages from
/// its end.
#[derive(Debug)]
struct BackScan {
    /// Lines still to find.
    need: u64,
    /// Where the last whole line ends: the log's end when complete, else after its last
    /// newline (found in the first page read).
    end: Option<u64>,
    /// The earliest line start counted so far: where a scan cut short starts.
    earliest: Option<u64>,
}

impl BackScan {
    fn new(need: u64, size: u64, complete: bool) -> Self {
        BackScan {
            need,
            end: complete.then_some(size),
            earliest: None,
        }
    }

    /// Takes the page of the log at `lo` (read backwards: each page ends where the
    /// previous one began; bytes the agent left out after a page's last newline hold
    /// none). `Some(offset)` once the start of the `need`th last line is found.
    fn page(&mut self, lo: u64, body: &[u8]) -> Option<u64> {
        for (i, b) in body.iter().enumerate().rev() {
            if *b != b'\n' {
                continue;
            }
            let line_start = lo + i as u64 + 1;
            match self.end {
                None => self.end = Some(line_start),
                Some(e) if line_start < e && self.need > 0 => {
                    self.earliest = Some(line_start);
                    self.need -= 1;
                    if self.need == 0 {
                        return Some(line_start);
                    }
                }
                Some(_) => {}
            }
        }
        None
    }

    /// The log's first line (at 0) counts too: `Some(0)` when it is the last one needed.
    fn at_start(&mut self) -> Option<u64> {
        if self.need > 0 && self.end.is_some_and(|e| e > 0) {
            self.need -= 1;
            if self.need == 0 {
                return Some(0);
            }
        }
        None
    }
}

/// Reads one attempt's log backwards from its end (`size`, `complete`) for the start of
/// its last `need` lines. `Some(offset)` when found (or the scan budget ran out there);
/// `None` when the attempt holds fewer lines: `need` is lowered by what it holds.
async fn scan_back(
    node: &Node,
    at: (&str, &str),
    (job_id, rank): (&str, u32),
    attempt: u32,
    (size, complete): (u64, bool),
    need: &mut u64,
    budget: &mut u64,
) -> Option<u64> {
    if *need == 0 {
        return Some(if complete {
            size
        } else {
            last_line_end(node, at, (job_id, rank), attempt, size).await
        });
    }
    let mut scan = BackScan::new(*need, size, complete);
    let mut hi = size;
    let found = loop {
        if hi == 0 {
            break scan.at_start();
        }
        if *budget == 0 {
            break Some(scan.earliest.unwrap_or(hi));
        }
        let lo = hi.saturating_sub(CHUNK_BYTES.min(*budget));
        let c = RankCursor {
            attempt,
            offset: lo,
        };
        let body = match fetch_bounded(node, at, (job_id, rank), c, hi - lo).await {
            Fetch::Chunk { body, .. } => body,
            _ => break Some(scan.earliest.unwrap_or(hi)),
        };
        *budget = budget.saturating_sub(hi - lo);
        if let Some(start) = scan.page(lo, &body) {
            break Some(start);
        }
        hi = lo;
    };
    *need = scan.need;
    found
}

/// Where an unfinished log's last whole line ends (for `tail=0`): after its last newline
/// within the last [`CHUNK_BYTES`], else `size` less that chunk.
async fn last_line_end(
    node: &Node,
    at: (&str, &str),
    (job_id, rank): (&str, u32),
    attempt: u32,
    size: u64,
) -> u64 {
    let lo = size.saturating_sub(CHUNK_BYTES);
    let c = RankCursor {
        attempt,
        offset: lo,
    };
    match fetch_bounded(node, at, (job_id, rank), c, size - lo).await {
        Fetch::Chunk { body, .. } => body
            .iter()
            .rposition(|b| *b == b'\n')
            .map_or(lo, |i| lo + i as u64 + 1),
        _ => lo,
    }
}

struct RankView {
    current_attempt: u32,
    attempt_workers: Vec<(u32, String)>,
    /// An elastic job's rank a shrink removed (or a rank past its current size): it gets
    /// no new attempt, so its last one, once read, is its end.
    removed: bool,
}

impl RankView {
    /// The view of a rank the job does not have now: the attempts it had before a
    /// shrink removed it (none for a rank it never had).
    fn removed(attempt_workers: Vec<(u32, String)>) -> Self {
        Self {
            current_attempt: attempt_workers.iter().map(|(a, _)| *a).max().unwrap_or(0),
            attempt_workers,
            removed: true,
        }
    }
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
    let terminal = terminal || view.removed;
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

/// A job's ranks and the workers' addresses, as the applied state has them now.
type JobView = (
    bool,
    BTreeMap<u32, RankView>,
    BTreeMap<String, (String, WorkerState)>,
);

/// Whether job `job_id` is over, its ranks' attempts and where they ran; `None` once the
/// job is gone.
fn job_view(node: &Node, job_id: &str) -> Option<JobView> {
    node.read_state(|s| {
        s.jobs.get(job_id).map(|j| {
            let views: BTreeMap<u32, RankView> = j
                .ranks
                .iter()
                .map(|r| {
                    (
                        r.rank,
                        RankView {
                            current_attempt: r.attempt,
                            attempt_workers: r.attempt_workers.clone(),
                            removed: false,
                        },
                    )
                })
                .chain(
                    j.removed_rank_workers
                        .iter()
                        .filter(|(rank, _)| **rank >= j.world_size())
                        .map(|(rank, aw)| (*rank, RankView::removed(aw.clone()))),
                )
                .collect();
            let workers: BTreeMap<String, (String, WorkerState)> = s
                .workers
                .values()
                .map(|w| (w.worker_id.clone(), (w.http_addr.clone(), w.state)))
                .collect();
            (j.state.is_terminal(), views, workers)
        })
    })
}

async fn pump(
    node: Arc<Node>,
    job_id: String,
    mut cursor: BTreeMap<u32, RankCursor>,
    opts: PumpOpts,
    tx: mpsc::Sender<Result<Event, Infallible>>,
) {
    let PumpOpts {
        follow, since_ms, ..
    } = opts;
    let ranks: Vec<u32> = cursor.keys().copied().collect();
    if let Some(n) = opts.tail {
        let Some((_, views, workers)) = job_view(&node, &job_id) else {
            return;
        };
        for rank in &ranks {
            if let Some(view) = views.get(rank) {
                let start = tail_start(&node, &job_id, *rank, view, &workers, n).await;
                cursor.insert(*rank, start);
            }
        }
    }
    loop {
        let Some((terminal, views, workers)) = job_view(&node, &job_id) else {
            return;
        };
        let mut progressed = false;
        let mut done = 0usize;
        for rank in &ranks {
            let none = RankView::removed(Vec::new());
            match poll_rank(
                &node,
                &job_id,
                *rank,
                views.get(rank).unwrap_or(&none),
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

    /// The start of a log's last `need` lines, read backwards in pages of `page` bytes
    /// (an unfinished log's pages cut after their last newline, as the agent cuts them).
    fn tail_of(log: &[u8], complete: bool, need: u64, page: usize) -> (Option<u64>, u64) {
        let mut scan = BackScan::new(need, log.len() as u64, complete);
        let mut hi = log.len();
        loop {
            if hi == 0 {
                return (scan.at_start(), scan.need);
            }
            let lo = hi.saturating_sub(page);
            let mut body = &log[lo..hi];
            if !complete {
                body = match body.iter().rposition(|b| *b == b'\n') {
                    Some(i) => &body[..=i],
                    None => &[],
                };
            }
            if let Some(start) = scan.page(lo as u64, body) {
                return (Some(start), scan.need);
            }
            hi = lo;
        }
    }

    #[test]
    fn the_last_lines_are_found_backwards_across_pages() {
        let log = b"one\ntwo\nthree\nfour\n";
        for page in [1, 3, 4, 100] {
            assert_eq!(tail_of(log, true, 1, page), (Some(14), 0), "page {page}");
            assert_eq!(tail_of(log, true, 2, page), (Some(8), 0), "page {page}");
            assert_eq!(tail_of(log, true, 4, page), (Some(0), 0), "page {page}");
            // Fewer lines than asked: the caller goes on with an earlier attempt.
            assert_eq!(tail_of(log, true, 6, page), (None, 2), "page {page}");
        }
        // A complete log whose last line has no newline: that line counts.
        assert_eq!(tail_of(b"a\nbb", true, 1, 2), (Some(2), 0));
        assert_eq!(tail_of(b"a\nbb", true, 2, 2), (Some(0), 0));
        // An unfinished log: its partial last line does not count (it streams once
        // complete), nor does anything after its last newline.
        assert_eq!(tail_of(b"a\nbb\ncc", false, 1, 2), (Some(2), 0));
        assert_eq!(tail_of(b"a\nbb\ncc", false, 2, 3), (Some(0), 0));
        assert_eq!(tail_of(b"partial", false, 1, 3), (None, 1));
        assert_eq!(tail_of(b"", true, 1, 3), (None, 1));
    }
}
