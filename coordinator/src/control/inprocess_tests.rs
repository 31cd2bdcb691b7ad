//! The path a group restart takes ([`plan::restart_path`]): which live ranks keep their
//! processes (an in-process restart) and why, or why not.

use std::collections::BTreeSet;

use cumulus_api::AttemptKey;
use cumulus_raft_store::Command;
use cumulus_raft_store::state::{ClusterState, RestartScope};

use super::tests::state_with_running_job;
use super::*;

/// A running 2-rank group job whose rank 1 was killed: `(state, job id)`.
fn rank_1_killed() -> (ClusterState, String) {
    let (mut s, job_id) = state_with_running_job(2, RestartScope::Group);
    let w = s.jobs[&job_id].ranks[1].worker_id.clone().expect("placed");
    s.apply(
        &Command::RankExited {
            cause: String::new(),
            step: 0,
            total_steps: 0,
            exec_failed: false,
            artifacts: None,
            job_id: job_id.clone(),
            rank: 1,
            attempt: 0,
            worker_id: w,
            exit_code: None,
            signal: Some(9),
            spawn_error: String::new(),
            at_ms: 50,
            agent_fault: false,
            agent_evidence: String::new(),
        },
        &mut BTreeSet::new(),
    );
    (s, job_id)
}

fn planned(s: &ClusterState, obs: &Observations) -> (Vec<u32>, String) {
    let mut zero = || 0.0;
    let actions = plan(s, obs, 5_000, &mut zero);
    let [
        Action::Restart {
            in_process,
            path_reason,
            ..
        },
    ] = actions.as_slice()
    else {
        panic!("{actions:?}")
    };
    (in_process.clone(), path_reason.clone())
}

#[test]
fn a_listening_rank_that_reported_progress_keeps_its_process() {
    let (s, job_id) = rank_1_killed();
    let key = AttemptKey::new(job_id.clone(), 0, 0);
    let mut obs = Observations::default();
    // Not listening: a full restart, saying so.
    obs.progress_stall_ms.insert(key.clone(), 10);
    let (keep, why) = planned(&s, &obs);
    assert!(keep.is_empty(), "{keep:?}");
    assert!(why.contains("does not run in cumulus.runtime.run"), "{why}");
    // Listening but no progress report in its attempt yet (starting, or recovering from
    // an earlier restart): full.
    let mut recovering = Observations::default();
    recovering.in_process.insert(key.clone());
    let (keep, why) = planned(&s, &recovering);
    assert!(keep.is_empty(), "{keep:?}");
    assert!(why.contains("had not reported progress"), "{why}");
    // Listening and reported: rank 0 keeps its process, rank 1 gets a new one.
    obs.in_process.insert(key);
    let (keep, why) = planned(&s, &obs);
    assert_eq!(keep, vec![0]);
    assert!(
        why.contains("[0] keep") && why.contains("[1] get new"),
        "{why}"
    );
}

#[test]
fn a_rank_scoped_restart_and_a_rank_not_started_are_full() {
    let (mut s, job_id) = rank_1_killed();
    let key = AttemptKey::new(job_id.clone(), 0, 0);
    let mut obs = Observations::default();
    obs.in_process.insert(key.clone());
    obs.progress_stall_ms.insert(key, 10);
    let job = s.jobs.get(&job_id).expect("job").clone();
    let mut scoped = (*job).clone();
    scoped.spec.restart.scope = RestartScope::Rank;
    let (keep, why) = restart_path(&scoped, &obs, &[(1, "w2".into())]);
    assert!(keep.is_empty() && why.contains("scope rank"), "{why}");
    // Rank 0 moving to another worker: full.
    let w0 = job.ranks[0].worker_id.clone().expect("placed");
    let other = if w0 == "w1" { "w2" } else { "w1" };
    let (keep, why) = restart_path(&job, &obs, &[(0, other.into()), (1, w0.clone())]);
    assert!(keep.is_empty() && why.contains("moves"), "{why}");
    // A rank still pending (placed, not started): full.
    let j = std::sync::Arc::make_mut(s.jobs.get_mut(&job_id).expect("job"));
    j.ranks[0].state = cumulus_raft_store::state::RankState::Pending;
    let (keep, why) = planned(&s, &obs);
    assert!(keep.is_empty() && why.contains("had not started"), "{why}");
}
