//! Ranks isolated from the agent and from each other (issue #25, item 3): an agent
//! started with `--run-as FIRST-LAST` runs each job's ranks as a user and group of their
//! own. Probed from inside real ranks (Python scripts) on a real cluster:
//! - a rank runs as its job's uid and gid, in a session of its own, with a minimal
//!   environment (none of the agent's `CUMULUS_*` or S3 settings);
//! - it cannot read the agent's environment, its token file, its TLS key or its logs;
//! - it reaches the rank-local API only through the agent's Unix socket and with its own
//!   token: another rank's token, read from that rank's environment, is refused;
//! - it commits a checkpoint part through the rank-local API, can read it back, but can
//!   neither change a committed file nor add one to the committed part;
//! - another job's rank can neither list the first job's checkpoint or staging
//!   directories, nor signal or inspect its process.
//!
//! Needs root (the agent changes the ranks' user); as another user the test says so and
//! checks instead that the agent refuses `--run-as`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use cumulus_api::v1;
use cumulus_api::{JobState, RankPhase};
use cumulus_e2e::{
    Cluster, ClusterOpts, assert_trainer_results, prepare_digits, trainer_spec, wait_for,
};

const LONG: Duration = Duration::from_secs(180);
const FIRST_UID: u32 = 61_000;
const UID_RANGE: u32 = 1_000;

/// Probes run by rank 0 of the first job (rank 1 only waits); prints `probe NAME:
/// RESULT` lines, then `ready`, and waits to be stopped.
const PROBE_A: &str = r#"
import http.client, json, os, socket, sys, time, urllib.parse
if os.environ["RANK"] == "1":
    while True:
        time.sleep(1)
class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=60)
        self.path_ = path
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(self.path_)
def call(method, path, body, token, tcp=False):
    if tcp:
        url = urllib.parse.urlsplit(os.environ["CUMULUS_AGENT_URL"])
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    else:
        conn = UnixConnection(os.environ["CUMULUS_AGENT_SOCKET"])
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={
        "Authorization": "Bearer " + token, "Content-Type": "application/json"})
    reply = conn.getresponse()
    out = reply.status, reply.read()
    conn.close()
    return out
def peer_token():
    me = os.environ["CUMULUS_JOB_ID"].encode()
    deadline = time.time() + 120
    while time.time() < deadline:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            kv = dict(e.split(b"=", 1) for e in env if b"=" in e)
            if kv.get(b"CUMULUS_JOB_ID") == me and kv.get(b"RANK") == b"1":
                return kv[b"CUMULUS_AGENT_TOKEN"].decode()
        time.sleep(0.2)
    raise RuntimeError("rank 1 not found")
own = os.environ["CUMULUS_AGENT_TOKEN"]
print(f"progress own-token socket: {call('POST', '/v1/progress', {'step': 1}, own)[0]}", flush=True)
print(f"progress own-token tcp: {call('POST', '/v1/progress', {'step': 1}, own, tcp=True)[0]}", flush=True)
stolen = peer_token()
print(f"progress rank-1-token socket: {call('POST', '/v1/progress', {'step': 1}, stolen)[0]}", flush=True)
def probe(name, fn):
    try:
        fn()
        print(f"probe {name}: allowed", flush=True)
    except PermissionError:
        print(f"probe {name}: denied", flush=True)
    except Exception as e:
        print(f"probe {name}: error {type(e).__name__} {e}", flush=True)
print(f"ids uid={os.getuid()} gid={os.getgid()} groups={sorted(os.getgroups())}", flush=True)
print(f"session sid={os.getsid(0)} pid={os.getpid()}", flush=True)
leaks = sorted(k for k in os.environ if k.startswith(("CUMULUS_S3", "CUMULUS_TOKEN", "AWS_", "RUST_")))
print(f"leaked env: {leaks}", flush=True)
probe("agent-environ", lambda: open(f"/proc/{os.environ['AGENT_PID']}/environ", "rb").read())
probe("token-file", lambda: open(os.environ["TOKEN_FILE"], "rb").read())
probe("tls-key", lambda: open(os.environ["TLS_KEY"], "rb").read())
probe("agent-logs", lambda: os.listdir(os.environ["AGENT_LOGS"]))
staging = os.environ["CUMULUS_CKPT_STAGING"]
with open(os.path.join(staging, "weights.bin"), "wb") as f:
    f.write(b"w" * 1024)
