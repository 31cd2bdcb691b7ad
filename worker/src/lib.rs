//! The Cumulus worker agent.
//!
//! The agent registers with the coordinators, heartbeats every `--heartbeat-interval-ms`
//! with the rank attempts it observes and the machine's resources, and makes its processes
//! match the *desired* rank attempts of each reply (see [`reconcile`]). It captures every
//! attempt's output into a capped log ([`logs`]), serves those logs to the coordinators
//! ([`agent_api`]), and serves the ranks' progress and checkpoint commits on loopback
//! ([`rank_api`]).
//!
//! Files under `--data-dir`:
//! ```text
//! agent.json                                   this agent's pid and bound addresses
//! agent.lock                                   held (flock) while an agent uses the dir
//! logs/<job>/rank-<r>/attempt-<a>.log|.exit    attempt logs and exit records
//! jobs/<job>/rank-<r>.attempt-<a>.shards       CUMULUS_SHARDS_FILE (removed at exit)
//! pids/<job>.rank-<r>.attempt-<a>.json         pid records of live attempts
//! envs/<key>/                                  jobs' Python environments ([`envs`])
//! blob-cache/<digest>                          jobs' packed workdirs ([`blobs`])
//! attempts/<job>/rank-<r>.attempt-<a>/         an attempt's work/ and output/ dirs
//! uv-cache/                                    uv's cache
//! ```

pub mod agent;
pub mod agent_api;
pub mod blobs;
pub mod client;
pub mod datadir;
pub mod enrol;
pub mod envs;
pub mod events;
pub mod gpus;
pub mod http;
pub mod identity;
pub mod logs;
pub mod metrics;
pub mod orphans;
pub mod rank_api;
pub mod reconcile;
pub mod resources;
pub mod spawn;
pub mod supervisor;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use cumulus_api::RegisterWorkerRequest;
use cumulus_tls::Tls;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::agent::ControlLoop;
use crate::agent_api::AgentApiState;
use crate::client::{CoordinatorClient, RetryPolicy};
use crate::events::EventReporter;
use crate::spawn::Spawner;
use crate::supervisor::{Supervisor, SupervisorSettings};

/// At shutdown, how long the agent still tries to report the exits of its ranks.
pub const SHUTDOWN_REPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// At shutdown, how long the HTTP servers get to finish in-flight requests.
pub const SERVER_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest token file accepted, in bytes: the longest token and surrounding whitespace.
pub const MAX_TOKEN_FILE_BYTES: u64 = cumulus_api::token::MAX_TOKEN_BYTES as u64 + 64;

/// Command-line configuration of the agent. Every flag also reads an environment
/// variable.
#[derive(Clone, clap::Parser)]
#[command(name = "cumulus-worker", version, about = "The Cumulus worker agent")]
pub struct Config {
    /// Stable id of this agent: 1..=64 bytes of [A-Za-z0-9._-]. Default: the host name.
    #[arg(long, env = "CUMULUS_WORKER_ID")]
    pub worker_id: Option<String>,

