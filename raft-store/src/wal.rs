//! The Raft log's entries in a write-ahead log of preallocated segment files: one
//! positioned write per append, one `fdatasync` per append or group of appends.
//!
//! Why not sled (which still holds the vote, the purge point and snapshots): the flush
//! latency bounds the write path (openraft 0.9 waited for each append's flush before it
//! took the next request; 0.10 replicates while it runs, but a write still waits for it). A sled flush of a small append cost ~1 ms here; an
//! `fdatasync` of a write inside an already allocated file costs ~0.2 ms, and one that
//! extends the file ~0.7 ms (docs/perf-notes.md, "The log"). So segments are allocated up
//! front (`fallocate`, etcd preallocates its WAL segments the same way) and written in
//! place.
//!
//! # Layout
//! `<dir>/<first index, 20 digits>.wal`, each [`SEGMENT_BYTES`] long (or one record's
//! size when larger). A segment holds records back to back from offset 0, then zeros:
//!
//! ```text
//! record = len: u32 LE | crc32: u32 LE | index: u64 LE | payload: len bytes (JSON entry)
//! crc32  = CRC-32 (IEEE, crc32fast) of the index bytes and the payload
//! ```
//!
//! A header with `len == 0` ends a segment's records. Indexes are consecutive across
//! records and segments, except that records at or below the last purged index (kept in
//! sled) are skipped on open.
//!
//! # Crash safety
//! - Append: records are written after the last valid one and become readable
//!   ([`Wal::write`]); the append is reported durable only after an `fdatasync` of the
//!   segment ([`Unsynced::sync`], run by the store's sync thread). A segment is synced
//!   before the next one is started, so a crash can tear only the unacknowledged tail of
//!   the newest segment.
//!
//! # Torn tail or corruption
//! A torn write and a damaged disk both leave a record that does not check; only the
//! first may be repaired, since only the first is sure to hold nothing that was ever
//! acknowledged. Segments are preallocated with zeros, and a disk writes whole sectors
//! or none of them, so a torn write leaves whole [`SECTOR_BYTES`]-aligned runs of zeros
//! where its unwritten sectors are (etcd's WAL decoder tells a torn entry from a
//! corrupt one the same way). In the newest segment a record that does not check is
//! taken for a torn tail only when
//! 1. its header is all zeros but bytes follow it, or its written part ends at a sector
//!    boundary with only zeros after it to the end of the record (`looks_torn`), and
//! 2. no valid record with a later index follows it anywhere in the segment
//!    ([`SCAN_INDEX_WINDOW`]): acknowledged records after a bad one mean the bad one was
//!    acknowledged too, and
//! 3. the saved committed index (a lower bound of what is committed, from the store) lies
//!    before it: a committed entry in the tail means the tail was acknowledged.
//!
//! Checks come before repair: [`Wal::scan`] reads every segment and decides, writing
//! nothing; [`ScannedWal::repair`] makes check 3 and only then zeroes the tail from that
//! record on (logged as a warning), so no record of the torn batch can resurface behind
//! later appends. Anything else — a flipped bit, a bad length, a record that does not
//! decode, damage in an older segment, a torn-looking tail holding a committed entry —
//! is [`WalError::Corrupt`]: open fails, naming the file and offset, and nothing on disk
//! is changed. The store checks once more that the saved committed index lies inside the
//! log it opened (see `store::open`).
//! - Truncate: later segments are deleted newest first, then the tail is zeroed, so a
//!   crash at any point leaves a prefix of the log. Zeroing matters: an old record left
//!   after a shorter new one could otherwise read as valid on the next open.
//! - Purge: whole segments below the purge point are deleted oldest first.
//! - A new segment's directory entry is made durable (directory `fsync`) before any
//!   record in it is reported.
//!
//! The record format and the rule that tells a torn write from damage are in `format`
//! (a child module); the writer and the scan that apply that rule are here. They are one
//! contract: a change to either must be read against the other.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::Entry;

mod format;
use format::{Read, classify_bad_tail, decode, encode_record, read_record};

