//! `FlagStraggler`: a rank attempt the leader found slower than the job's other ranks.

use std::collections::BTreeSet;

use crate::state::*;

impl ClusterState {
    /// `FlagStraggler`: records `flag` for the current, running attempt of its rank, on
    /// the worker it names, once per attempt, when the job's action is not `off` (the
    /// flag's action must be the job's). With [`StragglerAction::Restart`] the attempt
    /// fails (it restarts under the job's policy) and, as with
    /// [`StragglerAction::Exclude`], its worker joins [`Job::avoided_workers`].
    pub(super) fn flag_straggler(
        &mut self,
        job_id: &str,
        flag: &StragglerFlag,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        self.with_live_job(job_id, dirty, |job| {
            if job.state != JobState::Running || job.stop.is_some() {
                return reject(format!("job {job_id} is not running without a stop"));
            }
            if job.spec.straggler.action == StragglerAction::Off
                || flag.action != job.spec.straggler.action
            {
                return reject(format!(
                    "job {job_id}'s straggler action is {}, not {}",
                    job.spec.straggler.action, flag.action
                ));
            }
            let Some(r) = job.ranks.get(flag.rank as usize) else {
                return reject(format!("job {job_id} has no rank {}", flag.rank));
            };
            if r.attempt != flag.attempt
                || r.state != RankState::Running
                || r.worker_id.as_deref() != Some(flag.worker_id.as_str())
            {
                return reject(format!(
                    "rank {} attempt {} of {job_id} is not running on {}",
                    flag.rank, flag.attempt, flag.worker_id
                ));
            }
            if job.is_straggler(flag.rank) {
                return reject(format!(
                    "rank {} attempt {} of {job_id} is flagged already",
                    flag.rank, flag.attempt
                ));
            }
            if job.stragglers.len() >= MAX_STRAGGLER_FLAGS {
                job.stragglers.remove(0);
            }
            job.stragglers.push(flag.clone());
            if matches!(
                flag.action,
                StragglerAction::Restart | StragglerAction::Exclude
            ) && !job.avoided_workers.contains(&flag.worker_id)
            {
                if job.avoided_workers.len() >= MAX_AVOIDED_WORKERS {
                    job.avoided_workers.remove(0);
                }
                job.avoided_workers.push(flag.worker_id.clone());
            }
            if flag.action == StragglerAction::Restart {
                let r = &mut job.ranks[flag.rank as usize];
                r.state = RankState::Failed;
                r.exited_at_ms = flag.at_ms;
                r.failure = Some(format!(
                    "rank {} attempt {}: straggler: {:.3} steps/s, below {} of the other \
                     ranks' median {:.3} for {} s on worker {}",
                    r.rank,
                    r.attempt,
                    flag.millisteps_per_s as f64 / 1000.0,
                    f64::from(job.spec.straggler.fraction_permille) / 1000.0,
                    flag.median_millisteps_per_s as f64 / 1000.0,
                    job.spec.straggler.window_ms as f64 / 1000.0,
                    flag.worker_id
                ));
            }
            Response::Ok
        })
    }
}
