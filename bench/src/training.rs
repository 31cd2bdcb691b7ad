//! Scenario `training` (issue 3, measurement 7): steps per second of the example trainer
//! run under Cumulus against the same trainer run directly (target ≥ 0.99).
//!
//! Both runs train world size 1 on every shard of the bundled digits data with the same
//! arguments and no checkpoints. Both are measured the same way: the trainer is started
//! through one tiny `/bin/sh` wrapper that stamps the wall clock (`date +%s%N`) before and
//! after the trainer process and writes both stamps to a file; steps come from the
//! trainer's `result.json`. So the ratio compares the trainer's wall time from its own
//! side in both cases, and what differs is only what the worker agent adds: the rank
//! environment, its own process group, stdout/stderr captured into the agent's log file,
//! and progress reports over the agent's local HTTP API (at most one per 200 ms). The
//! direct run's stdout/stderr also go into pipes that this process drains into files (as
//! the agent drains a rank's, or a terminal would), and it gets no `CUMULUS_*` or torchrun
//! variables. The trainer prints no timing of its own, hence the wrapper.
//!
//! One cluster (3 coordinators, 1 worker) stays up during the whole scenario, direct runs
//! included, so the background load of idle coordinators and agent is the same for both
//! arms; the runs alternate which goes first, and the median of the per-pair ratios is
//! reported. Both runs must end with the same step count and record digest (the same work),
//! or the scenario fails. On the shared 2-core development machine one run's steps/s
//! ranged 29k–62k from run to run (other processes' load), far more than the 1% the target
//! asks to resolve: the ratio there ranged 0.73–1.08 over six runs of the scenario; judge
//! it on a quiet machine.
//!
//! For information (no target): the ratio of steps per CPU-second of the trainer (user +
//! sys from the wrapper's `times`, less sensitive to other load than wall time), the
//! best-of-runs ratio, the host's load average, the CPU seconds the agent, the
//! coordinators and this process (draining the direct run's output) used during each kind
//! of run (on a machine with few cores that CPU comes out of the trainer's share), the
//! rank's wall time as the leader stamps it (start and exit reports), one diagnostic pair
//! with `--log-every 0` (the trainer's default prints a line every 20 steps, thousands of
//! lines per second here) that tells how much of the difference is the agent capturing
//! log lines, and a run under Cumulus with a checkpoint every 25 steps (the trainer's
//! default) into a checkpoint dir, with what each checkpoint costs on average relative to
//! the direct rate.

use cumulus_api::JobState;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use cumulus_api::v1;
use cumulus_e2e::{Cluster, ClusterOpts, Workload};

use crate::Ctx;
use crate::report::{Row, percentile};

/// Scenario name in every row.
const SCENARIO: &str = "training";
/// Shards the digits data is split into (all of them go to the one rank).
const SHARDS: u32 = 4;
/// Steps between checkpoints in the checkpointed run.
const CKPT_EVERY: u64 = 25;
/// Target: Cumulus steps/s over direct steps/s.
const TARGET_RATIO: f64 = 0.99;
/// Longest a job of this scenario may take before the scenario fails.
const JOB_DEADLINE: Duration = Duration::from_secs(900);
/// How often the timing file is looked for while a job runs, in milliseconds.
const FILE_POLL_MS: u64 = 100;
/// The job's state is read once per this many looks for the timing file.
const JOB_POLL_EVERY: u64 = 50;
/// The timing wrapper: `sh timed.sh TIMING_FILE CMD ARGS...` runs CMD and writes
/// `<start_ns> <end_ns>` (wall clock) then the output of the shell's `times` builtin
/// (`<shell user> <shell sys>` / `<children user> <children sys>`, each like `0m1.234s`) to
/// TIMING_FILE, exiting with CMD's status.
const WRAPPER: &str = r#"timing="$1"; shift
start=$(date +%s%N)
"$@"
rc=$?
end=$(date +%s%N)
{ echo "$start $end"; times; } > "$timing"
exit $rc
"#;

