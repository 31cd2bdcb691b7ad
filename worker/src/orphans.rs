//! Pid records: the durable trace of every attempt the agent started, so that an agent
//! restarted on the same data dir finds (and kills) what its previous incarnation left.
//!
//! `<data-dir>/pids/<job>.rank-<r>.attempt-<a>.json` is written before the process is
//! spawned (`pid: null`), rewritten with the pid and the process start time once it runs,
//! and removed after the attempt's exit record is written. A record found at start-up
//! therefore names an attempt whose end the previous agent never recorded.

use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;

use cumulus_api::AttemptKey;
use cumulus_api::ids::{self, IdError};

/// Largest pid record accepted when reading one back.
const MAX_RECORD_BYTES: u64 = 4096;
/// Most records read at start-up (one per attempt that was live; far above any slot count).
pub const MAX_RECORDS_SCANNED: usize = 4096;

/// Content of a pid record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PidRecord {
    /// The job's id (`job-NNNNNN`).
    pub job_id: String,
    /// Global rank, `0..world_size`.
    pub rank: u32,
    /// The rank's attempt number (0 for its first run).
    pub attempt: u32,
    /// Pid (= process group id) of the rank, once spawned.
    pub pid: Option<u32>,
    /// Start time of that process in clock ticks since boot (`/proc/<pid>/stat` field 22),
    /// which tells the rank apart from a later process that reuses its pid.
    pub start_ticks: Option<u64>,
}

impl PidRecord {
    /// The attempt this record is about.
    pub fn key(&self) -> AttemptKey {
        AttemptKey::new(self.job_id.clone(), self.rank, self.attempt)
    }
}

/// Directory of the pid records.
pub fn records_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("pids")
}

/// Path of the record of `key`.
pub fn record_path(data_dir: &Path, key: &AttemptKey) -> Result<PathBuf, IdError> {
    ids::check_job_id(&key.job_id)?;
    Ok(records_dir(data_dir).join(format!(
        "{}.rank-{}.attempt-{}.json",
        key.job_id, key.rank, key.attempt
    )))
}

/// Writes `record` atomically (temp file, fsync, rename, fsync of the directory).
pub async fn write(data_dir: &Path, record: &PidRecord) -> io::Result<()> {
    let path = record_path(data_dir, &record.key())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let dir = records_dir(data_dir);
    tokio::fs::create_dir_all(&dir).await?;
    let tmp = path.with_extension("json.tmp");
    let mut file = tokio::fs::File::create(&tmp).await?;
    file.write_all(&serde_json::to_vec(record).map_err(io::Error::other)?)
        .await?;
    file.sync_all().await?;
    drop(file);
    tokio::fs::rename(&tmp, &path).await?;
    tokio::fs::File::open(&dir).await?.sync_all().await
}

