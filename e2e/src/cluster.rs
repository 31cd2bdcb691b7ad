//! [`Cluster`]: real coordinator and worker processes on 127.0.0.1 in a temp dir, one
//! cluster at a time per test binary, killed on drop; and [`View`], a client-side view of
//! their addresses.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use cumulus_api::JobState;
use cumulus_api::v1;
use cumulus_api::v1::client_service_client::ClientServiceClient;
use cumulus_client::{ChannelSettings, ClientTls, LeaderClient, RetryPolicy};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::*;

/// One spawned process.
pub struct Proc {
    /// Name for messages ("coord-1", "worker-2").
    pub name: String,
    /// The child (None once killed and reaped).
    pub child: Option<Child>,
    /// Its combined stdout/stderr log.
    pub log: PathBuf,
}

impl Proc {
    /// OS pid while alive.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGKILL);
            let _ = c.wait();
        }
    }
}

/// A coordinator of the test cluster.
pub struct Coordinator {
    /// Raft node id.
    pub id: u64,
    /// gRPC address it advertises (a [`net::Proxy`] front when the cluster is proxied).
    pub grpc: String,
    /// gRPC address it listens on (equal to `grpc` unless proxied).
    pub grpc_listen: String,
    /// HTTP address.
    pub http: String,
    /// Raft address (`--raft-listen`), when the cluster gives Raft a port of its own
    /// ([`ClusterOpts::raft_listen`]).
    pub raft: Option<String>,
    /// Data dir.
    pub data_dir: PathBuf,
    /// Process.
    pub proc: Proc,
    /// Started with `--join` (added after the cluster was created, or wiped): it never
    /// bootstraps and waits for `add-learner`.
    pub join: bool,
    /// More arguments for its next start (e.g. `--rejoin-empty`).
    pub extra_args: Vec<String>,
}

impl Coordinator {
    /// `GRPC@HTTP`, or `GRPC@HTTP@RAFT` when it has a Raft port of its own.
    pub fn member_addr(&self) -> String {
        match &self.raft {
            Some(raft) => format!("{}@{}@{raft}", self.grpc, self.http),
            None => format!("{}@{}", self.grpc, self.http),
        }
    }

    /// Its `--peer` entry: `ID=` and [`Coordinator::member_addr`].
    pub fn peer_entry(&self) -> String {
        format!("{}={}", self.id, self.member_addr())
    }
}

/// `RUST_LOG` of a test coordinator: `info,openraft=warn`, then `extra` if any.
pub(crate) fn coordinator_log_filter(extra: Option<&str>) -> String {
    match extra {
        Some(extra) => format!("info,openraft=warn,{extra}"),
        None => "info,openraft=warn".into(),
    }
}

/// Options of a test cluster.
#[derive(Clone, Debug)]
pub struct ClusterOpts {
    /// Coordinators (3 or 5).
    pub coordinators: usize,
    /// Worker agents.
    pub workers: usize,
    /// Slots per worker.
    pub slots: u32,
    /// Worker expiry timeout, in milliseconds.
    pub heartbeat_timeout_ms: u64,
    /// Coordinators' `--snapshot-every-entries` and `--snapshot-max-entries`: a snapshot
    /// every this many entries (None: the coordinator's defaults).
    pub snapshot_every_entries: Option<u64>,
    /// Coordinators' `--keep-log-entries` (None: the coordinator's default).
    pub keep_log_entries: Option<u64>,
    /// Put a fault-injecting [`net::Proxy`] in front of every coordinator's gRPC port,
    /// so [`Cluster::net`] can cut links between nodes.
    pub proxied: bool,
    /// S3 settings given to every coordinator and worker (`CUMULUS_S3_*`); `None` = none.
    pub s3: Option<S3Access>,
    /// Extra `RUST_LOG` directives of the coordinators, appended to the default
    /// `info,openraft=warn` (e.g. `cumulus_stage=trace`); `None` = the default only.
    pub coordinator_log: Option<String>,
    /// The coordinators' `--max-state-bytes` (`None`: their default).
    pub max_state_bytes: Option<u64>,
    /// More arguments for every coordinator (e.g. connection caps).
    pub coordinator_args: Vec<String>,
    /// More arguments for every worker agent.
    pub worker_args: Vec<String>,
    /// More arguments for worker agent `i` alone (index `i`; e.g. its `--gpus` file).
    pub per_worker_args: Vec<Vec<String>>,
    /// Open-file limit (soft and hard) of the worker agents (`None`: inherited).
    pub worker_nofile: Option<u64>,
    /// TLS on every connection, with a CA and certificates made for this cluster
    /// (`false`: every process runs `--insecure`).
    pub tls: bool,
    /// With `tls`: workers get no certificate; they enrol (`--tls-enrol`) with the
    /// coordinators, which hold the CA key (`--tls-ca-key`).
    pub enrol_workers: bool,
    /// Every coordinator serves Raft on a port of its own (`--raft-listen`, named in its
    /// `--peer` entry and in `add-learner`), apart from its gRPC port. Not with
    /// `proxied` (the proxies front the gRPC ports).
    pub raft_listen: bool,
}

