//! The planner's elastic world size ([`JobSpec::min_world_size`]): how many ranks a
//! pending elastic job starts with, when a running one shrinks, and when it grows.
//!
//! - **Start**: a pending elastic job is placed with the most ranks that fit, from its
//!   `world_size` down to its `min_world_size`.
//! - **Shrink**: when a failed rank of a running elastic job cannot be restarted for
//!   lack of room (its worker is gone and no other has a slot), the job continues with
//!   the most ranks that fit, at least its minimum ([`Action::Resize`]), from its newest
//!   committed step. No restart budget is spent: nothing the ranks did caused it.
//! - **Grow**, at most once per [`GROW_INTERVAL_MS`] (no flapping): a running elastic
//!   job below its `world_size`, every rank running, grows to as many ranks as fit when
//!   a checkpoint step was committed since its last resize (the boundary it resumes
//!   from), its last resize is [`GROW_INTERVAL_MS`] old, no job waits in the queue, and
//!   each worker the new ranks would use has been registered for [`GROW_INTERVAL_MS`]
//!   (a worker that comes and goes is not grown onto). The ranks are first asked to
//!   checkpoint and stop ([`Action::RequestGrow`], a preemption's checkpoint-then-stop):
//!   once none runs and the step they took is committed, the job is resized from that
//!   step ([`plan_grown`]), so no step is redone (a rank that stops without committing
//!   leaves the job to resume from its newest commit, as before). When the room is gone
//!   by then, the stop completes as a preemption (the job is queued and placed again
//!   with the ranks that fit).

use cumulus_raft_store::state::JobSpec;

use super::*;

/// Least time between two resizes of a job before it grows, and least time a worker
/// must have been registered before a job grows onto it, in milliseconds.
pub const GROW_INTERVAL_MS: u64 = 20_000;

/// The most ranks of `spec` (ranks `0..n`, `n` from `spec.world_size` down to
/// `spec.min_ranks()`) that fit on `free` (slots) or, for a job with GPUs, the alive
/// workers' GPUs given `used`.
pub(super) fn largest_fit(
    state: &ClusterState,
    obs: &Observations,
    spec: &JobSpec,
    free: &[WorkerSlots],
    used: &Used,
    alive: &dyn Fn(&str) -> bool,
    below: u32,
) -> Option<Placed> {
    let most = spec.world_size.min(below);
    let least = spec.min_ranks();
    if most < least {
        return None;
    }
    match spec.gpu_demand() {
        None => {
            let total: u64 = free.iter().map(|w| u64::from(w.free_slots)).sum();
            let n = most.min(u32::try_from(total).unwrap_or(u32::MAX));
            if n < least {
                return None;
            }
            let ranks: Vec<u32> = (0..n).collect();
            shard_planner::place_ranks(&ranks, free)
                .ok()
                .flatten()
                .map(|p| (p, Vec::new()))
        }
        Some(demand) => {
            let capacity = gpu_capacity(state, obs, alive, used);
            (least..=most).rev().find_map(|n| {
                let ranks: Vec<u32> = (0..n).collect();
                shard_planner::place_gpu_ranks(&ranks, &capacity, demand)
                    .ok()
                    .flatten()
                    .map(split_gpu_plan)
            })
        }
    }
}

/// `used` without the slots and GPUs `job`'s live ranks hold.
fn used_without_job(used: &Used, job: &Job) -> Used {
    let mut out = used.clone();
    let share = job.spec.gpu_share_permille();
    for r in &job.ranks {
        if let (Some(w), RankState::Pending | RankState::Running) = (&r.worker_id, r.state) {
            if let Some(n) = out.slots.get_mut(w) {
                *n = n.saturating_sub(1);
            }
            for g in &r.gpus {
                if let Some(n) = out.gpus.get_mut(g) {
                    *n = n.saturating_sub(share);
                }
            }
        }
    }
    out
}

/// The most ranks of a running `job` (at most `below`, at least its minimum) that fit
/// on the free slots of the workers `alive` accepts once the job's own slots and GPU
/// shares are given back, with the usage without the job (to reserve them in).
fn refit(
    state: &ClusterState,
    job: &Job,
    obs: &Observations,
    used: &Used,
    alive: &dyn Fn(&str) -> bool,
    below: u32,
) -> Option<(Placed, Used)> {
    let mine = used_without_job(used, job);
    let free: Vec<WorkerSlots> = free_workers(state, alive, &mine.slots)
        .into_iter()
        .filter(|w| w.free_slots > 0)
        .collect();
    let placed = largest_fit(state, obs, &job.spec, &free, &mine, alive, below)?;
    Some((placed, mine))
}

