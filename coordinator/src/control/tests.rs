use std::collections::BTreeSet;

use cumulus_api::AttemptKey;
use cumulus_raft_store::state::{ClusterState, MAX_AGENT_FAULT_RESTARTS, RankState, RestartScope};

use super::*;
use cumulus_raft_store::state::{JobSpec, RestartPolicy, StopAction};
use cumulus_raft_store::{Command, Response};

#[tokio::test]
async fn checkpoint_io_runs_one_task_per_job_off_the_loop_and_remembers_outcomes() {
    let mut memory = LoopMemory::default();
    let (release, gate) = tokio::sync::oneshot::channel::<()>();
    // A slow task (an S3 outage being retried) for job a ...
    memory.spawn_io("a", async move {
        let _ = gate.await;
        IoOutcome::BadStep(7)
    });
    assert!(memory.io_busy("a"));
    // ... does not let a second task of job a start, nor block job b.
    memory.spawn_io("a", async { IoOutcome::LatestOk(1) });
    memory.spawn_io("b", async { IoOutcome::LatestOk(3) });
    assert_eq!(memory.io_jobs.len(), 2);
    let deadline = Instant::now() + Duration::from_secs(30);
    while memory.io_busy("b") {
        assert!(Instant::now() < deadline, "job b's task did not finish");
        tokio::task::yield_now().await;
        memory.reap_io();
    }
    assert_eq!(memory.latest_ok.get("b"), Some(&3));
    assert!(memory.io_busy("a"), "job a's task is still waiting");
    release.send(()).expect("task a waits");
    while memory.io_busy("a") {
        assert!(Instant::now() < deadline, "job a's task did not finish");
        tokio::task::yield_now().await;
        memory.reap_io();
    }
    assert!(memory.bad_steps.contains(&("a".to_string(), 7)));
    assert!(
        !memory.latest_ok.contains_key("a"),
        "the refused task never ran"
    );
    // A panicking task frees its job.
    memory.spawn_io("c", async { panic!("boom") });
    while memory.io_busy("c") {
        assert!(Instant::now() < deadline, "job c's task did not end");
        tokio::task::yield_now().await;
        memory.reap_io();
    }
    // The number of tasks in flight is bounded.
    let mut gates = Vec::new();
    for i in 0..MAX_IO_TASKS + 5 {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        gates.push(tx);
        memory.spawn_io(&format!("j{i}"), async move {
            let _ = rx.await;
            IoOutcome::Done
        });
    }
    assert_eq!(memory.io_jobs.len(), MAX_IO_TASKS);
}

#[test]
fn periodic_io_is_due_at_most_once_per_interval() {
    let mut memory = LoopMemory::default();
    assert!(memory.due("a", IoKind::Latest));
    assert!(!memory.due("a", IoKind::Latest));
    assert!(memory.due("a", IoKind::Mirror), "kinds are independent");
    assert!(memory.due("b", IoKind::Latest), "jobs are independent");
}

pub(super) fn state_with_running_job(
    world_size: u32,
    scope: RestartScope,
) -> (ClusterState, String) {
    let mut s = ClusterState::default();
    let mut d = BTreeSet::new();
    for w in ["w1", "w2"] {
        s.apply(
            &Command::RegisterWorker {
                gpus: Vec::new(),
                worker_id: w.into(),
                host: "h".into(),
                http_addr: "h:1".into(),
                slots: 4,
                at_ms: 0,
            },
            &mut d,
        );
    }
    let spec = JobSpec {
        restart: RestartPolicy {
            scope,
            max_restarts: 1,
            ..RestartPolicy::default()
        },
        progress_timeout_ms: 1_000,
        ..JobSpec::new(world_size, vec!["x".into()])
    };
    let Response::JobSubmitted { job_id, .. } = s.apply(
        &Command::SubmitJob {
            owner: String::new(),
            request_id: "r".into(),
            spec,
            shards: vec![],
            submitted_at_ms: 0,
        },
        &mut d,
    ) else {
        panic!("submit")
    };
    let mut zero = || 0.0;
    let actions = plan(&s, &Observations::default(), 5_000, &mut zero);
    let [Action::Place { placements, .. }] = actions.as_slice() else {
        panic!("{actions:?}")
    };
    // Least-loaded placement alternates workers.
    assert_eq!(
        placements.iter().filter(|(_, w)| w == "w1").count() as u32,
        world_size.div_ceil(2)
    );
    s.apply(
        &Command::PlaceJob {
            gpus: Vec::new(),
            job_id: job_id.clone(),
            placements: placements.clone(),
            at_ms: 1,
        },
        &mut d,
    );
    for r in 0..world_size {
        let w = s.jobs[&job_id].ranks[r as usize]
            .worker_id
            .clone()
            .expect("placed");
        s.apply(
            &Command::RankStarted {
                job_id: job_id.clone(),
                rank: r,
                attempt: 0,
                worker_id: w,
                pid: 1,
                at_ms: 2,
            },
            &mut d,
        );
    }
    (s, job_id)
}

