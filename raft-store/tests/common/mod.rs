//! Helpers shared by the raft-store integration tests.

use cumulus_raft_store::state::{Command, JobSpec};
use cumulus_raft_store::{Entry, EntryPayload, LeaderId, LogId, TypeConfig};
use openraft::storage::EntryResponder;

/// A valid 2-rank spec named `name`.
pub fn spec(name: &str) -> JobSpec {
    JobSpec {
        name: name.into(),
        ..JobSpec::new(2, vec!["true".into()])
    }
}

/// A normal entry of `term` (leader node 1) at `index` carrying `cmd`.
pub fn entry(term: u64, index: u64, cmd: Command) -> Entry {
    Entry {
        log_id: LogId::new(LeaderId { term, node_id: 1 }, index),
        payload: EntryPayload::Normal(cmd),
    }
}

/// `entries` as the stream openraft hands to `RaftStateMachine::apply` (no client waits).
#[allow(dead_code)] // not every test crate that includes this module applies entries
pub fn to_apply(
    entries: Vec<Entry>,
) -> futures::stream::Iter<std::vec::IntoIter<Result<EntryResponder<TypeConfig>, std::io::Error>>> {
    let items: Vec<Result<EntryResponder<TypeConfig>, std::io::Error>> =
        entries.into_iter().map(|e| Ok((e, None))).collect();
    futures::stream::iter(items)
}

/// Runs `open` (of the store or of its sled database) again while it fails because the
/// database's file lock is still held, up to 10 s: sled's background flush thread can
/// keep the lock for a moment after the last handle of a reopened directory was dropped.
/// Any other outcome is returned at once.
#[allow(dead_code)] // not every test crate that includes this module reopens a store
pub fn retry_locked<T, E: std::fmt::Display>(
    mut open: impl FnMut() -> Result<T, E>,
) -> Result<T, E> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match open() {
            Err(e)
                if e.to_string().contains("could not acquire lock")
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => return other,
        }
    }
}
