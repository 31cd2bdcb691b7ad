//! Content digests of checkpoint files.
//!
//! A digest is written in the OCI content-descriptor form `<algorithm>:<encoded>` (OCI
//! image spec, "Digests"): the algorithm name, a colon, then the digest in lowercase hex.
//! Two algorithms are known, both with 32-byte (64 hex digit) digests:
//! - `blake3`, what this version writes ([`WRITE_ALGORITHM`]): BLAKE3 (O'Connor, Aumasson,
//!   Neves, Wilcox-O'Hearn, 2020) through the `blake3` crate, which picks SSE4.1 / AVX2 /
//!   AVX-512 at run time; on the 2-core benchmark machine it hashes 3–4 GB/s per core,
//!   about 3× SHA-256 with SHA-NI (docs/perf-notes.md, "BLAKE3, hashed once");
//! - `sha256`, what manifest format 1 recorded (as a bare hex field `sha256`), still read
//!   and verified so that steps written before format 2 stay resumable.

use std::fmt;
use std::io::Read;
use std::path::Path;

use sha2::Digest as _;

use crate::CkptError;

/// Read size used when hashing a file, in bytes (1 MiB: large enough for BLAKE3's
/// multi-chunk SIMD paths, small enough to stay in L2 cache).
pub const HASH_BUFFER_BYTES: usize = 1 << 20;

/// Number of hex digits of a digest of either algorithm (32 bytes).
const DIGEST_HEX_DIGITS: usize = 64;

/// A digest algorithm of checkpoint files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DigestAlgorithm {
    /// SHA-256 (FIPS 180-4); manifest format 1.
    Sha256,
    /// BLAKE3, 32-byte output; manifest format 2.
    Blake3,
}

/// The algorithm new parts are hashed with.
pub const WRITE_ALGORITHM: DigestAlgorithm = DigestAlgorithm::Blake3;

impl DigestAlgorithm {
    /// The name used before the colon of a digest: `sha256` or `blake3`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sha256 => "sha256",
            Self::Blake3 => "blake3",
        }
    }

    /// A fresh incremental hasher of this algorithm.
    pub fn hasher(self) -> Hasher {
        match self {
            Self::Sha256 => Hasher::Sha256(Box::default()),
            Self::Blake3 => Hasher::Blake3(Box::default()),
        }
    }
}

impl fmt::Display for DigestAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An incremental hasher of one [`DigestAlgorithm`].
pub enum Hasher {
    /// SHA-256 state.
    Sha256(Box<sha2::Sha256>),
    /// BLAKE3 state.
    Blake3(Box<blake3::Hasher>),
}

impl Hasher {
    /// Feeds `bytes`.
    pub fn update(&mut self, bytes: &[u8]) {
        match self {
            Self::Sha256(h) => h.update(bytes),
            Self::Blake3(h) => {
                h.update(bytes);
            }
        }
    }

    /// The digest of everything fed, as `<algorithm>:<64 lowercase hex digits>`.
    pub fn finalize(self) -> String {
        match self {
            Self::Sha256(h) => format!("sha256:{}", hex::encode(h.finalize())),
            Self::Blake3(h) => format!("blake3:{}", h.finalize().to_hex()),
        }
    }
}

/// Parses a digest `<algorithm>:<64 lowercase hex digits>` and returns its algorithm.
///
/// # Errors
/// [`CkptError::Invalid`] naming the problem: no colon, an unknown algorithm, or an
/// encoded part that is not 64 lowercase hex digits.
pub fn parse_digest(text: &str) -> Result<DigestAlgorithm, CkptError> {
    let (name, encoded) = text.split_once(':').ok_or_else(|| {
        CkptError::Invalid(format!(
            "digest {text:?} is not <algorithm>:<hex> (e.g. blake3:…)"
        ))
    })?;
    let algorithm = match name {
        "blake3" => DigestAlgorithm::Blake3,
        "sha256" => DigestAlgorithm::Sha256,
        other => {
            return Err(CkptError::Invalid(format!(
                "digest algorithm {other:?} is not blake3 or sha256"
            )));
        }
    };
    if encoded.len() != DIGEST_HEX_DIGITS
        || !encoded
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(CkptError::Invalid(format!(
            "digest {text:?}: {} digits, want {DIGEST_HEX_DIGITS} lowercase hex digits",
            encoded.len()
        )));
    }
    Ok(algorithm)
}

/// Size in bytes and digest (`algorithm`) of everything `reader` yields, read in
/// [`HASH_BUFFER_BYTES`] chunks; `path` names the source in errors.
///
/// # Errors
/// [`CkptError::Io`] (`op` "read") when a read fails.
pub fn hash_reader(
    reader: &mut impl Read,
    path: &Path,
    algorithm: DigestAlgorithm,
) -> Result<(u64, String), CkptError> {
    let mut hasher = algorithm.hasher();
    let mut buffer = vec![0u8; HASH_BUFFER_BYTES];
    let mut size_bytes = 0u64;
    loop {
        let read = match reader.read(&mut buffer) {
            Ok(0) => break,
            Ok(read) => read,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(source) => {
                return Err(CkptError::Io {
                    op: "read",
                    path: path.to_owned(),
                    source,
                });
            }
        };
        hasher.update(&buffer[..read]);
        size_bytes += u64::try_from(read).expect("a read length fits in u64");
    }
    Ok((size_bytes, hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answers() {
        // SHA-256("abc"), FIPS 180-4 appendix; BLAKE3("abc"), the reference implementation.
        let mut sha = DigestAlgorithm::Sha256.hasher();
        sha.update(b"abc");
        assert_eq!(
            sha.finalize(),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let mut b3 = DigestAlgorithm::Blake3.hasher();
        b3.update(b"abc");
        assert_eq!(
            b3.finalize(),
            "blake3:6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
        );
    }

    #[test]
    fn parse_accepts_both_algorithms_and_refuses_malformed_digests() {
        let hex = "0123456789abcdef".repeat(4);
        assert_eq!(
            parse_digest(&format!("blake3:{hex}")).expect("a valid blake3 digest"),
            DigestAlgorithm::Blake3
        );
        assert_eq!(
            parse_digest(&format!("sha256:{hex}")).expect("a valid sha256 digest"),
            DigestAlgorithm::Sha256
        );
        for bad in [
            hex.clone(),
            format!("md5:{hex}"),
            format!("blake3:{}", hex.to_uppercase()),
            format!("blake3:{}", &hex[1..]),
            format!("blake3:{hex}0"),
            format!("blake3:{}g", &hex[1..]),
            String::new(),
        ] {
            assert!(parse_digest(&bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn hash_reader_counts_bytes_across_buffers() {
        let data = vec![5u8; HASH_BUFFER_BYTES * 2 + 3];
        let (size, digest) = hash_reader(&mut &data[..], Path::new("mem"), DigestAlgorithm::Blake3)
            .expect("reading memory cannot fail");
        assert_eq!(size, data.len() as u64);
        assert_eq!(digest, format!("blake3:{}", blake3::hash(&data).to_hex()));
    }
}