/// For a grow: the most ranks of `job` up to its `world_size` that fit (as [`refit`]),
/// reserved in `used`, when that is more ranks than it has now; else `None` and `used`
/// unchanged.
fn reserve_larger(
    state: &ClusterState,
    job: &Job,
    obs: &Observations,
    used: &mut Used,
    alive: &dyn Fn(&str) -> bool,
) -> Option<Placed> {
    let ((placements, gpus), mine) = refit(state, job, obs, used, alive, job.spec.world_size)?;
    if placements.len() <= job.ranks.len() {
        return None;
    }
    *used = mine;
    used.add(&placements, &gpus, job.spec.gpu_share_permille());
    Some((placements, gpus))
}

/// A running elastic `job` whose failed ranks found no room to restart: plans a
/// resize to the most ranks that fit (below its current size, at least its minimum)
/// and returns true; false when even its minimum does not fit (it waits, as a fixed
/// job does).
pub(super) fn plan_shrink(
    state: &ClusterState,
    job: &Job,
    obs: &Observations,
    causes: &str,
    used: &mut Used,
    alive: &dyn Fn(&str) -> bool,
    actions: &mut Vec<Action>,
) -> bool {
    let below = job.world_size().saturating_sub(1);
    let Some(((placements, gpus), mine)) = refit(state, job, obs, used, alive, below) else {
        return false;
    };
    *used = mine;
    used.add(&placements, &gpus, job.spec.gpu_share_permille());
    let cause = truncate(format!(
        "shrink from {} to {} ranks: no room to restart the failed ranks ({causes})",
        job.world_size(),
        placements.len()
    ));
    actions.push(Action::Resize {
        job_id: job.id.clone(),
        placements,
        gpus,
        cause,
    });
    true
}

/// A running elastic `job` below its `world_size` with every rank running: when the
/// module doc's rule allows a grow, asks its ranks to checkpoint and stop first
/// ([`Action::RequestGrow`]) and returns true.
pub(super) fn plan_grow(
    state: &ClusterState,
    job: &Job,
    obs: &Observations,
    used: &mut Used,
    alive: &dyn Fn(&str) -> bool,
    actions: &mut Vec<Action>,
) -> bool {
    if !job.spec.is_elastic()
        || job.world_size() >= job.spec.world_size
        || job.stop.is_some()
        || !job.ranks.iter().all(|r| r.state == RankState::Running)
    {
        return false;
    }
    let (last_at, last_step) = job
        .resizes
        .last()
        .map_or((job.run_started_at_ms, None), |r| (r.at_ms, r.resume_step));
    let committed_since = job.committed_step.is_some() && job.committed_step > last_step;
    if !committed_since || obs.now_ms < last_at.saturating_add(GROW_INTERVAL_MS) {
        return false;
    }
    let index = state.job_index();
    let queued = index
        .queue
        .iter()
        .filter_map(|(_, id)| state.jobs.get(id))
        .any(|j| j.state == JobState::Pending);
    if queued {
        return false;
    }
    let stable = |id: &str| {
        alive(id)
            && state
                .workers
                .get(id)
                .is_some_and(|w| obs.now_ms >= w.registered_at_ms.saturating_add(GROW_INTERVAL_MS))
    };
    let Some((placements, _)) = reserve_larger(state, job, obs, used, &stable) else {
        return false;
    };
    let cause = format!(
        "room for {} ranks (now {}) since committed step {}",
        placements.len(),
        job.world_size(),
        job.committed_step.unwrap_or_default()
    );
    actions.push(Action::RequestGrow {
        job_id: job.id.clone(),
        cause,
    });
    true
}

