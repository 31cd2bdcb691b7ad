//! [`S3Store`]: the checkpoint protocol over S3 objects (uploads verified, `LATEST`
//! moved by conditional writes, restores hashed), and its [`CheckpointStore`] impl.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_s3::Client;
use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use md5::{Digest as _, Md5};
use tokio::io::AsyncWriteExt;
use tokio::sync::Semaphore;

use crate::{
    CheckpointStore, CkptError, FileEntry, LATEST_FILE, MANIFEST_FILE, MAX_LATEST_BYTES,
    MAX_MANIFEST_BYTES, Manifest, PartRecord, parse_digest, parse_step_dir_name, part_dir_rel,
    step_dir_name, validate_job_id,
};

use super::*;

/// The L2 tier: checkpoints in an S3 bucket under a prefix. Cheap to clone (one client).
///
/// It stores steps, manifests and `LATEST`; parts are committed into it by
/// [`crate::TieredStore`], which stages and commits on local disk (L1) first and then calls
/// [`S3Store::upload_part`]. Its own [`CheckpointStore::prepare_staging`] /
/// [`CheckpointStore::commit_part`] refuse with [`CkptError::Invalid`] for that reason.
#[derive(Clone)]
pub struct S3Store {
    pub(super) client: Client,
    pub(super) location: S3Location,
    pub(super) settings: Arc<S3Settings>,
    endpoint: String,
    pub(super) requests: Arc<Semaphore>,
}

