//! The training loop: data preparation, steps, checkpoints through the agent, resume,
//! progress reports and the final result.
//!
//! Record order: every epoch visits every record of the rank's shards once, in a
//! Fisher–Yates shuffle drawn from a splitmix64 PRNG seeded with `--seed` (see
//! [`crate::rng`]). A step is one mini-batch of `batch_size` consecutive records of that
//! order; the last batch of an epoch may be smaller; batches never span epochs. So
//! `total_steps = epochs × ceil(records / batch_size)`.
//!
//! Features: by default (`--feature-scale standardize`) every column is standardized,
//! `(x - mean) / std`, with the statistics of the whole data set, the same on every rank:
//! read from `--feature-stats FILE`, else from the `.feature-stats.json` that `cumulusctl
//! dataset split` writes beside the shards, else computed over the rank's own data (with
//! a warning: ranks may then differ). Or every raw value is multiplied by one factor: `auto` is `1 / max
//! |value|` over the rank's training data (1 when every value is 0), or a number. What
//! was used is saved in the checkpoint (a fingerprint of the statistics) and must match
//! on resume.
//!
//! Classes: `--classes`, or the largest training label + 1.
//!
//! The training loop stays in this one file: its resume is exact only if data order, RNG
//! state, checkpoint content and step counting agree, so they stay side by side.
//! One rank's run under the agent ([`run`]: progress reports, checkpoint commits, the
//! results) is in `trainer/rank.rs`.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::data::{self, DataError, Dataset, MAX_CLASSES};
use crate::digest::RecordDigest;
use crate::env::EnvError;
use crate::model::{self, ModelError, Momentum, SoftmaxModel};
use crate::rng::epoch_order;
use crate::state::{
    HexF64, HexU64, MAX_STATE_BYTES, RunSpec, STATE_FORMAT, StateError, TrainState,
};
use cumulus_api::feature_stats::{FEATURE_STATS_FILE, FeatureStats, StatsAccumulator};

/// File of the model parameters in a checkpoint and in the output dir (f64 LE,
/// `classes × (features + 1)`, row-major, bias last).
pub const WEIGHTS_FILE: &str = "weights.bin";
/// File of the momentum buffers in a checkpoint (f64 LE, same shape as the weights).
pub const OPTIMIZER_FILE: &str = "optimizer.bin";
/// File of the [`TrainState`] in a checkpoint.
pub const STATE_FILE: &str = "state.json";
/// File of the [`RankResult`] in the output dir.
pub const RESULT_FILE: &str = "result.json";
/// Retries of a failed checkpoint commit (after the first try).
pub const CKPT_MAX_RETRIES: u32 = 5;
/// Wait before the first retry of a checkpoint commit, in milliseconds; doubles each time
/// (100, 200, 400, 800, 1600: 3.1 s in all).
pub const CKPT_BACKOFF_INITIAL_MS: u64 = 100;
/// Least time between two progress reports, in milliseconds (the final one is always sent).
pub const PROGRESS_INTERVAL_MS: u64 = 200;
/// Progress failures logged in full; after that only every 100th is logged.
pub const PROGRESS_FAILURES_LOGGED: u64 = 5;

/// Exit code of a successful run.
pub const EXIT_OK: i32 = 0;
/// Exit code of a bad argument, bad input data or an I/O failure.
pub const EXIT_INPUT: i32 = 1;
/// Exit code of a resume that cannot be done (missing or invalid checkpoint).
pub const EXIT_RESUME: i32 = 2;
/// Exit code when the agent rejected this attempt as stale.
pub const EXIT_STALE: i32 = 3;
/// Exit code when a checkpoint could not be committed after every retry.
pub const EXIT_COMMIT_FAILED: i32 = 4;
/// Exit code when a checkpoint could not be committed because the agent never answered
/// (its last try failed with a transport error: refused, reset, timed out): the rank
/// contract's code, which the agent counts as its own fault when it saw its rank API
/// turn connections away (docs/scheduling.md, "Failures that are the agent's").
pub const EXIT_AGENT_UNREACHABLE: i32 = cumulus_api::rank_env::EXIT_AGENT_UNREACHABLE;

