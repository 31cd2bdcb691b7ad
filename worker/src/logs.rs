//! Attempt logs: capture of a rank's output (stdout and stderr share one pipe) into one capped
//! record that marks a log complete, and paged reads for the agent's HTTP API.
//!
//! Layout under the agent's data dir:
//! ```text
//! <data-dir>/logs/<job>/rank-<r>/attempt-<a>.log    combined stdout + stderr
//! <data-dir>/logs/<job>/rank-<r>/attempt-<a>.times  "<offset> <unix ms>" lines
//! <data-dir>/logs/<job>/rank-<r>/attempt-<a>.exit   {"exit_code": .., "signal": ..}
//! ```
//! The time index (`.times`) gets one line per flush of new output, at most one per
//! [`TIME_MARK_INTERVAL_MS`]: the log's size before that output and the agent's clock.
//! The output between two marks was flushed within an interval of the first, so
//! `since_ms` reads ([`offset_since`]) start at the first mark less than an interval
//! before the time asked: no line after it is missed, and at most an interval of
//! earlier lines is shown.
//! The exit record is written (temp file, fsync, rename, fsync of the directory) only after
//! the process exited and its output pipe was drained into the log, so its presence means the
//! log is complete and will never change again.

use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;

use nix::poll::{PollFd, PollFlags, PollTimeout};

use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
use tokio::sync::mpsc;

use cumulus_api::AttemptKey;
use cumulus_api::ids::{self, IdError};

/// Most bytes one read of a log may ask for (docs/architecture.md: `max_bytes` ≤ 1 MiB).
pub const MAX_READ_BYTES: u64 = 1 << 20;
/// A line longer than this is written in pieces of this size (bounds the memory a rank
/// that writes without newlines can make the agent hold).
pub const LINE_PIECE_MAX_BYTES: usize = 64 * 1024;
/// Bytes read from a pipe at a time (Linux's default pipe buffer is 64 KiB).
const PIPE_READ_BYTES: usize = 64 * 1024;
/// How long a pipe pump waits before its next read after a small read, in milliseconds
/// (see [`pump_lines`]).
pub const LOG_COALESCE_MS: u16 = 5;
/// Stack of a pump thread (its buffers are on the heap).
const PUMP_STACK_BYTES: usize = 128 * 1024;
/// Largest exit record accepted when reading one back.
const MAX_EXIT_RECORD_BYTES: u64 = 64 * 1024;
/// Least time between two marks of a log's time index, in milliseconds.
pub const TIME_MARK_INTERVAL_MS: u64 = 1_000;
/// Most bytes of a time index read back (a mark a second for over a week); the marks
/// past it are not used (a `since_ms` read then starts at the last mark read).
const MAX_TIME_INDEX_BYTES: u64 = 16 << 20;

/// The line written once when a log reaches its cap (`at` = the log's size before it).
pub fn truncation_marker(at_bytes: u64) -> String {
    format!("[cumulus: log truncated at {at_bytes} bytes]\n")
}

/// Where one attempt's log and exit record live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptPaths {
    /// `<data-dir>/logs/<job>/rank-<r>`.
    pub dir: PathBuf,
    /// `<dir>/attempt-<a>.log`.
    pub log: PathBuf,
    /// `<dir>/attempt-<a>.exit`.
    pub exit: PathBuf,
    /// `<dir>/attempt-<a>.times`: the log's time index.
    pub times: PathBuf,
}

impl AttemptPaths {
    /// Paths of `key` under `data_dir`; fails when the job id is not a safe path component.
    pub fn new(data_dir: &Path, key: &AttemptKey) -> Result<Self, IdError> {
        ids::check_job_id(&key.job_id)?;
        let dir = data_dir
            .join("logs")
            .join(&key.job_id)
            .join(format!("rank-{}", key.rank));
        Ok(Self {
            log: dir.join(format!("attempt-{}.log", key.attempt)),
            exit: dir.join(format!("attempt-{}.exit", key.attempt)),
            times: dir.join(format!("attempt-{}.times", key.attempt)),
            dir,
        })
    }
}

/// How an attempt ended: the content of `attempt-<a>.exit`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitRecord {
    /// Exit code when the process exited normally.
    pub exit_code: Option<i32>,
    /// Signal number when the process was killed by a signal.
    pub signal: Option<i32>,
    /// Why the process never ran (then neither of the above is set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spawn_error: Option<String>,
    /// With `spawn_error`: the agent lacked a resource of its own (descriptors, memory,
    /// disk, process slots); not the rank's failure ([`is_agent_resource_error`]). With
    /// exit code [`cumulus_api::rank_env::EXIT_AGENT_UNREACHABLE`]: the rank could not
    /// reach the agent's rank-local API, and `agent_evidence` says why that was the
    /// agent's doing.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub agent_fault: bool,
    /// With `agent_fault` and exit code `EXIT_AGENT_UNREACHABLE`: what the agent saw of
    /// its rank-local API during the attempt ([`crate::supervisor::RankApiWatch`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_evidence: Option<String>,
    /// No restart can fix this: with `spawn_error`, the program cannot be executed
    /// ([`is_exec_error`]) or its environment could not be built; with exit code
    /// [`cumulus_api::rank_env::EXIT_CANNOT_RUN`], the rank found it cannot run here.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exec_failed: bool,
    /// What the process died of, in one line of at most
    /// [`cumulus_api::limits::MAX_EXIT_CAUSE_BYTES`] (see
    /// [`crate::supervisor::Supervisor::record_exception`] and [`OutputTail::cause`]);
    /// `None` for a clean exit, a stop the agent asked for, or no line to tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<String>,
}

/// Whether `e`, from starting a rank's program, says the program cannot be executed at
/// all: missing (`ENOENT`), not executable or not permitted (`EACCES`), or not a valid
/// executable (`ENOEXEC`). The same command fails the same way on every restart.
pub fn is_exec_error(e: &io::Error) -> bool {
    use nix::errno::Errno;
    e.raw_os_error().is_some_and(|code| {
        [Errno::ENOENT, Errno::EACCES, Errno::ENOEXEC]
            .iter()
            .any(|errno| *errno as i32 == code)
    })
}

