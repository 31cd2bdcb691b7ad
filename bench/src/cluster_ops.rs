//! Failure scenarios on a running cluster (issue 3, measurements 2–4):
//! leader failover, rank failure to restart, worker expiry.
//!
//! Times stamped by the leader (`failed_at_ms`, `started_at_ms`, `not_before_ms`) and
//! the kill time taken here come from the same machine's clock, so their differences
//! are meaningful; everything else is measured with `Instant`.

use cumulus_api::JobState;
use cumulus_api::RankPhase;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cumulus_api::v1;
use cumulus_e2e::{Cluster, ClusterOpts, make_named_files, prepare_digits, trainer_spec, wait_for};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::Ctx;
use crate::report::{Row, ms, percentile};

const DEADLINE: Duration = Duration::from_secs(120);

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// One write (a tiny submit) through whichever live coordinator leads now; each
/// coordinator is tried once with a short timeout. Ok(()) when acknowledged.
async fn try_write(cluster: &Cluster, request_id: &str) -> anyhow::Result<()> {
    let spec = v1::JobSpec {
        world_size: 1,
        command: vec!["true".into()],
        ..Default::default()
    };
    for (i, c) in cluster.coordinators.iter().enumerate() {
        if c.proc.child.is_none() {
            continue;
        }
        let Ok(Ok(mut client)) =
            tokio::time::timeout(Duration::from_millis(300), cluster.client_of(i)).await
        else {
            continue;
        };
        let req = v1::SubmitJobRequest {
            allow_pending: false,
            request_id: request_id.into(),
            spec: Some(spec.clone()),
        };
        if let Ok(Ok(_)) =
            tokio::time::timeout(Duration::from_millis(500), client.submit_job(req)).await
        {
            return Ok(());
        }
    }
    anyhow::bail!("no coordinator acknowledged the write")
}

