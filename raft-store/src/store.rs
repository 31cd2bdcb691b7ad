//! openraft storage (openraft 0.10): the Raft log ([`LogStore`]: entries in the write-ahead log
//! of [`crate::wal`], the vote and the purge point in sled) and the state machine
//! ([`StateMachineStore`]: in memory, its snapshots in sled).
//!
//! Durability: an append is reported flushed (its `IOFlushed` callback) only after the
//! sync thread's `fdatasync` ([`crate::flusher`]); a truncation, a purge, a vote and a
//! snapshot are on disk (`fdatasync` or sled flush) before they return, and wait for
//! every flush submitted before them (openraft's contract; its rocksdb example skips
//! the flush, we do not). The applied state is not written per
//! entry: on open it is restored from the newest snapshot, and openraft re-applies the
//! committed entries after it from the log (we save the committed log id; the log is
//! purged only behind a snapshot).
//!
//! Every record kept in sled carries a checksum written by Cumulus: the vote, the
//! committed log id and the purge point in the record format of [`crate::record`], the
//! snapshot in its own format 2 (a CRC-32 over meta and data). Everything read back is
//! verified and parsed; a record that does not check refuses to start
//! ([`OpenError::CorruptRecord`], naming the tree and the key), and so does a sled that
//! lost flushed writes ([`OpenError::LostWrites`]): never silently wrong state.
//!
//! This file implements openraft's two storage traits, whose methods share one ordering
//! contract with the flusher (every vote, truncation and purge waits for the flushes
//! before it); they stay together so that contract reads in one place. Opening a data dir,
//! with its checks and repairs, is the child module `open`.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::io::{self, Cursor};
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use futures::{Stream, TryStreamExt};
use openraft::storage::{EntryResponder, IOFlushed, LogState, RaftLogStorage, RaftStateMachine};
use openraft::{OptionalSend, RaftLogReader, RaftSnapshotBuilder};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::flusher::{Flusher, Job, SyncJob};
use crate::record::{GENERATION_FILE, GenerationFile, MetaRecord, decode_meta, encode_meta};
use crate::state::{ClusterState, Command, DirtyKey, Response};
use crate::wal::{Wal, WalError};
use crate::{
    Entry, EntryPayload, LogId, Snapshot, SnapshotData, SnapshotMeta, StoredMembership, TypeConfig,
    Vote, stage,
};

/// Errors opening the store.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// sled could not open or read the database.
    #[error("cannot open the sled database at {path}: {source}")]
    Sled {
        /// Data directory.
        path: String,
        /// Human-readable cause, shown to users.
        #[source]
        source: sled::Error,
    },
    /// sled found damage in its own files (its CRCs) and cannot recover past it.
    #[error(
        "the sled database at {path} is damaged: {source}; refusing to start. {hint}",
        hint = crate::wal::RECOVERY_HINT
    )]
    SledCorrupt {
        /// Data directory.
        path: String,
        /// sled's report (`Error::Corruption`).
        #[source]
        source: sled::Error,
    },
    /// The write-ahead log of entries could not be opened, or is corrupt.
    #[error("cannot open the raft log: {0}")]
    Wal(#[from] WalError),
    /// The log's sync thread could not be started.
    #[error("cannot start the raft log's sync thread: {0}")]
    Flusher(#[source] io::Error),
    /// A record in the database does not parse or is inconsistent.
    #[error(
        "the data directory {path} holds corrupt Raft state ({what}); refusing to start with wrong state: {reason}"
    )]
    Corrupt {
        /// Data directory.
        path: String,
        /// Which record.
        what: String,
        /// Human-readable cause, shown to users.
        reason: String,
    },
    /// A record Cumulus keeps in sled fails its checksum or does not parse
    /// ([`crate::record`]; the snapshot's own format-2 CRC).
    #[error(
        "the data directory {path} holds a corrupt record in sled tree `{tree}`, key `{key}`: \
         {reason}; refusing to start with wrong state. {hint}",
        hint = crate::wal::RECOVERY_HINT
    )]
    CorruptRecord {
        /// Data directory.
        path: String,
        /// The sled tree (`raft_meta`, `snapshot`).
        tree: String,
        /// The record's key in that tree (`vote`, `committed`, `last_purged`, `current`).
        key: String,
        /// What is wrong, shown to users.
        reason: String,
    },
    /// sled returned older records than were flushed: its recovery stopped at a damaged
    /// message and dropped every later write ([`crate::record`], "Generations").
    #[error(
        "the sled database in {path} lost flushed writes: the newest record it holds \
         ({newest}) has generation {found}, but generation {recorded} was flushed (recorded \
         in {file}); sled drops every write after a damaged message in its log, so it \
         would start with an older vote; refusing to start. {hint}",
        file = crate::record::GENERATION_FILE,
        hint = crate::wal::RECOVERY_HINT
    )]
    LostWrites {
        /// Data directory.
        path: String,
        /// Which record holds the newest generation found (its tree and key).
        newest: String,
        /// The newest generation found in sled.
        found: u64,
        /// The generation in the generation file.
        recorded: u64,
    },
    /// The generation file could not be read or written (the message names it).
    #[error("cannot use the raft metadata's generation file: {0}")]
    Generation(#[source] io::Error),
}

