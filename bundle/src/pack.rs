//! Packing a directory: walk it (ignore files honoured or not), check every entry, sort,
//! then write a deterministic tar.gz while hashing it.
//!
//! Determinism: entries sorted by path (bytes), every header ustar with mtime 0, uid and
//! gid 0, no user or group names, mode 0o755 for directories and executables and 0o644
//! for other files; the gzip header has mtime 0, no file name and "unknown" as its
//! operating system. Paths too long for a ustar header get a PAX `path` record.

use std::fs;
use std::io::{self, BufWriter, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use cumulus_api::blobs::{DEFAULT_MAX_WORKDIR_BYTES, MAX_ARCHIVE_ENTRIES, MAX_ENTRY_PATH_BYTES};
use cumulus_api::text::escape_control;

use crate::IO_BUFFER_BYTES;

/// Cumulus's own ignore file, read as `.gitignore` is (in any directory of the tree).
pub const CUMULUSIGNORE: &str = ".cumulusignore";

/// How many of the largest files a size-limit error names.
pub const LARGEST_NAMED: usize = 10;

/// Options of [`pack`].
#[derive(Debug, Clone)]
pub struct PackOptions {
    /// Leave out what `.gitignore` files (also outside a git repository, and the
    /// repository's `.git/info/exclude`) and `.cumulusignore` files inside the directory
    /// exclude, and every `.git` entry (a job's `--upload`). `false`: pack every file
    /// (a rank's artifacts).
    pub respect_ignore_files: bool,
    /// Most bytes the packed files may hold in all (their sizes before compression);
    /// past it [`PackError::TooLarge`] names the largest files.
    pub max_bytes: u64,
    /// Directory of the temporary archive (`None`: the system's): put it beside the
    /// archive's final place to [`Packed::persist`] it there by a rename.
    pub temp_dir: Option<PathBuf>,
}

impl Default for PackOptions {
    /// Ignore files honoured, [`DEFAULT_MAX_WORKDIR_BYTES`], the system's temp directory.
    fn default() -> Self {
        Self {
            respect_ignore_files: true,
            max_bytes: DEFAULT_MAX_WORKDIR_BYTES,
            temp_dir: None,
        }
    }
}

/// A packed directory: the archive in a temporary file (removed when this is dropped,
/// unless persisted) and what it holds.
#[derive(Debug)]
pub struct Packed {
    file: tempfile::NamedTempFile,
    /// BLAKE3 of the archive's bytes, 64 lowercase hex digits: the blob's name.
    pub digest: String,
    /// Size of the archive, in bytes.
    pub size_bytes: u64,
    /// Regular files packed.
    pub files: u64,
    /// Directories packed (the root not counted).
    pub dirs: u64,
    /// Bytes of the packed files before compression.
    pub unpacked_bytes: u64,
}

impl Packed {
    /// Where the archive is now.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// Moves the archive to `dest` (a rename: `dest` on the file system of
    /// [`PackOptions::temp_dir`]), synced first.
    ///
    /// # Errors
    /// The sync or the rename failed.
    pub fn persist(self, dest: &Path) -> io::Result<()> {
        self.file.as_file().sync_all()?;
        self.file.persist(dest).map(drop).map_err(|e| e.error)
    }
}

/// Why a directory was not packed.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    /// The path to pack is not a directory.
    #[error("{0} is not a directory")]
    NotADirectory(PathBuf),
    /// Reading the directory tree failed.
    #[error("reading {path}: {message}")]
    Walk {
        /// Where.
        path: String,
        /// The walker's error (permission denied, a symbolic link loop, …).
        message: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: io::Error,
    },
    /// A symbolic link leads out of the directory (or nowhere).
    #[error(
        "symbolic link {link} points outside the directory ({target}): only links to files inside it are packed; remove it or list it in {CUMULUSIGNORE}"
    )]
    LinkOutside {
        /// The link, relative to the directory.
        link: String,
        /// Where it points.
        target: String,
    },
    /// A socket, FIFO or device file.
    #[error(
        "{path} is a {kind}: only regular files and directories are packed; remove it or list it in {CUMULUSIGNORE}"
    )]
    Special {
        /// The entry, relative to the directory.
        path: String,
        /// What it is.
        kind: &'static str,
    },
    /// A path that is not UTF-8.
    #[error("{0} is not a UTF-8 file name: rename it or list it in {CUMULUSIGNORE}")]
    NonUtf8Path(String),
    /// A path longer than [`MAX_ENTRY_PATH_BYTES`].
    #[error("{path} is {bytes} bytes long, over the limit of {MAX_ENTRY_PATH_BYTES}")]
    PathTooLong {
        /// The path (relative).
        path: String,
        /// Its length.
        bytes: usize,
    },
    /// More entries than [`MAX_ARCHIVE_ENTRIES`].
    #[error(
        "more than {MAX_ARCHIVE_ENTRIES} files and directories: list what the job does not need in {CUMULUSIGNORE}"
    )]
    TooManyEntries,
    /// The files hold more than the limit.
    #[error("{}", too_large_text(*total_bytes, *limit_bytes, largest))]
    TooLarge {
        /// Bytes of every file that would be packed.
        total_bytes: u64,
        /// The limit.
        limit_bytes: u64,
        /// The [`LARGEST_NAMED`] largest files (path, bytes), largest first.
        largest: Vec<(String, u64)>,
    },
}

