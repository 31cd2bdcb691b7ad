//! The gRPC `RaftService`: peers' Raft RPCs, decoded and handed to openraft.

use std::sync::Arc;

use cumulus_proto::v1::raft_service_server::RaftService;
use cumulus_proto::v1::{RaftPayload, SnapshotChunk};
use cumulus_raft_store::{Snapshot, TypeConfig, stage};
use openraft::raft::AppendEntriesRequest;
use serde::Serialize;
use tonic::{Request, Response, Status, Streaming};

use crate::network::{MAX_SNAPSHOT_BYTES, SnapshotHeader};
use crate::node::Node;

/// Serves Raft RPCs for one node.
pub struct RaftSvc {
    /// The node.
    pub node: Arc<Node>,
}

fn decode<T: serde::de::DeserializeOwned>(req: Request<RaftPayload>) -> Result<T, Status> {
    serde_json::from_slice(&req.into_inner().json)
        .map_err(|e| Status::invalid_argument(format!("undecodable raft payload: {e}")))
}

fn encode<T: Serialize>(value: &T) -> Result<Response<RaftPayload>, Status> {
    serde_json::to_vec(value)
        .map(|json| Response::new(RaftPayload { json }))
        .map_err(|e| Status::internal(format!("cannot encode raft reply: {e}")))
}

#[tonic::async_trait]
impl RaftService for RaftSvc {
    async fn append_entries(
        &self,
        req: Request<RaftPayload>,
    ) -> Result<Response<RaftPayload>, Status> {
        let received_ns = stage::now_ns();
        let rpc: AppendEntriesRequest<TypeConfig> = decode(req)?;
        let last_index = rpc.entries.last().map(|e| e.log_id.index);
        let decoded_ns = stage::now_ns();
        let result = self.node.raft.append_entries(rpc).await;
        let raft_done_ns = stage::now_ns();
        let reply = encode(&result);
        if let Some(last_index) = last_index {
            tracing::trace!(
                target: stage::TARGET,
                stage = "append_entries_served",
                last_index,
                received_ns,
                decoded_ns,
                raft_done_ns,
                end_ns = stage::now_ns(),
            );
        }
        reply
    }

    async fn vote(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let rpc = decode(req)?;
        encode(&self.node.raft.vote(rpc).await)
    }

    /// Receives a snapshot in chunks (the first carries the header), bounded by
    /// [`MAX_SNAPSHOT_BYTES`], and installs it.
    async fn install_snapshot(
        &self,
        req: Request<Streaming<SnapshotChunk>>,
    ) -> Result<Response<RaftPayload>, Status> {
        let mut chunks = req.into_inner();
        let mut header: Option<SnapshotHeader> = None;
        let mut data: Vec<u8> = Vec::new();
        while let Some(chunk) = chunks.message().await? {
            if !chunk.header_json.is_empty() {
                if header.is_some() {
                    return Err(Status::invalid_argument(
                        "a snapshot stream carries its header twice",
                    ));
                }
                header = Some(serde_json::from_slice(&chunk.header_json).map_err(|e| {
                    Status::invalid_argument(format!("undecodable snapshot header: {e}"))
                })?);
            } else if header.is_none() {
                return Err(Status::invalid_argument(
                    "a snapshot stream must start with its header",
                ));
            }
            if data.len().saturating_add(chunk.data.len()) > MAX_SNAPSHOT_BYTES {
                return Err(Status::resource_exhausted(format!(
                    "snapshot larger than {MAX_SNAPSHOT_BYTES} bytes"
                )));
            }
            data.extend_from_slice(&chunk.data);
        }
        let Some(header) = header else {
            return Err(Status::invalid_argument("an empty snapshot stream"));
        };
        let snapshot = Snapshot {
            meta: header.meta,
            snapshot: std::io::Cursor::new(data),
        };
        encode(
            &self
                .node
                .raft
                .install_full_snapshot(header.vote, snapshot)
                .await,
        )
    }
}
