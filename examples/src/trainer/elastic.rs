//! The trainer of an elastic job's rank (`--world-size MIN:MAX`; the agent sets
//! `CUMULUS_DATA_PLAN`): it reads its records as the job's data plan deals them and saves
//! its data position in every checkpoint, so that every record is consumed exactly once
//! per epoch however often the job is resized (docs/scheduling.md, "Elastic world size").
//!
//! Records: epoch `e`'s records are the plan's segments of `e` when the plan lists it
//! (each a shard from a record on), else the rank's shards file, each shard whole; they
//! are read in that order (no shuffle: the data position is an offset into that order).
//! A step takes up to `batch_size` records of the current epoch (a batch never spans
//! epochs); once every epoch is done, the steps are empty. Every rank runs
//! `--total-steps` steps, the same at any world size, so each checkpoint step has a part
//! of every rank.
//!
//! State: `state.json` is an [`ElasticState`]: the run's identity, and under
//! `"cumulus_data"` the data position `{epoch, segment, record}` with its `carry`, the
//! [`RecordSum`] of the records this rank (and the ranks whose records it took over)
//! consumed. An attempt resuming from the step its plan starts from (a resize) takes the
//! weights of the part it was given (rank `r mod` the old world size) and starts the
//! plan: its first epoch, segment 0, with the old ranks' carries summed; any other resume
//! continues from its own position. The model of a resized run differs from a
//! fixed-size run's (other ranks, other batches); the record sums of the last ranks add
//! up to [`expected_sum`] of the data set.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use cumulus_api::rank_env::RankDataPlan;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::rank::{
    ProgressSender, RankTrainer, agent_and_staging, load_data, train, write_outputs,
};
use super::{
    Hyper, OPTIMIZER_FILE, RankResult, ResumeError, STATE_FILE, StepReport, TrainConfig, TrainData,
    TrainError, TrainOutcome, WEIGHTS_FILE, normalization_fingerprint, read_f64_file,
};
use crate::data::{self, Dataset};
use crate::env::RankEnv;
use crate::model::{Momentum, SoftmaxModel};
use crate::state::HexF64;

/// The value of [`ElasticState::format`].
pub const ELASTIC_STATE_FORMAT: &str = "cumulus-trainer-elastic-state/1";
/// Largest data plan file read, in bytes (as the Python runtime's).
pub const MAX_PLAN_BYTES: u64 = 64 << 20;

/// The id hash of record `index` (0-based, counting records) of the shard named
/// `shard_name` in `epoch`: the first 8 bytes, little-endian, of SHA-256 of
/// `"{epoch}\0{shard_name}\0{index}"` (as `examples/python/elastic_records.py`'s).
pub fn record_hash(epoch: u32, shard_name: &str, index: u64) -> u64 {
    let h = Sha256::digest(format!("{epoch}\0{shard_name}\0{index}").as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&h[..8]);
    u64::from_le_bytes(first)
}

/// An order-free digest of records consumed: how many, and the sum of their
/// [`record_hash`]es modulo 2^64. It does not depend on the order nor on which rank
/// consumed a record, so the sums of several ranks add up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecordSum {
    /// Records consumed.
    pub count: u64,
    /// Sum of their hashes, modulo 2^64.
    pub sum: u64,
}

impl RecordSum {
    /// Counts one record.
    pub fn add(&mut self, epoch: u32, shard_name: &str, index: u64) {
        self.count += 1;
        self.sum = self.sum.wrapping_add(record_hash(epoch, shard_name, index));
    }

    /// Adds another sum (records consumed elsewhere).
    pub fn merge(&mut self, other: RecordSum) {
        self.count += other.count;
        self.sum = self.sum.wrapping_add(other.sum);
    }

    /// The sum as 16 lower-case hex digits.
    pub fn sum_hex(&self) -> String {
        format!("{:016x}", self.sum)
    }

    /// The `carry` of a data position: `{"count": N, "sum": "<16 hex digits>"}`.
    pub fn to_carry(self) -> serde_json::Value {
        serde_json::json!({"count": self.count, "sum": self.sum_hex()})
    }