/// One measured trainer run.
struct RunResult {
    /// Trainer wall time from the wrapper's stamps.
    elapsed: Duration,
    /// CPU time (user + sys) of the trainer (and the two `date` calls), from `times`.
    cpu: Duration,
    /// Steps from `result.json`.
    steps: u64,
    /// Record digest from `result.json`.
    digest: String,
    /// Rank wall time from the leader's stamps (`exited_at_ms - started_at_ms`); runs under
    /// Cumulus only.
    leader_wall: Option<Duration>,
    /// Latest committed checkpoint step; runs under Cumulus only.
    committed_step: Option<u64>,
    /// CPU the other processes used during the run.
    others_cpu: CpuSnapshot,
}

/// CPU seconds (user + sys) of the processes around the trainer: so far, or used during
/// a run (a difference of two readings).
#[derive(Clone, Copy, Debug, Default)]
struct CpuSnapshot {
    /// The worker agent.
    agent_s: f64,
    /// Every coordinator together.
    coordinators_s: f64,
    /// This benchmark process (which drains the direct run's output).
    bench_s: f64,
}

impl CpuSnapshot {
    /// Reads the CPU time of the cluster's processes and of this process.
    fn read(cluster: &Cluster) -> anyhow::Result<CpuSnapshot> {
        let cpu_of = |proc: &cumulus_e2e::Proc| -> anyhow::Result<f64> {
            let pid = proc
                .pid()
                .with_context(|| format!("{} is not running", proc.name))?;
            crate::procstat::cpu_seconds(pid)
        };
        let mut agent_s = 0.0;
        for worker in &cluster.workers {
            agent_s += cpu_of(worker)?;
        }
        let mut coordinators_s = 0.0;
        for coordinator in &cluster.coordinators {
            coordinators_s += cpu_of(&coordinator.proc)?;
        }
        let bench_s = crate::procstat::cpu_seconds(std::process::id())?;
        Ok(CpuSnapshot {
            agent_s,
            coordinators_s,
            bench_s,
        })
    }

    /// The CPU used since `before`.
    fn since(&self, before: &CpuSnapshot) -> CpuSnapshot {
        CpuSnapshot {
            agent_s: self.agent_s - before.agent_s,
            coordinators_s: self.coordinators_s - before.coordinators_s,
            bench_s: self.bench_s - before.bench_s,
        }
    }
}

impl RunResult {
    fn steps_per_s(&self) -> f64 {
        self.steps as f64 / self.elapsed.as_secs_f64()
    }

    fn steps_per_cpu_s(&self) -> f64 {
        self.steps as f64 / self.cpu.as_secs_f64()
    }
}

/// What every run of the scenario shares.
struct Setup {
    /// Scratch dir of the scenario.
    dir: PathBuf,
    /// The digits shards and holdout.
    workload: Workload,
    /// Shards file listing every shard, sorted (what the agent gives rank 0 of 1).
    shards_file: PathBuf,
    /// The timing wrapper script.
    wrapper: PathBuf,
    /// The trainer binary.
    trainer: PathBuf,
}

impl Setup {
    /// `train` arguments shared by both arms (no `--shards-file`: see the callers).
    fn train_args(&self, out: &Path, epochs: u32, extra: &[String]) -> Vec<String> {
        let mut args = vec![
            "train".to_string(),
            "--test-file".into(),
            self.workload.holdout.to_string_lossy().into_owned(),
            "--out".into(),
            out.to_string_lossy().into_owned(),
            "--epochs".into(),
            epochs.to_string(),
        ];
        args.extend(extra.iter().cloned());
        args
    }
}

