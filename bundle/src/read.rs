//! Reading an archive as hostile input: every entry is checked before anyone sees it.
//!
//! The tar reader runs in raw mode, so that extension headers (PAX records, GNU long
//! names) are read here, bounded, instead of into memory of any size. An entry is passed
//! on only when it is a regular file or a directory with a relative, normalized UTF-8
//! path of at most [`MAX_ENTRY_PATH_BYTES`], within the entry count and byte limits.

use std::cell::Cell;
use std::fs;
use std::io::{self, BufReader, Read};
use std::path::Path;
use std::rc::Rc;

use cumulus_api::blobs::{MAX_ENTRY_PATH_BYTES, MAX_EXPANSION_RATIO, MAX_UNPACKED_BYTES};
use cumulus_api::text::escape_control;

use crate::IO_BUFFER_BYTES;

/// Most bytes of one PAX extended header (local or global) read.
pub const MAX_PAX_HEADER_BYTES: u64 = 64 * 1024;

/// Bytes of tar structure allowed per entry beyond its file bytes when bounding the
/// decompressed stream: a header, a PAX header and a long name (each up to a block's
/// padding), with room to spare.
const STRUCTURE_BYTES_PER_ENTRY: u64 = 8 * 1024 + MAX_PAX_HEADER_BYTES;

/// What an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
}

/// One entry of an archive, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedEntry {
    /// Relative, normalized, `/`-separated, no trailing slash.
    pub path: String,
    /// File or directory.
    pub kind: EntryKind,
    /// Bytes of a file (0 for a directory).
    pub size: u64,
    /// Whether the archive marks it executable (any execute bit).
    pub executable: bool,
}

/// Why an archive was not read, listed or unpacked.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// A local file or directory could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The error.
        source: io::Error,
    },
    /// The bytes are not a gzip-compressed tar archive (or are truncated).
    #[error("not a valid tar.gz archive: {0}")]
    Corrupt(String),
    /// An entry of a kind or with a path that is refused.
    #[error("archive entry {entry}: {reason}")]
    Refused {
        /// The entry's path as the archive gives it (control characters escaped).
        entry: String,
        /// Why.
        reason: String,
    },
    /// More entries than the limit.
    #[error("the archive has more than {limit} entries")]
    TooManyEntries {
        /// The limit.
        limit: usize,
    },
    /// The archive unpacks to more bytes than the limit (a decompression bomb, or too
    /// big for this place).
    #[error(
        "the archive unpacks to more than {limit_bytes} bytes (at entry {entry}): refused as a decompression bomb or too large"
    )]
    TooLarge {
        /// The entry being read when the limit was passed ("" when between entries).
        entry: String,
        /// The limit in force.
        limit_bytes: u64,
    },
    /// The destination of [`crate::unpack`] exists already.
    #[error("{0} exists already: unpack only into a new directory")]
    DestExists(String),
    /// [`crate::extract_file`]: no file entry has that path.
    #[error("the archive has no file {0}")]
    NotFound(String),
}

/// Bounds of one read of an archive.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadLimits {
    /// Most file bytes in all.
    pub max_bytes: u64,
    /// Most entries (files, directories and global PAX headers).
    pub max_entries: usize,
}

impl ReadLimits {
    /// The limits for an archive of `packed_bytes`: the caller's, and never above
    /// [`MAX_UNPACKED_BYTES`] nor [`MAX_EXPANSION_RATIO`] times the packed size.
    pub fn for_archive(max_bytes: u64, max_entries: usize, packed_bytes: u64) -> Self {
        Self {
            max_bytes: max_bytes
                .min(MAX_UNPACKED_BYTES)
                .min(MAX_EXPANSION_RATIO.saturating_mul(packed_bytes)),
            max_entries,
        }
    }
}

/// What the visitor of [`for_each_entry`] wants next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flow {
    /// The next entry.
    Continue,
    /// Stop reading (success).
    Stop,
}

/// Counts the decompressed bytes and fails past a cap, setting a flag the caller reads
/// to tell this failure from others.
struct CappedReader<R> {
    inner: R,
    left: u64,
    exceeded: Rc<Cell<bool>>,
}