/// Most bytes of encoded entries (their JSON) in one replication request, unless its one
/// entry is larger ([`LogStore`]'s `limited_get_log_entries`). Bounds what a leader and
/// a follower hold and encode or decode per request (serde_json runs at a few hundred
/// MB/s in a release build) and keeps a request below the Raft message limit.
pub const REPLICATION_BATCH_BYTES: usize = 8 << 20;

/// Log entries of data dirs written before the write-ahead log (moved into it on open).
const LEGACY_LOGS_TREE: &str = "raft_logs";
/// Directory of the write-ahead log, inside the store's directory.
const WAL_DIR: &str = "wal";
const META_TREE: &str = "raft_meta";
const SNAPSHOT_TREE: &str = "snapshot";

/// Shortest time between two writes of the committed log id to sled
/// ([`LogStore`]'s `save_committed`). openraft saves it at every commit (a thousand
/// times a second under load), a sled insert cost a follower 13% of its CPU, and a
/// saved committed index is only a lower bound anyway (not flushed; a node re-learns
/// the rest from the leader), so most saves only replace the pending value in memory.
pub const SAVE_COMMITTED_INTERVAL: Duration = Duration::from_millis(100);

const KEY_VOTE: &[u8] = b"vote";
const KEY_COMMITTED: &[u8] = b"committed";
const KEY_LAST_PURGED: &[u8] = b"last_purged";
const KEY_SNAPSHOT: &[u8] = b"current";

/// An `io::Error` (what openraft 0.10's storage methods return) saying what failed.
fn io_err(what: &str, e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("{what}: {e}"))
}

/// The Raft log: entries in the write-ahead log ([`Wal`]), made durable by the sync thread
/// ([`Flusher`]); the vote, the committed log id and the purge point in the sled tree
/// `raft_meta`. Cheap to clone (shared handles).
#[derive(Clone)]
pub struct LogStore {
    /// The sled database (flushed after a vote or a purge point is saved).
    db: sled::Db,
    /// Tree `raft_meta`: vote, committed log id, purge point (format-2 records,
    /// [`crate::record`]).
    meta: sled::Tree,
    /// The entries.
    wal: Wal,
    /// The saved vote, cached: openraft reads it twice per replication read.
    vote: Arc<Mutex<Option<Vote>>>,
    /// The committed log id, written to sled at most every [`SAVE_COMMITTED_INTERVAL`].
    committed: Arc<Mutex<CommittedSaver>>,
    /// The generations of the flushed records (vote, purge point) and their file.
    generation: Arc<Generations>,
    /// The sync thread of appends.
    flusher: Flusher,
    /// This node's id, once known ([`LogStore::set_local_node`]): appends of entries
    /// proposed by another node (this node is a follower) are synced inline.
    local_node: Option<crate::NodeId>,
}

