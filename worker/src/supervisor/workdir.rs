//! An attempt's own directories: its working directory unpacked from the job's packed
//! workdir (`DesiredRank.workdir`), and its output directory (`CUMULUS_OUTPUT_DIR`),
//! packed and uploaded as the attempt's artifacts once its process has ended.
//!
//! Both live in `<data-dir>/attempts/<job>/rank-<r>.attempt-<a>/` (`work/`, `output/`),
//! created for the attempt and removed when it ends (and, after an agent restart, with
//! the attempt's pid record). The directories above them are the agent's, `0711`: ranks
//! of another user pass through to their own directories but list nothing. With ranks
//! running as another user, `work/` (`0700`) and the tree in it, and `output/` (`0700`),
//! are that user's; before the output is packed, every entry of it becomes the agent's
//! again, each directory before it is listed and each file before it is read, through
//! descriptors opened without following links, and a file with another hard link is
//! refused (rank isolation invariant 4: a process the rank left behind cannot swap in
//! what it could not read itself).

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use cumulus_api::blobs::{MAX_ARCHIVE_ENTRIES, MAX_BLOB_BYTES};
use cumulus_api::{AttemptKey, BlobRef, DesiredRank};

use super::prepare::{PrepareError, append_line};
use super::*;
use crate::identity::RankCreds;

/// The directory of the attempts' own directories under the data dir.
pub const ATTEMPTS_DIR: &str = "attempts";
/// Mode of `attempts/`, its job directories and each attempt's directory: the agent
/// writes, others may only pass through.
const PASS_THROUGH_MODE: u32 = 0o711;
/// Mode of `work/` and `output/`: their owner only.
const PRIVATE_MODE: u32 = 0o700;

/// `<data-dir>/attempts/<job>/rank-<r>.attempt-<a>` (the job id was checked by the
/// caller: [`AttemptPaths::new`]).
pub fn attempt_dir(data_dir: &Path, key: &AttemptKey) -> PathBuf {
    data_dir
        .join(ATTEMPTS_DIR)
        .join(&key.job_id)
        .join(format!("rank-{}.attempt-{}", key.rank, key.attempt))
}

/// The agent's effective user and group ids.
fn agent_ids() -> (u32, u32) {
    (
        nix::unistd::geteuid().as_raw(),
        nix::unistd::getegid().as_raw(),
    )
}

/// The rank's credentials when it runs as another user than the agent.
fn other_user(creds: Option<&RankCreds>) -> Option<&RankCreds> {
    creds.filter(|c| c.uid != agent_ids().0)
}

/// Creates `attempts/<job>/rank-<r>.attempt-<a>` and the directories above it, the
/// agent's with [`PASS_THROUGH_MODE`]; a directory left by an earlier agent for the same
/// attempt is removed first.
fn create_attempt_dir(data_dir: &Path, key: &AttemptKey) -> io::Result<PathBuf> {
    let dir = attempt_dir(data_dir, key);
    match fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    // In one call: the job's directory, empty a moment, may be removed by its last
    // attempt meanwhile ([`Supervisor::remove_attempt_dir`]); once the attempt's
    // directory is in it, it stays.
    fs::DirBuilder::new()
        .recursive(true)
        .mode(PASS_THROUGH_MODE)
        .create(&dir)?;
    let attempts = data_dir.join(ATTEMPTS_DIR);
    let job = attempts.join(&key.job_id);
    for d in [&attempts, &job, &dir] {
        // The umask may have taken the others' search bit.
        fs::set_permissions(d, fs::Permissions::from_mode(PASS_THROUGH_MODE))?;
    }
    Ok(dir)
}

/// Gives `path` and everything below it to `creds` (never through a link: the tree was
/// just unpacked and holds none), `path` itself with [`PRIVATE_MODE`].
fn give_tree(path: &Path, creds: &RankCreds) -> io::Result<()> {
    let mut stack = vec![path.to_owned()];
    let mut seen = 0usize;
    while let Some(p) = stack.pop() {
        seen += 1;
        if seen > MAX_ARCHIVE_ENTRIES + 1 {
            return Err(io::Error::other("more entries than an archive may hold"));
        }
        std::os::unix::fs::lchown(&p, Some(creds.uid), Some(creds.gid))?;
        if fs::symlink_metadata(&p)?.is_dir() {
            for entry in fs::read_dir(&p)? {
                stack.push(entry?.path());
            }
        }
    }
    fs::set_permissions(path, fs::Permissions::from_mode(PRIVATE_MODE))
}