/// Runs the scenario.
pub async fn run(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    // ~1.2–2.4 ms per epoch of 90 steps in release: 4500 epochs is 5–11 s of training.
    let epochs: u32 = ctx.pick(4500, 3);
    let ckpt_epochs: u32 = ctx.pick(20, 2);
    // 7 pairs (was 3 until session 13): on session 13's machine one run's steps per
    // CPU-second moved by up to ±10% from run to run with no change to either arm, and the
    // median of 3 pair ratios ranged 0.85–1.13 over eight runs of the scenario.
    let reps: usize = ctx.pick(7, 1);
    let dir = ctx.work_dir.join(SCENARIO);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let setup = prepare(&dir)?;
    let load_before = load_average()?;
    let cluster = Cluster::start(ClusterOpts {
        coordinators: 3,
        workers: 1,
        slots: 1,
        heartbeat_timeout_ms: 5_000,
        ..ClusterOpts::default()
    })
    .await
    .context("starting the cluster")?;

    let mut pairs = Vec::with_capacity(reps);
    for rep in 0..reps {
        let pair = run_pair(
            &cluster,
            &setup,
            &format!("rep{rep}"),
            epochs,
            &[],
            rep % 2 == 0,
        )
        .await?;
        pairs.push(pair);
    }
    // Diagnostic pair: the same runs with the trainer's progress lines off, to tell how
    // much of the difference is the agent capturing ~2,500 log lines per second.
    let quiet_args = ["--log-every".to_string(), "0".to_string()];
    let quiet = run_pair(&cluster, &setup, "quiet", epochs, &quiet_args, true).await?;

    let ckpt_root = dir.join("ckpt");
    let ckpt_args = ["--ckpt-every".to_string(), CKPT_EVERY.to_string()];
    let checkpointed = run_cumulus(
        &cluster,
        &setup,
        "ckpt",
        ckpt_epochs,
        Some(&ckpt_root),
        &ckpt_args,
    )
    .await?;
    drop(cluster);

    let measured = Measured {
        load_before,
        pairs,
        quiet,
        checkpointed,
    };
    let mut rows = pair_rows(&measured);
    rows.extend(diagnostic_rows(&measured));
    Ok(rows)
}

/// What the scenario measured, for its rows.
struct Measured {
    /// The host's 1-minute load average before the runs.
    load_before: f64,
    /// The counted `(direct, Cumulus)` pairs, in the order they ran (at least one).
    pairs: Vec<(RunResult, RunResult)>,
    /// The diagnostic pair run with `--log-every 0`.
    quiet: (RunResult, RunResult),
    /// The run under Cumulus with a checkpoint every [`CKPT_EVERY`] steps.
    checkpointed: RunResult,
}

impl Measured {
    /// The median over the counted pairs of `f` of each `(direct, Cumulus)` pair.
    fn median(&self, f: &dyn Fn(&(RunResult, RunResult)) -> f64) -> f64 {
        percentile(&self.pairs.iter().map(f).collect::<Vec<_>>(), 50.0)
    }

    /// The median steps per second of the direct runs (the rate checkpoint costs are
    /// measured against).
    fn direct_rate(&self) -> f64 {
        self.median(&|(d, _)| d.steps_per_s())
    }
}

/// The rows of the counted pairs: the target ratio (medians of per-pair ratios), the
/// ratio per CPU-second and of the best runs, the host's load, each arm's steps per
/// second, and the CPU the agent, the coordinators and this process used meanwhile.
fn pair_rows(m: &Measured) -> Vec<Row> {
    let pairs = &m.pairs;
    let n = pairs.len();
    let direct_rate = m.direct_rate();
    let ratio = m.median(&|(d, c)| c.steps_per_s() / d.steps_per_s());
    let cpu_ratio = m.median(&|(d, c)| c.steps_per_cpu_s() / d.steps_per_cpu_s());
    let best = |f: &dyn Fn(&(RunResult, RunResult)) -> f64| -> f64 {
        pairs.iter().map(f).fold(0.0, f64::max)
    };
    let best_ratio = best(&|(_, c)| c.steps_per_s()) / best(&|(d, _)| d.steps_per_s());
    let load_before = m.load_before;
    vec![
        Row::at_least(
            SCENARIO,
            "cumulus/direct steps per second",
            ratio,
            "ratio",
            n,
            TARGET_RATIO,
        ),
        Row::new(
            SCENARIO,
            "cumulus/direct steps per CPU-second (trainer user+sys)",
            cpu_ratio,
            "ratio",
            n,
        ),
        Row::new(
            SCENARIO,
            "cumulus/direct best-of-runs steps per second",
            best_ratio,
            "ratio",
            n,
        ),
        Row::new(
            SCENARIO,
            "host 1-min load average before the runs",
            load_before,
            "load",
            1,
        ),
        Row::new(
            SCENARIO,
            "direct steps/s (trainer wall, wrapper-stamped)",
            direct_rate,
            "steps/s",
            n,
        ),
        Row::new(
            SCENARIO,
            "cumulus steps/s (trainer wall, wrapper-stamped)",
            m.median(&|(_, c)| c.steps_per_s()),
            "steps/s",
            n,
        ),
        Row::new(
            SCENARIO,
            "agent CPU during a run under Cumulus",
            m.median(&|(_, c)| c.others_cpu.agent_s),
            "s",
            n,
        ),
        Row::new(
            SCENARIO,
            "agent CPU during a direct run (idle agent)",
            m.median(&|(d, _)| d.others_cpu.agent_s),
            "s",
            n,
        ),
        Row::new(
            SCENARIO,
            "3 coordinators' CPU during a run under Cumulus",
            m.median(&|(_, c)| c.others_cpu.coordinators_s),
            "s",
            n,
        ),
        Row::new(
            SCENARIO,
            "3 coordinators' CPU during a direct run",
            m.median(&|(d, _)| d.others_cpu.coordinators_s),
            "s",
            n,
        ),
        Row::new(
            SCENARIO,
            "bench CPU during a direct run (draining its output)",
            m.median(&|(d, _)| d.others_cpu.bench_s),
            "s",
            n,
        ),
    ]
}

