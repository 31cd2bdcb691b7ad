//! Read-only capacity and placement queries of the [`ClusterState`]: slots and GPU shares
//! in use, what the alive workers offer (free now, or in all), whether a job fits now,
//! later or never and why ([`Outlook`]), and the check of a placement against all that
//! ([`PlacementError`]). `apply` checks `PlaceJob` and `ScheduleRestart` with them; the
//! leader plans and explains pending jobs with the same answers. None of them changes the
//! state.

use std::collections::{BTreeMap, BTreeSet};

use super::*;

impl ClusterState {
    /// Slots of the alive workers in all (what a job may use at most).
    pub fn alive_slots(&self) -> u64 {
        self.workers
            .values()
            .filter(|w| w.state == WorkerState::Alive)
            .map(|w| u64::from(w.slots))
            .sum()
    }

    /// What the alive workers offer in all, computed once so that many jobs can be
    /// tested against it ([`AliveTotals::never_fits`]): O(workers + their GPUs).
    pub fn alive_totals(&self) -> AliveTotals {
        AliveTotals {
            slots: self.alive_slots(),
            gpus_all_free: self.gpu_capacity(true),
        }
    }

    /// Free capacity of every alive worker for the GPU planner: free slots and each
    /// GPU's free share (`all_free`: as if nothing ran, for "could it ever fit"). GPU
    /// health is soft state the replicated state does not hold: every GPU counts here.
    pub fn gpu_capacity(&self, all_free: bool) -> Vec<shard_planner::WorkerGpus> {
        let (slots, gpus) = if all_free {
            (BTreeMap::new(), BTreeMap::new())
        } else {
            (self.slots_used(None), self.gpus_used(None))
        };
        self.workers
            .values()
            .filter(|w| w.state == WorkerState::Alive)
            .map(|w| shard_planner::WorkerGpus {
                worker_id: w.worker_id.clone(),
                free_slots: w
                    .slots
                    .saturating_sub(slots.get(&w.worker_id).copied().unwrap_or(0)),
                gpus: w
                    .gpus
                    .iter()
                    .map(|g| shard_planner::GpuFree {
                        uuid: g.uuid.clone(),
                        free_permille: cumulus_api::gpus::WHOLE_GPU_PERMILLE
                            .saturating_sub(gpus.get(&g.uuid).copied().unwrap_or(0)),
                    })
                    .collect(),
            })
            .collect()
    }

    /// Why a pending job is not placed: what it needs against what the alive workers
    /// offer in all ("cannot be placed") or have free now ("waiting"). `None` for a job
    /// that is not pending, or one that would fit now (the leader places it at its next
    /// pass). O(workers + running ranks).
    pub fn pending_reason(&self, job: &Job) -> Option<String> {
        if job.state != JobState::Pending {
            return None;
        }
        match self.capacity_outlook(&job.spec) {
            // It fits, so a job ahead of it in the queue holds it back.
            Outlook::FitsNow => {
                let totals = self.alive_totals();
                self.index
                    .queue
                    .range(..(-job.spec.priority, job.id.clone()))
                    .find(|(_, id)| {
                        // One larger than the cluster holds no one up (the planner skips it).
                        self.jobs
                            .get(id)
                            .is_some_and(|j| !totals.never_fits(&j.spec))
                    })
                    .map(|(neg_priority, id)| {
                        format!(
                            "queued behind {id} (priority {}), which waits for capacity: a job \
                         behind it starts first only when it cannot delay it (its time limit \
                         ends before that job can start, or it fits in slots that job will \
                         not need)",
                            -neg_priority
                        )
                    })
            }
            Outlook::Waits(why) | Outlook::Never(why) => Some(why),
        }
    }

    /// Whether a job of `spec` fits the alive workers now, later (once running jobs end),
    /// or never (more than they offer in all), with the reason in words. GPU health is
    /// soft state the replicated state does not hold: every GPU counts here.
    pub fn capacity_outlook(&self, spec: &JobSpec) -> Outlook {
        // An elastic job starts with as few as its minimum.
        let world = spec.min_ranks();
        let Some(demand) = spec.gpu_demand() else {
            let capacity = self.gpu_capacity(false);
            let total = self.alive_slots();
            let free: u64 = capacity.iter().map(|w| u64::from(w.free_slots)).sum();
            return if total < u64::from(world) {
                Outlook::Never(format!(
                    "cannot be placed: it needs {world} slots and the alive workers offer {total} in all"
                ))
            } else if free < u64::from(world) {
                Outlook::Waits(format!(
                    "waiting for {world} free slots: {free} of {total} are free now"
                ))
            } else {
                Outlook::FitsNow
            };
        };
        let need = if demand.permille == shard_planner::WHOLE_GPU_PERMILLE {
            format!(
                "{world} ranks x {} GPU{}",
                demand.gpus_per_rank,
                if demand.gpus_per_rank == 1 { "" } else { "s" }
            )
        } else {
            format!(
                "{world} ranks x {} of a GPU",
                cumulus_api::gpus::permille_to_fraction(demand.permille)
            )
        };
        let total_gpus: usize = self
            .workers
            .values()
            .filter(|w| w.state == WorkerState::Alive)
            .map(|w| w.gpus.len())
            .sum();
        let now = self.gpu_capacity(false);
        if !gpu_job_fits(spec, &self.gpu_capacity(true)) {
            return Outlook::Never(format!(
                "cannot be placed: it needs {need} (gang, each rank's GPUs on its worker) and \
                 the alive workers have {total_gpus} GPUs in all"
            ));
        }
        if gpu_job_fits(spec, &now) {
            return Outlook::FitsNow;
        }
        let free_gpus = now
            .iter()
            .flat_map(|w| &w.gpus)
            .filter(|g| g.free_permille >= demand.permille)
            .count();
        Outlook::Waits(format!(
            "waiting for GPUs: it needs {need}; {free_gpus} of {total_gpus} GPUs have room for a rank now"
        ))
    }

