//! The blob store in an S3 bucket (`--blob-url s3://bucket/prefix`), shared by every
//! coordinator of the cluster: blob `D` is the object `<prefix>/blobs/D`, with user
//! metadata `digest` (`blake3:D`, as the checkpoint tier records a part's files),
//! `uploader` (a user's name or `worker/ID`) and `stored-at-ms`.
//!
//! - **Upload**: the receiving coordinator streams the bytes into a temp file of its
//!   local store while hashing them ([`super::LocalStore::receive_temp`]), refusing a size or
//!   digest other than announced, and only then uploads the file with the checkpoint
//!   tier's client (`S3Store::put_file`: one `PutObject`, or multipart past the part size,
//!   so nothing appears under the final key before it is complete; each request signed
//!   over its body's SHA-256, which the server checks; then `HEAD` must show the size and
//!   digest). The answer, `replicas` 0, comes once S3 has it.
//! - **Stat** and admission: `HEAD` of the object; it counts only with this store's
//!   `digest` metadata and a size within `--max-blob-bytes`.
//! - **Read**: a streamed `GET`, re-hashed as it is served; the last bytes are held back
//!   until the digest checks, so a corrupt object ends its stream with DATA_LOSS and is
//!   never served whole. It is then deleted (when its ETag is still the one read), so
//!   `StatBlob` says absent and the client uploads it again.
//! - **Quota**: a user's usage is the size of the objects whose `uploader` metadata names
//!   them: the blobs' listing, with each object's uploader read once by `HEAD` and cached
//!   (by digest and time written), plus this coordinator's uploads in progress. Like the
//!   local store's, it is checked by the coordinator that receives an upload, so uploads
//!   to several coordinators at once may pass it together.
//! - **Collection**: only the leader sweeps the bucket ([`super::gc`]; N coordinators
//!   racing to delete would gain nothing): an object written more than
//!   `--blob-retention-ms` ago (the server's time) that no job of the applied state
//!   references and that the leader did not use since (stat, upload, read, admission) is
//!   deleted. A use on this node takes a per-digest lock that a deletion must win first,
//!   so a blob admitted by the leader is not deleted before the job naming it is applied.
//!   An unreferenced blob found present through a follower may still be collected before
//!   its submit, which then says "upload it first".
//!
//! Every S3 request runs on a small runtime of this store's own
//! ([`BLOB_S3_THREADS`] threads): signing a request hashes its body, which must not hold
//! up the coordinator's one runtime thread.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use cumulus_api::blobs::{CHUNK_BYTES, is_valid_digest};
use cumulus_api::v1;
use cumulus_ckpt::{CkptError, DIGEST_METADATA_KEY, ObjectBody, ObjectInfo, S3Store};
use futures::{Stream, StreamExt};
use tokio::sync::{RwLock, mpsc};

use super::ops::Uploader;
use super::store::{READ_QUEUE_CHUNKS, TempBlob};
use super::{BlobError, BlobHeader, BlobMeta, BlobRead, Blobs};
use crate::soft::now_ms;

/// The "directory" of the blobs under the bucket's prefix: `<prefix>/blobs/<digest>`.
pub const BLOBS_KEY_DIR: &str = "blobs";
/// User metadata naming a blob's uploader (`x-amz-meta-uploader`).
pub const UPLOADER_METADATA_KEY: &str = "uploader";
/// User metadata holding when a blob was stored, in ms since the Unix epoch
/// (`x-amz-meta-stored-at-ms`).
pub const STORED_AT_METADATA_KEY: &str = "stored-at-ms";
/// Most objects listed under `<prefix>/blobs/` (quota and collection); past it both fail
/// with an error naming the bound.
pub const MAX_LISTED_BLOBS: usize = 1_000_000;
/// `HEAD`s in flight while a quota check learns the uploaders of objects it has not seen.
pub const QUOTA_HEAD_CONCURRENCY: usize = 16;
/// Threads of the runtime every S3 request of the blob store runs on.
pub const BLOB_S3_THREADS: usize = 2;
/// Most per-digest locks kept; past it the unused ones are dropped.
pub const MAX_DIGEST_LOCKS: usize = 1_024;
/// Most blobs whose last use on this node is remembered; past it the uses older than the
/// retention are forgotten.
pub const MAX_REMEMBERED_USES: usize = super::store::MAX_BLOBS;

