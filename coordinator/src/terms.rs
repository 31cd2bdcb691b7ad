//! The one rule for a Raft term that enters a coordinator from outside: a candidate's vote
//! or pre-vote request, a leader's append or snapshot, a peer's answer.
//!
//! Two bounds, checked by [`check_term`] wherever a term arrives:
//! - **absolute** ([`MAX_RAFT_TERM`], inclusive): no term above it is ever accepted or
//!   adopted. openraft 0.10.0-alpha.37 `unwrap`s the `term + 1` of an election, so a node
//!   that adopted a term near `u64::MAX` panicked at its next election, and did again on
//!   every restart (the vote is persisted first).
//! - **per step** ([`MAX_TERM_STEP`]): a candidate's request may carry a term at most this
//!   far above the receiver's own. A vote request is the only message that raises a term
//!   without a majority having accepted it, so this is what bounds how fast any sequence of
//!   accepted messages can climb: reaching [`MAX_RAFT_TERM`] from 0 takes at least
//!   `MAX_RAFT_TERM / MAX_TERM_STEP` = 2^42 (4.4·10^12) accepted vote requests, each
//!   persisted with an `fdatasync` before it is answered — about 1.4 years at 10 µs a sync,
//!   and only while no leader's lease is live (openraft refuses votes during a lease, and a
//!   leadership-transfer vote, which would skip the lease, is never honoured here: see
//!   [`strip_transfer`]). Below the bound every node can still start an election: its
//!   `term + 1` passes both bounds at any peer of its own term.
//!
//! An honest candidate is never far ahead: pre-vote is on (`enable_pre_vote`), so a node
//! cut off from a majority does not raise its term while it waits, and a candidate's term
//! exceeds a voter's only by the elections that voter missed. A leader's term was granted
//! by a majority under the per-step bound, so appends, snapshots and answers are held to
//! the absolute bound only: a node that was partitioned while the others' terms rose must
//! still follow the new leader.

use openraft::raft::VoteRequest;

use cumulus_raft_store::TypeConfig;

/// Highest Raft term any coordinator accepts or adopts (inclusive). Far below `u64::MAX`,
/// so `term + 1` never overflows; far above any real cluster's terms (one election per
/// millisecond reaches it after ~146 million years).
pub const MAX_RAFT_TERM: u64 = 1 << 62;

/// Most a candidate's vote or pre-vote request may raise the receiver's term by. With
/// pre-vote on, honest candidates lead a voter by the elections it missed: a handful. A
/// node running a version without pre-vote raises its term once per election timeout
/// while partitioned (200–400 ms by default), so it may come back more than this far
/// ahead only after ~2.4 days cut off; its votes are then refused (logged) until it
/// follows the cluster's leader.
pub const MAX_TERM_STEP: u64 = 1 << 20;

/// Where a term comes from, which decides the bounds it is held to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TermSource {
    /// A candidate's vote or pre-vote request: both bounds.
    Candidate,
    /// A leader's append or snapshot: the absolute bound.
    Leader,
    /// A peer's answer to one of this node's requests: the absolute bound.
    Answer,
}

/// Why a term is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TermRefusal {
    /// Above [`MAX_RAFT_TERM`].
    #[error("term {term} is above the highest any coordinator accepts ({MAX_RAFT_TERM})")]
    AboveBound {
        /// The term refused.
        term: u64,
    },
    /// A candidate more than [`MAX_TERM_STEP`] ahead of this node.
    #[error(
        "term {term} is more than {MAX_TERM_STEP} above this node's term {own}: no honest \
         candidate is that far ahead"
    )]
    TooFarAhead {
        /// The term refused.
        term: u64,
        /// This node's term.
        own: u64,
    },
}

/// Checks a `term` from `source` against this node's own term `own` (see the module doc).
///
/// # Errors
/// [`TermRefusal`] naming the bound the term breaks.
pub fn check_term(source: TermSource, term: u64, own: u64) -> Result<(), TermRefusal> {
    if term > MAX_RAFT_TERM {
        return Err(TermRefusal::AboveBound { term });
    }
    if source == TermSource::Candidate && term > own.saturating_add(MAX_TERM_STEP) {
        return Err(TermRefusal::TooFarAhead { term, own });
    }
    Ok(())
}

