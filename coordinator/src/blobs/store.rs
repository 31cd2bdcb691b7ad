//! The local blob store under `<data-dir>/blobs/`: one file per blob named by its digest,
//! a small JSON sidecar (`<digest>.json`: size, uploader, time stored) beside it, and
//! `.tmp/` for writes in progress (same file system, so the final rename is atomic).
//!
//! A write streams into a temp file while hashing with BLAKE3 on a blocking thread,
//! refuses more or fewer bytes than announced and a digest that differs from the bytes',
//! fsyncs the file and its sidecar, renames both into place and fsyncs the directory;
//! only then is the blob held. A read streams the file on a blocking thread while hashing
//! it again: when the bytes turn out not to be the blob (a disk fault, a hand edit), the
//! stream ends with [`BlobError::Corrupt`] and the file is removed, so a later read fetches
//! the blob again from a peer. What is held is indexed in memory (size, uploader, time
//! stored, time last used), loaded at start from the directory.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use axum::body::Bytes;
use cumulus_api::blobs::{CHUNK_BYTES, is_valid_digest};
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::BlobError;
use crate::soft::now_ms;

/// Most blobs one coordinator holds; a new blob past it is refused (RESOURCE_EXHAUSTED)
/// until garbage collection removes some.
pub const MAX_BLOBS: usize = 100_000;
/// Chunks queued between an upload's stream and its writing thread (each at most a
/// stream's chunk: [`CHUNK_BYTES`] on gRPC).
pub const WRITE_QUEUE_CHUNKS: usize = 4;
/// Chunks a read's thread reads ahead of the client.
pub const READ_QUEUE_CHUNKS: usize = 4;
/// Longest wait for the next chunk of an upload, in milliseconds; past it the upload is
/// dropped and its temp file removed.
pub const CHUNK_IDLE_TIMEOUT_MS: u64 = 60_000;
/// Largest sidecar file read back, in bytes (one is ~150).
pub const MAX_SIDECAR_BYTES: u64 = 4_096;
/// Temp files left in `.tmp/` by no write in progress are removed once this old, in
/// milliseconds (every temp file is removed at start).
pub const STALE_TEMP_MS: u64 = 10 * 60 * 1_000;

/// The directory of the blob store under a data dir.
pub const BLOBS_DIR: &str = "blobs";
/// The temp directory under [`BLOBS_DIR`].
pub const TMP_DIR: &str = ".tmp";
/// The extension of a blob's sidecar.
pub const SIDECAR_EXT: &str = "json";

/// What the sidecar records of a blob: its size, who uploaded it, and when it was stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobMeta {
    /// The blob's size, in bytes.
    pub size_bytes: u64,
    /// Who uploaded it: a user's name, `worker/ID` for an agent's artifacts, or "" when
    /// unknown (a blob found without a sidecar).
    pub uploader: String,
    /// When it was first stored in the cluster (the uploading node's clock), in ms since
    /// the Unix epoch.
    pub stored_at_ms: u64,
}

/// One held blob, in memory.
#[derive(Clone, Debug)]
struct Entry {
    meta: BlobMeta,
    /// When it was last stored, read, stat'ed or named by a submit (this node's clock,
    /// ms since the Unix epoch); garbage collection keeps a blob used since the retention.
    used_at_ms: u64,
}

/// A blob's name and size, as an upload announces them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlobHeader {
    /// BLAKE3 of the bytes, 64 lowercase hex digits.
    pub digest: String,
    /// Bytes the blob has.
    pub size_bytes: u64,
}

/// The index of held blobs, shared with the reading threads (which drop a blob found
/// corrupt).
type Index = Arc<Mutex<HashMap<String, Entry>>>;

/// The local blob store of one coordinator.
pub struct LocalStore {
    /// `<data-dir>/blobs`.
    dir: PathBuf,
    /// `<data-dir>/blobs/.tmp`.
    tmp: PathBuf,
    /// Largest blob accepted, in bytes (`--max-blob-bytes`).
    max_blob_bytes: u64,
    /// What is held.
    index: Index,
    /// Temp files of writes in progress (kept by the sweep of stale ones).
    writing: Mutex<HashSet<PathBuf>>,
    /// Makes temp file names unique within this process.
    next_tmp: AtomicU64,
}

/// The bytes of a held blob, verified as they stream ([`LocalStore::read`]).
pub struct BlobRead {
    /// The blob's size, in bytes.
    pub size_bytes: u64,
    /// Its bytes in chunks of at most [`CHUNK_BYTES`]; the last item is an error when the
    /// bytes turned out not to be the blob (the file is then removed).
    pub chunks: tokio_stream::wrappers::ReceiverStream<Result<Bytes, BlobError>>,
}

