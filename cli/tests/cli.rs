//! The `cumulusctl` binary as a user runs it: dataset split on the bundled digits data,
//! argument errors, and the errors shown when no cluster is reachable or configured.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn digits() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/digits/digits.csv.gz")
}

/// Runs `cumulusctl args…` in `cwd` with no CUMULUS_* variables inherited.
fn ctl(cwd: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cumulusctl"));
    cmd.current_dir(cwd).args(args);
    for var in [
        "CUMULUS_ADDR",
        "CUMULUS_HTTP",
        "CUMULUS_TOKEN",
        "CUMULUS_TOKEN_FILE",
        "CUMULUS_LOCAL_DIR",
    ] {
        cmd.env_remove(var);
    }
    cmd.output().expect("run cumulusctl")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn dataset_split_of_digits_writes_shards_and_holdout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let input = digits();
    let out = ctl(
        dir.path(),
        &[
            "dataset",
            "split",
            input.to_str().expect("utf8"),
            "--shards",
            "8",
            "--out",
            "shards",
            "--holdout-out",
            "holdout.csv",
        ],
    );
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("1797 rows"), "{stdout}");
    assert!(stdout.contains("holdout: 359 rows"), "{stdout}");
    let mut names: Vec<String> = std::fs::read_dir(dir.path().join("shards"))
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".feature-stats.json")
        .collect();
    names.sort();
    assert_eq!(names.len(), 8);
    assert!(dir.path().join("shards/.feature-stats.json").is_file());
    assert_eq!(names[0], "shard-00000.csv");
    assert_eq!(names[7], "shard-00007.csv");
    let hold = std::fs::read_to_string(dir.path().join("holdout.csv")).expect("holdout");
    assert_eq!(hold.lines().count(), 359);

    // A second run into the same directory is refused without --force …
    let again = ctl(
        dir.path(),
        &[
            "dataset",
            "split",
            input.to_str().expect("utf8"),
            "--shards",
            "4",
            "--out",
            "shards",
        ],
    );
    assert_eq!(again.status.code(), Some(1));
    let err = text(&again.stderr);
    assert!(
        err.starts_with("error: ") && err.contains("--force"),
        "{err}"
    );

    // … and allowed with it; -o json is machine-readable.
    let forced = ctl(
        dir.path(),
        &[
            "-o",
            "json",
            "dataset",
            "split",
            input.to_str().expect("utf8"),
            "--shards",
            "4",
            "--out",
            "shards",
            "--force",
        ],
    );
    assert!(forced.status.success(), "stderr: {}", text(&forced.stderr));
    let v: serde_json::Value = serde_json::from_slice(&forced.stdout).expect("json");
    assert_eq!(v["rows"], 1797);
    assert_eq!(v["holdout_rows"], 0);
    assert_eq!(v["shard_rows"].as_array().expect("array").len(), 4);
    assert_eq!(
        std::fs::read_dir(dir.path().join("shards"))
            .expect("ls")
            .count(),
        4 + 1,
        "stale shards removed (4 shards and their statistics)"
    );

    // -o yaml holds the same fields as -o json.
    let yaml = ctl(
        dir.path(),
        &[
            "-o",
            "yaml",
            "dataset",
            "split",
            input.to_str().expect("utf8"),
            "--shards",
            "4",
            "--out",
            "shards",
            "--force",
        ],
    );
    assert!(yaml.status.success(), "stderr: {}", text(&yaml.stderr));
    let y: serde_json::Value = yaml_serde::from_slice(&yaml.stdout).expect("yaml");
    assert_eq!(y, v, "{}", text(&yaml.stdout));
}

#[test]
fn a_bad_row_is_named_with_its_line_and_a_hint() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("bad.csv"), "1,2,3\n4,5,6\n7,eight,9\n").expect("write");
    let out = ctl(
        dir.path(),
        &["dataset", "split", "bad.csv", "--shards", "2", "--out", "s"],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("bad.csv:3") && err.contains("\"eight\" is not a number"),
        "{err}"
    );
    assert!(err.contains("hint: "), "{err}");
}

#[test]
fn options_set_by_the_environment_stay_out_of_the_usage_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_cumulusctl"))
        .current_dir(dir.path())
        .env("CUMULUS_LOCAL_DIR", dir.path())
        .env("CUMULUS_ADDR", "127.0.0.1:1")
        .args(["status"])
        .output()
        .expect("run cumulusctl");
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    let usage = stderr
        .lines()
        .find(|l| l.starts_with("Usage:"))
        .unwrap_or_else(|| panic!("no usage line: {stderr}"));
    assert_eq!(usage, "Usage: cumulusctl status <JOB>", "{stderr}");
}

