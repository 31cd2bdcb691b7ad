//! `cumulusctl local up` run as root keeps a job's code from the cluster's credentials
//! (issue 39 item 7): its ranks run as a uid of the default range, never root, and cannot
//! read the token, the peer token, any TLS key, a coordinator's data dir or the logs,
//! nor write into another job's checkpoint directory; a job whose program its user
//! cannot reach fails at once, naming the directory in the way. Real processes: `local
//! up`, jobs whose ranks are shell scripts probing those paths. Needs root (skipped
//! otherwise, saying why) and the workspace's binaries (`cargo build --workspace --bins`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs `cumulusctl --local-dir <local> args…` with no CUMULUS_* variables inherited.
fn ctl(local: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cumulusctl"));
    cmd.arg("--local-dir").arg(local).args(args);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("CUMULUS_") {
            cmd.env_remove(name);
        }
    }
    cmd.output().expect("run cumulusctl")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Stops the cluster (and deletes its data) however the test ends.
struct Down(PathBuf);

impl Drop for Down {
    fn drop(&mut self) {
        let out = ctl(&self.0, &["local", "down", "--purge"]);
        if !out.status.success() {
            eprintln!("local down failed: {}", text(&out.stderr));
        }
    }
}

/// Submits a 1-rank job running `script` with `sh -c`, waits for it, and returns its
/// id and its log.
fn run_script(local: &Path, extra: &[&str], script: &str) -> (String, String) {
    let mut args = vec![
        "submit",
        "--world-size",
        "1",
        "--wait",
        "--wait-timeout-s",
        "120",
    ];
    args.extend_from_slice(extra);
    args.extend(["--", "/bin/sh", "-c", script]);
    let out = ctl(local, &args);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "submit failed: {}\n{stdout}",
        text(&out.stderr)
    );
    let job = stdout
        .lines()
        .next()
        .expect("submit prints the job id first")
        .trim()
        .to_string();
    let logs = ctl(local, &["logs", &job]);
    assert!(logs.status.success(), "logs: {}", text(&logs.stderr));
    (job, text(&logs.stdout))
}

#[test]
fn ranks_of_a_root_local_cluster_run_as_other_users_and_cannot_read_its_secrets() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!(
            "SKIPPED: needs root (`local up` changes the ranks' user only when run as root; \
             as another user its ranks run as that user)"
        );
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().expect("tempdir");
    // Ranks of other users pass through it to their workers' data dirs.
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let local = tmp.path().join("cluster");
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_cumulusctl"))
        .parent()
        .expect("bin dir")
        .to_path_buf();
    let out = ctl(
        &local,
        &[
            "local",
            "up",
            "--coordinators",
            "1",
            "--workers",
            "1",
            "--slots",
            "2",
            "--bin-dir",
            bin_dir.to_str().expect("utf-8"),
        ],
    );
    let _down = Down(local.clone());
    assert!(out.status.success(), "local up: {}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("ranks run as: a user and group of their own per job"),
        "{}",
        text(&out.stdout)
    );

    // A first job with a checkpoint directory: the agent makes its job dir there.
    let ckpt = tmp.path().join("ckpt");
    let ckpt_s = ckpt.to_str().expect("utf-8");
    let (first, _) = run_script(&local, &["--ckpt-dir", ckpt_s], "true");
    let first_dir = ckpt.join(&first);
    assert!(first_dir.is_dir(), "no job dir {}", first_dir.display());

    // A second job probes the cluster's secrets and the first job's directory.
    let secrets: Vec<PathBuf> = [
        "token",
        "peer-token",
        "tls/ca-key.pem",
        "tls/coordinator-1-key.pem",
        "tls/worker-1-key.pem",
        "coord-1.log",
        "worker-1.log",
    ]
    .iter()
    .map(|f| local.join(f))
    .collect();
    let dirs = [local.join("coord-1"), local.join("worker-1/logs")];
    let mut script = String::from("echo \"ids $(id -u) $(id -g)\"\n");
    for f in &secrets {
        script.push_str(&format!(
            "cat '{}' 2>&1 >/dev/null | head -n1\n",
            f.display()
        ));
    }
    for d in &dirs {
        script.push_str(&format!("ls '{}' 2>&1 | head -n1\n", d.display()));
    }
    let intruder = first_dir.join("intruder");
    script.push_str(&format!("touch '{}' 2>&1 | head -n1\n", intruder.display()));
    let (second, log) = run_script(&local, &[], &script);
    assert_ne!(first, second);

    let ids: Vec<u32> = log
        .lines()
        .find_map(|l| l.split_once("ids ").map(|(_, ids)| ids.to_string()))
        .unwrap_or_else(|| panic!("no ids line in the log:\n{log}"))
        .split_whitespace()
        .map(|n| n.parse().expect("a number"))
        .collect();
    assert!(
        ids.len() == 2 && ids.iter().all(|id| (60000..=60999).contains(id)),
        "the rank runs as {ids:?}, not as a uid and gid of 60000-60999:\n{log}"
    );
    for path in secrets.iter().chain(&dirs).chain([&intruder]) {
        let denied = format!("{}': Permission denied", path.display());
        let denied_plain = format!("{}: Permission denied", path.display());
        assert!(
            log.contains(&denied) || log.contains(&denied_plain),
            "the rank was not denied {}:\n{log}",
            path.display()
        );
    }
    assert!(!intruder.exists(), "the second job wrote into the first's");

    // A program its user cannot reach (as a Python under /root): the job fails at once,
    // no restart spent, and the message names the directory in the way and the fix.
    let closed = tmp.path().join("closed");
    std::fs::create_dir(&closed).expect("mkdir");
    let tool = closed.join("tool");
    std::fs::write(&tool, "#!/bin/sh\necho never runs\n").expect("write");
    std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let out = ctl(
        &local,
        &[
            "submit",
            "--world-size",
            "1",
            "--max-restarts",
            "3",
            "--wait",
            "--wait-timeout-s",
            "120",
            "--",
            tool.to_str().expect("utf-8"),
        ],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    let named = format!("cannot search {} (mode 0700, owner 0:0)", closed.display());
    assert!(
        stderr.contains(&named) && stderr.contains("--allow-root"),
        "the failure does not name {} and the fix:\n{stderr}",
        closed.display()
    );
    assert!(
        stdout.contains("0 used of 3"),
        "a restart was spent:\n{stdout}"
    );
    // What was denied exists and is not empty (the test would pass on a missing file).
    for f in &secrets {
        assert!(
            std::fs::metadata(f).is_ok_and(|m| m.len() > 0),
            "{} is missing or empty",
            f.display()
        );
    }
}
