//! Property tests of the planning functions: completeness, balance, capacity, gang
//! semantics and independence from input order.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use shard_planner::{WorkerSlots, assign_shards, local_ranks, place_ranks, shards_for_rank};

/// Shard names, distinct, in a random order.
fn shuffled_shards() -> impl Strategy<Value = Vec<String>> {
    prop::collection::btree_set("[a-z0-9/._-]{1,8}", 0..80)
        .prop_map(|set| set.into_iter().collect::<Vec<_>>())
        .prop_shuffle()
}

/// Workers with distinct ids and 0..=4 free slots, in a random order.
fn shuffled_workers() -> impl Strategy<Value = Vec<WorkerSlots>> {
    prop::collection::btree_map("w[a-z0-9]{1,4}", 0u32..=4, 0..12)
        .prop_map(|map| {
            map.into_iter()
                .map(|(worker_id, free_slots)| WorkerSlots {
                    worker_id,
                    free_slots,
                })
                .collect::<Vec<_>>()
        })
        .prop_shuffle()
}

/// Distinct ranks, ascending.
fn ascending_ranks() -> impl Strategy<Value = Vec<u32>> {
    prop::collection::btree_set(0u32..200, 0..24).prop_map(|set| set.into_iter().collect())
}

/// Straightforward reference of the placement rule: scan all workers for every rank.
fn reference_place(ranks: &[u32], workers: &[WorkerSlots]) -> Option<Vec<(u32, String)>> {
    let total: u64 = workers.iter().map(|w| u64::from(w.free_slots)).sum();
    if total < ranks.len() as u64 {
        return None;
    }
    let mut free: BTreeMap<String, u32> = workers
        .iter()
        .map(|w| (w.worker_id.clone(), w.free_slots))
        .collect();
    let mut out = Vec::new();
    for &rank in ranks {
        // BTreeMap iterates ids ascending; keep the first maximum → smallest id wins ties.
        let mut best: Option<(&String, u32)> = None;
        for (id, slots) in &free {
            if *slots > 0 && best.is_none_or(|(_, b)| *slots > b) {
                best = Some((id, *slots));
            }
        }
        let id = best.expect("capacity checked").0.clone();
        *free.get_mut(&id).expect("present") -= 1;
        out.push((rank, id));
    }
    Some(out)
}

