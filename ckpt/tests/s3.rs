//! The S3 tier against a real S3 server: `s3s-fs` started on a loopback port per test
//! (`cumulus-s3-test`; `scripts/setup.sh` installs the binary).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use axum::http::Method;
use cumulus_s3_test::{ACCESS_KEY, S3TestServer, SECRET_KEY};

use cumulus_ckpt::{
    CheckpointStore, CkptError, CommitTier, DatasetCache, FileEntry, LEGACY_SHA256_METADATA_KEY,
    LocalStore, MANIFEST_FORMAT_VERSION, Manifest, PartRecord, RemoteKind, S3Connector, S3Location,
    S3Settings, S3Store, TieredStore, part_dir_rel, staging_dir_rel,
};

mod support;
use support::{FaultProxy, Rule};

/// A real `s3s-fs` on a loopback port (the workspace's one harness); killed on drop.
fn start_s3() -> S3TestServer {
    S3TestServer::start().expect("s3s-fs")
}

fn settings(port: u16) -> S3Settings {
    S3Settings {
        endpoint_url: Some(format!("http://127.0.0.1:{port}")),
        force_path_style: true,
        access_key_id: Some(ACCESS_KEY.into()),
        secret_access_key: Some(SECRET_KEY.into()),
        multipart_threshold_bytes: 5 * 1024 * 1024,
        part_size_bytes: 5 * 1024 * 1024,
        retry_deadline_ms: 2_000,
        ..S3Settings::default()
    }
}

async fn store(server: &S3TestServer, bucket: &str, create: bool) -> S3Store {
    store_at(settings(server.port()), bucket, create).await
}

/// A store of `s3://<bucket>/runs/a` with `settings` (creating the bucket when `create`).
async fn store_at(settings: S3Settings, bucket: &str, create: bool) -> S3Store {
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
    let tiered = l2_tiered(&l2, l1_dir.path(), 2);
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
    let fresh = l2_tiered(&l2, other.path(), 2);
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

    // An object uploaded for a format-1 manifest (bare hex SHA-256 in `x-amz-meta-sha256`)
    // still verifies by HEAD and restores, checked against its `sha256:` digest.
    let body = b"weights of a format-1 step".to_vec();
    let hex = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&body));
    let legacy = PartRecord {
        rank: 0,
        attempt: 1,
        dir: part_dir_rel(9, 0, 1),
        files: vec![FileEntry {
            path: "w.bin".into(),
            size_bytes: body.len() as u64,
            digest: format!("sha256:{hex}"),
        }],
        state: serde_json::json!({}),
    };
    l2.client()
        .put_object()
        .bucket("ckpt-bucket")
        .key(format!("runs/a/{job}/{}/w.bin", legacy.dir))
        .metadata(LEGACY_SHA256_METADATA_KEY, &hex)
        .body(body.clone().into())
        .send()
        .await
        .expect("put a format-1 object");
    l2.verify_part(job, &legacy)
        .await
        .expect("format-1 object verifies");
    let restored = tempfile::tempdir().expect("tempdir");
    let dest = restored.path().join("part");
    l2.restore_part(job, &legacy, &dest)
        .await
        .expect("format-1 object restores");
    assert_eq!(std::fs::read(dest.join("w.bin")).expect("read"), body);
    let mut wrong = legacy.clone();
    wrong.files[0].digest = format!("sha256:{}", "0".repeat(64));
    assert!(matches!(
        l2.verify_part(job, &wrong).await,
        Err(CkptError::Corrupt { .. })
    ));

    // Deleting the job (`cumulusctl delete --checkpoints`): every object under its
    // prefix, LATEST first; another job's objects stay.
    commit_step(&tiered, "job-000002", 1, 1, false).await;
    assert!(l2.delete_job(job).await.expect("delete"));
    assert_eq!(l2.list_steps(job).await.expect("list"), Vec::<u64>::new());
    assert_eq!(l2.read_latest(job).await.expect("latest"), None);
    assert_eq!(
        l2.list_steps("job-000002").await.expect("list"),
        vec![1],
        "the other job is untouched"
    );
    assert!(!l2.delete_job(job).await.expect("nothing left"));
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

    let mut wrong = settings(server.port());
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

    let port = server.port();
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

