//! The blob store from a test's side: upload and read a blob over the client API in
//! the contract's chunks (`cumulus_api::blobs::CHUNK_BYTES`).

use cumulus_api::v1;

use crate::Client;

/// An upload's chunks: the first names the blob (`digest`, size), each carries at most
/// `CHUNK_BYTES`; an empty blob is one empty chunk.
pub fn blob_chunks(digest: &str, data: &[u8]) -> Vec<v1::BlobChunk> {
    let mut out: Vec<v1::BlobChunk> = data
        .chunks(cumulus_api::blobs::CHUNK_BYTES)
        .map(|c| v1::BlobChunk {
            data: c.to_vec(),
            ..Default::default()
        })
        .collect();
    if out.is_empty() {
        out.push(v1::BlobChunk::default());
    }
    out[0].digest = digest.to_string();
    out[0].size_bytes = data.len() as u64;
    out
}

/// `PutBlob` of `data` as `digest` through `c`.
///
/// # Errors
/// The coordinator's refusal (wrong digest, quota, no majority, permission).
pub async fn put_blob(
    c: &mut Client,
    digest: &str,
    data: &[u8],
) -> Result<v1::PutBlobResponse, tonic::Status> {
    c.put_blob(futures::stream::iter(blob_chunks(digest, data)))
        .await
        .map(tonic::Response::into_inner)
}

/// `GetBlob` of `digest` through `c`, its chunks joined.
///
/// # Errors
/// The coordinator's refusal (not found, permission, data loss mid-stream).
pub async fn get_blob(c: &mut Client, digest: &str) -> Result<Vec<u8>, tonic::Status> {
    let mut stream = c
        .get_blob(v1::GetBlobRequest {
            digest: digest.into(),
        })
        .await?
        .into_inner();
    let mut out = Vec::new();
    while let Some(chunk) = stream.message().await? {
        out.extend_from_slice(&chunk.data);
    }
    Ok(out)
}