/// Why a checkpoint could not be resumed.
#[derive(Debug, Error)]
pub enum ResumeError {
    /// The resume variables are incomplete or malformed.
    #[error("{0}")]
    Env(EnvError),
    /// A checkpoint file could not be read.
    #[error("cannot read checkpoint file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// `state.json` is larger than [`MAX_STATE_BYTES`].
    #[error("checkpoint file {path} is {size_bytes} bytes, limit {limit_bytes}")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size_bytes: u64,
        /// The limit.
        limit_bytes: u64,
    },
    /// `state.json` is not a valid state.
    #[error("checkpoint file {path} is not a valid trainer state: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The state does not fit this run.
    #[error("checkpoint {dir}: {source}")]
    State {
        /// The checkpoint dir.
        dir: PathBuf,
        /// What is wrong.
        source: StateError,
    },
    /// `weights.bin` or `optimizer.bin` has the wrong size.
    #[error("checkpoint {dir}: {source}")]
    Model {
        /// The checkpoint dir.
        dir: PathBuf,
        /// What is wrong.
        source: ModelError,
    },
    /// An elastic run's checkpoint part does not fit this run ([`elastic`]).
    #[error("checkpoint {dir}: {why}")]
    Elastic {
        /// The checkpoint dir.
        dir: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The next record named by the state is not the one the record order gives.
    #[error(
        "checkpoint {dir}: state.json names the next record as {found}, but the record \
         order of epoch {epoch} gives {expected}"
    )]
    NextRecord {
        /// The checkpoint dir.
        dir: PathBuf,
        /// The epoch.
        epoch: u32,
        /// `shard #index name:line` from the order.
        expected: String,
        /// `shard #index name:line` from the state.
        found: String,
    },
}

/// Why a run failed; [`TrainError::exit_code`] gives the process exit code.
#[derive(Debug, Error)]
pub enum TrainError {
    /// A bad argument or environment.
    #[error("{0}")]
    Config(String),
    /// A bad rank environment variable.
    #[error("{0}")]
    Env(#[from] EnvError),
    /// Bad or missing input data.
    #[error("{0}")]
    Data(#[from] DataError),
    /// The checkpoint to resume from is missing or invalid.
    #[error("cannot resume: {0}")]
    Resume(#[from] ResumeError),
    /// A file could not be written or read.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The I/O error.
        source: io::Error,
    },
    /// The agent rejected this attempt as stale.
    #[error("stopping: {0}")]
    Stale(String),
    /// A checkpoint could not be committed after every retry.
    #[error("checkpoint commit failed: {0}")]
    CommitFailed(String),
    /// A checkpoint could not be committed after every retry, the last for want of any
    /// answer from the agent.
    #[error("checkpoint commit failed, the agent is unreachable: {0}")]
    AgentUnreachable(String),
}

impl TrainError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            TrainError::Config(_) | TrainError::Data(_) | TrainError::Io { .. } => EXIT_INPUT,
            TrainError::Env(e) if e.is_resume() => EXIT_RESUME,
            TrainError::Env(_) => EXIT_INPUT,
            TrainError::Resume(_) => EXIT_RESUME,
            TrainError::Stale(_) => EXIT_STALE,
            TrainError::CommitFailed(_) => EXIT_COMMIT_FAILED,
            TrainError::AgentUnreachable(_) => EXIT_AGENT_UNREACHABLE,
        }
    }
}

/// How raw feature values are scaled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FeatureScale {
    /// Per column, `(x - mean) / std` with the whole data set's statistics.
    Standardize,
    /// `1 / max |value|` over the training data (1 when all are 0).
    Auto,
    /// This factor (finite, > 0).
    Fixed(f64),
}

impl std::str::FromStr for FeatureScale {
    type Err = BadFeatureScale;

    fn from_str(s: &str) -> Result<Self, BadFeatureScale> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(FeatureScale::Auto);
        }
        if s.eq_ignore_ascii_case("standardize") {
            return Ok(FeatureScale::Standardize);
        }
        match s.parse::<f64>() {
            Ok(v) if v.is_finite() && v > 0.0 => Ok(FeatureScale::Fixed(v)),
            _ => Err(BadFeatureScale(s.to_owned())),
        }
    }
}

/// A feature scale that is neither `auto` nor a positive finite number (the text given).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("feature scale {0:?} is neither \"standardize\", \"auto\" nor a positive finite number")]
pub struct BadFeatureScale(pub String);

