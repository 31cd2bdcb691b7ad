//! `demo`: the README's first command. A fresh local cluster, the digits data split into
//! shards, a 4-rank training job, one rank SIGKILLed mid-run, its detection, restart and
//! resume from the last committed checkpoint measured, and the final accuracies shown.

use cumulus_api::{JobState, RankPhase};
use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use cumulus_api::{Job, JobSpec, RankStatus, RestartPolicy, SubmitJobRequest};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::client::{Client, new_request_id};
use crate::config::Conn;
use crate::dataset::{self, SplitOptions};
use crate::local::{self, TRAINER_BIN, UpOptions};
use crate::logs::{CursorState, LogLine, LogRequest, follow_logs};
use crate::render;

/// Marker file that lets a later demo wipe the directory.
pub const MARKER: &str = ".cumulus-demo";
/// World size of the demo job.
pub const WORLD_SIZE: u32 = 4;
/// Rank that gets SIGKILLed.
pub const VICTIM_RANK: u32 = 2;
/// Committed step after which the victim is killed.
pub const KILL_AFTER_STEP: u64 = 50;
/// Deadline for reaching [`KILL_AFTER_STEP`], from the submit.
pub const KILL_DEADLINE: Duration = Duration::from_secs(90);
/// Deadline for the restarted rank to make progress, from the kill.
pub const RECOVERY_DEADLINE: Duration = Duration::from_secs(60);
/// Deadline for the job to succeed, from the recovery.
pub const SUCCESS_DEADLINE: Duration = Duration::from_secs(150);
/// Poll interval of the job while measuring.
pub const POLL: Duration = Duration::from_millis(100);

/// Epochs of the demo job.
pub const EPOCHS: u32 = 30;

/// Demo options.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Working directory (wiped first).
    pub dir: PathBuf,
    /// Leave the cluster running.
    pub keep: bool,
    /// Where the binaries are.
    pub bin_dir: Option<PathBuf>,
}

/// Step announcer: headline, then the step's and the total time when it ends.
struct Steps {
    start: Instant,
    step_start: Instant,
    total: u32,
}

impl Steps {
    fn begin(&mut self, n: u32, headline: &str) {
        self.step_start = Instant::now();
        println!("\n==> [{n}/{}] {headline}", self.total);
    }

    fn done(&self, what: &str) {
        println!(
            "    {what} ({:.1} s; t+{:.1} s)",
            self.step_start.elapsed().as_secs_f64(),
            self.start.elapsed().as_secs_f64()
        );
    }
}

/// Finds the bundled digits data: `data/digits/digits.csv.gz` under the current
/// directory, else next to this crate's sources.
pub fn find_digits() -> Result<PathBuf> {
    let here = Path::new("data/digits/digits.csv.gz");
    if here.is_file() {
        return Ok(dataset::absolute(here)?);
    }
    let built = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../data/digits/digits.csv.gz"
    ));
    if built.is_file() {
        return Ok(built.to_path_buf());
    }
    bail!(
        "cannot find data/digits/digits.csv.gz (looked in the current directory and {}); run the demo from the repository root",
        built.display()
    )
}

/// Prepares the demo directory: stops a cluster recorded there, wipes it (only when it
/// is empty or was made by a demo), and marks it.
fn prepare_dir(dir: &Path) -> Result<()> {
    if dir.exists() {
        let entries = fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .count();
        if entries > 0 && !dir.join(MARKER).exists() {
            bail!(
                "refusing to wipe {}: it is not empty and was not made by `cumulusctl demo`; pass another --dir",
                dir.display()
            );
        }
        match local::down(dir, false) {
            Ok(stopped) => {
                let n = stopped
                    .iter()
                    .filter(|(_, o)| *o != local::StopOutcome::NotRunning)
                    .count();
                if n > 0 {
                    println!("    stopped {n} process(es) of a previous demo cluster");
                }
            }
            Err(local::LocalError::NotFound(_)) => {}
            Err(e) => return Err(e).context("stopping the previous demo cluster"),
        }
        fs::remove_dir_all(dir).with_context(|| format!("wiping {}", dir.display()))?;
    }
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    fs::write(
        dir.join(MARKER),
        "made by `cumulusctl demo`; wiped by the next demo\n",
    )
    .context("writing the demo marker")?;
    Ok(())
}

