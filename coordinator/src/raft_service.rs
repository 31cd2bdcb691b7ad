//! The gRPC `RaftService`: peers' Raft RPCs, decoded and handed to openraft.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use cumulus_api::v1::raft_service_server::RaftService;
use cumulus_api::v1::{RaftPayload, SnapshotChunk};
use cumulus_raft_store::{Snapshot, TypeConfig, Vote, codec, stage};
use futures::{Stream, StreamExt};
use openraft::async_runtime::watch::WatchReceiver;
use openraft::error::Fatal;
use openraft::raft::{AppendEntriesRequest, SnapshotResponse, VoteRequest};
use serde::Serialize;
use tonic::{Request, Response, Status, Streaming};

use crate::blobs;
use crate::network::{MAX_SNAPSHOT_BYTES, SnapshotHeader, off_runtime_if};
use crate::node::Node;
use crate::terms::{TermSource, check_term, strip_transfer};

/// Replication requests larger than this many bytes of JSON are decoded on the blocking
/// pool (a request carries up to
/// [`REPLICATION_BATCH_BYTES`](cumulus_raft_store::store::REPLICATION_BATCH_BYTES)).
pub const DECODE_INLINE_MAX_BYTES: usize = 1 << 20;

/// Serves Raft RPCs for one node.
pub struct RaftSvc {
    /// This coordinator's shared context (Raft handle, applied state, peers).
    pub node: Arc<Node>,
    /// One permit: snapshots are received one at a time (each may hold up to
    /// [`MAX_SNAPSHOT_BYTES`] in memory).
    pub snapshot_slot: tokio::sync::Semaphore,
    /// The members of the cluster this node was started to bootstrap with (`--peer`);
    /// empty for a node that joins an existing cluster ([`check_sender`]).
    pub initial_members: Vec<cumulus_raft_store::NodeId>,
}

impl RaftSvc {
    /// The service of `node`, receiving no snapshot yet.
    pub fn new(node: Arc<Node>, initial_members: Vec<cumulus_raft_store::NodeId>) -> Self {
        RaftSvc {
            node,
            snapshot_slot: tokio::sync::Semaphore::new(1),
            initial_members,
        }
    }
}

/// The answer to a snapshot whose sender's `vote` this node's `current` vote has passed
/// (`!(vote >= current)`, openraft's own rule for accepting a vote: votes are only
/// partially ordered), or `None` when openraft must decide. `current` may lag the node's
/// vote but never leads it, and votes only grow, so a snapshot refused here would be
/// refused by openraft too.
pub fn stale_snapshot_reply(vote: &Vote, current: &Vote) -> Option<SnapshotResponse<TypeConfig>> {
    if vote >= current {
        None
    } else {
        Some(SnapshotResponse::new(*current))
    }
}

/// An empty buffer with room for a snapshot of the announced size (`data_bytes`, absent
/// from senders that predate it), refused when it exceeds [`MAX_SNAPSHOT_BYTES`].
///
/// # Errors
/// `resource_exhausted` for an announced size over the limit or one the allocator
/// refuses.
pub fn snapshot_buffer(data_bytes: Option<u64>) -> Result<Vec<u8>, Status> {
    match data_bytes {
        None => Ok(Vec::new()),
        Some(n) if n > MAX_SNAPSHOT_BYTES as u64 => Err(Status::resource_exhausted(format!(
            "a snapshot of {n} bytes is larger than this node accepts ({MAX_SNAPSHOT_BYTES} bytes)"
        ))),
        Some(n) => {
            let mut data = Vec::new();
            data.try_reserve_exact(n as usize).map_err(|e| {
                Status::resource_exhausted(format!("cannot allocate {n} bytes for a snapshot: {e}"))
            })?;
            Ok(data)
        }
    }
}

/// A Raft RPC, as [`check_sender`] tells them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RaftRpc {
    /// A candidate asks for this node's vote.
    Vote,
    /// A candidate asks whether this node would vote for it (nothing is persisted).
    PreVote,
    /// A leader appends entries (or sends a heartbeat).
    Append,
    /// A leader installs a snapshot.
    Snapshot,
}

