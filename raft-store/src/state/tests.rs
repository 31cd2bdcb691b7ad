use std::collections::BTreeSet;

use super::*;

pub(super) fn spec(world_size: u32) -> JobSpec {
    JobSpec {
        ckpt_dir: "/ckpt".into(),
        ckpt_keep: 2,
        restart: RestartPolicy {
            max_restarts: 2,
            ..RestartPolicy::default()
        },
        ..JobSpec::new(world_size, vec!["train".into()])
    }
}

pub(super) fn apply(s: &mut ClusterState, cmd: Command) -> Response {
    s.apply(&cmd, &mut BTreeSet::new())
}

pub(super) fn cluster_with_job(world_size: u32) -> (ClusterState, String) {
    let mut s = ClusterState::default();
    for w in ["w1", "w2"] {
        let r = apply(
            &mut s,
            Command::RegisterWorker {
                gpus: Vec::new(),
                worker_id: w.into(),
                host: "127.0.0.1".into(),
                http_addr: "127.0.0.1:1".into(),
                slots: 4,
                at_ms: 1,
            },
        );
        assert_eq!(r, Response::Ok);
    }
    let r = apply(
        &mut s,
        Command::SubmitJob {
            owner: String::new(),
            request_id: "req".into(),
            spec: spec(world_size),
            shards: vec![],
            submitted_at_ms: 2,
        },
    );
    let Response::JobSubmitted {
        job_id,
        created: true,
    } = r
    else {
        panic!("{r:?}")
    };
    let placements = (0..world_size)
        .map(|r| (r, if r % 2 == 0 { "w1" } else { "w2" }.to_string()))
        .collect();
    assert_eq!(
        apply(
            &mut s,
            Command::PlaceJob {
                gpus: Vec::new(),
                job_id: job_id.clone(),
                placements,
                at_ms: 3
            }
        ),
        Response::Ok
    );
    (s, job_id)
}

pub(super) fn exit(job_id: &str, rank: u32, attempt: u32, worker: &str, code: i32) -> Command {
    Command::RankExited {
        cause: String::new(),
        step: 0,
        total_steps: 0,
        exec_failed: false,
        job_id: job_id.into(),
        rank,
        attempt,
        worker_id: worker.into(),
        exit_code: Some(code),
        signal: None,
        spawn_error: String::new(),
        at_ms: 100,
        agent_fault: false,
        agent_evidence: String::new(),
        artifacts: None,
    }
}

#[test]
fn a_batch_applies_each_command_in_order_as_if_alone() {
    let submit = |req: &str| Command::SubmitJob {
        owner: String::new(),
        request_id: req.into(),
        spec: spec(2),
        shards: vec![],
        submitted_at_ms: 2,
    };
    // The same commands applied one by one and as one batch give the same state and
    // the same responses, a rejected member included.
    let commands = vec![
        submit("a"),
        submit("b"),
        Command::CancelJob {
            job_id: "no-such-job".into(),
            at_ms: 3,
        },
        submit("a"),
    ];
    let mut alone = ClusterState::default();
    let mut alone_dirty = BTreeSet::new();
    let expected: Vec<Response> = commands
        .iter()
        .map(|c| alone.apply(c, &mut alone_dirty))
        .collect();
    assert!(matches!(expected[2], Response::Rejected { .. }));
    let mut batched = ClusterState::default();
    let mut batched_dirty = BTreeSet::new();
    let r = batched.apply(
        &Command::Batch {
            commands: commands.clone(),
        },
        &mut batched_dirty,
    );
    assert_eq!(
        r,
        Response::Batch {
            responses: expected
        }
    );
    assert_eq!(batched, alone);
    assert_eq!(batched_dirty, alone_dirty);

    // A nested batch or one over the limit is rejected whole and changes nothing.
    for bad in [
        vec![submit("c"), Command::Batch { commands: vec![] }],
        vec![submit("d"); MAX_BATCH_COMMANDS + 1],
    ] {
        let before = batched.clone();
        let r = apply(&mut batched, Command::Batch { commands: bad });
        assert!(matches!(r, Response::Rejected { .. }), "{r:?}");
        assert_eq!(batched, before);
    }
}

/// The index kept by `apply` equals one rebuilt from scratch.
fn assert_index_current(s: &ClusterState) {
    let mut rebuilt = s.clone();
    rebuilt.rebuild_index();
    assert_eq!(s.job_index(), rebuilt.job_index());
    // Each owner's unfinished bytes are the sum over its pending, running and paused jobs.
    let mut by_owner: std::collections::BTreeMap<&str, u64> = Default::default();
    for j in s.jobs.values().filter(|j| !j.state.is_terminal()) {
        *by_owner.entry(j.owner.as_str()).or_default() += j.approx_encoded_bytes();
    }
    for (owner, bytes) in &by_owner {
        assert_eq!(s.job_index().unfinished_bytes_of(owner), *bytes, "{owner}");
    }
    assert_eq!(
        by_owner.values().sum::<u64>(),
        s.job_index().unfinished_bytes()
    );
}

#[test]
fn the_job_index_follows_every_state_change_and_survives_serialization() {
    let (mut s, placed) = cluster_with_job(2);
    assert_index_current(&s);
    assert!(s.job_index().running.contains(&placed));
    let submit = |req: String, owner: &str| Command::SubmitJob {
        owner: owner.into(),
        request_id: req,
        spec: spec(1),
        shards: vec![],
        submitted_at_ms: 5,
    };
    let r = apply(
        &mut s,
        Command::Batch {
            commands: (0..3)
                .map(|i| submit(format!("b{i}"), ["ann", "bo", "ann"][i]))
                .collect(),
        },
    );
    assert!(matches!(r, Response::Batch { .. }));
    assert_eq!(s.job_index().pending.len(), 3);
    assert_index_current(&s);
    assert!(s.job_index().unfinished_bytes_of("ann") > s.job_index().unfinished_bytes_of("bo"));
    assert_eq!(s.job_index().unfinished_bytes_of("nobody"), 0);
    let pending: Vec<String> = s.job_index().pending.iter().cloned().collect();
    apply(
        &mut s,
        Command::CancelJob {
            job_id: pending[0].clone(),
            at_ms: 6,
        },
    );
    apply(
        &mut s,
        Command::FailJob {
            job_id: placed.clone(),
            cause: "test".into(),
            at_ms: 7,
        },
    );
    assert_index_current(&s);
    assert!(s.job_index().terminal.contains(&pending[0]));
    assert!(s.job_index().terminal.contains(&placed));
    assert_eq!(s.job_index().running.len(), 0);
    // A deserialized state (snapshot, Raft state transfer) carries a rebuilt index.
    let json = serde_json::to_vec(&s).expect("encode");
    let back: ClusterState = serde_json::from_slice(&json).expect("decode");
    assert_eq!(back, s);
    assert_eq!(back.job_index().pending.len(), 2);
}

