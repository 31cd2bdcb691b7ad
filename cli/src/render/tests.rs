use super::*;
use cumulus_api::{CheckpointInfo, JobSpec, Member, RestartPolicy, WorkerInfo};

fn job() -> Job {
    Job {
        id: "job-000001".into(),
        spec: Some(JobSpec {
            name: "digits".into(),
            world_size: 2,
            command: vec![
                "cumulus-trainer".into(),
                "train".into(),
                "--note".into(),
                "two words".into(),
            ],
            restart: Some(RestartPolicy {
                max_restarts: Some(5),
                ..Default::default()
            }),
            ckpt_dir: "/ck".into(),
            ..Default::default()
        }),
        state: "running".into(),
        submitted_at_ms: 1_000_000,
        restarts_used: 1,
        committed_step: Some(50),
        shard_count: 8,
        ranks: vec![
            RankStatus {
                rank: 0,
                attempt: 1,
                worker_id: "worker-1".into(),
                state: "running".into(),
                pid: 4242,
                step: 60,
                total_steps: 360,
                ..Default::default()
            },
            RankStatus {
                rank: 1,
                attempt: 0,
                worker_id: "worker-2".into(),
                state: "failed".into(),
                signal: Some(9),
                ..Default::default()
            },
        ],
        restarts: vec![RestartRecord {
            number: 1,
            delay_ms: 1043,
            cause: "rank 1 attempt 0 killed by signal 9".into(),
            ranks: vec![0, 1],
            resume_step: Some(50),
            ..Default::default()
        }],
        ..Default::default()
    }
}

#[test]
fn status_shows_summary_ranks_and_restarts() {
    let text = job_status(
        &JobResponse {
            job: Some(job()),
            linearizable: true,
        },
        1_012_000,
    );
    for needle in [
        "job-000001 (digits)",
        "running",
        "2 (8 shards)",
        "1 used of 5",
        "committed step:",
        "50",
        "linearizable",
        "12s ago",
        "'two words'",
        "4242",
        "60/360",
        "signal 9",
        "#1",
        "1043",
        "rank 1 attempt 0 killed by signal 9",
        "0,1",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    let text = job_status(
        &JobResponse {
            job: Some(job()),
            linearizable: false,
        },
        1_012_000,
    );
    assert!(text.contains("local (may be stale)"), "{text}");
}

#[test]
fn list_table_has_one_line_per_job_plus_header() {
    let mut j2 = job();
    j2.id = "job-000002".into();
    j2.spec.as_mut().expect("spec").restart = None;
    let text = jobs_table(
        &ListJobsResponse {
            jobs: vec![job(), j2],
        },
        1_000_000 + 7_200_000,
    );
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines[0].contains("ID") && lines[0].contains("STATE"));
    assert!(
        lines[1].contains("job-000001") && lines[1].contains("1/5") && lines[1].contains("2h ago")
    );
    assert!(lines[2].contains("1/3"), "default budget shown: {text}");
    assert_eq!(jobs_table(&ListJobsResponse::default(), 0), "no jobs\n");
}

#[test]
fn user_strings_cannot_forge_rows_or_drive_the_terminal() {
    let mut evil = job();
    let spec = evil.spec.as_mut().expect("spec");
    spec.name = "a\rjob-000009  succeeded\n\u{1b}[2Jfake\u{202e}".into();
    spec.command = vec!["python".into(), "x\u{1b}]0;title\u{7}".into()];
    evil.failure_cause = "rank 0 said \u{1b}[31mred\u{8}\u{8}".into();
    evil.state = "failed".into();
    let list = jobs_table(
        &ListJobsResponse {
            jobs: vec![evil.clone()],
        },
        0,
    );
    let status = job_status(
        &JobResponse {
            job: Some(evil),
            linearizable: true,
        },
        0,
    );
    for text in [&list, &status] {
        assert!(
            !text
                .chars()
                .any(|c| (c.is_control() && c != '\n') || c == '\u{202e}'),
            "{text:?}"
        );
    }
    assert_eq!(list.lines().count(), 2, "one header, one job: {list}");
    assert!(list.contains("a\\rjob-000009"), "{list}");
    assert!(status.contains("\\u{1b}[31mred"), "{status}");
}

