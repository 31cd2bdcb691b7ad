//! Tests of `LocalStore` against real files in temporary directories.

use std::fs;
use std::path::{Path, PathBuf};

use cumulus_ckpt::{
    CheckpointStore, CkptError, DigestAlgorithm, Durability, LATEST_FILE, LocalStore,
    MANIFEST_FILE, MANIFEST_FORMAT_VERSION, MAX_PART_FILES, MAX_STATE_JSON_BYTES, Manifest,
    PartRecord, hash_file, newest_valid_step, parse_step_dir_name, part_dir_rel, staging_dir_rel,
    step_dir_name,
};
use proptest::prelude::*;
use serde_json::json;
use sha2::{Digest, Sha256};

const JOB: &str = "job-000001";

/// The digest agents write: `blake3:<hex>`.
fn digest_of(bytes: &[u8]) -> String {
    let mut hasher = DigestAlgorithm::Blake3.hasher();
    hasher.update(bytes);
    hasher.finalize()
}

/// A format-1 digest: `sha256:<hex>`.
fn sha256_of(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// (path, size, digest) of every file of `part`, in the record's order.
fn listed_files(part: &PartRecord) -> Vec<(&str, u64, String)> {
    part.files
        .iter()
        .map(|f| (f.path.as_str(), f.size_bytes, f.digest.clone()))
        .collect()
}

fn read_dir_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .expect("read dir")
        .map(|entry| {
            entry
                .expect("entry")
                .file_name()
                .into_string()
                .expect("utf-8")
        })
        .collect();
    names.sort();
    names
}

/// Writes `files` into the staging dir of (rank, attempt) and commits them as part of `step`.
async fn commit(
    store: &LocalStore,
    step: u64,
    rank: u32,
    attempt: u32,
    files: &[(&str, &[u8])],
) -> Result<PartRecord, CkptError> {
    let staging = store.prepare_staging(JOB, rank, attempt).await?;
    for (path, content) in files {
        let path = staging.join(path);
        fs::create_dir_all(path.parent().expect("has parent")).expect("mkdir");
        fs::write(&path, content).expect("write");
    }
    store
        .commit_part(
            JOB,
            step,
            rank,
            attempt,
            &staging,
            json!({"step": step, "rank": rank}),
        )
        .await
}

/// Commits a full step (2 ranks, attempt 1) with manifest; content depends on the step.
async fn full_step(store: &LocalStore, step: u64) -> Manifest {
    let mut parts = Vec::new();
    for rank in 0..2 {
        let weights = format!("weights of step {step} rank {rank}").into_bytes();
        let part = commit(
            store,
            step,
            rank,
            1,
            &[("model.bin", &weights), ("opt/state.bin", b"optimizer")],
        )
        .await
        .expect("commit part");
        parts.push(part);
    }
    let manifest = Manifest {
        format_version: MANIFEST_FORMAT_VERSION,
        job_id: JOB.into(),
        step,
        world_size: 2,
        committed_at_ms: 1_700_000_000_000 + step,
        parts,
    };
    store
        .write_manifest(&manifest)
        .await
        .expect("write manifest");
    manifest
}

fn part_file(store: &LocalStore, step: u64, rank: u32, rel: &str) -> PathBuf {
    store
        .job_dir(JOB)
        .join(part_dir_rel(step, rank, 1))
        .join(rel)
}