/// Which log lines the demo shows: resumes, results, errors, the first line of every
/// attempt and every 10th line after it.
#[derive(Debug, Default)]
pub struct LogFilter {
    counts: HashMap<(u32, u32), u64>,
}

impl LogFilter {
    /// Whether to show `l`.
    pub fn show(&mut self, l: &LogLine) -> bool {
        let n = self.counts.entry((l.rank, l.attempt)).or_insert(0);
        *n += 1;
        let lower = l.line.to_ascii_lowercase();
        lower.contains("resum")
            || l.line.contains("RESULT")
            || lower.contains("error")
            || lower.contains("panick")
            || *n % 10 == 1
    }
}

fn rank(job: &Job, r: u32) -> Option<&RankStatus> {
    job.ranks.iter().find(|x| x.rank == r)
}

/// Whether `pid` runs the named binary (argv[0]'s file name), per `/proc`.
fn runs_binary(pid: u32, binary: &str) -> bool {
    fs::read(format!("/proc/{pid}/cmdline"))
        .ok()
        .and_then(|c| {
            c.split(|&b| b == 0)
                .next()
                .map(|a| String::from_utf8_lossy(a).into_owned())
        })
        .is_some_and(|argv0| Path::new(&argv0).file_name().and_then(|n| n.to_str()) == Some(binary))
}

async fn get(client: &Client, job_id: &str) -> Result<Job> {
    client
        .get_job(job_id, false)
        .await?
        .job
        .context("the coordinator returned no job")
}

