//! The fault schedule: one random fault at a time, held, then repaired ([`one_fault`]),
//! and the process and network faults themselves (kills, stops, partitions, a hung rank,
//! a pause of the trainer job).

use std::time::{Duration, Instant};

use cumulus_api::v1;
use cumulus_api::{JobState, RankPhase, StopAction};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rand::RngExt;
use rand::rngs::StdRng;

use super::hostile::{flood_listeners, forge_raft_rpcs};
use super::storage::{corrupt_and_rebuild, corrupt_sled};
use super::{
    FAULTS, HANG_DETECT_SLACK_MS, HARNESS_CALL, HEARTBEAT_TIMEOUT_MS, Report, STOP_GRACE_MS,
    TRAINER_PROGRESS_TIMEOUT_MS, terminal,
};
use crate::Cluster;
use crate::history::Anomaly;

fn alive(p: &crate::Proc) -> bool {
    p.child.is_some()
}

fn signal(p: &crate::Proc, s: Signal) {
    if let Some(pid) = p.pid() {
        let _ = kill(Pid::from_raw(pid as i32), s);
    }
}

/// Puts every process back: heals links, resumes and restarts what is down.
pub(super) fn repair(cluster: &mut Cluster) -> anyhow::Result<()> {
    cluster.net.heal();
    for i in 0..cluster.coordinators.len() {
        signal(&cluster.coordinators[i].proc, Signal::SIGCONT);
        if !alive(&cluster.coordinators[i].proc) {
            cluster.spawn_coordinator(i)?;
        }
    }
    for i in 0..cluster.workers.len() {
        signal(&cluster.workers[i], Signal::SIGCONT);
        if !alive(&cluster.workers[i]) {
            cluster.spawn_worker(i)?;
        }
    }
    Ok(())
}

/// The start time of process `pid` (clock ticks after boot), `None` when it is gone.
fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    crate::ranks::parse_stat(&stat).map(|(_, _, start)| start)
}

/// Whether `pid` is still the process that started at `start` (not gone, not reused).
fn same_process(pid: u32, start: u64) -> bool {
    start_ticks(pid) == Some(start)
}