    /// Reads a `carry` written by [`RecordSum::to_carry`].
    ///
    /// # Errors
    /// The value is not such an object.
    pub fn from_carry(carry: &serde_json::Value) -> Result<Self, String> {
        let count = carry.get("count").and_then(serde_json::Value::as_u64);
        let sum = carry
            .get("sum")
            .and_then(serde_json::Value::as_str)
            .filter(|s| s.len() == 16)
            .and_then(|s| u64::from_str_radix(s, 16).ok());
        match (count, sum) {
            (Some(count), Some(sum)) => Ok(Self { count, sum }),
            _ => Err(format!(
                "carry {carry} is not {{\"count\": N, \"sum\": 16 hex digits}}"
            )),
        }
    }
}

/// The record sum of a run that consumed every record of `dataset` exactly once in each
/// of `epochs` epochs: what the `record_sum`s of an elastic run's last ranks add up to.
pub fn expected_sum(dataset: &Dataset, epochs: u32) -> RecordSum {
    let mut sum = RecordSum::default();
    for epoch in 0..epochs {
        for shard in &dataset.shards {
            for index in 0..shard.records {
                sum.add(epoch, &shard.name, index);
            }
        }
    }
    sum
}

/// Reads and checks a data plan file (`CUMULUS_DATA_PLAN`).
///
/// # Errors
/// [`TrainError::Config`] when it cannot be read, is larger than [`MAX_PLAN_BYTES`] or
/// is not a plan.
pub fn read_plan(path: &Path) -> Result<RankDataPlan, TrainError> {
    let bad = |why: String| TrainError::Config(format!("data plan {}: {why}", path.display()));
    let size_bytes = std::fs::metadata(path)
        .map_err(|e| bad(format!("cannot read it: {e}")))?
        .len();
    if size_bytes > MAX_PLAN_BYTES {
        return Err(bad(format!("{size_bytes} bytes, limit {MAX_PLAN_BYTES}")));
    }
    let bytes = std::fs::read(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
    let plan: RankDataPlan =
        serde_json::from_slice(&bytes).map_err(|e| bad(format!("not a data plan: {e}")))?;
    if plan.world_size == 0 || plan.previous_world_size == 0 {
        return Err(bad("a world size of 0".to_string()));
    }
    Ok(plan)
}

/// A data position and its carry: `state["cumulus_data"]`
/// ([`cumulus_api::rank_env::DATA_STATE_KEY`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataState {
    /// The epoch (0-based; `epochs` once every epoch is done).
    pub epoch: u32,
    /// Segments of the epoch consumed.
    pub segment: u32,
    /// Records of segment `segment` consumed.
    pub record: u64,
    /// [`RecordSum::to_carry`] of the records consumed so far.
    pub carry: serde_json::Value,
}

/// The content of an elastic run's `state.json`, also the `state` of its commits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ElasticState {
    /// Always [`ELASTIC_STATE_FORMAT`].
    pub format: String,
    /// Steps completed; the checkpoint's step.
    pub step: u64,
    /// `--total-steps`.
    pub total_steps: u64,
    /// Epochs of the run.
    pub epochs: u32,
    /// Records per step at most.
    pub batch_size: u64,
    /// Learning rate.
    pub lr: HexF64,
    /// Momentum.
    pub momentum: HexF64,
    /// Classes of the model.
    pub classes: u32,
    /// Features of the model.
    pub features: u64,
    /// Factor every raw feature value is multiplied by.
    pub feature_scale: HexF64,
    /// [`normalization_fingerprint`] of the run.
    pub normalization: String,
    /// The world size of the ranks that wrote it.
    pub world_size: u32,
    /// The rank that wrote it.
    pub rank: u32,
    /// The data position, under the rank contract's key.
    #[serde(rename = "cumulus_data")]
    pub data: DataState,
}

/// Where the records of each epoch are: this rank's segments, as indices into the
/// loaded [`Dataset`]'s shards and first records.
#[derive(Debug, Clone)]
pub struct Layout {
    /// The epochs the plan does not list: the shards file's shards, whole.
    standard: Vec<(usize, u64)>,
    /// The epochs the plan lists.
    epochs: BTreeMap<u32, Vec<(usize, u64)>>,
    /// The index in the data set of each shard's first record.
    offsets: Vec<usize>,
}

