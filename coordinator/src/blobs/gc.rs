//! Garbage collection of the local blob store, on every coordinator (leader or not): a
//! blob no job of this node's applied state references (as its workdir or an artifact)
//! and neither stored nor used for `--blob-retention-ms` is removed, and with it its
//! bytes from its uploader's quota; temp files no write owns are removed once stale.
//!
//! A sweep runs once the node has caught up (it has applied what the cluster committed,
//! as a leader's append told it since it started: a node still catching up must not take
//! a referenced blob for an orphan), then every [`sweep_interval`].
//!
//! With `--blob-url` the bucket is swept too, by the leader alone (one sweeper: the
//! coordinators would otherwise race to list and delete the same objects): an object
//! written before the retention that no job references and the leader did not use since
//! is deleted (`super::s3`).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use openraft::ServerState;
use openraft::async_runtime::watch::WatchReceiver;
use tokio_util::sync::CancellationToken;

use super::{Blobs, refs};
use crate::soft::now_ms;

/// Longest pause between two sweeps, in milliseconds.
pub const MAX_SWEEP_INTERVAL_MS: u64 = 5 * 60 * 1_000;
/// Shortest pause between two sweeps, in milliseconds (also the poll while catching up).
pub const MIN_SWEEP_INTERVAL_MS: u64 = 1_000;

/// The pause between sweeps for a retention of `retention_ms`: half of it, within
/// [`MIN_SWEEP_INTERVAL_MS`]..=[`MAX_SWEEP_INTERVAL_MS`].
pub fn sweep_interval(retention_ms: u64) -> Duration {
    Duration::from_millis((retention_ms / 2).clamp(MIN_SWEEP_INTERVAL_MS, MAX_SWEEP_INTERVAL_MS))
}

/// What one sweep removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    /// Blobs removed.
    pub blobs: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Stale temp files removed.
    pub temp_files: usize,
    /// Blobs deleted from the bucket of `--blob-url` (the leader's sweep).
    pub s3_blobs: usize,
    /// Their bytes.
    pub s3_bytes: u64,
}

/// Whether this node's applied state is current, from evidence of this process's life
/// (a restarted node's metrics first show the leader and commit index it had before):
/// a leader acknowledged by a quorum that has applied what it committed in its own term;
/// a follower or learner that has applied the commit index a leader's append told it
/// since it started.
fn caught_up(blobs: &Blobs) -> bool {
    let m = blobs.raft.metrics();
    let m = m.borrow_watched();
    let applied = m.last_applied.map(|l| l.index);
    match m.state {
        ServerState::Leader => {
            m.last_quorum_acked.is_some()
                && m.cluster_committed
                    .is_some_and(|c| c.leader_id.term == m.current_term)
                && applied >= m.cluster_committed.map(|l| l.index)
        }
        ServerState::Follower | ServerState::Learner => {
            let seen = blobs.leader_commit_seen();
            seen > 0 && applied.map_or(0, |a| a.saturating_add(1)) >= seen
        }
        ServerState::Candidate | ServerState::Shutdown => false,
    }
}

/// Sweeps until `cancel`: once caught up, then every [`sweep_interval`].
pub async fn run(blobs: Arc<Blobs>, cancel: CancellationToken) {
    let interval = sweep_interval(blobs.retention_ms);
    loop {
        let pause = if caught_up(&blobs) {
            let swept = sweep(&blobs).await;
            if swept != Swept::default() {
                tracing::info!(
                    blobs = swept.blobs,
                    bytes = swept.bytes,
                    temp_files = swept.temp_files,
                    s3_blobs = swept.s3_blobs,
                    s3_bytes = swept.s3_bytes,
                    retention_ms = blobs.retention_ms,
                    "removed unreferenced blobs"
                );
            }
            interval
        } else {
            Duration::from_millis(MIN_SWEEP_INTERVAL_MS)
        };
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
    }
}

/// One sweep: removes the blobs unused for the retention that no job references, and
/// the stale temp files.
pub async fn sweep(blobs: &Arc<Blobs>) -> Swept {
    let cut = now_ms().saturating_sub(blobs.retention_ms);
    let mut candidates: HashSet<String> = blobs.store.unused_since(cut).into_iter().collect();
    if !candidates.is_empty() {
        blobs
            .shared
            .read(|d| refs::drop_referenced(&d.state, &mut candidates));
    }
    let mut swept = Swept::default();
    for digest in candidates {
        match blobs.store.remove_if_unused(&digest, cut).await {
            Ok(Some(size)) => {
                swept.blobs += 1;
                swept.bytes += size;
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(%digest, error = %e, "cannot remove an unreferenced blob"),
        }
    }
    let this = blobs.clone();
    swept.temp_files = tokio::task::spawn_blocking(move || this.store.sweep_temp())
        .await
        .unwrap_or(0);
    if let super::Backend::S3(s3) = &blobs.backend
        && leading(blobs)
    {
        let referenced = |c: &mut HashSet<String>| {
            blobs.shared.read(|d| refs::drop_referenced(&d.state, c));
        };
        match s3.sweep(cut, referenced).await {
            Ok((n, bytes)) => (swept.s3_blobs, swept.s3_bytes) = (n, bytes),
            Err(e) => tracing::warn!(error = %e, "cannot sweep the blob store's bucket"),
        }
    }
    swept
}

/// Whether this node leads (the one that sweeps the bucket).
fn leading(blobs: &Blobs) -> bool {
    blobs.raft.metrics().borrow_watched().state == ServerState::Leader
}
