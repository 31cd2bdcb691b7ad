//! The blob store's contract: content-addressed blobs (a job's packed working directory,
//! a rank attempt's artifacts, a remote function's result) that clients, coordinators and
//! agents exchange, and the limits each side checks.
//!
//! A blob is named by the BLAKE3 hash of its bytes ([`is_valid_digest`]). A packed
//! directory is a gzip-compressed tar archive (POSIX ustar/PAX) whose entries are
//! regular files and directories with relative, normalized paths; unpacking refuses
//! anything else (absolute paths, `..`, links, device files) and stops past
//! [`MAX_UNPACKED_BYTES`] or [`MAX_ARCHIVE_ENTRIES`] (a decompression bomb). The Raft log
//! holds only a blob's digest and size (`BlobRef`), never its bytes.

/// Length of a digest: BLAKE3's 32 bytes in lowercase hex.
pub const DIGEST_HEX_LEN: usize = 64;

/// Default cap on a packed working directory (`--upload`), in bytes: 512 MiB. Past it the
/// client refuses the upload and names the largest files.
pub const DEFAULT_MAX_WORKDIR_BYTES: u64 = 512 * 1024 * 1024;

/// Hard cap on any one blob a coordinator accepts, in bytes: 2 GiB.
pub const MAX_BLOB_BYTES: u64 = 2 * 1024 * 1024 * 1024;

/// Most bytes one blob chunk carries on the wire (gRPC `BlobChunk.data`): 1 MiB, under
/// tonic's 4 MiB default message limit.
pub const CHUNK_BYTES: usize = 1024 * 1024;

/// Most bytes an archive may unpack to: 8 GiB, and at most [`MAX_EXPANSION_RATIO`] times
/// its packed size (whichever is smaller). Past either, unpacking stops with an error.
pub const MAX_UNPACKED_BYTES: u64 = 8 * 1024 * 1024 * 1024;

/// Largest ratio of unpacked to packed bytes an archive may have (zip-bomb guard);
/// source trees compress 3–10×, so 200× leaves room for sparse or repetitive data.
pub const MAX_EXPANSION_RATIO: u64 = 200;

/// Most entries (files and directories) one archive may hold.
pub const MAX_ARCHIVE_ENTRIES: usize = 100_000;

/// Longest path of one archive entry, in bytes.
pub const MAX_ENTRY_PATH_BYTES: usize = 4_096;

/// Default cap on what one rank attempt leaves in `CUMULUS_OUTPUT_DIR`, packed, in bytes:
/// 256 MiB. Past it the agent uploads nothing and says so in the attempt's log.
pub const DEFAULT_MAX_ARTIFACT_BYTES: u64 = 256 * 1024 * 1024;

/// Default cap on a remote function's pickled result (`Client.run`), in bytes: 64 MiB.
pub const DEFAULT_MAX_RESULT_BYTES: u64 = 64 * 1024 * 1024;

/// Longest `requirements` text of an environment, in bytes.
pub const MAX_REQUIREMENTS_BYTES: usize = 64 * 1024;

/// Most `find_links` entries of an environment.
pub const MAX_FIND_LINKS: usize = 16;

/// The file name a remote function's rank writes its result to, under
/// `CUMULUS_OUTPUT_DIR` (a pickle), and the one it writes a raised exception to (JSON:
/// `type`, `message`, `traceback`).
pub const RESULT_FILE: &str = "_cumulus/result.pkl";
/// See [`RESULT_FILE`].
pub const ERROR_FILE: &str = "_cumulus/error.json";

/// Whether `digest` is a blob name: exactly [`DIGEST_HEX_LEN`] lowercase hex digits.
pub fn is_valid_digest(digest: &str) -> bool {
    digest.len() == DIGEST_HEX_LEN
        && digest
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Whether `python` names a Python version an environment may ask for: `3.X` or
/// `3.X.Y` with numbers of at most three digits ("" = the worker's own).
pub fn is_valid_python_version(python: &str) -> bool {
    if python.is_empty() {
        return true;
    }
    let parts: Vec<&str> = python.split('.').collect();
    (2..=3).contains(&parts.len())
        && parts[0] == "3"
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.len() <= 3 && p.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_64_lowercase_hex_digits() {
        assert!(is_valid_digest(&"a0".repeat(32)));
        assert!(!is_valid_digest(&"A0".repeat(32)));
        assert!(!is_valid_digest(&"a0".repeat(31)));
        assert!(!is_valid_digest(&format!("{}g", "a".repeat(63))));
        assert!(!is_valid_digest(""));
    }

    #[test]
    fn python_versions_are_3_x_or_3_x_y() {
        for ok in ["", "3.11", "3.9.18", "3.100"] {
            assert!(is_valid_python_version(ok), "{ok}");
        }
        for bad in [
            "3",
            "2.7",
            "3.",
            "3.11.",
            "3.x",
            "python3.11",
            "3.11.1.1",
            "3.1000",
        ] {
            assert!(!is_valid_python_version(bad), "{bad}");
        }
    }
}
