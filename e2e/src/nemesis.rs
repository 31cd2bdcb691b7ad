//! The nemesis suite: a seeded random client workload against a real proxied cluster
//! while a seeded nemesis injects faults, then checks of the recorded history.
//!
//! Faults: SIGKILL + restart of the leader, a follower, a worker agent or a rank;
//! SIGSTOP/SIGCONT of a coordinator or a worker; partitions through the harness's TCP
//! proxies (one coordinator isolated, the leader isolated, a worker cut from every
//! coordinator for longer than its heartbeat timeout); a hung rank (a trainer rank
//! SIGSTOPped: it neither exits nor progresses; the trainer job has a progress timeout
//! and the leader must fail that attempt as hung and restart it); storage and hostile
//! input faults: a bit flipped in a stopped follower's raft log (it must refuse to
//! start, then `--rejoin-empty` rebuilds it from the others), a bit flipped in its sled
//! database or generation file (it refuses to start, naming the damage, and is rebuilt
//! the same way, or the bit lay where nothing reads and it catches up as a consistent
//! member), forged Raft RPCs (with the
//! client token, from a non-member, with term `u64::MAX`: each must be refused), and a
//! flood of idle connections against every listener of every process; and a pause of
//! the trainer job, held, then resumed. The clients' workload submits small jobs (some
//! with a time limit far shorter than their run; priorities 0 to 2, half of them
//! preemptible), cancels, pauses and resumes their own jobs, and reads; the jobs still
//! paused when the faults end are resumed.
//!
//! Checks: (1) every acknowledged submit exists exactly once; (2) observed job states
//! follow the state machine, restart counts stay within the budget and delays at or
//! above the policy's minimum; (3) linearizable reads are linearizable
//! ([`crate::history::check_reads`]); (4) a trainer job that succeeded holds every
//! record exactly once and weights byte-identical to a fault-free run; (5) at the OS
//! level, no two attempts of one rank make progress together for longer than it takes to
//! stop one ([`crate::ranks`], `/proc` sampled every [`PROC_SAMPLE_MS`]); (6) a hung rank
//! is failed as hung and restarted within its progress timeout plus
//! [`HANG_DETECT_SLACK_MS`], and its process does not outlive the fault; (7) a job with a
//! time limit never runs more than [`TIME_LIMIT_SLACK_MS`] past it and never succeeds.
//! Job states are ordered by `Job.state_changes` (a paused or preempted job goes back).
//!
//! Why one file of ~1,800 lines: the workload, the fault schedule and the checks share one
//! seeded random stream and one recorded history; replaying a seed needs them in one
//! order, which this file keeps visible.

use cumulus_api::{JobState, RankPhase, StopAction};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use cumulus_api::v1;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::history::{Anomaly, Read, Version, check_reads, check_transitions};
use crate::{Cluster, ClusterOpts, View, Workload, expected_digest, prepare_digits, trainer_spec};

/// Options of one nemesis run.
#[derive(Clone, Debug)]
pub struct RunOpts {
    /// Seed of the workload and of the fault schedule.
    pub seed: u64,
    /// How long faults are injected, in milliseconds.
    pub fault_ms: u64,
    /// Concurrent clients.
    pub clients: usize,
    /// Trainer epochs (the trainer job runs during the faults).
    pub epochs: u32,
    /// Inject a hang-rank fault first, as soon as a trainer rank reports progress (so a
    /// short run covers it; later faults are drawn at random, hang-rank among them).
    pub hang_first: bool,
    /// Inject only this fault (one of [`FAULTS`]) instead of the one drawn: to exercise
    /// one fault kind in a short run. The draw is still made, so the rest of the seeded
    /// stream stays as without it.
    pub only: Option<String>,
}

/// The faults, by the number drawn for each (equal odds).
pub const FAULTS: [&str; 15] = [
    "kill-leader",
    "kill-follower",
    "kill-worker",
    "kill-rank",
    "stop-coordinator",
    "stop-worker",
    "partition-follower",
    "partition-leader",
    "hang-rank",
    "partition-worker",
    "corrupt-follower-log",
    "forged-raft-rpc",
    "flood-listeners",
    "pause-resume-trainer",
    "corrupt-follower-sled",
];

/// Counts of what one run did and found.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// Client operations attempted, by kind.
    pub ops: BTreeMap<String, u64>,
    /// Faults injected, by kind.
    pub faults: BTreeMap<String, u64>,
    /// Acknowledged submits.
    pub acked_submits: u64,
    /// Linearizable reads checked.
    pub reads: u64,
    /// State of the trainer job at the end.
    pub trainer_state: String,
    /// Restarts the trainer job used.
    pub trainer_restarts: u32,
    /// Connections the proxies cut.
    pub proxy_drops: u64,
    /// `/proc` samples taken for the OS-level check of invariant 2.
    pub proc_samples: u64,
    /// Distinct rank processes those samples saw.
    pub rank_processes_seen: u64,
    /// Overlaps seen: two attempts of one rank progressing together (any length).
    pub attempt_overlaps: u64,
    /// Longest such overlap, in milliseconds (an anomaly past [`OVERLAP_LIMIT_MS`]).
    pub attempt_overlap_longest_ms: u64,
    /// Hung-rank faults: milliseconds from the SIGSTOP to the leader's restart, each.
    pub hang_detect_ms: Vec<u64>,
    /// `corrupt-follower-sled` faults by outcome: `refused` (the follower refused to
    /// start, naming the damage, and was rebuilt), `started` (the flipped bit lay in bytes
    /// nobody reads: it restarted and caught up), `anomaly` (anything else).
    pub sled_outcomes: BTreeMap<String, u64>,
    /// One line per `corrupt-follower-sled` fault: the node, the file, the offset and bit
    /// flipped, the outcome and, for a refusal, the coordinator's message.
    pub sled_flips: Vec<String>,
    /// Everything the checks found (empty: the run passed).
    pub anomalies: Vec<String>,
    /// Wall time of the run, in milliseconds.
    pub wall_ms: u64,
}

