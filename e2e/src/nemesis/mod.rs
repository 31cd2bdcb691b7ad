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
//! The parts, in the order of a run ([`run`]): `clients` (the workload), `faults` (the
//! schedule and the process and network faults), `storage` (damaged logs and sled
//! databases, rebuilds), `hostile` (forged Raft RPCs, listener floods), `checks` (the
//! history checks). The workload, the fault schedule and the checks share one seeded
//! random stream and one recorded history: replaying a seed needs their draws in one
//! order, which [`run`] keeps visible phase by phase.

use cumulus_api::JobState;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use cumulus_api::v1;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

mod checks;
mod clients;
mod faults;
mod hostile;
mod storage;

use clients::{client, trainer};
use faults::{hang_rank, one_fault, repair};

use crate::history::{Anomaly, Read, check_reads};
use crate::{Cluster, ClusterOpts, Workload, prepare_digits};

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

/// Longest one call of the harness's own may take (a connection to a dead or cut-off
/// coordinator never answers).
const HARNESS_CALL: Duration = Duration::from_secs(5);

/// How long a follower restarted with a flipped bit in its sled database may take to
/// either refuse to start or be a caught-up member again.
pub const SLED_RESTART_DEADLINE: Duration = Duration::from_secs(120);

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

/// What the start of a run sets up before any fault: the proxied cluster, the `/proc`
/// sampler, the dataset and the trainer's fault-free weights.
struct Setup {
    cluster: Cluster,
    root: PathBuf,
    sampler: crate::ranks::Sampler,
    w: Workload,
    reference: Vec<Vec<u8>>,
}

/// One nemesis run: a fresh proxied cluster, a fault-free reference run of the trainer,
/// then the workload under faults, then the checks.
///
/// # Errors
/// When the cluster cannot be started or repaired (not an anomaly: a harness failure).
pub async fn run(opts: &RunOpts) -> anyhow::Result<Report> {
    let started = Instant::now();
    let Setup {
        mut cluster,
        root,
        sampler,
        w,
        reference,
    } = start(opts).await?;

    let mut rng = StdRng::seed_from_u64(opts.seed);
    let trainer_job = submit_trainer(&cluster, &w, &root, opts).await?;
    let history = Arc::new(Mutex::new(History {
        start: Some(Instant::now()),
        ..History::default()
    }));
    history
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .acked
        .insert("nemesis-trainer".into(), trainer_job.clone());

    let mut report = Report {
        seed: opts.seed,
        ..Report::default()
    };
    let mut anomalies: Vec<Anomaly> = Vec::new();
    if opts.hang_first {
        hang_first(
            &cluster,
            &mut rng,
            &trainer_job,
            &mut report,
            &mut anomalies,
        )
        .await;
    }
    faults_under_workload(
        &mut cluster,
        &mut rng,
        &trainer_job,
        opts,
        &history,
        &mut report,
        &mut anomalies,
    )
    .await?;
    heal(&mut cluster, &mut report).await?;

    let h = std::mem::take(&mut *history.lock().unwrap_or_else(|p| p.into_inner()));
    report.ops = h.ops.clone();
    report.acked_submits = h.acked.len() as u64;
    report.reads = h.reads.len() as u64;

    // Everything finishes once the faults stop (liveness): a job still running after
    // LONG is an anomaly, reported with its ranks, not a harness panic.
    let all = checks::wait_until_finished(&cluster).await?;
    checks::liveness(&all, &mut anomalies);
    let trainer_final = all
        .jobs
        .iter()
        .find(|j| j.id == trainer_job)
        .cloned()
        .context("the trainer job is missing from ListJobs")?;
    checks::submits_exactly_once(&all, &h, &mut anomalies);
    checks::transitions_and_restarts(&all, &h, &mut anomalies);
    checks::time_limits(&all, &mut anomalies);
    // 3. Linearizable reads.
    anomalies.extend(check_reads(&h.reads));
    checks::one_attempt_at_a_time(sampler, &mut report, &mut anomalies);
    checks::trainer_result(
        &trainer_final,
        &w,
        &root,
        opts.epochs,
        &reference,
        &mut report,
        &mut anomalies,
    )?;

    finish_report(&mut cluster, opts, started, report, &anomalies)
}

/// The start of a run: checks the options, starts the proxied cluster and the `/proc`
/// sampler, prepares the dataset and runs the trainer once without faults.
async fn start(opts: &RunOpts) -> anyhow::Result<Setup> {
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
    let cluster = Cluster::start(ClusterOpts {
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
    Ok(Setup {
        cluster,
        root,
        sampler,
        w,
        reference,
    })
}

/// Submits the trainer job that runs under the faults; returns its id.
async fn submit_trainer(
    cluster: &Cluster,
    w: &Workload,
    root: &Path,
    opts: &RunOpts,
) -> anyhow::Result<String> {
    Ok(cluster
        .submit(
            "nemesis-trainer",
            // With a hang to inject first, a slower pace: on a quiet machine the trainer
            // can otherwise finish before the leader has seen its progress.
            trainer(
                w,
                root,
                "nemesis",
                opts.epochs,
                if opts.hang_first { 50 } else { 5 },
            ),
        )
        .await?
        .job_id)
}

/// The first fault (CI) hangs a trainer rank before the clients start: on a quiet
/// cluster the trainer is placed at once and reports progress within a few heartbeats
/// (with the clients' small jobs competing for slots first, it could finish unseen).
async fn hang_first(
    cluster: &Cluster,
    rng: &mut StdRng,
    trainer_job: &str,
    report: &mut Report,
    anomalies: &mut Vec<Anomaly>,
) {
    // As soon as a trainer rank reports progress (bounded by LONG).
    let give_up = Instant::now() + LONG;
    let kind = loop {
        if hang_rank(cluster, rng, trainer_job, report, anomalies)
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

/// The clients' workload runs while the nemesis injects one fault after another for
/// `opts.fault_ms`; then the clients stop.
async fn faults_under_workload(
    cluster: &mut Cluster,
    rng: &mut StdRng,
    trainer_job: &str,
    opts: &RunOpts,
    history: &Arc<Mutex<History>>,
    report: &mut Report,
    anomalies: &mut Vec<Anomaly>,
) -> anyhow::Result<()> {
    // The nemesis mutates the cluster; clients only need its addresses.
    let stop = tokio_util::sync::CancellationToken::new();
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
            cluster,
            rng,
            trainer_job,
            opts.only.as_deref(),
            report,
            anomalies,
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
    Ok(())
}

/// After the faults: every link healed, every process back, a leader elected.
async fn heal(cluster: &mut Cluster, report: &mut Report) -> anyhow::Result<()> {
    repair(cluster)?;
    cluster.wait_leader(LONG).await;
    report.proxy_drops = cluster.net.dropped();
    Ok(())
}

/// The report's last fields: the anomalies as text and the wall time; a failing run
/// keeps its cluster's logs.
fn finish_report(
    cluster: &mut Cluster,
    opts: &RunOpts,
    started: Instant,
    mut report: Report,
    anomalies: &[Anomaly],
) -> anyhow::Result<Report> {
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
