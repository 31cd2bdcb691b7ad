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

/// A data dir whose sled tree `raft_meta` holds a vote, a purge point and a committed log
/// id, and whose tree `snapshot` holds a snapshot: every kind of record Cumulus keeps in
/// sled.
async fn every_kind_of_record(dir: &std::path::Path) {
    snapshot_one_job(dir).await;
    let (mut log, _sm) = common::retry_locked(|| open(dir)).expect("reopen");
    let entries: Vec<_> = (1..=3)
        .map(|i| {
            common::entry(
                1,
                i,
                Command::SubmitJob {
                    owner: String::new(),
                    request_id: format!("r{i}"),
                    spec: common::spec("t"),
                    shards: vec!["/d/a".into()],
                    submitted_at_ms: 10,
                },
            )
        })
        .collect();
    let first = entries[0].log_id;
    log.append(entries.clone(), openraft::storage::IOFlushed::noop())
        .await
        .expect("append");
    // The vote waits for the append's flush, so the committed log id is saved as given.
    log.save_vote(&Vote::new(4u64, 2u64)).await.expect("vote");
    log.save_committed(Some(entries[2].log_id))
        .await
        .expect("committed");
    log.purge(first).await.expect("purge");
}

/// One byte flipped inside each record Cumulus keeps in sled (the value as sled returns
/// it, so sled's own checks pass: what the checksum written by Cumulus is for) refuses
/// to start, naming the tree, the key and the checksum mismatch, and how to recover.
/// Before format 2 the vote, the committed log id and the purge point were bare JSON: a
/// changed digit was read as a valid, wrong vote.
#[tokio::test]
async fn a_flipped_byte_in_any_sled_record_refuses_to_open_naming_tree_and_key() {
    let dir = tempfile::tempdir().expect("temp dir");
    every_kind_of_record(dir.path()).await;
    for (tree, key) in [
        ("raft_meta", "vote"),
        ("raft_meta", "committed"),
        ("raft_meta", "last_purged"),
        ("snapshot", "current"),
    ] {
        let original = {
            let db = common::retry_locked(|| sled::open(dir.path())).expect("sled");
            let t = db.open_tree(tree).expect("tree");
            let stored = t.get(key).expect("get").expect("a record").to_vec();
            // A digit or letter of the value near its end: still valid JSON.
            let mut flipped = stored.clone();
            let at = stored.len() - 3;
            flipped[at] ^= 0x01;
            t.insert(key, flipped).expect("insert");
            db.flush().expect("flush");
            stored
        };
        let err = match common::retry_locked(|| open(dir.path())) {
            Ok(_) => panic!("a flipped byte in {tree}/{key} must not open"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains(&format!("sled tree `{tree}`, key `{key}`")),
            "{err}"
        );
        assert!(
            err.contains("mismatch") && err.contains("--rejoin-empty"),
            "{err}"
        );
        let db = common::retry_locked(|| sled::open(dir.path())).expect("sled");
        db.open_tree(tree)
            .expect("tree")
            .insert(key, original)
            .expect("restore");
        db.flush().expect("flush");
    }
    let (mut log, _sm) = common::retry_locked(|| open(dir.path())).expect("restored opens");
    assert_eq!(
        log.read_vote().await.expect("vote"),
        Some(Vote::new(4u64, 2u64))
    );
}

/// Every offset of the newest segment of sled's log whose bytes a `kill -9`'d node wrote
/// since sled's last snapshot of its own: a flipped byte there makes sled end its
/// recovery at that message, silently dropping every later write (its CRC catches the
/// damage, and it takes it for a torn write). The probe: an older vote came back
/// and the node led at an old term. The generation file tells: refuse.
#[tokio::test]
async fn a_flipped_byte_in_sleds_log_that_drops_the_newest_vote_refuses_to_open() {
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let (mut log, _sm) = open(dir.path()).expect("open");
        for term in 1..=3u64 {
            log.save_vote(&Vote::new(term, 1u64)).await.expect("vote");
        }
    }
    // The newest vote record in sled's log file: the last format-2 record there.
    let db_file = dir.path().join("db");
    let bytes = std::fs::read(&db_file).expect("read");
    let magic = b"cumulus-meta-2\n";
    let newest = bytes
        .windows(magic.len())
        .rposition(|w| w == magic)
        .expect("a format-2 record in sled's log");
    // A byte of its JSON (past magic, CRC-32 and generation).
    let at = newest + magic.len() + 4 + 8 + 3;
    let mut damaged = bytes.clone();
    damaged[at] ^= 0x01;
    std::fs::write(&db_file, &damaged).expect("flip");

    let err = match common::retry_locked(|| open(dir.path())) {
        Ok(_) => panic!("a sled log that lost the newest vote must not open"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("lost flushed writes")
            && err.contains("tree `raft_meta`, key `vote`")
            && err.contains("generation 2")
            && err.contains("generation 3 was flushed"),
        "{err}"
    );
    assert!(err.contains("--rejoin-empty"), "{err}");
    // What sled alone returns (what the store trusted before the generation file): the
    // previous vote, valid and wrong.
    let db = common::retry_locked(|| sled::open(dir.path())).expect("sled opens");
    let stored = db
        .open_tree("raft_meta")
        .expect("tree")
        .get("vote")
        .expect("get")
        .expect("a vote");
    let json = &stored[magic.len() + 12..];
    let vote: Vote = serde_json::from_slice(json).expect("a valid vote");
    assert_eq!(vote, Vote::new(2u64, 1u64), "sled rolled back one vote");
}

/// A data dir of an earlier version (the vote, the committed log id and the purge point
/// as bare JSON, no generation file) still opens, with the same values; its records are
/// rewritten in format 2 with checksums, so a later flipped byte is caught.
#[tokio::test]
async fn format_1_records_of_an_earlier_version_open_and_are_rewritten_with_checksums() {
    let dir = tempfile::tempdir().expect("temp dir");
    every_kind_of_record(dir.path()).await;
    let legacy: Vec<(&str, Vec<u8>)> = {
        let db = common::retry_locked(|| sled::open(dir.path())).expect("sled");
        let meta = db.open_tree("raft_meta").expect("tree");
        let mut out = Vec::new();
        for key in ["vote", "committed", "last_purged"] {
            let stored = meta.get(key).expect("get").expect("a record");
            assert!(stored.starts_with(b"cumulus-meta-2\n"), "format 2: {key}");
            let json = stored[15 + 12..].to_vec();
            meta.insert(key, json.clone()).expect("insert");
            out.push((key, json));
        }
        db.flush().expect("flush");
        out
    };
    std::fs::remove_file(dir.path().join("meta.generation")).expect("no generation file");
    {
        let (mut log, _sm) = common::retry_locked(|| open(dir.path())).expect("format 1 opens");
        assert_eq!(
            log.read_vote().await.expect("vote"),
            Some(Vote::new(4u64, 2u64))
        );
        assert_eq!(
            log.read_committed()
                .await
                .expect("committed")
                .map(|l| l.index),
            Some(3)
        );
        let state = log.get_log_state().await.expect("log state");
        assert_eq!(state.last_purged_log_id.map(|l| l.index), Some(1));
    }
    let db = common::retry_locked(|| sled::open(dir.path())).expect("sled");
    let meta = db.open_tree("raft_meta").expect("tree");
    for (key, json) in legacy {
        let stored = meta.get(key).expect("get").expect("a record");
        assert!(stored.starts_with(b"cumulus-meta-2\n"), "rewritten: {key}");
        assert_eq!(&stored[15 + 12..], &json[..], "same value: {key}");
    }
    assert!(dir.path().join("meta.generation").exists());
}