/// The generation of the flushed records in tree `raft_meta` ([`crate::record`]).
struct Generations {
    /// The generation file (written after each flushed record).
    file: GenerationFile,
    /// The generation the next flushed record gets.
    next: AtomicU64,
}

/// The committed log id on its way to sled: written at once when the last write is
/// [`SAVE_COMMITTED_INTERVAL`] old, otherwise kept as `pending` and written by the next
/// save past the interval, or when the last handle of the store is dropped.
struct CommittedSaver {
    /// Tree `raft_meta`.
    meta: sled::Tree,
    /// When the committed log id was last written to sled.
    last_write: Option<Instant>,
    /// A newer committed log id than the one in sled, not yet written.
    pending: Option<Option<LogId>>,
}

impl CommittedSaver {
    /// Records `committed` (already capped inside the durable log), writing it to sled
    /// when the interval has passed.
    fn save(&mut self, committed: Option<LogId>, now: Instant) -> Result<(), io::Error> {
        if self
            .last_write
            .is_some_and(|at| now.duration_since(at) < SAVE_COMMITTED_INTERVAL)
        {
            self.pending = Some(committed);
            return Ok(());
        }
        self.pending = None;
        self.last_write = Some(now);
        self.write(committed)
    }

    /// Writes `committed` to sled (not flushed) as a format-2 record of generation 0:
    /// the committed log id is a lower bound that may be lost, not a flushed record.
    fn write(&self, committed: Option<LogId>) -> Result<(), io::Error> {
        let bytes = encode_meta(META_TREE, KEY_COMMITTED, 0, &committed)
            .map_err(|e| io_err("committed", e))?;
        self.meta
            .insert(KEY_COMMITTED, bytes)
            .map_err(|e| io_err("committed", e))?;
        Ok(())
    }
}

impl Drop for CommittedSaver {
    /// Writes the pending committed log id (a clean stop keeps the newest one; after a
    /// crash the older one in sled is still a lower bound).
    fn drop(&mut self) {
        if let Some(committed) = self.pending.take()
            && let Err(e) = self.write(committed)
        {
            tracing::warn!(error = %e, "cannot save the committed log id on close");
        }
    }
}

impl LogStore {
    /// Tells the store this node's id. From then on an append of entries another node
    /// proposed (this node is a follower: its answer to the leader waits for the flush)
    /// is `fdatasync`ed on the calling task when no earlier flush is pending, instead of
    /// on the sync thread, saving two thread wake-ups per append on the replication
    /// round trip. A leader's own appends keep the sync thread: it replicates while its
    /// `fdatasync` runs.
    pub fn set_local_node(&mut self, id: crate::NodeId) {
        self.local_node = Some(id);
    }

    /// Reads the record of `key` in tree `raft_meta`, its checksum verified.
    ///
    /// # Errors
    /// sled fails, or the record does not check (the message names tree and key).
    fn get_meta<T: for<'de> Deserialize<'de>>(&self, key: &[u8]) -> Result<Option<T>, io::Error> {
        let what = format!(
            "sled tree `{META_TREE}`, key `{}`",
            String::from_utf8_lossy(key)
        );
        match self.meta.get(key).map_err(|e| io_err(&what, e))? {
            Some(v) => decode_meta(META_TREE, key, &v)
                .map(|r| Some(r.value))
                .map_err(|e| io_err(&what, e)),
            None => Ok(None),
        }
    }

