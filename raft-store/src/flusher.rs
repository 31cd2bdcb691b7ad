//! The log's sync thread: makes written appends durable in order and reports them to
//! openraft.
//!
//! openraft 0.10 calls [`RaftLogStorage::append`](openraft::storage::RaftLogStorage) and
//! expects it to return once the entries are readable, then to hear through the append's
//! [`IOFlushed`] callback when they are on disk. A leader replicates the entries while its
//! own `fdatasync` runs (etcd's leader does the same: Raft thesis §10.2.1), instead of
//! paying the two `fdatasync`s in series (docs/perf-notes.md, "The leader's flush overlaps replication").
//!
//! One thread per log store takes [`Job`]s in submission order. It groups the syncs
//! waiting at once: one `fdatasync` per segment covers all of them, then their callbacks
//! run in order. A [`Job::Barrier`] completes only after every sync submitted before it,
//! so a vote, a truncation or a purge never overtakes a pending flush.
//!
//! Of the `IOFlushed::Notify` callbacks of one group only the last is called: openraft
//! keeps the newest flushed IO id in a watch channel, so the earlier ones add nothing, and
//! each extra send in a burst makes openraft's forwarder (`io_completion_forwarder`,
//! which batches notifications 1 µs apart) sleep until the next 1 ms timer tick.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};

use openraft::storage::IOFlushed;

use crate::wal::Unsynced;
use crate::{TypeConfig, stage};

/// Most jobs waiting in the queue; `submit` blocks its caller beyond this (back-pressure
/// on openraft's core; the sync thread never waits on the async runtime, so this cannot
/// deadlock).
pub const QUEUE_JOBS: usize = 4096;
/// Most syncs grouped under one `fdatasync` pass.
pub const GROUP_JOBS: usize = 1024;

/// A written append to make durable, then report through its callback.
pub struct SyncJob {
    /// What to `fdatasync`.
    pub unsynced: Unsynced,
    /// openraft's completion callback.
    pub callback: IOFlushed<TypeConfig>,
    /// Index of the append's last entry (stage timing).
    pub last_index: u64,
    /// Entries in the append (stage timing).
    pub entries: usize,
    /// When `append` was called, ns since the Unix epoch (stage timing).
    pub called_ns: u64,
    /// When `append` had written the entries and returned, ns (stage timing).
    pub written_ns: u64,
}

/// Work for the sync thread.
pub enum Job {
    /// Make a written append durable, then call its callback.
    Sync(SyncJob),
    /// Completes once every sync submitted before it is done: `Ok` if every `fdatasync`
    /// so far succeeded, else the first failure.
    Barrier(tokio::sync::oneshot::Sender<Result<(), Arc<std::io::Error>>>),
}

/// Handle on a log store's sync thread. Cheap to clone; the thread ends when every handle
/// is dropped and its queue is drained.
#[derive(Clone)]
pub struct Flusher {
    /// Queue of the thread.
    tx: mpsc::SyncSender<Job>,
    /// What the thread and [`Flusher::sync_inline`] share.
    shared: Arc<Shared>,
}

/// State shared by the sync thread and the callers of [`Flusher::sync_inline`].
#[derive(Default)]
struct Shared {
    /// Jobs submitted and not yet completed (callbacks called, barrier answered).
    queued: AtomicUsize,
    /// The first `fdatasync` failure: every later sync and barrier reports it.
    failed: Mutex<Option<Arc<std::io::Error>>>,
    /// One past the index of the last entry known durable (0: none): the store never
    /// saves a committed index past it, so a saved committed index always lies inside
    /// the durable log and one past it on open is damage.
    durable_end: AtomicU64,
}

impl Shared {
    fn failed(&self) -> std::sync::MutexGuard<'_, Option<Arc<std::io::Error>>> {
        self.failed.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The store cannot make appends durable.
#[derive(Debug, thiserror::Error)]
pub enum FlushError {
    /// The sync thread is gone (it panicked).
    #[error("the raft log's sync thread has stopped")]
    Gone,
    /// An `fdatasync` of the log failed; the log stays failed (a later `fdatasync` may
    /// succeed after the kernel dropped the dirty pages, so it proves nothing).
    #[error("an fdatasync of the raft log failed earlier: {0}")]
    Failed(Arc<std::io::Error>),
}

impl Flusher {
    /// Starts the sync thread.
    ///
    /// # Errors
    /// The thread cannot be spawned.
    pub fn start() -> std::io::Result<Flusher> {
        let (tx, rx) = mpsc::sync_channel(QUEUE_JOBS);
        let shared = Arc::new(Shared::default());
        let thread_shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("raft-log-sync".into())
            .spawn(move || run(&rx, &thread_shared))?;
        Ok(Flusher { tx, shared })
    }

    /// One past the index of the last entry whose `fdatasync` completed (0: none).
    pub fn durable_end(&self) -> u64 {
        self.shared.durable_end.load(Ordering::Acquire)
    }

    /// Records that every entry below `end` is durable (entries found on disk at open).
    pub fn set_durable_end(&self, end: u64) {
        self.shared.durable_end.store(end, Ordering::Release);
    }