#[test]
fn past_the_retention_limit_the_oldest_terminal_jobs_are_evicted() {
    let mut s = ClusterState::default();
    let submit = |i: usize| Command::SubmitJob {
        owner: String::new(),
        request_id: format!("r{i}"),
        spec: spec(1),
        shards: vec![],
        submitted_at_ms: 1,
    };
    for i in 0..MAX_JOBS_RETAINED {
        apply(&mut s, submit(i));
    }
    let oldest: Vec<String> = s.jobs.keys().take(3).cloned().collect();
    for id in &oldest {
        apply(
            &mut s,
            Command::CancelJob {
                job_id: id.clone(),
                at_ms: 2,
            },
        );
    }
    let mut dirty = BTreeSet::new();
    s.apply(&submit(MAX_JOBS_RETAINED), &mut dirty);
    s.apply(&submit(MAX_JOBS_RETAINED + 1), &mut dirty);
    assert_eq!(s.jobs.len(), MAX_JOBS_RETAINED);
    assert!(!s.jobs.contains_key(&oldest[0]) && !s.jobs.contains_key(&oldest[1]));
    assert!(s.jobs.contains_key(&oldest[2]), "only as many as needed go");
    assert!(!s.request_ids.contains_key("r0") && !s.request_ids.contains_key("r1"));
    assert!(dirty.contains(&DirtyKey::Job(oldest[0].clone())));
    assert_index_current(&s);
    // Pending jobs are never evicted: with no terminal job left, the state grows.
    let before = s.jobs.len();
    apply(&mut s, submit(MAX_JOBS_RETAINED + 2));
    apply(&mut s, submit(MAX_JOBS_RETAINED + 3));
    assert_eq!(s.jobs.len(), before + 1);
    assert_index_current(&s);
}

#[test]
fn the_size_estimate_of_a_submit_bounds_its_json_encoding() {
    let mut big = spec(4);
    big.command = vec!["x".repeat(4_000); 20];
    big.env = (0..50)
        .map(|i| (format!("K{i}"), "v".repeat(100)))
        .collect();
    for (s, shards) in [
        (spec(1), vec![]),
        (
            big,
            (0..1_000)
                .map(|i| format!("/data/shard-{i:05}.bin"))
                .collect(),
        ),
    ] {
        let cmd = Command::SubmitJob {
            owner: String::new(),
            request_id: "r".repeat(24),
            spec: s,
            shards,
            submitted_at_ms: 1,
        };
        let json = serde_json::to_vec(&cmd).expect("encode").len();
        let estimate = cmd.approx_encoded_bytes();
        assert!(estimate >= json, "estimate {estimate} < encoded {json}");
        assert!(estimate <= 2 * json + 1_024, "estimate {estimate} ≫ {json}");
    }
}

#[test]
fn backoff_doubles_and_caps() {
    let p = RestartPolicy {
        backoff_initial_ms: 500,
        backoff_max_ms: 30_000,
        ..RestartPolicy::default()
    };
    assert_eq!(p.base_delay_ms(1), 500);
    assert_eq!(p.base_delay_ms(2), 1_000);
    assert_eq!(p.base_delay_ms(3), 2_000);
    assert_eq!(p.base_delay_ms(10), 30_000);
    assert_eq!(p.base_delay_ms(200), 30_000);
    assert_eq!(p.jittered_delay_ms(1, -1.0), 400);
    assert_eq!(p.jittered_delay_ms(1, 1.0), 600);
    assert_eq!(p.jittered_delay_ms(1, f64::NAN), 500);
    assert_eq!(p.min_delay_ms(2), 800);
}

#[test]
fn submit_is_idempotent_by_request_id() {
    let (mut s, job_id) = cluster_with_job(2);
    let again = apply(
        &mut s,
        Command::SubmitJob {
            owner: String::new(),
            request_id: "req".into(),
            spec: spec(2),
            shards: vec![],
            submitted_at_ms: 9,
        },
    );
    assert_eq!(
        again,
        Response::JobSubmitted {
            job_id,
            created: false
        }
    );
    assert_eq!(s.jobs.len(), 1);
    let different = apply(
        &mut s,
        Command::SubmitJob {
            owner: String::new(),
            request_id: "req".into(),
            spec: spec(3),
            shards: vec![],
            submitted_at_ms: 9,
        },
    );
    assert!(matches!(different, Response::Rejected { .. }));
    assert_eq!(s.jobs.len(), 1);
}

#[test]
fn invalid_specs_are_rejected_and_change_nothing() {
    let mut s = ClusterState::default();
    for bad in [
        JobSpec {
            world_size: 0,
            ..spec(1)
        },
        JobSpec {
            command: vec![],
            ..spec(1)
        },
        JobSpec {
            ckpt_dir: "relative".into(),
            ..spec(1)
        },
        JobSpec {
            restart: RestartPolicy {
                backoff_initial_ms: 10,
                backoff_max_ms: 5,
                ..RestartPolicy::default()
            },
            ..spec(1)
        },
    ] {
        let before = s.clone();
        let r = apply(
            &mut s,
            Command::SubmitJob {
                owner: String::new(),
                request_id: "x".into(),
                spec: bad,
                shards: vec![],
                submitted_at_ms: 1,
            },
        );
        assert!(matches!(r, Response::Rejected { .. }), "{r:?}");
        assert_eq!(s, before);
    }
}

#[test]
fn stale_attempt_reports_are_rejected() {
    let (mut s, job_id) = cluster_with_job(2);
    assert_eq!(apply(&mut s, exit(&job_id, 1, 0, "w2", 1)), Response::Ok);
    let placements = vec![(0, "w1".to_string()), (1, "w2".to_string())];
    let restart = Command::ScheduleRestart {
        gpus: Vec::new(),
        job_id: job_id.clone(),
        placements,
        failed_at_ms: 100,
        delay_ms: 500,
        cause: "rank 1 exited".into(),
        resume_step: None,
        agent_fault: false,
        in_process: Vec::new(),
        path_reason: String::new(),
    };
    assert_eq!(apply(&mut s, restart), Response::Ok);
    let job = &s.jobs[&job_id];
    assert!(
        job.ranks
            .iter()
            .all(|r| r.attempt == 1 && r.state == RankState::Pending && r.not_before_ms == 600)
    );
    // Rank 0's old attempt exits after being stopped: stale, changes nothing.
    let before = s.clone();
    assert!(matches!(
        apply(&mut s, exit(&job_id, 0, 0, "w1", 143)),
        Response::Rejected { .. }
    ));
    assert_eq!(s, before);
    // A report from the wrong worker is rejected too.
    assert!(matches!(
        apply(&mut s, exit(&job_id, 0, 1, "w2", 0)),
        Response::Rejected { .. }
    ));
}

#[test]
fn restart_budget_and_delay_floor_are_enforced() {
    let (mut s, job_id) = cluster_with_job(1);
    for attempt in 0..2 {
        assert_eq!(
            apply(&mut s, exit(&job_id, 0, attempt, "w1", 1)),
            Response::Ok
        );
        let n = attempt + 1;
        let floor = s.jobs[&job_id].spec.restart.min_delay_ms(n);
        let too_short = Command::ScheduleRestart {
            gpus: Vec::new(),
            job_id: job_id.clone(),
            placements: vec![(0, "w1".into())],
            failed_at_ms: 100,
            delay_ms: floor - 1,
            cause: "c".into(),
            resume_step: None,
            agent_fault: false,
            in_process: Vec::new(),
            path_reason: String::new(),
        };
        assert!(matches!(
            apply(&mut s, too_short),
            Response::Rejected { .. }
        ));
        let ok = Command::ScheduleRestart {
            gpus: Vec::new(),
            job_id: job_id.clone(),
            placements: vec![(0, "w1".into())],
            failed_at_ms: 100,
            delay_ms: floor,
            cause: "c".into(),
            resume_step: None,
            agent_fault: false,
            in_process: Vec::new(),
            path_reason: String::new(),
        };
        assert_eq!(apply(&mut s, ok), Response::Ok);
    }
    assert_eq!(apply(&mut s, exit(&job_id, 0, 2, "w1", 1)), Response::Ok);
    let over = Command::ScheduleRestart {
        gpus: Vec::new(),
        job_id: job_id.clone(),
        placements: vec![(0, "w1".into())],
        failed_at_ms: 100,
        delay_ms: 100_000,
        cause: "c".into(),
        resume_step: None,
        agent_fault: false,
        in_process: Vec::new(),
        path_reason: String::new(),
    };
    assert!(matches!(apply(&mut s, over), Response::Rejected { .. }));
    assert_eq!(s.jobs[&job_id].restarts_used, 2);
}