/// Training data ready for the model: the data set, its classes and scaled features.
#[derive(Debug, Clone)]
pub struct TrainData {
    /// The loaded records.
    pub dataset: Dataset,
    /// Classes of the model.
    pub classes: u32,
    /// The factor applied to every raw feature value (1 when standardizing).
    pub feature_scale: f64,
    /// The per-column statistics every feature is standardized with (`None`: scaled by
    /// `feature_scale`).
    pub stats: Option<FeatureStats>,
    /// Scaled features, `records × features`, row-major.
    pub x: Vec<f64>,
}

/// `values` (`n × features`, row-major) standardized by `stats` when given, else times
/// `scale`.
fn normalized(
    values: &[f64],
    features: usize,
    stats: Option<&FeatureStats>,
    scale: f64,
) -> Vec<f64> {
    match stats {
        Some(st) => values
            .iter()
            .enumerate()
            .map(|(i, v)| st.standardize(i % features.max(1), *v))
            .collect(),
        None => values.iter().map(|v| v * scale).collect(),
    }
}

/// What a checkpoint records of the normalization: `standardize:<SHA-256 of the
/// statistics' JSON>` or `scale`, so that a resume never continues with other inputs.
pub fn normalization_fingerprint(stats: Option<&FeatureStats>) -> String {
    match stats {
        Some(st) => {
            use sha2::Digest;
            let json = serde_json::to_vec(st).unwrap_or_default();
            format!("standardize:{}", hex::encode(sha2::Sha256::digest(&json)))
        }
        None => "scale".to_string(),
    }
}

/// The statistics to standardize with: `explicit` (`--feature-stats`), else
/// `.feature-stats.json` in the directory of the first shard (what `cumulusctl dataset
/// split` writes: the same on every rank), else computed over `dataset`, this rank's own
/// data (ranks of a job may then differ: the text returned says so). Returns them and
/// where they came from.
///
/// # Errors
/// A statistics file that cannot be read or does not describe `dataset`'s columns.
pub fn load_feature_stats(
    explicit: Option<&Path>,
    shard_paths: &[PathBuf],
    dataset: &Dataset,
) -> Result<(FeatureStats, String), TrainError> {
    let dir = shard_paths
        .first()
        .and_then(|p| p.parent())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let default_file = dir.join(FEATURE_STATS_FILE);
    let file = match explicit {
        Some(p) => Some(p.to_path_buf()),
        None => default_file.is_file().then_some(default_file),
    };
    if let Some(path) = file {
        let bytes = std::fs::read(&path).map_err(|source| TrainError::Io {
            what: format!("cannot read the feature statistics {}", path.display()),
            source,
        })?;
        let stats: FeatureStats = serde_json::from_slice(&bytes).map_err(|e| {
            TrainError::Config(format!(
                "{} is not a feature statistics file: {e}",
                path.display()
            ))
        })?;
        stats.validate(Some(dataset.features)).map_err(|why| {
            TrainError::Config(format!("feature statistics {}: {why}", path.display()))
        })?;
        return Ok((stats, path.display().to_string()));
    }
    let mut acc = StatsAccumulator::default();
    for row in dataset.values.chunks(dataset.features.max(1)) {
        acc.add(row);
    }
    let stats = acc
        .finish()
        .ok_or_else(|| TrainError::Config("the training data has no records".to_string()))?;
    Ok((
        stats,
        format!(
            "computed over this rank's {} records: other ranks may differ (`cumulusctl \
             dataset split` writes {FEATURE_STATS_FILE} for the whole data set)",
            dataset.len()
        ),
    ))
}