const LONG: Duration = Duration::from_secs(300);
/// Worker heartbeat timeout of nemesis clusters, in milliseconds.
pub const HEARTBEAT_TIMEOUT_MS: u64 = 3_000;
/// Restart budget and backoff of the small jobs.
const SMALL_RESTARTS: u32 = 2;
const SMALL_BACKOFF_MS: u64 = 100;
/// Restart budget and backoff of the trainer job (faults make it restart often).
const TRAINER_RESTARTS: u32 = 100;
const TRAINER_BACKOFF_MS: u64 = 200;
const TRAINER_WORLD: u32 = 2;
/// Progress timeout of the trainer job, in milliseconds: longer than any fault that
/// pauses progress innocently (a stopped worker: at most 2.5 s; a cut-off worker stops
/// its ranks itself), so only the hung-rank fault trips it.
pub const TRAINER_PROGRESS_TIMEOUT_MS: u64 = 6_000;
/// How long past the progress timeout the leader may take to restart a hung rank, in
/// milliseconds (failure-detector tick, backoff, a loaded machine).
pub const HANG_DETECT_SLACK_MS: u64 = 20_000;
/// The worker agents' stop grace (SIGTERM to SIGKILL), their default, in milliseconds.
const STOP_GRACE_MS: u64 = 5_000;
/// Longest two attempts of one rank may both progress (check 5), in milliseconds: the
/// stop grace, plus a heartbeat timeout (a cut-off worker stops its ranks about when the
/// leader places replacements), plus sampling slack.
pub const OVERLAP_LIMIT_MS: u64 = STOP_GRACE_MS + HEARTBEAT_TIMEOUT_MS + 1_000;
/// Interval of the `/proc` sampler, in milliseconds.
pub const PROC_SAMPLE_MS: u64 = 100;

#[derive(Default)]
struct History {
    start: Option<Instant>,
    /// request id → job id, for acknowledged submits.
    acked: HashMap<String, String>,
    /// request ids of submits whose outcome is unknown (errored).
    unknown: Vec<String>,
    reads: Vec<Read>,
    ops: BTreeMap<String, u64>,
}

impl History {
    fn us(&self) -> u64 {
        self.start.map_or(0, |s| s.elapsed().as_micros() as u64)
    }
}

fn terminal(state: &str) -> bool {
    state.parse::<JobState>().is_ok_and(JobState::is_terminal)
}

