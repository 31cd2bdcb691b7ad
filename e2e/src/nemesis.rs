//! The nemesis suite: a seeded random client workload against a real proxied cluster
//! while a seeded nemesis injects faults, then checks of the recorded history.
//!
//! Faults: SIGKILL + restart of the leader, a follower, a worker agent or a rank;
//! SIGSTOP/SIGCONT of a coordinator or a worker; partitions through the harness's TCP
//! proxies (one coordinator isolated, the leader isolated, a worker cut from every
//! coordinator for longer than its heartbeat timeout).
//!
//! Checks: (1) every acknowledged submit exists exactly once; (2) observed job states
//! follow the state machine, restart counts stay within the budget and delays at or
//! above the policy's minimum; (3) linearizable reads are linearizable
//! ([`crate::history::check_reads`]); (4) a trainer job that succeeded holds every
//! record exactly once and weights byte-identical to a fault-free run.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use cumulus_proto::v1;
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
}

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

fn small_spec(rng: &mut StdRng) -> v1::JobSpec {
    let command: Vec<String> = match rng.random_range(0..4u32) {
        0 => vec!["true".into()],
        1 => vec!["sleep".into(), "0.5".into()],
        2 => vec!["false".into()],
        _ => vec!["sleep".into(), "3".into()],
    };
    v1::JobSpec {
        world_size: rng.random_range(1..=2u32),
        command,
        restart: Some(v1::RestartPolicy {
            max_restarts: Some(SMALL_RESTARTS),
            backoff_initial_ms: Some(SMALL_BACKOFF_MS),
            backoff_max_ms: Some(SMALL_BACKOFF_MS * 4),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn trainer(w: &Workload, root: &Path, name: &str, epochs: u32) -> v1::JobSpec {
    let args = [
        "--epochs".to_string(),
        epochs.to_string(),
        "--ckpt-every".into(),
        "10".into(),
        "--step-sleep-ms".into(),
        "5".into(),
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

/// Injects one random fault, holds it for a random while, then repairs.
async fn one_fault(
    cluster: &mut Cluster,
    rng: &mut StdRng,
    trainer_job: &str,
) -> anyhow::Result<&'static str> {
    let leader = cluster.status().await.and_then(|s| s.leader_id);
    let li = leader.and_then(|l| cluster.index_of(l));
    let followers: Vec<usize> = (0..cluster.coordinators.len())
        .filter(|i| Some(*i) != li)
        .collect();
    let hold = Duration::from_millis(rng.random_range(500..2_500));
    let kind = match rng.random_range(0..9u32) {
        0 => {
            let Some(i) = li else { return Ok("none") };
            cluster.coordinators[i].proc.kill9();
            tokio::time::sleep(hold).await;
            "kill-leader"
        }
        1 => {
            let i = followers[rng.random_range(0..followers.len())];
            cluster.coordinators[i].proc.kill9();
            tokio::time::sleep(hold).await;
            "kill-follower"
        }
        2 => {
            let i = rng.random_range(0..cluster.workers.len());
            cluster.workers[i].kill9();
            tokio::time::sleep(hold).await;
            "kill-worker"
        }
        3 => {
            let job = cluster.job(trainer_job).await;
            let pids: Vec<u32> = job
                .map(|j| {
                    j.ranks
                        .iter()
                        .filter(|r| r.state == "running")
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
        4 => {
            let i = rng.random_range(0..cluster.coordinators.len());
            signal(&cluster.coordinators[i].proc, Signal::SIGSTOP);
            tokio::time::sleep(hold).await;
            signal(&cluster.coordinators[i].proc, Signal::SIGCONT);
            "stop-coordinator"
        }
        5 => {
            let i = rng.random_range(0..cluster.workers.len());
            signal(&cluster.workers[i], Signal::SIGSTOP);
            tokio::time::sleep(hold).await;
            signal(&cluster.workers[i], Signal::SIGCONT);
            "stop-worker"
        }
        6 => {
            let i = followers[rng.random_range(0..followers.len())];
            isolate_coordinator(cluster, i);
            tokio::time::sleep(hold).await;
            "partition-follower"
        }
        7 => {
            let Some(i) = li else { return Ok("none") };
            isolate_coordinator(cluster, i);
            tokio::time::sleep(hold).await;
            "partition-leader"
        }
        _ => {
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
        .submit("reference", trainer(w, root, "reference", epochs))
        .await?;
    let job = cluster.wait_finished(&r.job_id, LONG).await;
    anyhow::ensure!(
        job.state == "succeeded",
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
    let mut cluster = Cluster::start(ClusterOpts {
        workers: 2,
        slots: 4,
        heartbeat_timeout_ms: HEARTBEAT_TIMEOUT_MS,
        proxied: true,
        ..ClusterOpts::default()
    })
    .await?;
    let root: PathBuf = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 4)?;
    let reference = reference_weights(&cluster, &w, &root, opts.epochs).await?;

    let mut rng = StdRng::seed_from_u64(opts.seed);
    let trainer_job = cluster
        .submit(
            "nemesis-trainer",
            trainer(&w, &root, "nemesis", opts.epochs),
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
        let kind = one_fault(&mut cluster, &mut rng, &trainer_job).await?;
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
    let mut anomalies: Vec<Anomaly> = Vec::new();

    // Everything finishes once the faults stop.
    let trainer_final = cluster.wait_finished(&trainer_job, LONG).await;
    let all = crate::wait_for("every job to finish", LONG, || async {
        let mut c = cluster.leader_client().await.ok()?;
        let list = c
            .list_jobs(v1::ListJobsRequest { linearizable: true })
            .await
            .ok()?
            .into_inner();
        list.jobs
            .iter()
            .all(|j| matches!(j.state.as_str(), "succeeded" | "failed" | "cancelled"))
            .then_some(list)
    })
    .await;

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

    // 3. Linearizable reads.
    anomalies.extend(check_reads(&h.reads));

    // 4. The trainer: every record once, weights identical to the fault-free run.
    report.trainer_state = trainer_final.state.clone();
    report.trainer_restarts = trainer_final.restarts_used;
    if trainer_final.state == "succeeded" {
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
