//! Pure, deterministic planning for Cumulus.
//!
//! Three plans, each a pure function of its input (no I/O, no clock, no randomness), so the
//! Raft state machine can compute them inside `apply` and every replica gets the same answer:
//!
//! - [`assign_shards`]: dataset shards → ranks. Shard `i` of the name-sorted list belongs to
//!   rank `i mod world_size` (DESIGN.md, "Shards"). The plan never depends on the order in
//!   which the shard names were given.
//! - [`place_ranks`]: ranks → workers, gang style (all ranks or none). Each rank goes to the
//!   worker with the most free slots left at that moment, ties broken by the smallest worker
//!   id; the result never depends on the order of the worker list.
//! - [`local_ranks`]: for a placement, each rank's `LOCAL_RANK` and `LOCAL_WORLD_SIZE` (the
//!   torchrun contract).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

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
}