/// Whether `e` is the agent's own lack of a resource rather than something about the
/// rank: no file descriptors (`EMFILE`, `ENFILE`), memory (`ENOMEM`), disk (`ENOSPC`,
/// `EDQUOT`) or process slots (`EAGAIN` from fork). A rank whose attempt could not start
/// for one of these spends none of its job's restart budget.
pub fn is_agent_resource_error(e: &io::Error) -> bool {
    use nix::errno::Errno;
    e.raw_os_error().is_some_and(|code| {
        [
            Errno::EMFILE,
            Errno::ENFILE,
            Errno::ENOMEM,
            Errno::ENOSPC,
            Errno::EDQUOT,
            Errno::EAGAIN,
        ]
        .iter()
        .any(|errno| *errno as i32 == code)
    })
}

impl ExitRecord {
    /// The record of a process that ran and ended with `status`; an exit with
    /// [`cumulus_api::rank_env::EXIT_CANNOT_RUN`] is one no restart can fix
    /// (`exec_failed`: the leader fails the job at once).
    pub fn from_status(status: ExitStatus) -> Self {
        Self {
            exit_code: status.code(),
            signal: status.signal(),
            spawn_error: None,
            agent_fault: false,
            agent_evidence: None,
            exec_failed: status.code() == Some(cumulus_api::rank_env::EXIT_CANNOT_RUN),
            cause: None,
        }
    }

    /// The record of an attempt whose process could not be started.
    pub fn spawn_failed(error: impl Into<String>) -> Self {
        Self {
            exit_code: None,
            signal: None,
            spawn_error: Some(error.into()),
            agent_fault: false,
            agent_evidence: None,
            exec_failed: false,
            cause: None,
        }
    }

    /// The record of an attempt the agent could not start for lack of a resource of its
    /// own (see [`is_agent_resource_error`]).
    pub fn agent_failed(error: impl Into<String>) -> Self {
        Self {
            agent_fault: true,
            ..Self::spawn_failed(error)
        }
    }

    /// [`ExitRecord::agent_failed`] when `e` is an agent resource error, else
    /// [`ExitRecord::spawn_failed`].
    pub fn start_failed(message: impl Into<String>, e: &io::Error) -> Self {
        if is_agent_resource_error(e) {
            Self::agent_failed(message)
        } else {
            Self::spawn_failed(message)
        }
    }

    /// Exactly one of exit code, signal and spawn error is set; else which rule fails.
    fn check(&self) -> Result<(), &'static str> {
        match (self.exit_code, self.signal, &self.spawn_error) {
            (Some(_), Some(_), _) => Err("both exit_code and signal are set"),
            (Some(_), None, None) | (None, Some(_), None) | (None, None, Some(_)) => Ok(()),
            (None, None, None) => Err("none of exit_code, signal, spawn_error is set"),
            _ => Err("spawn_error is set together with an exit status"),
        }
    }
}

/// Lines of a rank's output an [`OutputTail`] keeps.
pub const TAIL_MAX_LINES: usize = 20;
/// Bytes of a rank's output an [`OutputTail`] keeps (its lines, each cut to this).
pub const TAIL_MAX_BYTES: usize = 4 * 1024;

/// The last lines of a rank's output (stdout and stderr share its pipe), at most
/// [`TAIL_MAX_LINES`] lines and [`TAIL_MAX_BYTES`] bytes: what a program that prints
/// its error and exits (a Python error before the runtime loads, `python trian.py`'s
/// "can't open file", any other program's message) died of ([`OutputTail::cause`]).
#[derive(Debug, Default, Clone)]
pub struct OutputTail {
    lines: std::collections::VecDeque<String>,
    bytes: usize,
}

impl OutputTail {
    /// Takes in one chunk of output (whole lines, or a piece of a long line), keeping
    /// only the newest lines within the bounds; invalid UTF-8 is replaced.
    pub fn push(&mut self, chunk: &[u8]) {
        // This runs on every chunk a rank prints: only the chunk's newest lines can be
        // kept, so the older ones are skipped without a copy.
        let newest: Vec<&[u8]> = chunk
            .rsplit(|&b| b == b'\n')
            .filter(|raw| !raw.trim_ascii().is_empty())
            .take(TAIL_MAX_LINES)
            .collect();
        for raw in newest.into_iter().rev() {
            let piece = &raw[..raw.len().min(TAIL_MAX_BYTES)];
            let line = String::from_utf8_lossy(piece).trim_end().to_string();
            if line.trim().is_empty() {
                continue;
            }
            self.bytes += line.len();
            self.lines.push_back(line);
            while self.lines.len() > TAIL_MAX_LINES || self.bytes > TAIL_MAX_BYTES {
                match self.lines.pop_front() {
                    Some(old) => self.bytes -= old.len(),
                    None => break,
                }
            }
        }
    }

    /// The kept lines, oldest first.
    pub fn lines(&self) -> impl Iterator<Item = &str> {
        self.lines.iter().map(String::as_str)
    }

    /// The cause of an exit, in one printable line of at most
    /// [`cumulus_api::limits::MAX_EXIT_CAUSE_BYTES`]: when the kept lines hold a Python
    /// traceback, the exception line that ends the last one, with its innermost frame's
    /// file base name and line (`ValueError: bad lr (train.py:42)`), even when output
    /// follows it (Python flushes a block-buffered stdout after printing the traceback
    /// on stderr, and both share the rank's pipe); otherwise the output's last non-blank
    /// line. `None` when the process printed nothing.
    pub fn cause(&self) -> Option<String> {
        let max = cumulus_api::limits::MAX_EXIT_CAUSE_BYTES;
        if let Some((exception, at)) = self.python_exception() {
            let suffix = format!(" ({})", cumulus_api::text::bounded_line(&at, max / 4));
            let head = cumulus_api::text::bounded_line(exception, max - suffix.len());
            return Some(format!("{head}{suffix}"));
        }
        let last = self.lines.back()?;
        Some(cumulus_api::text::bounded_line(last, max))
    }