status, reply = call("POST", "/v1/checkpoint", {"step": 1, "state": {"ok": True}}, own)
assert status == 200, (status, reply)
part = json.loads(reply)["dir"]
committed = os.path.join(os.environ["CKPT_ROOT"], os.environ["CUMULUS_JOB_ID"], part)
print(f"committed {committed}", flush=True)
probe("read-committed", lambda: open(os.path.join(committed, "weights.bin"), "rb").read())
probe("write-committed", lambda: open(os.path.join(committed, "weights.bin"), "ab").write(b"x"))
probe("add-to-committed", lambda: open(os.path.join(committed, "extra.bin"), "wb").write(b"x"))
probe("write-staging", lambda: open(os.path.join(staging, "next.bin"), "wb").write(b"x"))
print("ready", flush=True)
while True:
    time.sleep(1)
"#;

/// Probes run by the second job's rank against the first job.
const PROBE_B: &str = r#"
import os, signal
def probe(name, fn):
    try:
        fn()
        print(f"probe {name}: allowed", flush=True)
    except PermissionError:
        print(f"probe {name}: denied", flush=True)
    except Exception as e:
        print(f"probe {name}: error {type(e).__name__} {e}", flush=True)
print(f"ids uid={os.getuid()} gid={os.getgid()}", flush=True)
probe("list-other-job", lambda: os.listdir(os.environ["OTHER_JOB_DIR"]))
probe("other-staging", lambda: os.listdir(os.path.join(os.environ["OTHER_JOB_DIR"], ".staging")))
probe("other-part", lambda: open(os.environ["OTHER_PART"] + "/weights.bin", "rb").read())
probe("signal-other-rank", lambda: os.kill(int(os.environ["OTHER_PID"]), signal.SIGTERM))
probe("other-rank-environ", lambda: open(f"/proc/{os.environ['OTHER_PID']}/environ", "rb").read())
print("done", flush=True)
"#;

fn log_of(cluster: &Cluster, job_id: &str) -> PathBuf {
    cluster
        .dir
        .path()
        .join("worker-1/logs")
        .join(job_id)
        .join("rank-0/attempt-0.log")
}

/// The log text once it contains `line` (a whole line); panics with the log when the
/// job ends first.
async fn wait_line(cluster: &Cluster, job_id: &str, line: &str) -> String {
    let path = log_of(cluster, job_id);
    let found = wait_for(&format!("{line:?} in {}", path.display()), LONG, || {
        let path = path.clone();
        async move {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            if text.lines().any(|l| l == line) {
                return Some(Ok(text));
            }
            let job = cluster.job(job_id).await?;
            matches!(job.state.as_str(), "failed" | "cancelled").then(|| {
                Err(format!(
                    "job {job_id} is {} ({}); rank 0's log:\n{text}",
                    job.state, job.failure_cause
                ))
            })
        }
    })
    .await;
    found.unwrap_or_else(|e| panic!("{e}"))
}

fn value_after<'a>(text: &'a str, prefix: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?} in:\n{text}"))
}

fn assert_probe(text: &str, name: &str, want: &str) {
    let got = value_after(text, &format!("probe {name}: "));
    assert_eq!(got, want, "probe {name}; the rank's output:\n{text}");
}

