//! openraft's network over tonic: one lazily connected gRPC channel per peer; requests
//! and results travel as serde_json inside `RaftPayload`.

use std::future::Future;
use std::time::Duration;

use cumulus_proto::v1::raft_service_client::RaftServiceClient;
use cumulus_proto::v1::{RaftPayload, SnapshotChunk};
use cumulus_raft_store::{CumulusNode, NodeId, Snapshot, SnapshotData, TypeConfig, Vote, stage};
use openraft::error::{
    Fatal, NetworkError, RPCError, RaftError, ReplicationClosed, StreamingError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetworkFactory, RaftNetworkV2};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tonic::codegen::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::auth::AddToken;

/// Largest Raft message accepted or sent, in bytes (snapshots are sent in chunks below it).
pub const MAX_RAFT_MESSAGE_BYTES: usize = 64 * 1024 * 1024;
/// Bytes of snapshot data per [`SnapshotChunk`].
pub const SNAPSHOT_CHUNK_BYTES: usize = 4 * 1024 * 1024;
/// Largest snapshot a follower accepts, in bytes (its data is held in memory).
pub const MAX_SNAPSHOT_BYTES: usize = 2 * 1024 * 1024 * 1024;

/// The first [`SnapshotChunk`]'s header: who sends the snapshot and what it covers.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct SnapshotHeader {
    /// The leader's vote.
    pub vote: Vote,
    /// The snapshot's meta.
    pub meta: cumulus_raft_store::SnapshotMeta,
}

/// Creates a [`PeerClient`] per target node.
#[derive(Clone)]
pub struct Network {
    /// Token interceptor for outgoing calls.
    pub auth: AddToken,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &CumulusNode) -> PeerClient {
        let endpoint = Endpoint::from_shared(format!("http://{}", node.grpc_addr)).map(|e| {
            e.connect_timeout(Duration::from_millis(500))
                .tcp_nodelay(true)
        });
        let client = endpoint.ok().map(|e| {
            RaftServiceClient::with_interceptor(e.connect_lazy(), self.auth.clone())
                .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES)
        });
        PeerClient {
            target,
            addr: node.grpc_addr.clone(),
            client,
        }
    }
}

/// The connection to one peer.
pub struct PeerClient {
    target: NodeId,
    addr: String,
    client: Option<RaftServiceClient<InterceptedService<Channel, AddToken>>>,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Msg(String);

enum Rpc {
    Append,
    Vote,
}

/// What failed in a call, before openraft's error types are chosen.
enum CallError {
    /// The peer cannot be reached (bad address, connection refused, unauthenticated).
    Unreachable(Msg),
    /// The call failed on the way (timeout, transport, undecodable reply).
    Network(Msg),
    /// The peer's Raft answered with a fatal error (it is shutting down or broken).
    Remote(Fatal<TypeConfig>),
}

impl CallError {
    fn into_rpc(self) -> RPCError<TypeConfig> {
        match self {
            CallError::Unreachable(m) => RPCError::Unreachable(Unreachable::new(&m)),
            CallError::Network(m) => RPCError::Network(NetworkError::new(&m)),
            CallError::Remote(f) => RPCError::Unreachable(Unreachable::new(&f)),
        }
    }

    fn into_streaming(self) -> StreamingError<TypeConfig> {
        match self {
            CallError::Unreachable(m) => StreamingError::Unreachable(Unreachable::new(&m)),
            CallError::Network(m) => StreamingError::Network(NetworkError::new(&m)),
            CallError::Remote(f) => StreamingError::Unreachable(Unreachable::new(&f)),
        }
    }
}

impl PeerClient {
    fn client(
        &mut self,
    ) -> Result<&mut RaftServiceClient<InterceptedService<Channel, AddToken>>, CallError> {
        match self.client.as_mut() {
            Some(c) => Ok(c),
            None => Err(CallError::Unreachable(Msg(format!(
                "bad peer address {}",
                self.addr
            )))),
        }
    }

    fn status_error(&self, status: &tonic::Status) -> CallError {
        let err = Msg(format!("peer {} at {}: {status}", self.target, self.addr));
        match status.code() {
            tonic::Code::Unavailable | tonic::Code::Unauthenticated => CallError::Unreachable(err),
            _ => CallError::Network(err),
        }
    }

