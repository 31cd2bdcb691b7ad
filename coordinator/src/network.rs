//! openraft's network over tonic: one lazily connected gRPC channel per peer; requests
//! and results travel inside `RaftPayload`, encoded by `cumulus_raft_store::codec`
//! (MessagePack; JSON from earlier versions is still read). Also the HTTPS clients of
//! the worker agents ([`AgentHttp`]).
//!
//! With TLS, a peer is accepted only if its certificate names the coordinator expected
//! (`cumulus://coordinator/N` with N the target's node id) and an agent only if its
//! names that worker; a peer refused so is not dialled again before a backoff
//! ([`cumulus_client::Refusals`], shared by every client of that target), and the
//! call fails as unreachable.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cumulus_api::v1::raft_service_client::RaftServiceClient;
use cumulus_api::v1::{RaftPayload, SnapshotChunk};
use cumulus_client::{Refusals, TlsConnector};
use cumulus_raft_store::{
    CumulusNode, EntryPayload, NodeId, Snapshot, SnapshotData, TypeConfig, Vote, codec, stage,
};
use cumulus_tls::{Credentials, ExpectedServer};
use futures::StreamExt;
use openraft::base::{BoxFuture, BoxStream};
use openraft::error::{
    Fatal, NetworkError, RPCError, RaftError, ReplicationClosed, StreamingError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetworkFactory, RaftNetworkV2};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, StreamAppendError,
    StreamAppendResult, VoteRequest, VoteResponse,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tonic::codegen::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::auth::AddToken;
use crate::terms::{TermSource, check_term};

/// Largest Raft message accepted or sent, in bytes (snapshots are sent in chunks below it).
pub const MAX_RAFT_MESSAGE_BYTES: usize = 64 * 1024 * 1024;
/// Bytes of snapshot data per [`SnapshotChunk`].
pub const SNAPSHOT_CHUNK_BYTES: usize = 4 * 1024 * 1024;
/// Largest snapshot a follower accepts, in bytes (its data is held in memory).
pub const MAX_SNAPSHOT_BYTES: usize = 2 * 1024 * 1024 * 1024;
/// Deadline of sending a snapshot, before the allowance for its size, in milliseconds.
/// openraft offers `install_snapshot_timeout` (200 ms by default), meant for one chunk;
/// our call carries the whole snapshot and its install.
pub const SNAPSHOT_BASE_TIMEOUT_MS: u64 = 10_000;
/// Slowest transfer and install rate the snapshot deadline allows for, in bytes per
/// second (the deadline grows by one second per this many bytes).
pub const SNAPSHOT_MIN_BYTES_PER_S: u64 = 8 * 1024 * 1024;

/// Deadline of sending a snapshot of `bytes`: [`SNAPSHOT_BASE_TIMEOUT_MS`] plus one second
/// per [`SNAPSHOT_MIN_BYTES_PER_S`], and never less than openraft's `offered`.
pub fn snapshot_deadline(bytes: usize, offered: Duration) -> Duration {
    let allowance_ms = (bytes as u64).saturating_mul(1_000) / SNAPSHOT_MIN_BYTES_PER_S;
    offered.max(Duration::from_millis(
        SNAPSHOT_BASE_TIMEOUT_MS.saturating_add(allowance_ms),
    ))
}

pub use crate::terms::MAX_RAFT_TERM;

/// HTTP/2 PING interval on a peer connection, in milliseconds.
pub const KEEPALIVE_INTERVAL_MS: u64 = 1_000;
/// How long a PING may go unanswered before the connection is closed, in milliseconds.
pub const KEEPALIVE_TIMEOUT_MS: u64 = 2_000;

/// The first [`SnapshotChunk`]'s header: who sends the snapshot and what it covers.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct SnapshotHeader {
    /// The leader's vote.
    pub vote: Vote,
    /// The snapshot's meta.
    pub meta: cumulus_raft_store::SnapshotMeta,
    /// Bytes of snapshot data the stream carries, so the receiver can refuse an
    /// oversized snapshot before it arrives and allocate its buffer once. Absent from
    /// senders that predate it (rolling upgrade).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_bytes: Option<u64>,
}

/// Most encoded bytes in one replication request: [`MAX_RAFT_MESSAGE_BYTES`] less room
/// for the protobuf field's tag and length. The sizes it is checked against are JSON
/// estimates, which MessagePack never exceeds (no escapes, shorter numbers).
pub const MAX_APPEND_ENCODED_BYTES: usize = MAX_RAFT_MESSAGE_BYTES - 64;

