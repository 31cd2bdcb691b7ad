//! Plain objects for other users of a bucket than the checkpoint protocol (the
//! coordinators' blob store, `--blob-url`): a local file uploaded under a key with its
//! digest and more user metadata (single `PutObject` or multipart, verified by `HEAD` as
//! a part's files are), `HEAD`, a streamed `GET`, a listing with sizes and times, and a
//! delete. Every request goes through the store's retries and its bound on requests in
//! flight.

use std::collections::HashMap;
use std::path::Path;

use aws_sdk_s3::primitives::ByteStream;
use futures::stream::BoxStream;

use crate::{CkptError, FileEntry};

use super::*;

/// What `HEAD` (or a `GET`'s answer) says of an object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObjectInfo {
    /// Its size, in bytes.
    pub size_bytes: u64,
    /// Its ETag, as the server sent it (quotes included), when it sent one.
    pub etag: Option<String>,
    /// Its user metadata (`x-amz-meta-*`, keys without the prefix, lowercase).
    pub metadata: HashMap<String, String>,
    /// When it was last written, in ms since the Unix epoch (the server's clock).
    pub last_modified_ms: Option<u64>,
}

/// One object of a listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedObject {
    /// Its full key in the bucket.
    pub key: String,
    /// Its size, in bytes.
    pub size_bytes: u64,
    /// When it was last written, in ms since the Unix epoch (the server's clock).
    pub last_modified_ms: Option<u64>,
}

/// The bytes of an object being read, as the server sends them (chunks of any size); a
/// transport failure ends it with [`CkptError::Remote`].
pub type ObjectBody = BoxStream<'static, Result<bytes::Bytes, CkptError>>;

fn millis(t: Option<&aws_smithy_types::DateTime>) -> Option<u64> {
    t.and_then(|t| t.to_millis().ok())
        .and_then(|ms| u64::try_from(ms).ok())
}

impl S3Store {
    /// Uploads the local file `path` (`size_bytes` long, `digest` `<algorithm>:<hex>` of
    /// its bytes, which the caller verified) as object `key`, with `digest` and `metadata`
    /// as user metadata: one `PutObject` up to the multipart threshold, else a multipart
    /// upload (the object appears only once complete). Then `HEAD` must show that size and
    /// digest. The object replaces any other under `key`.
    ///
    /// # Errors
    /// [`CkptError::Io`] reading the file; [`CkptError::Remote`] when S3 refuses or stays
    /// unreachable past the retry deadline; [`CkptError::Corrupt`] when the object stored
    /// is not of that size and digest.
    pub async fn put_file(
        &self,
        key: &str,
        path: &Path,
        (size_bytes, digest): (u64, &str),
        metadata: &[(&str, &str)],
    ) -> Result<(), CkptError> {
        let file = FileEntry {
            path: path.display().to_string(),
            size_bytes,
            digest: digest.to_owned(),
        };
        self.upload_file_with(key, path, &file, metadata).await
    }

    /// `HEAD` of object `key`; `None` when there is none.
    ///
    /// # Errors
    /// [`CkptError::Remote`] when S3 refuses or stays unreachable past the retry deadline.
    pub async fn head_object(&self, key: &str) -> Result<Option<ObjectInfo>, CkptError> {
        let head = match self
            .retry("head", key, || {
                self.client
                    .head_object()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .send()
            })
            .await
        {
            Ok(head) => head,
            Err(CkptError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        Ok(Some(ObjectInfo {
            size_bytes: self.size_of(key, head.content_length())?,
            etag: head.e_tag().map(str::to_owned),
            metadata: head.metadata().cloned().unwrap_or_default(),
            last_modified_ms: millis(head.last_modified()),
        }))
    }

    /// Opens object `key` for reading: what the server says of it and its bytes, as they
    /// arrive (nothing is checked: the caller verifies them). `None` when there is none.
    ///
    /// # Errors
    /// [`CkptError::Remote`] when S3 refuses or stays unreachable past the retry deadline.
    pub async fn get_object(
        &self,
        key: &str,
    ) -> Result<Option<(ObjectInfo, ObjectBody)>, CkptError> {
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
        let info = ObjectInfo {
            size_bytes: self.size_of(key, output.content_length())?,
            etag: output.e_tag().map(str::to_owned),
            metadata: output.metadata().cloned().unwrap_or_default(),
            last_modified_ms: millis(output.last_modified()),
        };
        let store = self.clone();
        let key = key.to_owned();
        let body = futures::stream::unfold(Some(output.body), move |body: Option<ByteStream>| {
            let (store, key) = (store.clone(), key.clone());
            async move {
                let mut body = body?;
                match body.next().await {
                    None => None,
                    Some(Ok(bytes)) => Some((Ok(bytes), Some(body))),
                    Some(Err(e)) => {
                        let error =
                            store.remote_error("get", &key, RemoteKind::Unreachable, e.to_string());
                        Some((Err(error), None))
                    }
                }
            }
        });
        Ok(Some((info, Box::pin(body))))
    }

    /// The objects whose keys start with `prefix` (a full key prefix; paginated), at most
    /// `max` of them; keys ending in `/` (folder markers) are left out.
    ///
    /// # Errors
    /// [`CkptError::Invalid`] past `max` objects; [`CkptError::Remote`] when S3 refuses or
    /// stays unreachable past the retry deadline.
    pub async fn list_objects_under(
        &self,
        prefix: &str,
        max: usize,
    ) -> Result<Vec<ListedObject>, CkptError> {
        let mut listed = Vec::new();
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
            for object in page.contents() {
                let Some(key) = object.key().filter(|k| !k.ends_with('/')) else {
                    continue;
                };
                listed.push(ListedObject {
                    key: key.to_owned(),
                    size_bytes: object
                        .size()
                        .and_then(|s| u64::try_from(s).ok())
                        .unwrap_or(0),
                    last_modified_ms: millis(object.last_modified()),
                });
            }
            if listed.len() > max {
                return Err(CkptError::Invalid(format!(
                    "more than {max} objects under s3://{}/{prefix}",
                    self.location.bucket
                )));
            }
            match page.next_continuation_token() {
                Some(next) if page.is_truncated() == Some(true) => token = Some(next.to_owned()),
                _ => return Ok(listed),
            }
        }
    }

    /// Deletes object `key` (one that is already gone is fine).
    ///
    /// # Errors
    /// [`CkptError::Remote`] when S3 refuses or stays unreachable past the retry deadline.
    pub async fn delete_object(&self, key: &str) -> Result<(), CkptError> {
        match self
            .retry("delete", key, || {
                self.client
                    .delete_object()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .send()
            })
            .await
        {
            Ok(_) | Err(CkptError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// An answer's Content-Length as a size.
    fn size_of(&self, key: &str, length: Option<i64>) -> Result<u64, CkptError> {
        length
            .and_then(|l| u64::try_from(l).ok())
            .ok_or_else(|| self.remote_error("head", key, RemoteKind::Other, "no size".into()))
    }
}
