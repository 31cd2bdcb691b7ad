//! Snapshots of what a user reads: `--help` of the main commands and the main tables
//! rendered from fixed answers. A change to any of them fails here until the snapshot
//! under `cli/tests/snapshots/` is updated, so that it is seen in review:
//!
//!     UPDATE_SNAPSHOTS=1 cargo test -p cumulusctl --test snapshots

use std::path::PathBuf;
use std::process::Command;

use cumulus_api::{
    ClusterStatusResponse, GpuDevice, GpuInfo, GpuStatus, Job, JobResponse, JobSpec,
    ListJobsResponse, Member, RankStatus, RestartPolicy, RestartRecord, WarmSpare, WorkerInfo,
};
use cumulusctl::render;

fn check(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(format!("{name}.txt"));
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, actual).expect("write snapshot");
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        expected == actual,
        "{} changed; if that is intended, update it with\n  UPDATE_SNAPSHOTS=1 cargo test -p cumulusctl --test snapshots\n--- expected\n{expected}\n--- actual\n{actual}",
        path.display()
    );
}

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_cumulusctl"))
        .args(args)
        .arg("--help")
        // The help shows defaults and environment variables: none from this shell.
        .env_clear()
        .output()
        .expect("run cumulusctl");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).expect("utf-8")
}

#[test]
fn help_texts() {
    check("help", &help(&[]));
    check("help-submit", &help(&["submit"]));
    check("help-list", &help(&["list"]));
    check("help-token-create", &help(&["token", "create"]));
}

fn job() -> Job {
    Job {
        id: "job-000007".into(),
        spec: Some(JobSpec {
            name: "digits".into(),
            world_size: 2,
            command: vec![
                "python".into(),
                "train.py".into(),
                "--lr".into(),
                "0.1".into(),
            ],
            restart: Some(RestartPolicy {
                max_restarts: Some(3),
                ..Default::default()
            }),
            ckpt_dir: "/ckpt".into(),
            gpus_per_rank: 1,
            ..Default::default()
        }),
        state: "running".into(),
        owner: "alice".into(),
        submitted_at_ms: 1_000_000,
        restarts_used: 1,
        committed_step: Some(200),
        shard_count: 8,
        ranks: vec![
            RankStatus {
                rank: 0,
                attempt: 1,
                worker_id: "worker-1".into(),
                state: "running".into(),
                pid: 4242,
                step: 260,
                total_steps: 690,
                gpus: vec!["GPU-0f3a".into()],
                metrics: [("loss".to_string(), 0.2314), ("accuracy".to_string(), 0.91)].into(),
                steps_per_s: 12.34,
                eta_ms: 34_850,
                ..Default::default()
            },
            RankStatus {
                rank: 1,
                attempt: 1,
                worker_id: "worker-2".into(),
                state: "running".into(),
                pid: 5151,
                step: 258,
                total_steps: 690,
                gpus: vec!["GPU-9c1e".into()],
                metrics: [("loss".to_string(), 0.2502)].into(),
                steps_per_s: 12.1,
                eta_ms: 35_700,
                ..Default::default()
            },
        ],
        restarts: vec![RestartRecord {
            number: 1,
            delay_ms: 512,
            cause: "rank 1 attempt 0 was killed by signal 9".into(),
            ranks: vec![0, 1],
            resume_step: Some(200),
            path: "in_process".into(),
            path_reason: "ranks [0] keep their processes (cumulus.runtime.run); ranks [1] get \
                          new ones"
                .into(),
            in_process_ranks: vec![0],
            ..Default::default()
        }],
        ..Default::default()
    }
}

#[test]
fn tables() {
    let now_ms = 1_000_000 + 95_000;
    let list = ListJobsResponse {
        jobs: vec![
            Job {
                running_ms: 95_000,
                ..job()
            },
            Job {
                id: "job-000008".into(),
                state: "pending".into(),
                owner: "bob".into(),
                ranks: vec![],
                ..job()
            },
        ],
    };
    check("list", &render::jobs_table(&list, now_ms));
    check("list-wide", &render::jobs_table_wide(&list, now_ms));
    check(
        "status",
        &render::job_status(
            &JobResponse {
                job: Some(job()),
                linearizable: true,
            },
            now_ms,
        ),
    );
    let mut finished = job();
    finished.state = "failed".into();
    finished.failure_cause =
        "restart budget of 3 exhausted; last failure: rank 1 attempt 3 exited with code 1".into();
    finished.finished_at_ms = 1_094_000;
    finished.restarts[0].failed_at_ms = 1_020_000;
    finished.restarts[0].not_before_ms = 1_020_512;
    finished.ranks[0].started_at_ms = 1_021_000;
    finished.ranks[1].started_at_ms = 1_021_100;
    finished.ranks[1].exited_at_ms = 1_093_000;
    finished.ranks[1].exit_code = Some(1);
    check("describe-events", &render::events_table(&finished));
    let worker = WorkerInfo {
        worker_id: "worker-1".into(),
        host: "10.0.0.5".into(),
        http_addr: "10.0.0.5:9000".into(),
        slots: 8,
        slots_used: 2,
        state: "alive".into(),
        last_heartbeat_age_ms: 420,
        cpu_percent: 37.4,
        memory_used_bytes: 12 << 30,
        memory_total_bytes: 64 << 30,
        gpus: vec![GpuInfo {
            device: Some(GpuDevice {
                index: 0,
                uuid: "GPU-0f3a".into(),
                name: "NVIDIA H100 80GB HBM3".into(),
                memory_total_bytes: 80 << 30,
            }),
            status: Some(GpuStatus {
                uuid: "GPU-0f3a".into(),
                memory_used_bytes: 20 << 30,
                utilization_percent: 93,
                healthy: true,
                error: String::new(),
            }),
            allocated: 1.0,
        }],
        warm_spares: vec![WarmSpare {
            job_id: "job-000007".into(),
            pid: 4242,
            age_ms: 12_300,
        }],
    };
    check(
        "cluster-status",
        &render::cluster_status(&ClusterStatusResponse {
            node_id: 1,
            leader_id: Some(1),
            term: 4,
            commit_index: Some(1234),
            last_applied_index: Some(1234),
            members: vec![Member {
                node_id: 1,
                grpc_addr: "10.0.0.1:7000".into(),
                http_addr: "10.0.0.1:8000".into(),
                role: "leader".into(),
                voter: true,
                ..Default::default()
            }],
            workers: vec![worker.clone()],
            ..Default::default()
        }),
    );
    check(
        "workers-from-a-follower",
        &render::workers_text(&ClusterStatusResponse {
            node_id: 2,
            leader_id: Some(1),
            workers: vec![worker],
            ..Default::default()
        }),
    );
}
