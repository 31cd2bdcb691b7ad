//! The probes of issues 21 and 39, rerun against real 3-coordinator clusters: forged Raft
//! RPCs (with the client token, from a non-member, with an absurd term, with the peer
//! token over a connection whose certificate does not name the sender, and with a
//! member's own certificate: a leadership-transfer vote and a vote at the old term
//! bound), and a flipped byte in
//! a stopped node's raft log. Each must end with no acknowledged job lost, no divergence,
//! no panic, and a clear refusal or recovery. Every wait is on a condition with a
//! generous deadline.

use std::collections::BTreeSet;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cumulus_api::JobState;
use cumulus_api::v1;
use cumulus_api::v1::RaftPayload;
use cumulus_api::v1::raft_service_client::RaftServiceClient;
use cumulus_client::ClientTls;
use cumulus_e2e::{Auth, Cluster, ClusterOpts, PEER_TOKEN, TOKEN, wait_for};
use cumulus_raft_store::state::Command;
use cumulus_raft_store::{Entry, EntryPayload, LeaderId, LogId, TypeConfig, Vote};
use cumulus_tls::Identity;
use openraft::raft::{AppendEntriesRequest, VoteRequest};

const LONG: Duration = Duration::from_secs(300);

/// A job that stays pending (the clusters here have no workers).
fn pending_spec() -> v1::JobSpec {
    v1::JobSpec {
        world_size: 1,
        command: vec!["true".into()],
        ..Default::default()
    }
}

async fn raft_client(
    grpc_addr: &str,
    token: &str,
    tls: Option<&ClientTls>,
) -> RaftServiceClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Auth>,
> {
    let channel = cumulus_e2e::endpoint(grpc_addr, tls)
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("connect");
    RaftServiceClient::with_interceptor(channel, Auth::new(token))
}

fn payload<T: serde::Serialize>(value: &T) -> RaftPayload {
    RaftPayload {
        body: serde_json::to_vec(value).expect("json"),
    }
}

/// A vote request of `candidate` at `term`, claiming a log far ahead of anyone's, as a
/// leadership transfer (the request that made a real leader step down).
fn forged_vote(candidate: u64, term: u64) -> RaftPayload {
    payload(&VoteRequest::<TypeConfig> {
        vote: Vote::new(term, candidate),
        last_log_id: Some(LogId::new(
            LeaderId {
                term: term.min(1 << 40),
                node_id: candidate,
            },
            1 << 40,
        )),
        leadership_transfer: true,
    })
}

/// An AppendEntries of "leader" `sender` at `term` carrying a `CancelJob` of `job_id`
/// right after the receiver's last log id, with a forged commit index.
fn forged_append(sender: u64, term: u64, after: Option<LogId>, job_id: &str) -> RaftPayload {
    let index = after.map_or(1, |l| l.index + 1);
    let log_id = LogId::new(
        LeaderId {
            term,
            node_id: sender,
        },
        index,
    );
    payload(&AppendEntriesRequest::<TypeConfig> {
        vote: Vote::new_committed(term, sender),
        prev_log_id: after,
        entries: vec![Entry {
            log_id,
            payload: EntryPayload::Normal(Command::CancelJob {
                job_id: job_id.into(),
                at_ms: 1,
            }),
        }],
        leader_commit: Some(log_id),
    })
}