/// The blob store in an S3 bucket.
pub struct S3Blobs {
    store: S3Store,
    runtime: BlobRuntime,
    max_blob_bytes: u64,
    retention_ms: u64,
    /// When each blob was last used on this node (ms since the Unix epoch).
    used: Mutex<HashMap<String, u64>>,
    /// Per digest: uses hold it shared, a deletion takes it exclusively (or skips).
    locks: Mutex<HashMap<String, Arc<RwLock<()>>>>,
    /// Per digest: the object's time written and its uploader, learned by `HEAD`.
    uploaders: Mutex<HashMap<String, (Option<u64>, String)>>,
}

/// The runtime S3 requests run on; shut down without waiting when dropped.
struct BlobRuntime(Option<tokio::runtime::Runtime>);

impl Drop for BlobRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A failed S3 request as a blob error: NOT_FOUND, an I/O error of this node's disk, or
/// UNAVAILABLE with S3's answer.
fn s3_error(what: &str, e: CkptError) -> BlobError {
    match e {
        CkptError::NotFound { .. } => BlobError::NotFound(format!("{what}: {e}")),
        CkptError::Io { .. } => BlobError::Io(format!("{what}: {e}")),
        e => BlobError::Unavailable(format!("{what}: {e}")),
    }
}

impl S3Blobs {
    /// The store of `url` (`s3://bucket/prefix`) reached with `s3`'s settings, for blobs
    /// of at most `max_blob_bytes`, collected after `retention_ms`. Nothing is asked of
    /// S3 yet: a background check logs an error when the bucket cannot be listed.
    ///
    /// # Errors
    /// A malformed URL, invalid S3 settings, or the runtime cannot be built.
    pub async fn connect(
        url: &str,
        s3: &cumulus_ckpt::S3Args,
        max_blob_bytes: u64,
        retention_ms: u64,
    ) -> anyhow::Result<S3Blobs> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(BLOB_S3_THREADS)
            .thread_name("blob-s3")
            .enable_all()
            .build()?;
        let connector = cumulus_ckpt::S3Connector::new(s3.settings())?;
        let owned_url = url.to_string();
        let store = runtime
            .spawn(async move { connector.store(&owned_url).await })
            .await??;
        let checked = store.clone();
        runtime.spawn(async move {
            match checked.check_access().await {
                Ok(()) => tracing::info!(location = %checked.location(), "blob store in S3"),
                Err(e) => tracing::error!(
                    location = %checked.location(),
                    error = %e,
                    "the blob store's bucket cannot be listed (--blob-url); uploads and reads will fail"
                ),
            }
        });
        Ok(S3Blobs {
            store,
            runtime: BlobRuntime(Some(runtime)),
            max_blob_bytes,
            retention_ms,
            used: Mutex::default(),
            locks: Mutex::default(),
            uploaders: Mutex::default(),
        })
    }

    /// `s3://bucket/prefix/blobs/`, for messages.
    pub fn url(&self) -> String {
        format!(
            "s3://{}/{}",
            self.store.location().bucket,
            self.store.location().key(&format!("{BLOBS_KEY_DIR}/"))
        )
    }

    /// The key of blob `digest`.
    pub fn key_of(&self, digest: &str) -> String {
        self.store
            .location()
            .key(&format!("{BLOBS_KEY_DIR}/{digest}"))
    }

    /// Runs `f` on the store's runtime.
    async fn on_runtime<T, F>(&self, f: F) -> Result<T, BlobError>
    where
        F: Future<Output = Result<T, BlobError>> + Send + 'static,
        T: Send + 'static,
    {
        let Some(rt) = &self.runtime.0 else {
            return Err(BlobError::Unavailable("the blob store is shut down".into()));
        };
        rt.spawn(f)
            .await
            .map_err(|e| BlobError::Io(format!("an S3 task of the blob store failed: {e}")))?
    }

    /// The lock of `digest` (created when absent; unused ones dropped past
    /// [`MAX_DIGEST_LOCKS`]).
    fn lock_of(&self, digest: &str) -> Arc<RwLock<()>> {
        let mut locks = lock(&self.locks);
        if locks.len() >= MAX_DIGEST_LOCKS {
            locks.retain(|_, l| Arc::strong_count(l) > 1);
        }
        locks.entry(digest.to_string()).or_default().clone()
    }

    /// Marks `digest` used now; waits for a deletion of it in progress first. The use
    /// lasts while the guard lives.
    async fn using(&self, digest: &str) -> tokio::sync::OwnedRwLockReadGuard<()> {
        let guard = self.lock_of(digest).read_owned().await;
        self.touch(digest);
        guard
    }

    fn touch(&self, digest: &str) {
        let now = now_ms();
        let mut used = lock(&self.used);
        if used.len() >= MAX_REMEMBERED_USES {
            let cut = now.saturating_sub(self.retention_ms);
            used.retain(|_, at| *at >= cut);
        }
        used.insert(digest.to_string(), now);
    }

    /// What the object says of blob `digest` when it is one of this store's: its `digest`
    /// metadata names it and its size is within the limit.
    fn meta_of(&self, digest: &str, info: &ObjectInfo) -> Option<BlobMeta> {
        let recorded = info.metadata.get(DIGEST_METADATA_KEY)?;
        if recorded.strip_prefix("blake3:") != Some(digest) || info.size_bytes > self.max_blob_bytes
        {
            return None;
        }
        Some(BlobMeta {
            size_bytes: info.size_bytes,
            uploader: info
                .metadata
                .get(UPLOADER_METADATA_KEY)
                .cloned()
                .unwrap_or_default(),
            stored_at_ms: info
                .metadata
                .get(STORED_AT_METADATA_KEY)
                .and_then(|v| v.parse().ok())
                .or(info.last_modified_ms)
                .unwrap_or(0),
        })
    }

    async fn head(&self, digest: &str) -> Result<Option<ObjectInfo>, BlobError> {
        let (store, key) = (self.store.clone(), self.key_of(digest));
        let what = format!("HEAD of blob {digest} in {}", self.url());
        self.on_runtime(async move {
            store
                .head_object(&key)
                .await
                .map_err(|e| s3_error(&what, e))
        })
        .await
    }

    /// Blob `digest` as the bucket holds it (`HEAD`), without taking its lock.
    async fn stat_unlocked(&self, digest: &str) -> Result<Option<BlobMeta>, BlobError> {
        let Some(info) = self.head(digest).await? else {
            return Ok(None);
        };
        let meta = self.meta_of(digest, &info);
        if meta.is_none() {
            tracing::warn!(
                digest,
                size_bytes = info.size_bytes,
                "an object under the blob store's key is not one of its blobs (no digest \
                 metadata naming it, or too large); taken as absent"
            );
        }
        Ok(meta)
    }

    /// Blob `digest` as the bucket holds it (`HEAD`), marked used.
    ///
    /// # Errors
    /// [`BlobError::Unavailable`] when S3 cannot answer.
    pub async fn stat(&self, digest: &str) -> Result<Option<BlobMeta>, BlobError> {
        let _use = self.using(digest).await;
        self.stat_unlocked(digest).await
    }

    /// Uploads the verified temp file `temp` of blob `header` with `uploader` recorded.
    async fn upload(
        &self,
        header: &BlobHeader,
        uploader: &str,
        temp: &TempBlob<'_>,
    ) -> Result<(), BlobError> {
        let (store, key) = (self.store.clone(), self.key_of(&header.digest));
        let path = temp.path().to_path_buf();
        let (digest, size) = (format!("blake3:{}", header.digest), header.size_bytes);
        let (uploader, stored_at) = (uploader.to_string(), now_ms().to_string());
        let what = format!("uploading blob {} to {}", header.digest, self.url());
        self.on_runtime(async move {
            let metadata = [
                (UPLOADER_METADATA_KEY, uploader.as_str()),
                (STORED_AT_METADATA_KEY, stored_at.as_str()),
            ];
            store
                .put_file(&key, &path, (size, &digest), &metadata)
                .await
                .map_err(|e| s3_error(&what, e))
        })
        .await
    }

    /// Opens blob `digest` for reading: its bytes stream from S3 and are re-hashed as
    /// they go; `permit` is held until the read ends.
    ///
    /// # Errors
    /// [`BlobError::NotFound`] when the bucket does not hold it; [`BlobError::Corrupt`]
    /// when the object is larger than a blob may be; [`BlobError::Unavailable`] when S3
    /// cannot answer.
    pub async fn open(
        &self,
        digest: &str,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<BlobRead, BlobError> {
        let _use = self.using(digest).await;
        let (store, key) = (self.store.clone(), self.key_of(digest));
        let what = format!("reading blob {digest} from {}", self.url());
        let opened = self
            .on_runtime(async move { store.get_object(&key).await.map_err(|e| s3_error(&what, e)) })
            .await?;
        let Some((info, body)) = opened else {
            return Err(BlobError::NotFound(format!(
                "blob {digest} is not in the blob store ({})",
                self.url()
            )));
        };
        if info.size_bytes > self.max_blob_bytes {
            return Err(BlobError::Corrupt(format!(
                "the object of blob {digest} in {} is {} bytes, more than a blob may be ({})",
                self.url(),
                info.size_bytes,
                self.max_blob_bytes
            )));
        }
        let (tx, rx) = mpsc::channel(READ_QUEUE_CHUNKS);
        let read = VerifiedRead {
            store: self.store.clone(),
            key: self.key_of(digest),
            url: self.url(),
            digest: digest.to_string(),
            info: info.clone(),
        };
        let Some(rt) = &self.runtime.0 else {
            return Err(BlobError::Unavailable("the blob store is shut down".into()));
        };
        rt.spawn(async move {
            let _permit = permit;
            read.run(body, &tx).await;
        });
        Ok(BlobRead {
            size_bytes: info.size_bytes,
            chunks: tokio_stream::wrappers::ReceiverStream::new(rx),
        })
    }

    /// The blobs in the bucket: digest and listing entry.
    async fn list(&self) -> Result<Vec<(String, cumulus_ckpt::ListedObject)>, BlobError> {
        let store = self.store.clone();
        let prefix = self.store.location().key(&format!("{BLOBS_KEY_DIR}/"));
        let what = format!("listing {}", self.url());
        let listed = self
            .on_runtime(async move {
                store
                    .list_objects_under(&prefix, MAX_LISTED_BLOBS)
                    .await
                    .map(|objects| (prefix, objects))
                    .map_err(|e| s3_error(&what, e))
            })
            .await?;
        let (prefix, objects) = listed;
        Ok(objects
            .into_iter()
            .filter_map(|o| {
                let digest = o.key.strip_prefix(&prefix)?.to_string();
                is_valid_digest(&digest).then_some((digest, o))
            })
            .collect())
    }

    /// Bytes of the blobs in the bucket that `user` uploaded.
    ///
    /// # Errors
    /// [`BlobError::Unavailable`] when S3 cannot list or answer a `HEAD`.
    pub async fn usage_of(&self, user: &str) -> Result<u64, BlobError> {
        let listed = self.list().await?;
        let mut usage = 0u64;
        let mut unknown = Vec::new();
        {
            let mut cache = lock(&self.uploaders);
            let names: HashSet<&str> = listed.iter().map(|(d, _)| d.as_str()).collect();
            cache.retain(|d, _| names.contains(d.as_str()));
            for (digest, object) in &listed {
                match cache.get(digest) {
                    Some((at, who)) if *at == object.last_modified_ms => {
                        if who == user {
                            usage = usage.saturating_add(object.size_bytes);
                        }
                    }
                    _ => unknown.push((digest.clone(), object.clone())),
                }
            }
        }
        let heads = futures::stream::iter(unknown)
            .map(|(digest, object)| async move {
                let head = self.head(&digest).await;
                (digest, object, head)
            })
            .buffer_unordered(QUOTA_HEAD_CONCURRENCY)
            .collect::<Vec<_>>()
            .await;
        for (digest, object, head) in heads {
            let Some(info) = head? else { continue };
            let who = self
                .meta_of(&digest, &info)
                .map(|m| m.uploader)
                .unwrap_or_default();
            if who == user {
                usage = usage.saturating_add(object.size_bytes);
            }
            lock(&self.uploaders).insert(digest, (object.last_modified_ms, who));
        }
        Ok(usage)
    }

    /// Deletes the blobs written before `cut_ms` (ms since the Unix epoch, the server's
    /// time) that `drop_referenced` keeps among the candidates it is given and that this
    /// node did not use since `cut_ms`; one in use or being used is skipped. Returns how
    /// many blobs and bytes it deleted.
    ///
    /// # Errors
    /// [`BlobError::Unavailable`] when the bucket cannot be listed; a failed deletion is
    /// logged and skipped.
    pub async fn sweep(
        &self,
        cut_ms: u64,
        drop_referenced: impl FnOnce(&mut HashSet<String>),
    ) -> Result<(usize, u64), BlobError> {
        let listed = self.list().await?;
        let sizes: HashMap<String, u64> = listed
            .iter()
            .filter(|(_, o)| o.last_modified_ms.is_some_and(|t| t < cut_ms))
            .map(|(d, o)| (d.clone(), o.size_bytes))
            .collect();
        let mut candidates: HashSet<String> = sizes.keys().cloned().collect();
        if !candidates.is_empty() {
            drop_referenced(&mut candidates);
        }
        let mut swept = (0usize, 0u64);
        for digest in candidates {
            let Ok(_deleting) = self.lock_of(&digest).try_write_owned() else {
                continue;
            };
            if lock(&self.used)
                .get(&digest)
                .is_some_and(|at| *at >= cut_ms)
            {
                continue;
            }
            match self.delete(&digest).await {
                Ok(()) => {
                    swept.0 += 1;
                    swept.1 = swept.1.saturating_add(sizes[&digest]);
                }
                Err(e) => tracing::warn!(%digest, error = %e, "cannot delete an unreferenced blob"),
            }
        }
        Ok(swept)
    }

    async fn delete(&self, digest: &str) -> Result<(), BlobError> {
        let (store, key) = (self.store.clone(), self.key_of(digest));
        let what = format!("deleting blob {digest} from {}", self.url());
        self.on_runtime(async move {
            store
                .delete_object(&key)
                .await
                .map_err(|e| s3_error(&what, e))
        })
        .await?;
        lock(&self.used).remove(digest);
        lock(&self.uploaders).remove(digest);
        Ok(())
    }
}