impl<R: Read> Read for CappedReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            // Something is left past the cap only if a read still yields bytes.
            let mut probe = [0u8; 1];
            if self.inner.read(&mut probe)? == 0 {
                return Ok(0);
            }
            self.exceeded.set(true);
            return Err(io::Error::other("decompressed past the limit"));
        }
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        self.left -= n as u64;
        Ok(n)
    }
}

/// Extension headers read for the entry that follows them.
#[derive(Default)]
struct Pending {
    /// A GNU long name (`L`).
    long_name: Option<Vec<u8>>,
    /// A PAX `path` record.
    pax_path: Option<Vec<u8>>,
    /// A PAX `size` record.
    pax_size: Option<u64>,
    /// Whether a PAX header was read.
    pax_seen: bool,
}

/// The paths seen so far, by a 128-bit BLAKE3 of the path (at most
/// [`cumulus_api::blobs::MAX_ARCHIVE_ENTRIES`]
/// of 17 bytes and a table slot, however long the paths): a file may not appear twice nor
/// under another entry; a directory may appear more than once.
#[derive(Default)]
struct Seen(std::collections::HashMap<[u8; 16], EntryKind>);

impl Seen {
    fn key(path: &str) -> [u8; 16] {
        let hash = blake3::hash(path.as_bytes());
        let mut key = [0u8; 16];
        key.copy_from_slice(&hash.as_bytes()[..16]);
        key
    }

    /// Records `path`, or says why it clashes with an entry seen before.
    fn check(&mut self, path: &str, kind: EntryKind) -> Result<(), String> {
        for (i, _) in path.match_indices('/') {
            if self.0.get(&Self::key(&path[..i])) == Some(&EntryKind::File) {
                return Err(format!("{} is a file of the archive already", &path[..i]));
            }
        }
        match (self.0.insert(Self::key(path), kind), kind) {
            (None, _) | (Some(EntryKind::Dir), EntryKind::Dir) => Ok(()),
            (Some(_), _) => Err("a second entry with the same path".into()),
        }
    }
}

/// Reads the archive at `archive`, checks every entry and calls `visit` with each file
/// and directory in archive order (a file with a reader of its bytes), until the end or
/// [`Flow::Stop`].
///
/// # Errors
/// See [`UnpackError`]; the visitor's own errors are passed on.
pub(crate) fn for_each_entry<F>(
    archive: &Path,
    limits: ReadLimits,
    mut visit: F,
) -> Result<(), UnpackError>
where
    F: FnMut(&ListedEntry, &mut dyn Read) -> Result<Flow, UnpackError>,
{
    let file = fs::File::open(archive).map_err(|source| UnpackError::Io {
        path: archive.display().to_string(),
        source,
    })?;
    let exceeded = Rc::new(Cell::new(false));
    let cap = limits.max_bytes.saturating_add(
        (limits.max_entries as u64)
            .saturating_add(4)
            .saturating_mul(STRUCTURE_BYTES_PER_ENTRY),
    );
    let capped = CappedReader {
        inner: flate2::read::GzDecoder::new(BufReader::with_capacity(IO_BUFFER_BYTES, file)),
        left: cap,
        exceeded: exceeded.clone(),
    };
    let mut tar = tar::Archive::new(capped);
    let mut current = String::new();
    let stream_err = |e: io::Error, current: &str| {
        if exceeded.get() {
            UnpackError::TooLarge {
                entry: escape_control(current).into_owned(),
                limit_bytes: limits.max_bytes,
            }
        } else {
            UnpackError::Corrupt(e.to_string())
        }
    };
    let entries = tar.entries().map_err(|e| stream_err(e, ""))?.raw(true);
    let mut pending = Pending::default();
    let mut seen = Seen::default();
    let mut count = 0usize;
    let mut total = 0u64;
    for entry in entries {
        let mut entry = entry.map_err(|e| stream_err(e, &current))?;
        let ty = entry.header().entry_type();
        if read_extension(&mut entry, ty, &mut pending)
            .map_err(|e| e.or_stream(|io| stream_err(io, &current)))?
        {
            if ty == tar::EntryType::XGlobalHeader {
                count += 1;
                if count > limits.max_entries {
                    return Err(UnpackError::TooManyEntries {
                        limit: limits.max_entries,
                    });
                }
            }
            continue;
        }
        let pending = std::mem::take(&mut pending);
        let raw_path = pending
            .long_name
            .or(pending.pax_path)
            .unwrap_or_else(|| entry.header().path_bytes().into_owned());
        current = String::from_utf8_lossy(&raw_path).into_owned();
        let refuse = |reason: String| UnpackError::Refused {
            entry: escape_control(&String::from_utf8_lossy(&raw_path)).into_owned(),
            reason,
        };
        let kind = entry_kind(ty, entry.header()).map_err(&refuse)?;
        let size = entry
            .header()
            .entry_size()
            .map_err(|e| refuse(e.to_string()))?;
        if let Some(pax_size) = pending.pax_size
            && pax_size != size
        {
            return Err(refuse(format!(
                "its PAX size {pax_size} disagrees with its header's {size}"
            )));
        }
        let path = normalize(&raw_path).map_err(&refuse)?;
        if path.is_empty() {
            if kind == EntryKind::Dir {
                continue; // "./": the root itself
            }
            return Err(refuse("a file with an empty path".into()));
        }
        count += 1;
        if count > limits.max_entries {
            return Err(UnpackError::TooManyEntries {
                limit: limits.max_entries,
            });
        }
        seen.check(&path, kind).map_err(&refuse)?;
        if kind == EntryKind::Dir && size != 0 {
            return Err(refuse(format!("a directory with {size} bytes of data")));
        }
        total = total.saturating_add(size);
        if total > limits.max_bytes {
            return Err(UnpackError::TooLarge {
                entry: escape_control(&path).into_owned(),
                limit_bytes: limits.max_bytes,
            });
        }
        let mode = entry.header().mode().map_err(|e| refuse(e.to_string()))?;
        let listed = ListedEntry {
            path,
            kind,
            size: if kind == EntryKind::File { size } else { 0 },
            executable: mode & 0o111 != 0,
        };
        let flow = visit(&listed, &mut entry).map_err(|e| {
            if exceeded.get() {
                stream_err(io::Error::other("past the limit"), &current)
            } else {
                e
            }
        })?;
        if flow == Flow::Stop {
            return Ok(());
        }
    }
    if pending.pax_seen || pending.long_name.is_some() {
        return Err(UnpackError::Corrupt(
            "extension headers at the end with no entry after them".into(),
        ));
    }
    Ok(())
}