    /// Share of each GPU (by UUID) held by ranks of running jobs that are placed and not
    /// ended, in thousandths (a whole GPU: 1000), leaving out the ranks named in
    /// `except` (which are being re-placed).
    pub fn gpus_used(&self, except: Option<(&str, &BTreeSet<u32>)>) -> BTreeMap<String, u32> {
        let mut used: BTreeMap<String, u32> = BTreeMap::new();
        for job in self.index.running.iter().filter_map(|id| self.jobs.get(id)) {
            let share = job.spec.gpu_share_permille();
            if share == 0 {
                continue;
            }
            for r in &job.ranks {
                if let Some((j, ranks)) = except
                    && j == job.id
                    && ranks.contains(&r.rank)
                {
                    continue;
                }
                if r.worker_id.is_some()
                    && matches!(r.state, RankState::Pending | RankState::Running)
                {
                    for g in &r.gpus {
                        *used.entry(g.clone()).or_insert(0) += share;
                    }
                }
            }
        }
        used
    }

    /// The GPU half of [`ClusterState::check_placements`].
    fn check_gpu_placements(
        &self,
        job_id: &str,
        ranks: &BTreeSet<u32>,
        placements: &[(u32, String)],
        gpus: &[RankGpus],
    ) -> Result<(), PlacementError> {
        let demand = self.jobs.get(job_id).and_then(|j| j.spec.gpu_demand());
        let Some(demand) = demand else {
            return if gpus.is_empty() {
                Ok(())
            } else {
                Err(PlacementError::GpusMismatch)
            };
        };
        let by_rank: BTreeMap<u32, &Vec<String>> = gpus.iter().map(|(r, g)| (*r, g)).collect();
        if by_rank.len() != gpus.len() || by_rank.keys().ne(ranks.iter()) {
            return Err(PlacementError::GpusMismatch);
        }
        let mut wanted: BTreeMap<&str, u32> = BTreeMap::new();
        for (rank, worker_id) in placements {
            let Some(list) = by_rank.get(rank) else {
                return Err(PlacementError::GpusMismatch);
            };
            let distinct: BTreeSet<&String> = list.iter().collect();
            if list.len() != demand.gpus_per_rank as usize || distinct.len() != list.len() {
                return Err(PlacementError::GpusMismatch);
            }
            let inventory = self.workers.get(worker_id).map(|w| &w.gpus);
            for uuid in list.iter() {
                if !inventory.is_some_and(|inv| inv.iter().any(|g| &g.uuid == uuid)) {
                    return Err(PlacementError::ForeignGpu {
                        uuid: uuid.clone(),
                        worker_id: worker_id.clone(),
                    });
                }
                *wanted.entry(uuid.as_str()).or_default() += demand.permille;
            }
        }
        let used = self.gpus_used(Some((job_id, ranks)));
        for (uuid, wanted_permille) in wanted {
            let free_permille = cumulus_api::gpus::WHOLE_GPU_PERMILLE
                .saturating_sub(used.get(uuid).copied().unwrap_or(0));
            if wanted_permille > free_permille {
                return Err(PlacementError::GpuFull {
                    uuid: uuid.to_string(),
                    free_permille,
                    wanted_permille,
                });
            }
        }
        Ok(())
    }

    /// Validates that `placements` put each of `ranks` on an alive worker exactly once,
    /// that no worker gets more ranks than its free slots, and, for a job with GPUs,
    /// that `gpus` gives each rank as many distinct GPUs of its worker as it needs with
    /// no GPU shared past a whole one (none for a job without GPUs).
    pub(super) fn check_placements(
        &self,
        job_id: &str,
        ranks: &BTreeSet<u32>,
        placements: &[(u32, String)],
        gpus: &[RankGpus],
    ) -> Result<(), PlacementError> {
        self.check_gpu_placements(job_id, ranks, placements, gpus)?;
        let placed: BTreeSet<u32> = placements.iter().map(|(r, _)| *r).collect();
        if placed != *ranks || placed.len() != placements.len() {
            return Err(PlacementError::RanksMismatch);
        }
        let mut wanted: BTreeMap<&str, u32> = BTreeMap::new();
        for (_, w) in placements {
            *wanted.entry(w.as_str()).or_default() += 1;
        }
        let used = self.slots_used(Some((job_id, ranks)));
        for (w, n) in wanted {
            let Some(rec) = self.workers.get(w) else {
                return Err(PlacementError::UnknownWorker(w.to_string()));
            };
            if rec.state != WorkerState::Alive {
                return Err(PlacementError::ExpiredWorker(w.to_string()));
            }
            let free = rec.slots.saturating_sub(used.get(w).copied().unwrap_or(0));
            if n > free {
                return Err(PlacementError::NoSlots {
                    worker_id: w.to_string(),
                    free,
                    wanted: n,
                });
            }
        }
        Ok(())
    }

