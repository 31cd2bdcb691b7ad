//! What a job brings with it (a packed workdir, a Python environment) and what its ranks
//! leave (artifacts): validation, `apply`, and old encodings without these fields.

use super::tests::{apply, cluster_with_job, exit, spec};
use super::*;

fn blob(byte: char, size_bytes: u64) -> BlobRef {
    BlobRef {
        digest: byte.to_string().repeat(64),
        size_bytes,
    }
}

fn exit_with(
    job_id: &str,
    (rank, attempt): (u32, u32),
    worker: &str,
    code: i32,
    artifacts: Option<BlobRef>,
) -> Command {
    let mut cmd = exit(job_id, rank, attempt, worker, code);
    if let Command::RankExited { artifacts: a, .. } = &mut cmd {
        *a = artifacts;
    }
    cmd
}

fn restart_all(s: &mut ClusterState, job_id: &str, world_size: u32, failed_at_ms: u64) {
    let placements = (0..world_size)
        .map(|r| (r, if r.is_multiple_of(2) { "w1" } else { "w2" }.to_string()))
        .collect();
    let r = apply(
        s,
        Command::ScheduleRestart {
            gpus: Vec::new(),
            job_id: job_id.into(),
            placements,
            failed_at_ms,
            delay_ms: 100_000,
            cause: "c".into(),
            resume_step: None,
            agent_fault: false,
            in_process: Vec::new(),
            path_reason: String::new(),
        },
    );
    assert_eq!(r, Response::Ok);
}

#[test]
fn workdir_and_environment_are_validated() {
    let ok = JobSpec {
        workdir: Some(blob('a', 10)),
        environment: Some(Environment {
            requirements: "numpy==2.0\ntorch\n".into(),
            python: "3.12".into(),
            index_url: "https://pypi.example/simple".into(),
            find_links: vec!["/wheels".into()],
            no_index: true,
        }),
        ..spec(2)
    };
    assert_eq!(ok.validate(16), Ok(()));
    let bad = |f: &dyn Fn(&mut JobSpec)| {
        let mut s = ok.clone();
        f(&mut s);
        s.validate(16).expect_err("invalid")
    };
    for (digest, size) in [
        ("A".repeat(64), 10),
        ("a".repeat(63), 10),
        ("a".repeat(64), 0),
        ("a".repeat(64), MAX_BLOB_BYTES + 1),
    ] {
        let e = bad(&|s| {
            s.workdir = Some(BlobRef {
                digest: digest.clone(),
                size_bytes: size,
            })
        });
        assert!(matches!(e, SpecError::BadWorkdir { .. }), "{e}");
    }
    assert_eq!(
        bad(&|s| s.working_dir = "/srv/code".into()),
        SpecError::WorkdirAndWorkingDir
    );
    let env =
        |f: fn(&mut Environment)| move |s: &mut JobSpec| f(s.environment.as_mut().expect("set"));
    assert!(matches!(
        bad(&env(
            |e| e.requirements = "x".repeat(MAX_REQUIREMENTS_BYTES + 1)
        )),
        SpecError::Requirements { .. }
    ));
    assert!(matches!(
        bad(&env(|e| e.requirements = "numpy\0".into())),
        SpecError::Requirements { .. }
    ));
    assert!(matches!(
        bad(&env(|e| e.python = "2.7".into())),
        SpecError::PythonVersion { .. }
    ));
    assert!(matches!(
        bad(&env(
            |e| e.find_links = vec!["/w".into(); MAX_FIND_LINKS + 1]
        )),
        SpecError::TooManyFindLinks { .. }
    ));
    assert!(matches!(
        bad(&env(|e| e.index_url = "https://x\n--extra".into())),
        SpecError::BadIndexOption {
            field: "index_url",
            ..
        }
    ));
    assert!(matches!(
        bad(&env(|e| e.find_links = vec!["x".repeat(MAX_ARG_BYTES + 1)])),
        SpecError::BadIndexOption {
            field: "find_links",
            ..
        }
    ));
    // A submit with an invalid spec is rejected by apply and changes nothing.
    let mut s = ClusterState::default();
    let r = apply(
        &mut s,
        Command::SubmitJob {
            owner: String::new(),
            request_id: "r".into(),
            spec: JobSpec {
                workdir: Some(blob('g', 10)),
                ..spec(1)
            },
            shards: vec![],
            submitted_at_ms: 1,
        },
    );
    assert!(matches!(r, Response::Rejected { .. }), "{r:?}");
    assert!(s.jobs.is_empty());
}

