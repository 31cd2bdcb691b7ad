//! The store (sled and the write-ahead log) keeps its state across a reopen, and refuses
//! corrupt files.

use std::collections::BTreeMap;

use cumulus_raft_store::state::{Command, JobSpec, RestartPolicy};
use cumulus_raft_store::{CumulusNode, Response, TypeConfig, open};
use openraft::storage::{RaftLogStorage, RaftStateMachine};
use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, RaftLogReader, Vote};

fn spec() -> JobSpec {
    JobSpec {
        name: "t".into(),
        world_size: 2,
        command: vec!["true".into()],
        env: BTreeMap::new(),
        dataset: String::new(),
        ckpt_dir: String::new(),
        ckpt_keep: 3,
        restart: RestartPolicy::default(),
        progress_timeout_ms: 0,
        working_dir: String::new(),
        ckpt_url: String::new(),
        ckpt_commit_tier: String::new(),
    }
}

fn entry(index: u64, cmd: Command) -> Entry<TypeConfig> {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(cmd),
    }
}

#[tokio::test]
async fn state_machine_and_vote_survive_reopen() {
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let (mut log, mut sm) = open(dir.path()).expect("open");
        log.save_vote(&Vote::new(3, 1)).await.expect("vote");
        let cmd = Command::SubmitJob {
            request_id: "r1".into(),
            spec: spec(),
            shards: vec!["/d/a".into(), "/d/b".into(), "/d/c".into()],
            submitted_at_ms: 10,
        };
        let out = sm.apply(vec![entry(1, cmd)]).await.expect("apply");
        assert_eq!(
            out,
            vec![Response::JobSubmitted {
                job_id: "job-000001".into(),
                created: true
            }]
        );
    }
    let (mut log, mut sm) = open(dir.path()).expect("reopen");
    assert_eq!(
        log.read_vote().await.expect("read vote"),
        Some(Vote::new(3, 1))
    );
    let (applied, _) = sm.applied_state().await.expect("applied");
    assert_eq!(applied.map(|l| l.index), Some(1));
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
        assert_eq!(d.state.next_job_seq, 1);
    });
    // The log reader sees nothing (nothing appended), and the membership is default.
    let entries = log.try_get_log_entries(0..10).await.expect("read");
    assert!(entries.is_empty());
    let _node = CumulusNode::default();
}

#[test]
fn corrupt_state_machine_record_refuses_to_open() {
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let db = sled::open(dir.path()).expect("sled");
        let tree = db.open_tree("state_machine").expect("tree");
        tree.insert(b"job/job-000001", &b"{not json"[..])
            .expect("insert");
        db.flush().expect("flush");
    }
    let err = match open(dir.path()) {
        Ok(_) => panic!("a corrupt record must not open"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("corrupt"), "{err}");
    assert!(err.contains("job/job-000001"), "{err}");
}

#[test]
fn corrupt_log_entry_refuses_to_open() {
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let db = sled::open(dir.path()).expect("sled");
        let tree = db.open_tree("raft_logs").expect("tree");
        tree.insert(5u64.to_be_bytes(), &b"garbage"[..])
            .expect("insert");
        db.flush().expect("flush");
    }
    assert!(open(dir.path()).is_err());
}
