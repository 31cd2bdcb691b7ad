//! Elastic world size (issue 46): a worker is lost and no other has room, so a
//! `--world-size 2:4` job continues at 2 ranks. Measured per round: the worker's
//! `kill -9` → every rank of the smaller job running and each of them past the step it
//! resumed from (a progress report at the new size). Target: ≤ 10 s with a 5 s
//! heartbeat timeout. The ranks run `examples/python/elastic_records.py`.

use std::time::{Duration, Instant};

use cumulus_api::{RankPhase, v1};
use cumulus_e2e::{Cluster, ClusterOpts, prepare_digits, workspace_root};

use crate::Ctx;
use crate::report::{Row, ms, percentile};

const DEADLINE: Duration = Duration::from_secs(180);
const HEARTBEAT_TIMEOUT_MS: u64 = 5_000;
const TARGET_MS: f64 = 10_000.0;

fn spec(root: &std::path::Path, shards: &std::path::Path, round: usize) -> v1::JobSpec {
    let script = workspace_root().join("examples/python/elastic_records.py");
    let slow = root.join("slow");
    v1::JobSpec {
        world_size: 4,
        min_world_size: 2,
        command: vec![
            "python3".into(),
            script.to_string_lossy().into_owned(),
            "train".into(),
            "--out".into(),
            root.join(format!("out-{round}"))
                .to_string_lossy()
                .into_owned(),
            "--total-steps".into(),
            "1000000".into(),
            "--ckpt-every".into(),
            "10".into(),
            "--slow-file".into(),
            slow.to_string_lossy().into_owned(),
            "--step-sleep-ms".into(),
            "100".into(),
        ],
        env: [(
            "PYTHONPATH".to_string(),
            workspace_root()
                .join("python/src")
                .to_string_lossy()
                .into_owned(),
        )]
        .into(),
        dataset: shards.to_string_lossy().into_owned(),
        ckpt_dir: root
            .join(format!("ckpt-{round}"))
            .to_string_lossy()
            .into_owned(),
        ..Default::default()
    }
}

/// Worker lost → training continues at the smaller size, p50/p99 over the rounds.
pub async fn shrink(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    if ctx.smoke {
        // The e2e test `elastic` runs the same path in CI; a smoke round would add
        // half a minute for nothing it does not check.
        return Ok(Vec::new());
    }
    let rounds = 7;
    let mut cluster = Cluster::start(ClusterOpts {
        workers: 2,
        slots: 2,
        heartbeat_timeout_ms: HEARTBEAT_TIMEOUT_MS,
        ..ClusterOpts::default()
    })
    .await?;
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 8)?;
    std::fs::write(root.join("slow"), b"")?;
    let mut times = Vec::new();
    for round in 0..rounds {
        let job_id = cluster
            .submit(
                &format!("elastic-{round}"),
                spec(&root, &w.shards_dir, round),
            )
            .await?
            .job_id;
        cluster
            .wait_job(
                &job_id,
                "4 ranks running, a step committed",
                DEADLINE,
                |j| {
                    j.world_size_now == 4
                        && j.committed_step.is_some()
                        && j.ranks.iter().all(|r| r.phase() == Ok(RankPhase::Running))
                },
            )
            .await;
        let killed = Instant::now();
        cluster.workers[1].kill9();
        cluster
            .wait_job(&job_id, "2 ranks training", DEADLINE, |j| {
                j.world_size_now == 2
                    && j.ranks.iter().all(|r| {
                        r.phase() == Ok(RankPhase::Running)
                            && r.resume_step.is_some_and(|s| r.step > s)
                    })
            })
            .await;
        let took = ms(killed.elapsed());
        eprintln!("   round {round}: worker lost -> 2 ranks training in {took:.0} ms");
        times.push(took);
        if let Ok(mut client) = cluster.leader_client().await {
            let _ = client.cancel_job(v1::CancelJobRequest { job_id }).await;
        }
        cluster.spawn_worker(1)?;
        cluster
            .wait_status("the worker registered again", DEADLINE, |s| {
                s.workers
                    .iter()
                    .filter(|w| w.worker_phase() == Ok(cumulus_api::WorkerPhase::Alive))
                    .count()
                    == 2
            })
            .await;
    }
    let n = times.len();
    Ok(vec![
        Row::new(
            "elastic_shrink",
            "worker lost -> training at 2 of 4 ranks p50",
            percentile(&times, 50.0),
            "ms",
            n,
        ),
        Row::below(
            "elastic_shrink",
            "worker lost -> training at 2 of 4 ranks p99",
            percentile(&times, 99.0),
            "ms",
            n,
            TARGET_MS,
        ),
    ])
}