/// Leader failover: `kill -9` of the leader under a light write load; time from the kill
/// to the first acknowledged write (through the new leader). The killed node is
/// restarted on its data dir and caught up before the next round.
pub async fn failover(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    let rounds = ctx.pick(20, 2);
    let mut cluster = Cluster::start(ClusterOpts {
        workers: 0,
        ..ClusterOpts::default()
    })
    .await?;
    let mut samples = Vec::new();
    let mut seq = 0u64;
    for round in 0..rounds {
        // Light load: a write every ~20 ms until the round's kill.
        for _ in 0..5 {
            seq += 1;
            try_write(&cluster, &format!("fo-{seq}")).await?;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let leader = cluster.wait_leader(DEADLINE).await;
        let i = cluster
            .coordinators
            .iter()
            .position(|c| c.id == leader)
            .expect("leader is a member");
        let killed = Instant::now();
        cluster.coordinators[i].proc.kill9();
        loop {
            seq += 1;
            if try_write(&cluster, &format!("fo-{seq}")).await.is_ok() {
                break;
            }
            anyhow::ensure!(
                killed.elapsed() < DEADLINE,
                "no write acknowledged {DEADLINE:?} after the kill"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let took = killed.elapsed();
        samples.push(ms(took));
        eprintln!(
            "   round {round}: leader {leader} killed -> write acknowledged in {:.0} ms",
            ms(took)
        );
        cluster.spawn_coordinator(i)?;
        // Caught up: the restarted node knows the leader and has applied the newest write.
        let id = cluster.coordinators[i].id;
        let target = format!("fo-{seq}");
        wait_for(
            "the restarted coordinator to catch up",
            DEADLINE,
            || async {
                let mut c = cluster.client_of(i).await.ok()?;
                let s = c
                    .cluster_status(v1::ClusterStatusRequest {})
                    .await
                    .ok()?
                    .into_inner();
                let jobs = c
                    .list_jobs(v1::ListJobsRequest {
                        linearizable: false,
                    })
                    .await
                    .ok()?
                    .into_inner();
                (s.node_id == id
                    && s.leader_id.is_some()
                    && jobs.jobs.iter().any(|j| j.request_id == target))
                .then_some(())
            },
        )
        .await;
    }
    let n = samples.len();
    Ok(vec![
        Row::new(
            "failover",
            "kill leader -> acked write p50",
            percentile(&samples, 50.0),
            "ms",
            n,
        ),
        Row::below(
            "failover",
            "kill leader -> acked write p99",
            percentile(&samples, 99.0),
            "ms",
            n,
            1000.0,
        ),
        Row::new(
            "failover",
            "kill leader -> acked write max",
            percentile(&samples, 100.0),
            "ms",
            n,
        ),
    ])
}

/// Rank failure to restart: `kill -9` of a rank of a running trainer, rank scope,
/// backoff fixed at 200 ms. (a) kill → `RankExited` committed (the leader's stamp);
/// (b) the new attempt started, minus the end of its backoff; (c) kill → the first
/// progress report of the resumed attempt past its resume step, as the leader sees it
/// (progress reaches the leader in heartbeats, every 1 s).
pub async fn rank_restart(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    rank_restart_as(ctx, "rank_restart", None).await
}

/// [`rank_restart`] with the worker running ranks as other users (`--run-as
/// 62000-62999`: staging given to the rank, parts sealed at commit, the rank-local API
/// on the Unix socket). Needs root; without it, no rows.
pub async fn rank_restart_run_as(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("   rank_restart_run_as: skipped (--run-as needs root)");
        return Ok(Vec::new());
    }
    rank_restart_as(ctx, "rank_restart_run_as", Some("62000-62999")).await
}

async fn rank_restart_as(
    ctx: &Ctx,
    scenario: &'static str,
    run_as: Option<&str>,
) -> anyhow::Result<Vec<Row>> {
    let rounds = ctx.pick(20, 2);
    let cluster = Cluster::start(ClusterOpts {
        workers: 1,
        worker_args: run_as
            .map(|range| vec!["--run-as".to_string(), range.to_string()])
            .unwrap_or_default(),
        ..ClusterOpts::default()
    })
    .await?;
    let root = ctx.work_dir.join(scenario);
    std::fs::create_dir_all(&root)?;
    if run_as.is_some() {
        // The ranks, as other users, read the shards under the scratch dir and write
        // their results into `out`.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&ctx.work_dir, std::fs::Permissions::from_mode(0o711))?;
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755))?;
        std::fs::create_dir_all(root.join("out"))?;
        std::fs::set_permissions(root.join("out"), std::fs::Permissions::from_mode(0o1777))?;
    }
    let w = prepare_digits(&root, 4)?;
    let args = [
        "--epochs",
        "100000",
        "--ckpt-every",
        "20",
        "--step-sleep-ms",
        "5",
    ];
    let mut spec = trainer_spec(&w, 1, &root.join("ckpt"), &root.join("out"), &args);
    spec.restart = Some(v1::RestartPolicy {
        scope: Some("rank".into()),
        max_restarts: Some(rounds + 1),
        backoff_initial_ms: Some(200),
        backoff_max_ms: Some(200),
    });
    let job_id = cluster.submit(scenario, spec).await?.job_id;
    let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let job = cluster
            .wait_job(&job_id, "the rank running with progress", DEADLINE, |j| {
                let r = &j.ranks[0];
                r.attempt == round
                    && r.phase() == Ok(RankPhase::Running)
                    && r.pid > 0
                    && r.step > 0
                    && j.committed_step.is_some()
            })
            .await;
        let killed_ms = wall_ms();
        let killed = Instant::now();
        kill(Pid::from_raw(job.ranks[0].pid as i32), Signal::SIGKILL)?;
        let restarted = cluster
            .wait_job(&job_id, "the new attempt started", DEADLINE, |j| {
                j.restarts_used == round + 1
                    && j.ranks[0].attempt == round + 1
                    && j.ranks[0].started_at_ms > 0
            })
            .await;
        let restart = restarted.restarts.last().expect("a restart record");
        let resume = restart.resume_step.unwrap_or(0);
        a.push(restart.failed_at_ms.saturating_sub(killed_ms) as f64);
        b.push(
            restarted.ranks[0]
                .started_at_ms
                .saturating_sub(restart.not_before_ms) as f64,
        );
        cluster
            .wait_job(&job_id, "progress past the resume step", DEADLINE, |j| {
                j.ranks[0].attempt == round + 1 && j.ranks[0].step > resume
            })
            .await;
        c.push(ms(killed.elapsed()));
        eprintln!(
            "   round {round}: exit committed +{} ms, started {} ms after backoff, progress +{:.0} ms",
            a[a.len() - 1],
            b[b.len() - 1],
            c[c.len() - 1]
        );
    }
    if let Ok(mut client) = cluster.leader_client().await {
        let _ = client.cancel_job(v1::CancelJobRequest { job_id }).await;
    }
    let n = a.len();
    Ok(vec![
        Row::new(
            scenario,
            "(a) kill -> RankExited committed p50",
            percentile(&a, 50.0),
            "ms",
            n,
        ),
        Row::below(
            scenario,
            "(a) kill -> RankExited committed p99",
            percentile(&a, 99.0),
            "ms",
            n,
            100.0,
        ),
        Row::new(
            scenario,
            "(b) new attempt running - backoff p50",
            percentile(&b, 50.0),
            "ms",
            n,
        ),
        Row::below(
            scenario,
            "(b) new attempt running - backoff p99",
            percentile(&b, 99.0),
            "ms",
            n,
            500.0,
        ),
        Row::new(
            scenario,
            "(c) kill -> resumed progress seen p50",
            percentile(&c, 50.0),
            "ms",
            n,
        ),
        Row::new(
            scenario,
            "(c) kill -> resumed progress seen p99",
            percentile(&c, 99.0),
            "ms",
            n,
        ),
    ])
}

