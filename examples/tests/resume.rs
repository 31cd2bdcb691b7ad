//! Checkpoints through a real HTTP agent and resumes: an interrupted run resumed from
//! its last committed checkpoint ends with final weights byte-identical to an
//! uninterrupted run, and with the digest of the `digest` subcommand (every record of
//! every epoch consumed exactly once). Also: stale attempts (409, 401) exit 3, a failing
//! agent exits 4 after its retries, and a bad resume exits 2.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

const EPOCHS: u32 = 8;

struct Fixture {
    dir: tempfile::TempDir,
    shards_file: PathBuf,
    holdout: PathBuf,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let split = split_digits(dir.path());
    let shards_file = rank_shards_file(dir.path(), &split.shards, 2, 4);
    Fixture {
        shards_file,
        holdout: split.holdout,
        dir,
    }
}

impl Fixture {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `train` with the shared arguments, as rank 2 of 4.
    fn train(&self, out: &Path) -> Command {
        let mut c = trainer();
        c.args([
            "train",
            "--epochs",
            &EPOCHS.to_string(),
            "--ckpt-every",
            "25",
        ])
        .args(["--log-every", "50", "--test-file"])
        .arg(&self.holdout)
        .arg("--out")
        .arg(out)
        .env("RANK", "2")
        .env("WORLD_SIZE", "4")
        .env("CUMULUS_JOB_ID", "job-000007")
        .env("CUMULUS_SHARDS_FILE", &self.shards_file);
        c
    }

    /// `train` as attempt `attempt` under `agent`, with its own staging dir.
    fn train_under(&self, agent: &FakeAgent, out: &Path, attempt: u64) -> Command {
        let token = format!("token-{attempt}");
        let staging = self.path(&format!("ckpt/.staging/rank-2.attempt-{attempt}"));
        agent.add_attempt(&token, attempt, &staging);
        let mut c = self.train(out);
        c.env("CUMULUS_ATTEMPT", attempt.to_string())
            .env("CUMULUS_AGENT_URL", &agent.url)
            .env("CUMULUS_AGENT_TOKEN", &token)
            .env("CUMULUS_CKPT_STAGING", &staging);
        c
    }

    /// The uninterrupted reference: standalone, no agent, no checkpoints.
    fn reference(&self) -> (Vec<u8>, serde_json::Value) {
        let out = self.path("out-reference");
        let o = run(&mut self.train(&out));
        assert!(o.status.success(), "{}", stderr(&o));
        (
            std::fs::read(out.join("rank-2/weights.bin")).expect("reference weights"),
            result_json(&out, 2),
        )
    }
}

fn assert_same_result(out: &Path, reference: &(Vec<u8>, serde_json::Value), f: &Fixture) {
    let weights = std::fs::read(out.join("rank-2/weights.bin")).expect("resumed weights");
    assert!(
        weights == reference.0,
        "final weights differ from the uninterrupted run"
    );
    let r = result_json(out, 2);
    let expected_digest = digest_of(&f.shards_file, EPOCHS, 1);
    assert_eq!(r["digest"].as_str(), Some(expected_digest.as_str()));
    assert_eq!(r["digest"], reference.1["digest"]);
    assert_eq!(r["records_consumed"], 359 * u64::from(EPOCHS));
    assert_eq!(r["accuracy"], reference.1["accuracy"]);
    assert_eq!(r["final_loss"], reference.1["final_loss"]);
    assert_eq!(r["steps"], reference.1["steps"]);
}

