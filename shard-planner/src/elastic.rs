//! Elastic world size: the records not yet consumed at a committed step, re-partitioned
//! over a new number of ranks, exactly once.
//!
//! The planner knows shards by name, never their contents, so it plans in *segments*: a
//! segment is the records of one shard from `first_record` (0-based, counting records,
//! not lines) to the shard's end. A rank's data for an epoch is a list of segments, read
//! in order; its position is `(epoch, segment, record)`: in that epoch, the segments
//! before `segment` are consumed, and `record` records of segment `segment`.
//!
//! A [`DataPlan`] names the segments of the epochs that differ from the standard
//! assignment ([`crate::assign_shards`] at the plan's world size, each shard whole);
//! every other epoch is standard. [`repartition`] takes the plan in force at a committed
//! step and each rank's position there, and returns the plan for a new world size in
//! which every record those positions had not consumed is assigned to exactly one new
//! rank, in the same epoch, and no consumed one is assigned again.
//!
//! The rule, for every epoch from the earliest any rank is in to the last one the old
//! plan names or any rank has reached: the unconsumed segments of the old ranks, in old
//! rank order then segment order (the current segment cut at the position), are dealt to
//! the new ranks round-robin (segment `k` to new rank `k mod new world`). An epoch no
//! rank has consumed anything of and the old plan leaves standard stays standard (at the
//! new world size). Epochs before the earliest position are fully consumed and dropped.
//! New ranks start at the first epoch of the new plan, segment 0, record 0.

use std::collections::BTreeMap;

use crate::{PlanError, assign_shards, shards_for_rank};

/// The records of one shard from `first_record` (0-based, in records) to its end.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Segment {
    /// The shard, as named in the job's shard list.
    pub shard: String,
    /// Records of the shard before this one are not part of the segment.
    pub first_record: u64,
}

impl Segment {
    /// A whole shard.
    pub fn whole(shard: &str) -> Self {
        Self {
            shard: shard.to_owned(),
            first_record: 0,
        }
    }
}

/// Where a rank is in its data: in `epoch`, the segments before `segment` and `record`
/// records of segment `segment` are consumed (`segment` equal to the number of segments,
/// with `record` 0, means the whole epoch).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct DataPosition {
    /// 0-based epoch.
    pub epoch: u32,
    /// Index into the rank's segments of that epoch.
    pub segment: u32,
    /// Records of that segment consumed.
    pub record: u64,
}

/// Each rank's segments, per epoch, for the epochs that differ from the standard
/// assignment at `world_size`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DataPlan {
    /// Ranks of the plan.
    pub world_size: u32,
    /// Epoch → one segment list per rank (outer length `world_size`); epochs absent are
    /// standard.
    pub epochs: BTreeMap<u32, Vec<Vec<Segment>>>,
}

impl DataPlan {
    /// The standard plan at `world_size`: every epoch [`assign_shards`].
    pub fn standard(world_size: u32) -> Self {
        Self {
            world_size,
            epochs: BTreeMap::new(),
        }
    }

    /// `rank`'s segments in `epoch` over `shards` (the job's whole shard list).
    ///
    /// # Errors
    /// [`PlanError::UnknownRank`] for a rank outside the plan; as [`shards_for_rank`].
    pub fn rank_segments(
        &self,
        shards: &[String],
        epoch: u32,
        rank: u32,
    ) -> Result<Vec<Segment>, PlanError> {
        if rank >= self.world_size {
            return Err(PlanError::UnknownRank(rank));
        }
        match self.epochs.get(&epoch) {
            Some(ranks) => Ok(ranks.get(rank as usize).cloned().unwrap_or_default()),
            None => Ok(shards_for_rank(shards, self.world_size, rank)?
                .iter()
                .map(|s| Segment::whole(s))
                .collect()),
        }
    }

    /// The explicit epochs of `rank` (empty for a standard plan).
    pub fn for_rank(&self, rank: u32) -> BTreeMap<u32, Vec<Segment>> {
        self.epochs
            .iter()
            .map(|(e, ranks)| (*e, ranks.get(rank as usize).cloned().unwrap_or_default()))
            .collect()
    }
}

/// What of `segments` is not consumed at `position` when the rank is in `epoch`'s data:
/// all of it before that epoch, none after, the rest of the current segment and the
/// segments after it in it.
fn unconsumed(segments: Vec<Segment>, epoch: u32, position: DataPosition) -> Vec<Segment> {
    if position.epoch > epoch {
        return Vec::new();
    }
    if position.epoch < epoch {
        return segments;
    }
    let at = position.segment as usize;
    segments
        .into_iter()
        .enumerate()
        .filter(|(i, _)| *i >= at)
        .map(|(i, mut s)| {
            if i == at {
                s.first_record = s.first_record.saturating_add(position.record);
            }
            s
        })
        .collect()
}