/// Requests whose entries are estimated above this many bytes are encoded on the
/// blocking pool, not on a runtime thread that also runs heartbeats and elections.
pub const ENCODE_INLINE_MAX_BYTES: usize = 1 << 20;

/// Room for a request's fields besides its entries, in bytes.
const REQUEST_ENVELOPE_BYTES: usize = 64 * 1024;

// Every replication request fits one Raft message: the log reader gives a request at
// most `REPLICATION_BATCH_BYTES` of entries, or one entry, and the leader admits no
// entry above `MAX_ENTRY_BYTES`.
const _: () = assert!(
    cumulus_raft_store::store::REPLICATION_BATCH_BYTES
        + crate::proposer::MAX_ENTRY_BYTES
        + REQUEST_ENVELOPE_BYTES
        <= MAX_APPEND_ENCODED_BYTES
);

/// Estimated encoded bytes of an entry that carries no command (blank or membership).
const OTHER_ENTRY_BYTES: usize = 1_024;

/// Estimated JSON bytes of `req`'s entries (each command's
/// `Command::approx_encoded_bytes`), without encoding them.
pub fn approx_append_bytes(req: &AppendEntriesRequest<TypeConfig>) -> usize {
    req.entries
        .iter()
        .map(|e| match &e.payload {
            EntryPayload::Normal(cmd) => cmd.approx_encoded_bytes(),
            _ => OTHER_ENTRY_BYTES,
        })
        .sum()
}

/// Runs `f` on the blocking pool when `large`, else here: CPU work on a large payload
/// (encoding or decoding a replication request) must not hold a runtime thread, which
/// also runs heartbeats and elections; a small one is not worth two thread hand-offs.
///
/// # Errors
/// `f`'s codec error, or the blocking task's failure (a panic, or the runtime shutting
/// down).
pub async fn off_runtime_if<T: Send + 'static>(
    large: bool,
    f: impl FnOnce() -> Result<T, codec::CodecError> + Send + 'static,
) -> Result<T, CodecError> {
    if !large {
        return Ok(f()?);
    }
    Ok(tokio::task::spawn_blocking(f).await??)
}

/// Why a replication request could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The bytes do not encode or decode.
    #[error("{0}")]
    Codec(#[from] codec::CodecError),
    /// The blocking task that ran the codec failed.
    #[error("the blocking task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// The client TLS of this coordinator's outgoing gRPC (peers, `--rejoin-empty`): its
/// credentials (the cluster CA, and its own certificate for mutual TLS); `None` with
/// `--insecure`.
pub fn client_tls(tls: &cumulus_tls::Tls) -> Option<Arc<Credentials>> {
    tls.credentials().cloned()
}

/// The endpoint of a peer at `addr` ([`cumulus_client::endpoint`]), to connect with
/// [`peer_connector`] when `tls`.
///
/// # Errors
/// The address is not a valid URI.
pub fn endpoint(addr: &str, tls: bool) -> Result<Endpoint, tonic::transport::Error> {
    cumulus_client::endpoint(addr, tls)
}

/// The connector of channels to coordinator `target`: mutual TLS with `creds`, accepting
/// only a certificate that names `cumulus://coordinator/{target}`.
///
/// # Errors
/// rustls refuses the configuration (it was checked when the credentials were loaded).
pub fn peer_connector(
    creds: &Credentials,
    target: NodeId,
    refusals: Refusals,
) -> Result<TlsConnector, cumulus_tls::TlsError> {
    let config = creds.client_config(ExpectedServer::Coordinator(target))?;
    Ok(TlsConnector::new(config, refusals))
}

/// Creates a [`PeerClient`] per target node.
#[derive(Clone)]
pub struct Network {
    /// Token interceptor for outgoing calls.
    auth: AddToken,
    /// Client TLS ([`client_tls`]); `None`: plaintext.
    tls: Option<Arc<Credentials>>,
    /// Each target's connector, made once: its refusals (and their backoff) outlive the
    /// clients openraft makes and drops.
    connectors: Arc<Mutex<HashMap<NodeId, TlsConnector>>>,
}

impl Network {
    /// Clients calling with `auth`, over TLS with `tls` (`None`: plaintext).
    pub fn new(auth: AddToken, tls: Option<Arc<Credentials>>) -> Network {
        Network {
            auth,
            tls,
            connectors: Arc::default(),
        }
    }

    /// The connector of `target`'s channels; `None` without TLS.
    fn connector(&self, target: NodeId) -> Result<Option<TlsConnector>, String> {
        let Some(creds) = &self.tls else {
            return Ok(None);
        };
        let mut connectors = self.connectors.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = connectors.get(&target) {
            return Ok(Some(c.clone()));
        }
        let c = peer_connector(creds, target, Refusals::default()).map_err(|e| e.to_string())?;
        connectors.insert(target, c.clone());
        Ok(Some(c))
    }
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &CumulusNode) -> PeerClient {
        // HTTP/2 keepalive: a replication stream waits for answers without a deadline, so
        // a peer that stops answering (stopped process, dropped packets) must break the
        // connection, which ends the stream with an error.
        // Its Raft address: `--raft-listen`'s port, or the gRPC port when Raft shares it.
        let addr = node.raft_target();
        let endpoint = endpoint(addr, self.tls.is_some())
            .map(|e| {
                e.connect_timeout(Duration::from_millis(500))
                    .tcp_nodelay(true)
                    .http2_keep_alive_interval(Duration::from_millis(KEEPALIVE_INTERVAL_MS))
                    .keep_alive_timeout(Duration::from_millis(KEEPALIVE_TIMEOUT_MS))
                    .keep_alive_while_idle(true)
            })
            .map_err(|e| format!("bad peer address {addr}: {e}"));
        let connector = self.connector(target);
        let refusals = match &connector {
            Ok(Some(c)) => Some(c.refusals().clone()),
            _ => None,
        };
        let client = endpoint.and_then(|e| {
            let channel = cumulus_client::connect_lazy(&e, connector?);
            Ok(
                RaftServiceClient::with_interceptor(channel, self.auth.clone())
                    .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES),
            )
        });
        PeerClient {
            target,
            addr: addr.to_string(),
            client,
            refusals,
        }
    }
}

