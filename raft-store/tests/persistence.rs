//! The store (sled and the write-ahead log) keeps its state across a reopen, and refuses
//! corrupt files.

mod common;

use cumulus_raft_store::Vote;
use cumulus_raft_store::state::Command;
use cumulus_raft_store::{CumulusNode, open};
use openraft::RaftLogReader;
use openraft::RaftSnapshotBuilder;
use openraft::storage::{RaftLogStorage, RaftStateMachine};

#[tokio::test]
async fn the_vote_and_the_snapshotted_state_survive_reopen() {
    let dir = tempfile::tempdir().expect("temp dir");
    let submit = |req: &str| Command::SubmitJob {
        owner: String::new(),
        request_id: req.into(),
        spec: common::spec("t"),
        shards: vec!["/d/a".into(), "/d/b".into(), "/d/c".into()],
        submitted_at_ms: 10,
    };
    {
        let (mut log, mut sm) = open(dir.path()).expect("open");
        log.save_vote(&Vote::new(3u64, 1u64)).await.expect("vote");
        sm.apply(common::to_apply(vec![common::entry(1, 1, submit("r1"))]))
            .await
            .expect("apply");
        assert!(
            sm.shared()
                .read(|d| d.state.jobs.contains_key("job-000001")),
            "the submit is applied"
        );
        let mut builder = sm.get_snapshot_builder().await;
        builder.build_snapshot().await.expect("snapshot");
        // Applied after the snapshot: not written anywhere by the state machine (openraft
        // re-applies it from the log on start).
        sm.apply(common::to_apply(vec![common::entry(1, 2, submit("r2"))]))
            .await
            .expect("apply");
    }
    let (mut log, mut sm) = common::retry_locked(|| open(dir.path())).expect("reopen");
    assert_eq!(
        log.read_vote().await.expect("read vote"),
        Some(Vote::new(3u64, 1u64))
    );
    let (applied, _) = sm.applied_state().await.expect("applied");
    assert_eq!(
        applied.map(|l| l.index),
        Some(1),
        "restored from the snapshot"
    );
    let shared = sm.shared();
    shared.read(|d| {
        let job = &d.state.jobs["job-000001"];
        assert_eq!(
            job.shard_plan,
            vec![
                vec!["/d/a".to_string(), "/d/c".to_string()],
                vec!["/d/b".to_string()]
            ]
        );
        assert_eq!(d.state.request_ids["r1"], "job-000001");
        assert!(!d.state.request_ids.contains_key("r2"));
        assert_eq!(d.state.next_job_seq, 1);
        assert!(d.state.job_index().pending.contains("job-000001"));
    });
    // The log reader sees nothing (nothing appended), and the membership is default.
    let entries = log.try_get_log_entries(0..10).await.expect("read");
    assert!(entries.is_empty());
    let _node = CumulusNode::default();
}

/// Applies one submit and builds a snapshot in `dir`, returning the snapshot's data.
async fn snapshot_one_job(dir: &std::path::Path) -> Vec<u8> {
    let (_log, mut sm) = open(dir).expect("open");
    sm.apply(common::to_apply(vec![common::entry(
        1,
        1,
        Command::SubmitJob {
            owner: String::new(),
            request_id: "r1".into(),
            spec: common::spec("t"),
            shards: vec!["/d/a".into()],
            submitted_at_ms: 10,
        },
    )]))
    .await
    .expect("apply");
    let mut builder = sm.get_snapshot_builder().await;
    let snap = builder.build_snapshot().await.expect("snapshot");
    snap.snapshot.into_inner()
}

#[tokio::test]
async fn a_snapshot_whose_bytes_changed_refuses_to_open() {
    let dir = tempfile::tempdir().expect("temp dir");
    snapshot_one_job(dir.path()).await;
    {
        let db = common::retry_locked(|| sled::open(dir.path())).expect("sled");
        let tree = db.open_tree("snapshot").expect("tree");
        let mut stored = tree
            .get(b"current")
            .expect("get")
            .expect("a snapshot")
            .to_vec();
        assert!(stored.starts_with(b"cumulus-snapshot-2\n"), "format 2");
        // One byte of the state, near the end: still valid JSON shape, wrong content.
        let at = stored.len() - 3;
        stored[at] ^= 0x01;
        tree.insert(b"current", stored).expect("insert");
        db.flush().expect("flush");
    }
    let err = match common::retry_locked(|| open(dir.path())) {
        Ok(_) => panic!("a snapshot with a changed byte must not open"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("CRC-32 mismatch"), "{err}");
}

#[tokio::test]
async fn a_format_1_snapshot_of_an_older_version_still_opens() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = snapshot_one_job(dir.path()).await;
    {
        // Rewrite the record as versions before format 2 stored it: one JSON object, the
        // data a JSON array of numbers.
        let db = common::retry_locked(|| sled::open(dir.path())).expect("sled");
        let tree = db.open_tree("snapshot").expect("tree");
        let stored = tree.get(b"current").expect("get").expect("a snapshot");
        let meta_len = u32::from_le_bytes(stored[19..23].try_into().expect("4 bytes")) as usize;
        let meta: serde_json::Value =
            serde_json::from_slice(&stored[27..27 + meta_len]).expect("meta");
        let legacy = serde_json::json!({ "meta": meta, "data": data });
        tree.insert(b"current", serde_json::to_vec(&legacy).expect("json"))
            .expect("insert");
        db.flush().expect("flush");
    }
    let (_log, mut sm) =
        common::retry_locked(|| open(dir.path())).expect("a format-1 snapshot opens");
    let (applied, _) = sm.applied_state().await.expect("applied");
    assert_eq!(applied.map(|l| l.index), Some(1));
    sm.shared()
        .read(|d| assert_eq!(d.state.request_ids["r1"], "job-000001"));
    let current = sm
        .get_current_snapshot()
        .await
        .expect("read")
        .expect("a snapshot");
    assert_eq!(current.snapshot.into_inner(), data, "the same data back");
}

#[test]
fn a_corrupt_snapshot_refuses_to_open() {
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let db = common::retry_locked(|| sled::open(dir.path())).expect("sled");
        let tree = db.open_tree("snapshot").expect("tree");
        tree.insert(b"current", &b"{not json"[..]).expect("insert");
        db.flush().expect("flush");
    }
    let err = match common::retry_locked(|| open(dir.path())) {
        Ok(_) => panic!("a corrupt snapshot must not open"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("corrupt"), "{err}");
    assert!(err.contains("snapshot"), "{err}");
}

#[test]
fn corrupt_log_entry_refuses_to_open() {
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let db = common::retry_locked(|| sled::open(dir.path())).expect("sled");
        let tree = db.open_tree("raft_logs").expect("tree");
        tree.insert(5u64.to_be_bytes(), &b"garbage"[..])
            .expect("insert");
        db.flush().expect("flush");
    }
    assert!(common::retry_locked(|| open(dir.path())).is_err());
}
