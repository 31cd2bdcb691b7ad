//! The S3 (L2) checkpoint tier: [`S3Store`] on aws-sdk-s3, for AWS S3, MinIO and other
//! S3-compatible servers (path-style addressing, custom endpoint).
//!
//! # Layout (docs/architecture.md "Checkpoint layout (S3)")
//! ```text
//! s3://<bucket>/<prefix>/<job_id>/step-00000100/rank-0/attempt-1/<file>   one part's files
//! s3://<bucket>/<prefix>/<job_id>/step-00000100/MANIFEST.json            after every part
//! s3://<bucket>/<prefix>/<job_id>/LATEST                                 last, conditional
//! ```
//! Every object of a part carries its digest (`blake3:<hex>`, [`crate::digest`]) as user
//! metadata (`x-amz-meta-digest`; parts of format-1 manifests carry `x-amz-meta-sha256`); an
//! upload is verified before it counts: every request of part data is signed with
//! SigV4 over the SHA-256 of its body (`x-amz-content-sha256`), which the server checks
//! against the bytes it received before it stores them (AWS S3, MinIO and s3s all refuse a
//! mismatch), and a final `HEAD` must show the recorded size and digest. (Part data is
//! not also sent with `Content-MD5`: the body's SHA-256 already covers it, and an MD5 of
//! every byte cost the 2-core benchmark machine about a tenth of its CPU time; see
//! docs/perf-notes.md, "Checkpoints in S3".) Small metadata objects (manifest, `LATEST`) carry
//! `Content-MD5` and their ETag is checked, because `LATEST`'s conditional writes compare
//! ETags anyway. A reader
//! ([`S3Store::verify_part`]) checks size and digest metadata by `HEAD`; a restore
//! ([`S3Store::restore_part`]) hashes every byte it downloads.
//!
//! `LATEST` moves with conditional writes (`If-Match` on the ETag read, `If-None-Match: *`
//! when absent): a writer whose view is stale gets 412 and re-reads, and a write that would
//! move `LATEST` backwards past a step that still verifies is refused.
//!
//! Transient failures (endpoint unreachable, timeouts, 5xx, 503 SlowDown) are retried with
//! exponential backoff until [`S3Settings::retry_deadline_ms`]; permanent ones (bad
//! credentials, missing bucket, access denied) are returned at once as
//! [`CkptError::Remote`] with a [`RemoteKind`] callers can branch on.
//!
//! Split along its seams: [`config`] (settings, locations), [`args`] (the binaries' flags,
//! feature `clap`), [`client`] (connector, error classification), [`store`] (the
//! protocol), [`upload`] (a part's files: single or multipart, verified), [`objects`]
//! (plain objects for the coordinators' blob store: a verified upload of a file with
//! user metadata, `HEAD`, a streamed `GET`, a listing with sizes, a delete).

#[cfg(feature = "clap")]
mod args;
mod client;
mod config;
mod objects;
mod store;
#[cfg(test)]
mod tests;
mod upload;

#[cfg(feature = "clap")]
pub use args::*;
pub use client::*;
pub use config::*;
pub use objects::*;
pub use store::*;

/// User-metadata key holding a part object's digest (`<algorithm>:<hex>`, as in its
/// [`FileEntry`]); sent as `x-amz-meta-digest`.
pub const DIGEST_METADATA_KEY: &str = "digest";
/// User-metadata key of the bare hex SHA-256 of objects uploaded for format-1 manifests
/// (`x-amz-meta-sha256`); still accepted for `sha256:` digests.
pub const LEGACY_SHA256_METADATA_KEY: &str = "sha256";
/// Most objects listed under one job prefix (pagination stops there).
pub const MAX_LISTED_OBJECTS: usize = 1_000_000;
/// Most attempts of one conditional `LATEST` update before giving up (412 races).
pub(super) const MAX_LATEST_RACES: u32 = 16;
/// Smallest multipart part S3 accepts (except the last), in bytes.
pub const MIN_PART_SIZE_BYTES: u64 = 5 * 1024 * 1024;
/// Largest number of parts of one multipart upload (S3's limit).
pub const MAX_UPLOAD_PARTS: u64 = 10_000;