/// The shards a rank with `shards_file` and `plan` reads: the shards file's, then the
/// plan's other ones in order of first appearance.
pub fn plan_shards(shards_file: &[PathBuf], plan: &RankDataPlan) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = shards_file.to_vec();
    for segment in plan.epochs.values().flatten() {
        let p = PathBuf::from(&segment.shard);
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

impl Layout {
    /// The layout of `plan` over `dataset`, loaded from [`plan_shards`] of
    /// `shards_file`.
    pub fn new(dataset: &Dataset, shards_file: &[PathBuf], plan: &RankDataPlan) -> Self {
        let index: HashMap<&Path, usize> = dataset
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| (s.path.as_path(), i))
            .collect();
        let standard = shards_file
            .iter()
            .filter_map(|p| index.get(p.as_path()).map(|i| (*i, 0)))
            .collect();
        let epochs = plan
            .epochs
            .iter()
            .map(|(e, segments)| {
                let segs = segments
                    .iter()
                    .filter_map(|s| index.get(Path::new(&s.shard)).map(|i| (*i, s.first_record)))
                    .collect();
                (*e, segs)
            })
            .collect();
        let mut offsets = Vec::with_capacity(dataset.shards.len());
        let mut at = 0usize;
        for s in &dataset.shards {
            offsets.push(at);
            at += s.records as usize;
        }
        Self {
            standard,
            epochs,
            offsets,
        }
    }

    /// This rank's segments of `epoch`.
    fn segments(&self, epoch: u32) -> &[(usize, u64)] {
        self.epochs
            .get(&epoch)
            .map_or(&self.standard, Vec::as_slice)
    }
}

/// Where a rank is in its data: in `epoch`, `segment` segments and `record` records of
/// the next one consumed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Position {
    /// The epoch.
    pub epoch: u32,
    /// Segments of it consumed.
    pub segment: u32,
    /// Records of the next segment consumed.
    pub record: u64,
}

/// The training state machine of an elastic job's rank.
#[derive(Debug, Clone)]
pub struct ElasticTrainer<'a> {
    data: &'a TrainData,
    layout: &'a Layout,
    hyper: Hyper,
    total_steps: u64,
    world_size: u32,
    rank: u32,
    model: SoftmaxModel,
    opt: Momentum,
    grad: Vec<f64>,
    step: u64,
    at: Position,
    sum: RecordSum,
    epoch_loss: (f64, u64),
    last_epoch_loss: Option<f64>,
}

impl<'a> ElasticTrainer<'a> {
    /// A fresh run: zero weights, epoch 0, nothing consumed.
    ///
    /// # Errors
    /// Bad hyper-parameters or a model too large.
    pub fn new(
        data: &'a TrainData,
        layout: &'a Layout,
        hyper: Hyper,
        total_steps: u64,
        (world_size, rank): (u32, u32),
    ) -> Result<Self, TrainError> {
        hyper.validate()?;
        let model = SoftmaxModel::zeros(data.classes as usize, data.dataset.features)
            .map_err(|e| TrainError::Config(e.to_string()))?;
        let params = model.param_count();
        let mut t = Self {
            data,
            layout,
            opt: Momentum::new(hyper.lr, hyper.momentum, params),
            grad: vec![0.0; params],
            model,
            hyper,
            total_steps,
            world_size,
            rank,
            step: 0,
            at: Position::default(),
            sum: RecordSum::default(),
            epoch_loss: (0.0, 0),
            last_epoch_loss: None,
        };
        t.settle();
        Ok(t)
    }

