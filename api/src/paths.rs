//! Which host paths a job may name, and under which roots.
//!
//! A job's dataset and checkpoint dir are opened, listed and created by processes that
//! are not the submitter: the leader lists a local dataset and creates the checkpoint
//! root, the agent creates staging and step directories under it, with their own
//! (often root) rights. Two rules keep a submitter inside what the operator allows:
//!
//! 1. [`check_job_path`]: a job path is absolute, normalized and holds no `.` or `..`
//!    component (`/srv/a/../elsewhere` once made the leader create `/srv/elsewhere`);
//!    checked by the CLI and at the leader's admission.
//! 2. [`Roots`]: with `--allowed-dataset-roots` / `--allowed-ckpt-roots`, a coordinator
//!    or agent touches a job path only if it lies under one of the roots, both as written
//!    and once every symlink on it is resolved ([`Roots::check_resolved`]), so a symlink
//!    inside a root cannot lead outside it.
//!
//! A refusal says only that the path is outside the allowed roots: never whether it
//! exists, is a symlink or is readable, which would let a submitter probe the host.
//!
//! Between the resolved check and the use, a symlink could still be swapped in by
//! someone who can write inside a root (a time-of-check race); roots should be
//! directories that only the operator and the agents write to, with per-job subdirectories.

use std::fmt;
use std::path::{Path, PathBuf};

/// Which kind of path a check is about, for messages and flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathKind {
    /// The job's dataset directory (`--dataset`).
    Dataset,
    /// The job's checkpoint root (`--ckpt-dir`).
    Checkpoint,
    /// The ranks' working directory (`--working-dir`).
    WorkingDir,
}

impl PathKind {
    /// The spec field, as users see it in errors.
    pub fn field(self) -> &'static str {
        match self {
            PathKind::Dataset => "dataset",
            PathKind::Checkpoint => "ckpt_dir",
            PathKind::WorkingDir => "working_dir",
        }
    }

    /// The flag of the coordinator and agent that sets the roots for this kind.
    pub fn roots_flag(self) -> &'static str {
        match self {
            PathKind::Dataset => "--allowed-dataset-roots",
            PathKind::Checkpoint | PathKind::WorkingDir => "--allowed-ckpt-roots",
        }
    }
}

impl fmt::Display for PathKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.field())
    }
}

/// Why a job path was refused. The text names the field and, for a root violation,
/// only the roots: nothing about what exists on the host.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// Not absolute.
    #[error("{kind} {path:?} must be an absolute path")]
    NotAbsolute {
        /// Which path.
        kind: PathKind,
        /// The path as given.
        path: String,
    },
    /// A `.` or `..` component, or a repeated or trailing `/`: give the path as the
    /// directory's own name.
    #[error("{kind} {path:?} must be a normalized absolute path, without '.' or '..' components")]
    NotNormalized {
        /// Which path.
        kind: PathKind,
        /// The path as given.
        path: String,
    },
    /// Outside every allowed root, as written or once its symlinks are resolved.
    #[error("{kind} {path:?} is outside the allowed roots ({roots}; set by {flag})")]
    OutsideRoots {
        /// Which path.
        kind: PathKind,
        /// The path as given.
        path: String,
        /// The allowed roots, comma-separated.
        roots: String,
        /// The flag that sets them.
        flag: &'static str,
    },
}

/// Checks that `path` is absolute and normalized: it starts with `/`, has no `.` or `..`
/// component, no empty component (`//`) and no trailing `/` (except `/` itself).
///
/// # Errors
/// [`PathError::NotAbsolute`] or [`PathError::NotNormalized`].
pub fn check_job_path(kind: PathKind, path: &str) -> Result<(), PathError> {
    if !path.starts_with('/') {
        return Err(PathError::NotAbsolute {
            kind,
            path: path.to_owned(),
        });
    }
    let normalized = path == "/"
        || path[1..]
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..");
    if normalized {
        Ok(())
    } else {
        Err(PathError::NotNormalized {
            kind,
            path: path.to_owned(),
        })
    }
}

/// The roots under which one kind of job path must lie; empty means any path (no
/// `--allowed-*-roots` given).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Roots {
    kind: Option<PathKind>,
    /// Each root as configured (absolute, normalized).
    given: Vec<PathBuf>,
    /// Each root with its symlinks resolved, when it exists.
    resolved: Vec<PathBuf>,
}

