//! The coordinators' blob store against a real 3-coordinator cluster (one scenario, one
//! cluster): an upload acknowledged on a majority survives the leader's SIGKILL right
//! after the acknowledgment (the new leader serves it and admits a submit naming it as
//! the workdir, and refuses one naming a blob nobody holds); a wrong digest is refused
//! naming both digests; a user cannot read another user's blob; the per-user quota is
//! enforced; a corrupted stored blob is detected while it streams, removed, and served
//! again from a peer; the REST mirror (HEAD, PUT, GET); an unreferenced blob is removed
//! past its retention while a referenced one stays; and `GET /v1/jobs/{id}/logs?tail=N`
//! starts at the last N lines.

use std::time::Duration;

use cumulus_api::JobState;
use cumulus_api::v1;
use cumulus_e2e::blobs::{get_blob, put_blob};
use cumulus_e2e::{Client, Cluster, ClusterOpts, TOKEN, wait_for};
use tonic::Code;

const LONG: Duration = Duration::from_secs(120);
const MIB: usize = 1024 * 1024;

/// Bytes that differ per `seed` and compress poorly.
fn blob(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn digest(data: &[u8]) -> String {
    blake3::hash(data).to_hex().to_string()
}

async fn create_user(admin: &mut Client, name: &str) -> String {
    admin
        .create_user(v1::CreateUserRequest {
            name: name.into(),
            role: "submit".into(),
        })
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e}"))
        .into_inner()
        .token
}

/// A job that stays pending: larger than the cluster (one worker of 4 slots), queued
/// with `allow_pending`, so nothing of it runs.
fn pending_submit(request_id: &str, workdir: Option<v1::BlobRef>) -> v1::SubmitJobRequest {
    v1::SubmitJobRequest {
        request_id: request_id.into(),
        allow_pending: true,
        spec: Some(v1::JobSpec {
            world_size: 8,
            command: vec!["true".into()],
            workdir,
            ..Default::default()
        }),
    }
}

fn index_of_leader(cluster: &Cluster, id: u64) -> usize {
    cluster.index_of(id).expect("the leader is a member")
}

/// The SSE `log` lines of `url` until `end`.
async fn sse_lines(http: &reqwest::Client, url: &str) -> Vec<String> {
    use eventsource_stream::Eventsource;
    use futures::StreamExt;
    let resp = http.get(url).bearer_auth(TOKEN).send().await.expect("sse");
    assert!(resp.status().is_success(), "{}", resp.status());
    let mut events = resp.bytes_stream().eventsource();
    let mut lines = Vec::new();
    while let Some(ev) = events.next().await {
        let ev = ev.expect("sse event");
        if ev.event == "end" {
            return lines;
        }
        let v: serde_json::Value = serde_json::from_str(&ev.data).expect("json");
        lines.push(v["line"].as_str().expect("line").to_string());
    }
    panic!("the stream ended without `end`");
}