    /// Decodes a peer's `Result<Resp, E>` reply.
    fn decode_reply<Resp, E>(
        &self,
        reply: &RaftPayload,
        to_fatal: fn(E) -> Fatal<TypeConfig>,
    ) -> Result<Resp, CallError>
    where
        Resp: DeserializeOwned,
        E: DeserializeOwned,
    {
        let decoded: Result<Resp, E> = serde_json::from_slice(&reply.json).map_err(|e| {
            CallError::Network(Msg(format!(
                "peer {} sent an undecodable reply: {e}",
                self.target
            )))
        })?;
        decoded.map_err(|e| CallError::Remote(to_fatal(e)))
    }

    /// One unary call: `req` as JSON out, `Result<Resp, RaftError>` as JSON back.
    async fn call<Req, Resp>(
        &mut self,
        rpc: Rpc,
        req: &Req,
        option: &RPCOption,
    ) -> Result<Resp, CallError>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
    {
        let json = serde_json::to_vec(req)
            .map_err(|e| CallError::Network(Msg(format!("cannot encode a raft request: {e}"))))?;
        let mut request = tonic::Request::new(RaftPayload { json });
        request.set_timeout(option.hard_ttl());
        let client = self.client()?;
        let result = match rpc {
            Rpc::Append => client.append_entries(request).await,
            Rpc::Vote => client.vote(request).await,
        };
        match result {
            Ok(r) => {
                self.decode_reply::<Resp, RaftError<TypeConfig>>(&r.into_inner(), |e| match e {
                    RaftError::Fatal(f) => f,
                    RaftError::APIError(never) => match never {},
                })
            }
            Err(status) => Err(self.status_error(&status)),
        }
    }

    /// Streams `snapshot` to the peer in [`SnapshotChunk`]s.
    async fn send_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot,
        option: &RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, CallError> {
        let header_json = serde_json::to_vec(&SnapshotHeader {
            vote,
            meta: snapshot.meta,
        })
        .map_err(|e| CallError::Network(Msg(format!("cannot encode a snapshot header: {e}"))))?;
        let data = snapshot.snapshot.into_inner();
        let mut chunks: Vec<SnapshotChunk> = data
            .chunks(SNAPSHOT_CHUNK_BYTES)
            .map(|piece| SnapshotChunk {
                header_json: Vec::new(),
                data: piece.to_vec(),
            })
            .collect();
        match chunks.first_mut() {
            Some(first) => first.header_json = header_json,
            None => chunks.push(SnapshotChunk {
                header_json,
                data: Vec::new(),
            }),
        }
        let mut request = tonic::Request::new(futures::stream::iter(chunks));
        request.set_timeout(option.hard_ttl());
        let result = self.client()?.install_snapshot(request).await;
        match result {
            Ok(r) => self.decode_reply::<SnapshotResponse<TypeConfig>, Fatal<TypeConfig>>(
                &r.into_inner(),
                |f| f,
            ),
            Err(status) => Err(self.status_error(&status)),
        }
    }
}

impl RaftNetworkV2<TypeConfig> for PeerClient {
    type SnapshotData = SnapshotData;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        let start_ns = stage::now_ns();
        let last_index = rpc.entries.last().map(|e| e.log_id.index);
        let result = self
            .call(Rpc::Append, &rpc, &option)
            .await
            .map_err(CallError::into_rpc);
        if let Some(last_index) = last_index {
            tracing::trace!(
                target: stage::TARGET,
                stage = "replicate",
                last_index,
                target = self.target,
                start_ns,
                end_ns = stage::now_ns(),
            );
        }
        result
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(Rpc::Vote, &rpc, &option)
            .await
            .map_err(CallError::into_rpc)
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot,
        cancel: impl Future<Output = ReplicationClosed> + Send + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        tokio::select! {
            closed = cancel => Err(StreamingError::Closed(closed)),
            sent = self.send_snapshot(vote, snapshot, &option) => {
                sent.map_err(CallError::into_streaming)
            }
        }
    }
}