/// Copies a file entry's `size` bytes from `entry` to `out` (at `out_path`, for errors):
/// a read error or a short entry is [`UnpackError::Corrupt`], a write error
/// [`UnpackError::Io`].
pub(crate) fn copy_entry(
    entry: &mut dyn Read,
    size: u64,
    out: &mut dyn io::Write,
    out_path: &str,
) -> Result<(), UnpackError> {
    let mut buf = vec![
        0u8;
        IO_BUFFER_BYTES
            .min(usize::try_from(size).unwrap_or(usize::MAX))
            .max(1)
    ];
    let mut copied = 0u64;
    loop {
        let n = match entry.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(UnpackError::Corrupt(e.to_string())),
        };
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n]).map_err(|source| UnpackError::Io {
            path: out_path.to_string(),
            source,
        })?;
        copied += n as u64;
    }
    if copied != size {
        return Err(UnpackError::Corrupt(format!(
            "truncated: an entry of {size} bytes ends after {copied}"
        )));
    }
    Ok(())
}

/// The kinds of entry passed on; the others are refused with what they are.
fn entry_kind(ty: tar::EntryType, header: &tar::Header) -> Result<EntryKind, String> {
    Ok(match ty {
        tar::EntryType::Regular => EntryKind::File,
        tar::EntryType::Directory => EntryKind::Dir,
        tar::EntryType::Symlink => {
            return Err(format!(
                "a symbolic link (to {}): links are refused",
                link_target(header)
            ));
        }
        tar::EntryType::Link => {
            return Err(format!(
                "a hard link (to {}): links are refused",
                link_target(header)
            ));
        }
        tar::EntryType::GNULongLink => {
            return Err("a long link name: links are refused".into());
        }
        tar::EntryType::Char => return Err("a character device: refused".into()),
        tar::EntryType::Block => return Err("a block device: refused".into()),
        tar::EntryType::Fifo => return Err("a FIFO: refused".into()),
        tar::EntryType::GNUSparse => return Err("a sparse file: refused".into()),
        tar::EntryType::Continuous => return Err("a contiguous file: refused".into()),
        other => {
            return Err(format!(
                "entry type {:?}: only regular files and directories are accepted",
                other.as_byte() as char
            ));
        }
    })
}

