//! The client's cache of workdir digests (`--upload DIR`): which blob an unchanged
//! directory packed to last time, so that a second submit of it walks and `stat`s the
//! tree ([`cumulus_bundle::fingerprint`]) instead of packing it again.
//!
//! One JSON file, `$XDG_CACHE_HOME/cumulus/cli-upload-digests.json` (default
//! `~/.cache/cumulus`), maps a directory's canonical absolute path to the fingerprint it
//! had, the digest and size it packed to, and when the fingerprint was taken. An entry is
//! trusted only when the fingerprint is the same and every entry of the tree changed more
//! than [`RACY_MARGIN_NS`] before the fingerprint was taken (git's rule for racy index
//! entries: a file rewritten within its file system's time granularity can keep its size
//! and mtime). At most [`MAX_ENTRIES`] directories, the oldest evicted; written to a
//! temporary file then renamed; a file that cannot be read or parsed is ignored (a `-v`
//! diagnostic), never an error. `CUMULUS_NO_UPLOAD_CACHE=1` turns it off.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use cumulus_api::blobs::{MAX_BLOB_BYTES, is_valid_digest};
use cumulus_bundle::Fingerprint;
use serde::{Deserialize, Serialize};

/// Name of the cache file in `$XDG_CACHE_HOME/cumulus`.
pub const CACHE_FILE: &str = "cli-upload-digests.json";
/// Environment variable that turns the cache off when set to `1`.
pub const DISABLE_ENV: &str = "CUMULUS_NO_UPLOAD_CACHE";
/// Most directories the cache remembers; past it the oldest entries are evicted.
pub const MAX_ENTRIES: usize = 256;
/// Largest cache file read, in bytes (a bigger one is ignored as corrupt).
pub const MAX_CACHE_FILE_BYTES: u64 = 4 * 1024 * 1024;
/// Longest directory path remembered, in bytes.
pub const MAX_KEY_BYTES: usize = 4096;
/// A tree whose newest change is less than this before the fingerprint was taken is not
/// trusted (git's racy rule, with room for coarse file system clocks), in nanoseconds.
pub const RACY_MARGIN_NS: i64 = 2_000_000_000;
/// Version of the cache file's format; a file of another version is ignored.
const FORMAT_VERSION: u32 = 1;

/// What the cache remembers of one directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachedDigest {
    /// [`Fingerprint::digest`] of the directory when it was packed.
    pub fingerprint: String,
    /// Digest of the blob it packed to.
    pub digest: String,
    /// Size of that blob, in bytes.
    pub size: u64,
    /// When the fingerprint was taken (before packing), ns since the epoch.
    pub written_at_ns: i64,
}

impl CachedDigest {
    /// Whether the fields are well formed (digests, size within a blob's limit).
    fn is_valid(&self) -> bool {
        is_valid_digest(&self.fingerprint)
            && is_valid_digest(&self.digest)
            && self.size <= MAX_BLOB_BYTES
            && self.written_at_ns > 0
    }
}

/// The file's contents.
#[derive(Debug, Default, Serialize, Deserialize)]
struct CacheFile {
    version: u32,
    entries: BTreeMap<String, CachedDigest>,
}

/// The cache file at one path.
#[derive(Debug, Clone)]
pub struct UploadCache {
    path: PathBuf,
}

/// Where the cache lives given `CUMULUS_NO_UPLOAD_CACHE`, `XDG_CACHE_HOME` and `HOME`:
/// `None` when turned off or when there is no home to put it in. A relative
/// `XDG_CACHE_HOME` is ignored, as the XDG spec asks.
pub fn cache_path(
    disabled: Option<OsString>,
    xdg_cache_home: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    if disabled.is_some_and(|v| v == "1") {
        return None;
    }
    let base = match xdg_cache_home.map(PathBuf::from) {
        Some(xdg) if xdg.is_absolute() => xdg,
        _ => PathBuf::from(home.filter(|h| !h.is_empty())?).join(".cache"),
    };
    Some(base.join("cumulus").join(CACHE_FILE))
}

/// Nanoseconds since the epoch, now.
pub fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

impl UploadCache {
    /// The cache of this user ([`cache_path`] from the environment), or `None` when
    /// turned off.
    pub fn from_env() -> Option<Self> {
        cache_path(
            std::env::var_os(DISABLE_ENV),
            std::env::var_os("XDG_CACHE_HOME"),
            std::env::var_os("HOME"),
        )
        .map(Self::at)
    }

    /// The cache file at `path`.
    pub fn at(path: PathBuf) -> Self {
        Self { path }
    }

    /// The cached digest of `dir` (canonical), when its fingerprint is `print` and the
    /// tree is not racy; `None` otherwise (and when the file is missing or corrupt).
    pub fn lookup(&self, dir: &str, print: &Fingerprint) -> Option<CachedDigest> {
        let entry = self.load().entries.remove(dir)?;
        let trusted = entry.fingerprint == print.digest
            && print.newest_change_ns < entry.written_at_ns.saturating_sub(RACY_MARGIN_NS);
        if !trusted {
            tracing::info!(
                "upload cache: {dir} changed or was changed too recently to trust its cached digest"
            );
        }
        trusted.then_some(entry)
    }