/// A part uploaded in the background after L2 moved past its step (commit tier `l1`) is
/// deleted again; parts of steps that may still be mirrored, or were, are kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_uploaded_after_l2_moved_past_its_step_is_discarded() {
    let server = start_s3();
    let l2 = store(&server, "ckpt-bucket", true).await;
    let l1_dir = tempfile::tempdir().expect("tempdir");
    let tiered = l2_tiered(&l2, l1_dir.path(), 4);
    let job = "job-000001";
    let first = commit_step(&tiered, job, 1, 1, false).await;
    tiered.write_latest(job, 1).await.expect("latest 1");
    // Step 2: a part in L2, no manifest (its upload is the straggler).
    let late = commit_one(&tiered, job, 2, 1, 7, false)
        .await
        .expect("part of step 2");
    assert!(
        !l2.discard_part_if_superseded(job, &late)
            .await
            .expect("check"),
        "LATEST is older: step 2 may still be mirrored"
    );
    commit_step(&tiered, job, 3, 1, false).await;
    tiered.write_latest(job, 3).await.expect("latest 3");
    assert!(
        !l2.discard_part_if_superseded(job, &first.parts[0])
            .await
            .expect("check"),
        "step 1 has a manifest"
    );
    assert!(
        l2.discard_part_if_superseded(job, &late)
            .await
            .expect("check"),
        "step 2 was passed over"
    );
    assert_eq!(l2.list_steps(job).await.expect("list"), vec![1, 3]);
    l2.verify_step(job, 1).await.expect("step 1 intact");
    l2.verify_step(job, 3).await.expect("step 3 intact");
}

/// The dataset cache never evicts a shard a running rank holds (pinned); when the pinned
/// shards leave no room, a fetch fails with a clear error instead of exceeding the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_dataset_shards_are_never_evicted() {
    let server = start_s3();
    let l2 = store(&server, "data-bucket", true).await;
    for name in ["a", "b", "c"] {
        l2.client()
            .put_object()
            .bucket("data-bucket")
            .key(format!("shards/{name}.txt"))
            .body(vec![name.as_bytes()[0]; 1000].into())
            .send()
            .await
            .expect("put shard");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let connector = S3Connector::new(settings(server.port())).expect("connector");
    // Room for two shards.
    let cache = std::sync::Arc::new(DatasetCache::new(dir.path(), 2_500, connector));
    let url = |name: &str| format!("s3://data-bucket/shards/{name}.txt");
    let (a, pin_a) = cache.fetch_pinned(&url("a")).await.expect("a");
    let (b, pin_b) = cache.fetch_pinned(&url("b")).await.expect("b");
    assert!(!a.hit && !b.hit);
    let refused = cache.fetch_pinned(&url("c")).await;
    assert!(
        matches!(&refused, Err(CkptError::Invalid(m)) if m.contains("pinned")),
        "{refused:?}"
    );
    assert!(a.path.is_file() && b.path.is_file(), "pinned shards stay");
    // Once a is unpinned it is the one evicted for c; b, still pinned, stays.
    drop(pin_a);
    let (c, _pin_c) = cache.fetch_pinned(&url("c")).await.expect("c");
    assert!(!c.hit && c.path.is_file());
    assert!(!a.path.exists(), "unpinned a was evicted");
    assert!(b.path.is_file());
    let (b_again, _pin_b2) = cache.fetch_pinned(&url("b")).await.expect("b again");
    assert!(b_again.hit, "b was never evicted");
    drop(pin_b);
}

/// A tiered store committing at L2 on `l2`, with L1 under `l1_root` keeping
/// `l1_keep_steps` parts per rank.
fn l2_tiered(l2: &S3Store, l1_root: &Path, l1_keep_steps: usize) -> TieredStore {
    TieredStore::new(
        LocalStore::new(l1_root),
        l2.clone(),
        CommitTier::L2,
        l1_keep_steps,
    )
}

/// The bytes [`write_staging`] writes to `opt/weights.bin` of a big part with `seed`.
fn big_weights(seed: u8) -> Vec<u8> {
    (0..12 * 1024 * 1024 + 17)
        .map(|i| (i % 251) as u8 ^ seed)
        .collect()
}

/// Request path (bucket included) of the part of `rank` at `step`, attempt `attempt`.
fn part_path(job: &str, step: u64, rank: u32, attempt: u32) -> String {
    format!("/ckpt-bucket/runs/a/{job}/step-{step:08}/rank-{rank}/attempt-{attempt}/")
}

/// Commits one part of `job` at `step` (rank 0) through `tiered`, staging `seed`'s files.
async fn commit_one(
    tiered: &TieredStore,
    job: &str,
    step: u64,
    attempt: u32,
    seed: u8,
    big: bool,
) -> Result<cumulus_ckpt::PartRecord, CkptError> {
    let staging = tiered
        .prepare_staging(job, 0, attempt)
        .await
        .expect("staging");
    write_staging(&staging, seed, big);
    tiered
        .commit_part(
            job,
            step,
            0,
            attempt,
            &staging,
            serde_json::json!({"rank": 0}),
        )
        .await
}

