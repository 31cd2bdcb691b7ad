//! What the leader observes outside the replicated state: the planner's
//! [`Observations`] built from the soft state, and the soft state kept bounded.

use openraft::async_runtime::watch::WatchReceiver;
use std::collections::HashSet;
use std::time::{Duration, Instant};

use cumulus_raft_store::state::{JobState, RankState, WorkerState};
use tracing::info;

use crate::node::Node;
use crate::soft::now_ms;
use cumulus_api::AttemptKey;

use super::*;

/// Builds the planner's observations from the soft state; on the first tick of a new
/// term, grants every worker a full heartbeat timeout of grace (as Nomad does).
pub(super) fn observe(node: &Node) -> Observations {
    let term = node.raft.metrics().borrow_watched().current_term;
    let now = Instant::now();
    let now_wall = now_ms();
    // Running and pending (placed) attempts: (key, worker, started_at_ms, pending
    // not_before_ms or None when running).
    #[allow(clippy::type_complexity)]
    let (workers, running): (Vec<String>, Vec<(AttemptKey, String, u64, Option<u64>)>) = node
        .read_state(|s| {
            let workers = s
                .workers
                .values()
                .filter(|w| w.state == WorkerState::Alive)
                .map(|w| w.worker_id.clone())
                .collect();
            let running = s
                .job_index()
                .running
                .iter()
                .filter_map(|id| s.jobs.get(id))
                .filter(|j| j.state == JobState::Running)
                .flat_map(|j| {
                    j.ranks
                        .iter()
                        .filter(|r| matches!(r.state, RankState::Running | RankState::Pending))
                        .filter_map(|r| {
                            let pending =
                                (r.state == RankState::Pending).then_some(r.not_before_ms);
                            r.worker_id.clone().map(|w| {
                                (
                                    AttemptKey::new(j.id.clone(), r.rank, r.attempt),
                                    w,
                                    r.started_at_ms,
                                    pending,
                                )
                            })
                        })
                })
                .collect();
            (workers, running)
        });
    let mut soft = node.soft();
    if soft.leader_term != Some(term) {
        info!(
            term,
            "acting as leader: every worker gets one heartbeat timeout of grace"
        );
        soft.leader_term = Some(term);
        soft.leader_since = Some(now);
        for w in &workers {
            soft.workers.insert(
                w.clone(),
                crate::soft::WorkerSoft {
                    last_seen: now,
                    observed: Vec::new(),
                    resources: Default::default(),
                },
            );
        }
        for p in soft.progress.values_mut() {
            p.changed_at = now;
            p.seen_at = now;
        }
        // A new leader has seen no heartbeat yet: a running attempt counts as seen now,
        // not at its start (else every attempt older than the lost threshold would be
        // declared lost on the first tick, and a failover would restart every job).
        for (key, _, _, _) in &running {
            soft.progress
                .entry(key.clone())
                .or_insert(crate::soft::ProgressSoft::observed_at(now, 0, 0));
        }
    }
    let mut obs = Observations {
        now_ms: now_wall,
        ..Observations::default()
    };
    for w in &workers {
        let silence = soft
            .workers
            .get(w)
            .map_or(0, |s| now.duration_since(s.last_seen).as_millis() as u64);
        obs.worker_silence_ms.insert(w.clone(), silence);
        if let Some(s) = soft.workers.get(w) {
            obs.in_process.extend(
                s.observed
                    .iter()
                    .filter(|o| o.in_process && o.pid != 0)
                    .map(|o| AttemptKey::new(o.job_id.clone(), o.rank, o.attempt)),
            );
            for g in s.resources.gpus.iter().filter(|g| !g.healthy) {
                let error = if g.error.is_empty() {
                    "reported unhealthy"
                } else {
                    g.error.as_str()
                };
                obs.unhealthy_gpus
                    .insert(g.uuid.clone(), format!("on worker {w}: {error}"));
            }
        }
    }
    let lost_after_ms = LOST_AFTER_HEARTBEATS * node.limits.heartbeat_interval_ms;
    let leader_ms = soft
        .leader_since
        .map_or(0, |t| now.duration_since(t).as_millis() as u64);
    for (key, worker, started_at_ms, pending) in running {
        // Only a worker that is heartbeating can tell that it no longer has the attempt.
        let worker_reporting = soft.workers.get(&worker).is_some_and(|w| {
            now.duration_since(w.last_seen).as_millis()
                < u128::from(node.limits.heartbeat_interval_ms) * 2
        });
        let unseen_ms = if let Some(not_before_ms) = pending {
            // A placed attempt: the clock starts when this leader first sees it pending (its
            // worker reports it, pid 0, from the moment it starts preparing it), and not
            // before its backoff ends. One that its reporting worker neither prepares nor
            // runs past the lost threshold was lost on the way (a dropped desired set or
            // start report) and would otherwise stay pending for ever.
            let p = soft
                .progress
                .entry(key.clone())
                .or_insert(crate::soft::ProgressSoft::observed_at(now, 0, 0));
            (now.duration_since(p.seen_at).as_millis() as u64)
                .min(now_wall.saturating_sub(not_before_ms))
        } else {
            let progress = soft.progress.get(&key);
            match progress {
                // The progress timeout counts from the attempt's first report...
                Some(p) if p.first_report_at.is_some() => {
                    obs.progress_stall_ms.insert(
                        key.clone(),
                        now.duration_since(p.changed_at).as_millis() as u64,
                    );
                }
                // ...and the startup timeout from its process's start (the leader's
                // stamp of it, so a stopped predecessor's grace is not counted), or
                // from this leader's start when later.
                _ => {
                    obs.startup_ms.insert(
                        key.clone(),
                        now_wall.saturating_sub(started_at_ms).min(leader_ms),
                    );
                }
            }
            match progress {
                Some(p) => now.duration_since(p.seen_at).as_millis() as u64,
                None => now_wall.saturating_sub(started_at_ms),
            }
        };
        if worker_reporting && unseen_ms > lost_after_ms {
            obs.lost.insert(key);
        }
    }
    obs
}

