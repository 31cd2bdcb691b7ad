//! The leader's checkpoint I/O, in per-job tasks off the control loop: finalizing a step
//! (verify every part, write the manifest, commit, LATEST, prune), choosing the step a
//! restart resumes from, repairing LATEST, mirroring L1-committed steps to L2.

use std::sync::Arc;
use std::time::Duration;

use cumulus_ckpt::{Manifest, PartRecord};
use cumulus_raft_store::Command;
use cumulus_raft_store::state::{ClusterState, Job, PartInfo};
use tracing::{info, warn};

use crate::node::Node;
use crate::soft::now_ms;

use super::*;

/// Most checkpoint I/O tasks (finalize, the resume-step choice of a restart, LATEST
/// repair, the L2 mirror of an L1-committed step) in flight at once; at most one per job.
pub const MAX_IO_TASKS: usize = 32;
/// Shortest time between two LATEST repairs or L2 mirror checks of one job.
pub const IO_RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// What a finished checkpoint I/O task tells the loop to remember.
#[derive(Debug)]
pub(super) enum IoOutcome {
    /// Nothing to remember.
    Done,
    /// The step's parts failed verification (a permanent error): never finalize it.
    BadStep(u64),
    /// LATEST of the commit tier names this committed step.
    LatestOk(u64),
    /// The L2 (S3) copy of a job committed at L1 holds this step's manifest and LATEST.
    MirroredToL2(u64),
}

/// Which kind of periodic I/O a retry time belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum IoKind {
    /// [`ensure_latest`].
    Latest,
    /// [`mirror_to_l2`].
    Mirror,
}

/// The manifest record of a part the log holds for `step`. The worker service checked it
/// before proposing it, so an error here means a log entry that should not exist.
pub(super) fn part_record(step: u64, p: &PartInfo) -> Result<PartRecord, cumulus_ckpt::CkptError> {
    PartRecord::from_reported(
        step,
        p.rank,
        p.attempt,
        p.dir.clone(),
        p.files.clone(),
        &p.state_json,
    )
}

/// Newest kept committed step whose manifest and files verify (the fallback for a
/// torn or corrupt newest step); None without checkpoints.
pub(super) async fn choose_resume_step(node: &Node, job_id: &str) -> Option<u64> {
    let (spec, steps) = node.read_state(|s| {
        s.jobs.get(job_id).map(|j| {
            (
                j.spec.clone(),
                j.committed.keys().copied().collect::<Vec<_>>(),
            )
        })
    })?;
    if steps.is_empty() {
        return None;
    }
    let store = match node.ckpt_store(&spec).await {
        Ok(Some(store)) => store,
        Ok(None) => return None,
        Err(e) => {
            warn!(job = %job_id, error = %e, "cannot open the checkpoint store: restarting from scratch");
            return None;
        }
    };
    match cumulus_ckpt::newest_valid_step(&*store, job_id, &steps).await {
        Ok(Some(m)) => {
            if Some(&m.step) != steps.last() {
                warn!(job = %job_id, step = m.step, "newest checkpoint failed verification: resuming from an older step");
            }
            Some(m.step)
        }
        Ok(None) => {
            warn!(job = %job_id, "no kept checkpoint verifies: restarting from scratch");
            None
        }
        Err(e) => {
            warn!(job = %job_id, error = %e, "cannot verify checkpoints: restarting from scratch");
            None
        }
    }
}