/// A real s3s-fs behind a [`FaultProxy`], an L2 store through the proxy (bucket
/// `ckpt-bucket`, created) with a 120 s retry deadline so that any retry would be visible,
/// and a tiered store committing at L2 over a fresh L1 directory.
struct ProxiedTiers {
    /// Kept for the test's lifetime (dropping it stops the server).
    _server: S3TestServer,
    proxy: FaultProxy,
    l2: S3Store,
    l1_dir: tempfile::TempDir,
    tiered: TieredStore,
}

async fn proxied_tiers() -> ProxiedTiers {
    let server = start_s3();
    let proxy = FaultProxy::start(server.port()).await;
    let mut patient = settings(proxy.port());
    patient.retry_deadline_ms = 120_000;
    let l2 = store_at(patient, "ckpt-bucket", true).await;
    let l1_dir = tempfile::tempdir().expect("tempdir");
    let tiered = l2_tiered(&l2, l1_dir.path(), 8);
    ProxiedTiers {
        _server: server,
        proxy,
        l2,
        l1_dir,
        tiered,
    }
}

/// 503 SlowDown in front of a real s3s-fs: a few are retried with backoff and the commit
/// succeeds; throttling past the retry deadline is `Throttled`, names throttling, reports
/// nothing committed and aborts a multipart upload it started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_down_is_retried_then_reported_as_throttling() {
    let ProxiedTiers {
        _server,
        proxy,
        l2,
        l1_dir,
        tiered,
    } = proxied_tiers().await;
    let job = "job-000001";

    // The first 3 PUTs of step 1's part (multipart parts of weights.bin or state.json).
    let step1 = part_path(job, 1, 0, 1);
    proxy.add(Rule::slow_down(Method::PUT, &step1).times(3));
    let manifest = commit_step(&tiered, job, 1, 1, true).await;
    let puts = |status: u16| {
        proxy.count(|s| {
            s.method == Method::PUT && s.path_and_query.contains(&step1) && s.status == status
        })
    };
    assert_eq!(puts(503), 3, "{:#?}", proxy.seen());
    assert_eq!(proxy.count(|s| s.injected), 3, "only injected 503s");
    // 3 multipart parts and state.json, each accepted once.
    assert_eq!(puts(200), 4, "{:#?}", proxy.seen());
    let part = &manifest.parts[0];
    l2.verify_part(job, part).await.expect("the part verifies");
    let other = tempfile::tempdir().expect("tempdir");
    let fresh = l2_tiered(&l2, other.path(), 2);
    let restored = fresh.resume_part_path(job, part).await.expect("restored");
    assert_eq!(
        std::fs::read(restored.join("opt/weights.bin")).expect("read"),
        big_weights(1)
    );

    // Throttled for longer than the retry deadline: a clear, typed error.
    let mut impatient = settings(proxy.port());
    impatient.retry_deadline_ms = 1_500;
    let short = store_at(impatient, "ckpt-bucket", false).await;
    let tiered = l2_tiered(&short, l1_dir.path(), 8);
    let state = format!("{}state.json", part_path(job, 2, 0, 1));
    proxy.add(Rule::slow_down(Method::PUT, &state));
    let started = Instant::now();
    let error = commit_one(&tiered, job, 2, 1, 2, false)
        .await
        .expect_err("throttled past the deadline");
    assert!(
        started.elapsed() >= Duration::from_millis(1_500),
        "retried until the deadline, not less: {:?}",
        started.elapsed()
    );
    match &error {
        CkptError::Remote {
            op: "put",
            url,
            kind: RemoteKind::Throttled,
            ..
        } => assert_eq!(url, &format!("s3:/{state}")),
        other => panic!("{other:?}"),
    }
    let text = error.to_string();
    assert!(
        text.contains("throttled")
            && text.contains("HTTP 503 SlowDown: Please reduce your request rate.")
            && text.contains("gave up after")
            && !text.contains("SdkBody"),
        "{text}"
    );
    let throttled = proxy.count(|s| s.path_and_query.contains(&state) && s.status == 503);
    assert!(throttled >= 3, "retried with backoff: {throttled} attempts");
    assert!(
        !short
            .list_objects()
            .await
            .expect("list")
            .iter()
            .any(|k| state.ends_with(k.as_str())),
        "a throttled object must not exist"
    );

    // A multipart upload throttled past the deadline is aborted.
    let step3 = part_path(job, 3, 0, 1);
    proxy.add(Rule::slow_down(
        Method::PUT,
        &format!("{step3}opt/weights.bin?"),
    ));
    let error = commit_one(&tiered, job, 3, 1, 3, true)
        .await
        .expect_err("throttled past the deadline");
    assert!(
        matches!(
            error,
            CkptError::Remote {
                op: "upload part",
                kind: RemoteKind::Throttled,
                ..
            }
        ),
        "{error:?}"
    );
    assert_eq!(
        proxy.count(|s| s.method == Method::DELETE
            && s.path_and_query.contains(&step3)
            && s.path_and_query.contains("uploadId=")
            && s.status == 204),
        1,
        "the upload is aborted: {:#?}",
        proxy.seen()
    );

    // Once the throttling ends, the rank's next attempt commits.
    proxy.clear();
    let part = commit_one(&tiered, job, 2, 2, 2, false)
        .await
        .expect("commits after throttling");
    short.verify_part(job, &part).await.expect("verifies");
}

