//! Who a rank runs as, and the environment it starts with (docs/architecture.md, "Rank
//! isolation"; SECURITY.md).
//!
//! A job's code is untrusted by the agent: it must not read the agent's secrets (the
//! worker's TLS key, a token file, `/proc/<agent>/environ`), signal or trace other jobs'
//! ranks, or read their files. The kernel enforces that only between different users, so
//! an agent running as root starts ranks as another user ([`RunAs`], `--run-as`):
//! - `--run-as USER` (or `UID[:GID]`): every job's ranks run as that one account. They
//!   are kept from the agent, not from each other.
//! - `--run-as FIRST-LAST`: each job's ranks run as their own user and group, `FIRST +
//!   (job number mod (LAST - FIRST + 1))` for both, as systemd's `DynamicUser=` allocates
//!   ids: ranks of different jobs cannot signal, trace (`ptrace` needs equal uids *and*
//!   gids), or read each other's checkpoint and staging directories (group-owned by the
//!   job's gid, `0750`). Two live jobs whose numbers are congruent modulo the range size
//!   share an id: size the range above the jobs a worker sees at once.
//!
//! Without `--run-as` ranks run as the agent's own user; an agent running as root refuses
//! to start then unless `--allow-root` says that is intended (a development machine).
//!
//! Every rank starts with a minimal environment ([`RankIdentity::base_env`]): `PATH`,
//! `LANG`, `LANGUAGE`, `LC_*`, `TZ` and `TMPDIR` from the agent's, the variables named by
//! `--pass-env`, and `HOME`/`USER`/`LOGNAME` of the user it runs as; then the job's
//! `--env` and the rank contract variables (set by the supervisor). Nothing else of the
//! agent's environment reaches it.

use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use thiserror::Error;

/// Agent environment variables every rank inherits (a trailing `*` is a prefix).
pub const DEFAULT_PASS_ENV: &[&str] = &["PATH", "LANG", "LANGUAGE", "LC_*", "TZ", "TMPDIR"];
/// Most `--pass-env` entries.
pub const MAX_PASS_ENV: usize = 64;
/// Largest `--run-as` range (user ids).
pub const MAX_RUN_AS_RANGE: u32 = 1 << 20;
/// Prefix of the agent's own configuration variables: never passed to a rank, whatever
/// `--pass-env` says.
pub const AGENT_ENV_PREFIX: &str = "CUMULUS_";

/// Why `--run-as`, `--pass-env` or the agent's files do not allow starting.
#[derive(Debug, Error)]
pub enum IdentityError {
    /// `--run-as` could not be parsed or names no usable user.
    #[error("--run-as {value:?}: {why}")]
    RunAs {
        /// The flag's value.
        value: String,
        /// What is wrong.
        why: String,
    },
    /// A `--pass-env` entry is not a variable name or `PREFIX*`.
    #[error("--pass-env {0:?}: expected a variable name or PREFIX* (not CUMULUS_*)")]
    PassEnv(String),
    /// The agent runs as root, ranks would too, and `--allow-root` was not given.
    #[error(
        "refusing to run ranks as root: the agent runs as root and has no --run-as; pass \
         --run-as USER (or a uid range FIRST-LAST, one uid per job) so that job code cannot \
         read this agent's credentials, or --allow-root on a machine where that is intended"
    )]
    RootRanks,
    /// `--run-as` needs the privilege to change user, which the agent lacks.
    #[error(
        "--run-as needs the agent to run as root (it starts ranks as another user); this agent \
         runs as uid {0}"
    )]
    NotRoot(u32),
    /// Ranks running as another user could not reach a directory they need.
    #[error(
        "ranks run as another user and cannot reach {path} (mode {mode:04o}): give other \
         users search permission (chmod o+x) on it, or choose a --data-dir they can reach"
    )]
    Unreachable {
        /// The directory.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// A secret file is readable by users other than the agent's.
    #[error(
        "{what} {path} is readable by other users (mode {mode:04o}) while ranks run as \
         another user: chmod 600 {path}"
    )]
    SecretReadable {
        /// Which secret (`token file`, `TLS key`).
        what: &'static str,
        /// The file.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// A file could not be inspected.
    #[error("cannot inspect {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// The user and groups one rank runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankCreds {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Supplementary groups (all others are dropped): the group of the job a forked job
    /// resumes from, so that it can read that job's checkpoint.
    pub groups: Vec<u32>,
}