    /// The exception line of the last Python traceback kept (the first unindented line
    /// after its `Traceback (most recent call last):` header and frames) and its
    /// innermost frame as `file:line`; `None` without a complete traceback.
    fn python_exception(&self) -> Option<(&str, String)> {
        let header = self
            .lines
            .iter()
            .rposition(|l| l == "Traceback (most recent call last):")?;
        let mut location = None;
        for line in self.lines.iter().skip(header + 1) {
            if line.starts_with(' ') {
                if let Some(at) = python_frame(line) {
                    location = Some(at);
                }
            } else {
                return location.map(|at| (line.as_str(), at));
            }
        }
        None
    }
}

/// `train.py:42` from a Python traceback's frame line `  File "/w/train.py", line 42,
/// in main`; `None` for any other line.
fn python_frame(line: &str) -> Option<String> {
    let rest = line.strip_prefix("  File \"")?;
    let (path, rest) = rest.split_once("\", line ")?;
    let number: String = rest.chars().take_while(char::is_ascii_digit).collect();
    if number.is_empty() {
        return None;
    }
    let file = path.rsplit('/').next().unwrap_or(path);
    Some(format!("{file}:{number}"))
}

/// Writes `record` to `path` atomically: temp file, fsync, rename, fsync of the directory.
pub async fn write_exit_record(path: &Path, record: &ExitRecord) -> io::Result<()> {
    let json = serde_json::to_vec(record).map_err(io::Error::other)?;
    let tmp = path.with_extension("exit.tmp");
    let mut file = tokio::fs::File::create(&tmp).await?;
    file.write_all(&json).await?;
    file.sync_all().await?;
    drop(file);
    tokio::fs::rename(&tmp, path).await?;
    if let Some(dir) = path.parent() {
        tokio::fs::File::open(dir).await?.sync_all().await?;
    }
    Ok(())
}

/// Errors reading back an exit record.
#[derive(Debug, Error)]
pub enum ExitRecordError {
    /// The file could not be read.
    #[error("cannot read exit record {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The file exists but does not hold a valid record.
    #[error("invalid exit record {path}: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
}

/// Reads and validates an exit record; `Ok(None)` when there is none.
pub async fn read_exit_record(path: &Path) -> Result<Option<ExitRecord>, ExitRecordError> {
    let io_err = |source| ExitRecordError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = match tokio::fs::File::open(path).await {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(e)),
    };
    let mut bytes = Vec::new();
    file.take(MAX_EXIT_RECORD_BYTES + 1)
        .read_to_end(&mut bytes)
        .await
        .map_err(io_err)?;
    let invalid = |reason: String| ExitRecordError::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.len() as u64 > MAX_EXIT_RECORD_BYTES {
        return Err(invalid(format!(
            "larger than {MAX_EXIT_RECORD_BYTES} bytes"
        )));
    }
    let record: ExitRecord = serde_json::from_slice(&bytes).map_err(|e| invalid(e.to_string()))?;
    record.check().map_err(|why| invalid(why.to_owned()))?;
    Ok(Some(record))
}

/// Appends an attempt's output to its log file, up to a cap.
///
/// A chunk that would take the file past `max_bytes` is cut after its last whole line that
/// fits; one [`truncation_marker`] line follows and every later chunk is dropped, so the
/// file never exceeds `max_bytes` plus the marker line.
#[derive(Debug)]
pub struct LogWriter {
    file: tokio::fs::File,
    size_bytes: u64,
    max_bytes: u64,
    truncated: bool,
    /// Appended bytes not yet written: one `write_all` per flush instead of one per line
    /// (each tokio file write is a blocking-pool round trip, ~50 µs). Bounded by what
    /// the caller appends between flushes (a batch of at most `LOG_BATCH_CHUNKS` chunks of
    /// at most 64 KiB each).
    pending: Vec<u8>,
    /// The time index (`.times` beside the log); `None` when it could not be created
    /// or written (the log goes on without it: `since_ms` reads then start earlier).
    times: Option<tokio::fs::File>,
    /// Agent clock of the last time mark, in ms since the Unix epoch.
    last_mark_ms: Option<u64>,
}

/// The agent's clock, in ms since the Unix epoch (0 if it is before it).
fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl LogWriter {
    /// Creates (or empties) the log at `path`, creating its directory.
    pub async fn create(path: &Path, max_bytes: u64) -> io::Result<Self> {
        if let Some(dir) = path.parent() {
            tokio::fs::create_dir_all(dir).await?;
        }
        let file = tokio::fs::File::create(path).await?;
        let times = match tokio::fs::File::create(path.with_extension("times")).await {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::warn!(log = %path.display(), "cannot create the log's time index: {e}");
                None
            }
        };
        Ok(Self {
            file,
            size_bytes: 0,
            max_bytes,
            pending: Vec::new(),
            truncated: false,
            times,
            last_mark_ms: None,
        })
    }

    /// Appends one chunk (whole lines, or a piece of a long line); when the chunk does not
    /// fit under the cap, its whole lines that do fit and then the marker (nothing after
    /// it). Call [`LogWriter::flush`] to make appended bytes visible to readers.
    pub async fn append(&mut self, chunk: &[u8]) -> io::Result<()> {
        if self.truncated || chunk.is_empty() {
            return Ok(());
        }
        if self.size_bytes + chunk.len() as u64 > self.max_bytes {
            let room = usize::try_from(self.max_bytes.saturating_sub(self.size_bytes))
                .unwrap_or(usize::MAX)
                .min(chunk.len());
            if let Some(last_newline) = chunk[..room].iter().rposition(|&b| b == b'\n') {
                self.pending.extend_from_slice(&chunk[..=last_newline]);
                self.size_bytes += last_newline as u64 + 1;
            }
            let marker = truncation_marker(self.size_bytes);
            self.pending.extend_from_slice(marker.as_bytes());
            self.size_bytes += marker.len() as u64;
            self.truncated = true;
            return Ok(());
        }
        self.pending.extend_from_slice(chunk);
        self.size_bytes += chunk.len() as u64;
        Ok(())
    }

    /// Hands every appended byte to the OS (one write for everything appended since the
    /// last flush).
    pub async fn flush(&mut self) -> io::Result<()> {
        if !self.pending.is_empty() {
            self.mark_time().await;
            self.file.write_all(&self.pending).await?;
            crate::metrics::metrics()
                .log_bytes
                .inc_by(self.pending.len() as u64);
            self.pending.clear();
        }
        self.file.flush().await
    }

    /// Adds a mark to the time index for the bytes about to be written, unless one was
    /// added less than [`TIME_MARK_INTERVAL_MS`] ago. A failed write drops the index (the
    /// log itself goes on).
    async fn mark_time(&mut self) {
        let now_ms = wall_ms();
        if self
            .last_mark_ms
            .is_some_and(|t| now_ms.saturating_sub(t) < TIME_MARK_INTERVAL_MS)
        {
            return;
        }
        let Some(times) = &mut self.times else {
            return;
        };
        let offset = self.size_bytes - self.pending.len() as u64;
        let line = format!("{offset} {now_ms}\n");
        let written = match times.write_all(line.as_bytes()).await {
            Ok(()) => times.flush().await,
            Err(e) => Err(e),
        };
        if let Err(e) = written {
            tracing::warn!("cannot write a log's time index (it is dropped): {e}");
            self.times = None;
            return;
        }
        self.last_mark_ms = Some(now_ms);
    }

    /// Flushes, fsyncs and closes the log; returns its final size in bytes.
    pub async fn finish(mut self) -> io::Result<u64> {
        self.flush().await?;
        if let Some(times) = &mut self.times
            && let Err(e) = times.flush().await
        {
            tracing::warn!("cannot write a log's time index: {e}");
        }
        self.file.sync_all().await?;
        Ok(self.size_bytes)
    }

    /// Bytes appended so far (marker included); all in the file after the next flush.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// Whether the cap was reached.
    pub fn truncated(&self) -> bool {
        self.truncated
    }
}

