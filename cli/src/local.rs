//! `local up|down|status`: a cluster of background processes on 127.0.0.1 under one
//! directory (`--local-dir`, default `.cumulus`).
//!
//! Layout: `token` and `peer-token` (0600), `cluster.json`, `tls/` (0700, keys 0600),
//! `coord-<i>/` (0700) + `coord-<i>.log` (0600) per coordinator (node ids 1..=n),
//! `worker-<j>/` (0700, 0711 with `--run-as`) + `worker-<j>.log` (0600) per worker.
//!
//! Ranks: run by root, `up` starts its workers with `--run-as` [`DEFAULT_RANK_UIDS`] (a
//! uid and gid per job), so that a job's code can read none of the above; it first
//! checks that other users can reach the local dir ([`check_other_user_ranks`]).
//! `--allow-root` runs them as root ([`Ranks`]). The choice applies to the workers a
//! call starts: restarting a partly dead cluster leaves its live workers as they are.
//! Each process runs in its own process group, so a ctrl-c of `cumulusctl` (or its exit)
//! does not reach it; `local down` stops it by the PID recorded in `cluster.json`, after
//! checking in `/proc/<pid>/cmdline` that the PID still names our binary and data dir.
//!
//! Ports: each coordinator needs a gRPC and an HTTP port, chosen by binding 127.0.0.1:0
//! and releasing the socket just before the coordinator starts. Another process may
//! take such a port in between (a small race); the coordinator then exits with an
//! address-in-use error, which `up` reports with the tail of its log.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::net::TcpListener;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cumulus_api::ClusterStatusResponse;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::Serialize;

use crate::client::{Client, RetryPolicy};
use crate::config::{ClusterFile, Conn, CoordinatorEntry, WorkerEntry, read_token_file};

/// The coordinator binary's name.
pub const COORDINATOR_BIN: &str = "cumulus-coordinator";
/// The worker agent binary's name.
pub const WORKER_BIN: &str = "cumulus-worker";
/// The example trainer binary's name.
pub const TRAINER_BIN: &str = "cumulus-trainer";
/// How long `up` waits for a leader and every worker, by default.
pub const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How long `down` waits after SIGTERM before SIGKILL.
pub const TERM_GRACE: Duration = Duration::from_secs(10);
/// Default number of coordinators.
pub const DEFAULT_COORDINATORS: u32 = 3;
/// Default number of workers.
pub const DEFAULT_WORKERS: u32 = 2;
/// Default slots per worker.
pub const DEFAULT_SLOTS: u32 = 4;
/// Bytes of a log shown when a process dies during `up`.
pub const LOG_TAIL_BYTES: u64 = 4096;
/// The user ids the ranks of a local cluster run as when `up` runs as root, one per job
/// (`cumulus-worker --run-as`): uid = gid = 60000 + job number mod 1000.
pub const DEFAULT_RANK_UIDS: &str = "60000-60999";

/// Who the ranks of the workers `up` starts run as.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Ranks {
    /// Run by root: as other users, [`DEFAULT_RANK_UIDS`]. Run by another user: as that
    /// user (an agent can change user only as root).
    #[default]
    Default,
    /// As root: as these users (`cumulus-worker --run-as`: a uid range `FIRST-LAST`, a
    /// user name, or `UID[:GID]`).
    RunAs(String),
    /// As root: as root too (`cumulus-worker --allow-root`): the ranks' code can read the
    /// cluster's token, the peer token and every key of the local dir.
    Root,
}

impl Ranks {
    /// The worker flags of `self` for an `up` run as root (`root`) or not.
    ///
    /// # Errors
    /// [`LocalError::Other`] for `--run-as` or `--allow-root` without root.
    pub fn worker_flags(&self, root: bool) -> Result<Vec<String>, LocalError> {
        match (self, root) {
            (Ranks::Default, true) => Ok(vec!["--run-as".into(), DEFAULT_RANK_UIDS.into()]),
            (Ranks::RunAs(value), true) => Ok(vec!["--run-as".into(), value.clone()]),
            (Ranks::Root, true) => Ok(vec!["--allow-root".into()]),
            (Ranks::Default, false) => Ok(Vec::new()),
            (Ranks::RunAs(_) | Ranks::Root, false) => Err(LocalError::Other(format!(
                "--run-as and --allow-root need `cumulusctl local up` to run as root; run by \
                 uid {}, its ranks run as that user",
                nix::unistd::geteuid()
            ))),
        }
    }
}