/// Clears a vote request's `leadership_transfer` flag (logged when it was set), so the
/// receiver honours the leader lease. openraft grants a transfer vote while a leader is
/// live, on the word of the candidate alone; this coordinator never starts a transfer
/// (its network has no `transfer_leader`), so no honest request carries the flag, and a
/// forged one could depose a live leader and raise the term with a single message.
pub fn strip_transfer(mut rpc: VoteRequest<TypeConfig>) -> VoteRequest<TypeConfig> {
    if rpc.leadership_transfer {
        tracing::warn!(
            candidate = rpc.vote.leader_id.node_id,
            term = rpc.vote.leader_id.term,
            "a vote request claims a leadership transfer, which no coordinator starts; \
             handled as an ordinary vote (the leader lease holds)"
        );
        rpc.leadership_transfer = false;
    }
    rpc
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_bounds_are_inclusive_and_one_rule() {
        use TermSource::*;
        for source in [Candidate, Leader, Answer] {
            assert!(check_term(source, MAX_RAFT_TERM, MAX_RAFT_TERM).is_ok());
            assert_eq!(
                check_term(source, MAX_RAFT_TERM + 1, MAX_RAFT_TERM),
                Err(TermRefusal::AboveBound {
                    term: MAX_RAFT_TERM + 1
                })
            );
            assert!(check_term(source, u64::MAX, u64::MAX).is_err());
        }
        assert!(check_term(Candidate, 5 + MAX_TERM_STEP, 5).is_ok());
        assert_eq!(
            check_term(Candidate, 6 + MAX_TERM_STEP, 5),
            Err(TermRefusal::TooFarAhead {
                term: 6 + MAX_TERM_STEP,
                own: 5
            })
        );
        // A leader or an answer far ahead is followed: a majority accepted that term.
        assert!(check_term(Leader, 1 << 40, 5).is_ok());
        assert!(check_term(Answer, 1 << 40, 5).is_ok());
        // The trap of the old bound: a vote at the bound itself from a low term.
        assert!(check_term(Candidate, MAX_RAFT_TERM, 3).is_err());
    }

    #[test]
    fn a_transfer_vote_becomes_an_ordinary_one() {
        let rpc = VoteRequest::<TypeConfig> {
            vote: cumulus_raft_store::Vote::new(11, 2),
            last_log_id: None,
            leadership_transfer: true,
        };
        let stripped = strip_transfer(rpc.clone());
        assert!(!stripped.leadership_transfer);
        assert_eq!(stripped.vote, rpc.vote);
    }

    /// One message a node receives in the model below.
    #[derive(Clone, Debug)]
    enum Msg {
        /// A candidate (honest or not) asks node `to` for its vote at `term`.
        Vote { to: usize, term: u64 },
        /// A leader at `term` appends to node `to`.
        Append { to: usize, term: u64 },
        /// Node `from` times out and starts an election at its term + 1, asking every
        /// other node.
        Elect { from: usize },
    }

    fn msg(nodes: usize) -> impl Strategy<Value = Msg> {
        let term = prop_oneof![
            any::<u64>(),
            0..1_000u64,
            (MAX_RAFT_TERM - 4)..=(MAX_RAFT_TERM + 4),
        ];
        prop_oneof![
            (0..nodes, term.clone()).prop_map(|(to, term)| Msg::Vote { to, term }),
            (0..nodes, term).prop_map(|(to, term)| Msg::Append { to, term }),
            (0..nodes).prop_map(|from| Msg::Elect { from }),
        ]
    }

    proptest! {
        /// Whatever a peer sends, in any order: no node ever holds a term above the
        /// bound; each accepted message raises the cluster's highest term by at most
        /// [`MAX_TERM_STEP`] unless a majority-elected leader carried it (appends, which
        /// only arrive from terms some node already accepted as a candidate's); and every
        /// node can still start an election its peers accept.
        #[test]
        fn no_sequence_of_accepted_messages_traps_the_cluster(
            start in 0u64..(1 << 40),
            msgs in prop::collection::vec(msg(3), 1..200),
        ) {
            let mut terms = [start; 3];
            // Terms some node accepted from a candidate: the only ones a leader can hold.
            let mut granted = vec![start];
            let mut raises = 0u64;
            for m in msgs {
                match m {
                    Msg::Vote { to, term } => {
                        if check_term(TermSource::Candidate, term, terms[to]).is_ok()
                            && term > terms[to]
                        {
                            terms[to] = term;
                            granted.push(term);
                            raises += 1;
                        }
                    }
                    Msg::Append { to, term } => {
                        // A leader's term is one a candidate was granted.
                        let term = granted[(term % granted.len() as u64) as usize];
                        if check_term(TermSource::Leader, term, terms[to]).is_ok()
                            && term > terms[to]
                        {
                            terms[to] = term;
                        }
                    }
                    Msg::Elect { from } => {
                        let next = terms[from] + 1;
                        prop_assert!(next <= MAX_RAFT_TERM + 1);
                        terms[from] = next;
                        for (to, term) in terms.iter_mut().enumerate() {
                            if to != from
                                && check_term(TermSource::Candidate, next, *term).is_ok()
                                && next > *term
                            {
                                *term = next;
                                granted.push(next);
                            }
                        }
                        raises += 1;
                    }
                }
                let highest = *terms.iter().max().expect("nodes");
                prop_assert!(highest <= MAX_RAFT_TERM);
                prop_assert!(highest <= start + raises * MAX_TERM_STEP);
                // Every node's next election is accepted by a peer at its own term.
                for t in terms {
                    prop_assert!(check_term(TermSource::Candidate, t + 1, t).is_ok());
                }
            }
        }
    }
}
