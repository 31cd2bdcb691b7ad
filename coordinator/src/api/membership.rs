//! Membership: the cluster as this node sees it, and an administrator's changes to the
//! coordinators' Raft membership (add a learner, promote it, remove a member).

use openraft::async_runtime::watch::WatchReceiver;
use std::collections::BTreeSet;

use cumulus_api::users::Principal;
use cumulus_api::v1;
use cumulus_api::{MemberRole, Role};
use cumulus_raft_store::CumulusNode;
use cumulus_raft_store::TypeConfig;
use openraft::error::{ClientWriteError, RaftError};
use openraft::{ChangeMembers, ServerState};

use super::authorization::require_role;
use crate::convert::workers_to_proto;
use crate::error::ApiError;
use crate::node::Node;

/// How long ago each other member last acknowledged this leader (a heartbeat or an
/// append), in milliseconds; a member never heard from since the election counts from
/// when this node started acting as leader. Empty on a follower, and while this leader's
/// control loop has not yet started its term (nothing is known to be late then).
fn ack_ages_ms(
    node: &Node,
    m: &openraft::RaftMetrics<TypeConfig>,
) -> std::collections::BTreeMap<u64, u64> {
    let Some(heartbeat) = m.heartbeat.as_ref() else {
        return Default::default();
    };
    let since_election_ms = {
        let soft = node.soft();
        match (soft.leader_term, soft.leader_since) {
            (Some(term), Some(at)) if term == m.current_term => {
                Some(at.elapsed().as_millis() as u64)
            }
            _ => None,
        }
    };
    heartbeat
        .iter()
        .filter(|(id, _)| **id != node.id)
        .filter_map(|(id, acked)| {
            let age = match acked {
                Some(at) => Some(openraft::Instant::elapsed(&**at).as_millis() as u64),
                None => since_election_ms,
            };
            age.map(|a| (*id, a))
        })
        .collect()
}

/// The cluster as this node sees it. On the leader, a member that has acknowledged
/// nothing for [`MemberRole::UNREACHABLE_AFTER_HEARTBEATS`] heartbeat intervals is shown
/// `unreachable`, with the role it had (`last_role`).
pub fn cluster_status(node: &Node) -> v1::ClusterStatusResponse {
    let m = node.raft.metrics().borrow_watched().clone();
    let membership = m.membership_config.membership();
    let voters: Vec<u64> = membership.voter_ids().collect();
    let ack_ages = ack_ages_ms(node, &m);
    let unreachable_after_ms =
        MemberRole::UNREACHABLE_AFTER_HEARTBEATS * node.raft.config().heartbeat_interval;
    let members = membership
        .nodes()
        .map(|(id, n)| {
            let role = if m.current_leader == Some(*id) {
                MemberRole::Leader
            } else if *id == node.id {
                match m.state {
                    ServerState::Candidate => MemberRole::Candidate,
                    ServerState::Learner => MemberRole::Learner,
                    ServerState::Follower => MemberRole::Follower,
                    ServerState::Leader => MemberRole::Leader,
                    ServerState::Shutdown => MemberRole::Shutdown,
                }
            } else if voters.contains(id) {
                MemberRole::Follower
            } else {
                MemberRole::Learner
            };
            let last_ack_age_ms = ack_ages.get(id).copied();
            let (role, last_role) = match last_ack_age_ms {
                Some(age) if age > unreachable_after_ms && role != MemberRole::Leader => {
                    (MemberRole::Unreachable, role.as_str().to_string())
                }
                _ => (role, String::new()),
            };
            v1::Member {
                node_id: *id,
                grpc_addr: n.grpc_addr.clone(),
                http_addr: n.http_addr.clone(),
                raft_addr: n.raft_addr.clone(),
                role: role.as_str().to_string(),
                voter: voters.contains(id),
                last_role,
                last_ack_age_ms,
            }
        })
        .collect();
    let soft_workers = node.soft().workers.clone();
    let workers = node.read_state(|s| workers_to_proto(s, &soft_workers));
    // openraft's committed log id as this node knows it: on the leader, acknowledged by
    // a quorum; on a follower, what the leader last told it.
    let commit_index = m.cluster_committed.or(m.local_committed).map(|l| l.index);
    v1::ClusterStatusResponse {
        node_id: node.id,
        leader_id: m.current_leader,
        term: m.current_term,
        commit_index: commit_index.or(m.last_applied.map(|l| l.index)),
        last_applied_index: m.last_applied.map(|l| l.index),
        members,
        workers,
        snapshot_index: m.snapshot.map(|l| l.index),
        purged_index: m.purged.map(|l| l.index),
        insecure: !node.tls,
    }
}

/// Longest an `add-learner` waits for the new learner to catch up before answering.
pub const ADD_LEARNER_TIMEOUT_MS: u64 = 60_000;
/// Longest address accepted for a new member, in bytes.
pub const MAX_MEMBER_ADDR_BYTES: usize = 256;

fn validate_member_addr(what: &str, addr: &str) -> Result<(), ApiError> {
    let ok = !addr.is_empty()
        && addr.len() <= MAX_MEMBER_ADDR_BYTES
        && addr.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
        })
        && !addr.contains(['/', ' ', '@']);
    if ok {
        Ok(())
    } else {
        Err(ApiError::InvalidArgument(format!(
            "{what} {addr:?} must be HOST:PORT (at most {MAX_MEMBER_ADDR_BYTES} bytes)"
        )))
    }
}

