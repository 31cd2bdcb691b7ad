//! The gRPC contract of Cumulus (package `cumulus.v1`): the messages and the tonic clients
//! and servers generated from `proto/cumulus.proto`. No logic lives here.
//!
//! Every generated message also derives `serde::Serialize`/`Deserialize` (with
//! `#[serde(default)]`), so the coordinator's REST mirror uses the same shapes as gRPC.

#![allow(clippy::all, missing_docs)]

/// Generated code for `cumulus.v1`.
pub mod v1 {
    tonic::include_proto!("cumulus.v1");
}

pub use v1::*;

/// gRPC metadata key naming the leader's gRPC address on an UNAVAILABLE answer.
pub const LEADER_GRPC_METADATA: &str = "x-cumulus-leader-grpc";
/// gRPC metadata key naming the leader's HTTP address on an UNAVAILABLE answer.
pub const LEADER_HTTP_METADATA: &str = "x-cumulus-leader-http";
/// HTTP header naming the leader's HTTP address on a 503 answer from a follower.
pub const LEADER_HTTP_HEADER: &str = "x-cumulus-leader-http";
