//! A job as submitted: [`JobSpec`] and [`RestartPolicy`], with their validation.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::*;

/// Restart policy of a job, with every default filled in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestartPolicy {
    /// What a failure restarts.
    pub scope: RestartScope,
    /// Job-wide restart budget.
    pub max_restarts: u32,
    /// Delay of the first restart before jitter, in milliseconds.
    pub backoff_initial_ms: u64,
    /// Cap of the delay before jitter, in milliseconds.
    pub backoff_max_ms: u64,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            scope: RestartScope::Group,
            max_restarts: 3,
            backoff_initial_ms: 500,
            backoff_max_ms: 30_000,
        }
    }
}

impl RestartPolicy {
    /// Base delay of restart number `n` (1-based), before jitter:
    /// `min(initial × 2^(n−1), max)` in milliseconds (saturating).
    pub fn base_delay_ms(&self, n: u32) -> u64 {
        let exp = n.saturating_sub(1).min(63);
        let factor = 1u64.checked_shl(exp).unwrap_or(u64::MAX);
        self.backoff_initial_ms
            .saturating_mul(factor)
            .min(self.backoff_max_ms)
    }

    /// The delay of restart `n` jittered by `unit` ∈ [−1, 1]: base × (1 + 0.2·unit).
    /// The leader draws `unit` at random and stamps the result into the command.
    pub fn jittered_delay_ms(&self, n: u32, unit: f64) -> u64 {
        let unit = if unit.is_finite() {
            unit.clamp(-1.0, 1.0)
        } else {
            0.0
        };
        let base = self.base_delay_ms(n) as f64;
        (base * (1.0 + BACKOFF_JITTER_FRACTION * unit))
            .round()
            .max(0.0) as u64
    }

    /// The smallest delay the policy allows for restart `n`: base × 0.8.
    pub fn min_delay_ms(&self, n: u32) -> u64 {
        self.jittered_delay_ms(n, -1.0)
    }
}

pub use cumulus_api::blobs::{
    MAX_BLOB_BYTES, MAX_FIND_LINKS, MAX_REQUIREMENTS_BYTES, is_valid_digest,
    is_valid_python_version,
};
pub use cumulus_api::is_job_id;

/// Committed checkpoint steps kept when a submit names none.
pub const DEFAULT_CKPT_KEEP: u32 = 3;