/// The connection to one peer.
pub struct PeerClient {
    target: NodeId,
    addr: String,
    /// The client, or why there is none (a bad address).
    client: Result<RaftServiceClient<InterceptedService<Channel, AddToken>>, String>,
    /// The refusals of the target's certificate (with TLS).
    refusals: Option<Refusals>,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Msg(String);

enum Rpc {
    Append,
    Vote,
    PreVote,
}

/// What failed in a call, before openraft's error types are chosen.
enum CallError {
    /// The peer cannot be reached (bad address, connection refused, unauthenticated).
    Unreachable(Msg),
    /// The call failed on the way (timeout, transport, undecodable reply).
    Network(Msg),
    /// The peer's Raft answered with a fatal error (it is shutting down or broken).
    Remote(Fatal<TypeConfig>),
    /// The peer serves no such RPC (a version before it).
    Unimplemented(Msg),
}

impl CallError {
    fn into_rpc(self) -> RPCError<TypeConfig> {
        match self {
            CallError::Unreachable(m) => RPCError::Unreachable(Unreachable::new(&m)),
            CallError::Network(m) | CallError::Unimplemented(m) => {
                RPCError::Network(NetworkError::new(&m))
            }
            CallError::Remote(f) => RPCError::Unreachable(Unreachable::new(&f)),
        }
    }

    fn into_streaming(self) -> StreamingError<TypeConfig> {
        match self {
            CallError::Unreachable(m) => StreamingError::Unreachable(Unreachable::new(&m)),
            CallError::Network(m) | CallError::Unimplemented(m) => {
                StreamingError::Network(NetworkError::new(&m))
            }
            CallError::Remote(f) => StreamingError::Unreachable(Unreachable::new(&f)),
        }
    }
}

/// Refuses a peer's answer that carries a vote of a term above [`MAX_RAFT_TERM`]
/// ([`check_term`], [`TermSource::Answer`]): openraft would adopt it (and persist it) and
/// overflow the term at the next election.
fn check_answer_vote(target: NodeId, vote: &Vote) -> Result<(), CallError> {
    let term = vote.leader_id.term;
    check_term(TermSource::Answer, term, term).map_err(|refusal| {
        tracing::warn!(
            target,
            term,
            "refused a peer's answer carrying an absurd term (not adopted)"
        );
        CallError::Network(Msg(format!("peer {target} answered: {refusal}")))
    })
}

/// A failed call's status: unreachable when the peer cannot be reached or refuses our
/// token, a network error otherwise.
fn status_error(target: NodeId, addr: &str, status: &tonic::Status) -> CallError {
    let err = Msg(format!("peer {target} at {addr}: {status}"));
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Unauthenticated => CallError::Unreachable(err),
        tonic::Code::Unimplemented => CallError::Unimplemented(err),
        _ => CallError::Network(err),
    }
}

