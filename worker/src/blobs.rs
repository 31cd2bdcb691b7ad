//! The agent's side of the blob store ([`cumulus_api::blobs`]): a verified, size-bounded
//! cache of the blobs its attempts need (a job's packed working directory), and uploads
//! of what attempts leave (their artifacts).
//!
//! The cache lives in `<data-dir>/blob-cache/<digest>`, one file per blob, closed to
//! ranks (`0700`). A blob is fetched once per digest (`WorkerService.GetBlob` through the
//! agent's leader-following client): into a temporary file in the same directory while
//! hashing it, its digest and size checked, fsynced, then renamed to its name. Attempts
//! that want a blob being fetched wait on that fetch (one flight per digest). Before each
//! use a cached blob is hashed again; one whose bytes no longer match its name is removed,
//! logged and fetched again (once). Leases ([`BlobLease`]) pin a blob while an attempt
//! unpacks it; past `--blob-cache-bytes` the least recently used unpinned blobs are
//! removed to make room, and a blob that cannot fit is refused.
//!
//! Bounds: every transfer has a deadline of [`TRANSFER_BASE_TIMEOUT`] plus its size at
//! [`TRANSFER_MIN_RATE_BYTES_PER_S`] ([`transfer_deadline`]), a stream that delivers
//! nothing for [`TRANSFER_STALL_TIMEOUT`] fails, a fetch is tried [`FETCH_ATTEMPTS`]
//! times, an upload [`UPLOAD_ATTEMPTS`] times; a blob is at most
//! [`cumulus_api::blobs::MAX_BLOB_BYTES`] and at most the cache's size.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cumulus_api::blobs::{CHUNK_BYTES, MAX_BLOB_BYTES, is_valid_digest};
use cumulus_api::v1::{BlobChunk, GetBlobRequest};
use futures::future::BoxFuture;
use futures::{Stream, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::client::CoordinatorClient;

/// The cache's directory under the data dir.
pub const BLOB_CACHE_DIR: &str = "blob-cache";
/// Default of `--blob-cache-bytes`: 10 GiB.
pub const DEFAULT_BLOB_CACHE_BYTES: u64 = 10 * 1024 * 1024 * 1024;
/// Fixed part of a transfer's deadline.
pub const TRANSFER_BASE_TIMEOUT: Duration = Duration::from_secs(60);
/// Slowest transfer rate a deadline allows for, in bytes per second (1 MiB/s): a 512 MiB
/// workdir gets 60 s + 512 s.
pub const TRANSFER_MIN_RATE_BYTES_PER_S: u64 = 1024 * 1024;
/// Longest wait for the next chunk of a transfer.
pub const TRANSFER_STALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Fetches of one blob per use (a stream that broke is fetched again from the start).
pub const FETCH_ATTEMPTS: u32 = 3;
/// Attempts of one upload (leader following included).
pub const UPLOAD_ATTEMPTS: u32 = 4;
/// Prefix of the cache's temporary files (removed when the cache opens).
const PART_PREFIX: &str = ".part-";

/// The deadline of a transfer of `size_bytes`: [`TRANSFER_BASE_TIMEOUT`] plus the size at
/// [`TRANSFER_MIN_RATE_BYTES_PER_S`].
pub fn transfer_deadline(size_bytes: u64) -> Duration {
    TRANSFER_BASE_TIMEOUT + Duration::from_secs(size_bytes / TRANSFER_MIN_RATE_BYTES_PER_S)
}

/// A stream of a blob's bytes, in pieces.
pub type ByteStream = Pin<Box<dyn Stream<Item = Result<Vec<u8>, String>> + Send>>;

/// Where blobs come from and go to: the coordinators ([`CoordinatorClient`]), or in this
/// crate's tests a store in memory.
pub trait BlobTransport: Send + Sync {
    /// Opens blob `digest` for reading: its bytes in order. Errors are in words.
    fn get<'a>(&'a self, digest: &'a str) -> BoxFuture<'a, Result<ByteStream, String>>;

    /// Stores the file at `path` as blob `blob` (its digest and size in bytes), within
    /// `deadline`. Errors are in words.
    fn put<'a>(
        &'a self,
        path: &'a Path,
        blob: (&'a str, u64),
        deadline: Duration,
    ) -> BoxFuture<'a, Result<(), String>>;
}

/// The file being uploaded, as each attempt of a `PutBlob` call reads it again.
#[derive(Clone)]
struct Upload {
    path: PathBuf,
    digest: String,
    size_bytes: u64,
}

impl BlobTransport for CoordinatorClient {
    fn get<'a>(&'a self, digest: &'a str) -> BoxFuture<'a, Result<ByteStream, String>> {
        Box::pin(async move {
            let request = GetBlobRequest {
                digest: digest.to_string(),
            };
            let stream = self
                .call_transfer(
                    "GetBlob",
                    (2, crate::client::REQUEST_TIMEOUT),
                    &request,
                    |mut c, r| async move { c.get_blob(r).await },
                )
                .await
                .map_err(|e| e.to_string())?;
            let expected = digest.to_string();
            let bytes = stream.map(move |chunk| match chunk {
                Ok(c) if !c.digest.is_empty() && c.digest != expected => Err(format!(
                    "the coordinator sent blob {} for {expected}",
                    cumulus_api::text::escape_control(&c.digest)
                )),
                Ok(c) => Ok(c.data),
                Err(status) => Err(format!("{:?}: {}", status.code(), status.message())),
            });
            Ok(Box::pin(bytes) as ByteStream)
        })
    }

    fn put<'a>(
        &'a self,
        path: &'a Path,
        (digest, size_bytes): (&'a str, u64),
        deadline: Duration,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let upload = Upload {
                path: path.to_owned(),
                digest: digest.to_string(),
                size_bytes,
            };
            let answer = self
                .call_transfer(
                    "PutBlob",
                    (UPLOAD_ATTEMPTS, deadline),
                    &upload,
                    |mut c, r| async move {
                        let (meta, ext, upload) = r.into_parts();
                        let chunks = file_chunks(upload).await.map_err(|e| {
                            tonic::Status::internal(format!("cannot read the upload: {e}"))
                        })?;
                        c.put_blob(tonic::Request::from_parts(meta, ext, chunks))
                            .await
                    },
                )
                .await
                .map_err(|e| e.to_string())?;
            if answer.digest != digest || answer.size_bytes != size_bytes {
                return Err(format!(
                    "the coordinator stored {} of {} bytes instead",
                    cumulus_api::text::escape_control(&answer.digest),
                    answer.size_bytes
                ));
            }
            Ok(())
        })
    }
}

