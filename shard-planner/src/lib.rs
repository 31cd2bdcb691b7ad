//! Pure, deterministic planning for Cumulus.
//!
//! Three plans, each a pure function of its input (no I/O, no clock, no randomness), so the
//! Raft state machine can compute them inside `apply` and every replica gets the same answer:
//!
//! - [`assign_shards`]: dataset shards → ranks. Shard `i` of the name-sorted list belongs to
//!   rank `i mod world_size` (the original brief, `DESIGN.md`, "Shards"). The plan never depends on the order in
//!   which the shard names were given.
//! - [`place_ranks`]: ranks → workers, gang style (all ranks or none). Each rank goes to the
//!   worker with the most free slots left at that moment, ties broken by the smallest worker
//!   id; the result never depends on the order of the worker list.
//! - [`place_gpu_ranks`]: ranks that need GPUs → workers and GPUs, gang style: whole GPUs
//!   or shares of one (thousandths), the ranks packed onto as few workers as possible
//!   (ranks on one machine talk over NVLink), consecutive ranks together.
//! - [`local_ranks`]: for a placement, each rank's `LOCAL_RANK` and `LOCAL_WORLD_SIZE` (the
//!   torchrun contract).
//! - [`repartition`] ([`elastic`]): when an elastic job changes its world size, the records
//!   its ranks had not consumed at the committed step, dealt over the new ranks exactly once.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

pub mod elastic;
pub use elastic::{DataPlan, DataPosition, Segment, repartition};

/// Error for invalid planning input. Callers branch on the variant; the payload names the
/// offending value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    /// `world_size` was 0; a job has at least one rank.
    #[error("world size must be at least 1")]
    ZeroWorldSize,
    /// The same shard name appears twice in a shard list.
    #[error("duplicate shard {0:?}")]
    DuplicateShard(String),
    /// The same worker id appears twice in a worker list or placement input.
    #[error("duplicate worker {0:?}")]
    DuplicateWorker(String),
    /// A worker id was empty.
    #[error("empty worker id")]
    EmptyWorkerId,
    /// The same rank appears twice.
    #[error("duplicate rank {0}")]
    DuplicateRank(u32),
    /// A rank outside `0..world_size` (for a placement: `0..placement.len()`).
    #[error("unknown rank {0}")]
    UnknownRank(u32),
    /// A GPU demand of zero GPUs per rank, or a share outside `1..=1000` thousandths.
    #[error("a GPU demand needs at least one GPU per rank and a share of 1..=1000 thousandths")]
    BadGpuDemand,
    /// The same GPU UUID appears twice among the workers' GPUs.
    #[error("duplicate GPU {0:?}")]
    DuplicateGpu(String),
    /// [`repartition`] got a number of positions other than the old plan's world size.
    #[error("{found} data positions for a plan of {expected} ranks")]
    PositionCount {
        /// The old plan's world size.
        expected: u32,
        /// Positions given.
        found: usize,
    },
    /// A rank's data position lies past the segments of its epoch.
    #[error("the data position of rank {rank} lies past its segments")]
    PositionOutOfRange {
        /// The rank.
        rank: u32,
    },
    /// The ranks given to [`place_ranks`] were not strictly ascending.
    #[error("ranks must be strictly ascending, but {next} follows {previous}")]
    RanksNotAscending {
        /// The rank before the offending one.
        previous: u32,
        /// The offending rank (≤ `previous`).
        next: u32,
    },
}

