//! Memory (issue 3, measurement 8): coordinator RSS with 1,000 jobs in its state and
//! after 100,000 committed entries with log compaction on (snapshot every 5,000
//! entries); worker agent RSS with 8 live ranks.
//!
//! The 100,000 entries are re-registrations of a fixed set of 100 workers, so the
//! state stays the same size and the figure isolates what the log and its compaction
//! cost (job submits would grow the state itself). Every write follows the leader, so
//! a leader change during the run (they happen under a saturating write load on 2
//! cores) costs a retry, not the scenario; RSS is read from whoever leads at the end.

use cumulus_api::RankPhase;
use std::time::Duration;

use cumulus_api::v1;
use cumulus_api::v1::worker_service_client::WorkerServiceClient;
use cumulus_e2e::{Auth, Cluster, ClusterOpts, TOKEN};
use futures::{StreamExt, TryStreamExt};

use crate::Ctx;
use crate::procstat::rss_bytes;
use crate::report::Row;

const CONCURRENCY: usize = 32;
const DEADLINE: Duration = Duration::from_secs(120);

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

/// PID of the current leader's process.
async fn leader_pid(cluster: &Cluster) -> anyhow::Result<u32> {
    let leader = cluster.wait_leader(DEADLINE).await;
    cluster
        .coordinators
        .iter()
        .find(|c| c.id == leader)
        .and_then(|c| c.proc.pid())
        .ok_or_else(|| anyhow::anyhow!("the leader {leader} has no live process"))
}

/// One registration through whoever leads now; retried (at most 50 times) across
/// leader changes.
async fn register_via_leader(
    cluster: &Cluster,
    req: v1::RegisterWorkerRequest,
) -> anyhow::Result<()> {
    let mut last = None;
    for _ in 0..50 {
        let leader = cluster.wait_leader(DEADLINE).await;
        let i = cluster
            .coordinators
            .iter()
            .position(|c| c.id == leader)
            .expect("the leader is a member");
        let ch = tonic::transport::Endpoint::from_shared(format!(
            "http://{}",
            cluster.coordinators[i].grpc
        ))?
        .timeout(Duration::from_secs(10))
        .connect()
        .await?;
        let mut c = WorkerServiceClient::with_interceptor(ch, Auth::new(TOKEN));
        match c.register(req.clone()).await {
            Ok(_) => return Ok(()),
            Err(e) if e.code() == tonic::Code::Unavailable => last = Some(e),
            Err(e) => return Err(e.into()),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("registration kept failing: {last:?}")
}

/// Runs the scenario.
pub async fn run(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    let jobs = ctx.pick(1_000, 100);
    let entries = ctx.pick(100_000, 2_000);
    let mut rows = Vec::new();
    {
        let cluster = Cluster::start(ClusterOpts {
            workers: 0,
            ..ClusterOpts::default()
        })
        .await?;
        rows.push(Row::new(
            "memory",
            "coordinator RSS, empty",
            mb(rss_bytes(leader_pid(&cluster).await?)?),
            "MB",
            1,
        ));
        let cluster_ref = &cluster;
        futures::stream::iter(0..jobs)
            .map(|j| async move {
                let spec = v1::JobSpec {
                    name: format!("mem-{j}"),
                    world_size: 4,
                    command: vec![
                        "/opt/train/bin/python".into(),
                        "train.py".into(),
                        "--epochs".into(),
                        "90".into(),
                    ],
                    ..Default::default()
                };
                // Follows the leader and retries with the same request id.
                cluster_ref
                    .submit(&format!("mem-{j}"), spec)
                    .await
                    .map(|_| ())
            })
            .buffer_unordered(CONCURRENCY)
            .try_collect::<Vec<()>>()
            .await?;
        let pid = leader_pid(&cluster).await?;
        rows.push(Row::new(
            "memory",
            &format!("coordinator RSS, {jobs} jobs"),
            mb(rss_bytes(pid)?),
            "MB",
            1,
        ));
    }
    {
        // Plaintext: the entries are registrations of simulated workers over one
        // channel, which mutual TLS (a certificate per worker) would not allow.
        let cluster = Cluster::start(ClusterOpts {
            workers: 0,
            tls: false,
            ..ClusterOpts::default()
        })
        .await?;
        let cluster_ref = &cluster;
        futures::stream::iter(0..entries)
            .map(|e| async move {
                let req = v1::RegisterWorkerRequest {
                    worker_id: format!("mem-w{}", e % 100),
                    host: "127.0.0.1".into(),
                    http_addr: "127.0.0.1:1".into(),
                    slots: 1 + (e % 7) as u32,
                    gpus: Vec::new(),
                };
                register_via_leader(cluster_ref, req).await
            })
            .buffer_unordered(CONCURRENCY)
            .try_collect::<Vec<()>>()
            .await?;
        let pid = leader_pid(&cluster).await?;
        let status = cluster
            .status()
            .await
            .ok_or_else(|| anyhow::anyhow!("no cluster status"))?;
        rows.push(Row::new(
            "memory",
            &format!(
                "coordinator RSS after {entries} entries (last applied {})",
                status.last_applied_index.unwrap_or(0)
            ),
            mb(rss_bytes(pid)?),
            "MB",
            1,
        ));
        let leader = cluster
            .coordinators
            .iter()
            .find(|c| c.proc.pid() == Some(pid))
            .expect("the leader is a member");
        let data = leader.data_dir.join("raft");
        rows.push(Row::new(
            "memory",
            &format!("leader raft dir (sled + WAL segments) after {entries} entries"),
            mb(dir_size(&data)),
            "MB",
            1,
        ));
    }
    {
        let cluster = Cluster::start(ClusterOpts {
            workers: 1,
            slots: 8,
            ..ClusterOpts::default()
        })
        .await?;
        let spec = v1::JobSpec {
            world_size: 8,
            command: vec!["sleep".into(), "1000".into()],
            ..Default::default()
        };
        let job_id = cluster.submit("mem-8-ranks", spec).await?.job_id;
        cluster
            .wait_job(&job_id, "8 ranks running", DEADLINE, |j| {
                j.ranks.iter().all(|r| r.phase() == Ok(RankPhase::Running))
            })
            .await;
        let pid = cluster.workers[0]
            .pid()
            .ok_or_else(|| anyhow::anyhow!("the worker is not running"))?;
        rows.push(Row::new(
            "memory",
            "worker agent RSS, 8 live ranks",
            mb(rss_bytes(pid)?),
            "MB",
            1,
        ));
        if let Ok(mut c) = cluster.leader_client().await {
            let _ = c.cancel_job(v1::CancelJobRequest { job_id }).await;
        }
    }
    Ok(rows)
}

fn dir_size(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_size(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}