/// A grow's stop ((`StopRequest::grow`)) has completed: no rank of `job` runs and the
/// step they took on request (if any) is committed. Plans the resize to as many ranks as
/// fit now, from that step, and returns true; false when no more ranks than it had fit
/// any longer (the stop then completes as a preemption).
pub(super) fn plan_grown(
    state: &ClusterState,
    job: &Job,
    obs: &Observations,
    used: &mut Used,
    alive: &dyn Fn(&str) -> bool,
    actions: &mut Vec<Action>,
) -> bool {
    let Some((placements, gpus)) = reserve_larger(state, job, obs, used, alive) else {
        return false;
    };
    let cause = format!(
        "grow from {} to {} ranks: capacity back, the ranks checkpointed first (committed \
         step {})",
        job.world_size(),
        placements.len(),
        job.committed_step.unwrap_or_default()
    );
    actions.push(Action::Resize {
        job_id: job.id.clone(),
        placements,
        gpus,
        cause,
    });
    true
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use cumulus_raft_store::state::PartInfo;
    use cumulus_raft_store::{Command, Response};

    use super::*;

    fn apply(s: &mut ClusterState, cmd: Command) {
        let r = s.apply(&cmd, &mut BTreeSet::new());
        assert!(!matches!(r, Response::Rejected { .. }), "{cmd:?}: {r:?}");
    }

    fn register(s: &mut ClusterState, worker: &str, at_ms: u64) {
        apply(
            s,
            Command::RegisterWorker {
                gpus: Vec::new(),
                worker_id: worker.into(),
                host: "h".into(),
                http_addr: "h:1".into(),
                slots: 2,
                at_ms,
            },
        );
    }

    fn plan_at(s: &ClusterState, now_ms: u64) -> Vec<Action> {
        let obs = Observations {
            now_ms,
            ..Observations::default()
        };
        plan(s, &obs, 5_000, &mut || 0.0)
    }

    /// Starts every rank of the job and commits `step` with a part of each.
    fn start_and_commit(s: &mut ClusterState, job_id: &str, step: u64) {
        start_with_parts(s, job_id, step);
        apply(
            s,
            Command::CheckpointCommitted {
                job_id: job_id.into(),
                step,
                at_ms: 3,
            },
        );
    }

    /// Every rank's current attempt exits 0.
    fn exit_all(s: &mut ClusterState, job_id: &str) {
        let ranks: Vec<(u32, u32, String)> = s.jobs[job_id]
            .ranks
            .iter()
            .map(|r| (r.rank, r.attempt, r.worker_id.clone().expect("placed")))
            .collect();
        for (rank, attempt, worker_id) in ranks {
            apply(
                s,
                Command::RankExited {
                    job_id: job_id.into(),
                    rank,
                    attempt,
                    worker_id,
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
                    at_ms: 4,
                },
            );
        }
    }

    /// Starts every rank of the job (those pending) and records a part of `step` from
    /// each, not committed yet.
    fn start_with_parts(s: &mut ClusterState, job_id: &str, step: u64) {
        let ranks: Vec<(u32, u32, String)> = s.jobs[job_id]
            .ranks
            .iter()
            .map(|r| (r.rank, r.attempt, r.worker_id.clone().expect("placed")))
            .collect();
        for (rank, attempt, worker_id) in &ranks {
            if s.jobs[job_id].ranks[*rank as usize].state == RankState::Pending {
                apply(
                    s,
                    Command::RankStarted {
                        job_id: job_id.into(),
                        rank: *rank,
                        attempt: *attempt,
                        worker_id: worker_id.clone(),
                        pid: 1,
                        at_ms: 2,
                    },
                );
            }
            apply(
                s,
                Command::CheckpointPartCommitted {
                    job_id: job_id.into(),
                    step,
                    part: PartInfo {
                        rank: *rank,
                        attempt: *attempt,
                        dir: format!("step-{step}/rank-{rank}/attempt-{attempt}"),
                        files: vec![],
                        state_json: r#"{"cumulus_data":{"epoch":0,"segment":0,"record":1}}"#.into(),
                    },
                },
            );
        }
    }

    fn resizes(actions: &[Action]) -> Vec<(usize, String)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Resize {
                    placements, cause, ..
                } => Some((placements.len(), cause.clone())),
                _ => None,
            })
            .collect()
    }

    fn commit_resize(s: &mut ClusterState, job_id: &str, actions: &[Action], at_ms: u64) {
        let Some(Action::Resize {
            placements, gpus, ..
        }) = actions.iter().find(|a| matches!(a, Action::Resize { .. }))
        else {
            panic!("no resize in {actions:?}")
        };
        apply(
            s,
            Command::ResizeJob {
                job_id: job_id.into(),
                placements: placements.clone(),
                gpus: gpus.clone(),
                resume_step: s.jobs[job_id].committed_step,
                cause: "test".into(),
                at_ms,
            },
        );
    }

    #[test]
    fn an_elastic_job_shrinks_on_a_lost_worker_and_grows_back_by_the_rule() {
        let mut s = ClusterState::default();
        register(&mut s, "w1", 0);
        let spec = JobSpec {
            min_world_size: 2,
            ckpt_dir: "/ckpt".into(),
            ..JobSpec::new(4, vec!["x".into()])
        };
        let shards: Vec<String> = (0..8).map(|i| format!("/d/s{i}")).collect();
        let r = s.apply(
            &Command::SubmitJob {
                owner: String::new(),
                request_id: "r".into(),
                spec,
                shards,
                submitted_at_ms: 0,
            },
            &mut BTreeSet::new(),
        );
        let Response::JobSubmitted { job_id, .. } = r else {
            panic!("{r:?}")
        };
        // One worker of 2 slots: it starts with the 2 ranks that fit.
        let actions = plan_at(&s, 1);
        let Some(Action::Place { placements, .. }) = actions.first() else {
            panic!("{actions:?}")
        };
        assert_eq!(placements.len(), 2);
        apply(
            &mut s,
            Command::PlaceJob {
                job_id: job_id.clone(),
                placements: placements.clone(),
                gpus: Vec::new(),
                at_ms: 1,
            },
        );
        start_and_commit(&mut s, &job_id, 10);

        // A second worker registers at 1 s: no grow before it is 20 s old, nor before the
        // job's last resize is 20 s old.
        register(&mut s, "w2", 1_000);
        let grows = |actions: &[Action]| {
            actions
                .iter()
                .filter(|a| matches!(a, Action::RequestGrow { .. }))
                .count()
        };
        assert_eq!(grows(&plan_at(&s, 15_000)), 0);
        // The rule allows a grow: the ranks are asked to checkpoint and stop first.
        let actions = plan_at(&s, 21_000);
        assert!(resizes(&actions).is_empty(), "{actions:?}");
        assert_eq!(grows(&actions), 1, "{actions:?}");
        apply(
            &mut s,
            Command::RequestGrow {
                job_id: job_id.clone(),
                at_ms: 21_000,
            },
        );
        let stop = s.jobs[&job_id].stop.clone().expect("a stop in flight");
        assert!(stop.grow && stop.action == StopAction::Preempt, "{stop:?}");
        // They take step 12 and exit 0: it is committed first, then the job grows from it.
        start_with_parts(&mut s, &job_id, 12);
        assert!(resizes(&plan_at(&s, 21_500)).is_empty(), "ranks still run");
        exit_all(&mut s, &job_id);
        let actions = plan_at(&s, 22_000);
        assert!(
            matches!(
                actions.as_slice(),
                [Action::Stopped {
                    finalize: Some(12),
                    ..
                }]
            ),
            "{actions:?}"
        );
        apply(
            &mut s,
            Command::CheckpointCommitted {
                job_id: job_id.clone(),
                step: 12,
                at_ms: 22_100,
            },
        );
        let actions = plan_at(&s, 22_200);
        assert_eq!(resizes(&actions).len(), 1, "{actions:?}");
        assert!(
            resizes(&actions)[0].1.contains("grow from 2 to 4")
                && resizes(&actions)[0].1.contains("step 12"),
            "{actions:?}"
        );
        commit_resize(&mut s, &job_id, &actions, 22_200);
        let job = &s.jobs[&job_id];
        assert_eq!((job.world_size(), job.stop.clone()), (4, None));
        assert_eq!(job.resizes.last().map(|r| r.resume_step), Some(Some(12)));

        // No second grow, and none without a commit since the resize.
        start_and_commit(&mut s, &job_id, 20);
        assert!(resizes(&plan_at(&s, 60_000)).is_empty());

        // w2 is lost: its ranks have no room, the job shrinks to the 2 that fit on w1.
        apply(
            &mut s,
            Command::ExpireWorker {
                worker_id: "w2".into(),
                at_ms: 61_000,
            },
        );
        let actions = plan_at(&s, 61_000);
        let shrink = resizes(&actions);
        assert_eq!(shrink.len(), 1, "{actions:?}");
        assert_eq!(shrink[0].0, 2);
        assert!(
            shrink[0].1.contains("shrink from 4 to 2"),
            "{}",
            shrink[0].1
        );
        commit_resize(&mut s, &job_id, &actions, 61_000);
        let job = &s.jobs[&job_id];
        assert_eq!((job.world_size(), job.restarts_used), (2, 0));
        assert!(
            job.ranks
                .iter()
                .all(|r| r.worker_id.as_deref() == Some("w1"))
        );
    }
}