/// Who ranks run as (`--run-as`); see the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunAs {
    /// As the agent's own user (no `--run-as`).
    Agent,
    /// One account for every job.
    Account {
        /// User id (never 0).
        uid: u32,
        /// Primary group id.
        gid: u32,
        /// The account's name, when the password database knows it (`USER`, `LOGNAME`).
        name: Option<String>,
        /// Its home directory, when known (`HOME`).
        home: Option<OsString>,
    },
    /// Each job its own user and group: `first + job number mod count`.
    Range {
        /// First user id (at least 1).
        first: u32,
        /// How many ids (1..=[`MAX_RUN_AS_RANGE`]).
        count: u32,
    },
}

impl RunAs {
    /// Parses `--run-as`: a user name, `UID[:GID]` or `FIRST-LAST`.
    ///
    /// # Errors
    /// An unknown user, root (uid or gid 0), or a malformed or oversized range.
    pub fn parse(value: &str) -> Result<RunAs, IdentityError> {
        let fail = |why: &str| IdentityError::RunAs {
            value: value.to_string(),
            why: why.to_string(),
        };
        let value = value.trim();
        if let Some((first, last)) = value.split_once('-')
            && first.bytes().all(|b| b.is_ascii_digit())
            && !first.is_empty()
        {
            let first: u32 = first.parse().map_err(|_| fail("FIRST is not a uid"))?;
            let last: u32 = last.parse().map_err(|_| fail("LAST is not a uid"))?;
            if first == 0 || last < first {
                return Err(fail("a range FIRST-LAST needs 1 <= FIRST <= LAST"));
            }
            let count = last - first + 1;
            if count > MAX_RUN_AS_RANGE {
                return Err(fail(&format!(
                    "a range holds at most {MAX_RUN_AS_RANGE} ids"
                )));
            }
            return Ok(RunAs::Range { first, count });
        }
        let (user, group) = match value.split_once(':') {
            Some((u, g)) => (u, Some(g)),
            None => (value, None),
        };
        let numeric = !user.is_empty() && user.bytes().all(|b| b.is_ascii_digit());
        let entry = if numeric {
            let uid: u32 = user.parse().map_err(|_| fail("not a uid"))?;
            nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
                .map_err(|e| fail(&format!("cannot read the password database: {e}")))?
                .map(Ok)
                .unwrap_or(Err(uid))
        } else {
            match nix::unistd::User::from_name(user)
                .map_err(|e| fail(&format!("cannot read the password database: {e}")))?
            {
                Some(u) => Ok(u),
                None => return Err(fail("no such user")),
            }
        };
        let (uid, mut gid, name, home) = match entry {
            Ok(u) => (
                u.uid.as_raw(),
                u.gid.as_raw(),
                Some(u.name),
                Some(u.dir.into_os_string()),
            ),
            Err(uid) => (uid, uid, None, None),
        };
        if let Some(group) = group {
            gid = if group.bytes().all(|b| b.is_ascii_digit()) && !group.is_empty() {
                group.parse().map_err(|_| fail("GID is not a group id"))?
            } else {
                nix::unistd::Group::from_name(group)
                    .map_err(|e| fail(&format!("cannot read the group database: {e}")))?
                    .ok_or_else(|| fail("no such group"))?
                    .gid
                    .as_raw()
            };
        }
        if uid == 0 || gid == 0 {
            return Err(fail(
                "ranks must run as an unprivileged user and group (not uid or gid 0)",
            ));
        }
        Ok(RunAs::Account {
            uid,
            gid,
            name,
            home,
        })
    }

    /// The credentials of job `job_id`'s ranks, or `None` to run them as the agent.
    /// `resumes_from` is the job a forked job starts from: with a range its group is
    /// added, so that the job can read that job's checkpoint.
    pub fn creds(&self, job_id: &str, resumes_from: Option<&str>) -> Option<RankCreds> {
        match self {
            RunAs::Agent => None,
            RunAs::Account { uid, gid, .. } => Some(RankCreds {
                uid: *uid,
                gid: *gid,
                groups: Vec::new(),
            }),
            RunAs::Range { first, count } => {
                let id = |job: &str| first + (job_number(job) % u64::from(*count)) as u32;
                let own = id(job_id);
                let groups = resumes_from
                    .filter(|j| !j.is_empty() && *j != job_id)
                    .map(id)
                    .filter(|g| *g != own)
                    .into_iter()
                    .collect();
                Some(RankCreds {
                    uid: own,
                    gid: own,
                    groups,
                })
            }
        }
    }

