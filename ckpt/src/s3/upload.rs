//! Uploads of a part's files: one `PutObject` below the multipart threshold, else a
//! multipart upload with bounded parallel parts, each body signed over its SHA-256 and
//! the object checked by `HEAD` afterwards (see the module documentation of `s3`).

use std::path::{Path, PathBuf};

use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use futures::{StreamExt, TryStreamExt};

use crate::{CkptError, FileEntry, PartRecord, validate_job_id};

use super::*;

impl S3Store {
    /// Uploads the files of an already committed local part (directory `local_dir`, files
    /// as in `record`) to `<job>/<record.dir>/…`, verifying each object (Content-MD5, ETag =
    /// MD5, then `HEAD` size + SHA-256 metadata) before returning. Re-uploading the same
    /// part is harmless (same keys, same bytes).
    pub async fn upload_part(
        &self,
        job_id: &str,
        record: &PartRecord,
        local_dir: &Path,
    ) -> Result<(), CkptError> {
        validate_job_id(job_id)?;
        record.validate()?;
        let mut uploads = Vec::with_capacity(record.files.len());
        for file in &record.files {
            let key = self.job_key(job_id, &format!("{}/{}", record.dir, file.path));
            let path = local_dir.join(&file.path);
            uploads.push(async move { self.upload_file(&key, &path, file).await });
        }
        // Files go up a few at a time; parts of large files are bounded by the semaphore.
        futures::stream::iter(uploads)
            .buffer_unordered(4)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }

    /// Uploads one file (single PUT or multipart) and verifies the object.
    pub(super) async fn upload_file(
        &self,
        key: &str,
        path: &Path,
        file: &FileEntry,
    ) -> Result<(), CkptError> {
        self.upload_file_with(key, path, file, &[]).await
    }

    /// [`S3Store::upload_file`] with more user metadata than the digest.
    pub(super) async fn upload_file_with(
        &self,
        key: &str,
        path: &Path,
        file: &FileEntry,
        metadata: &[(&str, &str)],
    ) -> Result<(), CkptError> {
        if file.size_bytes > self.settings.multipart_threshold_bytes {
            self.upload_multipart(key, path, file, metadata).await?;
        } else {
            let bytes = bytes::Bytes::from(read_range(path, 0, file.size_bytes).await?);
            // The SigV4 payload hash (signed, checked by the server) verifies the body.
            self.retry("put", key, || {
                let mut put = self
                    .client
                    .put_object()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .metadata(DIGEST_METADATA_KEY, &file.digest);
                for (k, v) in metadata {
                    put = put.metadata(*k, *v);
                }
                put.body(ByteStream::from(bytes.clone())).send()
            })
            .await?;
        }
        self.check_object(key, file, "verify upload").await
    }