/// Runs the demo; `Err` when any step failed.
pub async fn run(opts: &DemoOptions) -> Result<()> {
    let mut steps = Steps {
        start: Instant::now(),
        step_start: Instant::now(),
        total: 8,
    };
    steps.begin(
        1,
        "Fresh local cluster: 3 coordinators (Raft), 2 workers × 4 slots",
    );
    prepare_dir(&opts.dir)?;
    let trainer = local::find_binary(TRAINER_BIN, opts.bin_dir.as_deref())?;
    let (ranks, why_root) = demo_ranks(
        &opts
            .dir
            .canonicalize()
            .with_context(|| format!("resolving {}", opts.dir.display()))?,
        &trainer,
    )?;
    let other_users = ranks == local::Ranks::Default && nix::unistd::geteuid().is_root();
    let up = UpOptions {
        dir: opts.dir.clone(),
        coordinators: Some(3),
        workers: Some(2),
        slots: Some(4),
        bin_dir: opts.bin_dir.clone(),
        ready_timeout: local::READY_TIMEOUT,
        insecure: false,
        ranks,
    };
    let started = local::up(&up, false)
        .await
        .context("starting the local cluster")?;
    let dir = started.dir.clone();
    println!(
        "    leader: node {}; workers: {}",
        started
            .status
            .leader_id
            .map_or("-".into(), |l| l.to_string()),
        started
            .file
            .workers
            .iter()
            .map(|w| w.worker_id.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "    ranks run as: {}",
        local::ranks_text(&started.rank_flags)
    );
    if let Some(why) = why_root {
        println!("    ({why})");
    }
    steps.done("cluster ready");
    let conn = started.conn()?;
    let children = started.children;

    let result = run_job(opts, &mut steps, &dir, &conn, other_users).await;
    let failed = result.is_err();

    steps.begin(
        8,
        if opts.keep {
            "Leaving the cluster running (--keep)"
        } else {
            "Stopping the cluster"
        },
    );
    if opts.keep {
        let flag = format!(" --local-dir {}", dir.display());
        println!("    cumulusctl{flag} cluster status");
        println!("    cumulusctl{flag} list");
        println!("    cumulusctl{flag} local down       (stop it; --purge deletes its data)");
        drop(children);
    } else {
        let stopped = tokio::task::spawn_blocking({
            let dir = dir.clone();
            move || local::down(&dir, false)
        })
        .await
        .context("stopping the cluster")?;
        local::reap(children);
        match stopped {
            Ok(_) => steps.done("stopped"),
            Err(e) => eprintln!("    could not stop the cluster cleanly: {e}"),
        }
    }
    if failed {
        println!("\nlogs: {}/*.log", dir.display());
    }
    println!(
        "\ntotal wall time: {:.1} s",
        steps.start.elapsed().as_secs_f64()
    );
    result
}

/// Who the demo's ranks run as: as `local up` has it (run by root: other users), unless
/// run by root where other users cannot reach the demo's directory `dir` or the
/// `trainer` (a checkout under `/root`): then as root, with the reason to print. The
/// demo runs only its own trainer, so root ranks expose nothing to foreign code.
fn demo_ranks(dir: &Path, trainer: &Path) -> Result<(local::Ranks, Option<String>)> {
    if !nix::unistd::geteuid().is_root() {
        return Ok((local::Ranks::Default, None));
    }
    use std::os::unix::fs::PermissionsExt;
    let trainer_mode = fs::metadata(trainer)
        .with_context(|| format!("inspecting {}", trainer.display()))?
        .permissions()
        .mode();
    let blocked = match local::closed_to_others(dir)? {
        Some(b) => Some(b),
        None => match trainer.parent().map(local::closed_to_others).transpose()? {
            Some(Some(b)) => Some(b),
            _ if trainer_mode & 0o001 == 0 => Some((trainer.to_path_buf(), trainer_mode & 0o7777)),
            _ => None,
        },
    };
    Ok(match blocked {
        None => (local::Ranks::Default, None),
        Some((path, mode)) => (
            local::Ranks::Root,
            Some(format!(
                "other users cannot reach {} (mode {mode:04o}) on the way to the demo's \
                 directory or its trainer, so its ranks run as root (`local up \
                 --allow-root`): the demo runs only its own trainer",
                path.display()
            )),
        ),
    })
}

async fn run_job(
    opts: &DemoOptions,
    steps: &mut Steps,
    dir: &Path,
    conn: &Conn,
    other_users: bool,
) -> Result<()> {
    steps.begin(2, "Split the digits data set into 8 shards + a 20% holdout");
    let digits = find_digits()?;
    let shards_dir = dir.join("data/shards");
    let holdout = dir.join("data/holdout.csv");
    let report = dataset::split(&SplitOptions {
        input: digits,
        shards: 8,
        out: shards_dir.clone(),
        holdout_fraction: 0.2,
        holdout_out: Some(holdout.clone()),
        force: false,
    })?;
    for line in dataset::report_text(&report).lines() {
        println!("    {line}");
    }
    steps.done("split");

    steps.begin(
        3,
        "Submit a 4-rank training job (checkpoint every 25 steps, 3 restarts, backoff 1 s)",
    );
    let trainer = local::find_binary(TRAINER_BIN, opts.bin_dir.as_deref())?;
    let out_dir = dir.join("out");
    let ckpt_dir = dir.join("ckpt");
    if other_users {
        // Ranks of another user write their results here: open to them as /tmp is.
        use std::os::unix::fs::PermissionsExt;
        fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
        fs::set_permissions(&out_dir, fs::Permissions::from_mode(0o1777))
            .with_context(|| format!("opening {} to the ranks", out_dir.display()))?;
    }
    let command: Vec<String> = vec![
        trainer.display().to_string(),
        "train".into(),
        "--test-file".into(),
        holdout.display().to_string(),
        "--out".into(),
        out_dir.display().to_string(),
        "--epochs".into(),
        EPOCHS.to_string(),
        "--ckpt-every".into(),
        "25".into(),
        "--step-sleep-ms".into(),
        "10".into(),
    ];
    println!("    command: {}", render::shell_words(&command));
    let req = SubmitJobRequest {
        allow_pending: false,
        request_id: new_request_id(),
        spec: Some(JobSpec {
            name: "digits-demo".into(),
            world_size: WORLD_SIZE,
            command,
            dataset: shards_dir.display().to_string(),
            ckpt_dir: ckpt_dir.display().to_string(),
            restart: Some(RestartPolicy {
                max_restarts: Some(3),
                backoff_initial_ms: Some(1000),
                ..Default::default()
            }),
            ..Default::default()
        }),
    };
    let client = Client::new(conn)?;
    let job_id = client.submit_job(req).await?.job_id;
    let submitted = Instant::now();
    steps.done(&format!("submitted {job_id}"));

    steps.begin(
        4,
        "Tail the job's logs over SSE (a subset: first and every 10th line, resumes, results)",
    );
    let tail = {
        let conn = conn.clone();
        let req = LogRequest {
            job_id: job_id.clone(),
            rank: None,
            follow: true,
            since_ms: None,
        };
        tokio::spawn(async move {
            let mut filter = LogFilter::default();
            let mut state = CursorState::default();
            follow_logs(&conn, &req, &mut state, |l| {
                if filter.show(l) {
                    println!("    | {}", l.human_escaped());
                }
            })
            .await
        })
    };
    steps.done("log stream started in the background");
    let outcome = measure_and_finish(
        steps,
        &client,
        &JobCtx {
            dir,
            job_id: &job_id,
            submitted,
            out_dir: &out_dir,
            report: &report,
            trainer: &trainer,
        },
    )
    .await;
    if outcome.is_ok() {
        // Let the stream drain to its `end` event (the job is finished), briefly.
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while !tail.is_finished() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
    }
    tail.abort();
    outcome
}

/// What the later steps need to know about the submitted job.
struct JobCtx<'a> {
    dir: &'a Path,
    job_id: &'a str,
    submitted: Instant,
    out_dir: &'a Path,
    report: &'a dataset::SplitReport,
    trainer: &'a Path,
}