/// Drops soft progress of attempts that are no longer current (bounded memory).
pub(super) fn prune_progress(node: &Node, memory: &mut LoopMemory) {
    if memory
        .last_progress_prune
        .is_some_and(|t| t.elapsed() < Duration::from_secs(5))
    {
        return;
    }
    memory.last_progress_prune = Some(Instant::now());
    // Progress is only reported by attempts of running jobs.
    let current: HashSet<AttemptKey> = node.read_state(|s| {
        s.job_index()
            .running
            .iter()
            .filter_map(|id| s.jobs.get(id))
            .flat_map(|j| {
                j.ranks
                    .iter()
                    .map(|r| AttemptKey::new(j.id.clone(), r.rank, r.attempt))
            })
            .collect()
    });
    let mut soft = node.soft();
    soft.progress.retain(|k, _| current.contains(k));
    if soft.progress.len() > crate::soft::MAX_PROGRESS_ENTRIES {
        soft.progress.clear();
    }
}

/// Least time between two passes of [`record_history`].
const HISTORY_PASS_INTERVAL: Duration = Duration::from_secs(1);
/// Least time between two samplings of the running jobs: at most one `RecordProgress`
/// entry per interval reaches the Raft log.
const SAMPLE_PASS_INTERVAL: Duration =
    Duration::from_millis(cumulus_raft_store::state::HISTORY_INTERVAL_MS);

/// Records the progress of every running job as its latest (soft; at most once per
/// [`HISTORY_PASS_INTERVAL`]), and returns the [`Command::RecordProgress`] with a sample
/// of each running job whose replicated history is due one (`None`: nothing to commit):
/// a job's first sample on the first pass that sees its progress, the others on a
/// sampling pass (at most one per [`SAMPLE_PASS_INTERVAL`]). Drops the soft latest progress
/// beyond [`crate::soft::MAX_HISTORY_JOBS`]: of jobs not running, least recently seen
/// first.
pub(super) fn record_history(
    node: &Node,
    memory: &mut LoopMemory,
) -> Option<cumulus_raft_store::Command> {
    use cumulus_raft_store::state::{MAX_HISTORY_JOBS, MAX_HISTORY_METRICS, ProgressSampleIn};
    if memory
        .last_history
        .is_some_and(|t| t.elapsed() < HISTORY_PASS_INTERVAL)
    {
        return None;
    }
    let now = Instant::now();
    memory.last_history = Some(now);
    let sampling = memory
        .last_history_sample
        .is_none_or(|t| now.duration_since(t) >= SAMPLE_PASS_INTERVAL);
    if sampling {
        memory.last_history_sample = Some(now);
    }
    let at_ms = crate::soft::now_ms();
    // Running jobs, with whether their replicated history is due a sample.
    let running: Vec<(String, Vec<AttemptKey>, bool)> = node.read_state(|s| {
        s.job_index()
            .running
            .iter()
            .filter_map(|id| s.jobs.get(id))
            .map(|j| {
                (
                    j.id.clone(),
                    j.ranks
                        .iter()
                        .map(|r| AttemptKey::new(j.id.clone(), r.rank, r.attempt))
                        .collect(),
                    // A job's first sample at once (a chart is never empty for
                    // long); the others on the sampling passes, when due.
                    s.histories
                        .get(&j.id)
                        .is_none_or(|h| h.points.is_empty() || (sampling && h.due(at_ms))),
                )
            })
            .collect()
    });
    let mut samples = Vec::new();
    let mut soft = node.soft();
    let soft = &mut *soft;
    for (job_id, attempts, due) in &running {
        if let Some(p) = crate::soft::job_progress(attempts, &soft.progress) {
            // An attempt is in the soft state once its worker reports it running; a
            // sample waits for its first report (a step or a metric).
            let reported = p.step > 0 || !p.metrics.is_empty();
            if *due && reported && samples.len() < MAX_HISTORY_JOBS {
                samples.push(ProgressSampleIn {
                    job_id: job_id.clone(),
                    at_ms,
                    step: p.step,
                    total_steps: p.total_steps,
                    steps_per_s_bits: p.steps_per_s.to_bits(),
                    metrics: p
                        .metrics
                        .iter()
                        .take(MAX_HISTORY_METRICS)
                        .map(|(k, v)| (k.clone(), v.to_bits()))
                        .collect(),
                });
            }
            soft.history.insert(
                job_id.clone(),
                crate::soft::JobHistory {
                    latest: p,
                    seen_at: now,
                },
            );
        }
    }
    let excess = soft
        .history
        .len()
        .saturating_sub(crate::soft::MAX_HISTORY_JOBS);
    if excess > 0 {
        let running: HashSet<&String> = running.iter().map(|(id, _, _)| id).collect();
        let mut idle: Vec<(Instant, String)> = soft
            .history
            .iter()
            .filter(|(id, _)| !running.contains(id))
            .map(|(id, h)| (h.seen_at, id.clone()))
            .collect();
        idle.sort();
        for (_, id) in idle.into_iter().take(excess) {
            soft.history.remove(&id);
        }
    }
    (!samples.is_empty()).then_some(cumulus_raft_store::Command::RecordProgress { samples })
}

