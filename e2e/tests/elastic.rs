//! Elastic world size end to end: a `--world-size 2:4` job on two workers of two slots
//! loses a worker for good and continues at 2 ranks from its committed step; the worker
//! comes back and the job grows back to 4 at a checkpoint boundary; over the whole run
//! every record is consumed exactly once (the carried record sums of the last ranks
//! equal the data set's). The trainer is `examples/python/elastic_records.py`, which
//! reads its records through `cumulus.runtime.ElasticData`.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use cumulus_api::{RankPhase, v1};
use cumulus_e2e::{Cluster, ClusterOpts, prepare_digits, workspace_root};

const LONG: Duration = Duration::from_secs(240);
const EPOCHS: u32 = 2;

fn script() -> String {
    workspace_root()
        .join("examples/python/elastic_records.py")
        .to_string_lossy()
        .into_owned()
}

/// What `elastic_records.py digest` prints for the shards: the record count and sum of
/// a run that consumed every record exactly once per epoch.
fn expected_digest(shards: &Path) -> serde_json::Value {
    let out = Command::new("python3")
        .arg(script())
        .args(["digest", "--shards-dir"])
        .arg(shards)
        .args(["--epochs", &EPOCHS.to_string()])
        .env("PYTHONPATH", workspace_root().join("python/src"))
        .output()
        .expect("run the digest");
    assert!(
        out.status.success(),
        "digest: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("digest JSON")
}

fn all_running(j: &v1::Job) -> bool {
    j.ranks.iter().all(|r| r.phase() == Ok(RankPhase::Running))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elastic_job_shrinks_on_a_lost_worker_grows_back_and_consumes_every_record_once() {
    let opts = ClusterOpts {
        slots: 2,
        heartbeat_timeout_ms: 5_000,
        ..ClusterOpts::default()
    };
    let mut cluster = Cluster::start(opts).await.expect("cluster");
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 8).expect("shards");
    let expected = expected_digest(&w.shards_dir);
    let records = expected["count"].as_u64().expect("count");
    let slow = root.join("slow");
    std::fs::write(&slow, b"").expect("slow file");
    let out = root.join("out");
    // One record a step; enough steps for every record at the smallest world size,
    // with room for an uneven deal.
    let total_steps = records / 2 + records / 4;
    let command = vec![
        "python3".to_string(),
        script(),
        "train".into(),
        "--out".into(),
        out.to_string_lossy().into_owned(),
        "--epochs".into(),
        EPOCHS.to_string(),
        "--total-steps".into(),
        total_steps.to_string(),
        "--ckpt-every".into(),
        "25".into(),
        "--slow-file".into(),
        slow.to_string_lossy().into_owned(),
        "--step-sleep-ms".into(),
        "100".into(),
    ];
    let spec = v1::JobSpec {
        name: "elastic".into(),
        world_size: 4,
        min_world_size: 2,
        command,
        env: [(
            "PYTHONPATH".to_string(),
            workspace_root()
                .join("python/src")
                .to_string_lossy()
                .into_owned(),
        )]
        .into(),
        dataset: w.shards_dir.to_string_lossy().into_owned(),
        ckpt_dir: root.join("ckpt").to_string_lossy().into_owned(),
        ..Default::default()
    };
    let job_id = cluster
        .submit("elastic", spec)
        .await
        .expect("submit")
        .job_id;
    cluster
        .wait_job(
            &job_id,
            "4 ranks running with a committed step",
            LONG,
            |j| j.world_size_now == 4 && all_running(j) && j.committed_step.is_some(),
        )
        .await;

    // A worker lost for good: no room for its ranks, so the job goes on with 2.
    let killed_at = Instant::now();
    cluster.workers[1].kill9();
    let shrunk = cluster
        .wait_job(&job_id, "2 ranks running after the shrink", LONG, |j| {
            j.world_size_now == 2 && all_running(j) && !j.resizes.is_empty()
        })
        .await;
    eprintln!(
        "worker lost -> training at 2 ranks: {:?}",
        killed_at.elapsed()
    );
    let shrink = &shrunk.resizes[0];
    assert_eq!((shrink.from_world_size, shrink.to_world_size), (4, 2));
    assert!(shrink.cause.contains("shrink"), "{shrink:?}");
    let from = shrink
        .resume_step
        .expect("the shrink resumes from a committed step");
    assert_eq!(shrunk.restarts_used, 0, "a shrink spends no restart budget");
    cluster
        .wait_job(&job_id, "a step committed at 2 ranks", LONG, |j| {
            j.committed_step > Some(from)
        })
        .await;

    // The worker is back: the job grows to 4 again at a checkpoint boundary.
    cluster.spawn_worker(1).expect("restart the worker");
    let grown = cluster
        .wait_job(&job_id, "4 ranks again", LONG, |j| {
            j.world_size_now == 4 && all_running(j) && j.resizes.len() >= 2
        })
        .await;
    let grow = &grown.resizes[1];
    assert_eq!((grow.from_world_size, grow.to_world_size), (2, 4));
    assert!(grow.cause.contains("grow"), "{grow:?}");
    assert!(
        grow.resume_step.is_some_and(|s| s > from),
        "grows from a step committed at 2 ranks: {grow:?}"
    );

    std::fs::remove_file(&slow).expect("let the job finish");
    let done = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(done.state, "succeeded", "{done:?}");
    assert_eq!(done.resizes.len(), 2, "no flapping: {:?}", done.resizes);

    // Every record exactly once: the last ranks' counts and sums (each took over the
    // carry of the ranks whose records it was dealt) add up to the data set's.
    let (mut count, mut sum) = (0u64, 0u64);
    for rank in 0..4 {
        let path = out.join(format!("rank-{rank}.json"));
        let r: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).expect("rank result")).expect("JSON");
        assert_eq!(r["world_size"], 4, "{r}");
        count += r["count"].as_u64().expect("count");
        let s = u64::from_str_radix(r["sum"].as_str().expect("sum"), 16).expect("hex");
        sum = sum.wrapping_add(s);
    }
    assert_eq!(count, records, "records consumed over the run");
    assert_eq!(
        format!("{sum:016x}"),
        expected["sum"].as_str().expect("sum"),
        "record digest over the run"
    );

    // `describe` shows both resizes with their causes.
    let describe = cluster
        .cumulusctl(&["describe", &job_id])
        .expect("describe");
    let text = String::from_utf8_lossy(&describe.stdout);
    assert!(
        text.contains("resized from 4 to 2 ranks") && text.contains("resized from 2 to 4 ranks"),
        "{text}"
    );
}