impl Default for ClusterOpts {
    fn default() -> Self {
        Self {
            coordinators: 3,
            workers: 2,
            slots: 4,
            heartbeat_timeout_ms: 5_000,
            snapshot_every_entries: None,
            keep_log_entries: None,
            proxied: false,
            s3: None,
            coordinator_log: None,
            max_state_bytes: None,
            coordinator_args: Vec::new(),
            worker_args: Vec::new(),
            per_worker_args: Vec::new(),
            worker_nofile: None,
            tls: true,
            enrol_workers: false,
            raft_listen: false,
        }
    }
}

/// A running test cluster; every process is SIGKILLed when it is dropped.
pub struct Cluster {
    /// Temp dir holding data dirs, logs and the token file.
    pub dir: tempfile::TempDir,
    /// Options it was started with.
    pub opts: ClusterOpts,
    /// Coordinators.
    pub coordinators: Vec<Coordinator>,
    /// Worker agents.
    pub workers: Vec<Proc>,
    token_file: PathBuf,
    /// The link fault state shared by every proxy (unused unless `opts.proxied`).
    pub net: Arc<net::Net>,
    /// Kept for the cluster's lifetime (a dropped proxy stops forwarding).
    _proxies: Vec<net::Proxy>,
    /// Held for the cluster's lifetime: test clusters run one at a time, so a 2-core CI
    /// machine never starves heartbeats of two clusters at once.
    _serial: std::sync::MutexGuard<'static, ()>,
    /// The cluster's CA, when `opts.tls`.
    pki: Option<Pki>,
}

/// A test cluster's CA, its files and a user's client TLS.
struct Pki {
    /// `ca.pem`, `ca-key.pem` and every issued `NAME.pem`/`NAME-key.pem`.
    dir: PathBuf,
    ca: cumulus_tls::generate::ClusterCa,
    /// A user's TLS: the CA, no certificate.
    user: ClientTls,
}

impl Pki {
    fn new(dir: PathBuf) -> anyhow::Result<Pki> {
        let ca = cumulus_tls::generate::ClusterCa::generate("e2e cluster")?;
        ca.write(&dir)?;
        let user = ClientTls {
            ca_pem: ca.cert_pem().as_bytes().into(),
            identity_pem: None,
        };
        Ok(Pki { dir, ca, user })
    }

    /// `--tls-cert`, `--tls-key`, `--tls-ca` for `identity`, issued once as `name`.
    fn flags(&self, name: &str, identity: &cumulus_tls::Identity) -> anyhow::Result<Vec<String>> {
        let files = cumulus_tls::generate::PairFiles::in_dir(&self.dir, name);
        if !files.cert.exists() {
            self.ca.issue(identity, &[])?.write(&self.dir, name)?;
        }
        Ok(vec![
            "--tls-cert".into(),
            files.cert.display().to_string(),
            "--tls-key".into(),
            files.key.display().to_string(),
            "--tls-ca".into(),
            self.ca_file().display().to_string(),
        ])
    }

    fn ca_file(&self) -> PathBuf {
        self.dir.join(cumulus_tls::generate::CA_FILE)
    }
}

/// `--uv <workspace>/python/.venv/bin/uv` (installed by scripts/setup.sh) when it is there
/// and `worker_args` give no `--uv` of their own: workers build jobs' Python environments
/// with it. Without it, workers look for uv on PATH.
fn venv_uv_flag(worker_args: &[String]) -> Vec<String> {
    let uv = crate::workspace_root().join("python/.venv/bin/uv");
    let own = worker_args
        .iter()
        .any(|a| a == "--uv" || a.starts_with("--uv="));
    if uv.exists() && !own {
        vec!["--uv".into(), uv.display().to_string()]
    } else {
        Vec::new()
    }
}