    /// Remembers `entry` for `dir` (canonical), evicting the oldest entries past
    /// [`MAX_ENTRIES`]. A failure is a `-v` diagnostic: the cache only saves time.
    pub fn record(&self, dir: &str, entry: CachedDigest) {
        if dir.len() > MAX_KEY_BYTES || !entry.is_valid() {
            return;
        }
        let mut file = self.load();
        file.entries.insert(dir.to_string(), entry);
        while file.entries.len() > MAX_ENTRIES {
            let oldest = file
                .entries
                .iter()
                .min_by_key(|(k, e)| (e.written_at_ns, (*k).clone()))
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => file.entries.remove(&k),
                None => break,
            };
        }
        file.version = FORMAT_VERSION;
        if let Err(e) = self.write(&file) {
            tracing::warn!("upload cache: writing {}: {e:#}", self.path.display());
        }
    }

    /// The file's entries; missing means empty, unreadable or corrupt means empty with
    /// a `-v` diagnostic; malformed entries are dropped.
    fn load(&self) -> CacheFile {
        let mut text = String::new();
        let read = std::fs::File::open(&self.path)
            .and_then(|f| f.take(MAX_CACHE_FILE_BYTES + 1).read_to_string(&mut text));
        match read {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return CacheFile::default(),
            Err(e) => {
                tracing::warn!("upload cache: ignoring {}: {e}", self.path.display());
                return CacheFile::default();
            }
            Ok(n) if n as u64 > MAX_CACHE_FILE_BYTES => {
                tracing::warn!(
                    "upload cache: ignoring {}: over {MAX_CACHE_FILE_BYTES} bytes",
                    self.path.display()
                );
                return CacheFile::default();
            }
            Ok(_) => {}
        }
        match serde_json::from_str::<CacheFile>(&text) {
            Ok(mut file) if file.version == FORMAT_VERSION => {
                file.entries
                    .retain(|k, e| k.len() <= MAX_KEY_BYTES && e.is_valid());
                file
            }
            Ok(file) => {
                tracing::warn!(
                    "upload cache: ignoring {}: format version {}, not {FORMAT_VERSION}",
                    self.path.display(),
                    file.version
                );
                CacheFile::default()
            }
            Err(e) => {
                tracing::warn!(
                    "upload cache: ignoring corrupt {}: {e}",
                    self.path.display()
                );
                CacheFile::default()
            }
        }
    }

    /// Writes `file` to a temporary file beside the cache, then renames it over.
    fn write(&self, file: &CacheFile) -> anyhow::Result<()> {
        let parent = self
            .path
            .parent()
            .ok_or_else(|| anyhow::anyhow!("no parent directory"))?;
        std::fs::create_dir_all(parent)?;
        let mut temp = tempfile::Builder::new()
            .prefix(".cli-upload-digests-")
            .tempfile_in(parent)?;
        temp.write_all(&serde_json::to_vec(file)?)?;
        temp.persist(&self.path).map_err(|e| e.error)?;
        Ok(())
    }
}