/// 403 AccessDenied in front of a real s3s-fs: permanent, returned at once (one request
/// per attempt, no retries), naming access denied and the object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_denied_is_permanent_and_named() {
    // A retry would be visible: nothing here may wait for the 120 s deadline.
    let ProxiedTiers {
        _server,
        proxy,
        l2,
        l1_dir,
        tiered,
    } = proxied_tiers().await;
    let job = "job-000001";

    // A single PUT.
    let state = format!("{}state.json", part_path(job, 1, 0, 1));
    proxy.add(Rule::access_denied(Method::PUT, &state));
    let started = Instant::now();
    let error = commit_one(&tiered, job, 1, 1, 1, false)
        .await
        .expect_err("access denied");
    match &error {
        CkptError::Remote {
            op: "put",
            url,
            kind: RemoteKind::AccessDenied,
            ..
        } => assert_eq!(url, &format!("s3:/{state}")),
        other => panic!("{other:?}"),
    }
    let text = error.to_string();
    assert!(
        text.contains("access denied")
            && text.contains("HTTP 403 AccessDenied: Access Denied")
            && text.contains(&format!("s3:/{state}"))
            && !text.contains("gave up")
            && !text.contains("SdkBody"),
        "{text}"
    );
    assert_eq!(
        proxy.count(|s| s.path_and_query.contains(&state)),
        1,
        "no retry: {:#?}",
        proxy.seen()
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "returned at once, not after the retry deadline"
    );
    // The L1 commit that ran beside the upload had finished before the error came back:
    // the part is in L1 and the staging directory is there again, empty, for the next try.
    let l1 = LocalStore::new(l1_dir.path());
    let part_dir = l1.job_dir(job).join(part_dir_rel(1, 0, 1));
    assert!(
        part_dir.join("state.json").is_file(),
        "the L1 part is there"
    );
    let staging = l1.job_dir(job).join(staging_dir_rel(0, 1));
    assert_eq!(
        std::fs::read_dir(&staging).expect("staging exists").count(),
        0,
        "staging is empty"
    );

    // Multipart: each denied part request is sent once, and the upload is aborted.
    let weights = format!("{}opt/weights.bin", part_path(job, 2, 0, 1));
    proxy.add(Rule::access_denied(Method::PUT, &format!("{weights}?")));
    let error = commit_one(&tiered, job, 2, 1, 2, true)
        .await
        .expect_err("access denied");
    assert!(
        matches!(
            error,
            CkptError::Remote {
                op: "upload part",
                kind: RemoteKind::AccessDenied,
                ..
            }
        ),
        "{error:?}"
    );
    let denied: Vec<_> = proxy
        .seen()
        .into_iter()
        .filter(|s| s.method == Method::PUT && s.path_and_query.contains(&weights))
        .collect();
    assert!(!denied.is_empty());
    for request in &denied {
        assert_eq!(request.status, 403);
        assert_eq!(
            denied
                .iter()
                .filter(|s| s.path_and_query == request.path_and_query)
                .count(),
            1,
            "no retry of {}",
            request.path_and_query
        );
    }
    assert_eq!(
        proxy.count(|s| s.method == Method::DELETE
            && s.path_and_query.contains(&weights)
            && s.status == 204),
        1,
        "the upload is aborted: {:#?}",
        proxy.seen()
    );

    // A HEAD (no error document, only the status): verify_part is denied, once.
    proxy.clear();
    let part = commit_one(&tiered, job, 3, 1, 3, false)
        .await
        .expect("commits");
    let state = format!("{}state.json", part_path(job, 3, 0, 1));
    let heads = || proxy.count(|s| s.method == Method::HEAD && s.path_and_query.contains(&state));
    let heads_before = heads();
    proxy.add(Rule::access_denied(Method::HEAD, &state).times(1));
    let error = l2.verify_part(job, &part).await.expect_err("access denied");
    assert!(
        matches!(
            error,
            CkptError::Remote {
                kind: RemoteKind::AccessDenied,
                ..
            }
        ),
        "{error:?}"
    );
    assert!(
        error.to_string().contains(&format!("s3:/{state}")),
        "{error}"
    );
    assert_eq!(heads(), heads_before + 1, "no retry: {:#?}", proxy.seen());
    l2.verify_part(job, &part)
        .await
        .expect("verifies once allowed");
}