/// Worker expiry: `kill -9` of the agent hosting a rank; the expiry time (stamped into
/// the failed rank) minus the kill, compared with the configured timeout. It must be
/// within `timeout ± one heartbeat interval` (the last heartbeat came up to one
/// interval before the kill).
pub async fn worker_expiry(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    let rounds = ctx.pick(5, 1);
    let timeout_ms = 3_000u64;
    let interval_ms = 1_000f64;
    let mut cluster = Cluster::start(ClusterOpts {
        workers: 2,
        heartbeat_timeout_ms: timeout_ms,
        ..ClusterOpts::default()
    })
    .await?;
    let mut deltas = Vec::new();
    for round in 0..rounds {
        let spec = v1::JobSpec {
            world_size: 1,
            command: vec!["sleep".into(), "1000".into()],
            restart: Some(v1::RestartPolicy {
                max_restarts: Some(1),
                ..Default::default()
            }),
            ..Default::default()
        };
        let job_id = cluster
            .submit(&format!("expiry-{round}"), spec)
            .await?
            .job_id;
        let job = cluster
            .wait_job(&job_id, "the rank running", DEADLINE, |j| {
                j.ranks[0].phase() == Ok(RankPhase::Running) && j.ranks[0].pid > 0
            })
            .await;
        let worker = job.ranks[0].worker_id.clone();
        let wi = cluster
            .workers
            .iter()
            .position(|w| w.name == worker)
            .expect("known worker");
        let killed_ms = wall_ms();
        cluster.workers[wi].kill9();
        let moved = cluster
            .wait_job(&job_id, "the expiry", DEADLINE, |j| j.restarts_used == 1)
            .await;
        let expired_at = moved.restarts[0].failed_at_ms;
        let delta = expired_at as f64 - killed_ms as f64 - timeout_ms as f64;
        deltas.push(delta);
        eprintln!(
            "   round {round}: expired {:.0} ms after the kill (timeout {timeout_ms} ms)",
            delta + timeout_ms as f64
        );
        if let Ok(mut client) = cluster.leader_client().await {
            let _ = client.cancel_job(v1::CancelJobRequest { job_id }).await;
        }
        cluster.spawn_worker(wi)?;
        cluster
            .wait_status("the worker registered again", DEADLINE, |s| {
                s.workers
                    .iter()
                    .filter(|w| w.worker_phase() == Ok(cumulus_api::WorkerPhase::Alive))
                    .count()
                    == 2
            })
            .await;
    }
    let n = deltas.len();
    let worst = deltas.iter().fold(0.0f64, |m, d| m.max(d.abs()));
    Ok(vec![
        Row::new(
            "worker_expiry",
            "expiry - kill - timeout p50",
            percentile(&deltas, 50.0),
            "ms",
            n,
        ),
        Row::new(
            "worker_expiry",
            "expiry - kill - timeout min",
            percentile(&deltas, 0.0),
            "ms",
            n,
        ),
        Row::below(
            "worker_expiry",
            "|expiry - kill - timeout| max",
            worst,
            "ms",
            n,
            interval_ms,
        ),
    ])
}

