//! The checkpoints' arms of `apply`: a rank's part of a step, a step committed; and
//! which committed steps jobs forked from a job still need.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::state::*;

impl ClusterState {
    /// `CheckpointPartCommitted`: a part already in a committed step answers Ok and
    /// changes nothing (a retry); a step not after the committed one, or a part too large or
    /// without a directory, is rejected; else the current, live attempt of the rank records
    /// its part as pending for the step (at most [`MAX_PENDING_CKPT_STEPS`] steps kept).
    pub(super) fn part_committed(
        &mut self,
        job_id: &str,
        step: u64,
        part: &PartInfo,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        let rank = part.rank;
        let attempt = part.attempt;
        if let Some(job) = self.jobs.get(job_id)
            && job.committed_step.is_some_and(|c| step <= c)
        {
            // The same part again, already in its committed step: a retry whose first
            // try was committed but not acknowledged (the leader died before replying).
            // It succeeds and changes nothing; rejecting it would tell the agent that
            // its attempt is stale and end a healthy rank.
            if job
                .committed
                .get(&step)
                .is_some_and(|parts| parts.contains(part))
            {
                return Response::Ok;
            }
            return reject(format!("step {step} is not after the committed step"));
        }
        if part.files.len() > 4096 || part.state_json.len() > 64 * 1024 || part.dir.is_empty() {
            return reject("checkpoint part is too large or has no directory");
        }
        self.with_current_rank(job_id, rank, attempt, None, dirty, |_, r| {
            if !matches!(r.state, RankState::Pending | RankState::Running) {
                return reject(format!("rank {rank} attempt {attempt} is not running"));
            }
            Response::Ok
        })
        .and_then_ok(|| {
            let job = Arc::make_mut(
                self.jobs
                    .get_mut(job_id)
                    .expect("checked by with_current_rank"),
            );
            job.pending_parts
                .entry(step)
                .or_default()
                .insert(rank, part.clone());
            while job.pending_parts.len() > MAX_PENDING_CKPT_STEPS {
                job.pending_parts.pop_first();
            }
            dirty.insert(DirtyKey::Job(job_id.to_string()));
            Response::Ok
        })
    }

    /// `CheckpointCommitted`: a step of a job not finished yet whose pending parts
    /// number its world size becomes committed (and the newest committed step if it is);
    /// pending parts up to it are dropped and only the newest `ckpt_keep` steps are kept.
    pub(super) fn checkpoint_committed(
        &mut self,
        job_id: &str,
        step: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        self.with_live_job(job_id, dirty, |job| {
            let Some(parts) = job.pending_parts.get(&step) else {
                return reject(format!("no parts of step {step} are pending"));
            };
            if parts.len() != job.world_size() as usize {
                return reject(format!(
                    "step {step} has {} of {} parts",
                    parts.len(),
                    job.world_size()
                ));
            }
            let parts: Vec<PartInfo> = parts.values().cloned().collect();
            job.committed.insert(step, parts);
            job.committed_step = Some(job.committed_step.map_or(step, |s| s.max(step)));
            job.pending_parts.retain(|s, _| *s > step);
            while job.committed.len() > job.spec.ckpt_keep as usize {
                job.committed.pop_first();
            }
            Response::Ok
        })
    }

    /// Steps of `job_id`'s checkpoint dir that jobs started from it still need, as
    /// `(that job, step)`: one for every unfinished job forked from it that has committed
    /// no step of its own.
    pub fn fork_references(&self, job_id: &str) -> Vec<(String, u64)> {
        self.index
            .forks
            .iter()
            .filter_map(|id| self.jobs.get(id))
            .filter_map(|j| j.fork.as_ref().map(|f| (j, f)))
            .filter(|(j, f)| f.job_id == job_id && !j.state.is_terminal() && j.committed.is_empty())
            .map(|(j, f)| (j.id.clone(), f.step))
            .collect()
    }
}

/// `Ok` followed by more work: the rest runs only when the first step answered `Ok`.
trait ResponseExt {
    fn and_then_ok(self, f: impl FnOnce() -> Response) -> Response;
}

impl ResponseExt for Response {
    fn and_then_ok(self, f: impl FnOnce() -> Response) -> Response {
        match self {
            Response::Ok => f(),
            other => other,
        }
    }
}
