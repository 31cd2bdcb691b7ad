//! The planner's part in straggler handling: a verdict becomes one flag per attempt with
//! the job's action; a restarted straggler moves to another worker with room; a job's
//! avoided workers are left out of its later placements while others have room.

use std::collections::BTreeSet;

use cumulus_api::AttemptKey;
use cumulus_raft_store::state::{
    ClusterState, JobSpec, RankState, RestartPolicy, RestartScope, StragglerAction, StragglerPolicy,
};
use cumulus_raft_store::{Command, Response};

use super::*;

fn apply(s: &mut ClusterState, cmd: &Command) -> Response {
    s.apply(cmd, &mut BTreeSet::new())
}

/// Workers `w1`, `w2`, `w3` of two slots; a 2-rank job with `action` (rank scope) whose
/// ranks run on `w1` and `w2`.
fn running(action: StragglerAction) -> (ClusterState, String) {
    let mut s = ClusterState::default();
    for w in ["w1", "w2", "w3"] {
        let r = apply(
            &mut s,
            &Command::RegisterWorker {
                worker_id: w.into(),
                host: "h".into(),
                http_addr: "h:1".into(),
                slots: 2,
                gpus: Vec::new(),
                at_ms: 0,
            },
        );
        assert_eq!(r, Response::Ok);
    }
    let spec = JobSpec {
        straggler: StragglerPolicy {
            action,
            ..StragglerPolicy::default()
        },
        restart: RestartPolicy {
            scope: RestartScope::Rank,
            ..RestartPolicy::default()
        },
        ..JobSpec::new(2, vec!["x".into()])
    };
    let Response::JobSubmitted { job_id, .. } = apply(
        &mut s,
        &Command::SubmitJob {
            request_id: "r".into(),
            spec,
            shards: Vec::new(),
            submitted_at_ms: 0,
            owner: String::new(),
        },
    ) else {
        panic!("submit refused")
    };
    let placements = vec![(0, "w1".to_string()), (1, "w2".to_string())];
    let place = Command::PlaceJob {
        job_id: job_id.clone(),
        placements: placements.clone(),
        gpus: Vec::new(),
        at_ms: 1,
    };
    assert_eq!(apply(&mut s, &place), Response::Ok);
    for (rank, w) in placements {
        let started = Command::RankStarted {
            job_id: job_id.clone(),
            rank,
            attempt: 0,
            worker_id: w,
            pid: 10 + rank,
            at_ms: 2,
        };
        assert_eq!(apply(&mut s, &started), Response::Ok);
    }
    (s, job_id)
}

/// Observations at leader time 10 s in which rank 1's attempt 0 is a straggler.
fn slow_rank_1(job_id: &str) -> Observations {
    let mut obs = Observations {
        now_ms: 10_000,
        ..Observations::default()
    };
    obs.stragglers.insert(
        AttemptKey::new(job_id.to_string(), 1, 0),
        straggler::Verdict {
            rank: 1,
            attempt: 0,
            millisteps_per_s: 3_000,
            median_millisteps_per_s: 10_000,
        },
    );
    obs
}

fn plan_once(s: &ClusterState, obs: &Observations) -> Vec<Action> {
    let mut zero = || 0.0;
    plan(s, obs, 60_000, &mut zero)
}

/// Applies the flags among `actions`; returns how many.
fn apply_flags(s: &mut ClusterState, actions: &[Action]) -> usize {
    let mut n = 0;
    for a in actions {
        if let Action::FlagStraggler { job_id, flag } = a {
            let cmd = Command::FlagStraggler {
                job_id: job_id.clone(),
                flag: flag.clone(),
            };
            assert_eq!(apply(s, &cmd), Response::Ok);
            n += 1;
        }
    }
    n
}

#[test]
fn a_straggler_is_flagged_once_per_attempt_with_the_jobs_action() {
    let (mut s, job) = running(StragglerAction::Warn);
    let obs = slow_rank_1(&job);
    let actions = plan_once(&s, &obs);
    assert_eq!(apply_flags(&mut s, &actions), 1, "{actions:?}");
    let flag = &s.jobs[&job].stragglers[0];
    assert_eq!(
        (
            flag.rank,
            flag.attempt,
            flag.worker_id.as_str(),
            flag.action
        ),
        (1, 0, "w2", StragglerAction::Warn)
    );
    // Flagged already: the same verdict plans nothing more.
    let again = plan_once(&s, &obs);
    assert!(
        !again
            .iter()
            .any(|a| matches!(a, Action::FlagStraggler { .. })),
        "{again:?}"
    );
    // A job with detection off is not flagged.
    let (s, job) = running(StragglerAction::Off);
    let actions = plan_once(&s, &slow_rank_1(&job));
    assert!(
        !actions
            .iter()
            .any(|a| matches!(a, Action::FlagStraggler { .. })),
        "{actions:?}"
    );
}