    /// Resumes from the checkpoint part `dir` of `resume_step`: its weights and
    /// optimizer, and either the start of `plan` (when the plan starts from this step:
    /// a resize; the carries summed) or the part's own data position. Returns the
    /// trainer and whether it started the plan.
    ///
    /// # Errors
    /// [`TrainError::Resume`] when the part does not fit this run.
    pub fn resume(
        mut self,
        dir: &Path,
        resume_step: u64,
        plan: &RankDataPlan,
        log: &mut dyn Write,
    ) -> Result<(Self, bool), TrainError> {
        let state = read_elastic_state(dir)?;
        let starts_plan = plan.from_step == Some(resume_step);
        let invalid = |why: String| {
            TrainError::from(ResumeError::Elastic {
                dir: dir.to_path_buf(),
                why,
            })
        };
        if state.step != resume_step {
            return Err(invalid(format!(
                "state.json is for step {}, but CUMULUS_RESUME_STEP is {resume_step}",
                state.step
            )));
        }
        self.check_identity(&state, starts_plan, log)
            .map_err(invalid)?;
        let params = self.model.param_count();
        let weights = read_f64_file(dir, WEIGHTS_FILE, params)?;
        let velocity = read_f64_file(dir, OPTIMIZER_FILE, params)?;
        self.model = SoftmaxModel::from_weights(
            self.data.classes as usize,
            self.data.dataset.features,
            weights,
        )
        .map_err(|source| ResumeError::Model {
            dir: dir.to_path_buf(),
            source,
        })?;
        self.opt = Momentum::with_velocity(self.hyper.lr, self.hyper.momentum, velocity);
        self.step = state.step;
        if starts_plan {
            self.at = Position {
                epoch: plan.start_epoch,
                ..Position::default()
            };
            self.sum = RecordSum::default();
            for carry in &plan.carry {
                let taken = RecordSum::from_carry(carry).map_err(|why| {
                    invalid(format!("the data plan's carry from an old rank: {why}"))
                })?;
                self.sum.merge(taken);
            }
        } else {
            self.at = Position {
                epoch: state.data.epoch,
                segment: state.data.segment,
                record: state.data.record,
            };
            self.sum = RecordSum::from_carry(&state.data.carry).map_err(invalid)?;
            self.check_position().map_err(invalid)?;
        }
        self.settle();
        Ok((self, starts_plan))
    }

    /// Checks that `state` was written by a run of these arguments. A run that resumes
    /// another rank's part at a resize may differ in its normalization (statistics
    /// computed over each rank's own records): warned, not refused.
    fn check_identity(
        &self,
        state: &ElasticState,
        starts_plan: bool,
        log: &mut dyn Write,
    ) -> Result<(), String> {
        let ours = self.state();
        let mut differ = Vec::new();
        if state.total_steps != ours.total_steps {
            differ.push(format!(
                "total_steps {} (this run {})",
                state.total_steps, ours.total_steps
            ));
        }
        if state.epochs != ours.epochs {
            differ.push(format!(
                "epochs {} (this run {})",
                state.epochs, ours.epochs
            ));
        }
        if state.batch_size != ours.batch_size {
            differ.push(format!(
                "batch_size {} (this run {})",
                state.batch_size, ours.batch_size
            ));
        }
        if state.lr != ours.lr || state.momentum != ours.momentum {
            differ.push("lr or momentum".to_string());
        }
        if state.classes != ours.classes || state.features != ours.features {
            differ.push(format!(
                "{} classes × {} features (this run {} × {})",
                state.classes, state.features, ours.classes, ours.features
            ));
        }
        if !differ.is_empty() {
            return Err(format!(
                "state.json has {}: resume with the same arguments as the checkpointed run",
                differ.join(", ")
            ));
        }
        if state.normalization != ours.normalization || state.feature_scale != ours.feature_scale {
            if !starts_plan {
                return Err(format!(
                    "state.json has normalization {} (scale {}), this run {} (scale {})",
                    state.normalization,
                    state.feature_scale.0,
                    ours.normalization,
                    ours.feature_scale.0
                ));
            }
            let _ = writeln!(
                log,
                "warning: the part resumed at the resize was trained with other feature \
                 normalization ({}); give every rank the same statistics (`cumulusctl \
                 dataset split` writes them beside the shards)",
                state.normalization
            );
        }
        Ok(())
    }

    /// Checks the position against this rank's segments.
    fn check_position(&self) -> Result<(), String> {
        let Position {
            epoch,
            segment,
            record,
        } = self.at;
        if epoch >= self.hyper.epochs {
            return if epoch == self.hyper.epochs && segment == 0 && record == 0 {
                Ok(())
            } else {
                Err(format!(
                    "data position {:?} is past the last epoch",
                    self.at
                ))
            };
        }
        let segments = self.layout.segments(epoch);
        let ok = match segments.get(segment as usize) {
            Some(s) => record <= self.available(*s),
            None => segment as usize == segments.len() && record == 0,
        };
        if ok {
            Ok(())
        } else {
            Err(format!(
                "data position {:?} is outside this rank's {} segments of epoch {epoch}",
                self.at,
                segments.len()
            ))
        }
    }

