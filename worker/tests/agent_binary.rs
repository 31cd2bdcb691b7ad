//! The real `cumulus-worker` binary, run without any coordinator listening: it must serve
//! its HTTP API, start no rank, finalize orphans left in its data dir, refuse unsafe
//! configurations, and stop cleanly on SIGTERM. (Cluster tests with real coordinators live
//! with the coordinator.)

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use cumulus_worker::orphans::{self, PidRecord};
use cumulus_worker::{AgentInfo, agent_info_path};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const DEADLINE: Duration = Duration::from_secs(30);
const TOKEN: &str = "bin-test-token-0123456789";

/// The agent, plaintext (`--insecure`: these tests read its HTTP API with a plain
/// client; TLS is covered by the listener's and the cluster's tests).
fn agent_command(data: &Path, token_file: &Path, extra: &[&str]) -> Command {
    let mut cmd = agent_command_without_tls(data, token_file, extra);
    cmd.arg("--insecure");
    cmd
}

fn agent_command_without_tls(data: &Path, token_file: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cumulus-worker"));
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("CUMULUS_") {
            cmd.env_remove(key);
        }
    }
    // Ranks run as the agent's user, whoever runs the tests (root refuses that without it).
    cmd.env("CUMULUS_ALLOW_ROOT", "true");
    cmd.args(["--coordinators", "127.0.0.1:1", "--worker-id", "w-bin"])
        .arg("--data-dir")
        .arg(data)
        .arg("--token-file")
        .arg(token_file)
        .args(["--heartbeat-interval-ms", "50"])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

fn wait_exit(child: &mut Child) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        assert!(start.elapsed() < DEADLINE, "the agent did not exit in time");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn stderr_of(child: &mut Child) -> String {
    use std::io::Read;
    let mut text = String::new();
    if let Some(mut err) = child.stderr.take() {
        let _ = err.read_to_string(&mut text);
    }
    text
}

fn wait_info(data: &Path, child: &mut Child) -> AgentInfo {
    let start = Instant::now();
    loop {
        if let Ok(bytes) = std::fs::read(agent_info_path(data))
            && let Ok(info) = serde_json::from_slice::<AgentInfo>(&bytes)
        {
            return info;
        }
        if let Some(status) = child.try_wait().expect("try_wait") {
            panic!("agent exited early ({status}): {}", stderr_of(child));
        }
        assert!(start.elapsed() < DEADLINE, "agent.json never appeared");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rsplit_once(") ").and_then(|(_, r)| r.chars().next()),
            Some('Z') | Some('X') | None
        ),
        Err(_) => false,
    }
}

struct Setup {
    _dir: tempfile::TempDir,
    data: PathBuf,
    token_file: PathBuf,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("token");
    Setup {
        data,
        token_file,
        _dir: dir,
    }
}

