//! The identifiers every process checks, with one rule each: a job id and a worker id
//! become directory names, S3 key components, URL path segments and log fields, so each
//! is 1..=max bytes of `[A-Za-z0-9._-]` not starting with `.` or `-` (never `/`, `..`, a
//! hidden name or an option-like name). The coordinator checks a worker id when a worker
//! registers, the agent checks its own `--worker-id` and every job id the leader or a rank
//! sends before it touches the disk, the checkpoint store checks job ids before it names a
//! directory or key, and the CLI checks `cluster.json`.
//!
//! [`crate::is_job_id`] is narrower: the form the leader itself gives jobs.

use thiserror::Error;

/// Most bytes in a job id. The leader issues `job-NNNNNN`; every process accepts any
/// id of this module's rule up to this length.
pub const MAX_JOB_ID_BYTES: usize = 128;
/// Most bytes in a worker id (docs/architecture.md "Identifiers and limits").
pub const MAX_WORKER_ID_BYTES: usize = 64;

/// An identifier that failed validation.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum IdError {
    /// The id is empty or longer than its limit.
    #[error("{what} must be 1..={max} bytes, got {len}")]
    Length {
        /// Which id was checked ("job id", "worker id").
        what: &'static str,
        /// The limit in bytes.
        max: usize,
        /// The length in bytes that was seen.
        len: usize,
    },
    /// The id contains a byte outside `[A-Za-z0-9._-]`, or starts with `.` or `-`.
    #[error("{what} {value:?} may only contain [A-Za-z0-9._-] and must not start with '.' or '-'")]
    Charset {
        /// Which id was checked.
        what: &'static str,
        /// The offending value (truncated to 80 characters).
        value: String,
    },
}

fn check_id(what: &'static str, value: &str, max: usize) -> Result<(), IdError> {
    if value.is_empty() || value.len() > max {
        return Err(IdError::Length {
            what,
            max,
            len: value.len(),
        });
    }
    let bytes = value.as_bytes();
    let allowed = |b: u8| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-';
    if !bytes.iter().all(|&b| allowed(b)) || bytes[0] == b'.' || bytes[0] == b'-' {
        return Err(IdError::Charset {
            what,
            value: value.chars().take(80).collect(),
        });
    }
    Ok(())
}

/// Checks that `job_id` is safe as a single path component: 1..=128 bytes of
/// `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub fn check_job_id(job_id: &str) -> Result<(), IdError> {
    check_id("job id", job_id, MAX_JOB_ID_BYTES)
}

/// Checks a worker id: 1..=64 bytes of `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub fn check_worker_id(worker_id: &str) -> Result<(), IdError> {
    check_id("worker id", worker_id, MAX_WORKER_ID_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ids() {
        assert!(check_job_id("job-000001").is_ok());
        assert!(check_job_id("a.b_c-9").is_ok());
        assert!(matches!(
            check_job_id(""),
            Err(IdError::Length { len: 0, .. })
        ));
        assert!(matches!(
            check_job_id(&"x".repeat(129)),
            Err(IdError::Length { len: 129, .. })
        ));
        for bad in ["..", ".hidden", "-x", "a/b", "a b", "é", "a\0"] {
            assert!(
                matches!(check_job_id(bad), Err(IdError::Charset { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn worker_ids() {
        assert!(check_worker_id("node-1.example").is_ok());
        assert!(check_worker_id(&"w".repeat(64)).is_ok());
        assert!(check_worker_id(&"w".repeat(65)).is_err());
    }
}
