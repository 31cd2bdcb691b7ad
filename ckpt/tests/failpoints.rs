//! Crash and disk-full tests of the local commit protocol, driven by the named failpoints of
//! `cumulus_ckpt::failpoints` (needs the feature: `cargo test -p cumulus-ckpt --features
//! failpoints --test failpoints`; scripts/test.sh runs it).
//!
//! Crash: the test binary runs itself as a child process (`child_commits_one_step`) that
//! commits a whole step the way the worker agents and the leader do (two parts, verify,
//! manifest, the commit record that stands for the Raft commit, `LATEST`, prune), with
//! `FAILPOINTS=<point>=panic` read by `fail::FailScenario::setup()`, so the child dies at
//! that point and leaves the files exactly as such a crash leaves them. The parent then
//! plays the restart: `LATEST` and the committed step must name a complete, checksum-valid
//! step, and the next commit must succeed.
//!
//! Disk full: `return(enospc)` at a write or fsync makes that operation fail with ENOSPC, in
//! process (`fail::FailScenario` serializes the tests that configure failpoints).
#![cfg(feature = "failpoints")]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use cumulus_ckpt::failpoints::{self, FINALIZE_POINTS, PART_POINTS};
use cumulus_ckpt::{
    CheckpointStore, CkptError, LATEST_FILE, LocalStore, MANIFEST_FILE, MANIFEST_FORMAT_VERSION,
    Manifest, PartRecord, newest_valid_step, step_dir_name,
};
use serde_json::json;

const JOB: &str = "job-000007";
const WORLD_SIZE: u32 = 2;
/// Environment of the child: the store root.
const CHILD_ROOT_ENV: &str = "CUMULUS_FAILPOINT_CHILD_ROOT";
/// Environment of the child: the step to commit (also its attempt number: a restarted rank
/// runs as a new attempt).
const CHILD_STEP_ENV: &str = "CUMULUS_FAILPOINT_CHILD_STEP";
/// The test's own failpoint for the Raft commit between the manifest and `LATEST` (the
/// coordinator's is `coordinator-finalize-before-raft-commit`).
const RAFT_COMMIT: &str = "test-raft-commit";
/// Stands for the job's committed step in the Raft log: written durably by the child after
/// the manifest and before `LATEST`, exactly where the leader commits `CheckpointCommitted`.
const COMMITTED_RECORD: &str = "committed-step";
/// Longest a child may run.
const CHILD_DEADLINE: Duration = Duration::from_secs(120);

/// The content of rank `rank`'s file at `step` (distinct per step and rank).
fn weights(step: u64, rank: u32) -> Vec<u8> {
    (0..4096u32)
        .map(|i| (i as u64 * 31 + step * 7 + u64::from(rank) * 13) as u8)
        .collect()
}

/// One part: the rank writes two files into its staging directory, the agent commits them.
async fn commit_part(
    store: &LocalStore,
    step: u64,
    rank: u32,
    attempt: u32,
) -> Result<PartRecord, CkptError> {
    let staging = store.prepare_staging(JOB, rank, attempt).await?;
    fs::create_dir_all(staging.join("opt")).expect("mkdir");
    fs::write(staging.join("weights.bin"), weights(step, rank)).expect("write");
    fs::write(staging.join("opt/state.bin"), weights(step + 1, rank)).expect("write");
    store
        .commit_part(
            JOB,
            step,
            rank,
            attempt,
            &staging,
            json!({ "step": step, "rank": rank }),
        )
        .await
}

/// The whole commit of `step` as the agents and the leader do it.
async fn commit_step(store: &LocalStore, step: u64, attempt: u32) -> Result<(), CkptError> {
    let mut parts = Vec::new();
    for rank in 0..WORLD_SIZE {
        parts.push(commit_part(store, step, rank, attempt).await?);
    }
    for part in &parts {
        store.verify_part(JOB, part).await?;
    }
    store
        .write_manifest(&Manifest {
            format_version: MANIFEST_FORMAT_VERSION,
            job_id: JOB.into(),
            step,
            world_size: WORLD_SIZE,
            committed_at_ms: 1,
            parts,
        })
        .await?;
    fail::fail_point!(RAFT_COMMIT);
    write_committed_record(store.root(), step);
    store.write_latest(JOB, step).await?;
    store.prune(JOB, &[]).await?;
    Ok(())
}