/// A job as submitted, validated and with defaults filled in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    /// Human-readable name (≤ 128 bytes).
    pub name: String,
    /// Number of ranks.
    pub world_size: u32,
    /// argv of every rank.
    pub command: Vec<String>,
    /// Extra environment of every rank (sorted for determinism).
    pub env: BTreeMap<String, String>,
    /// Dataset directory, or an S3 prefix `s3://bucket/prefix` ("" = none).
    pub dataset: String,
    /// Checkpoint root ("" = disabled).
    pub ckpt_dir: String,
    /// Committed checkpoint steps kept.
    pub ckpt_keep: u32,
    /// What a failure restarts, the restart budget and its backoff.
    pub restart: RestartPolicy,
    /// Hang detection: a running attempt whose reported step does not change for this
    /// long after its first progress report fails (0 = off), in milliseconds.
    pub progress_timeout_ms: u64,
    /// Longest time from an attempt's process start to its first progress report, in
    /// milliseconds, at most [`MAX_STARTUP_TIMEOUT_MS`]; past it the attempt is hung. 0:
    /// [`DEFAULT_STARTUP_TIMEOUT_MS`] when `progress_timeout_ms` is set, else off
    /// ([`JobSpec::startup_timeout_ms`]).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub startup_timeout_ms: u64,
    /// Working directory of the ranks ("" = the worker's).
    pub working_dir: String,
    /// S3 checkpoint target `s3://bucket/prefix` ("" = none).
    #[serde(default)]
    pub ckpt_url: String,
    /// Commit tier with an S3 target: "l1" or "l2" ("" = l2).
    #[serde(default)]
    pub ckpt_commit_tier: String,
    /// Distinct GPUs each rank gets (0 = none), at most [`MAX_GPUS_PER_WORKER`].
    #[serde(default)]
    pub gpus_per_rank: u32,
    /// Share of its GPU each rank gets, in thousandths: `1..=999` (then `gpus_per_rank`
    /// is 1), or 0 for whole GPUs.
    #[serde(default)]
    pub gpu_memory_permille: u32,
    /// Time between SIGTERM and SIGKILL when a rank is stopped, in milliseconds (0: the
    /// agent's own), at most [`MAX_STOP_GRACE_MS`].
    #[serde(default)]
    pub stop_grace_ms: u64,
    /// Running time the job may use (time paused or queued is not counted), in
    /// milliseconds (0: no limit), at most [`MAX_TIME_LIMIT_MS`]. Its ranks are asked
    /// to checkpoint and stop `signal_before_ms` before it; the job ends `timed_out`.
    #[serde(default)]
    pub time_limit_ms: u64,
    /// How long before the time limit the ranks are asked to checkpoint and stop, in
    /// milliseconds (below `time_limit_ms`; as Slurm's `--signal`). Their SIGTERM comes
    /// at the limit itself.
    #[serde(default)]
    pub signal_before_ms: u64,
    /// Queue priority, `-MAX_PRIORITY..=MAX_PRIORITY` (default 0): pending jobs are
    /// placed highest priority first, in submission order within one priority.
    #[serde(default)]
    pub priority: i32,
    /// The committed step of another job the first attempt resumes from (a fork): same
    /// world size, shard plan and checkpoint target as that job. `None`: from scratch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_from: Option<ResumeFrom>,
    /// The job may be stopped (checkpoint first, as for a pause) and queued again when a
    /// job of higher priority waits for its slots; that costs no restart budget.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub preemptible: bool,
    /// The ranks' working directory sent by the client: a packed directory in the
    /// cluster's blob store, unpacked afresh for every attempt. Not with `working_dir`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<BlobRef>,
    /// The Python environment the ranks run in, built and cached on each worker
    /// (`None`: the worker's own interpreter and packages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<Environment>,
    /// The job opted out of failing fast (`fail_fast: false`): a first attempt whose
    /// ranks all exit the same way right after their start is restarted under the
    /// budget like any failure, instead of failing the job at once.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_fail_fast: bool,
    /// How the job's stragglers are found and what is done about them (default: warn
    /// at 0.7 of the median for 60 s).
    #[serde(default, skip_serializing_if = "StragglerPolicy::is_default")]
    pub straggler: StragglerPolicy,
    /// Warm spares each worker running ranks of the job keeps, at most
    /// [`cumulus_api::limits::MAX_WARM_SPARES`] (0: none; [`cumulus_api::warm`]).
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub warm_spares: u32,
    /// Modules a warm spare imports before it is assigned a rank.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warm_imports: Vec<String>,
    /// Elastic world size: the fewest ranks the job may run with, `1..=world_size`
    /// (`world_size` is then the most); 0 = a fixed world of `world_size` ranks. An
    /// elastic job starts with as many ranks as fit, shrinks when a lost rank has no
    /// room, and grows at a checkpoint boundary ([`Job::world_size`]).
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub min_world_size: u32,
}

fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}

/// A content-addressed blob of the cluster's blob store ([`cumulus_api::blobs`]): only
/// its name and size are in the Raft log, never its bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobRef {
    /// BLAKE3 of the blob's bytes, 64 lowercase hex digits
    /// ([`cumulus_api::blobs::is_valid_digest`]).
    pub digest: String,
    /// The blob's size in bytes, `1..=`[`MAX_BLOB_BYTES`].
    pub size_bytes: u64,
}

impl BlobRef {
    /// Whether the reference names a blob at all: a valid digest and a size in
    /// `1..=`[`MAX_BLOB_BYTES`].
    pub fn is_valid(&self) -> bool {
        is_valid_digest(&self.digest) && self.size_bytes > 0 && self.size_bytes <= MAX_BLOB_BYTES
    }
}