/// Writes a token file readable by its owner only (`0600`), as agents whose ranks run
/// as another user require.
fn write_secret(path: &Path, content: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?
        .write_all(content.as_bytes())
}

static ONE_CLUSTER_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The message of the last panic in this test process, repeated after the log dump of a
/// failing test (CI shows the tail of a failing test's output, and the dump buries the
/// panic message above it).
static LAST_PANIC: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Installs (once per process) a panic hook that records the message in [`LAST_PANIC`]
/// and then runs the default hook.
pub(crate) fn record_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let thread = std::thread::current();
            let message = format!("thread '{}' {info}", thread.name().unwrap_or("?"));
            *LAST_PANIC.lock().unwrap_or_else(|p| p.into_inner()) = Some(message);
            default_hook(info);
        }));
    });
}

impl Cluster {
    /// Starts the coordinators and workers and waits for a leader and every worker.
    pub async fn start(opts: ClusterOpts) -> anyhow::Result<Cluster> {
        record_panics();
        anyhow::ensure!(
            !(opts.proxied && opts.raft_listen),
            "a proxied cluster fronts the gRPC ports: it cannot also use --raft-listen"
        );
        let serial = ONE_CLUSTER_AT_A_TIME
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let dir = tempfile::Builder::new().prefix("cumulus-e2e-").tempdir()?;
        if opts.worker_args.iter().any(|a| a.starts_with("--run-as")) {
            // Ranks running as another user reach their shards files in the workers'
            // data dirs, here: others may search the test dir, not list it.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711))?;
        }
        let token_file = dir.path().join("token");
        write_secret(&token_file, TOKEN)?;
        write_secret(&dir.path().join("peer-token"), PEER_TOKEN)?;
        let pki = if opts.tls {
            Some(Pki::new(dir.path().join("tls"))?)
        } else {
            None
        };
        let mut coordinators = Vec::new();
        let net = net::Net::new();
        let mut proxies = Vec::new();
        for id in 1..=opts.coordinators as u64 {
            let grpc = format!("127.0.0.1:{}", free_port());
            let grpc_listen = if opts.proxied {
                let back = format!("127.0.0.1:{}", free_port());
                proxies.push(net::Proxy::start(
                    net.clone(),
                    &format!("coord-{id}"),
                    grpc.parse()?,
                    back.parse()?,
                )?);
                back
            } else {
                grpc.clone()
            };
            coordinators.push(Coordinator {
                id,
                grpc,
                grpc_listen,
                http: format!("127.0.0.1:{}", free_port()),
                raft: opts
                    .raft_listen
                    .then(|| format!("127.0.0.1:{}", free_port())),
                data_dir: dir.path().join(format!("coord-{id}")),
                proc: Proc {
                    name: format!("coord-{id}"),
                    child: None,
                    log: dir.path().join(format!("coord-{id}.log")),
                },
                join: false,
                extra_args: Vec::new(),
            });
        }
        let mut cluster = Cluster {
            dir,
            opts: opts.clone(),
            coordinators,
            workers: Vec::new(),
            token_file,
            net,
            _proxies: proxies,
            _serial: serial,
            pki,
        };
        for i in 0..cluster.coordinators.len() {
            cluster.spawn_coordinator(i)?;
        }
        cluster.wait_leader(Duration::from_secs(60)).await;
        for i in 1..=opts.workers {
            let name = format!("worker-{i}");
            let log = cluster.dir.path().join(format!("{name}.log"));
            cluster.workers.push(Proc {
                name,
                child: None,
                log,
            });
            cluster.spawn_worker(i - 1)?;
        }
        let n = opts.workers;
        cluster
            .wait_status("every worker registered", Duration::from_secs(60), |s| {
                s.workers
                    .iter()
                    .filter(|w| w.worker_phase() == Ok(cumulus_api::WorkerPhase::Alive))
                    .count()
                    == n
            })
            .await;
        Ok(cluster)
    }