/// Size of a new segment file, in bytes (a record larger than this gets a segment of its
/// own size).
pub const SEGMENT_BYTES: u64 = 16 * 1024 * 1024;
/// Bytes of decoded recent entries kept in memory for reads (replication, apply); older
/// entries are read back from their segment and decoded on demand.
pub const CACHE_BYTES: usize = 32 * 1024 * 1024;
/// Size of a record header, in bytes.
const HEADER_BYTES: u64 = 16;
/// Largest record payload accepted when reading back, in bytes (a larger length field is
/// damage, not data).
const MAX_PAYLOAD_BYTES: u64 = 1 << 30;
/// File name extension of segments.
const SEGMENT_EXT: &str = "wal";
/// Unit in which a disk writes, in bytes: a torn write leaves whole sectors unwritten
/// (zeros in a preallocated segment). 512 divides every sector and page size in use.
pub const SECTOR_BYTES: u64 = 512;
/// How far past the last good index a record found after a bad one may be and still
/// count as "a valid record follows", in entries. Random bytes pass a CRC-32 and land
/// their index field in this window with odds of about 2^-32 × 2^20 / 2^64.
pub const SCAN_INDEX_WINDOW: u64 = 1 << 20;
/// What a refusal to open tells the operator to do.
pub const RECOVERY_HINT: &str = "The log is damaged where it held acknowledged entries: \
     keep this data dir for inspection and rebuild the node from the others: \
     `cumulusctl cluster remove ID` on a working node, then restart this node with \
     `--rejoin-empty` (it moves the damaged data dir aside) and add it back with \
     `cumulusctl cluster add-learner` and `cumulusctl cluster promote` \
     (docs/architecture.md, \"Recovering a damaged node\")";

/// Errors of the WAL.
#[derive(Debug, thiserror::Error)]
pub enum WalError {
    /// An I/O error on a segment or the directory.
    #[error("raft log {path}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// Human-readable cause, shown to users.
        #[source]
        source: io::Error,
    },
    /// Damage that is not a torn tail: refuse to use the log.
    #[error("raft log {path} is corrupt: {reason}")]
    Corrupt {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// An entry could not be encoded.
    #[error("cannot encode raft log entry {index}: {source}")]
    Encode {
        /// Its index.
        index: u64,
        /// Human-readable cause, shown to users.
        #[source]
        source: serde_json::Error,
    },
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> WalError + '_ {
    move |source| WalError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// One segment file.
struct Segment {
    /// Path of the file.
    path: PathBuf,
    /// The open file (read and written positionally).
    file: Arc<File>,
    /// Allocated size, in bytes.
    capacity_bytes: u64,
    /// End of its last valid record, in bytes.
    written_bytes: u64,
    /// Index of its last live record (`None`: it holds none).
    last_index: Option<u64>,
}

/// Where one record lives.
#[derive(Clone, Copy)]
struct Loc {
    /// First index of its segment (key of `segments`).
    segment: u64,
    /// Offset of its header, in bytes.
    offset: u64,
    /// Payload length, in bytes.
    len: u32,
}

/// The log in memory: where every live record is, and a cache of the newest entries.
///
/// openraft only appends consecutive entries after the last one (after truncating a
/// conflicting suffix), but its storage test suite also uses the log as a sparse map
/// (an entry below the purge point, an index skipped); both are accepted. Records in
/// the segments are always in increasing index order: an append at or below the last
/// index first truncates from there.
struct Inner {
    /// Segments by first index, oldest first; the last one is written.
    segments: BTreeMap<u64, Segment>,
    /// Locations of the live records, by index.
    locs: BTreeMap<u64, Loc>,
    /// Decoded newest entries and their payload sizes, by index.
    cache: BTreeMap<u64, (Entry, usize)>,
    /// Sum of the payload sizes in `cache`, in bytes.
    cache_bytes: usize,
}

impl Inner {
    /// Index after the last live record (0 for an empty log).
    fn next_index(&self) -> u64 {
        self.locs.last_key_value().map_or(0, |(i, _)| i + 1)
    }

    fn push_cache(&mut self, entry: Entry, bytes: usize) {
        if let Some((_, old)) = self.cache.insert(entry.log_id.index, (entry, bytes)) {
            self.cache_bytes -= old;
        }
        self.cache_bytes += bytes;
        while self.cache_bytes > CACHE_BYTES && self.cache.len() > 1 {
            if let Some((_, (_, b))) = self.cache.pop_first() {
                self.cache_bytes -= b;
            }
        }
    }

    /// Adds the valid record of `index` read at `offset` of the segment starting at index
    /// `segment` (file `path`): decodes its `payload`, notes where it lives and caches the
    /// entry.
    ///
    /// # Errors
    /// [`WalError::Corrupt`] when `index` does not follow the last live record (indexes
    /// must increase) or the payload does not decode to the entry of that index.
    fn load_record(
        &mut self,
        path: &Path,
        segment: u64,
        offset: u64,
        index: u64,
        payload: &[u8],
    ) -> Result<(), WalError> {
        if !self.locs.is_empty() && index < self.next_index() {
            return Err(WalError::Corrupt {
                path: path.display().to_string(),
                reason: format!(
                    "entry {index} follows entry {} (indexes must increase)",
                    self.next_index() - 1
                ),
            });
        }
        let entry = decode(path, index, payload)?;
        self.locs.insert(
            index,
            Loc {
                segment,
                offset,
                len: payload.len() as u32,
            },
        );
        self.push_cache(entry, payload.len());
        Ok(())
    }

    /// Forgets the cached entries with index ≥ `since`.
    fn drop_cache_from(&mut self, since: u64) {
        for (_, (_, b)) in self.cache.split_off(&since) {
            self.cache_bytes -= b;
        }
    }

    /// Forgets the cached entries with index ≤ `upto`.
    fn drop_cache_through(&mut self, upto: u64) {
        let kept = self.cache.split_off(&upto.saturating_add(1));
        for (_, (_, b)) in std::mem::replace(&mut self.cache, kept) {
            self.cache_bytes -= b;
        }
    }
}

/// An entry a read wants: cloned from the cache, or to be read back from its segment.
// Short-lived (one per entry of a read, moved into the result); boxing the large variant
// would add an allocation per cached entry on the replication path.
#[allow(clippy::large_enum_variant)]
enum Wanted {
    /// A decoded entry from the cache.
    Cached(Entry),
    /// Where the record is: its location, the segment's file and path.
    OnDisk(Loc, Arc<File>, PathBuf),
}

/// Records written by [`Wal::write`] whose segment still needs an `fdatasync` before they
/// are durable.
pub struct Unsynced {
    /// The segment the last records went to.
    file: Arc<File>,
    /// Its path (for errors).
    path: PathBuf,
}

impl Unsynced {
    /// `fdatasync`s the segment: every record written to it so far is durable after.
    ///
    /// # Errors
    /// The `fdatasync` fails (the records may not be durable).
    pub fn sync(&self) -> Result<(), WalError> {
        self.file.sync_data().map_err(io_error(&self.path))
    }

    /// Whether `self` and `other` are writes to the same segment (one `fdatasync` covers
    /// both).
    pub fn same_segment(&self, other: &Unsynced) -> bool {
        Arc::ptr_eq(&self.file, &other.file)
    }
}

/// The write-ahead log. Cheap to clone; clones share the log. Appends, truncations and
/// purges must not run concurrently (openraft calls them from its core task, one at a
/// time); reads may run at any time.
#[derive(Clone)]
pub struct Wal {
    /// Directory of the segments.
    dir: PathBuf,
    /// Shared state (never held across I/O on the write path, nor across an `.await`).
    inner: Arc<Mutex<Inner>>,
}

fn segment_path(dir: &Path, first_index: u64) -> PathBuf {
    dir.join(format!("{first_index:020}.{SEGMENT_EXT}"))
}

fn sync_dir(dir: &Path) -> Result<(), WalError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(dir))
}

