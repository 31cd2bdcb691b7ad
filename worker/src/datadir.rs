//! The agent's data dir is closed to other users.
//!
//! Below it live the ranks' logs (whatever a job prints, secrets included), the pid
//! records, and the certificate and key of enrolment (`tls/`). [`prepare`] creates the
//! data dir and, at every start, sets its mode: `0700` when ranks run as the agent's own
//! user, `0711` when they run as other users (`--run-as`), who must pass through it to
//! their shards file, the dataset cache, the checkpoint store and the rank API's socket
//! but may not list it. `logs/`, `pids/` and `tls/` are `0700` in both cases. A data dir
//! that was open to other users is tightened with a warning; one owned by another user is
//! refused.
//!
//! The agent does not change its umask: the checkpoint store and the dataset cache give
//! ranks of other users the access they need through the modes they create with, and
//! ranks inherit the agent's umask.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::Path;

use anyhow::{Context, bail};

/// Mode of the data dir when ranks run as the agent's user.
pub const PRIVATE_MODE: u32 = 0o700;
/// Mode of the data dir when ranks run as other users: they may enter it by a path they
/// know (search), not list it.
pub const SEARCH_ONLY_MODE: u32 = 0o711;
/// Directories of the data dir that ranks never enter: `0700` whoever ranks run as. The
/// first two are created at start; the last (enrolment's) only when enrolling.
pub const PRIVATE_SUBDIRS: &[&str] = &["logs", "pids", crate::enrol::ENROL_DIR];
/// How many of [`PRIVATE_SUBDIRS`] are created at start.
const CREATED_SUBDIRS: usize = 2;

/// What [`prepare`] changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Changed {
    /// The data dir's mode before, when it was open beyond what ranks need (a warning).
    pub tightened_from: Option<u32>,
    /// The private subdirs that were open to others and were tightened (a warning).
    pub subdirs_tightened: Vec<&'static str>,
}

/// Creates `data_dir` (missing parents with the umask's mode), refuses it when another
/// user owns it, and sets its mode ([`PRIVATE_MODE`], or [`SEARCH_ONLY_MODE`] when
/// `ranks_other_user`) and that of the [`PRIVATE_SUBDIRS`] (created `0700`). Logs a
/// warning when something was open to other users.
///
/// # Errors
/// When the dir cannot be created, inspected or changed, is not a directory, or is owned
/// by another user than the agent's effective one.
pub fn prepare(data_dir: &Path, ranks_other_user: bool) -> anyhow::Result<Changed> {
    let changed = prepare_as(data_dir, ranks_other_user, nix::unistd::geteuid().as_raw())?;
    if let Some(was) = changed.tightened_from {
        tracing::warn!(
            data_dir = %data_dir.display(),
            mode_was = format!("{was:04o}"),
            "the data dir was open to other users (it holds the ranks' logs and the agent's \
             key); its mode is tightened"
        );
    }
    if !changed.subdirs_tightened.is_empty() {
        tracing::warn!(
            data_dir = %data_dir.display(),
            subdirs = ?changed.subdirs_tightened,
            "directories of the data dir were open to other users; made 0700"
        );
    }
    Ok(changed)
}

/// [`prepare`] for an agent whose effective user id is `euid`.
fn prepare_as(data_dir: &Path, ranks_other_user: bool, euid: u32) -> anyhow::Result<Changed> {
    let shown = data_dir.display();
    if let Some(parent) = data_dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create the parent of --data-dir {shown}"))?;
    }
    create_private(data_dir).with_context(|| format!("cannot create --data-dir {shown}"))?;
    let meta = std::fs::metadata(data_dir)
        .with_context(|| format!("cannot inspect --data-dir {shown}"))?;
    if !meta.is_dir() {
        bail!("--data-dir {shown} exists and is not a directory");
    }
    if meta.uid() != euid {
        bail!(
            "--data-dir {shown} is owned by uid {}, and this agent runs as uid {euid}: its \
             owner could change the agent's records and keys; chown it or choose another \
             --data-dir",
            meta.uid()
        );
    }
    let want = if ranks_other_user {
        SEARCH_ONLY_MODE
    } else {
        PRIVATE_MODE
    };
    let mut changed = Changed::default();
    let mode = meta.mode() & 0o777;
    if mode != want {
        if mode & !want != 0 {
            changed.tightened_from = Some(mode);
        }
        chmod(data_dir, (meta.mode() & 0o7000) | want)?;
    }
    for (i, name) in PRIVATE_SUBDIRS.iter().enumerate() {
        let dir = data_dir.join(name);
        if i < CREATED_SUBDIRS {
            create_private(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        }
        let meta = match std::fs::symlink_metadata(&dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            other => other.with_context(|| format!("cannot inspect {}", dir.display()))?,
        };
        if !meta.is_dir() {
            bail!("{} exists and is not a directory", dir.display());
        }
        if meta.mode() & 0o077 != 0 {
            chmod(&dir, meta.mode() & 0o7700)?;
            changed.subdirs_tightened.push(name);
        }
    }
    Ok(changed)
}

