//! Supervisor tests with real processes, real files and a real rank-local HTTP server.
//! No coordinator runs: reports go to a closed port and stay queued, which the tests check.

use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

use cumulus_ckpt::{CheckpointStore, LocalStore, MANIFEST_FORMAT_VERSION, Manifest};

use super::*;
use crate::logs::truncation_marker;

const DEADLINE: Duration = Duration::from_secs(30);

pub(super) struct Harness {
    _dir: tempfile::TempDir,
    pub(super) root: PathBuf,
    pub(super) sup: Supervisor,
}

pub(super) struct Options {
    stop_grace: Duration,
    log_max_bytes: u64,
    rank_api_url: String,
    roots: cumulus_api::paths::JobRoots,
    /// Python environments with the uv and python3 of python/.venv (else: no uv).
    with_uv: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            stop_grace: Duration::from_secs(5),
            log_max_bytes: 1 << 20,
            rank_api_url: "http://127.0.0.1:9".into(),
            roots: Default::default(),
            with_uv: false,
        }
    }
}

pub(super) fn harness(opts: Options) -> Harness {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().to_path_buf();
    let sup = supervisor_at(&root, opts);
    Harness {
        _dir: dir,
        root,
        sup,
    }
}

fn supervisor_at(root: &Path, opts: Options) -> Supervisor {
    // Nothing listens on port 1: every report fails fast and stays queued.
    let client = Arc::new(
        CoordinatorClient::new(&["127.0.0.1:1".into()], "token", CancellationToken::new())
            .expect("client"),
    );
    let events = EventReporter::new(client.clone(), Duration::from_secs(3600));
    let spawner = Spawner::start(tokio::runtime::Handle::current()).expect("spawner");
    let envs = crate::envs::Environments::open(
        crate::envs::EnvSettings {
            data_dir: root.join("data"),
            uv: opts.with_uv.then(|| crate::envs::tests::venv_bin("uv")),
            python: opts.with_uv.then(|| crate::envs::tests::venv_bin("python")),
            max_bytes: crate::envs::DEFAULT_CACHE_BYTES,
            build_timeout: Duration::from_secs(60),
            ranks_other_user: false,
        },
        spawner.clone(),
    )
    .expect("environments");
    Supervisor::new(
        SupervisorSettings {
            worker_id: "w-test".into(),
            data_dir: root.join("data"),
            advertise_host: "10.1.2.3".into(),
            rank_api_url: opts.rank_api_url,
            stop_grace: opts.stop_grace,
            log_max_bytes: opts.log_max_bytes,
            commit_retry: RetryPolicy {
                max_attempts: 1,
                initial_backoff: Duration::from_millis(1),
                max_backoff: Duration::from_millis(1),
                attempt_timeout: crate::client::REQUEST_TIMEOUT,
            },
            s3: None,
            dataset_cache: None,
            roots: opts.roots,
            has_gpus: false,
            identity: Default::default(),
            rank_api_socket: None,
            rank_api_watch: Default::default(),
            envs,
            blobs: crate::blobs::BlobCache::open(
                &root.join("data"),
                crate::blobs::DEFAULT_BLOB_CACHE_BYTES,
                Arc::clone(&client) as Arc<dyn crate::blobs::BlobTransport>,
            )
            .expect("blob cache"),
            max_artifact_bytes: cumulus_api::blobs::DEFAULT_MAX_ARTIFACT_BYTES,
        },
        spawner,
        client,
        events,
    )
}

pub(super) fn desired(job: &str, rank: u32, attempt: u32, script: &str) -> DesiredRank {
    DesiredRank {
        job_id: job.into(),
        rank,
        attempt,
        world_size: 4,
        local_rank: 1,
        local_world_size: 2,
        master_port: 29500,
        command: vec!["sh".into(), "-c".into(), script.into()],
        ..Default::default()
    }
}

pub(super) async fn poll_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn wait_finished(sup: &Supervisor, key: &AttemptKey) -> ExitRecord {
    poll_until(&format!("{key} to finish"), || {
        sup.is_finished(key) && sup.attempt_pid(key).is_none() && sup.live_count() == 0
    })
    .await;
    let paths = AttemptPaths::new(&sup.inner.settings.data_dir, key).expect("paths");
    logs::read_exit_record(&paths.exit)
        .await
        .expect("read exit")
        .expect("exit record exists")
}

pub(super) fn log_text(sup: &Supervisor, key: &AttemptKey) -> String {
    let paths = AttemptPaths::new(&sup.inner.settings.data_dir, key).expect("paths");
    std::fs::read_to_string(paths.log).unwrap_or_default()
}

fn parse_env(text: &str) -> HashMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn exited_events(sup: &Supervisor) -> Vec<RankExitedRequest> {
    sup.events()
        .pending()
        .into_iter()
        .filter_map(|e| match e {
            RankEvent::Exited(r) => Some(r),
            RankEvent::Started(_) => None,
        })
        .collect()
}