/// Errors of the local cluster commands.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    /// I/O on a named path.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A binary was not found.
    #[error(
        "cannot find {name} (looked in {looked}); build it with `cargo build` or pass --bin-dir"
    )]
    BinaryNotFound {
        /// Binary name.
        name: String,
        /// Where we looked.
        looked: String,
    },
    /// A recorded process is still running.
    #[error(
        "a local cluster is already running under {dir} (pids {pids}); stop it with `cumulusctl local down`"
    )]
    AlreadyRunning {
        /// The local dir.
        dir: PathBuf,
        /// Live pids.
        pids: String,
    },
    /// The recorded cluster differs from the requested shape.
    #[error(
        "{dir} holds a cluster with {recorded}, but {requested} was asked; use `cumulusctl local down --purge` first for a new shape"
    )]
    ShapeMismatch {
        /// The local dir.
        dir: PathBuf,
        /// What is recorded.
        recorded: String,
        /// What was asked.
        requested: String,
    },
    /// State from an unrecorded cluster is in the way.
    #[error("{0} exists but no cluster.json records it; remove it or choose another --local-dir")]
    StaleState(PathBuf),
    /// No cluster is recorded.
    #[error("no local cluster under {0} (no cluster.json); start one with `cumulusctl local up`")]
    NotFound(PathBuf),
    /// A process exited while the cluster was coming up.
    #[error("{name} exited during startup ({status}); last lines of {log}:\n{tail}")]
    Exited {
        /// Which process.
        name: String,
        /// Its exit status.
        status: String,
        /// Its log file.
        log: PathBuf,
        /// The end of its log.
        tail: String,
    },
    /// The cluster did not become ready in time.
    #[error("the cluster was not ready after {secs} s: {last}; logs are in {dir}")]
    NotReady {
        /// Seconds waited.
        secs: u64,
        /// The last thing seen.
        last: String,
        /// Where the logs are.
        dir: PathBuf,
    },
    /// Ranks would run as other users who cannot reach the local dir.
    #[error(
        "the ranks of this cluster run as other users (--run-as {run_as}), who cannot reach \
         {dir}: {blocked} is mode {mode:04o} (no search permission for others). Choose a \
         --local-dir that other users can reach (o+x on every directory down to it), or \
         pass --allow-root (ranks then run as root, and their code can read the cluster's \
         token and keys)"
    )]
    Unreachable {
        /// The local dir.
        dir: PathBuf,
        /// The directory on the way that others cannot search.
        blocked: PathBuf,
        /// Its permission bits.
        mode: u32,
        /// Who the ranks run as.
        run_as: String,
    },
    /// The rank uid range lies outside this user namespace's ids.
    #[error(
        "the ranks of this cluster would run as ids {run_as}, which this user namespace \
         does not map (/proc/self/{map}: {mapped}); pass --run-as with a range inside it, \
         or --allow-root (ranks then run as root)"
    )]
    Unmapped {
        /// Who the ranks run as.
        run_as: String,
        /// `uid_map` or `gid_map`.
        map: &'static str,
        /// The map's ranges (inside id, length), one line each joined by `; `.
        mapped: String,
    },
    /// The cluster's certificates could not be made or used.
    #[error("TLS: {0}")]
    Tls(#[from] cumulus_tls::TlsError),
    /// Something else (config, client), with context.
    #[error("{0}")]
    Other(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> LocalError + '_ {
    move |source| LocalError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Finds a binary: in `bin_dir` when given (only there), else next to this executable,
/// else in `PATH`.
pub fn find_binary(name: &str, bin_dir: Option<&Path>) -> Result<PathBuf, LocalError> {
    let is_exe = |p: &Path| {
        p.metadata()
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    };
    if let Some(dir) = bin_dir {
        let p = dir.join(name);
        return if is_exe(&p) {
            Ok(absolute(&p))
        } else {
            Err(LocalError::BinaryNotFound {
                name: name.into(),
                looked: dir.display().to_string(),
            })
        };
    }
    let mut looked = Vec::new();
    if let Ok(exe) = std::env::current_exe()
        && let Some(dir) = exe.parent()
    {
        let p = dir.join(name);
        if is_exe(&p) {
            return Ok(p);
        }
        looked.push(dir.display().to_string());
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join(name);
            if is_exe(&p) {
                return Ok(absolute(&p));
            }
        }
    }
    looked.push("PATH".into());
    Err(LocalError::BinaryNotFound {
        name: name.into(),
        looked: looked.join(", "),
    })
}

fn absolute(p: &Path) -> PathBuf {
    crate::dataset::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

/// Lowest port `local up` hands out.
pub const LOCAL_PORT_MIN: u16 = 10_000;
/// One past the highest: below Linux's ephemeral range (32768–60999), so no outgoing
/// connection — say, a coordinator dialing its peers while they start — can take a
/// chosen port before the process it is meant for binds it.
pub const LOCAL_PORT_END: u16 = 32_000;

/// `n` distinct free TCP ports on 127.0.0.1 outside the ephemeral range, from a random
/// start (bound together, then released; see the module docs for the remaining race
/// with other programs choosing fixed ports).
pub fn free_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let span = u32::from(LOCAL_PORT_END - LOCAL_PORT_MIN);
    let start = rand::random::<u32>() % span;
    let mut listeners = Vec::with_capacity(n);
    for i in 0..span {
        if listeners.len() == n {
            break;
        }
        let port = LOCAL_PORT_MIN + ((start + i) % span) as u16;
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
            listeners.push(l);
        }
    }
    if listeners.len() < n {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            format!("fewer than {n} free ports in {LOCAL_PORT_MIN}..{LOCAL_PORT_END}"),
        ));
    }
    listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect()
}