/// Allocates `bytes` for a file without writing them, so that later in-place writes do
/// not change its size (cheaper `fdatasync`). Falls back to writing zeros where the file
/// system cannot allocate.
fn preallocate(file: &File, path: &Path, bytes: u64) -> Result<(), WalError> {
    let len = i64::try_from(bytes).map_err(|_| WalError::Corrupt {
        path: path.display().to_string(),
        reason: format!("a segment of {bytes} bytes"),
    })?;
    match nix::fcntl::fallocate(file, nix::fcntl::FallocateFlags::empty(), 0, len) {
        Ok(()) => Ok(()),
        Err(_) => {
            let zeros = vec![0u8; 1 << 20];
            let mut at = 0;
            while at < bytes {
                let n = (bytes - at).min(zeros.len() as u64) as usize;
                file.write_all_at(&zeros[..n], at).map_err(io_error(path))?;
                at += n as u64;
            }
            Ok(())
        }
    }
}

fn create_segment(dir: &Path, first_index: u64, bytes: u64) -> Result<Segment, WalError> {
    let path = segment_path(dir, first_index);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .map_err(io_error(&path))?;
    preallocate(&file, &path, bytes)?;
    file.sync_all().map_err(io_error(&path))?;
    sync_dir(dir)?;
    Ok(Segment {
        path,
        file: Arc::new(file),
        capacity_bytes: bytes,
        written_bytes: 0,
        last_index: None,
    })
}

/// True when `[from, to)` of `file` holds only zeros.
fn all_zero(file: &File, from: u64, to: u64) -> io::Result<bool> {
    let mut buf = vec![0u8; 1 << 20];
    let mut at = from;
    while at < to {
        let n = (to - at).min(buf.len() as u64) as usize;
        file.read_exact_at(&mut buf[..n], at)?;
        if buf[..n].iter().any(|b| *b != 0) {
            return Ok(false);
        }
        at += n as u64;
    }
    Ok(true)
}