/// Assigns shards to ranks round-robin: after sorting the names ascending (byte order),
/// shard `i` goes to rank `i mod world_size`.
///
/// Returns one `Vec` per rank (outer length == `world_size`), each holding that rank's shard
/// names in ascending order. A rank gets zero shards when there are fewer shards than ranks.
///
/// # Errors
/// [`PlanError::ZeroWorldSize`] when `world_size == 0`; [`PlanError::DuplicateShard`] when a
/// name appears twice (the smallest duplicated name is reported).
pub fn assign_shards(shards: &[String], world_size: u32) -> Result<Vec<Vec<String>>, PlanError> {
    if world_size == 0 {
        return Err(PlanError::ZeroWorldSize);
    }
    let mut sorted: Vec<&String> = shards.iter().collect();
    sorted.sort_unstable();
    if let Some(pair) = sorted.windows(2).find(|pair| pair[0] == pair[1]) {
        return Err(PlanError::DuplicateShard(pair[0].clone()));
    }
    let world = usize::try_from(world_size).expect("u32 fits in usize on supported targets");
    let mut plan: Vec<Vec<String>> = (0..world)
        .map(|rank| {
            Vec::with_capacity(sorted.len() / world + usize::from(rank < sorted.len() % world))
        })
        .collect();
    for (index, shard) in sorted.into_iter().enumerate() {
        plan[index % world].push(shard.clone());
    }
    Ok(plan)
}

/// The shards of one rank: the `rank`-th list of [`assign_shards`], computed without building
/// the other ranks' lists.
///
/// # Errors
/// As [`assign_shards`], plus [`PlanError::UnknownRank`] when `rank >= world_size`.
pub fn shards_for_rank(
    shards: &[String],
    world_size: u32,
    rank: u32,
) -> Result<Vec<String>, PlanError> {
    if world_size == 0 {
        return Err(PlanError::ZeroWorldSize);
    }
    if rank >= world_size {
        return Err(PlanError::UnknownRank(rank));
    }
    let mut sorted: Vec<&String> = shards.iter().collect();
    sorted.sort_unstable();
    if let Some(pair) = sorted.windows(2).find(|pair| pair[0] == pair[1]) {
        return Err(PlanError::DuplicateShard(pair[0].clone()));
    }
    let world = usize::try_from(world_size).expect("u32 fits in usize on supported targets");
    let rank = usize::try_from(rank).expect("u32 fits in usize on supported targets");
    Ok(sorted
        .into_iter()
        .skip(rank)
        .step_by(world)
        .cloned()
        .collect())
}

/// A worker's capacity as seen by the scheduler: how many more ranks it can take.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WorkerSlots {
    /// Worker id (1..=64 bytes of `[A-Za-z0-9._-]` by the cluster contract; only
    /// non-emptiness and uniqueness are checked here).
    pub worker_id: String,
    /// Number of rank slots still free on this worker (count of ranks).
    pub free_slots: u32,
}

/// Gang placement of `ranks` (strictly ascending) on `workers`: all ranks or none.
///
/// Ranks are placed in ascending order; each goes to the worker with the most free slots
/// remaining at that moment (after the ranks placed before it), ties broken by the smallest
/// `worker_id` (byte order). The result does not depend on the order of `workers`.
///
/// Returns `Ok(None)` when the total free slots are fewer than `ranks.len()` (nothing is
/// placed), otherwise `Ok(Some(pairs))` with one `(rank, worker_id)` per rank, in rank
/// order. No worker ever receives more ranks than its `free_slots`.
///
/// # Errors
/// [`PlanError::RanksNotAscending`] when `ranks` is not strictly ascending;
/// [`PlanError::DuplicateWorker`] / [`PlanError::EmptyWorkerId`] for a bad worker list.
pub fn place_ranks(
    ranks: &[u32],
    workers: &[WorkerSlots],
) -> Result<Option<Vec<(u32, String)>>, PlanError> {
    if let Some(pair) = ranks.windows(2).find(|pair| pair[0] >= pair[1]) {
        return Err(PlanError::RanksNotAscending {
            previous: pair[0],
            next: pair[1],
        });
    }
    let mut seen: BTreeSet<&str> = BTreeSet::new();
    for worker in workers {
        if worker.worker_id.is_empty() {
            return Err(PlanError::EmptyWorkerId);
        }
        if !seen.insert(worker.worker_id.as_str()) {
            return Err(PlanError::DuplicateWorker(worker.worker_id.clone()));
        }
    }
    let total_free: u64 = workers
        .iter()
        .map(|worker| u64::from(worker.free_slots))
        .sum();
    let wanted = u64::try_from(ranks.len()).expect("a slice length fits in u64");
    if total_free < wanted {
        return Ok(None);
    }
    // Max-heap on (free slots, smallest id first): the top is the worker the rule picks.
    let mut heap: BinaryHeap<(u32, Reverse<&str>)> = workers
        .iter()
        .filter(|worker| worker.free_slots > 0)
        .map(|worker| (worker.free_slots, Reverse(worker.worker_id.as_str())))
        .collect();
    let mut placement = Vec::with_capacity(ranks.len());
    for &rank in ranks {
        let (free, Reverse(id)) = heap
            .pop()
            .expect("total free slots were checked to cover every rank");
        placement.push((rank, id.to_owned()));
        if free > 1 {
            heap.push((free - 1, Reverse(id)));
        }
    }
    Ok(Some(placement))
}

