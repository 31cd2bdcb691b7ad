//! Attempt logs: capture of a rank's stdout and stderr into one capped file, the exit
//! record that marks a log complete, and paged reads for the agent's HTTP API.
//!
//! Layout under the agent's data dir:
//! ```text
//! <data-dir>/logs/<job>/rank-<r>/attempt-<a>.log    combined stdout + stderr
//! <data-dir>/logs/<job>/rank-<r>/attempt-<a>.exit   {"exit_code": .., "signal": ..}
//! ```
//! The exit record is written (temp file, fsync, rename, fsync of the directory) only after
//! the process exited and its pipes were drained into the log, so its presence means the
//! log is complete and will never change again.

use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;

use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::reconcile::AttemptKey;
use crate::validate::{self, IdError};

/// Most bytes one read of a log may ask for (ARCHITECTURE.md: `max_bytes` ≤ 1 MiB).
pub const MAX_READ_BYTES: u64 = 1 << 20;
/// A line longer than this is written in pieces of this size (bounds the memory a rank
/// that writes without newlines can make the agent hold).
pub const LINE_PIECE_MAX_BYTES: usize = 64 * 1024;
/// Bytes read from a pipe at a time.
const PIPE_READ_BYTES: usize = 8 * 1024;
/// Largest exit record accepted when reading one back.
const MAX_EXIT_RECORD_BYTES: u64 = 64 * 1024;

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
}