#[test]
fn the_size_estimate_counts_the_environment() {
    let s = JobSpec {
        workdir: Some(blob('b', 1)),
        environment: Some(Environment {
            requirements: "package-name==1.0\n".repeat(3_000),
            python: "3.11".into(),
            index_url: "https://i.example/simple".into(),
            find_links: vec!["/wheels/dir".into(); MAX_FIND_LINKS],
            no_index: false,
        }),
        ..spec(1)
    };
    let cmd = Command::SubmitJob {
        owner: String::new(),
        request_id: "r".into(),
        spec: s,
        shards: vec![],
        submitted_at_ms: 1,
    };
    let json = serde_json::to_vec(&cmd).expect("encode").len();
    let estimate = cmd.approx_encoded_bytes();
    assert!(estimate >= json, "estimate {estimate} < encoded {json}");
    assert!(estimate <= 2 * json + 1_024, "estimate {estimate} ≫ {json}");
}

#[test]
fn specs_jobs_and_exits_written_before_these_fields_still_decode() {
    let (mut s, job_id) = cluster_with_job(1);
    assert_eq!(
        apply(
            &mut s,
            exit_with(&job_id, (0, 0), "w1", 0, Some(blob('c', 5)))
        ),
        Response::Ok
    );
    let mut job = serde_json::to_value(&*s.jobs[&job_id]).expect("json");
    let obj = job.as_object_mut().expect("object");
    assert!(obj.remove("artifacts").is_some());
    let spec = obj["spec"].as_object_mut().expect("spec");
    assert!(!spec.contains_key("workdir") && !spec.contains_key("environment"));
    let old: Job = serde_json::from_value(job).expect("decode old job");
    assert!(old.artifacts.is_empty() && old.spec.workdir.is_none());
    // The same through the log and snapshot codec (MessagePack, structs as maps).
    let bytes = crate::codec::encode(&old).expect("encode");
    let back: Job = crate::codec::decode(&bytes).expect("decode");
    assert_eq!(back, old);
    // An exit of an older agent has no artifacts field.
    let mut cmd = serde_json::to_value(exit(&job_id, 0, 0, "w1", 0)).expect("json");
    let fields = cmd
        .as_object_mut()
        .and_then(|o| o.values_mut().next())
        .and_then(|v| v.as_object_mut())
        .expect("variant fields");
    assert!(!fields.contains_key("artifacts"), "None is not written");
    let old: Command = serde_json::from_value(cmd).expect("decode old exit");
    assert!(matches!(
        old,
        Command::RankExited {
            artifacts: None,
            ..
        }
    ));
}

#[test]
fn an_accepted_exit_records_its_artifacts_newest_attempt_per_rank() {
    let (mut s, job_id) = cluster_with_job(3);
    // Rank 2 exits with artifacts first, rank 0 fails with some: kept in rank order.
    let r = apply(
        &mut s,
        exit_with(&job_id, (2, 0), "w1", 0, Some(blob('2', 7))),
    );
    assert_eq!(r, Response::Ok);
    let r = apply(
        &mut s,
        exit_with(&job_id, (0, 0), "w1", 1, Some(blob('0', 8))),
    );
    assert_eq!(r, Response::Ok);
    let ranks: Vec<(u32, u32)> = s.jobs[&job_id]
        .artifacts
        .iter()
        .map(|a| (a.rank, a.attempt))
        .collect();
    assert_eq!(ranks, [(0, 0), (2, 0)]);
    // A stale attempt, a wrong worker, or an invalid ref records nothing.
    let before = s.clone();
    for cmd in [
        exit_with(&job_id, (1, 0), "w1", 0, Some(blob('1', 9))),
        exit_with(&job_id, (0, 0), "w1", 0, Some(blob('9', 9))),
    ] {
        assert!(matches!(apply(&mut s, cmd), Response::Rejected { .. }));
    }
    assert_eq!(s, before);
    let r = apply(
        &mut s,
        exit_with(&job_id, (1, 0), "w2", 1, Some(blob('x', 9))),
    );
    assert_eq!(r, Response::Ok, "the exit itself is accepted");
    assert_eq!(s.jobs[&job_id].artifacts.len(), 2, "an invalid ref is not");
    // After a restart, attempt 1 replaces rank 0's entry; one without artifacts keeps
    // the older attempt's.
    restart_all(&mut s, &job_id, 3, 200);
    let r = apply(
        &mut s,
        exit_with(&job_id, (0, 1), "w1", 0, Some(blob('e', 3))),
    );
    assert_eq!(r, Response::Ok);
    let r = apply(&mut s, exit_with(&job_id, (2, 1), "w1", 0, None));
    assert_eq!(r, Response::Ok);
    let job = &s.jobs[&job_id];
    let got: Vec<(u32, u32, u64)> = job
        .artifacts
        .iter()
        .map(|a| (a.rank, a.attempt, a.blob.size_bytes))
        .collect();
    assert_eq!(got, [(0, 1, 3), (2, 0, 7)]);
    assert!(job.approx_dynamic_bytes() >= 2 * 64);
}