#[test]
fn a_restarted_straggler_moves_to_another_worker_with_room() {
    let (mut s, job) = running(StragglerAction::Restart);
    let actions = plan_once(&s, &slow_rank_1(&job));
    assert_eq!(apply_flags(&mut s, &actions), 1, "{actions:?}");
    assert_eq!(s.jobs[&job].ranks[1].state, RankState::Failed);
    let actions = plan_once(
        &s,
        &Observations {
            now_ms: 10_100,
            ..Observations::default()
        },
    );
    let restart = actions
        .iter()
        .find_map(|a| match a {
            Action::Restart {
                placements, cause, ..
            } => Some((placements.clone(), cause.clone())),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no restart: {actions:?}"));
    assert_eq!(restart.0.len(), 1, "rank scope: rank 1 only");
    assert_eq!(restart.0[0].0, 1);
    assert_ne!(restart.0[0].1, "w2", "away from the straggler's worker");
    assert!(restart.1.contains("straggler"), "{}", restart.1);
}

#[test]
fn avoided_workers_are_used_only_when_no_other_has_room() {
    // w2 is avoided; a group restart of both ranks keeps rank 0 on w1 and moves rank 1
    // to w3 (w1 has a free slot too).
    let (mut s, job) = running(StragglerAction::Exclude);
    let actions = plan_once(&s, &slow_rank_1(&job));
    assert_eq!(apply_flags(&mut s, &actions), 1);
    assert_eq!(s.jobs[&job].avoided_workers, vec!["w2".to_string()]);
    assert_eq!(
        s.jobs[&job].ranks[1].state,
        RankState::Running,
        "exclude: runs on"
    );

    // Preempted and queued again (a stop, then JobStopped): its next placement leaves
    // out w2 while w1 and w3 have room.
    let stop = Command::RequestStop {
        job_id: job.clone(),
        action: cumulus_raft_store::state::StopAction::Preempt,
        at_ms: 20_000,
    };
    assert_eq!(apply(&mut s, &stop), Response::Ok);
    for rank in 0..2 {
        let exited = Command::RankExited {
            job_id: job.clone(),
            rank,
            attempt: 0,
            worker_id: if rank == 0 { "w1" } else { "w2" }.into(),
            exit_code: Some(0),
            signal: None,
            spawn_error: String::new(),
            agent_fault: false,
            agent_evidence: String::new(),
            exec_failed: false,
            step: 0,
            total_steps: 0,
            artifacts: None,
            cause: String::new(),
            at_ms: 20_100,
        };
        assert_eq!(apply(&mut s, &exited), Response::Ok);
    }
    let stopped = Command::JobStopped {
        job_id: job.clone(),
        at_ms: 20_200,
    };
    assert_eq!(apply(&mut s, &stopped), Response::Ok);
    let obs = Observations {
        now_ms: 20_300,
        ..Observations::default()
    };
    let placed = plan_once(&s, &obs)
        .into_iter()
        .find_map(|a| match a {
            Action::Place { placements, .. } => Some(placements),
            _ => None,
        })
        .expect("placed again");
    assert!(placed.iter().all(|(_, w)| w != "w2"), "{placed:?}");

    // With w1 and w3 full, w2 is used after all.
    for (name, w) in [("fill-1", "w1"), ("fill-3", "w3")] {
        let Response::JobSubmitted { job_id, .. } = apply(
            &mut s,
            &Command::SubmitJob {
                request_id: name.into(),
                spec: JobSpec::new(2, vec!["x".into()]),
                shards: Vec::new(),
                submitted_at_ms: 0,
                owner: String::new(),
            },
        ) else {
            panic!("submit refused")
        };
        let place = Command::PlaceJob {
            job_id,
            placements: vec![(0, w.to_string()), (1, w.to_string())],
            gpus: Vec::new(),
            at_ms: 20_250,
        };
        assert_eq!(apply(&mut s, &place), Response::Ok);
    }
    let placed = plan_once(&s, &obs)
        .into_iter()
        .find_map(|a| match a {
            Action::Place {
                job_id, placements, ..
            } if job_id == job => Some(placements),
            _ => None,
        })
        .expect("placed on the avoided worker");
    assert!(placed.iter().all(|(_, w)| w == "w2"), "{placed:?}");
}
