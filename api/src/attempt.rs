//! [`AttemptKey`]: the identity of one rank attempt, shared by the leader (its soft
//! state of progress reports) and the worker agent (its processes, logs and exits).

use std::fmt;

use serde::{Deserialize, Serialize};

/// True for a job id as the leader makes them (`job-` and 6 to 20 ASCII digits, the
/// sequence number zero-padded to six).
pub fn is_job_id(id: &str) -> bool {
    id.strip_prefix("job-")
        .is_some_and(|n| (6..=20).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Identity of one rank attempt: `(job_id, rank, attempt)`. Displayed as
/// `job-000001/rank-0/attempt-2`, the form logs and errors use.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AttemptKey {
    /// Job id, e.g. `job-000001`.
    pub job_id: String,
    /// Global rank, `0..world_size`.
    pub rank: u32,
    /// Attempt number (epoch) of the rank, 0 for its first run.
    pub attempt: u32,
}

impl AttemptKey {
    /// Builds a key from its three parts.
    pub fn new(job_id: impl Into<String>, rank: u32, attempt: u32) -> Self {
        Self {
            job_id: job_id.into(),
            rank,
            attempt,
        }
    }

    /// The key of a desired rank attempt (a heartbeat reply's entry).
    #[cfg(feature = "grpc")]
    pub fn of(desired: &crate::v1::DesiredRank) -> Self {
        Self::new(desired.job_id.clone(), desired.rank, desired.attempt)
    }
}

impl fmt::Display for AttemptKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/rank-{}/attempt-{}",
            self.job_id, self.rank, self.attempt
        )
    }
}
