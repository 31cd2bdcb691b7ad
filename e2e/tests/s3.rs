//! End-to-end tests of issue 5: checkpoints in S3 (a real `s3s-fs` server on loopback),
//! with real coordinator, worker, trainer and cumulusctl processes.

use std::path::Path;
use std::time::Duration;

use cumulus_api::RankPhase;
use cumulus_api::v1;
use cumulus_ckpt::CheckpointStore;
use cumulus_e2e::{
    Cluster, ClusterOpts, S3Access, S3Server, Workload, assert_trainer_results, prepare_digits,
    trainer_spec, wait_for,
};

const LONG: Duration = Duration::from_secs(300);
const EPOCHS: u32 = 8;
const BUCKET: &str = "cumulus-ckpt";

fn spec(w: &Workload, root: &Path, name: &str, ckpt_url: &str, step_sleep_ms: u32) -> v1::JobSpec {
    let sleep = step_sleep_ms.to_string();
    let epochs = EPOCHS.to_string();
    let mut s = trainer_spec(
        w,
        4,
        Path::new(""),
        &root.join(format!("out-{name}")),
        &[
            "--epochs",
            &epochs,
            "--ckpt-every",
            "20",
            "--step-sleep-ms",
            &sleep,
        ],
    );
    s.name = name.into();
    s.ckpt_dir = String::new();
    s.ckpt_url = ckpt_url.into();
    s
}

fn check_results(cluster: &Cluster, w: &Workload, out: &Path) {
    assert_trainer_results(cluster, w, out, 4, EPOCHS, None);
}