/// Durably records `step` as the committed step (temp file, fsync, rename, fsync dir).
fn write_committed_record(root: &Path, step: u64) {
    let temp = root.join(format!("{COMMITTED_RECORD}.tmp"));
    let file = fs::File::create(&temp).expect("create");
    std::io::Write::write_all(&mut &file, step.to_string().as_bytes()).expect("write");
    file.sync_all().expect("fsync");
    fs::rename(&temp, root.join(COMMITTED_RECORD)).expect("rename");
    fs::File::open(root)
        .and_then(|d| d.sync_all())
        .expect("fsync dir");
}

fn read_committed_record(root: &Path) -> Option<u64> {
    let text = fs::read_to_string(root.join(COMMITTED_RECORD)).ok()?;
    Some(text.parse().expect("a step number"))
}

/// The child process: commits one step under the failpoints of `FAILPOINTS`. Run only by
/// `crash_at_every_failpoint_then_restart` (ignored otherwise).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of crash_at_every_failpoint_then_restart"]
async fn child_commits_one_step() {
    let root = PathBuf::from(std::env::var(CHILD_ROOT_ENV).expect("child root"));
    let step: u64 = std::env::var(CHILD_STEP_ENV)
        .expect("child step")
        .parse()
        .expect("a step number");
    let scenario = fail::FailScenario::setup();
    let store = LocalStore::new(&root);
    let attempt = u32::try_from(step).expect("a small step");
    commit_step(&store, step, attempt)
        .await
        .expect("the commit succeeds");
    scenario.teardown();
}

