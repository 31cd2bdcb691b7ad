//! Test harness for end-to-end tests: starts real `cumulus-coordinator` and
//! `cumulus-worker` processes on 127.0.0.1 in a temp dir, talks to them over gRPC and
//! HTTP, kills them with SIGKILL, and waits on conditions (never on fixed sleeps).
//!
//! The binaries are taken from the cargo target dir of the test executable, so run
//! `cargo build --workspace --bins` before `cargo test` (the README's test command
//! does).

pub mod history;
pub mod nemesis;
pub mod net;
pub mod ranks;

use std::fs::File;
use std::future::Future;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use cumulus_api::JobState;
use cumulus_api::leader::{ChannelSettings, LeaderClient, RetryPolicy};
use cumulus_api::v1;
use cumulus_api::v1::client_service_client::ClientServiceClient;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tonic::codegen::InterceptedService;
use tonic::transport::{Channel, Endpoint};

/// The token every test cluster uses.
pub const TOKEN: &str = "e2e-test-token-0123456789abcdef";
/// Peer token of test clusters: what coordinators present to each other's Raft service
/// (in the file `peer-token` of the cluster's temp dir).
pub const PEER_TOKEN: &str = "e2e-peer-token-fedcba9876543210";

/// Directory holding the workspace's binaries (target/debug or target/release): the
/// directory of the running executable, or its parent for test executables in `deps/`.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the running executable has a path");
    let dir = exe.parent().expect("an executable lives in a directory");
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().expect("deps has a parent").to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

/// Path of a workspace binary; panics with the fix when it was not built.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

/// Root of the workspace (for the bundled data set).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e lives in the workspace")
        .to_path_buf()
}

/// Lowest port handed out by [`free_port`].
pub const TEST_PORT_MIN: u16 = 10_000;
/// One past the highest port handed out by [`free_port`]: below Linux's ephemeral range
/// (32768–60999), so no outgoing connection of any process can take a port between
/// the moment it is chosen and the moment a coordinator binds it.
pub const TEST_PORT_END: u16 = 32_000;

/// A free TCP port on 127.0.0.1 outside the ephemeral range, never the same twice in
/// one test process (bound, then released for the process that will use it).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let span = u32::from(TEST_PORT_END - TEST_PORT_MIN);
    // Spread concurrent test processes apart by pid.
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = TEST_PORT_MIN + ((start + n) % span) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {TEST_PORT_MIN}..{TEST_PORT_END}");
}

/// Polls `f` every 100 ms until it yields `Some`, or panics after `deadline` naming `what`.
pub async fn wait_for<T, F, Fut>(what: &str, deadline: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Adds the bearer token to gRPC calls.
#[derive(Clone)]
pub struct Auth(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl Auth {
    /// For `token`.
    pub fn new(token: &str) -> Self {
        Auth(format!("Bearer {token}").parse().expect("ascii token"))
    }
}

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        req.metadata_mut().insert("authorization", self.0.clone());
        Ok(req)
    }
}

/// An authenticated client of one coordinator.
pub type Client = ClientServiceClient<InterceptedService<Channel, Auth>>;

/// An authenticated worker-API client of one coordinator (tests that play an agent).
pub type WorkerClient =
    v1::worker_service_client::WorkerServiceClient<InterceptedService<Channel, Auth>>;

/// A channel to the coordinator at `grpc_addr` (host:port): 1 s to connect, 10 s per call.
pub async fn coordinator_channel(grpc_addr: &str) -> anyhow::Result<Channel> {
    Ok(Endpoint::from_shared(format!("http://{grpc_addr}"))?
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(10))
        .connect()
        .await?)
}

/// A worker-API client of the coordinator at `grpc_addr`.
pub async fn worker_client(grpc_addr: &str) -> anyhow::Result<WorkerClient> {
    let ch = coordinator_channel(grpc_addr).await?;
    Ok(v1::worker_service_client::WorkerServiceClient::with_interceptor(ch, Auth::new(TOKEN)))
}

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