impl Supervisor {
    /// The attempt's working directory when its job sent one: the packed workdir had from
    /// the blob cache (fetched and verified once per digest), unpacked afresh into
    /// `work/` (entries refused as [`cumulus_bundle::unpack`] says) and given to the
    /// rank's user. `None`: the job sent none.
    pub(super) async fn prepare_workdir(
        &self,
        key: &AttemptKey,
        d: &DesiredRank,
        creds: Option<&RankCreds>,
    ) -> Result<Option<PathBuf>, PrepareError> {
        let Some(blob) = &d.workdir else {
            return Ok(None);
        };
        let settings = &self.inner.settings;
        let lease = settings
            .blobs
            .get(&blob.digest, blob.size_bytes)
            .await
            .map_err(|e| PrepareError::Invalid(format!("the job's workdir: {e}")))?;
        let data_dir = settings.data_dir.clone();
        let key = key.clone();
        let creds = other_user(creds).cloned();
        let digest = blob.digest.clone();
        let work = tokio::task::spawn_blocking(move || {
            let dir = create_attempt_dir(&data_dir, &key).map_err(|source| PrepareError::Write {
                path: attempt_dir(&data_dir, &key),
                source,
            })?;
            let work = dir.join("work");
            let unpacked = cumulus_bundle::unpack(
                lease.path(),
                &work,
                &cumulus_bundle::UnpackLimits::default(),
            )
            .map_err(|e| {
                PrepareError::Invalid(format!("the job's workdir (blob {digest}) cannot be unpacked: {e}"))
            })?;
            drop(lease);
            match &creds {
                Some(creds) => give_tree(&work, creds),
                None => fs::set_permissions(&work, fs::Permissions::from_mode(PRIVATE_MODE)),
            }
            .map_err(|source| PrepareError::Write {
                path: work.clone(),
                source,
            })?;
            tracing::info!(attempt = %key, files = unpacked.files, bytes = unpacked.bytes, "workdir unpacked");
            Ok::<_, PrepareError>(work)
        })
        .await
        .map_err(|e| PrepareError::Invalid(format!("the unpack task failed: {e}")))??;
        Ok(Some(work))
    }

    /// The attempt's `CUMULUS_OUTPUT_DIR`: a fresh empty `output/`, the rank's user's.
    pub(super) async fn prepare_output_dir(
        &self,
        key: &AttemptKey,
        creds: Option<&RankCreds>,
    ) -> Result<PathBuf, PrepareError> {
        let data_dir = self.inner.settings.data_dir.clone();
        let key = key.clone();
        let creds = other_user(creds).cloned();
        tokio::task::spawn_blocking(move || {
            let dir = attempt_dir(&data_dir, &key);
            let made = if dir.is_dir() {
                Ok(dir)
            } else {
                create_attempt_dir(&data_dir, &key)
            };
            let output = made.map(|d| d.join("output"));
            let output = output.and_then(|o| {
                fs::DirBuilder::new().mode(PRIVATE_MODE).create(&o)?;
                if let Some(c) = &creds {
                    std::os::unix::fs::lchown(&o, Some(c.uid), Some(c.gid))?;
                }
                fs::set_permissions(&o, fs::Permissions::from_mode(PRIVATE_MODE))?;
                Ok(o)
            });
            output.map_err(|source| PrepareError::Write {
                path: attempt_dir(&data_dir, &key).join("output"),
                source,
            })
        })
        .await
        .map_err(|e| PrepareError::Invalid(format!("the output dir task failed: {e}")))?
    }