/// What goes to a write's thread.
enum Msg {
    Data(Bytes),
    /// Every byte was sent: check and commit. A channel closed without it aborts.
    End,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl LocalStore {
    /// Opens (creating it `0700`) the store under `data_dir`: removes every temp file
    /// (no write survives a restart) and indexes the blobs found, with their sidecars
    /// (an orphan sidecar is removed; a blob without one is indexed as uploaded by
    /// nobody, at its file's time). Blocking.
    ///
    /// # Errors
    /// The directory cannot be created or listed.
    pub fn open(data_dir: &Path, max_blob_bytes: u64) -> anyhow::Result<LocalStore> {
        let dir = data_dir.join(BLOBS_DIR);
        let tmp = dir.join(TMP_DIR);
        for d in [&dir, &tmp] {
            match std::fs::DirBuilder::new().mode(0o700).create(d) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e).with_context(|| format!("creating {}", d.display())),
            }
        }
        for entry in
            std::fs::read_dir(&tmp).with_context(|| format!("listing {}", tmp.display()))?
        {
            let path = entry?.path();
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove a stale blob temp file");
            }
        }
        let index = scan(&dir)?;
        tracing::info!(dir = %dir.display(), blobs = index.len(), "blob store opened");
        Ok(LocalStore {
            dir,
            tmp,
            max_blob_bytes,
            index: Arc::new(Mutex::new(index)),
            writing: Mutex::default(),
            next_tmp: AtomicU64::new(0),
        })
    }

    /// `<data-dir>/blobs`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Largest blob accepted, in bytes.
    pub fn max_blob_bytes(&self) -> u64 {
        self.max_blob_bytes
    }

    /// The blob's path.
    pub fn path_of(&self, digest: &str) -> PathBuf {
        self.dir.join(digest)
    }

    /// What is recorded of `digest` when it is held (by the index; the bytes are checked
    /// when read), marking it used now.
    pub fn held(&self, digest: &str) -> Option<BlobMeta> {
        let mut index = lock(&self.index);
        let entry = index.get_mut(digest)?;
        entry.used_at_ms = now_ms();
        Some(entry.meta.clone())
    }

    /// Bytes of the blobs `uploader` uploaded that this node holds.
    pub fn usage_of(&self, uploader: &str) -> u64 {
        lock(&self.index)
            .values()
            .filter(|e| e.meta.uploader == uploader)
            .map(|e| e.meta.size_bytes)
            .sum()
    }

    /// How many blobs this node holds.
    pub fn count(&self) -> usize {
        lock(&self.index).len()
    }

    /// The blobs neither stored nor used since `before_ms` (ms since the Unix epoch).
    pub fn unused_since(&self, before_ms: u64) -> Vec<String> {
        lock(&self.index)
            .iter()
            .filter(|(_, e)| e.meta.stored_at_ms.max(e.used_at_ms) < before_ms)
            .map(|(d, _)| d.clone())
            .collect()
    }

    /// Checks a header: a digest and a size within the limit.
    ///
    /// # Errors
    /// [`BlobError::Invalid`] naming what is wrong.
    pub fn check_header(&self, header: &BlobHeader) -> Result<(), BlobError> {
        if !is_valid_digest(&header.digest) {
            return Err(BlobError::Invalid(format!(
                "{} is not a blob digest (64 lowercase hex digits of BLAKE3)",
                cumulus_api::text::escape_control(&truncated(&header.digest))
            )));
        }
        if header.size_bytes > self.max_blob_bytes {
            return Err(BlobError::Invalid(format!(
                "blob {} of {} bytes is larger than this cluster accepts ({} bytes, \
                 --max-blob-bytes)",
                header.digest, header.size_bytes, self.max_blob_bytes
            )));
        }
        Ok(())
    }

    /// Stores the blob `header` names from `chunks`, recording `meta`'s uploader and time
    /// (its size is the header's). Returns what was recorded. The bytes go to a temp file
    /// on a blocking thread that hashes them; the blob is held once the file and its
    /// sidecar are fsynced, renamed into place and the directory fsynced.
    ///
    /// # Errors
    /// [`BlobError::Invalid`] for a bad header, more or fewer bytes than announced or a
    /// digest that is not the bytes' (naming both); [`BlobError::Exhausted`] past
    /// [`MAX_BLOBS`]; [`BlobError::Aborted`] when `chunks` fails or stalls for
    /// [`CHUNK_IDLE_TIMEOUT_MS`]; [`BlobError::Io`] when the disk fails. Nothing is
    /// stored on error.
    pub async fn write<S>(
        &self,
        header: &BlobHeader,
        meta: BlobMeta,
        chunks: S,
    ) -> Result<BlobMeta, BlobError>
    where
        S: Stream<Item = Result<Bytes, BlobError>> + Unpin + Send,
    {
        self.check_header(header)?;
        if self.count() >= MAX_BLOBS && self.held(&header.digest).is_none() {
            return Err(BlobError::Exhausted(format!(
                "this coordinator holds {MAX_BLOBS} blobs, the most it keeps; retry once \
                 unreferenced ones are collected"
            )));
        }
        let meta = BlobMeta {
            size_bytes: header.size_bytes,
            ..meta
        };
        let tmp = self.temp_path(&header.digest);
        let _writing = WritingGuard::new(&self.writing, tmp.clone());
        self.stream_to_temp(header, Some(meta.clone()), &tmp, chunks)
            .await?;
        lock(&self.index).insert(
            header.digest.clone(),
            Entry {
                meta: meta.clone(),
                used_at_ms: now_ms(),
            },
        );
        Ok(meta)
    }

    /// Receives the blob `header` names from `chunks` into a temp file of the store,
    /// hashed on a blocking thread as it is written, for an upload on its way elsewhere
    /// (the S3 bucket of `--blob-url`): the blob is not held here, and the file is removed
    /// when the returned [`TempBlob`] is dropped.
    ///
    /// # Errors
    /// As [`LocalStore::write`] (but for [`MAX_BLOBS`], which does not apply); nothing
    /// is left on error.
    pub async fn receive_temp<S>(
        &self,
        header: &BlobHeader,
        chunks: S,
    ) -> Result<TempBlob<'_>, BlobError>
    where
        S: Stream<Item = Result<Bytes, BlobError>> + Unpin + Send,
    {
        self.check_header(header)?;
        let path = self.temp_path(&header.digest);
        let writing = WritingGuard::new(&self.writing, path.clone());
        self.stream_to_temp(header, None, &path, chunks).await?;
        Ok(TempBlob {
            path,
            _writing: writing,
        })
    }

    /// A fresh temp file name for a write of `digest`.
    fn temp_path(&self, digest: &str) -> PathBuf {
        let n = self.next_tmp.fetch_add(1, Ordering::Relaxed);
        self.tmp
            .join(format!("{digest}.{}.{n}", std::process::id()))
    }

    /// Streams `chunks` into `tmp` on a blocking thread that hashes them and checks size
    /// and digest; with `commit`, the file and its sidecar (`commit`) are then fsynced and
    /// renamed into place. The temp files are removed on error.
    async fn stream_to_temp<S>(
        &self,
        header: &BlobHeader,
        commit: Option<BlobMeta>,
        tmp: &Path,
        mut chunks: S,
    ) -> Result<(), BlobError>
    where
        S: Stream<Item = Result<Bytes, BlobError>> + Unpin + Send,
    {
        let (tx, rx) = mpsc::channel(WRITE_QUEUE_CHUNKS);
        let job = WriteJob {
            dir: self.dir.clone(),
            tmp: tmp.to_path_buf(),
            header: header.clone(),
            commit,
        };
        let writer = tokio::task::spawn_blocking(move || job.run(rx));
        let fed = feed(&mut chunks, &tx).await;
        if fed.is_ok() {
            let _ = tx.send(Msg::End).await;
        }
        drop(tx);
        let written = writer
            .await
            .map_err(|e| BlobError::Io(format!("the blob writing task failed: {e}")));
        // The stream's own failure explains an aborted write better than the writer.
        fed?;
        written?
    }

    /// Opens the held blob `digest` for reading: its bytes stream from a blocking thread
    /// that hashes them; a blob whose bytes are not its digest's (or not its recorded
    /// size) ends the stream with [`BlobError::Corrupt`] and is removed. `permit` is held
    /// until the read ends.
    ///
    /// # Errors
    /// [`BlobError::NotFound`] when it is not held; [`BlobError::Io`] when it cannot be
    /// opened.
    pub async fn read(
        &self,
        digest: &str,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<BlobRead, BlobError> {
        let Some(meta) = self.held(digest) else {
            return Err(BlobError::NotFound(format!(
                "blob {digest} is not held by this coordinator"
            )));
        };
        let path = self.path_of(digest);
        let opened = tokio::task::spawn_blocking({
            let path = path.clone();
            move || -> std::io::Result<(std::fs::File, std::fs::Metadata)> {
                let file = std::fs::File::open(&path)?;
                let m = file.metadata()?;
                Ok((file, m))
            }
        })
        .await
        .map_err(|e| BlobError::Io(format!("the blob opening task failed: {e}")))?;
        let (file, file_meta) = match opened {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                lock(&self.index).remove(digest);
                return Err(BlobError::NotFound(format!(
                    "blob {digest} is no longer on this coordinator's disk"
                )));
            }
            Err(e) => {
                return Err(BlobError::Io(format!(
                    "opening blob {}: {e}",
                    path.display()
                )));
            }
        };
        let (tx, rx) = mpsc::channel(READ_QUEUE_CHUNKS);
        let job = ReadJob {
            dir: self.dir.clone(),
            digest: digest.to_string(),
            size_bytes: meta.size_bytes,
            file,
            identity: (file_meta.dev(), file_meta.ino()),
            index: self.index.clone(),
        };
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            job.run(&tx);
        });
        Ok(BlobRead {
            size_bytes: meta.size_bytes,
            chunks: tokio_stream::wrappers::ReceiverStream::new(rx),
        })
    }

    /// Removes the blob `digest` and its sidecar (garbage collection); the index first,
    /// so no new read starts on it.
    ///
    /// # Errors
    /// The file exists and cannot be removed.
    pub async fn remove(&self, digest: &str) -> Result<(), BlobError> {
        lock(&self.index).remove(digest);
        let (dir, digest) = (self.dir.clone(), digest.to_string());
        tokio::task::spawn_blocking(move || remove_files(&dir, &digest))
            .await
            .map_err(|e| BlobError::Io(format!("the blob removal task failed: {e}")))?
            .map_err(|e| BlobError::Io(format!("removing blob {}: {e}", e.kind())))
    }

    /// Removes the blob `digest` when it was neither stored nor used since `before_ms`
    /// (checked and dropped from the index at once, so a use racing with garbage
    /// collection keeps it). Returns its size when removed.
    ///
    /// # Errors
    /// The file exists and cannot be removed.
    pub async fn remove_if_unused(
        &self,
        digest: &str,
        before_ms: u64,
    ) -> Result<Option<u64>, BlobError> {
        let size = {
            let mut index = lock(&self.index);
            match index.get(digest) {
                Some(e) if e.meta.stored_at_ms.max(e.used_at_ms) < before_ms => {
                    let size = e.meta.size_bytes;
                    index.remove(digest);
                    size
                }
                _ => return Ok(None),
            }
        };
        self.remove(digest).await.map(|()| Some(size))
    }

    /// Removes temp files that no write in progress owns and that were last modified
    /// [`STALE_TEMP_MS`] ago or more. Returns how many. Blocking.
    pub fn sweep_temp(&self) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.tmp) else {
            return 0;
        };
        let writing = lock(&self.writing).clone();
        let stale = std::time::SystemTime::now() - Duration::from_millis(STALE_TEMP_MS);
        let mut removed = 0;
        for entry in entries.flatten() {
            let path = entry.path();
            // A sidecar's temp file is its blob's temp name plus an extension.
            let owned = writing.iter().any(|w| {
                path.as_os_str()
                    .as_encoded_bytes()
                    .starts_with(w.as_os_str().as_encoded_bytes())
            });
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t <= stale);
            if old && !owned && std::fs::remove_file(&path).is_ok() {
                removed += 1;
            }
        }
        removed
    }
}