/// An object that changed under us (a foreign overwrite) is refused by verify, verify_step
/// and resume; a `LATEST` writer racing another one (a real 412 from s3s-fs on `If-Match`)
/// re-reads, moves forward when it still may, and refuses to move `LATEST` backwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changed_objects_and_latest_races_are_refused() {
    let ProxiedTiers {
        _server,
        proxy,
        l2,
        l1_dir: _l1_dir,
        tiered,
    } = proxied_tiers().await;
    let job = "job-000001";
    let mut manifests = Vec::new();
    for step in 1..=5 {
        manifests.push(commit_step(&tiered, job, step, 1, false).await);
    }
    tiered.write_latest(job, 1).await.expect("latest 1");

    // Someone else overwrites a file of step 1's part (other bytes, no digest metadata).
    let key = format!("runs/a/{job}/step-00000001/rank-0/attempt-1/opt/weights.bin");
    l2.client()
        .put_object()
        .bucket("ckpt-bucket")
        .key(&key)
        .body(b"not the checkpoint".to_vec().into())
        .send()
        .await
        .expect("overwrite");
    let part = &manifests[0].parts[0];
    let refused = [
        l2.verify_part(job, part).await.map(|_| ()),
        l2.verify_step(job, 1).await.map(|_| ()),
        {
            let other = tempfile::tempdir().expect("tempdir");
            let fresh = l2_tiered(&l2, other.path(), 2);
            fresh.resume_part_path(job, part).await.map(|_| ())
        },
    ];
    for result in refused {
        match result {
            Err(CkptError::Corrupt { path, .. }) => {
                assert_eq!(path, PathBuf::from(format!("s3://ckpt-bucket/{key}")))
            }
            other => panic!("a changed object must be refused: {other:?}"),
        }
    }

    // Race 1: A reads LATEST = 1 and sends its conditional PUT (held); B moves LATEST to 2;
    // A's PUT gets 412, A re-reads 2 < 3 and moves LATEST forward to 3.
    let (rule, gate) = Rule::hold(Method::PUT, &format!("/{job}/LATEST"));
    proxy.add(rule);
    let a = tokio::spawn({
        let l2 = l2.clone();
        async move { l2.write_latest(job, 3).await }
    });
    gate.wait_arrived(Duration::from_secs(60)).await;
    l2.write_latest(job, 2).await.expect("B moves LATEST to 2");
    gate.release();
    a.await
        .expect("task")
        .expect("A re-reads and moves LATEST to 3");
    assert_eq!(l2.read_latest(job).await.expect("read"), Some(3));
    let precondition_failed =
        || proxy.count(|s| s.path_and_query.contains("/LATEST?") && s.status == 412);
    assert_eq!(precondition_failed(), 1, "{:#?}", proxy.seen());

    // Race 2: A reads LATEST = 3 and sends its PUT for 4 (held); B moves LATEST to 5, which
    // verifies; A's PUT gets 412 and A refuses to move LATEST back from 5 to 4.
    let (rule, gate) = Rule::hold(Method::PUT, &format!("/{job}/LATEST"));
    proxy.add(rule);
    let a = tokio::spawn({
        let l2 = l2.clone();
        async move { l2.write_latest(job, 4).await }
    });
    gate.wait_arrived(Duration::from_secs(60)).await;
    l2.write_latest(job, 5).await.expect("B moves LATEST to 5");
    gate.release();
    let refused = a.await.expect("task");
    match &refused {
        Err(
            error @ CkptError::Remote {
                op: "put LATEST",
                kind: RemoteKind::Changed,
                ..
            },
        ) => assert!(
            error.to_string().contains("refusing to move it back"),
            "{error}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(precondition_failed(), 2, "{:#?}", proxy.seen());
    assert_eq!(l2.read_latest(job).await.expect("read"), Some(5));
}