    /// What the attempt left in its output directory, once its process has ended:
    /// packed (sealed first when ranks run as another user), within
    /// `--max-artifact-bytes`, and uploaded. `None` when it left nothing, or when any
    /// step failed (then the attempt's log at `log` says why).
    pub(super) async fn collect_artifacts(&self, key: &AttemptKey, log: &Path) -> Option<BlobRef> {
        let settings = &self.inner.settings;
        let dir = attempt_dir(&settings.data_dir, key);
        let output = dir.join("output");
        let sealed = settings.identity.run_as.is_other_user();
        let max_bytes = settings.max_artifact_bytes.min(MAX_BLOB_BYTES);
        let packed =
            tokio::task::spawn_blocking(move || pack_output(&output, &dir, sealed, max_bytes))
                .await
                .map_err(|e| format!("the pack task failed: {e}"))
                .and_then(|r| r);
        let packed = match packed {
            Ok(Some(p)) => p,
            Ok(None) => return None,
            Err(why) => {
                note_no_artifacts(key, log, &why).await;
                return None;
            }
        };
        match settings
            .blobs
            .upload(packed.path(), &packed.digest, packed.size_bytes)
            .await
        {
            Ok(()) => {
                tracing::info!(
                    attempt = %key,
                    digest = %packed.digest,
                    files = packed.files,
                    bytes = packed.size_bytes,
                    "artifacts uploaded"
                );
                Some(BlobRef {
                    digest: packed.digest.clone(),
                    size_bytes: packed.size_bytes,
                })
            }
            Err(why) => {
                note_no_artifacts(key, log, &format!("the upload failed: {why}")).await;
                None
            }
        }
    }

    /// Removes the attempt's own directories (its working and output directories).
    pub(super) async fn remove_attempt_dir(&self, key: &AttemptKey) {
        let data_dir = self.inner.settings.data_dir.clone();
        let dir = attempt_dir(&data_dir, key);
        let removed = tokio::task::spawn_blocking(move || {
            let result = match fs::remove_dir_all(&dir) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            };
            // The job's directory goes with its last attempt (not empty: kept).
            if let Some(job) = dir.parent() {
                let _ = fs::remove_dir(job);
            }
            result
        })
        .await;
        match removed {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(attempt = %key, "cannot remove the attempt's directories: {e}")
            }
            Err(e) => tracing::warn!(attempt = %key, "the removal task failed: {e}"),
        }
    }
}

/// Writes why the attempt has no artifacts into its log (and the agent's).
async fn note_no_artifacts(key: &AttemptKey, log: &Path, why: &str) {
    tracing::warn!(attempt = %key, "no artifacts: {why}");
    let line = format!(
        "[cumulus: what the attempt left in {} was not uploaded as its artifacts: {why}]\n",
        cumulus_api::rank_env::OUTPUT_DIR
    );
    if let Err(e) = append_line(log, &line).await {
        tracing::warn!(attempt = %key, "cannot write to the log: {e}");
    }
}

/// Packs `output` (sealed first with `sealed`) into an archive in `dir`, at most
/// `max_bytes` of files and of archive; `None` when it is absent or empty.
fn pack_output(
    output: &Path,
    dir: &Path,
    sealed: bool,
    max_bytes: u64,
) -> Result<Option<cumulus_bundle::Packed>, String> {
    match fs::symlink_metadata(output) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(format!("{} is not a directory", output.display())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", output.display())),
    }
    if sealed {
        seal_tree(output)?;
    }
    let empty = fs::read_dir(output)
        .map_err(|e| format!("{}: {e}", output.display()))?
        .next()
        .is_none();
    if empty {
        return Ok(None);
    }
    let options = cumulus_bundle::PackOptions {
        respect_ignore_files: false,
        max_bytes,
        temp_dir: Some(dir.to_owned()),
    };
    let packed = cumulus_bundle::pack(output, &options).map_err(|e| e.to_string())?;
    if packed.size_bytes > max_bytes {
        return Err(format!(
            "the packed archive has {} bytes, more than --max-artifact-bytes ({max_bytes})",
            packed.size_bytes
        ));
    }
    Ok(Some(packed))
}

