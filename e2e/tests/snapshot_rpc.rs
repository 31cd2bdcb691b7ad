//! A follower's `InstallSnapshot` RPC against stale, oversized and concurrent senders,
//! over real gRPC to a follower of a real 3-node cluster. Every sender keeps its request
//! stream open (no data, no end), so an answer proves the follower decided on the header
//! alone, without buffering a snapshot; every wait has a generous deadline.

use std::time::Duration;

use cumulus_api::v1::SnapshotChunk;
use cumulus_api::v1::raft_service_client::RaftServiceClient;
use cumulus_client::ClientTls;
use cumulus_coordinator::network::{MAX_SNAPSHOT_BYTES, SnapshotHeader};
use cumulus_e2e::{Auth, Cluster, ClusterOpts, PEER_TOKEN, wait_for};
use cumulus_raft_store::{SnapshotMeta, TypeConfig, Vote};
use cumulus_tls::Identity;
use futures::channel::mpsc;
use openraft::error::Fatal;
use openraft::raft::SnapshotResponse;
use tokio::task::JoinHandle;

const LONG: Duration = Duration::from_secs(120);

type Reply = Result<SnapshotResponse<TypeConfig>, Fatal<TypeConfig>>;

/// A sender that has sent its header chunk and holds its stream open: `_open` keeps the
/// request stream from ending; `call` resolves when the follower answers or fails.
struct OpenSend {
    _open: mpsc::UnboundedSender<SnapshotChunk>,
    call: JoinHandle<Result<Reply, tonic::Status>>,
}

/// Opens an `InstallSnapshot` call to `grpc_addr` and sends only the header chunk.
async fn open_send(
    grpc_addr: &str,
    tls: Option<&ClientTls>,
    vote: Vote,
    data_bytes: Option<u64>,
) -> OpenSend {
    let channel = cumulus_e2e::endpoint(grpc_addr, tls)
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("connect to the follower");
    let mut client = RaftServiceClient::with_interceptor(channel, Auth::new(PEER_TOKEN));
    let header_json = serde_json::to_vec(&SnapshotHeader {
        vote,
        meta: SnapshotMeta::default(),
        data_bytes,
    })
    .expect("header JSON");
    let (tx, rx) = mpsc::unbounded();
    tx.unbounded_send(SnapshotChunk {
        header_json,
        data: vec![0; 1024],
    })
    .expect("queue the header chunk");
    let call = tokio::spawn(async move {
        let reply = client.install_snapshot(rx).await?.into_inner();
        Ok(cumulus_raft_store::codec::decode::<Reply>(&reply.body).expect("a decodable reply"))
    });
    OpenSend { _open: tx, call }
}

/// Asserts that `what` was refused with `resource_exhausted`.
fn assert_exhausted(answer: Result<Reply, tonic::Status>, what: &str) {
    let status = answer.expect_err(&format!("{what} is refused"));
    assert_eq!(
        status.code(),
        tonic::Code::ResourceExhausted,
        "{what}: {status}"
    );
}

/// Waits for `send` to be answered, within [`LONG`].
async fn answer(send: OpenSend) -> Result<Reply, tonic::Status> {
    tokio::time::timeout(LONG, send.call)
        .await
        .expect("the follower answers while the stream is still open")
        .expect("the call task")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_snapshot_decides_on_the_header_for_stale_oversized_and_concurrent_senders() {
    let cluster = Cluster::start(ClusterOpts {
        workers: 0,
        ..Default::default()
    })
    .await
    .expect("cluster");
    let leader = cluster.wait_leader(LONG).await;
    let status = cluster.status().await.expect("status");
    let follower = cluster
        .coordinators
        .iter()
        .find(|c| c.id != leader)
        .expect("a follower");
    let addr = follower.grpc.clone();
    let follower_id = follower.id;
    // The follower must have taken the leader's vote: until then its own vote (term 0,
    // itself) is not comparable with a term-0 sender's and refuses it as well.
    let i = cluster.index_of(follower_id).expect("follower index");
    let applied_before = wait_for("the follower to follow the leader", LONG, || async {
        let own = cluster.status_of(i).await?;
        (own.leader_id == Some(leader) && own.term == status.term).then_some(own.last_applied_index)
    })
    .await;
    // The sender speaks as the leader: on a TLS cluster it needs the leader's
    // certificate (the follower checks that the connection names the vote's node).
    let as_leader = cluster
        .member_tls(&Identity::Coordinator(leader))
        .expect("certificate");
    let current = Vote::new_committed(status.term, leader);
    let stale = Vote::new_committed(status.term - 1, leader);

    // A size over the limit is refused from the header.
    let big = open_send(
        &addr,
        as_leader.as_ref(),
        current,
        Some(MAX_SNAPSHOT_BYTES as u64 + 1),
    )
    .await;
    assert_exhausted(answer(big).await, "an oversized snapshot");

    // A deposed leader's snapshot is answered with the follower's vote at once.
    let old = open_send(&addr, as_leader.as_ref(), stale, Some(1 << 30)).await;
    let reply = answer(old)
        .await
        .expect("a stale sender gets an answer")
        .expect("not fatal");
    assert!(
        reply.vote >= current,
        "the follower answers with its own vote ({}), not below {current}",
        reply.vote
    );

    // Two senders of the current term: the second to arrive is refused while the first
    // holds the only receive slot (its stream open, no data yet).
    let mut a = open_send(&addr, as_leader.as_ref(), current, Some(1 << 20)).await;
    let mut b = open_send(&addr, as_leader.as_ref(), current, Some(1 << 20)).await;
    let (first_answer, b_answered) = tokio::time::timeout(LONG, async {
        tokio::select! {
            answered = &mut a.call => (answered, false),
            answered = &mut b.call => (answered, true),
        }
    })
    .await
    .expect("one of two concurrent senders is refused");
    let held = if b_answered { a } else { b };
    assert_exhausted(
        first_answer.expect("the call task"),
        "the second of two concurrent senders",
    );
    assert!(
        !held.call.is_finished(),
        "the first sender is still being received"
    );

    // Cancelling the held call frees the slot: a later sender is answered again.
    held.call.abort();
    drop(held._open);
    wait_for("the receive slot to be free again", LONG, || async {
        let old = open_send(&addr, as_leader.as_ref(), stale, Some(1 << 20)).await;
        match answer(old).await {
            Ok(Ok(reply)) if reply.vote >= current => Some(()),
            _ => None,
        }
    })
    .await;

    // The follower still follows a leader and lost no applied entry.
    let after = cluster.status_of(i).await.expect("the follower answers");
    assert!(after.leader_id.is_some(), "{after:?}");
    assert!(after.last_applied_index >= applied_before, "{after:?}");
}