    /// Records of segment `(shard, first_record)`.
    fn available(&self, (shard, first): (usize, u64)) -> u64 {
        self.data.dataset.shards[shard]
            .records
            .saturating_sub(first)
    }

    /// Moves past used-up segments and, at the end of an epoch, to the next one.
    fn settle(&mut self) {
        let layout = self.layout;
        while self.at.epoch < self.hyper.epochs {
            let segments = layout.segments(self.at.epoch);
            while let Some(s) = segments.get(self.at.segment as usize) {
                if self.at.record < self.available(*s) {
                    return;
                }
                self.at.segment += 1;
                self.at.record = 0;
            }
            self.finish_epoch();
        }
    }

    fn finish_epoch(&mut self) {
        let (loss, n) = self.epoch_loss;
        if n > 0 {
            self.last_epoch_loss = Some(loss / n as f64);
        }
        self.epoch_loss = (0.0, 0);
        self.at = Position {
            epoch: self.at.epoch + 1,
            ..Position::default()
        };
    }

    /// The next batch: up to `batch_size` records of the current epoch, as indices into
    /// the data set, each counted in the record sum.
    fn take_batch(&mut self) -> Vec<usize> {
        let mut batch = Vec::new();
        if self.at.epoch >= self.hyper.epochs {
            return batch;
        }
        let epoch = self.at.epoch;
        let (layout, data) = (self.layout, self.data);
        let segments = layout.segments(epoch);
        while (batch.len() as u64) < self.hyper.batch_size {
            let Some(&(shard, first)) = segments.get(self.at.segment as usize) else {
                break;
            };
            if self.at.record >= self.available((shard, first)) {
                self.at.segment += 1;
                self.at.record = 0;
                continue;
            }
            let index = first + self.at.record;
            batch.push(layout.offsets[shard] + index as usize);
            self.sum.add(epoch, &data.dataset.shards[shard].name, index);
            self.at.record += 1;
        }
        batch
    }

    /// Runs one step; `None` once `total_steps` are done.
    pub fn train_step(&mut self) -> Option<StepReport> {
        if self.step >= self.total_steps {
            return None;
        }
        let epoch = self.at.epoch;
        let batch = self.take_batch();
        let mut batch_loss = 0.0;
        if !batch.is_empty() {
            let loss_sum = self.model.batch_gradient(
                &self.data.x,
                &self.data.dataset.labels,
                &batch,
                &mut self.grad,
            );
            self.opt.apply(self.model.weights_mut(), &self.grad);
            self.epoch_loss.0 += loss_sum;
            self.epoch_loss.1 += batch.len() as u64;
            batch_loss = loss_sum / batch.len() as f64;
        }
        self.step += 1;
        self.settle();
        Some(StepReport {
            step: self.step,
            epoch,
            batch_loss,
        })
    }

    /// Steps completed.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The data position.
    pub fn position(&self) -> Position {
        self.at
    }

    /// The record sum so far (this rank's and the ranks' whose records it took over).
    pub fn record_sum(&self) -> RecordSum {
        self.sum
    }

    /// The model.
    pub fn model(&self) -> &SoftmaxModel {
        &self.model
    }

    /// The mean loss of the current epoch so far, else of the last one this attempt
    /// finished.
    pub fn current_loss(&self) -> Option<f64> {
        let (loss, n) = self.epoch_loss;
        if n > 0 {
            Some(loss / n as f64)
        } else {
            self.last_epoch_loss
        }
    }

    /// The checkpoint state of now.
    pub fn state(&self) -> ElasticState {
        ElasticState {
            format: ELASTIC_STATE_FORMAT.to_string(),
            step: self.step,
            total_steps: self.total_steps,
            epochs: self.hyper.epochs,
            batch_size: self.hyper.batch_size,
            lr: HexF64(self.hyper.lr),
            momentum: HexF64(self.hyper.momentum),
            classes: self.data.classes,
            features: self.data.dataset.features as u64,
            feature_scale: HexF64(self.data.feature_scale),
            normalization: normalization_fingerprint(self.data.stats.as_ref()),
            world_size: self.world_size,
            rank: self.rank,
            data: DataState {
                epoch: self.at.epoch,
                segment: self.at.segment,
                record: self.at.record,
                carry: self.sum.to_carry(),
            },
        }
    }
}