fn python_job(
    world_size: u32,
    script: &str,
    env: &[(&str, String)],
    ckpt_dir: &Path,
) -> v1::JobSpec {
    v1::JobSpec {
        world_size,
        command: vec!["python3".into(), "-c".into(), script.into()],
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
        ckpt_dir: ckpt_dir.display().to_string(),
        working_dir: "/".into(),
        restart: Some(v1::RestartPolicy {
            max_restarts: Some(0),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The user (and group) id of job `job_id`'s ranks under `--run-as FIRST_UID-...`.
fn job_uid(job_id: &str) -> u32 {
    let n: u32 = job_id
        .trim_start_matches("job-")
        .parse()
        .expect("job number");
    FIRST_UID + n % UID_RANGE
}

fn run_as_cluster_opts() -> ClusterOpts {
    ClusterOpts {
        workers: 1,
        worker_args: vec![
            "--run-as".into(),
            format!("{FIRST_UID}-{}", FIRST_UID + UID_RANGE - 1),
        ],
        ..ClusterOpts::default()
    }
}

fn mode_owner(path: &Path) -> (u32, u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (m.mode() & 0o7777, m.uid(), m.gid())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_run_as_their_jobs_user_and_reach_nothing_else() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!(
            "rank isolation needs root (the agent changes the ranks' user); \
             worker/tests/agent_binary.rs checks that --run-as is refused without it"
        );
        return;
    }
    let cluster = Cluster::start(run_as_cluster_opts())
        .await
        .expect("cluster");
    let root = cluster.dir.path().to_path_buf();
    let ckpt = root.join("ckpt");
    let agent_pid = cluster.workers[0]
        .child
        .as_ref()
        .expect("worker running")
        .id();

    let job_a = cluster
        .submit(
            "isolation-a",
            python_job(
                2,
                PROBE_A,
                &[
                    ("AGENT_PID", agent_pid.to_string()),
                    ("TOKEN_FILE", root.join("token").display().to_string()),
                    (
                        "TLS_KEY",
                        root.join("tls/worker-1-key.pem").display().to_string(),
                    ),
                    (
                        "AGENT_LOGS",
                        root.join("worker-1/logs").display().to_string(),
                    ),
                    ("CKPT_ROOT", ckpt.display().to_string()),
                ],
                &ckpt,
            ),
        )
        .await
        .expect("submit a")
        .job_id;
    let text_a = wait_line(&cluster, &job_a, "ready").await;

    // Its job's own ids, in a session of its own, with nothing of the agent's environment.
    let uid_a = job_uid(&job_a);
    assert_eq!(
        value_after(&text_a, "ids "),
        format!("uid={uid_a} gid={uid_a} groups=[]"),
        "{text_a}"
    );
    let session = value_after(&text_a, "session ");
    let pid_a: u32 = session
        .split_once(" pid=")
        .and_then(|(_, p)| p.parse().ok())
        .expect("pid");
    assert_eq!(session, format!("sid={pid_a} pid={pid_a}"));
    assert_eq!(value_after(&text_a, "leaked env: "), "[]");
    // The rank-local API: its own token on the Unix socket works; over TCP, or another
    // rank's token (readable from that rank's environment: same job, same user), not.
    assert_eq!(value_after(&text_a, "progress own-token socket: "), "204");
    assert_eq!(value_after(&text_a, "progress own-token tcp: "), "403");
    assert_eq!(
        value_after(&text_a, "progress rank-1-token socket: "),
        "403"
    );
    for probe in ["agent-environ", "token-file", "tls-key", "agent-logs"] {
        assert_probe(&text_a, probe, "denied");
    }
    // Its committed part: readable, sealed.
    assert_probe(&text_a, "read-committed", "allowed");
    assert_probe(&text_a, "write-committed", "denied");
    assert_probe(&text_a, "add-to-committed", "denied");
    // The staging dir it got back after the commit is its own again.
    assert_probe(&text_a, "write-staging", "allowed");
    let committed = PathBuf::from(value_after(&text_a, "committed "));
    assert_eq!(
        mode_owner(&committed.join("weights.bin")),
        (0o640, 0, uid_a)
    );
    assert_eq!(mode_owner(&committed), (0o750, 0, uid_a));
    let job_dir_a = ckpt.join(&job_a);
    assert_eq!(mode_owner(&job_dir_a), (0o750, 0, uid_a));
    assert_eq!(
        mode_owner(&job_dir_a.join(".staging/rank-0.attempt-0")),
        (0o700, uid_a, uid_a)
    );

    // A second job's rank cannot reach the first job's files or process.
    let job_b = cluster
        .submit(
            "isolation-b",
            python_job(
                1,
                PROBE_B,
                &[
                    ("OTHER_JOB_DIR", job_dir_a.display().to_string()),
                    ("OTHER_PART", committed.display().to_string()),
                    ("OTHER_PID", pid_a.to_string()),
                ],
                &ckpt,
            ),
        )
        .await
        .expect("submit b")
        .job_id;
    let text_b = wait_line(&cluster, &job_b, "done").await;
    let uid_b = job_uid(&job_b);
    assert_ne!(uid_a, uid_b);
    assert_eq!(
        value_after(&text_b, "ids "),
        format!("uid={uid_b} gid={uid_b}")
    );
    for probe in [
        "list-other-job",
        "other-staging",
        "other-part",
        "signal-other-rank",
        "other-rank-environ",
    ] {
        assert_probe(&text_b, probe, "denied");
    }
    cluster
        .wait_job(&job_b, "job b succeeded", LONG, |j| {
            j.job_state() == Ok(JobState::Succeeded)
        })
        .await;
    // The first job's rank survived the second's attempts on it.
    let job = cluster.job(&job_a).await.expect("job a");
    assert_eq!(job.state, "running", "{job:?}");
}

/// The example trainer under `--run-as`: its ranks reach the agent through the Unix
/// socket, commit checkpoints that are sealed, and a killed rank's next attempt resumes
/// from its sealed part (readable through the job's group) and consumes every record
/// exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trainer_commits_and_resumes_as_its_jobs_user() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("rank isolation needs root (the agent changes the ranks' user)");
        return;
    }
    let cluster = Cluster::start(run_as_cluster_opts())
        .await
        .expect("cluster");
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 8).expect("shards");
    let out = root.join("out");
    // The ranks write their results here as their job's user.
    std::fs::create_dir(&out).expect("out dir");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
    }
    let epochs = 6;
    let spec = trainer_spec(
        &w,
        2,
        &root.join("ckpt"),
        &out,
        &[
            "--epochs",
            &epochs.to_string(),
            "--ckpt-every",
            "10",
            "--step-sleep-ms",
            "5",
        ],
    );
    let job_id = cluster
        .submit("isolated-trainer", spec)
        .await
        .expect("submit")
        .job_id;
    let job = cluster
        .wait_job(&job_id, "a committed step", LONG, |j| {
            j.committed_step.is_some()
                && j.ranks.iter().all(|r| r.phase() == Ok(RankPhase::Running))
        })
        .await;
    let pid = job.ranks[0].pid;
    assert!(pid > 0);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill rank 0");
    let job = cluster
        .wait_job(&job_id, "the job finished", LONG, |j| {
            matches!(j.state.as_str(), "succeeded" | "failed" | "cancelled")
        })
        .await;
    assert_eq!(job.state, "succeeded", "{job:?}");
    assert!(job.restarts_used >= 1, "{job:?}");
    assert_trainer_results(&cluster, &w, &out, 2, epochs, None);
}

