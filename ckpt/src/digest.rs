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

/// Least bytes per piece [`hash_file_blake3_parallel`] hands a thread: smaller pieces
/// cost more in thread hand-offs than they gain.
pub const PARALLEL_HASH_PIECE_BYTES: u64 = 16 << 20;

/// The BLAKE3 digest (`blake3:…`) of the first `len` bytes of `file`, hashed by up to
/// `threads` threads at once: the file is cut along BLAKE3's own tree into subtrees of
/// at least [`PARALLEL_HASH_PIECE_BYTES`] (the left ones whole powers of two, as
/// `blake3::hazmat::left_subtree_len` splits), each hashed from its offset with
/// positioned reads (`pread`: no shared cursor), and their chaining values merged up
/// the same tree. The same digest as [`hash_reader`] over those bytes, in about
/// 1/`threads` of the time on idle cores.
///
/// # Errors
/// [`CkptError::Io`] (`op` "read") when a read fails or the file ends before `len`.
pub fn hash_file_blake3_parallel(
    file: &std::fs::File,
    len: u64,
    path: &Path,
    threads: usize,
) -> Result<String, CkptError> {
    use blake3::hazmat::{HasherExt, Mode, merge_subtrees_non_root, merge_subtrees_root};

    /// A subtree: its byte range, and its children (`None` for a piece hashed whole).
    struct Node {
        start: u64,
        end: u64,
        children: Option<Box<(Node, Node)>>,
    }
    fn split(start: u64, end: u64, piece: u64, pieces: &mut Vec<(u64, u64)>) -> Node {
        let len = end - start;
        if len <= piece || len <= blake3::CHUNK_LEN as u64 {
            pieces.push((start, end));
            return Node {
                start,
                end,
                children: None,
            };
        }
        let mid = start + blake3::hazmat::left_subtree_len(len);
        let left = split(start, mid, piece, pieces);
        let right = split(mid, end, piece, pieces);
        Node {
            start,
            end,
            children: Some(Box::new((left, right))),
        }
    }
    let threads = threads.max(1);
    if threads == 1 || len < 2 * PARALLEL_HASH_PIECE_BYTES {
        // One thread, from offset 0 whatever the file's cursor.
        let mut hasher = blake3::Hasher::new();
        let mut buffer = vec![0u8; HASH_BUFFER_BYTES];
        let mut at = 0;
        while at < len {
            use std::os::unix::fs::FileExt;
            let want = usize::try_from((len - at).min(HASH_BUFFER_BYTES as u64))
                .expect("at most the buffer's size");
            match file.read_at(&mut buffer[..want], at) {
                Ok(0) => return Err(short_read(path, at, len)),
                Ok(read) => {
                    hasher.update(&buffer[..read]);
                    at += read as u64;
                }
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(CkptError::Io {
                        op: "read",
                        path: path.to_owned(),
                        source,
                    });
                }
            }
        }
        return Ok(format!("blake3:{}", hasher.finalize().to_hex()));
    }
    // Pieces of about len / (4 × threads), so that uneven ones still share out.
    let piece = (len / (4 * threads as u64)).max(PARALLEL_HASH_PIECE_BYTES);
    let mut pieces = Vec::new();
    let tree = split(0, len, piece, &mut pieces);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let hash_piece =
        |(start, end): (u64, u64)| -> Result<blake3::hazmat::ChainingValue, CkptError> {
            use std::os::unix::fs::FileExt;
            let mut hasher = blake3::Hasher::new();
            hasher.set_input_offset(start);
            let mut buffer = vec![0u8; HASH_BUFFER_BYTES];
            let mut at = start;
            while at < end {
                let want = usize::try_from((end - at).min(HASH_BUFFER_BYTES as u64))
                    .expect("at most the buffer's size");
                let read = match file.read_at(&mut buffer[..want], at) {
                    Ok(0) => return Err(short_read(path, at, len)),
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
                at += read as u64;
            }
            Ok(hasher.finalize_non_root())
        };
    let results: Vec<Result<Vec<(usize, blake3::hazmat::ChainingValue)>, CkptError>> =
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads.min(pieces.len()))
                .map(|_| {
                    scope.spawn(|| {
                        let mut done = Vec::new();
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let Some(range) = pieces.get(i) else {
                                return Ok(done);
                            };
                            done.push((i, hash_piece(*range)?));
                        }
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| {
                    w.join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
                })
                .collect()
        });
    let mut cvs = vec![None; pieces.len()];
    for result in results {
        for (i, cv) in result? {
            cvs[i] = Some(cv);
        }
    }
    // Merge up the tree, the leaves in the order `split` listed them.
    fn merge(
        node: &Node,
        cvs: &[Option<blake3::hazmat::ChainingValue>],
        leaf: &mut usize,
    ) -> blake3::hazmat::ChainingValue {
        match &node.children {
            None => {
                let cv = cvs[*leaf].expect("every piece hashed");
                *leaf += 1;
                cv
            }
            Some(children) => {
                let left = merge(&children.0, cvs, leaf);
                let right = merge(&children.1, cvs, leaf);
                merge_subtrees_non_root(&left, &right, Mode::Hash)
            }
        }
    }
    let Some(children) = &tree.children else {
        unreachable!("a file of two pieces or more is split at its root")
    };
    let mut leaf = 0;
    let left = merge(&children.0, &cvs, &mut leaf);
    let right = merge(&children.1, &cvs, &mut leaf);
    debug_assert_eq!((tree.start, tree.end), (0, len));
    let root = merge_subtrees_root(&left, &right, Mode::Hash);
    Ok(format!("blake3:{}", root.to_hex()))
}

/// The error of a file that ended at `at` bytes while `len` were expected (it changed
/// during the commit).
fn short_read(path: &Path, at: u64, len: u64) -> CkptError {
    CkptError::Io {
        op: "read",
        path: path.to_owned(),
        source: std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("the file ended at {at} of its {len} bytes"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parallel_blake3_hash_is_blake3_over_every_split() {
        // Sizes around the piece size and the tree's power-of-two boundaries, with and
        // without a short last chunk, hashed by 1, 2 and 3 threads.
        let piece = PARALLEL_HASH_PIECE_BYTES as usize;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        let mut data = vec![0u8; 4 * piece + 3 * blake3::CHUNK_LEN + 17];
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for b in &mut data {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        std::fs::write(&path, &data).expect("write");
        let file = std::fs::File::open(&path).expect("open");
        for len in [
            0,
            1,
            blake3::CHUNK_LEN,
            2 * piece - 1,
            2 * piece,
            2 * piece + 1,
            3 * piece + blake3::CHUNK_LEN,
            4 * piece,
            data.len(),
        ] {
            let want = format!("blake3:{}", blake3::hash(&data[..len]).to_hex());
            for threads in [1, 2, 3] {
                let got =
                    hash_file_blake3_parallel(&file, len as u64, &path, threads).expect("hashed");
                assert_eq!(got, want, "len {len}, {threads} threads");
            }
        }
        // A file shorter than said is an error, not a digest of fewer bytes.
        let e = hash_file_blake3_parallel(&file, data.len() as u64 + 1, &path, 2)
            .expect_err("the file is shorter");
        assert!(e.to_string().contains("ended at"), "{e}");
    }

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