#[tokio::test]
async fn spawns_with_the_full_env_contract() {
    let h = harness(Options::default());
    let out = h.root.join("env.txt");
    let shards_copy = h.root.join("shards.txt");
    let workdir = h.root.join("work");
    std::fs::create_dir_all(&workdir).expect("mkdir");
    let mut d = desired(
        "job-000001",
        2,
        0,
        &format!(
            "env > {o}.tmp; echo PWD_IS=$(pwd) >> {o}.tmp; cat \"$CUMULUS_SHARDS_FILE\" > {s}; mv {o}.tmp {o}",
            o = out.display(),
            s = shards_copy.display()
        ),
    );
    d.shards = vec!["/data/shard-0002".into(), "/data/shard-0006".into()];
    d.working_dir = workdir.display().to_string();
    d.env = [
        ("FOO", "bar"),
        ("RANK", "99"),
        ("CUMULUS_RESUME_STEP", "7"),
        ("CUMULUS_AGENT_TOKEN", "forged"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();

    let actions = h.sup.apply_desired(std::slice::from_ref(&d));
    assert_eq!(actions.len(), 1);
    let key = AttemptKey::of(&d);
    let exit = wait_finished(&h.sup, &key).await;
    assert_eq!(
        exit,
        ExitRecord {
            exec_failed: false,
            cause: None,
            exit_code: Some(0),
            signal: None,
            spawn_error: None,
            agent_fault: false,
            agent_evidence: None,
        }
    );

    let env = parse_env(&std::fs::read_to_string(&out).expect("env dump"));
    let data = h.root.join("data");
    let expect = [
        ("RANK", "2".to_string()),
        ("WORLD_SIZE", "4".into()),
        ("LOCAL_RANK", "1".into()),
        ("LOCAL_WORLD_SIZE", "2".into()),
        ("MASTER_ADDR", "10.1.2.3".into()),
        ("MASTER_PORT", "29500".into()),
        ("CUMULUS_JOB_ID", "job-000001".into()),
        ("CUMULUS_ATTEMPT", "0".into()),
        (
            "CUMULUS_SHARDS_FILE",
            data.join("jobs/job-000001/rank-2.attempt-0.shards")
                .display()
                .to_string(),
        ),
        ("CUMULUS_AGENT_URL", "http://127.0.0.1:9".into()),
        ("FOO", "bar".into()),
        (
            "PWD_IS",
            std::fs::canonicalize(&workdir)
                .expect("canon")
                .display()
                .to_string(),
        ),
    ];
    for (k, v) in expect {
        assert_eq!(env.get(k), Some(&v), "{k}");
    }
    let token = env.get("CUMULUS_AGENT_TOKEN").expect("token");
    assert_eq!(token.len(), 32);
    assert!(token.bytes().all(|b| b.is_ascii_hexdigit()), "{token}");
    for absent in [
        "CUMULUS_CKPT_STAGING",
        "CUMULUS_RESUME_STEP",
        "CUMULUS_RESUME_DIR",
    ] {
        assert!(!env.contains_key(absent), "{absent} must not be set");
    }
    assert_eq!(
        std::fs::read_to_string(&shards_copy).expect("shards"),
        "/data/shard-0002\n/data/shard-0006\n"
    );
    // Cleaned up after exit: shards file and pid record; the token is dead.
    assert!(
        !data
            .join("jobs/job-000001/rank-2.attempt-0.shards")
            .exists()
    );
    assert!(orphans::scan(&data).await.expect("scan").is_empty());
    assert!(h.sup.attempt_for_token(token).is_none());

    // Started then Exited were queued (no coordinator acknowledged them).
    let events = h.sup.events().pending();
    assert!(matches!(&events[0], RankEvent::Started(s) if s.rank == 2 && s.pid > 1));
    assert!(
        matches!(&events[1], RankEvent::Exited(e) if e.exit_code == Some(0) && e.signal.is_none() && e.spawn_error.is_empty())
    );

    // The same attempt is never started again, by this agent or by a new one on this dir.
    assert!(h.sup.apply_desired(std::slice::from_ref(&d)).is_empty());
    let again = supervisor_at(&h.root, Options::default());
    assert!(again.apply_desired(std::slice::from_ref(&d)).is_empty());
    assert!(again.is_finished(&key));
}

#[tokio::test]
async fn stdout_and_stderr_share_one_capped_log() {
    let h = harness(Options {
        log_max_bytes: 4096,
        ..Options::default()
    });
    // ~190 KB of output, far past the cap: the rank must still run to a clean exit.
    let d = desired(
        "job-000002",
        0,
        0,
        "echo out-first; echo err-second >&2; i=0; while [ $i -lt 20000 ]; do echo line-$i; i=$((i+1)); done; echo done >&2",
    );
    let key = AttemptKey::of(&d);
    h.sup.apply_desired(std::slice::from_ref(&d));
    let exit = wait_finished(&h.sup, &key).await;
    assert_eq!(
        exit.exit_code,
        Some(0),
        "the rank kept writing after the cap"
    );
    let text = log_text(&h.sup, &key);
    assert!(text.contains("out-first\n"));
    assert!(text.contains("err-second\n"));
    let marker_at = text.find("[cumulus: log truncated at ").expect("marker");
    assert!(marker_at <= 4096);
    assert_eq!(&text[marker_at..], truncation_marker(marker_at as u64));
    assert!(
        text[..marker_at].ends_with('\n'),
        "only whole lines before the marker"
    );
    assert_eq!(text.matches("[cumulus:").count(), 1);
}

#[tokio::test]
async fn stop_escalates_from_sigterm_to_sigkill() {
    let h = harness(Options {
        stop_grace: Duration::from_millis(300),
        ..Options::default()
    });
    // Ignores SIGTERM (its `sleep` children inherit the ignored disposition).
    let d = desired(
        "job-000003",
        0,
        0,
        "trap '' TERM; echo ready; while :; do sleep 0.05; done",
    );
    let key = AttemptKey::of(&d);
    h.sup.apply_desired(std::slice::from_ref(&d));
    poll_until("ready", || log_text(&h.sup, &key).contains("ready\n")).await;
    let observed = h.sup.observed();
    assert_eq!(observed.len(), 1);
    let stopped_at = Instant::now();
    let actions = h.sup.apply_desired(&[]);
    assert_eq!(actions, vec![Action::Stop(key.clone())]);
    // Stopping is idempotent.
    assert!(h.sup.apply_desired(&[]).is_empty());
    let exit = wait_finished(&h.sup, &key).await;
    assert_eq!(exit.signal, Some(9), "{exit:?}");
    assert!(stopped_at.elapsed() >= Duration::from_millis(300));
    let exited = exited_events(&h.sup);
    assert_eq!(exited.len(), 1);
    assert_eq!(exited[0].signal, Some(9));
}

#[tokio::test]
async fn stop_with_sigterm_when_the_rank_obeys() {
    let h = harness(Options {
        stop_grace: Duration::from_secs(60),
        ..Options::default()
    });
    let d = desired("job-000004", 1, 3, "echo ready; exec sleep 1000");
    let key = AttemptKey::of(&d);
    h.sup.apply_desired(std::slice::from_ref(&d));
    poll_until("ready", || log_text(&h.sup, &key).contains("ready\n")).await;
    let started = Instant::now();
    h.sup.stop_all();
    let exit = wait_finished(&h.sup, &key).await;
    assert_eq!(exit.signal, Some(15));
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[tokio::test]
async fn replacement_starts_only_after_its_predecessor_is_gone() {
    let h = harness(Options {
        stop_grace: Duration::from_millis(200),
        ..Options::default()
    });
    let first = desired(
        "job-000005",
        0,
        0,
        "trap '' TERM; echo ready; while :; do sleep 0.05; done",
    );
    let second = desired("job-000005", 0, 1, "echo second");
    let k0 = AttemptKey::of(&first);
    let k1 = AttemptKey::of(&second);
    h.sup.apply_desired(std::slice::from_ref(&first));
    poll_until("ready", || log_text(&h.sup, &k0).contains("ready\n")).await;
    let actions = h.sup.apply_desired(std::slice::from_ref(&second));
    assert_eq!(actions, vec![Action::Stop(k0.clone())]);
    // While attempt 0 is stopping, attempt 1 is reported as waiting (pid 0), so the
    // leader does not take the placed attempt for lost.
    let observed = h.sup.observed();
    assert!(
        observed.iter().any(|o| o.attempt == 1 && o.pid == 0),
        "{observed:?}"
    );
    poll_until("attempt 0 gone", || {
        h.sup.is_finished(&k0) && h.sup.live_count() == 0
    })
    .await;
    let actions = h.sup.apply_desired(std::slice::from_ref(&second));
    assert!(matches!(&actions[..], [Action::Start(d)] if d.attempt == 1));
    let exit = wait_finished(&h.sup, &k1).await;
    assert_eq!(exit.exit_code, Some(0));
}

#[tokio::test]
async fn spawn_failures_are_recorded_and_reported() {
    let h = harness(Options::default());
    let mut d = desired("job-000006", 0, 0, "");
    d.command = vec!["/nonexistent/cumulus-no-such-program".into()];
    let key = AttemptKey::of(&d);
    h.sup.apply_desired(std::slice::from_ref(&d));
    let exit = wait_finished(&h.sup, &key).await;
    let why = exit.spawn_error.expect("spawn error");
    assert!(why.contains("cumulus-no-such-program"), "{why}");
    assert!(log_text(&h.sup, &key).starts_with("[cumulus: cannot start the rank: "));
    let exited = exited_events(&h.sup);
    assert_eq!(exited.len(), 1);
    assert_eq!((exited[0].exit_code, exited[0].signal), (None, None));
    assert_eq!(exited[0].spawn_error, why);

    // An invalid job id never touches the disk and is reported too.
    let bad = desired("../escape", 0, 0, "true");
    h.sup.apply_desired(std::slice::from_ref(&bad));
    let bad_key = AttemptKey::of(&bad);
    poll_until("bad attempt reported", || exited_events(&h.sup).len() == 2).await;
    assert!(exited_events(&h.sup)[1].spawn_error.contains("job id"));
    assert!(h.sup.is_finished(&bad_key));
    assert!(!h.root.join("escape").exists());
}

#[tokio::test]
async fn job_paths_outside_the_agents_roots_are_refused_before_anything_is_created() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = std::fs::canonicalize(dir.path()).expect("canonical");
    for d in ["datasets", "ckpt", "elsewhere"] {
        std::fs::create_dir_all(root.join(d)).expect("mkdir");
    }
    std::fs::write(root.join("datasets/shard-0.csv"), "1,0\n").expect("write");
    std::fs::write(root.join("elsewhere/shard-0.csv"), "1,0\n").expect("write");
    std::os::unix::fs::symlink(root.join("elsewhere"), root.join("ckpt/escape")).expect("symlink");
    std::os::unix::fs::symlink(root.join("elsewhere"), root.join("datasets/escape"))
        .expect("symlink");
    let roots = cumulus_api::paths::JobRoots::new(&[root.join("datasets")], &[root.join("ckpt")])
        .expect("roots");
    let sup = supervisor_at(
        &root,
        Options {
            roots,
            ..Options::default()
        },
    );
    let s = |p: &str| root.join(p).to_str().expect("utf-8").to_owned();
    let refused = [
        (
            "job-000011",
            s("datasets/shard-0.csv"),
            s("ckpt/escape/job"),
        ),
        ("job-000012", s("elsewhere/shard-0.csv"), s("ckpt/job")),
        (
            "job-000013",
            s("datasets/escape/shard-0.csv"),
            s("ckpt/job"),
        ),
        (
            "job-000014",
            s("datasets/../elsewhere/shard-0.csv"),
            s("ckpt/job"),
        ),
        ("job-000015", s("datasets/shard-0.csv"), s("elsewhere/job")),
    ];
    for (job, shard, ckpt_dir) in refused {
        let mut d = desired(job, 0, 0, "true");
        d.shards = vec![shard.clone()];
        d.ckpt_dir = ckpt_dir.clone();
        let key = AttemptKey::of(&d);
        sup.apply_desired(std::slice::from_ref(&d));
        let exit = wait_finished(&sup, &key).await;
        let why = exit.spawn_error.expect("refused");
        assert!(why.contains("refused by this agent"), "{job}: {why}");
        assert!(
            why.contains("allowed roots") || why.contains("normalized"),
            "{why}"
        );
    }
    assert_eq!(
        std::fs::read_dir(root.join("elsewhere"))
            .expect("ls")
            .count(),
        1,
        "nothing created outside the roots"
    );
    assert!(
        !root.join("ckpt/job").exists(),
        "no staging before the checks"
    );

    let mut d = desired("job-000016", 0, 0, "true");
    d.shards = vec![s("datasets/shard-0.csv")];
    d.ckpt_dir = s("ckpt/job");
    let key = AttemptKey::of(&d);
    sup.apply_desired(std::slice::from_ref(&d));
    let exit = wait_finished(&sup, &key).await;
    assert_eq!(
        (exit.exit_code, exit.spawn_error),
        (Some(0), None),
        "inside the roots"
    );
}

async fn commit_step(store: &LocalStore, job: &str, step: u64, rank: u32, attempt: u32) -> String {
    let staging = store
        .prepare_staging(job, rank, attempt)
        .await
        .expect("staging");
    std::fs::write(staging.join("weights.bin"), b"0123456789").expect("write");
    let part = store
        .commit_part(
            job,
            step,
            rank,
            attempt,
            &staging,
            serde_json::json!({"shard": 1}),
        )
        .await
        .expect("commit");
    let dir = part.dir.clone();
    store
        .write_manifest(&Manifest {
            format_version: MANIFEST_FORMAT_VERSION,
            job_id: job.into(),
            step,
            world_size: 1,
            committed_at_ms: 0,
            parts: vec![part],
        })
        .await
        .expect("manifest");
    dir
}

#[tokio::test]
async fn checkpoint_staging_and_verified_resume() {
    let h = harness(Options::default());
    let ckpt = h.root.join("ckpt");
    let store = LocalStore::new(&ckpt);
    let part_dir = commit_step(&store, "job-000007", 100, 0, 0).await;

    let out = h.root.join("env.txt");
    let mut d = desired(
        "job-000007",
        0,
        1,
        &format!(
            "test -d \"$CUMULUS_CKPT_STAGING\" && test -f \"$CUMULUS_RESUME_DIR/weights.bin\" || exit 3; \
             env > {o}.tmp; mv {o}.tmp {o}",
            o = out.display()
        ),
    );
    d.ckpt_dir = ckpt.display().to_string();
    d.resume_step = Some(100);
    d.resume_dir = part_dir.clone();
    let key = AttemptKey::of(&d);
    h.sup.apply_desired(std::slice::from_ref(&d));
    let exit = wait_finished(&h.sup, &key).await;
    assert_eq!(exit.exit_code, Some(0), "{exit:?}");
    let env = parse_env(&std::fs::read_to_string(&out).expect("env"));
    let staging = ckpt.join("job-000007/.staging/rank-0.attempt-1");
    assert_eq!(
        env.get("CUMULUS_CKPT_STAGING"),
        Some(&staging.display().to_string())
    );
    // Staging existed for the rank and is removed once the attempt ended.
    assert!(!staging.exists());
    assert_eq!(
        env.get("CUMULUS_RESUME_STEP").map(String::as_str),
        Some("100")
    );
    let resume = ckpt.join("job-000007").join(&part_dir);
    assert_eq!(
        env.get("CUMULUS_RESUME_DIR"),
        Some(&resume.display().to_string())
    );

    // Corrupt the part: the next attempt must not start.
    std::fs::write(resume.join("weights.bin"), b"0123456789-tampered").expect("tamper");
    let mut d2 = d.clone();
    d2.attempt = 2;
    let key2 = AttemptKey::of(&d2);
    h.sup.apply_desired(std::slice::from_ref(&d2));
    let exit = wait_finished(&h.sup, &key2).await;
    let why = exit.spawn_error.expect("refused");
    assert!(
        why.starts_with(&format!(
            "checkpoint part {part_dir:?} of step 100 failed verification: "
        )),
        "{why}"
    );
    // A resume from a step without manifest is refused as well.
    let mut d3 = d.clone();
    d3.attempt = 3;
    d3.resume_step = Some(200);
    d3.resume_dir = "step-00000200/rank-0/attempt-0".into();
    let key3 = AttemptKey::of(&d3);
    h.sup.apply_desired(std::slice::from_ref(&d3));
    let why = wait_finished(&h.sup, &key3)
        .await
        .spawn_error
        .expect("refused");
    assert!(why.contains("failed verification"), "{why}");
}

#[tokio::test]
async fn orphans_of_a_previous_agent_are_killed_and_finalized() {
    let h = harness(Options::default());
    let data = h.root.join("data");
    // A rank left behind by a "previous agent": its own process group, no parent-death signal.
    let mut orphan = std::process::Command::new("sleep")
        .arg("1000")
        .process_group(0)
        .spawn()
        .expect("spawn orphan");
    let pid = orphan.id();
    let running = PidRecord {
        job_id: "job-000008".into(),
        rank: 0,
        attempt: 0,
        pid: Some(pid),
        start_ticks: orphans::process_start_ticks(pid),
    };
    orphans::write(&data, &running).await.expect("record");
    let never_started = PidRecord {
        job_id: "job-000008".into(),
        rank: 1,
        attempt: 0,
        pid: None,
        start_ticks: None,
    };
    orphans::write(&data, &never_started).await.expect("record");
    let logs_dir = data.join("logs/job-000008/rank-0");
    std::fs::create_dir_all(&logs_dir).expect("mkdir");
    std::fs::write(logs_dir.join("attempt-0.log"), b"old output\n").expect("log");

    h.sup.recover_orphans().await;

    let status = tokio::task::spawn_blocking(move || orphan.wait())
        .await
        .expect("join")
        .expect("wait");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    assert!(orphans::scan(&data).await.expect("scan").is_empty());
    for (rank, signal, spawn_error) in [(0, Some(9), false), (1, None, true)] {
        let key = AttemptKey::new("job-000008", rank, 0);
        assert!(h.sup.is_finished(&key));
        let paths = AttemptPaths::new(&data, &key).expect("paths");
        let exit = logs::read_exit_record(&paths.exit)
            .await
            .expect("read")
            .expect("exit");
        assert_eq!(exit.signal, signal);
        assert_eq!(exit.spawn_error.is_some(), spawn_error);
        assert!(
            log_text(&h.sup, &key)
                .ends_with("[cumulus: the agent restarted; this attempt was lost]\n")
        );
    }
    assert!(log_text(&h.sup, &AttemptKey::new("job-000008", 0, 0)).starts_with("old output\n"));
    let exited = exited_events(&h.sup);
    assert_eq!(exited.len(), 2);
    assert_eq!(exited[0].signal, Some(9));
    assert!(!exited[1].spawn_error.is_empty());
    // Never started again.
    assert!(
        h.sup
            .apply_desired(&[desired("job-000008", 0, 0, "true")])
            .is_empty()
    );
}

// ---------------------------------------------------------------------------
// Rank-local API over real HTTP
// ---------------------------------------------------------------------------

struct RankApi {
    h: Harness,
    url: String,
    http: reqwest::Client,
    _server: tokio::task::JoinHandle<()>,
}

async fn rank_api(opts: Options) -> RankApi {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let h = harness(Options {
        rank_api_url: url.clone(),
        ..opts
    });
    let router = crate::rank_api::router(h.sup.clone(), false);
    let server = tokio::spawn(async move {
        axum::serve(listener, router).await.expect("serve");
    });
    RankApi {
        h,
        url,
        http: reqwest::Client::new(),
        _server: server,
    }
}

/// Starts a rank that dumps its env and then waits; returns its env.
async fn start_waiting_rank(api: &RankApi, d: &mut DesiredRank) -> HashMap<String, String> {
    let out = api.h.root.join(format!("env-{}-{}.txt", d.rank, d.attempt));
    d.command = vec![
        "sh".into(),
        "-c".into(),
        format!(
            "trap '' TERM; env > {o}.tmp; mv {o}.tmp {o}; while :; do sleep 0.05; done",
            o = out.display()
        ),
    ];
    api.h.sup.apply_desired(std::slice::from_ref(d));
    poll_until("env dump", || out.exists()).await;
    parse_env(&std::fs::read_to_string(&out).expect("env"))
}

#[tokio::test]
async fn rank_api_progress_and_auth() {
    let api = rank_api(Options {
        stop_grace: Duration::from_millis(100),
        ..Options::default()
    })
    .await;
    let mut d = desired("job-000009", 0, 0, "");
    let env = start_waiting_rank(&api, &mut d).await;
    assert_eq!(env.get("CUMULUS_AGENT_URL"), Some(&api.url));
    let token = env.get("CUMULUS_AGENT_TOKEN").expect("token").clone();
    let progress = format!("{}/v1/progress", api.url);
    let key = AttemptKey::of(&d);

    let r = api
        .http
        .post(&progress)
        .bearer_auth(&token)
        .json(&serde_json::json!({"step": 42, "total_steps": 100, "metrics": {"loss": 0.5}}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 204);
    let p = api.h.sup.progress(&key).expect("progress");
    assert_eq!((p.step, p.total_steps), (42, 100));
    assert_eq!(p.metrics.get("loss"), Some(&0.5));
    // A diverging run's NaN and infinities, in the contract's JSON spelling, are kept.
    let r = api
        .http
        .post(&progress)
        .bearer_auth(&token)
        .json(&serde_json::json!({"step": 42, "total_steps": 100,
            "metrics": {"loss": "NaN", "up": "Infinity", "down": "-Infinity", "lr": 0.5}}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 204);
    let p = api.h.sup.progress(&key).expect("progress");
    assert!(p.metrics["loss"].is_nan(), "{:?}", p.metrics);
    assert_eq!(p.metrics["up"], f64::INFINITY);
    assert_eq!(p.metrics["down"], f64::NEG_INFINITY);
    assert_eq!(p.metrics["lr"], 0.5);
    poll_until("pid", || !api.h.sup.observed().is_empty()).await;
    let observed = api.h.sup.observed();
    assert_eq!((observed[0].step, observed[0].total_steps), (42, 100));

    for (auth, body, status) in [
        (None, serde_json::json!({"step": 1}), 401),
        (Some("wrong-token"), serde_json::json!({"step": 1}), 401),
        (
            Some(token.as_str()),
            serde_json::json!({"total_steps": 1}),
            400,
        ),
        (Some(token.as_str()), serde_json::json!({"step": -1}), 400),
        (
            Some(token.as_str()),
            serde_json::json!({"step": 1, "metrics": {"loss": "nan"}}),
            400,
        ),
    ] {
        let mut req = api.http.post(&progress).json(&body);
        if let Some(t) = auth {
            req = req.bearer_auth(t);
        }
        let r = req.send().await.expect("send");
        assert_eq!(r.status(), status, "{auth:?} {body}");
        let err: serde_json::Value = r.json().await.expect("json error");
        assert!(err["error"].is_string());
    }
    let many: serde_json::Map<String, serde_json::Value> = (0..65)
        .map(|i| (format!("m{i}"), serde_json::json!(1.0)))
        .collect();
    let r = api
        .http
        .post(&progress)
        .bearer_auth(&token)
        .json(&serde_json::json!({"step": 1, "metrics": many}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 400);

    // Checkpoints are disabled for this job.
    let r = api
        .http
        .post(format!("{}/v1/checkpoint", api.url))
        .bearer_auth(&token)
        .json(&serde_json::json!({"step": 1, "state": {}}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 400);

    // Once the attempt ended, its token is unknown.
    api.h.sup.apply_desired(&[]);
    wait_finished(&api.h.sup, &key).await;
    let r = api
        .http
        .post(&progress)
        .bearer_auth(&token)
        .json(&serde_json::json!({"step": 43}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 401);
}

/// Issue 42 item 4: an exit names its cause, the exception the rank reported on
/// `POST /v1/exception`, else the last line of its output; a clean exit names none.
#[tokio::test]
async fn an_exit_carries_the_reported_exception_else_the_last_line_of_output() {
    let api = rank_api(Options::default()).await;
    let go = api.h.root.join("go");
    let d = desired(
        "job-000012",
        0,
        0,
        &format!(
            "env > {e}.tmp; mv {e}.tmp {e}; while [ ! -e {g} ]; do sleep 0.02; done; \
             echo 'ValueError: bad lr' >&2; exit 1",
            e = api.h.root.join("env-12.txt").display(),
            g = go.display()
        ),
    );
    api.h.sup.apply_desired(std::slice::from_ref(&d));
    let env_file = api.h.root.join("env-12.txt");
    poll_until("env dump", || env_file.exists()).await;
    let env = parse_env(&std::fs::read_to_string(&env_file).expect("env"));
    let token = env.get("CUMULUS_AGENT_TOKEN").expect("token").clone();
    let exception = format!("{}/v1/exception", api.url);
    for (body, status) in [
        (serde_json::json!({"type": "", "message": "x"}), 400),
        (
            serde_json::json!({"type": "E", "frames": vec!["f"; 17]}),
            400,
        ),
        (serde_json::json!({"message": "no type"}), 400),
        (
            serde_json::json!({"type": "ValueError", "message": "bad lr",
                "frames": ["/w/train.py:42 in main"], "origin": "train.py:42"}),
            204,
        ),
    ] {
        let r = api
            .http
            .post(&exception)
            .bearer_auth(&token)
            .json(&body)
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), status, "{body}");
    }
    std::fs::write(&go, b"").expect("go");
    let key = AttemptKey::of(&d);
    let exit = wait_finished(&api.h.sup, &key).await;
    let told = "ValueError: bad lr (train.py:42)";
    assert_eq!(
        (exit.exit_code, exit.cause.as_deref()),
        (Some(1), Some(told))
    );
    let events = exited_events(&api.h.sup);
    assert!(events.iter().any(|e| e.cause == told), "{events:?}");

    // No report: the last line the program wrote (stdout and stderr share the pipe).
    for (job, script, cause) in [
        (
            "job-000013",
            "echo starting; echo 'fatal: no GPU found' >&2; exit 3",
            Some("fatal: no GPU found"),
        ),
        ("job-000014", "echo 'all good'; exit 0", None),
    ] {
        let d = desired(job, 0, 0, script);
        api.h.sup.apply_desired(std::slice::from_ref(&d));
        let exit = wait_finished(&api.h.sup, &AttemptKey::of(&d)).await;
        assert_eq!(exit.cause.as_deref(), cause, "{script}");
    }
}

#[tokio::test]
async fn rank_api_checkpoint_commit_paths() {
    let api = rank_api(Options {
        stop_grace: Duration::from_secs(60),
        ..Options::default()
    })
    .await;
    let ckpt = api.h.root.join("ckpt");
    let mut d = desired("job-000010", 0, 0, "");
    d.ckpt_dir = ckpt.display().to_string();
    let env = start_waiting_rank(&api, &mut d).await;
    let token = env.get("CUMULUS_AGENT_TOKEN").expect("token").clone();
    let staging = PathBuf::from(env.get("CUMULUS_CKPT_STAGING").expect("staging"));
    let url = format!("{}/v1/checkpoint", api.url);
    let key = AttemptKey::of(&d);

    // Bad bodies.
    for body in [
        serde_json::json!({"step": 1, "state": [1, 2]}),
        serde_json::json!({"state": {}}),
        serde_json::json!({"step": 1, "state": {"big": "x".repeat(MAX_BODY_TEST)}}),
    ] {
        let r = api
            .http
            .post(&url)
            .bearer_auth(&token)
            .json(&body)
            .send()
            .await
            .expect("send");
        assert!(r.status() == 400 || r.status() == 413, "{}", r.status());
    }

    // The part commits locally; no leader acknowledges it: 503, and the part stays.
    std::fs::write(staging.join("weights.bin"), b"abc").expect("write");
    let body = serde_json::json!({"step": 100, "state": {"shard": 3, "record": 17}});
    let r = api
        .http
        .post(&url)
        .bearer_auth(&token)
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 503);
    let err: serde_json::Value = r.json().await.expect("json");
    assert!(
        err["error"]
            .as_str()
            .expect("msg")
            .contains("CommitCheckpointPart")
    );
    let part = ckpt.join("job-000010/step-00000100/rank-0/attempt-0");
    assert_eq!(
        std::fs::read(part.join("weights.bin")).expect("part"),
        b"abc"
    );
    assert_eq!(std::fs::read_dir(&staging).expect("staging").count(), 0);
    // A retry of the same step re-reports the committed part (no "already exists" 400).
    let r = api
        .http
        .post(&url)
        .bearer_auth(&token)
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 503);

    // Once the attempt is no longer desired: 409.
    poll_until("pid", || api.h.sup.attempt_pid(&key).is_some()).await;
    let pid = api.h.sup.attempt_pid(&key).expect("pid");
    api.h.sup.apply_desired(&[]);
    let r = api
        .http
        .post(&url)
        .bearer_auth(&token)
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 409);
    // The rank ignores SIGTERM and the grace is long: end it here.
    signal_group(pid, Signal::SIGKILL).expect("kill");
    wait_finished(&api.h.sup, &key).await;
}

const MAX_BODY_TEST: usize = cumulus_api::limits::MAX_STATE_JSON_BYTES + 10;

/// A rank runs in the environment its job asks for (built once, its output in the log as
/// the setup stream), a restart finds it cached, and an environment that cannot be built
/// fails the attempt as one no restart can fix, with uv's message.
#[tokio::test]
async fn ranks_run_in_their_environment_and_a_failed_install_cannot_run() {
    let h = harness(Options {
        with_uv: true,
        ..Options::default()
    });
    let wheels = h.root.join("wheels");
    std::fs::create_dir(&wheels).expect("mkdir");
    crate::envs::tests::write_wheel(&wheels, "cumtestpkg", "1.0", 42);
    let env = |requirements: &str| cumulus_api::EnvironmentSpec {
        requirements: requirements.into(),
        find_links: vec![wheels.display().to_string()],
        no_index: true,
        ..Default::default()
    };
    let script = "python -c 'import cumtestpkg, os, sys; \
        print(\"VALUE\", cumtestpkg.VALUE, os.environ[\"VIRTUAL_ENV\"] == sys.prefix)'";
    for attempt in 0..2 {
        let mut d = desired("job-000001", 0, attempt, script);
        d.environment = Some(env("cumtestpkg"));
        h.sup.apply_desired(std::slice::from_ref(&d));
        let key = AttemptKey::of(&d);
        let exit = wait_finished(&h.sup, &key).await;
        let log = log_text(&h.sup, &key);
        assert_eq!(exit.exit_code, Some(0), "{exit:?}\n{log}");
        assert!(log.contains("VALUE 42 True"), "{log}");
        let setup = if attempt == 0 {
            "[setup] building environment"
        } else {
            "(cached)"
        };
        assert!(
            log.lines()
                .any(|l| l.starts_with("[setup] ") && l.contains(setup)),
            "{log}"
        );
    }
    assert_eq!(h.sup.inner.settings.envs.builds_started(), 1);

    let mut d = desired("job-000002", 0, 0, "echo never runs");
    d.environment = Some(env("doesnotexist"));
    h.sup.apply_desired(std::slice::from_ref(&d));
    let key = AttemptKey::of(&d);
    let exit = wait_finished(&h.sup, &key).await;
    let log = log_text(&h.sup, &key);
    assert!(exit.exec_failed && !exit.agent_fault, "{exit:?}");
    let message = exit.spawn_error.expect("spawn error");
    assert!(
        message.contains("uv pip install failed") && message.contains("doesnotexist"),
        "{message}"
    );
    assert!(!log.contains("never runs"), "{log}");
    assert!(
        log.contains("[cumulus: cannot start the rank: cannot build the Python environment"),
        "{log}"
    );
    let reported = exited_events(&h.sup);
    let report = reported
        .iter()
        .find(|r| r.job_id == "job-000002")
        .expect("exit report");
    assert!(report.exec_failed && report.spawn_error.contains("doesnotexist"));
}

/// A job with a warm spare: once its rank has reported progress, the next reconciliation
/// starts a spare (the job's interpreter, imports done); the rank's next attempt runs in
/// it (the spare's pid, the attempt's arguments, environment and working directory, its
/// output in the attempt's log); with the job gone from the desired set, its spares are
/// stopped.
#[tokio::test]
async fn a_new_attempt_runs_in_a_warm_spare_which_ends_with_the_job() {
    let h = harness(Options::default());
    let script = h.root.join("rank.py");
    std::fs::write(
        &script,
        "import os, sys, time\n\
         print('attempt', os.environ['CUMULUS_ATTEMPT'], 'pid', os.getpid(), 'sid',\n\
               os.getsid(0), 'argv', sys.argv[1:], 'cwd', os.getcwd(), 'name', __name__,\n\
               'json' in sys.modules, flush=True)\n\
         while os.environ['CUMULUS_ATTEMPT'] == '0':\n\
         \x20   time.sleep(0.02)\n",
    )
    .expect("script");
    let first = DesiredRank {
        job_id: "job-000031".into(),
        world_size: 1,
        local_world_size: 1,
        command: vec![
            "python3".into(),
            script.display().to_string(),
            "an arg".into(),
        ],
        working_dir: h.root.display().to_string(),
        warm_spares: 1,
        warm_imports: vec!["json".into()],
        ..Default::default()
    };
    let second = DesiredRank {
        attempt: 1,
        ..first.clone()
    };
    let (k0, k1) = (AttemptKey::of(&first), AttemptKey::of(&second));
    h.sup.apply_desired(std::slice::from_ref(&first));
    poll_until("attempt 0 running", || {
        log_text(&h.sup, &k0).contains("attempt 0 pid")
    })
    .await;
    assert!(h.sup.warm_spares().is_empty(), "no spare before a report");
    let token = {
        let table = h.sup.table();
        let (token, _) = table.tokens.iter().find(|(_, k)| **k == k0).expect("token");
        token.clone()
    };
    h.sup.record_progress(&token, Progress::default());
    h.sup.apply_desired(std::slice::from_ref(&first));
    poll_until("a spare", || h.sup.warm_spares().len() == 1).await;
    let spare = h.sup.warm_spares()[0].clone();
    assert_eq!(spare.job_id, "job-000031");

    h.sup.apply_desired(std::slice::from_ref(&second));
    // Gone from the table too: its exit record is written just before its entry is
    // removed, and the rank's next attempt starts only once the entry is gone.
    poll_until("attempt 0 gone", || {
        h.sup.is_finished(&k0) && h.sup.live_count() == 0
    })
    .await;
    h.sup.apply_desired(std::slice::from_ref(&second));
    let exit = wait_finished(&h.sup, &k1).await;
    assert_eq!(exit.exit_code, Some(0), "{}", log_text(&h.sup, &k1));
    let fresh = log_text(&h.sup, &k0);
    let warm = log_text(&h.sup, &k1);
    let pid = spare.pid;
    assert!(
        warm.starts_with(&format!("[setup] warm spare pid {pid} ")),
        "{warm}"
    );
    let cwd = std::fs::canonicalize(&h.root).expect("canonical root");
    let view = |attempt: u32, pid: u32| {
        format!(
            "attempt {attempt} pid {pid} sid {pid} argv ['an arg'] cwd {} name __main__",
            cwd.display()
        )
    };
    assert!(warm.contains(&format!("{} True", view(1, pid))), "{warm}");
    let fresh_pid: u32 = fresh
        .split_whitespace()
        .nth(3)
        .and_then(|p| p.parse().ok())
        .expect("attempt 0's pid");
    assert_ne!(fresh_pid, pid);
    assert!(fresh.contains(&view(0, fresh_pid)), "{fresh}");

    h.sup.apply_desired(&[]);
    assert!(h.sup.warm_spares().is_empty());
}
