//! One rank's run under the agent ([`run`]): the data loaded, the trainer started or
//! resumed, the steps with progress reports (at most one per [`PROGRESS_INTERVAL_MS`])
//! and checkpoints committed through the agent, then the results written.

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cumulus_api::StopAction;

use super::{
    CKPT_BACKOFF_INITIAL_MS, CKPT_MAX_RETRIES, FeatureScale, OPTIMIZER_FILE,
    PROGRESS_FAILURES_LOGGED, PROGRESS_INTERVAL_MS, RESULT_FILE, RankResult, STATE_FILE,
    StepReport, TrainConfig, TrainData, TrainError, TrainOutcome, Trainer, WEIGHTS_FILE,
    load_feature_stats, write_atomic,
};
use crate::agent::{AgentClient, AgentError, ProgressReport};
use crate::data::{self, Dataset};
use crate::env::RankEnv;
use crate::model::{self, SoftmaxModel};

/// What the loop of a rank needs of a trainer: the fixed-size one ([`Trainer`]) and the
/// elastic one ([`super::elastic::ElasticTrainer`]).
pub(super) trait RankTrainer {
    /// Steps completed.
    fn steps_done(&self) -> u64;
    /// Steps of the whole run.
    fn steps_total(&self) -> u64;
    /// Runs one step; `None` when training is already complete.
    fn next_step(&mut self) -> Option<StepReport>;
    /// The loss to report now.
    fn loss_now(&self) -> Option<f64>;
    /// Writes the checkpoint files into `dir` (which exists); returns the resume state
    /// sent with the commit.
    fn write_checkpoint_files(&self, dir: &Path) -> io::Result<serde_json::Value>;
}

impl RankTrainer for Trainer<'_> {
    fn steps_done(&self) -> u64 {
        self.step()
    }

    fn steps_total(&self) -> u64 {
        self.total_steps()
    }

    fn next_step(&mut self) -> Option<StepReport> {
        self.train_step()
    }

    fn loss_now(&self) -> Option<f64> {
        self.current_loss()
    }

    fn write_checkpoint_files(&self, dir: &Path) -> io::Result<serde_json::Value> {
        let state = self.write_checkpoint(dir)?;
        Ok(serde_json::to_value(&state).expect("a TrainState always serializes"))
    }
}

/// Sends progress reports, at most one per [`PROGRESS_INTERVAL_MS`], logging failures
/// (bounded) and otherwise ignoring them.
pub(super) struct ProgressSender<'c> {
    client: Option<&'c AgentClient>,
    last_sent: Option<Instant>,
    failures: u64,
    /// The first stop request a reply carried.
    asked: Option<StopAction>,
    /// When this attempt's first report was sent, and its step: the trainer's own rate
    /// (the `steps_per_s` metric, its mean since then) is measured from there.
    first: Option<(Instant, u64)>,
}

impl<'c> ProgressSender<'c> {
    /// A sender to `client` (none: reports go nowhere).
    pub(super) fn new(client: Option<&'c AgentClient>) -> Self {
        Self {
            client,
            last_sent: None,
            failures: 0,
            asked: None,
            first: None,
        }
    }

    pub(super) fn send(&mut self, step: u64, total_steps: u64, loss: Option<f64>, force: bool) {
        let Some(client) = self.client else { return };
        if !force
            && self
                .last_sent
                .is_some_and(|t| t.elapsed() < Duration::from_millis(PROGRESS_INTERVAL_MS))
        {
            return;
        }
        let now = Instant::now();
        self.last_sent = Some(now);
        let mut metrics = std::collections::BTreeMap::new();
        if let Some(l) = loss.filter(|l| l.is_finite()) {
            metrics.insert("loss".to_string(), l);
        }
        let (t0, step0) = *self.first.get_or_insert((now, step));
        let secs = now.duration_since(t0).as_secs_f64();
        if secs > 0.0 && step > step0 {
            metrics.insert("steps_per_s".to_string(), (step - step0) as f64 / secs);
        }
        let report = ProgressReport {
            step,
            total_steps,
            metrics,
        };
        match client.progress(&report) {
            Ok(action) => {
                if self.asked.is_none() {
                    self.asked = action;
                }
            }
            Err(e) => {
                self.failures += 1;
                if self.failures <= PROGRESS_FAILURES_LOGGED || self.failures.is_multiple_of(100) {
                    eprintln!(
                        "warning: progress report failed ({} so far, ignored): {e}",
                        self.failures
                    );
                }
            }
        }
    }
}