/// A random 32-byte token as 64 hex characters.
pub fn new_token() -> String {
    hex::encode(rand::random::<[u8; 32]>())
}

/// Creates a process's data dir `0700`, as the coordinator and the agent want it (they
/// tighten a more open one at start, with a warning).
fn create_data_dir(dir: &Path) -> Result<(), LocalError> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_err(dir))
}

/// Writes the token file with mode 0600 (also when it existed with another mode).
pub fn write_token(path: &Path, token: &str) -> Result<(), LocalError> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(io_err(path))?;
    f.set_permissions(fs::Permissions::from_mode(0o600))
        .map_err(io_err(path))?;
    f.write_all(token.as_bytes()).map_err(io_err(path))?;
    f.write_all(b"\n").map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))?;
    Ok(())
}

/// The planned cluster under `dir` (absolute) with the given ports (2 per coordinator).
pub fn plan(dir: &Path, coordinators: u32, workers: u32, slots: u32, ports: &[u16]) -> ClusterFile {
    assert!(
        ports.len() >= 2 * coordinators as usize,
        "two ports per coordinator"
    );
    ClusterFile {
        token_file: dir.join("token"),
        tls_dir: None,
        coordinators: (1..=coordinators)
            .map(|i| {
                let k = (i - 1) as usize;
                CoordinatorEntry {
                    node_id: i as u64,
                    grpc: format!("127.0.0.1:{}", ports[2 * k]),
                    http: format!("127.0.0.1:{}", ports[2 * k + 1]),
                    pid: None,
                    data_dir: dir.join(format!("coord-{i}")),
                    log: dir.join(format!("coord-{i}.log")),
                }
            })
            .collect(),
        workers: (1..=workers)
            .map(|j| WorkerEntry {
                worker_id: format!("worker-{j}"),
                pid: None,
                data_dir: dir.join(format!("worker-{j}")),
                log: dir.join(format!("worker-{j}.log")),
                slots,
            })
            .collect(),
    }
}

/// Arguments of coordinator `c` (after the binary).
pub fn coordinator_args(file: &ClusterFile, c: &CoordinatorEntry) -> Vec<String> {
    let mut a = vec![
        "--node-id".to_string(),
        c.node_id.to_string(),
        "--grpc-listen".into(),
        c.grpc.clone(),
        "--http-listen".into(),
        c.http.clone(),
    ];
    for p in &file.coordinators {
        a.push("--peer".into());
        a.push(format!("{}={}@{}", p.node_id, p.grpc, p.http));
    }
    a.extend([
        "--data-dir".into(),
        c.data_dir.display().to_string(),
        "--token-file".into(),
        file.token_file.display().to_string(),
        "--peer-token-file".into(),
        file.peer_token_file().display().to_string(),
    ]);
    a.extend(tls_args(file, &format!("coordinator-{}", c.node_id)));
    a
}

/// The TLS flags of the process whose certificate files are named `name` in the
/// cluster's TLS dir, or `--insecure` without one.
fn tls_args(file: &ClusterFile, name: &str) -> Vec<String> {
    match &file.tls_dir {
        Some(dir) => {
            let pair = cumulus_tls::generate::PairFiles::in_dir(dir, name);
            vec![
                "--tls-cert".into(),
                pair.cert.display().to_string(),
                "--tls-key".into(),
                pair.key.display().to_string(),
                "--tls-ca".into(),
                dir.join(cumulus_tls::generate::CA_FILE)
                    .display()
                    .to_string(),
            ]
        }
        None => vec!["--insecure".into()],
    }
}

/// Makes the cluster CA and one certificate per coordinator (`coordinator-N`, naming
/// `cumulus://coordinator/N`) and per worker (`worker-ID`) in `dir`, keys 0600. Every
/// process of a local cluster listens on 127.0.0.1, which each certificate names.
///
/// # Errors
/// [`LocalError::Tls`] when generating or writing fails.
pub fn make_certificates(dir: &Path, file: &ClusterFile) -> Result<(), LocalError> {
    use cumulus_tls::Identity;
    let ca = cumulus_tls::generate::ClusterCa::generate("cumulus local cluster")?;
    ca.write(dir)?;
    for c in &file.coordinators {
        ca.issue(&Identity::Coordinator(c.node_id), &[])?
            .write(dir, &format!("coordinator-{}", c.node_id))?;
    }
    for w in &file.workers {
        ca.issue(&Identity::Worker(w.worker_id.clone()), &[])?
            .write(dir, &w.worker_id)?;
    }
    Ok(())
}

/// Arguments of worker `w` (after the binary), with `ranks`: who its ranks run as
/// ([`Ranks::worker_flags`]).
pub fn worker_args(file: &ClusterFile, w: &WorkerEntry, ranks: &[String]) -> Vec<String> {
    let mut a = vec![
        "--worker-id".into(),
        w.worker_id.clone(),
        "--coordinators".into(),
        file.grpc_addrs().join(","),
        "--token-file".into(),
        file.token_file.display().to_string(),
        "--data-dir".into(),
        w.data_dir.display().to_string(),
        "--slots".into(),
        w.slots.to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
    ];
    a.extend(ranks.iter().cloned());
    a.extend(tls_args(file, &w.worker_id));
    a
}