/// `RUST_LOG` of a test coordinator: `info,openraft=warn`, then `extra` if any.
fn coordinator_log_filter(extra: Option<&str>) -> String {
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
    /// Open-file limit (soft and hard) of the worker agents (`None`: inherited).
    pub worker_nofile: Option<u64>,
}

/// How coordinators and workers reach a test S3 server.
#[derive(Clone, Debug)]
pub struct S3Access {
    /// Endpoint URL, `http://127.0.0.1:<port>`.
    pub endpoint: String,
    /// Access key id.
    pub access_key: String,
    /// Secret access key.
    pub secret_key: String,
    /// Retry deadline of transient failures, milliseconds.
    pub retry_deadline_ms: u64,
}

impl S3Access {
    /// `CUMULUS_S3_*` environment of a process.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("CUMULUS_S3_ENDPOINT", self.endpoint.clone()),
            ("CUMULUS_S3_PATH_STYLE", "true".into()),
            ("CUMULUS_S3_ACCESS_KEY", self.access_key.clone()),
            ("CUMULUS_S3_SECRET_KEY", self.secret_key.clone()),
            (
                "CUMULUS_S3_RETRY_DEADLINE_MS",
                self.retry_deadline_ms.to_string(),
            ),
            ("CUMULUS_S3_PART_SIZE_MIB", "5".into()),
        ]
    }

    /// The same settings for an in-process [`cumulus_ckpt::S3Store`].
    pub fn settings(&self) -> cumulus_ckpt::S3Settings {
        cumulus_ckpt::S3Settings {
            endpoint_url: Some(self.endpoint.clone()),
            force_path_style: true,
            access_key_id: Some(self.access_key.clone()),
            secret_access_key: Some(self.secret_key.clone()),
            retry_deadline_ms: 5_000,
            ..cumulus_ckpt::S3Settings::default()
        }
    }

    /// The store of `url` (`s3://bucket/prefix`) as the tests' independent reader.
    pub async fn store(&self, url: &str) -> anyhow::Result<cumulus_ckpt::S3Store> {
        let settings = self.settings();
        let client = settings.client().await?;
        Ok(cumulus_ckpt::S3Store::new(
            client,
            settings,
            cumulus_ckpt::S3Location::parse(url)?,
        ))
    }
}

/// Path of the `s3s-fs` binary: `$CUMULUS_S3S_FS`, else `~/.cargo/bin/s3s-fs`, else PATH.
pub fn s3s_fs_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("CUMULUS_S3S_FS") {
        return path.into();
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let cargo_bin = home.join(".cargo/bin/s3s-fs");
    if cargo_bin.exists() {
        return cargo_bin;
    }
    PathBuf::from("s3s-fs")
}

/// A real S3 server (`s3s-fs`) on a loopback port, serving a temp dir; it can be stopped
/// and restarted on the same port and data. Killed on drop.
pub struct S3Server {
    /// The process.
    pub proc: Proc,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// Access for clients.
    pub access: S3Access,
    dir: tempfile::TempDir,
}

impl S3Server {
    /// Starts `s3s-fs` and waits until it accepts connections.
    pub async fn start() -> anyhow::Result<S3Server> {
        let dir = tempfile::Builder::new().prefix("cumulus-s3-").tempdir()?;
        std::fs::create_dir_all(dir.path().join("data"))?;
        let port = free_port();
        let mut server = S3Server {
            proc: Proc {
                name: "s3s-fs".into(),
                child: None,
                log: dir.path().join("s3s-fs.log"),
            },
            port,
            access: S3Access {
                endpoint: format!("http://127.0.0.1:{port}"),
                access_key: "cumulus-e2e-key".into(),
                secret_key: "cumulus-e2e-secret".into(),
                retry_deadline_ms: 120_000,
            },
            dir,
        };
        server.spawn().await?;
        Ok(server)
    }