fn fmt_loss(loss: Option<f64>) -> String {
    loss.map_or_else(|| "none".to_string(), |l| format!("{l:.4}"))
}

/// Most foreign staging entries named in one warning.
const FOREIGN_ENTRIES_NAMED: usize = 5;

/// Warns (on stderr) when the staging dir holds entries that are not the trainer's: the
/// agent would commit them with the checkpoint. They are left alone.
fn warn_foreign_entries(staging: &Path, step: u64) {
    let Ok(entries) = std::fs::read_dir(staging) else {
        return;
    };
    let foreign: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| ![WEIGHTS_FILE, OPTIMIZER_FILE, STATE_FILE].contains(&n.as_str()))
        .collect();
    if !foreign.is_empty() {
        eprintln!(
            "warning: checkpoint step {step}: staging dir {} already holds {} foreign \
             entries (e.g. {:?}); they will be committed with the checkpoint",
            staging.display(),
            foreign.len(),
            &foreign[..foreign.len().min(FOREIGN_ENTRIES_NAMED)]
        );
    }
}

/// Writes the checkpoint into `staging` and has the agent commit it, retrying failures
/// [`CKPT_MAX_RETRIES`] times with doubling backoff. A stale verdict stops at once. When
/// the last try got no answer from the agent at all, the error is
/// [`TrainError::AgentUnreachable`].
pub(super) fn commit_checkpoint(
    trainer: &impl RankTrainer,
    staging: &Path,
    agent: &AgentClient,
    log: &mut dyn Write,
) -> Result<(), TrainError> {
    let step = trainer.steps_done();
    let mut backoff_ms = CKPT_BACKOFF_INITIAL_MS;
    let mut last_error = String::new();
    let mut unreachable = false;
    for attempt in 0..=CKPT_MAX_RETRIES {
        unreachable = false;
        if attempt > 0 {
            std::thread::sleep(Duration::from_millis(backoff_ms));
            backoff_ms *= 2;
        }
        // The staging dir is written again on every try: a failed commit may have taken
        // the files away (or left them), and the content is the same each time.
        // The agent empties (or recreates) the staging dir after a commit; only the dir
        // itself is created here, never its parents.
        if !staging.is_dir()
            && let Err(e) = std::fs::create_dir(staging)
        {
            last_error = format!("cannot create staging dir {}: {e}", staging.display());
            eprintln!("checkpoint step {step}: try {}: {last_error}", attempt + 1);
            continue;
        }
        warn_foreign_entries(staging, step);
        let state_json = match trainer.write_checkpoint_files(staging) {
            Ok(s) => s,
            Err(e) => {
                last_error = format!("cannot write into staging dir {}: {e}", staging.display());
                eprintln!("checkpoint step {step}: try {}: {last_error}", attempt + 1);
                continue;
            }
        };
        match agent.commit_checkpoint(step, &state_json) {
            Ok(reply) => {
                // A failed log write cannot be reported anywhere better; training goes on.
                let _ = writeln!(log, "checkpoint step {step} committed: {}", reply.dir);
                return Ok(());
            }
            Err(AgentError::Stale { status, message }) => {
                return Err(TrainError::Stale(format!(
                    "the agent rejected the checkpoint of step {step} with HTTP {status} \
                     ({message}): this attempt is stale and must not continue"
                )));
            }
            Err(e) => {
                unreachable = matches!(e, AgentError::Transport(_));
                last_error = e.to_string();
                eprintln!("checkpoint step {step}: try {} failed: {e}", attempt + 1);
            }
        }
    }
    let why = format!(
        "step {step}: {} tries failed; last error: {last_error}",
        CKPT_MAX_RETRIES + 1
    );
    Err(if unreachable {
        TrainError::AgentUnreachable(why)
    } else {
        TrainError::CommitFailed(why)
    })
}