/// Makes every entry of `root` the agent's before it is read: each directory (opened
/// without following a link) is taken and closed to others before it is listed, each
/// regular file before it is packed; a file with another hard link is refused. Links
/// stay as they are (the pack refuses one that leads out of the tree); other entries are
/// left for the pack to refuse.
fn seal_tree(root: &Path) -> Result<(), String> {
    let (uid, gid) = agent_ids();
    let mut stack = vec![root.to_owned()];
    let mut seen = 0usize;
    while let Some(dir) = stack.pop() {
        let handle = open_nofollow(&dir, true).map_err(|e| format!("{}: {e}", dir.display()))?;
        std::os::unix::fs::fchown(&handle, Some(uid), Some(gid))
            .and_then(|()| handle.set_permissions(fs::Permissions::from_mode(0o700)))
            .map_err(|e| format!("cannot take {}: {e}", dir.display()))?;
        for entry in fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))? {
            seen += 1;
            if seen > MAX_ARCHIVE_ENTRIES {
                return Err(format!(
                    "more than {MAX_ARCHIVE_ENTRIES} entries in the output directory"
                ));
            }
            let entry = entry.map_err(|e| format!("{}: {e}", dir.display()))?;
            let path = entry.path();
            let kind = entry
                .file_type()
                .map_err(|e| format!("{}: {e}", path.display()))?;
            if kind.is_dir() {
                stack.push(path);
            } else if kind.is_file() {
                seal_file(&path, uid, gid)?;
            }
        }
    }
    Ok(())
}

/// Opens `path` for reading without following a link (and without blocking on a FIFO
/// swapped in), a directory when `dir`.
fn open_nofollow(path: &Path, dir: bool) -> io::Result<fs::File> {
    let mut flags = nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK;
    if dir {
        flags |= nix::libc::O_DIRECTORY;
    }
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
}

fn seal_file(path: &Path, uid: u32, gid: u32) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let file = open_nofollow(path, false).map_err(|e| format!("{}: {e}", path.display()))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", path.display()));
    }
    if meta.nlink() != 1 {
        return Err(format!(
            "{} has {} hard links: only files of the attempt's own are uploaded",
            path.display(),
            meta.nlink()
        ));
    }
    std::os::unix::fs::fchown(&file, Some(uid), Some(gid))
        .and_then(|()| file.set_permissions(fs::Permissions::from_mode(0o600)))
        .map_err(|e| format!("cannot take {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_output_dir_is_packed_when_it_holds_something_and_within_the_limit() {
        let tmp = tempfile::tempdir().unwrap();
        let output = tmp.path().join("output");
        fs::create_dir(&output).unwrap();
        assert!(
            pack_output(&tmp.path().join("absent"), tmp.path(), true, 1 << 20)
                .unwrap()
                .is_none()
        );
        assert!(
            pack_output(&output, tmp.path(), true, 1 << 20)
                .unwrap()
                .is_none()
        );
        fs::create_dir(output.join("sub")).unwrap();
        fs::write(output.join("sub/result.txt"), b"42\n").unwrap();
        let packed = pack_output(&output, tmp.path(), true, 1 << 20)
            .unwrap()
            .expect("packed");
        assert_eq!(packed.files, 1);
        let (digest, size) = cumulus_bundle::digest_file(packed.path()).unwrap();
        assert_eq!((digest, size), (packed.digest.clone(), packed.size_bytes));
        fs::write(output.join("big.bin"), vec![7u8; 4096]).unwrap();
        let err = pack_output(&output, tmp.path(), false, 1_000).unwrap_err();
        assert!(err.contains("big.bin"), "{err}");
    }

    #[test]
    fn sealing_refuses_a_hard_link_and_keeps_links_for_the_pack_to_judge() {
        let tmp = tempfile::tempdir().unwrap();
        let output = tmp.path().join("output");
        fs::create_dir(&output).unwrap();
        let outside = tmp.path().join("secret");
        fs::write(&outside, b"not the rank's").unwrap();
        fs::hard_link(&outside, output.join("linked")).unwrap();
        let err = seal_tree(&output).unwrap_err();
        assert!(err.contains("hard links"), "{err}");
        fs::remove_file(output.join("linked")).unwrap();
        std::os::unix::fs::symlink(&outside, output.join("escape")).unwrap();
        seal_tree(&output).expect("sealed");
        let err = pack_output(&output, tmp.path(), true, 1 << 20).unwrap_err();
        assert!(err.contains("outside"), "{err}");
    }
}