/// A configured root that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RootError {
    /// Not an absolute, normalized path.
    #[error("{flag}: {root:?} must be an absolute path without '.' or '..' components")]
    NotNormalized {
        /// The flag.
        flag: &'static str,
        /// The root as given.
        root: String,
    },
    /// It cannot be resolved (it does not exist, or is unreadable).
    #[error("{flag}: {root:?} cannot be resolved: {source}")]
    Unresolvable {
        /// The flag.
        flag: &'static str,
        /// The root as given.
        root: String,
        /// Why.
        source: std::io::Error,
    },
}

impl Roots {
    /// No restriction.
    pub fn any() -> Roots {
        Roots::default()
    }

    /// The roots for `kind`; each must be an absolute, normalized path to an existing
    /// directory (resolved once here, so a root that is itself a symlink works).
    ///
    /// # Errors
    /// [`RootError`] naming the first root that is not usable.
    pub fn new(kind: PathKind, roots: &[PathBuf]) -> Result<Roots, RootError> {
        let mut out = Roots {
            kind: Some(kind),
            ..Roots::default()
        };
        for root in roots {
            let text = root.to_string_lossy().into_owned();
            if check_job_path(kind, &text).is_err() {
                return Err(RootError::NotNormalized {
                    flag: kind.roots_flag(),
                    root: text,
                });
            }
            let resolved =
                std::fs::canonicalize(root).map_err(|source| RootError::Unresolvable {
                    flag: kind.roots_flag(),
                    root: text.clone(),
                    source,
                })?;
            out.given.push(root.clone());
            out.resolved.push(resolved);
        }
        Ok(out)
    }

    /// True when no root is configured (any path is allowed).
    pub fn is_any(&self) -> bool {
        self.given.is_empty()
    }

    /// The roots as configured, comma-separated (for messages).
    pub fn describe(&self) -> String {
        let given: Vec<_> = self.given.iter().map(|p| p.display().to_string()).collect();
        given.join(",")
    }

    fn outside(&self, path: &str) -> PathError {
        let kind = self.kind.unwrap_or(PathKind::Dataset);
        PathError::OutsideRoots {
            kind,
            path: path.to_owned(),
            roots: self.describe(),
            flag: kind.roots_flag(),
        }
    }

    /// Checks `path` (already [`check_job_path`]-valid) as written: it must be a root or
    /// lie under one, component by component (`/data2` is not under `/data`). No I/O.
    ///
    /// # Errors
    /// [`PathError::OutsideRoots`].
    pub fn check_lexical(&self, path: &str) -> Result<(), PathError> {
        if self.is_any() {
            return Ok(());
        }
        let p = Path::new(path);
        if self
            .given
            .iter()
            .chain(&self.resolved)
            .any(|root| p.starts_with(root))
        {
            Ok(())
        } else {
            Err(self.outside(path))
        }
    }

    /// Checks `path` with every symlink resolved: the deepest existing ancestor of `path`
    /// (the path itself when it exists) is resolved and must lie under a resolved root;
    /// the components below it do not exist yet, so nothing can redirect them. Blocking
    /// (a `realpath` per missing component at most); call it off a runtime thread.
    ///
    /// # Errors
    /// [`PathError::OutsideRoots`] also when no ancestor can be resolved: the message
    /// never says which.
    pub fn check_resolved(&self, path: &str) -> Result<(), PathError> {
        self.check_lexical(path)?;
        if self.is_any() {
            return Ok(());
        }
        let mut probe = Path::new(path);
        loop {
            match std::fs::canonicalize(probe) {
                Ok(real) => {
                    return if self.resolved.iter().any(|root| real.starts_with(root)) {
                        Ok(())
                    } else {
                        Err(self.outside(path))
                    };
                }
                // Only a component that does not exist is skipped (nothing below it
                // can be a symlink yet); one that exists but does not resolve (a
                // dangling symlink, no permission) is refused.
                Err(_) => match (std::fs::symlink_metadata(probe), probe.parent()) {
                    (Err(e), Some(parent)) if e.kind() == std::io::ErrorKind::NotFound => {
                        probe = parent;
                    }
                    _ => return Err(self.outside(path)),
                },
            }
        }
    }
}

