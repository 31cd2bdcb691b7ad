//! The reconciliation rule: a pure function from (desired, observed, finished) to actions.
//!
//! The leader sends the full desired set of rank attempts with every heartbeat reply; the
//! agent compares it with the processes it runs and the attempts that already ran here, and
//! derives what to start and what to stop. Lost, duplicated or reordered replies heal by
//! themselves because the function only looks at the current sets.

use std::collections::{BTreeMap, HashMap, HashSet};

use cumulus_api::AttemptKey;
use cumulus_api::DesiredRank;

/// A rank attempt the agent currently has a process (or a starting process) for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedAttempt {
    /// Which attempt.
    pub key: AttemptKey,
    /// true once the agent has decided to stop it (SIGTERM sent or about to be).
    pub stopping: bool,
}

/// What the agent must do to make observed match desired.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Start this attempt (it is desired, not running and never ran on this agent).
    Start(Box<DesiredRank>),
    /// Stop this attempt (it runs and is no longer desired).
    Stop(AttemptKey),
}

/// Derives the actions that move `observed` towards `desired`.
///
/// Rules, in order:
/// 1. Of several desired entries for the same `(job, rank)`, only the highest attempt counts
///    (a malformed reply cannot make two attempts of one rank live); an exact duplicate
///    entry counts once.
/// 2. Every observed attempt that is not in the effective desired set and not already
///    stopping is stopped.
/// 3. A desired attempt is started when it is not observed, not in `finished` (it already
///    ran on this agent: an attempt never runs twice), and no other attempt of the same
///    `(job, rank)` is still alive here — a replacement waits until its predecessor is gone,
///    so at most one attempt of a rank is ever live on this agent.
///
/// Stops come first, then starts; each group is sorted by key, so the result is
/// deterministic.
pub fn reconcile(
    desired: &[DesiredRank],
    observed: &[ObservedAttempt],
    finished: &HashSet<AttemptKey>,
) -> Vec<Action> {
    // Rule 1: the effective desired set, one attempt per (job, rank).
    let mut effective: BTreeMap<(&str, u32), &DesiredRank> = BTreeMap::new();
    for d in desired {
        effective
            .entry((d.job_id.as_str(), d.rank))
            .and_modify(|cur| {
                if d.attempt > cur.attempt {
                    *cur = d;
                }
            })
            .or_insert(d);
    }
    let wanted: HashSet<AttemptKey> = effective.values().map(|d| AttemptKey::of(d)).collect();

    let observed_keys: HashMap<&AttemptKey, bool> =
        observed.iter().map(|o| (&o.key, o.stopping)).collect();
    let alive_ranks: HashSet<(&str, u32)> = observed
        .iter()
        .map(|o| (o.key.job_id.as_str(), o.key.rank))
        .collect();

    let mut stops: Vec<AttemptKey> = observed
        .iter()
        .filter(|o| !o.stopping && !wanted.contains(&o.key))
        .map(|o| o.key.clone())
        .collect();
    stops.sort();
    stops.dedup();

    let mut starts: Vec<&DesiredRank> = effective
        .values()
        .copied()
        .filter(|d| {
            let key = AttemptKey::of(d);
            !observed_keys.contains_key(&key)
                && !finished.contains(&key)
                && !alive_ranks.contains(&(d.job_id.as_str(), d.rank))
        })
        .collect();
    starts.sort_by_key(|d| AttemptKey::of(d));

    stops
        .into_iter()
        .map(Action::Stop)
        .chain(
            starts
                .into_iter()
                .map(|d| Action::Start(Box::new(d.clone()))),
        )
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(job: &str, rank: u32, attempt: u32) -> DesiredRank {
        DesiredRank {
            job_id: job.into(),
            rank,
            attempt,
            world_size: 4,
            command: vec!["true".into()],
            ..Default::default()
        }
    }

    fn o(job: &str, rank: u32, attempt: u32, stopping: bool) -> ObservedAttempt {
        ObservedAttempt {
            key: AttemptKey::new(job, rank, attempt),
            stopping,
        }
    }

    fn keys(actions: &[Action]) -> Vec<String> {
        actions
            .iter()
            .map(|a| match a {
                Action::Start(d) => format!("start {}", AttemptKey::of(d)),
                Action::Stop(k) => format!("stop {k}"),
            })
            .collect()
    }

    #[test]
    fn starts_what_is_missing_in_key_order() {
        let actions = reconcile(
            &[d("job-2", 0, 0), d("job-1", 1, 0), d("job-1", 0, 0)],
            &[],
            &HashSet::new(),
        );
        assert_eq!(
            keys(&actions),
            [
                "start job-1/rank-0/attempt-0",
                "start job-1/rank-1/attempt-0",
                "start job-2/rank-0/attempt-0"
            ]
        );
    }

    #[test]
    fn steady_state_does_nothing() {
        let actions = reconcile(
            &[d("job-1", 0, 2)],
            &[o("job-1", 0, 2, false)],
            &HashSet::new(),
        );
        assert!(actions.is_empty(), "{actions:?}");
    }

    #[test]
    fn never_restarts_a_finished_attempt() {
        let finished: HashSet<_> = [AttemptKey::new("job-1", 0, 0)].into();
        let actions = reconcile(&[d("job-1", 0, 0), d("job-1", 1, 0)], &[], &finished);
        assert_eq!(keys(&actions), ["start job-1/rank-1/attempt-0"]);
    }

    #[test]
    fn stops_what_is_not_desired_once() {
        let actions = reconcile(
            &[d("job-1", 0, 0)],
            &[
                o("job-1", 0, 0, false),
                o("job-9", 3, 1, false),
                o("job-9", 4, 1, true),
            ],
            &HashSet::new(),
        );
        // job-9 rank 4 is already stopping: no second stop.
        assert_eq!(keys(&actions), ["stop job-9/rank-3/attempt-1"]);
    }

    #[test]
    fn empty_desired_stops_everything() {
        let actions = reconcile(
            &[],
            &[o("job-1", 1, 0, false), o("job-1", 0, 0, false)],
            &HashSet::new(),
        );
        assert_eq!(
            keys(&actions),
            ["stop job-1/rank-0/attempt-0", "stop job-1/rank-1/attempt-0"]
        );
    }

    #[test]
    fn replacement_waits_for_its_predecessor() {
        // Attempt 0 runs, the leader now wants attempt 1: stop 0, do not start 1 yet.
        let actions = reconcile(
            &[d("job-1", 0, 1)],
            &[o("job-1", 0, 0, false)],
            &HashSet::new(),
        );
        assert_eq!(keys(&actions), ["stop job-1/rank-0/attempt-0"]);
        // Still stopping: nothing to do.
        let actions = reconcile(
            &[d("job-1", 0, 1)],
            &[o("job-1", 0, 0, true)],
            &HashSet::new(),
        );
        assert!(actions.is_empty(), "{actions:?}");
        // Gone (finished): start attempt 1.
        let finished: HashSet<_> = [AttemptKey::new("job-1", 0, 0)].into();
        let actions = reconcile(&[d("job-1", 0, 1)], &[], &finished);
        assert_eq!(keys(&actions), ["start job-1/rank-0/attempt-1"]);
    }

    #[test]
    fn highest_attempt_of_a_rank_wins_and_duplicates_count_once() {
        let actions = reconcile(
            &[
                d("job-1", 0, 1),
                d("job-1", 0, 3),
                d("job-1", 0, 2),
                d("job-1", 0, 3),
            ],
            &[o("job-1", 0, 2, false)],
            &HashSet::new(),
        );
        // Attempt 2 is not the effective one: stopped; 3 waits for 2 to be gone.
        assert_eq!(keys(&actions), ["stop job-1/rank-0/attempt-2"]);
        let actions = reconcile(&[d("job-1", 0, 3), d("job-1", 0, 3)], &[], &HashSet::new());
        assert_eq!(keys(&actions), ["start job-1/rank-0/attempt-3"]);
    }

    #[test]
    fn start_carries_the_full_desired_entry() {
        let mut want = d("job-1", 2, 5);
        want.shards = vec!["/data/a".into()];
        want.master_port = 29500;
        let actions = reconcile(std::slice::from_ref(&want), &[], &HashSet::new());
        assert_eq!(actions, vec![Action::Start(Box::new(want))]);
    }
}
