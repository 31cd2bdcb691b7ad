//! Preemption for and of jobs with GPUs, on fake GPU inventories: the planner alone, with
//! every command applied by the real `apply`.

use std::collections::BTreeSet;

use cumulus_raft_store::state::{ClusterState, GpuDevice, JobSpec, StopAction};
use cumulus_raft_store::{Command, Response};

use super::*;

/// A worker `id` with `slots` slots and `gpus` fake GPUs `GPU-<id>-<i>`.
fn register(s: &mut ClusterState, id: &str, slots: u32, gpus: u32) {
    let gpus = (0..gpus)
        .map(|i| GpuDevice {
            index: i,
            uuid: format!("GPU-{id}-{i}"),
            name: "Fake GPU".into(),
            memory_total_bytes: 80 << 30,
        })
        .collect();
    let r = s.apply(
        &Command::RegisterWorker {
            worker_id: id.into(),
            host: "h".into(),
            http_addr: "h:1".into(),
            slots,
            gpus,
            at_ms: 0,
        },
        &mut BTreeSet::new(),
    );
    assert_eq!(r, Response::Ok);
}

/// Submits a job of `world` ranks with `gpus_per_rank` GPUs each, of `permille` of each
/// (0: whole GPUs), at `priority`, preemptible or not.
fn submit(
    s: &mut ClusterState,
    name: &str,
    world: u32,
    (gpus_per_rank, permille): (u32, u32),
    priority: i32,
    preemptible: bool,
) -> String {
    let spec = JobSpec {
        priority,
        preemptible,
        gpus_per_rank,
        gpu_memory_permille: permille,
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

/// One planning pass: applies its placements and returns the jobs placed and the jobs
/// asked to stop for preemption (not applied).
fn pass(s: &mut ClusterState, obs: &Observations) -> (Vec<String>, Vec<String>) {
    let mut zero = || 0.0;
    let mut placed = Vec::new();
    let mut preempted = Vec::new();
    for a in plan(s, obs, 5_000, &mut zero) {
        match a {
            Action::Place {
                job_id,
                placements,
                gpus,
            } => {
                let r = s.apply(
                    &Command::PlaceJob {
                        job_id: job_id.clone(),
                        placements,
                        gpus,
                        at_ms: 1,
                    },
                    &mut BTreeSet::new(),
                );
                assert_eq!(r, Response::Ok, "{job_id}");
                placed.push(job_id);
            }
            Action::RequestStop {
                job_id,
                action: StopAction::Preempt,
            } => preempted.push(job_id),
            _ => {}
        }
    }
    (placed, preempted)
}

fn quiet() -> Observations {
    Observations {
        now_ms: 1_000,
        ..Observations::default()
    }
}

fn stop(s: &mut ClusterState, job_id: &str) {
    let r = s.apply(
        &Command::RequestStop {
            job_id: job_id.into(),
            action: StopAction::Preempt,
            at_ms: 2,
        },
        &mut BTreeSet::new(),
    );
    assert_eq!(r, Response::Ok);
}

#[test]
fn a_gpu_job_preempts_a_preemptible_gpu_job_of_lower_priority_only() {
    let mut s = ClusterState::default();
    register(&mut s, "g", 4, 1);
    let low = submit(&mut s, "low", 1, (1, 0), 0, true);
    assert_eq!(pass(&mut s, &quiet()).0, vec![low.clone()]);

    // Same priority: it waits; nothing is preempted.
    let same = submit(&mut s, "same", 1, (1, 500), 0, false);
    assert_eq!(pass(&mut s, &quiet()), (vec![], vec![]));
    let cancel = Command::CancelJob {
        job_id: same,
        at_ms: 3,
    };
    assert_eq!(s.apply(&cancel, &mut BTreeSet::new()), Response::Ok);

    // Higher priority, half a GPU: the whole-GPU job gives way.
    let high = submit(&mut s, "high", 1, (1, 500), 5, false);
    assert_eq!(pass(&mut s, &quiet()), (vec![], vec![low.clone()]));
    // Once the stop is in flight, nothing more is asked.
    stop(&mut s, &low);
    assert_eq!(pass(&mut s, &quiet()), (vec![], vec![]));
    let _ = high;

    // A job that is not preemptible is never asked.
    let mut s = ClusterState::default();
    register(&mut s, "g", 4, 1);
    let fixed = submit(&mut s, "fixed", 1, (1, 0), 0, false);
    assert_eq!(pass(&mut s, &quiet()).0, vec![fixed]);
    submit(&mut s, "high", 1, (1, 0), 5, false);
    assert_eq!(pass(&mut s, &quiet()), (vec![], vec![]));
}

#[test]
fn fractional_shares_count_and_the_fewest_jobs_stop() {
    // One GPU shared by two preemptible jobs of 0.4 each (0.2 free).
    let mut s = ClusterState::default();
    register(&mut s, "g", 8, 1);
    let older = submit(&mut s, "older", 1, (1, 400), 0, true);
    let newer = submit(&mut s, "newer", 1, (1, 400), 0, true);
    assert_eq!(pass(&mut s, &quiet()).0.len(), 2);

    // 0.5 needed: the newest one is enough (0.2 + 0.4).
    let half = submit(&mut s, "half", 1, (1, 500), 5, false);
    assert_eq!(pass(&mut s, &quiet()).1, vec![newer.clone()]);
    let cancel = Command::CancelJob {
        job_id: half,
        at_ms: 3,
    };
    assert_eq!(s.apply(&cancel, &mut BTreeSet::new()), Response::Ok);

    // 0.9 needed: both.
    submit(&mut s, "most", 1, (1, 900), 5, false);
    let mut got = pass(&mut s, &quiet()).1;
    got.sort();
    assert_eq!(got, vec![older.clone(), newer.clone()]);

    // A lower-priority victim the other one makes unnecessary is spared: the lowest
    // priority goes first, but a priority-1 job holding a whole GPU alone frees enough.
    let mut s = ClusterState::default();
    register(&mut s, "g", 8, 2);
    let tiny = submit(&mut s, "tiny", 1, (1, 100), -5, true);
    let whole = submit(&mut s, "whole", 1, (1, 0), 1, true);
    assert_eq!(pass(&mut s, &quiet()).0.len(), 2);
    // Two whole GPUs on one rank: neither job alone frees both, so both go.
    submit(&mut s, "pair", 1, (2, 0), 5, false);
    let mut got = pass(&mut s, &quiet()).1;
    got.sort();
    assert_eq!(got, vec![tiny.clone(), whole.clone()]);
    // One whole GPU for a rank: `tiny` (taken first) is dropped again, as `whole`
    // alone frees a GPU; with `tiny` gone alone, 0.9 of a GPU would not do.
    let mut s = ClusterState::default();
    register(&mut s, "g", 8, 2);
    let tiny = submit(&mut s, "tiny", 1, (1, 200), -5, true);
    let whole = submit(&mut s, "whole", 1, (1, 0), 1, true);
    let _fill = submit(&mut s, "fill", 1, (1, 800), 0, false);
    assert_eq!(pass(&mut s, &quiet()).0.len(), 3);
    submit(&mut s, "one", 1, (1, 0), 5, false);
    assert_eq!(pass(&mut s, &quiet()).1, vec![whole]);
    let _ = tiny;
}

#[test]
fn nothing_is_preempted_when_even_every_candidate_would_not_make_room() {
    // Two GPUs: one held by a job that is not preemptible, one by a preemptible job;
    // a rank needing both can never start while the first runs.
    let mut s = ClusterState::default();
    register(&mut s, "g", 4, 2);
    let _fixed = submit(&mut s, "fixed", 1, (1, 0), 0, false);
    let _low = submit(&mut s, "low", 1, (1, 0), 0, true);
    assert_eq!(pass(&mut s, &quiet()).0.len(), 2);
    submit(&mut s, "both", 1, (2, 0), 5, false);
    assert_eq!(pass(&mut s, &quiet()), (vec![], vec![]));
}

#[test]
fn candidates_without_anything_on_a_gpu_worker_and_unhealthy_gpus_are_not_counted() {
    // A CPU worker and a GPU worker; the preemptible CPU job has the lowest priority,
    // but stopping it frees nothing a GPU job can use.
    let mut s = ClusterState::default();
    register(&mut s, "cpu", 4, 0);
    register(&mut s, "g", 1, 1);
    let cpu_job = submit(&mut s, "cpu-job", 4, (0, 0), -9, true);
    let gpu_job = submit(&mut s, "gpu-job", 1, (1, 0), 0, true);
    let (mut placed, _) = pass(&mut s, &quiet());
    placed.sort();
    let mut both = vec![cpu_job.clone(), gpu_job.clone()];
    both.sort();
    assert_eq!(placed, both);
    assert!(
        s.jobs[&cpu_job]
            .ranks
            .iter()
            .all(|r| r.worker_id.as_deref() == Some("cpu"))
    );
    submit(&mut s, "urgent", 1, (1, 0), 5, false);
    assert_eq!(pass(&mut s, &quiet()).1, vec![gpu_job.clone()]);

    // The GPU it would get back is unhealthy: preempting would not make room.
    let mut obs = quiet();
    obs.unhealthy_gpus
        .insert("GPU-g-0".into(), "on worker g: Xid 79".into());
    assert!(pass(&mut s, &obs).1.is_empty());
}

#[test]
fn a_job_without_gpus_may_preempt_a_gpu_job_for_its_slots() {
    let mut s = ClusterState::default();
    register(&mut s, "g", 2, 2);
    let gpu_job = submit(&mut s, "gpu-job", 2, (1, 0), 0, true);
    assert_eq!(pass(&mut s, &quiet()).0, vec![gpu_job.clone()]);
    submit(&mut s, "cpu", 2, (0, 0), 5, false);
    assert_eq!(pass(&mut s, &quiet()).1, vec![gpu_job]);
}