/// Runs `cumulus-trainer train`: loads and validates the data (and the test file),
/// resumes when the environment says so, trains with progress reports and checkpoints,
/// and writes `weights.bin` and `result.json` into `<out>/rank-<RANK>/`. Human-readable
/// lines go to `log`.
///
/// Returns `None` when the agent asked the rank to pause, give way or stop for a time
/// limit (a progress reply's action): it then trains on to the next checkpoint step,
/// commits it and stops there without writing results (the job resumes from that step).
/// A plain stop request is left to the agent's SIGTERM.
pub fn run(
    config: &TrainConfig,
    env: &RankEnv,
    log: &mut dyn Write,
) -> Result<Option<TrainOutcome>, TrainError> {
    config.hyper.validate()?;
    if let Some(plan) = &env.data_plan {
        return super::elastic::run(config, env, plan, log);
    }
    if config.total_steps.is_some() {
        return Err(TrainError::Config(
            "--total-steps is for the ranks of an elastic job (CUMULUS_DATA_PLAN set); a \
             fixed-size run has epochs × ceil(records / batch size) steps"
                .to_string(),
        ));
    }
    let (agent, staging) = agent_and_staging(config, env)?;
    let shard_paths = data::read_shards_file(&config.shards_file)?;
    let (data, test) = load_data(config, &shard_paths, log)?;
    let mut trainer = start_trainer(&data, config, env, log)?;
    let mut progress = ProgressSender::new(agent.as_ref());
    let checkpoints = staging.as_deref().zip(agent.as_ref());
    if !train(&mut trainer, config, env, checkpoints, &mut progress, log)? {
        return Ok(None);
    }
    progress.send(
        trainer.step(),
        trainer.total_steps(),
        trainer.current_loss(),
        true,
    );
    write_results(&trainer, &data, test.as_ref(), config, env, log).map(Some)
}

/// The agent's client (when the environment names the agent) and the staging dir (when
/// the run checkpoints); a staging dir nobody could commit is a configuration error.
pub(super) fn agent_and_staging(
    config: &TrainConfig,
    env: &RankEnv,
) -> Result<(Option<AgentClient>, Option<PathBuf>), TrainError> {
    let agent = match (&env.agent_url, &env.agent_token) {
        (Some(url), Some(token)) => Some(
            AgentClient::new(url, token, env.agent_socket.as_deref())
                .map_err(|e| TrainError::Config(e.to_string()))?,
        ),
        _ => None,
    };
    let staging = if config.ckpt_every > 0 {
        env.ckpt_staging.clone()
    } else {
        None
    };
    if staging.is_some() && agent.is_none() {
        return Err(TrainError::Config(
            "CUMULUS_CKPT_STAGING is set but CUMULUS_AGENT_URL is not: nobody could commit \
             the checkpoints"
                .to_string(),
        ));
    }
    Ok((agent, staging))
}

/// The test file and its features scaled as the training data's.
pub(super) type TestSet = (Dataset, Vec<f64>);

/// The shards `shard_paths`, prepared for training (standardized with the feature
/// statistics or scaled), and the test file with its scaled features when one is given.
pub(super) fn load_data(
    config: &TrainConfig,
    shard_paths: &[PathBuf],
    log: &mut dyn Write,
) -> Result<(TrainData, Option<TestSet>), TrainError> {
    let dataset = data::load_shards(shard_paths)?;
    let stats = match config.feature_scale {
        FeatureScale::Standardize => {
            let (stats, from) =
                load_feature_stats(config.feature_stats.as_deref(), shard_paths, &dataset)?;
            let _ = writeln!(log, "feature statistics: {from}");
            Some(stats)
        }
        _ => None,
    };
    let data = TrainData::prepare(dataset, config.classes, config.feature_scale, stats)?;
    let test = match &config.test_file {
        Some(path) => {
            let t = data::load_csv(path)?;
            let x = data.scale_test(&t, path)?;
            Some((t, x))
        }
        None => None,
    };
    Ok((data, test))
}

/// A trainer resumed from the step the environment names, or a new one; logs what it
/// trains on.
fn start_trainer<'a>(
    data: &'a TrainData,
    config: &TrainConfig,
    env: &RankEnv,
    log: &mut dyn Write,
) -> Result<Trainer<'a>, TrainError> {
    let trainer = match &env.resume {
        Some(r) => {
            let t = Trainer::resume(data, config.hyper.clone(), &r.dir, r.step)?;
            let _ = writeln!(
                log,
                "resumed from step {} (epoch {}, record {})",
                t.step(),
                t.epoch(),
                t.position()
            );
            t
        }
        None => Trainer::new(data, config.hyper.clone())?,
    };
    let _ = writeln!(
        log,
        "rank={} attempt={} training on {} records from {} shard(s): {} features, {} classes, \
         features {}, {} epochs of {} steps",
        env.rank,
        env.attempt,
        data.dataset.len(),
        data.dataset.shards.len(),
        data.dataset.features,
        data.classes,
        if data.stats.is_some() {
            "standardized per column".to_string()
        } else {
            format!("scaled by {}", data.feature_scale)
        },
        config.hyper.epochs,
        trainer.spec.steps_per_epoch()
    );
    Ok(trainer)
}

