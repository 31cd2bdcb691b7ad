//! The format of the small records Cumulus keeps in sled (tree `raft_meta`: the vote,
//! the committed log id, the purge point), and the generation file that tells when sled
//! has lost writes.
//!
//! # Record format 2
//! ```text
//! record = magic "cumulus-meta-2\n" | crc32: u32 LE | generation: u64 LE | value (JSON)
//! crc32  = CRC-32 (IEEE, crc32fast, as in the WAL) of the tree name, the key, the
//!          generation bytes and the value
//! ```
//! The CRC covers the tree and the key, so a value read under another key than it was
//! written under does not check either. Format 1 (earlier versions, still read) was the
//! bare JSON value; a JSON value starts with `{` or `n` (`null`), never with the magic's
//! `c`, so a record whose magic was damaged does not read as format 1 either. A format-1
//! record is rewritten in format 2 when the store opens.
//!
//! # Generations
//! sled checks its own log with CRCs, but on a message that does not check it takes the
//! log to end there (a torn write) and silently drops every later write: one flipped
//! byte in an old record can bring back an older vote, which would let this node vote
//! twice in one term. So every flushed record (the vote and the purge point) carries a
//! generation, one more than the last, and after sled's flush the generation is also
//! written to the file [`GENERATION_FILE`] beside sled (its own CRC, `fdatasync`ed).
//! sled may be one write ahead of the file (a crash between the two writes), never
//! behind: on open, a newest generation in sled below the file's means sled lost writes,
//! and the store refuses to start. The committed log id is not flushed (a lower bound,
//! which may be lost) and carries generation 0.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;

/// First bytes of a format-2 record.
pub(crate) const META_MAGIC: &[u8] = b"cumulus-meta-2\n";
/// Bytes of a format-2 header: the magic, the CRC-32 (u32) and the generation (u64).
const META_HEADER_BYTES: usize = META_MAGIC.len() + 4 + 8;

/// Name of the generation file, in the store's directory (beside sled's files).
pub const GENERATION_FILE: &str = "meta.generation";
/// First bytes of the generation file.
const GENERATION_MAGIC: &[u8] = b"cumulus-generation-1\n";
/// Size of the generation file, in bytes: magic, generation (u64 LE), CRC-32 (u32 LE) of
/// the magic and the generation.
const GENERATION_BYTES: usize = GENERATION_MAGIC.len() + 8 + 4;

/// A record read back: its value, and its generation (`None`: a format-1 record, which
/// has none).
#[derive(Debug)]
pub(crate) struct MetaRecord<T> {
    /// The decoded value.
    pub value: T,
    /// Generation written with it; `None` for a format-1 record.
    pub generation: Option<u64>,
}

/// Why a record in sled does not decode; the caller names the tree and the key.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// A format-2 record shorter than its header; `len` in bytes.
    #[error("a format-2 record of {len} bytes has no complete header")]
    ShortHeader {
        /// The record's length, in bytes.
        len: usize,
    },
    /// The CRC-32 over tree, key, generation and value does not match the header's.
    #[error(
        "checksum mismatch: stored CRC-32 {stored:08x}, computed {computed:08x} over the tree, \
         key, generation and value"
    )]
    Crc {
        /// The CRC-32 in the header.
        stored: u32,
        /// The CRC-32 of what was read.
        computed: u32,
    },
    /// A format-2 record whose checksum holds but whose value does not parse (written
    /// wrong, not damaged).
    #[error("the value does not parse: {0}")]
    Value(serde_json::Error),
    /// No format-2 magic, and not format-1 JSON either.
    #[error("not a format-2 record (no magic), nor format-1 JSON: {0}")]
    NotJson(serde_json::Error),
}

fn meta_crc(tree: &str, key: &[u8], generation: u64, value: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(tree.as_bytes());
    hasher.update(key);
    hasher.update(&generation.to_le_bytes());
    hasher.update(value);
    hasher.finalize()
}