impl TrainData {
    /// Fixes classes and scale for `dataset`. Fails when `classes` is not above the
    /// largest label, or the model would be too large.
    pub fn prepare(
        dataset: Dataset,
        classes: Option<u32>,
        scale: FeatureScale,
        stats: Option<FeatureStats>,
    ) -> Result<Self, TrainError> {
        let max_label = dataset
            .max_label()
            .ok_or_else(|| TrainError::Config("the training data has no records".to_string()))?;
        let classes = match classes {
            Some(c) if c <= max_label => {
                return Err(TrainError::Config(format!(
                    "--classes {c} is too small: the training data has label {max_label}"
                )));
            }
            Some(c) if c > MAX_CLASSES => {
                return Err(TrainError::Config(format!(
                    "--classes {c} is above the limit {MAX_CLASSES}"
                )));
            }
            Some(c) => c,
            None => max_label + 1,
        };
        if classes < 2 {
            return Err(TrainError::Config(format!(
                "a classifier needs at least 2 classes; the training data has only label \
                 {max_label} (pass --classes)"
            )));
        }
        let params = (classes as usize).saturating_mul(dataset.features + 1);
        if params > data::MAX_VALUES {
            return Err(TrainError::Config(format!(
                "{classes} classes × {} features is {params} parameters, limit {}",
                dataset.features,
                data::MAX_VALUES
            )));
        }
        let (feature_scale, stats) = match scale {
            FeatureScale::Fixed(s) => (s, None),
            FeatureScale::Auto => {
                let max = dataset.max_abs_feature();
                (if max > 0.0 { 1.0 / max } else { 1.0 }, None)
            }
            FeatureScale::Standardize => {
                let stats = stats.ok_or_else(|| {
                    TrainError::Config(
                        "standardizing needs the data set's feature statistics".to_string(),
                    )
                })?;
                stats
                    .validate(Some(dataset.features))
                    .map_err(|why| TrainError::Config(format!("feature statistics: {why}")))?;
                (1.0, Some(stats))
            }
        };
        let x = normalized(
            &dataset.values,
            dataset.features,
            stats.as_ref(),
            feature_scale,
        );
        Ok(Self {
            dataset,
            classes,
            feature_scale,
            stats,
            x,
        })
    }

    /// Scales a test set like the training data. Fails when its feature count differs or
    /// a label is not below `classes`.
    pub fn scale_test(&self, test: &Dataset, path: &Path) -> Result<Vec<f64>, TrainError> {
        if test.features != self.dataset.features {
            return Err(TrainError::Config(format!(
                "test file {} has {} features, the training data {}",
                path.display(),
                test.features,
                self.dataset.features
            )));
        }
        if let Some(i) = test.labels.iter().position(|l| *l >= self.classes) {
            let (_, line) = test.record_name(i);
            return Err(TrainError::Config(format!(
                "test file {} line {}: label {} is not below the model's {} classes",
                path.display(),
                line + 1,
                test.labels[i],
                self.classes
            )));
        }
        Ok(normalized(
            &test.values,
            test.features,
            self.stats.as_ref(),
            self.feature_scale,
        ))
    }
}

/// Hyper-parameters that determine the run.
#[derive(Debug, Clone, PartialEq)]
pub struct Hyper {
    /// Epochs (≥ 1).
    pub epochs: u32,
    /// Records per mini-batch (≥ 1).
    pub batch_size: u64,
    /// Learning rate (finite, > 0).
    pub lr: f64,
    /// Momentum (in `[0, 1)`).
    pub momentum: f64,
    /// Seed of the record order.
    pub seed: u64,
}

impl Hyper {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), TrainError> {
        if self.epochs == 0 {
            return Err(TrainError::Config(
                "--epochs must be at least 1".to_string(),
            ));
        }
        if self.batch_size == 0 {
            return Err(TrainError::Config(
                "--batch-size must be at least 1".to_string(),
            ));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(TrainError::Config(format!(
                "--lr {} must be a positive finite number",
                self.lr
            )));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(TrainError::Config(format!(
                "--momentum {} must be in [0, 1)",
                self.momentum
            )));
        }
        Ok(())
    }
}

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Steps completed after this one.
    pub step: u64,
    /// Epoch the batch belonged to.
    pub epoch: u32,
    /// Mean loss of the batch.
    pub batch_loss: f64,
}

/// The training state machine of one rank: model, optimizer and data position.
#[derive(Debug, Clone)]
pub struct Trainer<'a> {
    data: &'a TrainData,
    hyper: Hyper,
    spec: RunSpec,
    model: SoftmaxModel,
    opt: Momentum,
    grad: Vec<f64>,
    step: u64,
    epoch: u32,
    position: usize,
    epoch_rng_state: u64,
    next_rng_state: u64,
    order: Vec<usize>,
    digest: RecordDigest,
    epoch_loss_sum: f64,
    last_epoch_loss: Option<f64>,
}