/// `--allowed-dataset-roots` and `--allowed-ckpt-roots`, the same on coordinators and
/// agents (feature `clap`).
#[cfg(feature = "clap")]
#[derive(Clone, Debug, Default, clap::Args)]
pub struct RootsArgs {
    /// Directories under which a job's local dataset must lie, comma-separated (default:
    /// anywhere). The leader lists a dataset and the agents hand its files to ranks with
    /// their own rights: on a shared cluster, set this so a submitter cannot make them
    /// list `/etc`. Checked as written and with symlinks resolved; each root must exist.
    /// Give coordinators and agents the same roots.
    #[arg(long, env = "CUMULUS_ALLOWED_DATASET_ROOTS", value_delimiter = ',')]
    pub allowed_dataset_roots: Vec<PathBuf>,
    /// Directories under which a job's checkpoint dir must lie, comma-separated (default:
    /// anywhere). The leader creates a missing checkpoint dir, and the agents staging and
    /// step directories under it, with their own rights.
    #[arg(long, env = "CUMULUS_ALLOWED_CKPT_ROOTS", value_delimiter = ',')]
    pub allowed_ckpt_roots: Vec<PathBuf>,
}

#[cfg(feature = "clap")]
impl RootsArgs {
    /// The roots the flags name.
    ///
    /// # Errors
    /// [`RootError`] for the first root that is not an existing, normalized directory.
    pub fn load(&self) -> Result<JobRoots, RootError> {
        JobRoots::new(&self.allowed_dataset_roots, &self.allowed_ckpt_roots)
    }
}

/// The roots of one process (coordinator or agent) for every kind of job path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobRoots {
    /// Where a local dataset may lie (`--allowed-dataset-roots`).
    pub dataset: Roots,
    /// Where a checkpoint root may lie (`--allowed-ckpt-roots`).
    pub ckpt: Roots,
}

impl JobRoots {
    /// Builds both from the flags' values (empty: any path).
    ///
    /// # Errors
    /// [`RootError`] for the first unusable root.
    pub fn new(dataset: &[PathBuf], ckpt: &[PathBuf]) -> Result<JobRoots, RootError> {
        Ok(JobRoots {
            dataset: Roots::new(PathKind::Dataset, dataset)?,
            ckpt: Roots::new(PathKind::Checkpoint, ckpt)?,
        })
    }