/// The message of [`PackError::TooLarge`].
fn too_large_text(total: u64, limit: u64, largest: &[(String, u64)]) -> String {
    let mut text = format!(
        "the directory holds {} in files to pack, over the limit of {}; the largest:",
        human_bytes(total),
        human_bytes(limit)
    );
    for (path, size) in largest {
        text.push_str(&format!("\n  {:>10}  {path}", human_bytes(*size)));
    }
    text.push_str(&format!(
        "\nlist what the job does not need in {CUMULUSIGNORE} (gitignore syntax), or raise the limit"
    ));
    text
}

/// `n` bytes for a person: `812 B`, `3.4 KiB`, `1.2 GiB`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// One entry to pack.
#[derive(Debug)]
pub(crate) struct Item {
    /// Path in the archive (relative, `/`-separated, no trailing slash).
    pub(crate) rel: String,
    /// Where its bytes are read (for a link inside the tree: its target).
    source: PathBuf,
    /// Directory, or file with its size, device and inode (checked again when opened)
    /// and whether it is executable.
    kind: ItemKind,
    /// What [`fingerprint`] records of `source`'s metadata.
    stat: StatKey,
}

/// The metadata of an entry that [`fingerprint`] hashes: any change to a file's bytes
/// that a `stat` can see changes one of these.
#[derive(Debug, Clone, Copy)]
struct StatKey {
    mtime_ns: i64,
    ctime_ns: i64,
    dev: u64,
    ino: u64,
    mode: u32,
    size: u64,
}