/// The first directory from `/` down to `dir` (absolute) that other users cannot search
/// (`o+x`), with its mode: ranks running as other users cannot reach a data dir below it.
///
/// # Errors
/// A directory on the way cannot be inspected.
pub fn closed_to_others(dir: &Path) -> Result<Option<(PathBuf, u32)>, LocalError> {
    let mut ways: Vec<&Path> = dir.ancestors().collect();
    ways.reverse();
    for d in ways {
        let mode = fs::metadata(d).map_err(io_err(d))?.permissions().mode() & 0o7777;
        if mode & 0o001 == 0 {
            return Ok(Some((d.to_path_buf(), mode)));
        }
    }
    Ok(None)
}

/// Whether every id of `first..=last` lies inside one range of a user namespace map
/// (`/proc/self/uid_map` or `gid_map`: lines of "inside outside length").
pub fn ids_mapped(map: &str, first: u32, last: u32) -> bool {
    map.lines().any(|line| {
        let f: Vec<u64> = line
            .split_whitespace()
            .filter_map(|n| n.parse().ok())
            .collect();
        matches!(f.as_slice(), [inside, _, len] if *inside <= u64::from(first)
            && u64::from(last) < inside + len)
    })
}

/// Checks, before any worker starts, what ranks running as other users (`run_as`, the
/// value of `--run-as`) need of a local cluster under `dir`: a way into it for others
/// (their shards files and the rank API's socket lie in the workers' data dirs), and,
/// for a uid range, ids this user namespace maps.
///
/// # Errors
/// [`LocalError::Unreachable`], [`LocalError::Unmapped`].
pub fn check_other_user_ranks(dir: &Path, run_as: &str) -> Result<(), LocalError> {
    if let Some((blocked, mode)) = closed_to_others(dir)? {
        return Err(LocalError::Unreachable {
            dir: dir.to_path_buf(),
            blocked,
            mode,
            run_as: run_as.into(),
        });
    }
    let range = run_as
        .split_once('-')
        .and_then(|(a, b)| Some((a.trim().parse::<u32>().ok()?, b.trim().parse::<u32>().ok()?)));
    if let Some((first, last)) = range {
        for map in ["uid_map", "gid_map"] {
            let Ok(text) = fs::read_to_string(format!("/proc/self/{map}")) else {
                continue; // no user namespaces: every id is the host's
            };
            if !ids_mapped(&text, first, last) {
                return Err(LocalError::Unmapped {
                    run_as: run_as.into(),
                    map,
                    mapped: text
                        .lines()
                        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
                        .collect::<Vec<_>>()
                        .join("; "),
                });
            }
        }
    }
    Ok(())
}

/// Starts `bin args…` in its own process group, stdin null, stdout+stderr appended to `log`
/// (created `0600`, and made so when it was more open: what a process logs is its user's).
pub fn spawn_detached(bin: &Path, args: &[String], log: &Path) -> Result<Child, LocalError> {
    let out = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(log)
        .map_err(io_err(log))?;
    out.set_permissions(fs::Permissions::from_mode(0o600))
        .map_err(io_err(log))?;
    let err = out.try_clone().map_err(io_err(log))?;
    Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
        .map_err(io_err(bin))
}

/// Whether `pid` is a live (non-zombie) process running `binary` with `data_dir` among
/// its arguments, i.e. still the process we started and not a reused PID.
pub fn is_ours(pid: u32, binary: &str, data_dir: &Path) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next());
    if matches!(state, Some("Z" | "X") | None) {
        return false;
    }
    let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    let Some(argv0) = args.first() else {
        return false;
    };
    let name_ok = Path::new(std::str::from_utf8(argv0).unwrap_or(""))
        .file_name()
        .and_then(|n| n.to_str())
        == Some(binary);
    let dir = data_dir.as_os_str().as_encoded_bytes();
    name_ok && args.iter().skip(1).any(|a| *a == dir)
}

/// One process of the local cluster.
#[derive(Debug, Clone, Serialize)]
pub struct Proc {
    /// "coordinator 1" / "worker-1".
    pub name: String,
    /// The binary name.
    pub binary: &'static str,
    /// Recorded pid.
    pub pid: Option<u32>,
    /// Its data dir.
    pub data_dir: PathBuf,
    /// Its log.
    pub log: PathBuf,
}

impl Proc {
    /// Whether the recorded pid is alive and ours.
    pub fn alive(&self) -> bool {
        self.pid
            .is_some_and(|p| is_ours(p, self.binary, &self.data_dir))
    }
}

/// Every process recorded in `file`, coordinators first.
pub fn processes(file: &ClusterFile) -> Vec<Proc> {
    let mut v: Vec<Proc> = file
        .coordinators
        .iter()
        .map(|c| Proc {
            name: format!("coordinator {}", c.node_id),
            binary: COORDINATOR_BIN,
            pid: c.pid,
            data_dir: c.data_dir.clone(),
            log: c.log.clone(),
        })
        .collect();
    v.extend(file.workers.iter().map(|w| Proc {
        name: w.worker_id.clone(),
        binary: WORKER_BIN,
        pid: w.pid,
        data_dir: w.data_dir.clone(),
        log: w.log.clone(),
    }));
    v
}