/// A fresh 3-coordinator cluster without workers and the ids of `n` pending jobs
/// submitted to it (request ids `<prefix>-<k>`).
async fn cluster_with_pending_jobs(prefix: &str, n: usize) -> (Cluster, Vec<String>) {
    let cluster = Cluster::start(ClusterOpts {
        workers: 0,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let mut acked = Vec::new();
    for k in 0..n {
        let r = cluster
            .submit(&format!("{prefix}-{k}"), pending_spec())
            .await
            .expect("submit");
        acked.push(r.job_id);
    }
    (cluster, acked)
}

/// The job as coordinator `i` has applied it (no linearizable read).
async fn local_job(cluster: &Cluster, i: usize, job_id: &str) -> Option<v1::Job> {
    let mut c = cluster.client_of(i).await.ok()?;
    c.get_job(v1::GetJobRequest {
        job_id: job_id.into(),
        linearizable: false,
    })
    .await
    .ok()?
    .into_inner()
    .job
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_raft_rpcs_are_refused_and_change_nothing() {
    let mut cluster = Cluster::start(ClusterOpts {
        workers: 0,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let job = cluster.submit("j-1", pending_spec()).await.expect("submit");
    let user = cluster.client_tls();
    let leader = cluster.wait_leader(LONG).await;
    let before = cluster.status().await.expect("status");
    let f = cluster.follower_of(leader);
    let last = LogId::new(
        LeaderId {
            term: before.term,
            node_id: leader,
        },
        before.commit_index.expect("a commit index"),
    );

    // 1. The client token opens no Raft RPC.
    for i in 0..cluster.coordinators.len() {
        let mut c = raft_client(&cluster.coordinators[i].grpc, TOKEN, user.as_ref()).await;
        let vote = c
            .vote(forged_vote(cluster.coordinators[f].id, before.term + 1))
            .await
            .expect_err("a vote with the client token");
        assert_eq!(vote.code(), tonic::Code::Unauthenticated, "{vote}");
        let append = c
            .append_entries(forged_append(leader, before.term, Some(last), &job.job_id))
            .await
            .expect_err("an append with the client token");
        assert_eq!(append.code(), tonic::Code::Unauthenticated, "{append}");
    }

    // 2. With the peer token: a node id outside the membership is refused.
    let mut c = raft_client(&cluster.coordinators[f].grpc, PEER_TOKEN, user.as_ref()).await;
    let outsider = c
        .vote(forged_vote(9, before.term + 1))
        .await
        .expect_err("a vote from node 9");
    assert_eq!(outsider.code(), tonic::Code::PermissionDenied, "{outsider}");
    let outsider = c
        .append_entries(forged_append(9, before.term + 1, Some(last), &job.job_id))
        .await
        .expect_err("an append from node 9");
    assert_eq!(outsider.code(), tonic::Code::PermissionDenied, "{outsider}");

    // 2b. With TLS, the peer token and a member's node id are not enough: the connection's
    //     certificate must name that coordinator. A user's connection (no certificate), a
    //     worker's certificate, and another coordinator's certificate are refused.
    if cluster.opts.tls {
        let other = cluster
            .coordinators
            .iter()
            .map(|c| c.id)
            .find(|id| *id != leader && *id != cluster.coordinators[f].id)
            .expect("a third member");
        let impostors = [
            ("no certificate", user.clone()),
            (
                "a worker's certificate",
                cluster
                    .member_tls(&Identity::Worker("worker-1".into()))
                    .expect("issue"),
            ),
            (
                "another coordinator's certificate",
                cluster
                    .member_tls(&Identity::Coordinator(other))
                    .expect("issue"),
            ),
        ];
        for (what, tls) in impostors {
            let mut c = raft_client(&cluster.coordinators[f].grpc, PEER_TOKEN, tls.as_ref()).await;
            let vote = c
                .vote(forged_vote(leader, before.term + 1))
                .await
                .expect_err(what);
            assert_eq!(vote.code(), tonic::Code::PermissionDenied, "{what}: {vote}");
            assert!(vote.message().contains("certificate"), "{what}: {vote}");
            let append = c
                .append_entries(forged_append(leader, before.term, Some(last), &job.job_id))
                .await
                .expect_err(what);
            assert_eq!(
                append.code(),
                tonic::Code::PermissionDenied,
                "{what}: {append}"
            );
        }
    }

    // 3. A vote of term u64::MAX to every node (it overflowed the next election and
    //    panicked all three, on every restart) is refused and never persisted.
    for i in 0..cluster.coordinators.len() {
        let mut c = raft_client(&cluster.coordinators[i].grpc, PEER_TOKEN, user.as_ref()).await;
        let absurd = c
            .vote(forged_vote(cluster.coordinators[f].id, u64::MAX))
            .await
            .expect_err("a vote of term u64::MAX");
        assert_eq!(absurd.code(), tonic::Code::PermissionDenied, "{absurd}");
    }

    // 4. With the peer token AND the sender's own certificate (what a job could read in a
    //    root-run local cluster): a leadership-transfer vote a few terms ahead no longer
    //    deposes the live leader (it is an ordinary vote, refused under the leader lease),
    //    and a vote at 2^48 — the old bound, which it met exactly, after which every
    //    election's term was refused and the cluster stayed leaderless — is refused as too
    //    far ahead of each node's term.
    let sender = cluster.coordinators[f].id;
    let own_tls = cluster
        .member_tls(&Identity::Coordinator(sender))
        .expect("issue")
        .or(user.clone());
    for i in (0..cluster.coordinators.len()).filter(|i| *i != f) {
        let mut c = raft_client(&cluster.coordinators[i].grpc, PEER_TOKEN, own_tls.as_ref()).await;
        let reply = c
            .vote(forged_vote(sender, before.term + 8))
            .await
            .expect("a member's vote is answered")
            .into_inner();
        let answer: Result<openraft::raft::VoteResponse<TypeConfig>, serde_json::Value> =
            cumulus_raft_store::codec::decode(&reply.body).expect("a vote answer");
        let answer = answer.expect("not a raft error");
        assert!(
            !answer.vote_granted,
            "node {}: a transfer vote was granted while a leader is live: {answer:?}",
            cluster.coordinators[i].id
        );
        let trap = c
            .vote(forged_vote(sender, 1 << 48))
            .await
            .expect_err("a vote at 2^48");
        assert_eq!(trap.code(), tonic::Code::PermissionDenied, "{trap}");
        assert!(trap.message().contains("above this node's term"), "{trap}");
    }

    // Nothing changed: same leader and term, the job pending on every node, and the
    // cluster still commits, also after every node restarted.
    let after = cluster.status().await.expect("status");
    assert_eq!((after.leader_id, after.term), (Some(leader), before.term));
    for i in 0..cluster.coordinators.len() {
        let j = wait_for("every node to apply the submit", LONG, || {
            local_job(&cluster, i, &job.job_id)
        })
        .await;
        assert_eq!(
            j.state, "pending",
            "node {}: {j:?}",
            cluster.coordinators[i].id
        );
    }
    for i in 0..cluster.coordinators.len() {
        cluster.coordinators[i].proc.kill9();
        cluster.spawn_coordinator(i).expect("restart");
    }
    cluster.wait_leader(LONG).await;
    let more = cluster
        .submit("j-2", pending_spec())
        .await
        .expect("submit after restarts");
    for i in 0..cluster.coordinators.len() {
        wait_for("every node to apply both jobs", LONG, || async {
            let a = local_job(&cluster, i, &job.job_id).await?;
            local_job(&cluster, i, &more.job_id).await?;
            (a.job_state() == Ok(JobState::Pending)).then_some(())
        })
        .await;
    }
    let log = std::fs::read_to_string(&cluster.coordinators[f].proc.log).expect("log");
    assert!(!log.contains("panicked"), "no node panics");
}

/// The segment files of a coordinator's raft log, oldest first.
fn wal_segments(data_dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(data_dir.join("raft").join("wal"))
        .expect("wal dir")
        .map(|e| e.expect("entry").path())
        .collect();
    out.sort();
    out
}

fn ctl(cluster: &Cluster, args: &[&str]) {
    let out = cluster.cumulusctl(args).expect("cumulusctl runs");
    assert!(
        out.status.success(),
        "cumulusctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_in_the_raft_log_refuses_to_start_and_rejoin_empty_recovers() {
    let (mut cluster, mut acked) = cluster_with_pending_jobs("r", 20).await;
    let leader = cluster.wait_leader(LONG).await;
    let i = cluster.follower_of(leader);
    let victim = cluster.coordinators[i].id;
    wait_for("the follower to apply every submit", LONG, || async {
        local_job(&cluster, i, acked.last().expect("jobs")).await
    })
    .await;

    // Stop it and flip one byte among its newest segment's records.
    cluster.coordinators[i].proc.kill9();
    let before = std::fs::read(
        wal_segments(&cluster.coordinators[i].data_dir)
            .pop()
            .expect("a segment"),
    )
    .expect("read");
    let (seg, at) = flip_a_record_byte(&cluster, i);

    // It refuses to start, naming the file, and changes nothing on disk.
    cluster.spawn_coordinator(i).expect("spawn");
    let status = cluster.wait_coordinator_exit(i, LONG).await;
    assert!(!status.success(), "a damaged raft log must not start");
    let log = std::fs::read_to_string(&cluster.coordinators[i].proc.log).expect("log");
    let seg_name = seg.file_name().and_then(|n| n.to_str()).expect("name");
    assert!(
        log.contains("corrupt") && log.contains(seg_name) && log.contains("--rejoin-empty"),
        "a clear refusal naming the segment: {log}"
    );
    let mut damaged = before;
    damaged[at as usize] ^= 0x01;
    assert!(
        std::fs::read(&seg).expect("read") == damaged,
        "no repair in place"
    );

    // The cluster goes on with two nodes.
    for n in 20..25 {
        let r = cluster
            .submit(&format!("r-{n}"), pending_spec())
            .await
            .expect("submit with one node down");
        acked.push(r.job_id);
    }

    // --rejoin-empty refuses while the node is a member ...
    cluster.coordinators[i].extra_args = vec!["--rejoin-empty".into()];
    cluster.spawn_coordinator(i).expect("spawn");
    let status = cluster.wait_coordinator_exit(i, LONG).await;
    assert!(!status.success());
    let log = std::fs::read_to_string(&cluster.coordinators[i].proc.log).expect("log");
    assert!(
        log.contains("is still a voting member"),
        "refuses while a member: {log}"
    );

    // ... and after `cluster remove` moves the damaged dir aside and catches up.
    ctl(&cluster, &["cluster", "remove", &victim.to_string()]);
    cluster
        .spawn_coordinator(i)
        .expect("spawn with --rejoin-empty");
    let addr = cluster.member_addr(i);
    ctl(
        &cluster,
        &["cluster", "add-learner", &victim.to_string(), &addr],
    );
    ctl(&cluster, &["cluster", "promote", &victim.to_string()]);
    let data_dir = cluster.coordinators[i].data_dir.clone();
    let parent = data_dir.parent().expect("parent");
    let name = data_dir.file_name().and_then(|n| n.to_str()).expect("name");
    let aside: Vec<_> = std::fs::read_dir(parent)
        .expect("read")
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(&format!("{name}.damaged-")))
        })
        .collect();
    assert_eq!(aside.len(), 1, "the damaged data dir is kept aside");
    wait_for(
        "the rebuilt node to hold every acknowledged job",
        LONG,
        || async {
            let mut c = cluster.client_of(i).await.ok()?;
            let list = c
                .list_jobs(v1::ListJobsRequest {
                    linearizable: false,
                })
                .await
                .ok()?
                .into_inner();
            let ids: BTreeSet<&str> = list.jobs.iter().map(|j| j.id.as_str()).collect();
            acked.iter().all(|j| ids.contains(j.as_str())).then_some(())
        },
    )
    .await;
    // No acknowledged job was lost or duplicated, and no id was reused.
    let mut c = cluster.leader_client().await.expect("leader");
    let list = c
        .list_jobs(v1::ListJobsRequest { linearizable: true })
        .await
        .expect("list")
        .into_inner();
    let ids: Vec<&str> = list.jobs.iter().map(|j| j.id.as_str()).collect();
    let unique: BTreeSet<&str> = ids.iter().copied().collect();
    assert_eq!(ids.len(), unique.len(), "no job id is reused");
    assert_eq!(ids.len(), acked.len());
}

/// Flips one byte among the records of the newest segment of coordinator `i`'s raft log
/// (it must be stopped); flipping it again undoes it. Returns the segment and offset.
fn flip_a_record_byte(cluster: &Cluster, i: usize) -> (PathBuf, u64) {
    let seg = wal_segments(&cluster.coordinators[i].data_dir)
        .pop()
        .expect("a segment");
    let bytes = std::fs::read(&seg).expect("read");
    let end = bytes.iter().rposition(|b| *b != 0).expect("records") + 1;
    let at = end / 3;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&seg)
        .expect("open");
    file.write_all_at(&[bytes[at] ^ 0x01], at as u64)
        .expect("flip");
    file.sync_all().expect("sync");
    (seg, at as u64)
}

/// Flips the byte at `at` of `seg` back.
fn unflip(seg: &Path, at: u64) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(seg)
        .expect("open");
    let mut b = [0u8; 1];
    file.read_exact_at(&mut b, at).expect("read");
    file.write_all_at(&[b[0] ^ 0x01], at).expect("unflip");
    file.sync_all().expect("sync");
}

/// Two of three coordinators with damaged logs (the issue's probe: they elected a leader
/// with the cut log, lost 21 acknowledged jobs, resurrected cancelled ones and reused an
/// id). Both refuse to start and change nothing on disk; the intact node alone is no
/// quorum, so the cluster stops accepting writes instead of diverging. With the damage
/// undone (a restored disk), the cluster comes back with every acknowledged job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_majority_of_damaged_logs_stops_writes_rather_than_diverge() {
    let (mut cluster, mut acked) = cluster_with_pending_jobs("m", 10).await;
    for i in 0..3 {
        wait_for("every node to apply every submit", LONG, || async {
            local_job(&cluster, i, acked.last().expect("jobs")).await
        })
        .await;
    }
    for i in 0..3 {
        cluster.coordinators[i].proc.kill9();
    }
    let damage = [
        flip_a_record_byte(&cluster, 0),
        flip_a_record_byte(&cluster, 1),
    ];
    for i in 0..3 {
        cluster.spawn_coordinator(i).expect("spawn");
    }
    for i in 0..2 {
        let status = cluster.wait_coordinator_exit(i, LONG).await;
        assert!(!status.success(), "node {} must refuse", i + 1);
    }
    // The intact node accepts no write: no quorum.
    let mut c = wait_for("the intact node to answer", LONG, || async {
        cluster.client_of(2).await.ok()
    })
    .await;
    let write = tokio::time::timeout(
        Duration::from_secs(20),
        c.submit_job(v1::SubmitJobRequest {
            allow_pending: false,
            request_id: "after-damage".into(),
            spec: Some(pending_spec()),
        }),
    )
    .await;
    assert!(
        !matches!(write, Ok(Ok(_))),
        "a lone intact node must not accept a write"
    );

    // Nothing was cut or zeroed: with the flipped bytes restored the cluster is whole.
    for (seg, at) in &damage {
        unflip(seg, *at);
    }
    for i in 0..2 {
        cluster.spawn_coordinator(i).expect("spawn");
    }
    cluster.wait_leader(LONG).await;
    let more = cluster
        .submit("after-repair", pending_spec())
        .await
        .expect("submit after the repair");
    acked.push(more.job_id);
    let mut c = cluster.leader_client().await.expect("leader");
    let list = c
        .list_jobs(v1::ListJobsRequest { linearizable: true })
        .await
        .expect("list")
        .into_inner();
    let ids: Vec<&str> = list.jobs.iter().map(|j| j.id.as_str()).collect();
    assert_eq!(ids, acked.iter().map(String::as_str).collect::<Vec<_>>());
}

