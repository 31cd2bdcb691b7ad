//! One file of a checkpoint part, as every process records it: in `MANIFEST.json`
//! (`cumulus_ckpt`), in the Raft log and snapshots (`cumulus_raft_store`), and on the wire
//! (`CheckpointFile` in the proto). One type, one compatibility rule.
//!
//! Manifest format 1 (and log entries written then) recorded a bare hex SHA-256 as
//! `{"path", "size_bytes", "sha256": "<hex>"}`; format 2 records `"digest":
//! "<algorithm>:<hex>"`. Both read as a [`FileEntry`] with a `digest`; only format 2 is
//! written. The digest's syntax and algorithms are checked by `cumulus_ckpt::parse_digest`.

use serde::{Deserialize, Serialize};

/// One file of a committed checkpoint part.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(try_from = "FileEntryWire")]
pub struct FileEntry {
    /// Path relative to the part directory, `/`-separated, no empty, `.` or `..` component,
    /// not absolute (checked by `cumulus_ckpt::validate_rel_path`).
    pub path: String,
    /// File size in bytes.
    pub size_bytes: u64,
    /// Digest of the content, `<algorithm>:<64 lowercase hex digits>`.
    pub digest: String,
}

/// [`FileEntry`] as read: exactly one of `digest` (format 2) or `sha256` (format 1).
#[derive(Deserialize)]
struct FileEntryWire {
    path: String,
    size_bytes: u64,
    #[serde(default)]
    digest: Option<String>,
    #[serde(default)]
    sha256: Option<String>,
}

impl TryFrom<FileEntryWire> for FileEntry {
    type Error = String;

    fn try_from(wire: FileEntryWire) -> Result<Self, Self::Error> {
        let digest = match (wire.digest, wire.sha256) {
            (Some(digest), None) => digest,
            (None, Some(hex)) => format!("sha256:{hex}"),
            (Some(_), Some(_)) => {
                return Err(format!("file {:?} has both digest and sha256", wire.path));
            }
            (None, None) => return Err(format!("file {:?} has no digest", wire.path)),
        };
        Ok(Self {
            path: wire.path,
            size_bytes: wire.size_bytes,
            digest,
        })
    }
}

/// A digest as an agent reported it, in the `<algorithm>:<hex>` form: agents from before
/// manifest format 2 sent a bare SHA-256 in hex in the same proto field, which becomes
/// `sha256:<lowercase hex>`; anything else is returned as is, for the caller to validate.
pub fn reported_digest(digest: String) -> String {
    if digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()) {
        format!("sha256:{}", digest.to_ascii_lowercase())
    } else {
        digest
    }
}

#[cfg(feature = "grpc")]
impl From<crate::v1::CheckpointFile> for FileEntry {
    /// A file as an agent reported it (the digest through [`reported_digest`]).
    fn from(f: crate::v1::CheckpointFile) -> Self {
        Self {
            path: f.path,
            size_bytes: f.size_bytes,
            digest: reported_digest(f.digest),
        }
    }
}

#[cfg(feature = "grpc")]
impl From<FileEntry> for crate::v1::CheckpointFile {
    fn from(f: FileEntry) -> Self {
        Self {
            path: f.path,
            size_bytes: f.size_bytes,
            digest: f.digest,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_format_1_entry_reads_its_sha256_as_a_digest() {
        let hex = "ab".repeat(32);
        let old: FileEntry = serde_json::from_str(&format!(
            r#"{{"path":"a","size_bytes":1,"sha256":"{hex}"}}"#
        ))
        .expect("format 1 entry");
        assert_eq!(old.digest, format!("sha256:{hex}"));
        let text = serde_json::to_string(&old).expect("serializes");
        assert!(text.contains(r#""digest":"sha256:"#), "{text}");
        assert!(!text.contains(r#""sha256":"#), "format 2 only: {text}");
    }

    #[test]
    fn an_entry_needs_exactly_one_digest() {
        let hex = "ab".repeat(32);
        let both =
            format!(r#"{{"path":"a","size_bytes":1,"sha256":"{hex}","digest":"sha256:{hex}"}}"#);
        let e = serde_json::from_str::<FileEntry>(&both).expect_err("two digests");
        assert!(e.to_string().contains("both digest and sha256"), "{e}");
        let none = r#"{"path":"a","size_bytes":1}"#;
        let e = serde_json::from_str::<FileEntry>(none).expect_err("no digest");
        assert!(e.to_string().contains("has no digest"), "{e}");
    }

    #[test]
    fn a_bare_sha256_from_an_older_agent_gets_its_algorithm() {
        let hex = "AB".repeat(32);
        assert_eq!(
            reported_digest(hex.clone()),
            format!("sha256:{}", hex.to_ascii_lowercase())
        );
        let blake = format!("blake3:{}", "cd".repeat(32));
        assert_eq!(reported_digest(blake.clone()), blake);
        assert_eq!(reported_digest("short".into()), "short");
    }
}
