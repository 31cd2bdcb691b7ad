//! Scheduler scale (issue #27): a real 3-coordinator cluster, 1,000 simulated worker
//! agents of one slot each in this process, and 10,000 single-rank jobs queued before the
//! workers arrive. Each simulated agent does what a real one does for the leader: it long-
//! polls `WatchDesired`, reports every attempt it is given as started, heartbeats at 1 Hz
//! with the attempts it runs, and reports each attempt exited 0 after [`RUN_MS`]; so
//! every slot cycles through the queue. Measured while the queue drains: placements per
//! second (attempts the agents were given), the time from a slot freed (its `RankExited`
//! acknowledged) to the next attempt on it, and the leader's CPU and RSS with thousands of
//! jobs pending; and, before that, the leader's CPU while nothing changes (every slot
//! busy with an attempt that does not end yet, 9,000 jobs pending): the control loop must
//! cost O(changed jobs), not O(all jobs).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cumulus_api::v1;
use cumulus_api::v1::client_service_client::ClientServiceClient;
use cumulus_e2e::{Auth, Cluster, TOKEN};
use tokio::sync::{Mutex, Semaphore};
use tonic::transport::Endpoint;

use crate::Ctx;
use crate::procstat::{cpu_seconds, rss_bytes};
use crate::report::{Row, percentile};

use crate::heartbeat_scale::WorkerClient;

/// How long a simulated attempt runs before it reports exit 0, in milliseconds.
pub const RUN_MS: u64 = 2_000;
/// Simulated workers per HTTP/2 channel.
const WORKERS_PER_CHANNEL: usize = 250;
/// Concurrent submits and registrations.
const CONCURRENCY: usize = 32;

/// What the simulated agents count.
#[derive(Default)]
struct Counters {
    /// Attempts given to agents (each one a placement) while measuring.
    placed: AtomicU64,
    /// Attempts given to agents since the start.
    placed_total: AtomicU64,
    /// True while the draining window is measured.
    measuring: AtomicBool,
    /// True while attempts do not end (the idle phase).
    hold: AtomicBool,
    /// True to stop.
    stop: AtomicBool,
    /// Slot freed → next attempt given, in milliseconds, while measuring.
    refill_ms: Mutex<Vec<f64>>,
}

/// Runs the scenario.
pub async fn run(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    let (workers, jobs): (usize, usize) = ctx.pick((1_000, 10_000), (20, 200));
    // Long enough to measure, short enough that the queue does not run dry while
    // draining (at most ~400 placements per second here).
    let window = Duration::from_secs(ctx.pick(10, 3));
    // Plaintext: the simulated agents share a few channels (as in heartbeat_scale).
    let (cluster, leader_pid, endpoint) = crate::heartbeat_scale::plaintext_cluster().await?;

    // The queue first: every job pending, no worker yet.
    queue_jobs(&endpoint, jobs).await?;

    let counters = Arc::new(Counters::default());
    counters.hold.store(true, Ordering::SeqCst);
    let channels = crate::heartbeat_scale::worker_channels(
        &endpoint,
        workers.div_ceil(WORKERS_PER_CHANNEL),
        Duration::from_secs(40),
    )
    .await?;
    let register = Arc::new(Semaphore::new(CONCURRENCY));
    let mut agents = Vec::new();
    for i in 0..workers {
        let client: WorkerClient = channels[i / WORKERS_PER_CHANNEL].clone();
        let (counters, register) = (counters.clone(), register.clone());
        agents.push(tokio::spawn(async move {
            simulated_agent(i, client, counters, register).await
        }));
    }

    // Idle first: every slot busy with an attempt that does not end yet, the rest of
    // the queue waiting; then draining.
    let idle = measure_idle(&cluster, &counters, leader_pid, workers, jobs, window).await?;
    let drain = measure_drain(&counters, leader_pid, window).await?;
    counters.stop.store(true, Ordering::SeqCst);
    for a in agents {
        let _ = a.await;
    }
    Ok(scheduler_rows(workers, jobs, &idle, &drain))
}