#[test]
fn silent_worker_is_expired_only_after_the_timeout() {
    let (s, _) = state_with_running_job(2, RestartScope::Group);
    let mut zero = || 0.0;
    let mut obs = Observations::default();
    obs.worker_silence_ms.insert("w1".into(), 5_000);
    assert!(plan(&s, &obs, 5_000, &mut zero).is_empty());
    obs.worker_silence_ms.insert("w1".into(), 5_001);
    assert_eq!(
        plan(&s, &obs, 5_000, &mut zero),
        vec![Action::ExpireWorker {
            worker_id: "w1".into()
        }]
    );
}

#[test]
fn group_restart_then_budget_exhaustion() {
    let (mut s, job_id) = state_with_running_job(4, RestartScope::Group);
    let mut d = BTreeSet::new();
    let w = s.jobs[&job_id].ranks[2].worker_id.clone().expect("placed");
    s.apply(
        &Command::RankExited {
            cause: String::new(),
            step: 0,
            total_steps: 0,
            exec_failed: false,
            artifacts: None,
            job_id: job_id.clone(),
            rank: 2,
            attempt: 0,
            worker_id: w,
            exit_code: Some(1),
            signal: None,
            spawn_error: String::new(),
            at_ms: 50,
            agent_fault: false,
            agent_evidence: String::new(),
        },
        &mut d,
    );
    let mut plus = || 1.0;
    let actions = plan(&s, &Observations::default(), 5_000, &mut plus);
    let [
        Action::Restart {
            placements,
            failed_at_ms,
            delay_ms,
            cause,
            ..
        },
    ] = actions.as_slice()
    else {
        panic!("{actions:?}")
    };
    assert_eq!(placements.len(), 4, "group scope restarts every rank");
    assert_eq!((*failed_at_ms, *delay_ms), (50, 600));
    assert!(cause.contains("exited with code 1"), "{cause}");
    let cmd = Command::ScheduleRestart {
        gpus: Vec::new(),
        job_id: job_id.clone(),
        placements: placements.clone(),
        failed_at_ms: 50,
        delay_ms: 600,
        cause: cause.clone(),
        resume_step: None,
        agent_fault: false,
        in_process: Vec::new(),
        path_reason: String::new(),
    };
    assert_eq!(s.apply(&cmd, &mut d), Response::Ok);
    // Second failure: the budget of 1 is used up.
    let w = s.jobs[&job_id].ranks[0].worker_id.clone().expect("placed");
    s.apply(
        &Command::RankStarted {
            job_id: job_id.clone(),
            rank: 0,
            attempt: 1,
            worker_id: w.clone(),
            pid: 9,
            at_ms: 700,
        },
        &mut d,
    );
    s.apply(
        &Command::RankExited {
            cause: String::new(),
            step: 0,
            total_steps: 0,
            exec_failed: false,
            artifacts: None,
            job_id: job_id.clone(),
            rank: 0,
            attempt: 1,
            worker_id: w,
            exit_code: None,
            signal: Some(9),
            spawn_error: String::new(),
            at_ms: 800,
            agent_fault: false,
            agent_evidence: String::new(),
        },
        &mut d,
    );
    let actions = plan(&s, &Observations::default(), 5_000, &mut plus);
    let [Action::FailJob { cause, .. }] = actions.as_slice() else {
        panic!("{actions:?}")
    };
    assert!(
        cause.contains("budget of 1 exhausted") && cause.contains("signal 9"),
        "{cause}"
    );
}