/// Writes zeros over `[from, to)` of `file`.
fn zero_range(file: &File, path: &Path, from: u64, to: u64) -> Result<(), WalError> {
    let zeros = vec![0u8; 1 << 20];
    let mut at = from;
    while at < to {
        let n = (to - at).min(zeros.len() as u64) as usize;
        file.write_all_at(&zeros[..n], at).map_err(io_error(path))?;
        at += n as u64;
    }
    Ok(())
}

/// Adds the operator's recovery steps to a corruption error.
fn with_hint(e: WalError) -> WalError {
    match e {
        WalError::Corrupt { path, reason } => WalError::Corrupt {
            path,
            reason: format!("{reason}. {RECOVERY_HINT}"),
        },
        other => other,
    }
}

/// A torn tail found by [`Wal::scan`] in the newest segment, not yet cut.
pub struct TornTail {
    /// The newest segment.
    path: PathBuf,
    /// Its open file (for the repair).
    file: Arc<File>,
    /// Where the torn bytes start, in bytes from the segment's start.
    offset: u64,
    /// The segment's size, in bytes: the tail is `[offset, capacity_bytes)`.
    capacity_bytes: u64,
    /// Index of the last valid record before it (or the purge point; `None`: neither).
    after_index: Option<u64>,
    /// What was found there (a record that does not check, bytes after a zero header).
    reason: String,
}

impl TornTail {
    /// Decides what the bad bytes at `offset` of the newest segment (`file` at `path`,
    /// `capacity_bytes` long) are, `reason` saying what was found there and `after_index`
    /// the index of the last good record before them (or the purge point): a torn tail,
    /// returned for [`ScannedWal::repair`] to cut, or damage ([`classify_bad_tail`]).
    ///
    /// # Errors
    /// [`WalError::Corrupt`] when the bytes are not a torn write or a valid record follows
    /// them; [`WalError::Io`] when the segment cannot be read.
    fn classify(
        file: &Arc<File>,
        path: &Path,
        capacity_bytes: u64,
        offset: u64,
        after_index: Option<u64>,
        reason: String,
    ) -> Result<TornTail, WalError> {
        classify_bad_tail(file, path, capacity_bytes, offset, after_index, &reason)?;
        Ok(TornTail {
            path: path.to_path_buf(),
            file: file.clone(),
            offset,
            capacity_bytes,
            after_index,
            reason,
        })
    }

    /// The segment file the tail is in.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where the torn bytes start, in bytes from the start of the segment.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Bytes a repair would zero (from [`TornTail::offset`] to the segment's end).
    pub fn discarded_bytes(&self) -> u64 {
        self.capacity_bytes - self.offset
    }

    /// Index of the last valid record before the tail (or the purge point when none is
    /// live); the tail holds what was written after it.
    pub fn after_index(&self) -> Option<u64> {
        self.after_index
    }
}

/// The log as read by [`Wal::scan`]: every record checked, nothing on disk changed yet.
/// [`ScannedWal::repair`] decides whether a torn tail may be cut, then cuts it.
pub struct ScannedWal {
    /// Directory of the segments.
    dir: PathBuf,
    /// The valid records found (a torn tail is not among them).
    inner: Inner,
    /// The newest segment's file and path: synced by the repair, so that what it holds
    /// is durable from then on (a process killed before its `fdatasync` left it in the
    /// page cache only).
    newest: Option<(Arc<File>, PathBuf)>,
    /// The torn tail of the newest segment, if any.
    torn: Option<TornTail>,
    /// Index after which a log that starts empty begins (the purge point).
    last_purged: Option<u64>,
}

impl ScannedWal {
    /// Index of the last valid record found (`None`: no live record).
    pub fn last_index(&self) -> Option<u64> {
        self.inner.locs.last_key_value().map(|(i, _)| *i)
    }

    /// The torn tail of the newest segment, if the scan found one.
    pub fn torn_tail(&self) -> Option<&TornTail> {
        self.torn.as_ref()
    }

    /// Cuts the torn tail, if any, unless it may hold a committed entry, and returns the
    /// log. `committed` is a lower bound of the committed index (the store's saved one;
    /// `None`: nothing is known to be committed). A tail after index `i` holds entries
    /// `i + 1` on, so `committed > i` means a committed entry lies in it: then this
    /// refuses with [`WalError::Corrupt`] and leaves every byte on disk as it was (the
    /// evidence stays for inspection). Otherwise the tail is zeroed (logged as a warning),
    /// the newest segment is synced, and a log with no segment gets its first one.
    ///
    /// # Errors
    /// [`WalError::Corrupt`] when a committed entry lies in the torn tail (with the
    /// recovery steps), [`WalError::Io`] when zeroing, syncing or creating fails.
    pub fn repair(self, committed: Option<u64>) -> Result<Wal, WalError> {
        self.repair_checked(committed).map_err(with_hint)
    }