/// Marks a temp file as being written until dropped (also when the write is cancelled).
struct WritingGuard<'a> {
    set: &'a Mutex<HashSet<PathBuf>>,
    path: PathBuf,
}

impl<'a> WritingGuard<'a> {
    fn new(set: &'a Mutex<HashSet<PathBuf>>, path: PathBuf) -> Self {
        lock(set).insert(path.clone());
        WritingGuard { set, path }
    }
}

impl Drop for WritingGuard<'_> {
    fn drop(&mut self) {
        lock(self.set).remove(&self.path);
    }
}

/// A verified blob in a temp file of the store ([`LocalStore::receive_temp`]), removed
/// (on a blocking thread) when dropped.
pub struct TempBlob<'a> {
    path: PathBuf,
    _writing: WritingGuard<'a>,
}

impl TempBlob<'_> {
    /// The temp file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the temp file now (on a blocking thread), rather than when dropped.
    pub async fn discard(mut self) {
        let path = std::mem::take(&mut self.path);
        let _ = tokio::task::spawn_blocking(move || remove_temp(&path)).await;
    }
}

/// Removes a temp file of [`TempBlob`] (one already gone is fine).
fn remove_temp(path: &Path) {
    if let Err(e) = std::fs::remove_file(path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(path = %path.display(), error = %e, "cannot remove a blob temp file");
    }
}