/// The diagnostic rows: the quiet pair's ratio and agent CPU, the steps per run, the rank's
/// rate as the leader stamps it, and the checkpointed run's rate, checkpoint count, latest
/// committed step and mean cost per checkpoint over the direct rate.
fn diagnostic_rows(m: &Measured) -> Vec<Row> {
    let (pairs, quiet, checkpointed) = (&m.pairs, &m.quiet, &m.checkpointed);
    let n = pairs.len();
    let direct_rate = m.direct_rate();
    let leader_rate = m.median(&|(_, c)| {
        c.leader_wall
            .map_or(0.0, |w| c.steps as f64 / w.as_secs_f64())
    });
    let checkpoints = checkpointed.steps / CKPT_EVERY;
    let ckpt_cost_ms = if checkpoints > 0 {
        let at_direct_rate = checkpointed.steps as f64 / direct_rate;
        (checkpointed.elapsed.as_secs_f64() - at_direct_rate) * 1_000.0 / checkpoints as f64
    } else {
        0.0
    };
    vec![
        Row::new(
            SCENARIO,
            "cumulus/direct steps per second with --log-every 0 (one pair)",
            quiet.1.steps_per_s() / quiet.0.steps_per_s(),
            "ratio",
            1,
        ),
        Row::new(
            SCENARIO,
            "agent CPU during a Cumulus run with --log-every 0",
            quiet.1.others_cpu.agent_s,
            "s",
            1,
        ),
        Row::new(
            SCENARIO,
            "steps per run",
            pairs[0].0.steps as f64,
            "count",
            n,
        ),
        Row::new(
            SCENARIO,
            "cumulus steps/s (rank wall, leader-stamped)",
            leader_rate,
            "steps/s",
            n,
        ),
        Row::new(
            SCENARIO,
            &format!("cumulus steps/s with a checkpoint every {CKPT_EVERY} steps"),
            checkpointed.steps_per_s(),
            "steps/s",
            1,
        ),
        Row::new(
            SCENARIO,
            "checkpoints in that run (each acknowledged by the leader)",
            checkpoints as f64,
            "count",
            1,
        ),
        Row::new(
            SCENARIO,
            "latest committed step of that run",
            checkpointed.committed_step.map_or(0.0, |s| s as f64),
            "step",
            1,
        ),
        Row::new(
            SCENARIO,
            "mean cost per checkpoint over the direct rate",
            ckpt_cost_ms,
            "ms",
            usize::try_from(checkpoints).unwrap_or(usize::MAX),
        ),
    ]
}

/// The host's 1-minute load average (`/proc/loadavg`): how busy the machine was.
fn load_average() -> anyhow::Result<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").context("reading /proc/loadavg")?;
    text.split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("/proc/loadavg holds {text:?}"))
}