#[test]
fn placement_respects_slots_and_expiry() {
    let mut s = ClusterState::default();
    apply(
        &mut s,
        Command::RegisterWorker {
            gpus: Vec::new(),
            worker_id: "w1".into(),
            host: "h".into(),
            http_addr: "h:1".into(),
            slots: 1,
            at_ms: 0,
        },
    );
    let Response::JobSubmitted { job_id, .. } = apply(
        &mut s,
        Command::SubmitJob {
            owner: String::new(),
            request_id: "a".into(),
            spec: spec(2),
            shards: vec![],
            submitted_at_ms: 0,
        },
    ) else {
        panic!()
    };
    let over = Command::PlaceJob {
        gpus: Vec::new(),
        job_id: job_id.clone(),
        placements: vec![(0, "w1".into()), (1, "w1".into())],
        at_ms: 1,
    };
    assert!(matches!(apply(&mut s, over), Response::Rejected { .. }));
    apply(
        &mut s,
        Command::ExpireWorker {
            worker_id: "w1".into(),
            at_ms: 2,
        },
    );
    let on_expired = Command::PlaceJob {
        gpus: Vec::new(),
        job_id: job_id.clone(),
        placements: vec![(0, "w1".into())],
        at_ms: 3,
    };
    assert!(matches!(
        apply(&mut s, on_expired),
        Response::Rejected { .. }
    ));
    assert_eq!(s.jobs[&job_id].state, JobState::Pending);
}

#[test]
fn worker_expiry_fails_its_ranks() {
    let (mut s, job_id) = cluster_with_job(2);
    assert_eq!(
        apply(
            &mut s,
            Command::ExpireWorker {
                worker_id: "w2".into(),
                at_ms: 50
            }
        ),
        Response::Ok
    );
    let r1 = &s.jobs[&job_id].ranks[1];
    assert_eq!(r1.state, RankState::Failed);
    assert!(r1.failure.as_deref().unwrap_or("").contains("expired"));
    assert_eq!(s.jobs[&job_id].ranks[0].state, RankState::Pending);
}

fn part(rank: u32, attempt: u32, step: u64) -> PartInfo {
    PartInfo {
        rank,
        attempt,
        dir: format!("step-{step:08}/rank-{rank}/attempt-{attempt}"),
        files: vec![],
        state_json: "{}".into(),
    }
}

#[test]
fn checkpoint_commits_only_with_every_part_and_keeps_k() {
    let (mut s, job_id) = cluster_with_job(2);
    for step in [10, 20, 30] {
        let commit = Command::CheckpointCommitted {
            job_id: job_id.clone(),
            step,
            at_ms: 1,
        };
        assert_eq!(
            apply(
                &mut s,
                Command::CheckpointPartCommitted {
                    job_id: job_id.clone(),
                    step,
                    part: part(0, 0, step)
                }
            ),
            Response::Ok
        );
        assert!(matches!(
            apply(&mut s, commit.clone()),
            Response::Rejected { .. }
        ));
        assert_eq!(
            apply(
                &mut s,
                Command::CheckpointPartCommitted {
                    job_id: job_id.clone(),
                    step,
                    part: part(1, 0, step)
                }
            ),
            Response::Ok
        );
        assert_eq!(apply(&mut s, commit), Response::Ok);
    }
    let job = &s.jobs[&job_id];
    assert_eq!(job.committed_step, Some(30));
    assert_eq!(
        job.committed.keys().copied().collect::<Vec<_>>(),
        vec![20, 30]
    );
    // A retry of a part already committed with its step (its first reply lost in a
    // failover) succeeds and changes nothing; any other part for a committed step is
    // rejected; a stale attempt's part too.
    let before = s.jobs[&job_id].clone();
    let retry = Command::CheckpointPartCommitted {
        job_id: job_id.clone(),
        step: 30,
        part: part(0, 0, 30),
    };
    assert_eq!(apply(&mut s, retry), Response::Ok);
    assert_eq!(s.jobs[&job_id], before);
    let mut other = part(0, 0, 30);
    other.dir.push_str("-other");
    let old = Command::CheckpointPartCommitted {
        job_id: job_id.clone(),
        step: 30,
        part: other,
    };
    assert!(matches!(apply(&mut s, old), Response::Rejected { .. }));
    let older = Command::CheckpointPartCommitted {
        job_id: job_id.clone(),
        step: 20,
        part: part(0, 0, 30),
    };
    assert!(matches!(apply(&mut s, older), Response::Rejected { .. }));
    let stale = Command::CheckpointPartCommitted {
        job_id: job_id.clone(),
        step: 40,
        part: part(0, 7, 40),
    };
    assert!(matches!(apply(&mut s, stale), Response::Rejected { .. }));
    // Restart resumes each rank from its own committed part.
    apply(&mut s, exit(&job_id, 0, 0, "w1", 1));
    let restart = Command::ScheduleRestart {
        gpus: Vec::new(),
        job_id: job_id.clone(),
        placements: vec![(0, "w1".into()), (1, "w2".into())],
        failed_at_ms: 0,
        delay_ms: 500,
        cause: "c".into(),
        resume_step: Some(30),
        agent_fault: false,
        in_process: Vec::new(),
        path_reason: String::new(),
    };
    assert_eq!(apply(&mut s, restart), Response::Ok);
    assert_eq!(
        s.jobs[&job_id].ranks[1].resume_dir,
        "step-00000030/rank-1/attempt-0"
    );
}

#[test]
fn job_succeeds_only_when_all_ranks_exited_zero() {
    let (mut s, job_id) = cluster_with_job(2);
    apply(&mut s, exit(&job_id, 0, 0, "w1", 0));
    let done = Command::JobSucceeded {
        job_id: job_id.clone(),
        at_ms: 5,
    };
    assert!(matches!(
        apply(&mut s, done.clone()),
        Response::Rejected { .. }
    ));
    apply(&mut s, exit(&job_id, 1, 0, "w2", 0));
    assert_eq!(apply(&mut s, done), Response::Ok);
    assert_eq!(s.jobs[&job_id].state, JobState::Succeeded);
    // Terminal jobs accept nothing more.
    assert!(matches!(
        apply(&mut s, Command::CancelJob { job_id, at_ms: 6 }),
        Response::Rejected { .. }
    ));
}