/// A Python virtual environment the ranks run in, built with uv on each worker and
/// cached per (requirements, Python version, platform, index options).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Environment {
    /// requirements.txt text (pip's format), at most [`MAX_REQUIREMENTS_BYTES`] without
    /// NUL; "" = a bare virtual environment.
    #[serde(default)]
    pub requirements: String,
    /// Python version `3.X` or `3.X.Y` ("" = the worker's python3).
    #[serde(default)]
    pub python: String,
    /// uv's `--index-url` ("" = uv's default), at most [`MAX_ARG_BYTES`].
    #[serde(default)]
    pub index_url: String,
    /// uv's `--find-links`: directories on the worker or URLs, at most
    /// [`MAX_FIND_LINKS`] of at most [`MAX_ARG_BYTES`] each.
    #[serde(default)]
    pub find_links: Vec<String>,
    /// uv's `--no-index`: packages come from `find_links` only.
    #[serde(default)]
    pub no_index: bool,
}

impl Environment {
    /// The bytes of its variable-size strings, each with a per-string allowance.
    fn approx_string_bytes(&self) -> usize {
        // Requirements are multi-line text: JSON escapes each newline.
        2 * self.requirements.len()
            + self.python.len()
            + self.index_url.len()
            + self
                .find_links
                .iter()
                .map(|l| l.len() + PER_STRING_BYTES)
                .sum::<usize>()
            + 4 * PER_STRING_BYTES
    }
}

/// A committed step of an earlier job that a new job starts from (`--resume-from JOB@STEP`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumeFrom {
    /// The earlier job (`job-NNNNNN`).
    pub job_id: String,
    /// Its committed step; `None` until the leader resolves it to that job's newest
    /// committed step (a proposed spec always names one).
    pub step: Option<u64>,
}

// The planner (no dependency on the contract crate) spells a whole GPU too.
const _: () = assert!(shard_planner::WHOLE_GPU_PERMILLE == cumulus_api::gpus::WHOLE_GPU_PERMILLE);

// The stop grace, priority and time limit bounds are the contract's (the CLI and the
// Python SDK check them too).
pub use cumulus_api::limits::{
    DEFAULT_STARTUP_TIMEOUT_MS, MAX_PRIORITY, MAX_STARTUP_TIMEOUT_MS, MAX_STOP_GRACE_MS,
    MAX_TIME_LIMIT_MS,
};

impl JobSpec {
    /// The smallest spec: `world_size` ranks running `command`, every other field at the
    /// API's default (no name, env, dataset or checkpoints; [`DEFAULT_CKPT_KEEP`] kept
    /// steps; the default restart policy; no hang detection). Set the rest with struct
    /// update syntax; [`JobSpec::validate`] still decides whether it is acceptable.
    pub fn new(world_size: u32, command: Vec<String>) -> Self {
        Self {
            name: String::new(),
            world_size,
            command,
            env: BTreeMap::new(),
            dataset: String::new(),
            ckpt_dir: String::new(),
            ckpt_keep: DEFAULT_CKPT_KEEP,
            restart: RestartPolicy::default(),
            progress_timeout_ms: 0,
            startup_timeout_ms: 0,
            working_dir: String::new(),
            ckpt_url: String::new(),
            ckpt_commit_tier: String::new(),
            gpus_per_rank: 0,
            gpu_memory_permille: 0,
            stop_grace_ms: 0,
            time_limit_ms: 0,
            signal_before_ms: 0,
            priority: 0,
            resume_from: None,
            preemptible: false,
            workdir: None,
            environment: None,
            no_fail_fast: false,
            straggler: StragglerPolicy::default(),
            warm_spares: 0,
            warm_imports: Vec::new(),
            min_world_size: 0,
        }
    }

    /// Whether the job's world size may change while it runs (`min_world_size` below
    /// `world_size`).
    pub fn is_elastic(&self) -> bool {
        self.min_world_size > 0 && self.min_world_size < self.world_size
    }

    /// The fewest ranks the job runs with: `min_world_size`, or `world_size` for a
    /// fixed world.
    pub fn min_ranks(&self) -> u32 {
        if self.is_elastic() {
            self.min_world_size
        } else {
            self.world_size
        }
    }

