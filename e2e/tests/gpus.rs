//! GPUs on machines without GPUs: real coordinators and agents whose `--gpus` names a
//! JSON inventory file (the agent reads it again at every heartbeat, so a test can make
//! a GPU unhealthy). Checks that
//! - a 4-rank job with one GPU per rank on two workers of 2 GPUs gets disjoint
//!   `CUDA_VISIBLE_DEVICES` (by UUID) and matching `LOCAL_RANK`/`LOCAL_WORLD_SIZE`;
//! - a job needing more GPUs than exist stays pending with the reason shown;
//! - a rank whose GPU turns unhealthy fails and restarts on another GPU;
//! - two jobs of fraction 0.5 share the one GPU of a worker, a third waits (with the
//!   reason) and runs once one of them ends; the ranks see `CUMULUS_GPU_MEMORY_FRACTION`.
//! - a job of higher priority that needs half of a GPU a preemptible job holds whole
//!   preempts it: the preemptible job stops, is queued again with no restart spent, and
//!   the GPU goes to the other.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cumulus_api::RankPhase;
use cumulus_api::{JobState, v1};
use cumulus_e2e::{Cluster, ClusterOpts, wait_for};

const LONG: Duration = Duration::from_secs(120);

/// Writes the inventory of the worker named `worker` (the harness names them
/// `worker-1`, `worker-2`, …): `count` GPUs `GPU-<worker>-<i>`, those in
/// `unhealthy` marked so.
fn write_inventory(path: &Path, worker: &str, count: u32, unhealthy: &[u32]) {
    let gpus: Vec<serde_json::Value> = (0..count)
        .map(|i| {
            serde_json::json!({
                "index": i,
                "uuid": format!("GPU-{worker}-{i}"),
                "name": "Fake GPU 80GB",
                "memory_total_bytes": 80u64 << 30,
                "healthy": !unhealthy.contains(&i),
                "error": if unhealthy.contains(&i) { "Xid 79: GPU has fallen off the bus" } else { "" },
            })
        })
        .collect();
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(&gpus).expect("json")).expect("write inventory");
    std::fs::rename(&tmp, path).expect("rename inventory");
}