#[test]
fn usage_errors_exit_2() {
    let dir = tempfile::tempdir().expect("tempdir");
    for args in [
        vec!["submit", "--", "true"],
        vec!["submit", "--world-size", "0", "--", "true"],
        vec!["--token", "a", "--token-file", "b", "list"],
        vec!["dataset", "split", "x.csv", "--shards", "0", "--out", "o"],
        vec!["-o", "xml", "list"],
        vec!["frobnicate"],
    ] {
        let out = ctl(dir.path(), &args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}

#[test]
fn without_a_cluster_the_error_says_what_to_pass() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = ctl(dir.path(), &["list"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.starts_with("error: no coordinator address: pass --addr"),
        "{err}"
    );
    assert!(err.contains("cumulusctl local up"), "{err}");

    let out = ctl(
        dir.path(),
        &["--addr", "127.0.0.1:9", "status", "job-000001"],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("no token"),
        "{}",
        text(&out.stderr)
    );

    let out = ctl(dir.path(), &["local", "status"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("no local cluster"),
        "{}",
        text(&out.stderr)
    );

    let out = ctl(
        dir.path(),
        &[
            "local",
            "up",
            "--bin-dir",
            dir.path().to_str().expect("utf8"),
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("cannot find cumulus-coordinator"), "{err}");
}

/// The pid `cluster.json` records for the first coordinator or the first worker.
fn recorded_pid(local_dir: &Path, kind: &str) -> Option<u64> {
    let text = std::fs::read_to_string(local_dir.join("cluster.json")).expect("cluster.json");
    let file: serde_json::Value = serde_json::from_str(&text).expect("json");
    file[kind][0]["pid"].as_u64()
}

#[test]
fn local_up_restarts_the_dead_processes_of_a_partly_dead_cluster_in_place() {
    let dir = tempfile::tempdir().expect("tempdir");
    // As root, ranks run as other users, who must pass through it to the worker's dir.
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_cumulusctl"))
        .parent()
        .expect("bin dir")
        .to_str()
        .expect("utf-8")
        .to_string();
    let local = dir.path().join("cluster");
    let local_s = local.to_str().expect("utf-8");
    let up = |extra: &[&str]| {
        let mut args = vec!["--local-dir", local_s, "local", "up", "--bin-dir", &bin_dir];
        args.extend_from_slice(extra);
        ctl(dir.path(), &args)
    };
    let out = up(&["--coordinators", "1", "--workers", "1", "--slots", "1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let coordinator = recorded_pid(&local, "coordinators").expect("coordinator pid");
    let worker = recorded_pid(&local, "workers").expect("worker pid");

    // All up: nothing to do, and it says so.
    let out = up(&[]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("already running"),
        "{}",
        text(&out.stderr)
    );

    // The worker dies: `local up` starts it again and keeps the coordinator.
    let pid = i32::try_from(worker).expect("pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the worker this test started");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while Path::new(&format!("/proc/{pid}/stat")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the worker did not die"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = up(&[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(recorded_pid(&local, "coordinators"), Some(coordinator));
    let restarted = recorded_pid(&local, "workers").expect("new worker pid");
    assert_ne!(restarted, worker);

    // The worker is restarted by hand, with the same command line: `local status`
    // finds it and records it, and `local down` stops it.
    let cmdline = std::fs::read(format!("/proc/{restarted}/cmdline")).expect("cmdline");
    let argv: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let pid = i32::try_from(restarted).expect("pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the worker local up started");
    while std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z ")) {
        assert!(
            std::time::Instant::now() < deadline,
            "the worker did not die"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let log = std::fs::File::create(dir.path().join("by-hand.log")).expect("log");
    let mut by_hand = Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("start the worker by hand");
    let out = ctl(
        dir.path(),
        &["--local-dir", local_s, "local", "status", "-o", "json"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let worker_row = status["processes"]
        .as_array()
        .expect("processes")
        .iter()
        .find(|p| p["name"] == "worker-1")
        .cloned()
        .unwrap_or_default();
    assert_eq!(worker_row["alive"], true, "{status}");
    assert_eq!(worker_row["pid"].as_u64(), Some(u64::from(by_hand.id())));
    assert_eq!(
        recorded_pid(&local, "workers"),
        Some(u64::from(by_hand.id()))
    );

    let out = ctl(
        dir.path(),
        &["--local-dir", local_s, "local", "down", "--purge"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Stopped by `local down` (SIGTERM): reaped here, since this test started it.
    loop {
        if by_hand.try_wait().expect("wait").is_some() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline + std::time::Duration::from_secs(60),
            "local down left the worker started by hand running"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn timeout_bounds_how_long_an_unreachable_cluster_is_retried() {
    let dir = tempfile::tempdir().expect("tempdir");
    let token = dir.path().join("token");
    std::fs::write(&token, "0123456789abcdef0123\n").expect("token");
    // A port nothing listens on: every attempt is refused at once.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let started = std::time::Instant::now();
    let out = ctl(
        dir.path(),
        &[
            "--addr",
            &addr,
            "--insecure",
            "--token-file",
            token.to_str().expect("utf-8"),
            "--timeout",
            "1",
            "list",
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    // Well below the default of 30 s: the flag took effect.
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "gave up after {:?}",
        started.elapsed()
    );
    let err = text(&out.stderr);
    assert!(err.contains("is the cluster running?"), "{err}");
    assert!(!err.contains("WARN"), "no tracing lines without -v: {err}");
}
