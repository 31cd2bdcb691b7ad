//! Unpacking, listing and extracting with the checks of [`crate::read`].
//!
//! [`unpack`] writes only into a directory it creates itself, creates every file with
//! `O_CREAT | O_EXCL | O_NOFOLLOW` (never through a link, never over an entry written
//! before: a duplicate is refused) and every directory only after checking that what is
//! there is a directory it made. Modes: 0o755 for directories and executable files,
//! 0o644 for other files (before the umask); times and owners are not restored.

use std::collections::HashSet;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use cumulus_api::blobs::{MAX_ARCHIVE_ENTRIES, MAX_UNPACKED_BYTES};
use cumulus_api::text::escape_control;

use crate::read::{
    EntryKind, Flow, ListedEntry, ReadLimits, UnpackError, copy_entry, for_each_entry, normalize,
};

/// The caller's bounds of [`unpack`], [`list`] and [`extract_file`]; the contract's
/// bounds ([`MAX_UNPACKED_BYTES`], [`cumulus_api::blobs::MAX_EXPANSION_RATIO`] times the
/// archive's size) apply as well.
#[derive(Debug, Clone, Copy)]
pub struct UnpackLimits {
    /// Most file bytes the archive may unpack to.
    pub max_bytes: u64,
    /// Most entries (files and directories).
    pub max_entries: usize,
}

impl Default for UnpackLimits {
    /// [`MAX_UNPACKED_BYTES`] and [`MAX_ARCHIVE_ENTRIES`].
    fn default() -> Self {
        Self {
            max_bytes: MAX_UNPACKED_BYTES,
            max_entries: MAX_ARCHIVE_ENTRIES,
        }
    }
}

/// What [`unpack`] wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unpacked {
    /// Files written.
    pub files: u64,
    /// Directories created (`dest` not counted).
    pub dirs: u64,
    /// Bytes of the files written.
    pub bytes: u64,
}

/// The limits for the archive at `archive`.
fn read_limits(archive: &Path, limits: &UnpackLimits) -> Result<ReadLimits, UnpackError> {
    let packed = fs::metadata(archive)
        .map_err(|source| UnpackError::Io {
            path: archive.display().to_string(),
            source,
        })?
        .len();
    Ok(ReadLimits::for_archive(
        limits.max_bytes,
        limits.max_entries,
        packed,
    ))
}

/// Unpacks the archive at `archive` into `dest`, a directory this creates (its parent
/// must exist; `dest` must not). On an error, what was written is removed.
///
/// # Errors
/// [`UnpackError::DestExists`], an entry refused (absolute path, `..`, a link, a device
/// file or FIFO, an over-long path, a duplicate), too many entries, too many bytes, a
/// corrupt archive, or a local I/O error.
pub fn unpack(archive: &Path, dest: &Path, limits: &UnpackLimits) -> Result<Unpacked, UnpackError> {
    let read = read_limits(archive, limits)?;
    fs::DirBuilder::new()
        .mode(0o755)
        .create(dest)
        .map_err(|source| {
            if source.kind() == io::ErrorKind::AlreadyExists {
                UnpackError::DestExists(dest.display().to_string())
            } else {
                UnpackError::Io {
                    path: dest.display().to_string(),
                    source,
                }
            }
        })?;
    let mut writer = Writer {
        dest,
        made: HashSet::new(),
        done: Unpacked::default(),
    };
    let result = for_each_entry(archive, read, |entry, bytes| {
        writer.write(entry, bytes)?;
        Ok(Flow::Continue)
    });
    match result {
        Ok(()) => Ok(writer.done),
        Err(e) => {
            if let Err(rm) = fs::remove_dir_all(dest) {
                return Err(UnpackError::Io {
                    path: dest.display().to_string(),
                    source: io::Error::other(format!(
                        "{e}; and removing what was unpacked failed: {rm}"
                    )),
                });
            }
            Err(e)
        }
    }
}