    /// Whether ranks run as another user than the agent.
    pub fn is_other_user(&self) -> bool {
        !matches!(self, RunAs::Agent)
    }
}

/// The number of a job id (`job-000123` → 123; 0 for an id without digits).
fn job_number(job_id: &str) -> u64 {
    job_id
        .strip_prefix("job-")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// This agent's rank identity: who ranks run as and what of its environment they get.
#[derive(Debug, Clone)]
pub struct RankIdentity {
    /// Who ranks run as.
    pub run_as: RunAs,
    /// Variables (or `PREFIX*`) ranks inherit: [`DEFAULT_PASS_ENV`] plus `--pass-env`.
    pass_env: Vec<String>,
}

impl Default for RankIdentity {
    fn default() -> Self {
        RankIdentity {
            run_as: RunAs::Agent,
            pass_env: DEFAULT_PASS_ENV.iter().map(|s| s.to_string()).collect(),
        }
    }
}

impl RankIdentity {
    /// The identity of `--run-as`, `--allow-root` and `--pass-env`, checked against the
    /// user the agent runs as (`agent_uid`).
    ///
    /// # Errors
    /// See [`IdentityError`]: a bad flag, root ranks without `--allow-root`, `--run-as`
    /// without root.
    pub fn from_flags(
        run_as: Option<&str>,
        allow_root: bool,
        pass_env: &[String],
        agent_uid: u32,
    ) -> Result<RankIdentity, IdentityError> {
        let run_as = match run_as.map(str::trim).filter(|s| !s.is_empty()) {
            Some(value) => RunAs::parse(value)?,
            None => RunAs::Agent,
        };
        match (&run_as, agent_uid) {
            (RunAs::Agent, 0) if !allow_root => return Err(IdentityError::RootRanks),
            (RunAs::Account { uid, .. }, own) if own != 0 && *uid != own => {
                return Err(IdentityError::NotRoot(own));
            }
            (RunAs::Range { .. }, own) if own != 0 => return Err(IdentityError::NotRoot(own)),
            _ => {}
        }
        if pass_env.len() > MAX_PASS_ENV {
            return Err(IdentityError::PassEnv(format!(
                "{} entries (at most {MAX_PASS_ENV})",
                pass_env.len()
            )));
        }
        let mut patterns: Vec<String> = DEFAULT_PASS_ENV.iter().map(|s| s.to_string()).collect();
        for entry in pass_env.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
            let name = entry.strip_suffix('*').unwrap_or(entry);
            let valid = !name.is_empty()
                && name.len() <= 128
                && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                && !name.starts_with(AGENT_ENV_PREFIX)
                && !AGENT_ENV_PREFIX.starts_with(name);
            if !valid {
                return Err(IdentityError::PassEnv(entry.to_string()));
            }
            patterns.push(entry.to_string());
        }
        Ok(RankIdentity {
            run_as,
            pass_env: patterns,
        })
    }

    /// Whether `name` is inherited by ranks.
    fn passes(&self, name: &[u8]) -> bool {
        if name.starts_with(AGENT_ENV_PREFIX.as_bytes()) {
            return false;
        }
        self.pass_env.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix.as_bytes()),
            None => name == p.as_bytes(),
        })
    }

    /// The environment a rank starts from, before the job's variables and the contract:
    /// the inherited variables of `agent_env` and, for another user, its `HOME`, `USER`
    /// and `LOGNAME` (as the agent's own otherwise).
    pub fn base_env(
        &self,
        agent_env: impl IntoIterator<Item = (OsString, OsString)>,
    ) -> Vec<(OsString, OsString)> {
        let mut env: Vec<(OsString, OsString)> = Vec::new();
        let mut own_user: Vec<(OsString, OsString)> = Vec::new();
        for (name, value) in agent_env {
            if matches!(name.as_bytes(), b"HOME" | b"USER" | b"LOGNAME") {
                own_user.push((name, value));
            } else if self.passes(name.as_bytes()) {
                env.push((name, value));
            }
        }
        match &self.run_as {
            RunAs::Agent => env.extend(own_user),
            RunAs::Account { name, home, .. } => {
                if let Some(home) = home {
                    env.push(("HOME".into(), home.clone()));
                }
                if let Some(name) = name {
                    env.push(("USER".into(), name.into()));
                    env.push(("LOGNAME".into(), name.into()));
                }
            }
            RunAs::Range { .. } => {}
        }
        env
    }

    /// Checks, before the agent starts, what running ranks as another user needs: every
    /// directory from `/` to `data_dir` searchable by other users (ranks read their
    /// shards file there), and each of `secrets` (what, path) readable by the agent's
    /// user only. Nothing is checked when ranks run as the agent.
    ///
    /// # Errors
    /// [`IdentityError::Unreachable`], [`IdentityError::SecretReadable`], or
    /// [`IdentityError::Io`] when a path cannot be inspected.
    pub fn check_files(
        &self,
        data_dir: &Path,
        secrets: &[(&'static str, &Path)],
    ) -> Result<(), IdentityError> {
        if !self.run_as.is_other_user() {
            return Ok(());
        }
        let io = |path: &Path| {
            let path = path.display().to_string();
            move |source| IdentityError::Io { path, source }
        };
        let dir = std::fs::canonicalize(data_dir).map_err(io(data_dir))?;
        for ancestor in dir.ancestors() {
            let mode = std::fs::metadata(ancestor).map_err(io(ancestor))?.mode() & 0o7777;
            if mode & 0o001 == 0 {
                return Err(IdentityError::Unreachable {
                    path: ancestor.display().to_string(),
                    mode,
                });
            }
        }
        for (what, path) in secrets {
            let mode = std::fs::metadata(path).map_err(io(path))?.mode() & 0o7777;
            if mode & 0o077 != 0 {
                return Err(IdentityError::SecretReadable {
                    what,
                    path: path.display().to_string(),
                    mode,
                });
            }
        }
        Ok(())
    }
}

/// Whether `creds` may read the file or directory described by `meta` by its mode bits
/// (owner, then group among the primary and supplementary groups, then others; ACLs are
/// not consulted). A directory also needs search (`x`) permission.
pub fn readable_by(meta: &std::fs::Metadata, creds: &RankCreds) -> bool {
    let mode = meta.mode();
    let (read, search) = if meta.uid() == creds.uid {
        (0o400, 0o100)
    } else if meta.gid() == creds.gid || creds.groups.contains(&meta.gid()) {
        (0o040, 0o010)
    } else {
        (0o004, 0o001)
    };
    mode & read != 0 && (!meta.is_dir() || mode & search != 0)
}

/// Whether `creds` may search the directory, or execute the file, described by `meta`,
/// by its mode bits (owner, then group, then others, as [`readable_by`]).
fn executable_by(meta: &std::fs::Metadata, creds: &RankCreds) -> bool {
    let bit = if meta.uid() == creds.uid {
        0o100
    } else if meta.gid() == creds.gid || creds.groups.contains(&meta.gid()) {
        0o010
    } else {
        0o001
    };
    meta.mode() & bit != 0
}

/// What keeps `creds` from executing `program` ("cannot search DIR (mode 0700, owner
/// 0:0) on the way to PROGRAM"), by mode bits: the working directory it
/// cannot enter, a directory on the way to the program (as written and with links
/// resolved) it cannot search, the file itself, or, for a script, the same of its `#!`
/// interpreter. A `program` without `/` is looked up in `path_var` as `execvp` does (the
/// first file found); a relative one from `working_dir` (else the agent's). `None` when
/// the mode bits allow it all or nothing is found to blame. For the message of a rank
/// whose `exec` failed with `EACCES` under `--run-as`.
pub fn exec_blocker(
    program: &Path,
    path_var: Option<&std::ffi::OsStr>,
    working_dir: Option<&Path>,
    creds: &RankCreds,
) -> Option<String> {
    if let Some(dir) = working_dir
        && let Some(why) = blocker_on_way(dir, true, creds)
    {
        return Some(format!("{why} (the rank's working directory)"));
    }
    let base = working_dir
        .map(Path::to_path_buf)
        .or_else(|| std::env::current_dir().ok())?;
    let found = if program.as_os_str().as_bytes().contains(&b'/') {
        Some(base.join(program))
    } else {
        std::env::split_paths(path_var.unwrap_or_default())
            .map(|dir| base.join(dir).join(program))
            .find(|p| p.is_file())
    }?;
    if let Some(why) = blocker_on_way(&found, false, creds) {
        return Some(why);
    }
    // A script: the kernel also executes its interpreter as the rank's user.
    let mut head = [0u8; 256];
    let n = std::fs::File::open(&found)
        .and_then(|mut f| std::io::Read::read(&mut f, &mut head))
        .unwrap_or(0);
    let line = head[..n].strip_prefix(b"#!")?;
    let line = line.split(|b| *b == b'\n').next().unwrap_or_default();
    let interpreter = line
        .split(|b| b.is_ascii_whitespace())
        .find(|w| !w.is_empty())?;
    let interpreter = Path::new(std::ffi::OsStr::from_bytes(interpreter));
    blocker_on_way(interpreter, false, creds)
        .map(|why| format!("{why} (the interpreter of {})", found.display()))
}

/// "cannot search DIR (mode, owner) on the way to PATH": the first directory on the way
/// to `path` that `creds` cannot search (from `/` down, as written, then with links
/// resolved), or `path` itself when it is a directory (`is_dir`) it cannot search or a
/// file it cannot execute; `None` when none blocks.
fn blocker_on_way(path: &Path, is_dir: bool, creds: &RankCreds) -> Option<String> {
    let describe = |meta: &std::fs::Metadata| {
        format!(
            "mode {:04o}, owner {}:{}",
            meta.mode() & 0o7777,
            meta.uid(),
            meta.gid()
        )
    };
    let resolved = std::fs::canonicalize(path).ok();
    for way in std::iter::once(path).chain(resolved.as_deref()) {
        let mut ancestors: Vec<&Path> = way.ancestors().skip(1).collect();
        ancestors.reverse();
        for dir in ancestors {
            let Ok(meta) = std::fs::metadata(dir) else {
                continue;
            };
            if !executable_by(&meta, creds) {
                return Some(format!(
                    "cannot search {} ({}) on the way to {}",
                    dir.display(),
                    describe(&meta),
                    way.display()
                ));
            }
        }
    }
    let meta = std::fs::metadata(path).ok()?;
    if executable_by(&meta, creds) {
        return None;
    }
    Some(format!(
        "cannot {} {} ({})",
        if is_dir { "search" } else { "execute" },
        path.display(),
        describe(&meta),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_as_parses_names_ids_and_ranges() {
        assert_eq!(
            RunAs::parse("60000-60009").expect("a valid range"),
            RunAs::Range {
                first: 60000,
                count: 10
            }
        );
        match RunAs::parse("nobody").expect("Debian has the nobody account") {
            RunAs::Account { uid, name, .. } => {
                assert_ne!(uid, 0);
                assert_eq!(name.as_deref(), Some("nobody"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            RunAs::parse("4242:4343").expect("numeric ids need no account"),
            RunAs::Account {
                uid: 4242,
                gid: 4343,
                name: None,
                home: None
            }
        );
        for bad in [
            "root",
            "0",
            "5:0",
            "0-10",
            "10-5",
            "1-2000000",
            "no-such-user-here",
            "",
        ] {
            assert!(RunAs::parse(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn range_gives_each_job_its_own_ids_and_a_fork_the_parent_group() {
        let run_as = RunAs::Range {
            first: 60000,
            count: 100,
        };
        let a = run_as
            .creds("job-000007", None)
            .expect("a range gives credentials");
        assert_eq!((a.uid, a.gid), (60007, 60007));
        assert!(a.groups.is_empty());
        let b = run_as
            .creds("job-000108", Some("job-000007"))
            .expect("a range gives credentials");
        assert_eq!((b.uid, b.gid, b.groups), (60008, 60008, vec![60007]));
        assert_eq!(RunAs::Agent.creds("job-000001", None), None);
    }

    #[test]
    fn flags_refuse_root_ranks_and_bad_pass_env() {
        assert!(matches!(
            RankIdentity::from_flags(None, false, &[], 0),
            Err(IdentityError::RootRanks)
        ));
        assert!(RankIdentity::from_flags(None, true, &[], 0).is_ok());
        assert!(RankIdentity::from_flags(None, false, &[], 1000).is_ok());
        assert!(matches!(
            RankIdentity::from_flags(Some("60000-60001"), false, &[], 1000),
            Err(IdentityError::NotRoot(1000))
        ));
        for bad in ["CUMULUS_TOKEN", "CUMULUS_*", "CUM*", "*", "A-B", "X=1"] {
            assert!(
                RankIdentity::from_flags(None, true, &[bad.to_string()], 0).is_err(),
                "{bad:?} was accepted"
            );
        }
    }

    #[test]
    fn exec_blocker_names_what_the_ranks_user_cannot_reach() {
        use std::os::unix::fs::PermissionsExt;
        let chmod = |p: &Path, mode: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).expect("chmod")
        };
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path();
        chmod(root, 0o755);
        // `closed` is like /root: its owner only. `open` is reachable by everyone.
        let (closed, open) = (root.join("closed"), root.join("open"));
        for d in [&closed, &open] {
            std::fs::create_dir(d).expect("mkdir");
        }
        let interp = closed.join("python3");
        std::fs::write(&interp, "").expect("write");
        chmod(&interp, 0o755);
        chmod(&closed, 0o700);
        std::os::unix::fs::symlink(&interp, open.join("python")).expect("symlink");
        std::fs::write(
            open.join("script"),
            format!("#!{} -u\nprint()\n", open.join("python").display()),
        )
        .expect("write");
        chmod(&open.join("script"), 0o755);
        std::fs::write(open.join("private"), "").expect("write");
        chmod(&open.join("private"), 0o700);
        std::fs::write(open.join("tool"), "").expect("write");
        chmod(&open.join("tool"), 0o755);

        let other = RankCreds {
            uid: 4242,
            gid: 4242,
            groups: Vec::new(),
        };
        let blocked = |program: &str, path: Option<&str>, wd: Option<&Path>| {
            exec_blocker(
                Path::new(program),
                path.map(std::ffi::OsStr::new),
                wd,
                &other,
            )
        };
        let search_closed = format!("cannot search {} (mode 0700, owner ", closed.display());
        // Through a symlink (a venv's python into a pyenv under /root).
        let why = blocked(&open.join("python").display().to_string(), None, None).expect("blocked");
        assert!(
            why.starts_with(&search_closed)
                && why.ends_with(&format!("on the way to {}", interp.display())),
            "{why}"
        );
        // A script whose interpreter is out of reach, found in PATH.
        let path = format!("/nonexistent:{}", open.display());
        let why = blocked("script", Some(&path), None).expect("blocked");
        assert!(
            why.starts_with(&search_closed)
                && why.ends_with(&format!(
                    "(the interpreter of {})",
                    open.join("script").display()
                )),
            "{why}"
        );
        // A file without the execute bit for others.
        let why = blocked("private", Some(&path), None).expect("blocked");
        assert!(
            why.starts_with(&format!(
                "cannot execute {} (mode 0700",
                open.join("private").display()
            )),
            "{why}"
        );
        // A working directory out of reach; a relative program from it.
        let why = blocked("./tool", None, Some(&closed)).expect("blocked");
        assert!(
            why.starts_with(&format!("cannot search {} (mode 0700", closed.display()))
                && why.ends_with("(the rank's working directory)"),
            "{why}"
        );
        // Nothing to blame: reachable, or not found at all.
        assert_eq!(blocked("./tool", None, Some(&open)), None);
        assert_eq!(blocked("tool", Some(&path), None), None);
        assert_eq!(blocked("no-such-program", Some(&path), None), None);
        // The owner itself is not blocked.
        let owner = RankCreds {
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
            groups: Vec::new(),
        };
        let program = open.join("python");
        assert_eq!(exec_blocker(&program, None, None, &owner), None);
    }

    #[test]
    fn base_env_keeps_only_what_is_passed() {
        let identity = RankIdentity::from_flags(Some("nobody"), false, &["NCCL_*".into()], 0)
            .expect("valid flags");
        let agent: Vec<(OsString, OsString)> = [
            ("PATH", "/usr/bin"),
            ("LC_ALL", "C"),
            ("NCCL_DEBUG", "INFO"),
            ("CUMULUS_TOKEN", "secret"),
            ("AWS_SECRET_ACCESS_KEY", "secret"),
            ("HOME", "/root"),
            ("USER", "root"),
        ]
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
        let env = identity.base_env(agent);
        let get = |k: &str| {
            env.iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.to_string_lossy().into_owned())
        };
        assert_eq!(get("PATH").as_deref(), Some("/usr/bin"));
        assert_eq!(get("LC_ALL").as_deref(), Some("C"));
        assert_eq!(get("NCCL_DEBUG").as_deref(), Some("INFO"));
        assert_eq!(get("CUMULUS_TOKEN"), None);
        assert_eq!(get("AWS_SECRET_ACCESS_KEY"), None);
        assert_eq!(get("USER").as_deref(), Some("nobody"));
        assert_ne!(get("HOME").as_deref(), Some("/root"));
    }
}