impl RaftRpc {
    fn as_str(self) -> &'static str {
        match self {
            RaftRpc::Vote => "vote",
            RaftRpc::PreVote => "pre-vote",
            RaftRpc::Append => "append",
            RaftRpc::Snapshot => "snapshot",
        }
    }
}

/// Checks the sender of a Raft request (the `vote` it carries: a candidate's, or a
/// leader's for an append or a snapshot). Its term must pass [`check_term`] against this
/// node's term `own_term` (a candidate's at most [`MAX_TERM_STEP`](crate::terms::MAX_TERM_STEP)
/// above it; none above [`MAX_RAFT_TERM`](crate::terms::MAX_RAFT_TERM)),
/// and its node id a member (voter or learner) of this node's membership `members`.
/// While that is empty (a pristine node that has received no entry yet), the cluster's
/// initial members, `initial_members` (the `--peer` list it bootstraps with), stand in:
/// its pristine nodes must vote for the first leader, one of them. A node that joins an
/// existing cluster (`--join`, `--rejoin-empty`: no initial members) votes for no one
/// until it is added, and takes entries and snapshots from any authenticated peer (it
/// hears first from the leader that adds it, whoever that is).
///
/// # Errors
/// `permission_denied` naming the node id or term refused; the refusal is logged.
pub fn check_sender(
    rpc: RaftRpc,
    vote: &Vote,
    own_term: u64,
    members: &[cumulus_raft_store::NodeId],
    initial_members: &[cumulus_raft_store::NodeId],
) -> Result<(), Status> {
    let what = rpc.as_str();
    let term = vote.leader_id.term;
    let sender = vote.leader_id.node_id;
    let source = match rpc {
        RaftRpc::Vote | RaftRpc::PreVote => TermSource::Candidate,
        RaftRpc::Append | RaftRpc::Snapshot => TermSource::Leader,
    };
    if let Err(refusal) = check_term(source, term, own_term) {
        tracing::warn!(
            sender,
            term,
            own_term,
            %refusal,
            "refused a raft {what} (its term is not persisted)"
        );
        return Err(Status::permission_denied(format!(
            "a raft {what} from node {sender} is refused: {refusal}"
        )));
    }
    let allowed = match (members.is_empty(), initial_members.is_empty(), rpc) {
        (false, _, _) => members,
        (true, false, _) => initial_members,
        (true, true, RaftRpc::Vote | RaftRpc::PreVote) => initial_members,
        (true, true, RaftRpc::Append | RaftRpc::Snapshot) => return Ok(()),
    };
    if !allowed.contains(&sender) {
        tracing::warn!(
            sender,
            term,
            ?allowed,
            "refused a raft {what} from a node that is not a member"
        );
        return Err(Status::permission_denied(format!(
            "a raft {what} from node {sender} is refused: it is not a member of this cluster"
        )));
    }
    Ok(())
}

/// The coordinator a Raft request's connection proved to be: the node id its verified
/// client certificate names (`None`: plaintext, no certificate, or not a coordinator's).
fn peer_node_id<T>(req: &Request<T>) -> Option<cumulus_raft_store::NodeId> {
    match req
        .extensions()
        .get::<cumulus_listen::ConnInfo>()?
        .peer_identity()?
    {
        cumulus_tls::Identity::Coordinator(id) => Some(id),
        _ => None,
    }
}

/// With TLS on, a Raft request must come on a connection whose certificate names the
/// coordinator that sends it (`sender`, from the request's vote): another member's
/// certificate, a worker's, a user's or none is refused, so the peer token alone can no
/// longer speak for a node.
///
/// # Errors
/// `permission_denied` naming both ids; the refusal is logged.
pub fn check_peer_certificate(
    tls: bool,
    rpc: RaftRpc,
    certified: Option<cumulus_raft_store::NodeId>,
    sender: cumulus_raft_store::NodeId,
) -> Result<(), Status> {
    if !tls || certified == Some(sender) {
        return Ok(());
    }
    let what = rpc.as_str();
    tracing::warn!(
        sender,
        ?certified,
        "refused a raft {what} whose connection's certificate does not name its sender"
    );
    Err(Status::permission_denied(match certified {
        Some(id) => format!(
            "a raft {what} from node {sender} is refused: the connection's certificate names coordinator {id}"
        ),
        None => format!(
            "a raft {what} from node {sender} is refused: the connection presents no coordinator certificate"
        ),
    }))
}