impl<'a> Trainer<'a> {
    /// The run's identity for checkpoint validation.
    pub fn run_spec(data: &TrainData, hyper: &Hyper) -> RunSpec {
        RunSpec {
            epochs: hyper.epochs,
            batch_size: hyper.batch_size,
            seed: hyper.seed,
            lr: hyper.lr,
            momentum: hyper.momentum,
            classes: data.classes,
            features: data.dataset.features as u64,
            feature_scale: data.feature_scale,
            normalization: normalization_fingerprint(data.stats.as_ref()),
            records_per_epoch: data.dataset.len() as u64,
            shard_count: data.dataset.shards.len() as u64,
            data_fingerprint: data.dataset.fingerprint_hex(),
        }
    }

    /// A fresh run: zero weights and velocity, epoch 0, position 0.
    pub fn new(data: &'a TrainData, hyper: Hyper) -> Result<Self, TrainError> {
        hyper.validate()?;
        let model = SoftmaxModel::zeros(data.classes as usize, data.dataset.features)
            .map_err(|e| TrainError::Config(e.to_string()))?;
        let params = model.param_count();
        let (order, next_rng_state) = epoch_order(hyper.seed, data.dataset.len());
        Ok(Self {
            data,
            spec: Self::run_spec(data, &hyper),
            opt: Momentum::new(hyper.lr, hyper.momentum, params),
            grad: vec![0.0; params],
            model,
            step: 0,
            epoch: 0,
            position: 0,
            epoch_rng_state: hyper.seed,
            next_rng_state,
            order,
            digest: RecordDigest::zero(),
            epoch_loss_sum: 0.0,
            last_epoch_loss: None,
            hyper,
        })
    }

    /// Resumes from a checkpoint dir written by [`Trainer::write_checkpoint`], after
    /// validating every file against this run and `resume_step`.
    pub fn resume(
        data: &'a TrainData,
        hyper: Hyper,
        dir: &Path,
        resume_step: u64,
    ) -> Result<Self, TrainError> {
        let mut t = Self::new(data, hyper)?;
        let state = read_state(dir)?;
        let digest = state
            .check(&t.spec, resume_step)
            .map_err(|source| ResumeError::State {
                dir: dir.to_path_buf(),
                source,
            })?;
        let params = t.model.param_count();
        let weights = read_f64_file(dir, WEIGHTS_FILE, params)?;
        let velocity = read_f64_file(dir, OPTIMIZER_FILE, params)?;
        t.model = SoftmaxModel::from_weights(data.classes as usize, data.dataset.features, weights)
            .map_err(|source| ResumeError::Model {
                dir: dir.to_path_buf(),
                source,
            })?;
        t.opt = Momentum::with_velocity(t.hyper.lr, t.hyper.momentum, velocity);
        t.step = state.step;
        t.epoch = state.epoch;
        t.position = state.position as usize;
        t.epoch_rng_state = state.rng_state.0;
        let (order, next) = epoch_order(t.epoch_rng_state, data.dataset.len());
        t.order = order;
        t.next_rng_state = next;
        t.digest = digest;
        t.epoch_loss_sum = state.epoch_loss_sum.0;
        t.last_epoch_loss = state.last_epoch_loss.map(|l| l.0);
        let (expected_index, expected_name, expected_line) = t.next_record_fields();
        if (expected_index, &expected_name, expected_line)
            != (
                state.next_shard_index,
                &state.next_shard,
                state.next_record_index,
            )
        {
            let show = |i: Option<u64>, n: &Option<String>, l: Option<u64>| match (i, n, l) {
                (Some(i), Some(n), Some(l)) => format!("shard #{i} {n}:{l}"),
                _ => "none".to_string(),
            };
            return Err(ResumeError::NextRecord {
                dir: dir.to_path_buf(),
                epoch: t.epoch,
                expected: show(expected_index, &expected_name, expected_line),
                found: show(
                    state.next_shard_index,
                    &state.next_shard,
                    state.next_record_index,
                ),
            }
            .into());
        }
        Ok(t)
    }

    fn next_record_fields(&self) -> (Option<u64>, Option<String>, Option<u64>) {
        if self.is_done() {
            return (None, None, None);
        }
        let i = self.order[self.position];
        let id = self.data.dataset.ids[i];
        (
            Some(u64::from(id.shard)),
            Some(self.data.dataset.shards[id.shard as usize].name.clone()),
            Some(id.line),
        )
    }

