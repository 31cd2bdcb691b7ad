//! The data dir is private to the coordinator's user.
//!
//! It holds the Raft log (WAL and sled), and with it every job's `--env` and the users'
//! token hashes: another local user, a rank of a job on the same host included, must not
//! read it. The binary sets its umask to `0077` before anything else (see `main.rs`), so
//! what sled and the WAL create is `0700`/`0600`; [`prepare`] creates the data dir `0700`
//! and, at every start, takes the group and other bits off the dir and everything in it
//! (a data dir written by an older binary or created by hand), with a warning. A data dir
//! owned by another user is refused: its owner could change it under the coordinator.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::Path;

use anyhow::{Context, bail};

/// Permission bits of the group and of other users.
const SHARED_BITS: u32 = 0o077;

/// What [`prepare`] had to tighten.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tightened {
    /// The data dir's own mode before, when it was group- or world-accessible.
    pub dir_mode_was: Option<u32>,
    /// Entries below it (files and dirs) whose group and other bits were cleared.
    pub entries: usize,
}

/// Creates `data_dir` (mode `0700`; missing parents with the umask's mode) or checks the
/// existing one, refuses it when another user owns it, and clears the group and other
/// permission bits of the dir and of every file and dir below it (symbolic links are not
/// followed). A warning is logged when anything was tightened.
///
/// # Errors
/// When the dir cannot be created, inspected or changed, is not a directory, or is owned
/// by another user than the process's effective one.
pub fn prepare(data_dir: &Path) -> anyhow::Result<Tightened> {
    let tightened = prepare_as(data_dir, nix::unistd::geteuid().as_raw())?;
    if tightened != Tightened::default() {
        tracing::warn!(
            data_dir = %data_dir.display(),
            mode_was = ?tightened.dir_mode_was.map(|m| format!("{m:04o}")),
            entries = tightened.entries,
            "the data dir was readable by other users; its group and other permissions \
             are removed (it holds the Raft log: job environments, token hashes)"
        );
    }
    Ok(tightened)
}

/// [`prepare`] for a process whose effective user id is `euid`.
fn prepare_as(data_dir: &Path, euid: u32) -> anyhow::Result<Tightened> {
    let shown = data_dir.display();
    if let Some(parent) = data_dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating the parent of the data dir {shown}"))?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(data_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e).with_context(|| format!("creating the data dir {shown}")),
    }
    let meta =
        std::fs::metadata(data_dir).with_context(|| format!("inspecting the data dir {shown}"))?;
    if !meta.is_dir() {
        bail!("the data dir {shown} exists and is not a directory");
    }
    if meta.uid() != euid {
        bail!(
            "the data dir {shown} is owned by uid {}, and this coordinator runs as uid {euid}: \
             its owner could change the Raft log under it; chown it or choose another --data-dir",
            meta.uid()
        );
    }
    let mut tightened = Tightened::default();
    let mode = meta.mode() & 0o7777;
    if mode & SHARED_BITS != 0 {
        chmod(data_dir, mode & !SHARED_BITS)?;
        tightened.dir_mode_was = Some(mode);
    }
    tighten_below(data_dir, euid, &mut tightened)?;
    Ok(tightened)
}

/// Clears the group and other bits of every entry below `dir` that `euid` owns,
/// recursively; symbolic links are neither changed nor followed.
fn tighten_below(dir: &Path, euid: u32, tightened: &mut Tightened) -> anyhow::Result<()> {
    let entries = std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))?;
    for entry in entries {
        let path = entry
            .with_context(|| format!("listing {}", dir.display()))?
            .path();
        let meta = std::fs::symlink_metadata(&path)
            .with_context(|| format!("inspecting {}", path.display()))?;
        if meta.file_type().is_symlink() || meta.uid() != euid {
            continue;
        }
        let mode = meta.mode() & 0o7777;
        if mode & SHARED_BITS != 0 {
            chmod(&path, mode & !SHARED_BITS)?;
            tightened.entries += 1;
        }
        if meta.is_dir() {
            tighten_below(&path, euid, tightened)?;
        }
    }
    Ok(())
}

fn chmod(path: &Path, mode: u32) -> anyhow::Result<()> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("making {} private (mode {mode:04o})", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(path: &Path) -> u32 {
        std::fs::symlink_metadata(path).expect("stat").mode() & 0o7777
    }

    fn euid() -> u32 {
        nix::unistd::geteuid().as_raw()
    }

    #[test]
    fn a_new_data_dir_is_private_and_needs_nothing_tightened() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("a/b/data");
        let tightened = prepare_as(&dir, euid()).expect("prepare");
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(tightened, Tightened::default());
        // A second start finds it as it left it.
        assert_eq!(
            prepare_as(&dir, euid()).expect("again"),
            Tightened::default()
        );
    }

    #[test]
    fn an_open_data_dir_and_everything_in_it_are_tightened() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("data");
        let raft = dir.join("raft");
        let wal = raft.join("wal");
        std::fs::create_dir_all(&wal).expect("mkdir");
        let segment = wal.join("00000001.log");
        std::fs::write(&segment, b"x").expect("write");
        let private = raft.join("db");
        std::fs::write(&private, b"x").expect("write");
        for (path, m) in [
            (&dir, 0o755),
            (&raft, 0o750),
            (&wal, 0o711),
            (&segment, 0o644),
            (&private, 0o600),
        ] {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(m)).expect("chmod");
        }
        // A link is left alone, and so is what it points to.
        let outside = tmp.path().join("outside");
        std::fs::write(&outside, b"x").expect("write");
        std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        std::os::unix::fs::symlink(&outside, dir.join("link")).expect("symlink");

        let tightened = prepare_as(&dir, euid()).expect("prepare");
        assert_eq!(
            tightened,
            Tightened {
                dir_mode_was: Some(0o755),
                entries: 3
            }
        );
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&raft), 0o700);
        assert_eq!(mode(&wal), 0o700);
        assert_eq!(mode(&segment), 0o600);
        assert_eq!(mode(&private), 0o600);
        assert_eq!(mode(&outside), 0o644);
    }

    #[test]
    fn a_data_dir_of_another_user_or_a_file_is_refused() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("data");
        std::fs::create_dir(&dir).expect("mkdir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let err = prepare_as(&dir, euid().wrapping_add(1)).expect_err("another user's dir");
        assert!(err.to_string().contains("is owned by uid"), "{err:#}");
        assert_eq!(mode(&dir), 0o755, "a refused dir is not changed");

        let file = tmp.path().join("file");
        std::fs::write(&file, b"x").expect("write");
        let err = prepare_as(&file, euid()).expect_err("a file");
        assert!(err.to_string().contains("not a directory"), "{err:#}");
    }
}