/// The last lines of a log (at most [`LOG_TAIL_BYTES`]).
pub fn log_tail(path: &Path) -> String {
    let Ok(mut f) = File::open(path) else {
        return format!("({} cannot be read)", path.display());
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)));
    let mut buf = Vec::new();
    let _ = f.take(LOG_TAIL_BYTES).read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// What `up` asks for.
#[derive(Debug, Clone)]
pub struct UpOptions {
    /// The local dir (created if absent).
    pub dir: PathBuf,
    /// Coordinators (default: as recorded, else 3).
    pub coordinators: Option<u32>,
    /// Workers (default: as recorded, else 2).
    pub workers: Option<u32>,
    /// Slots per worker (default: as recorded, else 4).
    pub slots: Option<u32>,
    /// Where the binaries are.
    pub bin_dir: Option<PathBuf>,
    /// How long to wait for readiness.
    pub ready_timeout: Duration,
    /// A new cluster runs plaintext (`--insecure`) instead of making a CA and
    /// certificates; a recorded cluster keeps what it was made with.
    pub insecure: bool,
    /// Who the ranks of the workers this call starts run as.
    pub ranks: Ranks,
}

/// A started local cluster.
#[derive(Debug)]
pub struct Started {
    /// The local dir (absolute).
    pub dir: PathBuf,
    /// What was started (pids filled in).
    pub file: ClusterFile,
    /// The child handles (for reaping when this process stops the cluster itself).
    pub children: Vec<Child>,
    /// Whether an existing cluster was restarted (its data kept).
    pub restarted: bool,
    /// The cluster token.
    pub token: String,
    /// The cluster status seen when ready.
    pub status: ClusterStatusResponse,
    /// Time from start to ready.
    pub elapsed: Duration,
    /// Who the ranks of the workers started run as: the worker flags
    /// ([`Ranks::worker_flags`]; empty: as the user running `up`).
    pub rank_flags: Vec<String>,
}

impl Started {
    /// How to reach this cluster.
    ///
    /// # Errors
    /// The cluster's CA certificate cannot be read.
    pub fn conn(&self) -> Result<Conn, LocalError> {
        local_conn(&self.file, &self.token)
    }
}

/// The worker flags of `ranks` for this user ([`Ranks::worker_flags`]), with what ranks
/// of other users need of `dir` checked ([`check_other_user_ranks`]); on a refusal, `dir`
/// is removed again when this call `created` it (and it is still empty).
fn rank_flags_checked(ranks: &Ranks, dir: &Path, created: bool) -> Result<Vec<String>, LocalError> {
    let flags = ranks.worker_flags(nix::unistd::geteuid().is_root())?;
    if let [flag, run_as] = flags.as_slice()
        && flag == "--run-as"
        && let Err(e) = check_other_user_ranks(dir, run_as)
    {
        if created {
            let _ = fs::remove_dir(dir);
        }
        return Err(e);
    }
    Ok(flags)
}