/// Trains to the end, reporting progress and committing a checkpoint every
/// `ckpt_every` steps through `checkpoints` (staging dir, agent). `false` when the rank
/// was asked to pause, give way or stop for a time limit and stopped at a checkpoint.
pub(super) fn train(
    trainer: &mut impl RankTrainer,
    config: &TrainConfig,
    env: &RankEnv,
    checkpoints: Option<(&Path, &AgentClient)>,
    progress: &mut ProgressSender<'_>,
    log: &mut dyn Write,
) -> Result<bool, TrainError> {
    let total = trainer.steps_total();
    while let Some(report) = trainer.next_step() {
        let step = report.step;
        if (config.log_every > 0 && step.is_multiple_of(config.log_every)) || step == total {
            let _ = writeln!(
                log,
                "rank={} attempt={} epoch={} step={step}/{total} loss={}",
                env.rank,
                env.attempt,
                report.epoch,
                fmt_loss(trainer.loss_now())
            );
        }
        progress.send(step, total, trainer.loss_now(), false);
        if let Some((staging, agent)) = checkpoints
            && step.is_multiple_of(config.ckpt_every)
        {
            commit_checkpoint(trainer, staging, agent, log)?;
            // Asked to pause, give way or stop for a time limit: stop at this
            // checkpoint. Every rank stops at the same step (the next multiple of
            // `ckpt_every`), so the step is complete and the job resumes from it.
            if let Some(action) = progress.asked.filter(|a| *a != StopAction::Stop) {
                let _ = writeln!(
                    log,
                    "rank={} asked to {action}: stopped at checkpoint step {step}",
                    env.rank
                );
                let _ = log.flush();
                return Ok(false);
            }
        }
        if config.step_sleep_ms > 0 && config.slow_file.as_ref().is_none_or(|f| f.exists()) {
            std::thread::sleep(Duration::from_millis(config.step_sleep_ms));
        }
    }
    Ok(true)
}

/// Writes `weights.bin` and `result.json` into `<out>/rank-<RANK>/` and logs the
/// `RESULT` line.
fn write_results(
    trainer: &Trainer<'_>,
    data: &TrainData,
    test: Option<&TestSet>,
    config: &TrainConfig,
    env: &RankEnv,
    log: &mut dyn Write,
) -> Result<TrainOutcome, TrainError> {
    let accuracy = test.map(|(t, x)| trainer.model().accuracy(x, &t.labels));
    let result = RankResult {
        rank: env.rank,
        attempt: env.attempt,
        accuracy,
        records_consumed: trainer.records_consumed(),
        digest: trainer.digest().to_hex(),
        steps: trainer.step(),
        epochs: config.hyper.epochs,
        final_loss: trainer.last_epoch_loss().filter(|l| l.is_finite()),
        classes: data.classes,
        features: data.dataset.features as u64,
        feature_scale: data.feature_scale,
        feature_stats: data.stats.clone(),
        test_records: test.map(|(t, _)| t.len() as u64),
        record_sum: None,
        world_size: None,
    };
    let outcome = write_outputs(trainer.model(), result, config, env)?;
    let _ = writeln!(
        log,
        "RESULT rank={} accuracy={} records={} digest={}",
        env.rank,
        accuracy.map_or_else(|| "none".to_string(), |a| format!("{a:.4}")),
        outcome.result.records_consumed,
        outcome.result.digest
    );
    let _ = log.flush();
    Ok(outcome)
}

/// Writes `model`'s `weights.bin` and `result` as `result.json` into
/// `<out>/rank-<RANK>/`.
pub(super) fn write_outputs(
    model: &SoftmaxModel,
    result: RankResult,
    config: &TrainConfig,
    env: &RankEnv,
) -> Result<TrainOutcome, TrainError> {
    let rank_dir = config.out_dir.join(format!("rank-{}", env.rank));
    std::fs::create_dir_all(&rank_dir).map_err(|source| TrainError::Io {
        what: format!("cannot create output dir {}", rank_dir.display()),
        source,
    })?;
    let weights_path = rank_dir.join(WEIGHTS_FILE);
    write_atomic(&weights_path, &model::f64s_to_le_bytes(model.weights())).map_err(|source| {
        TrainError::Io {
            what: format!("cannot write {}", weights_path.display()),
            source,
        }
    })?;
    let result_path = rank_dir.join(RESULT_FILE);
    let text = serde_json::to_vec_pretty(&result).expect("a RankResult always serializes");
    write_atomic(&result_path, &text).map_err(|source| TrainError::Io {
        what: format!("cannot write {}", result_path.display()),
        source,
    })?;
    Ok(TrainOutcome {
        result,
        weights_path,
        result_path,
    })
}