/// How a [`pump_lines`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PumpEnd {
    /// The pipe reached its end (every writer closed it); everything read was sent.
    Eof,
    /// `cancel` fired first; what was still in the pipe is left unread.
    Cancelled,
}

/// Reads `pipe` (a rank's output: its stdout and stderr share it) to its end on the calling
/// thread and sends its content on `tx` in chunks of whole lines. Meant for a thread of its
/// own ([`spawn_pump`]); blocks.
///
/// Each chunk is one or more complete lines, at most [`LINE_PIECE_MAX_BYTES`] long; a line
/// longer than that is sent in pieces of that size; an unterminated last line gets a
/// `\n`. (Whole lines are what a log page is cut at: see [`read_log`].)
///
/// **Wake-ups.** The pipe is read with blocking `poll`/`read` calls, never registered with
/// the async runtime's epoll: Linux wakes every epoll waiter of a pipe on *every* write
/// into it (`pipe_write`'s `poll_usage`), so a rank printing thousands of lines per second
/// would cost a runtime wake-up per line in the agent and an inter-processor wake-up per
/// line in the rank (issue 3, measurement 7). Here, after a small read (less than a quarter
/// of the pipe's capacity, `F_GETPIPE_SZ`: 16 KiB of Linux's default 64 KiB) the thread
/// waits [`LOG_COALESCE_MS`] before reading again, and a write into a pipe that nobody
/// waits on wakes no one: a rank printing lines costs one wake-up and one chunk per
/// interval, and a live tail sees a line at most that much later. The wait never makes the
/// rank block: it happens only while the rank writes less than a quarter of the pipe per
/// interval; a faster writer fills reads past that and is read without waits.
///
/// **Cancellation.** `cancel` is the read end of a pipe (or any fd) that becomes readable
/// or hangs up when the pump must stop (the agent gave up draining: [`PumpEnd::Cancelled`]).
/// When `tx`'s receiver is gone the pipe is still read to its end (and the data dropped),
/// so the rank never blocks or gets `EPIPE` because the agent stopped listening.
///
/// Errors: a failed `poll` or `read` of `pipe` (what was read before is sent).
pub fn pump_lines(
    pipe: impl Read + AsFd,
    tx: &mpsc::Sender<Vec<u8>>,
    cancel: BorrowedFd<'_>,
) -> io::Result<PumpEnd> {
    let mut pipe = pipe;
    let capacity_bytes = nix::fcntl::fcntl(pipe.as_fd(), nix::fcntl::FcntlArg::F_GETPIPE_SZ)
        .ok()
        .and_then(|c| usize::try_from(c).ok())
        .unwrap_or(PIPE_READ_BYTES);
    let coalesce_below_bytes = (capacity_bytes / 4).max(1);
    let mut buf = vec![0u8; PIPE_READ_BYTES];
    let mut pending: Vec<u8> = Vec::with_capacity(PIPE_READ_BYTES);
    let mut receiver_alive = true;
    loop {
        // Wait until the pipe has data (or its writers are gone) or we are cancelled.
        let mut fds = [
            PollFd::new(pipe.as_fd(), PollFlags::POLLIN),
            PollFd::new(cancel, PollFlags::POLLIN),
        ];
        poll_retrying(&mut fds, PollTimeout::NONE)?;
        if fds[1].any().unwrap_or(true) {
            return Ok(PumpEnd::Cancelled);
        }
        let n = loop {
            match pipe.read(&mut buf) {
                Ok(n) => break n,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => return Err(error),
            }
        };
        if n == 0 {
            break;
        }
        if receiver_alive {
            pending.extend_from_slice(&buf[..n]);
            while let Some(cut) = chunk_cut(&pending) {
                let chunk: Vec<u8> = pending.drain(..cut).collect();
                if tx.blocking_send(chunk).is_err() {
                    receiver_alive = false;
                    pending = Vec::new();
                    break;
                }
            }
        }
        if n < coalesce_below_bytes {
            // Coalescing wait; ends early only when cancelled.
            let mut cancel_only = [PollFd::new(cancel, PollFlags::POLLIN)];
            poll_retrying(&mut cancel_only, PollTimeout::from(LOG_COALESCE_MS))?;
            if cancel_only[0].any().unwrap_or(true) {
                return Ok(PumpEnd::Cancelled);
            }
        }
    }
    if receiver_alive && !pending.is_empty() {
        pending.push(b'\n');
        // The receiver may be gone by now; the data then has nowhere to go.
        let _ = tx.blocking_send(pending);
    }
    Ok(PumpEnd::Eof)
}

