//! Heartbeat scale (issue 3, measurement 5): N simulated worker agents in this process
//! register with the leader and heartbeat at 1 Hz over a few shared HTTP/2 channels.
//! Measured: heartbeats handled per second, p99 handling latency (seen by the client),
//! leader CPU (cores) and RSS, and false expirations (simulated workers that the leader
//! expired although they never stopped heartbeating).
//!
//! The load generator shares the machine's 2 cores with the 3 coordinators, so the
//! leader's CPU figure is what it used while competing for them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cumulus_api::v1;
use cumulus_api::v1::worker_service_client::WorkerServiceClient;
use cumulus_e2e::{Auth, Cluster, ClusterOpts, TOKEN};
use tokio::sync::{Mutex, Semaphore};
use tonic::codegen::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::Ctx;
use crate::procstat::{cpu_seconds, rss_bytes};
use crate::report::{Row, percentile};

pub(crate) type WorkerClient = WorkerServiceClient<InterceptedService<Channel, Auth>>;

/// Simulated workers per HTTP/2 channel.
const WORKERS_PER_CHANNEL: usize = 500;
/// Concurrent registrations.
const REGISTER_CONCURRENCY: usize = 64;

/// Runs the scenario for each fleet size.
pub async fn run(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    let sizes: Vec<usize> = ctx.pick(vec![1_000, 10_000], vec![100]);
    let window = Duration::from_secs(ctx.pick(30, 3));
    let mut rows = Vec::new();
    for n in sizes {
        rows.extend(one_fleet(n, window).await?);
    }
    Ok(rows)
}

/// Runs the scenario for one fleet of `n` simulated workers: a plaintext cluster, the
/// fleet registered and heartbeating, one `window` of steady state measured.
async fn one_fleet(n: usize, window: Duration) -> anyhow::Result<Vec<Row>> {
    let (cluster, leader_pid, endpoint) = plaintext_cluster().await?;
    let channels = worker_channels(
        &endpoint,
        n.div_ceil(WORKERS_PER_CHANNEL),
        Duration::from_secs(10),
    )
    .await?;
    let fleet = Fleet::spawn(&channels, n, window);
    // Wait until every simulated worker is registered (bounded).
    let registered = cumulus_e2e::wait_for(
        "every simulated worker registered",
        Duration::from_secs(600),
        || async {
            let s = cluster.status().await?;
            (s.workers.len() >= n).then_some(Instant::now())
        },
    )
    .await;
    eprintln!(
        "   {n} workers registered in {:.1} s",
        (registered - fleet.started).as_secs_f64()
    );
    let measured = measure_window(&cluster, leader_pid, &fleet, window).await?;
    let latencies = fleet.finish().await;
    Ok(fleet_rows(n, &measured, &latencies))
}

/// Starts a cluster of the default coordinators with no worker and without TLS (the
/// simulated agents share a few channels, which mutual TLS, one certificate per worker,
/// checked on every call, would not allow) and waits up to 60 s for its leader.
/// Returns the cluster, the leader's pid and its gRPC endpoint (`http://host:port`).
///
/// # Errors
/// The cluster does not start.
pub(crate) async fn plaintext_cluster() -> anyhow::Result<(Cluster, u32, String)> {
    let cluster = Cluster::start(ClusterOpts {
        workers: 0,
        tls: false,
        ..ClusterOpts::default()
    })
    .await?;
    let leader = cluster.wait_leader(Duration::from_secs(60)).await;
    let li = cluster
        .coordinators
        .iter()
        .position(|c| c.id == leader)
        .expect("leader is a member");
    let leader_pid = cluster.coordinators[li].proc.pid().expect("leader alive");
    let endpoint = format!("http://{}", cluster.coordinators[li].grpc);
    Ok((cluster, leader_pid, endpoint))
}