#[tokio::test]
async fn commit_and_verify_round_trip() {
    let root = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(root.path());

    let staging = store.prepare_staging(JOB, 0, 1).await.expect("staging");
    assert_eq!(staging, store.job_dir(JOB).join(staging_dir_rel(0, 1)));
    assert!(staging.is_dir());
    fs::write(staging.join("model.bin"), b"weights").expect("write");
    fs::create_dir_all(staging.join("sub/deeper")).expect("mkdir");
    fs::write(staging.join("sub/deeper/x.json"), b"{}").expect("write");
    fs::write(staging.join("empty"), b"").expect("write");

    let part = store
        .commit_part(JOB, 100, 0, 1, &staging, json!({"shard": 2, "record": 17}))
        .await
        .expect("commit");
    assert_eq!(part.dir, "step-00000100/rank-0/attempt-1");
    assert_eq!(part.rank, 0);
    assert_eq!(part.attempt, 1);
    assert_eq!(part.state, json!({"shard": 2, "record": 17}));
    let listed = listed_files(&part);
    assert_eq!(
        listed,
        vec![
            ("empty", 0, digest_of(b"")),
            ("model.bin", 7, digest_of(b"weights")),
            ("sub/deeper/x.json", 2, digest_of(b"{}")),
        ]
    );
    // The staging dir is back, empty; the part holds the files.
    assert!(staging.is_dir());
    assert!(read_dir_names(&staging).is_empty());
    let part_path = store.local_part_path(JOB, &part.dir).expect("local path");
    assert_eq!(
        fs::read(part_path.join("sub/deeper/x.json")).expect("read"),
        b"{}"
    );
    assert_eq!(
        hash_file(&part_path.join("model.bin")).expect("hash"),
        (7, digest_of(b"weights"))
    );
    store.verify_part(JOB, &part).await.expect("verify part");
    store.check_part(JOB, &part).await.expect("check part");

    // A record of manifest format 1 (SHA-256 digests) still verifies, and a wrong one fails.
    let mut legacy = part.clone();
    for (file, content) in legacy
        .files
        .iter_mut()
        .zip([&b""[..], &b"weights"[..], &b"{}"[..]])
    {
        file.digest = sha256_of(content);
    }
    store
        .verify_part(JOB, &legacy)
        .await
        .expect("format-1 record verifies");
    legacy.files[1].digest = sha256_of(b"weighty");
    assert!(matches!(
        store.verify_part(JOB, &legacy).await,
        Err(CkptError::Corrupt { .. })
    ));
    // The finalize check reads no content: it passes a wrong digest, and fails a wrong size.
    store.check_part(JOB, &legacy).await.expect("sizes match");
    legacy.files[1].size_bytes += 1;
    assert!(matches!(
        store.check_part(JOB, &legacy).await,
        Err(CkptError::Corrupt { .. })
    ));

    let manifest = Manifest {
        format_version: MANIFEST_FORMAT_VERSION,
        job_id: JOB.into(),
        step: 100,
        world_size: 1,
        committed_at_ms: 5,
        parts: vec![part],
    };
    store
        .write_manifest(&manifest)
        .await
        .expect("write manifest");
    assert_eq!(store.read_manifest(JOB, 100).await.expect("read"), manifest);
    assert_eq!(
        store.verify_step(JOB, 100).await.expect("verify step"),
        manifest
    );
    assert_eq!(manifest.total_bytes(), 9);
    assert_eq!(store.list_steps(JOB).await.expect("list"), vec![100]);
    // No temp file is left next to the manifest.
    assert_eq!(
        read_dir_names(&store.job_dir(JOB).join("step-00000100")),
        vec![MANIFEST_FILE, "rank-0"]
    );
    assert_eq!(
        newest_valid_step(&store, JOB, &[100])
            .await
            .expect("newest")
            .map(|m| m.step),
        Some(100)
    );
}

#[tokio::test]
async fn a_cache_commit_records_the_same_part_as_a_durable_one() {
    let root = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(root.path());
    let mut records = Vec::new();
    for (attempt, durability) in [(1, Durability::Durable), (2, Durability::Cache)] {
        let staging = store
            .prepare_staging(JOB, 0, attempt)
            .await
            .expect("staging");
        fs::write(staging.join("model.bin"), vec![9u8; 5 << 20]).expect("write");
        fs::create_dir_all(staging.join("opt")).expect("mkdir");
        fs::write(staging.join("opt/state.json"), b"{}").expect("write");
        let part = store
            .clone()
            .with_durability(durability)
            .commit_part(JOB, 1, 0, attempt, &staging, json!({}))
            .await
            .expect("commit");
        assert!(
            read_dir_names(&staging).is_empty(),
            "staging is back, empty"
        );
        store.verify_part(JOB, &part).await.expect("verifies");
        records.push(part.files);
    }
    assert_eq!(records[0], records[1]);
    assert_eq!(records[1][0].digest, digest_of(&vec![9u8; 5 << 20]));
}