/// A rank with a warm spare: it reports progress over the agent's Unix socket, then
/// waits for the test; its next attempt after it exits 3.
const SPARE_RANK: &str = r#"
import http.client, json, os, socket, sys, time
class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=60)
        self.path_ = path
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(self.path_)
def progress(step):
    conn = UnixConnection(os.environ["CUMULUS_AGENT_SOCKET"])
    conn.request("POST", "/v1/progress", body=json.dumps({"step": step}).encode(), headers={
        "Authorization": "Bearer " + os.environ["CUMULUS_AGENT_TOKEN"],
        "Content-Type": "application/json"})
    status = conn.getresponse().status
    conn.close()
    return status
a = os.environ["CUMULUS_ATTEMPT"]
print(f"attempt {a} uid={os.getuid()} gid={os.getgid()} sid={os.getsid(0)} pid={os.getpid()} "
      f"progress={progress(1)}", flush=True)
if a == "0":
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    sys.exit(3)
"#;

/// A warm spare under `--run-as`: it runs as its job's user in a session of its own
/// before it has a rank, and the attempt that takes it (its pid the spare's) reaches the
/// rank-local API through the Unix socket as any rank of that job; the spare is gone
/// once the job ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_spare_runs_as_its_jobs_user() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("rank isolation needs root (the agent changes the ranks' user)");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let cluster = Cluster::start(run_as_cluster_opts())
        .await
        .expect("cluster");
    // The script and the go file where the job's user reaches them.
    let open_dir = tempfile::Builder::new()
        .prefix("cumulus-spare-")
        .tempdir()
        .expect("tempdir");
    std::fs::set_permissions(open_dir.path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod");
    let script = open_dir.path().join("rank.py");
    std::fs::write(&script, SPARE_RANK).expect("script");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let go = open_dir.path().join("go");
    let spec = v1::JobSpec {
        world_size: 1,
        command: vec![
            "python3".into(),
            script.display().to_string(),
            go.display().to_string(),
        ],
        working_dir: "/".into(),
        restart: Some(v1::RestartPolicy {
            max_restarts: Some(1),
            backoff_initial_ms: Some(10),
            backoff_max_ms: Some(10),
            ..Default::default()
        }),
        warm_spares: 1,
        warm_imports: vec!["json".into()],
        ..Default::default()
    };
    let job_id = cluster
        .submit("warm-spare", spec)
        .await
        .expect("submit")
        .job_id;
    let uid = job_uid(&job_id);
    let spare_of = |s: &v1::ClusterStatusResponse| {
        s.workers
            .iter()
            .flat_map(|w| &w.warm_spares)
            .find(|x| x.job_id == job_id)
            .map(|x| x.pid)
    };
    let status = cluster
        .wait_status("a warm spare listed", LONG, |s| spare_of(s).is_some())
        .await;
    let pid = spare_of(&status).expect("spare");
    let proc_status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("spare alive");
    let uids = value_after(&proc_status, "Uid:\t");
    assert!(
        uids.split_whitespace().all(|u| u == uid.to_string()),
        "the spare runs as {uids}, not {uid}"
    );
    assert_eq!(
        nix::unistd::getsid(Some(nix::unistd::Pid::from_raw(pid as i32))).expect("sid"),
        nix::unistd::Pid::from_raw(pid as i32),
        "a session of its own"
    );
    std::fs::write(&go, b"").expect("go");
    let job = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(job.state, "succeeded", "{job:?}");
    assert_eq!(job.restarts_used, 1, "{job:?}");
    let log = |attempt: u32| {
        let path = cluster
            .dir
            .path()
            .join("worker-1/logs")
            .join(&job_id)
            .join(format!("rank-0/attempt-{attempt}.log"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let (first, second) = (log(0), log(1));
    assert!(
        first.contains(&format!("attempt 0 uid={uid} gid={uid} "))
            && first.contains("progress=204"),
        "{first}"
    );
    assert!(
        second.starts_with(&format!("[setup] warm spare pid {pid} ")),
        "{second}"
    );
    assert!(
        second.contains(&format!(
            "attempt 1 uid={uid} gid={uid} sid={pid} pid={pid} progress=204"
        )),
        "{second}"
    );
    cluster
        .wait_status("the job's spares gone", LONG, |s| spare_of(s).is_none())
        .await;
}