/// Least time between two passes of [`detect_stragglers`]: its samples are at least
/// this far apart anyway ([`straggler::SAMPLE_INTERVAL_MS`]).
const STRAGGLER_PASS_INTERVAL: Duration = Duration::from_millis(straggler::SAMPLE_INTERVAL_MS);

/// Feeds the straggler detector the steps of every rank of each running job that has
/// straggler detection on and no stop in flight (at most every
/// [`STRAGGLER_PASS_INTERVAL`]), and puts the attempts it finds in `obs.stragglers`.
/// O(ranks of those jobs); the detector's memory of other jobs is dropped.
pub(super) fn detect_stragglers(node: &Node, memory: &mut LoopMemory, obs: &mut Observations) {
    if memory
        .last_straggler_pass
        .is_some_and(|t| t.elapsed() < STRAGGLER_PASS_INTERVAL)
    {
        return;
    }
    memory.last_straggler_pass = Some(Instant::now());
    #[allow(clippy::type_complexity)]
    let jobs: Vec<(String, straggler::Rule, Vec<(u32, u32, bool)>)> = node.read_state(|s| {
        s.job_index()
            .running
            .iter()
            .filter_map(|id| s.jobs.get(id))
            .filter(|j| {
                j.state == JobState::Running
                    && j.stop.is_none()
                    && j.spec.straggler.action != cumulus_raft_store::state::StragglerAction::Off
            })
            .map(|j| {
                (
                    j.id.clone(),
                    straggler::Rule {
                        fraction_permille: j.spec.straggler.fraction_permille,
                        window_ms: j.spec.straggler.window_ms,
                    },
                    // Ranks that finished (exited 0) or were never placed take no part;
                    // a pending or failed one keeps the job from being judged.
                    j.ranks
                        .iter()
                        .filter(|r| {
                            matches!(
                                r.state,
                                RankState::Pending | RankState::Running | RankState::Failed
                            )
                        })
                        .map(|r| (r.rank, r.attempt, r.state == RankState::Running))
                        .collect(),
                )
            })
            .collect()
    });
    let soft = node.soft();
    let mut watched = HashSet::new();
    for (job_id, rule, ranks) in jobs {
        let samples: Vec<straggler::RankSample> = ranks
            .into_iter()
            .map(|(rank, attempt, running)| {
                let p = running
                    .then(|| {
                        soft.progress
                            .get(&AttemptKey::new(job_id.clone(), rank, attempt))
                    })
                    .flatten();
                straggler::RankSample {
                    rank,
                    attempt,
                    step: p.map_or(0, |p| p.step),
                    reported: p.is_some_and(|p| p.first_report_at.is_some()),
                }
            })
            .collect();
        let verdicts = memory
            .stragglers
            .entry(job_id.clone())
            .or_default()
            .observe(rule, obs.now_ms, &samples);
        for v in verdicts {
            obs.stragglers
                .insert(AttemptKey::new(job_id.clone(), v.rank, v.attempt), v);
        }
        watched.insert(job_id);
    }
    memory.stragglers.retain(|id, _| watched.contains(id));
}