#[test]
fn resume_after_a_stale_verdict_is_byte_identical() {
    let f = fixture();
    let reference = f.reference();
    let agent = FakeAgent::start(
        &f.path("ckpt/job-000007"),
        CommitPolicy::RejectStep {
            attempt: 1,
            step: 75,
            status: 409,
        },
    );
    let out = f.path("out");

    let first = run(&mut f.train_under(&agent, &out, 1));
    assert_eq!(
        first.status.code(),
        Some(3),
        "stdout: {}\nstderr: {}",
        stdout(&first),
        stderr(&first)
    );
    assert!(stderr(&first).contains("stale"), "{}", stderr(&first));
    assert!(
        stdout(&first).contains("checkpoint step 50 committed: step-00000050/rank-0/attempt-1")
    );
    assert!(
        !out.join("rank-2/result.json").exists(),
        "a stale attempt writes no result"
    );
    let part = agent.latest_part().expect("a part was committed");
    assert_eq!(part.step, 50);

    let second = run(f
        .train_under(&agent, &out, 2)
        .env("CUMULUS_RESUME_DIR", &part.dir)
        .env("CUMULUS_RESUME_STEP", "50"));
    let text = stdout(&second);
    assert!(second.status.success(), "{}\n{text}", stderr(&second));
    // 359 records, batches of 16: 23 steps per epoch; step 50 = epoch 2 after 4 batches.
    assert!(
        text.contains("resumed from step 50 (epoch 2, record 64)"),
        "{text}"
    );
    assert!(
        text.contains("rank=2 attempt=2 epoch=4 step=100/184"),
        "{text}"
    );
    assert_same_result(&out, &reference, &f);
    assert_eq!(result_json(&out, 2)["attempt"], 2);

    agent.with_log(|log| {
        assert!(log.violations.is_empty(), "{:?}", log.violations);
        assert_eq!(log.unauthorized, 0);
        // Attempt 1 asked for 25, 50, 75 (refused); attempt 2 for 75 … 175.
        assert_eq!(
            log.commit_requests,
            vec![25, 50, 75, 75, 100, 125, 150, 175]
        );
        let last = &log.progress.last().expect("progress was reported").2;
        assert_eq!(last["step"], 184);
        assert_eq!(last["total_steps"], 184);
        assert!(last["metrics"]["loss"].as_f64().is_some_and(|l| l > 0.0));
    });
}