/// Thousandths of a GPU: a whole GPU is [`WHOLE_GPU_PERMILLE`].
pub const WHOLE_GPU_PERMILLE: u32 = 1000;

/// One healthy GPU of a worker as the GPU planner sees it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GpuFree {
    /// The GPU's UUID (unique in the cluster).
    pub uuid: String,
    /// Share of it not given to any rank, in thousandths (`0..=1000`; more is treated as
    /// 1000).
    pub free_permille: u32,
}

/// A worker's capacity for ranks that need GPUs.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WorkerGpus {
    /// Worker id (non-empty, unique).
    pub worker_id: String,
    /// Rank slots still free on it (count of ranks).
    pub free_slots: u32,
    /// Its healthy GPUs, in index order (the order breaks ties).
    pub gpus: Vec<GpuFree>,
}

/// What each rank of a job needs: `gpus_per_rank` distinct GPUs with `permille`
/// thousandths free on each (1000: whole GPUs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuDemand {
    /// Distinct GPUs per rank (at least 1).
    pub gpus_per_rank: u32,
    /// Share of each of them, in thousandths, `1..=1000`.
    pub permille: u32,
}

/// One rank's place: its worker and the UUIDs of its GPUs (in the worker's GPU order).
pub type GpuPlacement = (u32, String, Vec<String>);

/// The GPUs a rank would get on a worker whose GPUs have `free` left, or `None` when
/// fewer than `demand.gpus_per_rank` have `demand.permille` free. Prefers GPUs this job
/// holds no share of yet (`taken`, two ranks of one NCCL job cannot share a device), then
/// the fullest GPU that still fits (best fit keeps whole GPUs free for whole-GPU jobs),
/// then the GPU order. Indices into `free`.
fn pick_gpus(free: &[u32], taken: &[bool], demand: GpuDemand) -> Option<Vec<usize>> {
    let mut fitting: Vec<usize> = (0..free.len())
        .filter(|&i| free[i] >= demand.permille)
        .collect();
    let wanted = usize::try_from(demand.gpus_per_rank).expect("u32 fits in usize");
    if fitting.len() < wanted {
        return None;
    }
    fitting.sort_by_key(|&i| (taken[i], free[i], i));
    fitting.truncate(wanted);
    fitting.sort_unstable();
    Some(fitting)
}

/// Places up to `limit` ranks on one worker, greedily with [`pick_gpus`]: the GPU
/// indices of each rank placed, at most `free_slots` of them.
fn fill_worker(worker: &WorkerGpus, demand: GpuDemand, limit: usize) -> Vec<Vec<usize>> {
    let mut free: Vec<u32> = worker
        .gpus
        .iter()
        .map(|g| g.free_permille.min(WHOLE_GPU_PERMILLE))
        .collect();
    let mut taken = vec![false; free.len()];
    let limit = limit.min(usize::try_from(worker.free_slots).expect("u32 fits in usize"));
    let mut ranks = Vec::new();
    while ranks.len() < limit {
        let Some(picked) = pick_gpus(&free, &taken, demand) else {
            break;
        };
        for &i in &picked {
            free[i] -= demand.permille;
            taken[i] = true;
        }
        ranks.push(picked);
    }
    ranks
}

