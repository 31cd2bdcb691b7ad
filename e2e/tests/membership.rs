//! End-to-end tests of live membership changes and log compaction on real processes:
//! `cumulusctl cluster add-learner / promote / remove`, a 3 → 5 → 3 change while a
//! training job runs, a wiped coordinator rejoining, and a lagging coordinator catching
//! up by a snapshot install. Every wait is on a condition with a generous deadline.

use std::collections::BTreeSet;
use std::time::Duration;

use cumulus_api::JobState;
use cumulus_api::v1;
use cumulus_e2e::{
    Cluster, ClusterOpts, expected_digest, prepare_digits, read_result, trainer_spec, wait_for,
};

const LONG: Duration = Duration::from_secs(300);
const EPOCHS: u32 = 6;

fn small_spec() -> v1::JobSpec {
    v1::JobSpec {
        world_size: 1,
        command: vec!["true".into()],
        ..Default::default()
    }
}

fn voters(s: &v1::ClusterStatusResponse) -> BTreeSet<u64> {
    s.members
        .iter()
        .filter(|m| m.voter)
        .map(|m| m.node_id)
        .collect()
}

fn members(s: &v1::ClusterStatusResponse) -> BTreeSet<u64> {
    s.members.iter().map(|m| m.node_id).collect()
}