/// Why [`finalize`] did not commit a step.
#[derive(Debug, thiserror::Error)]
pub enum FinalizeError {
    /// Reading, verifying or writing the checkpoint storage failed.
    #[error(transparent)]
    Storage(#[from] cumulus_ckpt::CkptError),
    /// A part the log holds for the step is not a valid part record.
    #[error("step {step} holds an invalid part: {source}")]
    InvalidPart {
        /// The step.
        step: u64,
        /// What is wrong with the part.
        source: cumulus_ckpt::CkptError,
    },
    /// The commit could not be proposed (leadership lost, no quorum).
    #[error("proposing the commit failed: {0}")]
    Propose(#[from] crate::error::ApiError),
    /// `apply` refused the commit (the job moved on).
    #[error("commit rejected: {0}")]
    Rejected(String),
}

impl FinalizeError {
    /// True for an S3 outage (unreachable, throttled, 5xx): the step is tried again on a
    /// later pass. Anything else marks the step bad (a later step commits instead).
    pub fn is_transient(&self) -> bool {
        matches!(self, FinalizeError::Storage(cumulus_ckpt::CkptError::Remote { kind, .. }) if kind.is_transient())
    }
}

/// Verifies every part of `step`, writes its manifest, commits the step in Raft, then
/// writes LATEST and prunes to the kept steps.
pub(super) async fn finalize(node: &Node, job_id: &str, step: u64) -> Result<(), FinalizeError> {
    let started = std::time::Instant::now();
    let Some((spec, world_size, parts)) = node.read_state(|s| {
        s.jobs.get(job_id).and_then(|j| {
            j.pending_parts.get(&step).map(|p| {
                (
                    j.spec.clone(),
                    j.world_size(),
                    p.values().cloned().collect::<Vec<_>>(),
                )
            })
        })
    }) else {
        return Ok(());
    };
    let Some(store) = node.ckpt_store(&spec).await? else {
        return Ok(());
    };
    let records = parts
        .iter()
        .map(|p| part_record(step, p))
        .collect::<Result<Vec<PartRecord>, _>>()
        .map_err(|source| FinalizeError::InvalidPart { step, source })?;
    // Every part is checked (files present, regular, of the recorded sizes; for S3 the
    // size and digest metadata by HEAD) without re-reading content: each digest was computed
    // by the agent over the bytes it fsynced before the rename, and every resume hashes every
    // byte again (docs/architecture.md, invariant 3). In parallel, at most one per core.
    {
        use futures::StreamExt;
        let parallel = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 16));
        let checks: Vec<_> = records
            .iter()
            .map(|p| store.check_part(job_id, p))
            .collect();
        let mut verified = futures::stream::iter(checks).buffer_unordered(parallel);
        while let Some(result) = verified.next().await {
            result?;
        }
    }
    let manifest = Manifest {
        format_version: cumulus_ckpt::MANIFEST_FORMAT_VERSION,
        job_id: job_id.to_string(),
        step,
        world_size,
        committed_at_ms: now_ms(),
        parts: records,
    };
    store.write_manifest(&manifest).await?;
    if let cumulus_raft_store::Response::Rejected { reason } = node
        .propose(Command::CheckpointCommitted {
            job_id: job_id.to_string(),
            step,
            at_ms: now_ms(),
        })
        .await?
    {
        return Err(FinalizeError::Rejected(reason));
    }
    let m = crate::metrics::metrics();
    m.step_commit_seconds
        .observe(started.elapsed().as_secs_f64());
    m.step_bytes.inc_by(
        manifest
            .parts
            .iter()
            .flat_map(|p| &p.files)
            .map(|f| f.size_bytes)
            .sum(),
    );
    store.write_latest(job_id, step).await?;
    let keep: Vec<u64> = node.read_state(|s| {
        s.jobs
            .get(job_id)
            .map(|j| j.kept_steps(s.fork_references(job_id).into_iter().map(|(_, st)| st)))
            .unwrap_or_default()
    });
    if let Err(e) = store.prune(job_id, &keep).await {
        warn!(job = %job_id, error = %e, "pruning old checkpoints failed");
    }
    info!(job = %job_id, step, "checkpoint committed");
    Ok(())
}

/// Jobs that were ever placed (running or terminal), in id order: only they can have
/// committed checkpoints. Leaves out pending jobs, however many are queued.
pub(super) fn placed_jobs(s: &ClusterState) -> impl Iterator<Item = &Job> {
    let index = s.job_index();
    index
        .running
        .union(&index.terminal)
        .filter_map(|id| s.jobs.get(id).map(|j| &**j))
}

/// Makes LATEST name the committed step of every job (a leader may have died between
/// the Raft commit and the LATEST write). One I/O task per job, at most every
/// [`IO_RETRY_INTERVAL`] until it succeeds.
pub(super) fn ensure_latest(node: &Arc<Node>, memory: &mut LoopMemory) {
    let jobs: Vec<(String, cumulus_raft_store::state::JobSpec, u64)> = node.read_state(|s| {
        placed_jobs(s)
            .filter(|j| j.spec.ckpt_enabled())
            .filter_map(|j| j.committed_step.map(|c| (j.id.clone(), j.spec.clone(), c)))
            .filter(|(id, _, c)| memory.latest_ok.get(id) != Some(c))
            .collect()
    });
    for (job_id, spec, step) in jobs {
        if memory.io_busy(&job_id) || !memory.due(&job_id, IoKind::Latest) {
            continue;
        }
        let node = node.clone();
        let task_job = job_id.clone();
        memory.spawn_io(&job_id, async move {
            let job_id = task_job;
            let store = match node.ckpt_store(&spec).await {
                Ok(Some(store)) => store,
                Ok(None) => return IoOutcome::Done,
                Err(e) => {
                    warn!(job = %job_id, error = %e, "cannot open the checkpoint store");
                    return IoOutcome::Done;
                }
            };
            match store.read_latest(&job_id).await {
                Ok(Some(s)) if s == step => IoOutcome::LatestOk(step),
                _ => {
                    if store.verify_step(&job_id, step).await.is_ok()
                        && store.write_latest(&job_id, step).await.is_ok()
                    {
                        info!(job = %job_id, step, "LATEST repaired to the committed step");
                        IoOutcome::LatestOk(step)
                    } else {
                        IoOutcome::Done
                    }
                }
            }
        });
    }
}

