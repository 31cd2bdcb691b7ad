//! Elastic world size end to end, once per example trainer that reads its data through
//! the job's data plan (`examples/python/elastic_records.py` through
//! `cumulus.runtime.ElasticData`, and the Rust `cumulus-trainer`): a `--world-size 2:4`
//! job on two workers of two slots loses a worker for good and continues at 2 ranks from
//! its committed step; while it runs at 2, the removed ranks' logs stay readable; the
//! worker comes back and the job grows back to 4, its ranks checkpointing first (the
//! grow resumes from the step they stopped at: none redone); over the whole run every
//! record is consumed exactly once (the carried record sums of the last ranks equal the
//! data set's, as a fault-free run's).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cumulus_api::{RankPhase, WorkerPhase, v1};
use cumulus_e2e::{Cluster, ClusterOpts, bin, prepare_digits, workspace_root};

const LONG: Duration = Duration::from_secs(240);
const EPOCHS: u32 = 2;

fn script() -> String {
    workspace_root()
        .join("examples/python/elastic_records.py")
        .to_string_lossy()
        .into_owned()
}

/// The trainer an elastic job runs.
#[derive(Clone, Copy, Debug)]
enum Trainer {
    /// `examples/python/elastic_records.py`: one record a step.
    Python,
    /// `cumulus-trainer train`: two records a step.
    Rust,
}

/// The record count and the order-free record sum (16 hex digits) of a run that
/// consumed every record of `shards` exactly once per epoch: what a fault-free run ends
/// with (as the trainer's own `digest` prints it).
fn expected_digest(trainer: Trainer, shards: &Path) -> (u64, String) {
    let out = match trainer {
        Trainer::Python => Command::new("python3")
            .arg(script())
            .args(["digest", "--shards-dir"])
            .arg(shards)
            .args(["--epochs", &EPOCHS.to_string()])
            .env("PYTHONPATH", workspace_root().join("python/src"))
            .output(),
        Trainer::Rust => {
            let list = shards.with_extension("all-shards");
            let mut names: Vec<PathBuf> = std::fs::read_dir(shards)
                .expect("shards dir")
                .map(|e| e.expect("entry").path())
                .filter(|p| {
                    !p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with('.'))
                })
                .collect();
            names.sort();
            let text: String = names.iter().map(|p| format!("{}\n", p.display())).collect();
            std::fs::write(&list, text).expect("shards list");
            Command::new(bin("cumulus-trainer"))
                .args(["digest", "--order-free", "--shards-file"])
                .arg(&list)
                .args(["--epochs", &EPOCHS.to_string()])
                .output()
        }
    }
    .expect("run the digest");
    assert!(
        out.status.success(),
        "digest: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("digest JSON");
    (
        v["count"].as_u64().expect("count"),
        v["sum"].as_str().expect("sum").to_string(),
    )
}

/// The job's command: enough steps for every record at the smallest world size (with
/// room for an uneven deal), slowed down while `slow` exists.
fn command(trainer: Trainer, records: u64, out: &Path, slow: &Path) -> Vec<String> {
    let path = |p: &Path| p.to_string_lossy().into_owned();
    let common = |total_steps: u64| {
        vec![
            "--total-steps".to_string(),
            total_steps.to_string(),
            "--ckpt-every".into(),
            "25".into(),
            "--slow-file".into(),
            path(slow),
            "--step-sleep-ms".into(),
            "100".into(),
        ]
    };
    match trainer {
        Trainer::Python => {
            let mut c = vec![
                "python3".to_string(),
                script(),
                "train".into(),
                "--out".into(),
                path(out),
                "--epochs".into(),
                EPOCHS.to_string(),
            ];
            c.extend(common(records / 2 + records / 4));
            c
        }
        Trainer::Rust => {
            let mut c = vec![
                bin("cumulus-trainer").to_string_lossy().into_owned(),
                "train".to_string(),
                "--out".into(),
                path(out),
                "--epochs".into(),
                EPOCHS.to_string(),
                "--batch-size".into(),
                "2".into(),
                "--classes".into(),
                "10".into(),
                "--log-every".into(),
                "100".into(),
            ];
            c.extend(common(records * 3 / 8));
            c
        }
    }
}

/// The last ranks' `(world size, record count, record sum)`.
fn rank_results(trainer: Trainer, out: &Path) -> Vec<(u64, u64, u64)> {
    (0..4)
        .map(|rank| {
            let path = match trainer {
                Trainer::Python => out.join(format!("rank-{rank}.json")),
                Trainer::Rust => out.join(format!("rank-{rank}/result.json")),
            };
            let r: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&path).expect("rank result")).expect("JSON");
            let (count, sum) = match trainer {
                Trainer::Python => (&r["count"], &r["sum"]),
                Trainer::Rust => (&r["records_consumed"], &r["record_sum"]),
            };
            let sum = u64::from_str_radix(sum.as_str().expect("sum"), 16).expect("hex");
            (
                r["world_size"].as_u64().expect("world size"),
                count.as_u64().expect("count"),
                sum,
            )
        })
        .collect()
}

