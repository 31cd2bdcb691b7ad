//! Elastic world size ([`JobSpec::min_world_size`]): the `ResizeJob` arm of `apply`, the
//! data plan each world size reads, and the resize events.
//!
//! A resize is a group restart at another number of ranks, from a kept committed step
//! (or from scratch): every rank gets a new attempt, ranks past the new size are
//! dropped, new ones are added. The records the old ranks had not consumed at that step
//! are dealt over the new ranks by [`shard_planner::repartition`], from each old rank's
//! data position, which its part's resume state carries under [`DATA_STATE_KEY`]
//! (module doc of `shard_planner::elastic`). A part without one (a trainer that does not
//! read its data through the plan) leaves the new ranks the standard plan. A resize
//! spends no restart budget.

use std::collections::BTreeSet;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use shard_planner::{DataPlan, DataPosition};

use super::*;

// The data position in a part's resume state: the rank contract's.
pub use cumulus_api::rank_env::{DATA_STATE_KEY, MAX_DATA_CARRY_BYTES};
/// Resize events kept per job (the oldest dropped first).
pub const MAX_RESIZES_KEPT: usize = 64;

/// One change of an elastic job's world size, as `describe` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResizeRecord {
    /// Leader time of the resize, in ms since the Unix epoch.
    pub at_ms: u64,
    /// Ranks before.
    pub from: u32,
    /// Ranks after.
    pub to: u32,
    /// The committed step the new ranks resume from (`None`: from scratch).
    pub resume_step: Option<u64>,
    /// Why, in words (a lost worker with no room for its ranks, capacity back at a
    /// checkpoint boundary, the first placement).
    pub cause: String,
}

/// The data plan the ranks read from a committed step on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPlanRecord {
    /// The committed step the plan's ranks started from (`None`: the job's start). Data
    /// positions in parts of later steps are in this plan's terms.
    pub from_step: Option<u64>,
    /// Segments of the epochs that differ from the standard plan.
    pub plan: DataPlan,
    /// The epoch the plan's ranks start in (segment 0, record 0).
    pub start_epoch: u32,
    /// For each rank, the `carry` values (compact JSON) of the old ranks whose records it
    /// took over: old rank `j` goes to new rank `j mod world size`. Empty when the plan
    /// did not come from data positions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub carry: Vec<Vec<String>>,
}

impl DataPlanRecord {
    /// The estimated encoded size, in bytes.
    pub(super) fn approx_bytes(&self) -> usize {
        let segments: usize = self
            .plan
            .epochs
            .values()
            .flatten()
            .flatten()
            .map(|s| s.shard.len() + 48)
            .sum();
        let carry: usize = self.carry.iter().flatten().map(|c| 2 * c.len() + 8).sum();
        128 + segments + carry
    }
}

/// The data position and carry a part's resume state holds, when it holds one.
fn data_of(state_json: &str) -> Option<(DataPosition, String)> {
    let value: serde_json::Value = serde_json::from_str(state_json).ok()?;
    let data = value.get(DATA_STATE_KEY)?;
    let num = |k: &str| data.get(k).and_then(serde_json::Value::as_u64);
    let position = DataPosition {
        epoch: u32::try_from(num("epoch")?).ok()?,
        segment: u32::try_from(num("segment")?).ok()?,
        record: num("record")?,
    };
    let carry = data
        .get("carry")
        .map(|c| c.to_string())
        .filter(|c| c.len() <= MAX_DATA_CARRY_BYTES)
        .unwrap_or_else(|| "null".to_string());
    Some((position, carry))
}

impl Job {
    /// The number of ranks the job runs with now: `spec.world_size`, or for an elastic
    /// job its current size (`spec.min_world_size..=spec.world_size`).
    pub fn world_size(&self) -> u32 {
        u32::try_from(self.ranks.len()).unwrap_or(u32::MAX)
    }

    /// Every shard of the job's dataset, sorted.
    pub fn all_shards(&self) -> Vec<String> {
        let mut all: Vec<String> = self.shard_plan.iter().flatten().cloned().collect();
        all.sort_unstable();
        all
    }

    /// The data plan in force for the parts of committed `step` (`None`: the job's
    /// start): the newest plan whose ranks started before it.
    pub fn data_plan_at(&self, step: Option<u64>) -> Option<&DataPlanRecord> {
        self.data_plans.iter().rev().find(|p| p.from_step < step)
    }

    /// The data plan of the current ranks (the newest).
    pub fn data_plan(&self) -> Option<&DataPlanRecord> {
        self.data_plans.last()
    }