/// Encodes `value` as a format-2 record of `key` in `tree` with `generation`.
///
/// # Errors
/// The value does not serialize to JSON.
pub(crate) fn encode_meta<T: Serialize + ?Sized>(
    tree: &str,
    key: &[u8],
    generation: u64,
    value: &T,
) -> Result<Vec<u8>, serde_json::Error> {
    let json = serde_json::to_vec(value)?;
    let mut out = Vec::with_capacity(META_HEADER_BYTES + json.len());
    out.extend_from_slice(META_MAGIC);
    out.extend_from_slice(&meta_crc(tree, key, generation, &json).to_le_bytes());
    out.extend_from_slice(&generation.to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

/// Decodes a record of `key` in `tree`: format 2 (checksum verified), or format 1.
///
/// # Errors
/// What does not check, as a [`RecordError`].
pub(crate) fn decode_meta<T: DeserializeOwned>(
    tree: &str,
    key: &[u8],
    bytes: &[u8],
) -> Result<MetaRecord<T>, RecordError> {
    let Some(rest) = bytes.strip_prefix(META_MAGIC) else {
        let value = serde_json::from_slice(bytes).map_err(RecordError::NotJson)?;
        return Ok(MetaRecord {
            value,
            generation: None,
        });
    };
    if bytes.len() < META_HEADER_BYTES {
        return Err(RecordError::ShortHeader { len: bytes.len() });
    }
    let stored = u32::from_le_bytes(rest[0..4].try_into().expect("4 bytes"));
    let generation = u64::from_le_bytes(rest[4..12].try_into().expect("8 bytes"));
    let json = &rest[12..];
    let computed = meta_crc(tree, key, generation, json);
    if computed != stored {
        return Err(RecordError::Crc { stored, computed });
    }
    let value = serde_json::from_slice(json).map_err(RecordError::Value)?;
    Ok(MetaRecord {
        value,
        generation: Some(generation),
    })
}

/// The generation file ([`GENERATION_FILE`]): the generation of the newest flushed
/// record in sled.
pub(crate) struct GenerationFile {
    /// Its path.
    path: std::path::PathBuf,
    /// The open file (`None` until the first write creates it) and the generation last
    /// written (or read on open): a write never moves it back.
    state: std::sync::Mutex<(Option<File>, u64)>,
}

impl GenerationFile {
    /// Reads the generation file in `dir`, creating nothing: `Ok(0)` when there is none
    /// (a data dir of an earlier version, or one whose first flushed record never had
    /// its generation written).
    ///
    /// # Errors
    /// `Err(Ok(_))`: an I/O error (the message names the file); `Err(Err(reason))`: a
    /// file that is not a valid generation (wrong size, magic or CRC-32).
    pub(crate) fn open(dir: &Path) -> Result<(GenerationFile, u64), Result<io::Error, String>> {
        let path = dir.join(GENERATION_FILE);
        let io = |e: io::Error| Ok(io::Error::new(e.kind(), format!("{}: {e}", path.display())));
        let file = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(file) => Some(file),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(io(e)),
        };
        let generation = match &file {
            None => 0,
            Some(file) => {
                let len = file.metadata().map_err(io)?.len();
                if len != GENERATION_BYTES as u64 {
                    return Err(Err(format!(
                        "{} is {len} bytes long, not {GENERATION_BYTES}",
                        path.display()
                    )));
                }
                let mut bytes = [0u8; GENERATION_BYTES];
                file.read_exact_at(&mut bytes, 0).map_err(io)?;
                decode_generation(&bytes)
                    .map_err(|why| Err(format!("{}: {why}", path.display())))?
            }
        };
        Ok((
            GenerationFile {
                path,
                state: std::sync::Mutex::new((file, generation)),
            },
            generation,
        ))
    }

    /// Writes `generation` in place and `fdatasync`s the file (creating it on the first
    /// write, then syncing its directory too); a generation at or below the one last
    /// written is not written.
    ///
    /// # Errors
    /// I/O errors, naming the file.
    pub(crate) fn write(&self, generation: u64) -> io::Result<()> {
        let io = |e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", self.path.display()));
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (file, last) = &mut *state;
        if generation <= *last {
            return Ok(());
        }
        if file.is_none() {
            let created = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&self.path)
                .map_err(io)?;
            created
                .write_all_at(&encode_generation(generation), 0)
                .map_err(io)?;
            created.sync_data().map_err(io)?;
            if let Some(dir) = self.path.parent() {
                File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
            }
            *file = Some(created);
        } else if let Some(file) = file {
            file.write_all_at(&encode_generation(generation), 0)
                .map_err(io)?;
            file.sync_data().map_err(io)?;
        }
        *last = generation;
        Ok(())
    }
}