/// Starts the local cluster (or restarts the recorded one) and waits until it is ready.
/// On a startup failure the processes already started are left running for inspection
/// only when `keep_on_failure`; otherwise they are stopped.
pub async fn up(opts: &UpOptions, keep_on_failure: bool) -> Result<Started, LocalError> {
    let start = Instant::now();
    let created = !opts.dir.exists();
    fs::create_dir_all(&opts.dir).map_err(io_err(&opts.dir))?;
    let dir = opts.dir.canonicalize().map_err(io_err(&opts.dir))?;
    let coord_bin = find_binary(COORDINATOR_BIN, opts.bin_dir.as_deref())?;
    let worker_bin = find_binary(WORKER_BIN, opts.bin_dir.as_deref())?;
    let rank_flags = rank_flags_checked(&opts.ranks, &dir, created)?;

    let recorded = ClusterFile::load(&dir).map_err(|e| LocalError::Other(e.to_string()))?;
    let (mut file, token, restarted) = match recorded {
        Some(mut file) => {
            let procs = processes(&file);
            let live: Vec<String> = procs
                .iter()
                .filter(|p| p.alive())
                .map(|p| p.pid.unwrap_or(0).to_string())
                .collect();
            // Every process up: nothing to do. Some up: the dead ones are started again
            // below, the live ones kept (a partly dead cluster is restarted in place).
            if live.len() == procs.len() {
                return Err(LocalError::AlreadyRunning {
                    dir,
                    pids: live.join(", "),
                });
            }
            let rec_slots = file.workers.first().map_or(DEFAULT_SLOTS, |w| w.slots);
            let recorded_shape = (
                file.coordinators.len() as u32,
                file.workers.len() as u32,
                rec_slots,
            );
            let asked = (
                opts.coordinators.unwrap_or(recorded_shape.0),
                opts.workers.unwrap_or(recorded_shape.1),
                opts.slots.unwrap_or(recorded_shape.2),
            );
            if asked != recorded_shape {
                return Err(LocalError::ShapeMismatch {
                    dir,
                    recorded: shape_text(recorded_shape),
                    requested: shape_text(asked),
                });
            }
            let token =
                read_token_file(&file.token_file).map_err(|e| LocalError::Other(e.to_string()))?;
            // Local dirs made before the peer token get one now.
            if !file.peer_token_file().exists() {
                write_token(&file.peer_token_file(), &new_token())?;
            }
            // A process restarted by hand is the cluster's: not started twice.
            adopt_running(&mut file);
            (file, token, true)
        }
        None => {
            let n = opts.coordinators.unwrap_or(DEFAULT_COORDINATORS);
            let m = opts.workers.unwrap_or(DEFAULT_WORKERS);
            let slots = opts.slots.unwrap_or(DEFAULT_SLOTS);
            let ports = free_ports(2 * n as usize).map_err(io_err(Path::new("127.0.0.1:0")))?;
            let file = plan(&dir, n, m, slots, &ports);
            for p in processes(&file) {
                if p.data_dir.exists() {
                    return Err(LocalError::StaleState(p.data_dir));
                }
            }
            let mut file = file;
            if !opts.insecure {
                let tls_dir = dir.join("tls");
                make_certificates(&tls_dir, &file)?;
                file.tls_dir = Some(tls_dir);
            }
            let token = new_token();
            write_token(&file.token_file, &token)?;
            write_token(&file.peer_token_file(), &new_token())?;
            (file, token, false)
        }
    };
    file.store(&dir)
        .map_err(|e| LocalError::Other(e.to_string()))?;

    let mut children = Vec::new();
    let spawned = (|| -> Result<(), LocalError> {
        for i in 0..file.coordinators.len() {
            let c = file.coordinators[i].clone();
            if c.pid.is_some() {
                continue; // alive (a partial restart keeps it)
            }
            create_data_dir(&c.data_dir)?;
            let child = spawn_detached(&coord_bin, &coordinator_args(&file, &c), &c.log)?;
            file.coordinators[i].pid = Some(child.id());
            children.push((format!("coordinator {}", c.node_id), c.log.clone(), child));
        }
        for j in 0..file.workers.len() {
            let w = file.workers[j].clone();
            if w.pid.is_some() {
                continue; // alive (a partial restart keeps it)
            }
            create_data_dir(&w.data_dir)?;
            let child = spawn_detached(&worker_bin, &worker_args(&file, &w, &rank_flags), &w.log)?;
            file.workers[j].pid = Some(child.id());
            children.push((w.worker_id.clone(), w.log.clone(), child));
        }
        Ok(())
    })();
    file.store(&dir)
        .map_err(|e| LocalError::Other(e.to_string()))?;
    let fail = |e: LocalError, file: &ClusterFile, children: Vec<(String, PathBuf, Child)>| {
        if !keep_on_failure {
            // Only what this call started: processes that were up before are left alone.
            let started: Vec<u32> = children.iter().map(|(_, _, c)| c.id()).collect();
            let ours: Vec<Proc> = processes(file)
                .into_iter()
                .filter(|p| p.pid.is_some_and(|pid| started.contains(&pid)))
                .collect();
            let _ = stop_processes(&ours, TERM_GRACE);
            reap(children.into_iter().map(|(_, _, c)| c).collect());
            let mut f = file.clone();
            for p in f
                .coordinators
                .iter_mut()
                .map(|c| &mut c.pid)
                .chain(f.workers.iter_mut().map(|w| &mut w.pid))
            {
                if p.is_some_and(|pid| started.contains(&pid)) {
                    *p = None;
                }
            }
            let _ = f.store(&dir);
        }
        e
    };
    if let Err(e) = spawned {
        return Err(fail(e, &file, children));
    }

    let conn = match local_conn(&file, &token) {
        Ok(conn) => conn,
        Err(e) => return Err(fail(e, &file, children)),
    };
    let expected: Vec<String> = file.workers.iter().map(|w| w.worker_id.clone()).collect();
    match wait_ready(&conn, &expected, &mut children, opts.ready_timeout, &dir).await {
        Ok(status) => Ok(Started {
            dir,
            file,
            children: children.into_iter().map(|(_, _, c)| c).collect(),
            restarted,
            token,
            status,
            elapsed: start.elapsed(),
            rank_flags,
        }),
        Err(e) => Err(fail(e, &file, children)),
    }
}

/// How to reach the cluster `file` records, with its token.
///
/// # Errors
/// The cluster's CA certificate cannot be read.
pub fn local_conn(file: &ClusterFile, token: &str) -> Result<Conn, LocalError> {
    let tls = file
        .ca_file()
        .as_deref()
        .map(crate::config::client_tls)
        .transpose()
        .map_err(|e| LocalError::Other(e.to_string()))?;
    Ok(Conn {
        retry_total: std::time::Duration::from_secs(30),
        grpc: file.grpc_addrs(),
        http: file.http_addrs(),
        token: token.to_owned(),
        tls,
    })
}