#[test]
fn resume_after_a_kill_is_byte_identical_and_progress_is_rate_limited() {
    let f = fixture();
    let reference = f.reference();
    let agent = FakeAgent::start(&f.path("ckpt/job-000007"), CommitPolicy::Accept);
    let out = f.path("out");

    let mut child = f
        .train_under(&agent, &out, 1)
        .args(["--step-sleep-ms", "20"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn trainer");
    let committed = wait_until(Duration::from_secs(120), || {
        agent.latest_part().is_some_and(|p| p.step >= 50)
    });
    assert!(committed, "no checkpoint of step 50 within the deadline");
    child.kill().expect("kill the trainer we started");
    let status = child.wait().expect("wait trainer");
    assert!(
        !status.success(),
        "the trainer was killed before it finished"
    );
    let part = agent.latest_part().expect("a part was committed");
    assert!(part.step >= 50 && part.step.is_multiple_of(25));

    let second = run(f
        .train_under(&agent, &out, 2)
        .env("CUMULUS_RESUME_DIR", &part.dir)
        .env("CUMULUS_RESUME_STEP", part.step.to_string()));
    let text = stdout(&second);
    assert!(second.status.success(), "{}\n{text}", stderr(&second));
    assert!(
        text.contains(&format!("resumed from step {} (epoch ", part.step)),
        "{text}"
    );
    assert_same_result(&out, &reference, &f);

    agent.with_log(|log| {
        assert!(log.violations.is_empty(), "{:?}", log.violations);
        // Consecutive progress reports of the slow first attempt are ≥ 200 ms apart at
        // the sender; allow for delivery jitter here.
        let first_attempt: Vec<_> = log.progress.iter().filter(|p| p.1 == 1).collect();
        let gaps: Vec<Duration> = first_attempt.windows(2).map(|w| w[1].0 - w[0].0).collect();
        assert!(
            !gaps.is_empty(),
            "progress was reported during the first attempt"
        );
        assert!(
            gaps.iter().all(|g| *g >= Duration::from_millis(100)),
            "progress reports too close together: {gaps:?}"
        );
    });
}

#[test]
fn unknown_token_means_stale_and_a_failing_agent_means_exit_4() {
    let f = fixture();
    // 401: the agent does not know the token (the attempt was dropped).
    let agent = FakeAgent::start(&f.path("ckpt-401"), CommitPolicy::Accept);
    let staging = f.path("staging-401");
    std::fs::create_dir_all(&staging).expect("staging");
    let o = run(f
        .train(&f.path("out-401"))
        .env("CUMULUS_AGENT_URL", &agent.url)
        .env("CUMULUS_AGENT_TOKEN", "nobody-knows-me")
        .env("CUMULUS_CKPT_STAGING", &staging));
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("HTTP 401"), "{}", stderr(&o));
    // Progress failures were logged but did not stop training before the checkpoint.
    assert!(
        stderr(&o).contains("progress report failed"),
        "{}",
        stderr(&o)
    );

    // 500 on every commit: one try and 5 retries, then exit 4.
    let agent = FakeAgent::start(&f.path("ckpt-500"), CommitPolicy::FailAll(500));
    let o = run(&mut f.train_under(&agent, &f.path("out-500"), 1));
    assert_eq!(o.status.code(), Some(4), "{}", stderr(&o));
    assert!(stderr(&o).contains("6 tries failed"), "{}", stderr(&o));
    agent.with_log(|log| assert_eq!(log.commit_requests, vec![25; 6]));
}

#[test]
fn an_invalid_resume_exits_2_with_a_clear_error() {
    let f = fixture();
    let agent = FakeAgent::start(
        &f.path("ckpt/job-000007"),
        CommitPolicy::RejectStep {
            attempt: 1,
            step: 50,
            status: 409,
        },
    );
    let out = f.path("out");
    let first = run(&mut f.train_under(&agent, &out, 1));
    assert_eq!(first.status.code(), Some(3), "{}", stderr(&first));
    let part = agent.latest_part().expect("step 25 committed");
    assert_eq!(part.step, 25);

    let attempt = |step: &str, dir: &Path, extra: &[&str]| {
        let o = run(f
            .train(&out)
            .args(extra)
            .env("CUMULUS_RESUME_DIR", dir)
            .env("CUMULUS_RESUME_STEP", step));
        (o.status.code(), stderr(&o))
    };
    let (code, err) = attempt("26", &part.dir, &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("step 25") && err.contains("CUMULUS_RESUME_STEP is 26"),
        "{err}"
    );

    let (code, err) = attempt("25", &part.dir, &["--lr", "0.2"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("lr"), "{err}");

    let (code, err) = attempt("x", &part.dir, &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("CUMULUS_RESUME_STEP"), "{err}");

    let (code, err) = attempt("25", &f.path("no-such-dir"), &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("state.json"), "{err}");

    // A truncated optimizer.bin is named.
    let copy = f.path("corrupt");
    std::fs::create_dir(&copy).expect("mkdir");
    for name in ["weights.bin", "optimizer.bin", "state.json"] {
        std::fs::copy(part.dir.join(name), copy.join(name)).expect("copy part");
    }
    let opt = std::fs::read(copy.join("optimizer.bin")).expect("read");
    std::fs::write(copy.join("optimizer.bin"), &opt[..opt.len() - 1]).expect("truncate");
    let (code, err) = attempt("25", &copy, &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("optimizer.bin") && err.contains("bytes"),
        "{err}"
    );

    // A bad digest in state.json is named.
    let text = std::fs::read_to_string(part.dir.join("state.json")).expect("read state");
    let mut state: serde_json::Value = serde_json::from_str(&text).expect("state is JSON");
    state["digest"] = serde_json::json!("not-hex");
    std::fs::write(copy.join("optimizer.bin"), &opt).expect("restore");
    std::fs::write(copy.join("state.json"), state.to_string()).expect("write");
    let (code, err) = attempt("25", &copy, &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("digest"), "{err}");
}
