//! When to build a snapshot (and so compact the log).
//!
//! A snapshot serializes the whole state, so its cost grows with the number of jobs and
//! workers; a fixed interval of N entries makes that cost per entry grow with the state
//! (session 7 measured 1.4–2.0 s of encode, write and flush per snapshot at 30,000 jobs,
//! on every coordinator). The interval here grows with the state instead: a snapshot is
//! due once the entries applied since the last one reach the number of records (jobs
//! plus workers) in the state, never fewer than `--snapshot-every-entries` and never more
//! than `--snapshot-max-entries`. The amortized snapshot work per applied entry then
//! stays about one record's encoding whatever the state's size, while a restart
//! re-applies at most `--snapshot-max-entries` entries. This is the rule of Redis's
//! `auto-aof-rewrite-percentage 100` (rewrite once the log has grown by the size of the
//! state); etcd 3.4 instead snapshots every 100,000 entries (`--snapshot-count`).
//!
//! openraft runs with `SnapshotPolicy::Never`; [`run`] asks for each snapshot with
//! `Raft::trigger().snapshot()`, which openraft ignores while one is being built. Log
//! purging after a snapshot is openraft's (`max_in_snapshot_log_to_keep`).

use std::sync::Arc;

use cumulus_raft_store::{Raft, SharedState};
use openraft::async_runtime::watch::WatchReceiver;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// How often snapshots are built, in applied log entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotInterval {
    /// Fewest entries between two snapshots (`--snapshot-every-entries`, ≥ 1).
    pub min_entries: u64,
    /// Most entries between two snapshots (`--snapshot-max-entries`, ≥ `min_entries`).
    pub max_entries: u64,
}

impl SnapshotInterval {
    /// Whether a snapshot is due after `entries_since` applied entries since the last
    /// one (all applied entries when there is none), with `state_records` jobs plus
    /// workers in the state: `entries_since ≥ clamp(state_records, min, max)`.
    pub fn due(&self, entries_since: u64, state_records: u64) -> bool {
        debug_assert!(self.min_entries >= 1 && self.min_entries <= self.max_entries);
        entries_since >= state_records.clamp(self.min_entries, self.max_entries)
    }
}

/// How often [`run`] reads the Raft metrics, in ms. A tick, not a watch on every metrics
/// change: openraft publishes new metrics several times per write (append, flush, commit,
/// apply), and each wake of this task is a task switch, often a wake of the other worker
/// thread, on the write path (docs/perf-notes.md, "No wake-ups off the path"). A
/// snapshot is due every ≥ 5,000 entries by default, so being up to 100 ms late changes
/// nothing.
pub const SNAPSHOT_CHECK_INTERVAL_MS: u64 = 100;

/// Reads the Raft metrics every [`SNAPSHOT_CHECK_INTERVAL_MS`] until `cancel` and
/// triggers a snapshot whenever [`SnapshotInterval::due`] says so. Trigger failures (the
/// node shutting down) are logged and end the loop.
pub async fn run(
    raft: Raft,
    shared: Arc<SharedState>,
    interval: SnapshotInterval,
    cancel: CancellationToken,
) {
    let metrics = raft.metrics();
    let mut tick =
        tokio::time::interval(std::time::Duration::from_millis(SNAPSHOT_CHECK_INTERVAL_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The last applied index a snapshot was asked for: one trigger per due point, not one
    // per metrics change while the snapshot is being built.
    let mut triggered_at: Option<u64> = None;
    loop {
        let (applied, snapshot) = {
            let m = metrics.borrow_watched();
            (m.last_applied.map(|l| l.index), m.snapshot.map(|l| l.index))
        };
        if let Some(applied) = applied {
            // Entries since the last snapshot; index 0 is the initial membership entry.
            let since = applied.saturating_sub(snapshot.unwrap_or(0));
            // Waiting for the snapshot asked for at `t`; asked again if none came within
            // `max_entries` (a trigger openraft dropped).
            let waiting = triggered_at.is_some_and(|t| {
                snapshot.is_none_or(|s| s < t) && applied < t.saturating_add(interval.max_entries)
            });
            if !waiting && since >= interval.min_entries {
                let records = shared.read(|d| d.state.jobs.len() + d.state.workers.len());
                if interval.due(since, records as u64) {
                    debug!(applied, since, records, "snapshot due");
                    if let Err(e) = raft.trigger().snapshot().await {
                        warn!(error = %e, "cannot trigger a snapshot; snapshots stop");
                        return;
                    }
                    triggered_at = Some(applied);
                }
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interval_grows_with_the_state_between_its_bounds() {
        let i = SnapshotInterval {
            min_entries: 5_000,
            max_entries: 100_000,
        };
        // Small state: every min_entries.
        assert!(!i.due(4_999, 10));
        assert!(i.due(5_000, 10));
        // 30,000 jobs: every 30,000 entries.
        assert!(!i.due(29_999, 30_000));
        assert!(i.due(30_000, 30_000));
        // Huge state: capped at max_entries.
        assert!(!i.due(99_999, 10_000_000));
        assert!(i.due(100_000, 10_000_000));
        // Equal bounds: a fixed interval.
        let fixed = SnapshotInterval {
            min_entries: 10,
            max_entries: 10,
        };
        assert!(fixed.due(10, 1_000));
        assert!(!fixed.due(9, 0));
    }
}