impl StatKey {
    fn of(meta: &fs::Metadata) -> Self {
        let ns = |s: i64, n: i64| s.saturating_mul(1_000_000_000).saturating_add(n);
        Self {
            mtime_ns: ns(meta.mtime(), meta.mtime_nsec()),
            ctime_ns: ns(meta.ctime(), meta.ctime_nsec()),
            dev: meta.dev(),
            ino: meta.ino(),
            mode: meta.mode(),
            size: meta.len(),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum ItemKind {
    Dir,
    File {
        size: u64,
        dev: u64,
        ino: u64,
        exec: bool,
    },
}

/// Packs `dir` into a temporary gzip-compressed tar archive (see the module doc for what
/// is packed and how), hashing it as it is written.
///
/// # Errors
/// See [`PackError`]: a link out of the tree, a special file, a path that is not UTF-8 or
/// too long, too many entries, more bytes than `options.max_bytes` (the error names the
/// largest files), a file that changed while it was read, or an I/O error.
pub fn pack(dir: &Path, options: &PackOptions) -> Result<Packed, PackError> {
    let io_err = |path: &Path| {
        let path = path.display().to_string();
        move |source| PackError::Io { path, source }
    };
    let items = selected(dir, options)?;
    let files: Vec<(&str, u64)> = items
        .iter()
        .filter_map(|i| match i.kind {
            ItemKind::File { size, .. } => Some((i.rel.as_str(), size)),
            ItemKind::Dir => None,
        })
        .collect();
    let total: u64 = files.iter().map(|(_, s)| s).sum();
    if total > options.max_bytes {
        let mut largest = files;
        largest.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        largest.truncate(LARGEST_NAMED);
        return Err(PackError::TooLarge {
            total_bytes: total,
            limit_bytes: options.max_bytes,
            largest: largest
                .into_iter()
                .map(|(p, s)| (escape_control(p).into_owned(), s))
                .collect(),
        });
    }
    let temp = match &options.temp_dir {
        Some(d) => tempfile::Builder::new()
            .prefix(".cumulus-pack-")
            .tempfile_in(d)
            .map_err(io_err(d))?,
        None => tempfile::Builder::new()
            .prefix("cumulus-pack-")
            .tempfile()
            .map_err(io_err(&std::env::temp_dir()))?,
    };
    let written =
        write_archive(temp.as_file(), &items).map_err(|(path, source)| PackError::Io {
            path: match path {
                Some(rel) => escape_control(&rel).into_owned(),
                None => temp.path().display().to_string(),
            },
            source,
        })?;
    Ok(Packed {
        file: temp,
        digest: written.digest,
        size_bytes: written.size,
        files: items
            .iter()
            .filter(|i| matches!(i.kind, ItemKind::File { .. }))
            .count() as u64,
        dirs: items
            .iter()
            .filter(|i| matches!(i.kind, ItemKind::Dir))
            .count() as u64,
        unpacked_bytes: total,
    })
}

/// What [`pack`] packs of `dir`, and what [`fingerprint`] lists: the walk of [`collect`]
/// from the canonical `dir`, sorted by path (bytes). The one place the selection is made.
pub(crate) fn selected(dir: &Path, options: &PackOptions) -> Result<Vec<Item>, PackError> {
    let io_err = |source| PackError::Io {
        path: dir.display().to_string(),
        source,
    };
    let meta = fs::metadata(dir).map_err(io_err)?;
    if !meta.is_dir() {
        return Err(PackError::NotADirectory(dir.to_path_buf()));
    }
    let root = fs::canonicalize(dir).map_err(io_err)?;
    let mut items = collect(&root, options.respect_ignore_files)?;
    items.sort_by(|a, b| a.rel.as_bytes().cmp(b.rel.as_bytes()));
    Ok(items)
}

/// Version of the bytes [`pack`] writes for a tree: bump it whenever the same tree would
/// pack to other bytes (header fields, compression, order), so that digests cached
/// against a [`fingerprint`] of the old format are not trusted.
pub const PACK_FORMAT_VERSION: u32 = 1;

/// What [`fingerprint`] found: a name for the listing of a directory as [`pack`] would
/// select it, and what a caller needs to trust a digest cached against it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// BLAKE3 (64 lowercase hex digits) of [`PACK_FORMAT_VERSION`], the options that
    /// change the packed bytes, and for every selected entry its relative path, where its
    /// bytes are read (a link's target), kind, size, mtime and ctime (ns), inode, device
    /// and mode.
    pub digest: String,
    /// The newest mtime or ctime among the entries (ns since the epoch; 0 when empty): a
    /// digest recorded less than a file system's time granularity after it may miss a
    /// change that kept the size and the time (git's "racy" entries).
    pub newest_change_ns: i64,
    /// Regular files selected.
    pub files: u64,
    /// Directories selected (the root not counted).
    pub dirs: u64,
    /// Bytes of the selected files (what [`Packed::unpacked_bytes`] would be).
    pub unpacked_bytes: u64,
}

/// Lists `dir` exactly as [`pack`] selects it (the same walk, ignore rules and checks)
/// without reading any file's bytes, and hashes the listing: the same fingerprint means
/// no entry was added, removed or changed in a way `stat` can see, so a digest packed
/// from the same listing still names these bytes (with the racy rule of
/// [`Fingerprint::newest_change_ns`]). `options.max_bytes` is not checked here.
///
/// # Errors
/// What [`pack`] refuses before reading files: not a directory, a link out of the tree,
/// a special file, a path that is not UTF-8 or too long, too many entries, or an I/O
/// error.
pub fn fingerprint(dir: &Path, options: &PackOptions) -> Result<Fingerprint, PackError> {
    let items = selected(dir, options)?;
    let mut h = blake3::Hasher::new();
    h.update(b"cumulus-bundle fingerprint\0");
    h.update(&PACK_FORMAT_VERSION.to_le_bytes());
    h.update(&[u8::from(options.respect_ignore_files)]);
    h.update(&(items.len() as u64).to_le_bytes());
    let mut out = Fingerprint {
        digest: String::new(),
        newest_change_ns: 0,
        files: 0,
        dirs: 0,
        unpacked_bytes: 0,
    };
    for item in &items {
        let source = item.source.as_os_str().as_encoded_bytes();
        for bytes in [item.rel.as_bytes(), source] {
            h.update(&(bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        }
        match item.kind {
            ItemKind::Dir => {
                h.update(b"d");
                out.dirs += 1;
            }
            ItemKind::File { size, .. } => {
                h.update(b"f");
                out.files += 1;
                out.unpacked_bytes = out.unpacked_bytes.saturating_add(size);
            }
        }
        let s = item.stat;
        h.update(&s.size.to_le_bytes());
        h.update(&s.mtime_ns.to_le_bytes());
        h.update(&s.ctime_ns.to_le_bytes());
        h.update(&s.ino.to_le_bytes());
        h.update(&s.dev.to_le_bytes());
        h.update(&s.mode.to_le_bytes());
        out.newest_change_ns = out.newest_change_ns.max(s.mtime_ns).max(s.ctime_ns);
    }
    out.digest = h.finalize().to_hex().to_string();
    Ok(out)
}

/// Walks `root` (canonical) and checks every entry; unsorted.
fn collect(root: &Path, respect_ignore_files: bool) -> Result<Vec<Item>, PackError> {
    let mut walk = ignore::WalkBuilder::new(root);
    walk.standard_filters(false)
        .hidden(false)
        .parents(false)
        .ignore(false)
        .git_global(false)
        .git_ignore(respect_ignore_files)
        .git_exclude(respect_ignore_files)
        .require_git(false)
        .follow_links(true);
    if respect_ignore_files {
        walk.add_custom_ignore_filename(CUMULUSIGNORE);
        walk.filter_entry(|e| e.depth() == 0 || e.file_name() != ".git");
    }
    let mut items = Vec::new();
    for entry in walk.build() {
        let entry = entry.map_err(|e| PackError::Walk {
            path: root.display().to_string(),
            message: e.to_string(),
        })?;
        if entry.depth() == 0 {
            continue;
        }
        let rel_path = entry
            .path()
            .strip_prefix(root)
            .expect("the walk yields paths under its root");
        let rel = rel_path
            .to_str()
            .ok_or_else(|| PackError::NonUtf8Path(rel_path.to_string_lossy().into_owned()))?
            .to_string();
        if rel.len() > MAX_ENTRY_PATH_BYTES {
            return Err(PackError::PathTooLong {
                bytes: rel.len(),
                path: escape_control(&rel).into_owned(),
            });
        }
        let source = if entry.path_is_symlink() {
            let target = fs::canonicalize(entry.path()).map_err(|_| PackError::LinkOutside {
                link: escape_control(&rel).into_owned(),
                target: fs::read_link(entry.path())
                    .map(|t| t.display().to_string())
                    .unwrap_or_else(|_| "unreadable".into()),
            })?;
            if !target.starts_with(root) {
                return Err(PackError::LinkOutside {
                    link: escape_control(&rel).into_owned(),
                    target: target.display().to_string(),
                });
            }
            target
        } else {
            entry.path().to_path_buf()
        };
        let meta = fs::metadata(&source).map_err(|source| PackError::Io {
            path: escape_control(&rel).into_owned(),
            source,
        })?;
        let kind = item_kind(&meta, &rel)?;
        let stat = StatKey::of(&meta);
        items.push(Item {
            rel,
            source,
            kind,
            stat,
        });
        if items.len() > MAX_ARCHIVE_ENTRIES {
            return Err(PackError::TooManyEntries);
        }
    }
    Ok(items)
}

/// A directory or a regular file; anything else is refused.
fn item_kind(meta: &fs::Metadata, rel: &str) -> Result<ItemKind, PackError> {
    use std::os::unix::fs::FileTypeExt;
    let ft = meta.file_type();
    if ft.is_dir() {
        return Ok(ItemKind::Dir);
    }
    if ft.is_file() {
        return Ok(ItemKind::File {
            size: meta.len(),
            dev: meta.dev(),
            ino: meta.ino(),
            exec: meta.mode() & 0o111 != 0,
        });
    }
    let kind = if ft.is_fifo() {
        "FIFO"
    } else if ft.is_socket() {
        "socket"
    } else if ft.is_block_device() {
        "block device"
    } else if ft.is_char_device() {
        "character device"
    } else {
        "special file"
    };
    Err(PackError::Special {
        path: escape_control(rel).into_owned(),
        kind,
    })
}

/// A writer that hashes and counts what goes through it.
struct HashingWriter<W> {
    inner: W,
    hasher: blake3::Hasher,
    count: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// What [`write_archive`] wrote.
struct Written {
    digest: String,
    size: u64,
}

/// An I/O error and the entry it happened on (`None`: the archive itself).
type WriteError = (Option<String>, io::Error);

/// Writes `items` (sorted) as a tar.gz into `file`.
fn write_archive(file: &fs::File, items: &[Item]) -> Result<Written, WriteError> {
    let archive_err = |e| (None, e);
    let hashing = HashingWriter {
        inner: BufWriter::with_capacity(IO_BUFFER_BYTES, file),
        hasher: blake3::Hasher::new(),
        count: 0,
    };
    let gz = flate2::GzBuilder::new()
        .mtime(0)
        .operating_system(255)
        .write(hashing, flate2::Compression::default());
    let mut tar = tar::Builder::new(gz);
    for item in items {
        append_item(&mut tar, item).map_err(|e| (Some(item.rel.clone()), e))?;
    }
    let gz = tar.into_inner().map_err(archive_err)?;
    let mut hashing = gz.finish().map_err(archive_err)?;
    hashing.flush().map_err(archive_err)?;
    Ok(Written {
        digest: hashing.hasher.finalize().to_hex().to_string(),
        size: hashing.count,
    })
}

/// A ustar header with the fixed fields of every entry.
fn base_header(entry_type: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(entry_type);
    h.set_mode(mode);
    h.set_size(size);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h
}

/// Sets `path` in `header`; when it does not fit a ustar header, writes a PAX `path`
/// record first and leaves a truncated name in the header.
fn set_path<W: Write>(
    tar: &mut tar::Builder<W>,
    header: &mut tar::Header,
    path: &str,
) -> io::Result<()> {
    if header.set_path(path).is_ok() {
        return Ok(());
    }
    tar.append_pax_extensions([("path", path.as_bytes())])?;
    let name = &mut header.as_old_mut().name;
    let n = name.len().min(path.len());
    name[..n].copy_from_slice(&path.as_bytes()[..n]);
    Ok(())
}

fn append_item<W: Write>(tar: &mut tar::Builder<W>, item: &Item) -> io::Result<()> {
    match item.kind {
        ItemKind::Dir => {
            let mut h = base_header(tar::EntryType::Directory, 0o755, 0);
            set_path(tar, &mut h, &format!("{}/", item.rel))?;
            h.set_cksum();
            tar.append(&h, io::empty())
        }
        ItemKind::File {
            size,
            dev,
            ino,
            exec,
        } => {
            // The file as walked: not through a link swapped in since, not another file.
            let file = fs::OpenOptions::new()
                .read(true)
                .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
                .open(&item.source)?;
            let meta = file.metadata()?;
            if meta.dev() != dev || meta.ino() != ino || !meta.is_file() {
                return Err(io::Error::other("replaced while it was being packed"));
            }
            let mode = if exec { 0o755 } else { 0o644 };
            let mut h = base_header(tar::EntryType::Regular, mode, size);
            set_path(tar, &mut h, &item.rel)?;
            h.set_cksum();
            tar.append(
                &h,
                ExactReader {
                    inner: file,
                    left: size,
                },
            )
        }
    }
}

/// Reads exactly `left` bytes of a file, and fails when the file holds fewer or more (it
/// changed since it was measured): a tar entry's size is written before its bytes.
struct ExactReader {
    inner: fs::File,
    left: u64,
}

impl Read for ExactReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            let mut probe = [0u8; 1];
            return match self.inner.read(&mut probe)? {
                0 => Ok(0),
                _ => Err(io::Error::other("grew while it was being packed")),
            };
        }
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::Error::other("shrank while it was being packed"));
        }
        self.left -= n as u64;
        Ok(n)
    }
}