    /// Coordinators' gRPC addresses, `host:port`, comma-separated.
    #[arg(
        long,
        env = "CUMULUS_COORDINATORS",
        value_delimiter = ',',
        required = true,
        num_args = 1..
    )]
    pub coordinators: Vec<String>,

    /// File holding the cluster bearer token (surrounding whitespace ignored; 16 to 4096
    /// visible ASCII bytes). Wins over `CUMULUS_TOKEN` when both are given.
    #[arg(long, env = "CUMULUS_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,

    /// The cluster bearer token, from the environment only: `--token` on the command line
    /// is refused (every local user sees it in `ps`).
    #[arg(long, env = "CUMULUS_TOKEN", hide = true, hide_env_values = true)]
    pub token: Option<String>,

    /// Address of the agent HTTP API (logs, health) for coordinators.
    #[arg(long, env = "CUMULUS_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,

    /// Host name or IP of this machine as other machines reach it: sent as the worker's
    /// `host` (the leader's `MASTER_ADDR` for ranks placed here), `MASTER_ADDR` when the
    /// leader sends none, and the host part of the `http_addr` given to the leader.
    #[arg(long, env = "CUMULUS_ADVERTISE_HOST", default_value = "127.0.0.1")]
    pub advertise_host: String,

    /// Address of the rank-local API; must be a loopback address.
    #[arg(long, env = "CUMULUS_RANK_API_LISTEN", default_value = "127.0.0.1:0")]
    pub rank_api_listen: SocketAddr,

    /// Directory for logs, shard files and pid records (created if missing).
    #[arg(long, env = "CUMULUS_DATA_DIR")]
    pub data_dir: PathBuf,

    /// Rank slots this worker offers (1..=4096).
    #[arg(long, env = "CUMULUS_SLOTS", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub slots: u32,

    /// GPUs this worker offers: `auto` (NVML; no driver: none), `none`, NVML indices
    /// (`0,1`), or a JSON inventory file (read again at every heartbeat; for tests and
    /// machines NVML cannot see).
    #[arg(long, env = "CUMULUS_GPUS", default_value = "auto")]
    pub gpus: String,

    /// Milliseconds between heartbeats (10..=600000); also the retry interval of
    /// unacknowledged exit reports.
    #[arg(long, env = "CUMULUS_HEARTBEAT_INTERVAL_MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(10..=600_000))]
    pub heartbeat_interval_ms: u64,

    /// Milliseconds between SIGTERM and SIGKILL when stopping a rank (0..=3600000).
    #[arg(long, env = "CUMULUS_STOP_GRACE_MS", default_value_t = 5000,
          value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    pub stop_grace_ms: u64,

    /// Cap of each attempt's log file in bytes (at least 1024); past it one marker line is
    /// written and further output dropped.
    #[arg(long, env = "CUMULUS_LOG_MAX_BYTES", default_value_t = 64 * 1024 * 1024,
          value_parser = clap::value_parser!(u64).range(1024..))]
    pub log_max_bytes: u64,

    /// S3 settings for jobs with an S3 checkpoint target (`--ckpt-url s3://…`) or an S3
    /// dataset (`--dataset s3://…`).
    #[command(flatten)]
    pub s3: cumulus_ckpt::S3Args,

    /// Most bytes of S3 dataset shards cached in `<data-dir>/dataset-cache` (least
    /// recently used evicted first); size it above the shards of the ranks run at once.
    #[arg(long, env = "CUMULUS_DATASET_CACHE_MAX_BYTES", default_value_t = 10 * 1024 * 1024 * 1024,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub dataset_cache_max_bytes: u64,

    /// Where a job's dataset shards and checkpoint dir may lie.
    #[command(flatten)]
    pub roots: cumulus_api::paths::RootsArgs,

    /// TLS: this agent's certificate (naming `cumulus://worker/WORKER_ID`), key and the
    /// cluster CA, for its connections to the coordinators and its agent API; or
    /// `--insecure`. The rank-local API stays plaintext on loopback.
    #[command(flatten)]
    pub tls: cumulus_tls::args::TlsArgs,

    /// Get this agent's certificate from the coordinators instead of `--tls-cert` and
    /// `--tls-key`: it makes a key, asks a coordinator started with `--tls-ca-key` to
    /// sign it (with the cluster token, the server verified against `--tls-ca`), keeps
    /// both in `<data-dir>/tls/` and uses them again while they fit (SECURITY.md,
    /// "Enrolment"). For workers whose ids are not known in advance (a scaled compose
    /// service).
    #[arg(
        long,
        env = "CUMULUS_TLS_ENROL",
        action = clap::ArgAction::SetTrue,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub tls_enrol: bool,

    /// Most connections open at once on the agent API (`--listen`); more are closed at
    /// accept. Scaled down to fit the open-file limit, which keeps descriptors in
    /// reserve for rank logs and processes.
    #[arg(long, env = "CUMULUS_MAX_HTTP_CONNECTIONS", default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(16..=1_000_000))]
    pub max_http_connections: u64,

    /// Who ranks run as (the agent must run as root): a user name or `UID[:GID]` (one
    /// account for every job), or a range of user ids `FIRST-LAST` (each job its own user
    /// and group, FIRST + job number mod the range size: jobs cannot signal, trace or read
    /// each other). Default: the agent's own user, which an agent running as root refuses
    /// without `--allow-root`.
    #[arg(long, env = "CUMULUS_RUN_AS")]
    pub run_as: Option<String>,

    /// Let ranks run as root when the agent runs as root without `--run-as` (their code
    /// can then read the agent's credentials): for a development machine only.
    #[arg(long, env = "CUMULUS_ALLOW_ROOT")]
    pub allow_root: bool,

    /// Agent environment variables ranks inherit besides PATH, LANG, LANGUAGE, LC_*, TZ and
    /// TMPDIR: names or PREFIX* (comma-separated or repeated; never CUMULUS_*). Nothing
    /// else of the agent's environment reaches a rank.
    #[arg(long, env = "CUMULUS_PASS_ENV", value_delimiter = ',')]
    pub pass_env: Vec<String>,

    /// Most connections open at once on the rank-local API; more are closed at accept.
    #[arg(long, env = "CUMULUS_MAX_RANK_API_CONNECTIONS", default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(16..=1_000_000))]
    pub max_rank_api_connections: u64,

    /// uv, which builds the jobs' Python environments (`pip install uv`). Default: `uv`
    /// on PATH, else `uv` beside the `python3` on PATH. Without one, a job asking for an
    /// environment fails with that message.
    #[arg(long, env = "CUMULUS_UV")]
    pub uv: Option<PathBuf>,

    /// Most bytes of Python environments and uv's cache kept in `<data-dir>/envs` and
    /// `<data-dir>/uv-cache`: past it, the least recently used environments no attempt
    /// uses are removed (then uv's cache).
    #[arg(long, env = "CUMULUS_ENV_CACHE_BYTES", default_value_t = envs::DEFAULT_CACHE_BYTES,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub env_cache_bytes: u64,

    /// Longest build of one Python environment, in milliseconds (1000..=86400000); past
    /// it the build is stopped and the attempts waiting for it fail.
    #[arg(long, env = "CUMULUS_ENV_BUILD_TIMEOUT_MS", default_value_t = envs::DEFAULT_BUILD_TIMEOUT_MS,
          value_parser = clap::value_parser!(u64).range(1_000..=86_400_000))]
    pub env_build_timeout_ms: u64,

    /// Most bytes of blobs (jobs' packed workdirs) kept in `<data-dir>/blob-cache`: past
    /// it the least recently used blobs no attempt is unpacking are removed.
    #[arg(long, env = "CUMULUS_BLOB_CACHE_BYTES", default_value_t = blobs::DEFAULT_BLOB_CACHE_BYTES,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub blob_cache_bytes: u64,

    /// Most bytes one rank attempt may leave in CUMULUS_OUTPUT_DIR (its files, and their
    /// archive) to be uploaded as its artifacts; past it nothing is uploaded and the
    /// attempt's log says why (at most 2 GiB).
    #[arg(long, env = "CUMULUS_MAX_ARTIFACT_BYTES",
          default_value_t = cumulus_api::blobs::DEFAULT_MAX_ARTIFACT_BYTES,
          value_parser = clap::value_parser!(u64).range(1..=cumulus_api::blobs::MAX_BLOB_BYTES))]
    pub max_artifact_bytes: u64,
    /// File holding the scrape token: it reads the agent API's `GET /metrics` and
    /// nothing else (give it to Prometheus rather than the cluster token, which
    /// `/metrics` also takes). Different from the cluster token.
    #[arg(long, env = "CUMULUS_METRICS_TOKEN_FILE")]
    pub metrics_token_file: Option<PathBuf>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("worker_id", &self.worker_id)
            .field("coordinators", &self.coordinators)
            .field("token_file", &self.token_file)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("listen", &self.listen)
            .field("advertise_host", &self.advertise_host)
            .field("rank_api_listen", &self.rank_api_listen)
            .field("data_dir", &self.data_dir)
            .field("slots", &self.slots)
            .field("gpus", &self.gpus)
            .field("heartbeat_interval_ms", &self.heartbeat_interval_ms)
            .field("stop_grace_ms", &self.stop_grace_ms)
            .field("log_max_bytes", &self.log_max_bytes)
            .field("max_http_connections", &self.max_http_connections)
            .field("max_rank_api_connections", &self.max_rank_api_connections)
            .field("run_as", &self.run_as)
            .field("allow_root", &self.allow_root)
            .field("pass_env", &self.pass_env)
            .field("uv", &self.uv)
            .field("env_cache_bytes", &self.env_cache_bytes)
            .field("env_build_timeout_ms", &self.env_build_timeout_ms)
            .field("blob_cache_bytes", &self.blob_cache_bytes)
            .field("max_artifact_bytes", &self.max_artifact_bytes)
            .finish()
    }
}