/// The plan at `new_world` for the records `positions` (one per rank of `old`, index =
/// rank) have not consumed under `old`, over the job's `shards` (module doc: the rule).
/// Pure and deterministic.
///
/// # Errors
/// [`PlanError::ZeroWorldSize`] for a new world of 0; [`PlanError::PositionCount`] when
/// `positions` does not hold one per old rank; [`PlanError::PositionOutOfRange`] for a
/// position past its epoch's segments; as [`assign_shards`] for the shards.
pub fn repartition(
    shards: &[String],
    old: &DataPlan,
    positions: &[DataPosition],
    new_world: u32,
) -> Result<DataPlan, PlanError> {
    if new_world == 0 || old.world_size == 0 {
        return Err(PlanError::ZeroWorldSize);
    }
    if positions.len() != old.world_size as usize {
        return Err(PlanError::PositionCount {
            expected: old.world_size,
            found: positions.len(),
        });
    }
    let standard_old = assign_shards(shards, old.world_size)?;
    let segments_of = |epoch: u32, rank: u32| -> Vec<Segment> {
        match old.epochs.get(&epoch) {
            Some(ranks) => ranks.get(rank as usize).cloned().unwrap_or_default(),
            None => standard_old[rank as usize]
                .iter()
                .map(|s| Segment::whole(s))
                .collect(),
        }
    };
    for (rank, p) in (0u32..).zip(positions) {
        let count = segments_of(p.epoch, rank).len();
        let at = p.segment as usize;
        if at > count || (at == count && p.record > 0) {
            return Err(PlanError::PositionOutOfRange { rank });
        }
    }
    let first = positions.iter().map(|p| p.epoch).min().unwrap_or(0);
    let reached = positions.iter().map(|p| p.epoch).max().unwrap_or(0);
    let last = old
        .epochs
        .keys()
        .next_back()
        .copied()
        .unwrap_or(0)
        .max(reached);
    let mut plan = DataPlan::standard(new_world);
    let world = new_world as usize;
    for epoch in first..=last {
        let untouched = positions
            .iter()
            .all(|p| p.epoch < epoch || (p.epoch == epoch && p.segment == 0 && p.record == 0));
        if untouched && !old.epochs.contains_key(&epoch) {
            continue;
        }
        let mut ranks: Vec<Vec<Segment>> = vec![Vec::new(); world];
        let left = (0u32..)
            .zip(positions)
            .flat_map(|(rank, p)| unconsumed(segments_of(epoch, rank), epoch, *p));
        for (k, segment) in left.enumerate() {
            ranks[k % world].push(segment);
        }
        plan.epochs.insert(epoch, ranks);
    }
    Ok(plan)
}