impl Drop for TempBlob<'_> {
    fn drop(&mut self) {
        let path = std::mem::take(&mut self.path);
        if path.as_os_str().is_empty() {
            return;
        }
        let remove = move || remove_temp(&path);
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => drop(handle.spawn_blocking(remove)),
            Err(_) => remove(),
        }
    }
}

/// The first 80 characters of a string a client sent, for a message.
fn truncated(s: &str) -> String {
    s.chars().take(80).collect()
}

/// Sends `chunks` to a write's thread until they end (`Ok`), fail or stall, or the
/// thread stops taking them (`Ok`: the thread's own error says why).
async fn feed<S>(chunks: &mut S, tx: &mpsc::Sender<Msg>) -> Result<(), BlobError>
where
    S: Stream<Item = Result<Bytes, BlobError>> + Unpin + Send,
{
    let idle = Duration::from_millis(CHUNK_IDLE_TIMEOUT_MS);
    loop {
        match tokio::time::timeout(idle, chunks.next()).await {
            Err(_) => {
                return Err(BlobError::Aborted(format!(
                    "no bytes of the upload for {CHUNK_IDLE_TIMEOUT_MS} ms"
                )));
            }
            Ok(None) => return Ok(()),
            Ok(Some(Err(e))) => return Err(e),
            Ok(Some(Ok(data))) => {
                if tx.send(Msg::Data(data)).await.is_err() {
                    return Ok(());
                }
            }
        }
    }
}

