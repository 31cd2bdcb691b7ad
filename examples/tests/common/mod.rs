//! Shared helpers of the trainer's integration tests: the digits split, running the
//! trainer binary, and a small real HTTP server playing the worker agent's rank-local API.

#![allow(dead_code)] // Each test binary uses a different subset of the helpers.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Variables of the rank contract: removed from every child so tests are hermetic.
pub use cumulus_api::rank_env::CONTRACT_VARS;

/// The trainer binary with a clean rank environment.
pub fn trainer() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_cumulus-trainer"));
    for v in CONTRACT_VARS {
        c.env_remove(v);
    }
    c
}

/// Runs a command to completion and returns its output.
pub fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("the trainer binary runs")
}

/// Stdout as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The digits data split like `cumulusctl dataset split --shards 8 --holdout-fraction
/// 0.2`: row `i` is held out when `i mod 5 == 4`, the `j`-th remaining row goes to
/// shard `j mod 8`.
pub struct DigitsSplit {
    /// `shard-00000.csv` … `shard-00007.csv`.
    pub shards: Vec<PathBuf>,
    /// The holdout CSV.
    pub holdout: PathBuf,
}

/// Splits `data/digits/digits.csv.gz` into `dir`.
pub fn split_digits(dir: &Path) -> DigitsSplit {
    let gz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/digits/digits.csv.gz");
    let file = std::fs::File::open(&gz).expect("the digits data set is in data/digits");
    let mut text = String::new();
    flate2::read::GzDecoder::new(file)
        .read_to_string(&mut text)
        .expect("digits.csv.gz decompresses");
    let rows: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(rows.len(), 1797, "digits has 1797 rows");
    let mut holdout = String::new();
    let mut shards = vec![String::new(); 8];
    let mut j = 0;
    for (i, row) in rows.iter().enumerate() {
        if i % 5 == 4 {
            holdout.push_str(row);
            holdout.push('\n');
        } else {
            shards[j % 8].push_str(row);
            shards[j % 8].push('\n');
            j += 1;
        }
    }
    let holdout_path = dir.join("holdout.csv");
    std::fs::write(&holdout_path, holdout).expect("write holdout");
    let shard_dir = dir.join("shards");
    std::fs::create_dir_all(&shard_dir).expect("create shard dir");
    let shards = shards
        .into_iter()
        .enumerate()
        .map(|(k, text)| {
            let p = shard_dir.join(format!("shard-{k:05}.csv"));
            std::fs::write(&p, text).expect("write shard");
            p
        })
        .collect();
    DigitsSplit {
        shards,
        holdout: holdout_path,
    }
}

/// Writes the shards file of `rank` (shards `i` with `i mod world_size == rank`).
pub fn rank_shards_file(dir: &Path, shards: &[PathBuf], rank: usize, world_size: usize) -> PathBuf {
    let text: String = shards
        .iter()
        .enumerate()
        .filter(|(i, _)| i % world_size == rank)
        .map(|(_, p)| format!("{}\n", p.display()))
        .collect();
    let path = dir.join(format!("shards-rank-{rank}.txt"));
    std::fs::write(&path, text).expect("write shards file");
    path
}

/// Reads `result.json` of a rank.
pub fn result_json(out: &Path, rank: u32) -> serde_json::Value {
    let path = out.join(format!("rank-{rank}/result.json"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_slice(&bytes).expect("result.json is JSON")
}

/// Output of `cumulus-trainer digest`.
pub fn digest_of(shards_file: &Path, epochs: u32, seed: u64) -> String {
    let o = run(trainer().args([
        "digest",
        "--shards-file",
        shards_file.to_str().expect("utf-8 path"),
        "--epochs",
        &epochs.to_string(),
        "--seed",
        &seed.to_string(),
    ]));
    assert!(o.status.success(), "digest failed: {}", stderr(&o));
    stdout(&o).trim().to_string()
}

/// Polls `cond` every 10 ms until it holds or `deadline` passes.
pub fn wait_until(deadline: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}

/// How the fake agent answers checkpoint commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitPolicy {
    /// Commit every request.
    Accept,
    /// Commit, except answer `status` (without committing) to `attempt`'s commit of
    /// `step`.
    RejectStep {
        /// The attempt refused.
        attempt: u64,
        /// The step refused.
        step: u64,
        /// The status answered.
        status: u16,
    },
    /// Answer this status to every commit.
    FailAll(u16),
}

/// A committed checkpoint part.
#[derive(Debug, Clone)]
pub struct Part {
    /// Checkpoint step.
    pub step: u64,
    /// The part dir.
    pub dir: PathBuf,
}

/// What the fake agent saw and did.
#[derive(Debug, Default)]
pub struct AgentLog {
    /// Progress bodies received with a known token: time of receipt, attempt, body.
    pub progress: Vec<(Instant, u64, serde_json::Value)>,
    /// Requests with a missing or unknown token.
    pub unauthorized: u64,
    /// Checkpoint requests received (any outcome), by step.
    pub commit_requests: Vec<u64>,
    /// Parts committed.
    pub parts: Vec<Part>,
    /// Protocol violations seen (must stay empty).
    pub violations: Vec<String>,
}

struct Attempt {
    attempt: u64,
    staging: PathBuf,
}

struct Shared {
    log: AgentLog,
    tokens: HashMap<String, Attempt>,
    policy: CommitPolicy,
    parts_root: PathBuf,
}

/// A real HTTP server on 127.0.0.1 that implements the two rank-local endpoints the way
/// the contract says: bearer check, commit = rename of the staging dir into a part dir
/// (then an empty staging dir again), 409 / errors per the policy.
pub struct FakeAgent {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    shared: Arc<Mutex<Shared>>,
}

impl FakeAgent {
    /// Starts the server; parts go under `parts_root/step-NNNNNNNN/rank-0/attempt-A`.
    pub fn start(parts_root: &Path, policy: CommitPolicy) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let url = format!("http://{}", listener.local_addr().expect("local addr"));
        let shared = Arc::new(Mutex::new(Shared {
            log: AgentLog::default(),
            tokens: HashMap::new(),
            policy,
            parts_root: parts_root.to_path_buf(),
        }));
        let s = shared.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                // One connection at a time: a rank sends one request at a time.
                let _ = handle(stream, &s);
            }
        });
        Self { url, shared }
    }

    /// Registers an attempt: its token and staging dir (created empty).
    pub fn add_attempt(&self, token: &str, attempt: u64, staging: &Path) {
        std::fs::create_dir_all(staging).expect("create staging");
        self.shared.lock().expect("agent lock").tokens.insert(
            token.to_string(),
            Attempt {
                attempt,
                staging: staging.to_path_buf(),
            },
        );
    }

    /// Runs `f` on the log.
    pub fn with_log<T>(&self, f: impl FnOnce(&AgentLog) -> T) -> T {
        f(&self.shared.lock().expect("agent lock").log)
    }

    /// The newest committed part.
    pub fn latest_part(&self) -> Option<Part> {
        self.with_log(|l| l.parts.iter().max_by_key(|p| p.step).cloned())
    }
}

