//! The gRPC `RaftService`: peers' Raft RPCs, decoded and handed to openraft.

use std::sync::Arc;

use cumulus_proto::v1::RaftPayload;
use cumulus_proto::v1::raft_service_server::RaftService;
use cumulus_raft_store::{TypeConfig, stage};
use openraft::raft::AppendEntriesRequest;
use serde::Serialize;
use tonic::{Request, Response, Status};

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

    async fn install_snapshot(
        &self,
        req: Request<RaftPayload>,
    ) -> Result<Response<RaftPayload>, Status> {
        let rpc = decode(req)?;
        encode(&self.node.raft.install_snapshot(rpc).await)
    }
}