#[test]
fn resuming_from_an_older_step_forgets_newer_steps_and_stale_parts() {
    let (mut s, job_id) = cluster_with_job(2);
    for step in [10, 20] {
        for rank in 0..2 {
            let c = Command::CheckpointPartCommitted {
                job_id: job_id.clone(),
                step,
                part: part(rank, 0, step),
            };
            assert_eq!(apply(&mut s, c), Response::Ok);
        }
        let c = Command::CheckpointCommitted {
            job_id: job_id.clone(),
            step,
            at_ms: 1,
        };
        assert_eq!(apply(&mut s, c), Response::Ok);
    }
    // Rank 0 of attempt 0 got its part of step 30 in before rank 1 failed.
    let c = Command::CheckpointPartCommitted {
        job_id: job_id.clone(),
        step: 30,
        part: part(0, 0, 30),
    };
    assert_eq!(apply(&mut s, c), Response::Ok);
    apply(&mut s, exit(&job_id, 1, 0, "w2", 1));
    let restart = Command::ScheduleRestart {
        gpus: Vec::new(),
        job_id: job_id.clone(),
        placements: vec![(0, "w1".into()), (1, "w2".into())],
        failed_at_ms: 0,
        delay_ms: 500,
        cause: "step 20 is corrupt".into(),
        resume_step: Some(10),
        agent_fault: false,
        in_process: Vec::new(),
        path_reason: String::new(),
    };
    assert_eq!(apply(&mut s, restart), Response::Ok);
    let job = &s.jobs[&job_id];
    assert_eq!(job.committed_step, Some(10));
    assert_eq!(job.committed.keys().copied().collect::<Vec<_>>(), vec![10]);
    assert!(
        job.pending_parts.is_empty(),
        "attempt-0 parts must not mix with attempt 1"
    );
    // Step 20 can be committed again by the new attempt.
    let c = Command::CheckpointPartCommitted {
        job_id: job_id.clone(),
        step: 20,
        part: part(0, 1, 20),
    };
    assert_eq!(apply(&mut s, c), Response::Ok);
}