    /// Writes `value` under `key` in tree `raft_meta` with the next generation, flushes
    /// sled, then records the generation in the generation file (in that order: sled may
    /// be ahead of the file after a crash, never behind).
    async fn put_meta<T: Serialize>(&self, key: &[u8], value: &T) -> Result<(), io::Error> {
        let what = String::from_utf8_lossy(key).into_owned();
        let generation = self.generation.next.fetch_add(1, Ordering::SeqCst);
        let bytes = encode_meta(META_TREE, key, generation, value).map_err(|e| io_err(&what, e))?;
        self.meta.insert(key, bytes).map_err(|e| io_err(&what, e))?;
        self.db.flush_async().await.map_err(|e| io_err(&what, e))?;
        let generations = self.generation.clone();
        tokio::task::spawn_blocking(move || generations.file.write(generation))
            .await
            .map_err(io::Error::other)?
            .map_err(|e| io_err(&what, e))?;
        Ok(())
    }

    /// Waits for every append flush submitted so far.
    async fn barrier(&self) -> Result<(), io::Error> {
        self.flusher.barrier().await.map_err(io::Error::other)
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, io::Error> {
        let start = match range.start_bound() {
            Bound::Included(i) => *i,
            Bound::Excluded(i) => i.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(i) => i.saturating_add(1),
            Bound::Excluded(i) => *i,
            Bound::Unbounded => u64::MAX,
        };
        self.wal.read(start, end).map_err(io::Error::other)
    }

    /// The entries openraft replicates in one `AppendEntries` request: from `start`, at
    /// most [`REPLICATION_BATCH_BYTES`] of them (at least one). openraft 0.10 bounds a
    /// request only by its count of entries (`max_payload_entries`, 300), and a follower
    /// that lags behind large entries would be sent a request larger than a Raft message
    /// may be, refused on every retry: it would never catch up.
    async fn limited_get_log_entries(
        &mut self,
        start: u64,
        end: u64,
    ) -> Result<Vec<Entry>, io::Error> {
        self.wal
            .read_limited(start, end, REPLICATION_BATCH_BYTES)
            .map_err(io::Error::other)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, io::Error> {
        Ok(*self.vote.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, io::Error> {
        let last_purged_log_id: Option<LogId> = self.get_meta(KEY_LAST_PURGED)?;
        let last = self.wal.last().map_err(io::Error::other)?;
        Ok(LogState {
            last_purged_log_id,
            last_log_id: last.or(last_purged_log_id),
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    /// Saves the vote durably (sled flush) after every pending append flush.
    async fn save_vote(&mut self, vote: &Vote) -> Result<(), io::Error> {
        self.barrier().await?;
        self.put_meta(KEY_VOTE, vote).await?;
        *self.vote.lock().unwrap_or_else(|p| p.into_inner()) = Some(*vote);
        Ok(())
    }

    /// Saves the committed log id, capped at the last entry this node has made durable
    /// (openraft 0.10 learns a commit index before the entries' own flush: a follower
    /// from the leader, a leader from its followers' flushes). So the saved id always
    /// lies inside the durable log, and `open` can take one past it for lost entries.
    /// When even the capped entry is not at hand (behind a purge), nothing is saved: the
    /// older saved id is still a lower bound. No flush: a lost committed index is
    /// re-learned from the leader.
    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), io::Error> {
        let durable_end = self.flusher.durable_end();
        let committed = match committed {
            Some(c) if c.index >= durable_end => {
                let purged = self.get_meta::<LogId>(KEY_LAST_PURGED)?;
                if purged.is_some_and(|p| p.index >= c.index) {
                    Some(c)
                } else if durable_end == 0 {
                    return Ok(());
                } else {
                    match self.wal.read(durable_end - 1, durable_end) {
                        Ok(mut v) if !v.is_empty() => v.pop().map(|e| e.log_id),
                        _ => return Ok(()),
                    }
                }
            }
            other => other,
        };
        self.committed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .save(committed, Instant::now())
    }

    /// The committed log id last given to `save_committed` (`open` has checked that the
    /// one on disk lies inside the log).
    async fn read_committed(&mut self) -> Result<Option<LogId>, io::Error> {
        if let Some(pending) = self
            .committed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pending
        {
            return Ok(pending);
        }
        Ok(self.get_meta::<Option<LogId>>(KEY_COMMITTED)?.flatten())
    }

    /// Writes the entries (readable when this returns) and hands their `fdatasync` and
    /// `callback` to the sync thread, or, for a follower's append with no earlier flush
    /// pending, `fdatasync`s and calls `callback` here ([`LogStore::set_local_node`]).
    /// The write is a positioned write into the page cache (a few µs for a submit-sized
    /// batch), done on the caller's task; a batch that fills a segment also syncs it and
    /// allocates the next one here (once per 16 MiB).
    async fn append<I>(
        &mut self,
        entries: I,
        callback: IOFlushed<TypeConfig>,
    ) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        let called_ns = stage::now_ns();
        let proposer = entries.first().map(|e| e.log_id.leader_id.node_id);
        let count = entries.len();
        let last_index = entries.last().map_or(0, |e| e.log_id.index);
        let written = match self.wal.write(entries) {
            Ok(w) => w,
            Err(e) => {
                let message = e.to_string();
                callback.io_completed(Err(io::Error::other(message.clone())));
                return Err(io_err("raft log append", message));
            }
        };
        let Some(unsynced) = written else {
            callback.io_completed(Ok(()));
            return Ok(());
        };
        let job = SyncJob {
            unsynced,
            callback,
            last_index,
            entries: count,
            called_ns,
            written_ns: stage::now_ns(),
        };
        let job = if self.local_node.is_some_and(|id| proposer != Some(id)) {
            match self.flusher.sync_inline(job) {
                Ok(()) => return Ok(()),
                Err(job) => job,
            }
        } else {
            job
        };
        self.flusher
            .submit(Job::Sync(job))
            .map_err(io::Error::other)
    }

    /// Removes the entries after `last_log_id` durably, after every pending flush.
    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), io::Error> {
        self.barrier().await?;
        let since = last_log_id.map_or(0, |l| l.index + 1);
        self.flusher.forget_from(since);
        let wal = self.wal.clone();
        tokio::task::spawn_blocking(move || wal.truncate(since))
            .await
            .map_err(io::Error::other)?
            .map_err(io::Error::other)
    }

    /// Records the purge point durably, then forgets the entries up to it.
    async fn purge(&mut self, log_id: LogId) -> Result<(), io::Error> {
        self.barrier().await?;
        // Record the purge point first, so a crash in between never loses track of it.
        self.put_meta(KEY_LAST_PURGED, &log_id).await?;
        let wal = self.wal.clone();
        tokio::task::spawn_blocking(move || wal.purge(log_id.index))
            .await
            .map_err(io::Error::other)?
            .map_err(io::Error::other)
    }
}

/// The applied state, shared between the state machine and readers (gRPC/HTTP handlers,
/// control loops). Never held across an `.await`.
#[derive(Debug, Default)]
pub struct SmData {
    /// Last applied log id.
    pub last_applied: Option<LogId>,
    /// Last applied membership.
    pub last_membership: StoredMembership,
    /// The Cumulus state.
    pub state: ClusterState,
}

/// Shared handle on the applied state plus a change counter that is bumped after every
/// applied batch, so loops can wait for "something changed" instead of polling.
#[derive(Debug)]
pub struct SharedState {
    /// The applied state.
    pub data: RwLock<SmData>,
    /// Bumped after each applied batch or installed snapshot.
    pub changes: watch::Sender<u64>,
    /// Bytes of the newest snapshot (its encoded state when built or installed, its
    /// stored record when found at open; 0: none): what `/metrics` reports, without
    /// reading the snapshot back.
    pub snapshot_bytes: std::sync::atomic::AtomicU64,
}

impl SharedState {
    /// Runs `f` on the current state under the read lock.
    pub fn read<T>(&self, f: impl FnOnce(&SmData) -> T) -> T {
        let guard = self
            .data
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&guard)
    }
}

/// First bytes of a snapshot record in format 2 (the sled value under `current` in tree
/// `snapshot`).
const SNAPSHOT_MAGIC: &[u8] = b"cumulus-snapshot-2\n";
/// Bytes of a format-2 header: the magic, then the meta length and the CRC-32 (u32 LE each).
const SNAPSHOT_HEADER_BYTES: usize = SNAPSHOT_MAGIC.len() + 8;

/// A snapshot as stored: its meta and the snapshot data ([`SnapshotPayload`] encoded by
/// [`crate::codec`]).
///
/// Format 2 (written since session 7):
/// ```text
/// magic "cumulus-snapshot-2\n" | meta_len: u32 LE | crc32: u32 LE | meta (JSON) | data
/// crc32 = CRC-32 (IEEE, crc32fast) of meta and data
/// ```
/// Format 1 (earlier versions, still read) was this struct as one JSON object, its data a
/// JSON array of numbers: about 4 bytes stored per byte of data, all of it encoded and
/// parsed as JSON once more.
#[derive(Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta,
    data: Vec<u8>,
}

impl StoredSnapshot {
    /// Encodes `meta` and `data` in format 2.
    ///
    /// # Errors
    /// The meta does not serialize, or is larger than 4 GiB.
    fn encode(meta: &SnapshotMeta, data: &[u8]) -> Result<Vec<u8>, std::io::Error> {
        let meta_json = serde_json::to_vec(meta)?;
        let meta_len = u32::try_from(meta_json.len())
            .map_err(|_| std::io::Error::other("snapshot meta larger than 4 GiB"))?;
        let mut crc = crc32fast::Hasher::new();
        crc.update(&meta_json);
        crc.update(data);
        let mut out = Vec::with_capacity(SNAPSHOT_HEADER_BYTES + meta_json.len() + data.len());
        out.extend_from_slice(SNAPSHOT_MAGIC);
        out.extend_from_slice(&meta_len.to_le_bytes());
        out.extend_from_slice(&crc.finalize().to_le_bytes());
        out.extend_from_slice(&meta_json);
        out.extend_from_slice(data);
        Ok(out)
    }

    /// Decodes a stored snapshot of format 2, or of format 1.
    ///
    /// # Errors
    /// What does not check, as a [`SnapshotDecodeError`].
    fn decode(bytes: &[u8]) -> Result<StoredSnapshot, SnapshotDecodeError> {
        let Some(rest) = bytes.strip_prefix(SNAPSHOT_MAGIC) else {
            return serde_json::from_slice(bytes).map_err(SnapshotDecodeError::NotJson);
        };
        if rest.len() < 8 {
            return Err(SnapshotDecodeError::ShortHeader { len: bytes.len() });
        }
        let meta_len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let crc = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]);
        let body = &rest[8..];
        if meta_len > body.len() {
            return Err(SnapshotDecodeError::MetaPastEnd {
                meta_len,
                left: body.len(),
            });
        }
        let (meta_json, data) = body.split_at(meta_len);
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(meta_json);
        hasher.update(data);
        let actual = hasher.finalize();
        if actual != crc {
            return Err(SnapshotDecodeError::Crc {
                stored: crc,
                computed: actual,
            });
        }
        let meta = serde_json::from_slice(meta_json).map_err(SnapshotDecodeError::Meta)?;
        Ok(StoredSnapshot {
            meta,
            data: data.to_vec(),
        })
    }
}