    fn peers(&self) -> Vec<String> {
        self.coordinators
            .iter()
            .filter(|c| !c.join)
            .flat_map(|c| ["--peer".to_string(), c.peer_entry()])
            .collect()
    }

    /// (Re)starts coordinator `i` (index into `coordinators`) on its data dir. A
    /// joining coordinator is given only itself as peer, plus `--join`.
    pub fn spawn_coordinator(&mut self, i: usize) -> anyhow::Result<()> {
        let mut peers = self.peers();
        let id = self.coordinators[i].id;
        let mut extra: Vec<String> = self.tls_flags(
            &format!("coordinator-{id}"),
            &cumulus_tls::Identity::Coordinator(id),
        )?;
        if let (true, Some(pki)) = (self.opts.enrol_workers, &self.pki) {
            extra.push("--tls-ca-key".into());
            extra.push(
                pki.dir
                    .join(cumulus_tls::generate::CA_KEY_FILE)
                    .display()
                    .to_string(),
            );
        }
        let c = &mut self.coordinators[i];
        if c.join {
            peers = vec!["--peer".into(), c.peer_entry()];
            extra.push("--join".into());
        }
        if let Some(raft) = &c.raft {
            extra.extend(["--raft-listen".into(), raft.clone()]);
        }
        if let Some(n) = self.opts.snapshot_every_entries {
            // A fixed interval: the test counts on a snapshot every n entries.
            extra.extend(["--snapshot-every-entries".into(), n.to_string()]);
            extra.extend(["--snapshot-max-entries".into(), n.to_string()]);
        }
        if let Some(n) = self.opts.keep_log_entries {
            extra.extend(["--keep-log-entries".into(), n.to_string()]);
        }
        if let Some(n) = self.opts.max_state_bytes {
            extra.extend(["--max-state-bytes".into(), n.to_string()]);
        }
        extra.extend(self.opts.coordinator_args.iter().cloned());
        extra.extend(c.extra_args.iter().cloned());
        let log = File::options()
            .create(true)
            .append(true)
            .open(&c.proc.log)?;
        let child = Command::new(bin("cumulus-coordinator"))
            .arg("--node-id")
            .arg(c.id.to_string())
            .arg("--grpc-listen")
            .arg(&c.grpc_listen)
            .arg("--http-listen")
            .arg(&c.http)
            .args(&peers)
            .arg("--data-dir")
            .arg(&c.data_dir)
            .arg("--token-file")
            .arg(&self.token_file)
            .arg("--peer-token-file")
            .arg(self.dir.path().join("peer-token"))
            .arg("--heartbeat-timeout-ms")
            .arg(self.opts.heartbeat_timeout_ms.to_string())
            .args(&extra)
            .envs(self.opts.s3.iter().flat_map(S3Access::env))
            .env(
                "RUST_LOG",
                coordinator_log_filter(self.opts.coordinator_log.as_deref()),
            )
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawning cumulus-coordinator")?;
        self.net.register(child.id(), &c.proc.name);
        c.proc.child = Some(child);
        Ok(())
    }

    /// Creates a new coordinator (next free id, fresh ports and data dir), starts it with
    /// `--join` and returns its index; it is not a member until `add-learner`.
    pub fn add_coordinator(&mut self) -> anyhow::Result<usize> {
        let id = self.coordinators.iter().map(|c| c.id).max().unwrap_or(0) + 1;
        let dir = self.dir.path();
        let grpc = format!("127.0.0.1:{}", free_port());
        self.coordinators.push(Coordinator {
            id,
            grpc_listen: grpc.clone(),
            grpc,
            http: format!("127.0.0.1:{}", free_port()),
            raft: self
                .opts
                .raft_listen
                .then(|| format!("127.0.0.1:{}", free_port())),
            data_dir: dir.join(format!("coord-{id}")),
            proc: Proc {
                name: format!("coord-{id}"),
                child: None,
                log: dir.join(format!("coord-{id}.log")),
            },
            join: true,
            extra_args: Vec::new(),
        });
        let i = self.coordinators.len() - 1;
        self.spawn_coordinator(i)?;
        Ok(i)
    }