    /// Whether every epoch is done.
    pub fn is_done(&self) -> bool {
        self.epoch >= self.hyper.epochs
    }

    /// Steps completed.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Steps of the whole run.
    pub fn total_steps(&self) -> u64 {
        self.spec.total_steps()
    }

    /// The current epoch (0-based; `epochs` when done).
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// Records of the current epoch consumed.
    pub fn position(&self) -> u64 {
        self.position as u64
    }

    /// Records consumed over the whole run.
    pub fn records_consumed(&self) -> u64 {
        u64::from(self.epoch) * self.data.dataset.len() as u64 + self.position as u64
    }

    /// The running record digest.
    pub fn digest(&self) -> RecordDigest {
        self.digest
    }

    /// The model.
    pub fn model(&self) -> &SoftmaxModel {
        &self.model
    }

    /// The mean training loss of the current epoch so far, or of the previous epoch at
    /// the start of an epoch; `None` before the first step.
    pub fn current_loss(&self) -> Option<f64> {
        if self.position > 0 {
            Some(self.epoch_loss_sum / self.position as f64)
        } else {
            self.last_epoch_loss
        }
    }

    /// The mean training loss of the last completed epoch.
    pub fn last_epoch_loss(&self) -> Option<f64> {
        self.last_epoch_loss
    }

    /// Runs one mini-batch; `None` when training is already complete.
    pub fn train_step(&mut self) -> Option<StepReport> {
        if self.is_done() {
            return None;
        }
        let n = self.order.len();
        let end = (self.position + self.hyper.batch_size as usize).min(n);
        let batch = &self.order[self.position..end];
        let loss_sum = self.model.batch_gradient(
            &self.data.x,
            &self.data.dataset.labels,
            batch,
            &mut self.grad,
        );
        self.opt.apply(self.model.weights_mut(), &self.grad);
        for &i in batch {
            let (name, line) = self.data.dataset.record_name(i);
            self.digest.update(self.epoch, name, line);
        }
        let report = StepReport {
            step: self.step + 1,
            epoch: self.epoch,
            batch_loss: loss_sum / batch.len() as f64,
        };
        self.epoch_loss_sum += loss_sum;
        self.position = end;
        self.step += 1;
        if self.position == n {
            self.last_epoch_loss = Some(self.epoch_loss_sum / n as f64);
            self.epoch_loss_sum = 0.0;
            self.position = 0;
            self.epoch += 1;
            self.epoch_rng_state = self.next_rng_state;
            if self.is_done() {
                self.order.clear();
            } else {
                let (order, next) = epoch_order(self.epoch_rng_state, n);
                self.order = order;
                self.next_rng_state = next;
            }
        }
        Some(report)
    }

    /// The checkpoint state of the current position.
    pub fn state(&self) -> TrainState {
        let (next_shard_index, next_shard, next_record_index) = self.next_record_fields();
        TrainState {
            format: STATE_FORMAT.to_string(),
            step: self.step,
            total_steps: self.total_steps(),
            epoch: self.epoch,
            epochs: self.hyper.epochs,
            position: self.position as u64,
            records_per_epoch: self.spec.records_per_epoch,
            records_consumed: self.records_consumed(),
            next_shard_index,
            next_shard,
            next_record_index,
            rng_state: HexU64(self.epoch_rng_state),
            digest: self.digest.to_hex(),
            batch_size: self.hyper.batch_size,
            seed: HexU64(self.hyper.seed),
            lr: HexF64(self.hyper.lr),
            momentum: HexF64(self.hyper.momentum),
            classes: self.data.classes,
            features: self.spec.features,
            feature_scale: HexF64(self.data.feature_scale),
            normalization: self.spec.normalization.clone(),
            epoch_loss_sum: HexF64(self.epoch_loss_sum),
            last_epoch_loss: self.last_epoch_loss.map(HexF64),
            shard_count: self.spec.shard_count,
            data_fingerprint: self.spec.data_fingerprint.clone(),
        }
    }

    /// Writes `weights.bin`, `optimizer.bin` and `state.json` into `dir` (which must
    /// exist); returns the state written.
    pub fn write_checkpoint(&self, dir: &Path) -> io::Result<TrainState> {
        let state = self.state();
        write_part_files(dir, &self.model, &self.opt, &state)?;
        Ok(state)
    }
}