impl RankTrainer for ElasticTrainer<'_> {
    fn steps_done(&self) -> u64 {
        self.step
    }

    fn steps_total(&self) -> u64 {
        self.total_steps
    }

    fn next_step(&mut self) -> Option<StepReport> {
        self.train_step()
    }

    fn loss_now(&self) -> Option<f64> {
        self.current_loss()
    }

    fn write_checkpoint_files(&self, dir: &Path) -> io::Result<serde_json::Value> {
        let state = self.state();
        super::write_part_files(dir, &self.model, &self.opt, &state)?;
        Ok(serde_json::to_value(&state).expect("an ElasticState always serializes"))
    }
}

/// Reads `state.json` of an elastic run's checkpoint part.
fn read_elastic_state(dir: &Path) -> Result<ElasticState, TrainError> {
    let (path, bytes) = super::read_state_bytes(dir)?;
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|source| ResumeError::Json {
            path: path.clone(),
            source,
        })?;
    let format = value.get("format").and_then(serde_json::Value::as_str);
    if format != Some(ELASTIC_STATE_FORMAT) {
        return Err(ResumeError::Elastic {
            dir: dir.to_path_buf(),
            why: format!(
                "{STATE_FILE} has format {format:?}, not {ELASTIC_STATE_FORMAT:?}: an \
                 elastic job's ranks resume only from checkpoints of elastic runs"
            ),
        }
        .into());
    }
    serde_json::from_value(value).map_err(|source| ResumeError::Json { path, source }.into())
}