#[tokio::test]
async fn torn_steps_are_never_chosen() {
    let root = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(root.path());
    full_step(&store, 1).await;

    // Step 2: rank 0 committed, rank 1 wrote its staging but never renamed; no manifest.
    commit(&store, 2, 0, 1, &[("model.bin", b"w")])
        .await
        .expect("commit rank 0");
    let staging = store.prepare_staging(JOB, 1, 1).await.expect("staging");
    fs::write(staging.join("model.bin"), b"half").expect("write");
    // Step 3: a crashed temp dir of a part in the DESIGN.md style.
    let temp = store.job_dir(JOB).join("step-00000003.tmp-0123");
    fs::create_dir_all(temp.join("rank-0")).expect("mkdir");
    fs::write(temp.join("rank-0/model.bin"), b"x").expect("write");

    let steps = store.list_steps(JOB).await.expect("list");
    assert_eq!(steps, vec![1, 2]);
    assert!(matches!(
        store.verify_step(JOB, 2).await,
        Err(CkptError::NotFound { .. })
    ));
    let newest = newest_valid_step(&store, JOB, &[2, 3, 1, 2])
        .await
        .expect("newest");
    assert_eq!(newest.map(|m| m.step), Some(1));
    assert!(
        newest_valid_step(&store, JOB, &[])
            .await
            .expect("newest")
            .is_none()
    );
    assert!(
        newest_valid_step(&store, JOB, &[2, 3])
            .await
            .expect("newest")
            .is_none()
    );
}

/// Damages step 2 in one way; verify_step(2) must fail as Corrupt (or NotFound) and
/// newest_valid_step must fall back to step 1.
async fn falls_back_after(damage: impl FnOnce(&LocalStore), expect_not_found: bool) {
    let root = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(root.path());
    let first = full_step(&store, 1).await;
    full_step(&store, 2).await;
    store
        .verify_step(JOB, 2)
        .await
        .expect("step 2 valid before the damage");
    damage(&store);
    let error = store
        .verify_step(JOB, 2)
        .await
        .expect_err("damaged step must not verify");
    if expect_not_found {
        assert!(matches!(error, CkptError::NotFound { .. }), "{error}");
    } else {
        assert!(matches!(error, CkptError::Corrupt { .. }), "{error}");
    }
    let steps = store.list_steps(JOB).await.expect("list");
    assert_eq!(
        newest_valid_step(&store, JOB, &steps)
            .await
            .expect("newest"),
        Some(first)
    );
}

#[tokio::test]
async fn flipped_byte_is_detected() {
    falls_back_after(
        |store| {
            let path = part_file(store, 2, 1, "model.bin");
            let mut bytes = fs::read(&path).expect("read");
            bytes[0] ^= 0x01;
            fs::write(&path, bytes).expect("write");
        },
        false,
    )
    .await;
}

#[tokio::test]
async fn truncated_file_is_detected() {
    falls_back_after(
        |store| {
            let path = part_file(store, 2, 0, "opt/state.bin");
            let file = fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .expect("open");
            file.set_len(3).expect("truncate");
        },
        false,
    )
    .await;
}

#[tokio::test]
async fn missing_file_is_detected() {
    falls_back_after(
        |store| fs::remove_file(part_file(store, 2, 1, "opt/state.bin")).expect("rm"),
        false,
    )
    .await;
}

#[tokio::test]
async fn missing_part_dir_is_detected() {
    falls_back_after(
        |store| fs::remove_dir_all(store.job_dir(JOB).join(part_dir_rel(2, 1, 1))).expect("rm"),
        false,
    )
    .await;
}

#[tokio::test]
async fn garbage_manifest_is_detected() {
    falls_back_after(
        |store| {
            fs::write(
                store.job_dir(JOB).join("step-00000002").join(MANIFEST_FILE),
                b"{not json",
            )
            .expect("write")
        },
        false,
    )
    .await;
}

#[tokio::test]
async fn truncated_manifest_is_detected() {
    falls_back_after(
        |store| {
            let path = store.job_dir(JOB).join("step-00000002").join(MANIFEST_FILE);
            let bytes = fs::read(&path).expect("read");
            fs::write(&path, &bytes[..bytes.len() / 2]).expect("write");
        },
        false,
    )
    .await;
}

#[tokio::test]
async fn manifest_of_another_step_is_detected() {
    falls_back_after(
        |store| {
            // A valid manifest copied to the wrong step.
            let from = store.job_dir(JOB).join("step-00000001").join(MANIFEST_FILE);
            let to = store.job_dir(JOB).join("step-00000002").join(MANIFEST_FILE);
            fs::copy(from, to).expect("copy");
        },
        false,
    )
    .await;
}

