//! The executor: stamps each planned [`Action`] with the leader's time and jitter, starts
//! its checkpoint I/O, and commits it through Raft.

use std::sync::Arc;

use cumulus_raft_store::Command;
use cumulus_raft_store::state::StragglerFlag;
use tracing::{info, warn};

use crate::node::Node;
use crate::soft::now_ms;

use super::*;

/// Turns `action` into the command to commit, with its description for the logs; an
/// action that needs checkpoint I/O first starts it in an I/O task instead (`None`).
/// The loop commits the commands of one pass together ([`commit_batch`]).
pub(super) fn execute(
    node: &Arc<Node>,
    action: Action,
    memory: &mut LoopMemory,
) -> Option<(Command, String)> {
    let now = now_ms();
    let describe = format!("{action:?}");
    let cmd = match action {
        Action::ExpireWorker { worker_id } => {
            warn!(worker = %worker_id, "worker missed its heartbeats: expiring it");
            Command::ExpireWorker {
                worker_id,
                at_ms: now,
            }
        }
        Action::FailRank {
            job_id,
            rank,
            attempt,
            cause,
        } => {
            warn!(job = %job_id, rank, attempt, %cause, "rank failed");
            Command::RankFailed {
                job_id,
                rank,
                attempt,
                cause,
                at_ms: now,
            }
        }
        Action::Place {
            job_id,
            placements,
            gpus,
        } => {
            info!(job = %job_id, ?placements, ?gpus, "placing job");
            Command::PlaceJob {
                job_id,
                placements,
                gpus,
                at_ms: now,
            }
        }
        Action::Restart {
            job_id,
            placements,
            gpus,
            failed_at_ms,
            delay_ms,
            cause,
            agent_fault,
            in_process,
            path_reason,
        } => {
            // Choosing the resume step reads (and verifies) checkpoints: off the loop.
            let task_node = node.clone();
            let task_job = job_id.clone();
            memory.spawn_io(&job_id, async move {
                let node = task_node;
                let resume_step = choose_resume_step(&node, &task_job).await;
                info!(job = %task_job, delay_ms, ?resume_step, %cause, "scheduling restart");
                let label = crate::metrics::restart_cause(&cause, agent_fault);
                let cmd = Command::ScheduleRestart {
                    job_id: task_job,
                    placements,
                    gpus,
                    failed_at_ms,
                    delay_ms,
                    cause,
                    resume_step,
                    agent_fault,
                    in_process,
                    path_reason,
                };
                if commit_planned(&node, cmd, &describe).await {
                    let cause = crate::metrics::CauseLabel { cause: label };
                    crate::metrics::metrics()
                        .restarts
                        .get_or_create(&cause)
                        .inc();
                }
                IoOutcome::Done
            });
            return None;
        }
        Action::Resize {
            job_id,
            placements,
            gpus,
            cause,
        } => {
            spawn_resize(node, memory, job_id, placements, gpus, cause, describe);
            return None;
        }
        Action::FailJob { job_id, cause } => {
            warn!(job = %job_id, %cause, "job failed");
            Command::FailJob {
                job_id,
                cause,
                at_ms: now,
            }
        }
        Action::Succeed { job_id, finalize } => {
            if let Some(step) = finalize
                && !memory.bad_steps.contains(&(job_id.clone(), step))
            {
                // The last checkpoint the ranks took before exiting is committed first
                // (or found bad); the success follows on a later pass. With the job's
                // I/O slot taken (that step's finalize already running, a LATEST check),
                // it is planned again.
                if !memory.io_busy(&job_id) {
                    spawn_finalize(node, memory, job_id, step);
                }
                return None;
            }
            info!(job = %job_id, "job succeeded");
            Command::JobSucceeded { job_id, at_ms: now }
        }
        Action::FlagStraggler { job_id, flag } => straggler_command(job_id, flag, now),
        Action::RequestStop { job_id, action } => {
            info!(job = %job_id, %action, "asking the job's ranks to checkpoint and stop");
            Command::RequestStop {
                job_id,
                action,
                at_ms: now,
            }
        }
        Action::RequestGrow { job_id, cause } => {
            info!(job = %job_id, %cause, "asking the job's ranks to checkpoint and stop before it grows");
            Command::RequestGrow { job_id, at_ms: now }
        }
        Action::Stopped { job_id, finalize } => {
            if memory.io_busy(&job_id) {
                return None; // a restart or a commit of this job is still in flight
            }
            if let Some(step) = finalize
                && !memory.bad_steps.contains(&(job_id.clone(), step))
            {
                // The checkpoint the ranks took on request is committed first; the stop
                // completes on a later pass.
                spawn_finalize(node, memory, job_id, step);
                return None;
            }
            info!(job = %job_id, "every rank stopped");
            Command::JobStopped { job_id, at_ms: now }
        }
        Action::Finalize { job_id, step } => {
            if !memory.bad_steps.contains(&(job_id.clone(), step)) {
                spawn_finalize(node, memory, job_id, step);
            }
            return None;
        }
    };
    Some((cmd, describe))
}