/// Why a stored snapshot record does not decode; the caller names the sled tree and
/// refuses to start (or to send the snapshot).
#[derive(Debug, thiserror::Error)]
enum SnapshotDecodeError {
    /// No format-2 magic, and not format-1 JSON either.
    #[error("not a format-2 snapshot, nor format-1 JSON: {0}")]
    NotJson(serde_json::Error),
    /// A format-2 record shorter than its header; `len` in bytes.
    #[error("a format-2 snapshot of {len} bytes has no complete header")]
    ShortHeader { len: usize },
    /// The header's meta length runs past the record; both in bytes.
    #[error("snapshot meta of {meta_len} bytes runs past the record's end ({left} bytes left)")]
    MetaPastEnd { meta_len: usize, left: usize },
    /// The CRC-32 over meta and data does not match the header's.
    #[error("snapshot CRC-32 mismatch: stored {stored:08x}, computed {computed:08x}")]
    Crc { stored: u32, computed: u32 },
    /// The meta JSON does not parse.
    #[error("snapshot meta does not parse: {0}")]
    Meta(serde_json::Error),
}

/// The snapshot data: the applied state, encoded by [`crate::codec`] (MessagePack; JSON
/// from earlier versions is still read).
#[derive(Serialize, Deserialize)]
struct SnapshotPayload {
    state: ClusterState,
}

