//! Blobs from and to the cluster's blob store: `--upload DIR` (packed with
//! [`cumulus_bundle`], stored unless the cluster has it already) and downloads of a
//! job's artifacts, verified against their digest.

use std::path::Path;

use anyhow::{Context, Result, bail};
use cumulus_api::BlobRef;
use cumulus_api::blobs::{DEFAULT_MAX_WORKDIR_BYTES, MAX_BLOB_BYTES, is_valid_digest};
use cumulus_bundle::{Fingerprint, PackOptions, human_bytes};

use crate::args::JobOpts;
use crate::client::{Client, RetryPolicy};
use crate::config::Conn;
use crate::upload_cache::{CachedDigest, UploadCache, key_of, now_ns};

/// The most bytes the files of `--upload` may hold: `--max-upload-mib`, or
/// [`DEFAULT_MAX_WORKDIR_BYTES`].
pub fn max_upload_bytes(args: &JobOpts) -> u64 {
    args.max_upload_mib
        .map_or(DEFAULT_MAX_WORKDIR_BYTES, |mib| mib * 1024 * 1024)
}

/// A client whose calls have time to move `bytes` ([`RetryPolicy::for_transfer`]).
fn transfer_client(conn: &Conn, bytes: u64) -> Result<Client> {
    let policy = RetryPolicy {
        max_total: conn.retry_total,
        ..RetryPolicy::default()
    }
    .for_transfer(bytes);
    Ok(Client::with_policy(conn, policy)?)
}

/// What the digest cache knows of a directory about to be uploaded.
struct CacheProbe {
    cache: UploadCache,
    /// The directory's canonical path.
    key: String,
    /// Its fingerprint, taken at `taken_at_ns`.
    print: Fingerprint,
    taken_at_ns: i64,
    /// The cached digest, when trusted.
    hit: Option<CachedDigest>,
}

/// Fingerprints `dir` and looks it up in the digest cache ([`crate::upload_cache`]);
/// `None` when the cache is off, or the directory cannot be fingerprinted (packing it
/// then says why).
fn probe_cache(dir: &Path, options: &PackOptions) -> Option<CacheProbe> {
    let cache = UploadCache::from_env()?;
    let key = key_of(dir)?;
    let taken_at_ns = now_ns();
    let print = cumulus_bundle::fingerprint(dir, options)
        .inspect_err(|e| tracing::info!("upload cache: {}: {e}", dir.display()))
        .ok()?;
    let hit = cache.lookup(&key, &print);
    Some(CacheProbe {
        cache,
        key,
        print,
        taken_at_ns,
        hit,
    })
}

/// Packs `dir` (ignore files honoured, at most `max_bytes` of files), asks the cluster
/// whether it holds that digest, and uploads it when it does not. Says on stderr what
/// was sent: `uploaded N bytes …` or `workdir unchanged: uploaded 0 bytes …`. A
/// directory unchanged since its last upload (the digest cache of
/// [`crate::upload_cache`]) is not packed again when the cluster still holds its blob.
///
/// # Errors
/// Packing refused (a link out of the tree, over the size limit: the error names the
/// largest files), or the cluster refused or could not be reached.
pub async fn upload_workdir(conn: &Conn, dir: &Path, max_bytes: u64) -> Result<BlobRef> {
    let options = PackOptions {
        respect_ignore_files: true,
        max_bytes,
        temp_dir: None,
    };
    let (owned, opts) = (dir.to_path_buf(), options.clone());
    let probe = tokio::task::spawn_blocking(move || probe_cache(&owned, &opts))
        .await
        .context("the fingerprinting task")?;
    if let Some(p) = &probe
        && let Some(hit) = &p.hit
        && p.print.unpacked_bytes <= max_bytes
    {
        let stat = Client::new(conn)?
            .stat_blob(&hit.digest)
            .await
            .context("asking the cluster whether it has the workdir")?;
        if stat.present && stat.size_bytes == hit.size {
            eprintln!(
                "workdir unchanged: uploaded 0 bytes ({} files, {} before compression; not packed again)",
                p.print.files,
                human_bytes(p.print.unpacked_bytes)
            );
            return Ok(BlobRef {
                digest: hit.digest.clone(),
                size_bytes: hit.size,
            });
        }
    }
    let blob = pack_and_upload(conn, dir, options).await?;
    if let Some(p) = probe {
        p.cache.record(
            &p.key,
            CachedDigest {
                fingerprint: p.print.digest,
                digest: blob.digest.clone(),
                size: blob.size_bytes,
                written_at_ns: p.taken_at_ns,
            },
        );
    }
    Ok(blob)
}

/// Packs `dir` and uploads it unless the cluster holds its digest already.
async fn pack_and_upload(conn: &Conn, dir: &Path, options: PackOptions) -> Result<BlobRef> {
    let owned = dir.to_path_buf();
    let packed = tokio::task::spawn_blocking(move || cumulus_bundle::pack(&owned, &options))
        .await
        .context("the packing task")?
        .with_context(|| format!("--upload {}", dir.display()))?;
    if packed.size_bytes > MAX_BLOB_BYTES {
        bail!(
            "--upload {} packs to {}, more than the cluster's limit of {} per blob",
            dir.display(),
            human_bytes(packed.size_bytes),
            human_bytes(MAX_BLOB_BYTES)
        );
    }
    let what = format!(
        "{} files, {} before compression",
        packed.files,
        human_bytes(packed.unpacked_bytes)
    );
    let stat = Client::new(conn)?
        .stat_blob(&packed.digest)
        .await
        .context("asking the cluster whether it has the workdir")?;
    if stat.present && stat.size_bytes == packed.size_bytes {
        eprintln!("workdir unchanged: uploaded 0 bytes ({what})");
    } else {
        let put = transfer_client(conn, packed.size_bytes)?
            .put_blob(packed.path(), &packed.digest, packed.size_bytes)
            .await
            .context("uploading the workdir")?;
        if put.digest != packed.digest || put.size_bytes != packed.size_bytes {
            bail!(
                "the cluster stored {} ({} bytes) for the workdir {} ({} bytes)",
                cumulus_api::text::escape_control(&put.digest),
                put.size_bytes,
                packed.digest,
                packed.size_bytes
            );
        }
        eprintln!("uploaded {} bytes ({what})", packed.size_bytes);
    }
    Ok(BlobRef {
        digest: packed.digest.clone(),
        size_bytes: packed.size_bytes,
    })
}

/// Downloads the blob `blob` into a temporary file (removed when dropped), checked
/// against its digest and size.
///
/// # Errors
/// A malformed reference, the cluster refused (not the job's owner, not stored), or the
/// bytes do not match.
pub async fn download(conn: &Conn, blob: &BlobRef) -> Result<tempfile::NamedTempFile> {
    if !is_valid_digest(&blob.digest) || blob.size_bytes > MAX_BLOB_BYTES {
        bail!(
            "the cluster named a malformed blob {} of {} bytes",
            cumulus_api::text::escape_control(&blob.digest),
            blob.size_bytes
        );
    }
    let mut file = tempfile::Builder::new()
        .prefix("cumulus-blob-")
        .tempfile()
        .context("a temporary file for the download")?;
    let got = transfer_client(conn, blob.size_bytes)?
        .get_blob(&blob.digest, blob.size_bytes, file.as_file_mut())
        .await
        .with_context(|| format!("downloading blob {}", blob.digest))?;
    if got != blob.size_bytes {
        bail!(
            "blob {}: {got} bytes received, {} expected",
            blob.digest,
            blob.size_bytes
        );
    }
    Ok(file)
}