/// The chunks of an upload: the file read in [`CHUNK_BYTES`] pieces, the first naming
/// the blob. A file that does not hold exactly the announced bytes ends the stream early
/// (the coordinator then refuses the upload).
async fn file_chunks(upload: Upload) -> io::Result<impl Stream<Item = BlobChunk> + Send + 'static> {
    let file = tokio::fs::File::open(&upload.path).await?;
    let state = (file, upload, 0u64, true);
    Ok(futures::stream::unfold(
        state,
        |(mut file, upload, sent, first)| async move {
            if !first && sent >= upload.size_bytes {
                return None;
            }
            let mut data = Vec::with_capacity(CHUNK_BYTES);
            let want = (upload.size_bytes - sent).min(CHUNK_BYTES as u64);
            match (&mut file).take(want).read_to_end(&mut data).await {
                Ok(n) if n as u64 == want => {}
                _ => return None,
            }
            let chunk = BlobChunk {
                digest: if first {
                    upload.digest.clone()
                } else {
                    String::new()
                },
                size_bytes: if first { upload.size_bytes } else { 0 },
                data,
            };
            Some((chunk, (file, upload, sent + want, false)))
        },
    ))
}

/// Why a blob could not be had.
#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    /// The reference names no blob: a bad digest, or a size of 0 or above the limits.
    #[error(
        "blob {digest} of {size_bytes} bytes is not a valid reference (the limit here is {max_bytes} bytes)"
    )]
    Invalid {
        /// The digest as given (escaped).
        digest: String,
        /// The size as given.
        size_bytes: u64,
        /// The largest blob this cache takes.
        max_bytes: u64,
    },
    /// Every cached blob is in use and the new one does not fit beside them.
    #[error(
        "the blob cache is full ({used_bytes} of {max_bytes} bytes in blobs in use): cannot fetch {size_bytes} more bytes"
    )]
    Full {
        /// Bytes of the blobs in use and in flight.
        used_bytes: u64,
        /// `--blob-cache-bytes`.
        max_bytes: u64,
        /// The blob's size.
        size_bytes: u64,
    },
    /// The fetch failed (every attempt), or what arrived did not match the reference.
    #[error("cannot fetch blob {digest} from the coordinators: {why}")]
    Fetch {
        /// The blob.
        digest: String,
        /// What failed last.
        why: String,
    },
    /// A local file operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was done.
        op: &'static str,
        /// On what.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> BlobError + use<> {
    let path = path.to_owned();
    move |source| BlobError::Io { op, path, source }
}