/// An attempt its agent could not start for lack of a resource of its own (here:
/// descriptors) is the worker's failure: the restart spends no budget, even with the
/// budget used up, moves the rank to another worker with room, and is itself bounded
/// by `MAX_AGENT_FAULT_RESTARTS`; a rank's own failure after it spends budget again.
#[test]
fn agent_resource_errors_restart_elsewhere_without_spending_budget() {
    let (mut s, job_id) = state_with_running_job(1, RestartScope::Group);
    let mut d = BTreeSet::new();
    Arc::make_mut(s.jobs.get_mut(&job_id).expect("job")).restarts_used = 1; // budget spent
    let w = s.jobs[&job_id].ranks[0].worker_id.clone().expect("placed");
    let mut attempt = 0;
    let mut agent_fails = |s: &mut ClusterState, attempt: u32, worker: &str| {
        s.apply(
            &Command::RankExited {
                cause: String::new(),
                step: 0,
                total_steps: 0,
                exec_failed: false,
                artifacts: None,
                job_id: job_id.clone(),
                rank: 0,
                attempt,
                worker_id: worker.into(),
                exit_code: None,
                signal: None,
                spawn_error: "cannot create log …: Too many open files (os error 24)".into(),
                agent_fault: true,
                agent_evidence: String::new(),
                at_ms: 50,
            },
            &mut d,
        )
    };
    assert_eq!(agent_fails(&mut s, attempt, &w), Response::Ok);
    let mut zero = || 0.0;
    let actions = plan(&s, &Observations::default(), 5_000, &mut zero);
    let [
        Action::Restart {
            placements,
            delay_ms,
            agent_fault: true,
            cause,
            ..
        },
    ] = actions.as_slice()
    else {
        panic!("{actions:?}")
    };
    assert!(cause.contains("resource error of the agent"), "{cause}");
    assert_ne!(
        placements[0].1, w,
        "moved off the worker that could not start it"
    );
    // Later restarts back off further; a long delay passes every minimum.
    let mut delay = *delay_ms;
    let mut restart = |s: &mut ClusterState, placements: Vec<(u32, String)>, agent_fault| {
        let delay_ms = delay;
        delay = 3_600_000;
        s.apply(
            &Command::ScheduleRestart {
                gpus: Vec::new(),
                job_id: job_id.clone(),
                placements,
                failed_at_ms: 50,
                delay_ms,
                cause: cause.clone(),
                resume_step: None,
                agent_fault,
                in_process: Vec::new(),
                path_reason: String::new(),
            },
            &mut BTreeSet::new(),
        )
    };
    assert_eq!(restart(&mut s, placements.clone(), true), Response::Ok);
    let job = &s.jobs[&job_id];
    assert_eq!((job.restarts_used, job.agent_fault_restarts), (1, 1));
    // Bounded: after MAX_AGENT_FAULT_RESTARTS such restarts the budget rules again.
    for _ in 1..MAX_AGENT_FAULT_RESTARTS {
        attempt += 1;
        let w = s.jobs[&job_id].ranks[0].worker_id.clone().expect("placed");
        assert_eq!(agent_fails(&mut s, attempt, &w), Response::Ok);
        let p = vec![(0, w)];
        assert_eq!(restart(&mut s, p, true), Response::Ok);
    }
    attempt += 1;
    let w = s.jobs[&job_id].ranks[0].worker_id.clone().expect("placed");
    assert_eq!(agent_fails(&mut s, attempt, &w), Response::Ok);
    assert!(matches!(
        restart(&mut s, vec![(0, w.clone())], true),
        Response::Rejected { .. }
    ));
    let actions = plan(&s, &Observations::default(), 5_000, &mut zero);
    assert!(
        matches!(actions.as_slice(), [Action::FailJob { .. }]),
        "{actions:?}"
    );
}

/// A rank that exited with `EXIT_AGENT_UNREACHABLE` (issue 39 item 1) is the agent's
/// fault only when its agent says so with evidence of its own: then the restart spends no
/// budget; a claim without evidence, or evidence with another exit code, spends it.
#[test]
fn an_unreachable_agent_is_its_fault_only_with_its_evidence() {
    let unreachable = cumulus_api::rank_env::EXIT_AGENT_UNREACHABLE;
    for (code, evidence, spends) in [
        (unreachable, "3 connections turned away at capacity", false),
        (unreachable, "", true),
        (1, "3 connections turned away at capacity", true),
    ] {
        let (mut s, job_id) = state_with_running_job(1, RestartScope::Group);
        let w = s.jobs[&job_id].ranks[0].worker_id.clone().expect("placed");
        let exited = Command::RankExited {
            cause: String::new(),
            step: 0,
            total_steps: 0,
            exec_failed: false,
            artifacts: None,
            job_id: job_id.clone(),
            rank: 0,
            attempt: 0,
            worker_id: w,
            exit_code: Some(code),
            signal: None,
            spawn_error: String::new(),
            agent_fault: true,
            agent_evidence: evidence.into(),
            at_ms: 50,
        };
        assert_eq!(s.apply(&exited, &mut BTreeSet::new()), Response::Ok);
        let mut zero = || 0.0;
        let actions = plan(&s, &Observations::default(), 5_000, &mut zero);
        let [
            Action::Restart {
                agent_fault, cause, ..
            },
        ] = actions.as_slice()
        else {
            panic!("{actions:?}")
        };
        assert_eq!(
            *agent_fault, !spends,
            "exit {code}, evidence {evidence:?}: {cause}"
        );
        if spends {
            assert!(
                cause.contains(&format!("exited with code {code}")),
                "{cause}"
            );
        } else {
            assert!(
                cause.contains("could not reach its agent") && cause.contains(evidence),
                "{cause}"
            );
        }
    }
}