    /// The checks that need no I/O, for a job's `dataset`, `ckpt_dir` and `working_dir`
    /// (each may be empty: not set): every set path is absolute and normalized
    /// ([`check_job_path`]), and a local dataset and the checkpoint root lie under their
    /// roots as written ([`Roots::check_lexical`]). An `s3://` dataset is not a host path.
    ///
    /// # Errors
    /// The first [`PathError`].
    pub fn check_spec_lexical(
        &self,
        dataset: &str,
        ckpt_dir: &str,
        working_dir: &str,
    ) -> Result<(), PathError> {
        if !dataset.is_empty() && !dataset.starts_with("s3://") {
            check_job_path(PathKind::Dataset, dataset)?;
            self.dataset.check_lexical(dataset)?;
        }
        if !ckpt_dir.is_empty() {
            check_job_path(PathKind::Checkpoint, ckpt_dir)?;
            self.ckpt.check_lexical(ckpt_dir)?;
        }
        if !working_dir.is_empty() {
            check_job_path(PathKind::WorkingDir, working_dir)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_paths_must_be_absolute_and_normalized() {
        for ok in [
            "/",
            "/srv",
            "/srv/a/b",
            "/srv/a b/c.d",
            "/srv/..a",
            "/srv/a..",
        ] {
            check_job_path(PathKind::Dataset, ok).expect(ok);
        }
        assert!(matches!(
            check_job_path(PathKind::Dataset, "srv/a"),
            Err(PathError::NotAbsolute { .. })
        ));
        for bad in [
            "/srv/a/../elsewhere",
            "/srv/./a",
            "/srv//a",
            "/srv/a/",
            "/..",
            "/srv/.",
        ] {
            assert!(
                matches!(
                    check_job_path(PathKind::Checkpoint, bad),
                    Err(PathError::NotNormalized { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn roots_compare_whole_components_and_resolve_symlinks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = std::fs::canonicalize(dir.path()).expect("canonical");
        let root = base.join("data");
        let outside = base.join("data2");
        std::fs::create_dir_all(root.join("set")).expect("mkdir");
        std::fs::create_dir_all(outside.join("secret")).expect("mkdir");
        std::os::unix::fs::symlink(&outside, root.join("escape")).expect("symlink");
        std::os::unix::fs::symlink(root.join("set"), root.join("alias")).expect("symlink");
        std::os::unix::fs::symlink(outside.join("none"), root.join("dangling")).expect("symlink");
        let roots = Roots::new(PathKind::Dataset, std::slice::from_ref(&root)).expect("roots");
        let s = |p: &Path| p.to_str().expect("utf-8").to_owned();

        roots.check_resolved(&s(&root)).expect("the root itself");
        roots.check_resolved(&s(&root.join("set"))).expect("inside");
        roots
            .check_resolved(&s(&root.join("alias")))
            .expect("a symlink that stays inside");
        roots
            .check_resolved(&s(&root.join("new/deeper")))
            .expect("missing components under the root");
        let refused = [
            outside.join("secret"),
            root.join("escape"),
            root.join("escape/secret"),
            root.join("escape/missing/deeper"),
            root.join("dangling"),
            root.join("dangling/deeper"),
            PathBuf::from("/etc"),
        ];
        let mut messages = Vec::new();
        for p in &refused {
            let err = roots.check_resolved(&s(p)).expect_err(&s(p));
            assert!(matches!(err, PathError::OutsideRoots { .. }), "{err}");
            messages.push(err.to_string().replace(&s(p), "PATH"));
        }
        // The same words whether the path exists, is missing, or escapes by a symlink.
        assert!(messages.windows(2).all(|w| w[0] == w[1]), "{messages:?}");
        assert!(messages[0].contains("--allowed-dataset-roots"));
    }

    #[test]
    fn a_root_through_a_symlink_accepts_both_spellings() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = std::fs::canonicalize(dir.path()).expect("canonical");
        std::fs::create_dir_all(base.join("real/ckpt")).expect("mkdir");
        std::os::unix::fs::symlink(base.join("real"), base.join("link")).expect("symlink");
        let roots = Roots::new(PathKind::Checkpoint, &[base.join("link")]).expect("roots");
        let s = |p: PathBuf| p.to_str().expect("utf-8").to_owned();
        roots
            .check_resolved(&s(base.join("link/ckpt")))
            .expect("as configured");
        roots
            .check_resolved(&s(base.join("real/ckpt")))
            .expect("resolved");
        assert!(roots.check_lexical(&s(base.join("other"))).is_err());
    }

    #[test]
    fn spec_paths_are_normalized_and_under_their_roots() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = std::fs::canonicalize(dir.path()).expect("canonical");
        std::fs::create_dir_all(base.join("data")).expect("mkdir");
        std::fs::create_dir_all(base.join("ckpt")).expect("mkdir");
        let roots = JobRoots::new(&[base.join("data")], &[base.join("ckpt")]).expect("roots");
        let s = |p: &str| base.join(p).to_str().expect("utf-8").to_owned();
        roots
            .check_spec_lexical(&s("data/set"), &s("ckpt/job"), "/work")
            .expect("inside");
        roots
            .check_spec_lexical("s3://bucket/set", "", "")
            .expect("an S3 dataset is not a host path");
        let err = roots
            .check_spec_lexical(&s("ckpt/set"), "", "")
            .expect_err("a dataset under the checkpoint root");
        assert!(err.to_string().contains("--allowed-dataset-roots"), "{err}");
        let err = roots
            .check_spec_lexical("", &s("ckpt/../data/x"), "")
            .expect_err("dot-dot");
        assert!(matches!(err, PathError::NotNormalized { .. }), "{err}");
        let err = roots
            .check_spec_lexical("", "", "/srv/../etc")
            .expect_err("dot-dot in the working dir");
        assert!(err.to_string().starts_with("working_dir"), "{err}");
        JobRoots::default()
            .check_spec_lexical("/anywhere", "/any/ckpt", "")
            .expect("no roots");
    }

    #[test]
    fn bad_roots_are_refused_at_start() {
        assert!(matches!(
            Roots::new(PathKind::Dataset, &[PathBuf::from("relative")]),
            Err(RootError::NotNormalized { .. })
        ));
        assert!(matches!(
            Roots::new(
                PathKind::Dataset,
                &[PathBuf::from("/no/such/root/anywhere")]
            ),
            Err(RootError::Unresolvable { .. })
        ));
        assert!(Roots::any().is_any());
        Roots::any()
            .check_resolved("/anything")
            .expect("no roots: any path");
    }
}