/// Removes the record of `key` (absent is fine).
pub async fn remove(data_dir: &Path, key: &AttemptKey) -> io::Result<()> {
    let path =
        record_path(data_dir, key).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    match tokio::fs::remove_file(&path).await {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Reads every record in the directory (at most [`MAX_RECORDS_SCANNED`]). Each entry is
/// the file and either its validated content or why it is invalid. Leftover temp files
/// are reported as invalid too, so the caller removes them.
pub async fn scan(data_dir: &Path) -> io::Result<Vec<(PathBuf, Result<PidRecord, RecordError>)>> {
    let dir = records_dir(data_dir);
    let mut entries = match tokio::fs::read_dir(&dir).await {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    while let Some(entry) = entries.next_entry().await? {
        if out.len() >= MAX_RECORDS_SCANNED {
            tracing::warn!(
                "more than {MAX_RECORDS_SCANNED} pid records in {}: the rest is handled at the next start",
                dir.display()
            );
            break;
        }
        let path = entry.path();
        let parsed = read_one(&path).await;
        out.push((path, parsed));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Why a file in the pid-record directory is not a valid record; the agent removes it.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The file name is not UTF-8.
    #[error("file name is not UTF-8")]
    NameNotUtf8,
    /// Not a `.json` record (a leftover temp file, or a stranger).
    #[error("not a .json record")]
    NotJson,
    /// Not a regular file, or larger than [`MAX_RECORD_BYTES`].
    #[error("not a regular file of at most {MAX_RECORD_BYTES} bytes")]
    NotSmallFile,
    /// It cannot be read.
    #[error("cannot read it: {0}")]
    Io(#[from] io::Error),
    /// Its content does not parse.
    #[error("its content does not parse: {0}")]
    Parse(#[from] serde_json::Error),
    /// Its job id is invalid.
    #[error("{0}")]
    Id(#[from] IdError),
    /// Its content names another attempt than its file name.
    #[error("content names {key} but the file is {name}")]
    NameMismatch {
        /// The attempt the content names.
        key: AttemptKey,
        /// The file name.
        name: String,
    },
    /// A pid of 0, 1 or above `i32::MAX`.
    #[error("invalid pid {0}")]
    Pid(u32),
}

async fn read_one(path: &Path) -> Result<PidRecord, RecordError> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or(RecordError::NameNotUtf8)?;
    if !name.ends_with(".json") {
        return Err(RecordError::NotJson);
    }
    let meta = tokio::fs::metadata(path).await?;
    if !meta.is_file() || meta.len() > MAX_RECORD_BYTES {
        return Err(RecordError::NotSmallFile);
    }
    let bytes = tokio::fs::read(path).await?;
    let record: PidRecord = serde_json::from_slice(&bytes)?;
    let expected = record_path(
        path.parent()
            .and_then(Path::parent)
            .unwrap_or(Path::new("")),
        &record.key(),
    )?;
    if expected.file_name() != path.file_name() {
        return Err(RecordError::NameMismatch {
            key: record.key(),
            name: name.to_owned(),
        });
    }
    if let Some(pid) = record.pid.filter(|p| *p <= 1 || *p > i32::MAX as u32) {
        return Err(RecordError::Pid(pid));
    }
    Ok(record)
}

/// Start time of process `pid` in clock ticks since boot, or `None` when there is no such
/// process (or its stat cannot be parsed).
pub fn process_start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and ')': split after the last ')'.
    let (_, rest) = stat.rsplit_once(')')?;
    // rest starts at field 3 (state); starttime is field 22.
    rest.split_whitespace().nth(22 - 3)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn write_scan_remove() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rec = PidRecord {
            job_id: "job-000007".into(),
            rank: 1,
            attempt: 2,
            pid: Some(std::process::id()),
            start_ticks: process_start_ticks(std::process::id()),
        };
        assert!(rec.start_ticks.is_some());
        write(dir.path(), &rec).await.expect("write");
        std::fs::write(records_dir(dir.path()).join("junk.json"), b"{").expect("junk");
        let found = scan(dir.path()).await.expect("scan");
        assert_eq!(found.len(), 2);
        let good: Vec<_> = found.iter().filter_map(|(_, r)| r.as_ref().ok()).collect();
        assert_eq!(good, vec![&rec]);
        remove(dir.path(), &rec.key()).await.expect("remove");
        remove(dir.path(), &rec.key()).await.expect("remove twice");
        let found = scan(dir.path()).await.expect("scan");
        assert_eq!(found.len(), 1);
        assert!(found[0].1.is_err());
    }

    #[tokio::test]
    async fn record_must_match_its_file_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rec = PidRecord {
            job_id: "job-1".into(),
            rank: 0,
            attempt: 0,
            pid: None,
            start_ticks: None,
        };
        write(dir.path(), &rec).await.expect("write");
        let path = record_path(dir.path(), &rec.key()).expect("path");
        std::fs::rename(
            &path,
            records_dir(dir.path()).join("job-1.rank-9.attempt-0.json"),
        )
        .expect("rename");
        let found = scan(dir.path()).await.expect("scan");
        assert!(
            found[0]
                .1
                .as_ref()
                .is_err_and(|e| matches!(e, RecordError::NameMismatch { .. }))
        );
    }

    #[test]
    fn start_ticks_of_missing_process() {
        assert_eq!(process_start_ticks(u32::MAX), None);
    }
}