/// `rank/attempt state@worker (not before, failure)` of every rank, for a report.
fn describe_ranks(j: &v1::Job) -> String {
    j.ranks
        .iter()
        .map(|r| {
            format!(
                "{}/{} {}@{} (pid {}, not_before_ms {}, exit {:?})",
                r.rank, r.attempt, r.state, r.worker_id, r.pid, r.not_before_ms, r.exit_code
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Running time of the small jobs given a time limit (they sleep far longer), in ms.
pub const SMALL_TIME_LIMIT_MS: u64 = 1_500;
/// How far past its time limit a job may run before it ends: a heartbeat timeout (the
/// stop of a rank on a cut-off worker is known when the worker expires), the stop grace,
/// and slack for failovers.
pub const TIME_LIMIT_SLACK_MS: u64 = HEARTBEAT_TIMEOUT_MS + STOP_GRACE_MS + 10_000;

fn small_spec(rng: &mut StdRng) -> v1::JobSpec {
    let (command, time_limit_ms): (Vec<String>, u64) = match rng.random_range(0..5u32) {
        0 => (vec!["true".into()], 0),
        1 => (vec!["sleep".into(), "0.5".into()], 0),
        2 => (vec!["false".into()], 0),
        3 => (vec!["sleep".into(), "3".into()], 0),
        _ => (vec!["sleep".into(), "60".into()], SMALL_TIME_LIMIT_MS),
    };
    v1::JobSpec {
        world_size: rng.random_range(1..=2u32),
        command,
        time_limit_ms,
        // Priorities and preemption: a queued job of a higher priority makes the leader
        // preempt running preemptible ones (the trainer job is neither).
        priority: rng.random_range(0..3),
        preemptible: rng.random_bool(0.5),
        restart: Some(v1::RestartPolicy {
            max_restarts: Some(SMALL_RESTARTS),
            backoff_initial_ms: Some(SMALL_BACKOFF_MS),
            backoff_max_ms: Some(SMALL_BACKOFF_MS * 4),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The trainer job: `step_sleep_ms` paces it (it does not change the weights).
fn trainer(w: &Workload, root: &Path, name: &str, epochs: u32, step_sleep_ms: u32) -> v1::JobSpec {
    let args = [
        "--epochs".to_string(),
        epochs.to_string(),
        "--ckpt-every".into(),
        "10".into(),
        "--step-sleep-ms".into(),
        step_sleep_ms.to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut s = trainer_spec(
        w,
        TRAINER_WORLD,
        &root.join(format!("ckpt-{name}")),
        &root.join(format!("out-{name}")),
        &args,
    );
    s.name = name.into();
    s.progress_timeout_ms = TRAINER_PROGRESS_TIMEOUT_MS;
    s.restart = Some(v1::RestartPolicy {
        max_restarts: Some(TRAINER_RESTARTS),
        backoff_initial_ms: Some(TRAINER_BACKOFF_MS),
        backoff_max_ms: Some(TRAINER_BACKOFF_MS * 4),
        ..Default::default()
    });
    s
}

/// One client: random submits, cancels and linearizable reads until `stop`.
async fn client(
    cluster: Arc<View>,
    history: Arc<Mutex<History>>,
    seed: u64,
    id: usize,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ (id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut n = 0u64;
    while !stop.is_cancelled() {
        let op = rng.random_range(0..10u32);
        // Every acknowledged job may be read; only the clients' own jobs are cancelled
        // (cancelling the trainer would void check 4).
        let (known, cancellable): (Vec<String>, Vec<String>) = {
            let h = history.lock().unwrap_or_else(|p| p.into_inner());
            (
                h.acked.values().cloned().collect(),
                h.acked
                    .iter()
                    .filter(|(rid, _)| rid.starts_with("nem-"))
                    .map(|(_, j)| j.clone())
                    .collect(),
            )
        };
        let i = rng.random_range(0..cluster.grpc.len());
        let kind = if op < 4 || known.is_empty() {
            n += 1;
            let rid = format!("nem-{seed}-{id}-{n}");
            let spec = small_spec(&mut rng);
            // Submit to a random coordinator, retrying across leader changes with
            // the same request id (the harness follows the leader).
            let r = cluster.submit(i, &rid, spec, Duration::from_secs(20)).await;
            let mut h = history.lock().unwrap_or_else(|p| p.into_inner());
            match r {
                Ok(resp) => {
                    h.acked.insert(rid, resp.job_id);
                }
                _ => h.unknown.push(rid),
            }
            "submit"
        } else if op < 5 && !cancellable.is_empty() {
            let job = &cancellable[rng.random_range(0..cancellable.len())];
            if let Ok(mut c) = cluster.client_of(i).await {
                let _ = c
                    .cancel_job(v1::CancelJobRequest {
                        job_id: job.clone(),
                    })
                    .await;
            }
            "cancel"
        } else if op < 7 && !cancellable.is_empty() {
            // Pause or resume one of the clients' jobs (refusals, e.g. a resume of a
            // job that is not paused, are part of the workload).
            let job_id = cancellable[rng.random_range(0..cancellable.len())].clone();
            if let Ok(mut c) = cluster.client_of(i).await {
                if op == 5 {
                    let _ = c.pause_job(v1::PauseJobRequest { job_id }).await;
                } else {
                    let _ = c.resume_job(v1::ResumeJobRequest { job_id }).await;
                }
            }
            if op == 5 { "pause" } else { "resume" }
        } else {
            let job = known[rng.random_range(0..known.len())].clone();
            let invoked = history.lock().unwrap_or_else(|p| p.into_inner()).us();
            if let Ok(mut c) = cluster.client_of(i).await {
                let r = c
                    .get_job(v1::GetJobRequest {
                        job_id: job.clone(),
                        linearizable: true,
                    })
                    .await;
                if let Ok(r) = r
                    && let Some(j) = r.into_inner().job
                {
                    let mut h = history.lock().unwrap_or_else(|p| p.into_inner());
                    let completed = h.us();
                    h.reads.push(Read {
                        job_id: job,
                        invoked_us: invoked,
                        completed_us: completed,
                        version: Version::of(
                            &j.state,
                            j.state_changes,
                            j.restarts_used,
                            j.ranks.iter().map(|r| r.attempt),
                        ),
                    });
                }
            }
            "read"
        };
        *history
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .ops
            .entry(kind.into())
            .or_default() += 1;
        tokio::time::sleep(Duration::from_millis(rng.random_range(20..200))).await;
    }
}

fn alive(p: &crate::Proc) -> bool {
    p.child.is_some()
}

fn signal(p: &crate::Proc, s: Signal) {
    if let Some(pid) = p.pid() {
        let _ = kill(Pid::from_raw(pid as i32), s);
    }
}

/// Puts every process back: heals links, resumes and restarts what is down.
fn repair(cluster: &mut Cluster) -> anyhow::Result<()> {
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
async fn hang_rank(
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

/// Injects one random fault, holds it for a random while, then repairs.
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

/// Longest one call of the harness's own may take (a connection to a dead or cut-off
/// coordinator never answers).
const HARNESS_CALL: Duration = Duration::from_secs(5);

/// Sends `ResumeJob` for `job_id` until a leader accepts it, the job is not paused or
/// pausing any more, or `deadline` passes; every call bounded by [`HARNESS_CALL`].
async fn resume_until_accepted(cluster: &Cluster, job_id: &str, deadline: Duration) {
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

async fn one_fault(
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

/// Records an anomaly of the cluster (not of one job).
fn cluster_anomaly(anomalies: &mut Vec<Anomaly>, what: String) {
    anomalies.push(Anomaly {
        job_id: "-".into(),
        what,
    });
}

/// Flips one random bit of `file` among its bytes up to its last non-zero one (where
/// what was written ends; a preallocated zero tail is never read) and syncs it. Returns
/// the offset and the bit's mask; `None` (nothing flipped) when every byte is zero.
fn flip_a_bit(file: &Path, rng: &mut StdRng) -> anyhow::Result<Option<(u64, u8)>> {
    use std::os::unix::fs::FileExt;
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let Some(last) = bytes.iter().rposition(|b| *b != 0) else {
        return Ok(None);
    };
    let at = rng.random_range(0..=last);
    let mask = 1u8 << rng.random_range(0..8u32);
    let f = std::fs::OpenOptions::new().write(true).open(file)?;
    f.write_all_at(&[bytes[at] ^ mask], at as u64)?;
    f.sync_all()?;
    Ok(Some((at as u64, mask)))
}

/// The exit status of coordinator `i` when it has exited (it is then reaped and
/// forgotten: [`repair`] would start it again), `None` while it runs.
fn reap_coordinator(
    cluster: &mut Cluster,
    i: usize,
) -> anyhow::Result<Option<std::process::ExitStatus>> {
    let Some(child) = cluster.coordinators[i].proc.child.as_mut() else {
        anyhow::bail!("coordinator {} is not running", cluster.coordinators[i].id);
    };
    let status = child.try_wait()?;
    if status.is_some() {
        cluster.coordinators[i].proc.child = None;
    }
    Ok(status)
}

/// Length of a log file (where what a process writes next starts).
fn log_len(log: &Path) -> u64 {
    std::fs::metadata(log).map_or(0, |m| m.len())
}

/// What a process wrote to `log` after byte `from`.
fn log_since(log: &Path, from: u64) -> String {
    let bytes = std::fs::read(log).unwrap_or_default();
    String::from_utf8_lossy(bytes.get(from as usize..).unwrap_or_default()).into_owned()
}

/// Stops follower `i`, flips one bit among the records of its raft log's newest segment
/// that holds any, and restarts it: it must refuse to start (an anomaly if it runs).
/// Then rebuilds it as an operator would ([`rebuild_coordinator`]).
async fn corrupt_and_rebuild(
    cluster: &mut Cluster,
    i: usize,
    rng: &mut StdRng,
    anomalies: &mut Vec<Anomaly>,
) -> anyhow::Result<()> {
    cluster.coordinators[i].proc.kill9();
    let wal = cluster.coordinators[i].data_dir.join("raft").join("wal");
    let mut segments: Vec<PathBuf> = std::fs::read_dir(&wal)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    segments.sort();
    let mut flipped = false;
    for seg in segments.iter().rev() {
        if flip_a_bit(seg, rng)?.is_some() {
            flipped = true;
            break;
        }
    }
    if !flipped {
        return Ok(()); // nothing written yet: an ordinary restart
    }
    let id = cluster.coordinators[i].id;
    cluster.spawn_coordinator(i)?;
    let give_up = Instant::now() + LONG;
    let exited = loop {
        if let Some(status) = reap_coordinator(cluster, i)? {
            break Some(status);
        }
        if Instant::now() > give_up {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    if exited.is_none_or(|s| s.success()) {
        cluster_anomaly(
            anomalies,
            format!(
                "coordinator {id} started (or did not exit within {LONG:?}) with a flipped bit in its raft log"
            ),
        );
        return Ok(());
    }
    rebuild_coordinator(cluster, i, anomalies).await
}

/// Rebuilds coordinator `i`, down with a damaged data dir, as an operator would:
/// `cluster remove`, a restart with `--rejoin-empty` (which moves the data dir aside),
/// `cluster add-learner`, `cluster promote`. A step that fails is an anomaly.
async fn rebuild_coordinator(
    cluster: &mut Cluster,
    i: usize,
    anomalies: &mut Vec<Anomaly>,
) -> anyhow::Result<()> {
    /// Runs cumulusctl; its stderr is the error when it fails.
    fn ctl(cluster: &Cluster, args: &[&str]) -> anyhow::Result<()> {
        let out = cluster.cumulusctl(args)?;
        anyhow::ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }
    let id = cluster.coordinators[i].id;
    if let Err(e) = ctl(cluster, &["cluster", "remove", &id.to_string()]) {
        cluster_anomaly(
            anomalies,
            format!("cannot remove damaged coordinator {id}: {e}"),
        );
        return Ok(());
    }
    // `--rejoin-empty` checks the membership with every other coordinator: it gets all
    // of them as peers, even on a node that joined before (a second corruption).
    cluster.coordinators[i].extra_args = vec!["--rejoin-empty".into()];
    cluster.coordinators[i].join = false;
    // `--rejoin-empty` asks the others whether it is still a voter; one that has not
    // applied the removal yet says so, and the node exits: start it again (bounded).
    let mut attempts = 0;
    loop {
        attempts += 1;
        cluster.spawn_coordinator(i)?;
        let settled = Instant::now() + Duration::from_secs(5);
        let mut exited = false;
        while Instant::now() < settled {
            if reap_coordinator(cluster, i)?.is_some() {
                exited = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !exited {
            break;
        }
        if attempts >= 10 {
            cluster_anomaly(
                anomalies,
                format!(
                    "coordinator {id} started with --rejoin-empty exited {attempts} times after its removal"
                ),
            );
            return Ok(());
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // From now on it is a member that joined: a later restart must never bootstrap.
    cluster.coordinators[i].extra_args.clear();
    cluster.coordinators[i].join = true;
    let addr = cluster.member_addr(i);
    let id_text = id.to_string();
    for step in [
        vec!["cluster", "add-learner", id_text.as_str(), addr.as_str()],
        vec!["cluster", "promote", id_text.as_str()],
    ] {
        if let Err(e) = ctl(cluster, &step) {
            cluster_anomaly(
                anomalies,
                format!("cannot rebuild coordinator {id} ({step:?}): {e}"),
            );
            return Ok(());
        }
    }
    Ok(())
}

/// How long a follower restarted with a flipped bit in its sled database may take to
/// either refuse to start or be a caught-up member again.
pub const SLED_RESTART_DEADLINE: Duration = Duration::from_secs(120);

/// The generation file of the raft metadata, beside sled's files
/// (`cumulus_raft_store::record::GENERATION_FILE`).
const GENERATION_FILE: &str = "meta.generation";

/// The file of a stopped coordinator's raft directory to damage: sled's log (`db`) half
/// the time, the generation file a quarter, otherwise one of sled's other files (`conf`,
/// its snapshots `snap.*`, `blobs/*`), each as likely; `db` when the one chosen does not
/// exist. `None` when there is no sled database yet.
fn pick_sled_file(raft: &Path, rng: &mut StdRng) -> anyhow::Result<Option<PathBuf>> {
    let mut others = Vec::new();
    for e in std::fs::read_dir(raft)? {
        let path = e?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name == "blobs" && path.is_dir() {
            for b in std::fs::read_dir(&path)? {
                let b = b?.path();
                if b.is_file() {
                    others.push(b);
                }
            }
        } else if path.is_file() && name != "db" && name != GENERATION_FILE {
            others.push(path);
        }
    }
    others.sort();
    let db = raft.join("db");
    let pick = match rng.random_range(0..4u32) {
        0 | 1 => db.clone(),
        2 => raft.join(GENERATION_FILE),
        _ if !others.is_empty() => others[rng.random_range(0..others.len())].clone(),
        _ => db.clone(),
    };
    Ok([pick, db].into_iter().find(|p| p.is_file()))
}

/// Whether a refusal's message says what is damaged (sled's database, one of its
/// records, or the generation file).
fn names_the_damage(message: &str) -> bool {
    ["sled", "generation file", "corrupt", "damaged"]
        .iter()
        .any(|w| message.contains(w))
}

/// The line of a coordinator's log that says why it exited (`Error: ...`, as its `main`
/// prints it), else its last line; at most 400 characters.
fn exit_message(log: &str) -> String {
    let line = log
        .lines()
        .find(|l| l.starts_with("Error:"))
        .or_else(|| log.lines().rev().find(|l| !l.trim().is_empty()))
        .unwrap_or("");
    line.chars().take(400).collect()
}

/// `fut`, bounded by [`HARNESS_CALL`]; `None` when it did not answer in time.
async fn bounded<T>(fut: impl std::future::Future<Output = Option<T>>) -> Option<T> {
    tokio::time::timeout(HARNESS_CALL, fut).await.ok().flatten()
}

/// The `corrupt-follower-sled` fault: stops follower `i`, flips one random bit of its
/// sled database or of its generation file ([`pick_sled_file`]), and restarts it.
/// Either it refuses to start, exiting non-zero with a message naming the damage, and is
/// rebuilt ([`rebuild_coordinator`]); or the bit lay in bytes nobody reads (sled's free
/// space, old pages) and it becomes a caught-up member again within
/// [`SLED_RESTART_DEADLINE`], holding every job the leader listed before the kill.
/// Anomalies: it exits 0, panics, or exits without naming the damage; it restarts at a
/// term below the one it had, or leads at a term below the cluster's; it misses a job;
/// it neither exits nor catches up in time (then it is stopped and rebuilt).
async fn corrupt_sled(
    cluster: &mut Cluster,
    i: usize,
    rng: &mut StdRng,
    report: &mut Report,
    anomalies: &mut Vec<Anomaly>,
) -> anyhow::Result<()> {
    let id = cluster.coordinators[i].id;
    let anomalies_before = anomalies.len();
    // Before the kill: the node's own term (restarting below it means it lost its vote),
    // every job the leader lists, and then the leader's commit index (the restarted node
    // holds them all once it has applied that far).
    let own_term = bounded(cluster.status_of(i)).await.map(|s| s.term);
    let listed: Option<Vec<String>> = bounded(async {
        let mut c = cluster.leader_client().await.ok()?;
        let r = c
            .list_jobs(v1::ListJobsRequest { linearizable: true })
            .await
            .ok()?;
        Some(r.into_inner().jobs.into_iter().map(|j| j.id).collect())
    })
    .await;
    let leader_status = bounded(async {
        let leader = cluster.status().await?.leader_id?;
        cluster.status_of(cluster.index_of(leader)?).await
    })
    .await;
    let cluster_term = leader_status.as_ref().map_or(0, |s| s.term);
    let caught_up_at = leader_status
        .as_ref()
        .and_then(|s| s.commit_index)
        .unwrap_or(0);

    cluster.coordinators[i].proc.kill9();
    let data_dir = cluster.coordinators[i].data_dir.clone();
    let raft = data_dir.join("raft");
    let Some(file) = pick_sled_file(&raft, rng)? else {
        return Ok(()); // no sled database yet: an ordinary restart
    };
    let Some((at, mask)) = flip_a_bit(&file, rng)? else {
        return Ok(());
    };
    let place = format!(
        "coordinator {id}: bit {mask:#04x} of byte {at} of {}",
        file.strip_prefix(&data_dir).unwrap_or(&file).display()
    );
    eprintln!("nemesis: corrupt-follower-sled: flipped {place}");
    let log = cluster.coordinators[i].proc.log.clone();
    let from = log_len(&log);
    cluster.spawn_coordinator(i)?;
    let started = Instant::now();
    let mut answered = false;
    let mut lower_term_seen = false;
    let mut led_stale = false;
    let mut exited = None;
    let mut healthy = false;
    while started.elapsed() < SLED_RESTART_DEADLINE {
        if let Some(status) = reap_coordinator(cluster, i)? {
            exited = Some(status);
            break;
        }
        if let Some(s) = bounded(cluster.status_of(i)).await {
            answered = true;
            if let Some(before) = own_term
                && s.term < before
                && !lower_term_seen
            {
                lower_term_seen = true;
                cluster_anomaly(
                    anomalies,
                    format!(
                        "{place}: it restarted at term {} below its term {before} before the kill (a lost vote)",
                        s.term
                    ),
                );
            }
            if s.leader_id == Some(id) && s.term < cluster_term && !led_stale {
                led_stale = true;
                cluster_anomaly(
                    anomalies,
                    format!(
                        "{place}: it serves as leader at term {} below the cluster's term {cluster_term}",
                        s.term
                    ),
                );
            }
            let member = s.members.iter().any(|m| m.node_id == id && m.voter);
            if s.leader_id.is_some() && member && s.last_applied_index.unwrap_or(0) >= caught_up_at
            {
                healthy = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let outcome = if let Some(status) = exited {
        let said = log_since(&log, from);
        let message = exit_message(&said);
        if status.success() {
            cluster_anomaly(
                anomalies,
                format!("{place}: it exited 0 after its restart: {message}"),
            );
        } else if said.contains("panicked") {
            cluster_anomaly(
                anomalies,
                format!("{place}: it panicked instead of refusing to start: {message}"),
            );
        } else if !names_the_damage(&message) {
            cluster_anomaly(
                anomalies,
                format!("{place}: it exited ({status}) without naming the damage: {message}"),
            );
        }
        rebuild_coordinator(cluster, i, anomalies).await?;
        // A node that answered first stopped later on (fail-stop on damage it read).
        let when = if answered { " after it answered" } else { "" };
        format!("refused ({status}){when}: {message}")
    } else if healthy {
        // Every job the leader listed before the kill, in the node's own state.
        if let Some(listed) = &listed {
            let local: Option<Vec<String>> = bounded(async {
                let mut c = cluster.client_of(i).await.ok()?;
                let r = c
                    .list_jobs(v1::ListJobsRequest {
                        linearizable: false,
                    })
                    .await
                    .ok()?;
                Some(r.into_inner().jobs.into_iter().map(|j| j.id).collect())
            })
            .await;
            match local {
                Some(local) => {
                    let missing: Vec<&String> =
                        listed.iter().filter(|j| !local.contains(j)).collect();
                    if !missing.is_empty() {
                        cluster_anomaly(
                            anomalies,
                            format!(
                                "{place}: caught up to index {caught_up_at} but misses {} jobs: {missing:?}",
                                missing.len()
                            ),
                        );
                    }
                }
                None => cluster_anomaly(
                    anomalies,
                    format!("{place}: caught up but does not list its jobs"),
                ),
            }
        }
        format!(
            "started, a caught-up voter again after {} ms",
            started.elapsed().as_millis()
        )
    } else {
        cluster_anomaly(
            anomalies,
            format!(
                "{place}: it neither refused to start nor caught up (index {caught_up_at}) within {SLED_RESTART_DEADLINE:?}"
            ),
        );
        cluster.coordinators[i].proc.kill9();
        rebuild_coordinator(cluster, i, anomalies).await?;
        "neither refused nor caught up".to_string()
    };
    let kind = if anomalies.len() > anomalies_before {
        "anomaly"
    } else if exited.is_some() {
        "refused"
    } else {
        "started"
    };
    eprintln!("nemesis: corrupt-follower-sled: {place}: {kind}: {outcome}");
    *report.sled_outcomes.entry(kind.into()).or_default() += 1;
    report
        .sled_flips
        .push(format!("{place}: {kind}: {outcome}"));
    Ok(())
}

/// Sends every coordinator forged Raft RPCs — a leadership-transfer vote with the client
/// token, a vote from a non-member and a vote of term `u64::MAX` with the peer token, and
/// a vote at term 2^48 with the peer token and a member's own certificate — and records
/// an anomaly for each one not refused.
async fn forge_raft_rpcs(cluster: &Cluster, anomalies: &mut Vec<Anomaly>) {
    use cumulus_api::v1::RaftPayload;
    use cumulus_api::v1::raft_service_client::RaftServiceClient;
    let vote = |candidate: u64, term: u64| {
        RaftPayload {
        body: serde_json::json!({
            "vote": {"leader_id": {"term": term, "node_id": candidate}, "committed": false},
            "last_log_id": {"leader_id": {"term": 1u64 << 40, "node_id": candidate}, "index": 1u64 << 40},
            "leadership_transfer": true,
        })
        .to_string()
        .into_bytes(),
    }
    };
    let members: Vec<u64> = cluster.coordinators.iter().map(|c| c.id).collect();
    let member = members[0];
    for c in &cluster.coordinators {
        if c.proc.child.is_none() {
            continue;
        }
        let Ok(channel) = crate::coordinator_channel(&c.grpc, cluster.client_tls().as_ref()).await
        else {
            continue;
        };
        for (token, rpc, what) in [
            (
                crate::TOKEN,
                vote(member, 1 << 40),
                "a vote with the client token",
            ),
            (
                crate::PEER_TOKEN,
                vote(99, 1 << 40),
                "a vote from a non-member",
            ),
            (
                crate::PEER_TOKEN,
                vote(member, u64::MAX),
                "a vote of term u64::MAX",
            ),
        ] {
            let mut client =
                RaftServiceClient::with_interceptor(channel.clone(), crate::Auth::new(token));
            match client.vote(rpc).await {
                Ok(_) => anomalies.push(Anomaly {
                    job_id: "-".into(),
                    what: format!("coordinator {} granted or answered {what}", c.id),
                }),
                Err(status)
                    if matches!(
                        status.code(),
                        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
                    ) => {}
                Err(_) => {} // unreachable right now (a fault): not a grant
            }
        }
    }
    // The term-bound probe: with the peer token and member 0's own certificate, a vote at
    // 2^48 (far above every node's term) must be refused by every other coordinator: a
    // granted one once left the cluster leaderless for good.
    let Ok(own_tls) = cluster.member_tls(&cumulus_tls::Identity::Coordinator(member)) else {
        return;
    };
    let own_tls = own_tls.or(cluster.client_tls());
    for c in cluster.coordinators.iter().filter(|c| c.id != member) {
        if c.proc.child.is_none() {
            continue;
        }
        let Ok(channel) = crate::coordinator_channel(&c.grpc, own_tls.as_ref()).await else {
            continue;
        };
        let mut client =
            RaftServiceClient::with_interceptor(channel, crate::Auth::new(crate::PEER_TOKEN));
        if client.vote(vote(member, 1 << 48)).await.is_ok() {
            anomalies.push(Anomaly {
                job_id: "-".into(),
                what: format!(
                    "coordinator {} answered a member's vote at term 2^48 instead of refusing it",
                    c.id
                ),
            });
        }
    }
}

/// Connections opened against each listener by [`flood_listeners`].
const FLOOD_CONNECTIONS: usize = 600;

/// The HTTP/2 client connection preface (RFC 9113, section 3.4): what a connection that
/// never opens a stream sends.
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Opens [`FLOOD_CONNECTIONS`] connections to every coordinator's gRPC and HTTP port and
/// every agent's API and rank API, holds them for `hold`, then closes them. Every other
/// connection is silent; the rest complete the TLS handshake where the port is TLS and
/// send the HTTP/2 preface, then nothing (the HTTP/2 idle flood: such connections were
/// once kept forever).
async fn flood_listeners(cluster: &Cluster, hold: Duration) {
    use cumulus_tls::ExpectedServer;
    // (address, whom its certificate names when the cluster is TLS)
    let mut targets: Vec<(String, Option<ExpectedServer>)> = Vec::new();
    for c in &cluster.coordinators {
        let me = Some(ExpectedServer::Coordinator(c.id));
        targets.push((c.grpc_listen.clone(), me.clone()));
        targets.push((c.http.clone(), me));
    }
    for w in &cluster.workers {
        let info = cluster.dir.path().join(&w.name).join("agent.json");
        if let Ok(v) = std::fs::read(&info)
            .map_err(anyhow::Error::from)
            .and_then(|b| Ok(serde_json::from_slice::<serde_json::Value>(&b)?))
        {
            if let Some(a) = v["listen_addr"].as_str() {
                targets.push((a.to_string(), Some(ExpectedServer::Worker(w.name.clone()))));
            }
            // The rank-local API is plaintext on loopback.
            if let Some(a) = v["rank_api_addr"].as_str() {
                targets.push((a.to_string(), None));
            }
        }
    }
    let ca_pem = cluster.client_tls().map(|t| t.ca_pem);
    // Held only to be dropped: plain streams and TLS streams alike.
    let mut open: Vec<Box<dyn std::any::Any + Send>> = Vec::new();
    for (t, expected) in &targets {
        let tls = match (&ca_pem, expected) {
            (Some(ca), Some(expected)) => {
                match cumulus_tls::client_config_from_pem(ca, None, expected.clone()) {
                    Ok(config) => {
                        let mut config = (*config).clone();
                        config.alpn_protocols = vec![b"h2".to_vec()];
                        Some(tokio_rustls::TlsConnector::from(Arc::new(config)))
                    }
                    Err(_) => None,
                }
            }
            _ => None,
        };
        for k in 0..FLOOD_CONNECTIONS {
            let Ok(Ok(conn)) =
                tokio::time::timeout(Duration::from_secs(1), tokio::net::TcpStream::connect(t))
                    .await
            else {
                break;
            };
            if k % 2 == 0 {
                open.push(Box::new(conn));
                continue;
            }
            let preface = async {
                use tokio::io::AsyncWriteExt;
                match &tls {
                    Some(connector) => {
                        let name =
                            tokio_rustls::rustls::pki_types::ServerName::try_from("localhost")
                                .expect("a valid name");
                        let mut stream = connector.connect(name, conn).await.ok()?;
                        stream.write_all(H2_PREFACE).await.ok()?;
                        Some(Box::new(stream) as Box<dyn std::any::Any + Send>)
                    }
                    None => {
                        let mut conn = conn;
                        conn.write_all(H2_PREFACE).await.ok()?;
                        Some(Box::new(conn) as Box<dyn std::any::Any + Send>)
                    }
                }
            };
            if let Ok(Some(c)) = tokio::time::timeout(Duration::from_secs(2), preface).await {
                open.push(c);
            }
        }
    }
    tokio::time::sleep(hold).await;
    drop(open);
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

fn weights(out: &Path, rank: u32) -> Option<Vec<u8>> {
    std::fs::read(out.join(format!("rank-{rank}/weights.bin"))).ok()
}

/// Runs the trainer job once without faults in `cluster` and returns each rank's
/// weights (the reference of check 4).
async fn reference_weights(
    cluster: &Cluster,
    w: &Workload,
    root: &Path,
    epochs: u32,
) -> anyhow::Result<Vec<Vec<u8>>> {
    let r = cluster
        .submit("reference", trainer(w, root, "reference", epochs, 5))
        .await?;
    let job = cluster.wait_finished(&r.job_id, LONG).await;
    anyhow::ensure!(
        job.job_state() == Ok(JobState::Succeeded),
        "the fault-free run failed: {job:?}"
    );
    (0..TRAINER_WORLD)
        .map(|rank| weights(&root.join("out-reference"), rank).context("reference weights"))
        .collect()
}

/// One nemesis run: a fresh proxied cluster, a fault-free reference run of the trainer,
/// then the workload under faults, then the checks.
///
/// # Errors
/// When the cluster cannot be started or repaired (not an anomaly: a harness failure).
pub async fn run(opts: &RunOpts) -> anyhow::Result<Report> {
    let started = Instant::now();
    eprintln!(
        "nemesis: seed {} ({} ms of faults)",
        opts.seed, opts.fault_ms
    );
    if let Some(only) = &opts.only {
        anyhow::ensure!(
            FAULTS.contains(&only.as_str()),
            "unknown fault {only:?} (known: {FAULTS:?})"
        );
    }
    let mut cluster = Cluster::start(ClusterOpts {
        workers: 2,
        slots: 4,
        heartbeat_timeout_ms: HEARTBEAT_TIMEOUT_MS,
        proxied: true,
        ..ClusterOpts::default()
    })
    .await?;
    let root: PathBuf = cluster.dir.path().to_path_buf();
    let sampler = crate::ranks::Sampler::start(
        root.clone(),
        Duration::from_millis(PROC_SAMPLE_MS),
        OVERLAP_LIMIT_MS,
    );
    let w = prepare_digits(&root, 4)?;
    let reference = reference_weights(&cluster, &w, &root, opts.epochs).await?;

    let mut rng = StdRng::seed_from_u64(opts.seed);
    let trainer_job = cluster
        .submit(
            "nemesis-trainer",
            // With a hang to inject first, a slower pace: on a quiet machine the trainer
            // can otherwise finish before the leader has seen its progress.
            trainer(
                &w,
                &root,
                "nemesis",
                opts.epochs,
                if opts.hang_first { 50 } else { 5 },
            ),
        )
        .await?
        .job_id;
    let history = Arc::new(Mutex::new(History {
        start: Some(Instant::now()),
        ..History::default()
    }));
    history
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .acked
        .insert("nemesis-trainer".into(), trainer_job.clone());

    // The nemesis mutates the cluster; clients only need its addresses.
    let stop = tokio_util::sync::CancellationToken::new();
    let mut report = Report {
        seed: opts.seed,
        ..Report::default()
    };
    let mut anomalies: Vec<Anomaly> = Vec::new();
    // The first fault (CI) hangs a trainer rank before the clients start: on a quiet
    // cluster the trainer is placed at once and reports progress within a few heartbeats
    // (with the clients' small jobs competing for slots first, it could finish unseen).
    if opts.hang_first {
        // As soon as a trainer rank reports progress (bounded by LONG).
        let give_up = Instant::now() + LONG;
        let kind = loop {
            if hang_rank(
                &cluster,
                &mut rng,
                &trainer_job,
                &mut report,
                &mut anomalies,
            )
            .await
            .is_some()
            {
                break "hang-rank";
            }
            if Instant::now() > give_up {
                break "none";
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        *report.faults.entry(kind.into()).or_default() += 1;
    }
    let shared = Arc::new(cluster.view());
    let mut tasks = Vec::new();
    for id in 0..opts.clients {
        tasks.push(tokio::spawn(client(
            shared.clone(),
            history.clone(),
            opts.seed,
            id,
            stop.clone(),
        )));
    }
    let deadline = Instant::now() + Duration::from_millis(opts.fault_ms);
    while Instant::now() < deadline {
        let kind = one_fault(
            &mut cluster,
            &mut rng,
            &trainer_job,
            opts.only.as_deref(),
            &mut report,
            &mut anomalies,
        )
        .await?;
        *report.faults.entry(kind.into()).or_default() += 1;
        let calm = rng.random_range(200..1_500);
        tokio::time::sleep(Duration::from_millis(calm)).await;
    }
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    repair(&mut cluster)?;
    cluster.wait_leader(LONG).await;
    report.proxy_drops = cluster.net.dropped();

    let h = std::mem::take(&mut *history.lock().unwrap_or_else(|p| p.into_inner()));
    report.ops = h.ops.clone();
    report.acked_submits = h.acked.len() as u64;
    report.reads = h.reads.len() as u64;

    // Everything finishes once the faults stop (liveness): a job still running after
    // LONG is an anomaly, reported with its ranks, not a harness panic.
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
                resume_until_accepted(&cluster, &j.id, left.min(Duration::from_secs(30))).await;
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
    let all = last.context("no leader answered ListJobs after the faults")?;
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
    let trainer_final = all
        .jobs
        .iter()
        .find(|j| j.id == trainer_job)
        .cloned()
        .context("the trainer job is missing from ListJobs")?;

    // 1. Acknowledged submits exactly once; nothing from nowhere.
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

    // 2. Transitions, restart budget and delays.
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

    // 7. Time limits: a job given one never runs much past it, and never succeeds
    // (the small jobs given one sleep far longer).
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

    // 3. Linearizable reads.
    anomalies.extend(check_reads(&h.reads));

    // 5. At most one progressing attempt of a rank, from /proc (every job has finished).
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

    // 4. The trainer: every record once, weights identical to the fault-free run.
    report.trainer_state = trainer_final.state.clone();
    report.trainer_restarts = trainer_final.restarts_used;
    if trainer_final.job_state() == Ok(JobState::Succeeded) {
        let out = root.join("out-nemesis");
        for rank in 0..TRAINER_WORLD {
            let want = expected_digest(&w, TRAINER_WORLD, rank, opts.epochs, &root)?;
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
    report.anomalies = anomalies
        .iter()
        .map(|a| format!("{}: {}", a.job_id, a.what))
        .collect();
    report.wall_ms = started.elapsed().as_millis() as u64;
    if !report.anomalies.is_empty() {
        // Keep the logs of a failing run.
        let kept = cluster.dir.path().to_path_buf();
        eprintln!(
            "nemesis: seed {} FAILED; logs in {}",
            opts.seed,
            kept.display()
        );
        std::mem::forget(std::mem::replace(
            &mut cluster.dir,
            tempfile::Builder::new()
                .prefix("cumulus-nemesis-drop-")
                .tempdir()?,
        ));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flipped_bit_lies_before_the_zero_tail() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("f");
        let before = [0u8, 7, 0, 9, 0, 0, 0];
        for seed in 0..50 {
            std::fs::write(&file, before).expect("write");
            let mut rng = StdRng::seed_from_u64(seed);
            let (at, mask) = flip_a_bit(&file, &mut rng).expect("flip").expect("flipped");
            let after = std::fs::read(&file).expect("read");
            assert!(at <= 3, "offset {at}");
            assert_eq!(mask.count_ones(), 1);
            let changed: Vec<usize> = (0..before.len())
                .filter(|&k| before[k] != after[k])
                .collect();
            assert_eq!(changed, vec![at as usize]);
            assert_eq!(before[at as usize] ^ after[at as usize], mask);
        }
        std::fs::write(&file, [0u8; 16]).expect("write");
        let mut rng = StdRng::seed_from_u64(1);
        assert!(flip_a_bit(&file, &mut rng).expect("read").is_none());
    }

    #[test]
    fn the_sled_file_to_damage_is_never_the_raft_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        let raft = dir.path();
        let mut rng = StdRng::seed_from_u64(7);
        assert!(pick_sled_file(raft, &mut rng).expect("pick").is_none());
        std::fs::create_dir_all(raft.join("blobs")).expect("mkdir");
        std::fs::create_dir_all(raft.join("wal")).expect("mkdir");
        for f in [
            "db",
            "conf",
            GENERATION_FILE,
            "snap.00000000000001B1",
            "blobs/1",
            "wal/0.wal",
        ] {
            std::fs::write(raft.join(f), b"x").expect("write");
        }
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..400 {
            let p = pick_sled_file(raft, &mut rng)
                .expect("pick")
                .expect("a file");
            seen.insert(p.strip_prefix(raft).expect("inside").display().to_string());
        }
        let want: std::collections::BTreeSet<String> = [
            "db",
            "conf",
            GENERATION_FILE,
            "snap.00000000000001B1",
            "blobs/1",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        assert_eq!(seen, want);
    }

    #[test]
    fn a_refusal_must_name_the_damage() {
        let log = "2026-11-28T19:31:02Z  INFO starting\n\
                   Error: the sled database at /d/raft is damaged: Read corrupted data; \
                   refusing to start.\n\nCaused by:\n    Read corrupted data\n";
        let message = exit_message(log);
        assert!(message.starts_with("Error: the sled database"), "{message}");
        assert!(names_the_damage(&message));
        assert!(names_the_damage(
            "Error: cannot use the raft metadata's generation file: /d/raft/meta.generation"
        ));
        assert!(!names_the_damage(
            "Error: address already in use (os error 98)"
        ));
        assert_eq!(exit_message("a\nlast line\n\n"), "last line");
    }
}