#[test]
fn ranks_of_an_expired_worker_move_to_a_live_one() {
    let (mut s, _job_id) = state_with_running_job(4, RestartScope::Group);
    let mut d = BTreeSet::new();
    s.apply(
        &Command::ExpireWorker {
            worker_id: "w2".into(),
            at_ms: 100,
        },
        &mut d,
    );
    let mut zero = || 0.0;
    let actions = plan(&s, &Observations::default(), 5_000, &mut zero);
    let [Action::Restart { placements, .. }] = actions.as_slice() else {
        panic!("{actions:?}")
    };
    assert!(placements.iter().all(|(_, w)| w == "w1"), "{placements:?}");
    assert_eq!(
        placements.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
}

#[test]
fn hung_and_lost_ranks_fail_and_rank_scope_restarts_one() {
    let (s, job_id) = state_with_running_job(2, RestartScope::Rank);
    let mut zero = || 0.0;
    let mut obs = Observations::default();
    obs.progress_stall_ms
        .insert(AttemptKey::new(job_id.clone(), 0, 0), 1_001);
    obs.lost.insert(AttemptKey::new(job_id.clone(), 1, 0));
    let actions = plan(&s, &obs, 5_000, &mut zero);
    assert_eq!(actions.len(), 2);
    assert!(
        matches!(&actions[0], Action::FailRank { rank: 0, cause, .. } if cause.starts_with("hung"))
    );
    assert!(
        matches!(&actions[1], Action::FailRank { rank: 1, cause, .. } if cause.starts_with("lost"))
    );
}

#[test]
fn an_attempt_without_a_first_report_is_judged_by_the_startup_timeout_only() {
    let (mut s, job_id) = state_with_running_job(3, RestartScope::Rank);
    let mut zero = || 0.0;
    let key = |r: u32| AttemptKey::new(job_id.clone(), r, 0);
    let mut obs = Observations::default();
    // Rank 0 started 5 s ago and has not reported: far past the 1 s progress timeout,
    // within the default startup timeout (10 minutes).
    obs.startup_ms.insert(key(0), 5_000);
    // Rank 1 reported, then nothing for 0.9 s: within its progress timeout.
    obs.progress_stall_ms.insert(key(1), 900);
    // Rank 2 has not reported for just over 10 minutes.
    obs.startup_ms
        .insert(key(2), cumulus_api::limits::DEFAULT_STARTUP_TIMEOUT_MS + 1);
    let actions = plan(&s, &obs, 5_000, &mut zero);
    let [Action::FailRank { rank: 2, cause, .. }] = actions.as_slice() else {
        panic!("{actions:?}")
    };
    assert_eq!(
        cause,
        "no first report within 600000 ms of start (startup timeout)"
    );

    // The job's own startup timeout replaces the default.
    Arc::make_mut(s.jobs.get_mut(&job_id).expect("job"))
        .spec
        .startup_timeout_ms = 4_000;
    let actions = plan(&s, &obs, 5_000, &mut zero);
    let ranks: Vec<(u32, &str)> = actions
        .iter()
        .filter_map(|a| match a {
            Action::FailRank { rank, cause, .. } => Some((*rank, cause.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(
        ranks,
        vec![
            (
                0,
                "no first report within 4000 ms of start (startup timeout)"
            ),
            (
                2,
                "no first report within 4000 ms of start (startup timeout)"
            ),
        ]
    );

    // Without a progress timeout or a startup timeout, no attempt is judged at all.
    let job = Arc::make_mut(s.jobs.get_mut(&job_id).expect("job"));
    job.spec.startup_timeout_ms = 0;
    job.spec.progress_timeout_ms = 0;
    assert!(plan(&s, &obs, 5_000, &mut zero).is_empty());
}

#[test]
fn a_lost_pending_attempt_fails_and_a_stalled_one_is_not_hung() {
    let (mut s, job_id) = state_with_running_job(2, RestartScope::Rank);
    for r in &mut Arc::make_mut(s.jobs.get_mut(&job_id).expect("job")).ranks {
        r.state = RankState::Pending; // placed, not started yet
    }
    let mut zero = || 0.0;
    let mut obs = Observations::default();
    // Rank 0 prepares for long (no progress) and is reported: not hung, not lost.
    obs.progress_stall_ms
        .insert(AttemptKey::new(job_id.clone(), 0, 0), 60_000);
    // Rank 1 is neither prepared nor run by its reporting worker.
    obs.lost.insert(AttemptKey::new(job_id.clone(), 1, 0));
    let actions = plan(&s, &obs, 5_000, &mut zero);
    assert_eq!(actions.len(), 1, "{actions:?}");
    assert!(
        matches!(&actions[0], Action::FailRank { rank: 1, attempt: 0, cause, .. } if cause == "lost: its worker neither prepares nor runs it"),
        "{actions:?}"
    );
}

#[test]
fn gang_placement_waits_for_capacity() {
    let mut s = ClusterState::default();
    let mut d = BTreeSet::new();
    s.apply(
        &Command::RegisterWorker {
            gpus: Vec::new(),
            worker_id: "w1".into(),
            host: "h".into(),
            http_addr: "h:1".into(),
            slots: 2,
            at_ms: 0,
        },
        &mut d,
    );
    let spec = JobSpec::new(3, vec!["x".into()]);
    s.apply(
        &Command::SubmitJob {
            owner: String::new(),
            request_id: "r".into(),
            spec,
            shards: vec![],
            submitted_at_ms: 0,
        },
        &mut d,
    );
    let mut zero = || 0.0;
    assert!(plan(&s, &Observations::default(), 5_000, &mut zero).is_empty());
}

/// A cluster of `workers` workers of 4 slots each, and a helper that submits.
fn queue_cluster(workers: u32) -> ClusterState {
    let mut s = ClusterState::default();
    let mut d = BTreeSet::new();
    for i in 0..workers {
        s.apply(
            &Command::RegisterWorker {
                gpus: Vec::new(),
                worker_id: format!("w{i}"),
                host: "h".into(),
                http_addr: "h:1".into(),
                slots: 4,
                at_ms: 0,
            },
            &mut d,
        );
    }
    s
}

fn submit_queued(
    s: &mut ClusterState,
    name: &str,
    world: u32,
    priority: i32,
    limit_ms: u64,
) -> String {
    let spec = JobSpec {
        priority,
        time_limit_ms: limit_ms,
        ..JobSpec::new(world, vec!["x".into()])
    };
    let r = s.apply(
        &Command::SubmitJob {
            owner: String::new(),
            request_id: name.into(),
            spec,
            shards: vec![],
            submitted_at_ms: 0,
        },
        &mut BTreeSet::new(),
    );
    let Response::JobSubmitted { job_id, .. } = r else {
        panic!("{r:?}")
    };
    job_id
}

/// Plans once at leader time `now_ms` and applies every placement; returns the placed
/// jobs in order.
fn place_pass(s: &mut ClusterState, now_ms: u64) -> Vec<String> {
    let obs = Observations {
        now_ms,
        ..Observations::default()
    };
    let mut zero = || 0.0;
    let mut placed = Vec::new();
    for a in plan(s, &obs, 5_000, &mut zero) {
        if let Action::Place {
            job_id,
            placements,
            gpus,
        } = a
        {
            let r = s.apply(
                &Command::PlaceJob {
                    job_id: job_id.clone(),
                    placements,
                    gpus,
                    at_ms: now_ms,
                },
                &mut BTreeSet::new(),
            );
            assert_eq!(r, Response::Ok);
            placed.push(job_id);
        }
    }
    placed
}

#[test]
fn the_queue_places_higher_priority_first_then_submission_order() {
    let mut s = queue_cluster(1);
    let low = submit_queued(&mut s, "low", 2, 0, 0);
    let high = submit_queued(&mut s, "high", 2, 5, 0);
    let high2 = submit_queued(&mut s, "high2", 2, 5, 0);
    // Four slots: the two priority-5 jobs, in submission order; the older low one waits.
    assert_eq!(place_pass(&mut s, 1_000), vec![high, high2]);
    assert_eq!(s.jobs[&low].state, cumulus_api::JobState::Pending);
    let why = s.pending_reason(&s.jobs[&low]).expect("a reason");
    assert!(why.contains("waiting for 2 free slots"), "{why}");
}

#[test]
fn a_wide_job_is_not_starved_by_narrow_ones_and_backfill_never_delays_it() {
    // 8 slots; a 6-slot job holds them without a time limit, another with one.
    let mut s = queue_cluster(2);
    let long = submit_queued(&mut s, "long", 4, 0, 0);
    let short = submit_queued(&mut s, "short", 2, 0, 60_000);
    assert_eq!(place_pass(&mut s, 0), vec![long.clone(), short.clone()]);
    // The wide job needs 6: it waits (2 free). It can start at the latest when `short`
    // reaches its limit (60 s): then 4 are free... not enough; it needs `long` to end,
    // which has no limit: no start can be promised, so nothing passes it.
    let wide = submit_queued(&mut s, "wide", 6, 0, 0);
    let narrow = submit_queued(&mut s, "narrow", 2, 0, 0);
    let narrow_limited = submit_queued(&mut s, "narrow-limited", 2, 0, 1_000);
    assert!(
        place_pass(&mut s, 1_000).is_empty(),
        "nothing passes the wide job"
    );
    let why = s.pending_reason(&s.jobs[&narrow]).expect("a reason");
    assert!(why.contains(&format!("queued behind {wide}")), "{why}");

    // Once `long` is gone, 6 slots are free: the wide job, first in the queue, starts
    // before the narrow ones that came after it.
    let cancel = Command::CancelJob {
        job_id: long,
        at_ms: 1_000,
    };
    assert_eq!(s.apply(&cancel, &mut BTreeSet::new()), Response::Ok);
    assert_eq!(place_pass(&mut s, 1_000), vec![wide]);
    assert!(place_pass(&mut s, 1_000).is_empty());
    for j in [&narrow, &narrow_limited] {
        assert_eq!(s.jobs[j].state, cumulus_api::JobState::Pending, "{j}");
    }
    // A job larger than the whole cluster holds nothing up: it waits for workers.
    let mut s = queue_cluster(1);
    let huge = submit_queued(&mut s, "huge", 5, 9, 0);
    let small = submit_queued(&mut s, "small", 1, 0, 0);
    assert_eq!(place_pass(&mut s, 0), vec![small]);
    assert_eq!(s.jobs[&huge].state, cumulus_api::JobState::Pending);
}

#[test]
fn backfill_takes_only_jobs_that_end_before_the_reserved_start_or_fit_in_spare_slots() {
    // 8 slots: two limited jobs hold 6 (ending in 10 s and 100 s of running time).
    let mut s = queue_cluster(2);
    let a = submit_queued(&mut s, "a", 3, 0, 10_000);
    let b = submit_queued(&mut s, "b", 3, 0, 100_000);
    assert_eq!(place_pass(&mut s, 0), vec![a, b]);
    // The head needs 5: 2 free now, 5 once `a` ends (in 10 s): start reserved at 10 s,
    // no slot to spare then.
    let head = submit_queued(&mut s, "head", 5, 0, 0);
    let too_long = submit_queued(&mut s, "too-long", 1, 0, 20_000);
    let unlimited = submit_queued(&mut s, "unlimited", 1, 0, 0);
    let in_time = submit_queued(&mut s, "in-time", 2, 0, 5_000);
    assert_eq!(place_pass(&mut s, 0), vec![in_time]);
    for j in [&head, &too_long, &unlimited] {
        assert_eq!(s.jobs[j].state, cumulus_api::JobState::Pending, "{j}");
    }

    // A head that needs 4: at its reserved start (10 s) 5 are free, one to spare, which
    // an unlimited 1-slot job may take now; a second may not.
    let mut s = queue_cluster(2);
    let a = submit_queued(&mut s, "a", 3, 0, 10_000);
    let b = submit_queued(&mut s, "b", 3, 0, 100_000);
    assert_eq!(place_pass(&mut s, 0), vec![a, b]);
    let _head = submit_queued(&mut s, "head", 4, 0, 0);
    let spare = submit_queued(&mut s, "spare", 1, 0, 0);
    let _more = submit_queued(&mut s, "more", 1, 0, 0);
    assert_eq!(place_pass(&mut s, 0), vec![spare]);
}

/// The jobs `plan` asks to stop for preemption at `now_ms`.
fn preempted(s: &ClusterState, now_ms: u64) -> Vec<String> {
    let obs = Observations {
        now_ms,
        ..Observations::default()
    };
    let mut zero = || 0.0;
    plan(s, &obs, 5_000, &mut zero)
        .into_iter()
        .filter_map(|a| match a {
            Action::RequestStop {
                job_id,
                action: StopAction::Preempt,
            } => Some(job_id),
            _ => None,
        })
        .collect()
}

fn make_preemptible(s: &mut ClusterState, id: &str) {
    let job = std::sync::Arc::make_mut(s.jobs.get_mut(id).expect("job"));
    job.spec.preemptible = true;
}

#[test]
fn a_higher_priority_job_preempts_lower_priority_preemptible_jobs_newest_first_until_it_fits() {
    // 8 slots, all held: two preemptible jobs of priority 0 (2 and 4 slots), one not
    // preemptible (2 slots).
    let mut s = queue_cluster(2);
    let old_small = submit_queued(&mut s, "old-small", 2, 0, 0);
    let big = submit_queued(&mut s, "big", 4, 0, 0);
    let _fixed = submit_queued(&mut s, "fixed", 2, 0, 0);
    make_preemptible(&mut s, &old_small);
    make_preemptible(&mut s, &big);
    assert_eq!(place_pass(&mut s, 0).len(), 3);

    // A job of the same priority preempts nothing.
    let same = submit_queued(&mut s, "same", 2, 0, 0);
    assert!(preempted(&s, 1_000).is_empty());
    let cancel = Command::CancelJob {
        job_id: same,
        at_ms: 1_000,
    };
    assert_eq!(s.apply(&cancel, &mut BTreeSet::new()), Response::Ok);

    // A priority-5 job of 2: the newest preemptible job goes (one is enough).
    let urgent = submit_queued(&mut s, "urgent", 2, 5, 0);
    assert_eq!(preempted(&s, 1_000), vec![big.clone()]);
    // Once that stop is in flight, nothing more is preempted for it.
    let stop = Command::RequestStop {
        job_id: big.clone(),
        action: StopAction::Preempt,
        at_ms: 1_000,
    };
    assert_eq!(s.apply(&stop, &mut BTreeSet::new()), Response::Ok);
    assert!(preempted(&s, 1_100).is_empty());
    let _ = urgent;

    // A job wider than all the preemptible slots preempts none.
    let mut s = queue_cluster(2);
    let a = submit_queued(&mut s, "a", 4, 0, 0);
    let b = submit_queued(&mut s, "b", 4, 0, 0);
    make_preemptible(&mut s, &a);
    assert_eq!(place_pass(&mut s, 0).len(), 2);
    let _wide = submit_queued(&mut s, "wide", 6, 9, 0);
    assert!(preempted(&s, 1_000).is_empty(), "4 preemptible slots < 6");
    make_preemptible(&mut s, &b);
    let mut got = preempted(&s, 1_000);
    got.sort();
    assert_eq!(got, vec![a, b], "both are needed for 6 slots");
}

/// A job whose ranks all exited 0 right after recording their parts of a step succeeds
/// only after that step is committed: the planner names it with the success.
#[test]
fn success_waits_for_the_last_complete_step() {
    let (mut s, job_id) = state_with_running_job(2, RestartScope::Group);
    std::sync::Arc::make_mut(s.jobs.get_mut(&job_id).expect("job"))
        .spec
        .ckpt_dir = "/ckpt".into();
    let mut d = BTreeSet::new();
    for step in [25, 30] {
        for rank in 0..2 {
            let part = cumulus_raft_store::state::PartInfo {
                rank,
                attempt: 0,
                dir: format!("step-{step:08}/rank-{rank}/attempt-0"),
                files: vec![],
                state_json: "{}".into(),
            };
            let r = s.apply(
                &Command::CheckpointPartCommitted {
                    job_id: job_id.clone(),
                    step,
                    part,
                },
                &mut d,
            );
            assert!(!matches!(r, Response::Rejected { .. }), "{r:?}");
        }
    }
    let r = s.apply(
        &Command::CheckpointCommitted {
            job_id: job_id.clone(),
            step: 25,
            at_ms: 3,
        },
        &mut d,
    );
    assert!(!matches!(r, Response::Rejected { .. }), "{r:?}");
    let mut zero = || 0.0;
    for rank in 0..2 {
        let w = s.jobs[&job_id].ranks[rank as usize]
            .worker_id
            .clone()
            .expect("placed");
        s.apply(
            &Command::RankExited {
                cause: String::new(),
                step: 30,
                total_steps: 30,
                exec_failed: false,
                artifacts: None,
                job_id: job_id.clone(),
                rank,
                attempt: 0,
                worker_id: w,
                exit_code: Some(0),
                signal: None,
                spawn_error: String::new(),
                at_ms: 4,
                agent_fault: false,
                agent_evidence: String::new(),
            },
            &mut d,
        );
    }
    assert_eq!(
        plan(&s, &Observations::default(), 5_000, &mut zero),
        vec![Action::Succeed {
            job_id: job_id.clone(),
            finalize: Some(30),
        }]
    );
    s.apply(
        &Command::CheckpointCommitted {
            job_id: job_id.clone(),
            step: 30,
            at_ms: 5,
        },
        &mut d,
    );
    assert_eq!(
        plan(&s, &Observations::default(), 5_000, &mut zero),
        vec![Action::Succeed {
            job_id,
            finalize: None,
        }]
    );
}

/// The exit of `rank`'s first attempt with `code` at `at_ms`, its agent naming `cause`.
fn exit_with_cause(
    s: &mut ClusterState,
    job_id: &str,
    rank: u32,
    code: i32,
    cause: &str,
    at_ms: u64,
) {
    let w = s.jobs[job_id].ranks[rank as usize]
        .worker_id
        .clone()
        .expect("placed");
    let r = s.apply(
        &Command::RankExited {
            cause: cause.into(),
            step: 0,
            total_steps: 0,
            exec_failed: false,
            artifacts: None,
            job_id: job_id.into(),
            rank,
            attempt: 0,
            worker_id: w,
            exit_code: Some(code),
            signal: None,
            spawn_error: String::new(),
            at_ms,
            agent_fault: false,
            agent_evidence: String::new(),
        },
        &mut BTreeSet::new(),
    );
    assert_eq!(r, Response::Ok);
}

#[test]
fn a_first_attempt_whose_ranks_all_fail_alike_at_once_fails_the_job_without_a_restart() {
    let missing = "python3: can't open file '/w/trian.py': [Errno 2] No such file or directory";
    let (mut s, job_id) = state_with_running_job(2, RestartScope::Group);
    let mut zero = || 0.0;
    let at = |now_ms| Observations {
        now_ms,
        ..Observations::default()
    };
    // Rank 0 failed at once: rank 1 may end the same way, so the planner waits ...
    exit_with_cause(&mut s, &job_id, 0, 2, missing, 50);
    assert_eq!(plan(&s, &at(60), 5_000, &mut zero), vec![]);
    // ... but not past the window (rank 1 still running: an ordinary failure).
    let late = plan(&s, &at(50 + FAIL_FAST_WINDOW_MS), 5_000, &mut zero);
    assert!(
        matches!(late.as_slice(), [Action::Restart { .. }]),
        "{late:?}"
    );
    // A rank that already reported progress ends the wait too.
    let mut reported = at(60);
    reported
        .progress_stall_ms
        .insert(AttemptKey::new(job_id.clone(), 1, 0), 0);
    let early = plan(&s, &reported, 5_000, &mut zero);
    assert!(
        matches!(early.as_slice(), [Action::Restart { .. }]),
        "{early:?}"
    );

    // Every rank the same way: the job fails at once, no restart spent.
    let mut alike = s.clone();
    exit_with_cause(&mut alike, &job_id, 1, 2, missing, 70);
    let actions = plan(&alike, &at(80), 5_000, &mut zero);
    let [Action::FailJob { cause, .. }] = actions.as_slice() else {
        panic!("{actions:?}")
    };
    assert!(
        cause.starts_with(&format!("rank 0 attempt 0 exited with code 2: {missing}")),
        "{cause}"
    );
    assert!(
        cause.contains("all 2 ranks") && cause.contains("--no-fail-fast"),
        "{cause}"
    );

    // Another cause, another exit code, or the job's opt-out: restarted as before.
    let mut other_cause = s.clone();
    exit_with_cause(
        &mut other_cause,
        &job_id,
        1,
        2,
        "RuntimeError: rendezvous failed",
        70,
    );
    let mut other_code = s.clone();
    exit_with_cause(&mut other_code, &job_id, 1, 1, missing, 70);
    let mut opted_out = alike.clone();
    Arc::make_mut(opted_out.jobs.get_mut(&job_id).expect("job"))
        .spec
        .no_fail_fast = true;
    for state in [&other_cause, &other_code, &opted_out] {
        let actions = plan(state, &at(80), 5_000, &mut zero);
        assert!(
            matches!(actions.as_slice(), [Action::Restart { .. }]),
            "{actions:?}"
        );
    }

    // A slow failure (past the window from its start) is not a start failure.
    let (mut slow, slow_id) = state_with_running_job(1, RestartScope::Group);
    exit_with_cause(
        &mut slow,
        &slow_id,
        0,
        2,
        missing,
        2 + FAIL_FAST_WINDOW_MS + 1,
    );
    let actions = plan(&slow, &at(20_000), 5_000, &mut zero);
    assert!(
        matches!(actions.as_slice(), [Action::Restart { .. }]),
        "{actions:?}"
    );
    // Nor is an exit without a cause its agent could tell.
    let (mut silent, silent_id) = state_with_running_job(1, RestartScope::Group);
    exit_with_cause(&mut silent, &silent_id, 0, 2, "", 50);
    let actions = plan(&silent, &at(60), 5_000, &mut zero);
    assert!(
        matches!(actions.as_slice(), [Action::Restart { .. }]),
        "{actions:?}"
    );
}