/// Issue 39's sled probe on a real coordinator: one byte flipped inside the newest `vote`
/// record of a stopped follower's sled log. sled's CRC catches it, takes it for a torn
/// write and silently drops it and every later write, so sled alone would hand back the
/// previous vote, or none when the follower had saved one vote (before, the node started
/// with it and led at an old term). The coordinator refuses to start, naming the tree and
/// the key, and how to recover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_in_a_sled_vote_record_refuses_to_start() {
    let (mut cluster, acked) = cluster_with_pending_jobs("v", 1).await;
    let leader = cluster.wait_leader(LONG).await;
    let i = cluster.follower_of(leader);
    wait_for("the follower to apply the submit", LONG, || async {
        local_job(&cluster, i, &acked[0]).await
    })
    .await;
    cluster.coordinators[i].proc.kill9();

    // The newest vote record in sled's log: a format-2 record whose JSON is a vote.
    let db_file = cluster.coordinators[i].data_dir.join("raft").join("db");
    let bytes = std::fs::read(&db_file).expect("read sled's log");
    let magic = b"cumulus-meta-2\n";
    let header = magic.len() + 4 + 8;
    let newest_vote = (0..bytes.len().saturating_sub(header))
        .rev()
        .find(|&at| {
            bytes[at..].starts_with(magic)
                && bytes[at + header..]
                    .windows(14)
                    .take(80)
                    .any(|w| w == b"},\"committed\":")
        })
        .expect("a vote record in sled's log");
    let at = newest_vote + header + 3;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&db_file)
        .expect("open");
    file.write_all_at(&[bytes[at] ^ 0x01], at as u64)
        .expect("flip");
    file.sync_all().expect("sync");

    cluster.spawn_coordinator(i).expect("spawn");
    let status = cluster.wait_coordinator_exit(i, LONG).await;
    assert!(
        !status.success(),
        "a node that lost its vote must not start"
    );
    let log = std::fs::read_to_string(&cluster.coordinators[i].proc.log).expect("log");
    assert!(
        log.contains("lost flushed writes")
            && log.contains("tree `raft_meta`")
            && log.contains("key `vote`")
            && log.contains("--rejoin-empty"),
        "a clear refusal naming the tree and the key: {log}"
    );
}