    /// Re-sizes the job to `placements.len()` ranks (placed as given), every rank a new
    /// attempt resuming from `resume_step` (rank `r` from the part of old rank `r mod`
    /// the parts' count), with the data plan for the new size: re-partitioned from the
    /// parts' data positions when every part has one, else standard. Pure.
    pub(super) fn resize(
        &mut self,
        (placements, gpus): (&[(u32, String)], &[RankGpus]),
        resume_step: Option<u64>,
        cause: &str,
        at_ms: u64,
    ) -> Result<(), String> {
        let new_world =
            u32::try_from(placements.len()).map_err(|_| "too many placements".to_string())?;
        let placed: BTreeSet<u32> = placements.iter().map(|(r, _)| *r).collect();
        if new_world == 0
            || placed.len() != placements.len()
            || placed.last() != Some(&(new_world - 1))
        {
            return Err(format!(
                "a resize to {new_world} ranks must place each of ranks 0..{new_world} once"
            ));
        }
        let shards = self.all_shards();
        let record = match resume_step {
            None => DataPlanRecord {
                from_step: None,
                plan: DataPlan::standard(new_world),
                start_epoch: 0,
                carry: Vec::new(),
            },
            Some(step) => {
                let parts = self
                    .committed
                    .get(&step)
                    .ok_or_else(|| format!("step {step} is not a kept committed step"))?;
                let data: Option<Vec<(DataPosition, String)>> =
                    parts.iter().map(|p| data_of(&p.state_json)).collect();
                match data {
                    Some(data) if !data.is_empty() => {
                        let old_world = u32::try_from(data.len()).unwrap_or(u32::MAX);
                        let old = self
                            .data_plan_at(Some(step))
                            .map(|p| p.plan.clone())
                            .filter(|p| p.world_size == old_world)
                            .unwrap_or_else(|| DataPlan::standard(old_world));
                        let positions: Vec<DataPosition> = data.iter().map(|(p, _)| *p).collect();
                        let plan = shard_planner::repartition(&shards, &old, &positions, new_world)
                            .map_err(|e| format!("data plan: {e}"))?;
                        let mut carry = vec![Vec::new(); new_world as usize];
                        for (j, (_, c)) in data.into_iter().enumerate() {
                            carry[j % new_world as usize].push(c);
                        }
                        DataPlanRecord {
                            from_step: Some(step),
                            plan,
                            start_epoch: shard_planner::elastic::start_epoch(&positions),
                            carry,
                        }
                    }
                    _ => DataPlanRecord {
                        from_step: Some(step),
                        plan: DataPlan::standard(new_world),
                        start_epoch: 0,
                        carry: Vec::new(),
                    },
                }
            }
        };
        self.shard_plan =
            shard_planner::assign_shards(&shards, new_world).map_err(|e| e.to_string())?;
        // Plans of steps no longer resumable go; the one in force for the oldest kept
        // step stays.
        self.data_plans.retain(|p| p.from_step < resume_step);
        let oldest = self.committed.keys().next().copied();
        while self.data_plans.len() > 1 && self.data_plans[1].from_step < oldest {
            self.data_plans.remove(0);
        }
        self.data_plans.push(record);
        match resume_step {
            Some(step) => {
                self.committed.retain(|s, _| *s <= step);
                self.committed_step = Some(step);
            }
            None => {
                self.committed.clear();
                self.committed_step = None;
            }
        }
        self.pending_parts.clear();
        let from = self.world_size();
        let floor = self
            .ranks
            .iter()
            .map(|r| r.attempt)
            .max()
            .unwrap_or(0)
            .max(self.attempt_floor);
        self.attempt_floor = floor;
        // The removed ranks' attempts stay findable (their logs), and come back with the
        // rank when a grow adds it again.
        for r in self.ranks.drain(new_world.min(from) as usize..) {
            if !r.attempt_workers.is_empty() {
                self.removed_rank_workers
                    .entry(r.rank)
                    .or_default()
                    .extend(r.attempt_workers);
            }
        }
        while self.world_size() < new_world {
            let mut r = self.ranks[0].clone();
            r.rank = self.world_size();
            r.attempt = floor;
            r.attempt_workers = self
                .removed_rank_workers
                .remove(&r.rank)
                .unwrap_or_default();
            r.worker_id = None;
            r.gpus.clear();
            self.ranks.push(r);
        }
        for i in 0..self.ranks.len() {
            let resume = self.resume_point(resume_step, self.ranks[i].rank);
            let r = &mut self.ranks[i];
            r.new_attempt(resume);
            r.not_before_ms = at_ms;
        }
        self.resize_count = self.resize_count.saturating_add(1);
        self.master_port = master_port(
            self.seq,
            self.restarts_used + self.agent_fault_restarts + self.resize_count,
        );
        self.resizes.push(ResizeRecord {
            at_ms,
            from,
            to: new_world,
            resume_step,
            cause: cumulus_api::text::bounded_line(cause, MAX_RESIZE_CAUSE_BYTES),
        });
        if self.resizes.len() > MAX_RESIZES_KEPT {
            self.resizes.remove(0);
        }
        apply::ranks::assign_placements(self, placements, gpus, at_ms);
        Ok(())
    }
}