    fn repair_checked(self, committed: Option<u64>) -> Result<Wal, WalError> {
        let ScannedWal {
            dir,
            mut inner,
            newest,
            torn,
            last_purged,
        } = self;
        if let Some(torn) = &torn {
            if let Some(c) = committed
                && torn.after_index.is_none_or(|a| c > a)
            {
                return Err(WalError::Corrupt {
                    path: torn.path.display().to_string(),
                    reason: format!(
                        "{}; it has the shape of a torn write after index {}, but the saved \
                         committed index {c} lies in it, so it held acknowledged entries: \
                         nothing on disk was changed",
                        torn.reason,
                        torn.after_index
                            .map_or_else(|| "none".to_string(), |a| a.to_string()),
                    ),
                });
            }
            tracing::warn!(
                path = %torn.path.display(),
                offset = torn.offset,
                reason = %torn.reason,
                discarded_bytes = torn.discarded_bytes(),
                committed,
                "the newest raft log segment ends in a torn write past the saved committed \
                 index; its unacknowledged tail is discarded"
            );
            zero_range(&torn.file, &torn.path, torn.offset, torn.capacity_bytes)?;
        }
        if let Some((file, path)) = &newest {
            file.sync_data().map_err(io_error(path))?;
        }
        if inner.segments.is_empty() {
            std::fs::create_dir_all(&dir).map_err(io_error(&dir))?;
            let first = last_purged.map_or(0, |p| p + 1);
            inner
                .segments
                .insert(first, create_segment(&dir, first, SEGMENT_BYTES)?);
        }
        Ok(Wal {
            dir,
            inner: Arc::new(Mutex::new(inner)),
        })
    }
}

impl Wal {
    /// Opens (creating if needed) the log in `dir`, checking every record; records at or
    /// below `last_purged` are skipped. A torn tail is cut whatever it holds: this is for
    /// a log with no committed index to check it against (tests, tools); the store uses
    /// [`Wal::scan`] and [`ScannedWal::repair`] with its saved committed index.
    ///
    /// # Errors
    /// [`WalError::Corrupt`] for damage other than a torn tail of the newest segment
    /// (then nothing is changed on disk), [`WalError::Io`] on I/O failure.
    pub fn open(dir: &Path, last_purged: Option<u64>) -> Result<Wal, WalError> {
        Self::scan(dir, last_purged)?.repair(None)
    }

    /// Reads and checks every record in `dir` (records at or below `last_purged` are
    /// skipped) and decides what a bad record is, without writing anything: damage is an
    /// error, a torn tail of the newest segment is reported ([`ScannedWal::torn_tail`])
    /// for [`ScannedWal::repair`] to cut. A missing `dir` reads as an empty log.
    ///
    /// # Errors
    /// [`WalError::Corrupt`] for damage other than a torn tail of the newest segment
    /// (with the recovery steps), [`WalError::Io`] on I/O failure.
    pub fn scan(dir: &Path, last_purged: Option<u64>) -> Result<ScannedWal, WalError> {
        Self::scan_checked(dir, last_purged).map_err(with_hint)
    }

    fn scan_checked(dir: &Path, last_purged: Option<u64>) -> Result<ScannedWal, WalError> {
        let firsts = Self::list_segments(dir)?;
        let mut inner = Inner {
            segments: BTreeMap::new(),
            locs: BTreeMap::new(),
            cache: BTreeMap::new(),
            cache_bytes: 0,
        };
        let mut newest_file = None;
        let mut torn = None;
        let count = firsts.len();
        for (i, first) in firsts.into_iter().enumerate() {
            let newest = i + 1 == count;
            let (segment, tail) = Self::scan_segment(dir, first, newest, last_purged, &mut inner)?;
            if newest {
                newest_file = Some((segment.file.clone(), segment.path.clone()));
                torn = tail;
            }
            inner.segments.insert(first, segment);
        }
        Ok(ScannedWal {
            dir: dir.to_path_buf(),
            inner,
            newest: newest_file,
            torn,
            last_purged,
        })
    }

