//! The workers' arms of `apply`: registration (with its GPU inventory's rules) and
//! expiry.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::state::*;

impl ClusterState {
    /// `RegisterWorker`: checks the worker id ([`valid_id`]), host, address and slots,
    /// then its GPUs ([`ClusterState::check_gpus`]); records the worker as alive (a worker
    /// registering again replaces its record). Dirty: the worker.
    pub(super) fn register_worker(
        &mut self,
        worker_id: &str,
        (host, http_addr): (&str, &str),
        (slots, gpus): (u32, &[GpuDevice]),
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        if !valid_id(worker_id) || host.is_empty() || http_addr.is_empty() || slots == 0 {
            return reject("invalid worker registration");
        }
        if let Err(e) = self.check_gpus(worker_id, gpus) {
            return reject(e.to_string());
        }
        self.workers.insert(
            worker_id.to_string(),
            WorkerRecord {
                worker_id: worker_id.to_string(),
                host: host.to_string(),
                http_addr: http_addr.to_string(),
                slots,
                state: WorkerState::Alive,
                registered_at_ms: at_ms,
                expired_at_ms: 0,
                gpus: gpus.to_vec(),
            },
        );
        dirty.insert(DirtyKey::Worker(worker_id.to_string()));
        Response::Ok
    }

    /// `ExpireWorker`: an alive worker is expired; every pending or running rank placed
    /// on it, of a running job, fails ("worker expired"). Dirty: the worker and those jobs.
    pub(super) fn expire_worker(
        &mut self,
        worker_id: &str,
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        let Some(w) = self.workers.get_mut(worker_id) else {
            return reject(format!("unknown worker {worker_id}"));
        };
        if w.state == WorkerState::Expired {
            return reject(format!("worker {worker_id} is already expired"));
        }
        w.state = WorkerState::Expired;
        w.expired_at_ms = at_ms;
        dirty.insert(DirtyKey::Worker(worker_id.to_string()));
        for job in self.jobs.values_mut() {
            let holds_live_rank = job.state == JobState::Running
                && job.ranks.iter().any(|r| {
                    r.worker_id.as_deref() == Some(worker_id)
                        && matches!(r.state, RankState::Pending | RankState::Running)
                });
            if !holds_live_rank {
                continue;
            }
            let job = Arc::make_mut(job);
            let mut touched = false;
            for r in &mut job.ranks {
                if r.worker_id.as_deref() == Some(worker_id)
                    && matches!(r.state, RankState::Pending | RankState::Running)
                {
                    r.state = RankState::Failed;
                    r.exited_at_ms = at_ms;
                    r.failure = Some(format!(
                        "rank {} attempt {}: worker {worker_id} expired (no heartbeat)",
                        r.rank, r.attempt
                    ));
                    touched = true;
                }
            }
            if touched {
                dirty.insert(DirtyKey::Job(job.id.clone()));
            }
        }
        Response::Ok
    }

    /// Validates a registration's GPUs: at most [`MAX_GPUS_PER_WORKER`], valid and
    /// distinct UUIDs that no other alive worker registered, printable names of at most
    /// [`MAX_GPU_NAME_BYTES`].
    fn check_gpus(&self, worker_id: &str, gpus: &[GpuDevice]) -> Result<(), PlacementError> {
        if gpus.len() > MAX_GPUS_PER_WORKER {
            return Err(PlacementError::BadGpu(format!(
                "{} GPUs, more than the limit of {MAX_GPUS_PER_WORKER}",
                gpus.len()
            )));
        }
        let mut seen = BTreeSet::new();
        for g in gpus {
            if !cumulus_api::gpus::is_valid_uuid(&g.uuid) {
                return Err(PlacementError::BadGpu(format!(
                    "GPU {} has an invalid UUID {:?}",
                    g.index,
                    cumulus_api::text::escape_control(&g.uuid)
                )));
            }
            if g.name.len() > MAX_GPU_NAME_BYTES || !cumulus_api::text::is_printable(&g.name) {
                return Err(PlacementError::BadGpu(format!(
                    "GPU {} has a name that is too long or not printable",
                    g.uuid
                )));
            }
            if !seen.insert(g.uuid.as_str()) {
                return Err(PlacementError::BadGpu(format!(
                    "GPU {} is listed twice",
                    g.uuid
                )));
            }
        }
        if let Some(other) = self.workers.values().find(|w| {
            w.worker_id != worker_id
                && w.state == WorkerState::Alive
                && w.gpus.iter().any(|g| seen.contains(g.uuid.as_str()))
        }) {
            return Err(PlacementError::BadGpu(format!(
                "a GPU of this registration is already registered by worker {}",
                other.worker_id
            )));
        }
        Ok(())
    }
}