/// `poll`, retried on `EINTR`.
fn poll_retrying(fds: &mut [PollFd<'_>], timeout: PollTimeout) -> io::Result<()> {
    loop {
        match nix::poll::poll(fds, timeout) {
            Ok(_) => return Ok(()),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(errno) => return Err(io::Error::from(errno)),
        }
    }
}

/// A pipe to stop pumps with: `(read end for `cancel`, write end)`; dropping the write end
/// cancels every pump polling the read end. Both ends are close-on-exec, and the pipe is
/// shrunk to one page (it never carries data), so it counts little against the user's
/// pipe-buffer quota (`/proc/sys/fs/pipe-user-pages-soft`).
///
/// Errors: the pipe cannot be created.
pub fn cancel_pipe() -> io::Result<(OwnedFd, io::PipeWriter)> {
    let (read_end, write_end) = io::pipe()?;
    let page_bytes = 4096;
    // Best effort: a pipe that keeps its default size works the same.
    let _ = nix::fcntl::fcntl(&write_end, nix::fcntl::FcntlArg::F_SETPIPE_SZ(page_bytes));
    Ok((OwnedFd::from(read_end), write_end))
}

/// Starts [`pump_lines`] on a thread of its own named `name`, for a rank's output `pipe`
/// (blocking mode, never registered with the async runtime); it ends at the pipe's end or when
/// `cancel` fires, dropping its `tx` (so the receiver sees the end once every pump ended).
/// A read error is logged once, here, and ends the pump like the pipe's end.
///
/// Errors: the thread cannot be created.
pub fn spawn_pump(
    name: String,
    pipe: OwnedFd,
    tx: mpsc::Sender<Vec<u8>>,
    cancel: OwnedFd,
) -> io::Result<()> {
    std::thread::Builder::new()
        .name(name)
        .stack_size(PUMP_STACK_BYTES)
        .spawn(move || {
            let pipe = std::fs::File::from(pipe);
            if let Err(error) = pump_lines(&pipe, &tx, cancel.as_fd()) {
                tracing::warn!(%error, "reading a rank's output failed; capture of that pipe ends");
            }
        })
        .map(drop)
}

/// Where the next chunk of `pending` ends: after its last `\n` within the first
/// [`LINE_PIECE_MAX_BYTES`], or at that length when no line ends within it (a piece of a
/// long line); `None` while `pending` holds less than that and no complete line.
fn chunk_cut(pending: &[u8]) -> Option<usize> {
    let window = &pending[..pending.len().min(LINE_PIECE_MAX_BYTES)];
    match window.iter().rposition(|&b| b == b'\n') {
        Some(i) => Some(i + 1),
        None if pending.len() >= LINE_PIECE_MAX_BYTES => Some(LINE_PIECE_MAX_BYTES),
        None => None,
    }
}

/// One page of a log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogChunk {
    /// Where `data` starts in the log: the offset asked, or for a first read since a
    /// time, where the time index says that output begins.
    pub offset: u64,
    /// Bytes `[offset, offset + data.len())` of the log.
    pub data: Vec<u8>,
    /// Size of the log file when it was read, in bytes.
    pub size_bytes: u64,
    /// true when the attempt's exit record exists: the log will not change any more.
    pub complete: bool,
}