/// Steps 5 to 7 of the demo and its results: kills the victim rank once a checkpoint
/// step is committed, measures its detection, restart and resume, waits for the job to
/// succeed, then checks and prints every rank's results, the job and its checkpoints.
///
/// # Errors
/// A step that fails or misses its deadline, or results that differ from a straight run.
async fn measure_and_finish(steps: &mut Steps, client: &Client, ctx: &JobCtx<'_>) -> Result<()> {
    let JobCtx {
        dir,
        job_id,
        submitted,
        out_dir,
        report,
        trainer,
    } = *ctx;
    let victim = kill_victim(steps, client, job_id, submitted).await?;
    watch_recovery(steps, client, job_id, &victim).await?;
    let final_resp = wait_for_success(steps, client, job_id).await?;
    println!();
    let results = verify_results(dir, out_dir, report, trainer)?;
    print!("{}", results.table);
    println!("{}\n", results.summary);
    print!("{}", render::job_status(&final_resp, render::now_ms()));
    println!();
    let ckpts = client.list_checkpoints(job_id).await?;
    print!("{}", render::checkpoints_table(&ckpts));
    println!(
        "checkpoints under {}",
        dir.join("ckpt").join(job_id).display()
    );
    Ok(())
}

/// The victim rank as it was SIGKILLed.
struct Victim {
    /// Its attempt that was killed.
    attempt: u32,
    /// Restart records the job had before the kill.
    restarts_before: usize,
    /// When the signal was sent.
    killed: Instant,
}

