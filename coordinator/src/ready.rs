//! Readiness (`GET /ready`): whether this node may take traffic, for load balancers and
//! Kubernetes readiness probes. `/health` answers while the process and its Raft core
//! run; `/ready` answers 200 only while this node's applied state is current:
//!
//! - a leader: acknowledged by a quorum within [`max_leader_ack_age`] and it has applied
//!   everything it committed, an entry of its own term included;
//! - a follower or learner: it knows a leader, heard from one within
//!   [`max_leader_ack_age`], and has applied the highest commit index a leader's append
//!   told it since this process started (a restarted node's metrics first show the
//!   leader and commit index it had before, so they prove nothing);
//! - a candidate, a node shut down or whose Raft core stopped, a pristine node not yet
//!   added (`--join`): never.
//!
//! A node catching up after a restart, a wipe or a partition thus stays out of a
//! Service's endpoints until it serves what the cluster committed.

use std::time::Duration;

use cumulus_raft_store::TypeConfig;
use openraft::{RaftMetrics, ServerState};

/// Election timeouts a leader may go without a quorum's acknowledgement, or a follower
/// without an append from a leader, and still be ready (by then a partitioned leader's
/// followers have elected another, and a cut-off follower serves an old state).
pub const LEADER_ACK_ELECTION_TIMEOUTS: u64 = 2;

/// The longest a ready leader may go without a quorum's acknowledgement, or a ready
/// follower without an append: [`LEADER_ACK_ELECTION_TIMEOUTS`] × the largest election
/// timeout (`election_timeout_max_ms`, in milliseconds).
pub fn max_leader_ack_age(election_timeout_max_ms: u64) -> Duration {
    Duration::from_millis(election_timeout_max_ms.saturating_mul(LEADER_ACK_ELECTION_TIMEOUTS))
}

/// What this process has heard from leaders since it started (`Blobs::note_leader_commit`).
#[derive(Clone, Copy, Debug, Default)]
pub struct LeaderContact {
    /// The highest commit index an append told it, plus one (0: no append yet).
    pub commit_seen: u64,
    /// How long ago the last append arrived (`None`: none yet).
    pub age: Option<Duration>,
}