impl RaftSvc {
    /// This node's current term, as its metrics last showed it (never ahead of it).
    fn own_term(&self) -> u64 {
        self.node
            .raft
            .metrics()
            .borrow_watched()
            .vote
            .leader_id
            .term
    }

    /// [`check_sender`] and [`check_peer_certificate`] for a candidate's request.
    fn check_candidate(
        &self,
        rpc: RaftRpc,
        req: &VoteRequest<TypeConfig>,
        certified: Option<cumulus_raft_store::NodeId>,
    ) -> Result<(), Status> {
        check_sender(
            rpc,
            &req.vote,
            self.own_term(),
            &self.members(),
            &self.initial_members,
        )?;
        check_peer_certificate(self.node.tls, rpc, certified, req.vote.leader_id.node_id)
    }

    /// Node ids of this node's current membership config (voters and learners).
    fn members(&self) -> Vec<cumulus_raft_store::NodeId> {
        self.node
            .raft
            .metrics()
            .borrow_watched()
            .membership_config
            .nodes()
            .map(|(id, _)| *id)
            .collect()
    }
}

fn decode<T: serde::de::DeserializeOwned>(req: Request<RaftPayload>) -> Result<T, Status> {
    codec::decode(&req.into_inner().body)
        .map_err(|e| Status::invalid_argument(format!("undecodable raft payload: {e}")))
}