    pub(super) async fn upload_multipart(
        &self,
        key: &str,
        path: &Path,
        file: &FileEntry,
        metadata: &[(&str, &str)],
    ) -> Result<(), CkptError> {
        let part_size = self
            .settings
            .part_size_bytes
            .max(file.size_bytes.div_ceil(MAX_UPLOAD_PARTS));
        let created = self
            .retry("create multipart upload", key, || {
                let mut create = self
                    .client
                    .create_multipart_upload()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .metadata(DIGEST_METADATA_KEY, &file.digest);
                for (k, v) in metadata {
                    create = create.metadata(*k, *v);
                }
                create.send()
            })
            .await?;
        let upload_id = created
            .upload_id()
            .ok_or_else(|| {
                self.remote_error(
                    "create multipart upload",
                    key,
                    RemoteKind::Other,
                    "no upload id".into(),
                )
            })?
            .to_owned();
        let count = file.size_bytes.div_ceil(part_size).max(1);
        // Each part is its own task, so that reading, signing (SHA-256 of the body) and
        // sending parts use every runtime thread rather than the one polling this
        // future; at most `max_concurrent_requests` of this file's parts are alive at once
        // (each holds its bytes), and the store's semaphore bounds requests across files.
        // A dropped upload aborts its part tasks.
        let mut parts = Vec::new();
        for index in 0..count {
            let offset = index * part_size;
            let len = part_size.min(file.size_bytes - offset);
            let store = self.clone();
            let task_key = key.to_owned();
            let upload_id = upload_id.clone();
            let path = path.to_owned();
            parts.push(async move {
                let task = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
                    store
                        .upload_one_part(&task_key, &upload_id, &path, index, offset, len)
                        .await
                }));
                match task.await {
                    Ok(result) => result,
                    Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
                    Err(error) => Err(CkptError::Io {
                        op: "upload part task",
                        path: PathBuf::from(format!("s3://{}/{key}", self.location.bucket)),
                        source: std::io::Error::other(error),
                    }),
                }
            });
        }
        let result: Result<Vec<CompletedPart>, CkptError> = futures::stream::iter(parts)
            .buffer_unordered(self.settings.max_concurrent_requests.max(1))
            .try_collect()
            .await;
        let mut completed = match result {
            Ok(parts) => parts,
            Err(error) => {
                self.abort_upload(key, &upload_id).await;
                return Err(error);
            }
        };
        completed.sort_by_key(|p| p.part_number());
        let body = CompletedMultipartUpload::builder()
            .set_parts(Some(completed))
            .build();
        if let Err(error) = self
            .retry("complete multipart upload", key, || {
                self.client
                    .complete_multipart_upload()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .upload_id(&upload_id)
                    .multipart_upload(body.clone())
                    .send()
            })
            .await
        {
            self.abort_upload(key, &upload_id).await;
            return Err(error);
        }
        Ok(())
    }

    /// Uploads part `index` (bytes `offset..offset + len` of `path`) of a multipart upload.
    /// The SigV4 payload hash (signed, checked by the server) verifies the body.
    pub(super) async fn upload_one_part(
        &self,
        key: &str,
        upload_id: &str,
        path: &Path,
        index: u64,
        offset: u64,
        len: u64,
    ) -> Result<CompletedPart, CkptError> {
        let bytes = bytes::Bytes::from(read_range(path, offset, len).await?);
        let number = i32::try_from(index + 1).expect("part number ≤ 10,000");
        let output = self
            .retry("upload part", key, || {
                self.client
                    .upload_part()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .upload_id(upload_id)
                    .part_number(number)
                    .body(ByteStream::from(bytes.clone()))
                    .send()
            })
            .await?;
        Ok(CompletedPart::builder()
            .part_number(number)
            .set_e_tag(output.e_tag().map(str::to_owned))
            .build())
    }

    pub(super) async fn abort_upload(&self, key: &str, upload_id: &str) {
        if let Err(e) = self
            .retry("abort multipart upload", key, || {
                self.client
                    .abort_multipart_upload()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .upload_id(upload_id)
                    .send()
            })
            .await
        {
            tracing::warn!(
                key,
                "cannot abort multipart upload (prune cleans it up later): {e}"
            );
        }
    }
}

/// Reads `len` bytes at `offset` of `path`: one blocking-pool task (open + one positioned
/// read), not one round trip to the pool per 2 MiB as `tokio::fs` reads would take.
pub(super) async fn read_range(path: &Path, offset: u64, len: u64) -> Result<Vec<u8>, CkptError> {
    use std::os::unix::fs::FileExt as _;
    let len = usize::try_from(len).map_err(|_| CkptError::Invalid("part too large".into()))?;
    let path = path.to_owned();
    crate::local::blocking(move || {
        let io = |op: &'static str| {
            let path = path.clone();
            move |source| CkptError::Io { op, path, source }
        };
        let file = std::fs::File::open(&path).map_err(io("open"))?;
        let mut buffer = vec![0u8; len];
        file.read_exact_at(&mut buffer, offset)
            .map_err(io("read"))?;
        Ok(buffer)
    })
    .await
}