/// What rank `rank` prints when an attempt of it at 4 ranks begins: found in its logs
/// after a shrink removed it.
fn first_line_of(trainer: Trainer, rank: u32) -> String {
    match trainer {
        Trainer::Python => format!("rank {rank} of 4 attempt "),
        Trainer::Rust => format!("rank={rank} attempt="),
    }
}

/// The checkpoint steps a rank's log says it stopped at when asked.
fn stop_steps(text: &str) -> Vec<u64> {
    let needle = "stopped at checkpoint step ";
    text.match_indices(needle)
        .filter_map(|(i, _)| {
            let rest = &text[i + needle.len()..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .collect()
}

fn all_running(j: &v1::Job) -> bool {
    j.ranks.iter().all(|r| r.phase() == Ok(RankPhase::Running))
}

fn logs(cluster: &Cluster, job_id: &str, rank: u32) -> String {
    let out = cluster
        .cumulusctl(&["logs", job_id, "--rank", &rank.to_string()])
        .expect("cumulusctl logs");
    assert!(
        out.status.success(),
        "logs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn shrink_grow_exactly_once(trainer: Trainer) {
    let opts = ClusterOpts {
        slots: 2,
        heartbeat_timeout_ms: 5_000,
        ..ClusterOpts::default()
    };
    let mut cluster = Cluster::start(opts).await.expect("cluster");
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 8).expect("shards");
    let (records, expected_sum) = expected_digest(trainer, &w.shards_dir);
    let slow = root.join("slow");
    std::fs::write(&slow, b"").expect("slow file");
    let out = root.join("out");
    let spec = v1::JobSpec {
        name: "elastic".into(),
        world_size: 4,
        min_world_size: 2,
        command: command(trainer, records, &out, &slow),
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
        "{trainer:?}: worker lost -> training at 2 ranks: {:?}",
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

    // The worker is back (the grow waits 20 s for it to prove stable): the removed
    // ranks' logs, wherever they ran, are readable while the job runs at 2.
    cluster.spawn_worker(1).expect("restart the worker");
    let back = cluster.workers[1].name.clone();
    cluster
        .wait_status("the worker alive again", LONG, |s| {
            s.workers
                .iter()
                .any(|w| w.worker_id == back && w.worker_phase() == Ok(WorkerPhase::Alive))
        })
        .await;
    let removed = cluster
        .wait_job(&job_id, "still 2 ranks", LONG, |j| j.world_size_now == 2)
        .await;
    assert_eq!(removed.resizes.len(), 1, "{:?}", removed.resizes);
    for rank in [2, 3] {
        let text = logs(&cluster, &job_id, rank);
        assert!(
            text.contains(&first_line_of(trainer, rank)),
            "the logs of removed rank {rank}:\n{text}"
        );
    }

    // The job grows back to 4: its ranks checkpoint and stop first.
    let grown = cluster
        .wait_job(&job_id, "4 ranks again", LONG, |j| {
            j.world_size_now == 4 && all_running(j) && j.resizes.len() >= 2
        })
        .await;
    let grow = &grown.resizes[1];
    assert_eq!((grow.from_world_size, grow.to_world_size), (2, 4));
    assert!(
        grow.cause.contains("grow") && grow.cause.contains("checkpointed first"),
        "{grow:?}"
    );
    let at = grow.resume_step.expect("the grow resumes from a step");
    assert!(
        at > from,
        "grows from a step committed at 2 ranks: {grow:?}"
    );

    std::fs::remove_file(&slow).expect("let the job finish");
    let done = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(done.state, "succeeded", "{done:?}");
    assert_eq!(done.resizes.len(), 2, "no flapping: {:?}", done.resizes);

    // The ranks at 2 stopped at a checkpoint when asked, and the 4 resumed from the
    // newest step they all committed: a rank redoes at most the one checkpoint interval
    // it went past the others (each goes on to its next `--ckpt-every` step from when it
    // noticed), not every step since the last commit before the grow.
    let mut stops = Vec::new();
    for rank in [0, 1] {
        let text = logs(&cluster, &job_id, rank);
        let stop = stop_steps(&text)
            .into_iter()
            .find(|s| (at..=at + 25).contains(s));
        assert!(
            stop.is_some(),
            "rank {rank} did not stop at step {at} or the checkpoint after:\n{text}"
        );
        stops.extend(stop);
    }
    eprintln!("{trainer:?}: the ranks stopped at steps {stops:?}, the grow resumed from {at}");
    assert!(stops.contains(&at), "no rank stopped at {at}: {stops:?}");

    // Every record exactly once: the last ranks' counts and sums (each took over the
    // carry of the ranks whose records it was dealt) add up to the data set's.
    let results = rank_results(trainer, &out);
    assert!(results.iter().all(|r| r.0 == 4), "{results:?}");
    let count: u64 = results.iter().map(|r| r.1).sum();
    let sum = results.iter().fold(0u64, |s, r| s.wrapping_add(r.2));
    assert_eq!(count, records, "records consumed over the run");
    assert_eq!(
        format!("{sum:016x}"),
        expected_sum,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elastic_python_job_shrinks_grows_back_and_consumes_every_record_once() {
    shrink_grow_exactly_once(Trainer::Python).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elastic_rust_trainer_shrinks_grows_back_and_consumes_every_record_once() {
    shrink_grow_exactly_once(Trainer::Rust).await;
}