    /// The startup timeout in force, in milliseconds (0: none): the job's own, else
    /// [`DEFAULT_STARTUP_TIMEOUT_MS`] for a job with hang detection
    /// (`progress_timeout_ms` > 0). A job that sets neither may never report progress
    /// and is never judged by it.
    pub fn effective_startup_timeout_ms(&self) -> u64 {
        if self.startup_timeout_ms > 0 {
            self.startup_timeout_ms
        } else if self.progress_timeout_ms > 0 {
            DEFAULT_STARTUP_TIMEOUT_MS
        } else {
            0
        }
    }

    /// What each rank needs of GPUs for the planner, or `None` for a job without GPUs.
    pub fn gpu_demand(&self) -> Option<shard_planner::GpuDemand> {
        (self.gpus_per_rank > 0).then_some(shard_planner::GpuDemand {
            gpus_per_rank: self.gpus_per_rank,
            permille: if self.gpu_memory_permille == 0 {
                shard_planner::WHOLE_GPU_PERMILLE
            } else {
                self.gpu_memory_permille
            },
        })
    }

    /// Share of a GPU one rank holds on each of its GPUs, in thousandths (0 without GPUs).
    pub fn gpu_share_permille(&self) -> u32 {
        self.gpu_demand().map_or(0, |d| d.permille)
    }

    /// The bytes of the spec's variable-size strings, each with a per-string allowance
    /// (quotes, comma): the part of its encoded size that varies.
    pub fn approx_string_bytes(&self) -> usize {
        self.name.len()
            + self
                .command
                .iter()
                .map(|a| a.len() + PER_STRING_BYTES)
                .sum::<usize>()
            + self
                .env
                .iter()
                .map(|(k, v)| k.len() + v.len() + 2 * PER_STRING_BYTES)
                .sum::<usize>()
            + self.dataset.len()
            + self.ckpt_dir.len()
            + self.working_dir.len()
            + self.ckpt_url.len()
            + self.ckpt_commit_tier.len()
            + self.resume_from.as_ref().map_or(0, |r| r.job_id.len())
            + self
                .workdir
                .as_ref()
                .map_or(0, |w| w.digest.len() + 2 * PER_STRING_BYTES)
            + self
                .environment
                .as_ref()
                .map_or(0, Environment::approx_string_bytes)
            + self
                .warm_imports
                .iter()
                .map(|m| m.len() + PER_STRING_BYTES)
                .sum::<usize>()
    }

    /// True when the job checkpoints (a local root, an S3 target, or both).
    pub fn ckpt_enabled(&self) -> bool {
        !self.ckpt_dir.is_empty() || !self.ckpt_url.is_empty()
    }