    /// SIGKILLs coordinator `i`, deletes its data dir and marks it as joining: the next
    /// [`Cluster::spawn_coordinator`] starts it empty with `--join`.
    pub fn wipe_coordinator(&mut self, i: usize) -> anyhow::Result<()> {
        let c = &mut self.coordinators[i];
        c.proc.kill9();
        if c.data_dir.exists() {
            std::fs::remove_dir_all(&c.data_dir)
                .with_context(|| format!("wiping {}", c.data_dir.display()))?;
        }
        c.join = true;
        Ok(())
    }

    /// Waits (up to `deadline`) for coordinator `i`, just spawned, to exit on its own, as
    /// one that refuses to start does, and returns its exit status (the process is
    /// reaped and forgotten).
    ///
    /// # Panics
    /// When it is not running or still runs after `deadline`.
    pub async fn wait_coordinator_exit(
        &mut self,
        i: usize,
        deadline: Duration,
    ) -> std::process::ExitStatus {
        let name = self.coordinators[i].proc.name.clone();
        let child = self.coordinators[i]
            .proc
            .child
            .as_mut()
            .expect("the coordinator was spawned");
        let status = wait_for(&format!("{name} to exit"), deadline, || {
            let st = child.try_wait().ok().flatten();
            async move { st }
        })
        .await;
        self.coordinators[i].proc.child = None;
        status
    }

    /// Index into `coordinators` of node `id`.
    pub fn index_of(&self, id: u64) -> Option<usize> {
        self.coordinators.iter().position(|c| c.id == id)
    }

    /// Index (into `coordinators`) of the first coordinator that is not `leader`.
    ///
    /// # Panics
    /// When every coordinator is the leader (a one-node cluster): a test bug.
    pub fn follower_of(&self, leader: u64) -> usize {
        self.coordinators
            .iter()
            .position(|c| c.id != leader)
            .expect("a cluster of several coordinators has a follower")
    }

    /// `GRPC@HTTP` (`GRPC@HTTP@RAFT` with a Raft port of its own) of coordinator `i`,
    /// as `cumulusctl cluster add-learner` takes it.
    pub fn member_addr(&self, i: usize) -> String {
        self.coordinators[i].member_addr()
    }

    /// Cluster status as coordinator `i` itself sees it (None when it does not answer).
    pub async fn status_of(&self, i: usize) -> Option<v1::ClusterStatusResponse> {
        let mut c = self.client_of(i).await.ok()?;
        c.cluster_status(v1::ClusterStatusRequest {})
            .await
            .ok()
            .map(|r| r.into_inner())
    }

    /// (Re)starts worker `i` (index into `workers`).
    pub fn spawn_worker(&mut self, i: usize) -> anyhow::Result<()> {
        let coords = self
            .coordinators
            .iter()
            .map(|c| c.grpc.clone())
            .collect::<Vec<_>>()
            .join(",");
        let name = self.workers[i].name.clone();
        let tls = match (&self.pki, self.opts.enrol_workers) {
            (Some(pki), true) => vec![
                "--tls-enrol".into(),
                "--tls-ca".into(),
                pki.ca_file().display().to_string(),
            ],
            _ => self.tls_flags(&name, &cumulus_tls::Identity::Worker(name.clone()))?,
        };
        let w = &mut self.workers[i];
        let log = File::options().create(true).append(true).open(&w.log)?;
        let mut command = Command::new(bin("cumulus-worker"));
        if let Some(nofile) = self.opts.worker_nofile {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
            #[allow(unsafe_code)]
            unsafe {
                command.pre_exec(move || {
                    nix::sys::resource::setrlimit(
                        nix::sys::resource::Resource::RLIMIT_NOFILE,
                        nofile,
                        nofile,
                    )
                    .map_err(std::io::Error::from)
                });
            }
        }
        let child = command
            .arg("--worker-id")
            .arg(&w.name)
            .arg("--coordinators")
            .arg(coords)
            .arg("--token-file")
            .arg(&self.token_file)
            .arg("--data-dir")
            .arg(self.dir.path().join(&w.name))
            .arg("--slots")
            .arg(self.opts.slots.to_string())
            .arg("--listen")
            .arg("127.0.0.1:0")
            .args(&tls)
            .args(venv_uv_flag(&self.opts.worker_args))
            .args(&self.opts.worker_args)
            .args(self.opts.per_worker_args.get(i).into_iter().flatten())
            .envs(self.opts.s3.iter().flat_map(S3Access::env))
            // Tests run as whoever runs them, often root: ranks run as the agent's user
            // unless a test gives `--run-as` (tests/rank_isolation.rs does).
            .env("CUMULUS_ALLOW_ROOT", "true")
            .env("RUST_LOG", "info")
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawning cumulus-worker")?;
        self.net.register(child.id(), &w.name);
        w.child = Some(child);
        Ok(())
    }