fn shape_text((c, w, s): (u32, u32, u32)) -> String {
    format!("{c} coordinators, {w} workers × {s} slots")
}

/// Records the pid of every process of the cluster that runs although its recorded
/// pid does not: one restarted by hand (with the command line `up` wrote to its log, or
/// by a supervisor), found in `/proc` by its binary and data dir ([`is_ours`]). The
/// others keep their pids, dead ones cleared. Returns the names of the processes
/// adopted; `cluster.json` is the caller's to store.
pub fn adopt_running(file: &mut ClusterFile) -> Vec<String> {
    let procs = processes(file);
    let alive: Vec<bool> = procs.iter().map(Proc::alive).collect();
    let candidates: Vec<u32> = if alive.iter().all(|a| *a) {
        Vec::new()
    } else {
        fs::read_dir("/proc")
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
                    .collect()
            })
            .unwrap_or_default()
    };
    let pids = file
        .coordinators
        .iter_mut()
        .map(|c| &mut c.pid)
        .chain(file.workers.iter_mut().map(|w| &mut w.pid));
    let mut adopted = Vec::new();
    for ((pid, alive), p) in pids.zip(alive).zip(&procs) {
        if alive {
            continue;
        }
        *pid = candidates
            .iter()
            .copied()
            .find(|c| is_ours(*c, p.binary, &p.data_dir));
        if pid.is_some() {
            adopted.push(p.name.clone());
        }
    }
    adopted
}

/// Sets every recorded pid to `None`.
pub fn clear_pids(file: &mut ClusterFile) {
    for c in &mut file.coordinators {
        c.pid = None;
    }
    for w in &mut file.workers {
        w.pid = None;
    }
}

/// Whether `status` shows a leader and every expected worker alive.
///
/// # Errors
/// [`NotReady`]: what is still missing.
pub fn readiness(
    status: &ClusterStatusResponse,
    expected_workers: &[String],
) -> Result<(), NotReady> {
    if status.leader_id.is_none() {
        return Err(NotReady::NoLeader {
            node_id: status.node_id,
            term: status.term,
        });
    }
    let missing: Vec<String> = expected_workers
        .iter()
        .filter(|id| {
            !status.workers.iter().any(|w| {
                &w.worker_id == *id && w.worker_phase() == Ok(cumulus_api::WorkerPhase::Alive)
            })
        })
        .cloned()
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(NotReady::WorkersMissing(missing))
    }
}

/// What a local cluster still lacks before it is ready.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    /// The node that answered knows no leader.
    #[error("no leader yet (node {node_id} answered, term {term})")]
    NoLeader {
        /// The node that answered.
        node_id: u64,
        /// Its current term.
        term: u64,
    },
    /// These expected workers are not registered and alive.
    #[error("workers not registered yet: {}", .0.join(", "))]
    WorkersMissing(Vec<String>),
}

/// Polls `ClusterStatus` until [`readiness`] holds, failing early when a process exits.
async fn wait_ready(
    conn: &Conn,
    expected_workers: &[String],
    children: &mut [(String, PathBuf, Child)],
    timeout: Duration,
    dir: &Path,
) -> Result<ClusterStatusResponse, LocalError> {
    let client = Client::with_policy(conn, RetryPolicy::single_pass(conn.grpc.len()))
        .map_err(|e| LocalError::Other(e.to_string()))?;
    let deadline = Instant::now() + timeout;
    loop {
        for (name, log, child) in children.iter_mut() {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(LocalError::Exited {
                    name: name.clone(),
                    status: status.to_string(),
                    log: log.clone(),
                    tail: log_tail(log),
                });
            }
        }
        let last = match client.cluster_status().await {
            Ok(s) => match readiness(&s, expected_workers) {
                Ok(()) => return Ok(s),
                Err(why) => why.to_string(),
            },
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            return Err(LocalError::NotReady {
                secs: timeout.as_secs(),
                last,
                dir: dir.to_path_buf(),
            });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Reaps child handles of processes that have been stopped (avoids zombies while this
/// process keeps running), waiting at most 2 s in total.
pub fn reap(mut children: Vec<Child>) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while !children.is_empty() && Instant::now() < deadline {
        children.retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_)) | Err(_)));
        if !children.is_empty() {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// What happened to one process on `down`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum StopOutcome {
    /// Was not running (or the pid is no longer ours).
    NotRunning,
    /// Exited after SIGTERM.
    Terminated,
    /// Needed SIGKILL.
    Killed,
    /// Still alive even after SIGKILL (should not happen).
    Stuck,
}