impl PeerClient {
    fn client(
        &mut self,
    ) -> Result<&mut RaftServiceClient<InterceptedService<Channel, AddToken>>, CallError> {
        match self.client.as_mut() {
            Ok(c) => Ok(c),
            Err(why) => Err(CallError::Unreachable(Msg(why.clone()))),
        }
    }

    fn status_error(&self, status: &tonic::Status) -> CallError {
        status_error(self.target, &self.addr, status)
    }

    /// Waits, at most `limit`, while the target is not dialled after its certificate was
    /// refused. openraft opens the next replication stream as soon as one fails: failing
    /// at once would spin (its own backoff delays only the requests of an open stream).
    async fn wait_out_refusal(&self, limit: Duration) {
        if let Some(left) = self.refusals.as_ref().and_then(Refusals::backoff_left) {
            tokio::time::sleep(left.min(limit)).await;
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
        let decoded: Result<Resp, E> = codec::decode(&reply.body).map_err(|e| {
            CallError::Network(Msg(format!(
                "peer {} sent an undecodable reply: {e}",
                self.target
            )))
        })?;
        decoded.map_err(|e| CallError::Remote(to_fatal(e)))
    }

    /// One unary call: `req` out, `Result<Resp, RaftError>` back ([`codec`]).
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
        let body = codec::encode(req)
            .map_err(|e| CallError::Network(Msg(format!("cannot encode a raft request: {e}"))))?;
        self.wait_out_refusal(option.hard_ttl()).await;
        let mut request = tonic::Request::new(RaftPayload { body });
        request.set_timeout(option.hard_ttl());
        let client = self.client()?;
        let result = match rpc {
            Rpc::Append => client.append_entries(request).await,
            Rpc::Vote => client.vote(request).await,
            Rpc::PreVote => client.pre_vote(request).await,
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
        let data = snapshot.snapshot.into_inner();
        if data.len() > MAX_SNAPSHOT_BYTES {
            // Sending it would move up to 2 GiB only to be refused, on every retry.
            let err = Msg(format!(
                "peer {}: the snapshot up to index {:?} is {} bytes, more than a follower \
                 accepts ({MAX_SNAPSHOT_BYTES} bytes); it cannot catch up by snapshot",
                self.target,
                snapshot.meta.last_log_id.map(|l| l.index),
                data.len()
            ));
            tracing::error!(%err, "not sending an oversized snapshot");
            return Err(CallError::Network(err));
        }
        let header_json = serde_json::to_vec(&SnapshotHeader {
            vote,
            meta: snapshot.meta,
            data_bytes: Some(data.len() as u64),
        })
        .map_err(|e| CallError::Network(Msg(format!("cannot encode a snapshot header: {e}"))))?;
        let deadline = snapshot_deadline(data.len(), option.hard_ttl());
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
        self.wait_out_refusal(deadline).await;
        let mut request = tonic::Request::new(futures::stream::iter(chunks));
        request.set_timeout(deadline);
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

/// How long a replication request that carries no entries, only a newer commit index, is
/// held back for the next request on the same stream ([`coalesce_commit_only`]), in
/// milliseconds. Bounds how much later than otherwise an idle follower learns a commit;
/// openraft's heartbeats carry the commit index too.
pub const COMMIT_ONLY_HOLD_MS: u64 = 5;

/// Whether `next` makes the unsent entry-less request `held` redundant: the same leader,
/// the same position in the log, and a commit index at least as new. The follower checks
/// `next`'s `prev_log_id` exactly as it would `held`'s, so `next`'s answer says everything
/// `held`'s would have.
fn supersedes(
    next: &AppendEntriesRequest<TypeConfig>,
    held: &AppendEntriesRequest<TypeConfig>,
) -> bool {
    next.vote == held.vote
        && next.prev_log_id == held.prev_log_id
        && next.leader_commit >= held.leader_commit
}

/// What [`coalesce_commit_only`] carries from one request to the next.
struct Coalescing<S> {
    input: S,
    /// A request taken from `input` while holding another, sent next.
    carried: Option<AppendEntriesRequest<TypeConfig>>,
    /// Whether the stream's first request went out (it is never held: it may be a probe).
    started: bool,
    /// `input` ended while a request was held; that request was the last.
    ended: bool,
}

/// Drops the replication requests that only announce a commit when the next request on
/// the stream, taken within `hold`, carries that commit anyway.
///
/// openraft 0.10's replication stream sends an entry-less AppendEntries whenever the
/// commit index advances and no new entry is waiting (`StreamState::get_log_id_range`).
/// With one client that is every write: each follower received, decoded, applied and
/// answered two requests per write, the second while the leader was answering the
/// client, on the same two CPUs. Here such a request waits up to `hold` for the next one
/// (the next client's entry, ~1 ms later at one client); when that one
/// [`supersedes`] it, only that one is sent. openraft acknowledges a stream's requests by
/// log id (`InflightAppendQueue::drain_acked` takes every request up to the matching log
/// id), so a request that was never sent needs no answer of its own. Dropping a message
/// is always safe in Raft; the cost is that an idle follower applies a commit up to
/// `hold` later. etcd sends the commit-only append at once (`bcastAppend` after
/// `maybeCommit`).
///
/// The first request of a stream and every request with entries go out at once, as does
/// a held request whose successor does not supersede it (then both, in order).
pub fn coalesce_commit_only<S>(
    input: S,
    hold: Duration,
) -> impl futures::Stream<Item = AppendEntriesRequest<TypeConfig>> + Send + Unpin + 'static
where
    S: futures::Stream<Item = AppendEntriesRequest<TypeConfig>> + Send + Unpin + 'static,
{
    let state = Coalescing {
        input,
        carried: None,
        started: false,
        ended: false,
    };
    Box::pin(futures::stream::unfold(state, move |mut st| async move {
        if st.ended {
            return None;
        }
        let mut held = match st.carried.take() {
            Some(req) => req,
            None => st.input.next().await?,
        };
        let first = !std::mem::replace(&mut st.started, true);
        if first || !held.entries.is_empty() {
            return Some((held, st));
        }
        let deadline = tokio::time::Instant::now() + hold;
        loop {
            match tokio::time::timeout_at(deadline, st.input.next()).await {
                Err(_elapsed) => return Some((held, st)),
                Ok(None) => {
                    st.ended = true;
                    return Some((held, st));
                }
                Ok(Some(next)) if supersedes(&next, &held) => {
                    if !next.entries.is_empty() {
                        return Some((next, st));
                    }
                    // Another commit-only request: it replaces the held one, and waits
                    // out what is left of the same deadline.
                    held = next;
                }
                Ok(Some(next)) => {
                    st.carried = Some(next);
                    return Some((held, st));
                }
            }
        }
    }))
}

/// Requests sent on a replication stream and not answered yet: `(last index, sent at ns)`,
/// for the `replicate` stage events.
type SentQueue = Arc<Mutex<VecDeque<(Option<u64>, u64)>>>;

/// The result of one request on a replication stream, as a peer sends it.
type StreamReply = Result<StreamAppendResult<TypeConfig>, Fatal<TypeConfig>>;

impl RaftNetworkV2<TypeConfig> for PeerClient {
    type SnapshotData = SnapshotData;

    /// Replication as a pipeline over one gRPC bidirectional stream (`AppendStream`):
    /// requests go out as openraft produces them, without waiting for the previous answer
    /// (openraft's default sends one request at a time), less the commit-only requests a
    /// later one supersedes ([`coalesce_commit_only`]); answers come back in order. Only
    /// opening the stream has a deadline (`option`); after that a peer that stops
    /// answering is detected by HTTP/2 keepalive ([`KEEPALIVE_TIMEOUT_MS`]), and openraft
    /// drops the stream whenever it changes what it replicates.
    fn stream_append<'s, S>(
        &'s mut self,
        input: S,
        option: RPCOption,
    ) -> BoxFuture<
        's,
        Result<
            BoxStream<'s, Result<StreamAppendResult<TypeConfig>, RPCError<TypeConfig>>>,
            RPCError<TypeConfig>,
        >,
    >
    where
        S: futures::Stream<Item = AppendEntriesRequest<TypeConfig>> + Send + Unpin + 'static,
    {
        Box::pin(async move {
            // The whole backoff: a stream is opened again only after it.
            self.wait_out_refusal(Duration::MAX).await;
            let mut client = self.client().map_err(CallError::into_rpc)?.clone();
            let target = self.target;
            let sent: SentQueue = Arc::default();
            let sent_out = sent.clone();
            // Ends the outgoing requests when openraft drops the answers: hyper keeps
            // sending a request body after its response body is dropped, and a request
            // taken from openraft's replication state for a stream nobody reads would
            // be lost to the next one.
            let (answers_alive, answers_dropped) = tokio::sync::oneshot::channel::<()>();
            let input = coalesce_commit_only(input, Duration::from_millis(COMMIT_ONLY_HOLD_MS));
            // An encoding failure ends the outgoing stream (openraft then starts another).
            let outbound = futures::stream::unfold(input, move |mut input| {
                let sent = sent_out.clone();
                async move {
                    let req = input.next().await?;
                    let last_index = req.entries.last().map(|e| e.log_id.index);
                    // A large request is encoded off the runtime threads, which also run
                    // heartbeats and elections.
                    let large = approx_append_bytes(&req) > ENCODE_INLINE_MAX_BYTES;
                    let encoded = off_runtime_if(large, move || codec::encode(&req)).await;
                    let body = match encoded {
                        Ok(body) if body.len() <= MAX_APPEND_ENCODED_BYTES => body,
                        Ok(body) => {
                            // Cannot happen: the log reader bounds a request's entries
                            // (`REPLICATION_BATCH_BYTES`) and the leader each entry's size.
                            tracing::error!(target, bytes = body.len(), "an AppendEntries request is larger than a Raft message may be; ending the replication stream");
                            return None;
                        }
                        Err(e) => {
                            tracing::warn!(target, error = %e, "cannot encode an AppendEntries request; ending the replication stream");
                            return None;
                        }
                    };
                    sent.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push_back((last_index, stage::now_ns()));
                    Some((RaftPayload { body }, input))
                }
            })
            .take_until(answers_dropped);
            let opened = tokio::time::timeout(
                option.hard_ttl(),
                client.append_stream(tonic::Request::new(outbound)),
            )
            .await;
            let inbound = match opened {
                Ok(Ok(response)) => response.into_inner(),
                Ok(Err(status)) => return Err(self.status_error(&status).into_rpc()),
                Err(_) => {
                    return Err(CallError::Network(Msg(format!(
                        "peer {target} at {}: no answer to opening a replication stream within {:?}",
                        self.addr,
                        option.hard_ttl()
                    )))
                    .into_rpc());
                }
            };
            let addr = self.addr.clone();
            let answers = inbound.map(move |item| {
                // Owned by this closure: dropped, and the requests end, with the answers.
                let _alive = &answers_alive;
                let sent_at = sent.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
                if let Some((Some(last_index), start_ns)) = sent_at {
                    tracing::trace!(
                        target: stage::TARGET,
                        stage = "replicate",
                        last_index,
                        target,
                        start_ns,
                        end_ns = stage::now_ns(),
                    );
                }
                let payload =
                    item.map_err(|status| status_error(target, &addr, &status).into_rpc())?;
                let reply: StreamReply = codec::decode(&payload.body).map_err(|e| {
                    CallError::Network(Msg(format!(
                        "peer {target} sent an undecodable replication answer: {e}"
                    )))
                    .into_rpc()
                })?;
                let answer = reply.map_err(|fatal| CallError::Remote(fatal).into_rpc())?;
                if let Err(StreamAppendError::HigherVote(vote)) = &answer {
                    check_answer_vote(target, vote).map_err(CallError::into_rpc)?;
                }
                Ok(answer)
            });
            let answers: BoxStream<'s, _> = Box::pin(answers);
            Ok(answers)
        })
    }

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
            .and_then(|resp: AppendEntriesResponse<TypeConfig>| {
                if let AppendEntriesResponse::HigherVote(vote) = &resp {
                    check_answer_vote(self.target, vote)?;
                }
                Ok(resp)
            })
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
            .and_then(|resp: VoteResponse<TypeConfig>| {
                check_answer_vote(self.target, &resp.vote)?;
                Ok(resp)
            })
            .map_err(CallError::into_rpc)
    }

    /// A pre-vote: whether the peer would grant `rpc`, which changes nothing there. A
    /// peer of a version without the RPC (`unimplemented`, during a rolling upgrade) is
    /// counted as granting, as openraft counts a network without pre-vote.
    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        match self.call(Rpc::PreVote, &rpc, &option).await {
            Ok(resp) => {
                let resp: VoteResponse<TypeConfig> = resp;
                check_answer_vote(self.target, &resp.vote).map_err(CallError::into_rpc)?;
                Ok(resp)
            }
            Err(CallError::Unimplemented(_)) => Ok(VoteResponse::new(rpc.vote, None, true)),
            Err(e) => Err(e.into_rpc()),
        }
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
                let target = self.target;
                sent.and_then(|resp| {
                    check_answer_vote(target, &resp.vote)?;
                    Ok(resp)
                })
                .map_err(CallError::into_streaming)
            }
        }
    }
}