    /// The TLS flags of a process: its certificate `name` (issued for `identity` on first
    /// use), key and the CA; or `--insecure`.
    fn tls_flags(
        &self,
        name: &str,
        identity: &cumulus_tls::Identity,
    ) -> anyhow::Result<Vec<String>> {
        match &self.pki {
            Some(pki) => pki.flags(name, identity),
            None => Ok(vec!["--insecure".into()]),
        }
    }

    /// A user's client TLS (the CA, no certificate); `None` on an insecure cluster.
    pub fn client_tls(&self) -> Option<ClientTls> {
        self.pki.as_ref().map(|p| p.user.clone())
    }

    /// Client TLS presenting a certificate issued now for `identity` (a fake worker, a
    /// coordinator impostor); `None` on an insecure cluster.
    ///
    /// # Errors
    /// Issuing fails.
    pub fn member_tls(
        &self,
        identity: &cumulus_tls::Identity,
    ) -> anyhow::Result<Option<ClientTls>> {
        let Some(pki) = &self.pki else {
            return Ok(None);
        };
        let issued = pki.ca.issue(identity, &[])?;
        Ok(Some(ClientTls {
            ca_pem: pki.user.ca_pem.clone(),
            identity_pem: Some(cumulus_client::IdentityPem {
                cert: issued.cert_pem.into_bytes().into(),
                key: issued.key_pem.into_bytes().into(),
            }),
        }))
    }

    /// An HTTP client of the coordinators' and agents' HTTP APIs: it trusts the
    /// cluster's CA (on a TLS cluster).
    pub fn http_client(&self) -> reqwest::Client {
        let mut builder = reqwest::Client::builder();
        if let Some(pki) = &self.pki {
            let ca = reqwest::Certificate::from_pem(&pki.user.ca_pem).expect("the test CA");
            builder = builder.tls_certs_only([ca]);
        }
        builder.build().expect("an HTTP client")
    }

    /// `https://addr/path` on a TLS cluster, else `http://addr/path`.
    pub fn url(&self, addr: &str, path: &str) -> String {
        let scheme = if self.pki.is_some() { "https" } else { "http" };
        format!("{scheme}://{addr}{path}")
    }

    /// The CA certificate file (`None` on an insecure cluster).
    pub fn ca_file(&self) -> Option<PathBuf> {
        self.pki.as_ref().map(Pki::ca_file)
    }

    /// The token file path.
    pub fn token_file(&self) -> &Path {
        &self.token_file
    }

    /// The `XDG_CACHE_HOME` of the clients a test runs (cumulusctl's upload digest
    /// cache), inside the cluster's temp dir: a test never writes to the user's home.
    pub fn client_cache_dir(&self) -> PathBuf {
        self.token_file
            .parent()
            .map_or_else(|| PathBuf::from("client-cache"), |d| d.join("client-cache"))
    }