/// Follower catch-up over large entries: a follower is `kill -9`ed, 35 submits of ~2 MB
/// each (7,000 shards with ~290-byte paths; ~70 MB of entries, above the 64 MiB a Raft
/// message may carry) are committed without it, and it is restarted on its data dir.
/// Measured: restart → it has applied the last of them, the rate in MB of entries per
/// second, and the elections (term changes) during the catch-up. No target in the issue;
/// it shows that a request carries a bounded size (8 MiB) and that large requests are
/// encoded and decoded off the runtime threads (docs/architecture.md, "The write path").
pub async fn follower_catchup(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    let rounds = ctx.pick(3, 1);
    let submits = ctx.pick(35, 3);
    let files = ctx.pick(7_000, 500);
    let mut cluster = Cluster::start(ClusterOpts {
        workers: 0,
        ..ClusterOpts::default()
    })
    .await?;
    let dataset = cluster.dir.path().join("dataset");
    make_named_files(&dataset, files, 250)?;
    let path_bytes = dataset.to_string_lossy().len() + 1 + 250;
    // The shard list dominates an entry: each path plus its quotes and comma.
    let entry_mb = (files * (path_bytes + 3)) as f64 / 1e6;
    let mut took_ms = Vec::new();
    let mut rates = Vec::new();
    let mut elections = 0u64;
    for round in 0..rounds {
        let leader = cluster.wait_leader(DEADLINE).await;
        let i = cluster.follower_of(leader);
        cluster.coordinators[i].proc.kill9();
        for n in 0..submits {
            let spec = v1::JobSpec {
                world_size: 1,
                command: vec!["true".into()],
                dataset: dataset.to_string_lossy().into_owned(),
                ..Default::default()
            };
            cluster.submit(&format!("cu-{round}-{n}"), spec).await?;
        }
        let before = cluster
            .wait_status("the leader's status", DEADLINE, |s| {
                s.leader_id == Some(s.node_id)
            })
            .await;
        let applied = before.last_applied_index.unwrap_or(0);
        let restarted = Instant::now();
        cluster.spawn_coordinator(i)?;
        let after = wait_for("the restarted follower to catch up", DEADLINE, || async {
            let s = cluster.status_of(i).await?;
            (s.last_applied_index? >= applied).then_some(s)
        })
        .await;
        let took = restarted.elapsed();
        let mb = entry_mb * submits as f64;
        took_ms.push(ms(took));
        rates.push(mb / took.as_secs_f64());
        elections += after.term.saturating_sub(before.term);
        eprintln!(
            "   round {round}: {mb:.0} MB of entries caught up in {:.0} ms, term {} -> {}",
            ms(took),
            before.term,
            after.term
        );
    }
    let n = took_ms.len();
    let what = format!("{submits} x {entry_mb:.1} MB entries");
    Ok(vec![
        Row::new(
            "follower_catchup",
            &format!("restart -> caught up, {what}, p50"),
            percentile(&took_ms, 50.0),
            "ms",
            n,
        ),
        Row::new(
            "follower_catchup",
            &format!("catch-up rate, {what}, p50"),
            percentile(&rates, 50.0),
            "MB/s",
            n,
        ),
        Row::new(
            "follower_catchup",
            "elections during the catch-ups",
            elections as f64,
            "count",
            n,
        ),
    ])
}