/// Runs the child committing `step`, with `FAILPOINTS` = `failpoints`. Returns
/// (success, stderr).
fn run_child(root: &Path, step: u64, failpoints: &str) -> (bool, String) {
    let exe = std::env::current_exe().expect("test binary");
    let mut child = Command::new(exe)
        .args([
            "--exact",
            "child_commits_one_step",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ROOT_ENV, root)
        .env(CHILD_STEP_ENV, step.to_string())
        .env("FAILPOINTS", failpoints)
        .env("RUST_BACKTRACE", "0")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn the child");
    let deadline = std::time::Instant::now() + CHILD_DEADLINE;
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the child committing step {step} ({failpoints}) ran past {CHILD_DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().expect("child output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

/// What a restart must find: `LATEST` and the committed record name steps that verify
/// (complete, every checksum valid), `LATEST` is never ahead of the committed step, and a
/// resume (newest valid step among those listed) lands on the committed step.
async fn check_after_restart(store: &LocalStore, point: &str) -> u64 {
    let latest = store
        .read_latest(JOB)
        .await
        .expect("LATEST readable")
        .expect("LATEST exists");
    store
        .verify_step(JOB, latest)
        .await
        .unwrap_or_else(|e| panic!("{point}: LATEST names step {latest}, which is invalid: {e}"));
    let committed = read_committed_record(store.root()).expect("a committed step");
    store
        .verify_step(JOB, committed)
        .await
        .unwrap_or_else(|e| panic!("{point}: the committed step {committed} is invalid: {e}"));
    assert!(
        latest <= committed,
        "{point}: LATEST {latest} is ahead of the committed step {committed}"
    );
    // A resume considers only committed steps (the Raft log's), newest valid first.
    let steps: Vec<u64> = store
        .list_steps(JOB)
        .await
        .expect("list")
        .into_iter()
        .filter(|s| *s <= committed)
        .collect();
    let resume = newest_valid_step(store, JOB, &steps)
        .await
        .expect("resume lookup");
    assert_eq!(
        resume.map(|m| m.step),
        Some(committed),
        "{point}: a resume must land on the committed step"
    );
    committed
}

#[test]
fn every_protocol_step_has_a_distinct_failpoint() {
    let mut all: Vec<&str> = PART_POINTS.iter().chain(FINALIZE_POINTS).copied().collect();
    assert_eq!(all.len(), 14);
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 14, "failpoint names must be distinct");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_at_every_failpoint_then_restart() {
    let points: Vec<&str> = PART_POINTS
        .iter()
        .chain(FINALIZE_POINTS)
        .copied()
        .chain([RAFT_COMMIT])
        .collect();
    for point in points {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("ckpt");
        let store = LocalStore::new(&root);
        let (ok, out) = run_child(&root, 1, "");
        assert!(ok, "the fault-free commit of step 1 failed:\n{out}");

        // Crash while committing step 2 (the first time the point is reached).
        let (ok, out) = run_child(&root, 2, &format!("{point}=1*panic"));
        assert!(!ok, "{point}: the child did not crash:\n{out}");
        assert!(
            out.contains(&format!("failpoint {point} panic")),
            "{point}: the child died elsewhere:\n{out}"
        );

        // The restart: what is committed is complete and valid.
        let committed = check_after_restart(&store, point).await;
        // The committed record (the Raft commit) precedes LATEST: a crash in LATEST's
        // write leaves step 2 committed, every earlier point leaves step 1.
        let expected = if point.starts_with("ckpt-latest-") {
            2
        } else {
            1
        };
        assert_eq!(committed, expected, "{point}: committed step");
        if committed == 2 {
            // The leader repairs LATEST to the committed step (coordinator `ensure_latest`).
            store.write_latest(JOB, 2).await.expect("repair LATEST");
        }
        // An uncommitted step 2 may hold a torn part or a manifest that the Raft log never
        // accepted: it is never resumed from (only committed steps are candidates).

        // The next commit succeeds and becomes LATEST.
        let (ok, out) = run_child(&root, 3, "");
        assert!(ok, "{point}: the commit after the crash failed:\n{out}");
        assert_eq!(store.read_latest(JOB).await.expect("LATEST"), Some(3));
        store
            .verify_step(JOB, 3)
            .await
            .unwrap_or_else(|e| panic!("{point}: step 3 is invalid: {e}"));
        assert_eq!(read_committed_record(&root), Some(3));
    }
}

/// Asserts `error` is the injected ENOSPC, with a message that says so.
fn assert_enospc(error: &CkptError, op: &str) {
    let text = error.to_string();
    assert!(
        text.contains("No space left on device") && text.contains(op),
        "not a clear disk-full error for {op}: {text}"
    );
    match error {
        CkptError::Io { source, .. } => {
            assert_eq!(source.raw_os_error(), Some(nix::libc::ENOSPC), "{text}");
        }
        other => panic!("expected an I/O error, got {other:?}"),
    }
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").file_name().into_string().expect("utf-8"))
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_full_while_committing_a_part() {
    let scenario = fail::FailScenario::setup();
    let dir = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(dir.path());
    commit_step(&store, 1, 1).await.expect("step 1");

    // Rank 0's part of step 2 commits; rank 1's runs out of space at the file fsync.
    let part0 = commit_part(&store, 2, 0, 2)
        .await
        .expect("rank 0 of step 2");
    fail::cfg(failpoints::PART_FSYNC_FILE, "return(enospc)").expect("cfg");
    let error = commit_part(&store, 2, 1, 2)
        .await
        .expect_err("the disk is full");
    assert_enospc(&error, "fsync");
    // The staging directory is empty again (its space is free), nothing of rank 1 is
    // visible, and step 2 (one part, no manifest) is not a valid step.
    let staging = store.job_dir(JOB).join(".staging/rank-1.attempt-2");
    assert!(staging.is_dir(), "the staging directory is recreated");
    assert!(names_in(&staging).is_empty(), "staging is cleaned");
    assert!(!store.job_dir(JOB).join("step-00000002/rank-1").exists());
    assert!(store.verify_step(JOB, 2).await.is_err());
    assert_eq!(store.read_latest(JOB).await.expect("LATEST"), Some(1));
    store.verify_step(JOB, 1).await.expect("step 1 still valid");
    let resume = newest_valid_step(&store, JOB, &store.list_steps(JOB).await.expect("list"))
        .await
        .expect("resume");
    assert_eq!(resume.map(|m| m.step), Some(1));

    // Disk full at the directory fsync and at the rename: same outcome.
    fail::remove(failpoints::PART_FSYNC_FILE);
    for point in [
        failpoints::PART_FSYNC_DIRS,
        failpoints::PART_MKDIR_PARENTS,
        failpoints::PART_RENAME,
    ] {
        fail::cfg(point, "return(enospc)").expect("cfg");
        let error = commit_part(&store, 2, 1, 2).await.expect_err("disk full");
        assert!(
            error.to_string().contains("No space left on device"),
            "{point}: {error}"
        );
        assert!(names_in(&staging).is_empty(), "{point}: staging is cleaned");
        assert!(
            !store
                .job_dir(JOB)
                .join("step-00000002/rank-1/attempt-2")
                .exists()
        );
        fail::remove(point);
    }

    // Space is back: the rank writes its part again and the step commits.
    let part1 = commit_part(&store, 2, 1, 2)
        .await
        .expect("rank 1 of step 2");
    store
        .write_manifest(&Manifest {
            format_version: MANIFEST_FORMAT_VERSION,
            job_id: JOB.into(),
            step: 2,
            world_size: WORLD_SIZE,
            committed_at_ms: 2,
            parts: vec![part0, part1],
        })
        .await
        .expect("manifest of step 2");
    store.write_latest(JOB, 2).await.expect("LATEST");
    store.verify_step(JOB, 2).await.expect("step 2 is valid");
    assert_eq!(store.read_latest(JOB).await.expect("LATEST"), Some(2));
    scenario.teardown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_full_while_writing_the_manifest_or_latest() {
    let scenario = fail::FailScenario::setup();
    let dir = tempfile::tempdir().expect("tempdir");
    let store = LocalStore::new(dir.path());
    commit_step(&store, 1, 1).await.expect("step 1");

    for point in [failpoints::MANIFEST_WRITE, failpoints::MANIFEST_FSYNC] {
        fail::cfg(point, "return(enospc)").expect("cfg");
        let error = commit_step(&store, 2, 2).await.expect_err("disk full");
        assert_enospc(
            &error,
            if point == failpoints::MANIFEST_WRITE {
                "write"
            } else {
                "fsync"
            },
        );
        // No manifest, no temp file left behind, LATEST unchanged.
        let step_dir = store.job_dir(JOB).join(step_dir_name(2));
        assert_eq!(names_in(&step_dir), ["rank-0", "rank-1"], "{point}");
        assert!(!step_dir.join(MANIFEST_FILE).exists());
        assert_eq!(store.read_latest(JOB).await.expect("LATEST"), Some(1));
        store.verify_step(JOB, 1).await.expect("step 1 still valid");
        fail::remove(point);
        // Clean up the uncommitted step for the next round (prune removes it once a
        // later step is committed; here the same step number is reused).
        fs::remove_dir_all(&step_dir).expect("remove step 2");
    }

    fail::cfg(failpoints::LATEST_WRITE, "return(enospc)").expect("cfg");
    let error = commit_step(&store, 2, 2).await.expect_err("disk full");
    assert_enospc(&error, "write");
    assert_eq!(store.read_latest(JOB).await.expect("LATEST"), Some(1));
    assert_eq!(
        names_in(&store.job_dir(JOB))
            .into_iter()
            .filter(|n| n.starts_with(LATEST_FILE))
            .collect::<Vec<_>>(),
        [LATEST_FILE],
        "no LATEST temp file is left behind"
    );
    fail::remove(failpoints::LATEST_WRITE);

    // Space is back: the next step commits.
    commit_step(&store, 3, 3).await.expect("step 3");
    assert_eq!(store.read_latest(JOB).await.expect("LATEST"), Some(3));
    store.verify_step(JOB, 3).await.expect("step 3 valid");
    scenario.teardown();
}
