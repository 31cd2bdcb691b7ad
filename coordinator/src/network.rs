//! openraft's network over tonic: one lazily connected gRPC channel per peer; requests
//! and results travel as serde_json inside `RaftPayload`.

use std::time::Duration;

use cumulus_proto::v1::RaftPayload;
use cumulus_proto::v1::raft_service_client::RaftServiceClient;
use cumulus_raft_store::{CumulusNode, NodeId, TypeConfig, stage};
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tonic::codegen::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::auth::AddToken;

/// Largest Raft message accepted or sent, in bytes (snapshots are sent in chunks below it).
pub const MAX_RAFT_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

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
    Snapshot,
}

impl PeerClient {
    async fn call<Req, Resp, E>(
        &mut self,
        rpc: Rpc,
        req: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<NodeId, CumulusNode, RaftError<NodeId, E>>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let Some(client) = self.client.as_mut() else {
            return Err(RPCError::Unreachable(Unreachable::new(&Msg(format!(
                "bad peer address {}",
                self.addr
            )))));
        };
        let json = serde_json::to_vec(req).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let mut request = tonic::Request::new(RaftPayload { json });
        request.set_timeout(option.hard_ttl());
        let result = match rpc {
            Rpc::Append => client.append_entries(request).await,
            Rpc::Vote => client.vote(request).await,
            Rpc::Snapshot => client.install_snapshot(request).await,
        };
        let reply = match result {
            Ok(r) => r.into_inner(),
            Err(status) => {
                let err = Msg(format!("peer {} at {}: {status}", self.target, self.addr));
                return Err(match status.code() {
                    tonic::Code::Unavailable | tonic::Code::Unauthenticated => {
                        RPCError::Unreachable(Unreachable::new(&err))
                    }
                    _ => RPCError::Network(NetworkError::new(&err)),
                });
            }
        };
        let decoded: Result<Resp, RaftError<NodeId, E>> = serde_json::from_slice(&reply.json)
            .map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        decoded.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<TypeConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, CumulusNode, RaftError<NodeId>>>
    {
        let start_ns = stage::now_ns();
        let last_index = rpc.entries.last().map(|e| e.log_id.index);
        let result = self.call(Rpc::Append, &rpc, &option).await;
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

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, CumulusNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        self.call(Rpc::Snapshot, &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, CumulusNode, RaftError<NodeId>>> {
        self.call(Rpc::Vote, &rpc, &option).await
    }
}
