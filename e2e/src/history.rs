//! Checks over a recorded client history (pure functions, tested here).
//!
//! * [`check_reads`]: linearizability of linearizable job reads. A job's replicated
//!   state only moves forward along a total order ([`Version`]: state rank, restarts,
//!   attempts, committed step), so a history of reads of one job is linearizable iff no
//!   read returns a version older than one returned by a read that completed before it
//!   was invoked (real-time order), and versions of overlapping reads are comparable.
//! * [`check_transitions`]: every observed sequence of job states is a path of the job
//!   state machine, and restarts and attempts never go back.

use cumulus_api::JobState;
use std::collections::BTreeMap;

/// One completed read of a job, with its invocation and completion times.
#[derive(Clone, Debug, PartialEq)]
pub struct Read {
    /// Job id.
    pub job_id: String,
    /// When the client sent the request, in microseconds since the run started.
    pub invoked_us: u64,
    /// When the client got the answer, in microseconds since the run started.
    pub completed_us: u64,
    /// What it saw.
    pub version: Version,
}

/// A job's position along its (monotone) history.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    /// How many times the job's state has changed (`Job.state_changes`): a job can go
    /// back to pending (preempted) or paused and back, so only this orders its states.
    pub changes: u64,
    /// 0 pending, 1 running, 2 terminal, 3 paused.
    pub phase: u8,
    /// Restarts used.
    pub restarts: u32,
    /// Sum of the ranks' attempt numbers.
    pub attempts: u64,
    /// The terminal state's name ("" before).
    pub terminal: String,
}

impl Version {
    /// From a job's state name, state changes, restarts used and rank attempts.
    pub fn of(
        state: &str,
        changes: u64,
        restarts: u32,
        attempts: impl Iterator<Item = u32>,
    ) -> Version {
        let phase = match state.parse::<JobState>() {
            Ok(JobState::Pending) => 0,
            Ok(JobState::Running) => 1,
            Ok(JobState::Paused) => 3,
            _ => 2,
        };
        Version {
            changes,
            phase,
            restarts,
            attempts: attempts.map(u64::from).sum(),
            terminal: if phase == 2 {
                state.to_string()
            } else {
                String::new()
            },
        }
    }

    /// True when `self` may follow `earlier` in one job's history: a terminal state
    /// never changes; otherwise the state changes, restarts and attempts never go back,
    /// and the state is the same while the count of changes is.
    pub fn follows(&self, earlier: &Version) -> bool {
        if earlier.phase == 2 {
            return self == earlier;
        }
        self.changes >= earlier.changes
            && (self.changes > earlier.changes || self.phase == earlier.phase)
            && self.restarts >= earlier.restarts
            && self.attempts >= earlier.attempts
    }
}

/// A violation found in a history.
#[derive(Clone, Debug, PartialEq)]
pub struct Anomaly {
    /// The job concerned.
    pub job_id: String,
    /// What is wrong.
    pub what: String,
}

/// Real-time order check of linearizable reads (see the module documentation).
/// O(n log n + n·k) per job where k is the number of concurrent reads.
pub fn check_reads(reads: &[Read]) -> Vec<Anomaly> {
    let mut by_job: BTreeMap<&str, Vec<&Read>> = BTreeMap::new();
    for r in reads {
        by_job.entry(&r.job_id).or_default().push(r);
    }
    let mut out = Vec::new();
    for (job, mut rs) in by_job {
        rs.sort_by_key(|r| r.invoked_us);
        // Newest version among reads completed before the current invocation.
        let mut done: Vec<&Read> = rs.clone();
        done.sort_by_key(|r| r.completed_us);
        let mut floor: Option<&Version> = None;
        let mut d = 0;
        for r in &rs {
            while d < done.len() && done[d].completed_us < r.invoked_us {
                let v = &done[d].version;
                if floor.is_none_or(|f| v.follows(f)) {
                    floor = Some(v);
                }
                d += 1;
            }
            if let Some(f) = floor
                && !r.version.follows(f)
            {
                out.push(Anomaly {
                    job_id: job.to_string(),
                    what: format!(
                        "stale read: {:?} invoked at {} µs after a read that completed with {:?}",
                        r.version, r.invoked_us, f
                    ),
                });
            }
        }
        // Every two reads must be ordered one way or the other along one history.
        let mut seen: Vec<&Version> = rs.iter().map(|r| &r.version).collect();
        seen.sort();
        seen.dedup();
        for w in seen.windows(2) {
            if !w[1].follows(w[0]) {
                out.push(Anomaly {
                    job_id: job.to_string(),
                    what: format!("incomparable versions {:?} and {:?}", w[0], w[1]),
                });
            }
        }
    }
    out
}