/// Submits `jobs` single-rank jobs (`true`, pending allowed) to the leader at `endpoint`,
/// [`CONCURRENCY`] at a time, and prints how long the queue took.
///
/// # Errors
/// The connection fails or a submit is refused.
async fn queue_jobs(endpoint: &str, jobs: usize) -> anyhow::Result<()> {
    let client_channel = Endpoint::from_shared(endpoint.to_string())?
        .timeout(Duration::from_secs(30))
        .connect()
        .await?;
    let client = ClientServiceClient::with_interceptor(client_channel, Auth::new(TOKEN));
    let submits = Arc::new(Semaphore::new(CONCURRENCY));
    let t_submit = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..jobs {
        let mut client = client.clone();
        let permit = submits.clone().acquire_owned().await?;
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let spec = v1::JobSpec {
                name: format!("queued-{i}"),
                world_size: 1,
                command: vec!["true".into()],
                ..Default::default()
            };
            client
                .submit_job(v1::SubmitJobRequest {
                    request_id: format!("sched-{i}"),
                    spec: Some(spec),
                    allow_pending: true,
                })
                .await
                .map(|_| ())
        }));
    }
    for t in tasks {
        t.await??;
    }
    eprintln!(
        "   {jobs} jobs queued in {:.1} s",
        t_submit.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The idle phase: the leader with every slot busy and the rest of the queue pending.
struct Idle {
    /// Jobs still pending during the window.
    pending: usize,
    /// The leader's CPU, in cores.
    cpu: f64,
}

/// Waits (up to 600 s each) until all `workers` are registered and every slot runs an
/// attempt (while `counters.hold` keeps them from ending), lets the leader settle 2 s,
/// then measures its CPU (`leader_pid`) over one `window`.
///
/// # Errors
/// The leader's CPU cannot be read.
async fn measure_idle(
    cluster: &Cluster,
    counters: &Counters,
    leader_pid: u32,
    workers: usize,
    jobs: usize,
    window: Duration,
) -> anyhow::Result<Idle> {
    cumulus_e2e::wait_for(
        "every simulated worker registered",
        Duration::from_secs(600),
        || async {
            let s = cluster.status().await?;
            (s.workers.len() >= workers).then_some(())
        },
    )
    .await;
    cumulus_e2e::wait_for(
        "every slot running an attempt",
        Duration::from_secs(600),
        || async {
            (counters.placed_total.load(Ordering::SeqCst) as usize >= workers.min(jobs))
                .then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pending = jobs.saturating_sub(counters.placed_total.load(Ordering::SeqCst) as usize);
    let cpu0 = cpu_seconds(leader_pid)?;
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let cpu = (cpu_seconds(leader_pid)? - cpu0) / t0.elapsed().as_secs_f64();
    eprintln!("   {pending} jobs pending in the idle window");
    Ok(Idle { pending, cpu })
}

/// The draining phase: attempts end and slots refill from the queue.
struct Drain {
    /// Attempts given to agents per second.
    placed_per_s: f64,
    /// The leader's CPU, in cores.
    cpu: f64,
    /// Slot freed -> next attempt given, in milliseconds.
    refill_ms: Vec<f64>,
    /// The leader's RSS after the window, in MB.
    rss_mb: f64,
}

/// Lets the attempts end (clears `counters.hold`) and measures one `window` of the
/// queue draining: placements, refill times and the leader's CPU, then its RSS.
///
/// # Errors
/// The leader's CPU or RSS cannot be read.
async fn measure_drain(
    counters: &Counters,
    leader_pid: u32,
    window: Duration,
) -> anyhow::Result<Drain> {
    counters.hold.store(false, Ordering::SeqCst);
    counters.placed.store(0, Ordering::SeqCst);
    counters.measuring.store(true, Ordering::SeqCst);
    let cpu0 = cpu_seconds(leader_pid)?;
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let elapsed = t0.elapsed().as_secs_f64();
    let cpu = (cpu_seconds(leader_pid)? - cpu0) / elapsed;
    counters.measuring.store(false, Ordering::SeqCst);
    let placed_per_s = counters.placed.load(Ordering::SeqCst) as f64 / elapsed;
    let refill_ms = counters.refill_ms.lock().await.clone();
    let rss_mb = rss_bytes(leader_pid)? as f64 / 1e6;
    Ok(Drain {
        placed_per_s,
        cpu,
        refill_ms,
        rss_mb,
    })
}

/// The scenario's rows for `workers` agents and `jobs` queued: placements, refill p50
/// and p99, the leader's CPU and RSS while draining, and its CPU while idle.
fn scheduler_rows(workers: usize, jobs: usize, idle: &Idle, drain: &Drain) -> Vec<Row> {
    let label = |m: &str| format!("{workers} workers, {jobs} queued: {m}");
    vec![
        Row::new(
            "scheduler",
            &label("placements while draining"),
            drain.placed_per_s,
            "per s",
            drain.refill_ms.len(),
        ),
        Row::new(
            "scheduler",
            &label("slot freed -> next attempt p50"),
            percentile(&drain.refill_ms, 50.0),
            "ms",
            drain.refill_ms.len(),
        ),
        Row::new(
            "scheduler",
            &label("slot freed -> next attempt p99"),
            percentile(&drain.refill_ms, 99.0),
            "ms",
            drain.refill_ms.len(),
        ),
        Row::new(
            "scheduler",
            &label("leader CPU while draining"),
            drain.cpu,
            "cores",
            1,
        ),
        Row::new("scheduler", &label("leader RSS"), drain.rss_mb, "MB", 1),
        Row::new(
            "scheduler",
            &label(&format!(
                "leader CPU, every slot busy, {} pending",
                idle.pending
            )),
            idle.cpu,
            "cores",
            1,
        ),
    ]
}

/// A rank attempt: `(job, rank, attempt)`.
type Key = (String, u32, u32);

/// One simulated worker agent with one slot (see the module doc).
async fn simulated_agent(
    i: usize,
    mut client: WorkerClient,
    counters: Arc<Counters>,
    register: Arc<Semaphore>,
) {
    let worker_id = format!("sim-{i:05}");
    {
        let Ok(_permit) = register.acquire().await else {
            return;
        };
        crate::heartbeat_scale::register_simulated(&mut client, &worker_id).await;
    }
    let pid = 100_000 + i as u32;
    let mut running: HashMap<Key, Instant> = HashMap::new();
    let mut freed_at: Option<Instant> = None;
    let mut digest = 0;
    let mut last_heartbeat = Instant::now() - Duration::from_secs(2);
    let resources = v1::Resources {
        cpu_percent: 5.0,
        memory_used_bytes: 1 << 30,
        memory_total_bytes: 8 << 30,
        gpus: Vec::new(),
        warm_spares: Vec::new(),
    };
    while !counters.stop.load(Ordering::Relaxed) {
        let desired = if last_heartbeat.elapsed() >= Duration::from_secs(1) {
            last_heartbeat = Instant::now();
            let observed = running
                .keys()
                .map(|(job_id, rank, attempt)| v1::ObservedRank {
                    job_id: job_id.clone(),
                    rank: *rank,
                    attempt: *attempt,
                    pid,
                    ..Default::default()
                })
                .collect();
            client
                .heartbeat(v1::HeartbeatRequest {
                    worker_id: worker_id.clone(),
                    observed,
                    resources: Some(resources.clone()),
                })
                .await
        } else {
            client
                .watch_desired(v1::WatchDesiredRequest {
                    worker_id: worker_id.clone(),
                    known_digest: digest,
                    timeout_ms: 500,
                })
                .await
        };
        let Ok(reply) = desired else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let reply = reply.into_inner();
        digest = reply.desired_digest;
        for d in &reply.desired {
            let key = (d.job_id.clone(), d.rank, d.attempt);
            if running.contains_key(&key) {
                continue;
            }
            let started = client
                .rank_started(v1::RankStartedRequest {
                    worker_id: worker_id.clone(),
                    job_id: d.job_id.clone(),
                    rank: d.rank,
                    attempt: d.attempt,
                    pid,
                })
                .await;
            if started.is_err() {
                continue;
            }
            counters.placed_total.fetch_add(1, Ordering::Relaxed);
            if counters.measuring.load(Ordering::Relaxed) {
                counters.placed.fetch_add(1, Ordering::Relaxed);
                if let Some(t) = freed_at.take() {
                    counters
                        .refill_ms
                        .lock()
                        .await
                        .push(t.elapsed().as_secs_f64() * 1_000.0);
                }
            }
            running.insert(key, Instant::now());
        }
        // Attempts no longer desired (cancelled) are gone; due ones exit 0.
        let wanted: std::collections::HashSet<Key> = reply
            .desired
            .iter()
            .map(|d| (d.job_id.clone(), d.rank, d.attempt))
            .collect();
        running.retain(|k, _| wanted.contains(k));
        if counters.hold.load(Ordering::Relaxed) {
            continue;
        }
        let due: Vec<Key> = running
            .iter()
            .filter(|(_, t)| t.elapsed() >= Duration::from_millis(RUN_MS))
            .map(|(k, _)| k.clone())
            .collect();
        for key in due {
            let exited = client
                .rank_exited(v1::RankExitedRequest {
                    worker_id: worker_id.clone(),
                    job_id: key.0.clone(),
                    rank: key.1,
                    attempt: key.2,
                    exit_code: Some(0),
                    ..Default::default()
                })
                .await;
            if exited.is_ok() {
                running.remove(&key);
                freed_at = Some(Instant::now());
            }
        }
    }
}