fn encode<T: Serialize>(value: &T) -> Result<Response<RaftPayload>, Status> {
    codec::encode(value)
        .map(|body| Response::new(RaftPayload { body }))
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
        let metrics = self.node.raft.metrics();
        let initial = self.initial_members.clone();
        let (tls, certified) = (self.node.tls, peer_node_id(&req));
        let blobs = self.node.blobs.clone();
        let requests = futures::stream::unfold(req.into_inner(), move |mut inbound| {
            let served = served_in.clone();
            let metrics = metrics.clone();
            let initial = initial.clone();
            let blobs = blobs.clone();
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
                // A large request is decoded off the runtime threads, which also run
                // heartbeats and elections.
                let large = payload.body.len() > DECODE_INLINE_MAX_BYTES;
                let decoded = off_runtime_if(large, move || {
                    codec::decode::<AppendEntriesRequest<TypeConfig>>(&payload.body)
                })
                .await;
                match decoded {
                    Ok(rpc) => {
                        let (members, own_term): (Vec<_>, u64) = {
                            let m = metrics.borrow_watched();
                            let members = m.membership_config.nodes().map(|(id, _)| *id).collect();
                            (members, m.vote.leader_id.term)
                        };
                        if check_sender(RaftRpc::Append, &rpc.vote, own_term, &members, &initial)
                            .is_err()
                            || check_peer_certificate(
                                tls,
                                RaftRpc::Append,
                                certified,
                                rpc.vote.leader_id.node_id,
                            )
                            .is_err()
                        {
                            return None;
                        }
                        if rpc.vote.leader_id.term >= own_term {
                            blobs.note_leader_commit(rpc.leader_commit.map(|l| l.index));
                        }
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
            let reply = codec::encode(&result)
                .map(|body| RaftPayload { body })
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
        let certified = peer_node_id(&req);
        let rpc: AppendEntriesRequest<TypeConfig> = decode(req)?;
        check_sender(
            RaftRpc::Append,
            &rpc.vote,
            self.own_term(),
            &self.members(),
            &self.initial_members,
        )?;
        check_peer_certificate(
            self.node.tls,
            RaftRpc::Append,
            certified,
            rpc.vote.leader_id.node_id,
        )?;
        if rpc.vote.leader_id.term >= self.own_term() {
            self.node
                .blobs
                .note_leader_commit(rpc.leader_commit.map(|l| l.index));
        }
        let last_index = rpc.entries.last().map(|e| e.log_id.index);
        let decoded_ns = stage::now_ns();
        let result = self.node.raft.append_entries(rpc).await;
        let raft_done_ns = stage::now_ns();
        let reply = encode(&result);
        trace_served(last_index, received_ns, decoded_ns, raft_done_ns);
        reply
    }

    /// A candidate's vote request. A `leadership_transfer` flag is cleared first
    /// ([`strip_transfer`]): no coordinator starts a transfer, and a forged one would skip
    /// the leader lease.
    async fn vote(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let certified = peer_node_id(&req);
        let rpc: VoteRequest<TypeConfig> = decode(req)?;
        self.check_candidate(RaftRpc::Vote, &rpc, certified)?;
        encode(&self.node.raft.vote(strip_transfer(rpc)).await)
    }

    /// A candidate's pre-vote: whether this node would grant the vote; nothing is
    /// persisted and the term does not change.
    async fn pre_vote(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let certified = peer_node_id(&req);
        let rpc: VoteRequest<TypeConfig> = decode(req)?;
        self.check_candidate(RaftRpc::PreVote, &rpc, certified)?;
        encode(&self.node.raft.pre_vote(strip_transfer(rpc)).await)
    }

    /// Receives a snapshot in chunks (the first carries the header), bounded by
    /// [`MAX_SNAPSHOT_BYTES`], and installs it. One snapshot is received at a time (a
    /// second stream gets `resource_exhausted`; the leader retries). A header whose vote
    /// this node has already passed is answered at once with this node's vote, before
    /// the data arrives, as openraft would answer it after: a deposed leader learns it is
    /// stale without the follower buffering its snapshot.
    async fn install_snapshot(
        &self,
        req: Request<Streaming<SnapshotChunk>>,
    ) -> Result<Response<RaftPayload>, Status> {
        let Ok(_receiving) = self.snapshot_slot.try_acquire() else {
            return Err(Status::resource_exhausted(
                "another snapshot is being received; retry when it is installed",
            ));
        };
        let certified = peer_node_id(&req);
        let mut chunks = req.into_inner();
        let Some(first) = chunks.message().await? else {
            return Err(Status::invalid_argument("an empty snapshot stream"));
        };
        if first.header_json.is_empty() {
            return Err(Status::invalid_argument(
                "a snapshot stream must start with its header",
            ));
        }
        let header: SnapshotHeader = serde_json::from_slice(&first.header_json)
            .map_err(|e| Status::invalid_argument(format!("undecodable snapshot header: {e}")))?;
        check_sender(
            RaftRpc::Snapshot,
            &header.vote,
            self.own_term(),
            &self.members(),
            &self.initial_members,
        )?;
        check_peer_certificate(
            self.node.tls,
            RaftRpc::Snapshot,
            certified,
            header.vote.leader_id.node_id,
        )?;
        let current = self.node.raft.metrics().borrow_watched().vote;
        if let Some(reply) = stale_snapshot_reply(&header.vote, &current) {
            tracing::info!(
                sender_vote = %header.vote,
                vote = %current,
                "refused a snapshot from a leader this node's vote has passed"
            );
            return encode(&Ok::<_, Fatal<TypeConfig>>(reply));
        }
        let mut data = snapshot_buffer(header.data_bytes)?;
        let mut chunk = first;
        loop {
            if data.len().saturating_add(chunk.data.len()) > MAX_SNAPSHOT_BYTES {
                return Err(Status::resource_exhausted(format!(
                    "snapshot larger than {MAX_SNAPSHOT_BYTES} bytes"
                )));
            }
            data.extend_from_slice(&chunk.data);
            chunk = match chunks.message().await? {
                Some(next) if next.header_json.is_empty() => next,
                Some(_) => {
                    return Err(Status::invalid_argument(
                        "a snapshot stream carries its header twice",
                    ));
                }
                None => break,
            };
        }
        if let Some(announced) = header.data_bytes
            && announced != data.len() as u64
        {
            return Err(Status::invalid_argument(format!(
                "the snapshot header announced {announced} bytes, the stream carried {}",
                data.len()
            )));
        }
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

    type FetchBlobStream =
        Pin<Box<dyn Stream<Item = Result<cumulus_api::v1::BlobChunk, Status>> + Send + 'static>>;

    /// A peer's replica of a blob it stored (the first chunk names it): stored here only
    /// (never replicated on), verified and fsynced before the answer.
    async fn replicate_blob(
        &self,
        req: Request<Streaming<cumulus_api::v1::BlobChunk>>,
    ) -> Result<Response<cumulus_api::v1::PutBlobResponse>, Status> {
        self.check_blob_peer(peer_node_id(&req))?;
        let md = req.metadata().clone();
        let (header, chunks) = blobs::peers::from_chunks(req.into_inner()).await?;
        let meta = blobs::peers::provenance_from(&md, header.size_bytes);
        let stored = self
            .node
            .blobs
            .receive_replica(header.clone(), meta, chunks)
            .await?;
        Ok(Response::new(cumulus_api::v1::PutBlobResponse {
            digest: header.digest,
            size_bytes: stored.size_bytes,
            replicas: 1,
        }))
    }

    /// A blob this node holds, for a peer that lacks it (NOT_FOUND when it lacks it too:
    /// never asked of another peer); its uploader and time in the answer's metadata.
    async fn fetch_blob(
        &self,
        req: Request<cumulus_api::v1::GetBlobRequest>,
    ) -> Result<Response<Self::FetchBlobStream>, Status> {
        self.check_blob_peer(peer_node_id(&req))?;
        let digest = req.into_inner().digest;
        let (meta, read) = self.node.blobs.open_local(&digest).await?;
        let header = blobs::BlobHeader {
            digest,
            size_bytes: meta.size_bytes,
        };
        let mut response: Response<Self::FetchBlobStream> =
            Response::new(Box::pin(blobs::peers::download_chunks(header, read.chunks)));
        blobs::peers::provenance_into(response.metadata_mut(), &meta);
        Ok(response)
    }
}

impl RaftSvc {
    /// A blob call between coordinators: the peer token (checked by the interceptor)
    /// and, with TLS, a connection whose certificate names a member (the initial members
    /// while this node knows no membership).
    ///
    /// # Errors
    /// `permission_denied` naming what is missing; the refusal is logged.
    fn check_blob_peer(&self, certified: Option<cumulus_raft_store::NodeId>) -> Result<(), Status> {
        if !self.node.tls {
            return Ok(());
        }
        let Some(id) = certified else {
            tracing::warn!(
                "refused a blob call whose connection presents no coordinator certificate"
            );
            return Err(Status::permission_denied(
                "a blob call between coordinators needs a coordinator certificate",
            ));
        };
        let members = self.members();
        let allowed = if members.is_empty() {
            &self.initial_members
        } else {
            &members
        };
        if allowed.contains(&id) {
            Ok(())
        } else {
            tracing::warn!(
                sender = id,
                "refused a blob call from a coordinator that is not a member"
            );
            Err(Status::permission_denied(format!(
                "coordinator {id} is not a member of this cluster"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::terms::{MAX_RAFT_TERM, MAX_TERM_STEP};

    #[test]
    fn a_snapshot_from_a_passed_vote_is_answered_with_the_current_vote() {
        let current = Vote::new_committed(5, 2);
        assert_eq!(
            stale_snapshot_reply(&Vote::new_committed(4, 2), &current).map(|r| r.vote),
            Some(current)
        );
        assert_eq!(
            stale_snapshot_reply(&Vote::new(4, 3), &current).map(|r| r.vote),
            Some(current)
        );
        // Equal or later votes are openraft's to decide.
        assert!(stale_snapshot_reply(&current, &current).is_none());
        assert!(stale_snapshot_reply(&Vote::new_committed(6, 1), &current).is_none());
        assert!(stale_snapshot_reply(&Vote::new(6, 1), &current).is_none());
    }

    #[test]
    fn a_sender_outside_the_membership_or_with_an_absurd_term_is_refused() {
        use RaftRpc::{Append, Snapshot, Vote as V};
        let members = [1, 2, 3];
        assert!(check_peer_certificate(true, V, Some(2), 2).is_ok());
        assert!(
            check_peer_certificate(false, V, None, 2).is_ok(),
            "--insecure"
        );
        assert!(
            check_peer_certificate(true, V, Some(3), 2).is_err(),
            "another member's"
        );
        assert!(
            check_peer_certificate(true, V, None, 2).is_err(),
            "no certificate"
        );
        assert!(check_sender(V, &Vote::new(7, 2), 0, &members, &[]).is_ok());
        assert!(
            check_sender(
                Append,
                &Vote::new_committed(MAX_RAFT_TERM, 3),
                0,
                &members,
                &[]
            )
            .is_ok()
        );
        let outsider =
            check_sender(V, &Vote::new(7, 9), 0, &members, &[]).expect_err("not a member");
        assert_eq!(outsider.code(), tonic::Code::PermissionDenied);
        assert!(
            outsider.message().contains("node 9"),
            "{}",
            outsider.message()
        );
        assert!(check_sender(Snapshot, &Vote::new_committed(7, 9), 0, &members, &[]).is_err());
        let absurd = check_sender(V, &Vote::new(u64::MAX, 2), 0, &members, &[]).expect_err("term");
        assert_eq!(absurd.code(), tonic::Code::PermissionDenied);
        assert!(check_sender(V, &Vote::new(MAX_RAFT_TERM + 1, 2), 0, &members, &[]).is_err());
        // A candidate may lead this node's term by at most MAX_TERM_STEP; a vote at the
        // bound itself, which once left every later election above it, is refused.
        let far = check_sender(V, &Vote::new(MAX_RAFT_TERM, 2), 3, &members, &[])
            .expect_err("at the bound, from term 3");
        assert_eq!(far.code(), tonic::Code::PermissionDenied);
        assert!(far.message().contains("term 3"), "{}", far.message());
        assert!(check_sender(V, &Vote::new(3 + MAX_TERM_STEP, 2), 3, &members, &[]).is_ok());
        assert!(
            check_sender(
                RaftRpc::PreVote,
                &Vote::new(4 + MAX_TERM_STEP, 2),
                3,
                &members,
                &[]
            )
            .is_err()
        );
    }

    #[test]
    fn a_pristine_node_votes_only_for_initial_members_but_hears_any_leader() {
        use RaftRpc::{Append, Snapshot, Vote as V};
        // Bootstrapping: the first leader needs the pristine nodes' votes, and is one of
        // the initial members.
        assert!(check_sender(V, &Vote::new(1, 1), 0, &[], &[1, 2, 3]).is_ok());
        assert!(check_sender(V, &Vote::new(2, 9), 0, &[], &[1, 2, 3]).is_err());
        assert!(check_sender(Append, &Vote::new_committed(1, 1), 0, &[], &[1, 2, 3]).is_ok());
        assert!(check_sender(Append, &Vote::new_committed(2, 9), 0, &[], &[1, 2, 3]).is_err());
        // A joining node votes for no one until it is added.
        assert!(check_sender(V, &Vote::new(2, 1), 0, &[], &[]).is_err());
        // ... but takes entries and snapshots from the leader that adds it.
        assert!(check_sender(Append, &Vote::new_committed(3, 9), 0, &[], &[]).is_ok());
        assert!(check_sender(Snapshot, &Vote::new_committed(3, 9), 0, &[], &[]).is_ok());
        assert!(check_sender(Append, &Vote::new_committed(u64::MAX, 9), 0, &[], &[]).is_err());
    }

    #[test]
    fn the_announced_snapshot_size_is_checked_and_allocated_once() {
        assert_eq!(snapshot_buffer(None).expect("no size").capacity(), 0);
        assert!(snapshot_buffer(Some(1 << 20)).expect("1 MiB").capacity() >= 1 << 20);
        let err = snapshot_buffer(Some(MAX_SNAPSHOT_BYTES as u64 + 1)).expect_err("too big");
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(snapshot_buffer(Some(u64::MAX)).is_err());
    }
}