#[test]
fn checkpoints_and_cluster_tables() {
    let text = checkpoints_table(&ListCheckpointsResponse {
        checkpoints: vec![
            CheckpointInfo {
                step: 25,
                path: "/ck/job-000001/step-00000025".into(),
                verified: true,
                bytes: 2048,
                latest: false,
                tiers: vec!["L1".into(), "L2".into()],
            },
            CheckpointInfo {
                step: 50,
                path: "/ck/job-000001/step-00000050".into(),
                verified: false,
                bytes: 10,
                latest: true,
                tiers: vec![],
            },
        ],
    });
    assert!(
        text.contains("2.0 KiB")
            && text.contains("step-00000050")
            && text.contains("NO")
            && text.contains("L1+L2")
            && text.contains('*'),
        "{text}"
    );

    // The leader's own answer: it knows the workers' heartbeats and resources.
    let text = cluster_status(&ClusterStatusResponse {
        node_id: 1,
        leader_id: Some(1),
        term: 3,
        commit_index: Some(17),
        last_applied_index: Some(16),
        snapshot_index: Some(10),
        purged_index: None,
        insecure: false,
        members: vec![
            Member {
                node_id: 1,
                grpc_addr: "127.0.0.1:1".into(),
                http_addr: "127.0.0.1:2".into(),
                role: "leader".into(),
                voter: true,
                ..Default::default()
            },
            Member {
                node_id: 2,
                grpc_addr: "127.0.0.1:3".into(),
                http_addr: "127.0.0.1:4".into(),
                role: "unreachable".into(),
                voter: true,
                last_role: "follower".into(),
                last_ack_age_ms: Some(12_400),
                ..Default::default()
            },
        ],
        workers: vec![WorkerInfo {
            worker_id: "worker-1".into(),
            host: "127.0.0.1".into(),
            slots: 4,
            slots_used: 2,
            state: "alive".into(),
            last_heartbeat_age_ms: 420,
            cpu_percent: 12.6,
            memory_used_bytes: 3 << 30,
            memory_total_bytes: 8 << 30,
            ..Default::default()
        }],
    });
    for needle in [
        "leader: node 1",
        "term 3",
        "commit index 17",
        "last applied 16",
        "snapshot 10",
        "purged -",
        "2/4",
        "420 ms ago",
        "13%",
        "3.0 GiB / 8.0 GiB",
        "unreachable (was follower, no answer for 12.4 s)",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}

#[test]
fn a_raft_column_only_where_a_member_has_a_raft_port() {
    let member = |id: u64, raft: &str| Member {
        node_id: id,
        grpc_addr: format!("c{id}:7000"),
        http_addr: format!("c{id}:8000"),
        raft_addr: raft.into(),
        role: "follower".into(),
        voter: true,
        ..Default::default()
    };
    let status = |members| ClusterStatusResponse {
        members,
        ..Default::default()
    };
    let shared = cluster_status(&status(vec![member(1, ""), member(2, "")]));
    assert!(!shared.contains("RAFT"), "{shared}");
    let apart = cluster_status(&status(vec![member(1, "c1:7100"), member(2, "")]));
    assert!(apart.contains("RAFT"), "{apart}");
    assert!(apart.contains("c1:7100"), "{apart}");
    let row2 = apart
        .lines()
        .find(|l| l.contains("c2:7000"))
        .expect("row of node 2");
    assert!(row2.contains(" - "), "{row2}");
}

#[test]
fn non_finite_metrics_show_as_nan_inf_and_minus_inf() {
    let metrics: std::collections::BTreeMap<String, f64> = [
        ("a".to_string(), f64::NAN),
        ("b".to_string(), f64::INFINITY),
        ("c".to_string(), f64::NEG_INFINITY),
        ("d".to_string(), 0.25),
    ]
    .into();
    assert_eq!(metrics_text(&metrics), "a=nan b=inf c=-inf d=0.2500");
}

#[test]
fn small_formatters() {
    assert_eq!(bytes(0), "0 B");
    assert_eq!(bytes(1536), "1.5 KiB");
    assert_eq!(age(0, 5), "-");
    assert_eq!(age(1000, 1000 + 300_000), "5m ago");
    assert_eq!(age(1000, 1000 + 3 * 86_400_000), "3d ago");
    assert_eq!(
        shell_words(&["a".into(), "it's".into(), "".into()]),
        r"a 'it'\''s' ''"
    );
    assert_eq!(step_text(&RankStatus::default()), "-");
}