#[tokio::test]
async fn tampered_hash_in_manifest_is_detected() {
    falls_back_after(
        |store| {
            let path = store.job_dir(JOB).join("step-00000002").join(MANIFEST_FILE);
            let mut manifest: Manifest =
                serde_json::from_slice(&fs::read(&path).expect("read")).expect("parse");
            manifest.parts[0].files[0].digest = digest_of(b"something else");
            fs::write(&path, serde_json::to_vec(&manifest).expect("json")).expect("write");
        },
        false,
    )
    .await;
}

#[tokio::test]
async fn missing_manifest_is_not_found() {
    falls_back_after(
        |store| {
            fs::remove_file(store.job_dir(JOB).join("step-00000002").join(MANIFEST_FILE))
                .expect("rm")
        },
        true,
    )
    .await;
}

#[cfg(unix)]
#[tokio::test]
async fn symlinked_part_file_is_refused() {
    falls_back_after(
        |store| {
            // Replace a file by a symlink to an identical copy outside the part.
            let path = part_file(store, 2, 0, "model.bin");
            let outside = store.root().join("outside.bin");
            fs::copy(&path, &outside).expect("copy");
            fs::remove_file(&path).expect("rm");
            std::os::unix::fs::symlink(&outside, &path).expect("symlink");
        },
        false,
    )
    .await;
}

#[cfg(unix)]
#[tokio::test]
async fn symlinked_part_subdir_is_refused() {
    falls_back_after(
        |store| {
            let dir = part_file(store, 2, 1, "opt");
            let outside = store.root().join("outside-opt");
            fs::rename(&dir, &outside).expect("move");
            std::os::unix::fs::symlink(&outside, &dir).expect("symlink");
        },
        false,
    )
    .await;
}

#[tokio::test]
async fn latest_round_trip_and_corruption() {
    let root = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(root.path());
    assert_eq!(store.read_latest(JOB).await.expect("read"), None);
    assert!(matches!(
        store.write_latest(JOB, 5).await,
        Err(CkptError::NotFound { .. })
    ));

    full_step(&store, 5).await;
    full_step(&store, 123_456_789).await;
    store.write_latest(JOB, 5).await.expect("write");
    let path = store.job_dir(JOB).join(LATEST_FILE);
    assert_eq!(fs::read_to_string(&path).expect("read"), "step-00000005\n");
    assert_eq!(store.read_latest(JOB).await.expect("read"), Some(5));
    store.write_latest(JOB, 123_456_789).await.expect("write");
    assert_eq!(
        store.read_latest(JOB).await.expect("read"),
        Some(123_456_789)
    );
    // No temp file left behind.
    assert!(
        read_dir_names(&store.job_dir(JOB))
            .iter()
            .all(|name| !name.contains(".tmp"))
    );

    // DESIGN.md's form without the newline is accepted too.
    fs::write(&path, "step-00000005").expect("write");
    assert_eq!(store.read_latest(JOB).await.expect("read"), Some(5));

    for bad in [
        &b"garbage"[..],
        b"step-5\n",
        b"",
        b"step-00000005\n\n",
        b"\xff\xfe",
        &[b'7'; 100],
    ] {
        fs::write(&path, bad).expect("write");
        let result = store.read_latest(JOB).await;
        assert!(
            matches!(result, Err(CkptError::Corrupt { .. })),
            "{bad:?}: {result:?}"
        );
    }
}