/// Most per-worker agent clients kept; past it the cache starts over (a client is cheap
/// to make, and a cluster has far fewer live workers).
pub const MAX_AGENT_CLIENTS: usize = 4_096;

/// HTTP clients of the worker agents (log retrieval), with timeouts. With TLS there is
/// one per worker, made on first use: it presents this coordinator's certificate and
/// accepts only a server certificate that names that worker (`cumulus://worker/ID`), so
/// a request and its token go to no other process on the agent's address. Without TLS,
/// one plaintext client for all.
pub struct AgentHttp {
    tls: Option<Arc<Credentials>>,
    plain: reqwest::Client,
    per_worker: Mutex<HashMap<String, reqwest::Client>>,
    /// The clients of the other coordinators' HTTP APIs (the dashboard's requests a
    /// follower forwards to the leader), per node id.
    per_coordinator: Mutex<HashMap<u64, reqwest::Client>>,
}

impl AgentHttp {
    /// The clients of a coordinator with `tls`.
    ///
    /// # Errors
    /// reqwest cannot build a client.
    pub fn new(tls: Option<Arc<Credentials>>) -> Result<AgentHttp, String> {
        let plain = agent_client_builder()
            .build()
            .map_err(|e| format!("building the agents' HTTP client: {e}"))?;
        Ok(AgentHttp {
            tls,
            plain,
            per_worker: Mutex::default(),
            per_coordinator: Mutex::default(),
        })
    }