/// Writes a checkpoint part's three files into `dir` (which must exist): `weights.bin`
/// and `optimizer.bin` (little-endian f64s) and `state` as pretty JSON in `state.json`.
fn write_part_files(
    dir: &Path,
    model: &SoftmaxModel,
    opt: &Momentum,
    state: &impl Serialize,
) -> io::Result<()> {
    std::fs::write(
        dir.join(WEIGHTS_FILE),
        model::f64s_to_le_bytes(model.weights()),
    )?;
    std::fs::write(
        dir.join(OPTIMIZER_FILE),
        model::f64s_to_le_bytes(opt.velocity()),
    )?;
    let text = serde_json::to_vec_pretty(state).expect("a trainer state always serializes");
    std::fs::write(dir.join(STATE_FILE), text)
}

fn read_state(dir: &Path) -> Result<TrainState, ResumeError> {
    let (path, bytes) = read_state_bytes(dir)?;
    serde_json::from_slice(&bytes).map_err(|source| ResumeError::Json { path, source })
}

/// The bytes of `state.json` in the checkpoint part `dir` and its path; a file over
/// [`MAX_STATE_BYTES`] is refused before it is read.
fn read_state_bytes(dir: &Path) -> Result<(PathBuf, Vec<u8>), ResumeError> {
    let path = dir.join(STATE_FILE);
    let io_err = |source| ResumeError::Io {
        path: path.clone(),
        source,
    };
    let size_bytes = std::fs::metadata(&path).map_err(io_err)?.len();
    if size_bytes > MAX_STATE_BYTES {
        return Err(ResumeError::TooLarge {
            path,
            size_bytes,
            limit_bytes: MAX_STATE_BYTES,
        });
    }
    let bytes = std::fs::read(&path).map_err(io_err)?;
    Ok((path, bytes))
}

fn read_f64_file(dir: &Path, name: &str, values: usize) -> Result<Vec<f64>, ResumeError> {
    let path = dir.join(name);
    let io_err = |source| ResumeError::Io {
        path: path.clone(),
        source,
    };
    let size_bytes = std::fs::metadata(&path).map_err(io_err)?.len();
    if size_bytes != values as u64 * 8 {
        return Err(ResumeError::Model {
            dir: dir.to_path_buf(),
            source: ModelError::Size {
                what: name.to_string(),
                found_bytes: size_bytes as usize,
                expected_bytes: values * 8,
                expected_values: values,
            },
        });
    }
    let bytes = std::fs::read(&path).map_err(io_err)?;
    model::f64s_from_le_bytes(&bytes, values, name).map_err(|source| ResumeError::Model {
        dir: dir.to_path_buf(),
        source,
    })
}

/// Everything `cumulus-trainer train` needs besides the environment.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    /// The shards file (from `--shards-file` or `CUMULUS_SHARDS_FILE`).
    pub shards_file: PathBuf,
    /// Holdout CSV to measure accuracy on at the end.
    pub test_file: Option<PathBuf>,
    /// Output dir; results go to `<out>/rank-<RANK>/`.
    pub out_dir: PathBuf,
    /// Hyper-parameters.
    pub hyper: Hyper,
    /// Classes (default: largest training label + 1).
    pub classes: Option<u32>,
    /// Feature scaling.
    pub feature_scale: FeatureScale,
    /// The feature statistics to standardize with (default: beside the shards, else
    /// computed over their directory).
    pub feature_stats: Option<PathBuf>,
    /// Checkpoint every this many steps (0: never).
    pub ckpt_every: u64,
    /// Sleep after every step, in milliseconds (simulates a heavier model).
    pub step_sleep_ms: u64,
    /// Sleep `step_sleep_ms` only while this file exists (tests slow a run down for as
    /// long as they need it running, then let it finish).
    pub slow_file: Option<PathBuf>,
    /// Print a progress line every this many steps (0: only the last step).
    pub log_every: u64,
    /// Steps of an elastic job's run, the same on every rank at any world size
    /// (required there; refused for a fixed-size run, whose steps follow from its data).
    pub total_steps: Option<u64>,
}

