//! Validation of identifiers that end up in file paths, URLs or gRPC requests.
//!
//! Everything the leader or a rank sends is checked before it touches the disk: a job id
//! becomes a directory name, so it must never contain `/`, `..` or a leading dot.

use thiserror::Error;

/// Most bytes in a job id. The coordinator issues `job-NNNNNN`; the agent accepts any
/// safe name up to this length.
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
pub fn job_id(job_id: &str) -> Result<(), IdError> {
    check_id("job id", job_id, MAX_JOB_ID_BYTES)
}

/// Checks a worker id: 1..=64 bytes of `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub fn worker_id(worker_id: &str) -> Result<(), IdError> {
    check_id("worker id", worker_id, MAX_WORKER_ID_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ids() {
        assert!(job_id("job-000001").is_ok());
        assert!(job_id("a.b_c-9").is_ok());
        assert!(matches!(job_id(""), Err(IdError::Length { len: 0, .. })));
        assert!(matches!(
            job_id(&"x".repeat(129)),
            Err(IdError::Length { len: 129, .. })
        ));
        for bad in ["..", ".hidden", "-x", "a/b", "a b", "é", "a\0"] {
            assert!(
                matches!(job_id(bad), Err(IdError::Charset { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn worker_ids() {
        assert!(worker_id("node-1.example").is_ok());
        assert!(worker_id(&"w".repeat(64)).is_ok());
        assert!(worker_id(&"w".repeat(65)).is_err());
    }
}