/// Pause and resume (issue #27): a two-rank trainer checkpointing every 20 steps is
/// paused and resumed repeatedly. Measured: pause request → the job `paused` with every
/// rank stopped and the step they reached committed (target: within one checkpoint
/// interval, from the trainer's own rate, plus 1 s); resume request → the first progress
/// past that step seen by the leader (to compare with `rank_restart` (c), which adds a
/// 200 ms backoff).
pub async fn pause(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    let rounds = ctx.pick(10, 2);
    let ckpt_every: u64 = 20;
    let cluster = Cluster::start(ClusterOpts {
        workers: 2,
        slots: 2,
        ..ClusterOpts::default()
    })
    .await?;
    let root = ctx.work_dir.join("pause");
    std::fs::create_dir_all(&root)?;
    let w = prepare_digits(&root, 4)?;
    let every = ckpt_every.to_string();
    let args = [
        "--epochs",
        "100000",
        "--ckpt-every",
        every.as_str(),
        "--step-sleep-ms",
        "5",
    ];
    let spec = trainer_spec(&w, 2, &root.join("ckpt"), &root.join("out"), &args);
    let job_id = cluster.submit("pause", spec).await?.job_id;
    let mut client = cluster.leader_client().await?;
    let (mut paused, mut resumed, mut interval) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let job = cluster
            .wait_job(&job_id, "running with a rate", DEADLINE, |j| {
                j.ranks.iter().all(|r| {
                    r.phase() == Ok(RankPhase::Running)
                        && r.attempt == round
                        && r.metrics.get("steps_per_s").is_some_and(|v| *v > 0.0)
                }) && j.committed_step.is_some()
            })
            .await;
        let rate = job
            .ranks
            .iter()
            .filter_map(|r| r.metrics.get("steps_per_s").copied())
            .fold(f64::INFINITY, f64::min);
        interval.push(ckpt_every as f64 / rate * 1_000.0);
        let t = Instant::now();
        client
            .pause_job(v1::PauseJobRequest {
                job_id: job_id.clone(),
            })
            .await?;
        let stopped = cluster
            .wait_job(&job_id, "paused", DEADLINE, |j| {
                j.job_state() == Ok(JobState::Paused)
            })
            .await;
        paused.push(ms(t.elapsed()));
        let step = stopped.committed_step.unwrap_or(0);
        let t = Instant::now();
        client
            .resume_job(v1::ResumeJobRequest {
                job_id: job_id.clone(),
            })
            .await?;
        cluster
            .wait_job(&job_id, "progress past the paused step", DEADLINE, |j| {
                j.ranks
                    .iter()
                    .any(|r| r.attempt == round + 1 && r.step > step)
            })
            .await;
        resumed.push(ms(t.elapsed()));
        eprintln!(
            "   round {round}: paused at step {step} in {:.0} ms (interval {:.0} ms), resumed in {:.0} ms",
            paused[paused.len() - 1],
            interval[interval.len() - 1],
            resumed[resumed.len() - 1]
        );
    }
    let _ = client.cancel_job(v1::CancelJobRequest { job_id }).await;
    let n = paused.len();
    let target = percentile(&interval, 50.0) + 1_000.0;
    Ok(vec![
        Row::new(
            "pause",
            "checkpoint interval (20 steps at the trainer's rate) p50",
            percentile(&interval, 50.0),
            "ms",
            n,
        ),
        Row::new(
            "pause",
            "pause request -> paused, step committed p50",
            percentile(&paused, 50.0),
            "ms",
            n,
        ),
        Row::below(
            "pause",
            "pause request -> paused, step committed p99",
            percentile(&paused, 99.0),
            "ms",
            n,
            target.round(),
        ),
        Row::new(
            "pause",
            "resume request -> progress past the step p50",
            percentile(&resumed, 50.0),
            "ms",
            n,
        ),
        Row::new(
            "pause",
            "resume request -> progress past the step p99",
            percentile(&resumed, 99.0),
            "ms",
            n,
        ),
    ])
}
