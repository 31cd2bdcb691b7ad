//! The gRPC `RaftService`: peers' Raft RPCs, decoded and handed to openraft.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use cumulus_proto::v1::raft_service_server::RaftService;
use cumulus_proto::v1::{RaftPayload, SnapshotChunk};
use cumulus_raft_store::{Snapshot, TypeConfig, stage};
use futures::{Stream, StreamExt};
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

/// Emits the `append_entries_served` stage event of one AppendEntries request that
/// carried entries (`last_index`); timestamps in ns since the Unix epoch, the end is now.
fn trace_served(last_index: Option<u64>, received_ns: u64, decoded_ns: u64, raft_done_ns: u64) {
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
}

/// Requests taken from a replication stream and not answered yet: `(last index,
/// received at ns, decoded at ns)`, for the `append_entries_served` stage events.
type ServedQueue = Arc<Mutex<VecDeque<(Option<u64>, u64, u64)>>>;

/// Answers of one replication stream.
type AnswerStream = Pin<Box<dyn Stream<Item = Result<RaftPayload, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl RaftService for RaftSvc {
    type AppendStreamStream = AnswerStream;

    /// Feeds the leader's AppendEntries requests to openraft's pipelined `stream_append`
    /// as they arrive and sends one answer per request, in order. An undecodable request
    /// or a broken stream ends the input; openraft then answers what it took and the
    /// stream ends (the leader opens a new one).
    async fn append_stream(
        &self,
        req: Request<Streaming<RaftPayload>>,
    ) -> Result<Response<AnswerStream>, Status> {
        let served: ServedQueue = Arc::default();
        let served_in = served.clone();
        let requests = futures::stream::unfold(req.into_inner(), move |mut inbound| {
            let served = served_in.clone();
            async move {
                let payload = match inbound.message().await {
                    Ok(Some(p)) => p,
                    Ok(None) => return None,
                    Err(status) => {
                        tracing::debug!(%status, "replication stream from the leader broke");
                        return None;
                    }
                };
                let received_ns = stage::now_ns();
                match serde_json::from_slice::<AppendEntriesRequest<TypeConfig>>(&payload.json) {
                    Ok(rpc) => {
                        let last_index = rpc.entries.last().map(|e| e.log_id.index);
                        served.lock().unwrap_or_else(|p| p.into_inner()).push_back((
                            last_index,
                            received_ns,
                            stage::now_ns(),
                        ));
                        Some((rpc, inbound))
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "undecodable AppendEntries request; ending the replication stream");
                        None
                    }
                }
            }
        });
        let answers = self.node.raft.stream_append(requests).map(move |result| {
            let raft_done_ns = stage::now_ns();
            let reply = serde_json::to_vec(&result)
                .map(|json| RaftPayload { json })
                .map_err(|e| Status::internal(format!("cannot encode a replication answer: {e}")));
            let taken = served.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
            if let Some((last_index, received_ns, decoded_ns)) = taken {
                trace_served(last_index, received_ns, decoded_ns, raft_done_ns);
            }
            reply
        });
        Ok(Response::new(Box::pin(answers)))
    }

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
        trace_served(last_index, received_ns, decoded_ns, raft_done_ns);
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