/// One write, on a blocking thread.
struct WriteJob {
    dir: PathBuf,
    tmp: PathBuf,
    header: BlobHeader,
    /// The sidecar's record, to commit the blob into place; `None`: leave the verified
    /// temp file (not fsynced) to the caller.
    commit: Option<BlobMeta>,
}

impl WriteJob {
    fn sidecar_tmp(&self) -> PathBuf {
        let mut s = self.tmp.clone().into_os_string();
        s.push(".");
        s.push(SIDECAR_EXT);
        PathBuf::from(s)
    }

    /// Writes, checks and commits; removes its temp files on any error.
    fn run(self, rx: mpsc::Receiver<Msg>) -> Result<(), BlobError> {
        let result = self.write(rx);
        if result.is_err() {
            let _ = std::fs::remove_file(&self.tmp);
            let _ = std::fs::remove_file(self.sidecar_tmp());
        }
        result
    }

    fn write(&self, mut rx: mpsc::Receiver<Msg>) -> Result<(), BlobError> {
        let io = |what: &str, e: std::io::Error| BlobError::Io(format!("{what}: {e}"));
        let BlobHeader { digest, size_bytes } = &self.header;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&self.tmp)
            .map_err(|e| io(&format!("creating {}", self.tmp.display()), e))?;
        let mut hasher = blake3::Hasher::new();
        let mut got: u64 = 0;
        loop {
            match rx.blocking_recv() {
                None => {
                    return Err(BlobError::Aborted(format!(
                        "the upload of blob {digest} ended after {got} of {size_bytes} bytes"
                    )));
                }
                Some(Msg::End) => break,
                Some(Msg::Data(data)) => {
                    got = got.saturating_add(data.len() as u64);
                    if got > *size_bytes {
                        return Err(BlobError::Invalid(format!(
                            "blob {digest}: more bytes than the {size_bytes} announced"
                        )));
                    }
                    hasher.update(&data);
                    file.write_all(&data)
                        .map_err(|e| io(&format!("writing {}", self.tmp.display()), e))?;
                }
            }
        }
        if got != *size_bytes {
            return Err(BlobError::Invalid(format!(
                "blob {digest}: {got} bytes received, {size_bytes} announced"
            )));
        }
        let actual = hasher.finalize().to_hex();
        if actual.as_str() != digest {
            return Err(BlobError::Invalid(format!(
                "blob digest mismatch: expected {digest}, got {actual} (BLAKE3 of the \
                 {got} bytes received)"
            )));
        }
        let Some(meta) = &self.commit else {
            return Ok(());
        };
        file.sync_all()
            .map_err(|e| io(&format!("fsync {}", self.tmp.display()), e))?;
        drop(file);
        let sidecar_tmp = self.sidecar_tmp();
        let json = serde_json::to_vec(meta)
            .map_err(|e| BlobError::Io(format!("encoding a sidecar: {e}")))?;
        let mut side = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&sidecar_tmp)
            .map_err(|e| io(&format!("creating {}", sidecar_tmp.display()), e))?;
        side.write_all(&json)
            .and_then(|()| side.sync_all())
            .map_err(|e| io(&format!("writing {}", sidecar_tmp.display()), e))?;
        let final_path = self.dir.join(digest);
        std::fs::rename(&sidecar_tmp, final_path.with_extension(SIDECAR_EXT))
            .map_err(|e| io("renaming a blob's sidecar into place", e))?;
        std::fs::rename(&self.tmp, &final_path)
            .map_err(|e| io(&format!("renaming blob {digest} into place"), e))?;
        std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io(&format!("fsync {}", self.dir.display()), e))?;
        Ok(())
    }
}

