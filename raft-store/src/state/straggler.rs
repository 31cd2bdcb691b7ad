//! Stragglers in the replicated state: a job's [`StragglerPolicy`] (part of its spec),
//! the [`StragglerFlag`]s the leader committed, and the workers the job's later
//! placements avoid. The detection itself is the leader's (soft state, from progress
//! reports: `coordinator/src/control/straggler.rs`); `apply` records what it decided
//! ([`Command::FlagStraggler`]).

use serde::{Deserialize, Serialize};

use super::*;

pub use cumulus_api::StragglerAction;
pub use cumulus_api::limits::{
    DEFAULT_STRAGGLER_FRACTION_PERMILLE, DEFAULT_STRAGGLER_WINDOW_MS,
    MAX_STRAGGLER_FRACTION_PERMILLE, MAX_STRAGGLER_WINDOW_MS, MIN_STRAGGLER_FRACTION_PERMILLE,
    MIN_STRAGGLER_WINDOW_MS,
};

/// Most [`StragglerFlag`]s a job keeps (the oldest go first).
pub const MAX_STRAGGLER_FLAGS: usize = 64;
/// Allowance for one [`StragglerFlag`]'s field names and scalar fields, in bytes.
const STRAGGLER_FLAG_BYTES: usize = 256;
/// Most workers a job avoids ([`Job::avoided_workers`]; the oldest go first).
pub const MAX_AVOIDED_WORKERS: usize = 64;

/// How a job's stragglers are found and what is done about them, every default filled
/// in. Integers only (the replicated state holds no floats).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StragglerPolicy {
    /// What the leader does about a straggler.
    pub action: StragglerAction,
    /// A rank is below when its steps/s is under this share of the median of the job's
    /// other ranks, in thousandths:
    /// [`MIN_STRAGGLER_FRACTION_PERMILLE`]`..=`[`MAX_STRAGGLER_FRACTION_PERMILLE`].
    pub fraction_permille: u32,
    /// How long a rank must stay below to be flagged, in milliseconds:
    /// [`MIN_STRAGGLER_WINDOW_MS`]`..=`[`MAX_STRAGGLER_WINDOW_MS`].
    pub window_ms: u64,
}

impl Default for StragglerPolicy {
    fn default() -> Self {
        Self {
            action: StragglerAction::Warn,
            fraction_permille: DEFAULT_STRAGGLER_FRACTION_PERMILLE,
            window_ms: DEFAULT_STRAGGLER_WINDOW_MS,
        }
    }
}

impl StragglerPolicy {
    /// True for the defaults (kept out of the log's JSON).
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// Checks the bounds; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        if !(MIN_STRAGGLER_FRACTION_PERMILLE..=MAX_STRAGGLER_FRACTION_PERMILLE)
            .contains(&self.fraction_permille)
        {
            return Err(format!(
                "straggler_fraction {} is out of range: it must be between {} and {}",
                f64::from(self.fraction_permille) / 1000.0,
                f64::from(MIN_STRAGGLER_FRACTION_PERMILLE) / 1000.0,
                f64::from(MAX_STRAGGLER_FRACTION_PERMILLE) / 1000.0
            ));
        }
        if !(MIN_STRAGGLER_WINDOW_MS..=MAX_STRAGGLER_WINDOW_MS).contains(&self.window_ms) {
            return Err(format!(
                "straggler_window_ms {} is out of range: it must be between \
                 {MIN_STRAGGLER_WINDOW_MS} and {MAX_STRAGGLER_WINDOW_MS}",
                self.window_ms
            ));
        }
        Ok(())
    }
}

/// A rank attempt the leader flagged as a straggler.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StragglerFlag {
    /// Global rank.
    pub rank: u32,
    /// The attempt flagged.
    pub attempt: u32,
    /// The worker it ran on.
    pub worker_id: String,
    /// Its rate when flagged, in thousandths of a step per second.
    pub millisteps_per_s: u64,
    /// The median rate of the job's other ranks then, in thousandths of a step per
    /// second.
    pub median_millisteps_per_s: u64,
    /// What was done (the job's action then; never [`StragglerAction::Off`]).
    pub action: StragglerAction,
    /// Leader time of the flag, in ms since the Unix epoch.
    pub at_ms: u64,
}

impl Job {
    /// The part of [`Job::approx_dynamic_bytes`] its straggler flags and avoided workers
    /// take, in bytes.
    pub(super) fn approx_straggler_bytes(&self) -> usize {
        self.stragglers
            .iter()
            .map(|f| STRAGGLER_FLAG_BYTES + f.worker_id.len())
            .sum::<usize>()
            + self
                .avoided_workers
                .iter()
                .map(|w| w.len() + PER_STRING_BYTES)
                .sum::<usize>()
    }