fn encode_generation(generation: u64) -> [u8; GENERATION_BYTES] {
    let mut out = [0u8; GENERATION_BYTES];
    let m = GENERATION_MAGIC.len();
    out[..m].copy_from_slice(GENERATION_MAGIC);
    out[m..m + 8].copy_from_slice(&generation.to_le_bytes());
    let crc = crc32fast::hash(&out[..m + 8]);
    out[m + 8..].copy_from_slice(&crc.to_le_bytes());
    out
}

fn decode_generation(bytes: &[u8; GENERATION_BYTES]) -> Result<u64, String> {
    let m = GENERATION_MAGIC.len();
    if &bytes[..m] != GENERATION_MAGIC {
        return Err("no generation-file magic".into());
    }
    let stored = u32::from_le_bytes(bytes[m + 8..].try_into().expect("4 bytes"));
    let computed = crc32fast::hash(&bytes[..m + 8]);
    if stored != computed {
        return Err(format!(
            "checksum mismatch: stored CRC-32 {stored:08x}, computed {computed:08x}"
        ));
    }
    Ok(u64::from_le_bytes(
        bytes[m..m + 8].try_into().expect("8 bytes"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_format_1_still_reads() {
        let bytes = encode_meta("raft_meta", b"vote", 7, &Some(5u64)).expect("encode");
        let r: MetaRecord<Option<u64>> = decode_meta("raft_meta", b"vote", &bytes).expect("decode");
        assert_eq!((r.value, r.generation), (Some(5), Some(7)));
        let r: MetaRecord<Option<u64>> = decode_meta("raft_meta", b"vote", b"null").expect("v1");
        assert_eq!((r.value, r.generation), (None, None));
    }

    #[test]
    fn every_flipped_bit_and_a_moved_value_are_refused() {
        let bytes =
            encode_meta("raft_meta", b"vote", 7, &serde_json::json!({"a": 1})).expect("encode");
        for at in 0..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[at] ^= 1 << bit;
                assert!(
                    decode_meta::<serde_json::Value>("raft_meta", b"vote", &b).is_err(),
                    "bit {bit} of byte {at}"
                );
            }
        }
        assert!(matches!(
            decode_meta::<serde_json::Value>("raft_meta", b"committed", &bytes),
            Err(RecordError::Crc { .. })
        ));
        assert!(matches!(
            decode_meta::<serde_json::Value>("raft_meta", b"vote", &bytes[..20]),
            Err(RecordError::ShortHeader { len: 20 })
        ));
    }

    #[test]
    fn the_generation_file_round_trips_and_refuses_damage() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (file, generation) = GenerationFile::open(dir.path()).expect("open");
        assert_eq!(generation, 0, "a new file");
        file.write(41).expect("write");
        drop(file);
        let (_, generation) = GenerationFile::open(dir.path()).expect("reopen");
        assert_eq!(generation, 41);
        let path = dir.path().join(GENERATION_FILE);
        let mut bytes = std::fs::read(&path).expect("read");
        bytes[GENERATION_MAGIC.len()] ^= 0x01;
        std::fs::write(&path, &bytes).expect("write");
        let err = GenerationFile::open(dir.path())
            .err()
            .expect("damage")
            .expect_err("not I/O");
        assert!(err.contains("checksum mismatch"), "{err}");
    }
}
