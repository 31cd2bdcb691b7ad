//! In-process restarts in `apply`: which ranks a `ScheduleRestart` may keep in their
//! processes, and what the restart record and the ranks say afterwards.

use super::tests::{apply, cluster_with_job, exit};
use super::*;

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

fn restart(job_id: &str, placements: &[(u32, &str)], in_process: Vec<u32>) -> Command {
    Command::ScheduleRestart {
        gpus: Vec::new(),
        job_id: job_id.into(),
        placements: placements
            .iter()
            .map(|(r, w)| (*r, w.to_string()))
            .collect(),
        failed_at_ms: 100,
        delay_ms: 2_000, // above the backoff of the first restarts
        cause: "rank 1 attempt 0 was killed by signal 9".into(),
        resume_step: None,
        agent_fault: false,
        in_process,
        path_reason: "ranks [0] keep their processes".into(),
    }
}

/// A running 2-rank job (rank 0 on w1, rank 1 on w2) whose rank 1 exited non-zero.
fn job_with_a_dead_rank() -> (ClusterState, String) {
    let (mut s, job_id) = cluster_with_job(2);
    started(&mut s, &job_id, 0, 0, "w1");
    started(&mut s, &job_id, 1, 0, "w2");
    assert_eq!(apply(&mut s, exit(&job_id, 1, 0, "w2", 1)), Response::Ok);
    (s, job_id)
}

#[test]
fn a_group_restart_keeps_a_running_rank_in_its_process() {
    let (mut s, job_id) = job_with_a_dead_rank();
    let placements = [(0, "w1"), (1, "w2")];
    assert_eq!(
        apply(&mut s, restart(&job_id, &placements, vec![0])),
        Response::Ok
    );
    let job = &s.jobs[&job_id];
    let record = job.restarts.last().expect("recorded");
    assert_eq!(record.path, RestartPath::InProcess);
    assert_eq!(record.in_process_ranks, vec![0]);
    assert_eq!(record.path_reason, "ranks [0] keep their processes");
    // Both ranks get a new attempt (the fence), only rank 0 continues its process.
    assert_eq!(
        job.ranks
            .iter()
            .map(|r| (r.attempt, r.in_process))
            .collect::<Vec<_>>(),
        vec![(1, true), (1, false)]
    );
    assert_eq!(job.restarts_used, 1);
    // The attempt that follows starts clean: a full restart later clears the flag.
    let mut s2 = s.clone();
    started(&mut s2, &job_id, 0, 1, "w1");
    started(&mut s2, &job_id, 1, 1, "w2");
    assert_eq!(apply(&mut s2, exit(&job_id, 0, 1, "w1", 1)), Response::Ok);
    assert_eq!(
        apply(&mut s2, restart(&job_id, &placements, vec![])),
        Response::Ok
    );
    let job = &s2.jobs[&job_id];
    assert!(job.ranks.iter().all(|r| !r.in_process && r.attempt == 2));
    assert_eq!(
        job.restarts.last().expect("recorded").path,
        RestartPath::Full
    );
    // The record survives a round trip (old records without a path read as full).
    let json = serde_json::to_string(&s.jobs[&job_id].restarts).expect("encodes");
    let back: Vec<RestartRecord> = serde_json::from_str(&json).expect("decodes");
    assert_eq!(back, s.jobs[&job_id].restarts);
    let old: RestartRecord = serde_json::from_str(
        r#"{"number":1,"failed_at_ms":1,"delay_ms":1,"not_before_ms":2,"cause":"c","ranks":[0],"resume_step":null}"#,
    )
    .expect("an old record decodes");
    assert_eq!(old.path, RestartPath::Full);
    assert!(old.in_process_ranks.is_empty());
}

#[test]
fn only_live_ranks_staying_on_their_worker_are_kept_and_only_in_group_restarts() {
    let (s, job_id) = job_with_a_dead_rank();
    let refused = |s: &ClusterState, placements: &[(u32, &str)], keep: Vec<u32>| {
        let mut s = s.clone();
        let before = s.jobs[&job_id].clone();
        let r = apply(&mut s, restart(&job_id, placements, keep));
        assert!(matches!(r, Response::Rejected { .. }), "{r:?}");
        assert_eq!(s.jobs[&job_id], before, "a refused restart changes nothing");
    };
    // The dead rank has no process to keep.
    refused(&s, &[(0, "w1"), (1, "w2")], vec![1]);
    // A kept rank must stay on its worker.
    refused(&s, &[(0, "w2"), (1, "w2")], vec![0]);
    // Named twice, or not a rank of the job.
    refused(&s, &[(0, "w1"), (1, "w2")], vec![0, 0]);
    refused(&s, &[(0, "w1"), (1, "w2")], vec![7]);
    // A rank-scoped restart keeps nothing.
    let mut rank_scoped = s.clone();
    let job = std::sync::Arc::make_mut(rank_scoped.jobs.get_mut(&job_id).expect("job"));
    job.spec.restart.scope = RestartScope::Rank;
    refused(&rank_scoped, &[(1, "w2")], vec![1]);
    // A rank the leader failed as hung, its process still there, may be kept.
    let mut hung = s.clone();
    let r = apply(
        &mut hung,
        Command::RankFailed {
            job_id: job_id.clone(),
            rank: 0,
            attempt: 0,
            cause: "hung: no progress for more than 1000 ms".into(),
            at_ms: 50,
        },
    );
    assert_eq!(r, Response::Ok);
    assert_eq!(
        apply(
            &mut hung,
            restart(&job_id, &[(0, "w1"), (1, "w2")], vec![0])
        ),
        Response::Ok
    );
    assert!(hung.jobs[&job_id].ranks[0].in_process);
}