/// One direct and one Cumulus run of the same trainer arguments (`extra` after the common
/// ones), in the given order, each with the CPU the cluster and this process used meanwhile.
/// Fails when the two did different work (steps or record digest differ).
async fn run_pair(
    cluster: &Cluster,
    setup: &Setup,
    label: &str,
    epochs: u32,
    extra: &[String],
    direct_first: bool,
) -> anyhow::Result<(RunResult, RunResult)> {
    let mut direct = None;
    let mut cumulus = None;
    for direct_turn in [direct_first, !direct_first] {
        let name = format!("{label}-{}", if direct_turn { "direct" } else { "cumulus" });
        let before = CpuSnapshot::read(cluster)?;
        let mut result = if direct_turn {
            run_direct(setup, &name, epochs, extra).await?
        } else {
            run_cumulus(cluster, setup, &name, epochs, None, extra).await?
        };
        result.others_cpu = CpuSnapshot::read(cluster)?.since(&before);
        if direct_turn {
            direct = Some(result);
        } else {
            cumulus = Some(result);
        }
    }
    let direct = direct.expect("the loop runs the direct turn once");
    let cumulus = cumulus.expect("the loop runs the Cumulus turn once");
    anyhow::ensure!(
        direct.steps == cumulus.steps && direct.digest == cumulus.digest,
        "the runs did different work: direct {} steps digest {}, cumulus {} steps digest {}",
        direct.steps,
        direct.digest,
        cumulus.steps,
        cumulus.digest
    );
    eprintln!(
        "   {label}: direct {:.0} steps/s ({:.2} s wall, {:.2} s cpu), cumulus {:.0} steps/s ({:.2} s wall, {:.2} s cpu, agent {:.2} s cpu), {} steps",
        direct.steps_per_s(),
        direct.elapsed.as_secs_f64(),
        direct.cpu.as_secs_f64(),
        cumulus.steps_per_s(),
        cumulus.elapsed.as_secs_f64(),
        cumulus.cpu.as_secs_f64(),
        cumulus.others_cpu.agent_s,
        direct.steps
    );
    Ok((direct, cumulus))
}