/// Runs `cumulus-trainer train` for a rank of an elastic job whose data plan is the
/// file `plan_path` (as [`super::run`] for a fixed-size one).
///
/// # Errors
/// As [`super::run`]; no `--total-steps`, or a bad plan, is a configuration error.
pub fn run(
    config: &TrainConfig,
    env: &RankEnv,
    plan_path: &Path,
    log: &mut dyn Write,
) -> Result<Option<TrainOutcome>, TrainError> {
    let total_steps = config.total_steps.ok_or_else(|| {
        TrainError::Config(
            "a rank of an elastic job (CUMULUS_DATA_PLAN is set) needs --total-steps: every \
             rank runs that many steps, the same at any world size"
                .to_string(),
        )
    })?;
    let plan = read_plan(plan_path)?;
    let world_size = env.world_size.unwrap_or(plan.world_size);
    if world_size != plan.world_size {
        return Err(TrainError::Config(format!(
            "data plan {} is for {} ranks, WORLD_SIZE is {world_size}",
            plan_path.display(),
            plan.world_size
        )));
    }
    let (agent, staging) = agent_and_staging(config, env)?;
    let shards_file = data::read_shards_file(&config.shards_file)?;
    let paths = plan_shards(&shards_file, &plan);
    let (data, test) = load_data(config, &paths, log)?;
    let layout = Layout::new(&data.dataset, &shards_file, &plan);
    let fresh = ElasticTrainer::new(
        &data,
        &layout,
        config.hyper.clone(),
        total_steps,
        (world_size, env.rank),
    )?;
    let mut trainer = match &env.resume {
        Some(r) => {
            let (t, started) = fresh.resume(&r.dir, r.step, &plan, log)?;
            let _ = writeln!(
                log,
                "resumed from step {} at {:?}{}: {} records so far",
                r.step,
                t.position(),
                if started {
                    format!(
                        ", starting the data plan of the resize from {} to {} ranks",
                        plan.previous_world_size, plan.world_size
                    )
                } else {
                    String::new()
                },
                t.record_sum().count
            );
            t
        }
        None => fresh,
    };
    let _ = writeln!(
        log,
        "rank={} attempt={} elastic, {world_size} ranks: {} records loaded from {} shard(s) \
         ({} epochs listed by the data plan), {} steps",
        env.rank,
        env.attempt,
        data.dataset.len(),
        data.dataset.shards.len(),
        plan.epochs.len(),
        total_steps
    );
    let mut progress = ProgressSender::new(agent.as_ref());
    let checkpoints = staging.as_deref().zip(agent.as_ref());
    if !train(&mut trainer, config, env, checkpoints, &mut progress, log)? {
        return Ok(None);
    }
    progress.send(trainer.step(), total_steps, trainer.current_loss(), true);
    let sum = trainer.record_sum();
    let result = RankResult {
        rank: env.rank,
        attempt: env.attempt,
        accuracy: test
            .as_ref()
            .map(|(t, x)| trainer.model().accuracy(x, &t.labels)),
        records_consumed: sum.count,
        digest: String::new(),
        steps: trainer.step(),
        epochs: config.hyper.epochs,
        final_loss: trainer.last_epoch_loss.filter(|l| l.is_finite()),
        classes: data.classes,
        features: data.dataset.features as u64,
        feature_scale: data.feature_scale,
        feature_stats: data.stats.clone(),
        test_records: test.as_ref().map(|(t, _)| t.len() as u64),
        record_sum: Some(sum.sum_hex()),
        world_size: Some(world_size),
    };
    let outcome = write_outputs(trainer.model(), result, config, env)?;
    let _ = writeln!(
        log,
        "RESULT rank={} accuracy={} records={} record_sum={} world_size={world_size}",
        env.rank,
        outcome
            .result
            .accuracy
            .map_or_else(|| "none".to_string(), |a| format!("{a:.4}")),
        sum.count,
        sum.sum_hex()
    );
    let _ = log.flush();
    Ok(Some(outcome))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use cumulus_api::rank_env::{DATA_STATE_KEY, DataSegment};

    use super::*;
    use crate::trainer::FeatureScale;

    fn hyper(batch_size: u64, epochs: u32) -> Hyper {
        Hyper {
            epochs,
            batch_size,
            lr: 0.1,
            momentum: 0.9,
            seed: 1,
        }
    }

    /// Three shards of 3, 2 and 4 records.
    fn shards(dir: &Path) -> Vec<PathBuf> {
        [("a.csv", 3), ("b.csv", 2), ("c.csv", 4)]
            .iter()
            .map(|(name, n)| {
                let p = dir.join(name);
                let text: String = (0..*n).map(|i| format!("{i},{}\n", i % 2)).collect();
                std::fs::write(&p, text).expect("write shard");
                p
            })
            .collect()
    }

    fn prepared(paths: &[PathBuf]) -> TrainData {
        let d = data::load_shards(paths).expect("load");
        TrainData::prepare(d, Some(2), FeatureScale::Fixed(1.0), None).expect("prepare")
    }

    #[test]
    fn the_state_holds_the_position_under_the_contract_key() {
        let dir = tempfile::tempdir().unwrap();
        let paths = shards(dir.path());
        let data = prepared(&paths);
        let plan = RankDataPlan {
            world_size: 1,
            previous_world_size: 1,
            ..RankDataPlan::default()
        };
        let layout = Layout::new(&data.dataset, &paths, &plan);
        let mut t = ElasticTrainer::new(&data, &layout, hyper(2, 1), 10, (1, 0)).unwrap();
        t.train_step();
        let v = serde_json::to_value(t.state()).unwrap();
        assert_eq!(
            v[DATA_STATE_KEY],
            serde_json::json!({"epoch": 0, "segment": 0, "record": 2,
                "carry": t.record_sum().to_carry()})
        );
    }

    #[test]
    fn a_plan_is_read_segment_by_segment_and_batches_stay_in_their_epoch() {
        let dir = tempfile::tempdir().unwrap();
        let paths = shards(dir.path());
        // Epoch 0: the rest of a.csv from record 2, then c.csv from record 3; epoch 1
        // is standard: the shards file (a.csv only), whole.
        let plan = RankDataPlan {
            world_size: 2,
            previous_world_size: 3,
            from_step: Some(5),
            start_epoch: 0,
            epochs: BTreeMap::from([(
                0,
                vec![
                    DataSegment {
                        shard: paths[0].display().to_string(),
                        first_record: 2,
                    },
                    DataSegment {
                        shard: paths[2].display().to_string(),
                        first_record: 3,
                    },
                ],
            )]),
            carry: Vec::new(),
        };
        let shards_file = vec![paths[0].clone()];
        let loaded = plan_shards(&shards_file, &plan);
        assert_eq!(loaded, vec![paths[0].clone(), paths[2].clone()]);
        let data = prepared(&loaded);
        let layout = Layout::new(&data.dataset, &shards_file, &plan);
        let mut t = ElasticTrainer::new(&data, &layout, hyper(3, 2), 4, (2, 0)).unwrap();
        let mut expected = RecordSum::default();
        expected.add(0, "a.csv", 2);
        expected.add(0, "c.csv", 3);
        t.train_step();
        assert_eq!(
            t.record_sum(),
            expected,
            "epoch 0 has 2 records: one short step"
        );
        assert_eq!(
            t.position(),
            Position {
                epoch: 1,
                segment: 0,
                record: 0
            }
        );
        t.train_step();
        for i in 0..3 {
            expected.add(1, "a.csv", i);
        }
        assert_eq!(t.record_sum(), expected);
        assert_eq!(t.position().epoch, 2, "every epoch done");
        assert!(t.train_step().is_some(), "empty steps up to --total-steps");
        assert!(t.train_step().is_some());
        assert!(t.train_step().is_none());
        assert_eq!(t.record_sum(), expected);
    }

    #[test]
    fn a_resume_continues_at_its_position_or_starts_the_plan_with_the_carries() {
        let dir = tempfile::tempdir().unwrap();
        let paths = shards(dir.path());
        let data = prepared(&paths);
        let standard = RankDataPlan {
            world_size: 1,
            previous_world_size: 1,
            ..RankDataPlan::default()
        };
        let layout = Layout::new(&data.dataset, &paths, &standard);
        let mut t = ElasticTrainer::new(&data, &layout, hyper(2, 2), 20, (1, 0)).unwrap();
        for _ in 0..3 {
            t.train_step();
        }
        let part = dir.path().join("part");
        std::fs::create_dir(&part).unwrap();
        t.write_checkpoint_files(&part).unwrap();
        let fresh = || ElasticTrainer::new(&data, &layout, hyper(2, 2), 20, (1, 0)).unwrap();
        let (mut r, started) = fresh()
            .resume(&part, 3, &standard, &mut Vec::new())
            .unwrap();
        assert!(!started);
        assert_eq!(
            (r.position(), r.record_sum()),
            (t.position(), t.record_sum())
        );
        while r.train_step().is_some() {}
        while t.train_step().is_some() {}
        assert_eq!(r.model().weights(), t.model().weights(), "exact resume");
        assert_eq!(r.record_sum(), expected_sum(&data.dataset, 2));

        // A plan that starts at step 3: epoch 1 from its start, with the old carries.
        let carried = RecordSum { count: 7, sum: 11 };
        let plan = RankDataPlan {
            world_size: 1,
            previous_world_size: 2,
            from_step: Some(3),
            start_epoch: 1,
            carry: vec![carried.to_carry(), carried.to_carry()],
            ..RankDataPlan::default()
        };
        let (r, started) = fresh().resume(&part, 3, &plan, &mut Vec::new()).unwrap();
        assert!(started);
        assert_eq!(
            r.position(),
            Position {
                epoch: 1,
                segment: 0,
                record: 0
            }
        );
        assert_eq!(r.record_sum(), RecordSum { count: 14, sum: 22 });

        // Another run's part is refused.
        let err = ElasticTrainer::new(&data, &layout, hyper(4, 2), 20, (1, 0))
            .unwrap()
            .resume(&part, 3, &standard, &mut Vec::new())
            .unwrap_err();
        assert!(err.to_string().contains("batch_size"), "{err}");
        let err = fresh()
            .resume(&part, 4, &standard, &mut Vec::new())
            .unwrap_err();
        assert!(err.to_string().contains("step 3"), "{err}");
    }

    #[test]
    fn the_record_hash_is_the_python_examples() {
        // elastic_records.py: sha256(f"{epoch}\0{shard}\0{index}").digest()[:8], little
        // endian.
        let h = Sha256::digest(b"1\0s.csv\x002");
        let mut first = [0u8; 8];
        first.copy_from_slice(&h[..8]);
        assert_eq!(record_hash(1, "s.csv", 2), u64::from_le_bytes(first));
        let carry = RecordSum {
            count: 3,
            sum: u64::MAX,
        }
        .to_carry();
        assert_eq!(
            carry,
            serde_json::json!({"count": 3, "sum": "ffffffffffffffff"})
        );
        assert_eq!(
            RecordSum::from_carry(&carry),
            Ok(RecordSum {
                count: 3,
                sum: u64::MAX
            })
        );
        assert!(RecordSum::from_carry(&serde_json::Value::Null).is_err());
    }
}