impl std::fmt::Debug for S3Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Store")
            .field("location", &self.location)
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl S3Store {
    /// A store for `location` over `client` (build it with [`S3Settings::client`]; one
    /// client may serve many stores).
    pub fn new(client: Client, settings: S3Settings, location: S3Location) -> Self {
        let endpoint = settings
            .endpoint_url
            .clone()
            .unwrap_or_else(|| format!("AWS {}", settings.region));
        let requests = Arc::new(Semaphore::new(settings.max_concurrent_requests.max(1)));
        Self {
            client,
            location,
            settings: Arc::new(settings),
            endpoint,
            requests,
        }
    }

    /// The bucket and prefix of this store.
    pub fn location(&self) -> &S3Location {
        &self.location
    }

    /// The underlying client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Checks that the bucket exists and these credentials may list it (one `ListObjectsV2`
    /// of at most one key). Errors: [`CkptError::Remote`] with `Unreachable`,
    /// `BadCredentials`, `NoSuchBucket`, `AccessDenied`, … (after retrying transient ones).
    pub async fn check_access(&self) -> Result<(), CkptError> {
        let key = self.location.key("");
        self.retry("list", &key, || {
            self.client
                .list_objects_v2()
                .bucket(&self.location.bucket)
                .prefix(&key)
                .max_keys(1)
                .send()
        })
        .await?;
        Ok(())
    }

    /// Size and ETag of object `key` (a full key in the bucket). [`CkptError::NotFound`]
    /// when absent.
    pub async fn head(&self, key: &str) -> Result<(u64, Option<String>), CkptError> {
        let head = self
            .retry("head", key, || {
                self.client
                    .head_object()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .send()
            })
            .await?;
        let size = head
            .content_length()
            .and_then(|l| u64::try_from(l).ok())
            .ok_or_else(|| self.remote_error("head", key, RemoteKind::Other, "no size".into()))?;
        Ok((size, head.e_tag().map(str::to_owned)))
    }

    /// The body of object `key`, only while its ETag is `etag` (`If-Match`): a changed
    /// object is [`CkptError::Remote`] with [`RemoteKind::Changed`].
    pub async fn get_if_match(&self, key: &str, etag: &str) -> Result<ByteStream, CkptError> {
        let output = self
            .retry("get", key, || {
                self.client
                    .get_object()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .if_match(etag)
                    .send()
            })
            .await?;
        Ok(output.body)
    }

    /// Keys of the objects under the store's prefix (full keys, sorted; at most
    /// [`MAX_LISTED_OBJECTS`]); keys ending in `/` (folder markers) are skipped.
    pub async fn list_objects(&self) -> Result<Vec<String>, CkptError> {
        let prefix = if self.location.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.location.prefix)
        };
        let mut keys = self.list_keys(&prefix).await?;
        keys.retain(|k| !k.ends_with('/'));
        keys.sort();
        Ok(keys)
    }

    pub(super) fn job_key(&self, job_id: &str, rest: &str) -> String {
        self.location.key(&format!("{job_id}/{rest}"))
    }

    pub(super) fn remote_error(
        &self,
        op: &'static str,
        key: &str,
        kind: RemoteKind,
        detail: String,
    ) -> CkptError {
        CkptError::Remote {
            op,
            url: format!("s3://{}/{key}", self.location.bucket),
            endpoint: self.endpoint.clone(),
            kind,
            detail,
        }
    }

    /// Runs `call` (one request) with a concurrency permit, retrying transient failures
    /// with exponential backoff (100 ms doubling to 5 s) until the retry deadline (the
    /// last attempt is made at the deadline). A transient failure given up on says how
    /// many attempts were made over how long.
    pub(super) async fn retry<T, E, F, Fut>(
        &self,
        op: &'static str,
        key: &str,
        mut call: F,
    ) -> Result<T, CkptError>
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, SdkError<E, HttpResponse>>>,
    {
        let started = tokio::time::Instant::now();
        let deadline = started + Duration::from_millis(self.settings.retry_deadline_ms);
        let mut delay = Duration::from_millis(100);
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let result = {
                let _permit = self
                    .requests
                    .acquire()
                    .await
                    .map_err(|_| CkptError::Invalid("S3 store closed".into()))?;
                call().await
            };
            match result {
                Ok(value) => return Ok(value),
                Err(error) => {
                    let (kind, _status, detail) = classify(&error);
                    if is_not_found(&error) {
                        return Err(CkptError::NotFound {
                            what: format!("s3://{}/{key}", self.location.bucket),
                        });
                    }
                    if !kind.is_transient() {
                        return Err(self.remote_error(op, key, kind, detail));
                    }
                    let now = tokio::time::Instant::now();
                    if now >= deadline {
                        let detail = format!(
                            "{detail}; gave up after {attempts} attempts in {} ms (retry deadline {} ms)",
                            started.elapsed().as_millis(),
                            self.settings.retry_deadline_ms
                        );
                        return Err(self.remote_error(op, key, kind, detail));
                    }
                    // The last attempt is made at the deadline, not one backoff before it.
                    let pause = delay.min(deadline - now);
                    tracing::warn!(op, key, %kind, retry_in_ms = pause.as_millis() as u64, "transient S3 failure: {detail}");
                    tokio::time::sleep(pause).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// `HEAD`s one object: its size and SHA-256 metadata must match `file`.
    pub(super) async fn check_object(
        &self,
        key: &str,
        file: &FileEntry,
        op: &'static str,
    ) -> Result<(), CkptError> {
        let head = match self
            .retry(op, key, || {
                self.client
                    .head_object()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .send()
            })
            .await
        {
            Ok(head) => head,
            Err(CkptError::NotFound { what }) => {
                return Err(CkptError::Corrupt {
                    path: PathBuf::from(what),
                    reason: "is missing".into(),
                });
            }
            Err(e) => return Err(e),
        };
        let size = head.content_length().and_then(|l| u64::try_from(l).ok());
        let metadata = head.metadata();
        let digest = metadata
            .and_then(|m| m.get(DIGEST_METADATA_KEY))
            .cloned()
            .or_else(|| {
                metadata
                    .and_then(|m| m.get(LEGACY_SHA256_METADATA_KEY))
                    .map(|hex| format!("sha256:{hex}"))
            });
        if size != Some(file.size_bytes) || digest.as_deref() != Some(file.digest.as_str()) {
            return Err(CkptError::Corrupt {
                path: PathBuf::from(format!("s3://{}/{key}", self.location.bucket)),
                reason: format!(
                    "has size {size:?} and digest {digest:?}, the record says {} and {}",
                    file.size_bytes, file.digest
                ),
            });
        }
        Ok(())
    }

    /// For a part uploaded in the background (commit tier `l1`): deletes the part's objects
    /// when its step can no longer be mirrored to L2, and returns whether it did. That is
    /// the case when L2's `LATEST` names a newer step and the step has no L2 manifest: the
    /// leader mirrors kept steps oldest first and stops at the first whose parts are not
    /// all in L2, so a step it went past without writing its manifest had already left the
    /// kept set (for good: the kept set only loses old steps), and L2's prune may have run
    /// before this upload ended. Without this, such a late part would stay in the bucket
    /// with no manifest after the job's last prune.
    ///
    /// # Errors
    /// An invalid record, or a storage error reading `LATEST` or the manifest or deleting
    /// (nothing is deleted unless both reads succeeded).
    pub async fn discard_part_if_superseded(
        &self,
        job_id: &str,
        part: &PartRecord,
    ) -> Result<bool, CkptError> {
        validate_job_id(job_id)?;
        let step = part.validate()?;
        match self.read_latest(job_id).await? {
            Some(latest) if latest > step => {}
            _ => return Ok(false),
        }
        match self.read_manifest(job_id, step).await {
            Err(CkptError::NotFound { .. }) => {}
            Ok(_) | Err(CkptError::Corrupt { .. }) => return Ok(false),
            Err(e) => return Err(e),
        }
        let prefix = self.job_key(job_id, &format!("{}/", part.dir));
        self.delete_keys(self.list_keys(&prefix).await?).await?;
        Ok(true)
    }

    /// Deletes `keys` in order (each with retries); stops at the first failure.
    async fn delete_keys(&self, keys: Vec<String>) -> Result<(), CkptError> {
        for key in keys {
            self.retry("delete", &key, || {
                self.client
                    .delete_object()
                    .bucket(&self.location.bucket)
                    .key(&key)
                    .send()
            })
            .await?;
        }
        Ok(())
    }

    /// Downloads `part` into `dest` (created; must not exist yet), hashing every byte: each
    /// file must have the recorded size and digest ([`CkptError::Corrupt`] otherwise). The
    /// files are fsynced; on error `dest` may hold a partial copy the caller removes.
    pub async fn restore_part(
        &self,
        job_id: &str,
        part: &PartRecord,
        dest: &Path,
    ) -> Result<(), CkptError> {
        validate_job_id(job_id)?;
        part.validate()?;
        let io = |op: &'static str, path: &Path| {
            let path = path.to_owned();
            move |source| CkptError::Io { op, path, source }
        };
        for file in &part.files {
            let key = self.job_key(job_id, &format!("{}/{}", part.dir, file.path));
            let target = dest.join(&file.path);
            if let Some(parent) = target.parent() {
                tokio::fs::create_dir_all(parent)
                    .await
                    .map_err(io("create dir", parent))?;
            }
            let output = match self
                .retry("get", &key, || {
                    self.client
                        .get_object()
                        .bucket(&self.location.bucket)
                        .key(&key)
                        .send()
                })
                .await
            {
                Ok(output) => output,
                Err(CkptError::NotFound { what }) => {
                    return Err(CkptError::Corrupt {
                        path: PathBuf::from(what),
                        reason: "is missing".into(),
                    });
                }
                Err(e) => return Err(e),
            };
            let mut out = tokio::fs::File::create(&target)
                .await
                .map_err(io("create", &target))?;
            let mut body = output.body;
            let mut hasher = parse_digest(&file.digest)?.hasher();
            let mut size = 0u64;
            while let Some(chunk) = body.try_next().await.map_err(|e| {
                self.remote_error("get", &key, RemoteKind::Unreachable, e.to_string())
            })? {
                size += chunk.len() as u64;
                if size > file.size_bytes {
                    break;
                }
                hasher.update(&chunk);
                out.write_all(&chunk).await.map_err(io("write", &target))?;
            }
            out.sync_all().await.map_err(io("fsync", &target))?;
            let digest = hasher.finalize();
            if size != file.size_bytes || digest != file.digest {
                return Err(CkptError::Corrupt {
                    path: PathBuf::from(format!("s3://{}/{key}", self.location.bucket)),
                    reason: format!(
                        "downloaded {size} bytes with digest {digest}; the manifest says {} bytes, {}",
                        file.size_bytes, file.digest
                    ),
                });
            }
        }
        Ok(())
    }

    /// Reads a small object whole: `None` when absent, [`CkptError::Corrupt`] when larger
    /// than `limit` bytes. Returns the bytes and the ETag.
    async fn get_small(
        &self,
        key: &str,
        limit: u64,
    ) -> Result<Option<(Vec<u8>, Option<String>)>, CkptError> {
        let output = match self
            .retry("get", key, || {
                self.client
                    .get_object()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .send()
            })
            .await
        {
            Ok(output) => output,
            Err(CkptError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let corrupt = |reason: String| CkptError::Corrupt {
            path: PathBuf::from(format!("s3://{}/{key}", self.location.bucket)),
            reason,
        };
        if output
            .content_length()
            .is_some_and(|l| u64::try_from(l).map_or(true, |l| l > limit))
        {
            return Err(corrupt(format!("is larger than {limit} bytes")));
        }
        let etag = output.e_tag().map(str::to_owned);
        let mut body = output.body;
        let mut bytes = Vec::new();
        while let Some(chunk) = body
            .try_next()
            .await
            .map_err(|e| self.remote_error("get", key, RemoteKind::Unreachable, e.to_string()))?
        {
            if (bytes.len() + chunk.len()) as u64 > limit {
                return Err(corrupt(format!("is larger than {limit} bytes")));
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(Some((bytes, etag)))
    }

    /// `LATEST` and its ETag; `None` when absent.
    async fn read_latest_tagged(
        &self,
        job_id: &str,
    ) -> Result<Option<(u64, Option<String>)>, CkptError> {
        validate_job_id(job_id)?;
        let key = self.job_key(job_id, LATEST_FILE);
        let Some((bytes, etag)) = self.get_small(&key, MAX_LATEST_BYTES).await? else {
            return Ok(None);
        };
        let step = std::str::from_utf8(&bytes)
            .ok()
            .and_then(|text| text.strip_suffix('\n'))
            .and_then(parse_step_dir_name)
            .ok_or_else(|| CkptError::Corrupt {
                path: PathBuf::from(format!("s3://{}/{key}", self.location.bucket)),
                reason: format!("{:?} is not a step name", String::from_utf8_lossy(&bytes)),
            })?;
        Ok(Some((step, etag)))
    }

    /// Keys under `prefix` (paginated, at most [`MAX_LISTED_OBJECTS`]).
    async fn list_keys(&self, prefix: &str) -> Result<Vec<String>, CkptError> {
        let mut keys = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let page = self
                .retry("list", prefix, || {
                    self.client
                        .list_objects_v2()
                        .bucket(&self.location.bucket)
                        .prefix(prefix)
                        .set_continuation_token(token.clone())
                        .send()
                })
                .await?;
            keys.extend(
                page.contents()
                    .iter()
                    .filter_map(|o| o.key().map(str::to_owned)),
            );
            if keys.len() > MAX_LISTED_OBJECTS {
                return Err(CkptError::Invalid(format!(
                    "more than {MAX_LISTED_OBJECTS} objects under s3://{}/{prefix}",
                    self.location.bucket
                )));
            }
            match page.next_continuation_token() {
                Some(next) if page.is_truncated() == Some(true) => token = Some(next.to_owned()),
                _ => return Ok(keys),
            }
        }
    }

    /// Aborts multipart uploads under the job's prefix that were started more than
    /// `older_than_ms` ago (abandoned by a crashed uploader). Returns how many it aborted.
    pub async fn abort_stale_uploads(
        &self,
        job_id: &str,
        older_than_ms: u64,
    ) -> Result<usize, CkptError> {
        validate_job_id(job_id)?;
        let prefix = self.job_key(job_id, "");
        let listed = self
            .retry("list multipart uploads", &prefix, || {
                self.client
                    .list_multipart_uploads()
                    .bucket(&self.location.bucket)
                    .prefix(&prefix)
                    .send()
            })
            .await?;
        let now = std::time::SystemTime::now();
        let mut aborted = 0;
        for upload in listed.uploads() {
            let (Some(key), Some(id)) = (upload.key(), upload.upload_id()) else {
                continue;
            };
            let old = upload.initiated().is_none_or(|t| {
                std::time::SystemTime::try_from(*t)
                    .ok()
                    .and_then(|t| now.duration_since(t).ok())
                    .is_some_and(|age| age.as_millis() >= u128::from(older_than_ms))
            });
            if old {
                self.abort_upload(key, id).await;
                aborted += 1;
            }
        }
        Ok(aborted)
    }
}

/// The ETag (quotes stripped) must be the hex MD5 of what we sent.
///
/// # Errors
/// [`EtagMismatch`] when it is absent or another digest.
pub(super) fn check_etag(etag: Option<&str>, md5: &[u8]) -> Result<(), EtagMismatch> {
    let expected = hex::encode(md5);
    match etag.map(|e| e.trim_matches('"')) {
        Some(e) if e.eq_ignore_ascii_case(&expected) => Ok(()),
        other => Err(EtagMismatch {
            etag: other.map(str::to_owned),
            expected,
        }),
    }
}

/// A single-part upload's ETag is not the MD5 of the bytes sent: the object the server
/// stored is not the one we wrote (S3 gives a single-part, unencrypted upload's MD5 as
/// its ETag).
#[derive(Debug, thiserror::Error)]
#[error("server ETag {etag:?} is not the MD5 {expected} of the bytes sent")]
pub(super) struct EtagMismatch {
    /// The ETag the server answered, quotes stripped (`None`: it sent none).
    etag: Option<String>,
    /// The hex MD5 of the bytes sent.
    expected: String,
}

pub(super) fn base64_encode(bytes: &[u8]) -> String {
    aws_smithy_types::base64::encode(bytes)
}

#[async_trait::async_trait]
impl CheckpointStore for S3Store {
    async fn prepare_staging(
        &self,
        _job_id: &str,
        _rank: u32,
        _attempt: u32,
    ) -> Result<PathBuf, CkptError> {
        Err(CkptError::Invalid(
            "an S3 store is the L2 tier and has no staging: commit through TieredStore".into(),
        ))
    }

    async fn commit_part(
        &self,
        _job_id: &str,
        _step: u64,
        _rank: u32,
        _attempt: u32,
        _staging: &Path,
        _state: serde_json::Value,
    ) -> Result<PartRecord, CkptError> {
        Err(CkptError::Invalid(
            "an S3 store is the L2 tier: commit through TieredStore (L1 then upload)".into(),
        ))
    }

    async fn verify_part(&self, job_id: &str, part: &PartRecord) -> Result<(), CkptError> {
        validate_job_id(job_id)?;
        part.validate()?;
        for file in &part.files {
            let key = self.job_key(job_id, &format!("{}/{}", part.dir, file.path));
            self.check_object(&key, file, "verify").await?;
        }
        Ok(())
    }

    async fn write_manifest(&self, manifest: &Manifest) -> Result<(), CkptError> {
        manifest.validate()?;
        let bytes = serde_json::to_vec_pretty(manifest)
            .map_err(|e| CkptError::Invalid(format!("cannot serialize manifest: {e}")))?;
        if bytes.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(CkptError::Invalid("manifest too large".into()));
        }
        let key = self.job_key(
            &manifest.job_id,
            &format!("{}/{MANIFEST_FILE}", step_dir_name(manifest.step)),
        );
        let md5 = Md5::digest(&bytes);
        let content_md5 = base64_encode(&md5);
        let bytes = bytes::Bytes::from(bytes);
        let output = self
            .retry("put manifest", &key, || {
                self.client
                    .put_object()
                    .bucket(&self.location.bucket)
                    .key(&key)
                    .content_md5(&content_md5)
                    .content_type("application/json")
                    .body(ByteStream::from(bytes.clone()))
                    .send()
            })
            .await?;
        check_etag(output.e_tag(), &md5).map_err(|e| {
            self.remote_error("put manifest", &key, RemoteKind::Changed, e.to_string())
        })
    }

    async fn read_manifest(&self, job_id: &str, step: u64) -> Result<Manifest, CkptError> {
        validate_job_id(job_id)?;
        let key = self.job_key(job_id, &format!("{}/{MANIFEST_FILE}", step_dir_name(step)));
        let path = PathBuf::from(format!("s3://{}/{key}", self.location.bucket));
        let (bytes, _) = self
            .get_small(&key, MAX_MANIFEST_BYTES)
            .await?
            .ok_or_else(|| CkptError::NotFound {
                what: format!("manifest {}", path.display()),
            })?;
        let manifest: Manifest =
            serde_json::from_slice(&bytes).map_err(|e| CkptError::Corrupt {
                path: path.clone(),
                reason: format!("unparsable manifest: {e}"),
            })?;
        manifest.validate().map_err(|e| CkptError::Corrupt {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        if manifest.job_id != job_id || manifest.step != step {
            return Err(CkptError::Corrupt {
                path,
                reason: format!("manifest is of {} step {}", manifest.job_id, manifest.step),
            });
        }
        Ok(manifest)
    }

    async fn verify_step(&self, job_id: &str, step: u64) -> Result<Manifest, CkptError> {
        let manifest = self.read_manifest(job_id, step).await?;
        for part in &manifest.parts {
            self.verify_part(job_id, part).await?;
        }
        Ok(manifest)
    }

    async fn write_latest(&self, job_id: &str, step: u64) -> Result<(), CkptError> {
        validate_job_id(job_id)?;
        let key = self.job_key(job_id, LATEST_FILE);
        let body = bytes::Bytes::from(format!("{}\n", step_dir_name(step)));
        for _ in 0..MAX_LATEST_RACES {
            let current = self.read_latest_tagged(job_id).await;
            let etag = match current {
                Ok(Some((current, _))) if current == step => return Ok(()),
                Ok(Some((current, _)))
                    if current > step && self.verify_step(job_id, current).await.is_ok() =>
                {
                    return Err(self.remote_error(
                        "put LATEST",
                        &key,
                        RemoteKind::Changed,
                        format!(
                            "LATEST names step {current}, which verifies; refusing to move it back to {step}"
                        ),
                    ));
                }
                Ok(Some((_, etag))) => etag,
                Ok(None) => None,
                // A corrupt LATEST is replaced (conditionally on what is there).
                Err(CkptError::Corrupt { .. }) => self
                    .retry("head LATEST", &key, || {
                        self.client
                            .head_object()
                            .bucket(&self.location.bucket)
                            .key(&key)
                            .send()
                    })
                    .await?
                    .e_tag()
                    .map(str::to_owned),
                Err(e) => return Err(e),
            };
            let result = self
                .retry("put LATEST", &key, || {
                    let request = self
                        .client
                        .put_object()
                        .bucket(&self.location.bucket)
                        .key(&key)
                        .content_type("text/plain")
                        .body(ByteStream::from(body.clone()));
                    match &etag {
                        Some(etag) => request.if_match(etag),
                        None => request.if_none_match("*"),
                    }
                    .send()
                })
                .await;
            match result {
                Ok(_) => return Ok(()),
                Err(CkptError::Remote {
                    kind: RemoteKind::Changed,
                    ..
                }) => {
                    tracing::debug!(job_id, step, "LATEST changed under us; re-reading");
                    continue;
                }
                Err(e) => return Err(e),
            }
        }
        Err(self.remote_error(
            "put LATEST",
            &key,
            RemoteKind::Changed,
            format!("LATEST kept changing under {MAX_LATEST_RACES} conditional writes"),
        ))
    }

    async fn read_latest(&self, job_id: &str) -> Result<Option<u64>, CkptError> {
        Ok(self.read_latest_tagged(job_id).await?.map(|(step, _)| step))
    }

    async fn list_steps(&self, job_id: &str) -> Result<Vec<u64>, CkptError> {
        validate_job_id(job_id)?;
        let prefix = self.job_key(job_id, "");
        let mut steps = BTreeSet::new();
        let mut token: Option<String> = None;
        loop {
            let page = self
                .retry("list", &prefix, || {
                    self.client
                        .list_objects_v2()
                        .bucket(&self.location.bucket)
                        .prefix(&prefix)
                        .delimiter("/")
                        .set_continuation_token(token.clone())
                        .send()
                })
                .await?;
            for common in page.common_prefixes() {
                if let Some(step) = common
                    .prefix()
                    .and_then(|p| p.strip_prefix(&prefix))
                    .and_then(|p| p.strip_suffix('/'))
                    .and_then(parse_step_dir_name)
                {
                    steps.insert(step);
                }
            }
            if steps.len() > MAX_LISTED_OBJECTS {
                return Err(CkptError::Invalid("too many steps listed".into()));
            }
            match page.next_continuation_token() {
                Some(next) if page.is_truncated() == Some(true) => token = Some(next.to_owned()),
                _ => return Ok(steps.into_iter().collect()),
            }
        }
    }

    async fn prune(&self, job_id: &str, keep: &[u64]) -> Result<Vec<u64>, CkptError> {
        validate_job_id(job_id)?;
        // Uploads abandoned by a crashed writer (an hour is far beyond any live upload's
        // retry deadline).
        match self.abort_stale_uploads(job_id, 3_600_000).await {
            Ok(0) => {}
            Ok(aborted) => tracing::info!(job_id, aborted, "aborted abandoned multipart uploads"),
            Err(e) => tracing::debug!(job_id, "cannot clean up abandoned multipart uploads: {e}"),
        }
        let Some(latest) = self.read_latest(job_id).await? else {
            return Ok(Vec::new());
        };
        let mut deleted = Vec::new();
        for step in self.list_steps(job_id).await? {
            if step >= latest || keep.contains(&step) {
                continue;
            }
            let prefix = self.job_key(job_id, &format!("{}/", step_dir_name(step)));
            // The manifest goes first, so a half-deleted step is never taken for whole.
            let manifest = format!("{prefix}{MANIFEST_FILE}");
            let mut keys = self.list_keys(&prefix).await?;
            keys.sort_by_key(|k| *k != manifest);
            self.delete_keys(keys).await?;
            deleted.push(step);
        }
        Ok(deleted)
    }

    async fn delete_job(&self, job_id: &str) -> Result<bool, CkptError> {
        validate_job_id(job_id)?;
        let mut keys = self.list_keys(&self.job_key(job_id, "")).await?;
        if keys.is_empty() {
            return Ok(false);
        }
        // LATEST first, then the manifests, then the parts: never a LATEST or a manifest
        // naming what is already gone.
        let latest = self.job_key(job_id, LATEST_FILE);
        keys.sort_by_key(|k| (*k != latest, !k.ends_with(MANIFEST_FILE)));
        self.delete_keys(keys).await?;
        Ok(true)
    }

    fn local_part_path(&self, _job_id: &str, _part_dir: &str) -> Option<PathBuf> {
        None
    }

    fn describe(&self) -> String {
        format!("{} (endpoint {})", self.location, self.endpoint)
    }
}

/// Key of one file of a part, relative to the store's prefix (for tools and tests).
pub fn part_file_key(job_id: &str, step: u64, rank: u32, attempt: u32, path: &str) -> String {
    format!("{job_id}/{}/{path}", part_dir_rel(step, rank, attempt))
}