    /// Checks every field against the limits of this module; `max_world_size` is the
    /// cluster's own limit (≤ [`MAX_WORLD_SIZE`]).
    ///
    /// # Errors
    /// The first invalid field, as a [`SpecError`] (its text is what a user sees).
    pub fn validate(&self, max_world_size: u32) -> Result<(), SpecError> {
        self.validate_world_size(max_world_size)?;
        if self.name.len() > MAX_JOB_NAME_BYTES {
            return Err(SpecError::NameTooLong);
        }
        if self.command.is_empty() || self.command[0].trim().is_empty() {
            return Err(SpecError::EmptyCommand);
        }
        if self.command.len() > MAX_COMMAND_ARGS {
            return Err(SpecError::TooManyArgs {
                count: self.command.len(),
            });
        }
        if let Some(a) = self
            .command
            .iter()
            .find(|a| a.len() > MAX_ARG_BYTES || a.contains('\0'))
        {
            return Err(SpecError::BadArg {
                prefix: a.chars().take(32).collect(),
            });
        }
        if self.env.len() > MAX_ENV_ENTRIES {
            return Err(SpecError::TooManyEnv);
        }
        for (k, v) in &self.env {
            let key_ok = !k.is_empty()
                && k.len() <= MAX_ARG_BYTES
                && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                && !k.as_bytes()[0].is_ascii_digit();
            if !key_ok {
                return Err(SpecError::BadEnvKey { key: k.clone() });
            }
            if v.len() > MAX_ARG_BYTES || v.contains('\0') {
                return Err(SpecError::BadEnvValue { key: k.clone() });
            }
        }
        for (field, path) in [
            ("dataset", &self.dataset),
            ("ckpt_dir", &self.ckpt_dir),
            ("working_dir", &self.working_dir),
        ] {
            let s3_dataset = field == "dataset" && path.starts_with("s3://");
            if !path.is_empty()
                && ((!path.starts_with('/') && !s3_dataset)
                    || path.len() > MAX_ARG_BYTES
                    || path.contains('\0'))
            {
                return Err(SpecError::NotAbsolute {
                    field,
                    path: path.clone(),
                });
            }
        }
        if !self.ckpt_url.is_empty()
            && (!self.ckpt_url.starts_with("s3://")
                || self.ckpt_url.len() > MAX_ARG_BYTES
                || self.ckpt_url.contains('\0'))
        {
            return Err(SpecError::BadCkptUrl {
                url: self.ckpt_url.clone(),
            });
        }
        let tier = CommitTier::from_spec(&self.ckpt_commit_tier).map_err(|_| {
            SpecError::BadCommitTier {
                tier: self.ckpt_commit_tier.clone(),
            }
        })?;
        if tier == CommitTier::L1 && (self.ckpt_url.is_empty() || self.ckpt_dir.is_empty()) {
            return Err(SpecError::L1NeedsBothTiers);
        }
        if self.ckpt_keep == 0 || self.ckpt_keep > MAX_CKPT_KEEP {
            return Err(SpecError::CkptKeep);
        }
        let r = &self.restart;
        if r.max_restarts > MAX_RESTART_BUDGET {
            return Err(SpecError::RestartBudget {
                max_restarts: r.max_restarts,
            });
        }
        if r.backoff_initial_ms > MAX_BACKOFF_MS || r.backoff_max_ms > MAX_BACKOFF_MS {
            return Err(SpecError::BackoffTooLong);
        }
        if r.backoff_max_ms < r.backoff_initial_ms {
            return Err(SpecError::BackoffOrder {
                initial_ms: r.backoff_initial_ms,
                max_ms: r.backoff_max_ms,
            });
        }
        if self.progress_timeout_ms > MAX_PROGRESS_TIMEOUT_MS {
            return Err(SpecError::ProgressTimeout);
        }
        if self.startup_timeout_ms > MAX_STARTUP_TIMEOUT_MS {
            return Err(SpecError::StartupTimeout {
                startup_timeout_ms: self.startup_timeout_ms,
            });
        }
        if self.stop_grace_ms > MAX_STOP_GRACE_MS {
            return Err(SpecError::StopGrace);
        }
        if !(-MAX_PRIORITY..=MAX_PRIORITY).contains(&self.priority) {
            return Err(SpecError::Priority {
                priority: self.priority,
            });
        }
        if self.time_limit_ms > MAX_TIME_LIMIT_MS {
            return Err(SpecError::TimeLimit);
        }
        if self.signal_before_ms > 0 && self.signal_before_ms >= self.time_limit_ms {
            return Err(SpecError::SignalBefore {
                signal_before_ms: self.signal_before_ms,
                time_limit_ms: self.time_limit_ms,
            });
        }
        if let Some(from) = &self.resume_from {
            if !is_job_id(&from.job_id) {
                return Err(SpecError::ResumeFrom {
                    why: format!(
                        "{} is not a job id (job-NNNNNN)",
                        cumulus_api::text::escape_control(&from.job_id)
                    ),
                });
            }
            if !self.ckpt_enabled() {
                return Err(SpecError::ResumeFrom {
                    why: "the job has no checkpoint target (ckpt_dir or ckpt_url)".into(),
                });
            }
        }
        if self.gpus_per_rank as usize > MAX_GPUS_PER_WORKER {
            return Err(SpecError::GpusPerRank {
                gpus_per_rank: self.gpus_per_rank,
            });
        }
        if self.gpu_memory_permille >= cumulus_api::gpus::WHOLE_GPU_PERMILLE
            || (self.gpu_memory_permille > 0 && self.gpus_per_rank != 1)
        {
            return Err(SpecError::GpuShare);
        }
        self.straggler
            .validate()
            .map_err(|why| SpecError::Straggler { why })?;
        cumulus_api::warm::check(self.warm_spares, &self.warm_imports, &self.command)
            .map_err(|why| SpecError::WarmSpares { why })?;
        self.validate_code()
    }