/// The hung-rank fault: SIGSTOPs one running rank of the trainer job, waits for the
/// leader to fail it as hung and restart it, then makes sure the stopped process is gone
/// (SIGCONT lets it take the agent's pending SIGTERM; SIGKILL after the stop grace, with
/// an anomaly, when the agent did not end it). `None` when no rank was running.
pub(super) async fn hang_rank(
    cluster: &Cluster,
    rng: &mut StdRng,
    trainer_job: &str,
    report: &mut Report,
    anomalies: &mut Vec<Anomaly>,
) -> Option<()> {
    let job = cluster.job(trainer_job).await?;
    let running: Vec<&v1::RankStatus> = job
        .ranks
        .iter()
        // Only a rank that reported progress can stall (the leader measures a stall from
        // the last progress it saw).
        .filter(|r| r.phase() == Ok(RankPhase::Running) && r.pid > 0 && r.step > 0)
        .collect();
    if running.is_empty() {
        return None;
    }
    let target = running[rng.random_range(0..running.len())];
    let (pid, rank) = (target.pid, target.rank);
    let Some(start) = start_ticks(pid) else {
        eprintln!("nemesis: hang-rank: rank {rank}'s process {pid} is gone");
        return None;
    };
    let restarts_before = job.restarts_used;
    if kill(Pid::from_raw(pid as i32), Signal::SIGSTOP).is_err() {
        return None;
    }
    eprintln!("nemesis: hang-rank: SIGSTOP rank {rank} (pid {pid})");
    let stopped_at = Instant::now();
    let deadline = Duration::from_millis(TRAINER_PROGRESS_TIMEOUT_MS + HANG_DETECT_SLACK_MS);
    let mut outcome = None;
    while stopped_at.elapsed() < deadline {
        if let Some(j) = cluster.job(trainer_job).await {
            let hung = j.restarts.iter().any(|r| {
                r.number > restarts_before && r.cause.contains("hung") && r.ranks.contains(&rank)
            });
            if hung {
                outcome = Some(Ok(stopped_at.elapsed().as_millis() as u64));
                break;
            }
            if terminal(&j.state) {
                outcome = Some(Err(format!(
                    "the job ended {} while rank {rank} hung",
                    j.state
                )));
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    match outcome {
        Some(Ok(ms)) => report.hang_detect_ms.push(ms),
        Some(Err(what)) => anomalies.push(Anomaly {
            job_id: trainer_job.to_string(),
            what,
        }),
        None => anomalies.push(Anomaly {
            job_id: trainer_job.to_string(),
            what: format!(
                "rank {rank} (pid {pid}) SIGSTOPped: no restart for \"hung\" within {} ms",
                deadline.as_millis()
            ),
        }),
    }
    // Nothing may leak: the stopped process must be gone once its agent stopped it.
    if same_process(pid, start) {
        let _ = kill(Pid::from_raw(pid as i32), Signal::SIGCONT);
    }
    let gone = Instant::now() + Duration::from_millis(STOP_GRACE_MS + 10_000);
    while same_process(pid, start) && Instant::now() < gone {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if same_process(pid, start) {
        let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
        anomalies.push(Anomaly {
            job_id: trainer_job.to_string(),
            what: format!("the hung rank {rank}'s process {pid} outlived its attempt"),
        });
    }
    Some(())
}

/// Pauses the trainer job, waits (bounded) until it is paused, holds it `hold`, and
/// resumes it: its final weights must still equal the fault-free run's (check 4). A
/// pause refused (a stop in flight, a leader change) is left at that; a paused job
/// that could not be resumed here is resumed when the faults end.
async fn pause_and_resume(cluster: &Cluster, trainer_job: &str, hold: Duration) {
    let paused = tokio::time::timeout(HARNESS_CALL, async {
        let mut c = cluster.leader_client().await.ok()?;
        c.pause_job(v1::PauseJobRequest {
            job_id: trainer_job.to_string(),
        })
        .await
        .ok()
    })
    .await;
    if !matches!(paused, Ok(Some(_))) {
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if tokio::time::timeout(HARNESS_CALL, cluster.job(trainer_job))
            .await
            .ok()
            .flatten()
            .is_some_and(|j| j.job_state() == Ok(JobState::Paused))
        {
            tokio::time::sleep(hold).await;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    resume_until_accepted(cluster, trainer_job, Duration::from_secs(30)).await;
}

/// Sends `ResumeJob` for `job_id` until a leader accepts it, the job is not paused or
/// pausing any more, or `deadline` passes; every call bounded by [`HARNESS_CALL`].
pub(super) async fn resume_until_accepted(cluster: &Cluster, job_id: &str, deadline: Duration) {
    let until = Instant::now() + deadline;
    while Instant::now() < until {
        let resumed = tokio::time::timeout(HARNESS_CALL, async {
            let mut c = cluster.leader_client().await.ok()?;
            c.resume_job(v1::ResumeJobRequest {
                job_id: job_id.to_string(),
            })
            .await
            .ok()
        })
        .await;
        if matches!(resumed, Ok(Some(_))) {
            return;
        }
        match tokio::time::timeout(HARNESS_CALL, cluster.job(job_id)).await {
            Ok(Some(j))
                if j.job_state() != Ok(JobState::Paused)
                    && j.stop_action != StopAction::Pause.as_str() =>
            {
                return;
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Injects one random fault, holds it for a random while, then repairs.
pub(super) async fn one_fault(
    cluster: &mut Cluster,
    rng: &mut StdRng,
    trainer_job: &str,
    only: Option<&str>,
    report: &mut Report,
    anomalies: &mut Vec<Anomaly>,
) -> anyhow::Result<&'static str> {
    let leader = cluster.status().await.and_then(|s| s.leader_id);
    let li = leader.and_then(|l| cluster.index_of(l));
    let followers: Vec<usize> = (0..cluster.coordinators.len())
        .filter(|i| Some(*i) != li)
        .collect();
    let hold = Duration::from_millis(rng.random_range(500..2_500));
    let drawn = FAULTS[rng.random_range(0..FAULTS.len())];
    let kind = match only.unwrap_or(drawn) {
        "pause-resume-trainer" => {
            // Bounded whatever the cluster does: the faults go on after it.
            let _ = tokio::time::timeout(
                Duration::from_secs(90),
                pause_and_resume(cluster, trainer_job, hold),
            )
            .await;
            "pause-resume-trainer"
        }
        "corrupt-follower-log" => {
            let i = followers[rng.random_range(0..followers.len())];
            corrupt_and_rebuild(cluster, i, rng, anomalies).await?;
            "corrupt-follower-log"
        }
        "corrupt-follower-sled" => {
            let i = followers[rng.random_range(0..followers.len())];
            corrupt_sled(cluster, i, rng, report, anomalies).await?;
            "corrupt-follower-sled"
        }
        "forged-raft-rpc" => {
            forge_raft_rpcs(cluster, anomalies).await;
            "forged-raft-rpc"
        }
        "flood-listeners" => {
            flood_listeners(cluster, hold).await;
            "flood-listeners"
        }
        "kill-leader" => {
            let Some(i) = li else { return Ok("none") };
            cluster.coordinators[i].proc.kill9();
            tokio::time::sleep(hold).await;
            "kill-leader"
        }
        "kill-follower" => {
            let i = followers[rng.random_range(0..followers.len())];
            cluster.coordinators[i].proc.kill9();
            tokio::time::sleep(hold).await;
            "kill-follower"
        }
        "kill-worker" => {
            let i = rng.random_range(0..cluster.workers.len());
            cluster.workers[i].kill9();
            tokio::time::sleep(hold).await;
            "kill-worker"
        }
        "kill-rank" => {
            let job = cluster.job(trainer_job).await;
            let pids: Vec<u32> = job
                .map(|j| {
                    j.ranks
                        .iter()
                        .filter(|r| r.phase() == Ok(RankPhase::Running))
                        .map(|r| r.pid)
                        .filter(|p| *p > 0)
                        .collect()
                })
                .unwrap_or_default();
            if pids.is_empty() {
                return Ok("none");
            }
            let pid = pids[rng.random_range(0..pids.len())];
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
            "kill-rank"
        }
        "stop-coordinator" => {
            let i = rng.random_range(0..cluster.coordinators.len());
            signal(&cluster.coordinators[i].proc, Signal::SIGSTOP);
            tokio::time::sleep(hold).await;
            signal(&cluster.coordinators[i].proc, Signal::SIGCONT);
            "stop-coordinator"
        }
        "stop-worker" => {
            let i = rng.random_range(0..cluster.workers.len());
            signal(&cluster.workers[i], Signal::SIGSTOP);
            tokio::time::sleep(hold).await;
            signal(&cluster.workers[i], Signal::SIGCONT);
            "stop-worker"
        }
        "partition-follower" => {
            let i = followers[rng.random_range(0..followers.len())];
            isolate_coordinator(cluster, i);
            tokio::time::sleep(hold).await;
            "partition-follower"
        }
        "partition-leader" => {
            let Some(i) = li else { return Ok("none") };
            isolate_coordinator(cluster, i);
            tokio::time::sleep(hold).await;
            "partition-leader"
        }
        "hang-rank" => {
            if hang_rank(cluster, rng, trainer_job, report, anomalies)
                .await
                .is_none()
            {
                return Ok("none");
            }
            "hang-rank"
        }
        "partition-worker" => {
            // Longer than the heartbeat timeout: the worker must stop its own ranks
            // and the leader reschedules them.
            let i = rng.random_range(0..cluster.workers.len());
            let coords: Vec<String> = cluster
                .coordinators
                .iter()
                .map(|c| c.proc.name.clone())
                .collect();
            cluster
                .net
                .partition(&[cluster.workers[i].name.clone()], &coords);
            tokio::time::sleep(Duration::from_millis(HEARTBEAT_TIMEOUT_MS + 1_500)).await;
            "partition-worker"
        }
        other => anyhow::bail!("unknown fault {other:?} (known: {FAULTS:?})"),
    };
    repair(cluster)?;
    Ok(kind)
}

fn isolate_coordinator(cluster: &Cluster, i: usize) {
    let me = cluster.coordinators[i].proc.name.clone();
    let others: Vec<String> = cluster
        .coordinators
        .iter()
        .map(|c| c.proc.name.clone())
        .chain(cluster.workers.iter().map(|w| w.name.clone()))
        .chain([crate::net::UNKNOWN.to_string()])
        .filter(|n| *n != me)
        .collect();
    cluster.net.partition(&[me], &others);
}