    /// (Re)starts the process on the same port and data dir.
    pub async fn spawn(&mut self) -> anyhow::Result<()> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.proc.log)?;
        let child = Command::new(s3s_fs_binary())
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--access-key", &self.access.access_key])
            .args(["--secret-key", &self.access.secret_key])
            .arg(self.dir.path().join("data"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawning s3s-fs (cargo install s3s-fs@0.14.1 --locked --features binary)")?;
        self.proc.child = Some(child);
        let port = self.port;
        wait_for("s3s-fs to listen", Duration::from_secs(30), || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
                .map(|_| ())
        })
        .await;
        Ok(())
    }

    /// Creates a bucket through the S3 API.
    pub async fn create_bucket(&self, bucket: &str) -> anyhow::Result<()> {
        let client = self.access.settings().client().await?;
        client.create_bucket().bucket(bucket).send().await?;
        Ok(())
    }
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
            worker_nofile: None,
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
}

static ONE_CLUSTER_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The message of the last panic in this test process, repeated after the log dump of a
/// failing test (CI shows the tail of a failing test's output, and the dump buries the
/// panic message above it).
static LAST_PANIC: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Installs (once per process) a panic hook that records the message in [`LAST_PANIC`]
/// and then runs the default hook.
fn record_panics() {
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
        let serial = ONE_CLUSTER_AT_A_TIME
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let dir = tempfile::Builder::new().prefix("cumulus-e2e-").tempdir()?;
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, TOKEN)?;
        std::fs::write(dir.path().join("peer-token"), PEER_TOKEN)?;
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
                s.workers.iter().filter(|w| w.state == "alive").count() == n
            })
            .await;
        Ok(cluster)
    }

    fn peers(&self) -> Vec<String> {
        self.coordinators
            .iter()
            .filter(|c| !c.join)
            .flat_map(|c| {
                [
                    "--peer".to_string(),
                    format!("{}={}@{}", c.id, c.grpc, c.http),
                ]
            })
            .collect()
    }

    /// (Re)starts coordinator `i` (index into `coordinators`) on its data dir. A
    /// joining coordinator is given only itself as peer, plus `--join`.
    pub fn spawn_coordinator(&mut self, i: usize) -> anyhow::Result<()> {
        let mut peers = self.peers();
        let c = &mut self.coordinators[i];
        let mut extra: Vec<String> = Vec::new();
        if c.join {
            peers = vec!["--peer".into(), format!("{}={}@{}", c.id, c.grpc, c.http)];
            extra.push("--join".into());
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

    /// `GRPC@HTTP` of coordinator `i`, as `cumulusctl cluster add-learner` takes it.
    pub fn member_addr(&self, i: usize) -> String {
        let c = &self.coordinators[i];
        format!("{}@{}", c.grpc, c.http)
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
        let w = &mut self.workers[i];
        let log = File::options().create(true).append(true).open(&w.log)?;
        let mut command = Command::new(bin("cumulus-worker"));
        if let Some(nofile) = self.opts.worker_nofile {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
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
            .args(&self.opts.worker_args)
            .envs(self.opts.s3.iter().flat_map(S3Access::env))
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

    /// The token file path.
    pub fn token_file(&self) -> &Path {
        &self.token_file
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
        let ch = coordinator_channel(&self.coordinators[i].grpc).await?;
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

    /// A client of the current leader.
    pub async fn leader_client(&self) -> anyhow::Result<Client> {
        let id = self.wait_leader(Duration::from_secs(60)).await;
        let i = self
            .coordinators
            .iter()
            .position(|c| c.id == id)
            .context("leader is a member")?;
        self.client_of(i).await
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
        Ok(Command::new(bin("cumulusctl"))
            .arg("--addr")
            .arg(self.grpc_addrs())
            .arg("--http")
            .arg(self.http_addrs())
            .arg("--token-file")
            .arg(&self.token_file)
            .args(args)
            .stdin(Stdio::null())
            .output()?)
    }

    /// A cloneable client-side view of the coordinators' addresses, for concurrent
    /// clients while the cluster itself is being mutated (faults, restarts).
    pub fn view(&self) -> View {
        View {
            grpc: self.coordinators.iter().map(|c| c.grpc.clone()).collect(),
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

/// `line` without ANSI escape sequences (`ESC [ ... letter`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Whether a log line is worth showing in a failure dump: an error or panic, or a
/// lifecycle event of a job, rank, worker or leader.
fn is_notable(line: &str) -> bool {
    const WORDS: [&str; 12] = [
        "panicked",
        "ERROR",
        "WARN",
        "exited",
        "restart",
        "lost",
        "expired",
        "failed",
        "acting as leader",
        "starting rank attempt",
        "stopping",
        "job succeeded",
    ];
    line.starts_with("Error") || WORDS.iter().any(|w| line.contains(w))
}

/// `lines` with each run of lines that differ only in their timestamp (the first
/// whitespace-separated word) folded into its first line and a count.
fn fold_repeats(lines: &[String]) -> Vec<String> {
    let body = |l: &str| l.split_once(' ').map_or(l, |(_, rest)| rest).to_string();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let b = body(&lines[i]);
        let mut j = i + 1;
        while j < lines.len() && body(&lines[j]) == b {
            j += 1;
        }
        out.push(lines[i].clone());
        if j - i > 1 {
            out.push(format!("  (the line above {} times in all)", j - i));
        }
        i = j;
    }
    out
}

/// The coordinators' advertised gRPC addresses, for clients (see [`Cluster::view`]).
#[derive(Clone, Debug)]
pub struct View {
    /// gRPC address of each coordinator.
    pub grpc: Vec<String>,
}

impl View {
    /// A client of coordinator `i`.
    pub async fn client_of(&self, i: usize) -> anyhow::Result<Client> {
        let ch = Endpoint::from_shared(format!("http://{}", self.grpc[i]))?
            .connect_timeout(Duration::from_secs(1))
            .timeout(Duration::from_secs(5))
            .connect()
            .await?;
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
            request_id: request_id.into(),
            spec: Some(spec),
        };
        let r = client
            .call("SubmitJob", &policy, None, &req, |ch, r| async move {
                ClientServiceClient::new(ch).submit_job(r).await
            })
            .await
            .with_context(|| format!("submit {request_id}"))?;
        Ok(r)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        if std::thread::panicking()
            && let Ok(log) = std::fs::read_to_string(&self.proc.log)
        {
            eprintln!("----- s3s-fs log -----\n{log}");
        }
        self.proc.kill9();
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

/// The example workload: digits split into shards and a holdout file.
pub struct Workload {
    /// Shard directory.
    pub shards_dir: PathBuf,
    /// Holdout CSV.
    pub holdout: PathBuf,
}

/// Creates `files` empty files in `dir` (created) whose names are `name_bytes` long
/// (at least 9): a dataset whose shard list is large without its shards taking space.
pub fn make_named_files(dir: &Path, files: usize, name_bytes: usize) -> anyhow::Result<()> {
    anyhow::ensure!(name_bytes >= 9, "names need at least 9 bytes");
    std::fs::create_dir_all(dir)?;
    for i in 0..files {
        let name = format!("{i:08}-{}", "s".repeat(name_bytes - 9));
        std::fs::File::create(dir.join(name))?;
    }
    Ok(())
}

/// Splits the bundled digits data with `cumulusctl dataset split` into `shards` shards
/// plus a 20% holdout, under `dir`.
pub fn prepare_digits(dir: &Path, shards: u32) -> anyhow::Result<Workload> {
    let shards_dir = dir.join("shards");
    let holdout = dir.join("holdout.csv");
    let data = workspace_root().join("data/digits/digits.csv.gz");
    let out = Command::new(bin("cumulusctl"))
        .args(["dataset", "split"])
        .arg(&data)
        .arg("--shards")
        .arg(shards.to_string())
        .arg("--out")
        .arg(&shards_dir)
        .arg("--holdout-fraction")
        .arg("0.2")
        .arg("--holdout-out")
        .arg(&holdout)
        .output()?;
    if !out.status.success() {
        bail!(
            "dataset split failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(Workload {
        shards_dir,
        holdout,
    })
}

/// A trainer job spec: world size `world_size` over `w`, checkpoints to `ckpt_dir`,
/// results under `out_dir`.
pub fn trainer_spec(
    w: &Workload,
    world_size: u32,
    ckpt_dir: &Path,
    out_dir: &Path,
    extra: &[&str],
) -> v1::JobSpec {
    let mut command = vec![
        bin("cumulus-trainer").to_string_lossy().to_string(),
        "train".into(),
        "--test-file".into(),
        w.holdout.to_string_lossy().to_string(),
        "--out".into(),
        out_dir.to_string_lossy().to_string(),
    ];
    command.extend(extra.iter().map(|s| s.to_string()));
    v1::JobSpec {
        world_size,
        command,
        dataset: w.shards_dir.to_string_lossy().to_string(),
        ckpt_dir: ckpt_dir.to_string_lossy().to_string(),
        ..Default::default()
    }
}

/// A rank's `result.json` written by the trainer.
pub fn read_result(out_dir: &Path, rank: u32) -> anyhow::Result<serde_json::Value> {
    let p = out_dir.join(format!("rank-{rank}")).join("result.json");
    let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// Asserts (panics otherwise) that every rank of a `world_size`-rank trainer job whose
/// outputs are under `out` consumed each record of its shards exactly once per epoch (its
/// reported digest equals [`expected_digest`]) and, when `min_accuracy` is given, reached
/// at least that holdout accuracy (a fraction in 0..=1).
pub fn assert_trainer_results(
    cluster: &Cluster,
    w: &Workload,
    out: &Path,
    world_size: u32,
    epochs: u32,
    min_accuracy: Option<f64>,
) {
    for rank in 0..world_size {
        let r = read_result(out, rank).expect("result.json");
        let want = expected_digest(w, world_size, rank, epochs, cluster.dir.path())
            .expect("expected digest");
        assert_eq!(
            r["digest"].as_str(),
            Some(want.as_str()),
            "rank {rank}: every record exactly once"
        );
        if let Some(min) = min_accuracy {
            let acc = r["accuracy"].as_f64().expect("accuracy");
            assert!(acc >= min, "rank {rank} accuracy {acc} < {min}");
        }
    }
}

/// The digest the trainer must report for `rank` when it consumed each record of its
/// shards exactly once per epoch, computed by `cumulus-trainer digest` from the shard
/// files read directly.
pub fn expected_digest(
    w: &Workload,
    world_size: u32,
    rank: u32,
    epochs: u32,
    tmp: &Path,
) -> anyhow::Result<String> {
    let mut shards: Vec<PathBuf> = std::fs::read_dir(&w.shards_dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    shards.sort();
    let mine: Vec<String> = shards
        .iter()
        .enumerate()
        .filter(|(i, _)| *i as u32 % world_size == rank)
        .map(|(_, p)| p.to_string_lossy().to_string())
        .collect();
    let list = tmp.join(format!("expected-rank-{rank}.shards"));
    std::fs::write(&list, mine.join("\n") + "\n")?;
    let out = Command::new(bin("cumulus-trainer"))
        .args(["digest", "--shards-file"])
        .arg(&list)
        .arg("--epochs")
        .arg(epochs.to_string())
        .output()?;
    if !out.status.success() {
        bail!(
            "trainer digest failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8(out.stdout)?;
    let digest = text
        .split_whitespace()
        .last()
        .context("digest output is empty")?
        .to_string();
    Ok(digest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dump_line_loses_its_colour_codes() {
        let line = "\u{1b}[2m2026-11-24T15:16:24Z\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m job succeeded";
        assert_eq!(strip_ansi(line), "2026-11-24T15:16:24Z  INFO job succeeded");
    }

    #[test]
    fn lines_that_differ_only_in_their_timestamp_are_folded() {
        let lines: Vec<String> = [
            "t1 ERROR x",
            "t2 ERROR x",
            "t3 ERROR x",
            "t4 INFO y",
            "t5 ERROR x",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            fold_repeats(&lines),
            vec![
                "t1 ERROR x".to_string(),
                "  (the line above 3 times in all)".to_string(),
                "t4 INFO y".to_string(),
                "t5 ERROR x".to_string(),
            ]
        );
    }
}