    /// Whether the current attempt of `rank` has been flagged a straggler.
    pub fn is_straggler(&self, rank: u32) -> bool {
        self.ranks.get(rank as usize).is_some_and(|r| {
            self.stragglers
                .iter()
                .any(|f| f.rank == rank && f.attempt == r.attempt)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn apply(s: &mut ClusterState, cmd: Command) -> Response {
        s.apply(&cmd, &mut BTreeSet::new())
    }

    /// Two workers of two slots, and a 2-rank job with `action` whose ranks run, rank `r`
    /// on worker `w{r+1}`.
    fn running(action: StragglerAction) -> (ClusterState, String) {
        let mut s = ClusterState::default();
        for w in ["w1", "w2"] {
            let r = apply(
                &mut s,
                Command::RegisterWorker {
                    worker_id: w.into(),
                    host: "h".into(),
                    http_addr: "h:1".into(),
                    slots: 2,
                    gpus: Vec::new(),
                    at_ms: 0,
                },
            );
            assert_eq!(r, Response::Ok);
        }
        let spec = JobSpec {
            straggler: StragglerPolicy {
                action,
                ..StragglerPolicy::default()
            },
            ..JobSpec::new(2, vec!["x".into()])
        };
        let Response::JobSubmitted { job_id, .. } = apply(
            &mut s,
            Command::SubmitJob {
                request_id: "r".into(),
                spec,
                shards: Vec::new(),
                submitted_at_ms: 0,
                owner: String::new(),
            },
        ) else {
            panic!("submit refused")
        };
        let placements = vec![(0, "w1".to_string()), (1, "w2".to_string())];
        let r = apply(
            &mut s,
            Command::PlaceJob {
                job_id: job_id.clone(),
                placements: placements.clone(),
                gpus: Vec::new(),
                at_ms: 1,
            },
        );
        assert_eq!(r, Response::Ok);
        for (rank, w) in placements {
            let r = apply(
                &mut s,
                Command::RankStarted {
                    job_id: job_id.clone(),
                    rank,
                    attempt: 0,
                    worker_id: w,
                    pid: 10 + rank,
                    at_ms: 2,
                },
            );
            assert_eq!(r, Response::Ok);
        }
        (s, job_id)
    }

    fn flag(action: StragglerAction) -> StragglerFlag {
        StragglerFlag {
            rank: 1,
            attempt: 0,
            worker_id: "w2".into(),
            millisteps_per_s: 3_000,
            median_millisteps_per_s: 10_000,
            action,
            at_ms: 5,
        }
    }

    fn flag_cmd(job_id: &str, flag: StragglerFlag) -> Command {
        Command::FlagStraggler {
            job_id: job_id.into(),
            flag,
        }
    }

    #[test]
    fn a_restart_flag_fails_the_attempt_and_avoids_its_worker_once() {
        let (mut s, job) = running(StragglerAction::Restart);
        assert_eq!(
            apply(&mut s, flag_cmd(&job, flag(StragglerAction::Restart))),
            Response::Ok
        );
        let j = &s.jobs[&job];
        assert!(j.is_straggler(1) && !j.is_straggler(0));
        assert_eq!(j.avoided_workers, vec!["w2".to_string()]);
        assert_eq!(j.ranks[1].state, RankState::Failed);
        let cause = j.ranks[1].failure.clone().expect("a cause");
        assert!(
            cause.contains("straggler: 3.000 steps/s") && cause.contains("on worker w2"),
            "{cause}"
        );
        assert_eq!(j.ranks[0].state, RankState::Running);
        // Once per attempt: the same flag again changes nothing.
        let again = apply(&mut s, flag_cmd(&job, flag(StragglerAction::Restart)));
        assert!(matches!(again, Response::Rejected { .. }), "{again:?}");
        assert_eq!(s.jobs[&job].stragglers.len(), 1);
    }

    #[test]
    fn a_warn_flag_only_records_and_a_stale_or_mismatched_flag_is_refused() {
        let (mut s, job) = running(StragglerAction::Warn);
        // Not the job's action, another worker, another attempt: refused.
        for bad in [
            flag(StragglerAction::Restart),
            StragglerFlag {
                worker_id: "w1".into(),
                ..flag(StragglerAction::Warn)
            },
            StragglerFlag {
                attempt: 1,
                ..flag(StragglerAction::Warn)
            },
        ] {
            let r = apply(&mut s, flag_cmd(&job, bad.clone()));
            assert!(matches!(r, Response::Rejected { .. }), "{bad:?}: {r:?}");
        }
        assert!(s.jobs[&job].stragglers.is_empty());
        assert_eq!(
            apply(&mut s, flag_cmd(&job, flag(StragglerAction::Warn))),
            Response::Ok
        );
        let j = &s.jobs[&job];
        assert!(j.is_straggler(1));
        assert!(j.avoided_workers.is_empty());
        assert_eq!(j.ranks[1].state, RankState::Running);

        // A job with detection off takes no flag.
        let (mut s, job) = running(StragglerAction::Off);
        let r = apply(&mut s, flag_cmd(&job, flag(StragglerAction::Off)));
        assert!(matches!(r, Response::Rejected { .. }), "{r:?}");
    }

    #[test]
    fn an_exclude_flag_avoids_the_worker_and_the_attempt_runs_on() {
        let (mut s, job) = running(StragglerAction::Exclude);
        assert_eq!(
            apply(&mut s, flag_cmd(&job, flag(StragglerAction::Exclude))),
            Response::Ok
        );
        let j = &s.jobs[&job];
        assert_eq!(j.avoided_workers, vec!["w2".to_string()]);
        assert_eq!(j.ranks[1].state, RankState::Running);
    }

    #[test]
    fn the_policy_bounds_name_the_field() {
        let bad_fraction = StragglerPolicy {
            fraction_permille: 50,
            ..StragglerPolicy::default()
        };
        let e = bad_fraction.validate().expect_err("0.05 is too low");
        assert!(e.starts_with("straggler_fraction 0.05"), "{e}");
        let bad_window = StragglerPolicy {
            window_ms: 1_000,
            ..StragglerPolicy::default()
        };
        let e = bad_window.validate().expect_err("1 s is too short");
        assert!(e.starts_with("straggler_window_ms 1000"), "{e}");
        let spec = JobSpec {
            straggler: bad_window,
            ..JobSpec::new(1, vec!["x".into()])
        };
        let e = spec.validate(8).expect_err("refused with the spec");
        assert!(e.to_string().contains("straggler_window_ms"), "{e}");
        assert!(StragglerPolicy::default().validate().is_ok());
    }
}