/// Commits an elastic job's resize ([`Action::Resize`]) in an I/O task: as for a
/// restart, the resume step is read (and verified) off the loop first.
fn spawn_resize(
    node: &Arc<Node>,
    memory: &mut LoopMemory,
    job_id: String,
    placements: Vec<(u32, String)>,
    gpus: Vec<(u32, Vec<String>)>,
    cause: String,
    describe: String,
) {
    let task_node = node.clone();
    let task_job = job_id.clone();
    memory.spawn_io(&job_id, async move {
        let node = task_node;
        let resume_step = choose_resume_step(&node, &task_job).await;
        info!(job = %task_job, ranks = placements.len(), ?resume_step, %cause, "resizing job");
        let cmd = Command::ResizeJob {
            job_id: task_job,
            placements,
            gpus,
            resume_step,
            cause,
            at_ms: now_ms(),
        };
        commit_planned(&node, cmd, &describe).await;
        IoOutcome::Done
    });
}

/// Most estimated bytes of the commands one planned batch carries (a small part of a
/// Raft entry's [`crate::proposer::MAX_ENTRY_BYTES`]).
pub const MAX_PLANNED_BATCH_BYTES: u64 = 1 << 20;

/// Commits the commands of one planning pass in as few Raft entries as fit
/// ([`Command::Batch`] of at most [`cumulus_raft_store::state::MAX_BATCH_COMMANDS`]
/// commands and [`MAX_PLANNED_BATCH_BYTES`]), applied one by one as if alone: one fsync
/// for a pass's placements and completions instead of one each. A rejected command (the
/// state moved on) is logged and planned again on the next pass. One command goes as
/// itself.
pub(super) async fn commit_batch(node: &Node, mut planned: Vec<(Command, String)>) {
    if planned.len() <= 1 {
        if let Some((cmd, describe)) = planned.pop() {
            commit_planned(node, cmd, &describe).await;
        }
        return;
    }
    let mut chunks: Vec<&[(Command, String)]> = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, (cmd, _)) in planned.iter().enumerate() {
        let size = cmd.approx_encoded_bytes() as u64;
        let full = i - start >= cumulus_raft_store::state::MAX_BATCH_COMMANDS
            || (i > start && bytes + size > MAX_PLANNED_BATCH_BYTES);
        if full {
            chunks.push(&planned[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    chunks.push(&planned[start..]);
    for chunk in chunks {
        if let [(cmd, describe)] = chunk {
            commit_planned(node, cmd.clone(), describe).await;
            continue;
        }
        let commands = chunk.iter().map(|(c, _)| c.clone()).collect();
        match node.propose(Command::Batch { commands }).await {
            Ok(cumulus_raft_store::Response::Batch { responses }) => {
                for ((_, describe), r) in chunk.iter().zip(responses) {
                    if let cumulus_raft_store::Response::Rejected { reason } = r {
                        tracing::debug!(action = %describe, %reason, "planned action rejected (state moved on)");
                    }
                }
            }
            Ok(other) => warn!(
                ?other,
                "a batch of planned actions was answered without one response each"
            ),
            Err(e) => {
                warn!(actions = chunk.len(), error = %e, "could not commit the planned actions");
                return;
            }
        }
    }
}

/// Verifies `step`'s parts and commits it, in an I/O task; a step that fails its
/// checks is remembered as bad and never finalized again.
fn spawn_finalize(node: &Arc<Node>, memory: &mut LoopMemory, job_id: String, step: u64) {
    let task_node = node.clone();
    let task_job = job_id.clone();
    memory.spawn_io(&job_id, async move {
        match finalize(&task_node, &task_job, step).await {
            Ok(()) => IoOutcome::Done,
            Err(e) => {
                let transient = e.is_transient();
                warn!(job = %task_job, step, error = %e, transient, "checkpoint step not committed");
                if transient {
                    IoOutcome::Done
                } else {
                    IoOutcome::BadStep(step)
                }
            }
        }
    });
}

/// Commits the command of a planned action; a rejection (the state moved on) or a lost
/// leadership is logged, and the next pass plans again. True when it was applied.
pub(super) async fn commit_planned(node: &Node, cmd: Command, describe: &str) -> bool {
    match node.propose(cmd).await {
        Ok(cumulus_raft_store::Response::Rejected { reason }) => {
            tracing::debug!(action = %describe, %reason, "planned action rejected (state moved on)");
            false
        }
        Ok(_) => true,
        Err(e) => {
            warn!(action = %describe, error = %e, "could not commit planned action");
            false
        }
    }
}

/// The command that records a straggler flag, stamped with the leader's time `now_ms`;
/// logged once here as a warning.
fn straggler_command(job_id: String, mut flag: StragglerFlag, now_ms: u64) -> Command {
    warn!(
        job = %job_id,
        rank = flag.rank,
        attempt = flag.attempt,
        worker = %flag.worker_id,
        millisteps_per_s = flag.millisteps_per_s,
        median_millisteps_per_s = flag.median_millisteps_per_s,
        action = %flag.action,
        "straggler"
    );
    flag.at_ms = now_ms;
    Command::FlagStraggler { job_id, flag }
}