#[tokio::test]
async fn prune_keeps_requested_latest_and_newer_steps() {
    let root = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(root.path());
    for step in 1..=5 {
        full_step(&store, step).await;
    }
    // Step 6 is in flight: one part committed, no manifest yet.
    commit(&store, 6, 0, 1, &[("model.bin", b"w")])
        .await
        .expect("commit");
    store.write_latest(JOB, 4).await.expect("latest");
    // Stale leftovers of crashed writes.
    let job_dir = store.job_dir(JOB);
    fs::write(job_dir.join("LATEST.tmp-00ff"), b"step-0000").expect("write");
    fs::create_dir_all(job_dir.join("step-00000009.tmp-prune-1/rank-0")).expect("mkdir");
    fs::write(
        job_dir.join("step-00000004").join("MANIFEST.json.tmp-abcd"),
        b"{",
    )
    .expect("write");

    // Without LATEST nothing is deleted (checked on a second job below); here LATEST = 4.
    let deleted = store.prune(JOB, &[2]).await.expect("prune");
    assert_eq!(deleted, vec![1, 3]);
    assert_eq!(store.list_steps(JOB).await.expect("list"), vec![2, 4, 5, 6]);
    assert_eq!(
        read_dir_names(&job_dir),
        vec![
            ".staging",
            LATEST_FILE,
            "step-00000002",
            "step-00000004",
            "step-00000005",
            "step-00000006"
        ]
    );
    assert_eq!(
        read_dir_names(&job_dir.join("step-00000004")),
        vec![MANIFEST_FILE, "rank-0", "rank-1"]
    );
    for step in [2, 4, 5] {
        store
            .verify_step(JOB, step)
            .await
            .expect("kept steps still verify");
    }
    // LATEST itself survives even when not in keep; a second prune is a no-op.
    assert_eq!(store.prune(JOB, &[]).await.expect("prune"), vec![2]);
    assert_eq!(store.list_steps(JOB).await.expect("list"), vec![4, 5, 6]);
    assert_eq!(
        store.prune(JOB, &[]).await.expect("prune"),
        Vec::<u64>::new()
    );
    assert_eq!(store.read_latest(JOB).await.expect("latest"), Some(4));

    // Corrupt LATEST: refuse to prune, delete nothing.
    fs::write(job_dir.join(LATEST_FILE), b"nonsense").expect("write");
    assert!(matches!(
        store.prune(JOB, &[]).await,
        Err(CkptError::Corrupt { .. })
    ));
    assert_eq!(store.list_steps(JOB).await.expect("list"), vec![4, 5, 6]);
}

#[tokio::test]
async fn prune_without_latest_deletes_nothing() {
    let root = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(root.path());
    full_step(&store, 1).await;
    full_step(&store, 2).await;
    assert_eq!(
        store.prune(JOB, &[]).await.expect("prune"),
        Vec::<u64>::new()
    );
    assert_eq!(store.list_steps(JOB).await.expect("list"), vec![1, 2]);
    // A job with no directory at all.
    assert_eq!(
        store.prune("job-000099", &[]).await.expect("prune"),
        Vec::<u64>::new()
    );
    assert_eq!(
        store.list_steps("job-000099").await.expect("list"),
        Vec::<u64>::new()
    );
}

#[tokio::test]
async fn commit_over_existing_part_fails_and_changes_nothing() {
    let root = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(root.path());
    let first = commit(&store, 3, 0, 1, &[("model.bin", b"original")])
        .await
        .expect("first commit");

    let staging = store.prepare_staging(JOB, 0, 1).await.expect("staging");
    fs::write(staging.join("model.bin"), b"zombie").expect("write");
    fs::write(staging.join("extra.bin"), b"more").expect("write");
    let result = store.commit_part(JOB, 3, 0, 1, &staging, json!({})).await;
    assert!(matches!(result, Err(CkptError::Invalid(_))), "{result:?}");

    store
        .verify_part(JOB, &first)
        .await
        .expect("original part intact");
    let part_dir = store.local_part_path(JOB, &first.dir).expect("path");
    assert_eq!(read_dir_names(&part_dir), vec!["model.bin"]);
    assert_eq!(
        fs::read(part_dir.join("model.bin")).expect("read"),
        b"original"
    );
    // The rejected content stays in staging, untouched.
    assert_eq!(read_dir_names(&staging), vec!["extra.bin", "model.bin"]);
    assert_eq!(
        fs::read(staging.join("model.bin")).expect("read"),
        b"zombie"
    );

    // Even an empty directory at the target blocks the commit (rename(2) alone would
    // replace it).
    let target = store.job_dir(JOB).join(part_dir_rel(4, 0, 1));
    fs::create_dir_all(&target).expect("mkdir");
    let result = store.commit_part(JOB, 4, 0, 1, &staging, json!({})).await;
    assert!(matches!(result, Err(CkptError::Invalid(_))), "{result:?}");
    assert!(read_dir_names(&target).is_empty());

    // A new attempt of the same rank commits next to it (fencing by directory).
    let second = store
        .commit_part(JOB, 3, 0, 2, &staging, json!({}))
        .await
        .expect("attempt 2");
    assert_eq!(second.dir, "step-00000003/rank-0/attempt-2");
    store.verify_part(JOB, &second).await.expect("second part");
    store
        .verify_part(JOB, &first)
        .await
        .expect("first part still intact");
}