/// A link's target as the header gives it, escaped.
fn link_target(header: &tar::Header) -> String {
    header
        .link_name_bytes()
        .map(|b| escape_control(&String::from_utf8_lossy(&b)).into_owned())
        .unwrap_or_else(|| "?".into())
}

/// An error of [`read_extension`]: a refusal, or the stream failing.
enum ExtError {
    Refused(UnpackError),
    Stream(io::Error),
}

impl ExtError {
    fn or_stream(self, f: impl FnOnce(io::Error) -> UnpackError) -> UnpackError {
        match self {
            ExtError::Refused(e) => e,
            ExtError::Stream(e) => f(e),
        }
    }
}

/// Reads an extension header (PAX local or global, GNU long name) into `pending`, bounded;
/// `false` when `entry` is not one.
fn read_extension<R: Read>(
    entry: &mut tar::Entry<'_, R>,
    ty: tar::EntryType,
    pending: &mut Pending,
) -> Result<bool, ExtError> {
    let refuse = |reason: &str| {
        ExtError::Refused(UnpackError::Refused {
            entry: "(extension header)".into(),
            reason: reason.to_string(),
        })
    };
    let bound = match ty {
        tar::EntryType::XHeader | tar::EntryType::XGlobalHeader => MAX_PAX_HEADER_BYTES,
        tar::EntryType::GNULongName => MAX_ENTRY_PATH_BYTES as u64 + 1,
        _ => return Ok(false),
    };
    let size = entry
        .header()
        .entry_size()
        .map_err(|e| refuse(&e.to_string()))?;
    if size > bound {
        return Err(refuse(&format!(
            "{size} bytes, over the limit of {bound} for this kind of header"
        )));
    }
    let mut data = Vec::with_capacity(size as usize);
    entry
        .take(bound)
        .read_to_end(&mut data)
        .map_err(ExtError::Stream)?;
    match ty {
        tar::EntryType::GNULongName => {
            if pending.long_name.is_some() {
                return Err(refuse("two long names for one entry"));
            }
            while data.last() == Some(&0) {
                data.pop();
            }
            pending.long_name = Some(data);
        }
        tar::EntryType::XHeader => {
            if pending.pax_seen {
                return Err(refuse("two PAX headers for one entry"));
            }
            pending.pax_seen = true;
            for ext in tar::PaxExtensions::new(&data) {
                let ext = ext.map_err(|e| refuse(&format!("a bad PAX record: {e}")))?;
                match ext.key_bytes() {
                    b"path" => pending.pax_path = Some(ext.value_bytes().to_vec()),
                    b"size" => {
                        let size = ext
                            .value()
                            .ok()
                            .and_then(|v| v.parse::<u64>().ok())
                            .ok_or_else(|| refuse("a PAX size that is not a number"))?;
                        pending.pax_size = Some(size);
                    }
                    // Times, owners, names, comments, charsets, vendor records: nothing
                    // here uses them. A linkpath belongs to a link, which is refused.
                    _ => {}
                }
            }
        }
        // A global header's records (a comment, git's commit id) are not used.
        _ => {}
    }
    Ok(true)
}

/// A path of an archive entry as a relative, normalized path: UTF-8, at most
/// [`MAX_ENTRY_PATH_BYTES`], no leading `/`, no `..`; `.` and empty components dropped
/// (`""`: the root).
///
/// # Errors
/// Why the path is refused.
pub(crate) fn normalize(raw: &[u8]) -> Result<String, String> {
    if raw.len() > MAX_ENTRY_PATH_BYTES {
        return Err(format!(
            "a path of {} bytes, over the limit of {MAX_ENTRY_PATH_BYTES}",
            raw.len()
        ));
    }
    let text = std::str::from_utf8(raw).map_err(|_| "a path that is not UTF-8".to_string())?;
    if text.contains('\0') {
        return Err("a path with a NUL byte".into());
    }
    if text.starts_with('/') {
        return Err("an absolute path".into());
    }
    let mut parts = Vec::new();
    for part in text.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err("a path with a `..` component".into()),
            p => parts.push(p),
        }
    }
    Ok(parts.join("/"))
}
