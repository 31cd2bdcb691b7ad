//! The S3 tier against a real S3 server: `s3s-fs` started on a loopback port per test
//! (`cargo install s3s-fs@0.14.1 --locked --features binary`; `.ci/run` installs it).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cumulus_ckpt::{
    CheckpointStore, CkptError, CommitTier, LocalStore, MANIFEST_FORMAT_VERSION, Manifest,
    RemoteKind, S3Location, S3Settings, S3Store, TieredStore,
};

const KEY: &str = "cumulus-test-key";
const SECRET: &str = "cumulus-test-secret";

/// An `s3s-fs` process serving a temp dir; killed on drop.
struct S3Server {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn s3s_fs_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("CUMULUS_S3S_FS") {
        return path.into();
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let cargo_bin = home.join(".cargo/bin/s3s-fs");
    if cargo_bin.exists() {
        return cargo_bin;
    }
    PathBuf::from("s3s-fs")
}

fn start_s3() -> S3Server {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let child = Command::new(s3s_fs_binary())
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--access-key", KEY, "--secret-key", SECRET])
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("s3s-fs must be installed: cargo install s3s-fs@0.14.1 --locked --features binary");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "s3s-fs did not listen on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
    S3Server {
        child,
        port,
        _dir: dir,
    }
}

fn settings(port: u16) -> S3Settings {
    S3Settings {
        endpoint_url: Some(format!("http://127.0.0.1:{port}")),
        force_path_style: true,
        access_key_id: Some(KEY.into()),
        secret_access_key: Some(SECRET.into()),
        multipart_threshold_bytes: 5 * 1024 * 1024,
        part_size_bytes: 5 * 1024 * 1024,
        retry_deadline_ms: 2_000,
        ..S3Settings::default()
    }
}

async fn store(server: &S3Server, bucket: &str, create: bool) -> S3Store {
    let settings = settings(server.port);
    let client = settings.client().await.expect("client");
    if create {
        client
            .create_bucket()
            .bucket(bucket)
            .send()
            .await
            .expect("create bucket");
    }
    S3Store::new(
        client,
        settings,
        S3Location::parse(&format!("s3://{bucket}/runs/a")).expect("location"),
    )
}

fn write_staging(staging: &Path, seed: u8, big: bool) {
    std::fs::create_dir_all(staging.join("opt")).expect("mkdir");
    std::fs::write(staging.join("state.json"), format!("{{\"seed\":{seed}}}")).expect("write");
    let size = if big { 12 * 1024 * 1024 + 17 } else { 1000 };
    let bytes: Vec<u8> = (0..size).map(|i| (i % 251) as u8 ^ seed).collect();
    std::fs::write(staging.join("opt/weights.bin"), bytes).expect("write");
}

async fn commit_step(
    tiered: &TieredStore,
    job: &str,
    step: u64,
    world: u32,
    big: bool,
) -> Manifest {
    let mut parts = Vec::new();
    for rank in 0..world {
        let staging = tiered.prepare_staging(job, rank, 1).await.expect("staging");
        write_staging(&staging, (step as u8).wrapping_add(rank as u8), big);
        let part = tiered
            .commit_part(
                job,
                step,
                rank,
                1,
                &staging,
                serde_json::json!({"rank": rank}),
            )
            .await
            .expect("commit part");
        parts.push(part);
    }
    let manifest = Manifest {
        format_version: MANIFEST_FORMAT_VERSION,
        job_id: job.into(),
        step,
        world_size: world,
        committed_at_ms: 1,
        parts,
    };
    tiered.write_manifest(&manifest).await.expect("manifest");
    manifest
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_verify_latest_restore_prune() {
    let server = start_s3();
    let l2 = store(&server, "ckpt-bucket", true).await;
    l2.check_access().await.expect("bucket is reachable");
    let l1_dir = tempfile::tempdir().expect("tempdir");
    let tiered = TieredStore::new(
        LocalStore::new(l1_dir.path()),
        l2.clone(),
        CommitTier::L2,
        2,
    );
    let job = "job-000001";

    // Step 1 with a multipart file (12 MiB over 5 MiB parts), steps 2..4 small.
    let first = commit_step(&tiered, job, 1, 2, true).await;
    assert_eq!(
        l2.verify_step(job, 1).await.expect("step 1 verifies"),
        first
    );
    tiered.write_latest(job, 1).await.expect("latest 1");
    for step in 2..=4 {
        commit_step(&tiered, job, step, 2, false).await;
        tiered.write_latest(job, step).await.expect("latest");
    }
    assert_eq!(l2.read_latest(job).await.expect("read"), Some(4));
    assert_eq!(l2.list_steps(job).await.expect("list"), vec![1, 2, 3, 4]);

    // A stale writer cannot move LATEST back past a step that verifies.
    let refused = l2.write_latest(job, 2).await;
    assert!(
        matches!(
            refused,
            Err(CkptError::Remote {
                kind: RemoteKind::Changed,
                ..
            })
        ),
        "{refused:?}"
    );
    assert_eq!(l2.read_latest(job).await.expect("read"), Some(4));

    // L1 keeps the newest two steps of each rank.
    let l1 = LocalStore::new(l1_dir.path());
    assert_eq!(l1.list_steps(job).await.expect("l1 steps"), vec![3, 4]);

    // Cross-machine resume: step 1's part is gone from L1; it is restored from L2 and verified.
    let part = first.parts[1].clone();
    let path = tiered.resume_part_path(job, &part).await.expect("restored");
    l1.verify_part(job, &part)
        .await
        .expect("restored copy verifies");
    let original: Vec<u8> = (0..12 * 1024 * 1024 + 17)
        .map(|i| (i % 251) as u8 ^ 2)
        .collect();
    assert_eq!(
        std::fs::read(path.join("opt/weights.bin")).expect("read"),
        original
    );

    // An object changed under us: same size and metadata, other bytes → restore refuses.
    let key = format!("runs/a/{job}/step-00000001/rank-0/attempt-1/state.json");
    let head = l2
        .client()
        .head_object()
        .bucket("ckpt-bucket")
        .key(&key)
        .send()
        .await
        .expect("head");
    let size = head.content_length().expect("size") as usize;
    l2.client()
        .put_object()
        .bucket("ckpt-bucket")
        .key(&key)
        .set_metadata(head.metadata().cloned())
        .body(vec![b' '; size].into())
        .send()
        .await
        .expect("overwrite");
    let other = tempfile::tempdir().expect("tempdir");
    let fresh = TieredStore::new(LocalStore::new(other.path()), l2.clone(), CommitTier::L2, 2);
    let damaged = fresh.resume_part_path(job, &first.parts[0]).await;
    assert!(
        matches!(damaged, Err(CkptError::Corrupt { .. })),
        "{damaged:?}"
    );

    // Retention: steps older than LATEST and not kept are deleted, manifests included.
    let deleted = l2.prune(job, &[3, 4]).await.expect("prune");
    assert_eq!(deleted, vec![1, 2]);
    assert_eq!(l2.list_steps(job).await.expect("list"), vec![3, 4]);
    assert!(matches!(
        l2.read_manifest(job, 2).await,
        Err(CkptError::NotFound { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clear_errors() {
    let server = start_s3();
    let missing = store(&server, "no-such-bucket", false).await;
    let error = missing.check_access().await.expect_err("missing bucket");
    assert!(
        matches!(
            error,
            CkptError::Remote {
                kind: RemoteKind::NoSuchBucket,
                ..
            }
        ),
        "{error}"
    );

    let mut wrong = settings(server.port);
    wrong.secret_access_key = Some("wrong-secret".into());
    let client = wrong.client().await.expect("client");
    let bad = S3Store::new(
        client,
        wrong,
        S3Location::parse("s3://any-bucket").expect("loc"),
    );
    let error = bad.check_access().await.expect_err("bad credentials");
    assert!(
        matches!(
            error,
            CkptError::Remote {
                kind: RemoteKind::BadCredentials,
                ..
            }
        ),
        "{error}"
    );

    let port = server.port;
    drop(server);
    let mut gone = settings(port);
    gone.retry_deadline_ms = 300;
    let client = gone.client().await.expect("client");
    let unreachable = S3Store::new(
        client,
        gone,
        S3Location::parse("s3://any-bucket").expect("loc"),
    );
    let error = unreachable.check_access().await.expect_err("unreachable");
    assert!(
        matches!(
            error,
            CkptError::Remote {
                kind: RemoteKind::Unreachable,
                ..
            }
        ),
        "{error}"
    );
    assert!(
        error.to_string().contains(&format!("127.0.0.1:{port}")),
        "{error}"
    );
}