/// Gang placement of `ranks` (strictly ascending) that each need GPUs: all ranks or none.
///
/// Each worker's capacity is the number of ranks it can take: its free slots, and for
/// each rank `demand.gpus_per_rank` distinct GPUs with `demand.permille` thousandths
/// free (shares add up to at most 1000 per GPU). When one worker can hold every rank,
/// the job goes to the one with the least capacity that can (best fit, ties: smallest
/// id), which keeps roomier workers for larger jobs and fills shared GPUs first.
/// Otherwise the workers with the largest capacity (ties: smallest id) are taken until
/// they hold every rank, which uses as few workers as possible; consecutive ranks fill
/// one worker before the next. On a worker a rank's GPUs are chosen as [`pick_gpus`]
/// says. The result does not depend on the order of `workers`.
///
/// Returns `Ok(None)` when the ranks do not fit, else one `(rank, worker_id, gpu
/// UUIDs)` per rank in rank order.
///
/// # Errors
/// [`PlanError::RanksNotAscending`], [`PlanError::DuplicateWorker`],
/// [`PlanError::EmptyWorkerId`], [`PlanError::DuplicateGpu`], [`PlanError::BadGpuDemand`].
pub fn place_gpu_ranks(
    ranks: &[u32],
    workers: &[WorkerGpus],
    demand: GpuDemand,
) -> Result<Option<Vec<GpuPlacement>>, PlanError> {
    if let Some(pair) = ranks.windows(2).find(|pair| pair[0] >= pair[1]) {
        return Err(PlanError::RanksNotAscending {
            previous: pair[0],
            next: pair[1],
        });
    }
    if demand.gpus_per_rank == 0 || !(1..=WHOLE_GPU_PERMILLE).contains(&demand.permille) {
        return Err(PlanError::BadGpuDemand);
    }
    let mut ids: BTreeSet<&str> = BTreeSet::new();
    let mut uuids: BTreeSet<&str> = BTreeSet::new();
    for worker in workers {
        if worker.worker_id.is_empty() {
            return Err(PlanError::EmptyWorkerId);
        }
        if !ids.insert(worker.worker_id.as_str()) {
            return Err(PlanError::DuplicateWorker(worker.worker_id.clone()));
        }
        for gpu in &worker.gpus {
            if !uuids.insert(gpu.uuid.as_str()) {
                return Err(PlanError::DuplicateGpu(gpu.uuid.clone()));
            }
        }
    }
    // Capacity of each worker: (capacity, smallest id first) descending.
    let mut by_capacity: Vec<(usize, &WorkerGpus)> = workers
        .iter()
        .map(|w| (fill_worker(w, demand, ranks.len()).len(), w))
        .filter(|(capacity, _)| *capacity > 0)
        .collect();
    by_capacity.sort_by(|a, b| {
        b.0.cmp(&a.0)
            .then_with(|| a.1.worker_id.cmp(&b.1.worker_id))
    });
    // Best fit when one worker holds the whole job: the one with the least room that
    // still does (ties: smallest id), keeping roomier workers for larger jobs.
    if let Some(&(_, worker)) = by_capacity
        .iter()
        .filter(|(capacity, _)| *capacity >= ranks.len())
        .min_by(|a, b| {
            a.0.cmp(&b.0)
                .then_with(|| a.1.worker_id.cmp(&b.1.worker_id))
        })
    {
        by_capacity = vec![(ranks.len(), worker)];
    }
    let mut chosen = Vec::new();
    let mut covered = 0usize;
    for (capacity, worker) in by_capacity {
        if covered >= ranks.len() {
            break;
        }
        let take = capacity.min(ranks.len() - covered);
        chosen.push((worker, take));
        covered += take;
    }
    if covered < ranks.len() {
        return Ok(None);
    }
    let mut placement = Vec::with_capacity(ranks.len());
    let mut next = ranks.iter();
    for (worker, take) in chosen {
        for picked in fill_worker(worker, demand, take) {
            let rank = *next.next().expect("capacities cover every rank");
            let gpus = picked
                .into_iter()
                .map(|i| worker.gpus[i].uuid.clone())
                .collect();
            placement.push((rank, worker.worker_id.clone(), gpus));
        }
    }
    Ok(Some(placement))
}