/// File name of the rank-local API's Unix socket in the data dir (when ranks run as
/// another user).
pub const RANK_API_SOCKET: &str = "rank-api.sock";

/// Binds the rank-local API's Unix socket at `path` (a stale socket of an earlier run is
/// removed first: the data dir's lock is held, so no live agent owns it) and lets every
/// local user connect to it (`0666`): the API identifies callers by their credentials.
fn bind_rank_socket(path: &std::path::Path) -> anyhow::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)
            .with_context(|| format!("cannot remove the stale socket {}", path.display()))?,
        Ok(_) => anyhow::bail!(
            "{} exists and is not a socket: move it away",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot inspect {}", path.display())),
    }
    let listener = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("cannot bind the rank API socket {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
        .with_context(|| format!("cannot open {} to ranks", path.display()))?;
    Ok(listener)
}

/// The rank identity of `--run-as`, `--allow-root` and `--pass-env`, with the files
/// that running ranks as another user needs checked (see [`identity`]), and the agent's
/// own directories of the data dir closed to ranks.
///
/// # Errors
/// Any [`identity::IdentityError`].
fn rank_identity(config: &Config) -> anyhow::Result<identity::RankIdentity> {
    let identity = identity::RankIdentity::from_flags(
        config.run_as.as_deref(),
        config.allow_root,
        &config.pass_env,
        nix::unistd::geteuid().as_raw(),
    )?;
    let mut secrets: Vec<(&'static str, &std::path::Path)> = Vec::new();
    if let Some(path) = &config.token_file {
        secrets.push(("token file", path));
    }
    if let Some(path) = &config.tls.tls_key {
        secrets.push(("TLS key", path));
    }
    if let Some(path) = &config.metrics_token_file {
        secrets.push(("metrics token file", path));
    }
    identity.check_files(&config.data_dir, &secrets)?;
    match &identity.run_as {
        identity::RunAs::Agent => {
            if nix::unistd::geteuid().is_root() {
                tracing::warn!(
                    "--allow-root: ranks run as root and their code can read this agent's credentials"
                );
            }
        }
        run_as => {
            // Ranks reach their shards files and the dataset cache through the data dir;
            // logs and pid records of every job stay the agent's.
            use std::os::unix::fs::PermissionsExt;
            for (dir, mode) in [("logs", 0o700), ("pids", 0o700), ("jobs", 0o711)] {
                let path = config.data_dir.join(dir);
                std::fs::create_dir_all(&path)
                    .and_then(|()| {
                        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                    })
                    .with_context(|| format!("cannot prepare {}", path.display()))?;
            }
            tracing::info!(?run_as, "ranks run as another user");
        }
    }
    Ok(identity)
}

/// The parts of a [`Config`] that need checking or reading before the agent starts.
#[derive(Clone)]
struct Resolved {
    worker_id: String,
    token: String,
    /// The scrape token of `--metrics-token-file`.
    metrics_token: Option<String>,
}

impl Config {
    fn resolve(&self) -> anyhow::Result<Resolved> {
        let worker_id = match &self.worker_id {
            Some(id) => id.clone(),
            None => nix::unistd::gethostname()
                .context("cannot read the host name for the default --worker-id")?
                .into_string()
                .map_err(|_| anyhow::anyhow!("the host name is not UTF-8: give --worker-id"))?,
        };
        cumulus_api::ids::check_worker_id(&worker_id).context("invalid --worker-id")?;
        let token = match (&self.token_file, &self.token) {
            (Some(path), _) => read_token_file(path)?,
            (None, Some(token)) => {
                cumulus_api::token::refuse_command_line(token, "--token", "CUMULUS_TOKEN")?;
                token.trim().to_string()
            }
            (None, None) => bail!("no cluster token: give --token-file or set CUMULUS_TOKEN"),
        };
        cumulus_api::token::check(&token).context("the cluster token")?;
        let metrics_token = match &self.metrics_token_file {
            Some(path) => {
                let t = read_token_file(path)?;
                cumulus_api::token::check(&t).context("the metrics token")?;
                if t == token {
                    bail!(
                        "the metrics token ({}) must differ from the cluster token: a \
                         scraper should hold nothing else",
                        path.display()
                    );
                }
                Some(t)
            }
            None => None,
        };
        if !self.rank_api_listen.ip().is_loopback() {
            bail!(
                "--rank-api-listen {} is not a loopback address: the rank-local API must \
                 only be reachable from this machine",
                self.rank_api_listen
            );
        }
        let host = self.advertise_host.trim();
        if host.is_empty() || host.contains(char::is_whitespace) || host.contains('/') {
            bail!("invalid --advertise-host {:?}", self.advertise_host);
        }
        if self.coordinators.iter().all(|c| c.trim().is_empty()) {
            bail!("--coordinators is empty");
        }
        Ok(Resolved {
            worker_id,
            token,
            metrics_token,
        })
    }
}

fn read_token_file(path: &Path) -> anyhow::Result<String> {
    let meta = std::fs::metadata(path)
        .with_context(|| format!("cannot read token file {}", path.display()))?;
    if meta.len() > MAX_TOKEN_FILE_BYTES {
        bail!(
            "token file {} is larger than {MAX_TOKEN_FILE_BYTES} bytes",
            path.display()
        );
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read token file {}", path.display()))?;
    Ok(text.trim().to_string())
}

/// `host` as it appears before `:port` in an address (IPv6 literals get brackets).
fn url_host(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// Takes the data dir's `agent.lock` (flock): two agents on one data dir would kill each
/// other's ranks as orphans.
fn lock_data_dir(data_dir: &Path) -> anyhow::Result<nix::fcntl::Flock<std::fs::File>> {
    let path = data_dir.join("agent.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(
        |(_, errno)| {
            anyhow::anyhow!(
                "cannot lock {} ({errno}): is another agent using this data dir?",
                path.display()
            )
        },
    )
}

/// Content of `<data-dir>/agent.json`, written once the servers are bound.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AgentInfo {
    /// The worker id.
    pub worker_id: String,
    /// The agent's pid.
    pub pid: u32,
    /// `host:port` of the agent API as sent to the leader.
    pub http_addr: String,
    /// Bound address of the agent API.
    pub listen_addr: SocketAddr,
    /// Bound address of the rank-local API.
    pub rank_api_addr: SocketAddr,
}

/// Path of [`AgentInfo`] in a data dir.
pub fn agent_info_path(data_dir: &Path) -> PathBuf {
    data_dir.join("agent.json")
}

async fn write_agent_info(data_dir: &Path, info: &AgentInfo) -> std::io::Result<()> {
    let path = agent_info_path(data_dir);
    let tmp = path.with_extension("json.tmp");
    let mut file = tokio::fs::File::create(&tmp).await?;
    file.write_all(&serde_json::to_vec_pretty(info).map_err(std::io::Error::other)?)
        .await?;
    file.sync_all().await?;
    drop(file);
    tokio::fs::rename(&tmp, &path).await
}

/// Runs the agent until `shutdown` completes, then stops every rank (SIGTERM, SIGKILL
/// after the grace time), waits for them, reports their exits (best effort, for at most
/// [`SHUTDOWN_REPORT_TIMEOUT`]) and returns `Ok(())`. Fails early on an invalid
/// configuration, a data dir in use by another agent, or an address that cannot be bound.
///
/// Startup, in order: the data dir (locked, enrolled), the GPUs, the credentials, the
/// listeners, the coordinator client, the supervisor, the servers, `agent.json`, the
/// loops; shutdown in [`Running::stop`].
pub async fn run(mut config: Config, shutdown: impl Future) -> anyhow::Result<()> {
    let resolved = config.resolve().context("invalid configuration")?;
    let mut shutdown = std::pin::pin!(shutdown);
    let Some(_lock) = take_data_dir(&mut config, &resolved, &mut shutdown).await? else {
        return Ok(());
    };
    let gpu_monitor = open_gpus(&config).await?;
    let (tls, client_tls) = credentials(&config, &resolved)?;
    let identity = rank_identity(&config)?;
    let listeners = bind_listeners(&config, &identity, &tls).await?;
    let http_addr = format!(
        "{}:{}",
        url_host(config.advertise_host.trim()),
        listeners.listen_addr.port()
    );
    let heartbeat_interval = Duration::from_millis(config.heartbeat_interval_ms);

    let client_cancel = CancellationToken::new();
    let client = Arc::new(
        CoordinatorClient::with_tls(
            &config.coordinators,
            &resolved.token,
            client_tls,
            client_cancel.clone(),
        )
        .context("invalid coordinator client configuration")?,
    );
    let events = EventReporter::new(client.clone(), heartbeat_interval);
    let Listeners {
        agent: agent_listener,
        rank: rank_listener,
        rank_socket,
        rank_api_watch,
        listen_addr,
        rank_api_addr,
    } = listeners;
    let supervisor = start_supervisor(
        &config,
        &resolved,
        SupervisorWiring {
            rank_api_addr,
            rank_api_socket: rank_socket.as_ref().map(|(path, _, _)| path.clone()),
            rank_api_watch,
            has_gpus: !gpu_monitor.inventory().is_empty(),
            identity,
        },
        &client,
        &events,
    )
    .await?;
    let (servers_cancel, servers) = start_servers(
        &config,
        &resolved,
        agent_listener,
        rank_listener,
        rank_socket,
        &supervisor,
    );
    announce(
        &config,
        &resolved,
        AgentInfo {
            worker_id: resolved.worker_id.clone(),
            pid: std::process::id(),
            http_addr: http_addr.clone(),
            listen_addr,
            rank_api_addr,
        },
    )
    .await?;

    let loops_cancel = CancellationToken::new();
    let events_task = tokio::spawn(events.clone().run(loops_cancel.clone()));
    let control = ControlLoop {
        client: client.clone(),
        supervisor: supervisor.clone(),
        registration: RegisterWorkerRequest {
            worker_id: resolved.worker_id.clone(),
            host: config.advertise_host.trim().to_string(),
            http_addr,
            slots: config.slots,
            gpus: gpu_monitor.inventory().to_vec(),
        },
        gpus: Arc::new(std::sync::Mutex::new(gpu_monitor)),
        heartbeat_interval,
        applied: Default::default(),
    };
    let control_task = tokio::spawn(control.run(loops_cancel.clone()));
    let mut running = Running {
        loops_cancel,
        control_task,
        events_task,
        supervisor,
        events,
        servers_cancel,
        servers,
        client_cancel,
    };
    let outcome = running.until_the_end(&mut shutdown).await;
    running.stop(&config.data_dir).await;
    outcome
}

/// The data dir prepared (its modes), locked (`agent.lock`, held while the agent runs)
/// and, with `--tls-enrol`, holding the agent's certificate, whose paths then go into
/// `config`. `None` when `shutdown` completed during the enrolment.
async fn take_data_dir(
    config: &mut Config,
    resolved: &Resolved,
    shutdown: &mut std::pin::Pin<&mut impl Future>,
) -> anyhow::Result<Option<nix::fcntl::Flock<std::fs::File>>> {
    let enrol_ca = if config.tls_enrol {
        Some(enrol::check_flags(&config.tls)?.to_path_buf())
    } else {
        None
    };
    // Ranks of other users (`--run-as`, checked below) pass through the data dir.
    let ranks_other_user = config
        .run_as
        .as_deref()
        .is_some_and(|r| !r.trim().is_empty());
    datadir::prepare(&config.data_dir, ranks_other_user)?;
    let lock = lock_data_dir(&config.data_dir)?;
    if let Some(ca) = enrol_ca {
        let enrolment = enrol::Enrolment {
            data_dir: &config.data_dir,
            worker_id: &resolved.worker_id,
            advertise_host: config.advertise_host.trim(),
            ca: &ca,
            coordinators: &config.coordinators,
            token: &resolved.token,
        };
        let cancel = CancellationToken::new();
        let files = tokio::select! {
            files = enrolment.ensure(&cancel) => files?,
            _ = shutdown.as_mut() => {
                tracing::info!("shutdown requested while enrolling");
                return Ok(None);
            }
        };
        config.tls.tls_cert = Some(files.cert);
        config.tls.tls_key = Some(files.key);
    }
    Ok(Some(lock))
}

/// The GPUs this agent offers (`--gpus`), detected off the runtime thread.
async fn open_gpus(config: &Config) -> anyhow::Result<gpus::GpuMonitor> {
    let gpu_setting = config.gpus.clone();
    let gpu_monitor = tokio::task::spawn_blocking(move || gpus::GpuMonitor::open(&gpu_setting))
        .await
        .context("GPU detection task failed")??;
    if !gpu_monitor.inventory().is_empty() {
        tracing::info!(gpus = ?gpu_monitor.inventory(), "GPUs offered");
    }
    Ok(gpu_monitor)
}

/// The agent's TLS credentials (or `--insecure`) and what its coordinator client
/// presents and trusts.
fn credentials(
    config: &Config,
    resolved: &Resolved,
) -> anyhow::Result<(Tls, Option<cumulus_client::ClientTls>)> {
    let tls = config
        .tls
        .load_for(&cumulus_tls::Identity::Worker(resolved.worker_id.clone()))?;
    let client_tls = match &tls {
        Tls::On(creds) => Some(cumulus_client::ClientTls {
            ca_pem: creds.trust().ca_pem().into(),
            identity_pem: Some(cumulus_client::IdentityPem {
                cert: creds.cert_pem().into(),
                key: creds.key_pem().into(),
            }),
        }),
        Tls::Insecure => {
            tracing::warn!(
                "--insecure: the agent's connections are plaintext; tokens and logs cross the network readable"
            );
            None
        }
    };
    Ok((tls, client_tls))
}

/// The agent's bound listeners, before they serve.
struct Listeners {
    /// The agent API (TLS unless `--insecure`).
    agent: cumulus_listen::BoundedListener,
    /// The rank-local API over TCP.
    rank: cumulus_listen::BoundedListener,
    /// With `--run-as`: the rank-local API's Unix socket (path, listener, its pool).
    rank_socket: Option<(PathBuf, tokio::net::UnixListener, cumulus_listen::Counter)>,
    /// What the rank-local API's listeners turn away, for the supervisor.
    rank_api_watch: supervisor::RankApiWatch,
    /// Bound address of the agent API.
    listen_addr: SocketAddr,
    /// Bound address of the rank-local API.
    rank_api_addr: SocketAddr,
}

/// Binds the rank API's Unix socket (ranks of another user), the agent API and the
/// rank API, with connection caps fitted to the open-file limit.
async fn bind_listeners(
    config: &Config,
    identity: &identity::RankIdentity,
    tls: &Tls,
) -> anyhow::Result<Listeners> {
    let rank_socket = if identity.run_as.is_other_user() {
        // Absolute: ranks run in their own working directories.
        let path = std::fs::canonicalize(&config.data_dir)
            .with_context(|| format!("cannot resolve --data-dir {}", config.data_dir.display()))?
            .join(RANK_API_SOCKET);
        Some((path.clone(), bind_rank_socket(&path)?))
    } else {
        None
    };

    let agent_listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot bind --listen {}", config.listen))?;
    let rank_listener = TcpListener::bind(config.rank_api_listen)
        .await
        .with_context(|| format!("cannot bind --rank-api-listen {}", config.rank_api_listen))?;
    let listen_addr = agent_listener.local_addr()?;
    let rank_api_addr = rank_listener.local_addr()?;
    let mut wanted = vec![
        config.max_http_connections as usize,
        config.max_rank_api_connections as usize,
    ];
    if rank_socket.is_some() {
        wanted.push(config.max_rank_api_connections as usize);
    }
    let budget = cumulus_listen::fd_budget(cumulus_listen::open_fds())
        .context("reading the open-file limit")?;
    let caps = cumulus_listen::fit_caps(&wanted, budget);
    if caps != wanted {
        tracing::warn!(
            agent_api = caps[0],
            rank_api = caps[1],
            fd_budget = budget,
            "connection caps lowered to fit the open-file limit"
        );
    }
    let agent_listener = cumulus_listen::BoundedListener::new(
        agent_listener,
        "agent API",
        cumulus_listen::Limits::connections(caps[0]),
    )
    .with_tls(match tls {
        Tls::On(creds) => Some(creds.server_config()?),
        Tls::Insecure => None,
    });
    let rank_listener = cumulus_listen::BoundedListener::new(
        rank_listener,
        "rank API",
        cumulus_listen::Limits::connections(caps[1]),
    );
    let mut rank_api_listeners = vec![("rank API", rank_listener.counter())];
    let rank_socket = rank_socket.map(|(path, listener)| {
        let counter = cumulus_listen::Counter::unix(cumulus_listen::Limits::connections(caps[2]));
        rank_api_listeners.push(("rank API socket", counter.clone()));
        (path, listener, counter)
    });
    Ok(Listeners {
        agent: agent_listener,
        rank: rank_listener,
        rank_socket,
        rank_api_watch: supervisor::RankApiWatch::new(rank_api_listeners),
        listen_addr,
        rank_api_addr,
    })
}

/// What the supervisor learns from the startup steps before it.
struct SupervisorWiring {
    rank_api_addr: SocketAddr,
    rank_api_socket: Option<PathBuf>,
    rank_api_watch: supervisor::RankApiWatch,
    has_gpus: bool,
    identity: identity::RankIdentity,
}

/// Starts the spawner thread and the supervisor, which then kills what a previous
/// agent left running.
async fn start_supervisor(
    config: &Config,
    resolved: &Resolved,
    wiring: SupervisorWiring,
    client: &Arc<CoordinatorClient>,
    events: &EventReporter,
) -> anyhow::Result<Supervisor> {
    let spawner = Spawner::start(tokio::runtime::Handle::current())
        .context("cannot start the spawner thread")?;
    let s3 = cumulus_ckpt::S3Connector::new(config.s3.settings()).context("invalid S3 settings")?;
    let roots = config.roots.load()?;
    let envs = open_environments(config, &wiring.identity, &spawner)?;
    let blobs = blobs::BlobCache::open(
        &config.data_dir,
        config.blob_cache_bytes,
        Arc::clone(client) as Arc<dyn blobs::BlobTransport>,
    )
    .context("cannot open the blob cache")?;
    let supervisor = Supervisor::new(
        SupervisorSettings {
            worker_id: resolved.worker_id.clone(),
            data_dir: config.data_dir.clone(),
            advertise_host: config.advertise_host.trim().to_string(),
            rank_api_url: format!("http://{}", wiring.rank_api_addr),
            rank_api_socket: wiring.rank_api_socket,
            stop_grace: Duration::from_millis(config.stop_grace_ms),
            log_max_bytes: config.log_max_bytes,
            commit_retry: RetryPolicy::STANDARD,
            s3: Some(s3.clone()),
            dataset_cache: Some(Arc::new(cumulus_ckpt::DatasetCache::new(
                config.data_dir.join("dataset-cache"),
                config.dataset_cache_max_bytes,
                s3,
            ))),
            roots,
            has_gpus: wiring.has_gpus,
            identity: wiring.identity,
            rank_api_watch: wiring.rank_api_watch,
            envs,
            blobs,
            max_artifact_bytes: config.max_artifact_bytes,
        },
        spawner,
        client.clone(),
        events.clone(),
    );
    supervisor.recover_orphans().await;
    Ok(supervisor)
}

/// The jobs' Python environments under the data dir, with the uv of `--uv` (or found on
/// PATH) and the `python3` on PATH.
///
/// # Errors
/// `--uv` names no executable; `envs/` or `uv-cache/` cannot be prepared.
fn open_environments(
    config: &Config,
    identity: &identity::RankIdentity,
    spawner: &Spawner,
) -> anyhow::Result<Arc<envs::Environments>> {
    let path = std::env::var_os("PATH");
    let uv = envs::locate_uv(config.uv.as_deref(), path.as_deref()).map_err(anyhow::Error::msg)?;
    match &uv {
        Some(uv) => tracing::info!(uv = %uv.display(), "Python environments are built with uv"),
        None => tracing::warn!(
            "no uv (--uv, or on PATH): jobs asking for a Python environment fail here"
        ),
    }
    let settings = envs::EnvSettings {
        data_dir: config.data_dir.clone(),
        uv,
        python: envs::locate_python3(path.as_deref()),
        max_bytes: config.env_cache_bytes,
        build_timeout: Duration::from_millis(config.env_build_timeout_ms),
        ranks_other_user: identity.run_as.is_other_user(),
    };
    envs::Environments::open(settings, spawner.clone()).with_context(|| {
        format!(
            "cannot prepare {}",
            config.data_dir.join(envs::ENVS_DIR).display()
        )
    })
}

/// Serves the agent API, the rank API and (with `--run-as`) the rank API's socket until
/// the returned token is cancelled.
fn start_servers(
    config: &Config,
    resolved: &Resolved,
    agent_listener: cumulus_listen::BoundedListener,
    rank_listener: cumulus_listen::BoundedListener,
    rank_socket: Option<(PathBuf, tokio::net::UnixListener, cumulus_listen::Counter)>,
    supervisor: &Supervisor,
) -> (CancellationToken, JoinSet<anyhow::Result<()>>) {
    let servers_cancel = CancellationToken::new();
    let mut servers = JoinSet::new();
    let agent_router = agent_api::router(AgentApiState {
        data_dir: Arc::new(config.data_dir.clone()),
        token: Arc::from(resolved.token.as_str()),
        worker_id: Arc::from(resolved.worker_id.as_str()),
        metrics_token: resolved.metrics_token.as_deref().map(Arc::from),
    });
    let stop = servers_cancel.clone();
    servers.spawn(async move {
        cumulus_listen::serve_http(agent_listener, agent_router, stop)
            .await
            .context("agent API server failed")
    });
    let check_caller = rank_socket.is_some();
    let rank_router = rank_api::router(supervisor.clone(), check_caller);
    let stop = servers_cancel.clone();
    let tcp_router = rank_router.clone();
    servers.spawn(async move {
        cumulus_listen::serve_http(rank_listener, tcp_router, stop)
            .await
            .context("rank API server failed")
    });
    if let Some((_, listener, counter)) = rank_socket {
        let stop = servers_cancel.clone();
        servers.spawn(async move {
            cumulus_listen::serve_unix_http_counted(
                listener,
                "rank API socket",
                counter,
                rank_router,
                stop,
            )
            .await
            .context("rank API socket server failed")
        });
    }
    (servers_cancel, servers)
}

/// Writes `agent.json` and logs that the agent started (with a warning when coordinators
/// on other machines cannot reach its loopback listener).
async fn announce(config: &Config, resolved: &Resolved, info: AgentInfo) -> anyhow::Result<()> {
    write_agent_info(&config.data_dir, &info)
        .await
        .context("cannot write agent.json")?;
    let AgentInfo {
        http_addr,
        listen_addr,
        rank_api_addr,
        ..
    } = info;
    let host = config.advertise_host.trim();
    if listen_addr.ip().is_loopback() && !matches!(host, "127.0.0.1" | "localhost" | "::1") {
        tracing::warn!(
            "--listen {listen_addr} is a loopback address but --advertise-host is {host}: \
             coordinators on other machines cannot fetch this agent's logs"
        );
    }
    tracing::info!(
        worker_id = %resolved.worker_id,
        %http_addr,
        %listen_addr,
        %rank_api_addr,
        coordinators = ?config.coordinators,
        "agent started"
    );
    Ok(())
}

/// The running agent: its loops, supervisor, servers and coordinator client.
struct Running {
    loops_cancel: CancellationToken,
    control_task: tokio::task::JoinHandle<()>,
    events_task: tokio::task::JoinHandle<()>,
    supervisor: Supervisor,
    events: EventReporter,
    servers_cancel: CancellationToken,
    servers: JoinSet<anyhow::Result<()>>,
    client_cancel: CancellationToken,
}

impl Running {
    /// Waits for `shutdown` (then `Ok`) or the first server to stop (an error).
    async fn until_the_end(
        &mut self,
        shutdown: &mut std::pin::Pin<&mut impl Future>,
    ) -> anyhow::Result<()> {
        tokio::select! {
            _ = shutdown.as_mut() => {
                tracing::info!("shutdown requested: stopping every rank");
                Ok(())
            }
            Some(result) = self.servers.join_next() => {
                let error = match result {
                    Ok(Ok(())) => anyhow::anyhow!("an HTTP server stopped unexpectedly"),
                    Ok(Err(e)) => e,
                    Err(e) => anyhow::anyhow!("an HTTP server task failed: {e}"),
                };
                tracing::error!("{error:#}: stopping the agent");
                Err(error)
            }
        }
    }

    /// Shutdown, in order: the loops, every rank (and their exits reported, bounded), the
    /// servers (bounded), the coordinator client, `agent.json`.
    async fn stop(mut self, data_dir: &Path) {
        self.loops_cancel.cancel();
        if let Err(e) = self.control_task.await {
            tracing::error!("control loop task failed: {e}");
        }
        if let Err(e) = self.events_task.await {
            tracing::error!("event reporter task failed: {e}");
        }
        self.supervisor.shutdown().await;
        let unreported = self.events.flush(SHUTDOWN_REPORT_TIMEOUT).await;
        if unreported > 0 {
            tracing::warn!("{unreported} rank events could not be reported before exiting");
        }
        self.servers_cancel.cancel();
        let servers = &mut self.servers;
        let drained = tokio::time::timeout(SERVER_SHUTDOWN_TIMEOUT, async {
            while servers.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                "HTTP servers did not finish within {SERVER_SHUTDOWN_TIMEOUT:?}: aborting them"
            );
            self.servers.abort_all();
        }
        self.client_cancel.cancel();
        if let Err(e) = tokio::fs::remove_file(agent_info_path(data_dir)).await {
            tracing::warn!("cannot remove agent.json: {e}");
        }
        tracing::info!("agent stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn parse(args: &[&str]) -> Result<Config, clap::Error> {
        Config::try_parse_from(std::iter::once("cumulus-worker").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_and_lists() {
        let c = parse(&[
            "--coordinators",
            "a:1,b:2",
            "--data-dir",
            "/tmp/x",
            "--token",
            "tok-on-the-command-line",
        ])
        .expect("parse");
        assert_eq!(c.coordinators, ["a:1", "b:2"]);
        assert_eq!(c.slots, 4);
        assert_eq!(c.heartbeat_interval_ms, 1000);
        assert_eq!(c.stop_grace_ms, 5000);
        assert_eq!(c.log_max_bytes, 64 << 20);
        assert_eq!(c.listen.to_string(), "127.0.0.1:0");
        assert!(
            !format!("{c:?}").contains("tok-on-the-command-line"),
            "token must be redacted"
        );
        assert!(
            parse(&["--data-dir", "/tmp/x"]).is_err(),
            "coordinators required"
        );
        assert!(parse(&["--coordinators", "a:1", "--data-dir", "/x", "--slots", "0"]).is_err());
    }

    #[test]
    fn resolve_checks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, " secret-file-0123456789 \n").expect("write");
        let short_file = dir.path().join("short");
        std::fs::write(&short_file, "short\n").expect("write");
        let tf = token_file.to_str().expect("utf8");
        let base = |extra: &[&str]| {
            let mut args = vec!["--coordinators", "a:1", "--data-dir", "/tmp/x"];
            args.extend_from_slice(extra);
            parse(&args).expect("parse")
        };
        let r = base(&[
            "--worker-id",
            "w1",
            "--token-file",
            token_file.to_str().expect("utf8"),
        ])
        .resolve()
        .expect("resolve");
        assert_eq!(
            (r.worker_id.as_str(), r.token.as_str()),
            ("w1", "secret-file-0123456789")
        );
        let err = base(&[
            "--worker-id",
            "w1",
            "--token-file",
            tf,
            "--rank-api-listen",
            "0.0.0.0:0",
        ])
        .resolve()
        .err()
        .expect("non-loopback refused");
        assert!(err.to_string().contains("loopback"), "{err}");
        assert!(
            base(&["--worker-id", "bad/id", "--token-file", tf])
                .resolve()
                .is_err()
        );
        let err = base(&[
            "--worker-id",
            "w",
            "--token-file",
            short_file.to_str().expect("utf8"),
        ])
        .resolve()
        .err()
        .expect("short token refused");
        assert!(format!("{err:#}").contains("at least 16"), "{err:#}");
        let err = base(&["--worker-id", "w", "--token", "0123456789abcdef0123"])
            .resolve()
            .err()
            .expect("token on the command line refused");
        assert!(err.to_string().contains("ps"), "{err}");
        assert_eq!(url_host("::1"), "[::1]");
        assert_eq!(url_host("node-1"), "node-1");
    }
}