/// Splits the data, writes the all-shards file and the wrapper.
fn prepare(dir: &Path) -> anyhow::Result<Setup> {
    let workload = cumulus_e2e::prepare_digits(dir, SHARDS).context("splitting the digits data")?;
    let mut shards: Vec<PathBuf> = std::fs::read_dir(&workload.shards_dir)
        .with_context(|| format!("listing {}", workload.shards_dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .with_context(|| format!("listing {}", workload.shards_dir.display()))?;
    // The shards as the coordinator lists them: not the dot-files (feature statistics).
    shards.retain(|p| {
        p.is_file()
            && p.file_name()
                .is_some_and(|n| !n.to_string_lossy().starts_with('.'))
    });
    shards.sort();
    anyhow::ensure!(
        shards.len() == SHARDS as usize,
        "expected {SHARDS} shards, found {}",
        shards.len()
    );
    let shards_file = dir.join("all.shards");
    let list: String = shards
        .iter()
        .map(|p| format!("{}\n", p.display()))
        .collect();
    std::fs::write(&shards_file, list)
        .with_context(|| format!("writing {}", shards_file.display()))?;
    let wrapper = dir.join("timed.sh");
    std::fs::write(&wrapper, WRAPPER).with_context(|| format!("writing {}", wrapper.display()))?;
    Ok(Setup {
        dir: dir.to_path_buf(),
        workload,
        shards_file,
        wrapper,
        trainer: cumulus_e2e::bin("cumulus-trainer"),
    })
}

/// Reads the wrapper's file: `<start_ns> <end_ns>` then `times` (4 durations like
/// `1m2.5s`). Returns (wall time, children's user + sys CPU time).
fn read_timing(path: &Path) -> anyhow::Result<(Duration, Duration)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let bad = || {
        anyhow::anyhow!(
            "{} holds {text:?}, not `<start_ns> <end_ns>` and the 4 durations of `times`",
            path.display()
        )
    };
    let tokens: Vec<&str> = text.split_whitespace().collect();
    let [start, end, _, _, child_user, child_sys] = tokens[..] else {
        return Err(bad());
    };
    let start: u64 = start.parse().map_err(|_| bad())?;
    let end: u64 = end.parse().map_err(|_| bad())?;
    let wall = end.checked_sub(start).ok_or_else(bad)?;
    let cpu = parse_times_duration(child_user).ok_or_else(bad)?
        + parse_times_duration(child_sys).ok_or_else(bad)?;
    Ok((Duration::from_nanos(wall), cpu))
}

/// Parses one duration of the shell's `times` output, `<minutes>m<seconds>s` (e.g.
/// `0m9.123456s`).
fn parse_times_duration(text: &str) -> Option<Duration> {
    let (minutes, seconds) = text.strip_suffix('s')?.split_once('m')?;
    let minutes: u64 = minutes.parse().ok()?;
    let seconds: f64 = seconds.parse().ok()?;
    (seconds.is_finite() && seconds >= 0.0)
        .then(|| Duration::from_secs(minutes * 60) + Duration::from_secs_f64(seconds))
}

/// Steps and digest from rank 0's `result.json` under `out`.
fn read_steps(out: &Path) -> anyhow::Result<(u64, String)> {
    let result = cumulus_e2e::read_result(out, 0)?;
    let steps = result["steps"]
        .as_u64()
        .context("result.json has no integer \"steps\"")?;
    let digest = result["digest"]
        .as_str()
        .context("result.json has no \"digest\"")?
        .to_string();
    Ok((steps, digest))
}

/// The trainer run directly (no agent), stdout/stderr to a file.
async fn run_direct(
    setup: &Setup,
    name: &str,
    epochs: u32,
    extra: &[String],
) -> anyhow::Result<RunResult> {
    let out = setup.dir.join(name);
    let timing = setup.dir.join(format!("{name}.timing"));
    let log_path = setup.dir.join(format!("{name}.log"));
    let err_path = setup.dir.join(format!("{name}.stderr.log"));
    let mut cmd = tokio::process::Command::new("/bin/sh");
    cmd.arg(&setup.wrapper)
        .arg(&timing)
        .arg(&setup.trainer)
        .args(setup.train_args(&out, epochs, extra))
        .arg("--shards-file")
        .arg(&setup.shards_file)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (key, _) in std::env::vars_os() {
        let key_text = key.to_string_lossy();
        if key_text.starts_with("CUMULUS_")
            || cumulus_api::rank_env::CONTRACT_VARS.contains(&key_text.as_ref())
        {
            cmd.env_remove(&key);
        }
    }
    let mut child = cmd.spawn().context("starting the trainer directly")?;
    let stdout = drain(child.stdout.take(), log_path.clone());
    let stderr = drain(child.stderr.take(), err_path.clone());
    let (status, stdout, stderr) = tokio::join!(child.wait(), stdout, stderr);
    let status = status.context("waiting for the direct trainer")?;
    stdout?;
    stderr?;
    anyhow::ensure!(
        status.success(),
        "direct trainer run failed ({status}); logs: {}, {}",
        log_path.display(),
        err_path.display()
    );
    let (steps, digest) = read_steps(&out)?;
    let (elapsed, cpu) = read_timing(&timing)?;
    Ok(RunResult {
        elapsed,
        cpu,
        steps,
        digest,
        leader_wall: None,
        committed_step: None,
        others_cpu: CpuSnapshot::default(),
    })
}

/// Waits until the wrapper has written `timing` (the trainer has exited), looking at the
/// file every [`FILE_POLL_MS`] and at the job only every [`JOB_POLL_EVERY`] looks: polling
/// the cluster (connections, linearizable reads) during the measured interval would load
/// the coordinators and this process in the Cumulus arm only. Fails when the job ended
/// without the file or after [`JOB_DEADLINE`].
async fn wait_timing_file(cluster: &Cluster, job_id: &str, timing: &Path) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    let mut look = 0u64;
    loop {
        look += 1;
        if timing.exists() {
            return Ok(());
        }
        anyhow::ensure!(
            start.elapsed() < JOB_DEADLINE,
            "{job_id}: no {} after {JOB_DEADLINE:?}",
            timing.display()
        );
        if look.is_multiple_of(JOB_POLL_EVERY)
            && let Some(job) = cluster.job(job_id).await
            && matches!(job.job_state(), Ok(JobState::Failed | JobState::Cancelled))
        {
            anyhow::bail!("{job_id} ended {}: {}", job.state, job.failure_cause);
        }
        tokio::time::sleep(Duration::from_millis(FILE_POLL_MS)).await;
    }
}