/// Longest cause of a resize kept, in bytes.
pub const MAX_RESIZE_CAUSE_BYTES: usize = 512;

impl ClusterState {
    /// `ResizeJob`: a running elastic job with no stop in flight (or a grow's, once no
    /// rank runs: the resize clears it) changes its number of ranks to
    /// `placements.len()` (within its bounds, not its current size), every rank placed as
    /// given (checked as a placement with the job's old ranks' slots free), resuming from
    /// a kept committed step or from scratch ([`Job::resize`]).
    pub(super) fn resize_job(
        &mut self,
        job_id: &str,
        (placements, gpus): (&[(u32, String)], &[RankGpus]),
        resume_step: Option<u64>,
        cause: &str,
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        let Some(job) = self.jobs.get(job_id) else {
            return reject(format!("unknown job {job_id}"));
        };
        if job.state != JobState::Running {
            return reject(format!(
                "job {job_id} is {}, not running",
                job.state.as_str()
            ));
        }
        if !job.spec.is_elastic() {
            return reject(format!("job {job_id} has a fixed world size"));
        }
        if let Some(stop) = &job.stop {
            if !stop.grow {
                return reject(format!(
                    "job {job_id} is stopping ({}): no resize",
                    stop.action
                ));
            }
            if let Some(r) = job.ranks.iter().find(|r| r.state == RankState::Running) {
                return reject(format!(
                    "job {job_id} is stopping to grow, and rank {} attempt {} still runs",
                    r.rank, r.attempt
                ));
            }
        }
        let n = placements.len();
        if n < job.spec.min_world_size as usize || n > job.spec.world_size as usize {
            return reject(format!(
                "{n} ranks is outside job {job_id}'s world size {}:{}",
                job.spec.min_world_size, job.spec.world_size
            ));
        }
        if n == job.ranks.len() {
            return reject(format!("job {job_id} already runs {n} ranks"));
        }
        if let Some(step) = resume_step
            && !job.committed.contains_key(&step)
        {
            return reject(format!("step {step} is not a kept committed step"));
        }
        let before = Arc::clone(job);
        let mut resized = (*before).clone();
        if let Err(why) = resized.resize((placements, gpus), resume_step, cause, at_ms) {
            return reject(why);
        }
        resized.stop = None;
        self.jobs.insert(job_id.to_string(), Arc::new(resized));
        let all: BTreeSet<u32> = (0..n as u32).collect();
        if let Err(e) = self.check_placements(job_id, &all, placements, gpus) {
            self.jobs.insert(job_id.to_string(), before);
            return reject(e.to_string());
        }
        dirty.insert(DirtyKey::Job(job_id.to_string()));
        Response::Ok
    }

    /// `PlaceJob` of a pending elastic job with another number of ranks than it has
    /// (`spec.min_world_size..=spec.world_size`): it starts with as many as fit, from its
    /// newest committed step ([`Job::resize`]); it becomes running.
    pub(super) fn place_elastic(
        &mut self,
        job_id: &str,
        (placements, gpus): (&[(u32, String)], &[RankGpus]),
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        let Some(job) = self.jobs.get(job_id) else {
            return reject(format!("unknown job {job_id}"));
        };
        let n = placements.len();
        if n < job.spec.min_world_size as usize || n > job.spec.world_size as usize {
            return reject(format!(
                "{n} ranks is outside job {job_id}'s world size {}:{}",
                job.spec.min_world_size, job.spec.world_size
            ));
        }
        let before = Arc::clone(job);
        let mut placed = (*before).clone();
        let cause = format!("placed with the {n} ranks that fit");
        if let Err(why) = placed.resize((placements, gpus), placed.committed_step, &cause, at_ms) {
            return reject(why);
        }
        for r in &mut placed.ranks {
            r.not_before_ms = 0;
        }
        placed.state = JobState::Running;
        placed.run_started_at_ms = at_ms;
        self.jobs.insert(job_id.to_string(), Arc::new(placed));
        let all: BTreeSet<u32> = (0..n as u32).collect();
        if let Err(e) = self.check_placements(job_id, &all, placements, gpus) {
            self.jobs.insert(job_id.to_string(), before);
            return reject(e.to_string());
        }
        dirty.insert(DirtyKey::Job(job_id.to_string()));
        Response::Ok
    }
}