fn membership_error(
    node: &Node,
    e: RaftError<TypeConfig, ClientWriteError<TypeConfig>>,
) -> ApiError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => ApiError::NotLeader {
            leader: f.leader_node.clone().or_else(|| node.leader_node()),
        },
        RaftError::APIError(ClientWriteError::ChangeMembershipError(c)) => {
            ApiError::FailedPrecondition(format!("membership change refused: {c}"))
        }
        other => ApiError::Unavailable(format!("raft could not change the membership: {other}")),
    }
}

/// Adds coordinator `req.node_id` as a learner and waits (up to
/// [`ADD_LEARNER_TIMEOUT_MS`]) until it has caught up with the leader's log. Idempotent:
/// adding a member again with the same addresses succeeds.
///
/// # Errors
/// `InvalidArgument` for a bad id or address, or an id already used with other
/// addresses; `NotLeader`; `Unavailable` when Raft cannot commit or the learner did not
/// catch up in time (it stays a learner; retry or remove it).
pub async fn add_learner(
    node: &Node,
    who: &Principal,
    req: v1::AddLearnerRequest,
) -> Result<v1::ClusterStatusResponse, ApiError> {
    require_role(who, Role::Admin, "change the membership")?;
    node.require_leader()?;
    if req.node_id == 0 {
        return Err(ApiError::InvalidArgument("node_id must be >= 1".into()));
    }
    validate_member_addr("grpc_addr", &req.grpc_addr)?;
    validate_member_addr("http_addr", &req.http_addr)?;
    if !req.raft_addr.is_empty() {
        validate_member_addr("raft_addr", &req.raft_addr)?;
        if req.raft_addr == req.grpc_addr {
            return Err(ApiError::InvalidArgument(format!(
                "raft_addr {:?} is its gRPC address: leave raft_addr empty when Raft shares \
                 the gRPC port",
                req.raft_addr
            )));
        }
    }
    let new = CumulusNode {
        grpc_addr: req.grpc_addr.clone(),
        http_addr: req.http_addr.clone(),
        raft_addr: req.raft_addr.clone(),
    };
    let existing = node
        .raft
        .metrics()
        .borrow_watched()
        .membership_config
        .membership()
        .get_node(&req.node_id)
        .cloned();
    if let Some(old) = existing
        && old != new
    {
        return Err(ApiError::InvalidArgument(format!(
            "node {} is already a member at {old}; remove it first",
            req.node_id
        )));
    }
    let added = tokio::time::timeout(
        std::time::Duration::from_millis(ADD_LEARNER_TIMEOUT_MS),
        node.raft.add_learner(req.node_id, new, true),
    )
    .await
    .map_err(|_| {
        ApiError::Unavailable(format!(
            "node {} was added as a learner but has not caught up within {} ms; is it running?",
            req.node_id, ADD_LEARNER_TIMEOUT_MS
        ))
    })?;
    added.map_err(|e| membership_error(node, e))?;
    Ok(cluster_status(node))
}

/// Makes learner `node_id` a voter. Idempotent for a node that already votes.
///
/// # Errors
/// `NotFound` for a node that is not a member; `NotLeader`; `FailedPrecondition` when
/// another membership change is in progress; `Unavailable` from Raft.
pub async fn promote_member(
    node: &Node,
    who: &Principal,
    node_id: u64,
) -> Result<v1::ClusterStatusResponse, ApiError> {
    require_role(who, Role::Admin, "change the membership")?;
    node.require_leader()?;
    let (is_member, is_voter) = {
        let m = node.raft.metrics().borrow_watched().clone();
        let ms = m.membership_config.membership();
        (
            ms.get_node(&node_id).is_some(),
            ms.voter_ids().any(|v| v == node_id),
        )
    };
    if !is_member {
        return Err(ApiError::NotFound(format!(
            "node {node_id} is not a member; add it with add-learner first"
        )));
    }
    if !is_voter {
        node.raft
            .change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([node_id])), false)
            .await
            .map_err(|e| membership_error(node, e))?;
    }
    Ok(cluster_status(node))
}

/// Removes voter or learner `node_id` from the cluster. Idempotent for a node that is not
/// a member. Removing the leader itself is allowed: it steps down once the new
/// configuration is committed.
///
/// # Errors
/// `FailedPrecondition` when it is the last voter or another change is in progress;
/// `NotLeader`; `Unavailable` from Raft.
pub async fn remove_member(
    node: &Node,
    who: &Principal,
    node_id: u64,
) -> Result<v1::ClusterStatusResponse, ApiError> {
    require_role(who, Role::Admin, "change the membership")?;
    node.require_leader()?;
    let (is_member, voters) = {
        let m = node.raft.metrics().borrow_watched().clone();
        let ms = m.membership_config.membership();
        (
            ms.get_node(&node_id).is_some(),
            ms.voter_ids().collect::<BTreeSet<_>>(),
        )
    };
    if is_member {
        let change = if voters.contains(&node_id) {
            if voters.len() == 1 {
                return Err(ApiError::FailedPrecondition(format!(
                    "node {node_id} is the last voter; a cluster cannot remove it"
                )));
            }
            ChangeMembers::RemoveVoters(BTreeSet::from([node_id]))
        } else {
            ChangeMembers::RemoveNodes(BTreeSet::from([node_id]))
        };
        node.raft
            .change_membership(change, false)
            .await
            .map_err(|e| membership_error(node, e))?;
    }
    Ok(cluster_status(node))
}
