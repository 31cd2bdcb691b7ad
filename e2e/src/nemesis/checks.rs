//! The checks of a run's recorded history, once every job has finished: liveness, and
//! checks 1, 2, 4, 5 and 7 of the module doc (check 3 is
//! [`crate::history::check_reads`]).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use cumulus_api::v1;
use cumulus_api::{JobState, StopAction};

use super::faults::resume_until_accepted;
use super::{
    HARNESS_CALL, History, LONG, OVERLAP_LIMIT_MS, Report, TIME_LIMIT_SLACK_MS, TRAINER_RESTARTS,
    TRAINER_WORLD, describe_ranks, terminal, weights,
};
use crate::history::{Anomaly, Read, Version, check_transitions};
use crate::{Cluster, Workload, expected_digest};

/// Lists the jobs (from the leader, linearizably) until every one has finished or
/// [`LONG`] has passed since the faults stopped, resuming the workload's paused jobs;
/// returns the last list.
pub(super) async fn wait_until_finished(cluster: &Cluster) -> anyhow::Result<v1::ListJobsResponse> {
    let started_wait = Instant::now();
    let mut last: Option<v1::ListJobsResponse> = None;
    loop {
        let listed = tokio::time::timeout(2 * HARNESS_CALL, async {
            let mut c = cluster.leader_client().await.ok()?;
            c.list_jobs(v1::ListJobsRequest { linearizable: true })
                .await
                .ok()
        })
        .await
        .ok()
        .flatten();
        if let Some(list) = listed {
            let list = list.into_inner();
            // The workload's paused jobs are resumed now: everything must finish (within
            // the liveness deadline, whatever the resumes meet).
            for j in list.jobs.iter().filter(|j| {
                j.job_state() == Ok(JobState::Paused) || j.stop_action == StopAction::Pause.as_str()
            }) {
                let left = LONG.saturating_sub(started_wait.elapsed());
                if left.is_zero() {
                    break;
                }
                resume_until_accepted(cluster, &j.id, left.min(Duration::from_secs(30))).await;
            }
            let done = list.jobs.iter().all(|j| terminal(&j.state));
            last = Some(list);
            if done {
                break;
            }
        }
        if started_wait.elapsed() > LONG {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    last.context("no leader answered ListJobs after the faults")
}

/// Liveness: every job still unfinished is an anomaly, with its ranks.
pub(super) fn liveness(all: &v1::ListJobsResponse, anomalies: &mut Vec<Anomaly>) {
    for j in all.jobs.iter().filter(|j| !terminal(&j.state)) {
        anomalies.push(Anomaly {
            job_id: j.id.clone(),
            what: format!(
                "liveness: still {} {} s after the faults stopped: restarts used {}, ranks {}",
                j.state,
                LONG.as_secs(),
                j.restarts_used,
                describe_ranks(j)
            ),
        });
    }
}

/// Check 1: acknowledged submits exactly once; nothing from nowhere.
pub(super) fn submits_exactly_once(
    all: &v1::ListJobsResponse,
    h: &History,
    anomalies: &mut Vec<Anomaly>,
) {
    let mut by_rid: HashMap<&str, Vec<&v1::Job>> = HashMap::new();
    for j in &all.jobs {
        by_rid.entry(j.request_id.as_str()).or_default().push(j);
    }
    for (rid, job_id) in &h.acked {
        let found = by_rid.get(rid.as_str()).map_or(0, Vec::len);
        let same = by_rid
            .get(rid.as_str())
            .is_some_and(|js| js.iter().any(|j| &j.id == job_id));
        if found != 1 || !same {
            anomalies.push(Anomaly {
                job_id: job_id.clone(),
                what: format!("acknowledged submit {rid} found {found} times"),
            });
        }
    }
    for (rid, js) in &by_rid {
        let known = rid.is_empty()
            || *rid == "reference"
            || h.acked.contains_key(*rid)
            || h.unknown.iter().any(|u| u == rid);
        if !known || js.len() > 1 {
            anomalies.push(Anomaly {
                job_id: js[0].id.clone(),
                what: format!("request id {rid:?} made {} jobs (known: {known})", js.len()),
            });
        }
    }
}

/// Check 2: transitions, restart budget and delays.
pub(super) fn transitions_and_restarts(
    all: &v1::ListJobsResponse,
    h: &History,
    anomalies: &mut Vec<Anomaly>,
) {
    let mut per_job: BTreeMap<&str, Vec<&Read>> = BTreeMap::new();
    for r in &h.reads {
        per_job.entry(&r.job_id).or_default().push(r);
    }
    for (job, mut rs) in per_job {
        rs.sort_by_key(|r| r.completed_us);
        // Reads that do not overlap form a real-time chain.
        let mut chain: Vec<Version> = Vec::new();
        let mut last_done = 0;
        for r in rs {
            if r.invoked_us > last_done {
                chain.push(r.version.clone());
                last_done = r.completed_us;
            }
        }
        anomalies.extend(check_transitions(job, &chain));
    }
    for j in &all.jobs {
        let policy = j.spec.as_ref().and_then(|s| s.restart.clone());
        let Some(p) = policy else { continue };
        let budget = p.max_restarts.unwrap_or(3);
        if j.restarts_used > budget || j.restarts.len() as u32 != j.restarts_used {
            anomalies.push(Anomaly {
                job_id: j.id.clone(),
                what: format!(
                    "restarts used {} (records {}) over budget {budget}",
                    j.restarts_used,
                    j.restarts.len()
                ),
            });
        }
        let initial = p.backoff_initial_ms.unwrap_or(1_000);
        let max = p.backoff_max_ms.unwrap_or(u64::MAX);
        for r in &j.restarts {
            let base = initial
                .saturating_mul(1u64 << (r.number.saturating_sub(1)).min(30))
                .min(max);
            if r.delay_ms * 10 < base * 8 || r.not_before_ms < r.failed_at_ms + r.delay_ms {
                anomalies.push(Anomaly {
                    job_id: j.id.clone(),
                    what: format!(
                        "restart {} delay {} ms below policy base {base} ms",
                        r.number, r.delay_ms
                    ),
                });
            }
        }
    }
}

/// Check 7: time limits; a job given one never runs much past it, and never succeeds
/// (the small jobs given one sleep far longer).
pub(super) fn time_limits(all: &v1::ListJobsResponse, anomalies: &mut Vec<Anomaly>) {
    for j in &all.jobs {
        let Some(spec) = &j.spec else { continue };
        if spec.time_limit_ms == 0 {
            continue;
        }
        if j.running_ms > spec.time_limit_ms + TIME_LIMIT_SLACK_MS {
            anomalies.push(Anomaly {
                job_id: j.id.clone(),
                what: format!(
                    "ran {} ms with a time limit of {} ms (slack {TIME_LIMIT_SLACK_MS} ms)",
                    j.running_ms, spec.time_limit_ms
                ),
            });
        }
        if j.job_state() == Ok(JobState::Succeeded) {
            anomalies.push(Anomaly {
                job_id: j.id.clone(),
                what: format!(
                    "succeeded although it sleeps past its time limit of {} ms",
                    spec.time_limit_ms
                ),
            });
        }
    }
}

/// Check 5: at most one progressing attempt of a rank, from /proc (every job has finished).
pub(super) fn one_attempt_at_a_time(
    sampler: crate::ranks::Sampler,
    report: &mut Report,
    anomalies: &mut Vec<Anomaly>,
) {
    let overlaps = sampler.finish();
    report.proc_samples = overlaps.samples;
    report.rank_processes_seen = overlaps.processes_seen();
    report.attempt_overlaps = overlaps.overlaps;
    report.attempt_overlap_longest_ms = overlaps.longest_ms;
    for o in &overlaps.anomalies {
        anomalies.push(Anomaly {
            job_id: o.job_id.clone(),
            what: format!(
                "rank {}: attempts {} (pid {}) and {} (pid {}) both progressed for {} ms \
                 (limit {OVERLAP_LIMIT_MS} ms)",
                o.rank,
                o.attempts[0].0,
                o.attempts[0].1,
                o.attempts[1].0,
                o.attempts[1].1,
                o.length_ms
            ),
        });
    }
}

/// Check 4: the trainer holds every record once, weights identical to the fault-free run.
pub(super) fn trainer_result(
    trainer_final: &v1::Job,
    w: &Workload,
    root: &Path,
    epochs: u32,
    reference: &[Vec<u8>],
    report: &mut Report,
    anomalies: &mut Vec<Anomaly>,
) -> anyhow::Result<()> {
    let trainer_job = &trainer_final.id;
    report.trainer_state = trainer_final.state.clone();
    report.trainer_restarts = trainer_final.restarts_used;
    if trainer_final.job_state() == Ok(JobState::Succeeded) {
        let out = root.join("out-nemesis");
        for rank in 0..TRAINER_WORLD {
            let want = expected_digest(w, TRAINER_WORLD, rank, epochs, root)?;
            let got = crate::read_result(&out, rank)
                .ok()
                .and_then(|r| r["digest"].as_str().map(str::to_string));
            if got.as_deref() != Some(want.as_str()) {
                anomalies.push(Anomaly {
                    job_id: trainer_job.clone(),
                    what: format!("rank {rank} digest {got:?}, every record once is {want}"),
                });
            }
            if weights(&out, rank).as_ref() != Some(&reference[rank as usize]) {
                anomalies.push(Anomaly {
                    job_id: trainer_job.clone(),
                    what: format!("rank {rank} weights differ from the fault-free run"),
                });
            }
        }
    } else {
        anomalies.push(Anomaly {
            job_id: trainer_job.clone(),
            what: format!(
                "the trainer job ended {} ({}) with {} of {TRAINER_RESTARTS} restarts",
                trainer_final.state, trainer_final.failure_cause, trainer_final.restarts_used
            ),
        });
    }
    Ok(())
}