    /// Slots in use per worker by ranks of running jobs that are placed and not ended,
    /// leaving out the ranks named in `except` (which are being re-placed). Visits only
    /// running jobs ([`JobIndex::running`]).
    pub fn slots_used(&self, except: Option<(&str, &BTreeSet<u32>)>) -> BTreeMap<String, u32> {
        let mut used = BTreeMap::new();
        // Only running jobs are placed (a job gets its workers when it leaves pending).
        for job in self.index.running.iter().filter_map(|id| self.jobs.get(id)) {
            for r in &job.ranks {
                if let Some((j, ranks)) = except
                    && j == job.id
                    && ranks.contains(&r.rank)
                {
                    continue;
                }
                if let (Some(w), RankState::Pending | RankState::Running) = (&r.worker_id, r.state)
                {
                    *used.entry(w.clone()).or_insert(0) += 1;
                }
            }
        }
        used
    }
}

/// Why a `PlaceJob` or `RestartRanks` command's placements were refused by `apply`: a
/// leader planned against a view that the log has since overtaken.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// The placements do not name each rank to place exactly once.
    #[error("placement does not cover exactly the ranks to place")]
    RanksMismatch,
    /// A worker the state does not know.
    #[error("unknown worker {0}")]
    UnknownWorker(String),
    /// A worker whose heartbeats have expired.
    #[error("worker {0} is expired")]
    ExpiredWorker(String),
    /// A worker given more ranks than it has free slots.
    #[error("worker {worker_id} has {free} free slots, not {wanted}")]
    NoSlots {
        /// The worker.
        worker_id: String,
        /// Its slots not used by other running ranks.
        free: u32,
        /// Ranks the placements give it.
        wanted: u32,
    },
    /// A registration's GPU inventory broke a rule.
    #[error("invalid GPU inventory: {0}")]
    BadGpu(String),
    /// GPUs given to a job without GPUs, or not exactly the placed ranks of a job with.
    #[error("the GPUs do not match the job's ranks and gpus_per_rank")]
    GpusMismatch,
    /// A GPU that is not its rank's worker's.
    #[error("GPU {uuid} is not a GPU of worker {worker_id}")]
    ForeignGpu {
        /// The GPU's UUID.
        uuid: String,
        /// The worker the rank is placed on.
        worker_id: String,
    },
    /// A GPU whose shares would add up past a whole GPU.
    #[error("GPU {uuid} has {free_permille}/1000 free, not {wanted_permille}/1000")]
    GpuFull {
        /// The GPU's UUID.
        uuid: String,
        /// Its share not held by other running ranks, in thousandths.
        free_permille: u32,
        /// What the placements give out of it, in thousandths.
        wanted_permille: u32,
    },
}

/// The alive workers' capacity in all, as if nothing ran ([`ClusterState::alive_totals`]):
/// a snapshot for one planning pass or one listing, not kept across state changes.
#[derive(Clone, Debug)]
pub struct AliveTotals {
    /// Slots of the alive workers in all.
    slots: u64,
    /// Every alive worker with all its slots and GPUs free.
    gpus_all_free: Vec<shard_planner::WorkerGpus>,
}

impl AliveTotals {
    /// True when a job of `spec` needs more than the alive workers offer in all: the
    /// test behind [`Outlook::Never`] without its words. O(1) for a job without GPUs,
    /// one run of the GPU planner for a job with them.
    pub fn never_fits(&self, spec: &JobSpec) -> bool {
        if spec.gpu_demand().is_some() {
            !gpu_job_fits(spec, &self.gpus_all_free)
        } else {
            self.slots < u64::from(spec.min_ranks())
        }
    }
}

/// True when every rank of `spec` finds its GPUs on `capacity` (a job without GPUs:
/// always).
fn gpu_job_fits(spec: &JobSpec, capacity: &[shard_planner::WorkerGpus]) -> bool {
    let Some(demand) = spec.gpu_demand() else {
        return true;
    };
    let ranks: Vec<u32> = (0..spec.min_ranks()).collect();
    matches!(
        shard_planner::place_gpu_ranks(&ranks, capacity, demand),
        Ok(Some(_))
    )
}

/// Whether a job fits the cluster's alive workers ([`ClusterState::capacity_outlook`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outlook {
    /// It would be placed at the leader's next pass.
    FitsNow,
    /// It fits the alive workers, once running jobs free slots or GPUs (why, in words).
    Waits(String),
    /// It needs more than the alive workers offer in all (why, in words).
    Never(String),
}
