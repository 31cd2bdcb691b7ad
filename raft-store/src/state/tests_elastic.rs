//! `ResizeJob` and the elastic `PlaceJob`: bounds, placements, attempts, resume points,
//! and the data plan dealt from the committed step's data positions.

use super::tests::{apply, spec};
use super::*;

/// A cluster of two workers (`slots` each) with an elastic job `min:max` over 8 shards,
/// placed with `placed` ranks (alternating workers).
fn elastic_job(min: u32, max: u32, placed: u32, slots: u32) -> (ClusterState, String) {
    let mut s = ClusterState::default();
    for w in ["w1", "w2"] {
        let r = apply(
            &mut s,
            Command::RegisterWorker {
                gpus: Vec::new(),
                worker_id: w.into(),
                host: "127.0.0.1".into(),
                http_addr: "127.0.0.1:1".into(),
                slots,
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
            spec: JobSpec {
                min_world_size: min,
                ..spec(max)
            },
            shards: (0..8).map(|i| format!("/d/s{i}.csv")).collect(),
            submitted_at_ms: 2,
        },
    );
    let Response::JobSubmitted { job_id, .. } = r else {
        panic!("{r:?}")
    };
    assert_eq!(
        apply(
            &mut s,
            Command::PlaceJob {
                gpus: Vec::new(),
                job_id: job_id.clone(),
                placements: alternating(placed),
                at_ms: 3
            }
        ),
        Response::Ok
    );
    (s, job_id)
}

fn alternating(n: u32) -> Vec<(u32, String)> {
    (0..n)
        .map(|r| (r, if r % 2 == 0 { "w1" } else { "w2" }.to_string()))
        .collect()
}

fn on(worker: &str, n: u32) -> Vec<(u32, String)> {
    (0..n).map(|r| (r, worker.to_string())).collect()
}

/// Commits `step` with one part per current rank, rank `r` at data position
/// `(0, 0, positions[r])` with carry `r`.
fn commit(s: &mut ClusterState, job_id: &str, step: u64, positions: &[u64]) {
    let job = &s.jobs[job_id];
    let attempts: Vec<u32> = job.ranks.iter().map(|r| r.attempt).collect();
    for (rank, attempt) in attempts.into_iter().enumerate() {
        let part = PartInfo {
            rank: rank as u32,
            attempt,
            dir: format!("step-{step:08}/rank-{rank}/attempt-{attempt}"),
            files: vec![],
            state_json: format!(
                r#"{{"cumulus_data":{{"epoch":0,"segment":0,"record":{},"carry":{rank}}}}}"#,
                positions[rank]
            ),
        };
        let r = apply(
            s,
            Command::CheckpointPartCommitted {
                job_id: job_id.into(),
                step,
                part,
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

fn resize(job_id: &str, placements: Vec<(u32, String)>, resume_step: Option<u64>) -> Command {
    Command::ResizeJob {
        job_id: job_id.into(),
        placements,
        gpus: Vec::new(),
        resume_step,
        cause: "test".into(),
        at_ms: 50,
    }
}

#[test]
fn an_elastic_job_starts_with_the_ranks_that_fit() {
    let (s, job_id) = elastic_job(2, 4, 3, 4);
    let job = &s.jobs[&job_id];
    assert_eq!(job.state, JobState::Running);
    assert_eq!(job.world_size(), 3);
    assert_eq!(job.shard_plan.len(), 3);
    assert_eq!(job.resizes.len(), 1);
    assert_eq!((job.resizes[0].from, job.resizes[0].to), (4, 3));
    assert!(job.ranks.iter().all(|r| r.state == RankState::Pending));
    // A job with a fixed world size is never resized.
    let (mut t, fixed) = super::tests::cluster_with_job(2);
    assert!(matches!(
        apply(&mut t, resize(&fixed, on("w1", 1), None)),
        Response::Rejected { .. }
    ));
}

#[test]
fn a_resize_checks_its_bounds_and_placements() {
    let (mut s, job_id) = elastic_job(2, 4, 4, 2);
    for bad in [
        resize(&job_id, on("w1", 1), None),    // below the minimum
        resize(&job_id, alternating(4), None), // the same size
        resize(&job_id, on("w1", 3), None),    // 3 ranks on 2 slots
        resize(&job_id, vec![(0, "w1".into()), (2, "w2".into())], None), // not 0..n
        resize(&job_id, on("w1", 2), Some(7)), // not a committed step
        resize("job-999999", on("w1", 2), None),
    ] {
        let before = s.clone();
        assert!(
            matches!(apply(&mut s, bad.clone()), Response::Rejected { .. }),
            "{bad:?}"
        );
        assert_eq!(s, before, "a refused resize changes nothing: {bad:?}");
    }
    // The job's own ranks' slots count as free: 2 ranks fit on w1 where 2 of its 4 ran.
    assert_eq!(
        apply(&mut s, resize(&job_id, on("w1", 2), None)),
        Response::Ok
    );
}

#[test]
fn a_shrink_then_a_grow_deal_the_unconsumed_records_and_carries() {
    let (mut s, job_id) = elastic_job(2, 4, 4, 4);
    // Every rank of 4 reads 2 shards (s0,s4 / s1,s5 / s2,s6 / s3,s7), 3 records in.
    commit(&mut s, &job_id, 10, &[3, 3, 3, 3]);
    let before: Vec<u32> = s.jobs[&job_id].ranks.iter().map(|r| r.attempt).collect();
    assert_eq!(
        apply(&mut s, resize(&job_id, on("w1", 2), Some(10))),
        Response::Ok
    );
    let job = &s.jobs[&job_id];
    assert_eq!(job.world_size(), 2);
    assert_eq!(job.restarts_used, 0, "no budget spent");
    for (r, a) in job.ranks.iter().zip(&before) {
        assert_eq!(r.attempt, a + 1);
        assert_eq!(r.resume_step, Some(10));
        assert_eq!(
            r.resume_dir,
            format!("step-00000010/rank-{}/attempt-{a}", r.rank)
        );
    }
    let plan = job.data_plan().expect("a plan");
    assert_eq!(plan.from_step, Some(10));
    assert_eq!(
        plan.carry,
        vec![
            vec!["0".to_string(), "2".into()],
            vec!["1".into(), "3".into()]
        ]
    );
    let e0 = &plan.plan.epochs[&0];
    let firsts: Vec<(&str, u64)> = e0[0]
        .iter()
        .map(|s| (s.shard.as_str(), s.first_record))
        .collect();
    assert_eq!(
        firsts,
        vec![
            ("/d/s0.csv", 3),
            ("/d/s1.csv", 3),
            ("/d/s2.csv", 3),
            ("/d/s3.csv", 3)
        ]
    );
    assert_eq!(e0[1].len(), 4);
    assert_eq!(job.shard_plan.len(), 2);
    // The removed ranks' attempts stay findable (their logs).
    for rank in [2, 3] {
        let w = if rank % 2 == 0 { "w1" } else { "w2" };
        assert_eq!(
            job.removed_rank_workers.get(&rank),
            Some(&vec![(before[rank as usize], w.to_string())])
        );
    }

    // At 2 ranks, 1 more record each; then back to 4: ranks 2 and 3 resume from the
    // parts of ranks 0 and 1, with attempt numbers above any rank 2 or 3 ever had.
    commit(&mut s, &job_id, 20, &[1, 1]);
    assert_eq!(
        apply(&mut s, resize(&job_id, alternating(4), Some(20))),
        Response::Ok
    );
    let job = &s.jobs[&job_id];
    assert_eq!(job.world_size(), 4);
    let parts = &job.committed[&20];
    assert_eq!(job.ranks[2].resume_dir, parts[0].dir);
    assert_eq!(job.ranks[3].resume_dir, parts[1].dir);
    assert!(job.ranks[2].attempt > before[2] && job.ranks[3].attempt > before[3]);
    // Ranks 2 and 3 take their old attempts back, before the new ones.
    assert!(job.removed_rank_workers.is_empty());
    assert_eq!(
        job.ranks[2].attempt_workers,
        vec![
            (before[2], "w1".to_string()),
            (job.ranks[2].attempt, "w1".to_string())
        ]
    );
    let plan = job.data_plan().expect("a plan");
    // The plan in force at step 20 was the first resize's: s0 from record 4 now.
    let all: Vec<(String, u64)> = plan.plan.epochs[&0]
        .iter()
        .flatten()
        .map(|s| (s.shard.clone(), s.first_record))
        .collect();
    assert!(all.contains(&("/d/s0.csv".to_string(), 4)), "{all:?}");
    assert_eq!(all.len(), 8);
    assert_eq!(job.resizes.len(), 2);
    // Only the plans a kept step or the current ranks need stay.
    assert!(job.data_plans.len() <= 3);
}

#[test]
fn the_spec_bounds_an_elastic_world_size() {
    let ok = JobSpec {
        min_world_size: 2,
        ..spec(4)
    };
    assert!(ok.validate(MAX_WORLD_SIZE).is_ok());
    assert!(ok.is_elastic() && ok.min_ranks() == 2);
    let same = JobSpec {
        min_world_size: 4,
        ..spec(4)
    };
    assert!(same.validate(MAX_WORLD_SIZE).is_ok() && !same.is_elastic());
    let above = JobSpec {
        min_world_size: 5,
        ..spec(4)
    };
    let e = above.validate(MAX_WORLD_SIZE).unwrap_err();
    assert!(e.to_string().contains("min_world_size 5"), "{e}");
    let fork = JobSpec {
        min_world_size: 2,
        resume_from: Some(ResumeFrom {
            job_id: "job-000001".into(),
            step: None,
        }),
        ..spec(4)
    };
    assert_eq!(fork.validate(MAX_WORLD_SIZE), Err(SpecError::ElasticFork));
}

/// Every rank's current attempt starts (`exit: None`) or exits with `exit`.
fn run_all(s: &mut ClusterState, job_id: &str, exit: Option<i32>) {
    let ranks: Vec<(u32, u32, String)> = s.jobs[job_id]
        .ranks
        .iter()
        .map(|r| (r.rank, r.attempt, r.worker_id.clone().expect("placed")))
        .collect();
    for (rank, attempt, worker_id) in ranks {
        let cmd = match exit {
            None => Command::RankStarted {
                job_id: job_id.into(),
                rank,
                attempt,
                worker_id,
                pid: 100 + rank,
                at_ms: 6,
            },
            Some(code) => Command::RankExited {
                job_id: job_id.into(),
                rank,
                attempt,
                worker_id,
                exit_code: Some(code),
                signal: None,
                spawn_error: String::new(),
                agent_fault: false,
                agent_evidence: String::new(),
                exec_failed: false,
                step: 0,
                total_steps: 0,
                artifacts: None,
                cause: String::new(),
                at_ms: 7,
            },
        };
        assert_eq!(apply(s, cmd), Response::Ok);
    }
}

#[test]
fn a_grow_stop_is_completed_by_the_resize_once_no_rank_runs() {
    let (mut s, job_id) = elastic_job(2, 4, 2, 2);
    run_all(&mut s, &job_id, None);
    commit(&mut s, &job_id, 10, &[1, 1]);
    let grow = Command::RequestGrow {
        job_id: job_id.clone(),
        at_ms: 20,
    };
    assert_eq!(apply(&mut s, grow.clone()), Response::Ok);
    let stop = s.jobs[&job_id].stop.clone().expect("a stop in flight");
    assert!(stop.grow && stop.action == StopAction::Preempt, "{stop:?}");
    assert!(
        matches!(apply(&mut s, grow), Response::Rejected { .. }),
        "one stop at a time"
    );
    // Not while a rank still runs.
    assert!(matches!(
        apply(&mut s, resize(&job_id, alternating(4), Some(10))),
        Response::Rejected { .. }
    ));
    // The ranks took step 20 on request and exited 0: the resize from it ends the stop.
    commit(&mut s, &job_id, 20, &[2, 2]);
    run_all(&mut s, &job_id, Some(0));
    assert_eq!(
        apply(&mut s, resize(&job_id, alternating(4), Some(20))),
        Response::Ok
    );
    let job = &s.jobs[&job_id];
    assert_eq!((job.world_size(), job.stop.clone()), (4, None));
    assert_eq!(job.state, JobState::Running);

    // A job at its most ranks cannot grow; a pause takes over a grow's stop.
    let (mut s, job_id) = elastic_job(2, 4, 4, 2);
    let grow = |id: &str| Command::RequestGrow {
        job_id: id.into(),
        at_ms: 20,
    };
    assert!(matches!(
        apply(&mut s, grow(&job_id)),
        Response::Rejected { .. }
    ));
    let (mut s, job_id) = elastic_job(2, 4, 2, 2);
    run_all(&mut s, &job_id, None);
    assert_eq!(apply(&mut s, grow(&job_id)), Response::Ok);
    assert_eq!(
        apply(
            &mut s,
            Command::PauseJob {
                job_id: job_id.clone(),
                at_ms: 21
            }
        ),
        Response::Ok
    );
    let stop = s.jobs[&job_id].stop.clone().expect("a stop in flight");
    assert!(!stop.grow && stop.action == StopAction::Pause, "{stop:?}");
}