/// One read of an object, on the store's runtime: the bytes re-chunked to
/// [`CHUNK_BYTES`] and hashed; the last chunk goes out only once size and digest check.
struct VerifiedRead {
    store: S3Store,
    key: String,
    url: String,
    digest: String,
    info: ObjectInfo,
}

impl VerifiedRead {
    async fn run(self, mut body: ObjectBody, tx: &mpsc::Sender<Result<Bytes, BlobError>>) {
        let size = self.info.size_bytes;
        let mut hasher = blake3::Hasher::new();
        let mut total: u64 = 0;
        let mut pending: Vec<u8> = Vec::new();
        while let Some(next) = body.next().await {
            let data = match next {
                Ok(d) => d,
                Err(e) => {
                    let why = format!("reading blob {} from {}: {e}", self.digest, self.url);
                    let _ = tx.send(Err(BlobError::Unavailable(why))).await;
                    return;
                }
            };
            total = total.saturating_add(data.len() as u64);
            if total > size {
                break;
            }
            hasher.update(&data);
            pending.extend_from_slice(&data);
            // Strictly more than a chunk: the last bytes wait for the verdict.
            while pending.len() > CHUNK_BYTES {
                let rest = pending.split_off(CHUNK_BYTES);
                let chunk = Bytes::from(std::mem::replace(&mut pending, rest));
                if tx.send(Ok(chunk)).await.is_err() {
                    return; // the reader went away
                }
            }
        }
        let actual = hasher.finalize().to_hex();
        if total == size && actual.as_str() == self.digest {
            if !pending.is_empty() {
                let _ = tx.send(Ok(Bytes::from(pending))).await;
            }
            return;
        }
        let why = if total == size {
            format!("its bytes hash to {actual}")
        } else {
            format!("it holds {total}+ bytes, not {size}")
        };
        tracing::error!(digest = %self.digest, %why, "a blob in S3 failed verification; deleting it");
        self.drop_corrupt().await;
        let _ = tx
            .send(Err(BlobError::Corrupt(format!(
                "blob {} failed verification in {} ({why}); it was deleted: upload it again",
                self.digest, self.url
            ))))
            .await;
    }