/// Local ranks of a job's placement: for each rank, `(LOCAL_RANK, LOCAL_WORLD_SIZE)`.
///
/// `placement` holds `(rank, worker_id)` for every rank `0..placement.len()` exactly once, in
/// any order. `LOCAL_RANK` is the rank's index among the job's ranks on the same worker,
/// ascending by rank; `LOCAL_WORLD_SIZE` is the number of the job's ranks on that worker.
/// The output is indexed by rank (length == `placement.len()`).
///
/// # Errors
/// [`PlanError::UnknownRank`] for a rank `>= placement.len()`, [`PlanError::DuplicateRank`]
/// for a rank given twice, [`PlanError::EmptyWorkerId`] for an empty worker id.
pub fn local_ranks(placement: &[(u32, String)]) -> Result<Vec<(u32, u32)>, PlanError> {
    let world = placement.len();
    let mut worker_of: Vec<Option<&str>> = vec![None; world];
    for (rank, worker_id) in placement {
        if worker_id.is_empty() {
            return Err(PlanError::EmptyWorkerId);
        }
        let index = usize::try_from(*rank).map_err(|_| PlanError::UnknownRank(*rank))?;
        let slot = worker_of
            .get_mut(index)
            .ok_or(PlanError::UnknownRank(*rank))?;
        if slot.is_some() {
            return Err(PlanError::DuplicateRank(*rank));
        }
        *slot = Some(worker_id.as_str());
    }
    // `world` distinct ranks, each < `world`: every slot is filled.
    let mut sizes: BTreeMap<&str, u32> = BTreeMap::new();
    let mut result = Vec::with_capacity(world);
    for worker_id in &worker_of {
        let worker_id = worker_id.expect("every rank 0..world was given exactly once");
        let count = sizes.entry(worker_id).or_insert(0);
        result.push((*count, 0));
        *count += 1;
    }
    for (local, worker_id) in result.iter_mut().zip(&worker_of) {
        local.1 = sizes[worker_id.expect("every rank 0..world was given exactly once")];
    }
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|name| (*name).to_owned()).collect()
    }

    fn slots(list: &[(&str, u32)]) -> Vec<WorkerSlots> {
        list.iter()
            .map(|(id, free)| WorkerSlots {
                worker_id: (*id).to_owned(),
                free_slots: *free,
            })
            .collect()
    }

    #[test]
    fn assign_round_robin_after_sorting() {
        let shards = names(&["d", "a", "c", "e", "b"]);
        let plan = assign_shards(&shards, 2).expect("valid input");
        assert_eq!(plan, vec![names(&["a", "c", "e"]), names(&["b", "d"])]);
        assert_eq!(
            shards_for_rank(&shards, 2, 1).expect("valid"),
            names(&["b", "d"])
        );
    }

    #[test]
    fn assign_fewer_shards_than_ranks() {
        let plan = assign_shards(&names(&["x"]), 3).expect("valid input");
        assert_eq!(plan, vec![names(&["x"]), vec![], vec![]]);
        assert_eq!(
            assign_shards(&[], 2).expect("valid input"),
            vec![Vec::<String>::new(), vec![]]
        );
    }

    #[test]
    fn assign_rejects_bad_input() {
        assert_eq!(
            assign_shards(&names(&["a"]), 0),
            Err(PlanError::ZeroWorldSize)
        );
        assert_eq!(
            assign_shards(&names(&["b", "a", "b"]), 2),
            Err(PlanError::DuplicateShard("b".into()))
        );
        assert_eq!(
            shards_for_rank(&names(&["a"]), 2, 2),
            Err(PlanError::UnknownRank(2))
        );
    }

    #[test]
    fn place_least_loaded_ties_by_id() {
        let workers = slots(&[("w-b", 2), ("w-a", 2), ("w-c", 1)]);
        let placed = place_ranks(&[0, 1, 2, 3], &workers)
            .expect("valid")
            .expect("fits");
        // w-a(2) w-b(2) tie → w-a; then w-b(2) → w-b; then all 1 → w-a, w-b.
        assert_eq!(
            placed,
            vec![
                (0, "w-a".into()),
                (1, "w-b".into()),
                (2, "w-a".into()),
                (3, "w-b".into())
            ]
        );
    }

    #[test]
    fn place_all_or_nothing() {
        let workers = slots(&[("a", 1), ("b", 1)]);
        assert_eq!(place_ranks(&[0, 1, 2], &workers), Ok(None));
        assert_eq!(place_ranks(&[], &workers), Ok(Some(vec![])));
        assert_eq!(place_ranks(&[0], &[]), Ok(None));
        assert_eq!(place_ranks(&[], &[]), Ok(Some(vec![])));
    }

    #[test]
    fn place_rejects_bad_input() {
        assert_eq!(
            place_ranks(&[0, 2, 1], &slots(&[("a", 3)])),
            Err(PlanError::RanksNotAscending {
                previous: 2,
                next: 1
            })
        );
        assert_eq!(
            place_ranks(&[0, 0], &slots(&[("a", 3)])),
            Err(PlanError::RanksNotAscending {
                previous: 0,
                next: 0
            })
        );
        assert_eq!(
            place_ranks(&[0], &slots(&[("a", 1), ("a", 2)])),
            Err(PlanError::DuplicateWorker("a".into()))
        );
        assert_eq!(
            place_ranks(&[0], &slots(&[("", 1)])),
            Err(PlanError::EmptyWorkerId)
        );
    }

    #[test]
    fn local_ranks_small_case() {
        let placement = vec![
            (2, "b".to_owned()),
            (0, "a".to_owned()),
            (1, "b".to_owned()),
            (3, "a".to_owned()),
        ];
        assert_eq!(
            local_ranks(&placement),
            Ok(vec![(0, 2), (0, 2), (1, 2), (1, 2)])
        );
        assert_eq!(local_ranks(&[]), Ok(vec![]));
    }

    #[test]
    fn local_ranks_rejects_bad_input() {
        assert_eq!(
            local_ranks(&[(1, "a".into())]),
            Err(PlanError::UnknownRank(1))
        );
        assert_eq!(
            local_ranks(&[(0, "a".into()), (0, "b".into())]),
            Err(PlanError::DuplicateRank(0))
        );
        assert_eq!(
            local_ranks(&[(0, String::new())]),
            Err(PlanError::EmptyWorkerId)
        );
    }

    fn gpu_workers(list: &[(&str, u32, &[u32])]) -> Vec<WorkerGpus> {
        list.iter()
            .map(|(id, slots, gpus)| WorkerGpus {
                worker_id: (*id).to_owned(),
                free_slots: *slots,
                gpus: gpus
                    .iter()
                    .enumerate()
                    .map(|(i, free)| GpuFree {
                        uuid: format!("GPU-{id}-{i}"),
                        free_permille: *free,
                    })
                    .collect(),
            })
            .collect()
    }

    const WHOLE: GpuDemand = GpuDemand {
        gpus_per_rank: 1,
        permille: 1000,
    };

    #[test]
    fn gpu_ranks_get_disjoint_whole_gpus_packed() {
        let workers = gpu_workers(&[("b", 4, &[1000, 1000]), ("a", 4, &[1000, 1000])]);
        let placed = place_gpu_ranks(&[0, 1, 2, 3], &workers, WHOLE)
            .expect("valid")
            .expect("fits");
        assert_eq!(
            placed,
            vec![
                (0, "a".into(), vec!["GPU-a-0".into()]),
                (1, "a".into(), vec!["GPU-a-1".into()]),
                (2, "b".into(), vec!["GPU-b-0".into()]),
                (3, "b".into(), vec!["GPU-b-1".into()]),
            ]
        );
        // Two ranks fit on one worker: the other stays untouched.
        let placed = place_gpu_ranks(&[0, 1], &workers, WHOLE)
            .expect("valid")
            .expect("fits");
        assert!(placed.iter().all(|(_, w, _)| w == "a"), "{placed:?}");
        // Packed: the worker with room for all three wins over an earlier id.
        let workers = gpu_workers(&[("a", 8, &[1000, 1000]), ("z", 8, &[1000; 3])]);
        let placed = place_gpu_ranks(&[0, 1, 2], &workers, WHOLE)
            .expect("valid")
            .expect("fits");
        assert!(placed.iter().all(|(_, w, _)| w == "z"), "{placed:?}");
    }

    #[test]
    fn gpu_ranks_all_or_nothing_and_bounded_by_slots() {
        let workers = gpu_workers(&[("a", 1, &[1000, 1000]), ("b", 4, &[1000, 500])]);
        // a: one slot; b: one whole GPU free. Two ranks fit, three do not.
        assert!(
            place_gpu_ranks(&[0, 1], &workers, WHOLE)
                .expect("valid")
                .is_some()
        );
        assert_eq!(place_gpu_ranks(&[0, 1, 2], &workers, WHOLE), Ok(None));
        assert_eq!(place_gpu_ranks(&[0], &[], WHOLE), Ok(None));
        let two = GpuDemand {
            gpus_per_rank: 2,
            permille: 1000,
        };
        assert_eq!(
            place_gpu_ranks(&[0], &workers, two),
            Ok(Some(vec![(
                0,
                "a".into(),
                vec!["GPU-a-0".into(), "GPU-a-1".into()]
            )]))
        );
    }

    #[test]
    fn gpu_shares_fill_a_gpu_and_prefer_unshared_devices() {
        let half = GpuDemand {
            gpus_per_rank: 1,
            permille: 500,
        };
        // One GPU half taken: one more half fits, a third does not.
        let workers = gpu_workers(&[("a", 4, &[500])]);
        assert!(
            place_gpu_ranks(&[0], &workers, half)
                .expect("valid")
                .is_some()
        );
        assert_eq!(place_gpu_ranks(&[0, 1], &workers, half), Ok(None));
        // Two ranks of one job spread over two GPUs before sharing one.
        let workers = gpu_workers(&[("a", 4, &[1000, 1000])]);
        let placed = place_gpu_ranks(&[0, 1], &workers, half)
            .expect("valid")
            .expect("fits");
        assert_eq!(placed[0].2, vec!["GPU-a-0".to_string()]);
        assert_eq!(placed[1].2, vec!["GPU-a-1".to_string()]);
        // Best fit: the half-used GPU is filled before a free one.
        let workers = gpu_workers(&[("a", 4, &[1000, 500])]);
        let placed = place_gpu_ranks(&[0], &workers, half)
            .expect("valid")
            .expect("fits");
        assert_eq!(placed[0].2, vec!["GPU-a-1".to_string()]);
    }

    #[test]
    fn gpu_placement_rejects_bad_input() {
        let workers = gpu_workers(&[("a", 1, &[1000])]);
        for demand in [
            GpuDemand {
                gpus_per_rank: 0,
                permille: 1000,
            },
            GpuDemand {
                gpus_per_rank: 1,
                permille: 0,
            },
            GpuDemand {
                gpus_per_rank: 1,
                permille: 1001,
            },
        ] {
            assert_eq!(
                place_gpu_ranks(&[0], &workers, demand),
                Err(PlanError::BadGpuDemand)
            );
        }
        let mut twice = gpu_workers(&[("a", 1, &[1000]), ("b", 1, &[1000])]);
        twice[1].gpus[0].uuid = "GPU-a-0".into();
        assert_eq!(
            place_gpu_ranks(&[0], &twice, WHOLE),
            Err(PlanError::DuplicateGpu("GPU-a-0".into()))
        );
        assert_eq!(
            place_gpu_ranks(&[1, 0], &workers, WHOLE),
            Err(PlanError::RanksNotAscending {
                previous: 1,
                next: 0
            })
        );
    }

    mod gpu_properties {
        use super::*;
        use proptest::prelude::*;
        use std::collections::BTreeMap;

        fn arb_workers() -> impl Strategy<Value = Vec<WorkerGpus>> {
            proptest::collection::vec(
                (
                    0u32..6,
                    proptest::collection::vec(prop_oneof![Just(1000u32), 0u32..=1000], 0..5),
                ),
                0..5,
            )
            .prop_map(|list| {
                list.into_iter()
                    .enumerate()
                    .map(|(w, (slots, gpus))| WorkerGpus {
                        worker_id: format!("w{w}"),
                        free_slots: slots,
                        gpus: gpus
                            .into_iter()
                            .enumerate()
                            .map(|(i, free)| GpuFree {
                                uuid: format!("GPU-{w}-{i}"),
                                free_permille: free,
                            })
                            .collect(),
                    })
                    .collect()
            })
        }

        fn arb_demand() -> impl Strategy<Value = GpuDemand> {
            (1u32..3, prop_oneof![Just(1000u32), 1u32..=1000]).prop_map(
                |(gpus_per_rank, permille)| GpuDemand {
                    gpus_per_rank,
                    permille,
                },
            )
        }

        proptest! {
            #[test]
            fn plans_respect_capacity_and_are_deterministic(
                workers in arb_workers(),
                demand in arb_demand(),
                world in 0u32..8,
                rotate in 0usize..5,
            ) {
                let ranks: Vec<u32> = (0..world).collect();
                let plan = place_gpu_ranks(&ranks, &workers, demand).expect("valid input");
                // Same input (in any worker order) → same plan.
                let mut shuffled = workers.clone();
                if !shuffled.is_empty() {
                    let k = rotate % shuffled.len();
                    shuffled.rotate_left(k);
                    shuffled.reverse();
                }
                prop_assert_eq!(&plan, &place_gpu_ranks(&ranks, &shuffled, demand).expect("valid"));
                let Some(plan) = plan else { return Ok(()); };
                // No partial gang: every rank once, in order.
                prop_assert_eq!(plan.iter().map(|p| p.0).collect::<Vec<_>>(), ranks.clone());
                let by_id: BTreeMap<&str, &WorkerGpus> =
                    workers.iter().map(|w| (w.worker_id.as_str(), w)).collect();
                let mut slots: BTreeMap<&str, u32> = BTreeMap::new();
                let mut given: BTreeMap<&str, u32> = BTreeMap::new();
                for (_, worker, gpus) in &plan {
                    let w = by_id[worker.as_str()];
                    *slots.entry(worker).or_default() += 1;
                    prop_assert_eq!(gpus.len() as u32, demand.gpus_per_rank);
                    let distinct: BTreeSet<&String> = gpus.iter().collect();
                    prop_assert_eq!(distinct.len(), gpus.len(), "a GPU given twice to one rank");
                    for uuid in gpus {
                        prop_assert!(w.gpus.iter().any(|g| &g.uuid == uuid), "GPU of another worker");
                        *given.entry(uuid).or_default() += demand.permille;
                    }
                }
                for (worker, n) in slots {
                    prop_assert!(n <= by_id[worker].free_slots);
                }
                // Shares never above what was free (a whole GPU never given twice).
                for w in &workers {
                    for g in &w.gpus {
                        let used = given.get(g.uuid.as_str()).copied().unwrap_or(0);
                        prop_assert!(used <= g.free_permille.min(1000), "{} over-committed", g.uuid);
                    }
                }
            }

            #[test]
            fn whole_gpu_plans_use_the_fewest_workers(
                workers in arb_workers(),
                world in 1u32..8,
            ) {
                let ranks: Vec<u32> = (0..world).collect();
                let Some(plan) = place_gpu_ranks(&ranks, &workers, WHOLE).expect("valid") else {
                    return Ok(());
                };
                let used: BTreeSet<&str> = plan.iter().map(|p| p.1.as_str()).collect();
                let mut capacities: Vec<u32> = workers
                    .iter()
                    .map(|w| w.free_slots.min(w.gpus.iter().filter(|g| g.free_permille >= 1000).count() as u32))
                    .collect();
                capacities.sort_unstable_by(|a, b| b.cmp(a));
                let mut covered = 0;
                let fewest = capacities.iter().take_while(|c| { let before = covered; covered += **c; before < world }).count();
                prop_assert_eq!(used.len(), fewest);
            }
        }
    }
}