/// Whether a node with metrics `m` and what it heard from leaders, `contact`, is ready:
/// `Ok(())`, or why not (a sentence for the probe's body).
///
/// # Errors
/// The reason this node is not ready.
pub fn readiness(
    m: &RaftMetrics<TypeConfig>,
    contact: LeaderContact,
    max_leader_ack_age: Duration,
) -> Result<(), String> {
    if let Err(fatal) = &m.running_state {
        return Err(format!("the raft core stopped: {fatal}"));
    }
    let applied_next = m.last_applied.map_or(0, |l| l.index.saturating_add(1));
    match m.state {
        ServerState::Leader => {
            let acked = m
                .last_quorum_acked
                .as_ref()
                .map(|at| openraft::Instant::elapsed(&**at));
            match acked {
                None => return Err("leader not yet acknowledged by a quorum".into()),
                Some(age) if age > max_leader_ack_age => {
                    return Err(format!(
                        "leader without a quorum's acknowledgement for {} ms",
                        age.as_millis()
                    ));
                }
                Some(_) => {}
            }
            let Some(committed) = m.cluster_committed else {
                return Err("leader has committed nothing yet".into());
            };
            if committed.leader_id.term != m.current_term {
                return Err("leader has not yet committed an entry of its term".into());
            }
            if applied_next <= committed.index {
                return Err(format!(
                    "catching up: applied {} of {} committed entries",
                    applied_next, committed.index
                ));
            }
            Ok(())
        }
        ServerState::Follower | ServerState::Learner => {
            if m.current_leader.is_none() {
                return Err("no leader known".into());
            }
            let (seen, Some(age)) = (contact.commit_seen, contact.age) else {
                return Err("no append from a leader since this node started".into());
            };
            if seen == 0 {
                return Err("no append from a leader since this node started".into());
            }
            if age > max_leader_ack_age {
                return Err(format!(
                    "no append from the leader for {} ms",
                    age.as_millis()
                ));
            }
            if applied_next < seen {
                return Err(format!(
                    "catching up: applied {} of {} committed entries",
                    applied_next,
                    seen - 1
                ));
            }
            Ok(())
        }
        ServerState::Candidate => Err("election in progress".into()),
        ServerState::Shutdown => Err("shut down".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cumulus_raft_store::{LeaderId, LogId};
    use openraft::Vote;

    type Metrics = RaftMetrics<TypeConfig>;
    const AGE: Duration = Duration::from_millis(800);

    /// Told commit index `seen` − 1, by an append 10 ms ago.
    fn heard(seen: u64) -> LeaderContact {
        LeaderContact {
            commit_seen: seen,
            age: (seen > 0).then_some(Duration::from_millis(10)),
        }
    }

    fn log_id(term: u64, index: u64) -> LogId {
        LogId::new(LeaderId { term, node_id: 1 }, index)
    }

    fn follower(applied: Option<u64>) -> Metrics {
        let mut m = Metrics::new_initial(2);
        m.state = ServerState::Follower;
        m.current_term = 3;
        m.vote = Vote::new_committed(3, 1);
        m.current_leader = Some(1);
        m.last_applied = applied.map(|i| log_id(3, i));
        m
    }

    #[test]
    fn a_follower_is_ready_once_it_applied_what_a_leader_told_it() {
        // Told commit index 9 (seen = 10): applied 8 is behind, 9 is current.
        let behind = readiness(&follower(Some(8)), heard(10), AGE).unwrap_err();
        assert!(behind.contains("catching up: applied 9 of 9"), "{behind}");
        assert_eq!(readiness(&follower(Some(9)), heard(10), AGE), Ok(()));
        assert_eq!(readiness(&follower(Some(12)), heard(10), AGE), Ok(()));
        // Nothing heard since it started: its old metrics prove nothing.
        let silent = readiness(&follower(Some(9)), heard(0), AGE).unwrap_err();
        assert!(silent.contains("no append"), "{silent}");
        // A pristine node waiting to be added: no leader, nothing applied.
        let mut pristine = Metrics::new_initial(4);
        pristine.state = ServerState::Learner;
        assert!(
            readiness(&pristine, heard(0), AGE)
                .unwrap_err()
                .contains("no leader")
        );
        let mut orphan = follower(Some(9));
        orphan.current_leader = None;
        assert!(
            readiness(&orphan, heard(10), AGE)
                .unwrap_err()
                .contains("no leader")
        );
        let mut learner = follower(Some(9));
        learner.state = ServerState::Learner;
        assert_eq!(readiness(&learner, heard(10), AGE), Ok(()));
        // Cut off: its leader has been silent for longer than the bound.
        let cut_off = LeaderContact {
            commit_seen: 10,
            age: Some(Duration::from_secs(3)),
        };
        let stale = readiness(&follower(Some(9)), cut_off, AGE).unwrap_err();
        assert!(
            stale.contains("no append from the leader for 3000 ms"),
            "{stale}"
        );
    }

    #[test]
    fn a_leader_is_ready_only_while_a_quorum_acknowledges_it_and_it_applied_its_commits() {
        let mut m = follower(Some(9));
        m.state = ServerState::Leader;
        m.id = 1;
        m.cluster_committed = Some(log_id(3, 9));
        let unacked = readiness(&m, heard(0), AGE).unwrap_err();
        assert!(unacked.contains("not yet acknowledged"), "{unacked}");
        m.last_quorum_acked = Some(openraft::metrics::SerdeInstant::new(
            <openraft::TokioInstant as openraft::Instant>::now(),
        ));
        assert_eq!(readiness(&m, heard(0), AGE), Ok(()));
        // Its own term's entry not yet committed: an old term's commit proves nothing.
        m.cluster_committed = Some(log_id(2, 9));
        assert!(
            readiness(&m, heard(0), AGE)
                .unwrap_err()
                .contains("of its term")
        );
        m.cluster_committed = Some(log_id(3, 11));
        let behind = readiness(&m, heard(0), AGE).unwrap_err();
        assert!(behind.contains("applied 10 of 11"), "{behind}");
        m.cluster_committed = Some(log_id(3, 9));
        // A quorum silent for longer than the bound (a partitioned leader).
        assert!(
            readiness(&m, heard(0), Duration::ZERO)
                .unwrap_err()
                .contains("without a quorum's acknowledgement")
        );
    }

    #[test]
    fn candidates_and_stopped_nodes_are_not_ready() {
        let mut m = follower(Some(9));
        m.state = ServerState::Candidate;
        assert!(readiness(&m, heard(10), AGE).is_err());
        m.state = ServerState::Shutdown;
        assert!(readiness(&m, heard(10), AGE).is_err());
        let mut m = follower(Some(9));
        m.running_state = Err(openraft::errors::Fatal::Panicked);
        assert!(
            readiness(&m, heard(10), AGE)
                .unwrap_err()
                .contains("raft core stopped")
        );
    }

    #[test]
    fn the_leader_bound_is_two_election_timeouts() {
        assert_eq!(max_leader_ack_age(400), Duration::from_millis(800));
    }
}