#[tokio::test]
async fn commit_rejects_bad_staging_and_state() {
    let root = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(root.path());
    let staging = store.prepare_staging(JOB, 0, 1).await.expect("staging");
    fs::write(staging.join("a"), b"a").expect("write");

    let too_big = json!({"blob": "x".repeat(MAX_STATE_JSON_BYTES)});
    for state in [json!(null), json!([1]), json!("s"), too_big] {
        let result = store.commit_part(JOB, 1, 0, 1, &staging, state).await;
        assert!(matches!(result, Err(CkptError::Invalid(_))), "{result:?}");
    }

    #[cfg(unix)]
    {
        std::os::unix::fs::symlink("/etc/hostname", staging.join("link")).expect("symlink");
        let result = store.commit_part(JOB, 1, 0, 1, &staging, json!({})).await;
        assert!(matches!(result, Err(CkptError::Invalid(_))), "{result:?}");
        fs::remove_file(staging.join("link")).expect("rm");
    }

    let missing = root.path().join("nope");
    let result = store.commit_part(JOB, 1, 0, 1, &missing, json!({})).await;
    assert!(
        matches!(result, Err(CkptError::NotFound { .. })),
        "{result:?}"
    );

    for bad_job in ["", ".", "..", "a/b", "../x"] {
        let result = store.prepare_staging(bad_job, 0, 1).await;
        assert!(
            matches!(result, Err(CkptError::Invalid(_))),
            "{bad_job}: {result:?}"
        );
        let result = store
            .commit_part(bad_job, 1, 0, 1, &staging, json!({}))
            .await;
        assert!(
            matches!(result, Err(CkptError::Invalid(_))),
            "{bad_job}: {result:?}"
        );
    }
    assert_eq!(
        store.list_steps(JOB).await.expect("list"),
        Vec::<u64>::new(),
        "nothing committed"
    );
    store
        .commit_part(JOB, 1, 0, 1, &staging, json!({}))
        .await
        .expect("valid commit");
}

#[tokio::test]
async fn commit_rejects_too_many_files() {
    let root = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(root.path());
    let staging = store.prepare_staging(JOB, 0, 1).await.expect("staging");
    for index in 0..=MAX_PART_FILES {
        fs::write(staging.join(format!("f{index}")), b"").expect("write");
    }
    let result = store.commit_part(JOB, 1, 0, 1, &staging, json!({})).await;
    assert!(matches!(result, Err(CkptError::Invalid(_))), "{result:?}");
    fs::remove_file(staging.join("f0")).expect("rm");
    let part = store
        .commit_part(JOB, 1, 0, 1, &staging, json!({}))
        .await
        .expect("exactly the limit");
    assert_eq!(part.files.len(), MAX_PART_FILES);
}

#[tokio::test]
async fn path_traversal_in_manifest_is_rejected() {
    let root = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(root.path());
    let mut manifest = full_step(&store, 1).await;
    // A file outside the part that a traversal would reach.
    fs::write(store.job_dir(JOB).join("secret"), b"s").expect("write");

    for evil in [
        "../../../secret",
        "/etc/passwd",
        "a/../../secret",
        "./model.bin",
    ] {
        manifest.parts[0].files[0].path = evil.into();
        assert!(manifest.validate().is_err(), "{evil}");
        let result = store.write_manifest(&manifest).await;
        assert!(
            matches!(result, Err(CkptError::Invalid(_))),
            "{evil}: {result:?}"
        );
        let result = store.verify_part(JOB, &manifest.parts[0]).await;
        assert!(
            matches!(result, Err(CkptError::Invalid(_))),
            "{evil}: {result:?}"
        );

        // Written to disk behind our back: reading it back is Corrupt.
        let path = store.job_dir(JOB).join("step-00000001").join(MANIFEST_FILE);
        fs::write(&path, serde_json::to_vec(&manifest).expect("json")).expect("write");
        let result = store.read_manifest(JOB, 1).await;
        assert!(
            matches!(result, Err(CkptError::Corrupt { .. })),
            "{evil}: {result:?}"
        );
        assert!(
            newest_valid_step(&store, JOB, &[1])
                .await
                .expect("newest")
                .is_none()
        );
    }

    // A part dir that escapes the job dir is rejected too.
    manifest.parts[0].files[0].path = "model.bin".into();
    manifest.parts[0].dir = "../step-00000001/rank-0/attempt-1".into();
    assert!(matches!(
        store.verify_part(JOB, &manifest.parts[0]).await,
        Err(CkptError::Invalid(_))
    ));
    assert!(store.local_part_path(JOB, "../x").is_none());
    assert!(
        store
            .local_part_path("..", "step-00000001/rank-0/attempt-1")
            .is_none()
    );
}