/// A job's size estimate is at least its real encoding and at most a few times it,
/// as it runs: placed, with checkpoint parts, restarted; and with a large shard list.
#[test]
fn a_jobs_size_estimate_covers_its_encoding() {
    let check = |job: &Job, what: &str| {
        let real = serde_json::to_vec(job).expect("encode").len() as u64;
        let estimate = job.approx_encoded_bytes();
        assert!(
            real <= estimate && estimate <= 4 * real,
            "{what}: estimate {estimate}, real {real}"
        );
    };
    let (mut s, job_id) = cluster_with_job(2);
    check(&s.jobs[&job_id], "placed");
    for step in [10, 20, 30] {
        for rank in 0..2 {
            let mut p = part(rank, 0, step);
            p.files = (0..20)
                .map(|i| FileEntry {
                    path: format!("shard-{i:04}.bin"),
                    size_bytes: 1 << 20,
                    digest: "b".repeat(64),
                })
                .collect();
            p.state_json = format!(r#"{{"epoch":3,"order":"{}"}}"#, "7".repeat(500));
            let c = Command::CheckpointPartCommitted {
                job_id: job_id.clone(),
                step,
                part: p,
            };
            assert_eq!(apply(&mut s, c), Response::Ok);
        }
        let commit = Command::CheckpointCommitted {
            job_id: job_id.clone(),
            step,
            at_ms: 1,
        };
        assert_eq!(apply(&mut s, commit), Response::Ok);
    }
    check(&s.jobs[&job_id], "with checkpoints");
    assert_eq!(apply(&mut s, exit(&job_id, 1, 0, "w2", 1)), Response::Ok);
    let restart = Command::ScheduleRestart {
        gpus: Vec::new(),
        job_id: job_id.clone(),
        placements: vec![(0, "w1".to_string()), (1, "w2".to_string())],
        failed_at_ms: 100,
        delay_ms: 500,
        cause: "rank 1 exited with code 1".into(),
        resume_step: Some(30),
        agent_fault: false,
        in_process: Vec::new(),
        path_reason: String::new(),
    };
    assert_eq!(apply(&mut s, restart), Response::Ok);
    check(&s.jobs[&job_id], "restarted");
    assert_index_current(&s);
    let shards: Vec<String> = (0..1_000)
        .map(|i| format!("/data/imagenet/train/shard-{i:06}.tar"))
        .collect();
    let r = apply(
        &mut s,
        Command::SubmitJob {
            owner: String::new(),
            request_id: "many-shards".into(),
            spec: spec(64),
            shards: shards.clone(),
            submitted_at_ms: 3,
        },
    );
    let Response::JobSubmitted { job_id: big, .. } = r else {
        panic!("{r:?}");
    };
    check(&s.jobs[&big], "1,000 shards, 64 ranks");
    assert_eq!(
        s.jobs[&big].approx_encoded_bytes(),
        submit_bytes(&spec(64), &shards) + (big.len() + "many-shards".len()) as u64,
        "what the leader admits a submit by is what it adds"
    );
    assert_eq!(
        s.job_index().total_bytes(),
        s.jobs
            .values()
            .map(|j| j.approx_encoded_bytes())
            .sum::<u64>()
    );
}

/// Past the byte budget, the oldest finished jobs are dropped until the estimate
/// fits; unfinished jobs never are.
#[test]
fn finished_jobs_are_dropped_to_stay_within_the_byte_budget() {
    let mut s = ClusterState::default();
    let mut ids = Vec::new();
    for i in 0..6 {
        let r = apply(
            &mut s,
            Command::SubmitJob {
                owner: String::new(),
                request_id: format!("r{i}"),
                spec: spec(1),
                shards: (0..10)
                    .map(|k| format!("{k}{}", "s".repeat(1_000)))
                    .collect(),
                submitted_at_ms: 1,
            },
        );
        let Response::JobSubmitted { job_id, .. } = r else {
            panic!("{r:?}");
        };
        ids.push(job_id);
    }
    for id in &ids[..4] {
        let cancel = Command::CancelJob {
            job_id: id.clone(),
            at_ms: 2,
        };
        assert_eq!(apply(&mut s, cancel), Response::Ok);
    }
    let evict = |s: &mut ClusterState, max_bytes: u64| {
        let mut dirty = BTreeSet::new();
        s.evict_old_jobs(MAX_JOBS_RETAINED, max_bytes, &mut dirty);
        for key in &dirty {
            if let DirtyKey::Job(id) = key {
                let job = s.jobs.get(id).cloned();
                s.index.update(id, job.as_deref());
            }
        }
        assert_index_current(s);
    };
    let index = s.job_index();
    let fits = index.total_bytes() - index.job_bytes(&ids[0]) - index.job_bytes(&ids[1]);
    assert!(index.unfinished_bytes() < fits);
    evict(&mut s, fits);
    assert!(!s.jobs.contains_key(&ids[0]) && !s.jobs.contains_key(&ids[1]));
    assert!(!s.request_ids.contains_key("r0") && !s.request_ids.contains_key("r1"));
    assert!(s.jobs.contains_key(&ids[2]), "only as many as needed go");
    assert_eq!(s.job_index().total_bytes(), fits);
    // Unfinished jobs stay, whatever the budget.
    evict(&mut s, 1);
    let kept: Vec<&String> = s.jobs.keys().collect();
    assert_eq!(kept, vec![&ids[4], &ids[5]]);
}

fn gpu(index: u32, uuid: &str) -> GpuDevice {
    GpuDevice {
        index,
        uuid: uuid.into(),
        name: "Fake".into(),
        memory_total_bytes: 1 << 30,
    }
}

fn register_gpus(s: &mut ClusterState, worker: &str, gpus: Vec<GpuDevice>) -> Response {
    apply(
        s,
        Command::RegisterWorker {
            gpus,
            worker_id: worker.into(),
            host: "h".into(),
            http_addr: "h:1".into(),
            slots: 4,
            at_ms: 0,
        },
    )
}

fn submit_gpu_job(s: &mut ClusterState, id: &str, gpus_per_rank: u32, permille: u32) -> String {
    let Response::JobSubmitted { job_id, .. } = apply(
        s,
        Command::SubmitJob {
            owner: String::new(),
            request_id: id.into(),
            spec: JobSpec {
                gpus_per_rank,
                gpu_memory_permille: permille,
                ..spec(1)
            },
            shards: vec![],
            submitted_at_ms: 0,
        },
    ) else {
        panic!("submit refused")
    };
    job_id
}

fn place_gpu(s: &mut ClusterState, job_id: &str, worker: &str, gpus: &[&str]) -> Response {
    apply(
        s,
        Command::PlaceJob {
            job_id: job_id.into(),
            placements: vec![(0, worker.into())],
            gpus: vec![(0, gpus.iter().map(|g| g.to_string()).collect())],
            at_ms: 1,
        },
    )
}

#[test]
fn gpu_inventories_are_checked_at_registration() {
    let mut s = ClusterState::default();
    assert_eq!(
        register_gpus(&mut s, "w1", vec![gpu(0, "GPU-a")]),
        Response::Ok
    );
    for bad in [
        vec![gpu(0, "GPU-b"), gpu(1, "GPU-b")],
        vec![gpu(0, "GPU,b")],
        vec![gpu(0, "GPU-a")], // w1's
        (0..65).map(|i| gpu(i, &format!("GPU-{i}"))).collect(),
    ] {
        assert!(
            matches!(
                register_gpus(&mut s, "w2", bad.clone()),
                Response::Rejected { .. }
            ),
            "{bad:?}"
        );
    }
    assert!(!s.workers.contains_key("w2"));
    // The same worker registering again keeps its own GPUs.
    assert_eq!(
        register_gpus(&mut s, "w1", vec![gpu(0, "GPU-a")]),
        Response::Ok
    );
}

#[test]
fn gpu_placements_are_checked_and_shares_never_pass_a_whole_gpu() {
    let mut s = ClusterState::default();
    register_gpus(&mut s, "w1", vec![gpu(0, "GPU-a"), gpu(1, "GPU-b")]);
    register_gpus(&mut s, "w2", vec![gpu(0, "GPU-c")]);
    let whole = submit_gpu_job(&mut s, "whole", 1, 0);
    // Wrong count, foreign GPU, none at all: refused.
    for gpus in [&["GPU-a", "GPU-b"][..], &["GPU-c"][..], &[][..]] {
        assert!(
            matches!(
                place_gpu(&mut s, &whole, "w1", gpus),
                Response::Rejected { .. }
            ),
            "{gpus:?}"
        );
    }
    assert_eq!(place_gpu(&mut s, &whole, "w1", &["GPU-a"]), Response::Ok);
    assert_eq!(s.jobs[&whole].ranks[0].gpus, vec!["GPU-a".to_string()]);
    // A half on the taken GPU is refused; two halves share the other, a third does not fit.
    let halves: Vec<String> = (0..3)
        .map(|i| submit_gpu_job(&mut s, &format!("half-{i}"), 1, 500))
        .collect();
    assert!(matches!(
        place_gpu(&mut s, &halves[0], "w1", &["GPU-a"]),
        Response::Rejected { .. }
    ));
    assert_eq!(
        place_gpu(&mut s, &halves[0], "w1", &["GPU-b"]),
        Response::Ok
    );
    assert_eq!(
        place_gpu(&mut s, &halves[1], "w1", &["GPU-b"]),
        Response::Ok
    );
    assert!(matches!(
        place_gpu(&mut s, &halves[2], "w1", &["GPU-b"]),
        Response::Rejected { .. }
    ));
    assert_eq!(s.gpus_used(None).get("GPU-b"), Some(&1000));
    assert!(
        s.pending_reason(&s.jobs[&halves[2]])
            .is_none_or(|r| r.contains("waiting")),
        "GPU-c is still free: no reason, or a waiting one"
    );
    // GPUs to a job without GPUs: refused.
    let plain = submit_gpu_job(&mut s, "plain", 0, 0);
    assert!(matches!(
        place_gpu(&mut s, &plain, "w2", &["GPU-c"]),
        Response::Rejected { .. }
    ));
    // Cancelling frees the share.
    apply(
        &mut s,
        Command::CancelJob {
            job_id: halves[0].clone(),
            at_ms: 5,
        },
    );
    assert_eq!(s.gpus_used(None).get("GPU-b"), Some(&500));
}

#[test]
fn gpu_specs_are_validated() {
    let ok = JobSpec {
        gpus_per_rank: 1,
        gpu_memory_permille: 500,
        ..spec(1)
    };
    assert_eq!(ok.validate(8), Ok(()));
    for (gpus_per_rank, gpu_memory_permille) in [(2, 500), (0, 500), (1, 1000), (65, 0)] {
        let bad = JobSpec {
            gpus_per_rank,
            gpu_memory_permille,
            ..spec(1)
        };
        assert!(
            bad.validate(8).is_err(),
            "{gpus_per_rank} {gpu_memory_permille}"
        );
    }
}

#[test]
fn pending_reasons_say_what_is_missing() {
    let mut s = ClusterState::default();
    register_gpus(&mut s, "w1", vec![gpu(0, "GPU-a")]);
    let big = submit_gpu_job(&mut s, "big", 2, 0);
    let reason = s.pending_reason(&s.jobs[&big]).expect("a reason");
    assert!(
        reason.contains("cannot be placed") && reason.contains("1 GPUs in all"),
        "{reason}"
    );
    let one = submit_gpu_job(&mut s, "one", 1, 0);
    assert_eq!(s.pending_reason(&s.jobs[&one]), None, "it fits now");
    assert_eq!(place_gpu(&mut s, &one, "w1", &["GPU-a"]), Response::Ok);
    let two = submit_gpu_job(&mut s, "two", 1, 0);
    let reason = s.pending_reason(&s.jobs[&two]).expect("a reason");
    assert!(reason.contains("waiting for GPUs"), "{reason}");
    let cpu = apply(
        &mut s,
        Command::SubmitJob {
            owner: String::new(),
            request_id: "cpu".into(),
            spec: spec(9),
            shards: vec![],
            submitted_at_ms: 0,
        },
    );
    let Response::JobSubmitted { job_id, .. } = cpu else {
        panic!()
    };
    let reason = s.pending_reason(&s.jobs[&job_id]).expect("a reason");
    assert!(
        reason.contains("needs 9 slots") && reason.contains("offer 4 in all"),
        "{reason}"
    );
}

#[test]
fn the_planners_larger_than_the_cluster_test_agrees_with_the_outlook() {
    let mut s = ClusterState::default();
    // No worker at all: every job is larger than the cluster.
    assert!(s.alive_totals().never_fits(&spec(1)));
    register_gpus(&mut s, "w1", vec![gpu(0, "GPU-a"), gpu(1, "GPU-b")]);
    let one = submit_gpu_job(&mut s, "one", 1, 0);
    assert_eq!(place_gpu(&mut s, &one, "w1", &["GPU-a"]), Response::Ok);
    let specs = [
        spec(1),
        spec(4),
        spec(5),
        JobSpec {
            gpus_per_rank: 2,
            ..spec(1)
        },
        JobSpec {
            gpus_per_rank: 3,
            ..spec(1)
        },
        JobSpec {
            gpus_per_rank: 1,
            gpu_memory_permille: 500,
            ..spec(4)
        },
        JobSpec {
            gpus_per_rank: 1,
            ..spec(3)
        },
    ];
    let totals = s.alive_totals();
    let mut never = Vec::new();
    for spec in &specs {
        let outlook = s.capacity_outlook(spec);
        assert_eq!(
            totals.never_fits(spec),
            matches!(outlook, Outlook::Never(_)),
            "{spec:?}: {outlook:?}"
        );
        never.push(totals.never_fits(spec));
    }
    // 4 slots and 2 GPUs in all, one GPU busy: only "busy now" is not "never".
    assert_eq!(never, [false, false, true, false, true, false, true]);
}

/// The coordinator's rule for users' certificates (`auth::issued_after_creation`) reads
/// `UserRecord::created_at_ms`, taken from `CreateUser`'s `at_ms`: both have been there
/// since users exist, so log entries and snapshots written then (JSON; MessagePack maps
/// with field names) carry it, and a re-created user's record has the new time.
#[test]
fn users_creation_times_read_from_entries_and_snapshots_written_before() {
    let digest = "ab".repeat(32);
    let entry = format!(
        r#"{{"CreateUser":{{"name":"alice","role":"submit","secret_sha256":"{digest}","created_by":"admin","at_ms":1800000000000}}}}"#
    );
    let cmd: Command = crate::codec::decode(entry.as_bytes()).expect("a JSON entry");
    assert_eq!(
        crate::codec::decode::<Command>(&crate::codec::encode(&cmd).expect("encode"))
            .expect("MessagePack"),
        cmd
    );
    let mut s = ClusterState::default();
    assert_eq!(apply(&mut s, cmd), Response::Ok);
    assert_eq!(s.users["alice"].created_at_ms, 1_800_000_000_000);

    let snapshot = format!(
        r#"{{"next_job_seq":1,"jobs":{{}},"request_ids":{{}},"workers":{{}},"users":{{"alice":{{"name":"alice","role":"read","secret_sha256":"{digest}","created_by":"admin","created_at_ms":1700000000000}}}}}}"#
    );
    let back: ClusterState = crate::codec::decode(snapshot.as_bytes()).expect("a JSON snapshot");
    assert_eq!(back.users["alice"].created_at_ms, 1_700_000_000_000);
    assert_eq!(back.users["alice"].role, cumulus_api::Role::Read);
    let packed: ClusterState =
        crate::codec::decode(&crate::codec::encode(&back).expect("encode")).expect("MessagePack");
    assert_eq!(packed.users, back.users);

    // Revoked and created again: the record holds the second creation's time.
    let mut s = back;
    assert_eq!(
        apply(
            &mut s,
            Command::RevokeUser {
                name: "alice".into()
            }
        ),
        Response::Ok
    );
    let again = Command::CreateUser {
        name: "alice".into(),
        role: cumulus_api::Role::Submit,
        secret_sha256: digest,
        created_by: "admin".into(),
        at_ms: 1_800_000_000_000,
    };
    assert_eq!(apply(&mut s, again), Response::Ok);
    assert_eq!(s.users["alice"].created_at_ms, 1_800_000_000_000);
}

#[test]
fn users_are_created_once_revoked_and_kept_in_snapshots() {
    let mut s = ClusterState::default();
    let create = |name: &str, digest: &str| Command::CreateUser {
        name: name.into(),
        role: cumulus_api::Role::Submit,
        secret_sha256: digest.into(),
        created_by: "admin".into(),
        at_ms: 7,
    };
    let digest = "ab".repeat(32);
    assert_eq!(apply(&mut s, create("alice", &digest)), Response::Ok);
    for bad in [
        create("alice", &digest),        // exists
        create("admin", &digest),        // reserved
        create("Bob", &digest),          // not a user name
        create("bob", "AB"),             // not a digest
        create("bob", &"AB".repeat(32)), // upper case
    ] {
        assert!(
            matches!(apply(&mut s, bad.clone()), Response::Rejected { .. }),
            "{bad:?}"
        );
    }
    // A snapshot (the serialized state) keeps them.
    let json = serde_json::to_string(&s).expect("encode");
    let back: ClusterState = serde_json::from_str(&json).expect("decode");
    assert_eq!(back.users, s.users);
    assert_eq!(s.users["alice"].created_at_ms, 7);
    assert_eq!(
        apply(
            &mut s,
            Command::RevokeUser {
                name: "alice".into()
            }
        ),
        Response::Ok
    );
    assert!(matches!(
        apply(
            &mut s,
            Command::RevokeUser {
                name: "alice".into()
            }
        ),
        Response::Rejected { .. }
    ));
    // A state written before users existed decodes with none.
    let mut old: serde_json::Value = serde_json::from_str(&json).expect("json");
    old.as_object_mut().expect("object").remove("users");
    let back: ClusterState = serde_json::from_value(old).expect("decode old");
    assert!(back.users.is_empty());
}

fn started(s: &mut ClusterState, job_id: &str, rank: u32, attempt: u32, worker: &str) {
    let r = apply(
        s,
        Command::RankStarted {
            job_id: job_id.into(),
            rank,
            attempt,
            worker_id: worker.into(),
            pid: 10 + rank,
            at_ms: 4,
        },
    );
    assert_eq!(r, Response::Ok);
}

fn commit_step(s: &mut ClusterState, job_id: &str, attempt: u32, step: u64, world_size: u32) {
    for rank in 0..world_size {
        let r = apply(
            s,
            Command::CheckpointPartCommitted {
                job_id: job_id.into(),
                step,
                part: part(rank, attempt, step),
            },
        );
        assert_eq!(r, Response::Ok);
    }
    let r = apply(
        s,
        Command::CheckpointCommitted {
            job_id: job_id.into(),
            step,
            at_ms: 5,
        },
    );
    assert_eq!(r, Response::Ok);
}

#[test]
fn a_pause_stops_the_ranks_then_parks_the_job_and_a_resume_queues_it_from_its_step() {
    let (mut s, job) = cluster_with_job(2);
    started(&mut s, &job, 0, 0, "w1");
    started(&mut s, &job, 1, 0, "w2");
    commit_step(&mut s, &job, 0, 10, 2);
    let pause = |at_ms| Command::PauseJob {
        job_id: job.clone(),
        at_ms,
    };
    assert_eq!(apply(&mut s, pause(50)), Response::Ok);
    assert_eq!(
        s.jobs[&job].state,
        JobState::Running,
        "running until its ranks stop"
    );
    assert_eq!(
        s.jobs[&job].stop.as_ref().map(|r| r.action),
        Some(StopAction::Pause)
    );
    // One pause at a time; a resume waits for the pause to complete.
    assert!(matches!(
        apply(&mut s, pause(51)),
        Response::Rejected { .. }
    ));
    let resume = |at_ms| Command::ResumeJob {
        job_id: job.clone(),
        at_ms,
    };
    let r = apply(&mut s, resume(52));
    assert!(
        matches!(&r, Response::Rejected { reason } if reason.contains("still pausing")),
        "{r:?}"
    );
    // The ranks checkpoint at step 20 and exit 0; a failure is not restarted meanwhile.
    commit_step(&mut s, &job, 0, 20, 2);
    assert_eq!(apply(&mut s, exit(&job, 0, 0, "w1", 0)), Response::Ok);
    let stopped = Command::JobStopped {
        job_id: job.clone(),
        at_ms: 103,
    };
    let r = apply(&mut s, stopped.clone());
    assert!(
        matches!(&r, Response::Rejected { reason } if reason.contains("still runs")),
        "{r:?}"
    );
    assert_eq!(apply(&mut s, exit(&job, 1, 0, "w2", 1)), Response::Ok);
    let restart = Command::ScheduleRestart {
        job_id: job.clone(),
        placements: vec![(0, "w1".into()), (1, "w2".into())],
        gpus: Vec::new(),
        failed_at_ms: 100,
        delay_ms: 10_000,
        cause: "x".into(),
        resume_step: Some(20),
        agent_fault: false,
        in_process: Vec::new(),
        path_reason: String::new(),
    };
    assert!(matches!(apply(&mut s, restart), Response::Rejected { .. }));
    assert_eq!(apply(&mut s, stopped), Response::Ok);
    let j = &s.jobs[&job];
    assert_eq!(j.state, JobState::Paused);
    assert_eq!(j.stop, None);
    assert_eq!(j.restarts_used, 0, "a pause spends no restart budget");
    assert_eq!(j.running_ms, 100, "placed at 3, stopped at 103");
    assert_eq!(j.running_ms_at(10_000), 100, "paused time is not counted");
    assert_eq!(j.paused_ms_at(150), 47, "paused at 103");
    for r in &j.ranks {
        assert_eq!(
            (r.state, r.attempt, r.worker_id.as_deref()),
            (RankState::Unplaced, 1, None)
        );
        assert_eq!(r.resume_step, Some(20));
        assert_eq!(r.resume_dir, part(r.rank, 0, 20).dir);
    }
    assert!(s.slots_used(None).values().all(|n| *n == 0), "no slot held");
    assert!(s.job_index().paused.contains(&job));
    assert_index_current(&s);
    // Resume: queued again, placed like a new job, on other workers if need be.
    assert_eq!(apply(&mut s, resume(200)), Response::Ok);
    assert_eq!(s.jobs[&job].state, JobState::Pending);
    assert_eq!(
        s.jobs[&job].paused_ms_at(10_000),
        97,
        "paused from 103 to 200"
    );
    assert!(matches!(
        apply(&mut s, resume(201)),
        Response::Rejected { .. }
    ));
    let place = Command::PlaceJob {
        job_id: job.clone(),
        placements: vec![(0, "w2".into()), (1, "w2".into())],
        gpus: Vec::new(),
        at_ms: 300,
    };
    assert_eq!(apply(&mut s, place), Response::Ok);
    let j = &s.jobs[&job];
    assert_eq!(j.state, JobState::Running);
    assert_eq!(j.running_ms_at(350), 150);
    assert!(
        j.ranks
            .iter()
            .all(|r| r.attempt == 1 && r.state == RankState::Pending)
    );
    assert_index_current(&s);
}

#[test]
fn a_pending_job_is_parked_at_once_and_a_paused_job_can_be_cancelled() {
    let mut s = ClusterState::default();
    let Response::JobSubmitted { job_id: job, .. } = apply(
        &mut s,
        Command::SubmitJob {
            owner: String::new(),
            request_id: "r".into(),
            spec: spec(2),
            shards: vec![],
            submitted_at_ms: 1,
        },
    ) else {
        panic!()
    };
    let pause = Command::PauseJob {
        job_id: job.clone(),
        at_ms: 2,
    };
    assert_eq!(apply(&mut s, pause.clone()), Response::Ok);
    assert_eq!(s.jobs[&job].state, JobState::Paused);
    let r = apply(&mut s, pause);
    assert!(
        matches!(&r, Response::Rejected { reason } if reason.contains("already paused")),
        "{r:?}"
    );
    assert_eq!(
        s.jobs[&job].ranks.iter().map(|r| r.attempt).max(),
        Some(0),
        "an attempt that never ran keeps its number"
    );
    let cancel = Command::CancelJob {
        job_id: job.clone(),
        at_ms: 3,
    };
    assert_eq!(apply(&mut s, cancel), Response::Ok);
    assert_eq!(s.jobs[&job].state, JobState::Cancelled);
    assert_index_current(&s);
}

#[test]
fn a_time_limit_stop_ends_the_job_timed_out_and_only_the_leader_kinds_are_requested() {
    let (mut s, job) = cluster_with_job(1);
    started(&mut s, &job, 0, 0, "w1");
    let request = |action| Command::RequestStop {
        job_id: job.clone(),
        action,
        at_ms: 40,
    };
    for action in [StopAction::Stop, StopAction::Pause] {
        assert!(matches!(
            apply(&mut s, request(action)),
            Response::Rejected { .. }
        ));
    }
    assert_eq!(apply(&mut s, request(StopAction::TimeLimit)), Response::Ok);
    assert!(matches!(
        apply(&mut s, request(StopAction::Preempt)),
        Response::Rejected { .. }
    ));
    // A user's pause cannot overtake the stop in flight.
    assert!(matches!(
        apply(
            &mut s,
            Command::PauseJob {
                job_id: job.clone(),
                at_ms: 41
            }
        ),
        Response::Rejected { .. }
    ));
    commit_step(&mut s, &job, 0, 7, 1);
    assert_eq!(apply(&mut s, exit(&job, 0, 0, "w1", 0)), Response::Ok);
    assert_eq!(
        apply(
            &mut s,
            Command::JobStopped {
                job_id: job.clone(),
                at_ms: 103
            }
        ),
        Response::Ok
    );
    let j = &s.jobs[&job];
    assert_eq!(j.state, JobState::TimedOut);
    assert!(j.state.is_terminal());
    assert_eq!(j.finished_at_ms, 103);
    assert_eq!(j.committed_step, Some(7));
    assert!(
        j.failure_cause
            .as_deref()
            .is_some_and(|c| c.contains("time limit") && c.contains('7')),
        "{:?}",
        j.failure_cause
    );
    assert_index_current(&s);
}

#[test]
fn a_preempted_job_is_queued_again_with_its_ranks_from_the_committed_step() {
    let (mut s, job) = cluster_with_job(2);
    started(&mut s, &job, 0, 0, "w1");
    commit_step(&mut s, &job, 0, 3, 2);
    assert_eq!(
        apply(
            &mut s,
            Command::RequestStop {
                job_id: job.clone(),
                action: StopAction::Preempt,
                at_ms: 10,
            }
        ),
        Response::Ok
    );
    // Rank 1 never started (its attempt was pending): it does not hold the stop up.
    assert_eq!(apply(&mut s, exit(&job, 0, 0, "w1", 0)), Response::Ok);
    let r = apply(
        &mut s,
        Command::JobStopped {
            job_id: job.clone(),
            at_ms: 20,
        },
    );
    assert_eq!(r, Response::Ok);
    let j = &s.jobs[&job];
    assert_eq!(j.state, JobState::Pending);
    assert!(
        j.ranks
            .iter()
            .all(|r| r.attempt == 1 && r.resume_step == Some(3))
    );
    assert_index_current(&s);
}

#[test]
fn time_limits_are_validated() {
    let limited = |time_limit_ms, signal_before_ms| JobSpec {
        time_limit_ms,
        signal_before_ms,
        ..spec(1)
    };
    assert!(limited(60_000, 5_000).validate(8).is_ok());
    assert!(limited(0, 0).validate(8).is_ok());
    assert!(limited(5_000, 5_000).validate(8).is_err());
    assert!(limited(0, 1).validate(8).is_err());
    assert!(limited(MAX_TIME_LIMIT_MS + 1, 0).validate(8).is_err());
}

#[test]
fn startup_timeouts_are_validated_and_default_with_hang_detection() {
    let timed = |progress_timeout_ms, startup_timeout_ms| JobSpec {
        progress_timeout_ms,
        startup_timeout_ms,
        ..spec(1)
    };
    assert_eq!(
        timed(0, 0).effective_startup_timeout_ms(),
        0,
        "no hang detection"
    );
    assert_eq!(
        timed(5_000, 0).effective_startup_timeout_ms(),
        DEFAULT_STARTUP_TIMEOUT_MS
    );
    assert_eq!(timed(5_000, 30_000).effective_startup_timeout_ms(), 30_000);
    assert_eq!(timed(0, 30_000).effective_startup_timeout_ms(), 30_000);
    assert!(timed(0, MAX_STARTUP_TIMEOUT_MS).validate(8).is_ok());
    let err = timed(0, MAX_STARTUP_TIMEOUT_MS + 1)
        .validate(8)
        .expect_err("above 7 days");
    assert!(err.to_string().contains("startup timeout"), "{err}");
    // A spec stored before the field existed reads back with the default.
    let mut json = serde_json::to_value(timed(5_000, 0)).expect("json");
    assert!(json.get("startup_timeout_ms").is_none(), "0 is not written");
    json.as_object_mut()
        .expect("object")
        .remove("startup_timeout_ms");
    let back: JobSpec = serde_json::from_value(json).expect("old spec");
    assert_eq!(back.startup_timeout_ms, 0);
}

#[test]
fn warm_spares_are_validated_and_absent_from_old_specs() {
    let warm = |warm_spares, imports: &[&str], command: &[&str]| JobSpec {
        warm_spares,
        warm_imports: imports.iter().map(|m| m.to_string()).collect(),
        ..JobSpec::new(2, command.iter().map(|a| a.to_string()).collect())
    };
    assert!(
        warm(2, &["torch", "numpy"], &["python3", "train.py"])
            .validate(8)
            .is_ok()
    );
    for (bad, field) in [
        (warm(9, &[], &["python3", "train.py"]), "warm_spares"),
        (
            warm(1, &["not a module"], &["python3", "train.py"]),
            "warm_imports",
        ),
        (warm(1, &[], &["bash", "run.sh"]), "warm_spares needs"),
    ] {
        let err = bad.validate(8).expect_err("refused");
        assert!(err.to_string().contains(field), "{err}");
    }
    let json = serde_json::to_value(JobSpec::new(1, vec!["x".into()])).expect("json");
    assert!(json.get("warm_spares").is_none() && json.get("warm_imports").is_none());
    let back: JobSpec = serde_json::from_value(json).expect("old spec");
    assert_eq!((back.warm_spares, back.warm_imports.len()), (0, 0));
}

#[test]
fn only_finished_jobs_are_deleted_with_their_request_id() {
    let (mut s, job) = cluster_with_job(1);
    let delete = Command::DeleteJob {
        job_id: job.clone(),
    };
    let r = apply(&mut s, delete.clone());
    assert!(
        matches!(&r, Response::Rejected { reason } if reason.contains("cancel it before")),
        "{r:?}"
    );
    let cancel = Command::CancelJob {
        job_id: job.clone(),
        at_ms: 9,
    };
    assert_eq!(apply(&mut s, cancel), Response::Ok);
    assert_eq!(apply(&mut s, delete.clone()), Response::Ok);
    assert!(!s.jobs.contains_key(&job));
    assert!(s.request_ids.is_empty(), "the request id goes with it");
    assert!(!s.job_index().terminal.contains(&job));
    assert_index_current(&s);
    assert!(matches!(apply(&mut s, delete), Response::Rejected { .. }));
}

fn submit_fork(s: &mut ClusterState, req: &str, spec: JobSpec) -> Response {
    apply(
        s,
        Command::SubmitJob {
            owner: String::new(),
            request_id: req.into(),
            spec,
            shards: vec![],
            submitted_at_ms: 30,
        },
    )
}

fn fork_spec(world_size: u32, job: &str, step: Option<u64>) -> JobSpec {
    JobSpec {
        resume_from: Some(ResumeFrom {
            job_id: job.into(),
            step,
        }),
        ..spec(world_size)
    }
}

#[test]
fn a_job_resumed_from_another_jobs_step_starts_there_until_it_commits_its_own() {
    let (mut s, source) = cluster_with_job(2);
    started(&mut s, &source, 0, 0, "w1");
    started(&mut s, &source, 1, 0, "w2");
    commit_step(&mut s, &source, 0, 3, 2);
    commit_step(&mut s, &source, 0, 6, 2);

    // What cannot be resumed is refused, with the reason, and changes nothing.
    let before = s.clone();
    for (spec, why) in [
        (
            fork_spec(2, &source, Some(4)),
            "not one of its committed steps (kept: 3, 6)",
        ),
        (fork_spec(3, &source, Some(3)), "world size 2, this job 3"),
        (fork_spec(2, "job-999999", Some(3)), "no such job"),
        (fork_spec(2, &source, None), "no step was named"),
        (
            JobSpec {
                ckpt_dir: "/elsewhere".into(),
                ..fork_spec(2, &source, Some(3))
            },
            "keeps the checkpoint target",
        ),
    ] {
        let r = submit_fork(&mut s, "bad", spec);
        let Response::Rejected { reason } = &r else {
            panic!("{r:?}")
        };
        assert!(reason.contains(why), "{reason}");
    }
    assert_eq!(s, before);
    // A different shard plan is refused too.
    let r = apply(
        &mut s,
        Command::SubmitJob {
            owner: String::new(),
            request_id: "shards".into(),
            spec: fork_spec(2, &source, Some(3)),
            shards: vec!["/data/a".into(), "/data/b".into()],
            submitted_at_ms: 30,
        },
    );
    assert!(
        matches!(&r, Response::Rejected { reason } if reason.contains("shard plan differs")),
        "{r:?}"
    );

    let Response::JobSubmitted { job_id: fork, .. } =
        submit_fork(&mut s, "fork", fork_spec(2, &source, Some(3)))
    else {
        panic!()
    };
    let j = &s.jobs[&fork];
    for r in &j.ranks {
        assert_eq!(r.resume_step, Some(3));
        assert_eq!(r.resume_job_id, source);
        assert_eq!(
            r.resume_dir,
            s.jobs[&source].committed[&3][r.rank as usize].dir
        );
    }
    assert_eq!(s.fork_references(&source), vec![(fork.clone(), 3)]);
    assert_eq!(s.jobs[&source].kept_steps([3, 1]), vec![1, 3, 6]);
    assert_index_current(&s);

    // A restart before the fork commits anything of its own resumes from the fork point.
    let placements: Vec<(u32, String)> = vec![(0, "w1".into()), (1, "w2".into())];
    let r = apply(
        &mut s,
        Command::PlaceJob {
            gpus: Vec::new(),
            job_id: fork.clone(),
            placements: placements.clone(),
            at_ms: 31,
        },
    );
    assert_eq!(r, Response::Ok);
    started(&mut s, &fork, 0, 0, "w1");
    assert_eq!(apply(&mut s, exit(&fork, 0, 0, "w1", 1)), Response::Ok);
    let r = apply(
        &mut s,
        Command::ScheduleRestart {
            job_id: fork.clone(),
            placements: placements.clone(),
            gpus: Vec::new(),
            failed_at_ms: 100,
            delay_ms: 10_000,
            cause: "rank 0 exited 1".into(),
            resume_step: None,
            agent_fault: false,
            in_process: Vec::new(),
            path_reason: String::new(),
        },
    );
    assert_eq!(r, Response::Ok, "{r:?}");
    let j = &s.jobs[&fork];
    assert!(
        j.ranks
            .iter()
            .all(|r| r.attempt == 1 && r.resume_step == Some(3) && r.resume_job_id == source)
    );

    // Once it commits a step of its own, it resumes from its own steps and no longer
    // holds the source's step.
    started(&mut s, &fork, 0, 1, "w1");
    started(&mut s, &fork, 1, 1, "w2");
    commit_step(&mut s, &fork, 1, 5, 2);
    assert!(s.fork_references(&source).is_empty());
    let j = &s.jobs[&fork];
    let own = j.resume_point(Some(5), 1);
    assert_eq!(own.job_id, "");
    assert_eq!(own.dir, j.committed[&5][1].dir);
    assert_eq!(j.resume_point(None, 1).job_id, source);
}