/// A job whose ranks write `CUDA_VISIBLE_DEVICES|LOCAL_RANK|LOCAL_WORLD_SIZE|fraction`
/// to `<out>/rank-<RANK>-<ATTEMPT>`, then exit 0 (`hold`: sleep until stopped).
fn env_job(world_size: u32, out: &Path, hold: bool) -> v1::JobSpec {
    let script = format!(
        "printf '%s|%s|%s|%s' \"$CUDA_VISIBLE_DEVICES\" \"$LOCAL_RANK\" \"$LOCAL_WORLD_SIZE\" \
         \"${{CUMULUS_GPU_MEMORY_FRACTION:-}}\" > \"$OUT/tmp-$RANK\" && \
         mv \"$OUT/tmp-$RANK\" \"$OUT/rank-$RANK-$CUMULUS_ATTEMPT\"{}",
        if hold { " && exec sleep 600" } else { "" }
    );
    v1::JobSpec {
        world_size,
        command: vec!["sh".into(), "-c".into(), script],
        env: [("OUT".to_string(), out.to_str().expect("utf-8").to_string())].into(),
        restart: Some(v1::RestartPolicy {
            max_restarts: Some(3),
            backoff_initial_ms: Some(100),
            backoff_max_ms: Some(500),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// What rank `rank`'s attempt `attempt` wrote, once it has.
async fn rank_env(out: &Path, rank: u32, attempt: u32) -> Vec<String> {
    let path = out.join(format!("rank-{rank}-{attempt}"));
    wait_for(
        &format!("{} to be written", path.display()),
        LONG,
        || async {
            std::fs::read_to_string(&path)
                .ok()
                .map(|s| s.split('|').map(str::to_string).collect::<Vec<_>>())
        },
    )
    .await
}

async fn submit(cluster: &Cluster, id: &str, spec: v1::JobSpec) -> String {
    cluster.submit(id, spec).await.expect("submit").job_id
}

async fn cancel(cluster: &Cluster, job_id: &str) {
    let mut client = cluster.leader_client().await.expect("client");
    client
        .cancel_job(v1::CancelJobRequest {
            job_id: job_id.into(),
        })
        .await
        .expect("cancel");
}

fn out_dir(base: &Path, name: &str) -> PathBuf {
    let dir = base.join(name);
    std::fs::create_dir_all(&dir).expect("mkdir");
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_gpus_are_disjoint_packed_and_replaced_when_unhealthy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = std::fs::canonicalize(dir.path()).expect("canonical");
    let inventories: Vec<PathBuf> = (0..2)
        .map(|i| base.join(format!("gpus-{i}.json")))
        .collect();
    for (i, path) in inventories.iter().enumerate() {
        write_inventory(path, &format!("worker-{}", i + 1), 2, &[]);
    }
    let cluster = Cluster::start(ClusterOpts {
        workers: 2,
        slots: 4,
        per_worker_args: inventories
            .iter()
            .map(|p| vec!["--gpus".into(), p.to_str().expect("utf-8").into()])
            .collect(),
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    cluster.wait_leader(LONG).await;
    // Both workers registered their GPUs.
    wait_for("4 GPUs registered", LONG, || async {
        let status = cluster.status().await?;
        (status.workers.iter().map(|w| w.gpus.len()).sum::<usize>() == 4).then_some(())
    })
    .await;

    // 1. Four ranks, one GPU each: disjoint GPUs, two ranks per worker.
    let out = out_dir(&base, "four");
    let mut spec = env_job(4, &out, false);
    spec.gpus_per_rank = 1;
    let job = submit(&cluster, "gpu-four", spec).await;
    let done = cluster.wait_finished(&job, LONG).await;
    assert_eq!(done.job_state(), Ok(JobState::Succeeded), "{done:?}");
    let mut seen = BTreeSet::new();
    for rank in 0..4 {
        let env = rank_env(&out, rank, 0).await;
        let r = &done.ranks[rank as usize];
        assert_eq!(r.gpus.len(), 1, "{r:?}");
        assert_eq!(env[0], r.gpus[0], "CUDA_VISIBLE_DEVICES is the rank's GPU");
        assert!(
            env[0].starts_with(&format!("GPU-{}-", r.worker_id)),
            "a GPU of the rank's own worker: {env:?} on {}",
            r.worker_id
        );
        assert_eq!(env[2], "2", "two ranks per worker: {env:?}");
        assert_eq!(env[1], (rank % 2).to_string(), "LOCAL_RANK: {env:?}");
        assert_eq!(env[3], "", "no fraction for whole GPUs");
        assert!(seen.insert(env[0].clone()), "GPU {} given twice", env[0]);
    }

    // 2. More GPUs than the cluster has: refused at submit, or with allow_pending
    // pending with the reason.
    let mut spec = env_job(3, &out_dir(&base, "big"), false);
    spec.gpus_per_rank = 2;
    let refused = cluster
        .leader_client()
        .await
        .expect("client")
        .submit_job(v1::SubmitJobRequest {
            request_id: "gpu-big-refused".into(),
            spec: Some(spec.clone()),
            allow_pending: false,
        })
        .await
        .expect_err("larger than the cluster");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().contains("larger than the cluster")
            && refused.message().contains("--allow-pending"),
        "{refused}"
    );
    let big = cluster
        .leader_client()
        .await
        .expect("client")
        .submit_job(v1::SubmitJobRequest {
            request_id: "gpu-big".into(),
            spec: Some(spec),
            allow_pending: true,
        })
        .await
        .expect("submit with allow_pending")
        .into_inner()
        .job_id;
    let pending = cluster
        .wait_job(&big, "a pending reason", LONG, |j| {
            !j.pending_reason.is_empty()
        })
        .await;
    assert_eq!(pending.job_state(), Ok(JobState::Pending));
    assert!(
        pending.pending_reason.contains("cannot be placed")
            && pending.pending_reason.contains("4 GPUs in all"),
        "{}",
        pending.pending_reason
    );
    let text = cluster
        .cumulusctl(&["status", &big])
        .expect("cumulusctl status");
    let stdout = String::from_utf8_lossy(&text.stdout);
    assert!(stdout.contains("cannot be placed"), "{stdout}");
    cancel(&cluster, &big).await;

    // The workers table lists every GPU.
    let text = cluster
        .cumulusctl(&["workers"])
        .expect("cumulusctl workers");
    let stdout = String::from_utf8_lossy(&text.stdout);
    for gpu in [
        "GPU-worker-1-0",
        "GPU-worker-1-1",
        "GPU-worker-2-0",
        "GPU-worker-2-1",
    ] {
        assert!(stdout.contains(gpu), "{stdout}");
    }

    // 3. A rank's GPU turns unhealthy: the rank fails and restarts on another GPU.
    let out = out_dir(&base, "sick");
    let mut spec = env_job(1, &out, true);
    spec.gpus_per_rank = 1;
    let sick = submit(&cluster, "gpu-sick", spec).await;
    let first = rank_env(&out, 0, 0).await;
    let running = cluster
        .wait_job(&sick, "rank 0 running", LONG, |j| {
            j.ranks[0].phase() == Ok(RankPhase::Running)
        })
        .await;
    let worker = running.ranks[0].worker_id.clone();
    let index: u32 = first[0]
        .rsplit('-')
        .next()
        .and_then(|i| i.parse().ok())
        .expect("GPU index");
    let inventory = &inventories[if worker == "worker-1" { 0 } else { 1 }];
    write_inventory(inventory, &worker, 2, &[index]);
    let second = rank_env(&out, 0, 1).await;
    assert_ne!(second[0], first[0], "restarted on the unhealthy GPU");
    let restarted = cluster.job(&sick).await.expect("job");
    assert_eq!(restarted.restarts.len(), 1, "{restarted:?}");
    assert!(
        restarted.restarts[0].cause.contains("unhealthy")
            && restarted.restarts[0].cause.contains(&first[0]),
        "{:?}",
        restarted.restarts[0]
    );
    // The leader shows it unhealthy.
    let status = cluster.status().await.expect("status");
    let gpu = status
        .workers
        .iter()
        .flat_map(|w| &w.gpus)
        .find(|g| g.device.as_ref().is_some_and(|d| d.uuid == first[0]))
        .expect("the GPU is listed");
    if let Some(s) = &gpu.status {
        assert!(!s.healthy && s.error.contains("Xid 79"), "{gpu:?}");
    }
    cancel(&cluster, &sick).await;
    cluster.wait_finished(&sick, LONG).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_fractions_share_one_gpu_and_a_third_job_waits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = std::fs::canonicalize(dir.path()).expect("canonical");
    let inventory = base.join("gpus.json");
    write_inventory(&inventory, "solo", 1, &[]);
    let cluster = Cluster::start(ClusterOpts {
        workers: 1,
        slots: 4,
        per_worker_args: vec![vec![
            "--gpus".into(),
            inventory.to_str().expect("utf-8").into(),
        ]],
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    cluster.wait_leader(LONG).await;
    wait_for("the GPU registered", LONG, || async {
        let status = cluster.status().await?;
        (status.workers.iter().map(|w| w.gpus.len()).sum::<usize>() == 1).then_some(())
    })
    .await;

    let mut jobs = Vec::new();
    let mut outs = Vec::new();
    for name in ["a", "b", "c"] {
        let out = out_dir(&base, name);
        let mut spec = env_job(1, &out, true);
        spec.gpu_memory_fraction = Some(0.5);
        jobs.push(submit(&cluster, &format!("half-{name}"), spec).await);
        outs.push(out);
    }
    // Submitted in order: a and b run on the one GPU; c waits.
    for (job, out) in jobs.iter().zip(&outs).take(2) {
        let env = rank_env(out, 0, 0).await;
        assert_eq!(env[0], "GPU-solo-0", "{job}: {env:?}");
        assert_eq!(env[3], "0.5", "{job}: CUMULUS_GPU_MEMORY_FRACTION {env:?}");
        cluster
            .wait_job(job, "running", LONG, |j| {
                j.job_state() == Ok(JobState::Running)
            })
            .await;
    }
    let waiting = cluster
        .wait_job(&jobs[2], "a pending reason", LONG, |j| {
            !j.pending_reason.is_empty()
        })
        .await;
    assert_eq!(waiting.job_state(), Ok(JobState::Pending));
    assert!(
        waiting.pending_reason.contains("waiting for GPUs")
            && waiting.pending_reason.contains("0.5 of a GPU"),
        "{}",
        waiting.pending_reason
    );
    let status = cluster.status().await.expect("status");
    let allocated = status.workers[0].gpus[0].allocated;
    assert!((allocated - 1.0).abs() < 1e-9, "allocated {allocated}");

    // One of the two ends: the third takes its half.
    cancel(&cluster, &jobs[0]).await;
    cluster.wait_finished(&jobs[0], LONG).await;
    let env = rank_env(&outs[2], 0, 0).await;
    assert_eq!(env[0], "GPU-solo-0");
    for job in &jobs[1..] {
        cancel(&cluster, job).await;
        cluster.wait_finished(job, LONG).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_job_of_higher_priority_preempts_a_preemptible_one_holding_its_gpu() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = std::fs::canonicalize(dir.path()).expect("canonical");
    let inventory = base.join("gpus.json");
    write_inventory(&inventory, "solo", 1, &[]);
    let cluster = Cluster::start(ClusterOpts {
        workers: 1,
        slots: 4,
        per_worker_args: vec![vec![
            "--gpus".into(),
            inventory.to_str().expect("utf-8").into(),
        ]],
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    cluster.wait_leader(LONG).await;
    wait_for("the GPU registered", LONG, || async {
        let status = cluster.status().await?;
        (status.workers.iter().map(|w| w.gpus.len()).sum::<usize>() == 1).then_some(())
    })
    .await;

    // A preemptible job holds the whole GPU (its rank sleeps until stopped).
    let low_out = out_dir(&base, "low");
    let mut low = env_job(1, &low_out, true);
    low.gpus_per_rank = 1;
    low.preemptible = true;
    low.stop_grace_ms = 500;
    let low = submit(&cluster, "low", low).await;
    assert_eq!(rank_env(&low_out, 0, 0).await[0], "GPU-solo-0");

    // Half of that GPU for a job of higher priority: the first one gives way.
    let high_out = out_dir(&base, "high");
    let mut high = env_job(1, &high_out, true);
    high.gpu_memory_fraction = Some(0.5);
    high.priority = 5;
    let high = submit(&cluster, "high", high).await;
    let env = rank_env(&high_out, 0, 0).await;
    assert_eq!((env[0].as_str(), env[3].as_str()), ("GPU-solo-0", "0.5"));
    let requeued = cluster
        .wait_job(&low, "queued again", LONG, |j| {
            j.job_state() == Ok(JobState::Pending) && !j.pending_reason.is_empty()
        })
        .await;
    assert_eq!(requeued.restarts_used, 0, "a preemption spends no budget");
    assert!(
        requeued.pending_reason.contains("waiting for GPUs"),
        "{}",
        requeued.pending_reason
    );
    for job in [&high, &low] {
        cancel(&cluster, job).await;
        cluster.wait_finished(job, LONG).await;
    }
}