#[test]
fn serves_logs_finalizes_orphans_and_stops_on_sigterm() {
    let s = setup();
    // A rank left by a previous agent on this data dir.
    let mut orphan = Command::new("sleep")
        .arg("1000")
        .process_group(0)
        .spawn()
        .expect("orphan");
    let orphan_pid = orphan.id();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(orphans::write(
        &s.data,
        &PidRecord {
            job_id: "job-000042".into(),
            rank: 0,
            attempt: 1,
            pid: Some(orphan_pid),
            start_ticks: orphans::process_start_ticks(orphan_pid),
        },
    ))
    .expect("pid record");

    let mut agent = agent_command(&s.data, &s.token_file, &[])
        .spawn()
        .expect("start agent");
    let info = wait_info(&s.data, &mut agent);
    assert_eq!(info.worker_id, "w-bin");
    assert_eq!(info.pid, agent.id());
    assert_eq!(
        info.http_addr,
        format!("127.0.0.1:{}", info.listen_addr.port())
    );
    assert!(info.rank_api_addr.ip().is_loopback());

    // The orphan was killed and its attempt finalized before anything else.
    let status = orphan.wait().expect("wait orphan");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    let exit = s.data.join("logs/job-000042/rank-0/attempt-1.exit");
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&exit).expect("exit record")).expect("json");
    assert_eq!(record["signal"], 9);

    let http = reqwest::blocking::Client::new();
    let base = format!("http://{}", info.listen_addr);
    assert_eq!(
        http.get(format!("{base}/health"))
            .send()
            .expect("health")
            .status(),
        200
    );
    let log_url = format!("{base}/v1/logs/job-000042/0/1");
    assert_eq!(http.get(&log_url).send().expect("send").status(), 401);
    let r = http.get(&log_url).bearer_auth(TOKEN).send().expect("send");
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()
            .get("x-cumulus-log-complete")
            .and_then(|v| v.to_str().ok()),
        Some("true")
    );
    let text = r.text().expect("body");
    assert!(text.contains("this attempt was lost"), "{text}");
    // The rank-local API knows no token yet.
    let r = http
        .post(format!("http://{}/v1/progress", info.rank_api_addr))
        .bearer_auth("nobody")
        .json(&serde_json::json!({"step": 1}))
        .send()
        .expect("send");
    assert_eq!(r.status(), 401);

    // A second agent on the same data dir is refused.
    let mut second = agent_command(&s.data, &s.token_file, &[])
        .spawn()
        .expect("start second");
    let status = wait_exit(&mut second);
    assert!(!status.success());
    assert!(stderr_of(&mut second).contains("another agent"));

    kill(Pid::from_raw(agent.id() as i32), Signal::SIGTERM).expect("SIGTERM");
    let status = wait_exit(&mut agent);
    let log = stderr_of(&mut agent);
    assert!(status.success(), "{status}: {log}");
    assert!(log.contains("agent stopped"), "{log}");
    assert!(!agent_info_path(&s.data).exists());
    // No coordinator ever answered: no rank was started.
    let logs: Vec<_> = std::fs::read_dir(s.data.join("logs"))
        .expect("logs")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(logs, vec![std::ffi::OsString::from("job-000042")]);
    assert!(!s.data.join("jobs").exists());
    assert!(!alive(orphan_pid));
}

#[test]
fn refuses_unsafe_or_incomplete_configuration() {
    let s = setup();
    let mut agent = agent_command(&s.data, &s.token_file, &["--rank-api-listen", "0.0.0.0:0"])
        .spawn()
        .expect("start");
    let status = wait_exit(&mut agent);
    assert!(!status.success());
    assert!(stderr_of(&mut agent).contains("loopback"));

    let missing = s.data.join("no-such-token");
    let mut agent = agent_command(&s.data, &missing, &[])
        .spawn()
        .expect("start");
    let status = wait_exit(&mut agent);
    assert!(!status.success());
    assert!(stderr_of(&mut agent).contains("token file"));

    // Neither TLS files nor --insecure: TLS is required.
    let mut agent = agent_command_without_tls(&s.data, &s.token_file, &[])
        .spawn()
        .expect("start");
    let status = wait_exit(&mut agent);
    assert!(!status.success());
    let stderr = stderr_of(&mut agent);
    assert!(
        stderr.contains("TLS is required") && stderr.contains("--insecure"),
        "{stderr}"
    );
}

/// Who ranks run as: an agent running as root refuses to start ranks as root unless
/// told (`--allow-root`); `--run-as` needs root; with `--run-as`, a token file other
/// users can read is refused (ranks would read the cluster token).
#[test]
fn refuses_root_ranks_and_readable_secrets() {
    use std::os::unix::fs::PermissionsExt;
    let s = setup();
    let root = nix::unistd::geteuid().is_root();
    let mut agent = agent_command(&s.data, &s.token_file, &[]);
    agent.env_remove("CUMULUS_ALLOW_ROOT");
    let mut agent = agent.spawn().expect("start");
    if root {
        let status = wait_exit(&mut agent);
        assert!(!status.success());
        let stderr = stderr_of(&mut agent);
        assert!(
            stderr.contains("refusing to run ranks as root") && stderr.contains("--run-as"),
            "{stderr}"
        );
    } else {
        // Ranks run as the agent's own, unprivileged, user: it starts.
        wait_info(&s.data, &mut agent);
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(agent.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .expect("sigterm");
        wait_exit(&mut agent);
    }

    std::fs::set_permissions(&s.token_file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let mut agent = agent_command(&s.data, &s.token_file, &["--run-as", "60000-60099"])
        .spawn()
        .expect("start");
    let status = wait_exit(&mut agent);
    assert!(!status.success());
    let stderr = stderr_of(&mut agent);
    if root {
        assert!(
            stderr.contains("readable by other users") && stderr.contains("chmod 600"),
            "{stderr}"
        );
    } else {
        assert!(
            stderr.contains("needs the agent to run as root"),
            "{stderr}"
        );
    }
}