/// Step 5: waits until checkpoint step [`KILL_AFTER_STEP`] is committed and the victim
/// rank runs, then SIGKILLs its process (after checking, through `/proc`, that it is the
/// trainer).
///
/// # Errors
/// The job finishes first, the step is not committed within [`KILL_DEADLINE`] of
/// `submitted`, the pid is not the trainer's, or the signal cannot be sent.
async fn kill_victim(
    steps: &mut Steps,
    client: &Client,
    job_id: &str,
    submitted: Instant,
) -> Result<Victim> {
    steps.begin(
        5,
        &format!("Wait for checkpoint step {KILL_AFTER_STEP}, then SIGKILL rank {VICTIM_RANK}"),
    );
    let (victim_pid, victim_attempt, restarts_before) = loop {
        let job = get(client, job_id).await?;
        if crate::jobs::is_finished(&job.state) {
            bail!(
                "{job_id} finished ({}) before checkpoint step {KILL_AFTER_STEP} was committed: {}",
                job.state,
                job.failure_cause
            );
        }
        if let Some(r) = rank(&job, VICTIM_RANK)
            && job.committed_step.unwrap_or(0) >= KILL_AFTER_STEP
            && r.phase() == Ok(RankPhase::Running)
            && r.pid != 0
        {
            let progress = if r.step > 0 {
                format!(", last progress report: step {}", r.step)
            } else {
                String::new()
            };
            println!(
                "    checkpoint step {} committed; rank {VICTIM_RANK} attempt {} is pid {}{progress}",
                job.committed_step.unwrap_or(0),
                r.attempt,
                r.pid,
            );
            break (r.pid, r.attempt, job.restarts.len());
        }
        if submitted.elapsed() > KILL_DEADLINE {
            bail!(
                "checkpoint step {KILL_AFTER_STEP} not committed within {} s of the submit (committed: {:?})",
                KILL_DEADLINE.as_secs(),
                job.committed_step
            );
        }
        tokio::time::sleep(POLL).await;
    };
    if !runs_binary(victim_pid, TRAINER_BIN) {
        bail!("pid {victim_pid} is not a {TRAINER_BIN} process here; not killing it");
    }
    kill(Pid::from_raw(victim_pid as i32), Signal::SIGKILL)
        .with_context(|| format!("SIGKILL pid {victim_pid}"))?;
    let killed = Instant::now();
    println!(
        "    SIGKILL sent to pid {victim_pid} at t+{:.1} s",
        steps.start.elapsed().as_secs_f64()
    );
    steps.done("rank killed");
    Ok(Victim {
        attempt: victim_attempt,
        restarts_before,
        killed,
    })
}