/// One cached blob.
#[derive(Debug)]
struct Cached {
    size_bytes: u64,
    /// The cache's clock at its last use: the smallest is evicted first.
    last_used: u64,
    /// Leases held on it.
    users: usize,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<String, Cached>,
    /// Bytes of the cached blobs.
    cached_bytes: u64,
    /// Bytes reserved for fetches in flight.
    reserved_bytes: u64,
    clock: u64,
    /// One lock per digest being had: its holder fetches, the others wait.
    flights: HashMap<String, Arc<tokio::sync::Mutex<()>>>,
}

/// The agent's blob cache (see the module documentation). Shared (`Arc`).
pub struct BlobCache {
    dir: PathBuf,
    max_bytes: u64,
    transport: Arc<dyn BlobTransport>,
    state: Mutex<State>,
}

impl std::fmt::Debug for BlobCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobCache")
            .field("dir", &self.dir)
            .field("max_bytes", &self.max_bytes)
            .finish_non_exhaustive()
    }
}

/// A cached blob pinned for one use: not evicted until dropped.
#[derive(Debug)]
pub struct BlobLease {
    cache: Arc<BlobCache>,
    digest: String,
    path: PathBuf,
}

impl BlobLease {
    /// The blob's file (verified when the lease was given).
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for BlobLease {
    fn drop(&mut self) {
        let mut st = self.cache.lock();
        st.clock += 1;
        let now = st.clock;
        if let Some(e) = st.entries.get_mut(&self.digest) {
            e.users = e.users.saturating_sub(1);
            e.last_used = now;
        }
    }
}

impl BlobCache {
    /// Opens the cache in `<data_dir>/blob-cache` (created `0700`): the blobs found there
    /// are indexed (oldest modification first in the eviction order), temporary files
    /// and foreign names are removed, and the cache is trimmed to `max_bytes`.
    ///
    /// # Errors
    /// The directory cannot be created or read.
    pub fn open(
        data_dir: &Path,
        max_bytes: u64,
        transport: Arc<dyn BlobTransport>,
    ) -> Result<Arc<Self>, BlobError> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let dir = data_dir.join(BLOB_CACHE_DIR);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(io_err("create", &dir))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err("chmod", &dir))?;
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&dir).map_err(io_err("read", &dir))? {
            let entry = entry.map_err(io_err("read", &dir))?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let meta = entry.metadata().map_err(io_err("stat", &path))?;
            if is_valid_digest(&name) && meta.is_file() && meta.len() > 0 {
                found.push((meta.modified().ok(), name, meta.len()));
            } else {
                tracing::info!(path = %path.display(), "removing a stray file of the blob cache");
                let removed = if meta.is_dir() {
                    std::fs::remove_dir_all(&path)
                } else {
                    std::fs::remove_file(&path)
                };
                removed.map_err(io_err("remove", &path))?;
            }
        }
        found.sort();
        let mut state = State::default();
        for (clock, (_, name, size_bytes)) in found.into_iter().enumerate() {
            state.cached_bytes += size_bytes;
            state.entries.insert(
                name,
                Cached {
                    size_bytes,
                    last_used: clock as u64,
                    users: 0,
                },
            );
            state.clock = clock as u64 + 1;
        }
        let cache = Arc::new(Self {
            dir,
            max_bytes,
            transport,
            state: Mutex::new(state),
        });
        let victims = cache.lock().evict_to(max_bytes);
        cache.remove_files(&victims);
        Ok(cache)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("blob cache lock poisoned")
    }

    /// The file of a cached blob.
    fn path_of(&self, digest: &str) -> PathBuf {
        self.dir.join(digest)
    }

    /// Bytes of the blobs cached now.
    pub fn cached_bytes(&self) -> u64 {
        self.lock().cached_bytes
    }

    /// Whether blob `digest` is cached now.
    pub fn contains(&self, digest: &str) -> bool {
        self.lock().entries.contains_key(digest)
    }

    /// How many callers are getting `digest` now (fetching it or waiting for its fetch).
    pub fn in_flight(&self, digest: &str) -> usize {
        self.lock()
            .flights
            .get(digest)
            .map_or(0, |f| Arc::strong_count(f).saturating_sub(1))
    }

    /// The blob `digest` of `size_bytes`, verified, pinned until the lease is dropped:
    /// from the cache when its bytes still match its name, else fetched (see the module
    /// documentation).
    ///
    /// # Errors
    /// [`BlobError`]: an invalid reference, a full cache, a failed or mismatched fetch,
    /// a local I/O error.
    pub async fn get(
        self: &Arc<Self>,
        digest: &str,
        size_bytes: u64,
    ) -> Result<BlobLease, BlobError> {
        let max = self.max_bytes.min(MAX_BLOB_BYTES);
        if !is_valid_digest(digest) || size_bytes == 0 || size_bytes > max {
            return Err(BlobError::Invalid {
                digest: cumulus_api::text::escape_control(digest)
                    .chars()
                    .take(80)
                    .collect(),
                size_bytes,
                max_bytes: max,
            });
        }
        let flight = Arc::clone(self.lock().flights.entry(digest.to_string()).or_default());
        let result = {
            let _turn = flight.lock().await;
            self.get_in_flight(digest, size_bytes).await
        };
        let mut st = self.lock();
        // The map's reference and ours: nobody else waits, the flight is over.
        if Arc::strong_count(&flight) == 2 {
            st.flights.remove(digest);
        }
        result
    }

    /// [`Self::get`] while holding the digest's flight.
    async fn get_in_flight(
        self: &Arc<Self>,
        digest: &str,
        size_bytes: u64,
    ) -> Result<BlobLease, BlobError> {
        if let Some(lease) = self.pin(digest) {
            match verify(lease.path(), digest, size_bytes).await {
                Ok(()) => return Ok(lease),
                Err(why) => {
                    tracing::warn!(
                        digest,
                        path = %lease.path().display(),
                        "a cached blob no longer matches its digest ({why}): removed, fetched again"
                    );
                    drop(lease);
                    self.forget(digest);
                }
            }
        }
        self.fetch(digest, size_bytes).await
    }

    /// A lease on a cached blob, or `None` when it is not cached.
    fn pin(self: &Arc<Self>, digest: &str) -> Option<BlobLease> {
        let mut st = self.lock();
        st.clock += 1;
        let now = st.clock;
        let e = st.entries.get_mut(digest)?;
        e.users += 1;
        e.last_used = now;
        Some(BlobLease {
            cache: Arc::clone(self),
            digest: digest.to_string(),
            path: self.path_of(digest),
        })
    }

    /// Removes a cached blob (its file and its entry).
    fn forget(&self, digest: &str) {
        {
            let mut st = self.lock();
            if let Some(e) = st.entries.remove(digest) {
                st.cached_bytes -= e.size_bytes;
            }
        }
        self.remove_files(&[digest.to_string()]);
    }

    fn remove_files(&self, digests: &[String]) {
        for d in digests {
            let path = self.path_of(d);
            match std::fs::remove_file(&path) {
                Ok(()) => tracing::info!(digest = %d, "blob removed from the cache"),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %path.display(), "cannot remove a cached blob: {e}")
                }
            }
        }
    }

    /// Fetches a blob into the cache: room reserved first (evicting unpinned blobs),
    /// then up to [`FETCH_ATTEMPTS`] downloads, each within [`transfer_deadline`].
    async fn fetch(
        self: &Arc<Self>,
        digest: &str,
        size_bytes: u64,
    ) -> Result<BlobLease, BlobError> {
        let victims = {
            let mut st = self.lock();
            let victims = st.evict_to(self.max_bytes.saturating_sub(size_bytes));
            let used = st.cached_bytes + st.reserved_bytes;
            if used + size_bytes > self.max_bytes {
                return Err(BlobError::Full {
                    used_bytes: used,
                    max_bytes: self.max_bytes,
                    size_bytes,
                });
            }
            st.reserved_bytes += size_bytes;
            victims
        };
        self.remove_files(&victims);
        let mut last = String::new();
        let mut fetched = false;
        for attempt in 1..=FETCH_ATTEMPTS {
            match self.download(digest, size_bytes).await {
                Ok(()) => {
                    fetched = true;
                    break;
                }
                Err(why) => {
                    tracing::warn!(digest, attempt, "fetching a blob failed: {why}");
                    last = why;
                }
            }
        }
        let mut st = self.lock();
        st.reserved_bytes -= size_bytes;
        if !fetched {
            return Err(BlobError::Fetch {
                digest: digest.to_string(),
                why: last,
            });
        }
        st.clock += 1;
        let now = st.clock;
        st.cached_bytes += size_bytes;
        st.entries.insert(
            digest.to_string(),
            Cached {
                size_bytes,
                last_used: now,
                users: 1,
            },
        );
        tracing::info!(digest, size_bytes, "blob fetched into the cache");
        Ok(BlobLease {
            cache: Arc::clone(self),
            digest: digest.to_string(),
            path: self.path_of(digest),
        })
    }

    /// One download into a temporary file, hashed as it is written, checked, fsynced and
    /// renamed to the blob's name. The temporary file is removed on any failure.
    async fn download(&self, digest: &str, size_bytes: u64) -> Result<(), String> {
        let part = self.dir.join(format!(
            "{PART_PREFIX}{digest}-{}",
            hex::encode(rand::random::<[u8; 4]>())
        ));
        let result = tokio::time::timeout(
            transfer_deadline(size_bytes),
            self.download_to(&part, digest, size_bytes),
        )
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "not done within {} s",
                transfer_deadline(size_bytes).as_secs()
            ))
        });
        if result.is_err() {
            let _ = tokio::fs::remove_file(&part).await;
            return result;
        }
        let target = self.path_of(digest);
        tokio::fs::rename(&part, &target)
            .await
            .map_err(|e| format!("rename to {}: {e}", target.display()))?;
        let dir = self.dir.clone();
        tokio::task::spawn_blocking(move || std::fs::File::open(&dir)?.sync_all())
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("fsync {}: {e}", self.dir.display()))
    }

    async fn download_to(&self, part: &Path, digest: &str, size_bytes: u64) -> Result<(), String> {
        let mut stream = self.transport.get(digest).await?;
        let mut file = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(part)
            .await
            .map_err(|e| format!("create {}: {e}", part.display()))?;
        let mut hasher = blake3::Hasher::new();
        let mut received = 0u64;
        loop {
            let next = tokio::time::timeout(TRANSFER_STALL_TIMEOUT, stream.next())
                .await
                .map_err(|_| {
                    format!(
                        "nothing arrived for {} s after {received} bytes",
                        TRANSFER_STALL_TIMEOUT.as_secs()
                    )
                })?;
            let Some(chunk) = next else { break };
            let chunk = chunk?;
            received += chunk.len() as u64;
            if received > size_bytes {
                return Err(format!(
                    "more than the {size_bytes} bytes of the reference arrived"
                ));
            }
            hasher.update(&chunk);
            file.write_all(&chunk)
                .await
                .map_err(|e| format!("write {}: {e}", part.display()))?;
        }
        if received != size_bytes {
            return Err(format!(
                "{received} bytes arrived, the reference says {size_bytes}"
            ));
        }
        let got = hasher.finalize().to_hex();
        if got.as_str() != digest {
            return Err(format!("the bytes that arrived hash to {got}"));
        }
        file.sync_all()
            .await
            .map_err(|e| format!("fsync {}: {e}", part.display()))
    }

    /// Uploads the file at `path` as blob `digest` of `size_bytes` (the caller hashed
    /// it), within [`transfer_deadline`].
    ///
    /// # Errors
    /// What failed, in words (the caller writes it into the attempt's log).
    pub async fn upload(&self, path: &Path, digest: &str, size_bytes: u64) -> Result<(), String> {
        let deadline = transfer_deadline(size_bytes);
        tokio::time::timeout(
            deadline + TRANSFER_BASE_TIMEOUT,
            self.transport.put(path, (digest, size_bytes), deadline),
        )
        .await
        .unwrap_or_else(|_| Err(format!("not stored within {} s", deadline.as_secs())))
    }
}

impl State {
    /// Removes unpinned blobs, least recently used first, until the cached bytes are at
    /// most `target`; returns their digests (the caller removes the files).
    fn evict_to(&mut self, target: u64) -> Vec<String> {
        let mut victims = Vec::new();
        while self.cached_bytes + self.reserved_bytes > target {
            let Some(digest) = self
                .entries
                .iter()
                .filter(|(_, e)| e.users == 0)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(d, _)| d.clone())
            else {
                break;
            };
            if let Some(e) = self.entries.remove(&digest) {
                self.cached_bytes -= e.size_bytes;
            }
            victims.push(digest);
        }
        victims
    }
}

/// Checks that the file at `path` holds `size_bytes` bytes hashing to `digest`, hashing
/// on the blocking pool.
async fn verify(path: &Path, digest: &str, size_bytes: u64) -> Result<(), String> {
    let owned = path.to_owned();
    let (got, size) = tokio::task::spawn_blocking(move || cumulus_bundle::digest_file(&owned))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    if size != size_bytes {
        return Err(format!("{size} bytes instead of {size_bytes}"));
    }
    if got != digest {
        return Err(format!("its bytes hash to {got}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
