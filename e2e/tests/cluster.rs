//! End-to-end tests of the core issue: a real 3-coordinator Raft cluster, 2 worker
//! agents and the example trainer on the digits data, all real processes on loopback.
//! Every wait is on a condition (job status, cluster status) with a generous deadline.

use std::path::Path;
use std::time::{Duration, Instant};

use cumulus_api::v1;
use cumulus_api::{JobState, RankPhase};
use cumulus_e2e::{
    Cluster, ClusterOpts, TOKEN, WorkerClient, Workload, assert_trainer_results, prepare_digits,
    read_result, trainer_spec, wait_for, worker_client,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const LONG: Duration = Duration::from_secs(300);
const EPOCHS: u32 = 8;

fn train_args(step_sleep_ms: u32) -> Vec<String> {
    vec![
        "--epochs".into(),
        EPOCHS.to_string(),
        "--ckpt-every".into(),
        "20".into(),
        "--step-sleep-ms".into(),
        step_sleep_ms.to_string(),
    ]
}

fn spec(w: &Workload, root: &Path, name: &str, step_sleep_ms: u32) -> v1::JobSpec {
    let args = train_args(step_sleep_ms);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut s = trainer_spec(
        w,
        4,
        &root.join(format!("ckpt-{name}")),
        &root.join(format!("out-{name}")),
        &args,
    );
    s.name = name.into();
    s
}

fn check_results(cluster: &Cluster, w: &Workload, out: &Path) {
    assert_trainer_results(cluster, w, out, 4, EPOCHS, Some(0.90));
}

fn kill_rank(job: &v1::Job, rank: u32) -> u32 {
    let pid = job.ranks[rank as usize].pid;
    assert!(pid > 0, "rank {rank} has a pid");
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).expect("SIGKILL the rank");
    pid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trainer_job_succeeds_with_every_record_consumed_exactly_once() {
    let cluster = Cluster::start(ClusterOpts::default())
        .await
        .expect("cluster");
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 8).expect("shards");
    let job_id = cluster
        .submit("happy", spec(&w, &root, "happy", 0))
        .await
        .expect("submit")
        .job_id;
    let job = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(job.state, "succeeded", "{job:?}");
    assert_eq!(job.restarts_used, 0);
    check_results(&cluster, &w, &root.join("out-happy"));
    // The committed step is on disk: LATEST names it and its manifest verifies.
    let step = job.committed_step.expect("a committed checkpoint");
    let latest = std::fs::read_to_string(root.join("ckpt-happy").join(&job_id).join("LATEST"))
        .expect("LATEST");
    assert_eq!(latest.trim(), format!("step-{step:08}"));
    let out = cluster
        .cumulusctl(&["-o", "json", "ckpt", "ls", &job_id])
        .expect("cumulusctl");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: v1::ListCheckpointsResponse = serde_json::from_slice(&out.stdout).expect("json");
    assert!(
        listed
            .checkpoints
            .iter()
            .any(|c| c.step == step && c.verified && c.latest),
        "{listed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_rank_restarts_with_backoff_and_resumes_to_identical_weights() {
    let cluster = Cluster::start(ClusterOpts::default())
        .await
        .expect("cluster");
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 8).expect("shards");
    // The same job twice: one undisturbed, one whose rank 2 is SIGKILLed mid-run.
    let clean = cluster
        .submit("clean", spec(&w, &root, "clean", 10))
        .await
        .expect("submit")
        .job_id;
    let mut killed_spec = spec(&w, &root, "killed", 10);
    killed_spec.restart = Some(v1::RestartPolicy {
        backoff_initial_ms: Some(1_000),
        ..Default::default()
    });
    let killed = cluster
        .submit("killed", killed_spec)
        .await
        .expect("submit")
        .job_id;
    let job = cluster
        .wait_job(&killed, "a committed step and rank 2 running", LONG, |j| {
            j.committed_step.is_some_and(|s| s >= 40)
                && j.ranks[2].phase() == Ok(RankPhase::Running)
                && j.ranks[2].pid > 0
        })
        .await;
    let killed_at = Instant::now();
    kill_rank(&job, 2);
    let resumed = cluster
        .wait_job(&killed, "the restarted group running again", LONG, |j| {
            j.restarts_used == 1
                && j.ranks
                    .iter()
                    .all(|r| r.attempt == 1 && matches!(r.state.as_str(), "running" | "exited"))
        })
        .await;
    eprintln!(
        "rank kill -> restarted group running: {:?}",
        killed_at.elapsed()
    );
    let restart = &resumed.restarts[0];
    assert!(restart.cause.contains("signal 9"), "{restart:?}");
    assert!(
        restart.delay_ms >= 800,
        "delay {} below the policy's minimum",
        restart.delay_ms
    );
    let resume_step = restart.resume_step.expect("resumed from a checkpoint");
    assert!(resume_step >= 40, "{restart:?}");
    for r in &resumed.ranks {
        assert!(
            r.started_at_ms >= restart.not_before_ms,
            "rank {} started before its backoff ended",
            r.rank
        );
    }
    let a = cluster.wait_finished(&clean, LONG).await;
    let b = cluster.wait_finished(&killed, LONG).await;
    assert_eq!(a.state, "succeeded", "{a:?}");
    assert_eq!(b.state, "succeeded", "{b:?}");
    check_results(&cluster, &w, &root.join("out-killed"));
    for rank in 0..4 {
        let wa = std::fs::read(root.join(format!("out-clean/rank-{rank}/weights.bin")))
            .expect("weights");
        let wb = std::fs::read(root.join(format!("out-killed/rank-{rank}/weights.bin")))
            .expect("weights");
        assert!(
            wa == wb,
            "rank {rank}: resumed weights differ from the uninterrupted run"
        );
        let r = read_result(&root.join("out-killed"), rank).expect("result");
        assert_eq!(
            r["attempt"].as_u64(),
            Some(1),
            "rank {rank} finished in the restarted attempt"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_kill_elects_a_new_leader_and_the_job_finishes() {
    let mut cluster = Cluster::start(ClusterOpts::default())
        .await
        .expect("cluster");
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 8).expect("shards");
    let job_id = cluster
        .submit("leader-kill", spec(&w, &root, "lk", 60))
        .await
        .expect("submit")
        .job_id;
    // Ranks running for longer than the coordinators' "lost" threshold (5 heartbeat
    // intervals of 1 s): a new leader must not take its own empty soft state for
    // attempts that went missing.
    let now_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    };
    cluster
        .wait_job(
            &job_id,
            "ranks running for 6 s with a checkpoint",
            LONG,
            |j| {
                j.committed_step.is_some_and(|s| s >= 20)
                    && j.ranks.iter().all(|r| {
                        r.phase() == Ok(RankPhase::Running)
                            && r.started_at_ms > 0
                            && now_ms().saturating_sub(r.started_at_ms) > 6_000
                    })
            },
        )
        .await;
    let old = cluster.wait_leader(LONG).await;
    let i = cluster
        .coordinators
        .iter()
        .position(|c| c.id == old)
        .expect("leader index");
    let killed_at = Instant::now();
    cluster.coordinators[i].proc.kill9();
    // A submit sent during the failover, retried with the same request id, makes one job.
    let extra = v1::JobSpec {
        world_size: 1,
        command: vec!["true".into()],
        ..Default::default()
    };
    let first = cluster
        .submit("failover-submit", extra.clone())
        .await
        .expect("submit during failover");
    let new = cluster.wait_leader(LONG).await;
    eprintln!(
        "leader {old} killed -> new leader {new} and a committed write: {:?}",
        killed_at.elapsed()
    );
    assert_ne!(new, old);
    let second = cluster
        .submit("failover-submit", extra)
        .await
        .expect("retried submit");
    assert_eq!(first.job_id, second.job_id);
    assert!(!second.created);
    let job = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(job.state, "succeeded", "{job:?}");
    assert_eq!(
        job.restarts_used, 0,
        "a leader failover restarts no rank: {:?}",
        job.restarts
    );
    check_results(&cluster, &w, &root.join("out-lk"));
    // cumulusctl keeps working with the dead coordinator still in its address list.
    let out = cluster
        .cumulusctl(&["-o", "json", "list"])
        .expect("cumulusctl list");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: v1::ListJobsResponse = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(
        list.jobs
            .iter()
            .filter(|j| j.request_id == "failover-submit")
            .count(),
        1
    );
    let out = cluster
        .cumulusctl(&["status", &job_id])
        .expect("cumulusctl status");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("succeeded"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_expires_and_its_ranks_move() {
    let opts = ClusterOpts {
        heartbeat_timeout_ms: 3_000,
        ..ClusterOpts::default()
    };
    let mut cluster = Cluster::start(opts).await.expect("cluster");
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 8).expect("shards");
    let job_id = cluster
        .submit("worker-kill", spec(&w, &root, "wk", 10))
        .await
        .expect("submit")
        .job_id;
    cluster
        .wait_job(&job_id, "ranks running on both workers", LONG, |j| {
            j.committed_step.is_some()
                && j.ranks.iter().all(|r| r.phase() == Ok(RankPhase::Running))
        })
        .await;
    let killed_at = Instant::now();
    cluster.workers[1].kill9();
    let moved = cluster
        .wait_job(&job_id, "every rank on worker-1", LONG, |j| {
            j.restarts_used >= 1 && j.ranks.iter().all(|r| r.worker_id == "worker-1")
        })
        .await;
    let expired_after = killed_at.elapsed();
    eprintln!("worker kill -> ranks re-placed: {expired_after:?}");
    // The timeout runs from the worker's last heartbeat, at most one interval (1 s)
    // before the kill.
    assert!(
        expired_after >= Duration::from_millis(2_000),
        "expired before the heartbeat timeout"
    );
    assert!(
        moved.restarts[0].cause.contains("expired"),
        "{:?}",
        moved.restarts
    );
    let s = cluster.status().await.expect("status");
    assert!(
        s.workers.iter().any(|w| w.worker_id == "worker-2"
            && w.worker_phase() == Ok(cumulus_api::WorkerPhase::Expired))
    );
    let job = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(job.state, "succeeded", "{job:?}");
    check_results(&cluster, &w, &root.join("out-wk"));
}

/// A job of `world_size` ranks running `sh -c script`, with a budget of 3 restarts
/// (300 ms backoff, at most 1 s) and `fail_fast` as given.
fn failing_spec(world_size: u32, command: &[&str], fail_fast: Option<bool>) -> v1::JobSpec {
    v1::JobSpec {
        world_size,
        command: command.iter().map(|a| a.to_string()).collect(),
        restart: Some(v1::RestartPolicy {
            max_restarts: Some(3),
            backoff_initial_ms: Some(300),
            backoff_max_ms: Some(1_000),
            ..Default::default()
        }),
        fail_fast,
        ..Default::default()
    }
}

/// Failures that name their cause, and fail fast (issue 42, items 4 and 5): with the
/// opt-out, a rank that always fails at once spends exactly its budget, each failure
/// naming the last line its program wrote to stderr; without it, a first attempt whose
/// ranks all exit the same way at once (a script path that does not exist, a program's
/// own error) fails the job within seconds with that error and no restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn always_failing_rank_exhausts_exactly_the_restart_budget() {
    let cluster = Cluster::start(ClusterOpts::default())
        .await
        .expect("cluster");
    let opted_out = failing_spec(
        2,
        &[
            "sh",
            "-c",
            "echo starting; echo 'error: disk full' >&2; exit 1",
        ],
        Some(false),
    );
    let job_id = cluster
        .submit("always-fails", opted_out)
        .await
        .expect("submit")
        .job_id;
    let missing = cluster.dir.path().join("trian.py");
    let missing = missing.to_str().expect("utf-8 path");
    let typo_id = cluster
        .submit("typo", failing_spec(2, &["python3", missing], None))
        .await
        .expect("submit")
        .job_id;
    let stderr_id = cluster
        .submit(
            "own-error",
            failing_spec(
                1,
                &["sh", "-c", "echo 'fatal: no GPU found' >&2; exit 3"],
                None,
            ),
        )
        .await
        .expect("submit")
        .job_id;

    // Fail fast: no restart, the error itself, within seconds of the start.
    let typo = cluster.wait_finished(&typo_id, LONG).await;
    assert_eq!(typo.state, "failed", "{typo:?}");
    assert_eq!(
        (typo.restarts_used, typo.restarts.len()),
        (0, 0),
        "{typo:?}"
    );
    let cause = &typo.failure_cause;
    assert!(
        cause.contains("exited with code 2: ")
            && cause.contains("can't open file")
            && cause.contains("trian.py")
            && cause.contains("all 2 ranks"),
        "{cause}"
    );
    let took_ms = typo.finished_at_ms.saturating_sub(typo.submitted_at_ms);
    assert!(took_ms < 10_000, "failed {took_ms} ms after its submit");
    let own = cluster.wait_finished(&stderr_id, LONG).await;
    assert_eq!(
        (own.state.as_str(), own.restarts_used),
        ("failed", 0),
        "{own:?}"
    );
    assert!(
        own.failure_cause
            .starts_with("rank 0 attempt 0 exited with code 3: fatal: no GPU found; its only rank"),
        "{}",
        own.failure_cause
    );
    assert_eq!(own.ranks[0].exit_cause, "fatal: no GPU found");
    let out = cluster
        .cumulusctl(&["describe", &stderr_id])
        .expect("cumulusctl");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("rank 0 attempt 0 exited with code 3: fatal: no GPU found"),
        "describe must name the cause:\n{text}"
    );

    // With the opt-out, the budget is spent as before.
    let job = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(job.state, "failed", "{job:?}");
    assert_eq!(job.restarts_used, 3);
    assert_eq!(job.restarts.len(), 3);
    assert!(
        job.failure_cause.contains("budget of 3 exhausted"),
        "{}",
        job.failure_cause
    );
    assert!(
        job.failure_cause
            .contains("exited with code 1: error: disk full"),
        "{}",
        job.failure_cause
    );
    assert!(
        job.restarts
            .iter()
            .all(|r| r.cause.contains("exited with code 1: error: disk full")),
        "{:?}",
        job.restarts
    );
    let mut previous_not_before = 0;
    for (n, r) in job.restarts.iter().enumerate() {
        let base = (300u64 << n).min(1_000);
        assert!(
            r.delay_ms * 10 >= base * 8,
            "restart {}: delay {} below 0.8 x {base}",
            r.number,
            r.delay_ms
        );
        assert_eq!(r.not_before_ms, r.failed_at_ms + r.delay_ms);
        // The attempt that failed had not started before its own backoff ended.
        assert!(
            r.failed_at_ms >= previous_not_before,
            "restart {} came too early",
            r.number
        );
        previous_not_before = r.not_before_ms;
    }
    for rank in &job.ranks {
        assert!(rank.started_at_ms >= previous_not_before || rank.started_at_ms == 0);
    }
    let out = cluster
        .cumulusctl(&["status", &job_id])
        .expect("cumulusctl");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("budget of 3 exhausted"),
        "status must name the cause:\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_errors_and_changes_nothing() {
    let cluster = Cluster::start(ClusterOpts::default())
        .await
        .expect("cluster");
    let mut c = cluster.leader_client().await.expect("client");
    let before = c
        .list_jobs(v1::ListJobsRequest { linearizable: true })
        .await
        .expect("list")
        .into_inner();
    let cases: Vec<(v1::JobSpec, &str)> = vec![
        (
            v1::JobSpec {
                world_size: 0,
                command: vec!["true".into()],
                ..Default::default()
            },
            "world size 0",
        ),
        (
            v1::JobSpec {
                world_size: 5000,
                command: vec!["true".into()],
                ..Default::default()
            },
            "world size 5000",
        ),
        (
            v1::JobSpec {
                world_size: 1,
                command: vec![],
                ..Default::default()
            },
            "command is empty",
        ),
        (
            v1::JobSpec {
                world_size: 1,
                command: vec!["true".into()],
                dataset: "/no/such/dataset".into(),
                ..Default::default()
            },
            "/no/such/dataset",
        ),
    ];
    for (i, (spec, needle)) in cases.into_iter().enumerate() {
        let err = c
            .submit_job(v1::SubmitJobRequest {
                allow_pending: false,
                request_id: format!("bad-{i}"),
                spec: Some(spec),
            })
            .await
            .expect_err("bad spec must be rejected");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert!(
            err.message().contains(needle),
            "{} should mention {needle}",
            err.message()
        );
    }
    let err = c
        .get_job(v1::GetJobRequest {
            job_id: "job-999999".into(),
            linearizable: false,
        })
        .await
        .expect_err("unknown");
    assert_eq!(err.code(), tonic::Code::NotFound);
    // Wrong token: rejected by gRPC and HTTP.
    let ch = cumulus_e2e::coordinator_channel(
        &cluster.coordinators[0].grpc,
        cluster.client_tls().as_ref(),
    )
    .await
    .expect("connect");
    let mut bad = v1::client_service_client::ClientServiceClient::with_interceptor(
        ch,
        cumulus_e2e::Auth::new("wrong-token-0123456789"),
    );
    let err = bad
        .submit_job(v1::SubmitJobRequest {
            allow_pending: false,
            request_id: "x".into(),
            spec: Some(v1::JobSpec {
                world_size: 1,
                command: vec!["true".into()],
                ..Default::default()
            }),
        })
        .await
        .expect_err("wrong token");
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    let http = cluster.http_client();
    let resp = http
        .get(cluster.url(&cluster.coordinators[0].http, "/v1/jobs"))
        .bearer_auth("wrong-token-0123456789")
        .send()
        .await
        .expect("http");
    assert_eq!(resp.status(), reqwest::StatusCode::UNAUTHORIZED);
    let resp = http
        .get(cluster.url(&cluster.coordinators[0].http, "/v1/jobs"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("http");
    assert_eq!(resp.status(), reqwest::StatusCode::OK);
    let after = c
        .list_jobs(v1::ListJobsRequest { linearizable: true })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(
        before.jobs, after.jobs,
        "rejected requests changed the state"
    );
    let out = cluster
        .cumulusctl(&["status", "job-999999"])
        .expect("cumulusctl");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("job-999999"));
}

/// What `corrupt_newest_step_then_resume` damages in the newest committed step.
#[derive(Clone, Copy, Debug)]
enum Corruption {
    /// One byte of rank 0's `weights.bin` flipped.
    PartFile,
    /// `MANIFEST.json` cut to half its length.
    Manifest,
}

/// Runs a 4-rank trainer; once two steps are committed, freezes every rank (SIGSTOP, so
/// no newer step can be committed), damages the newest committed step N, checks that
/// `cumulusctl ckpt ls` shows N as not verified, kills rank 0 and checks that the restart
/// resumes from the newest step that verifies (older than N), and that the job then
/// succeeds with every record consumed exactly once.
async fn corrupt_newest_step_then_resume(name: &str, corruption: Corruption) {
    let cluster = Cluster::start(ClusterOpts::default())
        .await
        .expect("cluster");
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 8).expect("shards");
    let mut s = spec(&w, &root, name, 15);
    s.restart = Some(v1::RestartPolicy {
        backoff_initial_ms: Some(200),
        ..Default::default()
    });
    let job_id = cluster.submit(name, s).await.expect("submit").job_id;
    let job = cluster
        .wait_job(&job_id, "two committed steps", LONG, |j| {
            j.committed_step.is_some_and(|s| s >= 60) && j.ranks.iter().all(|r| r.pid > 0)
        })
        .await;
    let pids: Vec<i32> = job.ranks.iter().map(|r| r.pid as i32).collect();
    for pid in &pids {
        kill(Pid::from_raw(*pid), Signal::SIGSTOP).expect("SIGSTOP a rank");
    }
    // The leader finishes the commit in flight: LATEST names the committed step.
    let job_dir = root.join(format!("ckpt-{name}")).join(&job_id);
    let step = cluster
        .wait_job(&job_id, "LATEST to name the committed step", LONG, |j| {
            let latest = std::fs::read_to_string(job_dir.join("LATEST")).unwrap_or_default();
            j.committed_step
                .is_some_and(|c| latest.trim() == format!("step-{c:08}"))
        })
        .await
        .committed_step
        .expect("committed");
    let step_dir = job_dir.join(format!("step-{step:08}"));
    match corruption {
        Corruption::PartFile => {
            let part = std::fs::read_dir(step_dir.join("rank-0"))
                .expect("rank-0 of the step")
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .find(|p| p.is_dir())
                .expect("the part directory");
            let weights = part.join("weights.bin");
            let mut bytes = std::fs::read(&weights).expect("weights");
            bytes[0] ^= 0xff;
            std::fs::write(&weights, &bytes).expect("corrupt");
        }
        Corruption::Manifest => {
            let manifest = step_dir.join("MANIFEST.json");
            let bytes = std::fs::read(&manifest).expect("manifest");
            std::fs::write(&manifest, &bytes[..bytes.len() / 2]).expect("corrupt");
        }
    }

    // `ckpt ls` shows the step as not verified; the newest verified step is older.
    let out = cluster
        .cumulusctl(&["ckpt", "ls", &job_id])
        .expect("cumulusctl");
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{table}");
    let row: Vec<String> = table
        .lines()
        .map(|l| {
            l.split(|c: char| c.is_whitespace() || "|│┆".contains(c))
                .filter(|t| !t.is_empty())
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .find(|t| t.first() == Some(&step.to_string()))
        .unwrap_or_else(|| panic!("step {step} is listed:\n{table}"));
    assert_eq!(row.get(1).map(String::as_str), Some("NO"), "{table}");
    let out = cluster
        .cumulusctl(&["ckpt", "ls", &job_id, "-o", "json"])
        .expect("cumulusctl");
    let listed: v1::ListCheckpointsResponse = serde_json::from_slice(&out.stdout).expect("ls json");
    let good = listed
        .checkpoints
        .iter()
        .filter(|c| c.verified)
        .map(|c| c.step)
        .max()
        .expect("an older verified step");
    assert!(good < step, "{listed:?}");

    kill(Pid::from_raw(pids[0]), Signal::SIGKILL).expect("SIGKILL rank 0");
    for pid in &pids[1..] {
        let _ = kill(Pid::from_raw(*pid), Signal::SIGCONT);
    }
    let restarted = cluster
        .wait_job(&job_id, "a restart", LONG, |j| j.restarts_used == 1)
        .await;
    assert_eq!(
        restarted.restarts[0].resume_step,
        Some(good),
        "{corruption:?}: a corrupt step is skipped for the previous good one"
    );
    let job = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(job.state, "succeeded", "{job:?}");
    check_results(&cluster, &w, &root.join(format!("out-{name}")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_checkpoint_part_falls_back_to_the_previous_good_step() {
    corrupt_newest_step_then_resume("corrupt", Corruption::PartFile).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_manifest_falls_back_to_the_previous_good_step() {
    corrupt_newest_step_then_resume("corrupt-manifest", Corruption::Manifest).await;
}

/// Reads SSE `log` events from `url` until `end` or until `limit` events; returns
/// `(rank, attempt, line)` triples and the last event id.
async fn read_sse(
    http: &reqwest::Client,
    url: &str,
    last_event_id: Option<&str>,
    limit: usize,
) -> (Vec<(u64, u64, String)>, Option<String>, bool) {
    use eventsource_stream::Eventsource;
    use futures::StreamExt;
    let mut req = http.get(url).bearer_auth(TOKEN);
    if let Some(id) = last_event_id {
        req = req.header("Last-Event-ID", id);
    }
    let resp = req.send().await.expect("sse request");
    assert!(resp.status().is_success(), "{}", resp.status());
    let mut events = resp.bytes_stream().eventsource();
    let mut lines = Vec::new();
    let mut last = last_event_id.map(str::to_string);
    while let Some(ev) = events.next().await {
        let ev = ev.expect("sse event");
        if ev.event == "end" {
            return (lines, last, true);
        }
        assert_eq!(ev.event, "log");
        let v: serde_json::Value = serde_json::from_str(&ev.data).expect("json data");
        lines.push((
            v["rank"].as_u64().expect("rank"),
            v["attempt"].as_u64().expect("attempt"),
            v["line"].as_str().expect("line").to_string(),
        ));
        last = Some(ev.id.clone());
        if lines.len() == limit {
            return (lines, last, false);
        }
    }
    (lines, last, false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_of_every_attempt_stream_over_sse_and_resume_on_another_coordinator() {
    let cluster = Cluster::start(ClusterOpts::default())
        .await
        .expect("cluster");
    // Attempt 0 of every rank prints 40 lines and fails; attempt 1 prints 40 and succeeds.
    // Rank scope, so each rank's attempt 0 runs (a group restart could supersede a rank
    // before it ever starts).
    let script = r#"for i in $(seq 1 40); do echo "rank $RANK attempt $CUMULUS_ATTEMPT line $i"; done; [ "$CUMULUS_ATTEMPT" -ge 1 ]"#;
    let spec = v1::JobSpec {
        world_size: 2,
        command: vec!["sh".into(), "-c".into(), script.into()],
        restart: Some(v1::RestartPolicy {
            scope: Some("rank".into()),
            max_restarts: Some(2),
            backoff_initial_ms: Some(200),
            ..Default::default()
        }),
        ..Default::default()
    };
    let job_id = cluster.submit("logs", spec).await.expect("submit").job_id;
    let job = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(job.state, "succeeded", "{job:?}");
    let url = |i: usize| {
        cluster.url(
            &cluster.coordinators[i].http,
            &format!("/v1/jobs/{job_id}/logs?follow=true"),
        )
    };
    let http = cluster.http_client();
    // Read part of the stream from coordinator 0, then resume on coordinator 2.
    let (first, last_id, ended) = read_sse(&http, &url(0), None, 55).await;
    assert!(!ended);
    let (rest, _, ended) = read_sse(&http, &url(2), last_id.as_deref(), usize::MAX).await;
    assert!(ended, "the stream ends once the job is over and drained");
    let all: Vec<_> = first.into_iter().chain(rest).collect();
    for rank in 0..2u64 {
        for attempt in 0..2u64 {
            let got: Vec<&str> = all
                .iter()
                .filter(|(r, a, _)| *r == rank && *a == attempt)
                .map(|(_, _, l)| l.as_str())
                .collect();
            let want: Vec<String> = (1..=40)
                .map(|i| format!("rank {rank} attempt {attempt} line {i}"))
                .collect();
            assert_eq!(
                got, want,
                "rank {rank} attempt {attempt}: no gap, no duplicate, in order"
            );
        }
    }
    assert_eq!(all.len(), 160);
    // One rank only, through cumulusctl.
    let out = cluster
        .cumulusctl(&["logs", &job_id, "--rank", "1"])
        .expect("cumulusctl logs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.lines()
            .filter(|l| l.contains("rank 1 attempt 1 line"))
            .count(),
        40,
        "{text}"
    );
    assert!(!text.contains("rank 0 attempt"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_rank_is_detected_by_the_startup_timeout() {
    let cluster = Cluster::start(ClusterOpts::default())
        .await
        .expect("cluster");
    // Alive but silent: never reports progress, never exits. The progress timeout
    // counts from a first report, which never comes: the startup timeout finds it.
    let spec = v1::JobSpec {
        world_size: 1,
        command: vec!["sleep".into(), "1000".into()],
        progress_timeout_ms: 2_000,
        startup_timeout_ms: 3_000,
        restart: Some(v1::RestartPolicy {
            max_restarts: Some(0),
            ..Default::default()
        }),
        ..Default::default()
    };
    let job_id = cluster.submit("hung", spec).await.expect("submit").job_id;
    let running = cluster
        .wait_job(&job_id, "the rank running", LONG, |j| j.ranks[0].pid > 0)
        .await;
    let pid = running.ranks[0].pid;
    let job = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(job.state, "failed");
    assert!(
        job.failure_cause
            .contains("no first report within 3000 ms of start (startup timeout)"),
        "{}",
        job.failure_cause
    );
    // The hung process is stopped by its agent.
    wait_for(
        "the hung process to be killed",
        Duration::from_secs(30),
        || async { (kill(Pid::from_raw(pid as i32), None).is_err()).then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_coordinator_rejoins_with_its_state() {
    let mut cluster = Cluster::start(ClusterOpts::default())
        .await
        .expect("cluster");
    let leader = cluster.wait_leader(LONG).await;
    let i = cluster.follower_of(leader);
    cluster.coordinators[i].proc.kill9();
    // Writes while it is down.
    let spec = v1::JobSpec {
        world_size: 1,
        command: vec!["true".into()],
        ..Default::default()
    };
    let job_id = cluster
        .submit("while-down", spec)
        .await
        .expect("submit")
        .job_id;
    let done = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(done.state, "succeeded");
    // The leader shows the dead follower as unreachable, with the role it had, in
    // `cumulusctl cluster status` (issue 42 item 7)...
    let dead = cluster.coordinators[i].id;
    let line_of = |text: &str, id: u64| {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(id.to_string().as_str()))
            .unwrap_or_default()
            .to_string()
    };
    let shown = wait_for("the dead follower shown unreachable", LONG, || async {
        let out = cluster.cumulusctl(&["cluster", "status"]).ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        line_of(&text, dead)
            .contains("unreachable (was follower, no answer for")
            .then_some(text)
    })
    .await;
    assert!(line_of(&shown, leader).contains("leader"), "{shown}");
    cluster
        .spawn_coordinator(i)
        .expect("restart on the same data dir");
    // ...and as a follower again once it answers.
    let li = cluster.index_of(leader).expect("leader index");
    wait_for("the restarted follower shown reachable", LONG, || async {
        let mut c = cluster.client_of(li).await.ok()?;
        let s = c
            .cluster_status(v1::ClusterStatusRequest {})
            .await
            .ok()?
            .into_inner();
        let m = s.members.iter().find(|m| m.node_id == dead)?;
        (m.role == cumulus_api::MemberRole::Follower.as_str()
            && m.last_role.is_empty()
            && m.last_ack_age_ms.is_some())
        .then_some(())
    })
    .await;
    // Its own (local, non-linearizable) view catches up with the committed state.
    wait_for("the restarted coordinator to catch up", LONG, || async {
        let mut c = cluster.client_of(i).await.ok()?;
        let r = c
            .get_job(v1::GetJobRequest {
                job_id: job_id.clone(),
                linearizable: false,
            })
            .await
            .ok()?;
        let job = r.into_inner().job?;
        (job.job_state() == Ok(JobState::Succeeded)).then_some(())
    })
    .await;
}

/// Many submits in flight at once on the leader (the proposal batcher groups them into
/// shared Raft entries): every one is answered, each request id creates exactly one job
/// even when it is sent twice at the same time, and every coordinator applies the same
/// jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_submits_are_each_committed_exactly_once() {
    const DISTINCT: usize = 64;
    const DUPLICATED: usize = 32;
    let cluster = Cluster::start(ClusterOpts {
        workers: 0,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let client = cluster.leader_client().await.expect("client");
    let before = cluster.status().await.expect("status");
    let mut tasks = tokio::task::JoinSet::new();
    for i in (0..DISTINCT).chain(0..DUPLICATED) {
        let mut c = client.clone();
        tasks.spawn(async move {
            let request_id = format!("concurrent-{i:03}");
            let r = c
                .submit_job(v1::SubmitJobRequest {
                    allow_pending: false,
                    request_id: request_id.clone(),
                    spec: Some(v1::JobSpec {
                        name: format!("c{i}"),
                        world_size: 2,
                        command: vec!["true".into()],
                        ..Default::default()
                    }),
                })
                .await
                .expect("every concurrent submit is committed")
                .into_inner();
            (request_id, r)
        });
    }
    let mut by_request: std::collections::BTreeMap<String, Vec<v1::SubmitJobResponse>> =
        Default::default();
    while let Some(joined) = tasks.join_next().await {
        let (request_id, r) = joined.expect("submit task");
        by_request.entry(request_id).or_default().push(r);
    }
    assert_eq!(by_request.len(), DISTINCT);
    let mut job_ids = std::collections::BTreeSet::new();
    for (request_id, answers) in &by_request {
        let created = answers.iter().filter(|r| r.created).count();
        assert_eq!(created, 1, "{request_id}: {answers:?}");
        assert!(
            answers.iter().all(|r| r.job_id == answers[0].job_id),
            "{request_id} got two jobs: {answers:?}"
        );
        assert!(job_ids.insert(answers[0].job_id.clone()), "a job id twice");
    }

    let after = cluster.status().await.expect("status");
    let entries = after
        .commit_index
        .unwrap_or(0)
        .saturating_sub(before.commit_index.unwrap_or(0));
    eprintln!(
        "{} submits committed in {entries} Raft entries",
        DISTINCT + DUPLICATED
    );
    // Every coordinator applies the same jobs.
    for i in 0..cluster.coordinators.len() {
        let c = cluster.client_of(i).await.expect("client");
        wait_for(&format!("coordinator {i} to apply every job"), LONG, || {
            let mut c = c.clone();
            let job_ids = &job_ids;
            async move {
                let jobs = c
                    .list_jobs(v1::ListJobsRequest {
                        linearizable: false,
                    })
                    .await
                    .ok()?
                    .into_inner()
                    .jobs;
                let ids: std::collections::BTreeSet<String> =
                    jobs.into_iter().map(|j| j.id).collect();
                (&ids == job_ids).then_some(())
            }
        })
        .await;
    }
}

/// A worker agent played by the test over the real worker API, so that it can send a
/// checkpoint part exactly as an agent whose first try was committed but never
/// acknowledged would send it again.
struct FakeAgent {
    /// gRPC addresses of every coordinator.
    addrs: Vec<String>,
    /// The agent's worker id.
    worker_id: String,
    /// TLS with a certificate naming `worker_id` (`None`: insecure cluster).
    tls: Option<cumulus_client::ClientTls>,
}

impl FakeAgent {
    /// A worker client of the first coordinator in `addrs` that answers `call` with
    /// something other than UNAVAILABLE (followers answer UNAVAILABLE: not the leader).
    /// As a real agent does, it goes round the coordinators again while every one answers
    /// UNAVAILABLE (a leader just elected may not serve yet, its followers may not know
    /// it), for up to [`FakeAgent::RETRY_DEADLINE`].
    async fn call<T, F, Fut>(&self, mut call: F) -> Result<T, tonic::Status>
    where
        F: FnMut(WorkerClient) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let give_up = Instant::now() + Self::RETRY_DEADLINE;
        loop {
            let mut last = tonic::Status::unavailable("no coordinator answered");
            for addr in &self.addrs {
                let Ok(client) = worker_client(addr, self.tls.as_ref()).await else {
                    continue;
                };
                match call(client).await {
                    Ok(r) => return Ok(r.into_inner()),
                    Err(s) if s.code() == tonic::Code::Unavailable => last = s,
                    Err(s) => return Err(s),
                }
            }
            if Instant::now() >= give_up {
                return Err(last);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// How long [`FakeAgent::call`] keeps trying while no coordinator serves.
    const RETRY_DEADLINE: Duration = Duration::from_secs(30);

    /// One heartbeat reporting `observed`, answered by whichever coordinator leads.
    async fn heartbeat(
        &self,
        observed: Vec<v1::ObservedRank>,
    ) -> Result<v1::HeartbeatResponse, tonic::Status> {
        self.call(|mut c| {
            let req = v1::HeartbeatRequest {
                worker_id: self.worker_id.clone(),
                observed: observed.clone(),
                resources: None,
            };
            async move { c.heartbeat(req).await }
        })
        .await
    }
}

/// A part whose entry was committed but whose reply was lost with the leader is sent
/// again by its agent to the new leader. That retry must succeed and change nothing;
/// before, it was rejected as "not after the committed step" (FAILED_PRECONDITION, which
/// an agent reads as a stale attempt) and a healthy rank was ended.
// One scenario (commit, lose the reply with the leader, retry): read in order.
#[allow(clippy::too_many_lines)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_part_retried_at_a_new_leader_after_its_step_committed_is_acknowledged() {
    let mut cluster = Cluster::start(ClusterOpts {
        workers: 0,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let root = cluster.dir.path().to_path_buf();
    let ckpt_root = root.join("ckpt-retry");
    let agent = std::sync::Arc::new(FakeAgent {
        addrs: cluster
            .coordinators
            .iter()
            .map(|c| c.grpc.clone())
            .collect(),
        worker_id: "fake-agent".into(),
        tls: cluster
            .member_tls(&cumulus_tls::Identity::Worker("fake-agent".into()))
            .expect("certificate"),
    });
    agent
        .call(|mut c| async move {
            c.register(v1::RegisterWorkerRequest {
                worker_id: "fake-agent".into(),
                host: "127.0.0.1".into(),
                http_addr: "127.0.0.1:9".into(),
                slots: 1,
                gpus: Vec::new(),
            })
            .await
        })
        .await
        .expect("register");
    let job_id = cluster
        .submit(
            "part-retry",
            v1::JobSpec {
                world_size: 1,
                command: vec!["true".into()],
                ckpt_dir: ckpt_root.to_string_lossy().to_string(),
                ..Default::default()
            },
        )
        .await
        .expect("submit")
        .job_id;
    let desired = wait_for("rank 0 placed on the fake agent", LONG, || async {
        let reply = agent.heartbeat(Vec::new()).await.ok()?;
        reply.desired.into_iter().find(|d| d.job_id == job_id)
    })
    .await;
    let attempt = desired.attempt;
    let pid = std::process::id();
    let observed = vec![v1::ObservedRank {
        job_id: job_id.clone(),
        rank: 0,
        attempt,
        pid,
        step: 10,
        total_steps: 100,
        metrics: Default::default(),
        reported: true,
        in_process: false,
    }];
    agent
        .call(|mut c| {
            let req = v1::RankStartedRequest {
                worker_id: "fake-agent".into(),
                job_id: job_id.clone(),
                rank: 0,
                attempt,
                pid,
            };
            async move { c.rank_started(req).await }
        })
        .await
        .expect("rank started");
    // Heartbeats keep the attempt alive at whichever coordinator leads.
    let beating = tokio_util::sync::CancellationToken::new();
    let heartbeats = {
        let agent = agent.clone();
        let observed = observed.clone();
        let beating = beating.clone();
        tokio::spawn(async move {
            // The agent's heartbeat period, not a wait for a condition.
            let mut period = tokio::time::interval(Duration::from_millis(200));
            loop {
                tokio::select! {
                    _ = beating.cancelled() => return,
                    _ = period.tick() => {
                        let _ = agent.heartbeat(observed.clone()).await;
                    }
                }
            }
        })
    };
    // The part, committed to the local store as the agent does it.
    use cumulus_ckpt::CheckpointStore;
    let store = cumulus_ckpt::LocalStore::new(&ckpt_root);
    let staging = store
        .prepare_staging(&job_id, 0, attempt)
        .await
        .expect("staging");
    std::fs::write(staging.join("weights.bin"), vec![7u8; 4096]).expect("write weights");
    let part = store
        .commit_part(
            &job_id,
            10,
            0,
            attempt,
            &staging,
            serde_json::json!({"step": 10}),
        )
        .await
        .expect("commit part");
    let request = |part: &cumulus_ckpt::PartRecord| v1::CommitCheckpointPartRequest {
        worker_id: "fake-agent".into(),
        job_id: job_id.clone(),
        rank: 0,
        attempt,
        step: 10,
        dir: part.dir.clone(),
        files: part
            .files
            .iter()
            .map(|f| v1::CheckpointFile {
                path: f.path.clone(),
                size_bytes: f.size_bytes,
                digest: f.digest.clone(),
            })
            .collect(),
        state_json: serde_json::to_string(&part.state).expect("json"),
    };
    let send = |req: v1::CommitCheckpointPartRequest| {
        let agent = agent.clone();
        async move {
            agent
                .call(|mut c| {
                    let req = req.clone();
                    async move { c.commit_checkpoint_part(req).await }
                })
                .await
        }
    };
    send(request(&part)).await.expect("first try");
    cluster
        .wait_job(&job_id, "step 10 committed", LONG, |j| {
            j.committed_step == Some(10)
        })
        .await;
    // The leader that committed it dies; the retry goes to its successor.
    let old = cluster.wait_leader(LONG).await;
    let i = cluster.index_of(old).expect("leader index");
    cluster.coordinators[i].proc.kill9();
    let new = cluster.wait_leader(LONG).await;
    assert_ne!(new, old);
    let retried = wait_for("the retry answered by the new leader", LONG, || async {
        match send(request(&part)).await {
            Err(s) if s.code() == tonic::Code::Unavailable => None,
            other => Some(other),
        }
    })
    .await;
    assert!(
        retried.is_ok(),
        "an identical part of the committed step is acknowledged: {retried:?}"
    );
    // A different part for the committed step is still refused as stale.
    let mut other = part.clone();
    other.files[0].size_bytes += 1;
    let refused = send(request(&other)).await.expect_err("a different part");
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
    let job = cluster.job(&job_id).await.expect("job");
    assert_eq!(job.committed_step, Some(10));
    assert_eq!(job.restarts_used, 0, "{:?}", job.restarts);
    assert_eq!(job.ranks[0].state, "running", "{:?}", job.ranks[0]);
    beating.cancel();
    heartbeats.await.expect("heartbeat task");
}