    /// Forgets durability of the entries at and after `since` (they were truncated; new
    /// entries at those indexes are durable only once their own sync completes).
    pub fn forget_from(&self, since: u64) {
        self.shared.durable_end.fetch_min(since, Ordering::AcqRel);
    }

    /// Queues `job`, blocking while the queue is full.
    ///
    /// # Errors
    /// [`FlushError::Gone`] if the thread has stopped; the job (and its callback) is
    /// dropped.
    pub fn submit(&self, job: Job) -> Result<(), FlushError> {
        self.shared.queued.fetch_add(1, Ordering::AcqRel);
        self.tx.send(job).map_err(|_| {
            self.shared.queued.fetch_sub(1, Ordering::AcqRel);
            FlushError::Gone
        })
    }

    /// Makes `job` durable and calls its callback on the caller's thread (one blocking
    /// `fdatasync`), when nothing submitted earlier is still pending, so callbacks stay in
    /// submission order; otherwise hands `job` back for [`Flusher::submit`]. Callers must
    /// not submit concurrently with this call (openraft calls a log store from one task).
    ///
    /// For a follower: its answer to the leader waits for this flush anyway, and syncing
    /// here saves two thread wake-ups on that path (the sync thread's and the answer's).
    pub fn sync_inline(&self, job: SyncJob) -> Result<(), SyncJob> {
        if self.shared.queued.load(Ordering::Acquire) != 0 {
            return Err(job);
        }
        sync_group(&mut vec![job], &self.shared, false);
        Ok(())
    }

    /// Waits until every sync submitted before this call has completed.
    ///
    /// # Errors
    /// [`FlushError::Gone`] if the thread has stopped; [`FlushError::Failed`] if any
    /// `fdatasync` of the log has failed.
    pub async fn barrier(&self) -> Result<(), FlushError> {
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        self.submit(Job::Barrier(done_tx))?;
        done_rx
            .await
            .map_err(|_| FlushError::Gone)?
            .map_err(FlushError::Failed)
    }
}

/// The thread's loop: take the first job (blocking), then whatever else is queued, and run
/// them in order.
fn run(rx: &mpsc::Receiver<Job>, shared: &Shared) {
    // Syncs taken from the queue, waiting for their group's `fdatasync`.
    let mut pending: Vec<SyncJob> = Vec::new();
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        while let Some(job) = next {
            match job {
                Job::Sync(sync) => pending.push(sync),
                Job::Barrier(done) => {
                    sync_group(&mut pending, shared, true);
                    // The waiter may have given up; nothing to do then.
                    let _ = done.send(shared.failed().clone().map_or(Ok(()), Err));
                    shared.queued.fetch_sub(1, Ordering::AcqRel);
                }
            }
            next = if pending.len() < GROUP_JOBS {
                rx.try_recv().ok()
            } else {
                None
            };
        }
        sync_group(&mut pending, shared, true);
    }
}

/// `fdatasync`s each distinct segment of `pending` once, then calls the callbacks in order
/// (the last `Notify` one only; every one on error) and empties `pending`. After a
/// failure (kept in `shared` for the store's life) nothing is synced and every callback
/// gets the error. With `queued` (jobs that came through the queue) each completed job
/// leaves `shared.queued`.
fn sync_group(pending: &mut Vec<SyncJob>, shared: &Shared, queued: bool) {
    if pending.is_empty() {
        return;
    }
    let io_start_ns = stage::now_ns();
    let mut failed = shared.failed();
    if failed.is_none() {
        let mut synced: Vec<&Unsynced> = Vec::new();
        for p in pending.iter() {
            if synced.iter().any(|s| s.same_segment(&p.unsynced)) {
                continue;
            }
            if let Err(e) = p.unsynced.sync() {
                *failed = Some(Arc::new(std::io::Error::other(e)));
                break;
            }
            synced.push(&p.unsynced);
        }
    }
    let failure = failed.clone();
    drop(failed);
    let io_end_ns = stage::now_ns();
    let last_notify = pending
        .iter()
        .rposition(|p| matches!(p.callback, IOFlushed::Notify(_)));
    for (i, p) in pending.drain(..).enumerate() {
        match &failure {
            Some(e) => {
                tracing::error!(last_index = p.last_index, error = %e, "raft log fdatasync failed");
                p.callback
                    .io_completed(Err(std::io::Error::new(e.kind(), e.to_string())));
            }
            None => {
                shared
                    .durable_end
                    .fetch_max(p.last_index.saturating_add(1), Ordering::AcqRel);
                let is_notify = matches!(p.callback, IOFlushed::Notify(_));
                if !is_notify || Some(i) == last_notify {
                    p.callback.io_completed(Ok(()));
                }
            }
        }
        tracing::trace!(
            target: stage::TARGET,
            stage = "log_append",
            last_index = p.last_index,
            entries = p.entries,
            called_ns = p.called_ns,
            written_ns = p.written_ns,
            io_start_ns,
            io_end_ns,
            done_ns = stage::now_ns(),
        );
        if queued {
            shared.queued.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