/// Writes entries under `dest`, remembering the directories it made.
struct Writer<'a> {
    dest: &'a Path,
    /// Directories made so far (relative paths): only these may be written into.
    made: HashSet<String>,
    done: Unpacked,
}

impl Writer<'_> {
    fn write(&mut self, entry: &ListedEntry, bytes: &mut dyn io::Read) -> Result<(), UnpackError> {
        let refuse = |reason: &str| UnpackError::Refused {
            entry: escape_control(&entry.path).into_owned(),
            reason: reason.to_string(),
        };
        // Every ancestor: made here, or made now.
        let parts: Vec<&str> = entry.path.split('/').collect();
        let dirs = match entry.kind {
            EntryKind::Dir => parts.len(),
            EntryKind::File => parts.len() - 1,
        };
        for i in 1..=dirs {
            let rel = parts[..i].join("/");
            if self.made.contains(&rel) {
                continue;
            }
            let path = self.dest.join(&rel);
            match fs::DirBuilder::new().mode(0o755).create(&path) {
                Ok(()) => {
                    self.made.insert(rel);
                    self.done.dirs += 1;
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    // Only a file written before can be there: this is a fresh directory.
                    return Err(refuse(&format!("{rel} is a file of the archive already")));
                }
                Err(source) => {
                    return Err(UnpackError::Io {
                        path: path.display().to_string(),
                        source,
                    });
                }
            }
        }
        if entry.kind == EntryKind::Dir {
            return Ok(());
        }
        let path = self.dest.join(&entry.path);
        let mode = if entry.executable { 0o755 } else { 0o644 };
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
            .open(&path)
            .map_err(|source| {
                if source.kind() == io::ErrorKind::AlreadyExists {
                    refuse("a second entry with the same path")
                } else {
                    UnpackError::Io {
                        path: path.display().to_string(),
                        source,
                    }
                }
            })?;
        let shown = path.display().to_string();
        copy_entry(bytes, entry.size, &mut file, &shown)?;
        file.flush().map_err(|source| UnpackError::Io {
            path: shown,
            source,
        })?;
        self.done.files += 1;
        self.done.bytes += entry.size;
        Ok(())
    }
}

/// The entries of the archive at `archive`, in archive order, checked as [`unpack`]
/// checks them (`cumulusctl artifacts ls`).
///
/// # Errors
/// As [`unpack`], without the local writes.
pub fn list(archive: &Path, limits: &UnpackLimits) -> Result<Vec<ListedEntry>, UnpackError> {
    let read = read_limits(archive, limits)?;
    let mut out = Vec::new();
    for_each_entry(archive, read, |entry, _| {
        out.push(entry.clone());
        Ok(Flow::Continue)
    })?;
    Ok(out)
}

/// Copies the bytes of the file `path` (relative; normalized as entries are) of the
/// archive at `archive` to `out`; the bytes copied (`cumulusctl artifacts get`). Every
/// entry up to it is checked as [`unpack`] checks it.
///
/// # Errors
/// [`UnpackError::NotFound`] when no file entry has that path (a directory is not a
/// file); otherwise as [`list`], or writing to `out` failed.
pub fn extract_file(
    archive: &Path,
    path: &str,
    out: &mut dyn Write,
    limits: &UnpackLimits,
) -> Result<u64, UnpackError> {
    let wanted = normalize(path.as_bytes()).map_err(|reason| UnpackError::Refused {
        entry: escape_control(path).into_owned(),
        reason,
    })?;
    let read = read_limits(archive, limits)?;
    let mut copied = None;
    for_each_entry(archive, read, |entry, bytes| {
        if entry.kind != EntryKind::File || entry.path != wanted {
            return Ok(Flow::Continue);
        }
        copy_entry(bytes, entry.size, out, "the output")?;
        copied = Some(entry.size);
        Ok(Flow::Stop)
    })?;
    copied.ok_or_else(|| UnpackError::NotFound(escape_control(path).into_owned()))
}
