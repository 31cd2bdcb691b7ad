//! End-to-end tests of jobs' Python environments (issue 41 item 2): real coordinator and
//! agent processes on loopback, the agent's uv (python/.venv/bin/uv, from
//! scripts/setup.sh) installing from a wheel directory built here (`--no-index
//! --find-links`: no package index is reached, no interpreter downloaded).

use std::path::Path;
use std::time::Duration;

use cumulus_api::{JobState, v1};
use cumulus_e2e::{Cluster, ClusterOpts, workspace_root};

const LONG: Duration = Duration::from_secs(180);

/// Writes a pure-Python wheel of package `name` whose `VALUE` is `value` into `dir`.
fn write_wheel(dir: &Path, name: &str, version: &str, value: u32) {
    let python = workspace_root().join("python/.venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/setup.sh",
        python.display()
    );
    let script = r#"
import sys, zipfile
dir, name, ver, value = sys.argv[1:5]
info = f"{name}-{ver}.dist-info"
with zipfile.ZipFile(f"{dir}/{name}-{ver}-py3-none-any.whl", "w") as z:
    z.writestr(f"{name}/__init__.py", f"VALUE = {value}\n")
    z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")
    z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: cumulus-e2e\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr(f"{info}/RECORD", f"{name}/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
"#;
    let status = std::process::Command::new(python)
        .args(["-c", script])
        .arg(dir)
        .args([name, version, &value.to_string()])
        .status()
        .expect("python");
    assert!(status.success(), "writing the wheel failed");
}

/// A job of `world_size` ranks, each importing `cumtestpkg` from its environment, which
/// asks for `requirements` from the wheels in `wheels`; three restarts allowed.
fn job(name: &str, world_size: u32, requirements: &str, wheels: &Path) -> v1::JobSpec {
    v1::JobSpec {
        name: name.into(),
        world_size,
        command: vec![
            "python".into(),
            "-c".into(),
            "import os, cumtestpkg; print('IMPORTED', os.environ['RANK'], cumtestpkg.VALUE)".into(),
        ],
        restart: Some(v1::RestartPolicy {
            max_restarts: Some(3),
            ..Default::default()
        }),
        environment: Some(v1::EnvironmentSpec {
            requirements: requirements.into(),
            python: String::new(),
            index_url: String::new(),
            find_links: vec![wheels.display().to_string()],
            no_index: true,
        }),
        ..Default::default()
    }
}

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_build_serves_concurrent_jobs_and_a_failed_install_fails_the_job_once() {
    // One worker: both jobs' ranks want the environment on it at about the same time.
    let cluster = Cluster::start(ClusterOpts {
        coordinators: 1,
        workers: 1,
        slots: 4,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let wheels = cluster.dir.path().join("wheels");
    std::fs::create_dir(&wheels).expect("mkdir");
    write_wheel(&wheels, "cumtestpkg", "1.0", 42);

    let a = cluster
        .submit("env-a", job("env-a", 2, "cumtestpkg\n", &wheels))
        .await
        .expect("submit a")
        .job_id;
    let b = cluster
        .submit("env-b", job("env-b", 1, "cumtestpkg\n", &wheels))
        .await
        .expect("submit b")
        .job_id;
    for id in [&a, &b] {
        let done = cluster.wait_finished(id, LONG).await;
        if done.job_state() != Ok(JobState::Succeeded) {
            cluster.dump_logs();
        }
        assert_eq!(done.job_state(), Ok(JobState::Succeeded), "{done:?}");
        assert_eq!(done.restarts_used, 0);
        let logs = cluster.cumulusctl(&["logs", id]).expect("logs");
        let logs = text(&logs);
        for rank in 0..done.spec.as_ref().map_or(0, |s| s.world_size) {
            assert!(logs.contains(&format!("IMPORTED {rank} 42")), "{logs}");
        }
        assert!(
            logs.contains("[setup] "),
            "the setup stream is in the logs: {logs}"
        );
    }
    // Three ranks of two jobs, one build on the worker.
    let agent_log = std::fs::read_to_string(&cluster.workers[0].log).expect("agent log");
    let builds = agent_log
        .lines()
        .filter(|l| l.contains("building a Python environment"))
        .count();
    assert_eq!(builds, 1, "{agent_log}");
    let envs_dir = cluster
        .dir
        .path()
        .join(&cluster.workers[0].name)
        .join("envs");
    let ready: Vec<String> = std::fs::read_dir(&envs_dir)
        .expect("envs dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    assert_eq!(ready.len(), 1, "{ready:?}");

    // A requirement no location has: the job fails at once, spending no restart, with
    // uv's message as its cause.
    let bad = cluster
        .submit("env-bad", job("env-bad", 1, "doesnotexist==1.0\n", &wheels))
        .await
        .expect("submit bad")
        .job_id;
    let failed = cluster.wait_finished(&bad, LONG).await;
    assert_eq!(failed.job_state(), Ok(JobState::Failed), "{failed:?}");
    assert_eq!(failed.restarts_used, 0, "{failed:?}");
    assert!(failed.restarts.is_empty(), "{failed:?}");
    assert!(
        failed
            .failure_cause
            .contains("cannot build the Python environment")
            && failed.failure_cause.contains("doesnotexist"),
        "{}",
        failed.failure_cause
    );
    let logs = text(&cluster.cumulusctl(&["logs", &bad]).expect("logs"));
    assert!(logs.contains("doesnotexist"), "{logs}");
    assert!(!logs.contains("IMPORTED"), "{logs}");
}