/// Most log lines quoted in an error.
const LOG_TAIL_LINES: usize = 30;

/// The last [`LOG_TAIL_LINES`] lines of every attempt's log of `job_id` (through
/// `cumulusctl logs`), or why they could not be read.
fn log_tail(cluster: &Cluster, job_id: &str) -> String {
    match cluster.cumulusctl(&["logs", job_id]) {
        Ok(out) => {
            let text = String::from_utf8_lossy(&out.stdout);
            let lines: Vec<&str> = text.lines().collect();
            let mut tail = lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n");
            if !out.status.success() {
                tail.push_str(&format!(
                    "\n(cumulusctl logs failed: {})",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            tail
        }
        Err(e) => format!("(cannot run cumulusctl logs: {e})"),
    }
}

/// Copies a child's output pipe into the file `path`, as a terminal or the agent's log
/// capture would drain it: the trainer writes into a pipe in both arms, never straight into
/// a file (a file write can stall on the kernel's dirty-page throttling when the disk is
/// busy, a pipe drained by another process does not).
async fn drain(
    pipe: Option<impl tokio::io::AsyncRead + Unpin>,
    path: PathBuf,
) -> anyhow::Result<()> {
    let mut pipe = pipe.context("the child's output is not piped")?;
    let mut file = tokio::fs::File::create(&path)
        .await
        .with_context(|| format!("creating {}", path.display()))?;
    tokio::io::copy(&mut pipe, &mut file)
        .await
        .with_context(|| format!("copying the trainer's output into {}", path.display()))?;
    Ok(())
}

/// The trainer as a world-size-1 job of `cluster`, optionally with a checkpoint dir, with
/// `extra` trainer arguments after the common ones.
async fn run_cumulus(
    cluster: &Cluster,
    setup: &Setup,
    name: &str,
    epochs: u32,
    ckpt_dir: Option<&Path>,
    extra: &[String],
) -> anyhow::Result<RunResult> {
    let out = setup.dir.join(name);
    let timing = setup.dir.join(format!("{name}.timing"));
    let ckpt_dir = ckpt_dir.unwrap_or(Path::new(""));
    let mut command = vec![
        "/bin/sh".to_string(),
        setup.wrapper.to_string_lossy().into_owned(),
        timing.to_string_lossy().into_owned(),
        setup.trainer.to_string_lossy().into_owned(),
    ];
    command.extend(setup.train_args(&out, epochs, extra));
    let spec = v1::JobSpec {
        name: format!("bench-training-{name}"),
        world_size: 1,
        command,
        dataset: setup.workload.shards_dir.to_string_lossy().into_owned(),
        ckpt_dir: ckpt_dir.to_string_lossy().into_owned(),
        ..Default::default()
    };
    let request_id = format!("bench-training-{name}-{}", std::process::id());
    let job_id = cluster
        .submit(&request_id, spec)
        .await
        .context("submitting the job")?
        .job_id;
    wait_timing_file(cluster, &job_id, &timing).await?;
    let job = cluster.wait_finished(&job_id, JOB_DEADLINE).await;
    if job.job_state() != Ok(JobState::Succeeded) || job.restarts_used != 0 {
        let causes: Vec<&str> = job.restarts.iter().map(|r| r.cause.as_str()).collect();
        anyhow::bail!(
            "{job_id} ended {} after {} restart(s) (causes: {causes:?}; failure: {:?}); its logs end with:\n{}",
            job.state,
            job.restarts_used,
            job.failure_cause,
            log_tail(cluster, &job_id)
        );
    }
    let rank = job
        .ranks
        .first()
        .with_context(|| format!("{job_id} has no rank"))?;
    let leader_wall = (rank.exited_at_ms >= rank.started_at_ms && rank.started_at_ms > 0)
        .then(|| Duration::from_millis(rank.exited_at_ms - rank.started_at_ms));
    let (steps, digest) = read_steps(&out)?;
    let (elapsed, cpu) = read_timing(&timing)?;
    Ok(RunResult {
        elapsed,
        cpu,
        steps,
        digest,
        leader_wall,
        committed_step: job.committed_step,
        others_cpu: CpuSnapshot::default(),
    })
}
