//! End-to-end tests of the job lifecycle (issue #27): pause and resume on another worker
//! to byte-identical weights, the stop escalation for a rank that ignores the request,
//! and a time limit that ends a job `timed_out` with a checkpoint taken in its window.
//! Real coordinators, agents and the example trainer on loopback; every wait is on a
//! condition with a generous deadline.

use std::time::Duration;

use cumulus_api::{JobState, RankPhase, v1};
use cumulus_e2e::{Cluster, ClusterOpts, prepare_digits, sigterm_ignoring_spec, trainer_spec};

const LONG: Duration = Duration::from_secs(300);

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn train_args(epochs: u32) -> Vec<String> {
    [
        "--epochs",
        &epochs.to_string(),
        "--ckpt-every",
        "20",
        "--step-sleep-ms",
        "10",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_job_resumes_on_another_worker_to_identical_weights() {
    // Three workers of two slots: a two-rank job uses at most two of them, so once the
    // workers it ran on are gone, the third still fits it whole.
    let mut cluster = Cluster::start(ClusterOpts {
        workers: 3,
        slots: 2,
        heartbeat_timeout_ms: 3_000,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 4).expect("shards");
    let args = train_args(6);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let spec = |name: &str| {
        let mut s = trainer_spec(
            &w,
            2,
            &root.join(format!("ckpt-{name}")),
            &root.join(format!("out-{name}")),
            &args,
        );
        s.name = name.into();
        s
    };

    // The reference: the same job, never interrupted.
    let clean = cluster
        .submit("clean", spec("clean"))
        .await
        .expect("submit")
        .job_id;
    let clean = cluster.wait_finished(&clean, LONG).await;
    assert_eq!(clean.job_state(), Ok(JobState::Succeeded), "{clean:?}");

    let paused = cluster
        .submit("paused", spec("paused"))
        .await
        .expect("submit")
        .job_id;
    let before = cluster
        .wait_job(&paused, "a committed step, ranks running", LONG, |j| {
            j.committed_step.is_some_and(|s| s >= 40)
                && j.ranks.iter().all(|r| r.phase() == Ok(RankPhase::Running))
        })
        .await;
    let used: Vec<String> = before.ranks.iter().map(|r| r.worker_id.clone()).collect();
    let out = cluster.cumulusctl(&["pause", &paused]).expect("pause");
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("pausing"), "{}", stdout(&out));
    let stopped = cluster
        .wait_job(&paused, "paused", LONG, |j| {
            j.job_state() == Ok(JobState::Paused)
        })
        .await;
    let pause_step = stopped.committed_step.expect("a committed step");
    // Both ranks stop at the next multiple of --ckpt-every after they were asked; the
    // lower of the two is complete (the other rank passed it and committed it too).
    assert!(
        pause_step >= before.committed_step.unwrap_or(0),
        "paused at {pause_step}, before {:?}",
        before.committed_step
    );
    assert_eq!(stopped.restarts_used, 0, "a pause spends no budget");
    assert!(stopped.ranks.iter().all(|r| r.worker_id.is_empty()));
    assert_eq!(stopped.stop_action, "");
    // Twice: refused with the reason.
    let again = cluster.cumulusctl(&["pause", &paused]).expect("pause");
    assert!(!again.status.success());
    assert!(
        stderr(&again).contains("already paused"),
        "{}",
        stderr(&again)
    );

    let logs = cluster.cumulusctl(&["logs", &paused]).expect("logs");
    let text = stdout(&logs);
    assert!(
        text.contains(&format!(
            "asked to pause: stopped at checkpoint step {pause_step}"
        )),
        "{text}"
    );

    // The workers it ran on go away; the resume places it on the one left.
    for id in &used {
        if let Some(p) = cluster.workers.iter_mut().find(|p| &p.name == id) {
            p.kill9();
        }
    }
    cluster
        .wait_status("the job's workers expired", LONG, |s| {
            s.workers
                .iter()
                .filter(|wk| used.contains(&wk.worker_id))
                .all(|wk| wk.worker_phase() == Ok(cumulus_api::WorkerPhase::Expired))
        })
        .await;
    let out = cluster.cumulusctl(&["resume", &paused]).expect("resume");
    assert!(out.status.success(), "{}", stderr(&out));
    let resumed = cluster
        .wait_job(&paused, "running again", LONG, |j| {
            j.ranks.iter().all(|r| r.phase() == Ok(RankPhase::Running))
        })
        .await;
    for r in &resumed.ranks {
        assert!(
            !used.contains(&r.worker_id),
            "rank {} back on {}",
            r.rank,
            r.worker_id
        );
        assert_eq!(r.attempt, 1, "a new attempt");
    }
    let done = cluster.wait_finished(&paused, LONG).await;
    assert_eq!(done.job_state(), Ok(JobState::Succeeded), "{done:?}");
    assert_eq!(done.restarts_used, 0);
    let logs = cluster.cumulusctl(&["logs", &paused]).expect("logs");
    let text = stdout(&logs);
    assert!(
        text.contains(&format!("resumed from step {pause_step}")),
        "{text}"
    );
    for rank in 0..2 {
        let a = std::fs::read(root.join(format!("out-clean/rank-{rank}/weights.bin")))
            .expect("weights");
        let b = std::fs::read(root.join(format!("out-paused/rank-{rank}/weights.bin")))
            .expect("weights");
        assert!(
            a == b,
            "rank {rank}: weights differ from the uninterrupted run"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_ignores_the_request_is_killed_and_a_time_limit_ends_the_job() {
    let cluster = Cluster::start(ClusterOpts::default())
        .await
        .expect("cluster");
    let root = cluster.dir.path().to_path_buf();

    // A rank that ignores both the request and SIGTERM: told, SIGTERM after the notice
    // (the job's 300 ms grace), SIGKILL 300 ms later; the job is paused all the same.
    let stubborn = cluster
        .submit("stubborn", sigterm_ignoring_spec(300))
        .await
        .expect("submit")
        .job_id;
    cluster
        .wait_job(&stubborn, "its rank running", LONG, |j| {
            j.ranks[0].phase() == Ok(RankPhase::Running)
        })
        .await;
    let asked_at_ms = now_ms();
    let out = cluster.cumulusctl(&["pause", &stubborn]).expect("pause");
    assert!(out.status.success(), "{}", stderr(&out));
    // A resume while the pause is in flight is refused.
    let early = cluster.cumulusctl(&["resume", &stubborn]).expect("resume");
    let early_text = stderr(&early);
    assert!(
        !early.status.success() && early_text.contains("still pausing"),
        "{early_text}"
    );
    let paused = cluster
        .wait_job(&stubborn, "paused", LONG, |j| {
            j.job_state() == Ok(JobState::Paused)
        })
        .await;
    assert_eq!(paused.committed_step, None);
    let took_ms = now_ms().saturating_sub(asked_at_ms);
    assert!(
        took_ms >= 600,
        "paused {took_ms} ms after the request: before the notice and grace ran out"
    );
    let out = cluster.cumulusctl(&["cancel", &stubborn]).expect("cancel");
    assert!(out.status.success(), "{}", stderr(&out));

    // A time limit: the trainer is asked `signal_before` ahead, stops at its next
    // checkpoint and the job ends timed_out with that step committed.
    let w = prepare_digits(&root, 2).expect("shards");
    let args = train_args(100_000);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut spec = trainer_spec(&w, 2, &root.join("ckpt-tl"), &root.join("out-tl"), &args);
    spec.name = "limited".into();
    spec.time_limit_ms = 6_000;
    spec.signal_before_ms = 4_000;
    let limited = cluster
        .submit("limited", spec)
        .await
        .expect("submit")
        .job_id;
    let ended = cluster.wait_finished(&limited, LONG).await;
    assert_eq!(ended.job_state(), Ok(JobState::TimedOut), "{ended:?}");
    let step = ended.committed_step.expect("a checkpoint in the window");
    assert!(
        ended.failure_cause.contains("time limit"),
        "{}",
        ended.failure_cause
    );
    assert!(
        ended.running_ms >= 2_000 && ended.running_ms < 6_000 + 10_000,
        "ran {} ms",
        ended.running_ms
    );
    let logs = cluster.cumulusctl(&["logs", &limited]).expect("logs");
    let text = stdout(&logs);
    assert!(
        text.contains(&format!(
            "asked to time_limit: stopped at checkpoint step {step}"
        )),
        "{text}"
    );
    // Every rank exited on its own (code 0), none was killed.
    assert!(
        ended.ranks.iter().all(|r| r.exit_code == Some(0)),
        "{:?}",
        ended.ranks
    );
    // The CLI spells the new states and flags.
    let out = cluster.cumulusctl(&["status", &limited]).expect("status");
    let text = stdout(&out);
    assert!(
        text.contains("timed_out") && text.contains("time limit"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_starts_higher_priority_first_and_never_passes_a_waiting_wide_job() {
    let cluster = Cluster::start(ClusterOpts {
        workers: 1,
        slots: 2,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let sleeper = |world_size: u32, priority: i32| v1::JobSpec {
        world_size,
        command: vec!["sleep".into(), "600".into()],
        priority,
        ..Default::default()
    };
    let running = |j: &v1::Job| j.job_state() == Ok(JobState::Running);
    let blocker = cluster
        .submit("blocker", sleeper(2, 0))
        .await
        .expect("submit")
        .job_id;
    cluster.wait_job(&blocker, "running", LONG, running).await;
    let low = cluster
        .submit("low", sleeper(1, 0))
        .await
        .expect("submit")
        .job_id;
    let high = cluster
        .submit("high", sleeper(1, 10))
        .await
        .expect("submit")
        .job_id;
    let wide = cluster
        .submit("wide", sleeper(2, 10))
        .await
        .expect("submit")
        .job_id;
    let out = cluster.cumulusctl(&["cancel", &blocker]).expect("cancel");
    assert!(out.status.success(), "{}", stderr(&out));
    // The older low-priority job waits; the high one starts; the wide one (also high)
    // does not fit beside it, and the low one, which would, does not pass it.
    cluster.wait_job(&high, "running", LONG, running).await;
    let held = cluster
        .wait_job(&low, "a reason to wait", LONG, |j| {
            j.pending_reason.contains(&format!("queued behind {wide}"))
        })
        .await;
    assert_eq!(held.job_state(), Ok(JobState::Pending));
    let out = cluster.cumulusctl(&["status", &low]).expect("status");
    assert!(stdout(&out).contains("queued behind"), "{}", stdout(&out));
    assert_eq!(
        cluster.job(&wide).await.expect("wide").job_state(),
        Ok(JobState::Pending)
    );
    // Once the high job ends, the wide one starts, still ahead of the low one.
    let out = cluster.cumulusctl(&["cancel", &high]).expect("cancel");
    assert!(out.status.success(), "{}", stderr(&out));
    cluster.wait_job(&wide, "running", LONG, running).await;
    assert_eq!(
        cluster.job(&low).await.expect("low").job_state(),
        Ok(JobState::Pending)
    );
    for j in [&wide, &low] {
        let out = cluster.cumulusctl(&["cancel", j]).expect("cancel");
        assert!(out.status.success(), "{}", stderr(&out));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_resumed_from_a_middle_step_of_another_ends_with_identical_weights() {
    let cluster = Cluster::start(ClusterOpts {
        workers: 2,
        slots: 2,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 4).expect("shards");
    let args = train_args(3);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut spec = trainer_spec(&w, 2, &root.join("ckpt"), &root.join("out-source"), &args);
    spec.ckpt_keep = Some(100);
    let source = cluster.submit("source", spec).await.expect("submit").job_id;
    let done = cluster.wait_finished(&source, LONG).await;
    assert_eq!(done.job_state(), Ok(JobState::Succeeded), "{done:?}");
    let out = cluster
        .cumulusctl(&["ckpt", "ls", &source, "-o", "json"])
        .expect("ckpt ls");
    assert!(out.status.success(), "{}", stderr(&out));
    let listed: v1::ListCheckpointsResponse =
        serde_json::from_slice(&out.stdout).expect("checkpoints JSON");
    let steps: Vec<u64> = listed.checkpoints.iter().map(|c| c.step).collect();
    assert!(steps.len() >= 3, "steps {steps:?}");
    let middle = steps[steps.len() / 2];

    // Through the CLI, as a user: the dataset and checkpoint dir come from the source.
    let trainer = trainer_spec(&w, 2, &root.join("ckpt"), &root.join("out-fork"), &args).command;
    let from = format!("{source}@{middle}");
    let mut submit = vec![
        "submit",
        "--world-size",
        "2",
        "--resume-from",
        &from,
        "-o",
        "json",
        "--",
    ];
    submit.extend(trainer.iter().map(String::as_str));
    let out = cluster.cumulusctl(&submit).expect("submit");
    assert!(out.status.success(), "{}", stderr(&out));
    let fork = serde_json::from_slice::<v1::SubmitJobResponse>(&out.stdout)
        .expect("submit JSON")
        .job_id;
    let first = cluster
        .wait_job(&fork, "placed", LONG, |j| {
            j.ranks.iter().all(|r| !r.worker_id.is_empty())
        })
        .await;
    assert!(
        first.ranks.iter().all(|r| r.resume_step == Some(middle)),
        "{first:?}"
    );
    let spec = first.spec.clone().expect("spec");
    assert_eq!(spec.resume_from_job, source);
    assert_eq!(spec.resume_from_step, Some(middle));
    assert_eq!(spec.dataset, w.shards_dir.to_string_lossy());
    // Followed live until it ends (not a terminal here: a progress line on stderr).
    let watched = cluster.cumulusctl(&["watch", &fork]).expect("watch");
    assert!(watched.status.success(), "{}", stderr(&watched));
    assert!(stderr(&watched).contains("rank 0"), "{}", stderr(&watched));
    assert!(
        stdout(&watched).contains("succeeded"),
        "{}",
        stdout(&watched)
    );
    let done = cluster.wait_finished(&fork, LONG).await;
    assert_eq!(done.job_state(), Ok(JobState::Succeeded), "{done:?}");
    assert_eq!(done.restarts_used, 0);
    let logs = cluster.cumulusctl(&["logs", &fork]).expect("logs");
    assert!(
        stdout(&logs).contains(&format!("resumed from step {middle}")),
        "{}",
        stdout(&logs)
    );
    for rank in 0..2 {
        let a = std::fs::read(root.join(format!("out-source/rank-{rank}/weights.bin")))
            .expect("weights");
        let b =
            std::fs::read(root.join(format!("out-fork/rank-{rank}/weights.bin"))).expect("weights");
        assert!(a == b, "rank {rank}: weights differ from the source's");
    }
    // The fork's checkpoints are its own; the source's are untouched.
    let out = cluster
        .cumulusctl(&["ckpt", "ls", &source, "-o", "json"])
        .expect("ckpt ls");
    let after: v1::ListCheckpointsResponse =
        serde_json::from_slice(&out.stdout).expect("checkpoints JSON");
    assert_eq!(
        after.checkpoints.iter().map(|c| c.step).collect::<Vec<_>>(),
        steps
    );

    // What cannot be resumed is refused at submit, with the reason.
    let wide = vec![
        "submit",
        "--world-size",
        "3",
        "--resume-from",
        &from,
        "--",
        "true",
    ];
    let out = cluster.cumulusctl(&wide).expect("submit");
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("keeps the world size"),
        "{}",
        stderr(&out)
    );
    let gone = format!("{source}@{}", middle + 1);
    let out = cluster
        .cumulusctl(&[
            "submit",
            "--world-size",
            "2",
            "--resume-from",
            &gone,
            "--",
            "true",
        ])
        .expect("submit");
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("not one of its committed steps"),
        "{}",
        stderr(&out)
    );
}

/// The job's summary through `cumulusctl summary JOB -o json`.
fn summary(cluster: &Cluster, job: &str) -> v1::JobSummary {
    let out = cluster
        .cumulusctl(&["summary", job, "-o", "json"])
        .expect("summary");
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).expect("summary JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preemptible_job_gives_way_to_a_higher_priority_one_and_summaries_track_the_rate() {
    // One worker of two slots: the two jobs cannot run side by side.
    let cluster = Cluster::start(ClusterOpts {
        workers: 1,
        slots: 2,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 4).expect("shards");
    let long_args = train_args(40);
    let long_args: Vec<&str> = long_args.iter().map(String::as_str).collect();
    let mut low = trainer_spec(&w, 2, &root.join("ckpt"), &root.join("out-low"), &long_args);
    low.preemptible = true;
    let low = cluster.submit("low", low).await.expect("submit").job_id;

    // While it runs, the leader's rate and time left agree with the trainer's own
    // timing (its `steps_per_s` metric, a mean since the attempt started) within 10%.
    let agreed = cluster
        .wait_job(&low, "a steady rate", LONG, |j| {
            j.committed_step.is_some_and(|s| s >= 20)
                && j.ranks.iter().all(|r| r.phase() == Ok(RankPhase::Running))
        })
        .await;
    assert_eq!(agreed.ranks.len(), 2);
    // The trainer's own estimate of the time left: the steps left at its own rate.
    let own_eta_ms =
        |s: &v1::JobSummary, own: f64| s.total_steps.saturating_sub(s.step) as f64 / own * 1000.0;
    let within_10_percent = |x: f64, of: f64| (x - of).abs() <= 0.1 * of;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let (s, own) = loop {
        let s = summary(&cluster, &low);
        let own = s.metrics.get("steps_per_s").copied().unwrap_or(0.0);
        if s.live
            && s.steps_per_s > 0.0
            && own > 0.0
            && s.total_steps > s.step
            && within_10_percent(s.steps_per_s, own)
            && within_10_percent(s.eta_ms as f64, own_eta_ms(&s, own))
        {
            break (s, own);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the leader's rate and time left never came within 10% of the trainer's: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    // The time left is the steps left at the leader's rate.
    let left = (s.total_steps - s.step) as f64;
    assert!(
        (s.eta_ms as f64 - left / s.steps_per_s * 1000.0).abs() <= 1.0,
        "eta {} ms vs {left} steps at {} steps/s (trainer: {own} steps/s)",
        s.eta_ms,
        s.steps_per_s
    );
    assert!(s.running_ms > 0);
    assert!(!s.history.is_empty(), "{s:?}");

    // A higher-priority job: the preemptible one checkpoints, stops, and waits.
    let short_args = train_args(1);
    let short_args: Vec<&str> = short_args.iter().map(String::as_str).collect();
    let mut high = trainer_spec(
        &w,
        2,
        &root.join("ckpt"),
        &root.join("out-high"),
        &short_args,
    );
    high.priority = 5;
    let high = cluster.submit("high", high).await.expect("submit").job_id;
    let requeued = cluster
        .wait_job(&low, "preempted and queued again", LONG, |j| {
            j.job_state() == Ok(JobState::Pending) && j.committed_step.is_some()
        })
        .await;
    assert_eq!(requeued.restarts_used, 0, "a preemption spends no budget");
    let high_done = cluster.wait_finished(&high, LONG).await;
    assert_eq!(
        high_done.job_state(),
        Ok(JobState::Succeeded),
        "{high_done:?}"
    );
    let low_done = cluster.wait_finished(&low, LONG).await;
    assert_eq!(
        low_done.job_state(),
        Ok(JobState::Succeeded),
        "{low_done:?}"
    );
    assert_eq!(low_done.restarts_used, 0);
    assert!(
        low_done.ranks.iter().all(|r| r.attempt == 1),
        "{low_done:?}"
    );
    assert!(
        low_done.finished_at_ms > high_done.finished_at_ms,
        "the preempted job ended after the one it gave way to"
    );
    let logs = cluster.cumulusctl(&["logs", &low]).expect("logs");
    let text = stdout(&logs);
    assert!(
        text.contains("asked to preempt: stopped at checkpoint step"),
        "{text}"
    );

    // After the end, the summary keeps what was seen.
    let s = summary(&cluster, &low);
    assert_eq!(s.state, "succeeded");
    assert!(s.total_steps > 0 && s.step == s.total_steps, "{s:?}");
    assert!(s.steps_per_s > 0.0 && s.eta_ms == 0, "{s:?}");
    assert!(s.metrics.contains_key("loss"), "{s:?}");
    let out = cluster
        .cumulusctl(&["summary", "--state", "succeeded"])
        .expect("summaries");
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    assert!(table.contains(&low) && table.contains(&high), "{table}");
}