/// Why a log page could not be read.
#[derive(Debug, Error)]
pub enum ReadLogError {
    /// The agent has no log for this attempt.
    #[error("no log for this attempt")]
    NotFound,
    /// `offset` is beyond the current end of the log.
    #[error("offset {offset} is past the end of the log ({size_bytes} bytes)")]
    OffsetPastEnd {
        /// The requested offset.
        offset: u64,
        /// The log's size.
        size_bytes: u64,
    },
    /// `max_bytes` is 0 or above [`MAX_READ_BYTES`].
    #[error("max_bytes must be 1..={MAX_READ_BYTES}, got {0}")]
    BadMaxBytes(u64),
    /// Reading failed.
    #[error("cannot read log: {0}")]
    Io(#[from] io::Error),
}

/// The offset a read of the log's output since `since_ms` (agent clock, ms since the
/// Unix epoch) starts at ([`start_offset`]; 0 without an index, `u64::MAX` when all of
/// it is older).
///
/// # Errors
/// The index exists but cannot be read.
pub async fn offset_since(paths: &AttemptPaths, since_ms: u64) -> io::Result<u64> {
    let file = match tokio::fs::File::open(&paths.times).await {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut text = Vec::new();
    file.take(MAX_TIME_INDEX_BYTES)
        .read_to_end(&mut text)
        .await?;
    Ok(start_offset(&text, since_ms))
}

/// [`offset_since`] over the index's bytes. The output between two marks was flushed
/// within [`TIME_MARK_INTERVAL_MS`] of the first (a flush after that adds a mark), so the
/// read starts at the first mark less than an interval before `since_ms`; `u64::MAX`
/// (the end of the log) when every mark is older than that. A mark that does not parse,
/// or whose offset or time goes back, or an index cut at its read limit, ends it: the
/// read then starts at the last good mark (never skipping output).
fn start_offset(index: &[u8], since_ms: u64) -> u64 {
    let mut last_good = 0;
    let mut last: Option<(u64, u64)> = None;
    let lines = index.strip_suffix(b"\n").unwrap_or(index);
    if lines.is_empty() {
        return 0;
    }
    for line in lines.split(|b| *b == b'\n') {
        let Some((offset, at_ms)) = std::str::from_utf8(line)
            .ok()
            .and_then(|l| l.split_once(' '))
            .and_then(|(o, t)| Some((o.parse::<u64>().ok()?, t.parse::<u64>().ok()?)))
        else {
            return last_good;
        };
        if last.is_some_and(|(o, t)| offset < o || at_ms < t) {
            return last_good;
        }
        if at_ms.saturating_add(TIME_MARK_INTERVAL_MS) > since_ms {
            return offset;
        }
        last = Some((offset, at_ms));
        last_good = offset;
    }
    if index.len() >= MAX_TIME_INDEX_BYTES as usize || !index.ends_with(b"\n") {
        last_good
    } else {
        u64::MAX
    }
}

/// Reads up to `max_bytes` of an attempt's log from `offset`.
///
/// Unless the log is complete, the page is cut after its last `\n` so that a reader never
/// sees half a line that is still being written; a page that holds no `\n` at all but is
/// `max_bytes` long is returned whole (a line longer than a page is delivered in pieces).
/// `offset == size` gives an empty page.
pub async fn read_log(
    paths: &AttemptPaths,
    offset: u64,
    max_bytes: u64,
    since_ms: Option<u64>,
) -> Result<LogChunk, ReadLogError> {
    if max_bytes == 0 || max_bytes > MAX_READ_BYTES {
        return Err(ReadLogError::BadMaxBytes(max_bytes));
    }
    // Completeness first: if the exit record exists now, the size read below is final.
    let complete = tokio::fs::try_exists(&paths.exit).await?;
    let mut file = match tokio::fs::File::open(&paths.log).await {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(ReadLogError::NotFound),
        Err(e) => return Err(e.into()),
    };
    let size_bytes = file.metadata().await?.len();
    if offset > size_bytes {
        return Err(ReadLogError::OffsetPastEnd { offset, size_bytes });
    }
    // A first read of the output since a time starts where the time index says.
    let offset = match since_ms {
        Some(since) if offset == 0 => offset_since(paths, since).await?.min(size_bytes),
        _ => offset,
    };
    let want = max_bytes.min(size_bytes - offset);
    let mut data = Vec::with_capacity(want as usize);
    file.seek(io::SeekFrom::Start(offset)).await?;
    file.take(want).read_to_end(&mut data).await?;
    if !complete {
        match data.iter().rposition(|&b| b == b'\n') {
            Some(i) => data.truncate(i + 1),
            None if data.len() as u64 == max_bytes => {}
            None => data.clear(),
        }
    }
    Ok(LogChunk {
        offset,
        data,
        size_bytes,
        complete,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_output_tail_keeps_the_last_lines_and_names_the_cause() {
        let mut tail = OutputTail::default();
        assert_eq!(tail.cause(), None);
        tail.push(b"step 1\n\n");
        tail.push(b"error: disk \x1b[31mfull\n");
        assert_eq!(tail.cause().as_deref(), Some("error: disk \\u{1b}[31mfull"));
        for i in 0..100 {
            tail.push(format!("line {i}\n").as_bytes());
        }
        assert_eq!(tail.lines().count(), TAIL_MAX_LINES);
        assert_eq!(tail.lines().next(), Some("line 80"));
        tail.push(&vec![b'x'; 3 * TAIL_MAX_BYTES]);
        assert!(tail.lines().map(str::len).sum::<usize>() <= TAIL_MAX_BYTES);
        let cause = tail.cause().expect("a cause");
        assert!(
            cause.len() <= cumulus_api::limits::MAX_EXIT_CAUSE_BYTES,
            "{}",
            cause.len()
        );

        let mut python = OutputTail::default();
        python.push(
            b"Traceback (most recent call last):\n  File \"/w/work/train.py\", line 42, in <module>\n    main()\n  File \"/w/work/lib.py\", line 7, in main\n    raise ValueError(\"bad lr\")\nValueError: bad lr\n",
        );
        assert_eq!(
            python.cause().as_deref(),
            Some("ValueError: bad lr (lib.py:7)")
        );
        // Python's block-buffered stdout reaches the pipe after the traceback.
        let mut buffered = OutputTail::default();
        buffered.push(b"Traceback (most recent call last):\n  File \"<string>\", line 1, in <module>\nValueError: bad lr\nuid 60002\nstep 3\n");
        assert_eq!(
            buffered.cause().as_deref(),
            Some("ValueError: bad lr (<string>:1)")
        );
        // A traceback cut off at the front of the tail, or without its exception line,
        // is not one: the last line stands.
        let mut partial = OutputTail::default();
        partial.push(b"  File \"/w/a.py\", line 3, in f\nfatal: out of memory\n");
        assert_eq!(partial.cause().as_deref(), Some("fatal: out of memory"));
        let mut missing = OutputTail::default();
        missing
            .push(b"python3: can't open file '/w/trian.py': [Errno 2] No such file or directory\n");
        assert_eq!(
            missing.cause().as_deref(),
            Some("python3: can't open file '/w/trian.py': [Errno 2] No such file or directory")
        );
    }

    #[test]
    fn only_the_agents_own_lack_of_a_resource_is_an_agent_fault() {
        let os = io::Error::from_raw_os_error;
        for errno in [
            nix::errno::Errno::EMFILE,
            nix::errno::Errno::ENFILE,
            nix::errno::Errno::ENOSPC,
        ] {
            let e = os(errno as i32);
            assert!(is_agent_resource_error(&e), "{e}");
            assert!(ExitRecord::start_failed("x", &e).agent_fault);
        }
        for errno in [
            nix::errno::Errno::ENOENT,
            nix::errno::Errno::EACCES,
            nix::errno::Errno::ENOEXEC,
        ] {
            let e = os(errno as i32);
            assert!(!is_agent_resource_error(&e), "{e}");
            assert!(!ExitRecord::start_failed("x", &e).agent_fault);
        }
        assert!(!is_agent_resource_error(&io::Error::other("no errno")));
    }

    #[test]
    fn an_exit_with_code_cannot_run_is_one_no_restart_fixes() {
        let code = cumulus_api::rank_env::EXIT_CANNOT_RUN;
        let cannot = ExitRecord::from_status(ExitStatus::from_raw(code << 8));
        assert_eq!(cannot.exit_code, Some(code));
        assert!(cannot.exec_failed && cannot.spawn_error.is_none());
        assert!(cannot.check().is_ok());
        for other in [ExitStatus::from_raw(1 << 8), ExitStatus::from_raw(9)] {
            assert!(!ExitRecord::from_status(other).exec_failed);
        }
    }

    fn paths(dir: &Path) -> AttemptPaths {
        AttemptPaths::new(dir, &AttemptKey::new("job-000001", 2, 3)).expect("paths")
    }

    #[test]
    fn layout() {
        let p = paths(Path::new("/d"));
        assert_eq!(p.log, Path::new("/d/logs/job-000001/rank-2/attempt-3.log"));
        assert_eq!(
            p.exit,
            Path::new("/d/logs/job-000001/rank-2/attempt-3.exit")
        );
        assert!(AttemptPaths::new(Path::new("/d"), &AttemptKey::new("../x", 0, 0)).is_err());
    }

    #[tokio::test]
    async fn writer_caps_with_one_marker() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = paths(dir.path());
        let mut w = LogWriter::create(&p.log, 10).await.expect("create");
        w.append(b"abcd\n").await.expect("append");
        w.append(b"efgh\n").await.expect("append");
        assert!(!w.truncated());
        w.append(b"i\n").await.expect("append");
        w.append(b"j\n").await.expect("append");
        assert!(w.truncated());
        let size = w.finish().await.expect("finish");
        let text = std::fs::read_to_string(&p.log).expect("read");
        assert_eq!(text, format!("abcd\nefgh\n{}", truncation_marker(10)));
        assert_eq!(size, text.len() as u64);
    }

    #[tokio::test]
    async fn writer_keeps_the_whole_lines_of_a_chunk_that_fit_under_the_cap() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = paths(dir.path());
        let mut w = LogWriter::create(&p.log, 12).await.expect("create");
        w.append(b"ab\ncd\nef\ngh\nij\n").await.expect("append");
        assert!(w.truncated());
        w.append(b"kl\n").await.expect("append");
        let size = w.finish().await.expect("finish");
        let text = std::fs::read_to_string(&p.log).expect("read");
        assert_eq!(text, format!("ab\ncd\nef\ngh\n{}", truncation_marker(12)));
        assert_eq!(size, text.len() as u64);
    }

    #[test]
    fn chunk_cut_ends_at_the_last_line_or_a_full_piece() {
        assert_eq!(chunk_cut(b""), None);
        assert_eq!(chunk_cut(b"partial"), None);
        assert_eq!(chunk_cut(b"one\ntwo\nthr"), Some(8));
        let mut long = b"one\n".to_vec();
        long.extend(std::iter::repeat_n(b'x', LINE_PIECE_MAX_BYTES));
        long.extend_from_slice(b"\n");
        // The last newline within the first piece, not the one beyond it.
        assert_eq!(chunk_cut(&long), Some(4));
        assert_eq!(chunk_cut(&long[4..]), Some(LINE_PIECE_MAX_BYTES));
        assert_eq!(chunk_cut(&long[4 + LINE_PIECE_MAX_BYTES..]), Some(1));
    }

    /// A pump on its own thread over a real pipe, and a writer thread that writes `input`
    /// in writes of varying size; returns the chunks received and how the pump ended.
    fn pump_through_pipe(input: Vec<u8>, capacity: usize) -> (Vec<Vec<u8>>, PumpEnd) {
        let (read_end, mut write_end) = std::io::pipe().expect("pipe");
        let (cancel_read, _cancel_write) = std::io::pipe().expect("pipe");
        let writer = std::thread::spawn(move || {
            use std::io::Write;
            let mut at = 0;
            let mut size = 1;
            while at < input.len() {
                let end = (at + size).min(input.len());
                write_end.write_all(&input[at..end]).expect("write");
                at = end;
                size = size * 7 % 100_003;
            }
        });
        let (tx, mut rx) = mpsc::channel(capacity);
        let pump = std::thread::spawn(move || {
            pump_lines(&read_end, &tx, cancel_read.as_fd()).expect("pump")
        });
        let mut got = Vec::new();
        while let Some(chunk) = rx.blocking_recv() {
            got.push(chunk);
        }
        writer.join().expect("writer");
        (got, pump.join().expect("pump thread"))
    }

    /// Whatever the pipe delivers, the chunks concatenate to exactly the input (plus the
    /// final `\n`), each ends a line or is a full piece, none is longer than a piece.
    #[test]
    fn pump_chunks_are_whole_lines_and_lose_nothing() {
        // Lines of 0..200 000 bytes from a fixed xorshift sequence.
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut input = Vec::new();
        for i in 0..400u64 {
            let len = if i % 50 == 7 {
                (next() % 200_000) as usize
            } else {
                (next() % 120) as usize
            };
            input.extend((0..len).map(|j| b'a' + ((i as usize + j) % 26) as u8));
            input.push(b'\n');
        }
        input.extend_from_slice(b"unterminated");
        let (got, end) = pump_through_pipe(input.clone(), 4);
        assert_eq!(end, PumpEnd::Eof);
        for chunk in &got {
            assert!(!chunk.is_empty());
            assert!(
                chunk.len() <= LINE_PIECE_MAX_BYTES,
                "chunk of {}",
                chunk.len()
            );
            assert!(
                chunk.ends_with(b"\n") || chunk.len() == LINE_PIECE_MAX_BYTES,
                "a chunk of {} bytes ends mid-line",
                chunk.len()
            );
        }
        input.push(b'\n');
        let joined = got.concat();
        assert_eq!(joined.len(), input.len());
        assert!(joined == input, "the chunks differ from the input");
        // Many short lines travel together, not one chunk per line.
        assert!(got.len() < 400, "{} chunks for 401 lines", got.len());
    }

    #[test]
    fn pump_keeps_draining_without_receiver() {
        let (read_end, mut write_end) = std::io::pipe().expect("pipe");
        let (cancel_read, _cancel_write) = std::io::pipe().expect("pipe");
        let (tx, rx) = mpsc::channel(1);
        drop(rx);
        let writer = std::thread::spawn(move || {
            use std::io::Write;
            // 16 pipe buffers: the writer finishes only if the pump keeps reading.
            write_end.write_all(&vec![b'y'; 1 << 20]).expect("write");
        });
        let end = pump_lines(&read_end, &tx, cancel_read.as_fd()).expect("drains to the end");
        assert_eq!(end, PumpEnd::Eof);
        writer.join().expect("writer");
    }

    #[test]
    fn pump_stops_when_cancelled_while_the_pipe_stays_open() {
        let (read_end, write_end) = std::io::pipe().expect("pipe");
        let (cancel_read, cancel_write) = std::io::pipe().expect("pipe");
        let (tx, _rx) = mpsc::channel(1);
        let pump = std::thread::spawn(move || {
            pump_lines(&read_end, &tx, cancel_read.as_fd()).expect("pump")
        });
        // The rank's end stays open (an escaped background process holds it).
        drop(cancel_write);
        assert_eq!(pump.join().expect("pump thread"), PumpEnd::Cancelled);
        drop(write_end);
    }

    #[tokio::test]
    async fn exit_record_round_trip_and_validation() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("attempt-0.exit");
        assert!(read_exit_record(&path).await.expect("read").is_none());
        let rec = ExitRecord {
            exec_failed: false,
            exit_code: Some(3),
            signal: None,
            spawn_error: None,
            agent_fault: false,
            agent_evidence: None,
            cause: None,
        };
        write_exit_record(&path, &rec).await.expect("write");
        assert_eq!(read_exit_record(&path).await.expect("read"), Some(rec));
        assert!(!dir.path().join("attempt-0.exit.tmp").exists());
        let text = std::fs::read_to_string(&path).expect("text");
        assert_eq!(text, r#"{"exit_code":3,"signal":null}"#);
        for bad in [
            r#"{"exit_code":1,"signal":9}"#,
            r#"{"exit_code":null,"signal":null}"#,
            "not json",
        ] {
            std::fs::write(&path, bad).expect("write");
            assert!(
                matches!(
                    read_exit_record(&path).await,
                    Err(ExitRecordError::Invalid { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_time_is_placed_at_the_first_mark_less_than_an_interval_before_it() {
        // Output flushed at 1.0 s, 2.0 s and 3.5 s (each segment within a second of its
        // mark).
        let index = b"0 1000\n40 2000\n90 3500\n";
        assert_eq!(
            start_offset(index, 500),
            0,
            "before every mark: from the start"
        );
        assert_eq!(
            start_offset(index, 1999),
            0,
            "the first segment may hold it"
        );
        assert_eq!(start_offset(index, 2000), 40);
        assert_eq!(start_offset(index, 2999), 40);
        assert_eq!(
            start_offset(index, 3000),
            90,
            "the gap 3.0 s .. 3.5 s held nothing"
        );
        assert_eq!(start_offset(index, 4499), 90);
        assert_eq!(start_offset(index, 4500), u64::MAX, "nothing is newer");
        assert_eq!(start_offset(b"", 10), 0, "no index: from the start");
        // A corrupt or cut index never skips output: from the last good mark.
        assert_eq!(start_offset(b"0 1000\n40 2000\nxx\n90 3500\n", 9_999), 40);
        assert_eq!(start_offset(b"0 1000\n40 2000\n30 2500\n", 9_999), 40);
        assert_eq!(start_offset(b"0 1000\n40 2000\n90 3", 9_999), 40);
        assert_eq!(start_offset(b"0 1000\n40 500\n", 9_999), 0);
    }

    #[tokio::test]
    async fn a_log_writes_its_time_index_and_reads_since_a_time_start_there() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = paths(dir.path());
        let mut w = LogWriter::create(&p.log, 1 << 20).await.expect("create");
        w.append(b"early\n").await.expect("append");
        w.flush().await.expect("flush");
        // Marks are at most one per interval: a later flush within it adds none.
        w.append(b"same interval\n").await.expect("append");
        w.flush().await.expect("flush");
        let index = std::fs::read_to_string(&p.times).expect("index");
        assert_eq!(index.lines().count(), 1, "{index}");
        let (offset, first_ms) = index
            .trim()
            .split_once(' ')
            .map(|(o, t)| (o.parse::<u64>().expect("o"), t.parse::<u64>().expect("t")))
            .expect("a mark");
        assert_eq!(offset, 0);
        // Since before the mark: everything; long after it: nothing.
        let c = read_log(&p, 0, 100, Some(first_ms)).await.expect("read");
        assert_eq!((c.offset, &c.data[..]), (0, &b"early\nsame interval\n"[..]));
        let c = read_log(&p, 0, 100, Some(first_ms + 60_000))
            .await
            .expect("read");
        assert_eq!((c.offset, c.data.len()), (c.size_bytes, 0));
        // A read that already has an offset ignores since_ms.
        let c = read_log(&p, 6, 100, Some(first_ms + 60_000))
            .await
            .expect("read");
        assert_eq!(&c.data[..], b"same interval\n");
        w.finish().await.expect("finish");
    }

    #[tokio::test]
    async fn read_pages_cut_at_lines_until_complete() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = paths(dir.path());
        assert!(matches!(
            read_log(&p, 0, 100, None).await,
            Err(ReadLogError::NotFound)
        ));
        std::fs::create_dir_all(&p.dir).expect("mkdir");
        std::fs::write(&p.log, b"line1\nline2\npart").expect("write");

        let c = read_log(&p, 0, 100, None).await.expect("read");
        assert_eq!(c.data, b"line1\nline2\n");
        assert_eq!((c.size_bytes, c.complete), (16, false));
        let c = read_log(&p, 0, 8, None).await.expect("read");
        assert_eq!(c.data, b"line1\n");
        let c = read_log(&p, 6, 100, None).await.expect("read");
        assert_eq!(c.data, b"line2\n");
        // Only a partial line left: nothing until it completes.
        let c = read_log(&p, 12, 100, None).await.expect("read");
        assert!(c.data.is_empty());
        // A page without newline that fills max_bytes is returned whole.
        let c = read_log(&p, 12, 3, None).await.expect("read");
        assert_eq!(c.data, b"par");
        let c = read_log(&p, 16, 100, None).await.expect("read");
        assert!(c.data.is_empty());
        assert!(matches!(
            read_log(&p, 17, 100, None).await,
            Err(ReadLogError::OffsetPastEnd {
                offset: 17,
                size_bytes: 16
            })
        ));
        assert!(matches!(
            read_log(&p, 0, MAX_READ_BYTES + 1, None).await,
            Err(ReadLogError::BadMaxBytes(_))
        ));
        assert!(matches!(
            read_log(&p, 0, 0, None).await,
            Err(ReadLogError::BadMaxBytes(0))
        ));

        write_exit_record(&p.exit, &ExitRecord::from_status(ExitStatus::from_raw(0)))
            .await
            .expect("exit");
        let c = read_log(&p, 12, 100, None).await.expect("read");
        assert_eq!(c.data, b"part");
        assert!(c.complete);
    }
}
