//! The clients' workload: small jobs submitted, cancelled, paused, resumed and read
//! (linearizable reads recorded for check 3) until the faults end, and the trainer job
//! whose result check 4 compares with a fault-free run.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cumulus_api::v1;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use super::{
    History, SMALL_BACKOFF_MS, SMALL_RESTARTS, SMALL_TIME_LIMIT_MS, TRAINER_BACKOFF_MS,
    TRAINER_PROGRESS_TIMEOUT_MS, TRAINER_RESTARTS, TRAINER_WORLD,
};
use crate::history::{Read, Version};
use crate::{View, Workload, trainer_spec};

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
pub(super) fn trainer(
    w: &Workload,
    root: &Path,
    name: &str,
    epochs: u32,
    step_sleep_ms: u32,
) -> v1::JobSpec {
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
pub(super) async fn client(
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