    /// Checks the world size: `1..=max_world_size` (at most [`MAX_WORLD_SIZE`]) ranks, or
    /// an elastic range `min_world_size..=world_size`, which a fork cannot have.
    fn validate_world_size(&self, max_world_size: u32) -> Result<(), SpecError> {
        let max_world_size = max_world_size.min(MAX_WORLD_SIZE);
        if self.world_size == 0 || self.world_size > max_world_size {
            return Err(SpecError::WorldSize {
                world_size: self.world_size,
                max: max_world_size,
            });
        }
        if self.min_world_size > self.world_size {
            return Err(SpecError::MinWorldSize {
                min_world_size: self.min_world_size,
                world_size: self.world_size,
            });
        }
        if self.is_elastic() && self.resume_from.is_some() {
            return Err(SpecError::ElasticFork);
        }
        Ok(())
    }

    /// Checks what the job brings with it: its packed working directory and its
    /// Python environment.
    fn validate_code(&self) -> Result<(), SpecError> {
        if let Some(w) = &self.workdir {
            if !w.is_valid() {
                return Err(SpecError::BadWorkdir {
                    digest: w.digest.chars().take(80).collect(),
                    size_bytes: w.size_bytes,
                });
            }
            if !self.working_dir.is_empty() {
                return Err(SpecError::WorkdirAndWorkingDir);
            }
        }
        let Some(env) = &self.environment else {
            return Ok(());
        };
        if env.requirements.len() > MAX_REQUIREMENTS_BYTES || env.requirements.contains('\0') {
            return Err(SpecError::Requirements {
                bytes: env.requirements.len(),
            });
        }
        if !is_valid_python_version(&env.python) {
            return Err(SpecError::PythonVersion {
                python: env.python.chars().take(32).collect(),
            });
        }
        if env.find_links.len() > MAX_FIND_LINKS {
            return Err(SpecError::TooManyFindLinks {
                count: env.find_links.len(),
            });
        }
        for (field, value) in std::iter::once(("index_url", &env.index_url))
            .chain(env.find_links.iter().map(|l| ("find_links", l)))
        {
            if value.len() > MAX_ARG_BYTES || value.contains(['\0', '\n', '\r']) {
                return Err(SpecError::BadIndexOption {
                    field,
                    prefix: value.chars().take(32).collect(),
                });
            }
        }
        Ok(())
    }
}

/// Longest progress timeout a job may ask for: 7 days, in milliseconds.
pub const MAX_PROGRESS_TIMEOUT_MS: u64 = 7 * 24 * 3_600_000;