/// One read, on a blocking thread.
struct ReadJob {
    dir: PathBuf,
    digest: String,
    size_bytes: u64,
    file: std::fs::File,
    /// The opened file's `(dev, inode)`: a corrupt file is removed only while its path
    /// still names it (not a good copy renamed over it meanwhile).
    identity: (u64, u64),
    index: Index,
}

impl ReadJob {
    fn run(mut self, tx: &mpsc::Sender<Result<Bytes, BlobError>>) {
        let mut hasher = blake3::Hasher::new();
        let mut total: u64 = 0;
        loop {
            let mut buf = vec![0u8; CHUNK_BYTES];
            let n = match read_full(&mut self.file, &mut buf) {
                Ok(n) => n,
                Err(e) => {
                    let _ = tx.blocking_send(Err(BlobError::Io(format!(
                        "reading blob {}: {e}",
                        self.digest
                    ))));
                    return;
                }
            };
            if n == 0 {
                break;
            }
            buf.truncate(n);
            total = total.saturating_add(n as u64);
            if total > self.size_bytes {
                break;
            }
            hasher.update(&buf);
            if tx.blocking_send(Ok(Bytes::from(buf))).is_err() {
                return; // the reader went away
            }
        }
        let actual = hasher.finalize().to_hex();
        if total == self.size_bytes && actual.as_str() == self.digest {
            return;
        }
        let why = if total == self.size_bytes {
            format!("its bytes hash to {actual}")
        } else {
            format!("its file holds {total}+ bytes, not {}", self.size_bytes)
        };
        tracing::error!(
            digest = %self.digest,
            %why,
            "a stored blob failed verification; removing it (a later read fetches it from a peer)"
        );
        self.drop_corrupt();
        let _ = tx.blocking_send(Err(BlobError::Corrupt(format!(
            "blob {} failed verification on this coordinator ({why}); it was removed, and \
             a retry fetches it from another coordinator",
            self.digest
        ))));
    }

    fn drop_corrupt(&self) {
        let path = self.dir.join(&self.digest);
        let same =
            std::fs::symlink_metadata(&path).is_ok_and(|m| (m.dev(), m.ino()) == self.identity);
        if same {
            lock(&self.index).remove(&self.digest);
            if let Err(e) = remove_files(&self.dir, &self.digest) {
                tracing::warn!(digest = %self.digest, error = %e, "cannot remove a corrupt blob");
            }
        }
    }
}

/// Reads until `buf` is full or the file ends.
fn read_full(file: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Removes a blob's file and sidecar (missing ones are fine), then fsyncs the directory.
fn remove_files(dir: &Path, digest: &str) -> std::io::Result<()> {
    let path = dir.join(digest);
    for p in [path.with_extension(SIDECAR_EXT), path] {
        match std::fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    std::fs::File::open(dir)?.sync_all()
}

/// Indexes the blobs in `dir`: files named by a digest, with their sidecars. A sidecar
/// whose blob is missing is removed; one that is unreadable, too large or of another
/// size is ignored (the blob is indexed as uploaded by nobody, at its file's time).
fn scan(dir: &Path) -> anyhow::Result<HashMap<String, Entry>> {
    let mut index = HashMap::new();
    let mut sidecars = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let entry = entry.with_context(|| format!("listing {}", dir.display()))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(digest) = name.strip_suffix(&format!(".{SIDECAR_EXT}")) {
            if is_valid_digest(digest) {
                sidecars.push(digest.to_string());
            }
            continue;
        }
        if !is_valid_digest(name) {
            continue;
        }
        let meta = entry.metadata()?;
        if !meta.is_file() {
            continue;
        }
        if index.len() >= MAX_BLOBS {
            tracing::warn!(
                dir = %dir.display(),
                "more than {MAX_BLOBS} blobs on disk; the rest are not served"
            );
            break;
        }
        let mtime_ms = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as u64);
        let recorded = read_sidecar(&dir.join(name).with_extension(SIDECAR_EXT))
            .filter(|m| m.size_bytes == meta.len());
        let meta = recorded.unwrap_or(BlobMeta {
            size_bytes: meta.len(),
            uploader: String::new(),
            stored_at_ms: mtime_ms,
        });
        index.insert(
            name.to_string(),
            Entry {
                used_at_ms: meta.stored_at_ms,
                meta,
            },
        );
    }
    for digest in sidecars {
        if !index.contains_key(&digest) {
            let _ = std::fs::remove_file(dir.join(&digest).with_extension(SIDECAR_EXT));
        }
    }
    Ok(index)
}

