//! What a user of `cumulusctl` is told, against a real cluster: errors knowable at submit
//! are refused at submit (a job larger than the cluster without `--allow-pending`, a
//! dataset with fewer shards than ranks), a program that cannot be executed fails the
//! job at once instead of spending its restart budget, the ranks of a cancelled job stop
//! showing a live process once they exit, a finished rank keeps the last step it
//! reported, a running job shows its ranks' metrics, rate and time left, a job's stop
//! grace wins over the agent's, `logs --tail` and `--since`, and `list` filters.

use std::time::Duration;

use cumulus_api::{JobState, RankPhase, v1};
use cumulus_e2e::{
    Cluster, ClusterOpts, prepare_digits, sigterm_ignoring_spec, trainer_spec, wait_for,
};
use tonic::Code;

const LONG: Duration = Duration::from_secs(180);

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

// One scenario against one cluster: read in order.
#[allow(clippy::too_many_lines)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_time_errors_fast_failure_and_truthful_status() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cluster = Cluster::start(ClusterOpts {
        workers: 1,
        slots: 2,
        // A long agent-wide grace: a job's own --stop-grace-s must win over it.
        worker_args: vec!["--stop-grace-ms".into(), "60000".into()],
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    cluster.wait_leader(LONG).await;
    wait_for("the worker registered", LONG, || async {
        let s = cluster.status().await?;
        s.workers
            .iter()
            .any(|w| w.worker_phase() == Ok(cumulus_api::WorkerPhase::Alive))
            .then_some(())
    })
    .await;

    // 1. Larger than the cluster (2 slots): refused with the way out; accepted with
    // --allow-pending, and pending with the reason.
    let out = cluster
        .cumulusctl(&["submit", "--world-size", "3", "--", "true"])
        .expect("cumulusctl submit");
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("larger than the cluster")
            && err.contains("needs 3 slots")
            && err.contains("--allow-pending"),
        "{err}"
    );
    let out = cluster
        .cumulusctl(&[
            "-o",
            "json",
            "submit",
            "--world-size",
            "3",
            "--allow-pending",
            "--name",
            "too-big",
            "--",
            "true",
        ])
        .expect("cumulusctl submit --allow-pending");
    assert!(out.status.success(), "{}", stderr(&out));
    // Restarts (3 by default) but no checkpoint directory: accepted, and said at submit,
    // on stderr and in the reply (issue 42 item 6).
    let warned = stderr(&out);
    assert!(
        warned
            .contains("warning: the job may restart up to 3 times but has no checkpoint directory")
            && warned.contains("step 0"),
        "{warned}"
    );
    let big: serde_json::Value = serde_json::from_str(&stdout(&out)).expect("json");
    assert!(
        big["warnings"][0]
            .as_str()
            .is_some_and(|w| w.contains("no checkpoint directory")),
        "{big}"
    );
    let big = big["job_id"].as_str().expect("job id").to_string();
    let pending = cluster
        .wait_job(&big, "a pending reason", LONG, |j| {
            !j.pending_reason.is_empty()
        })
        .await;
    assert!(
        pending.pending_reason.contains("cannot be placed"),
        "{}",
        pending.pending_reason
    );

    // 2. Fewer shards than ranks: refused, saying how to fix it.
    let work = prepare_digits(dir.path(), 1).expect("one shard");
    let mut spec = trainer_spec(
        &work,
        2,
        &dir.path().join("ckpt"),
        &dir.path().join("out"),
        &[],
    );
    spec.name = "underfed".into();
    let refused = cluster
        .leader_client()
        .await
        .expect("client")
        .submit_job(v1::SubmitJobRequest {
            request_id: "underfed".into(),
            spec: Some(spec),
            allow_pending: false,
        })
        .await
        .expect_err("1 shard for 2 ranks");
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(
        refused.message().contains("1 shard for 2 ranks")
            && refused.message().contains("dataset split"),
        "{refused}"
    );

    // 3. A program that does not exist: the job fails at once, no restart spent.
    let missing = cluster
        .submit(
            "missing-program",
            v1::JobSpec {
                world_size: 1,
                command: vec!["/nonexistent/prog".into()],
                restart: Some(v1::RestartPolicy {
                    max_restarts: Some(3),
                    backoff_initial_ms: Some(100),
                    backoff_max_ms: Some(100),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
        .await
        .expect("submit")
        .job_id;
    let failed = cluster.wait_finished(&missing, LONG).await;
    assert_eq!(failed.job_state(), Ok(JobState::Failed), "{failed:?}");
    assert_eq!(failed.restarts_used, 0, "{failed:?}");
    assert!(failed.restarts.is_empty(), "{:?}", failed.restarts);
    assert!(
        failed.failure_cause.contains("cannot be executed")
            && failed.failure_cause.contains("/nonexistent/prog"),
        "{}",
        failed.failure_cause
    );

    let out = cluster
        .cumulusctl(&["describe", &missing])
        .expect("describe");
    let text = stdout(&out);
    assert!(
        text.contains("submitted by admin")
            && text.contains("failed: rank 0 attempt 0 could not start"),
        "{text}"
    );

    // 4. A cancelled job's ranks stop showing a running process once they exit.
    let cancel_me = cluster
        .submit(
            "cancel-me",
            v1::JobSpec {
                world_size: 2,
                name: "sleepers".into(),
                command: vec!["sh".into(), "-c".into(), "exec sleep 600".into()],
                ..Default::default()
            },
        )
        .await
        .expect("submit")
        .job_id;
    // The over-sized job waits for slots; cancel it first so this one runs.
    let out = cluster.cumulusctl(&["cancel", &big]).expect("cancel");
    assert!(out.status.success(), "{}", stderr(&out));
    cluster
        .wait_job(&cancel_me, "both ranks running", LONG, |j| {
            j.ranks.iter().all(|r| r.phase() == Ok(RankPhase::Running))
        })
        .await;
    let out = cluster.cumulusctl(&["cancel", &cancel_me]).expect("cancel");
    assert!(out.status.success(), "{}", stderr(&out));
    let stopped = cluster
        .wait_job(&cancel_me, "its ranks' exits recorded", LONG, |j| {
            j.ranks
                .iter()
                .all(|r| r.phase() != Ok(RankPhase::Running) && r.signal.is_some())
        })
        .await;
    assert_eq!(stopped.job_state(), Ok(JobState::Cancelled));

    // 5. A finished rank keeps the last step it reported (the trainer's final report).
    let work = prepare_digits(&dir.path().join("ok"), 2).expect("two shards");
    let mut spec = trainer_spec(
        &work,
        2,
        &dir.path().join("ok-ckpt"),
        &dir.path().join("ok-out"),
        &["--epochs", "2"],
    );
    spec.name = "finisher".into();
    let done = cluster
        .submit("finisher", spec)
        .await
        .expect("submit")
        .job_id;
    let done = cluster.wait_finished(&done, LONG).await;
    assert_eq!(done.job_state(), Ok(JobState::Succeeded), "{done:?}");
    for r in &done.ranks {
        assert!(
            r.total_steps > 0 && r.step == r.total_steps,
            "rank {} shows {}/{} after it finished",
            r.rank,
            r.step,
            r.total_steps
        );
    }

    // Live metrics, rate and time left of a running job, in the API and `status`.
    let mut spec = trainer_spec(
        &work,
        2,
        &dir.path().join("live-ckpt"),
        &dir.path().join("live-out"),
        &["--epochs", "100000"],
    );
    spec.name = "live".into();
    let submitted = cluster.submit("live", spec).await.expect("submit");
    assert!(
        submitted.warnings.is_empty(),
        "a job with a checkpoint dir: {:?}",
        submitted.warnings
    );
    let live = submitted.job_id;
    let seen = cluster
        .wait_job(&live, "metrics, a rate and a time left", LONG, |j| {
            j.ranks.iter().all(|r| {
                r.metrics.get("loss").is_some_and(|l| l.is_finite())
                    && r.steps_per_s > 0.0
                    && r.eta_ms > 0
            })
        })
        .await;
    assert_eq!(seen.job_state(), Ok(JobState::Running));
    let out = cluster.cumulusctl(&["status", &live]).expect("status");
    let text = stdout(&out);
    assert!(
        text.contains("steps/s") && text.contains("left") && text.contains("loss="),
        "{text}"
    );
    let out = cluster.cumulusctl(&["cancel", &live]).expect("cancel");
    assert!(out.status.success(), "{}", stderr(&out));

    // logs --tail N: the last N lines of each rank, the same as the end of the full logs.
    let full = cluster
        .cumulusctl(&["-o", "json", "logs", &done.id])
        .expect("logs");
    let tail = cluster
        .cumulusctl(&["-o", "json", "logs", &done.id, "--tail", "2"])
        .expect("logs --tail");
    assert!(tail.status.success(), "{}", stderr(&tail));
    let lines = |out: &std::process::Output| -> Vec<serde_json::Value> {
        stdout(out)
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect()
    };
    let (full, tail) = (lines(&full), lines(&tail));
    for rank in 0..2u64 {
        let of = |v: &[serde_json::Value]| -> Vec<String> {
            v.iter()
                .filter(|l| l["rank"].as_u64() == Some(rank))
                .map(|l| l["line"].as_str().unwrap_or_default().to_string())
                .collect()
        };
        let all = of(&full);
        assert!(all.len() > 2, "rank {rank} logged {} lines", all.len());
        assert_eq!(of(&tail), all[all.len() - 2..].to_vec(), "rank {rank}");
    }

    // logs --since D: only what was written in that last span (to within a second).
    let spaced = cluster
        .submit(
            "spaced",
            v1::JobSpec {
                world_size: 1,
                command: vec![
                    "sh".into(),
                    "-c".into(),
                    "echo early; sleep 8; echo late".into(),
                ],
                ..Default::default()
            },
        )
        .await
        .expect("submit")
        .job_id;
    let spaced = cluster.wait_finished(&spaced, LONG).await;
    // Since 4 s before the rank exited: "late" (just before the exit) is in, "early"
    // (8 s before) is out, whenever this runs.
    let since_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64
        - (spaced.ranks[0].exited_at_ms - 4_000);
    let out = cluster
        .cumulusctl(&["logs", &spaced.id, "--since", &format!("{since_ms}ms")])
        .expect("logs --since");
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("late") && !text.contains("early"), "{text}");
    let out = cluster
        .cumulusctl(&["logs", &spaced.id, "--since", "1h"])
        .expect("logs --since");
    assert!(stdout(&out).contains("early"), "{}", stdout(&out));

    // 6. list filters: by state, by name, the newest N.
    let out = cluster
        .cumulusctl(&["-o", "json", "list", "--state", "failed"])
        .expect("list");
    let listed: serde_json::Value = serde_json::from_str(&stdout(&out)).expect("json");
    let ids: Vec<&str> = listed["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .filter_map(|j| j["id"].as_str())
        .collect();
    assert_eq!(ids, vec![missing.as_str()]);
    let out = cluster
        .cumulusctl(&["list", "--name", "sleep"])
        .expect("list");
    let text = stdout(&out);
    assert!(
        text.contains(&cancel_me) && !text.contains(&missing),
        "{text}"
    );
    let out = cluster
        .cumulusctl(&["-o", "json", "list", "--limit", "1"])
        .expect("list");
    let listed: serde_json::Value = serde_json::from_str(&stdout(&out)).expect("json");
    assert_eq!(listed["jobs"].as_array().map(Vec::len), Some(1));

    // 7. A job's stop grace: a rank that ignores SIGTERM is killed after the job's 200 ms,
    // not the agent's 60 s.
    let stubborn = cluster
        .submit("stubborn", sigterm_ignoring_spec(200))
        .await
        .expect("submit")
        .job_id;
    cluster
        .wait_job(&stubborn, "its rank running", LONG, |j| {
            j.ranks[0].phase() == Ok(RankPhase::Running)
        })
        .await;
    let cancelled_at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    let out = cluster.cumulusctl(&["cancel", &stubborn]).expect("cancel");
    assert!(out.status.success(), "{}", stderr(&out));
    let killed = cluster
        .wait_job(&stubborn, "its rank killed", LONG, |j| {
            j.ranks[0].signal == Some(9)
        })
        .await;
    let took_ms = killed.ranks[0].exited_at_ms.saturating_sub(cancelled_at_ms);
    assert!(
        took_ms < 30_000,
        "SIGKILL came {took_ms} ms after the cancel: the job's 200 ms grace was not used"
    );

    // 8. Cancelling twice says what happened, in words.
    let out = cluster.cumulusctl(&["cancel", &cancel_me]).expect("cancel");
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("already cancelled"), "{err}");
    assert!(!err.contains("WARN"), "no tracing lines without -v: {err}");
}