/// Runs `cumulusctl -o json cluster ARGS…` and parses the status it prints.
fn ctl_cluster(cluster: &Cluster, args: &[&str]) -> v1::ClusterStatusResponse {
    let mut all = vec!["-o", "json", "cluster"];
    all.extend_from_slice(args);
    let out = cluster.cumulusctl(&all).expect("cumulusctl runs");
    assert!(
        out.status.success(),
        "cumulusctl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("cluster status JSON")
}

/// Every acknowledged submit is in the final state exactly once (no loss, no duplicate).
async fn assert_submits_exactly_once(cluster: &Cluster, acked: &[(String, String)]) {
    let mut c = cluster.leader_client().await.expect("leader client");
    let list = c
        .list_jobs(v1::ListJobsRequest { linearizable: true })
        .await
        .expect("list jobs")
        .into_inner();
    for (rid, job_id) in acked {
        let found: Vec<&v1::Job> = list.jobs.iter().filter(|j| &j.request_id == rid).collect();
        assert_eq!(found.len(), 1, "request {rid} must make exactly one job");
        assert_eq!(&found[0].id, job_id, "request {rid}");
    }
}

/// `GET /ready` of coordinator `i` once its HTTP server answers: the status code and the
/// JSON body.
async fn ready(cluster: &Cluster, i: usize, want: u16) -> serde_json::Value {
    let http = cluster.http_client();
    let url = cluster.url(&cluster.coordinators[i].http, "/ready");
    let what = format!(
        "/ready of node {} to answer {want}",
        cluster.coordinators[i].id
    );
    wait_for(&what, LONG, || {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let r = http.get(&url).send().await.ok()?;
            let code = r.status().as_u16();
            let body: serde_json::Value = r.json().await.ok()?;
            (code == want).then_some(body)
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grow_3_to_5_to_3_while_a_job_runs() {
    let mut cluster = Cluster::start(ClusterOpts::default())
        .await
        .expect("cluster");
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 8).expect("shards");
    let args = [
        "--epochs",
        &EPOCHS.to_string(),
        "--ckpt-every",
        "20",
        "--step-sleep-ms",
        "40",
    ]
    .map(str::to_string);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = root.join("out-member");
    let spec = trainer_spec(&w, 4, &root.join("ckpt-member"), &out, &args);
    let job_id = cluster
        .submit("member-train", spec)
        .await
        .expect("submit")
        .job_id;
    cluster
        .wait_job(&job_id, "the job running", LONG, |j| {
            j.job_state() == Ok(JobState::Running)
        })
        .await;
    let mut acked = vec![("member-train".to_string(), job_id.clone())];
    let mut seq = 0;
    let mut submit = async |cluster: &Cluster, acked: &mut Vec<(String, String)>| {
        seq += 1;
        let rid = format!("member-{seq}");
        let r = cluster.submit(&rid, small_spec()).await.expect("submit");
        acked.push((rid, r.job_id));
    };

    // Every member serves current state: ready (the readiness probe of Kubernetes).
    for i in 0..3 {
        let body = ready(&cluster, i, 200).await;
        assert_eq!(body["ready"], true, "{body}");
    }

    // Grow: two new coordinators join as learners, then become voters.
    for _ in 0..2 {
        let i = cluster
            .add_coordinator()
            .expect("start a joining coordinator");
        let id = cluster.coordinators[i].id;
        // Not added yet: it has no leader and no state, so it is not ready.
        let body = ready(&cluster, i, 503).await;
        assert_eq!(body["ready"], false, "{body}");
        assert!(
            body["reason"].as_str().is_some_and(|r| !r.is_empty()),
            "{body}"
        );
        let addr = cluster.member_addr(i);
        let s = ctl_cluster(&cluster, &["add-learner", &id.to_string(), &addr]);
        assert!(members(&s).contains(&id), "{s:?}");
        assert!(!voters(&s).contains(&id), "a learner does not vote: {s:?}");
        // Caught up (add-learner returns once it is): ready.
        ready(&cluster, i, 200).await;
        submit(&cluster, &mut acked).await;
        let s = ctl_cluster(&cluster, &["promote", &id.to_string()]);
        assert!(voters(&s).contains(&id), "{s:?}");
        submit(&cluster, &mut acked).await;
    }
    let s = cluster
        .wait_status("5 voters", LONG, |s| voters(s).len() == 5)
        .await;
    assert_eq!(voters(&s), BTreeSet::from([1, 2, 3, 4, 5]));
    let mid = cluster.job(&job_id).await.expect("job");
    assert_eq!(mid.state, "running", "the job spans the membership change");

    // Shrink: remove the leader itself and one original follower.
    let leader = cluster.wait_leader(LONG).await;
    let other = [1, 2, 3]
        .into_iter()
        .find(|id| *id != leader)
        .expect("a follower among the originals");
    for id in [other, leader] {
        let s = ctl_cluster(&cluster, &["remove", &id.to_string()]);
        assert!(!members(&s).contains(&id), "{s:?}");
        // The operator stops a removed node: it no longer hears from the cluster, so
        // its own view (its last known leader) goes stale.
        let i = cluster.index_of(id).expect("index");
        cluster.coordinators[i].proc.kill9();
        submit(&cluster, &mut acked).await;
    }
    let s = cluster
        .wait_status("3 voters without the removed ones", LONG, |s| {
            voters(s).len() == 3 && s.leader_id.is_some_and(|l| l != leader && l != other)
        })
        .await;
    assert!(!voters(&s).contains(&leader) && !voters(&s).contains(&other));
    submit(&cluster, &mut acked).await;

    let job = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(job.state, "succeeded", "{job:?}");
    assert_eq!(job.restarts_used, 0, "the job is unaffected: {job:?}");
    for rank in 0..4 {
        let r = read_result(&out, rank).expect("result.json");
        let want = expected_digest(&w, 4, rank, EPOCHS, &root).expect("expected digest");
        assert_eq!(r["digest"].as_str(), Some(want.as_str()), "rank {rank}");
    }
    assert_submits_exactly_once(&cluster, &acked).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wiped_coordinator_rejoins_after_remove_and_add_learner() {
    let mut cluster = Cluster::start(ClusterOpts {
        workers: 1,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let mut acked = Vec::new();
    for n in 0..5 {
        let rid = format!("before-{n}");
        let r = cluster.submit(&rid, small_spec()).await.expect("submit");
        acked.push((rid, r.job_id));
    }
    let leader = cluster.wait_leader(LONG).await;
    // Wipe the lowest-id follower: without --join it would bootstrap a new cluster.
    let victim = [1, 2, 3]
        .into_iter()
        .find(|id| *id != leader)
        .expect("a follower");
    let i = cluster.index_of(victim).expect("index");
    cluster.wipe_coordinator(i).expect("wipe");
    let s = ctl_cluster(&cluster, &["remove", &victim.to_string()]);
    assert!(!members(&s).contains(&victim), "{s:?}");
    for n in 0..5 {
        let rid = format!("between-{n}");
        let r = cluster.submit(&rid, small_spec()).await.expect("submit");
        acked.push((rid, r.job_id));
    }
    cluster
        .spawn_coordinator(i)
        .expect("restart the wiped node");
    let addr = cluster.member_addr(i);
    ctl_cluster(&cluster, &["add-learner", &victim.to_string(), &addr]);
    let s = ctl_cluster(&cluster, &["promote", &victim.to_string()]);
    assert_eq!(voters(&s).len(), 3, "{s:?}");
    // Its own view holds every acknowledged job.
    wait_for("the rejoined node to hold every job", LONG, || async {
        let mut c = cluster.client_of(i).await.ok()?;
        let list = c
            .list_jobs(v1::ListJobsRequest {
                linearizable: false,
            })
            .await
            .ok()?
            .into_inner();
        let ids: BTreeSet<&str> = list.jobs.iter().map(|j| j.request_id.as_str()).collect();
        acked
            .iter()
            .all(|(rid, _)| ids.contains(rid.as_str()))
            .then_some(())
    })
    .await;
    // It is a working voter: with the old leader down, it and the third node still
    // elect a leader and commit.
    let li = cluster.index_of(leader).expect("leader index");
    cluster.coordinators[li].proc.kill9();
    let r = cluster
        .submit("after-leader-kill", small_spec())
        .await
        .expect("submit without the old leader");
    acked.push(("after-leader-kill".into(), r.job_id));
    assert_submits_exactly_once(&cluster, &acked).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lagging_coordinator_catches_up_by_snapshot_install() {
    let mut cluster = Cluster::start(ClusterOpts {
        workers: 0,
        snapshot_every_entries: Some(10),
        keep_log_entries: Some(0),
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let leader = cluster.wait_leader(LONG).await;
    let i = cluster.follower_of(leader);
    let before = cluster
        .status_of(i)
        .await
        .and_then(|s| s.last_applied_index)
        .unwrap_or(0);
    cluster.coordinators[i].proc.kill9();
    let mut acked = Vec::new();
    for n in 0..40 {
        let rid = format!("lag-{n}");
        let r = cluster.submit(&rid, small_spec()).await.expect("submit");
        acked.push((rid, r.job_id));
    }
    // The leader compacted past everything the stopped follower has.
    let s = cluster
        .wait_status("the leader to purge its log", LONG, |s| {
            s.purged_index.is_some_and(|p| p > before + 10)
        })
        .await;
    let purged = s.purged_index.expect("purged");
    // Every acknowledged submit is applied on the leader by now; the follower's
    // non-linearizable list below must wait for all of them, not only for `purged`.
    let li = cluster
        .coordinators
        .iter()
        .position(|c| c.id == leader)
        .expect("the leader");
    let on_leader = cluster
        .status_of(li)
        .await
        .and_then(|s| s.last_applied_index)
        .unwrap_or(0);
    let target = on_leader.max(purged);
    cluster.spawn_coordinator(i).expect("restart the follower");
    let caught = wait_for("the follower to catch up", LONG, || async {
        let s = cluster.status_of(i).await?;
        (s.last_applied_index? >= target).then_some(s)
    })
    .await;
    assert!(
        caught.snapshot_index.is_some_and(|x| x >= purged),
        "{caught:?}"
    );
    let log = std::fs::read_to_string(&cluster.coordinators[i].proc.log).expect("log");
    assert!(
        log.contains("installed a snapshot received from the leader"),
        "the follower caught up by a snapshot install"
    );
    let mut c = cluster.client_of(i).await.expect("client");
    let list = c
        .list_jobs(v1::ListJobsRequest {
            linearizable: false,
        })
        .await
        .expect("list")
        .into_inner();
    for (rid, job_id) in &acked {
        assert_eq!(
            list.jobs
                .iter()
                .filter(|j| &j.request_id == rid && &j.id == job_id)
                .count(),
            1,
            "{rid}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_coordinator_data_refuses_to_start() {
    let mut cluster = Cluster::start(ClusterOpts {
        workers: 0,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let r = cluster.submit("c-1", small_spec()).await.expect("submit");
    let leader = cluster.wait_leader(LONG).await;
    let i = cluster.follower_of(leader);
    wait_for("the follower to apply the submit", LONG, || async {
        let mut c = cluster.client_of(i).await.ok()?;
        c.get_job(v1::GetJobRequest {
            job_id: r.job_id.clone(),
            linearizable: false,
        })
        .await
        .ok()
        .map(|_| ())
    })
    .await;
    // kill -9 and restart: log and state intact.
    cluster.coordinators[i].proc.kill9();
    cluster.spawn_coordinator(i).expect("restart");
    wait_for(
        "the restarted follower to serve its state",
        LONG,
        || async {
            let mut c = cluster.client_of(i).await.ok()?;
            c.get_job(v1::GetJobRequest {
                job_id: r.job_id.clone(),
                linearizable: false,
            })
            .await
            .ok()
            .map(|_| ())
        },
    )
    .await;
    // Overwrite every sled file with garbage: it must refuse to start, not run empty.
    cluster.coordinators[i].proc.kill9();
    let raft_dir = cluster.coordinators[i].data_dir.join("raft");
    let mut corrupted = 0;
    for entry in walk(&raft_dir) {
        let len = std::fs::metadata(&entry).map(|m| m.len()).unwrap_or(0);
        if len > 0 {
            std::fs::write(&entry, vec![0xA5u8; len as usize]).expect("corrupt");
            corrupted += 1;
        }
    }
    assert!(
        corrupted > 0,
        "sled wrote files under {}",
        raft_dir.display()
    );
    cluster.spawn_coordinator(i).expect("spawn");
    let status = cluster.wait_coordinator_exit(i, LONG).await;
    assert!(!status.success(), "a corrupt data dir must not start");
    let log = std::fs::read_to_string(&cluster.coordinators[i].proc.log).expect("log");
    let tail: String = log.lines().rev().take(20).collect::<Vec<_>>().join("\n");
    assert!(
        tail.contains("corrupt") || tail.contains("sled") || tail.contains("data dir"),
        "a clear error: {tail}"
    );
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// A call's gRPC status code, or `None` when it was answered.
fn code<T>(answer: Result<tonic::Response<T>, tonic::Status>) -> Option<tonic::Code> {
    answer.err().map(|s| s.code())
}

/// `--raft-listen`: three coordinators serve Raft (and blob replication) on ports of
/// their own, named in the membership; they elect, commit a job, replicate a blob to a
/// majority, and add a fourth member with `add-learner ID GRPC@HTTP@RAFT`. Each gRPC port
/// answers a Raft call, even with the peer token and a coordinator's certificate,
/// `UNIMPLEMENTED`; each Raft port answers the client service the same. A member
/// restarted without `--raft-listen` refuses to start. About 2–5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_on_a_port_of_its_own() {
    use cumulus_api::v1::client_service_client::ClientServiceClient;
    use cumulus_api::v1::raft_service_client::RaftServiceClient;
    use cumulus_e2e::{Auth, PEER_TOKEN, TOKEN};
    use cumulus_raft_store::{TypeConfig, Vote};

    let mut cluster = Cluster::start(ClusterOpts {
        workers: 1,
        raft_listen: true,
        ..ClusterOpts::default()
    })
    .await
    .expect("a cluster with Raft ports of their own");
    let s = cluster.status().await.expect("status");
    for c in &cluster.coordinators {
        let m = s
            .members
            .iter()
            .find(|m| m.node_id == c.id)
            .expect("a member");
        let raft = c.raft.as_deref().expect("a raft port");
        assert_eq!(
            (m.grpc_addr.as_str(), m.raft_addr.as_str()),
            (c.grpc.as_str(), raft)
        );
        assert_ne!(m.raft_addr, m.grpc_addr);
    }

    // Raft commits (a job runs to its end on the worker, which reached the gRPC port),
    // and blobs reach a majority over the Raft ports.
    let r = cluster
        .submit("raft-port-job", small_spec())
        .await
        .expect("submit");
    let job = cluster.wait_finished(&r.job_id, LONG).await;
    assert_eq!(job.job_state(), Ok(JobState::Succeeded), "{job:?}");
    let data = b"replicated over the raft ports".to_vec();
    let digest = blake3::hash(&data).to_hex().to_string();
    let mut leader = cluster.leader_client().await.expect("leader client");
    cumulus_e2e::blobs::put_blob(&mut leader, &digest, &data)
        .await
        .expect("a blob stored on a majority");

    // The gRPC port serves no Raft, whoever asks; the Raft port serves only Raft.
    let leader_id = cluster.wait_leader(LONG).await;
    let f = cluster.follower_of(leader_id);
    let (f_grpc, f_raft) = {
        let c = &cluster.coordinators[f];
        (c.grpc.clone(), c.raft.clone().expect("a raft port"))
    };
    let as_leader = cluster
        .member_tls(&cumulus_tls::Identity::Coordinator(leader_id))
        .expect("a coordinator certificate");
    // A pre-vote persists nothing; at term 1 it is refused or answered, never acted on.
    let pre_vote = v1::RaftPayload {
        body: serde_json::to_vec(&openraft::raft::VoteRequest::<TypeConfig> {
            vote: Vote::new(1, leader_id),
            last_log_id: None,
            leadership_transfer: false,
        })
        .expect("json"),
    };
    let raft_at = async |addr: &str| {
        let channel = cumulus_e2e::endpoint(addr, as_leader.as_ref())
            .expect("endpoint")
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .expect("connect");
        RaftServiceClient::with_interceptor(channel, Auth::new(PEER_TOKEN))
    };
    let on_grpc = raft_at(&f_grpc).await.pre_vote(pre_vote.clone()).await;
    assert_eq!(
        code(on_grpc),
        Some(tonic::Code::Unimplemented),
        "raft on {f_grpc}"
    );
    let on_raft = code(raft_at(&f_raft).await.pre_vote(pre_vote).await);
    assert_ne!(
        on_raft,
        Some(tonic::Code::Unimplemented),
        "raft on {f_raft}"
    );
    let tls = cluster.client_tls();
    let channel = cumulus_e2e::coordinator_channel(&f_raft, tls.as_ref())
        .await
        .expect("connect to the raft port");
    let status = ClientServiceClient::with_interceptor(channel, Auth::new(TOKEN))
        .cluster_status(v1::ClusterStatusRequest {})
        .await;
    assert_eq!(
        code(status),
        Some(tonic::Code::Unimplemented),
        "clients on {f_raft}"
    );

    // A member added later is reached at the Raft address `add-learner` names.
    let i = cluster.add_coordinator().expect("a fourth coordinator");
    let addr = cluster.member_addr(i);
    assert_eq!(addr.matches('@').count(), 2, "{addr}");
    let id = cluster.coordinators[i].id.to_string();
    ctl_cluster(&cluster, &["add-learner", &id, &addr]);
    let s = ctl_cluster(&cluster, &["promote", &id]);
    assert_eq!(voters(&s).len(), 4, "{s:?}");
    let raft = cluster.coordinators[i].raft.clone().expect("a raft port");
    assert!(
        s.members.iter().any(|m| m.raft_addr == raft),
        "{raft} in {s:?}"
    );

    // A member stored with a Raft port of its own refuses to restart without
    // --raft-listen (its peers would dial a port nothing serves), rather than vanish.
    cluster.coordinators[f].proc.kill9();
    cluster.coordinators[f].raft = None;
    cluster
        .spawn_coordinator(f)
        .expect("restart without --raft-listen");
    let exit = cluster.wait_coordinator_exit(f, LONG).await;
    assert!(!exit.success(), "{exit:?}");
    let log = std::fs::read_to_string(&cluster.coordinators[f].proc.log).expect("its log");
    assert!(log.contains("nothing would serve"), "{log}");
}
