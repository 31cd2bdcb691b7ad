//! The blob store in S3 (`--blob-url`) against a real 3-coordinator cluster and a real
//! S3 server (`s3-test`: s3s-fs on loopback), one scenario: an uploaded workdir is
//! acknowledged with `replicas` 0 once it is in the bucket, under `<prefix>/blobs/`; the
//! leader dies right after the acknowledgment, and the new leader admits a job naming it,
//! which runs on a worker (the agent fetches it through `WorkerService.GetBlob`) and
//! whose artifacts the agent stores in the bucket too; the new leader serves the blob
//! (gRPC and REST `HEAD`); a corrupted object is refused with DATA_LOSS and deleted; a
//! user's uploads are held to their quota (the uploader recorded in object metadata).

use std::path::Path;
use std::time::Duration;

use cumulus_api::JobState;
use cumulus_api::v1;
use cumulus_e2e::blobs::{get_blob, put_blob};
use cumulus_e2e::{Client, Cluster, ClusterOpts, S3Server};
use tonic::Code;

const LONG: Duration = Duration::from_secs(120);
const BUCKET: &str = "cumulus-blobs";
const PREFIX: &str = "cluster-1";
const MIB: usize = 1024 * 1024;

/// The script the rank runs from its working directory.
const SCRIPT: &str = r#"#!/bin/sh
set -eu
test -f data/input.txt || { echo "data/input.txt is missing in $(pwd)"; exit 3; }
cp data/input.txt "$CUMULUS_OUTPUT_DIR/seen.txt"
"#;

async fn put(c: &mut Client, digest: &str, data: &[u8]) -> v1::PutBlobResponse {
    put_blob(c, digest, data).await.expect("put a blob")
}

/// Where s3s-fs keeps blob `digest`'s object.
fn object_path(server: &S3Server, digest: &str) -> std::path::PathBuf {
    server
        .server
        .data_dir()
        .join(BUCKET)
        .join(PREFIX)
        .join("blobs")
        .join(digest)
}

