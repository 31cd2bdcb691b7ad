//! The blob store as clients see it (gRPC `StatBlob`/`PutBlob`/`GetBlob` and
//! `HEAD|PUT|GET /v1/blobs/{digest}`): who may stat, upload and read which blob, and the
//! admission check of a submit that names a workdir blob. The mechanism is
//! [`crate::blobs`].
//!
//! Any authenticated principal may ask whether a blob is held; users who submit (and
//! administrators) upload, within their quota; an administrator (the cluster token
//! included) reads any blob, a user only a blob that a job they own references (its
//! workdir or one of its artifacts).

use axum::body::Bytes;
use cumulus_api::Role;
use cumulus_api::blobs::is_valid_digest;
use cumulus_api::users::Principal;
use cumulus_api::v1;
use futures::Stream;

use super::authorization::require_role;
use crate::blobs::ops::Uploader;
use crate::blobs::{BlobError, BlobHeader, BlobRead, refs};
use crate::error::ApiError;
use crate::node::Node;

/// Refuses a malformed digest.
fn check_digest(digest: &str) -> Result<(), ApiError> {
    if is_valid_digest(digest) {
        Ok(())
    } else {
        Err(ApiError::InvalidArgument(format!(
            "{} is not a blob digest (64 lowercase hex digits of BLAKE3)",
            cumulus_api::text::escape_control(&digest.chars().take(80).collect::<String>())
        )))
    }
}

/// Whether this coordinator holds blob `digest` (with its recorded size).
///
/// # Errors
/// `InvalidArgument` for a malformed digest.
pub async fn stat_blob(node: &Node, digest: &str) -> Result<v1::StatBlobResponse, ApiError> {
    check_digest(digest)?;
    Ok(match node.blobs.stat(digest).await? {
        Some(m) => v1::StatBlobResponse {
            present: true,
            size_bytes: m.size_bytes,
        },
        None => v1::StatBlobResponse {
            present: false,
            size_bytes: 0,
        },
    })
}

/// Stores `who`'s upload of the blob `header` names from `chunks`; answered once a
/// majority of the voting coordinators hold it.
///
/// # Errors
/// `PermissionDenied` for a reader; `InvalidArgument` for a bad digest, a size past the
/// limit or bytes that are not the blob (naming the digest expected and the one got);
/// `ResourceExhausted` past the user's quota (with usage and quota) or the uploads in
/// progress; `Unavailable` naming the coordinators that failed when no majority holds
/// it in time.
pub async fn put_blob<S>(
    node: &Node,
    who: &Principal,
    header: BlobHeader,
    chunks: S,
) -> Result<v1::PutBlobResponse, ApiError>
where
    S: Stream<Item = Result<Bytes, BlobError>> + Unpin + Send,
{
    require_role(who, Role::Submit, "upload blobs")?;
    check_digest(&header.digest)?;
    Ok(node
        .blobs
        .put(header, &Uploader::User(who.clone()), chunks)
        .await?)
}

/// Opens blob `digest` for `who` (fetched from a peer first when this coordinator lacks
/// it).
///
/// # Errors
/// `InvalidArgument` for a malformed digest; `PermissionDenied` when `who` is not an
/// administrator and owns no job referencing it; `NotFound` when no coordinator holds
/// it; `Unavailable` when it cannot be fetched.
pub async fn get_blob(node: &Node, who: &Principal, digest: &str) -> Result<BlobRead, ApiError> {
    check_digest(digest)?;
    if !node.read_state(|s| refs::may_read(s, who, digest)) {
        return Err(ApiError::PermissionDenied(format!(
            "user {} may not read blob {digest}: no job of theirs references it (as its \
             workdir or an artifact)",
            who.name
        )));
    }
    Ok(node.blobs.open(digest).await?)
}

/// Admission of a submit naming `workdir`: the leader holds the blob (fetched from a
/// peer first when it lacks it) with the size the spec gives, and it is on a majority of
/// the voters again (a blob uploaded long ago may have been collected on some).
///
/// # Errors
/// `InvalidArgument` for a malformed reference; `FailedPrecondition` when no coordinator
/// holds it ("upload it first") or it has another size; `Unavailable` when it cannot be
/// fetched or put back on a majority.
pub async fn check_workdir(node: &Node, workdir: &v1::BlobRef) -> Result<(), ApiError> {
    check_digest(&workdir.digest)?;
    let digest = &workdir.digest;
    let meta = match node.blobs.ensure_held(digest).await {
        Ok(m) => m,
        Err(BlobError::NotFound(_)) => {
            return Err(ApiError::FailedPrecondition(format!(
                "workdir blob {digest} is not in the blob store: upload it first"
            )));
        }
        Err(e) => return Err(e.into()),
    };
    if meta.size_bytes != workdir.size_bytes {
        return Err(ApiError::FailedPrecondition(format!(
            "workdir blob {digest} is {} bytes, and the spec says {}",
            meta.size_bytes, workdir.size_bytes
        )));
    }
    let header = BlobHeader {
        digest: digest.clone(),
        size_bytes: meta.size_bytes,
    };
    node.blobs.replicate_to_majority(&header, &meta).await?;
    Ok(())
}