    /// Deletes the object read when it is still that one (same ETag).
    async fn drop_corrupt(&self) {
        match self.store.head_object(&self.key).await {
            Ok(Some(now)) if now.etag == self.info.etag => {
                if let Err(e) = self.store.delete_object(&self.key).await {
                    tracing::warn!(digest = %self.digest, error = %e, "cannot delete a corrupt blob");
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(digest = %self.digest, error = %e, "cannot check a corrupt blob")
            }
        }
    }
}

impl Blobs {
    /// [`Blobs::put`] into the bucket: answered with `replicas` 0 once S3 holds the blob
    /// (one already there, of that size, is not received again).
    pub(super) async fn put_s3<S>(
        &self,
        s3: &S3Blobs,
        header: BlobHeader,
        uploader: &Uploader,
        chunks: S,
    ) -> Result<v1::PutBlobResponse, BlobError>
    where
        S: Stream<Item = Result<Bytes, BlobError>> + Unpin + Send,
    {
        let _use = s3.using(&header.digest).await;
        match s3.stat_unlocked(&header.digest).await? {
            Some(m) if m.size_bytes == header.size_bytes => {}
            Some(m) => {
                return Err(BlobError::Invalid(format!(
                    "blob {} is {} bytes, not the {} announced",
                    header.digest, m.size_bytes, header.size_bytes
                )));
            }
            None => {
                let held = match uploader {
                    Uploader::User(p) if p.role != cumulus_api::Role::Admin => {
                        s3.usage_of(&p.name).await?
                    }
                    _ => 0,
                };
                let place = format!("in {}", s3.url());
                let _reservation =
                    self.reserve_quota(uploader, header.size_bytes, |_| held, &place)?;
                let temp = self.store.receive_temp(&header, chunks).await?;
                s3.upload(&header, &uploader.recorded_name(), &temp).await?;
                temp.discard().await;
            }
        }
        Ok(v1::PutBlobResponse {
            digest: header.digest,
            size_bytes: header.size_bytes,
            replicas: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use cumulus_s3_test::{ACCESS_KEY, S3TestServer, SECRET_KEY};

    use super::*;
    use crate::blobs::LocalStore;

    const BUCKET: &str = "blob-store-test";
    const MIB: usize = 1024 * 1024;

    fn args(server: &S3TestServer) -> cumulus_ckpt::S3Args {
        cumulus_ckpt::S3Args {
            endpoint: Some(server.endpoint()),
            region: "us-east-1".into(),
            path_style: true,
            access_key: Some(ACCESS_KEY.into()),
            secret_key: Some(SECRET_KEY.into()),
            part_size_mib: 5,
            max_concurrency: 4,
            retry_deadline_ms: 5_000,
        }
    }

    fn data(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
            .collect()
    }

    fn header(data: &[u8]) -> BlobHeader {
        BlobHeader {
            digest: blake3::hash(data).to_hex().to_string(),
            size_bytes: data.len() as u64,
        }
    }

    fn chunks(data: &[u8]) -> impl Stream<Item = Result<Bytes, BlobError>> + Unpin + Send {
        let pieces: Vec<Result<Bytes, BlobError>> = data
            .chunks(300 * 1024)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        futures::stream::iter(pieces)
    }

    fn permit() -> tokio::sync::OwnedSemaphorePermit {
        Arc::new(tokio::sync::Semaphore::new(1))
            .try_acquire_owned()
            .expect("a permit")
    }

    /// What a read streams before it ends, and how it ends.
    async fn read_all(s3: &S3Blobs, digest: &str) -> (Vec<u8>, Result<(), BlobError>) {
        let mut read = match s3.open(digest, permit()).await {
            Ok(r) => r,
            Err(e) => return (Vec::new(), Err(e)),
        };
        let mut out = Vec::new();
        while let Some(chunk) = read.chunks.next().await {
            match chunk {
                Ok(c) => {
                    assert!(c.len() <= CHUNK_BYTES, "a chunk of {} bytes", c.len());
                    out.extend_from_slice(&c);
                }
                Err(e) => return (out, Err(e)),
            }
        }
        (out, Ok(()))
    }

    async fn store(s3: &S3Blobs, local: &LocalStore, data: &[u8], uploader: &str) -> BlobHeader {
        let h = header(data);
        let temp = local
            .receive_temp(&h, chunks(data))
            .await
            .expect("received");
        s3.upload(&h, uploader, &temp).await.expect("uploaded");
        temp.discard().await;
        h
    }

    // One server for the whole story (starting s3s-fs costs more than the checks).
    #[allow(clippy::too_many_lines)]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn blobs_go_to_s3_verified_and_are_counted_read_and_swept() {
        let server = tokio::task::spawn_blocking(S3TestServer::start)
            .await
            .expect("join")
            .expect("s3s-fs");
        let args = args(&server);
        args.settings()
            .client()
            .await
            .expect("client")
            .create_bucket()
            .bucket(BUCKET)
            .send()
            .await
            .expect("create bucket");
        let s3 = S3Blobs::connect(
            &format!("s3://{BUCKET}/pre"),
            &args,
            64 * MIB as u64,
            60_000,
        )
        .await
        .expect("connect");
        let tmp = tempfile::tempdir().expect("tmp");
        let local = LocalStore::open(tmp.path(), 64 * MIB as u64).expect("local");

        // A multipart upload (past the 5 MiB part) and a single PUT, with uploaders.
        let big = data(1, 6 * MIB + 3);
        let small = data(2, 100 * 1024);
        let hb = store(&s3, &local, &big, "alice").await;
        let hs = store(&s3, &local, &small, "worker/w1").await;
        let on_disk = server.data_dir().join(BUCKET).join(s3.key_of(&hb.digest));
        assert_eq!(
            std::fs::metadata(&on_disk).expect("in the bucket").len(),
            hb.size_bytes
        );
        assert_eq!(
            std::fs::read_dir(local.dir().join(crate::blobs::store::TMP_DIR))
                .expect("tmp dir")
                .count(),
            0,
            "the temp files are gone"
        );
        let meta = s3.stat(&hb.digest).await.expect("stat").expect("present");
        assert_eq!(
            (meta.size_bytes, meta.uploader.as_str()),
            (hb.size_bytes, "alice")
        );
        assert!(meta.stored_at_ms > 0);
        let absent = header(b"never stored");
        assert_eq!(s3.stat(&absent.digest).await.expect("stat"), None);
        let (got, end) = read_all(&s3, &absent.digest).await;
        assert!(
            got.is_empty() && matches!(end, Err(BlobError::NotFound(_))),
            "{end:?}"
        );

        // Reads come back whole and verified.
        let (got, end) = read_all(&s3, &hb.digest).await;
        end.expect("a good read");
        assert!(got == big, "the bytes read are the blob's");
        let (got, end) = read_all(&s3, &hs.digest).await;
        end.expect("a good read");
        assert!(got == small);

        // The quota's usage, by uploader (twice: the second from the cache).
        for _ in 0..2 {
            assert_eq!(s3.usage_of("alice").await.expect("usage"), hb.size_bytes);
            assert_eq!(
                s3.usage_of("worker/w1").await.expect("usage"),
                hs.size_bytes
            );
            assert_eq!(s3.usage_of("bob").await.expect("usage"), 0);
        }

        // An object without this store's digest metadata is not one of its blobs.
        let foreign = data(3, 10);
        let hf = header(&foreign);
        let client = args.settings().client().await.expect("client");
        client
            .put_object()
            .bucket(BUCKET)
            .key(s3.key_of(&hf.digest))
            .body(foreign.clone().into())
            .send()
            .await
            .expect("put a foreign object");
        assert_eq!(s3.stat(&hf.digest).await.expect("stat"), None);

        // A corrupted object: its read ends with Corrupt before its last bytes, and it is
        // deleted.
        let mut bad = big.clone();
        bad[3 * MIB] ^= 0x10;
        std::fs::write(&on_disk, &bad).expect("corrupt it");
        let (got, end) = read_all(&s3, &hb.digest).await;
        assert!(matches!(end, Err(BlobError::Corrupt(_))), "{end:?}");
        assert!(
            got.len() < big.len(),
            "not served whole: {} bytes",
            got.len()
        );
        assert!(!on_disk.exists(), "deleted");
        assert_eq!(s3.stat(&hb.digest).await.expect("stat"), None);

        // Collection: nothing written before a cut in the past; with a cut in the future,
        // the unreferenced blobs but for one in use, and never a referenced one.
        let again = store(&s3, &local, &big, "alice").await;
        assert_eq!(s3.sweep(1, |_| {}).await.expect("sweep"), (0, 0));
        let cut = now_ms() + 60_000;
        let in_use = s3.using(&hf.digest).await;
        let referenced = hs.digest.clone();
        let swept = s3
            .sweep(cut, |c| {
                c.remove(&referenced);
            })
            .await
            .expect("sweep");
        assert_eq!(swept, (1, again.size_bytes), "only the big blob");
        assert_eq!(s3.stat(&again.digest).await.expect("stat"), None);
        assert!(
            s3.stat(&hs.digest).await.expect("stat").is_some(),
            "referenced: kept"
        );
        drop(in_use);
        // A use at the cut or after keeps a blob (here: as if used a minute from now).
        lock(&s3.used).insert(hs.digest.clone(), cut);
        let swept = s3.sweep(cut, |_| {}).await.expect("sweep");
        assert_eq!(swept, (1, hf.size_bytes), "the foreign object only");
        assert!(
            s3.stat(&hs.digest).await.expect("stat").is_some(),
            "used: kept"
        );
        drop(server);
    }
}