    /// The client for coordinator `id`'s HTTP API: with TLS it presents this
    /// coordinator's certificate and accepts only one naming `cumulus://coordinator/ID`.
    ///
    /// # Errors
    /// Its TLS configuration cannot be made.
    pub fn coordinator(&self, id: u64) -> Result<reqwest::Client, String> {
        let Some(creds) = &self.tls else {
            return Ok(self.plain.clone());
        };
        let mut clients = self
            .per_coordinator
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(c) = clients.get(&id) {
            return Ok(c.clone());
        }
        let config = creds
            .client_config(ExpectedServer::Coordinator(id))
            .map_err(|e| format!("TLS for coordinator {id}: {e}"))?;
        let client = agent_client_builder()
            .tls_backend_preconfigured((*config).clone())
            .build()
            .map_err(|e| format!("the HTTP client of coordinator {id}: {e}"))?;
        if clients.len() >= MAX_AGENT_CLIENTS {
            clients.clear();
        }
        clients.insert(id, client.clone());
        Ok(client)
    }

    /// The client for worker `worker`'s agent.
    ///
    /// # Errors
    /// Its TLS configuration cannot be made (its credentials were checked at start).
    pub fn client(&self, worker: &str) -> Result<reqwest::Client, String> {
        let Some(creds) = &self.tls else {
            return Ok(self.plain.clone());
        };
        let mut clients = self.per_worker.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = clients.get(worker) {
            return Ok(c.clone());
        }
        let config = creds
            .client_config(ExpectedServer::Worker(worker.to_string()))
            .map_err(|e| format!("TLS for worker {worker}'s agent: {e}"))?;
        let client = agent_client_builder()
            .tls_backend_preconfigured((*config).clone())
            .build()
            .map_err(|e| format!("the HTTP client of worker {worker}'s agent: {e}"))?;
        if clients.len() >= MAX_AGENT_CLIENTS {
            clients.clear();
        }
        clients.insert(worker.to_string(), client.clone());
        Ok(client)
    }
}

