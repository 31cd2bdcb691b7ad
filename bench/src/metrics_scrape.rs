//! Metrics scrape (issue #44): `GET /metrics` on the leader of a real 3-coordinator
//! cluster holding 10,000 jobs (submitted, then cancelled: no placement churn) with 1,000
//! simulated worker agents heartbeating at 1 Hz. Measured: the scrape's latency (p50,
//! p99, sequential scrapes, seen by the client) and the leader's CPU per scrape, from
//! which its added CPU at Prometheus's usual 15 s interval follows (target < 1% of a
//! core): the leader's CPU over the scrapes minus its CPU over an equal window without
//! them (the heartbeats' share), divided by the scrapes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cumulus_api::v1;
use cumulus_api::v1::client_service_client::ClientServiceClient;
use cumulus_e2e::{Auth, TOKEN};
use tokio::sync::Semaphore;
use tonic::transport::Endpoint;

use crate::Ctx;
use crate::heartbeat_scale::WorkerClient;
use crate::procstat::cpu_seconds;
use crate::report::{Row, percentile};

/// Prometheus's usual scrape interval, in seconds.
const SCRAPE_INTERVAL_S: f64 = 15.0;
/// Simulated workers per HTTP/2 channel.
const WORKERS_PER_CHANNEL: usize = 500;
/// Concurrent submits, cancels and registrations.
const CONCURRENCY: usize = 32;

/// Runs the scenario.
pub async fn run(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    let (workers, jobs, scrapes): (usize, usize, usize) =
        ctx.pick((1_000, 10_000, 200), (20, 100, 10));
    let (cluster, leader_pid, endpoint) = crate::heartbeat_scale::plaintext_cluster().await?;
    let leader = cluster.wait_leader(Duration::from_secs(60)).await;
    let li = cluster.index_of(leader).expect("the leader is a member");
    let url = format!("http://{}/metrics", cluster.coordinators[li].http);

    submit_and_cancel(&endpoint, jobs).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let channels = crate::heartbeat_scale::worker_channels(
        &endpoint,
        workers.div_ceil(WORKERS_PER_CHANNEL),
        Duration::from_secs(10),
    )
    .await?;
    let register = Arc::new(Semaphore::new(CONCURRENCY));
    let mut fleet = Vec::new();
    for i in 0..workers {
        let client = channels[i / WORKERS_PER_CHANNEL].clone();
        let (stop, register) = (stop.clone(), register.clone());
        fleet.push(tokio::spawn(heartbeating(i, client, stop, register)));
    }
    cumulus_e2e::wait_for(
        "every simulated worker registered",
        Duration::from_secs(600),
        || async {
            let s = cluster.status().await?;
            (s.workers.len() >= workers).then_some(())
        },
    )
    .await;

    let http = reqwest::Client::new();
    // The first scrape checks the answer and warms the connection.
    let (_, bytes) = scrape(&http, &url).await?;

    // The heartbeats' share of the leader's CPU, then the scrapes, back to back.
    let t0 = Instant::now();
    let cpu0 = cpu_seconds(leader_pid)?;
    let mut latencies = Vec::with_capacity(scrapes);
    for _ in 0..scrapes {
        latencies.push(scrape(&http, &url).await?.0);
    }
    let scraping = t0.elapsed();
    let cpu_scraping = cpu_seconds(leader_pid)? - cpu0;
    let cpu1 = cpu_seconds(leader_pid)?;
    tokio::time::sleep(scraping).await;
    let cpu_idle = cpu_seconds(leader_pid)? - cpu1;
    let per_scrape_s = ((cpu_scraping - cpu_idle) / scrapes as f64).max(0.0);

    stop.store(true, Ordering::SeqCst);
    for t in fleet {
        let _ = t.await;
    }
    let label = |m: &str| format!("{workers} workers, {jobs} jobs: {m}");
    Ok(vec![
        Row::new(
            "metrics_scrape",
            &label("scrape size"),
            bytes as f64 / 1e3,
            "KB",
            1,
        ),
        Row::new(
            "metrics_scrape",
            &label("scrape latency p50"),
            percentile(&latencies, 50.0),
            "ms",
            latencies.len(),
        ),
        Row::new(
            "metrics_scrape",
            &label("scrape latency p99"),
            percentile(&latencies, 99.0),
            "ms",
            latencies.len(),
        ),
        Row::new(
            "metrics_scrape",
            &label("leader CPU per scrape"),
            per_scrape_s * 1_000.0,
            "ms",
            scrapes,
        ),
        Row::below(
            "metrics_scrape",
            &label("leader CPU added at a 15 s interval"),
            per_scrape_s / SCRAPE_INTERVAL_S * 100.0,
            "% of a core",
            scrapes,
            1.0,
        ),
    ])
}

/// One `GET /metrics` at `url` with the cluster token: its latency in milliseconds and
/// its size in bytes.
///
/// # Errors
/// The request fails or is not answered 200.
async fn scrape(http: &reqwest::Client, url: &str) -> anyhow::Result<(f64, usize)> {
    let t = Instant::now();
    let r = http.get(url).bearer_auth(TOKEN).send().await?;
    anyhow::ensure!(r.status().is_success(), "scrape answered {}", r.status());
    let body = r.text().await?;
    Ok((t.elapsed().as_secs_f64() * 1_000.0, body.len()))
}

/// Submits `jobs` single-rank jobs to the leader at `endpoint` (pending: no worker yet)
/// and cancels each, [`CONCURRENCY`] at a time: the state holds them all, and nothing
/// places, restarts or finishes them while the scrapes are measured.
///
/// # Errors
/// The connection fails, or a submit or cancel is refused.
async fn submit_and_cancel(endpoint: &str, jobs: usize) -> anyhow::Result<()> {
    let channel = Endpoint::from_shared(endpoint.to_string())?
        .timeout(Duration::from_secs(30))
        .connect()
        .await?;
    let client = ClientServiceClient::with_interceptor(channel, Auth::new(TOKEN));
    let permits = Arc::new(Semaphore::new(CONCURRENCY));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..jobs {
        let mut client = client.clone();
        let permit = permits.clone().acquire_owned().await?;
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let spec = v1::JobSpec {
                name: format!("scraped-{i}"),
                world_size: 1,
                command: vec!["true".into()],
                ..Default::default()
            };
            let job_id = client
                .submit_job(v1::SubmitJobRequest {
                    request_id: format!("scrape-{i}"),
                    spec: Some(spec),
                    allow_pending: true,
                })
                .await?
                .into_inner()
                .job_id;
            client
                .cancel_job(v1::CancelJobRequest { job_id })
                .await
                .map(|_| ())
        }));
    }
    for t in tasks {
        t.await??;
    }
    eprintln!(
        "   {jobs} jobs submitted and cancelled in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// A simulated worker agent: registers (one slot), then heartbeats at 1 Hz with nothing
/// running until `stop`.
async fn heartbeating(
    i: usize,
    mut client: WorkerClient,
    stop: Arc<AtomicBool>,
    register: Arc<Semaphore>,
) {
    let worker_id = format!("scrape-sim-{i:05}");
    {
        let Ok(_permit) = register.acquire().await else {
            return;
        };
        crate::heartbeat_scale::register_simulated(&mut client, &worker_id).await;
    }
    // Spread the fleet over the second.
    tokio::time::sleep(Duration::from_millis((i as u64 * 7_919) % 1_000)).await;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let _ = client
            .heartbeat(v1::HeartbeatRequest {
                worker_id: worker_id.clone(),
                observed: vec![],
                resources: Some(v1::Resources::default()),
            })
            .await;
    }
}