    /// The first indexes of the segments in `dir`, sorted (a missing `dir` has none).
    ///
    /// # Errors
    /// [`WalError::Corrupt`] for a file in `dir` that is not a segment (its name is not
    /// `<20 digits>.wal`), [`WalError::Io`] when the directory cannot be listed.
    fn list_segments(dir: &Path) -> Result<Vec<u64>, WalError> {
        let mut firsts = Vec::new();
        let listing = match std::fs::read_dir(dir) {
            Ok(listing) => Some(listing),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(io_error(dir)(e)),
        };
        for item in listing.into_iter().flatten() {
            let item = item.map_err(io_error(dir))?;
            let name = item.file_name().to_string_lossy().to_string();
            let parsed = name
                .strip_suffix(&format!(".{SEGMENT_EXT}"))
                .filter(|n| n.len() == 20)
                .and_then(|n| n.parse::<u64>().ok());
            match parsed {
                Some(first) => firsts.push(first),
                None => {
                    return Err(WalError::Corrupt {
                        path: item.path().display().to_string(),
                        reason: "an unknown file in the raft log directory".into(),
                    });
                }
            }
        }
        firsts.sort_unstable();
        Ok(firsts)
    }

    /// Reads and checks every record of the segment starting at index `first`, adding the
    /// live ones (above `last_purged`) to `inner`, and returns the segment (written up to
    /// the end of its last valid record) and its torn tail, if any. Only the `newest`
    /// segment may end in a torn tail: a bad record there, or bytes after a zero header,
    /// is classified ([`TornTail::classify`]) and returned for the repair to decide on;
    /// nothing is written.
    ///
    /// # Errors
    /// [`WalError::Corrupt`] for a bad record in an older segment, damage that is not a
    /// torn write in the newest one, indexes that do not increase or an entry that does not
    /// decode; [`WalError::Io`] when the file cannot be opened or read.
    fn scan_segment(
        dir: &Path,
        first: u64,
        newest: bool,
        last_purged: Option<u64>,
        inner: &mut Inner,
    ) -> Result<(Segment, Option<TornTail>), WalError> {
        let path = segment_path(dir, first);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io_error(&path))?;
        let capacity_bytes = file.metadata().map_err(io_error(&path))?.len();
        let file = Arc::new(file);
        let mut offset = 0;
        let mut last_index = None;
        let mut torn = None;
        // Index of the last record read in this log (live or skipped as purged).
        let last_good = |inner: &Inner| {
            inner
                .locs
                .last_key_value()
                .map(|(i, _)| *i)
                .max(last_purged)
        };
        loop {
            match read_record(&file, capacity_bytes, offset).map_err(io_error(&path))? {
                Read::End if newest => {
                    // A torn write can also leave a zero header followed by written
                    // bytes; they must not read as records once the log goes on here.
                    if !all_zero(&file, offset, capacity_bytes).map_err(io_error(&path))? {
                        let reason = format!("bytes follow the zero header at offset {offset}");
                        let after_index = last_good(inner);
                        torn = Some(TornTail::classify(
                            &file,
                            &path,
                            capacity_bytes,
                            offset,
                            after_index,
                            reason,
                        )?);
                    }
                    break;
                }
                Read::End => break,
                Read::Bad(reason) if newest => {
                    let after_index = last_good(inner);
                    torn = Some(TornTail::classify(
                        &file,
                        &path,
                        capacity_bytes,
                        offset,
                        after_index,
                        reason,
                    )?);
                    break;
                }
                Read::Bad(reason) => {
                    return Err(WalError::Corrupt {
                        path: path.display().to_string(),
                        reason: format!("{reason} (a segment older than the newest is never torn)"),
                    });
                }
                Read::Record(index, payload, end) => {
                    let skip = last_purged.is_some_and(|p| index <= p);
                    if !skip {
                        inner.load_record(&path, first, offset, index, &payload)?;
                        last_index = Some(index);
                    }
                    offset = end;
                }
            }
        }
        let segment = Segment {
            path,
            file,
            capacity_bytes,
            written_bytes: offset,
            last_index,
        };
        Ok((segment, torn))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The last entry's log id, if any entry is live.
    ///
    /// # Errors
    /// I/O errors or damage reading it back (when it is not cached).
    pub fn last(&self) -> Result<Option<crate::LogId>, WalError> {
        let last = {
            let inner = self.lock();
            let Some((last, _)) = inner.locs.last_key_value() else {
                return Ok(None);
            };
            if let Some((e, _)) = inner.cache.get(last) {
                return Ok(Some(e.log_id));
            }
            *last
        };
        Ok(self.read(last, last + 1)?.pop().map(|e| e.log_id))
    }

    /// Live entries with indexes in `[start, end)`, in order (those outside the live log
    /// are left out).
    ///
    /// # Errors
    /// I/O errors or damage found while reading an uncached entry back.
    pub fn read(&self, start: u64, end: u64) -> Result<Vec<Entry>, WalError> {
        self.read_limited(start, end, usize::MAX)
    }