/// SIGTERMs every live process, waits up to `grace`, SIGKILLs the rest.
pub fn stop_processes(procs: &[Proc], grace: Duration) -> Vec<(Proc, StopOutcome)> {
    let mut result: Vec<(Proc, StopOutcome)> = Vec::new();
    let mut pending = Vec::new();
    for p in procs {
        if p.alive() {
            let pid = p.pid.expect("alive implies a pid");
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
            pending.push(p.clone());
        } else {
            result.push((p.clone(), StopOutcome::NotRunning));
        }
    }
    let deadline = Instant::now() + grace;
    loop {
        let (done, still): (Vec<Proc>, Vec<Proc>) = pending.into_iter().partition(|p| !p.alive());
        result.extend(done.into_iter().map(|p| (p, StopOutcome::Terminated)));
        pending = still;
        if pending.is_empty() || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for p in &pending {
        let _ = kill(
            Pid::from_raw(p.pid.expect("alive implies a pid") as i32),
            Signal::SIGKILL,
        );
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while pending.iter().any(Proc::alive) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    for p in pending {
        let outcome = if p.alive() {
            StopOutcome::Stuck
        } else {
            StopOutcome::Killed
        };
        result.push((p, outcome));
    }
    result
}

/// `down`: stops every recorded process, clears the pids in `cluster.json`, and with
/// `purge` deletes what `up` created (data dirs, logs, token, cluster.json; the local
/// dir itself only when it is then empty).
pub fn down(dir: &Path, purge: bool) -> Result<Vec<(Proc, StopOutcome)>, LocalError> {
    let mut file = ClusterFile::load(dir)
        .map_err(|e| LocalError::Other(e.to_string()))?
        .ok_or_else(|| LocalError::NotFound(dir.to_path_buf()))?;
    // Processes restarted by hand are stopped too.
    adopt_running(&mut file);
    let outcomes = stop_processes(&processes(&file), TERM_GRACE);
    if outcomes.iter().any(|(_, o)| *o == StopOutcome::Stuck) {
        return Err(LocalError::Other(format!(
            "some processes survived SIGKILL: {:?}",
            outcomes
        )));
    }
    clear_pids(&mut file);
    if purge {
        for p in processes(&file) {
            remove_path(&p.data_dir)?;
            remove_path(&p.log)?;
        }
        remove_path(&file.token_file)?;
        remove_path(&file.peer_token_file())?;
        remove_path(&ClusterFile::path_in(dir))?;
        let _ = fs::remove_dir(dir);
    } else {
        file.store(dir)
            .map_err(|e| LocalError::Other(e.to_string()))?;
    }
    Ok(outcomes)
}

fn remove_path(p: &Path) -> Result<(), LocalError> {
    let r = match p.symlink_metadata() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => Err(e),
        Ok(m) if m.is_dir() => fs::remove_dir_all(p),
        Ok(_) => fs::remove_file(p),
    };
    r.map_err(io_err(p))
}

/// Who ranks run as, from the worker flags `up` gave ([`Ranks::worker_flags`]).
pub fn ranks_text(flags: &[String]) -> String {
    match flags {
        [flag, range] if flag == "--run-as" && range.contains('-') => {
            format!("a user and group of their own per job, ids {range} (--run-as {range})")
        }
        [flag, user] if flag == "--run-as" => format!("{user} (--run-as {user})"),
        [flag] if flag == "--allow-root" => {
            "root (--allow-root: their code can read the cluster's token and keys)".into()
        }
        _ => format!(
            "uid {}, the user running the cluster",
            nix::unistd::geteuid()
        ),
    }
}

/// Human summary after `up`.
pub fn up_summary(s: &Started, local_dir_flag: &str) -> String {
    let mut out = format!(
        "local cluster {} in {:.1} s under {}\n",
        if s.restarted {
            "restarted (state kept)"
        } else {
            "up"
        },
        s.elapsed.as_secs_f64(),
        s.dir.display()
    );
    for c in &s.file.coordinators {
        let leader = if s.status.leader_id == Some(c.node_id) {
            "  (leader)"
        } else {
            ""
        };
        out.push_str(&format!(
            "  coordinator {}  grpc {}  http {}  pid {}{leader}\n",
            c.node_id,
            c.grpc,
            c.http,
            c.pid.map_or("-".into(), |p| p.to_string())
        ));
    }
    for w in &s.file.workers {
        out.push_str(&format!(
            "  {}  {} slots  pid {}\n",
            w.worker_id,
            w.slots,
            w.pid.map_or("-".into(), |p| p.to_string())
        ));
    }
    out.push_str(&format!(
        "  logs: {}/*.log   token: {}\n",
        s.dir.display(),
        s.file.token_file.display()
    ));
    out.push_str(&format!(
        "  ranks run as: {}\n\n",
        ranks_text(&s.rank_flags)
    ));
    out.push_str("use it:\n");
    out.push_str(&format!("  cumulusctl{local_dir_flag} cluster status\n"));
    out.push_str(&format!(
        "  cumulusctl{local_dir_flag} submit --world-size 2 -- <command> [args...]\n"
    ));
    out.push_str(&format!("  cumulusctl{local_dir_flag} logs -f <job-id>\n"));
    out.push_str(&format!(
        "  (from elsewhere: export CUMULUS_LOCAL_DIR={})\n",
        s.dir.display()
    ));
    out.push_str(&format!(
        "stop it:\n  cumulusctl{local_dir_flag} local down      (add --purge to delete its data)\n"
    ));
    out
}

#[cfg(test)]
mod tests;