#[test]
fn a_finished_jobs_last_exits_record_their_artifacts() {
    let (mut s, job_id) = cluster_with_job(2);
    let r = apply(
        &mut s,
        Command::CancelJob {
            job_id: job_id.clone(),
            at_ms: 50,
        },
    );
    assert_eq!(r, Response::Ok);
    let r = apply(
        &mut s,
        exit_with(&job_id, (1, 0), "w2", 143, Some(blob('f', 4))),
    );
    assert_eq!(r, Response::Ok);
    let job = &s.jobs[&job_id];
    assert_eq!(job.state, JobState::Cancelled);
    assert_eq!(job.artifacts.len(), 1);
    assert_eq!((job.artifacts[0].rank, job.artifacts[0].attempt), (1, 0));
    // The same report again is rejected (the rank ended) and records nothing new.
    let r = apply(
        &mut s,
        exit_with(&job_id, (1, 0), "w2", 143, Some(blob('d', 4))),
    );
    assert!(matches!(r, Response::Rejected { .. }));
    assert_eq!(s.jobs[&job_id].artifacts[0].blob.digest, "f".repeat(64));
}

#[test]
fn exit_code_cannot_run_with_the_agents_flag_means_no_restart_can_help() {
    let (mut s, job_id) = cluster_with_job(3);
    let flagged = |rank: u32, code: i32| {
        let mut cmd = exit(
            &job_id,
            rank,
            0,
            if rank.is_multiple_of(2) { "w1" } else { "w2" },
            code,
        );
        if let Command::RankExited { exec_failed, .. } = &mut cmd {
            *exec_failed = true;
        }
        cmd
    };
    let code = cumulus_api::rank_env::EXIT_CANNOT_RUN;
    assert_eq!(apply(&mut s, flagged(0, code)), Response::Ok);
    // The flag on any other exit code is not believed.
    assert_eq!(apply(&mut s, flagged(1, 1)), Response::Ok);
    // Exit 78 without the agent's flag is an ordinary failure.
    assert_eq!(apply(&mut s, exit(&job_id, 2, 0, "w1", code)), Response::Ok);
    let ranks = &s.jobs[&job_id].ranks;
    assert!(ranks[0].exec_failed);
    assert!(
        ranks[0]
            .failure
            .as_deref()
            .is_some_and(|f| f.contains("cannot run")),
        "{:?}",
        ranks[0].failure
    );
    assert!(!ranks[1].exec_failed && !ranks[2].exec_failed);
}

#[test]
fn an_exit_keeps_its_cause_in_one_bounded_line_in_the_failure_and_only_for_that_attempt() {
    let (mut s, job_id) = cluster_with_job(3);
    let with_cause = |rank: u32, code: i32, cause: String| {
        let mut cmd = exit(
            &job_id,
            rank,
            0,
            if rank.is_multiple_of(2) { "w1" } else { "w2" },
            code,
        );
        if let Command::RankExited { cause: c, .. } = &mut cmd {
            *c = cause;
        }
        cmd
    };
    let told = "ValueError: bad lr (train.py:42)";
    assert_eq!(apply(&mut s, with_cause(0, 1, told.into())), Response::Ok);
    // A hostile agent's cause: several lines, escapes, far too long.
    let hostile = format!("a\nb\u{1b}[2J{}", "x".repeat(10_000));
    assert_eq!(apply(&mut s, with_cause(1, 3, hostile)), Response::Ok);
    // A clean exit keeps none.
    assert_eq!(
        apply(&mut s, with_cause(2, 0, "noise".into())),
        Response::Ok
    );
    let ranks = &s.jobs[&job_id].ranks;
    assert_eq!(ranks[0].exit_cause.as_deref(), Some(told));
    assert_eq!(
        ranks[0].failure.as_deref(),
        Some("rank 0 attempt 0 exited with code 1: ValueError: bad lr (train.py:42)")
    );
    let bounded = ranks[1].exit_cause.as_deref().expect("a cause");
    assert!(
        bounded.len() <= cumulus_api::limits::MAX_EXIT_CAUSE_BYTES,
        "{}",
        bounded.len()
    );
    assert!(bounded.starts_with("a\\nb\\u{1b}[2J") && cumulus_api::text::is_printable(bounded));
    assert_eq!(ranks[2].exit_cause, None);
    // The next attempt starts without the previous one's cause.
    let mut rank = ranks[0].clone();
    rank.new_attempt(ResumePoint::default());
    assert_eq!((rank.exit_cause, rank.failure), (None, None));
}
