//! Stage timing of the write path: trace events, off unless asked for, that let a
//! benchmark split one write's latency into the stages it crosses on the leader and on
//! a follower (`cumulus-bench --only write_stages`, docs/perf-notes.md).
//!
//! Every event has target [`TARGET`] at TRACE level, a `stage` name and wall-clock
//! timestamps in nanoseconds since the Unix epoch ([`now_ns`]; the same clock in every
//! process of a machine, so a leader's and a follower's events can be lined up). They
//! are emitted only where the subscriber enables them (`RUST_LOG=…,cumulus_stage=trace`);
//! otherwise an event costs one cached level check, and the timestamps a few clock reads.
//!
//! | `stage` | where | fields |
//! |---|---|---|
//! | `submit` | coordinator, SubmitJob handler | `start_ns`, `proposed_ns` (validation done), `end_ns` |
//! | `client_write` | coordinator, one Raft entry proposed by the leader | `index`, `start_ns`, `end_ns` (applied and answered) |
//! | `log_append` | raft-store sync thread, every log append (leader and follower) | `last_index`, `entries`, `called_ns` (`append` called), `written_ns` (written and readable; `append` returns), `io_start_ns`, `io_end_ns` (the group's fdatasync), `done_ns` (flush reported to openraft) |
//! | `replicate` | coordinator, one AppendEntries RPC sent by the leader | `last_index`, `target`, `start_ns`, `end_ns` (reply decoded) |
//! | `append_entries_served` | coordinator, one AppendEntries RPC served by a follower | `last_index`, `received_ns`, `decoded_ns`, `raft_done_ns`, `end_ns` (reply encoded) |
//! | `apply` | raft-store, one call of the state machine's apply | `last_index`, `entries`, `start_ns`, `end_ns` |

use std::time::{SystemTime, UNIX_EPOCH};

/// tracing target of every stage event.
pub const TARGET: &str = "cumulus_stage";

/// Now, in nanoseconds since the Unix epoch (0 if the clock is before it).
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}