/// For jobs that commit at L1 with an S3 target (`--ckpt-commit-tier l1`): once every
/// part of the committed step is in L2 (the agents upload them in the background),
/// writes the manifests of the kept steps, then LATEST, to L2 and prunes L2 to them, so
/// that the bucket alone is a complete, verifiable checkpoint (the same layout as an
/// L2-committed job). Checked at most every [`IO_RETRY_INTERVAL`] per job.
pub(super) fn mirror_to_l2(node: &Arc<Node>, memory: &mut LoopMemory) {
    type MirrorJob = (
        String,
        cumulus_raft_store::state::JobSpec,
        u64,
        (Vec<u64>, Vec<u64>),
    );
    let jobs: Vec<MirrorJob> = node.read_state(|s| {
        placed_jobs(s)
            .filter(|j| !j.spec.ckpt_url.is_empty() && j.spec.ckpt_commit_tier == "l1")
            .filter_map(|j| {
                j.committed_step.map(|c| {
                    (
                        j.id.clone(),
                        j.spec.clone(),
                        c,
                        (
                            j.committed.keys().copied().collect(),
                            j.kept_steps(s.fork_references(&j.id).into_iter().map(|(_, st)| st)),
                        ),
                    )
                })
            })
            .filter(|(id, _, c, _)| memory.l2_mirrored.get(id).is_none_or(|m| m < c))
            .collect()
    });
    for (job_id, spec, step, keep) in jobs {
        if memory.io_busy(&job_id) || !memory.due(&job_id, IoKind::Mirror) {
            continue;
        }
        let mirrored = memory.l2_mirrored.get(&job_id).copied();
        let node = node.clone();
        let task_job = job_id.clone();
        memory.spawn_io(&job_id, async move {
            let job_id = task_job;
            let (committed, keep) = &keep;
            match mirror_steps(&node, &spec, &job_id, mirrored, committed, keep).await {
                Ok(Some(done)) => {
                    info!(job = %job_id, step = done, committed = step, "L1-committed steps mirrored to L2 (manifests, LATEST)");
                    IoOutcome::MirroredToL2(done)
                }
                Ok(None) => IoOutcome::Done, // parts still uploading
                Err(e) => {
                    warn!(job = %job_id, step, error = %e, "cannot mirror the step to L2 yet");
                    IoOutcome::Done
                }
            }
        });
    }
}

/// One try of [`mirror_to_l2`]: writes the L2 manifest of every kept committed step
/// (`committed`, ascending) after `mirrored` (oldest first) whose parts are all in L2,
/// stopping at the first that is not complete yet, then moves L2's LATEST to the newest
/// step written and prunes L2 to `keep` (the committed steps and those other jobs
/// resume from). Returns that step, or `None` when none was complete.
pub(super) async fn mirror_steps(
    node: &Node,
    spec: &cumulus_raft_store::state::JobSpec,
    job_id: &str,
    mirrored: Option<u64>,
    committed: &[u64],
    keep: &[u64],
) -> Result<Option<u64>, cumulus_ckpt::CkptError> {
    use cumulus_ckpt::CheckpointStore;
    let Some(l1) = node.ckpt_store(spec).await? else {
        return Ok(None);
    };
    let l2 = node.s3.store(&spec.ckpt_url).await?;
    let mut newest = None;
    'steps: for &step in committed
        .iter()
        .filter(|s| mirrored.is_none_or(|m| **s > m))
    {
        let manifest = l1.read_manifest(job_id, step).await?;
        for part in &manifest.parts {
            if let Err(e) = l2.verify_part(job_id, part).await {
                tracing::debug!(job = %job_id, step, part = %part.dir, error = %e, "part not in L2 yet");
                break 'steps;
            }
        }
        l2.write_manifest(&manifest).await?;
        newest = Some(step);
    }
    let Some(step) = newest else {
        return Ok(None);
    };
    l2.write_latest(job_id, step).await?;
    if let Err(e) = l2.prune(job_id, keep).await {
        warn!(job = %job_id, error = %e, "pruning old L2 checkpoints failed");
    }
    Ok(Some(step))
}