#[tokio::test]
async fn write_manifest_needs_the_step() {
    let root = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(root.path());
    let mut manifest = full_step(&store, 1).await;
    manifest.step = 2;
    for part in &mut manifest.parts {
        part.dir = part_dir_rel(2, part.rank, part.attempt);
    }
    assert!(matches!(
        store.write_manifest(&manifest).await,
        Err(CkptError::NotFound { .. })
    ));
    assert!(matches!(
        store.read_manifest(JOB, 2).await,
        Err(CkptError::NotFound { .. })
    ));
}

#[tokio::test]
async fn oversized_manifest_is_corrupt() {
    let root = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(root.path());
    full_step(&store, 1).await;
    let path = store.job_dir(JOB).join("step-00000001").join(MANIFEST_FILE);
    let file = fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open");
    file.set_len(cumulus_ckpt::MAX_MANIFEST_BYTES + 1)
        .expect("grow");
    assert!(matches!(
        store.read_manifest(JOB, 1).await,
        Err(CkptError::Corrupt { .. })
    ));
}

#[test]
fn describe_names_the_root() {
    let root = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(root.path());
    assert_eq!(
        store.describe(),
        format!("file://{}", root.path().display())
    );
    assert_eq!(store.root(), root.path());
    assert_eq!(
        store.local_part_path(JOB, "step-00000001/rank-0/attempt-1"),
        Some(root.path().join(JOB).join("step-00000001/rank-0/attempt-1"))
    );
}

proptest! {
    #[test]
    fn step_dir_name_round_trip(step in any::<u64>()) {
        let name = step_dir_name(step);
        prop_assert!(name.len() >= "step-00000000".len());
        prop_assert_eq!(parse_step_dir_name(&name), Some(step));
    }

    #[test]
    fn parse_accepts_only_canonical_names(name in "step-[0-9+ -]{0,22}|[a-z]{0,6}-?[0-9]{0,10}") {
        if let Some(step) = parse_step_dir_name(&name) {
            prop_assert_eq!(step_dir_name(step), name);
        }
    }
}

/// A file at or above the size where fsync overlaps hashing (4 MiB, on a second thread)
/// commits with the same record and verifies like a small one beside it.
#[tokio::test]
async fn large_file_hashed_while_fsynced_round_trips() {
    let root = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(root.path());
    let large: Vec<u8> = (0..(5u32 << 20)).map(|i| (i % 251) as u8).collect();
    let part = commit(
        &store,
        7,
        0,
        1,
        &[("large.bin", large.as_slice()), ("small.bin", b"x")],
    )
    .await
    .expect("commit");
    let listed = listed_files(&part);
    assert_eq!(
        listed,
        vec![
            ("large.bin", large.len() as u64, digest_of(&large)),
            ("small.bin", 1, digest_of(b"x")),
        ]
    );
    store.verify_part(JOB, &part).await.expect("verifies");
    assert_eq!(
        fs::read(part_file(&store, 7, 0, "large.bin")).expect("read"),
        large
    );
}

#[tokio::test]
async fn delete_job_removes_latest_and_every_step_of_that_job_only() {
    let root = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(root.path());
    full_step(&store, 1).await;
    full_step(&store, 2).await;
    store.write_latest(JOB, 2).await.expect("latest");
    let other = tempfile::tempdir().expect("tempdir");
    let neighbour = LocalStore::new(other.path());
    full_step(&neighbour, 1).await;
    assert!(store.delete_job(JOB).await.expect("delete"));
    assert!(!store.job_dir(JOB).exists());
    assert_eq!(store.read_latest(JOB).await.expect("latest"), None);
    assert_eq!(neighbour.list_steps(JOB).await.expect("list"), vec![1]);
    // Again, or a job never written: nothing there, not an error.
    assert!(!store.delete_job(JOB).await.expect("delete again"));
    assert!(matches!(
        store.delete_job("../escape").await,
        Err(CkptError::Invalid(_))
    ));
}