/// Why [`JobSpec::validate`] refused a spec: the first invalid field. The coordinator
/// answers it as `InvalidArgument` (HTTP 400) with this text; `apply` rejects the
/// command with it (a replica never applies an invalid spec, whichever leader sent it).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// `warm_spares` or `warm_imports` is out of bounds or does not fit the command
    /// ([`cumulus_api::warm::check`]).
    #[error("{why}")]
    WarmSpares {
        /// What is wrong, naming the field.
        why: String,
    },
    /// `min_world_size` is above `world_size` (the most ranks).
    #[error(
        "min_world_size {min_world_size} is above world_size {world_size}: an elastic \
         world size MIN:MAX needs 1 <= MIN <= MAX"
    )]
    MinWorldSize {
        /// The fewest ranks asked for.
        min_world_size: u32,
        /// The most ranks.
        world_size: u32,
    },
    /// An elastic job named `resume_from`: a fork keeps the world size of the job it
    /// starts from.
    #[error(
        "min_world_size: an elastic job cannot start from another job's step \
         (resume_from keeps that job's world size)"
    )]
    ElasticFork,
    /// `world_size` is 0 or above the cluster's limit `max`.
    #[error("world size {world_size} is out of range: it must be between 1 and {max}")]
    WorldSize {
        /// The requested world size.
        world_size: u32,
        /// The cluster's limit (at most [`MAX_WORLD_SIZE`]).
        max: u32,
    },
    /// The name is over [`MAX_JOB_NAME_BYTES`].
    #[error("job name is longer than {MAX_JOB_NAME_BYTES} bytes")]
    NameTooLong,
    /// No program, or a blank one.
    #[error("the command is empty: give the program to run after `--`")]
    EmptyCommand,
    /// More than [`MAX_COMMAND_ARGS`] arguments.
    #[error("the command has {count} arguments, more than the limit of {MAX_COMMAND_ARGS}")]
    TooManyArgs {
        /// The number of arguments given (program included).
        count: usize,
    },
    /// An argument over [`MAX_ARG_BYTES`] or holding NUL; `prefix` is its first 32
    /// characters.
    #[error("command argument {prefix:?}… is longer than {MAX_ARG_BYTES} bytes or contains NUL")]
    BadArg {
        /// The first 32 characters of the argument.
        prefix: String,
    },
    /// More than [`MAX_ENV_ENTRIES`] environment entries.
    #[error("more than {MAX_ENV_ENTRIES} env entries")]
    TooManyEnv,
    /// An environment key that is not `[A-Za-z_][A-Za-z0-9_]*` of at most
    /// [`MAX_ARG_BYTES`].
    #[error("env key {key:?} is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)")]
    BadEnvKey {
        /// The key as given.
        key: String,
    },
    /// An environment value over [`MAX_ARG_BYTES`] or holding NUL.
    #[error("env value of {key} is longer than {MAX_ARG_BYTES} bytes or contains NUL")]
    BadEnvValue {
        /// The key whose value is invalid.
        key: String,
    },
    /// `dataset`, `ckpt_dir` or `working_dir` is not an absolute path (a dataset may
    /// also be `s3://`), is too long or holds NUL.
    #[error("{field} {path:?} must be an absolute path")]
    NotAbsolute {
        /// The spec field: `dataset`, `ckpt_dir` or `working_dir`.
        field: &'static str,
        /// The path as given.
        path: String,
    },
    /// `ckpt_url` is not an `s3://bucket/prefix` URL.
    #[error("ckpt_url {url:?} must be an s3://bucket/prefix URL")]
    BadCkptUrl {
        /// The URL as given.
        url: String,
    },
    /// `ckpt_commit_tier` is neither empty, `l1` nor `l2`.
    #[error("ckpt_commit_tier {tier:?} must be l1 or l2")]
    BadCommitTier {
        /// The tier as given.
        tier: String,
    },
    /// Tier `l1` without both a checkpoint URL and a shared checkpoint dir.
    #[error("ckpt_commit_tier l1 needs both ckpt_url (L2) and a shared ckpt_dir (L1)")]
    L1NeedsBothTiers,
    /// `ckpt_keep` is 0 or above [`MAX_CKPT_KEEP`].
    #[error("ckpt_keep must be between 1 and {MAX_CKPT_KEEP}")]
    CkptKeep,
    /// The restart budget is above [`MAX_RESTART_BUDGET`].
    #[error("max_restarts {max_restarts} is above the limit of {MAX_RESTART_BUDGET}")]
    RestartBudget {
        /// The requested budget.
        max_restarts: u32,
    },
    /// A backoff delay above [`MAX_BACKOFF_MS`].
    #[error("backoff delays must be at most {MAX_BACKOFF_MS} ms")]
    BackoffTooLong,
    /// The backoff cap is below the first delay.
    #[error("backoff_max_ms ({max_ms}) is below backoff_initial_ms ({initial_ms})")]
    BackoffOrder {
        /// The first delay, in milliseconds.
        initial_ms: u64,
        /// The cap, in milliseconds.
        max_ms: u64,
    },
    /// The progress timeout is above [`MAX_PROGRESS_TIMEOUT_MS`].
    #[error("progress timeout is above 7 days")]
    ProgressTimeout,
    /// The startup timeout is above [`MAX_STARTUP_TIMEOUT_MS`].
    #[error(
        "startup timeout of {startup_timeout_ms} ms is above 7 days ({MAX_STARTUP_TIMEOUT_MS} ms)"
    )]
    StartupTimeout {
        /// The timeout asked for, in milliseconds.
        startup_timeout_ms: u64,
    },
    /// A stop grace above [`MAX_STOP_GRACE_MS`].
    #[error("stop grace is above 1 hour")]
    StopGrace,
    /// A priority outside `-MAX_PRIORITY..=MAX_PRIORITY`.
    #[error("priority {priority} is outside -{MAX_PRIORITY}..={MAX_PRIORITY}")]
    Priority {
        /// The requested priority.
        priority: i32,
    },
    /// `resume_from` names no valid job id, or the job has no checkpoint target.
    #[error("resume_from: {why}")]
    ResumeFrom {
        /// What is wrong.
        why: String,
    },
    /// A time limit above [`MAX_TIME_LIMIT_MS`].
    #[error("time limit is above 365 days")]
    TimeLimit,
    /// A signal-before without a time limit, or not shorter than it.
    #[error(
        "signal_before_ms ({signal_before_ms}) must be below the time limit ({time_limit_ms} ms; 0 = none)"
    )]
    SignalBefore {
        /// The requested notice, in milliseconds.
        signal_before_ms: u64,
        /// The job's time limit, in milliseconds.
        time_limit_ms: u64,
    },
    /// More GPUs per rank than [`MAX_GPUS_PER_WORKER`]: no worker could hold a rank.
    #[error("gpus_per_rank {gpus_per_rank} is above the limit of {MAX_GPUS_PER_WORKER}")]
    GpusPerRank {
        /// The requested count.
        gpus_per_rank: u32,
    },
    /// A GPU memory share with several GPUs per rank, or not below a whole GPU.
    #[error(
        "a GPU memory fraction below 1 applies to one GPU per rank (gpus_per_rank 1), in thousandths 1..=999"
    )]
    GpuShare,
    /// The straggler fraction or window is out of bounds ([`StragglerPolicy::validate`]).
    #[error("{why}")]
    Straggler {
        /// What is wrong, naming the field.
        why: String,
    },
    /// A workdir reference whose digest is not 64 lowercase hex digits, or whose size is
    /// 0 or above [`MAX_BLOB_BYTES`].
    #[error(
        "workdir {digest:?} of {size_bytes} bytes is not a blob: it needs a BLAKE3 digest \
         (64 lowercase hex digits) and a size between 1 and {MAX_BLOB_BYTES} bytes"
    )]
    BadWorkdir {
        /// The digest as given (its first 80 characters).
        digest: String,
        /// The size as given, in bytes.
        size_bytes: u64,
    },
    /// Both a packed workdir and a `working_dir` path on the workers.
    #[error(
        "workdir (an uploaded directory) and working_dir (a path on the workers) exclude each other"
    )]
    WorkdirAndWorkingDir,
    /// Requirements over [`MAX_REQUIREMENTS_BYTES`] or holding NUL.
    #[error(
        "environment requirements ({bytes} bytes) are longer than {MAX_REQUIREMENTS_BYTES} bytes or contain NUL"
    )]
    Requirements {
        /// Their length, in bytes.
        bytes: usize,
    },
    /// A Python version that is not `3.X` or `3.X.Y`.
    #[error("environment python {python:?} must be 3.X or 3.X.Y")]
    PythonVersion {
        /// The version as given (its first 32 characters).
        python: String,
    },
    /// More than [`MAX_FIND_LINKS`] find-links entries.
    #[error("environment has {count} find_links entries, more than the limit of {MAX_FIND_LINKS}")]
    TooManyFindLinks {
        /// The number given.
        count: usize,
    },
    /// An index URL or find-links entry over [`MAX_ARG_BYTES`], or holding NUL or a
    /// line break.
    #[error(
        "environment {field} {prefix:?}… is longer than {MAX_ARG_BYTES} bytes or contains NUL or a line break"
    )]
    BadIndexOption {
        /// `index_url` or `find_links`.
        field: &'static str,
        /// The value's first 32 characters.
        prefix: String,
    },
}