/// A sidecar's record, or `None` when it is missing, larger than [`MAX_SIDECAR_BYTES`]
/// or not one.
fn read_sidecar(path: &Path) -> Option<BlobMeta> {
    let mut text = Vec::new();
    std::fs::File::open(path)
        .ok()?
        .take(MAX_SIDECAR_BYTES + 1)
        .read_to_end(&mut text)
        .ok()?;
    if text.len() as u64 > MAX_SIDECAR_BYTES {
        return None;
    }
    serde_json::from_slice(&text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest_of(data: &[u8]) -> String {
        blake3::hash(data).to_hex().to_string()
    }

    fn chunks(data: &[u8]) -> impl Stream<Item = Result<Bytes, BlobError>> + Unpin + Send {
        let pieces: Vec<Result<Bytes, BlobError>> = data
            .chunks(7)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        futures::stream::iter(pieces)
    }

    fn meta(uploader: &str) -> BlobMeta {
        BlobMeta {
            size_bytes: 0,
            uploader: uploader.into(),
            stored_at_ms: 1_000,
        }
    }

    fn permit() -> tokio::sync::OwnedSemaphorePermit {
        Arc::new(tokio::sync::Semaphore::new(1))
            .try_acquire_owned()
            .expect("a permit")
    }

    async fn read_all(store: &LocalStore, digest: &str) -> Result<Vec<u8>, BlobError> {
        let mut read = store.read(digest, permit()).await?;
        let mut out = Vec::new();
        while let Some(chunk) = read.chunks.next().await {
            out.extend_from_slice(&chunk?);
        }
        Ok(out)
    }

    fn tmp_files(store: &LocalStore) -> usize {
        std::fs::read_dir(&store.tmp).expect("tmp").count()
    }

    #[tokio::test]
    async fn a_blob_is_stored_verified_and_read_back() {
        let tmp = tempfile::tempdir().expect("tmp");
        let store = LocalStore::open(tmp.path(), 1 << 20).expect("open");
        let data: Vec<u8> = (0..100u32).flat_map(u32::to_le_bytes).collect();
        let header = BlobHeader {
            digest: digest_of(&data),
            size_bytes: data.len() as u64,
        };
        let stored = store
            .write(&header, meta("alice"), chunks(&data))
            .await
            .expect("write");
        assert_eq!(stored.size_bytes, 400);
        assert_eq!(store.held(&header.digest), Some(stored.clone()));
        assert_eq!(store.usage_of("alice"), 400);
        assert_eq!(store.usage_of("bob"), 0);
        assert_eq!(read_all(&store, &header.digest).await.expect("read"), data);
        assert_eq!(tmp_files(&store), 0);

        // Reopened: the index comes back from the directory, with the sidecar.
        drop(store);
        let store = LocalStore::open(tmp.path(), 1 << 20).expect("reopen");
        assert_eq!(store.held(&header.digest), Some(stored));
    }

    #[tokio::test]
    async fn wrong_digests_sizes_and_limits_are_refused_and_leave_nothing() {
        let tmp = tempfile::tempdir().expect("tmp");
        let store = LocalStore::open(tmp.path(), 64).expect("open");
        let data = b"hello blob store".to_vec();
        let good = digest_of(&data);
        let wrong = digest_of(b"something else");
        let cases = [
            (wrong.clone(), data.len() as u64, "expected"),
            (good.clone(), data.len() as u64 + 1, "announced"),
            (good.clone(), data.len() as u64 - 1, "more bytes"),
            (good.clone(), 65, "larger than"),
            ("ABC".to_string(), 3, "not a blob digest"),
        ];
        for (digest, size_bytes, says) in cases {
            let header = BlobHeader { digest, size_bytes };
            let err = store
                .write(&header, meta("alice"), chunks(&data))
                .await
                .expect_err("refused");
            assert!(matches!(err, BlobError::Invalid(_)), "{err}");
            assert!(err.to_string().contains(says), "{err}");
        }
        let err = store
            .write(
                &BlobHeader {
                    digest: wrong.clone(),
                    size_bytes: data.len() as u64,
                },
                meta("alice"),
                chunks(&data),
            )
            .await
            .expect_err("mismatch");
        assert!(err.to_string().contains(&good), "names what was got: {err}");
        assert_eq!(store.count(), 0);
        assert_eq!(tmp_files(&store), 0);

        // A stream that fails midway stores nothing either.
        let broken = futures::stream::iter(vec![
            Ok(Bytes::from_static(b"hello")),
            Err(BlobError::Aborted("the client went away".into())),
        ]);
        let err = store
            .write(
                &BlobHeader {
                    digest: good,
                    size_bytes: data.len() as u64,
                },
                meta("alice"),
                broken,
            )
            .await
            .expect_err("aborted");
        assert!(err.to_string().contains("went away"), "{err}");
        assert_eq!(store.count(), 0);
        assert_eq!(tmp_files(&store), 0);
    }

    #[tokio::test]
    async fn a_temp_receive_is_verified_not_held_and_removed_when_done() {
        let tmp = tempfile::tempdir().expect("tmp");
        let store = LocalStore::open(tmp.path(), 1 << 20).expect("open");
        let data = b"on its way to a bucket".to_vec();
        let header = BlobHeader {
            digest: digest_of(&data),
            size_bytes: data.len() as u64,
        };
        let temp = store
            .receive_temp(&header, chunks(&data))
            .await
            .expect("received");
        assert_eq!(std::fs::read(temp.path()).expect("temp"), data);
        assert!(store.held(&header.digest).is_none(), "not held here");
        assert_eq!(store.sweep_temp(), 0, "a live temp file is not swept");
        temp.discard().await;
        assert_eq!(tmp_files(&store), 0);

        let wrong = BlobHeader {
            digest: digest_of(b"other bytes"),
            size_bytes: data.len() as u64,
        };
        let err = store
            .receive_temp(&wrong, chunks(&data))
            .await
            .err()
            .expect("a wrong digest");
        assert!(matches!(err, BlobError::Invalid(_)), "{err}");
        assert_eq!(tmp_files(&store), 0, "nothing left");
    }

    #[tokio::test]
    async fn a_corrupt_blob_ends_its_read_with_an_error_and_is_removed() {
        let tmp = tempfile::tempdir().expect("tmp");
        let store = LocalStore::open(tmp.path(), 1 << 20).expect("open");
        let data = vec![7u8; 3 * 1024];
        let header = BlobHeader {
            digest: digest_of(&data),
            size_bytes: data.len() as u64,
        };
        store
            .write(&header, meta("alice"), chunks(&data))
            .await
            .expect("write");
        let path = store.path_of(&header.digest);
        let mut bad = data.clone();
        bad[100] ^= 1;
        std::fs::write(&path, &bad).expect("corrupt it");
        let err = read_all(&store, &header.digest).await.expect_err("corrupt");
        assert!(matches!(err, BlobError::Corrupt(_)), "{err}");
        assert!(!path.exists(), "the corrupt file is removed");
        assert!(!path.with_extension(SIDECAR_EXT).exists());
        assert!(store.held(&header.digest).is_none());
        let err = read_all(&store, &header.digest).await.expect_err("gone");
        assert!(matches!(err, BlobError::NotFound(_)), "{err}");
    }

    #[tokio::test]
    async fn unused_blobs_are_listed_and_removed_and_stale_temp_files_swept() {
        let tmp = tempfile::tempdir().expect("tmp");
        let store = LocalStore::open(tmp.path(), 1 << 20).expect("open");
        let data = b"old".to_vec();
        let header = BlobHeader {
            digest: digest_of(&data),
            size_bytes: 3,
        };
        store
            .write(&header, meta("bob"), chunks(&data))
            .await
            .expect("write");
        // Just used: not listed before now; listed for a later cut.
        assert!(store.unused_since(1_000).is_empty());
        assert_eq!(
            store.unused_since(now_ms() + 1),
            vec![header.digest.clone()]
        );
        store.remove(&header.digest).await.expect("remove");
        assert_eq!(store.count(), 0);
        assert_eq!(store.usage_of("bob"), 0);
        assert!(!store.path_of(&header.digest).exists());

        let stale = store.tmp.join("leftover");
        std::fs::write(&stale, b"x").expect("write");
        let old = std::time::SystemTime::now() - Duration::from_millis(STALE_TEMP_MS + 1_000);
        std::fs::File::options()
            .write(true)
            .open(&stale)
            .and_then(|f| f.set_modified(old))
            .expect("age it");
        let fresh = store.tmp.join("fresh");
        std::fs::write(&fresh, b"x").expect("write");
        assert_eq!(store.sweep_temp(), 1);
        assert!(!stale.exists() && fresh.exists());
    }
}
