//! Dataset shards from S3 (`--dataset s3://bucket/prefix`): a size-bounded local cache on
//! the worker, least recently used evicted first, every entry verified by size and ETag.
//!
//! Entry of object `s3://b/k/name`: directory `<dir>/<sha256(url)>/` holding `name` (the
//! bytes, under the object's own base name) and `.meta` (JSON: url, size, ETag). A fetch first `HEAD`s the object: when the entry's meta and data size
//! match the object's size and ETag it is a hit (its mtime is bumped for LRU); otherwise the
//! object is downloaded with `If-Match: <etag>` (an object changed during the download is
//! an error, not a mix), its MD5 checked against a plain (non-multipart) ETag, fsynced,
//! renamed into place, and older entries evicted until the cache fits.
//!
//! An entry handed to a rank is pinned ([`DatasetCache::fetch_pinned`], [`ShardPin`]) until
//! the rank's attempt ends: eviction never removes a pinned entry, so a shard cannot vanish
//! between the fetch and the rank opening it. When the unpinned entries cannot make room,
//! the fetch fails with a clear error (the cache is smaller than the shards of the ranks
//! running at once) instead of exceeding its bound.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use md5::{Digest as _, Md5};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use tokio::io::AsyncWriteExt;

use crate::{CkptError, RemoteKind, S3Connector};

/// Largest `.meta` file read back, in bytes.
const MAX_META_BYTES: u64 = 8 * 1024;
/// Name of an entry's metadata file.
const META_FILE: &str = ".meta";
/// Name of an entry's download in progress.
const TMP_FILE: &str = ".download";

#[derive(Serialize, Deserialize, PartialEq, Eq, Debug)]
struct EntryMeta {
    url: String,
    size_bytes: u64,
    etag: String,
}

/// Result of [`DatasetCache::fetch_pinned`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    /// Local path of the verified copy.
    pub path: PathBuf,
    /// True when the copy was already cached (no download).
    pub hit: bool,
    /// Size of the object, in bytes.
    pub size_bytes: u64,
}

/// A size-bounded, LRU, verified local cache of S3 objects. One fetch at a time.
#[derive(Debug)]
pub struct DatasetCache {
    /// Directory holding one subdirectory per entry.
    dir: PathBuf,
    /// Most bytes of entry data kept.
    max_bytes: u64,
    /// Builds the S3 store of an object's bucket.
    connector: S3Connector,
    /// Serializes fetches (and so evictions).
    lock: tokio::sync::Mutex<()>,
    /// Pin count per entry directory; pinned entries are never evicted. At most one key per
    /// entry, so bounded by the entries on disk.
    pins: Mutex<HashMap<PathBuf, usize>>,
}

/// Keeps one cache entry from eviction while it lives (a rank's attempt holds the pins of
/// its shards). Dropping it unpins the entry.
#[derive(Debug)]
pub struct ShardPin {
    /// The cache the entry is in.
    cache: Arc<DatasetCache>,
    /// The entry directory.
    entry: PathBuf,
}

impl Drop for ShardPin {
    fn drop(&mut self) {
        let mut pins = self
            .cache
            .pins
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(count) = pins.get_mut(&self.entry) {
            *count -= 1;
            if *count == 0 {
                pins.remove(&self.entry);
            }
        }
    }
}

impl DatasetCache {
    /// A cache in `dir` (created on first use) holding at most `max_bytes` of data.
    pub fn new(dir: impl Into<PathBuf>, max_bytes: u64, connector: S3Connector) -> Self {
        Self {
            dir: dir.into(),
            max_bytes,
            connector,
            lock: tokio::sync::Mutex::new(()),
            pins: Mutex::new(HashMap::new()),
        }
    }

    /// A verified local copy of `url` (`s3://bucket/key`), pinned until the returned
    /// [`ShardPin`] is dropped (the pin is taken before another fetch can evict).
    ///
    /// # Errors
    /// [`CkptError::Invalid`] for a bad URL, an object larger than the cache, or when the
    /// entries pinned by running ranks leave no room; [`CkptError::NotFound`] for a missing
    /// object; [`CkptError::Remote`] for S3 failures (`Changed` when the object changed
    /// during the download); [`CkptError::Corrupt`] when the bytes do not match.
    pub async fn fetch_pinned(
        self: &Arc<Self>,
        url: &str,
    ) -> Result<(Fetched, ShardPin), CkptError> {
        let (fetched, entry) = self.fetch_and_pin(url).await?;
        Ok((
            fetched,
            ShardPin {
                cache: Arc::clone(self),
                entry,
            },
        ))
    }