// One scenario on one cluster, read in order.
#[allow(clippy::too_many_lines)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blobs_survive_a_leader_kill_are_verified_guarded_and_collected() {
    let mut cluster = Cluster::start(ClusterOpts {
        workers: 1,
        coordinator_args: vec!["--blob-quota-bytes-per-user".into(), (6 * MIB).to_string()],
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let leader = cluster.wait_leader(LONG).await;
    let mut admin = cluster.leader_client().await.expect("admin");

    // Logs with ?tail=N: the last N lines of a finished job, then `end`.
    let job = cluster
        .submit(
            "tail-1",
            v1::JobSpec {
                world_size: 1,
                command: vec![
                    "sh".into(),
                    "-c".into(),
                    "for i in $(seq 1 30); do echo line-$i; done".into(),
                ],
                ..Default::default()
            },
        )
        .await
        .expect("submit")
        .job_id;
    let done = cluster.wait_finished(&job, LONG).await;
    assert_eq!(done.job_state(), Ok(JobState::Succeeded));
    let http = cluster.http_client();
    let leader_http = cluster.coordinators[index_of_leader(&cluster, leader)]
        .http
        .clone();
    let lines = sse_lines(
        &http,
        &cluster.url(&leader_http, &format!("/v1/jobs/{job}/logs?tail=5")),
    )
    .await;
    let expected: Vec<String> = (26..=30).map(|i| format!("line-{i}")).collect();
    assert_eq!(lines, expected);
    let all = sse_lines(
        &http,
        &cluster.url(&leader_http, &format!("/v1/jobs/{job}/logs")),
    )
    .await;
    assert_eq!(all.len(), 30, "without tail, every line");
    let refused = http
        .get(cluster.url(&leader_http, &format!("/v1/jobs/{job}/logs?tail=10001")))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("request");
    assert_eq!(refused.status(), reqwest::StatusCode::BAD_REQUEST);

    let alice = create_user(&mut admin, "alice").await;
    let bob = create_user(&mut admin, "bob").await;
    let mut as_alice = cluster.leader_client_as(&alice).await.expect("alice");

    // Two uploads to the leader, each acknowledged on a majority: B0 (no job will
    // reference it) and the workdir W (3 MiB: several chunks).
    let b0 = blob(0, 100 * 1024);
    let w = blob(1, 3 * MIB + 17);
    let (d0, dw) = (digest(&b0), digest(&w));
    let r0 = put_blob(&mut as_alice, &d0, &b0).await.expect("put B0");
    assert!(r0.replicas >= 2, "{r0:?}");
    let rw = put_blob(&mut as_alice, &dw, &w).await.expect("put W");
    assert_eq!(
        (rw.digest.as_str(), rw.size_bytes),
        (dw.as_str(), w.len() as u64)
    );
    assert!(rw.replicas >= 2, "{rw:?}");

    // The leader dies right after the acknowledgment.
    let old = index_of_leader(&cluster, leader);
    cluster.coordinators[old].proc.kill9();
    let new_leader = cluster.wait_leader(LONG).await;
    assert_ne!(new_leader, leader);
    let new = index_of_leader(&cluster, new_leader);
    let mut admin = cluster
        .leader_client()
        .await
        .expect("admin on the new leader");
    assert_eq!(
        get_blob(&mut admin, &dw)
            .await
            .expect("the new leader serves W"),
        w
    );

    // The new leader admits a submit naming W as the workdir, and refuses one naming a
    // blob no coordinator holds.
    let mut as_alice = cluster.leader_client_as(&alice).await.expect("alice");
    let workdir = v1::BlobRef {
        digest: dw.clone(),
        size_bytes: w.len() as u64,
    };
    as_alice
        .submit_job(pending_submit("alice-w", Some(workdir.clone())))
        .await
        .expect("a submit naming an uploaded workdir is admitted");
    let missing = digest(b"never uploaded");
    let err = as_alice
        .submit_job(pending_submit(
            "alice-missing",
            Some(v1::BlobRef {
                digest: missing.clone(),
                size_bytes: 14,
            }),
        ))
        .await
        .expect_err("a workdir nobody holds");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert!(
        err.message().contains(&format!(
            "workdir blob {missing} is not in the blob store: upload it first"
        )),
        "{err}"
    );

    // Alice reads her job's workdir; Bob may not; neither reads an unreferenced blob.
    assert_eq!(
        get_blob(&mut as_alice, &dw).await.expect("alice reads W"),
        w
    );
    let mut as_bob = cluster.leader_client_as(&bob).await.expect("bob");
    let err = get_blob(&mut as_bob, &dw)
        .await
        .expect_err("bob reads alice's W");
    assert_eq!(err.code(), Code::PermissionDenied, "{err}");
    let err = get_blob(&mut as_alice, &d0)
        .await
        .expect_err("no job references B0");
    assert_eq!(err.code(), Code::PermissionDenied, "{err}");

    // A wrong digest is refused, naming the digest expected and the one the bytes have.
    let other = blob(2, 1000);
    let err = put_blob(&mut as_bob, &missing, &other)
        .await
        .expect_err("wrong digest");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(
        err.message().contains(&missing) && err.message().contains(&digest(&other)),
        "{err}"
    );
    // The quota (6 MiB here): Bob's 2 MiB fit, 5 MiB more do not.
    let b2 = blob(3, 2 * MIB);
    put_blob(&mut as_bob, &digest(&b2), &b2)
        .await
        .expect("bob's 2 MiB");
    let b4 = blob(4, 5 * MIB);
    let err = put_blob(&mut as_bob, &digest(&b4), &b4)
        .await
        .expect_err("past the quota");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert!(err.message().contains("quota"), "{err}");

    // The REST mirror: HEAD, PUT (streamed, Content-Length), GET.
    let new_http = cluster.coordinators[new].http.clone();
    let url = |d: &str| cluster.url(&new_http, &format!("/v1/blobs/{d}"));
    let head = http
        .head(url(&dw))
        .bearer_auth(&alice)
        .send()
        .await
        .expect("head");
    assert_eq!(head.status(), reqwest::StatusCode::OK);
    // The header itself (reqwest's content_length() is the body's: empty for a HEAD).
    let length = head
        .headers()
        .get(reqwest::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    assert_eq!(length, Some(w.len() as u64));
    let head = http
        .head(url(&missing))
        .bearer_auth(&alice)
        .send()
        .await
        .expect("head");
    assert_eq!(head.status(), reqwest::StatusCode::NOT_FOUND);
    let b3 = blob(5, MIB + 3);
    let d3 = digest(&b3);
    let resp = http
        .put(url(&d3))
        .bearer_auth(&alice)
        .body(b3.clone())
        .send()
        .await
        .expect("put");
    assert_eq!(resp.status(), reqwest::StatusCode::CREATED);
    let answer: serde_json::Value = resp.json().await.expect("json");
    assert_eq!(answer["digest"], d3.as_str());
    assert!(answer["replicas"].as_u64() >= Some(2), "{answer}");
    let resp = http
        .put(url(&d0))
        .bearer_auth(&alice)
        .body(b3.clone())
        .send()
        .await
        .expect("put");
    assert_eq!(resp.status(), reqwest::StatusCode::BAD_REQUEST);
    let got = http
        .get(url(&d3))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("get");
    assert_eq!(got.status(), reqwest::StatusCode::OK);
    assert_eq!(got.bytes().await.expect("body").as_ref(), b3.as_slice());
    let got = http
        .get(url(&d3))
        .bearer_auth(&bob)
        .send()
        .await
        .expect("get");
    assert_eq!(got.status(), reqwest::StatusCode::FORBIDDEN);

    // A corrupted stored copy: the read that finds it ends with DATA_LOSS and removes
    // it; the next read fetches W from a peer (admission put it on a majority again).
    let stored = cluster.coordinators[new].data_dir.join("blobs").join(&dw);
    let mut bad = std::fs::read(&stored).expect("the new leader holds W");
    bad[MIB + 5] ^= 0x40;
    std::fs::write(&stored, &bad).expect("corrupt W");
    let err = get_blob(&mut admin, &dw).await.expect_err("corrupt W");
    assert_eq!(err.code(), Code::DataLoss, "{err}");
    assert!(!stored.exists(), "the corrupt copy is removed");
    assert_eq!(
        get_blob(&mut admin, &dw)
            .await
            .expect("W again, from a peer"),
        w
    );
    assert_eq!(std::fs::read(&stored).expect("fetched back"), w);

    // Garbage collection: the old leader restarts with a retention of 1 s; once caught
    // up it removes B0 (no job references it) and keeps W (alice's job's workdir).
    cluster.coordinators[old].extra_args = vec!["--blob-retention-ms".into(), "1000".into()];
    cluster
        .spawn_coordinator(old)
        .expect("restart the old leader");
    let blobs_dir = cluster.coordinators[old].data_dir.join("blobs");
    wait_for("the old leader to collect B0", LONG, || async {
        (!blobs_dir.join(&d0).exists()).then_some(())
    })
    .await;
    assert!(
        !blobs_dir.join(&d0).with_extension("json").exists(),
        "its sidecar too"
    );
    assert!(blobs_dir.join(&dw).exists(), "W is referenced: kept");
}