/// Opens `count` HTTP/2 channels to `endpoint` (each call on them limited to `timeout`),
/// one worker-service client with the cluster token on each.
///
/// # Errors
/// The endpoint is invalid or a connection fails.
pub(crate) async fn worker_channels(
    endpoint: &str,
    count: usize,
    timeout: Duration,
) -> anyhow::Result<Vec<WorkerClient>> {
    let mut channels = Vec::new();
    for _ in 0..count {
        let ch = Endpoint::from_shared(endpoint.to_string())?
            .timeout(timeout)
            .connect()
            .await?;
        channels.push(WorkerServiceClient::with_interceptor(ch, Auth::new(TOKEN)));
    }
    Ok(channels)
}

/// The simulated workers of one fleet, and what they count.
struct Fleet {
    /// Set to 1 to stop every simulated worker.
    stop: Arc<AtomicU64>,
    /// Heartbeats answered while measuring.
    handled: Arc<AtomicU64>,
    /// Latencies of those heartbeats, in milliseconds.
    latencies: Arc<Mutex<Vec<f64>>>,
    /// 1 while the window is measured.
    measuring: Arc<AtomicU64>,
    /// When the workers were started.
    started: Instant,
    /// One task per simulated worker.
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Fleet {
    /// Starts `n` simulated workers, [`WORKERS_PER_CHANNEL`] per channel of `channels`,
    /// registering at most [`REGISTER_CONCURRENCY`] at once; room for the latencies of
    /// one `window` is reserved.
    fn spawn(channels: &[WorkerClient], n: usize, window: Duration) -> Fleet {
        let stop = Arc::new(AtomicU64::new(0));
        let handled = Arc::new(AtomicU64::new(0));
        let latencies = Arc::new(Mutex::new(Vec::<f64>::with_capacity(
            n * window.as_secs() as usize,
        )));
        let measuring = Arc::new(AtomicU64::new(0));
        let register = Arc::new(Semaphore::new(REGISTER_CONCURRENCY));
        let started = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..n {
            let client: WorkerClient = channels[i / WORKERS_PER_CHANNEL].clone();
            let (stop, handled, latencies, measuring, register) = (
                stop.clone(),
                handled.clone(),
                latencies.clone(),
                measuring.clone(),
                register.clone(),
            );
            tasks.push(tokio::spawn(async move {
                simulated_worker(i, client, stop, handled, latencies, measuring, register).await
            }));
        }
        Fleet {
            stop,
            handled,
            latencies,
            measuring,
            started,
            tasks,
        }
    }

    /// Stops every simulated worker, waits for them, and returns the heartbeat latencies
    /// measured, in milliseconds.
    async fn finish(self) -> Vec<f64> {
        self.stop.store(1, Ordering::SeqCst);
        for t in self.tasks {
            let _ = t.await;
        }
        self.latencies.lock().await.clone()
    }
}

/// What one window of steady state measured.
struct Window {
    /// Heartbeats handled per second.
    rate: f64,
    /// The leader's CPU, in cores.
    cpu: f64,
    /// The leader's RSS after the window, in MB.
    rss_mb: f64,
    /// Simulated workers the leader reports expired after the window.
    expired: usize,
}

/// Measures one `window` of the running `fleet`: heartbeats handled (their latencies go
/// to the fleet), the CPU of the leader (`leader_pid`), then its RSS and the workers the
/// cluster reports expired.
///
/// # Errors
/// The leader's CPU or RSS cannot be read, or no coordinator answers the status.
async fn measure_window(
    cluster: &Cluster,
    leader_pid: u32,
    fleet: &Fleet,
    window: Duration,
) -> anyhow::Result<Window> {
    fleet.handled.store(0, Ordering::SeqCst);
    fleet.measuring.store(1, Ordering::SeqCst);
    let cpu0 = cpu_seconds(leader_pid)?;
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let elapsed = t0.elapsed().as_secs_f64();
    let cpu = (cpu_seconds(leader_pid)? - cpu0) / elapsed;
    fleet.measuring.store(0, Ordering::SeqCst);
    let rate = fleet.handled.load(Ordering::SeqCst) as f64 / elapsed;
    let rss_mb = rss_bytes(leader_pid)? as f64 / 1e6;
    let status = cluster
        .status()
        .await
        .ok_or_else(|| anyhow::anyhow!("no cluster status"))?;
    let expired = status
        .workers
        .iter()
        .filter(|w| w.worker_phase() == Ok(cumulus_api::WorkerPhase::Expired))
        .count();
    Ok(Window {
        rate,
        cpu,
        rss_mb,
        expired,
    })
}

/// The rows of a fleet of `n`: heartbeats handled, latency p50 and p99 (of `lat`, in
/// ms), and false expirations, leader CPU and RSS (with targets from 10,000 workers on).
fn fleet_rows(n: usize, w: &Window, lat: &[f64]) -> Vec<Row> {
    let label = |m: &str| format!("n={n}: {m}");
    let mut rows = vec![
        Row::new(
            "heartbeat_scale",
            &label("heartbeats handled"),
            w.rate,
            "per s",
            lat.len(),
        ),
        Row::new(
            "heartbeat_scale",
            &label("heartbeat latency p50"),
            percentile(lat, 50.0),
            "ms",
            lat.len(),
        ),
        Row::new(
            "heartbeat_scale",
            &label("heartbeat latency p99"),
            percentile(lat, 99.0),
            "ms",
            lat.len(),
        ),
    ];
    if n >= 10_000 {
        rows.push(Row::below(
            "heartbeat_scale",
            &label("false expirations"),
            w.expired as f64,
            "count",
            n,
            1.0,
        ));
        rows.push(Row::below(
            "heartbeat_scale",
            &label("leader CPU"),
            w.cpu,
            "cores",
            1,
            1.0,
        ));
        rows.push(Row::below(
            "heartbeat_scale",
            &label("leader RSS"),
            w.rss_mb,
            "MB",
            1,
            500.0,
        ));
    } else {
        rows.push(Row::new(
            "heartbeat_scale",
            &label("false expirations"),
            w.expired as f64,
            "count",
            n,
        ));
        rows.push(Row::new(
            "heartbeat_scale",
            &label("leader CPU"),
            w.cpu,
            "cores",
            1,
        ));
        rows.push(Row::new(
            "heartbeat_scale",
            &label("leader RSS"),
            w.rss_mb,
            "MB",
            1,
        ));
    }
    rows
}

async fn simulated_worker(
    i: usize,
    mut client: WorkerClient,
    stop: Arc<AtomicU64>,
    handled: Arc<AtomicU64>,
    latencies: Arc<Mutex<Vec<f64>>>,
    measuring: Arc<AtomicU64>,
    register: Arc<Semaphore>,
) {
    let worker_id = format!("sim-{i:05}");
    {
        let Ok(_permit) = register.acquire().await else {
            return;
        };
        register_simulated(&mut client, &worker_id).await;
    }
    // Spread the fleet over the second.
    tokio::time::sleep(Duration::from_millis((i as u64 * 7_919) % 1_000)).await;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let resources = v1::Resources {
        cpu_percent: 5.0,
        memory_used_bytes: 1 << 30,
        memory_total_bytes: 8 << 30,
        gpus: Vec::new(),
        warm_spares: Vec::new(),
    };
    while stop.load(Ordering::Relaxed) == 0 {
        tick.tick().await;
        let req = v1::HeartbeatRequest {
            worker_id: worker_id.clone(),
            observed: vec![],
            resources: Some(resources.clone()),
        };
        let t = Instant::now();
        let ok = client.heartbeat(req).await.is_ok();
        if ok && measuring.load(Ordering::Relaxed) == 1 {
            handled.fetch_add(1, Ordering::Relaxed);
            latencies
                .lock()
                .await
                .push(t.elapsed().as_secs_f64() * 1_000.0);
        }
    }
}

/// Registers a simulated worker of one slot, retrying (a leader still starting, a
/// loaded machine) up to 50 times, 200 ms apart.
pub(crate) async fn register_simulated(client: &mut WorkerClient, worker_id: &str) {
    let req = v1::RegisterWorkerRequest {
        worker_id: worker_id.to_string(),
        host: "127.0.0.1".into(),
        http_addr: "127.0.0.1:1".into(),
        slots: 1,
        gpus: Vec::new(),
    };
    for _ in 0..50 {
        if client.register(req.clone()).await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
