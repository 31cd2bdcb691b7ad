//! Cumulus's replicated state machine and its openraft storage on sled.
//!
//! - [`state`]: the state ([`ClusterState`]), the commands ([`Command`]) and their pure,
//!   deterministic `apply` (DESIGN.md "The replicated state").
//! - [`store`]: openraft's `RaftLogStorage` and `RaftStateMachine` (storage-v2 API):
//!   log entries in [`wal`], everything else (vote, state machine, snapshots) in sled;
//!   checked by openraft's own storage test suite.
//! - [`wal`]: the write-ahead log of Raft entries (preallocated segments, CRC-checked
//!   records, one `fdatasync` per append).
//! - [`stage`]: trace events that time each stage of a write (for the benchmarks).

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
    /// `host:port` of its gRPC server (Raft, client and worker services).
    pub grpc_addr: String,
    /// `host:port` of its HTTP server (REST, SSE logs, health).
    pub http_addr: String,
}

impl fmt::Display for CumulusNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "grpc={} http={}", self.grpc_addr, self.http_addr)
    }
}

openraft::declare_raft_types!(
    /// openraft type configuration of Cumulus: commands in, responses out, u64 node ids,
    /// snapshots as in-memory JSON bytes.
    pub TypeConfig:
        D = Command,
        R = Response,
        NodeId = NodeId,
        Node = CumulusNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = std::io::Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// The openraft handle of a Cumulus coordinator.
pub type Raft = openraft::Raft<TypeConfig>;