/// A project of a script and a data file, packed; some incompressible bytes make the
/// packed blob a few MiB (several chunks, a multipart upload past the 5 MiB part).
fn packed_project(dir: &Path) -> cumulus_bundle::Packed {
    std::fs::create_dir_all(dir.join("data")).unwrap();
    std::fs::write(dir.join("run.sh"), SCRIPT).unwrap();
    std::fs::write(dir.join("data/input.txt"), "the input\n").unwrap();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let noise: Vec<u8> = (0..6 * MIB + 11)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(dir.join("data/noise.bin"), noise).unwrap();
    cumulus_bundle::pack(dir, &cumulus_bundle::PackOptions::default()).expect("pack")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blobs_in_s3_survive_a_leader_kill_run_as_a_workdir_and_are_verified() {
    let server = S3Server::start().await.expect("s3s-fs");
    server.create_bucket(BUCKET).await.expect("bucket");
    let mut cluster = Cluster::start(ClusterOpts {
        coordinators: 3,
        workers: 1,
        slots: 1,
        s3: Some(server.access.clone()),
        coordinator_args: vec![
            "--blob-url".into(),
            format!("s3://{BUCKET}/{PREFIX}"),
            "--blob-quota-bytes-per-user".into(),
            (6 * MIB).to_string(),
        ],
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let leader = cluster.wait_leader(LONG).await;
    let mut admin = cluster.leader_client().await.expect("admin");

    // The upload is acknowledged with no coordinator replica, once the bucket holds it.
    let src = tempfile::tempdir().unwrap();
    let packed = packed_project(src.path());
    let bytes = std::fs::read(packed.path()).unwrap();
    assert!(bytes.len() > 5 * MIB, "{} bytes", bytes.len());
    let stored = put(&mut admin, &packed.digest, &bytes).await;
    assert_eq!(
        (stored.digest.as_str(), stored.size_bytes, stored.replicas),
        (packed.digest.as_str(), packed.size_bytes, 0)
    );
    let object = object_path(&server, &packed.digest);
    assert!(std::fs::read(&object).expect("the object") == bytes);
    for c in &cluster.coordinators {
        let local = c.data_dir.join("blobs").join(&packed.digest);
        assert!(
            !local.exists(),
            "not on the coordinators: {}",
            local.display()
        );
    }

    // The leader dies right after the acknowledgment; the new one admits a job naming
    // the blob as its workdir, which runs on the worker.
    let old = cluster.index_of(leader).expect("the leader is a member");
    cluster.coordinators[old].proc.kill9();
    let new_leader = cluster.wait_leader(LONG).await;
    assert_ne!(new_leader, leader);
    let workdir = v1::BlobRef {
        digest: packed.digest.clone(),
        size_bytes: packed.size_bytes,
    };
    let spec = v1::JobSpec {
        world_size: 1,
        command: vec!["sh".into(), "run.sh".into()],
        workdir: Some(workdir.clone()),
        ..Default::default()
    };
    let job = cluster
        .submit("s3-workdir", spec)
        .await
        .expect("submit")
        .job_id;
    let done = cluster.wait_finished(&job, LONG).await;
    if done.job_state() != Ok(JobState::Succeeded) {
        cluster.dump_logs();
    }
    assert_eq!(done.job_state(), Ok(JobState::Succeeded), "{done:?}");
    let worker_dir = cluster.dir.path().join(&cluster.workers[0].name);
    assert!(
        worker_dir.join("blob-cache").join(&packed.digest).is_file(),
        "the agent fetched the workdir"
    );
    // The rank's output went to the bucket as an artifact.
    let artifact = done.artifacts[0].blob.clone().expect("an artifact");
    assert!(object_path(&server, &artifact.digest).is_file());

    // The new leader serves the blob, over gRPC and REST.
    let mut admin = cluster
        .leader_client()
        .await
        .expect("admin on the new leader");
    assert!(get_blob(&mut admin, &packed.digest).await.expect("get") == bytes);
    let new = cluster.index_of(new_leader).expect("a member");
    let http_addr = cluster.coordinators[new].http.clone();
    let head = cluster
        .http_client()
        .head(cluster.url(&http_addr, &format!("/v1/blobs/{}", packed.digest)))
        .bearer_auth(cumulus_e2e::TOKEN)
        .send()
        .await
        .expect("head");
    assert_eq!(head.status(), reqwest::StatusCode::OK);
    let length = head
        .headers()
        .get(reqwest::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    assert_eq!(length, Some(packed.size_bytes));

    // A corrupted object is refused with DATA_LOSS, and deleted: no longer present.
    let mut bad = bytes.clone();
    bad[bytes.len() / 2] ^= 0x20;
    std::fs::write(&object, &bad).expect("corrupt the object");
    let err = get_blob(&mut admin, &packed.digest)
        .await
        .expect_err("a corrupt object");
    assert_eq!(err.code(), Code::DataLoss, "{err}");
    let stat = admin
        .stat_blob(v1::StatBlobRequest {
            digest: packed.digest.clone(),
        })
        .await
        .expect("stat")
        .into_inner();
    assert!(!stat.present, "{stat:?}");
    assert!(!object.exists(), "the corrupt object is deleted");

    // The quota (6 MiB here), counted from the objects' uploader metadata: Bob's 2 MiB
    // fit, 5 MiB more do not.
    let bob = admin
        .create_user(v1::CreateUserRequest {
            name: "bob".into(),
            role: "submit".into(),
        })
        .await
        .expect("create bob")
        .into_inner()
        .token;
    let mut as_bob = cluster.leader_client_as(&bob).await.expect("bob");
    let two = vec![7u8; 2 * MIB];
    let d2 = blake3::hash(&two).to_hex().to_string();
    assert_eq!(put(&mut as_bob, &d2, &two).await.replicas, 0);
    let five = vec![8u8; 5 * MIB];
    let d5 = blake3::hash(&five).to_hex().to_string();
    let err = put_blob(&mut as_bob, &d5, &five)
        .await
        .expect_err("past the quota");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert!(err.message().contains("quota"), "{err}");
    assert!(!object_path(&server, &d5).exists());
}