/// The cache's key for `dir`: its canonical absolute path, when it is UTF-8.
pub fn key_of(dir: &Path) -> Option<String> {
    std::fs::canonicalize(dir)
        .ok()?
        .to_str()
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cumulus_bundle::{PackOptions, fingerprint};

    fn print(digest: char, newest_change_ns: i64) -> Fingerprint {
        Fingerprint {
            digest: digest.to_string().repeat(64),
            newest_change_ns,
            files: 1,
            dirs: 0,
            unpacked_bytes: 1,
        }
    }

    fn entry(fp: char, written_at_ns: i64) -> CachedDigest {
        CachedDigest {
            fingerprint: fp.to_string().repeat(64),
            digest: "d".repeat(64),
            size: 42,
            written_at_ns,
        }
    }

    fn cache() -> (tempfile::TempDir, UploadCache) {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = UploadCache::at(dir.path().join("cumulus").join(CACHE_FILE));
        (dir, cache)
    }

    #[test]
    fn a_recorded_digest_is_found_for_the_same_settled_fingerprint() {
        let (_d, cache) = cache();
        assert_eq!(cache.lookup("/w", &print('a', 1)), None, "empty cache");
        let written = 100 * RACY_MARGIN_NS;
        cache.record("/w", entry('a', written));
        assert_eq!(
            cache.lookup("/w", &print('a', written - RACY_MARGIN_NS - 1)),
            Some(entry('a', written))
        );
        assert_eq!(cache.lookup("/other", &print('a', 1)), None);
        assert_eq!(
            cache.lookup("/w", &print('b', 1)),
            None,
            "another fingerprint"
        );
    }

    #[test]
    fn a_tree_changed_within_the_racy_margin_is_not_trusted() {
        let (_d, cache) = cache();
        let written = 100 * RACY_MARGIN_NS;
        cache.record("/w", entry('a', written));
        for newest in [written - RACY_MARGIN_NS, written - 1, written, written + 5] {
            assert_eq!(cache.lookup("/w", &print('a', newest)), None, "{newest}");
        }

        // On real files: fingerprinted just now, the tree is racy; a fingerprint taken
        // past the margin trusts it, and a changed file misses.
        let tree = tempfile::tempdir().expect("tempdir");
        std::fs::write(tree.path().join("train.py"), b"print(1)\n").expect("write");
        let key = key_of(tree.path()).expect("key");
        let fp = fingerprint(tree.path(), &PackOptions::default()).expect("fingerprint");
        let mut recorded = entry('a', now_ns());
        recorded.fingerprint = fp.digest.clone();
        cache.record(&key, recorded.clone());
        assert_eq!(cache.lookup(&key, &fp), None, "racy right after writing");
        recorded.written_at_ns = fp.newest_change_ns + RACY_MARGIN_NS + 1;
        cache.record(&key, recorded.clone());
        assert_eq!(cache.lookup(&key, &fp), Some(recorded));
        std::fs::write(tree.path().join("train.py"), b"print(22)\n").expect("write");
        let changed = fingerprint(tree.path(), &PackOptions::default()).expect("fingerprint");
        assert_eq!(cache.lookup(&key, &changed), None, "a changed file");
    }

    #[test]
    fn a_corrupt_or_unreadable_cache_file_is_ignored_and_replaced() {
        let (_d, cache) = cache();
        let parent = cache.path.parent().expect("parent");
        std::fs::create_dir_all(parent).expect("mkdir");
        let written = 100 * RACY_MARGIN_NS;
        let settled = print('a', 1);
        for corrupt in [
            &b"{not json"[..],
            b"",
            b"{\"version\":99,\"entries\":{}}",
            b"\xff\xfe",
        ] {
            std::fs::write(&cache.path, corrupt).expect("write");
            assert_eq!(cache.lookup("/w", &settled), None);
            cache.record("/w", entry('a', written));
            assert_eq!(cache.lookup("/w", &settled), Some(entry('a', written)));
        }
        // A malformed entry is dropped, the others kept.
        let text = format!(
            "{{\"version\":1,\"entries\":{{\"/bad\":{{\"fingerprint\":\"x\",\"digest\":\"{d}\",\"size\":1,\"written_at_ns\":{written}}},\"/w\":{{\"fingerprint\":\"{a}\",\"digest\":\"{d}\",\"size\":42,\"written_at_ns\":{written}}}}}}}",
            d = "d".repeat(64),
            a = "a".repeat(64),
        );
        std::fs::write(&cache.path, text).expect("write");
        assert_eq!(cache.lookup("/bad", &settled), None);
        assert_eq!(cache.lookup("/w", &settled), Some(entry('a', written)));
        // A directory where the file should be: ignored, recording fails quietly.
        std::fs::remove_file(&cache.path).expect("rm");
        std::fs::create_dir(&cache.path).expect("mkdir");
        assert_eq!(cache.lookup("/w", &settled), None);
        cache.record("/w", entry('a', written));
        assert_eq!(cache.lookup("/w", &settled), None);
    }

    #[test]
    fn the_cache_keeps_the_newest_entries_up_to_its_bound() {
        let (_d, cache) = cache();
        let base = 100 * RACY_MARGIN_NS;
        let extra = 10;
        for i in 0..MAX_ENTRIES + extra {
            cache.record(&format!("/w/{i}"), entry('a', base + i as i64));
        }
        assert_eq!(cache.load().entries.len(), MAX_ENTRIES);
        let settled = print('a', 1);
        for i in 0..extra {
            assert_eq!(cache.lookup(&format!("/w/{i}"), &settled), None, "{i} kept");
        }
        for i in extra..MAX_ENTRIES + extra {
            assert!(
                cache.lookup(&format!("/w/{i}"), &settled).is_some(),
                "{i} evicted"
            );
        }
        // No temporary files left beside it.
        let names: Vec<_> = std::fs::read_dir(cache.path.parent().expect("parent"))
            .expect("read_dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, [OsString::from(CACHE_FILE)]);
    }

    #[test]
    fn the_cache_lives_under_xdg_cache_home_or_home_unless_turned_off() {
        let p = |d: Option<&str>, x: Option<&str>, h: Option<&str>| {
            cache_path(d.map(Into::into), x.map(Into::into), h.map(Into::into))
        };
        let file = Path::new("cumulus").join(CACHE_FILE);
        assert_eq!(
            p(None, Some("/x"), Some("/h")),
            Some(Path::new("/x").join(&file))
        );
        assert_eq!(
            p(None, None, Some("/h")),
            Some(Path::new("/h/.cache").join(&file))
        );
        assert_eq!(
            p(None, Some("rel"), Some("/h")),
            Some(Path::new("/h/.cache").join(&file))
        );
        assert_eq!(p(Some("1"), Some("/x"), Some("/h")), None);
        assert_eq!(
            p(Some("0"), Some("/x"), None),
            Some(Path::new("/x").join(&file))
        );
        assert_eq!(p(None, None, None), None);
    }
}
