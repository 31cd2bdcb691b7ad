//! Packed directories of the Cumulus blob store, in the format of [`cumulus_api::blobs`]:
//! a gzip-compressed POSIX tar archive of regular files and directories with relative,
//! normalized paths, named by the BLAKE3 digest of its bytes.
//!
//! - [`pack`]: a directory into an archive, deterministically (the same tree gives the
//!   same bytes, whatever the files' times, owners or the walk's order), honouring
//!   `.gitignore` and `.cumulusignore` when asked (a job's `--upload`; a rank's artifacts
//!   are packed as they are), within a size limit whose error names the largest files.
//! - [`unpack`]: an archive into a fresh directory, treating it as hostile input: only
//!   regular files and directories; absolute paths, `..`, links, device files and FIFOs,
//!   over-long paths, too many entries and decompression bombs are refused with the
//!   entry named.
//! - [`list`] and [`extract_file`]: the entries of an archive, or one file's bytes, with
//!   the same checks (`cumulusctl artifacts ls` / `get`).
//! - [`fingerprint`]: the listing [`pack`] would pack, hashed from `stat` alone (no
//!   file read), for a client's cache of digests (`cumulusctl --upload`).
//! - [`digest_file`]: the BLAKE3 digest of a file, streamed.
//!
//! Users: `cumulusctl` (upload, artifacts), the worker agent (a job's workdir, a rank's
//! artifacts). No I/O beyond the paths it is given; no network.

mod pack;
mod read;
mod unpack;

#[cfg(test)]
mod tests;

pub use pack::{
    CUMULUSIGNORE, Fingerprint, LARGEST_NAMED, PACK_FORMAT_VERSION, PackError, PackOptions, Packed,
    fingerprint, human_bytes, pack,
};
pub use read::{EntryKind, ListedEntry, MAX_PAX_HEADER_BYTES, UnpackError};
pub use unpack::{UnpackLimits, Unpacked, extract_file, list, unpack};

use std::io::Read;
use std::path::Path;

/// Bytes read at a time when hashing or copying a file.
pub const IO_BUFFER_BYTES: usize = 256 * 1024;

/// The BLAKE3 digest of the file at `path` (64 lowercase hex digits, as
/// [`cumulus_api::blobs::is_valid_digest`] names a blob), read in
/// [`IO_BUFFER_BYTES`] pieces, and its size in bytes.
///
/// # Errors
/// The file cannot be opened or read.
pub fn digest_file(path: &Path) -> std::io::Result<(String, u64)> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; IO_BUFFER_BYTES];
    let mut size = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((hasher.finalize().to_hex().to_string(), size))
}
