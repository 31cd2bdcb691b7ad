//! Reading back: parts verified against their records (layout and sizes, or every byte's
//! digest), manifests, `LATEST` and the list of steps, never through a symlink and never
//! more than a file's bound.

use std::collections::BTreeSet;
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use super::{LocalStore, corrupt, io_err, open_nofollow, open_regular};
use crate::{
    CkptError, LATEST_FILE, MANIFEST_FILE, MAX_LATEST_BYTES, MAX_MANIFEST_BYTES, Manifest,
    PartRecord, digest::hash_reader, parse_digest, parse_step_dir_name, step_dir_name,
};

/// Checks that `base/rel` is a chain of real directories below `base` (no symlink, nothing
/// missing); a missing or wrong component is [`CkptError::Corrupt`].
fn check_dir_chain(base: &Path, rel: &str) -> Result<PathBuf, CkptError> {
    let mut path = base.to_owned();
    for component in rel.split('/') {
        path.push(component);
        match fs::symlink_metadata(&path) {
            Ok(metadata) if metadata.is_dir() => {}
            Ok(_) => return Err(corrupt(&path, "is not a directory (symlinks are refused)")),
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                return Err(corrupt(&path, "is missing"));
            }
            Err(source) => {
                return Err(CkptError::Io {
                    op: "stat",
                    path,
                    source,
                });
            }
        }
    }
    Ok(path)
}

/// Reads a small regular file (not a symlink) of at most `limit` bytes. `Ok(None)` when it
/// does not exist.
fn read_limited(path: &Path, limit: u64) -> Result<Option<Vec<u8>>, CkptError> {
    match fs::symlink_metadata(path) {
        Ok(metadata) if metadata.is_file() => {}
        Ok(_) => {
            return Err(corrupt(
                path,
                "is not a regular file (symlinks are refused)",
            ));
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(CkptError::Io {
                op: "stat",
                path: path.to_owned(),
                source,
            });
        }
    }
    let file = match open_nofollow(path) {
        Ok(file) => file,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(CkptError::Io {
                op: "open",
                path: path.to_owned(),
                source,
            });
        }
    };
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(io_err("read", path))?;
    if u64::try_from(bytes.len()).expect("a buffer length fits in u64") > limit {
        return Err(corrupt(path, format!("is larger than {limit} bytes")));
    }
    Ok(Some(bytes))
}

impl LocalStore {
    /// [`CheckpointStore::verify_part`](crate::CheckpointStore::verify_part) when
    /// `read_content`, else [`CheckpointStore::check_part`](crate::CheckpointStore::check_part)
    /// (layout and sizes only).
    pub(super) fn verify_part_sync(
        &self,
        job_id: &str,
        part: &PartRecord,
        read_content: bool,
    ) -> Result<(), CkptError> {
        let job_dir = self.checked_job_dir(job_id)?;
        part.validate()?;
        let part_dir = check_dir_chain(&job_dir, &part.dir)?;
        let mut checked_dirs: BTreeSet<String> = BTreeSet::new();
        for entry in &part.files {
            // Intermediate directories must be real directories inside the part.
            if let Some((parent_rel, _)) = entry.path.rsplit_once('/')
                && !checked_dirs.contains(parent_rel)
            {
                check_dir_chain(&part_dir, parent_rel)?;
                checked_dirs.insert(parent_rel.to_owned());
            }
            let path = part_dir.join(&entry.path);
            let mut file = open_regular(&path, true)?;
            let size_on_disk = file.metadata().map_err(io_err("stat", &path))?.len();
            if size_on_disk != entry.size_bytes {
                return Err(corrupt(
                    &path,
                    format!(
                        "size is {size_on_disk} bytes, the record says {}",
                        entry.size_bytes
                    ),
                ));
            }
            if !read_content {
                continue;
            }
            let algorithm = parse_digest(&entry.digest)?;
            let (size_bytes, digest) = hash_reader(&mut file, &path, algorithm)?;
            if size_bytes != entry.size_bytes {
                return Err(corrupt(
                    &path,
                    format!(
                        "read {size_bytes} bytes, the record says {}",
                        entry.size_bytes
                    ),
                ));
            }
            if digest != entry.digest {
                return Err(corrupt(
                    &path,
                    format!("digest is {digest}, the record says {}", entry.digest),
                ));
            }
        }
        Ok(())
    }

    pub(super) fn read_manifest_sync(
        &self,
        job_id: &str,
        step: u64,
    ) -> Result<Manifest, CkptError> {
        let job_dir = self.checked_job_dir(job_id)?;
        let step_dir = job_dir.join(step_dir_name(step));
        let path = step_dir.join(MANIFEST_FILE);
        let not_found = || CkptError::NotFound {
            what: format!(
                "manifest of step {step} of job {job_id} ({})",
                path.display()
            ),
        };
        match fs::symlink_metadata(&step_dir) {
            Ok(metadata) if metadata.is_dir() => {}
            Ok(_) => {
                return Err(corrupt(
                    &step_dir,
                    "is not a directory (symlinks are refused)",
                ));
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Err(not_found()),
            Err(source) => {
                return Err(CkptError::Io {
                    op: "stat",
                    path: step_dir,
                    source,
                });
            }
        }
        let bytes = read_limited(&path, MAX_MANIFEST_BYTES)?.ok_or_else(not_found)?;
        let manifest: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| corrupt(&path, format!("is not a valid manifest: {e}")))?;
        manifest
            .validate()
            .map_err(|e| corrupt(&path, e.to_string()))?;
        if manifest.job_id != job_id || manifest.step != step {
            return Err(corrupt(
                &path,
                format!(
                    "names job {} step {}, but lies at job {job_id} step {step}",
                    manifest.job_id, manifest.step
                ),
            ));
        }
        Ok(manifest)
    }

    pub(super) fn verify_step_sync(&self, job_id: &str, step: u64) -> Result<Manifest, CkptError> {
        let manifest = self.read_manifest_sync(job_id, step)?;
        for part in &manifest.parts {
            self.verify_part_sync(job_id, part, true)?;
        }
        Ok(manifest)
    }

    pub(super) fn read_latest_sync(&self, job_id: &str) -> Result<Option<u64>, CkptError> {
        let path = self.checked_job_dir(job_id)?.join(LATEST_FILE);
        let Some(bytes) = read_limited(&path, MAX_LATEST_BYTES)? else {
            return Ok(None);
        };
        let text = std::str::from_utf8(&bytes).map_err(|_| corrupt(&path, "is not UTF-8"))?;
        let name = text.strip_suffix('\n').unwrap_or(text);
        parse_step_dir_name(name).map(Some).ok_or_else(|| {
            corrupt(
                &path,
                format!("content {text:?} is not a step directory name"),
            )
        })
    }

    pub(super) fn list_steps_sync(&self, job_id: &str) -> Result<Vec<u64>, CkptError> {
        let job_dir = self.checked_job_dir(job_id)?;
        let entries = match fs::read_dir(&job_dir) {
            Ok(entries) => entries,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => {
                return Err(CkptError::Io {
                    op: "read dir",
                    path: job_dir,
                    source,
                });
            }
        };
        let mut steps = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io_err("read dir", &job_dir))?;
            let Some(step) = entry.file_name().to_str().and_then(parse_step_dir_name) else {
                continue;
            };
            if entry
                .file_type()
                .map_err(io_err("stat", &entry.path()))?
                .is_dir()
            {
                steps.push(step);
            }
        }
        steps.sort_unstable();
        Ok(steps)
    }
}