/// The state machine: [`ClusterState`] in memory; what is durable is the current
/// snapshot (sled tree `snapshot`) plus the log after it, which openraft re-applies on
/// start (the committed log id is saved with the log). Nothing is written per applied
/// entry: persisting every touched key in sled took ~28% of the leader's CPU on the write
/// path (docs/perf-notes.md, "The state machine in memory"). The sled tree `state_machine` of older data dirs is
/// no longer read.
pub struct StateMachineStore {
    db: sled::Db,
    snap_tree: sled::Tree,
    shared: Arc<SharedState>,
}

impl StateMachineStore {
    /// The shared, read-only view of the applied state.
    pub fn shared(&self) -> Arc<SharedState> {
        self.shared.clone()
    }
}

type LoadError = (String, String);

impl RaftSnapshotBuilder<TypeConfig> for StateMachineStore {
    type SnapshotData = SnapshotData;

    /// Clones the applied state under the read lock (apply waits only for the clone), then
    /// encodes it and writes it to sled on a blocking thread: encoding tens of MB of JSON
    /// under the lock, on a runtime thread, had stalled apply and every reader for seconds
    /// and cost leadership under load (docs/perf-notes.md, "Snapshots").
    async fn build_snapshot(&mut self) -> Result<Snapshot, io::Error> {
        let started = Instant::now();
        let (state, last_applied, last_membership) = self
            .shared
            .read(|d| (d.state.clone(), d.last_applied, d.last_membership.clone()));
        let clone_ms = started.elapsed().as_millis();
        let meta = SnapshotMeta {
            last_log_id: last_applied,
            last_membership,
        };
        let db = self.db.clone();
        let tree = self.snap_tree.clone();
        let stored_meta = meta.clone();
        let write_err = |e: std::io::Error| io_err("writing a snapshot", e);
        let bytes = tokio::task::spawn_blocking(move || -> Result<Vec<u8>, std::io::Error> {
            let bytes =
                crate::codec::encode(&SnapshotPayload { state }).map_err(std::io::Error::other)?;
            tree.insert(KEY_SNAPSHOT, StoredSnapshot::encode(&stored_meta, &bytes)?)
                .map_err(std::io::Error::other)?;
            db.flush().map_err(std::io::Error::other)?;
            Ok(bytes)
        })
        .await
        .map_err(|e| write_err(std::io::Error::other(e)))?
        .map_err(write_err)?;
        self.shared
            .snapshot_bytes
            .store(bytes.len() as u64, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(
            last_log_index = meta.last_log_id.map(|l| l.index),
            bytes = bytes.len(),
            clone_ms,
            total_ms = started.elapsed().as_millis(),
            "built a snapshot"
        );
        Ok(Snapshot {
            meta,
            snapshot: Cursor::new(bytes),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotData = SnapshotData;
    type SnapshotBuilder = StateMachineStore;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), io::Error> {
        Ok(self
            .shared
            .read(|d| (d.last_applied, d.last_membership.clone())))
    }

    /// Takes the entries openraft offers, applies them under the write lock (nothing is
    /// awaited under it), bumps the change counter, then answers each waiting client.
    async fn apply<Strm>(&mut self, mut entries: Strm) -> Result<(), io::Error>
    where
        Strm: Stream<Item = Result<EntryResponder<TypeConfig>, io::Error>> + Unpin + OptionalSend,
    {
        let start_ns = stage::now_ns();
        let mut batch = Vec::new();
        while let Some(item) = entries.try_next().await? {
            batch.push(item);
        }
        let mut answers = Vec::with_capacity(batch.len());
        let mut dirty = BTreeSet::new();
        let mut last_index = 0;
        {
            let mut guard = self.shared.data.write().unwrap_or_else(|p| p.into_inner());
            let data = &mut *guard;
            for (entry, responder) in batch {
                data.last_applied = Some(entry.log_id);
                last_index = entry.log_id.index;
                let resp = match &entry.payload {
                    EntryPayload::Blank => Response::Ok,
                    EntryPayload::Normal(cmd) => apply_command(&mut data.state, cmd, &mut dirty),
                    EntryPayload::Membership(m) => {
                        data.last_membership = StoredMembership::new(Some(entry.log_id), m.clone());
                        Response::Ok
                    }
                };
                answers.push((responder, resp));
            }
        }
        self.shared.changes.send_modify(|n| *n = n.wrapping_add(1));
        let count = answers.len();
        for (responder, resp) in answers {
            if let Some(responder) = responder {
                responder.send(resp);
            }
        }
        tracing::trace!(
            target: stage::TARGET,
            stage = "apply",
            last_index,
            entries = count,
            start_ns,
            end_ns = stage::now_ns(),
        );
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        StateMachineStore {
            db: self.db.clone(),
            snap_tree: self.snap_tree.clone(),
            shared: self.shared.clone(),
        }
    }

    /// Decodes the received state and writes it to sled on a blocking thread, then swaps
    /// it in under the write lock.
    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: SnapshotData,
    ) -> Result<(), io::Error> {
        let bytes = snapshot.into_inner();
        let len_bytes = bytes.len();
        let db = self.db.clone();
        let tree = self.snap_tree.clone();
        let stored_meta = meta.clone();
        let decoded =
            tokio::task::spawn_blocking(move || -> Result<ClusterState, std::io::Error> {
                let payload: SnapshotPayload =
                    crate::codec::decode(&bytes).map_err(std::io::Error::other)?;
                tree.insert(KEY_SNAPSHOT, StoredSnapshot::encode(&stored_meta, &bytes)?)
                    .map_err(std::io::Error::other)?;
                db.flush().map_err(std::io::Error::other)?;
                Ok(payload.state)
            })
            .await
            .map_err(std::io::Error::other)
            .and_then(|r| r);
        let state = decoded.map_err(|e| {
            io_err(
                &format!(
                    "installing the snapshot up to {:?}",
                    meta.last_log_id.map(|l| l.index)
                ),
                e,
            )
        })?;
        let data = SmData {
            last_applied: meta.last_log_id,
            last_membership: meta.last_membership.clone(),
            state,
        };
        {
            let mut guard = self.shared.data.write().unwrap_or_else(|p| p.into_inner());
            *guard = data;
        }
        self.shared.changes.send_modify(|n| *n = n.wrapping_add(1));
        self.shared
            .snapshot_bytes
            .store(len_bytes as u64, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(
            last_log_index = meta.last_log_id.map(|l| l.index),
            bytes = len_bytes,
            "installed a snapshot received from the leader"
        );
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, io::Error> {
        let Some(v) = self
            .snap_tree
            .get(KEY_SNAPSHOT)
            .map_err(|e| io_err("reading the snapshot", e))?
        else {
            return Ok(None);
        };
        let stored =
            StoredSnapshot::decode(&v).map_err(|reason| io_err("reading the snapshot", reason))?;
        Ok(Some(Snapshot {
            meta: stored.meta,
            snapshot: Cursor::new(stored.data),
        }))
    }
}

fn apply_command(
    state: &mut ClusterState,
    cmd: &Command,
    dirty: &mut BTreeSet<DirtyKey>,
) -> Response {
    state.apply(cmd, dirty)
}

mod open;

pub use open::open;

#[cfg(test)]
mod tests;