proptest! {
    #[test]
    fn every_shard_assigned_exactly_once(shards in shuffled_shards(), world in 1u32..12) {
        let plan = assign_shards(&shards, world).expect("valid input");
        prop_assert_eq!(plan.len(), world as usize);
        let mut all: Vec<String> = plan.iter().flatten().cloned().collect();
        all.sort();
        let mut expected = shards.clone();
        expected.sort();
        prop_assert_eq!(all, expected);
    }

    #[test]
    fn ranks_balanced_and_round_robin(shards in shuffled_shards(), world in 1u32..12) {
        let plan = assign_shards(&shards, world).expect("valid input");
        let sizes: Vec<usize> = plan.iter().map(Vec::len).collect();
        let max = *sizes.iter().max().expect("world >= 1");
        let min = *sizes.iter().min().expect("world >= 1");
        prop_assert!(max - min <= 1, "sizes {:?}", sizes);
        // Lower ranks get the extra shards.
        prop_assert!(sizes.windows(2).all(|pair| pair[0] >= pair[1]));
        let mut sorted = shards.clone();
        sorted.sort();
        for (rank, list) in plan.iter().enumerate() {
            prop_assert!(list.windows(2).all(|pair| pair[0] < pair[1]));
            for shard in list {
                let index = sorted.binary_search(shard).expect("assigned shard comes from input");
                prop_assert_eq!(index % world as usize, rank);
            }
            let one = shards_for_rank(&shards, world, rank as u32).expect("valid input");
            prop_assert_eq!(&one, list);
        }
    }

    #[test]
    fn assignment_independent_of_input_order(shards in shuffled_shards(), world in 1u32..12) {
        let mut sorted = shards.clone();
        sorted.sort();
        prop_assert_eq!(
            assign_shards(&shards, world).expect("valid"),
            assign_shards(&sorted, world).expect("valid")
        );
    }

    #[test]
    fn duplicate_shard_rejected(shards in shuffled_shards(), world in 1u32..12, pick in any::<prop::sample::Index>()) {
        prop_assume!(!shards.is_empty());
        let dup = shards[pick.index(shards.len())].clone();
        let mut with_dup = shards.clone();
        with_dup.push(dup.clone());
        prop_assert_eq!(assign_shards(&with_dup, world), Err(shard_planner::PlanError::DuplicateShard(dup)));
    }

    #[test]
    fn gang_placement_respects_capacity_and_is_all_or_nothing(
        ranks in ascending_ranks(),
        workers in shuffled_workers(),
    ) {
        let total: u64 = workers.iter().map(|w| u64::from(w.free_slots)).sum();
        let placed = place_ranks(&ranks, &workers).expect("valid input");
        match placed {
            None => prop_assert!(total < ranks.len() as u64),
            Some(pairs) => {
                prop_assert!(total >= ranks.len() as u64);
                let placed_ranks: Vec<u32> = pairs.iter().map(|(rank, _)| *rank).collect();
                prop_assert_eq!(&placed_ranks, &ranks);
                let mut used: BTreeMap<&str, u32> = BTreeMap::new();
                for (_, id) in &pairs {
                    *used.entry(id.as_str()).or_insert(0) += 1;
                }
                for (id, count) in used {
                    let worker = workers.iter().find(|w| w.worker_id == id).expect("placed on a known worker");
                    prop_assert!(count <= worker.free_slots, "{} over-filled: {} > {}", id, count, worker.free_slots);
                }
            }
        }
    }

    #[test]
    fn gang_placement_follows_rule_and_ignores_worker_order(
        ranks in ascending_ranks(),
        workers in shuffled_workers(),
    ) {
        let placed = place_ranks(&ranks, &workers).expect("valid input");
        let mut sorted = workers.clone();
        sorted.sort_by(|a, b| a.worker_id.cmp(&b.worker_id));
        let mut reversed = sorted.clone();
        reversed.reverse();
        prop_assert_eq!(&placed, &place_ranks(&ranks, &sorted).expect("valid input"));
        prop_assert_eq!(&placed, &place_ranks(&ranks, &reversed).expect("valid input"));
        prop_assert_eq!(placed, reference_place(&ranks, &workers));
    }

    #[test]
    fn local_ranks_consistent(
        assignment in prop::collection::vec(0usize..5, 0..30),
        order_seed in any::<prop::sample::Index>(),
    ) {
        let placement: Vec<(u32, String)> = assignment
            .iter()
            .enumerate()
            .map(|(rank, worker)| (rank as u32, format!("w{worker}")))
            .collect();
        // Rotate the input: the output must not depend on the order of the pairs.
        let mut rotated = placement.clone();
        if !rotated.is_empty() {
            let by = order_seed.index(rotated.len());
            rotated.rotate_left(by);
        }
        let local = local_ranks(&rotated).expect("valid placement");
        prop_assert_eq!(&local, &local_ranks(&placement).expect("valid placement"));
        prop_assert_eq!(local.len(), placement.len());
        let mut by_worker: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
        for (rank, id) in &placement {
            by_worker.entry(id.as_str()).or_default().push(*rank);
        }
        for ranks_here in by_worker.values() {
            let size = ranks_here.len() as u32;
            let locals: BTreeSet<u32> = ranks_here.iter().map(|r| local[*r as usize].0).collect();
            prop_assert_eq!(locals, (0..size).collect::<BTreeSet<_>>());
            for (index, rank) in ranks_here.iter().enumerate() {
                prop_assert_eq!(local[*rank as usize], (index as u32, size));
            }
        }
    }
}