async fn s3_cluster(server: &S3Server, workers: usize) -> Cluster {
    Cluster::start(ClusterOpts {
        workers,
        s3: Some(server.access.clone()),
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster")
}

/// Every committed step the job kept verifies in the bucket (manifest + every object's
/// size and SHA-256), LATEST names the job's committed step, and the parts of steps that
/// were never committed (overtaken by a newer step while they were being finalized) are
/// pruned from below LATEST. The leader prunes right after it writes LATEST, so the test
/// waits for that instead of racing it.
async fn check_bucket(access: &S3Access, url: &str, job: &v1::Job) {
    let store = access.store(url).await.expect("store");
    let step = job.committed_step.expect("a committed checkpoint");
    assert_eq!(
        store.read_latest(&job.id).await.expect("LATEST"),
        Some(step)
    );
    let manifest = store
        .verify_step(&job.id, step)
        .await
        .expect("step verifies");
    assert_eq!(manifest.world_size, 4);
    let listed = wait_for(
        "the leader to prune the uncommitted steps below LATEST",
        LONG,
        || async {
            let steps = store.list_steps(&job.id).await.ok()?;
            for s in steps.iter().filter(|s| **s <= step) {
                store.read_manifest(&job.id, *s).await.ok()?;
            }
            Some(steps)
        },
    )
    .await;
    for listed in listed {
        if listed <= step {
            store
                .verify_step(&job.id, listed)
                .await
                .unwrap_or_else(|e| panic!("kept step {listed} does not verify: {e}"));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_checkpoint_job_commits_steps_manifests_and_latest_to_the_bucket() {
    let server = S3Server::start().await.expect("s3s-fs");
    server.create_bucket(BUCKET).await.expect("bucket");
    let cluster = s3_cluster(&server, 2).await;
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 8).expect("shards");
    let url = format!("s3://{BUCKET}/runs");

    // A missing bucket is refused at submit, with a clear error.
    let missing = cluster
        .submit(
            "missing",
            spec(&w, &root, "missing", "s3://no-such-bucket/x", 0),
        )
        .await
        .expect_err("missing bucket");
    assert!(
        missing.to_string().contains("bucket does not exist"),
        "{missing:#}"
    );

    let job_id = cluster
        .submit("s3", spec(&w, &root, "s3", &url, 0))
        .await
        .expect("submit")
        .job_id;
    let job = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(job.state, "succeeded", "{job:?}");
    check_results(&cluster, &w, &root.join("out-s3"));
    check_bucket(&server.access, &url, &job).await;

    let out = cluster
        .cumulusctl(&["-o", "json", "ckpt", "ls", &job_id])
        .expect("cumulusctl");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: v1::ListCheckpointsResponse = serde_json::from_slice(&out.stdout).expect("json");
    let step = job.committed_step.expect("committed");
    assert!(
        listed.checkpoints.iter().any(|c| c.step == step
            && c.verified
            && c.latest
            && c.tiers == ["L2"]
            && c.path.starts_with(&format!("s3://{BUCKET}/runs/{job_id}/"))),
        "{listed:?}"
    );
    let table = cluster
        .cumulusctl(&["ckpt", "ls", &job_id])
        .expect("cumulusctl");
    assert!(String::from_utf8_lossy(&table.stdout).contains("TIERS"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_s3_credentials_are_a_clear_error_at_submit() {
    let server = S3Server::start().await.expect("s3s-fs");
    server.create_bucket(BUCKET).await.expect("bucket");
    let mut access = server.access.clone();
    access.secret_key = "not-the-secret".into();
    let cluster = Cluster::start(ClusterOpts {
        workers: 1,
        s3: Some(access),
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 4).expect("shards");
    let error = cluster
        .submit(
            "creds",
            spec(&w, &root, "creds", &format!("s3://{BUCKET}/x"), 0),
        )
        .await
        .expect_err("wrong credentials");
    let text = format!("{error:#}");
    assert!(text.contains("credentials rejected"), "{text}");
    assert!(text.contains(&server.access.endpoint), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rank_moved_to_another_worker_resumes_from_l2_to_identical_weights() {
    let server = S3Server::start().await.expect("s3s-fs");
    server.create_bucket(BUCKET).await.expect("bucket");
    let mut cluster = Cluster::start(ClusterOpts {
        workers: 2,
        heartbeat_timeout_ms: 3_000,
        s3: Some(server.access.clone()),
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 8).expect("shards");
    let url = format!("s3://{BUCKET}/moves");

    // The uninterrupted run first (both jobs do not fit on one worker).
    let clean = cluster
        .submit("clean", spec(&w, &root, "clean", &url, 20))
        .await
        .expect("submit")
        .job_id;
    let a = cluster.wait_finished(&clean, LONG).await;
    assert_eq!(a.state, "succeeded", "{a:?}");

    let moved = cluster
        .submit("moved", spec(&w, &root, "moved", &url, 20))
        .await
        .expect("submit")
        .job_id;
    let job = cluster
        .wait_job(
            &moved,
            "a committed step, ranks on both workers",
            LONG,
            |j| {
                j.committed_step.is_some_and(|s| s >= 20)
                    && j.ranks.iter().all(|r| r.phase() == Ok(RankPhase::Running))
                    && j.ranks.iter().any(|r| r.worker_id == "worker-2")
            },
        )
        .await;
    let on_worker_2: Vec<u32> = job
        .ranks
        .iter()
        .filter(|r| r.worker_id == "worker-2")
        .map(|r| r.rank)
        .collect();
    // worker-2 dies with its ranks and its L1 copies (its data dir is never seen again).
    cluster.workers[1].kill9();
    let resumed = cluster
        .wait_job(&moved, "every rank on worker-1", LONG, |j| {
            j.restarts_used >= 1 && j.ranks.iter().all(|r| r.worker_id == "worker-1")
        })
        .await;
    assert!(
        resumed.restarts[0].resume_step.is_some(),
        "{:?}",
        resumed.restarts
    );
    let b = cluster.wait_finished(&moved, LONG).await;
    assert_eq!(b.state, "succeeded", "{b:?}");
    check_results(&cluster, &w, &root.join("out-moved"));
    for rank in 0..4 {
        let wa = std::fs::read(root.join(format!("out-clean/rank-{rank}/weights.bin")))
            .expect("weights");
        let wb = std::fs::read(root.join(format!("out-moved/rank-{rank}/weights.bin")))
            .expect("weights");
        assert!(
            wa == wb,
            "rank {rank}: resumed weights differ from the uninterrupted run"
        );
    }
    // The moved ranks' parts came from L2: worker-1 restored them into its L1 and said so.
    let log = std::fs::read_to_string(&cluster.workers[0].log).expect("worker-1 log");
    let restored = log.matches("part restored from L2 into L1").count();
    assert!(
        restored >= on_worker_2.len(),
        "{restored} parts restored from L2; ranks {on_worker_2:?} moved"
    );
    check_bucket(&server.access, &url, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_server_restart_mid_upload_loses_no_step_and_commits_no_partial_one() {
    let mut server = S3Server::start().await.expect("s3s-fs");
    server.create_bucket(BUCKET).await.expect("bucket");
    let cluster = s3_cluster(&server, 2).await;
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 8).expect("shards");
    let url = format!("s3://{BUCKET}/outage");
    let job_id = cluster
        .submit("outage", spec(&w, &root, "outage", &url, 10))
        .await
        .expect("submit")
        .job_id;
    let before = cluster
        .wait_job(&job_id, "a committed step", LONG, |j| {
            j.committed_step.is_some_and(|s| s >= 20)
                && j.ranks.iter().all(|r| r.phase() == Ok(RankPhase::Running))
        })
        .await;
    server.stop();
    // The next checkpoint's uploads now fail and are retried (both workers' logs say so).
    let logs = [
        cluster.workers[0].log.clone(),
        cluster.workers[1].log.clone(),
    ];
    cumulus_e2e::wait_for("a retried upload", LONG, || {
        let logs = logs.clone();
        async move {
            logs.iter()
                .any(|l| {
                    std::fs::read_to_string(l).is_ok_and(|t| t.contains("transient S3 failure"))
                })
                .then_some(())
        }
    })
    .await;
    let during = cluster.job(&job_id).await.expect("job");
    // Nothing commits while the bucket is unreachable (the leader cannot verify a part).
    let committed_during = during.committed_step;
    server.restart().expect("s3s-fs restarted");
    let job = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(job.state, "succeeded", "{job:?}");
    assert!(
        job.committed_step >= committed_during && committed_during >= before.committed_step,
        "committed {:?} -> {committed_during:?} -> {:?}",
        before.committed_step,
        job.committed_step
    );
    check_results(&cluster, &w, &root.join("out-outage"));
    check_bucket(&server.access, &url, &job).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dataset_from_s3_is_cached_and_the_cache_is_hit_on_restart() {
    let server = S3Server::start().await.expect("s3s-fs");
    server.create_bucket(BUCKET).await.expect("bucket");
    let cluster = s3_cluster(&server, 2).await;
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 8).expect("shards");
    // The shards go to s3://BUCKET/digits/.
    let client = server.access.settings().client().await.expect("client");
    let mut names: Vec<String> = std::fs::read_dir(&w.shards_dir)
        .expect("shards dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for name in &names {
        let bytes = std::fs::read(w.shards_dir.join(name)).expect("shard");
        client
            .put_object()
            .bucket(BUCKET)
            .key(format!("digits/{name}"))
            .body(bytes.into())
            .send()
            .await
            .expect("upload shard");
    }
    let mut s = spec(&w, &root, "data", &format!("s3://{BUCKET}/data-ckpt"), 10);
    s.dataset = format!("s3://{BUCKET}/digits");
    s.restart = Some(v1::RestartPolicy {
        backoff_initial_ms: Some(500),
        ..Default::default()
    });
    let job_id = cluster.submit("data", s).await.expect("submit").job_id;
    let job = cluster
        .wait_job(&job_id, "a committed step", LONG, |j| {
            j.committed_step.is_some()
                && j.ranks
                    .iter()
                    .all(|r| r.phase() == Ok(RankPhase::Running) && r.pid > 0)
        })
        .await;
    let count = |what: &str| {
        cluster
            .workers
            .iter()
            .map(|w| {
                std::fs::read_to_string(&w.log)
                    .unwrap_or_default()
                    .matches(what)
                    .count()
            })
            .sum::<usize>()
    };
    // Every shard was downloaded once, by the worker of its rank; the feature statistics
    // uploaded beside them (a name starting with a dot) are not a shard.
    let shards = names.iter().filter(|n| !n.starts_with('.')).count();
    assert!(
        shards < names.len(),
        "the statistics were uploaded too: {names:?}"
    );
    assert_eq!(count("dataset cache miss"), shards);
    assert_eq!(count("dataset cache hit"), 0);
    let pid = job.ranks[1].pid;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL rank 1");
    let done = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(done.state, "succeeded", "{done:?}");
    assert_eq!(done.restarts_used, 1, "{done:?}");
    check_results(&cluster, &w, &root.join("out-data"));
    // The restarted group found every shard in its worker's cache: no new download.
    assert_eq!(count("dataset cache miss"), shards);
    assert_eq!(count("dataset cache hit"), shards);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_committed_steps_are_mirrored_to_the_bucket_with_manifest_and_latest() {
    let server = S3Server::start().await.expect("s3s-fs");
    server.create_bucket(BUCKET).await.expect("bucket");
    let cluster = s3_cluster(&server, 2).await;
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 8).expect("shards");
    let url = format!("s3://{BUCKET}/l1");
    let mut s = spec(&w, &root, "l1", &url, 0);
    s.ckpt_dir = root.join("ckpt").to_string_lossy().to_string();
    s.ckpt_commit_tier = "l1".into();
    let job_id = cluster.submit("l1", s).await.expect("submit").job_id;
    let job = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(job.state, "succeeded", "{job:?}");
    check_results(&cluster, &w, &root.join("out-l1"));
    let step = job.committed_step.expect("a committed checkpoint");

    // The step committed at L1 (manifest and LATEST in ckpt_dir) ...
    let l1 = cumulus_ckpt::LocalStore::new(root.join("ckpt"));
    assert_eq!(
        l1.read_latest(&job_id).await.expect("L1 LATEST"),
        Some(step)
    );
    l1.verify_step(&job_id, step)
        .await
        .expect("L1 step verifies");
    // ... reaches L2 once the agents' background uploads are done: manifest, then LATEST.
    let store = server.access.store(&url).await.expect("store");
    wait_for(
        "LATEST in the bucket to reach the committed step",
        LONG,
        || async { (store.read_latest(&job_id).await.ok().flatten() == Some(step)).then_some(()) },
    )
    .await;
    // LATEST's step verifies in the bucket, and so does every step that has a manifest
    // there. (Parts of an older step whose background upload ended after the leader's
    // L2 prune may remain without a manifest; a reader never trusts those.)
    let manifest = store
        .verify_step(&job_id, step)
        .await
        .expect("step verifies");
    assert_eq!(manifest.world_size, 4);
    for listed in store.list_steps(&job_id).await.expect("list") {
        if store.read_manifest(&job_id, listed).await.is_ok() {
            store
                .verify_step(&job_id, listed)
                .await
                .unwrap_or_else(|e| {
                    panic!("step {listed} has a manifest but does not verify: {e}")
                });
        }
    }

    let out = cluster
        .cumulusctl(&["-o", "json", "ckpt", "ls", &job_id])
        .expect("cumulusctl");
    let listed: v1::ListCheckpointsResponse = serde_json::from_slice(&out.stdout).expect("json");
    assert!(
        listed
            .checkpoints
            .iter()
            .any(|c| c.step == step && c.verified && c.latest && c.tiers == ["L1", "L2"]),
        "{listed:?}"
    );
}
