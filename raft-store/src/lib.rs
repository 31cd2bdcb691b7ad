//! Cumulus's replicated state machine and its openraft storage on sled.
//!
//! - [`state`]: the state ([`ClusterState`]), the commands ([`Command`]) and their pure,
//!   deterministic `apply` (docs/architecture.md, "The replicated state").
//! - [`store`]: openraft's `RaftLogStorage` and `RaftStateMachine` (openraft 0.10):
//!   log entries in [`wal`], everything else (vote, state machine, snapshots) in sled;
//!   checked by openraft's own storage test suite.
//! - [`wal`]: the write-ahead log of Raft entries (preallocated segments, CRC-checked
//!   records; an append returns once written and is reported
//!   flushed by its sync thread after `fdatasync`).
//! - [`record`]: the checksummed format of the records in sled and the generation file
//!   that tells when sled lost flushed writes.
//! - [`stage`]: trace events that time each stage of a write (for the benchmarks).

pub mod codec;
pub mod flusher;
pub mod record;
pub mod stage;
pub mod state;
pub mod store;
pub mod wal;

use std::fmt;

use serde::{Deserialize, Serialize};

pub use state::{ClusterState, Command, Response};
pub use store::{LogStore, OpenError, SharedState, SmData, StateMachineStore, open};

/// Raft node id of a coordinator (≥ 1).
pub type NodeId = u64;

/// The addresses of a coordinator, stored in Raft membership.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CumulusNode {
    /// `host:port` of its gRPC server (client and worker services; Raft too when
    /// `raft_addr` is empty).
    pub grpc_addr: String,
    /// `host:port` of its HTTP server (REST, SSE logs, health).
    pub http_addr: String,
    /// `host:port` of its Raft listener (`cumulus-coordinator --raft-listen`: the Raft
    /// service and blob replication between coordinators, on a port of their own); empty
    /// when Raft shares the gRPC port. Absent from members stored before it existed,
    /// and not written when empty, so nodes of either version read each other's
    /// memberships.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub raft_addr: String,
}

impl CumulusNode {
    /// Where peers reach this node's Raft service: `raft_addr`, or `grpc_addr` when
    /// Raft shares the gRPC port.
    pub fn raft_target(&self) -> &str {
        if self.raft_addr.is_empty() {
            &self.grpc_addr
        } else {
            &self.raft_addr
        }
    }
}

impl fmt::Display for CumulusNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "grpc={} http={}", self.grpc_addr, self.http_addr)?;
        if !self.raft_addr.is_empty() {
            write!(f, " raft={}", self.raft_addr)?;
        }
        Ok(())
    }
}

openraft::declare_raft_types!(
    /// openraft type configuration of Cumulus: commands in, responses out, u64 node ids
    /// and terms, openraft's default leader id (term and node id, so several leaders
    /// per term are not allowed to commit), tokio.
    pub TypeConfig:
        D = Command,
        R = Response,
        NodeId = NodeId,
        Node = CumulusNode,
        AsyncRuntime = openraft::TokioRuntime,
);

/// A leader id: `{term, node_id}` (openraft's default, "advanced" leader id).
pub type LeaderId = openraft::type_config::alias::LeaderIdOf<TypeConfig>;
/// A Raft log id (`{leader_id: {term, node_id}, index}` in JSON, as in openraft 0.9).
pub type LogId = openraft::type_config::alias::LogIdOf<TypeConfig>;
/// A vote (`{leader_id: {term, node_id}, committed}` in JSON).
pub type Vote = openraft::type_config::alias::VoteOf<TypeConfig>;
/// A Raft log entry.
pub type Entry = openraft::type_config::alias::EntryOf<TypeConfig>;
/// The payload of a log entry (blank, a [`Command`] or a membership).
pub type EntryPayload = openraft::type_config::alias::EntryPayloadOf<TypeConfig>;
/// A membership with the log id where it was proposed.
pub type StoredMembership = openraft::type_config::alias::StoredMembershipOf<TypeConfig>;
/// What a snapshot covers: its last log id, membership and id.
pub type SnapshotMeta = openraft::type_config::alias::SnapshotMetaOf<TypeConfig>;
/// The bytes of a snapshot (the JSON of the applied state), in memory.
pub type SnapshotData = std::io::Cursor<Vec<u8>>;
/// A snapshot: its meta and its data.
pub type Snapshot = openraft::type_config::alias::SnapshotOf<TypeConfig, SnapshotData>;

/// The openraft handle of a Cumulus coordinator.
pub type Raft = openraft::Raft<TypeConfig, StateMachineStore>;