/// Step 6: polls the job until a new attempt of the victim rank reports progress past
/// the step it resumed from, printing when the kill was detected, the restart record,
/// when the new attempt ran and when it progressed, each measured from the kill.
///
/// # Errors
/// The job finishes during recovery (but for a success after the restart record was
/// seen), or the rank does not recover within [`RECOVERY_DEADLINE`].
async fn watch_recovery(
    steps: &mut Steps,
    client: &Client,
    job_id: &str,
    victim: &Victim,
) -> Result<()> {
    let Victim {
        attempt: victim_attempt,
        restarts_before,
        killed,
    } = *victim;
    steps.begin(6, "Detection, restart and resume");
    let (mut detected, mut running, mut progressed) =
        (None::<Duration>, None::<Duration>, None::<Duration>);
    let mut record_shown = false;
    let mut resume_step = None;
    while progressed.is_none() {
        let job = get(client, job_id).await?;
        let r = rank(&job, VICTIM_RANK).cloned().unwrap_or_default();
        if detected.is_none()
            && (r.attempt != victim_attempt
                || r.phase() != Ok(RankPhase::Running)
                || job.restarts.len() > restarts_before)
        {
            detected = Some(killed.elapsed());
            println!(
                "    detected after {} ms: rank {VICTIM_RANK} {}",
                killed.elapsed().as_millis(),
                detection_text(&r, victim_attempt)
            );
        }
        if !record_shown && let Some(rec) = job.restarts.get(restarts_before) {
            record_shown = true;
            resume_step = rec.resume_step;
            println!(
                "    restart #{}: cause \"{}\"; ranks {:?}; delay {} ms; resume from step {}",
                rec.number,
                rec.cause,
                rec.ranks,
                rec.delay_ms,
                rec.resume_step.map_or("scratch".into(), |s| s.to_string())
            );
        }
        if r.attempt > victim_attempt && r.phase() == Ok(RankPhase::Running) && running.is_none() {
            running = Some(killed.elapsed());
            println!(
                "    rank {VICTIM_RANK} attempt {} running (pid {}) {} ms after the kill",
                r.attempt,
                r.pid,
                killed.elapsed().as_millis()
            );
        }
        if running.is_some()
            && r.attempt > victim_attempt
            && record_shown
            && r.step > resume_step.unwrap_or(0)
        {
            progressed = Some(killed.elapsed());
            println!(
                "    rank {VICTIM_RANK} attempt {} reported step {} (> resume step {}) {} ms after the kill",
                r.attempt,
                r.step,
                resume_step.unwrap_or(0),
                killed.elapsed().as_millis()
            );
        }
        if crate::jobs::is_finished(&job.state) && progressed.is_none() {
            if job.job_state() == Ok(JobState::Succeeded) && record_shown {
                println!(
                    "    (the job finished before a progress report of the new attempt was seen)"
                );
                break;
            }
            bail!(
                "{job_id} finished ({}) during recovery: {}",
                job.state,
                job.failure_cause
            );
        }
        if killed.elapsed() > RECOVERY_DEADLINE {
            bail!(
                "rank {VICTIM_RANK} did not recover within {} s of the kill (state {}, attempt {})",
                RECOVERY_DEADLINE.as_secs(),
                r.state,
                r.attempt
            );
        }
        tokio::time::sleep(POLL).await;
    }
    let ms = |d: Option<Duration>| d.map_or("-".into(), |d| format!("{} ms", d.as_millis()));
    println!(
        "    kill -> detected {}; -> new attempt running {}; -> progress past the checkpoint {}",
        ms(detected),
        ms(running),
        ms(progressed)
    );
    steps.done("recovered");
    Ok(())
}

/// What became of the victim rank when its kill was first noticed (`r`, its status
/// then): its attempt's state and exit, or that the killed `victim_attempt` is gone and
/// which attempt replaced it.
fn detection_text(r: &RankStatus, victim_attempt: u32) -> String {
    let exit = render::exit_text(r);
    let exit = if exit == "-" {
        String::new()
    } else {
        format!(" ({exit})")
    };
    if r.attempt == victim_attempt {
        format!("attempt {} is {}{exit}", r.attempt, r.state)
    } else {
        format!(
            "attempt {victim_attempt} is gone; attempt {} is {}{exit}",
            r.attempt, r.state
        )
    }
}