    /// Like [`Wal::read`], but stops before the entry that would bring the entries' encoded
    /// size (their records' payloads, the entries' JSON) past `max_bytes`; the first entry
    /// is returned whatever its size.
    ///
    /// # Errors
    /// I/O errors or damage found while reading an uncached entry back.
    pub fn read_limited(
        &self,
        start: u64,
        end: u64,
        max_bytes: usize,
    ) -> Result<Vec<Entry>, WalError> {
        // Cached entries are cloned under the lock; the rest are read back after it.
        let wanted: Vec<(u64, Wanted)> = {
            let inner = self.lock();
            if start >= end {
                return Ok(Vec::new());
            }
            let mut total_bytes = 0usize;
            inner
                .locs
                .range(start..end)
                .take_while(|(_, loc)| {
                    let first = total_bytes == 0;
                    total_bytes = total_bytes.saturating_add(loc.len as usize);
                    first || total_bytes <= max_bytes
                })
                .map(|(index, loc)| {
                    let item = match inner.cache.get(index) {
                        Some((e, _)) => Wanted::Cached(e.clone()),
                        None => {
                            let seg = &inner.segments[&loc.segment];
                            Wanted::OnDisk(*loc, seg.file.clone(), seg.path.clone())
                        }
                    };
                    (*index, item)
                })
                .collect()
        };
        let mut out = Vec::with_capacity(wanted.len());
        for (index, item) in wanted {
            match item {
                Wanted::Cached(entry) => out.push(entry),
                Wanted::OnDisk(loc, file, path) => {
                    let mut payload = vec![0u8; loc.len as usize];
                    file.read_exact_at(&mut payload, loc.offset + HEADER_BYTES)
                        .map_err(io_error(&path))?;
                    out.push(decode(&path, index, &payload)?);
                }
            }
        }
        Ok(out)
    }

    /// Appends `entries` (consecutive, starting at the next index) and makes them durable
    /// ([`Wal::write`], then [`Unsynced::sync`]).
    ///
    /// # Errors
    /// Encoding or I/O errors; on error nothing new is readable.
    pub fn append(&self, entries: Vec<Entry>) -> Result<(), WalError> {
        match self.write(entries)? {
            Some(unsynced) => unsynced.sync(),
            None => Ok(()),
        }
    }

    /// Writes `entries` (consecutive, starting at the next index) after the last record
    /// and makes them readable, without the final `fdatasync`: the caller makes them
    /// durable with the returned [`Unsynced`] (`None` when `entries` is empty) before it
    /// reports them durable. Segments this append filled are synced here. openraft 0.10
    /// wants exactly this split: an append returns once its entries are readable (the
    /// leader replicates them while its own flush runs) and reports the flush later.
    ///
    /// # Errors
    /// Encoding or I/O errors; on error nothing new is readable.
    pub fn write(&self, entries: Vec<Entry>) -> Result<Option<Unsynced>, WalError> {
        if entries.is_empty() {
            return Ok(None);
        }
        let records: Vec<Vec<u8>> = entries
            .iter()
            .map(encode_record)
            .collect::<Result<_, _>>()?;
        let first_index = entries[0].log_id.index;
        if let Some((i, e)) = entries
            .iter()
            .enumerate()
            .find(|(i, e)| e.log_id.index != first_index + *i as u64)
        {
            return Err(WalError::Corrupt {
                path: self.dir.display().to_string(),
                reason: format!(
                    "an append whose entry {} is not consecutive (expected {})",
                    e.log_id.index,
                    first_index + i as u64
                ),
            });
        }
        // Records stay in increasing index order: appending at or below the last index
        // replaces the log from there.
        if first_index < self.lock().next_index() {
            self.truncate(first_index)?;
        }
        let (mut segment_first, mut file, mut path, mut capacity, mut offset) = {
            let inner = self.lock();
            let (first, seg) = inner
                .segments
                .last_key_value()
                .expect("the log always has a segment to write");
            (
                *first,
                seg.file.clone(),
                seg.path.clone(),
                seg.capacity_bytes,
                seg.written_bytes,
            )
        };
        // Write the records, starting new segments as needed; nothing is published yet.
        let mut new_segments = Vec::new();
        // `(segment, end of its records)` of segments filled by this append.
        let mut filled = Vec::new();
        let mut placed = Vec::with_capacity(records.len());
        let mut run: Vec<u8> = Vec::new();
        let mut run_offset = offset;
        for (entry, record) in entries.iter().zip(&records) {
            let size = record.len() as u64;
            if offset + size > capacity {
                file.write_all_at(&run, run_offset)
                    .map_err(io_error(&path))?;
                file.sync_data().map_err(io_error(&path))?;
                run.clear();
                filled.push((segment_first, offset));
                // Segment names increase with the file order, whatever the index.
                let name = entry.log_id.index.max(segment_first + 1);
                let seg = create_segment(&self.dir, name, SEGMENT_BYTES.max(size + HEADER_BYTES))?;
                segment_first = name;
                file = seg.file.clone();
                path = seg.path.clone();
                capacity = seg.capacity_bytes;
                offset = 0;
                run_offset = 0;
                new_segments.push((segment_first, seg));
            }
            placed.push(Loc {
                segment: segment_first,
                offset,
                len: (size - HEADER_BYTES) as u32,
            });
            run.extend_from_slice(record);
            offset += size;
        }
        file.write_all_at(&run, run_offset)
            .map_err(io_error(&path))?;

        let mut inner = self.lock();
        for (first, seg) in new_segments {
            inner.segments.insert(first, seg);
        }
        filled.push((segment_first, offset));
        for (first, end) in filled {
            if let Some(seg) = inner.segments.get_mut(&first) {
                seg.written_bytes = end;
            }
        }
        for ((entry, loc), record) in entries.into_iter().zip(placed).zip(&records) {
            if let Some(seg) = inner.segments.get_mut(&loc.segment) {
                seg.last_index = Some(entry.log_id.index);
            }
            inner.locs.insert(entry.log_id.index, loc);
            inner.push_cache(entry, record.len() - HEADER_BYTES as usize);
        }
        Ok(Some(Unsynced { file, path }))
    }