/// The epoch new ranks start in after [`repartition`] from `positions`: the earliest
/// any old rank was in.
pub fn start_epoch(positions: &[DataPosition]) -> u32 {
    positions.iter().map(|p| p.epoch).min().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("s{i:02}")).collect()
    }

    /// Every record `(epoch, shard, record)` a rank reads from `segments` (shards of
    /// `sizes` records), from `from` (segment, record) on, or before it when `before`.
    fn records(
        segments: &[Segment],
        sizes: &BTreeMap<String, u64>,
        from: (u32, u64),
        before: bool,
    ) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        for (i, s) in segments.iter().enumerate() {
            let size = sizes[&s.shard];
            let mut r = s.first_record;
            let mut k = 0u64;
            while r < size {
                let pos = (i as u32, k);
                if (pos < from) == before {
                    out.push((s.shard.clone(), r));
                }
                r += 1;
                k += 1;
            }
        }
        out
    }

    #[test]
    fn a_shrink_deals_the_rest_round_robin() {
        let shards = names(4);
        let old = DataPlan::standard(4);
        let positions = [
            DataPosition {
                epoch: 0,
                segment: 0,
                record: 3,
            },
            DataPosition {
                epoch: 0,
                segment: 1,
                record: 0,
            },
            DataPosition::default(),
            DataPosition::default(),
        ];
        let plan = repartition(&shards, &old, &positions, 2).unwrap();
        assert_eq!(plan.world_size, 2);
        let e0 = &plan.epochs[&0];
        assert_eq!(
            e0[0],
            vec![
                Segment {
                    shard: "s00".into(),
                    first_record: 3
                },
                Segment::whole("s03")
            ]
        );
        assert_eq!(e0[1], vec![Segment::whole("s02")]);
        // Epoch 1 is untouched and standard: not named.
        assert_eq!(plan.epochs.len(), 1);
        assert_eq!(
            plan.rank_segments(&shards, 1, 1).unwrap(),
            vec![Segment::whole("s01"), Segment::whole("s03")]
        );
    }

    #[test]
    fn nothing_consumed_stays_standard() {
        let shards = names(5);
        let plan = repartition(
            &shards,
            &DataPlan::standard(3),
            &[DataPosition::default(); 3],
            2,
        )
        .unwrap();
        assert_eq!(plan, DataPlan::standard(2));
    }

    #[test]
    fn bad_positions_are_refused() {
        let shards = names(2);
        let old = DataPlan::standard(2);
        assert_eq!(
            repartition(&shards, &old, &[DataPosition::default()], 1),
            Err(PlanError::PositionCount {
                expected: 2,
                found: 1
            })
        );
        let past = DataPosition {
            epoch: 0,
            segment: 1,
            record: 1,
        };
        assert_eq!(
            repartition(&shards, &old, &[DataPosition::default(), past], 1),
            Err(PlanError::PositionOutOfRange { rank: 1 })
        );
        assert_eq!(
            repartition(&shards, &old, &[DataPosition::default(); 2], 0),
            Err(PlanError::ZeroWorldSize)
        );
    }

    /// A position for a rank reading `segments`: anywhere in them, or the end.
    fn position(segments: usize, pick: (u32, u64), epoch: u32) -> DataPosition {
        let segment = pick.0 % (segments as u32 + 1);
        let record = if segment as usize == segments {
            0
        } else {
            pick.1
        };
        DataPosition {
            epoch,
            segment,
            record,
        }
    }

    /// Checks that, for every epoch from the earliest position on, what `positions`
    /// consumed under `old` plus what `new` assigns is every record `old` deals in that
    /// epoch exactly once (for a standard `old`, every record of the data set; chained,
    /// what earlier plans left).
    fn check_exactly_once(
        shards: &[String],
        sizes: &BTreeMap<String, u64>,
        old: &DataPlan,
        positions: &[DataPosition],
        new: &DataPlan,
    ) -> Result<(), TestCaseError> {
        let first = start_epoch(positions);
        let horizon = positions.iter().map(|p| p.epoch).max().unwrap() + 2;
        let horizon = horizon.max(old.epochs.keys().next_back().copied().unwrap_or(0) + 2);
        for epoch in first..horizon {
            let mut all: Vec<(String, u64)> = Vec::new();
            for rank in 0..old.world_size {
                let segs = old.rank_segments(shards, epoch, rank).unwrap();
                all.extend(records(&segs, sizes, (0, 0), false));
            }
            all.sort();
            if old.epochs.is_empty() {
                let mut every: Vec<(String, u64)> = shards
                    .iter()
                    .flat_map(|s| (0..sizes[s]).map(move |r| (s.clone(), r)))
                    .collect();
                every.sort();
                prop_assert_eq!(&all, &every, "a standard plan deals every record");
            }
            let mut seen: Vec<(String, u64)> = Vec::new();
            for (rank, p) in (0u32..).zip(positions) {
                let segs = old.rank_segments(shards, epoch, rank).unwrap();
                if p.epoch > epoch {
                    seen.extend(records(&segs, sizes, (0, 0), false));
                } else if p.epoch == epoch {
                    seen.extend(records(&segs, sizes, (p.segment, p.record), true));
                }
            }
            for rank in 0..new.world_size {
                let segs = new.rank_segments(shards, epoch, rank).unwrap();
                seen.extend(records(&segs, sizes, (0, 0), false));
            }
            seen.sort();
            prop_assert_eq!(&seen, &all, "epoch {}", epoch);
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any shards and sizes, any old and new world, positions anywhere (ranks up to
        /// two epochs apart), and a second resize from positions in the first's plan:
        /// every record not consumed is assigned exactly once, nothing consumed again.
        #[test]
        fn every_unconsumed_record_exactly_once(
            sizes in proptest::collection::vec(0u64..6, 1..9),
            old_world in 1u32..6,
            mid_world in 1u32..6,
            new_world in 1u32..6,
            picks in proptest::collection::vec((0u32..8, 0u64..6, 0u32..3), 5),
            picks2 in proptest::collection::vec((0u32..8, 0u64..6, 0u32..2), 5),
        ) {
            let shards = names(sizes.len());
            let sizes: BTreeMap<String, u64> =
                shards.iter().cloned().zip(sizes.iter().copied()).collect();
            let old = DataPlan::standard(old_world);
            let positions: Vec<DataPosition> = (0..old_world)
                .map(|r| {
                    let (s, rec, e) = picks[r as usize];
                    let n = old.rank_segments(&shards, e, r).unwrap().len();
                    position(n, (s, rec), e)
                })
                .collect();
            let mid = repartition(&shards, &old, &positions, mid_world).unwrap();
            check_exactly_once(&shards, &sizes, &old, &positions, &mid)?;
            // Deterministic.
            prop_assert_eq!(&mid, &repartition(&shards, &old, &positions, mid_world).unwrap());
            // Again, from positions in the new plan (at or after where it starts).
            let start = start_epoch(&positions);
            let positions2: Vec<DataPosition> = (0..mid_world)
                .map(|r| {
                    let (s, rec, e) = picks2[r as usize];
                    let n = mid.rank_segments(&shards, start + e, r).unwrap().len();
                    position(n, (s, rec), start + e)
                })
                .collect();
            let new = repartition(&shards, &mid, &positions2, new_world).unwrap();
            check_exactly_once(&shards, &sizes, &mid, &positions2, &new)?;
        }
    }
}