/// `result.json`, written to `<out>/rank-<RANK>/` at the end of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankResult {
    /// `RANK`.
    pub rank: u32,
    /// `CUMULUS_ATTEMPT` (0 standalone).
    pub attempt: u64,
    /// Fraction of the test file predicted right; `None` without a test file.
    pub accuracy: Option<f64>,
    /// Records consumed over the whole run, across restarts.
    pub records_consumed: u64,
    /// Final record digest, 64 hex characters ("" for an elastic run: see
    /// `record_sum`).
    pub digest: String,
    /// Steps of the whole run.
    pub steps: u64,
    /// Epochs of the whole run.
    pub epochs: u32,
    /// Mean training loss of the last epoch; `None` when not finite.
    pub final_loss: Option<f64>,
    /// Classes of the model.
    pub classes: u32,
    /// Features of the model.
    pub features: u64,
    /// Factor applied to every raw feature value (needed to use `weights.bin`; 1 when
    /// standardizing).
    pub feature_scale: f64,
    /// Per-column mean and standard deviation every feature was standardized with
    /// (needed to use `weights.bin`); absent when scaled by `feature_scale`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feature_stats: Option<FeatureStats>,
    /// Records of the test file; `None` without one.
    pub test_records: Option<u64>,
    /// An elastic run's order-free record sum over the whole run, 16 hex digits
    /// ([`elastic::RecordSum`]: across resizes, the sums of the last ranks add up to the
    /// data set's); absent for a fixed-size run, whose `digest` is the chained one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record_sum: Option<String>,
    /// The world size of an elastic run's last ranks; absent for a fixed-size run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u32>,
}

/// What a completed run produced.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainOutcome {
    /// The result written to `result.json`.
    pub result: RankResult,
    /// Path of the final `weights.bin`.
    pub weights_path: PathBuf,
    /// Path of `result.json`.
    pub result_path: PathBuf,
}

/// Writes `bytes` to `path` through a temp file in the same dir, fsync and rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("output");
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

/// Result of `cumulus-trainer eval`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalResult {
    /// Fraction of records predicted right.
    pub accuracy: f64,
    /// Records evaluated.
    pub records: u64,
    /// Classes of the model (from the weights size).
    pub classes: u32,
}

/// Evaluates `weights.bin` on a test CSV whose raw features are standardized by `stats`
/// when given, else multiplied by `feature_scale`; the classes follow from the file size
/// and the test file's features.
pub fn evaluate(
    weights_path: &Path,
    test_path: &Path,
    stats: Option<&FeatureStats>,
    feature_scale: f64,
) -> Result<EvalResult, TrainError> {
    let test = data::load_csv(test_path)?;
    let bytes = std::fs::read(weights_path).map_err(|source| TrainError::Io {
        what: format!("cannot read {}", weights_path.display()),
        source,
    })?;
    let row_bytes = (test.features + 1) * 8;
    if bytes.is_empty() || bytes.len() % row_bytes != 0 {
        return Err(TrainError::Config(format!(
            "{} is {} bytes, not a whole number of rows of {} f64 values ({} features + bias) \
             for the {} features of {}",
            weights_path.display(),
            bytes.len(),
            test.features + 1,
            test.features,
            test.features,
            test_path.display()
        )));
    }
    let classes = bytes.len() / row_bytes;
    let weights = model::f64s_from_le_bytes(&bytes, classes * (test.features + 1), "weights")
        .map_err(|e| TrainError::Config(e.to_string()))?;
    let m = SoftmaxModel::from_weights(classes, test.features, weights)
        .map_err(|e| TrainError::Config(e.to_string()))?;
    if let Some(i) = test.labels.iter().position(|l| *l as usize >= classes) {
        let (_, line) = test.record_name(i);
        return Err(TrainError::Config(format!(
            "{} line {}: label {} is not below the model's {classes} classes",
            test_path.display(),
            line + 1,
            test.labels[i]
        )));
    }
    if let Some(st) = stats {
        st.validate(Some(test.features)).map_err(|why| {
            TrainError::Config(format!(
                "feature statistics for {}: {why}",
                test_path.display()
            ))
        })?;
    }
    let x = normalized(&test.values, test.features, stats, feature_scale);
    Ok(EvalResult {
        accuracy: m.accuracy(&x, &test.labels),
        records: test.len() as u64,
        classes: classes as u32,
    })
}

pub mod elastic;
mod rank;
#[cfg(test)]
mod tests;

pub use rank::run;