    /// Removes every entry with index ≥ `since`, durably.
    ///
    /// # Errors
    /// I/O errors.
    pub fn truncate(&self, since: u64) -> Result<(), WalError> {
        let (doomed, keep) = {
            let mut inner = self.lock();
            let Some(cut) = inner.locs.range(since..).next().map(|(_, l)| *l) else {
                return Ok(()); // nothing at or after `since`
            };
            inner.locs.split_off(&since);
            inner.drop_cache_from(since);
            // Segments after the one holding `since` go (newest first); that one is cut
            // at the record's offset.
            let later: Vec<u64> = inner
                .segments
                .range(cut.segment.saturating_add(1)..)
                .map(|(f, _)| *f)
                .collect();
            let doomed: Vec<Segment> = later
                .into_iter()
                .rev()
                .filter_map(|f| inner.segments.remove(&f))
                .collect();
            let last_kept = inner
                .locs
                .iter()
                .next_back()
                .filter(|(_, l)| l.segment == cut.segment)
                .map(|(i, _)| *i);
            let keep = inner.segments.get_mut(&cut.segment).map(|seg| {
                let old_end = seg.written_bytes;
                seg.written_bytes = cut.offset;
                seg.last_index = last_kept;
                (seg.file.clone(), seg.path.clone(), cut.offset, old_end)
            });
            (doomed, keep)
        };
        for seg in &doomed {
            std::fs::remove_file(&seg.path).map_err(io_error(&seg.path))?;
        }
        if !doomed.is_empty() {
            sync_dir(&self.dir)?;
        }
        if let Some((file, path, from, to)) = keep
            && from < to
        {
            zero_range(&file, &path, from, to)?;
            file.sync_data().map_err(io_error(&path))?;
        }
        Ok(())
    }

    /// Forgets every entry with index ≤ `upto` and deletes the segments holding only such
    /// entries (the newest segment is always kept). The caller records the purge point
    /// durably first.
    ///
    /// # Errors
    /// I/O errors deleting segments.
    pub fn purge(&self, upto: u64) -> Result<(), WalError> {
        let doomed: Vec<Segment> = {
            let mut inner = self.lock();
            inner.locs = inner.locs.split_off(&upto.saturating_add(1));
            inner.drop_cache_through(upto);
            // A segment goes when it holds no live record; the newest always stays.
            let newest = *inner
                .segments
                .last_key_value()
                .expect("the log always has a segment")
                .0;
            let gone: Vec<u64> = inner
                .segments
                .iter()
                .take_while(|(first, seg)| {
                    **first != newest && seg.last_index.is_none_or(|l| l <= upto)
                })
                .map(|(first, _)| *first)
                .collect();
            gone.into_iter()
                .filter_map(|f| inner.segments.remove(&f))
                .collect()
        };
        for seg in &doomed {
            std::fs::remove_file(&seg.path).map_err(io_error(&seg.path))?;
        }
        if !doomed.is_empty() {
            sync_dir(&self.dir)?;
        }
        Ok(())
    }

    /// Number of segment files (for tests and metrics).
    pub fn segment_count(&self) -> usize {
        self.lock().segments.len()
    }
}