impl AttemptPaths {
    /// Paths of `key` under `data_dir`; fails when the job id is not a safe path component.
    pub fn new(data_dir: &Path, key: &AttemptKey) -> Result<Self, IdError> {
        validate::job_id(&key.job_id)?;
        let dir = data_dir
            .join("logs")
            .join(&key.job_id)
            .join(format!("rank-{}", key.rank));
        Ok(Self {
            log: dir.join(format!("attempt-{}.log", key.attempt)),
            exit: dir.join(format!("attempt-{}.exit", key.attempt)),
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
}

impl ExitRecord {
    /// The record of a process that ran and ended with `status`.
    pub fn from_status(status: ExitStatus) -> Self {
        Self {
            exit_code: status.code(),
            signal: status.signal(),
            spawn_error: None,
        }
    }

    /// The record of an attempt whose process could not be started.
    pub fn spawn_failed(error: impl Into<String>) -> Self {
        Self {
            exit_code: None,
            signal: None,
            spawn_error: Some(error.into()),
        }
    }

    fn check(&self) -> Result<(), String> {
        match (self.exit_code, self.signal, &self.spawn_error) {
            (Some(_), Some(_), _) => Err("both exit_code and signal are set".into()),
            (Some(_), None, None) | (None, Some(_), None) | (None, None, Some(_)) => Ok(()),
            (None, None, None) => Err("none of exit_code, signal, spawn_error is set".into()),
            _ => Err("spawn_error is set together with an exit status".into()),
        }
    }
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
    record.check().map_err(invalid)?;
    Ok(Some(record))
}

/// Appends an attempt's output to its log file, up to a cap.
///
/// Chunks are written whole: a chunk that would take the file past `max_bytes` is replaced
/// by one [`truncation_marker`] line and every later chunk is dropped, so the file never
/// exceeds `max_bytes` plus the marker line.
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
}

impl LogWriter {
    /// Creates (or empties) the log at `path`, creating its directory.
    pub async fn create(path: &Path, max_bytes: u64) -> io::Result<Self> {
        if let Some(dir) = path.parent() {
            tokio::fs::create_dir_all(dir).await?;
        }
        let file = tokio::fs::File::create(path).await?;
        Ok(Self {
            file,
            size_bytes: 0,
            max_bytes,
            pending: Vec::new(),
            truncated: false,
        })
    }

    /// Appends one chunk (normally one line), or the marker if the cap is reached.
    /// Call [`LogWriter::flush`] to make appended bytes visible to readers.
    pub async fn append(&mut self, chunk: &[u8]) -> io::Result<()> {
        if self.truncated || chunk.is_empty() {
            return Ok(());
        }
        if self.size_bytes + chunk.len() as u64 > self.max_bytes {
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
            self.file.write_all(&self.pending).await?;
            self.pending.clear();
        }
        self.file.flush().await
    }

    /// Flushes, fsyncs and closes the log; returns its final size in bytes.
    pub async fn finish(mut self) -> io::Result<u64> {
        self.flush().await?;
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

/// Reads `reader` (a pipe) to its end and sends its content line by line on `tx`.
///
/// A line longer than [`LINE_PIECE_MAX_BYTES`] is sent in pieces of that size; an
/// unterminated last line gets a `\n`. When the receiver is gone the pipe is still read to
/// its end (and the data dropped), so the writer on the other end never blocks or gets
/// `EPIPE` because the agent stopped listening.
pub async fn pump_lines<R: AsyncRead + Unpin>(
    mut reader: R,
    tx: mpsc::Sender<Vec<u8>>,
) -> io::Result<()> {
    let mut buf = vec![0u8; PIPE_READ_BYTES];
    let mut pending: Vec<u8> = Vec::with_capacity(PIPE_READ_BYTES);
    let mut receiver_alive = true;
    loop {
        let n = reader.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        if !receiver_alive {
            continue;
        }
        pending.extend_from_slice(&buf[..n]);
        loop {
            let cut = match pending.iter().position(|&b| b == b'\n') {
                Some(i) if i < LINE_PIECE_MAX_BYTES => i + 1,
                _ if pending.len() >= LINE_PIECE_MAX_BYTES => LINE_PIECE_MAX_BYTES,
                _ => break,
            };
            let rest = pending.split_off(cut);
            let line = std::mem::replace(&mut pending, rest);
            if tx.send(line).await.is_err() {
                receiver_alive = false;
                pending.clear();
                break;
            }
        }
    }
    if receiver_alive && !pending.is_empty() {
        pending.push(b'\n');
        // The receiver may be gone by now; the data then has nowhere to go.
        let _ = tx.send(pending).await;
    }
    Ok(())
}

/// One page of a log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogChunk {
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
        data,
        size_bytes,
        complete,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
    async fn pump_splits_lines_and_long_pieces() {
        let (tx, mut rx) = mpsc::channel(16);
        let long = vec![b'x'; LINE_PIECE_MAX_BYTES + 10];
        let mut input = b"one\ntwo\n".to_vec();
        input.extend_from_slice(&long);
        input.extend_from_slice(b"\nlast");
        let task = tokio::spawn(pump_lines(std::io::Cursor::new(input), tx));
        let mut got = Vec::new();
        while let Some(chunk) = rx.recv().await {
            got.push(chunk);
        }
        task.await.expect("join").expect("pump");
        assert_eq!(got[0], b"one\n");
        assert_eq!(got[1], b"two\n");
        assert_eq!(got[2].len(), LINE_PIECE_MAX_BYTES);
        assert_eq!(got[3], b"xxxxxxxxxx\n");
        assert_eq!(got[4], b"last\n");
        assert_eq!(got.len(), 5);
    }

    #[tokio::test]
    async fn pump_keeps_draining_without_receiver() {
        let (tx, rx) = mpsc::channel(1);
        drop(rx);
        let input = vec![b'y'; 1 << 20];
        pump_lines(std::io::Cursor::new(input), tx)
            .await
            .expect("drains to the end");
    }

    #[tokio::test]
    async fn exit_record_round_trip_and_validation() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("attempt-0.exit");
        assert!(read_exit_record(&path).await.expect("read").is_none());
        let rec = ExitRecord {
            exit_code: Some(3),
            signal: None,
            spawn_error: None,
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

    #[tokio::test]
    async fn read_pages_cut_at_lines_until_complete() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = paths(dir.path());
        assert!(matches!(
            read_log(&p, 0, 100).await,
            Err(ReadLogError::NotFound)
        ));
        std::fs::create_dir_all(&p.dir).expect("mkdir");
        std::fs::write(&p.log, b"line1\nline2\npart").expect("write");

        let c = read_log(&p, 0, 100).await.expect("read");
        assert_eq!(c.data, b"line1\nline2\n");
        assert_eq!((c.size_bytes, c.complete), (16, false));
        let c = read_log(&p, 0, 8).await.expect("read");
        assert_eq!(c.data, b"line1\n");
        let c = read_log(&p, 6, 100).await.expect("read");
        assert_eq!(c.data, b"line2\n");
        // Only a partial line left: nothing until it completes.
        let c = read_log(&p, 12, 100).await.expect("read");
        assert!(c.data.is_empty());
        // A page without newline that fills max_bytes is returned whole.
        let c = read_log(&p, 12, 3).await.expect("read");
        assert_eq!(c.data, b"par");
        let c = read_log(&p, 16, 100).await.expect("read");
        assert!(c.data.is_empty());
        assert!(matches!(
            read_log(&p, 17, 100).await,
            Err(ReadLogError::OffsetPastEnd {
                offset: 17,
                size_bytes: 16
            })
        ));
        assert!(matches!(
            read_log(&p, 0, MAX_READ_BYTES + 1).await,
            Err(ReadLogError::BadMaxBytes(_))
        ));
        assert!(matches!(
            read_log(&p, 0, 0).await,
            Err(ReadLogError::BadMaxBytes(0))
        ));

        write_exit_record(&p.exit, &ExitRecord::from_status(ExitStatus::from_raw(0)))
            .await
            .expect("exit");
        let c = read_log(&p, 12, 100).await.expect("read");
        assert_eq!(c.data, b"part");
        assert!(c.complete);
    }
}