    /// Entry directories pinned now.
    fn pinned_entries(&self) -> Vec<PathBuf> {
        self.pins
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .keys()
            .cloned()
            .collect()
    }

    /// Pins `entry` once more (called with the fetch lock held).
    fn pin(&self, entry: &Path) {
        *self
            .pins
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .entry(entry.to_owned())
            .or_insert(0) += 1;
    }

    /// The fetch of [`DatasetCache::fetch_pinned`]: the entry is pinned under the fetch
    /// lock, and its directory returned for the [`ShardPin`].
    async fn fetch_and_pin(&self, url: &str) -> Result<(Fetched, PathBuf), CkptError> {
        let (bucket_url, key) = split_object_url(url)?;
        let store = self.connector.store(&bucket_url).await?;
        let head = store.head(&key).await?;
        let size_bytes = head.0;
        let etag = head
            .1
            .ok_or_else(|| CkptError::Invalid(format!("{url} has no ETag")))?;
        if size_bytes > self.max_bytes {
            return Err(CkptError::Invalid(format!(
                "{url} is {size_bytes} bytes, larger than the dataset cache ({} bytes)",
                self.max_bytes
            )));
        }
        let _guard = self.lock.lock().await;
        let io = |op: &'static str, p: &Path| {
            let p = p.to_owned();
            move |source| CkptError::Io {
                op,
                path: p,
                source,
            }
        };
        tokio::fs::create_dir_all(&self.dir)
            .await
            .map_err(io("create dir", &self.dir))?;
        let name = hex::encode(<Sha256 as sha2::Digest>::digest(url.as_bytes()));
        // The copy keeps the object's base name: trainers may use it (record ids).
        let base = key.rsplit('/').next().unwrap_or(&key);
        if base.is_empty() || base == "." || base == ".." || base.len() > 255 {
            return Err(CkptError::Invalid(format!("{url} has no usable file name")));
        }
        let entry = self.dir.join(&name);
        tokio::fs::create_dir_all(&entry)
            .await
            .map_err(io("create dir", &entry))?;
        let data = entry.join(base);
        let meta_path = entry.join(META_FILE);
        let want = EntryMeta {
            url: url.to_owned(),
            size_bytes,
            etag: etag.clone(),
        };
        if read_meta(&meta_path).await.as_ref() == Some(&want)
            && tokio::fs::metadata(&data)
                .await
                .is_ok_and(|m| m.is_file() && m.len() == size_bytes)
        {
            let file = std::fs::File::options()
                .write(true)
                .open(&data)
                .map_err(io("open", &data))?;
            file.set_modified(SystemTime::now())
                .map_err(io("touch", &data))?;
            self.pin(&entry);
            return Ok((
                Fetched {
                    path: data,
                    hit: true,
                    size_bytes,
                },
                entry,
            ));
        }
        let _ = tokio::fs::remove_file(&meta_path).await;
        let _ = tokio::fs::remove_file(&data).await;
        self.evict(size_bytes, &entry).await?;
        let tmp = entry.join(TMP_FILE);
        let mut out = tokio::fs::File::create(&tmp)
            .await
            .map_err(io("create", &tmp))?;
        let mut body = store.get_if_match(&key, &etag).await?;
        let mut md5 = Md5::new();
        let mut got = 0u64;
        while let Some(chunk) = body.try_next().await.map_err(|e| CkptError::Remote {
            op: "get",
            url: url.to_owned(),
            endpoint: String::new(),
            kind: RemoteKind::Unreachable,
            detail: e.to_string(),
        })? {
            got += chunk.len() as u64;
            if got > size_bytes {
                break;
            }
            md5.update(&chunk);
            out.write_all(&chunk).await.map_err(io("write", &tmp))?;
        }
        out.sync_all().await.map_err(io("fsync", &tmp))?;
        drop(out);
        let md5 = hex::encode(md5.finalize());
        let plain_etag = etag.trim_matches('"');
        let etag_is_md5 =
            plain_etag.len() == 32 && plain_etag.bytes().all(|b| b.is_ascii_hexdigit());
        if got != size_bytes || (etag_is_md5 && !plain_etag.eq_ignore_ascii_case(&md5)) {
            let _ = tokio::fs::remove_file(&tmp).await;
            return Err(CkptError::Corrupt {
                path: PathBuf::from(url),
                reason: format!(
                    "downloaded {got} bytes with MD5 {md5}; the object has {size_bytes} bytes, ETag {etag}"
                ),
            });
        }
        tokio::fs::rename(&tmp, &data)
            .await
            .map_err(io("rename", &tmp))?;
        let meta = serde_json::to_vec(&want).map_err(|e| CkptError::Invalid(e.to_string()))?;
        tokio::fs::write(&meta_path, meta)
            .await
            .map_err(io("write", &meta_path))?;
        self.pin(&entry);
        Ok((
            Fetched {
                path: data,
                hit: false,
                size_bytes,
            },
            entry,
        ))
    }

    /// Removes least recently used entries until `incoming` more bytes fit under the
    /// bound; the entry `keep` and pinned entries are never removed. [`CkptError::Invalid`]
    /// when the pinned entries leave no room.
    async fn evict(&self, incoming: u64, keep: &Path) -> Result<(), CkptError> {
        let dir = self.dir.clone();
        let keep = keep.to_owned();
        let max = self.max_bytes;
        let pinned = self.pinned_entries();
        let outcome = tokio::task::spawn_blocking(move || -> std::io::Result<(u64, u64)> {
            let mut entries = Vec::new();
            let mut total = 0u64;
            let mut pinned_bytes = 0u64;
            for entry in std::fs::read_dir(&dir)? {
                let entry_dir = entry?.path();
                if entry_dir == keep || !entry_dir.is_dir() {
                    continue;
                }
                // An entry's size and age are those of its data file (the one non-dot file).
                let mut size = 0u64;
                let mut modified = std::time::SystemTime::UNIX_EPOCH;
                for file in std::fs::read_dir(&entry_dir)? {
                    let file = file?;
                    if file.file_name().to_string_lossy().starts_with('.') {
                        continue;
                    }
                    let meta = file.metadata()?;
                    size += meta.len();
                    modified = modified.max(meta.modified()?);
                }
                total += size;
                if pinned.contains(&entry_dir) {
                    pinned_bytes += size;
                    continue;
                }
                entries.push((modified, size, entry_dir));
            }
            entries.sort();
            for (_, size, entry_dir) in entries {
                if total + incoming <= max {
                    break;
                }
                std::fs::remove_dir_all(&entry_dir)?;
                total -= size;
            }
            Ok((total, pinned_bytes))
        })
        .await
        .map_err(|e| CkptError::Invalid(format!("eviction task failed: {e}")))?
        .map_err(|source| CkptError::Io {
            op: "evict",
            path: self.dir.clone(),
            source,
        })?;
        let (total, pinned_bytes) = outcome;
        if total + incoming > max {
            return Err(CkptError::Invalid(format!(
                "the dataset cache ({max} bytes) has no room for {incoming} more bytes: \
                 {pinned_bytes} bytes are shards of running ranks (pinned); size the cache \
                 above the shards of the ranks run at once"
            )));
        }
        Ok(())
    }
}

async fn read_meta(path: &Path) -> Option<EntryMeta> {
    let meta = tokio::fs::metadata(path).await.ok()?;
    if meta.len() > MAX_META_BYTES {
        return None;
    }
    serde_json::from_slice(&tokio::fs::read(path).await.ok()?).ok()
}

/// `s3://bucket/key` → (`s3://bucket`, `key`); the key must not be empty.
fn split_object_url(url: &str) -> Result<(String, String), CkptError> {
    let rest = url
        .strip_prefix("s3://")
        .ok_or_else(|| CkptError::Invalid(format!("{url:?} is not an s3:// URL")))?;
    match rest.split_once('/') {
        Some((bucket, key)) if !key.is_empty() && !key.ends_with('/') => {
            Ok((format!("s3://{bucket}"), key.to_owned()))
        }
        _ => Err(CkptError::Invalid(format!("{url:?} names no object"))),
    }
}
