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
