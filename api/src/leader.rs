//! How a follower names the leader to a client: the metadata keys and header a follower
//! sets on an UNAVAILABLE (gRPC) or 503 (HTTP) answer, and the longest address taken from
//! them. The client that follows them is the `cumulus-client` crate; the Python SDK
//! reads the same names from the generated contract.

/// gRPC metadata key naming the leader's gRPC address (`host:port`) on an UNAVAILABLE
/// answer from a follower.
pub const LEADER_GRPC_METADATA: &str = "x-cumulus-leader-grpc";
/// gRPC metadata key naming the leader's HTTP address on an UNAVAILABLE answer.
pub const LEADER_HTTP_METADATA: &str = "x-cumulus-leader-http";
/// HTTP header naming the leader's HTTP address on a 503 answer from a follower.
pub const LEADER_HTTP_HEADER: &str = "x-cumulus-leader-http";
/// Longest leader address accepted from metadata, in bytes.
pub const MAX_LEADER_ADDR_BYTES: usize = 256;