/// Timeouts of every agent client.
fn agent_client_builder() -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        // Agents close a keep-alive connection idle for their header deadline; drop it
        // first, so no request is sent on a connection the agent is closing.
        .pool_idle_timeout(Duration::from_millis(
            cumulus_listen::HTTP_HEADER_READ_TIMEOUT_MS / 2,
        ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use cumulus_raft_store::{Entry, LeaderId, LogId};

    fn log_id(index: u64) -> LogId {
        LogId::new(
            LeaderId {
                term: 2,
                node_id: 1,
            },
            index,
        )
    }

    /// An AppendEntries of the term-2 leader after `prev`, with entries up to `last`.
    fn append(prev: u64, last: u64, commit: u64) -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: Vote::new_committed(2, 1),
            prev_log_id: Some(log_id(prev)),
            entries: (prev + 1..=last)
                .map(|i| Entry {
                    log_id: log_id(i),
                    payload: EntryPayload::Blank,
                })
                .collect(),
            leader_commit: Some(log_id(commit)),
        }
    }

    /// `(prev, last, commit)` of each request.
    fn shape(reqs: &[AppendEntriesRequest<TypeConfig>]) -> Vec<(u64, u64, u64)> {
        reqs.iter()
            .map(|r| {
                let prev = r.prev_log_id.map_or(0, |l| l.index);
                let last = r.entries.last().map_or(prev, |e| e.log_id.index);
                (prev, last, r.leader_commit.map_or(0, |l| l.index))
            })
            .collect()
    }

    /// A hold no test run reaches: what these tests see cannot depend on timing.
    const LONG_HOLD: Duration = Duration::from_secs(600);

    /// A coalescing stream over a channel: the test queues requests, then takes what the
    /// stream sends, so the order is fixed by what was queued when.
    fn coalescing(
        hold: Duration,
    ) -> (
        tokio::sync::mpsc::UnboundedSender<AppendEntriesRequest<TypeConfig>>,
        impl futures::Stream<Item = AppendEntriesRequest<TypeConfig>> + Unpin,
    ) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let input = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
        (tx, coalesce_commit_only(input, hold))
    }

    #[tokio::test]
    async fn a_commit_only_request_is_dropped_when_the_next_carries_its_commit() {
        let (tx, sent) = coalescing(LONG_HOLD);
        // first (never held), entries 11, commit-only for 11, entries 12.
        for r in [
            append(9, 10, 9),
            append(10, 11, 10),
            append(11, 11, 11),
            append(11, 12, 11),
        ] {
            tx.send(r).expect("the test holds the receiver");
        }
        drop(tx);
        let sent: Vec<_> = sent.collect().await;
        assert_eq!(shape(&sent), [(9, 10, 9), (10, 11, 10), (11, 12, 11)]);
    }

    #[tokio::test]
    async fn a_commit_only_request_goes_out_after_the_hold_when_nothing_follows() {
        let (tx, mut sent) = coalescing(Duration::from_millis(COMMIT_ONLY_HOLD_MS));
        tx.send(append(9, 10, 9))
            .expect("the test holds the receiver");
        tx.send(append(10, 10, 10))
            .expect("the test holds the receiver");
        let first = sent
            .next()
            .await
            .expect("the stream is open and a request is queued");
        // Nothing else is queued until the held request came out on its own.
        let held = sent
            .next()
            .await
            .expect("the stream is open and a request is queued");
        tx.send(append(10, 11, 10))
            .expect("the test holds the receiver");
        drop(tx);
        let rest: Vec<_> = sent.collect().await;
        assert_eq!(shape(&[first, held]), [(9, 10, 9), (10, 10, 10)]);
        assert_eq!(shape(&rest), [(10, 11, 10)]);
    }

    #[tokio::test]
    async fn the_first_request_is_never_held_and_a_held_one_goes_out_when_the_stream_ends() {
        let (tx, mut sent) = coalescing(LONG_HOLD);
        tx.send(append(10, 10, 9))
            .expect("the test holds the receiver");
        // The first request comes out while the stream is still open and nothing follows.
        let first = sent
            .next()
            .await
            .expect("the stream is open and a request is queued");
        tx.send(append(10, 10, 10))
            .expect("the test holds the receiver");
        drop(tx);
        let rest: Vec<_> = sent.collect().await;
        assert_eq!(shape(&[first]), [(10, 10, 9)]);
        assert_eq!(shape(&rest), [(10, 10, 10)]);
    }

    #[tokio::test]
    async fn a_successor_that_does_not_supersede_is_sent_after_the_held_request() {
        let (tx, sent) = coalescing(LONG_HOLD);
        let mut other_leader = append(11, 12, 11);
        other_leader.vote = Vote::new_committed(3, 2);
        for r in [
            append(9, 10, 9),
            append(10, 10, 10),
            append(9, 10, 10), // another position in the log
            append(10, 10, 10),
            other_leader,
            append(10, 10, 10),
            append(10, 10, 10), // a second commit-only replaces the first
            append(10, 11, 10),
        ] {
            tx.send(r).expect("the test holds the receiver");
        }
        drop(tx);
        let sent: Vec<_> = sent.collect().await;
        assert_eq!(
            shape(&sent),
            [
                (9, 10, 9),
                (10, 10, 10),
                (9, 10, 10),
                (10, 10, 10),
                (11, 12, 11),
                (10, 11, 10)
            ]
        );
        assert_eq!(sent[4].vote, Vote::new_committed(3, 2));
    }

    #[test]
    fn a_snapshot_deadline_grows_with_its_size_and_never_undercuts_openraft() {
        let offered = Duration::from_millis(200);
        assert_eq!(snapshot_deadline(0, offered), Duration::from_secs(10));
        assert_eq!(
            snapshot_deadline(80 * 1024 * 1024, offered),
            Duration::from_secs(20)
        );
        assert_eq!(
            snapshot_deadline(MAX_SNAPSHOT_BYTES, offered),
            Duration::from_secs(10 + 256)
        );
        let long = Duration::from_secs(3_600);
        assert_eq!(snapshot_deadline(1, long), long);
    }
}