/// Legal job state changes: each one counted in `changes` (pending → running →
/// terminal, pending → terminal, and through paused and back); a terminal state never
/// changes. `observed` is one job's states in read order of a
/// single client (or any sequence consistent with real time).
pub fn check_transitions(job_id: &str, observed: &[Version]) -> Vec<Anomaly> {
    observed
        .windows(2)
        .filter(|w| !w[1].follows(&w[0]))
        .map(|w| Anomaly {
            job_id: job_id.to_string(),
            what: format!("illegal transition {:?} -> {:?}", w[0], w[1]),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version of a job that went pending → running → terminal (its state changes
    /// counted as such).
    fn v(state: &str, restarts: u32) -> Version {
        let changes = match state {
            "pending" => 0,
            "running" => 1,
            _ => 2,
        };
        Version::of(state, changes, restarts, [restarts].into_iter())
    }

    /// A version with its count of state changes given.
    fn vc(state: &str, changes: u64, attempts: u32) -> Version {
        Version::of(state, changes, 0, [attempts].into_iter())
    }

    fn read(inv: u64, done: u64, version: Version) -> Read {
        Read {
            job_id: "job-1".into(),
            invoked_us: inv,
            completed_us: done,
            version,
        }
    }

    #[test]
    fn a_sequential_forward_history_is_linearizable() {
        let h = [
            read(0, 10, v("pending", 0)),
            read(20, 30, v("running", 0)),
            read(40, 50, v("running", 1)),
            read(60, 70, v("succeeded", 1)),
        ];
        assert!(check_reads(&h).is_empty());
    }

    #[test]
    fn a_stale_read_after_a_newer_completed_read_is_caught() {
        let h = [read(0, 10, v("running", 0)), read(20, 30, v("pending", 0))];
        let a = check_reads(&h);
        assert_eq!(a.len(), 1, "{a:?}");
        assert!(a[0].what.contains("stale read"));
    }

    #[test]
    fn overlapping_reads_may_see_either_order() {
        // The second read overlaps the first: it may linearize before it.
        let h = [read(0, 50, v("running", 0)), read(10, 60, v("pending", 0))];
        assert!(check_reads(&h).is_empty());
        // But a read that starts after a terminal read completed must see it.
        let h = [
            read(0, 50, v("succeeded", 0)),
            read(51, 60, v("running", 0)),
        ];
        assert_eq!(check_reads(&h).len(), 1);
    }

    #[test]
    fn two_different_terminal_states_are_incomparable() {
        let h = [read(0, 10, v("succeeded", 0)), read(5, 20, v("failed", 0))];
        let a = check_reads(&h);
        assert!(a.iter().any(|a| a.what.contains("incomparable")), "{a:?}");
    }

    #[test]
    fn reads_of_different_jobs_are_independent() {
        let mut b = read(20, 30, v("pending", 0));
        b.job_id = "job-2".into();
        let h = [read(0, 10, v("running", 0)), b];
        assert!(check_reads(&h).is_empty());
    }

    #[test]
    fn transitions_follow_the_state_machine() {
        let ok = [
            v("pending", 0),
            v("running", 0),
            v("running", 1),
            v("failed", 1),
        ];
        assert!(check_transitions("j", &ok).is_empty());
        let back = [v("running", 1), v("running", 0)];
        assert_eq!(check_transitions("j", &back).len(), 1);
        let resurrected = [v("cancelled", 0), v("running", 0)];
        assert_eq!(check_transitions("j", &resurrected).len(), 1);
        let to_pending = [v("running", 0), v("pending", 0)];
        assert_eq!(check_transitions("j", &to_pending).len(), 1);
    }

    #[test]
    fn a_pause_and_resume_moves_forward_and_a_stale_paused_read_is_caught() {
        // running → paused (new attempts) → pending → running → succeeded.
        let cycle = [
            vc("running", 1, 0),
            vc("paused", 2, 1),
            vc("pending", 3, 1),
            vc("running", 4, 1),
            vc("succeeded", 5, 1),
        ];
        assert!(check_transitions("j", &cycle).is_empty());
        let h: Vec<Read> = cycle
            .iter()
            .enumerate()
            .map(|(i, v)| read(i as u64 * 20, i as u64 * 20 + 10, v.clone()))
            .collect();
        assert!(check_reads(&h).is_empty());
        // Paused again after the job was seen running once more: stale.
        let stale = [
            read(0, 10, vc("running", 4, 1)),
            read(20, 30, vc("paused", 2, 1)),
        ];
        assert_eq!(check_reads(&stale).len(), 1);
        // Another state with the same count of changes: impossible.
        let forged = [vc("running", 4, 1), vc("paused", 4, 1)];
        assert_eq!(check_transitions("j", &forged).len(), 1);
    }
}