    /// Comma-separated gRPC addresses of every coordinator.
    pub fn grpc_addrs(&self) -> String {
        self.coordinators
            .iter()
            .map(|c| c.grpc.clone())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Comma-separated HTTP addresses of every coordinator.
    pub fn http_addrs(&self) -> String {
        self.coordinators
            .iter()
            .map(|c| c.http.clone())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A client of coordinator `i`.
    pub async fn client_of(&self, i: usize) -> anyhow::Result<Client> {
        let ch =
            coordinator_channel(&self.coordinators[i].grpc, self.client_tls().as_ref()).await?;
        Ok(ClientServiceClient::with_interceptor(ch, Auth::new(TOKEN)))
    }

    /// Cluster status from the first live coordinator that answers with a known leader.
    pub async fn status(&self) -> Option<v1::ClusterStatusResponse> {
        for (i, c) in self.coordinators.iter().enumerate() {
            if c.proc.child.is_none() {
                continue;
            }
            let Ok(mut cl) = self.client_of(i).await else {
                continue;
            };
            if let Ok(r) = cl.cluster_status(v1::ClusterStatusRequest {}).await {
                let r = r.into_inner();
                if r.leader_id.is_some() {
                    return Some(r);
                }
            }
        }
        None
    }

    /// Waits until a leader that is alive is known; returns its node id.
    pub async fn wait_leader(&self, deadline: Duration) -> u64 {
        wait_for("a leader", deadline, || async {
            let s = self.status().await?;
            let id = s.leader_id?;
            let alive = self
                .coordinators
                .iter()
                .any(|c| c.id == id && c.proc.child.is_some());
            alive.then_some(id)
        })
        .await
    }

    /// Waits until the cluster status satisfies `pred`.
    pub async fn wait_status(
        &self,
        what: &str,
        deadline: Duration,
        pred: impl Fn(&v1::ClusterStatusResponse) -> bool,
    ) -> v1::ClusterStatusResponse {
        wait_for(what, deadline, || async {
            self.status().await.filter(|s| pred(s))
        })
        .await
    }

    /// A client of the current leader (with the cluster token).
    pub async fn leader_client(&self) -> anyhow::Result<Client> {
        self.leader_client_as(TOKEN).await
    }

    /// A client of the current leader that presents `token` (a user's) instead of the
    /// cluster token.
    pub async fn leader_client_as(&self, token: &str) -> anyhow::Result<Client> {
        let id = self.wait_leader(Duration::from_secs(60)).await;
        let i = self
            .coordinators
            .iter()
            .position(|c| c.id == id)
            .context("leader is a member")?;
        let ch =
            coordinator_channel(&self.coordinators[i].grpc, self.client_tls().as_ref()).await?;
        Ok(ClientServiceClient::with_interceptor(ch, Auth::new(token)))
    }

    /// Submits through the leader (following it across leader changes with the same
    /// request id, for up to 60 s).
    pub async fn submit(
        &self,
        request_id: &str,
        spec: v1::JobSpec,
    ) -> anyhow::Result<v1::SubmitJobResponse> {
        self.view()
            .submit(0, request_id, spec, Duration::from_secs(60))
            .await
    }

    /// Reads a job (linearizable, through the leader), retrying across leader changes.
    pub async fn job(&self, job_id: &str) -> Option<v1::Job> {
        let mut c = self.leader_client().await.ok()?;
        let r = c
            .get_job(v1::GetJobRequest {
                job_id: job_id.into(),
                linearizable: true,
            })
            .await
            .ok()?;
        r.into_inner().job
    }

    /// Waits until the job satisfies `pred`; returns it.
    pub async fn wait_job(
        &self,
        job_id: &str,
        what: &str,
        deadline: Duration,
        pred: impl Fn(&v1::Job) -> bool,
    ) -> v1::Job {
        wait_for(what, deadline, || async {
            self.job(job_id).await.filter(|j| pred(j))
        })
        .await
    }

    /// Waits until the job is terminal.
    pub async fn wait_finished(&self, job_id: &str, deadline: Duration) -> v1::Job {
        self.wait_job(job_id, &format!("{job_id} to finish"), deadline, |j| {
            j.job_state().is_ok_and(JobState::is_terminal)
        })
        .await
    }

    /// Runs `cumulusctl` against this cluster and returns its output.
    pub fn cumulusctl(&self, args: &[&str]) -> anyhow::Result<std::process::Output> {
        let tls = match self.ca_file() {
            Some(ca) => vec!["--tls-ca".to_string(), ca.display().to_string()],
            None => vec!["--insecure".to_string()],
        };
        Ok(Command::new(bin("cumulusctl"))
            .args(&tls)
            .arg("--addr")
            .arg(self.grpc_addrs())
            .arg("--http")
            .arg(self.http_addrs())
            .arg("--token-file")
            .arg(&self.token_file)
            .args(args)
            .env("XDG_CACHE_HOME", self.client_cache_dir())
            .stdin(Stdio::null())
            .output()?)
    }

    /// A cloneable client-side view of the coordinators' addresses, for concurrent
    /// clients while the cluster itself is being mutated (faults, restarts).
    pub fn view(&self) -> View {
        View {
            grpc: self.coordinators.iter().map(|c| c.grpc.clone()).collect(),
            tls: self.client_tls(),
        }
    }

    /// Prints, for every process, its Cumulus errors and lifecycle events (rank exits,
    /// restarts, expiries, elections; openraft's per-RPC noise left out) and the tail of
    /// its log (without the errors of RPCs to an unreachable peer), without colour codes
    /// and with repeated lines folded (called when a test
    /// fails; CI shows only an excerpt of a failing test's output, so it is kept short).
    pub fn dump_logs(&self) {
        let procs = self
            .coordinators
            .iter()
            .map(|c| &c.proc)
            .chain(self.workers.iter());
        for p in procs {
            let text = std::fs::read_to_string(&p.log).unwrap_or_default();
            let lines: Vec<String> = text.lines().map(strip_ansi).collect();
            let events: Vec<&str> = lines
                .iter()
                .map(String::as_str)
                .filter(|l| !l.contains("openraft::") && is_notable(l))
                .take(30)
                .collect();
            // Unreachable-peer errors of a killed coordinator would fill the tail.
            let kept: Vec<String> = lines
                .iter()
                .filter(|l| !l.contains("Unreachable node"))
                .cloned()
                .collect();
            let tail = fold_repeats(&kept[kept.len().saturating_sub(25)..]);
            let exit = p
                .child
                .as_ref()
                .map_or("killed by the test".to_string(), |c| {
                    format!("pid {}", c.id())
                });
            eprintln!(
                "===== {} ({}, {exit}) =====\n--- errors and events ---\n{}\n--- tail ---\n{}",
                p.name,
                p.log.display(),
                events.join("\n"),
                tail.join("\n")
            );
        }
    }
}

/// The coordinators' advertised gRPC addresses, for clients (see [`Cluster::view`]).
#[derive(Clone, Debug)]
pub struct View {
    /// gRPC address of each coordinator.
    pub grpc: Vec<String>,
    /// A user's client TLS (`None`: the cluster is insecure).
    pub tls: Option<ClientTls>,
}

impl View {
    /// A client of coordinator `i`; connecting (TCP, TLS and HTTP/2 handshakes) is
    /// bounded by [`crate::CONNECT_DEADLINE`].
    pub async fn client_of(&self, i: usize) -> anyhow::Result<Client> {
        let endpoint = crate::endpoint(&self.grpc[i], self.tls.as_ref())?
            .connect_timeout(Duration::from_secs(1))
            .timeout(Duration::from_secs(5));
        let ch = crate::connect_bounded(&self.grpc[i], endpoint).await?;
        Ok(ClientServiceClient::with_interceptor(ch, Auth::new(TOKEN)))
    }

    /// Submits with one request id, starting at coordinator `first` and following
    /// leader hints or rotating on errors (the shared leader-following client), for up to
    /// `deadline`.
    pub async fn submit(
        &self,
        first: usize,
        request_id: &str,
        spec: v1::JobSpec,
        deadline: Duration,
    ) -> anyhow::Result<v1::SubmitJobResponse> {
        let n = self.grpc.len();
        let addrs: Vec<String> = (0..n).map(|k| self.grpc[(first + k) % n].clone()).collect();
        let client = LeaderClient::new(
            &addrs,
            TOKEN,
            ChannelSettings {
                connect_timeout: Duration::from_secs(1),
                request_timeout: Duration::from_secs(5),
                keep_alive: None,
                tls: self.tls.clone(),
            },
        )?;
        let policy = RetryPolicy {
            max_attempts: u32::MAX,
            max_total: deadline,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(500),
            attempt_timeout: Duration::from_secs(5),
            retry_server_errors: false,
            warn_after_attempts: 0,
        };
        let req = v1::SubmitJobRequest {
            allow_pending: false,
            request_id: request_id.into(),
            spec: Some(spec),
        };
        let r = client
            .call("SubmitJob", &policy, None, &req, |ch, r| async move {
                ClientServiceClient::new(ch).submit_job(r).await
            })
            .await?;
        Ok(r)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let message = LAST_PANIC.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(message) = &message {
                eprintln!("===== the test failed =====\n{message}");
            }
            self.dump_logs();
            if let Some(message) = &message {
                eprintln!(
                    "===== the test failed (the panic, repeated after the logs) =====\n{message}"
                );
            }
        }
        for w in &mut self.workers {
            w.kill9();
        }
        for c in &mut self.coordinators {
            c.proc.kill9();
        }
    }
}