fn respond(stream: &mut TcpStream, status: u16, body: &str) -> std::io::Result<()> {
    let reason = match status {
        200 => "OK",
        204 => "No Content",
        401 => "Unauthorized",
        409 => "Conflict",
        _ => "Error",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    stream.flush()
}

fn handle(stream: TcpStream, shared: &Mutex<Shared>) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut stream = stream;
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    let mut content_length = 0usize;
    let mut auth = None;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            let v = v.trim();
            match k.to_ascii_lowercase().as_str() {
                "content-length" => content_length = v.parse().unwrap_or(0),
                "authorization" => auth = v.strip_prefix("Bearer ").map(str::to_string),
                _ => {}
            }
        }
    }
    let mut body = vec![0u8; content_length.min(1 << 20)];
    reader.read_exact(&mut body)?;
    let path = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("")
        .to_string();
    let mut s = shared.lock().expect("agent lock");
    let Some(attempt) = auth.as_ref().and_then(|t| s.tokens.get(t)) else {
        s.log.unauthorized += 1;
        drop(s);
        return respond(&mut stream, 401, r#"{"error":"unknown token"}"#);
    };
    let (attempt_no, staging) = (attempt.attempt, attempt.staging.clone());
    let value: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            s.log
                .violations
                .push(format!("{path}: body is not JSON: {e}"));
            drop(s);
            return respond(&mut stream, 400, r#"{"error":"bad json"}"#);
        }
    };
    match path.as_str() {
        "/v1/progress" => {
            s.log.progress.push((Instant::now(), attempt_no, value));
            drop(s);
            respond(&mut stream, 204, "")
        }
        "/v1/checkpoint" => {
            let step = value["step"].as_u64().unwrap_or(u64::MAX);
            s.log.commit_requests.push(step);
            match s.policy {
                CommitPolicy::FailAll(code) => {
                    drop(s);
                    return respond(&mut stream, code, r#"{"error":"injected failure"}"#);
                }
                CommitPolicy::RejectStep {
                    attempt,
                    step: bad,
                    status,
                } if attempt == attempt_no && bad == step => {
                    drop(s);
                    return respond(&mut stream, status, r#"{"error":"stale attempt"}"#);
                }
                _ => {}
            }
            // The staging dir must hold exactly the trainer's three files, and
            // state.json must be the state object of the request.
            let mut names: Vec<String> = std::fs::read_dir(&staging)?
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            if names != ["optimizer.bin", "state.json", "weights.bin"] {
                s.log
                    .violations
                    .push(format!("step {step}: staging holds {names:?}"));
            }
            let on_disk: serde_json::Value =
                serde_json::from_slice(&std::fs::read(staging.join("state.json"))?)
                    .unwrap_or(serde_json::Value::Null);
            if on_disk != value["state"] {
                s.log.violations.push(format!(
                    "step {step}: state.json differs from the request's state"
                ));
            }
            let rel = format!("step-{step:08}/rank-0/attempt-{attempt_no}");
            let part = s.parts_root.join(&rel);
            std::fs::create_dir_all(part.parent().expect("part has a parent"))?;
            std::fs::rename(&staging, &part)?;
            std::fs::create_dir(&staging)?;
            s.log.parts.push(Part { step, dir: part });
            drop(s);
            respond(&mut stream, 200, &format!(r#"{{"dir":"{rel}"}}"#))
        }
        other => {
            s.log.violations.push(format!("unexpected path {other}"));
            drop(s);
            respond(&mut stream, 404, r#"{"error":"not found"}"#)
        }
    }
}