/// `mkdir` with mode `0700`; an existing entry is left for the caller to inspect.
fn create_private(dir: &Path) -> std::io::Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        other => other,
    }
}

fn chmod(path: &Path, mode: u32) -> anyhow::Result<()> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("cannot set the mode of {} to {mode:04o}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).expect("stat").mode() & 0o7777
    }

    fn euid() -> u32 {
        nix::unistd::geteuid().as_raw()
    }

    #[test]
    fn a_new_data_dir_is_private_or_search_only() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let own = tmp.path().join("parent/own");
        assert_eq!(
            prepare_as(&own, false, euid()).expect("prepare"),
            Changed::default()
        );
        assert_eq!(mode(&own), 0o700);
        let other = tmp.path().join("other");
        assert_eq!(
            prepare_as(&other, true, euid()).expect("prepare"),
            Changed::default(),
            "opening a new dir to search is no warning"
        );
        assert_eq!(mode(&other), 0o711);
        for dir in [&own, &other] {
            assert_eq!(mode(&dir.join("logs")), 0o700);
            assert_eq!(mode(&dir.join("pids")), 0o700);
            assert!(!dir.join("tls").exists(), "made by enrolment only");
        }
    }

    #[test]
    fn an_open_data_dir_and_its_private_subdirs_are_tightened() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("data");
        std::fs::create_dir_all(dir.join("logs")).expect("mkdir");
        std::fs::create_dir_all(dir.join("tls")).expect("mkdir");
        std::fs::create_dir_all(dir.join("jobs")).expect("mkdir");
        for (path, m) in [
            (dir.clone(), 0o755),
            (dir.join("logs"), 0o755),
            (dir.join("tls"), 0o750),
        ] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(m)).expect("chmod");
        }
        std::fs::set_permissions(dir.join("jobs"), std::fs::Permissions::from_mode(0o711))
            .expect("chmod");
        let changed = prepare_as(&dir, false, euid()).expect("prepare");
        assert_eq!(
            changed,
            Changed {
                tightened_from: Some(0o755),
                subdirs_tightened: vec!["logs", "tls"],
            }
        );
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("logs")), 0o700);
        assert_eq!(mode(&dir.join("tls")), 0o700);
        assert_eq!(
            mode(&dir.join("jobs")),
            0o711,
            "the ranks' dirs keep the modes the agent gives them"
        );
        // Ranks of other users: the same dir becomes search-only, with no warning.
        let changed = prepare_as(&dir, true, euid()).expect("prepare");
        assert_eq!(changed, Changed::default());
        assert_eq!(mode(&dir), 0o711);
        // And back: 0711 is open beyond 0700 (a warning).
        let changed = prepare_as(&dir, false, euid()).expect("prepare");
        assert_eq!(changed.tightened_from, Some(0o711));
        assert_eq!(mode(&dir), 0o700);
    }

    #[test]
    fn a_data_dir_of_another_user_or_a_file_is_refused() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("data");
        std::fs::create_dir(&dir).expect("mkdir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let err = prepare_as(&dir, false, euid().wrapping_add(1)).expect_err("another user's");
        assert!(err.to_string().contains("is owned by uid"), "{err:#}");
        assert_eq!(mode(&dir), 0o755, "a refused dir is not changed");
        let file = tmp.path().join("file");
        std::fs::write(&file, b"x").expect("write");
        let err = prepare_as(&file, false, euid()).expect_err("a file");
        assert!(err.to_string().contains("not a directory"), "{err:#}");
    }
}