/// Step 7: polls the job (linearizable reads) until it finishes, within
/// [`SUCCESS_DEADLINE`]. Returns its last response.
///
/// # Errors
/// The job finishes otherwise than succeeded (its status is printed first), or does not
/// finish in time.
async fn wait_for_success(
    steps: &mut Steps,
    client: &Client,
    job_id: &str,
) -> Result<cumulus_api::JobResponse> {
    steps.begin(7, "Wait for the job to succeed");
    let deadline = Instant::now() + SUCCESS_DEADLINE;
    let final_resp = loop {
        let resp = client.get_job(job_id, true).await?;
        let job = resp
            .job
            .clone()
            .context("the coordinator returned no job")?;
        if crate::jobs::is_finished(&job.state) {
            if job.job_state() != Ok(JobState::Succeeded) {
                print!("{}", render::job_status(&resp, render::now_ms()));
                bail!("{job_id} {}: {}", job.state, job.failure_cause);
            }
            break resp;
        }
        if Instant::now() > deadline {
            bail!(
                "{job_id} did not finish within {} s (state {})",
                SUCCESS_DEADLINE.as_secs(),
                job.state
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    steps.done("succeeded");
    Ok(final_resp)
}

/// The ranks' results, checked against a straight run.
struct Results {
    table: String,
    summary: String,
}

/// Shard indices of `rank`: shard `i` belongs to rank `i mod world_size`.
pub fn shards_of(rank: u32, shard_count: usize, world_size: u32) -> Vec<usize> {
    (0..shard_count)
        .filter(|i| *i % world_size as usize == rank as usize)
        .collect()
}

/// Reads every rank's `result.json` and checks that its records and record digest are
/// those of a straight, uninterrupted run over its shards (`cumulus-trainer digest`):
/// the kill and the resume lost and repeated no record.
fn verify_results(
    dir: &Path,
    out_dir: &Path,
    report: &dataset::SplitReport,
    trainer: &Path,
) -> Result<Results> {
    let verify_dir = dir.join("verify");
    fs::create_dir_all(&verify_dir)
        .with_context(|| format!("creating {}", verify_dir.display()))?;
    let mut t = render::table(&[
        "RANK",
        "ATTEMPT",
        "ACCURACY",
        "RECORDS",
        "EXPECTED",
        "DIGEST",
        "STRAIGHT-RUN DIGEST",
    ]);
    let mut mismatches = Vec::new();
    let mut accuracies = Vec::new();
    for r in 0..WORLD_SIZE {
        let path = out_dir.join(format!("rank-{r}/result.json"));
        let text =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        let accuracy = v.get("accuracy").and_then(serde_json::Value::as_f64);
        let attempt = v.get("attempt").and_then(serde_json::Value::as_u64);
        let records = v
            .get("records_consumed")
            .and_then(serde_json::Value::as_u64)
            .with_context(|| format!("{}: no integer \"records_consumed\"", path.display()))?;
        let digest = v
            .get("digest")
            .and_then(serde_json::Value::as_str)
            .with_context(|| format!("{}: no \"digest\"", path.display()))?
            .to_string();

        let mine = shards_of(r, report.shard_rows.len(), WORLD_SIZE);
        let expected_records: u64 =
            mine.iter().map(|&i| report.shard_rows[i]).sum::<u64>() * EPOCHS as u64;
        let list = verify_dir.join(format!("rank-{r}.shards"));
        let listing: String = mine
            .iter()
            .map(|&i| {
                format!(
                    "{}\n",
                    report.out_dir.join(dataset::shard_name(i as u32)).display()
                )
            })
            .collect();
        fs::write(&list, listing).with_context(|| format!("writing {}", list.display()))?;
        let out = std::process::Command::new(trainer)
            .args(["digest", "--shards-file"])
            .arg(&list)
            .args(["--epochs", &EPOCHS.to_string()])
            .output()
            .with_context(|| format!("running {} digest", trainer.display()))?;
        if !out.status.success() {
            bail!(
                "{} digest failed: {}",
                trainer.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let straight = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if straight != digest || records != expected_records {
            mismatches.push(r);
        }
        if let Some(a) = accuracy {
            accuracies.push(a);
        }
        t.add_row(vec![
            r.to_string(),
            attempt.map_or("-".into(), |a| a.to_string()),
            accuracy.map_or("-".into(), |a| format!("{:.2}%", a * 100.0)),
            records.to_string(),
            expected_records.to_string(),
            digest.chars().take(16).collect::<String>(),
            if straight == digest {
                "same".into()
            } else {
                format!(
                    "DIFFERENT ({})",
                    straight.chars().take(16).collect::<String>()
                )
            },
        ]);
    }
    if !mismatches.is_empty() {
        print!("{}", render::table_text(&t));
        bail!(
            "ranks {mismatches:?} did not consume exactly the records of a straight run (records or digest differ)"
        );
    }
    let mean = if accuracies.is_empty() {
        0.0
    } else {
        accuracies.iter().sum::<f64>() / accuracies.len() as f64
    };
    Ok(Results {
        table: render::table_text(&t),
        summary: format!(
            "every rank consumed each of its records exactly once per epoch ({} training rows × {EPOCHS} epochs), \
             despite the kill; mean holdout accuracy {:.2}% on {} rows",
            report.rows - report.holdout_rows,
            mean * 100.0,
            report.holdout_rows
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn as_root_the_demo_runs_ranks_as_root_only_when_others_cannot_reach_its_files() {
        use std::os::unix::fs::PermissionsExt;
        let chmod = |p: &Path, mode: u32| {
            fs::set_permissions(p, fs::Permissions::from_mode(mode)).expect("chmod")
        };
        let tmp = tempfile::tempdir().expect("tempdir");
        chmod(tmp.path(), 0o755);
        let (open, closed) = (tmp.path().join("open"), tmp.path().join("closed"));
        for d in [&open, &closed] {
            fs::create_dir(d).expect("mkdir");
        }
        let trainer = open.join(TRAINER_BIN);
        fs::write(&trainer, "").expect("write");
        chmod(&trainer, 0o755);
        chmod(&closed, 0o700);
        let (ranks, why) = demo_ranks(&open, &trainer).expect("inspect");
        assert_eq!((ranks, why), (local::Ranks::Default, None));
        let (ranks, why) = demo_ranks(&closed, &trainer).expect("inspect");
        if !nix::unistd::geteuid().is_root() {
            // Run by another user, ranks run as that user whatever the modes.
            assert_eq!((ranks, why), (local::Ranks::Default, None));
            return;
        }
        assert_eq!(ranks, local::Ranks::Root);
        let why = why.expect("a reason");
        assert!(
            why.contains(&format!("{} (mode 0700)", closed.display())),
            "{why}"
        );
        // A trainer others may not execute.
        chmod(&trainer, 0o700);
        let (ranks, why) = demo_ranks(&open, &trainer).expect("inspect");
        assert_eq!(ranks, local::Ranks::Root);
        assert!(why.is_some_and(|w| w.contains(&trainer.display().to_string())));
    }

    #[test]
    fn filter_shows_first_every_tenth_and_interesting_lines() {
        let mut f = LogFilter::default();
        let line = |attempt: u32, s: &str| LogLine {
            rank: 1,
            attempt,
            offset: 0,
            line: s.into(),
        };
        let shown: Vec<bool> = (0..21)
            .map(|i| f.show(&line(0, &format!("step {i}"))))
            .collect();
        assert_eq!(shown.iter().filter(|&&b| b).count(), 3, "lines 1, 11, 21");
        assert!(f.show(&line(0, "RESULT accuracy=0.93")));
        assert!(f.show(&line(0, "resumed from step 50")));
        assert!(f.show(&line(1, "step 0")), "first line of a new attempt");
        assert!(!f.show(&line(1, "step 1")));
    }

    #[test]
    fn shard_ownership_is_modulo_world_size() {
        assert_eq!(shards_of(2, 8, 4), vec![2, 6]);
        assert_eq!(shards_of(0, 3, 4), vec![0]);
        assert_eq!(shards_of(3, 3, 4), Vec::<usize>::new());
    }

    #[test]
    fn digits_are_found_from_any_directory() {
        let p = find_digits().expect("digits");
        assert!(p.is_file(), "{}", p.display());
    }

    #[test]
    fn prepare_dir_refuses_foreign_non_empty_dirs_and_wipes_demo_dirs() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let foreign = tmp.path().join("foreign");
        fs::create_dir_all(&foreign).expect("mkdir");
        fs::write(foreign.join("precious"), "x").expect("write");
        assert!(prepare_dir(&foreign).is_err());
        assert!(foreign.join("precious").exists());

        let demo = tmp.path().join("demo");
        prepare_dir(&demo).expect("fresh");
        fs::write(demo.join("old-output"), "x").expect("write");
        prepare_dir(&demo).expect("again");
        assert!(!demo.join("old-output").exists());
        assert!(demo.join(MARKER).exists());
    }
}
