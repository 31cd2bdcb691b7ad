//! The replicated state of a Cumulus cluster and the pure, deterministic `apply` of
//! [`Command`]s to it.
//!
//! `apply` reads no clock, draws no random number and does no I/O: every time and every
//! jittered delay is stamped into the command by the leader that proposed it
//! (DESIGN.md, "The replicated state"). Every command is validated here too, so a stale
//! or malformed command that reaches the log changes nothing and is answered with
//! [`Response::Rejected`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

pub use cumulus_api::limits::{
    MAX_ARG_BYTES, MAX_BACKOFF_MS, MAX_CKPT_KEEP, MAX_COMMAND_ARGS, MAX_ENV_ENTRIES,
    MAX_JOB_NAME_BYTES, MAX_REQUEST_ID_BYTES, MAX_RESTART_BUDGET, MAX_SHARDS, MAX_WORLD_SIZE,
};
pub use cumulus_api::{CommitTier, FileEntry, JobState, RankState, RestartScope};
use serde::{Deserialize, Serialize};

/// Upper bound on jobs kept in the state; the oldest finished jobs are dropped first.
pub const MAX_JOBS_RETAINED: usize = 10_000;
/// Upper bound on the jobs' estimated encoded size ([`Job::approx_encoded_bytes`]), in
/// bytes: past it `apply` drops the oldest finished jobs (as past
/// [`MAX_JOBS_RETAINED`]), and the leader refuses submits once the unfinished jobs
/// alone would pass it (coordinator `--max-state-bytes`, at most this). Half the 2 GiB
/// snapshot a follower accepts: the state is what a snapshot carries, and a follower
/// that needs a snapshot it cannot receive never catches up.
pub const MAX_STATE_BYTES: u64 = 1 << 30;
/// Upper bound on uncommitted checkpoint steps tracked per job (oldest dropped first).
pub const MAX_PENDING_CKPT_STEPS: usize = 64;
/// Most restarts a job is given, besides its restart budget, after attempts that could
/// not start because of a resource error of the agent (no descriptors, memory, disk or
/// process slot): those are the worker's failures, not the rank's, and spend no budget,
/// but a worker that stays broken must not restart a job forever.
pub const MAX_AGENT_FAULT_RESTARTS: u32 = 20;
/// Base of the MASTER_PORT range handed to jobs.
pub const MASTER_PORT_BASE: u32 = 29_500;
/// Size of the MASTER_PORT range.
pub const MASTER_PORT_SPAN: u32 = 10_000;
/// Jitter of a restart delay, as a fraction of the base delay (±20%).
pub const BACKOFF_JITTER_FRACTION: f64 = 0.2;

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
    /// Restart policy.
    pub restart: RestartPolicy,
    /// Hang detection: no progress for this long fails the rank (0 = off), in milliseconds.
    pub progress_timeout_ms: u64,
    /// Working directory of the ranks ("" = the worker's).
    pub working_dir: String,
    /// S3 checkpoint target `s3://bucket/prefix` ("" = none).
    #[serde(default)]
    pub ckpt_url: String,
    /// Commit tier with an S3 target: "l1" or "l2" ("" = l2).
    #[serde(default)]
    pub ckpt_commit_tier: String,
}

impl JobSpec {
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
    }

    /// True when the job checkpoints (a local root, an S3 target, or both).
    pub fn ckpt_enabled(&self) -> bool {
        !self.ckpt_dir.is_empty() || !self.ckpt_url.is_empty()
    }

    /// Checks every field against the limits of this module; `max_world_size` is the
    /// cluster's own limit (≤ [`MAX_WORLD_SIZE`]).
    ///
    /// # Errors
    /// A message naming the first invalid field.
    pub fn validate(&self, max_world_size: u32) -> Result<(), String> {
        let max_world_size = max_world_size.min(MAX_WORLD_SIZE);
        if self.world_size == 0 || self.world_size > max_world_size {
            return Err(format!(
                "world size {} is out of range: it must be between 1 and {max_world_size}",
                self.world_size
            ));
        }
        if self.name.len() > MAX_JOB_NAME_BYTES {
            return Err(format!(
                "job name is longer than {MAX_JOB_NAME_BYTES} bytes"
            ));
        }
        if self.command.is_empty() || self.command[0].trim().is_empty() {
            return Err("the command is empty: give the program to run after `--`".into());
        }
        if self.command.len() > MAX_COMMAND_ARGS {
            return Err(format!(
                "the command has {} arguments, more than the limit of {MAX_COMMAND_ARGS}",
                self.command.len()
            ));
        }
        if let Some(a) = self
            .command
            .iter()
            .find(|a| a.len() > MAX_ARG_BYTES || a.contains('\0'))
        {
            return Err(format!(
                "command argument {:?}… is longer than {MAX_ARG_BYTES} bytes or contains NUL",
                a.chars().take(32).collect::<String>()
            ));
        }
        if self.env.len() > MAX_ENV_ENTRIES {
            return Err(format!("more than {MAX_ENV_ENTRIES} env entries"));
        }
        for (k, v) in &self.env {
            let key_ok = !k.is_empty()
                && k.len() <= MAX_ARG_BYTES
                && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                && !k.as_bytes()[0].is_ascii_digit();
            if !key_ok {
                return Err(format!(
                    "env key {k:?} is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)"
                ));
            }
            if v.len() > MAX_ARG_BYTES || v.contains('\0') {
                return Err(format!(
                    "env value of {k} is longer than {MAX_ARG_BYTES} bytes or contains NUL"
                ));
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
                return Err(format!("{field} {path:?} must be an absolute path"));
            }
        }
        if !self.ckpt_url.is_empty()
            && (!self.ckpt_url.starts_with("s3://")
                || self.ckpt_url.len() > MAX_ARG_BYTES
                || self.ckpt_url.contains('\0'))
        {
            return Err(format!(
                "ckpt_url {:?} must be an s3://bucket/prefix URL",
                self.ckpt_url
            ));
        }
        let tier = CommitTier::from_spec(&self.ckpt_commit_tier).map_err(|_| {
            format!(
                "ckpt_commit_tier {:?} must be l1 or l2",
                self.ckpt_commit_tier
            )
        })?;
        if tier == CommitTier::L1 && (self.ckpt_url.is_empty() || self.ckpt_dir.is_empty()) {
            return Err(
                "ckpt_commit_tier l1 needs both ckpt_url (L2) and a shared ckpt_dir (L1)".into(),
            );
        }
        if self.ckpt_keep == 0 || self.ckpt_keep > MAX_CKPT_KEEP {
            return Err(format!("ckpt_keep must be between 1 and {MAX_CKPT_KEEP}"));
        }
        let r = &self.restart;
        if r.max_restarts > MAX_RESTART_BUDGET {
            return Err(format!(
                "max_restarts {} is above the limit of {MAX_RESTART_BUDGET}",
                r.max_restarts
            ));
        }
        if r.backoff_initial_ms > MAX_BACKOFF_MS || r.backoff_max_ms > MAX_BACKOFF_MS {
            return Err(format!(
                "backoff delays must be at most {MAX_BACKOFF_MS} ms"
            ));
        }
        if r.backoff_max_ms < r.backoff_initial_ms {
            return Err(format!(
                "backoff_max_ms ({}) is below backoff_initial_ms ({})",
                r.backoff_max_ms, r.backoff_initial_ms
            ));
        }
        if self.progress_timeout_ms > 7 * 24 * 3_600_000 {
            return Err("progress timeout is above 7 days".into());
        }
        Ok(())
    }
}

/// One rank of a job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankRecord {
    /// Rank number, 0..world_size.
    pub rank: u32,
    /// Current attempt number (0 = first run).
    pub attempt: u32,
    /// Worker of the current attempt.
    pub worker_id: Option<String>,
    /// State of the current attempt.
    pub state: RankState,
    /// LOCAL_RANK of the current placement.
    pub local_rank: u32,
    /// LOCAL_WORLD_SIZE of the current placement.
    pub local_world_size: u32,
    /// Exit code of the current attempt, once exited.
    pub exit_code: Option<i32>,
    /// Terminating signal of the current attempt, once exited.
    pub signal: Option<i32>,
    /// Why the current attempt failed, when it did.
    pub failure: Option<String>,
    /// Leader time the attempt started, ms since the Unix epoch (0 = not yet).
    pub started_at_ms: u64,
    /// Leader time the attempt exited or failed (0 = not yet).
    pub exited_at_ms: u64,
    /// OS pid of the current attempt (0 = not started).
    pub pid: u32,
    /// The attempt may start no earlier than this leader time (backoff).
    pub not_before_ms: u64,
    /// Checkpoint step this attempt resumes from.
    pub resume_step: Option<u64>,
    /// Part directory (relative to the job's checkpoint dir) this attempt resumes from.
    pub resume_dir: String,
    /// Worker of every attempt so far, `(attempt, worker_id)`, for log retrieval.
    pub attempt_workers: Vec<(u32, String)>,
    /// The current attempt failed because its agent could not start it for lack of a
    /// local resource (descriptors, memory, disk, process slots): not the rank's fault.
    #[serde(default)]
    pub agent_fault: bool,
}

/// One restart decided by the leader.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestartRecord {
    /// 1-based restart number within the job.
    pub number: u32,
    /// Leader time of the failure that caused it.
    pub failed_at_ms: u64,
    /// Jittered delay stamped by the leader, in milliseconds.
    pub delay_ms: u64,
    /// `failed_at_ms + delay_ms`.
    pub not_before_ms: u64,
    /// Human-readable cause.
    pub cause: String,
    /// Ranks restarted.
    pub ranks: Vec<u32>,
    /// Step resumed from.
    pub resume_step: Option<u64>,
    /// A restart after agent resource errors only ([`MAX_AGENT_FAULT_RESTARTS`]): it
    /// spent none of the job's restart budget (`number` is the budget's count then).
    #[serde(default)]
    pub agent_fault: bool,
}

/// A checkpoint part accepted from a rank attempt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartInfo {
    /// Rank.
    pub rank: u32,
    /// Attempt that wrote it.
    pub attempt: u32,
    /// Directory relative to the job's checkpoint dir.
    pub dir: String,
    /// Files with sizes and checksums.
    pub files: Vec<FileEntry>,
    /// The rank's resume state (JSON text, ≤ 64 KiB).
    pub state_json: String,
}

/// A job and everything the cluster knows about it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    /// `job-NNNNNN`.
    pub id: String,
    /// Sequence number the id was made from.
    pub seq: u64,
    /// Idempotency key of the submit.
    pub request_id: String,
    /// The validated spec.
    pub spec: JobSpec,
    /// Shards of each rank (index = rank), fixed at submit.
    pub shard_plan: Vec<Vec<String>>,
    /// Total shards.
    pub shard_count: u32,
    /// Lifecycle state.
    pub state: JobState,
    /// Leader time of the submit.
    pub submitted_at_ms: u64,
    /// Leader time the job reached a terminal state (0 = not yet).
    pub finished_at_ms: u64,
    /// Why it failed or was cancelled.
    pub failure_cause: Option<String>,
    /// Ranks, index = rank.
    pub ranks: Vec<RankRecord>,
    /// Restarts used from the budget.
    pub restarts_used: u32,
    /// Every restart.
    pub restarts: Vec<RestartRecord>,
    /// Restarts given after agent resource errors only, outside the restart budget
    /// (at most [`MAX_AGENT_FAULT_RESTARTS`]).
    #[serde(default)]
    pub agent_fault_restarts: u32,
    /// MASTER_PORT of the current attempt.
    pub master_port: u32,
    /// Parts received for steps not yet committed: step → rank → part.
    pub pending_parts: BTreeMap<u64, BTreeMap<u32, PartInfo>>,
    /// Committed steps still kept (ascending, at most `ckpt_keep`) with their parts (index = rank).
    pub committed: BTreeMap<u64, Vec<PartInfo>>,
    /// Newest committed step.
    pub committed_step: Option<u64>,
}

impl Job {
    /// True when every rank's current attempt exited 0.
    pub fn all_ranks_succeeded(&self) -> bool {
        self.ranks.iter().all(|r| r.state == RankState::Exited)
    }

    /// An estimate of the job's serde_json size, in bytes: [`Job::approx_static_bytes`]
    /// plus [`Job::approx_dynamic_bytes`]. Meant to be at least the real size for text
    /// without characters JSON escapes and at most a few times it (tested against real
    /// encodings); the state's byte budget ([`MAX_STATE_BYTES`]) counts it.
    pub fn approx_encoded_bytes(&self) -> u64 {
        self.approx_static_bytes() + self.approx_dynamic_bytes()
    }

    /// The part of [`Job::approx_encoded_bytes`] fixed at submit: the spec, the shard
    /// plan and a fixed allowance for the scalar fields.
    pub fn approx_static_bytes(&self) -> u64 {
        submit_static_bytes(&self.spec, self.shard_plan.iter().flatten())
            + (self.id.len() + self.request_id.len()) as u64
    }

    /// The part of [`Job::approx_encoded_bytes`] that changes as the job runs: ranks,
    /// restarts, checkpoint parts, failure cause. O(ranks + restarts + parts).
    pub fn approx_dynamic_bytes(&self) -> u64 {
        let ranks: usize = self
            .ranks
            .iter()
            .map(|r| {
                RANK_BYTES
                    + r.worker_id.as_ref().map_or(0, String::len)
                    + r.failure.as_ref().map_or(0, String::len)
                    + r.resume_dir.len()
                    + r.attempt_workers
                        .iter()
                        .map(|(_, w)| w.len() + 2 * PER_STRING_BYTES)
                        .sum::<usize>()
            })
            .sum();
        let restarts: usize = self
            .restarts
            .iter()
            .map(|r| RESTART_BYTES + r.cause.len() + 11 * r.ranks.len())
            .sum();
        let parts: usize = self
            .pending_parts
            .values()
            .flat_map(BTreeMap::values)
            .chain(self.committed.values().flatten())
            .map(|p| {
                PART_BYTES
                    + p.dir.len()
                    // JSON text inside a JSON string: its quotes get escaped.
                    + 2 * p.state_json.len()
                    + p.files
                        .iter()
                        .map(|f| PART_FILE_BYTES + f.path.len() + f.digest.len())
                        .sum::<usize>()
            })
            .sum();
        (ranks + restarts + parts + self.failure_cause.as_ref().map_or(0, String::len)) as u64
    }
}

/// Allowance per string of the estimates (quotes, comma, escapes of ordinary text), in
/// bytes.
const PER_STRING_BYTES: usize = 8;
/// Allowance for a job's field names and scalar fields, and its spec's, in bytes.
const JOB_BYTES: usize = 2_048;
/// Allowance for one rank record's field names and scalar fields, in bytes.
const RANK_BYTES: usize = 512;
/// Allowance for one restart record's field names and scalar fields, in bytes.
const RESTART_BYTES: usize = 256;
/// Allowance for one checkpoint part's field names and scalar fields, in bytes.
const PART_BYTES: usize = 256;
/// Allowance for one checkpoint part file's field names and size, in bytes.
const PART_FILE_BYTES: usize = 64;

/// The estimated encoded size of a job submitted with `spec` and `shards` before it
/// runs ([`Job::approx_static_bytes`] without its ids), in bytes; the leader checks a
/// submit against the state's byte budget with it.
pub fn submit_static_bytes<'a>(spec: &JobSpec, shards: impl Iterator<Item = &'a String>) -> u64 {
    let shard_bytes: usize = shards.map(|s| s.len() + PER_STRING_BYTES).sum();
    (JOB_BYTES + spec.approx_string_bytes() + shard_bytes) as u64
}

/// The estimated size of a job that has not run yet, in bytes: what a submit adds to
/// the state ([`submit_static_bytes`] plus its unplaced ranks).
pub fn submit_bytes(spec: &JobSpec, shards: &[String]) -> u64 {
    submit_static_bytes(spec, shards.iter()) + RANK_BYTES as u64 * u64::from(spec.world_size)
}

/// Whether a worker is heartbeating.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerState {
    /// Registered and not expired.
    Alive,
    /// Silent for longer than the heartbeat timeout; must register again.
    Expired,
}

/// A worker agent known to the cluster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// Worker id.
    pub worker_id: String,
    /// Host ranks use to reach it (MASTER_ADDR).
    pub host: String,
    /// Agent HTTP API, `host:port`.
    pub http_addr: String,
    /// Rank slots offered.
    pub slots: u32,
    /// Alive or expired.
    pub state: WorkerState,
    /// Leader time of the latest registration.
    pub registered_at_ms: u64,
    /// Leader time of expiry (0 = alive).
    pub expired_at_ms: u64,
}

/// The whole replicated state.
///
/// Besides the replicated data it carries a derived [`JobIndex`], never serialized:
/// [`ClusterState::apply`] keeps it current, deserialization rebuilds it, and code that
/// fills `jobs` by hand must call [`ClusterState::rebuild_index`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "ClusterStateData")]
pub struct ClusterState {
    /// Sequence number of the next job id.
    pub next_job_seq: u64,
    /// Jobs by id. Each job is shared (`Arc`, changed through `Arc::make_mut`) so that
    /// cloning the state for a snapshot copies pointers, not every job: a deep clone of
    /// 30,000 jobs held the apply lock for over a second (docs/perf-notes.md, "Snapshots").
    pub jobs: BTreeMap<String, Arc<Job>>,
    /// Submit idempotency: request id → job id.
    pub request_ids: BTreeMap<String, String>,
    /// Workers by id.
    pub workers: BTreeMap<String, WorkerRecord>,
    /// Job ids by lifecycle class (derived from `jobs`).
    #[serde(skip)]
    index: JobIndex,
}

/// The serialized fields of [`ClusterState`]; deserializing goes through it so that the
/// derived index is always rebuilt.
#[derive(Deserialize)]
struct ClusterStateData {
    next_job_seq: u64,
    jobs: BTreeMap<String, Arc<Job>>,
    request_ids: BTreeMap<String, String>,
    workers: BTreeMap<String, WorkerRecord>,
}

impl From<ClusterStateData> for ClusterState {
    fn from(d: ClusterStateData) -> ClusterState {
        let mut state = ClusterState {
            next_job_seq: d.next_job_seq,
            jobs: d.jobs,
            request_ids: d.request_ids,
            workers: d.workers,
            index: JobIndex::default(),
        };
        state.rebuild_index();
        state
    }
}

/// Job ids by lifecycle class, in id order (which is submission order: ids are
/// zero-padded sequence numbers). Derived from [`ClusterState::jobs`]: it lets the
/// leader's planner visit only the jobs that can change (pending ones only while there
/// is capacity) and the bounded-state eviction find the oldest terminal jobs without a
/// scan of every retained job, which cost O(jobs) per submit and per planner pass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobIndex {
    /// Pending jobs (waiting for a placement).
    pub pending: BTreeSet<String>,
    /// Running jobs (placed).
    pub running: BTreeSet<String>,
    /// Succeeded, failed or cancelled jobs.
    pub terminal: BTreeSet<String>,
    /// Each job's estimated encoded size ([`Job::approx_encoded_bytes`]), as of the last
    /// command that touched it.
    bytes: HashMap<String, JobBytes>,
    /// Sum of `bytes`, in bytes.
    total_bytes: u64,
    /// Sum of `bytes` over terminal jobs, in bytes.
    terminal_bytes: u64,
}

/// One job's estimated encoded size, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct JobBytes {
    /// [`Job::approx_static_bytes`], computed once: it cannot change.
    fixed: u64,
    /// Fixed plus [`Job::approx_dynamic_bytes`].
    total: u64,
}

impl JobIndex {
    /// Files `job_id` under the class of its state and records its estimated size
    /// (`None`: the job is gone).
    fn update(&mut self, job_id: &str, job: Option<&Job>) {
        self.pending.remove(job_id);
        self.running.remove(job_id);
        let was_terminal = self.terminal.remove(job_id);
        let old = self.bytes.get(job_id).copied();
        if let Some(old) = old {
            self.total_bytes -= old.total;
            if was_terminal {
                self.terminal_bytes -= old.total;
            }
        }
        let Some(job) = job else {
            self.bytes.remove(job_id);
            return;
        };
        let fixed = old.map_or_else(|| job.approx_static_bytes(), |o| o.fixed);
        let total = fixed + job.approx_dynamic_bytes();
        self.bytes
            .insert(job_id.to_string(), JobBytes { fixed, total });
        self.total_bytes += total;
        let class = match job.state {
            JobState::Pending => &mut self.pending,
            JobState::Running => &mut self.running,
            _ => {
                self.terminal_bytes += total;
                &mut self.terminal
            }
        };
        class.insert(job_id.to_string());
    }

    /// Estimated encoded size of every job, in bytes.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Estimated encoded size of the pending and running jobs, in bytes.
    pub fn unfinished_bytes(&self) -> u64 {
        self.total_bytes - self.terminal_bytes
    }

    /// Estimated encoded size of `job_id` (0 for an unknown job), in bytes.
    pub fn job_bytes(&self, job_id: &str) -> u64 {
        self.bytes.get(job_id).map_or(0, |b| b.total)
    }
}

/// A state change, proposed by a coordinator and applied by every replica.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Create a job (or return the one `request_id` already created).
    SubmitJob {
        /// Idempotency key.
        request_id: String,
        /// Validated spec.
        spec: JobSpec,
        /// Shard paths of the dataset, sorted by name.
        shards: Vec<String>,
        /// Leader time.
        submitted_at_ms: u64,
    },
    /// Cancel a job.
    CancelJob {
        /// Job.
        job_id: String,
        /// Leader time.
        at_ms: u64,
    },
    /// A worker (re-)registers.
    RegisterWorker {
        /// Worker id.
        worker_id: String,
        /// MASTER_ADDR host.
        host: String,
        /// Agent HTTP address.
        http_addr: String,
        /// Slots.
        slots: u32,
        /// Leader time.
        at_ms: u64,
    },
    /// A worker went silent for the heartbeat timeout: its ranks fail.
    ExpireWorker {
        /// Worker id.
        worker_id: String,
        /// Leader time.
        at_ms: u64,
    },
    /// Gang placement of a pending job.
    PlaceJob {
        /// Job.
        job_id: String,
        /// `(rank, worker_id)` for every rank.
        placements: Vec<(u32, String)>,
        /// Leader time.
        at_ms: u64,
    },
    /// The agent started a rank attempt.
    RankStarted {
        /// Job.
        job_id: String,
        /// Rank.
        rank: u32,
        /// Attempt.
        attempt: u32,
        /// Reporting worker.
        worker_id: String,
        /// OS pid.
        pid: u32,
        /// Leader time.
        at_ms: u64,
    },
    /// A rank attempt's process exited (or could not start).
    RankExited {
        /// Job.
        job_id: String,
        /// Rank.
        rank: u32,
        /// Attempt.
        attempt: u32,
        /// Reporting worker.
        worker_id: String,
        /// Exit code, when it exited.
        exit_code: Option<i32>,
        /// Signal, when killed.
        signal: Option<i32>,
        /// Non-empty when it could not start.
        spawn_error: String,
        /// It could not start for lack of a resource on the agent (not the rank's fault).
        #[serde(default)]
        agent_fault: bool,
        /// Leader time.
        at_ms: u64,
    },
    /// The leader declared a running attempt failed (hung, lost by its agent).
    RankFailed {
        /// Job.
        job_id: String,
        /// Rank.
        rank: u32,
        /// Attempt.
        attempt: u32,
        /// Why.
        cause: String,
        /// Leader time.
        at_ms: u64,
    },
    /// Restart ranks with new attempt numbers after a stamped delay.
    ScheduleRestart {
        /// Job.
        job_id: String,
        /// `(rank, worker_id)` of every restarted rank.
        placements: Vec<(u32, String)>,
        /// Leader time of the failure.
        failed_at_ms: u64,
        /// Jittered delay.
        delay_ms: u64,
        /// Cause shown to users.
        cause: String,
        /// Step to resume from (the newest committed step that verified).
        resume_step: Option<u64>,
        /// Every failed rank failed for an agent resource error: the restart spends no
        /// budget (one of [`MAX_AGENT_FAULT_RESTARTS`] instead).
        #[serde(default)]
        agent_fault: bool,
    },
    /// Fail a job for good.
    FailJob {
        /// Job.
        job_id: String,
        /// Cause.
        cause: String,
        /// Leader time.
        at_ms: u64,
    },
    /// A rank attempt committed its part of a checkpoint step.
    CheckpointPartCommitted {
        /// Job.
        job_id: String,
        /// Step.
        step: u64,
        /// Part (rank, attempt, dir, files, state).
        part: PartInfo,
    },
    /// Every rank's part of `step` arrived and verified; the manifest is written.
    CheckpointCommitted {
        /// Job.
        job_id: String,
        /// Step.
        step: u64,
        /// Leader time.
        at_ms: u64,
    },
    /// Every rank of the current attempt exited 0.
    JobSucceeded {
        /// Job.
        job_id: String,
        /// Leader time.
        at_ms: u64,
    },
    /// Several commands proposed together by the leader's proposal batcher (group
    /// commit: one Raft entry, one log flush, for many client writes). Applied in order,
    /// each exactly as if it were an entry of its own; the response is
    /// [`Response::Batch`] with one response per command, in the same order. At most
    /// [`MAX_BATCH_COMMANDS`] commands, none of them a batch; a batch breaking either
    /// rule is rejected whole and changes nothing.
    Batch {
        /// The commands, in proposal order.
        commands: Vec<Command>,
    },
}

impl std::fmt::Display for Command {
    /// The command's name (and a batch's size): what openraft prints of a log entry's
    /// payload in its own logs, without the payload itself.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            Command::SubmitJob { .. } => "SubmitJob",
            Command::CancelJob { .. } => "CancelJob",
            Command::RegisterWorker { .. } => "RegisterWorker",
            Command::ExpireWorker { .. } => "ExpireWorker",
            Command::PlaceJob { .. } => "PlaceJob",
            Command::RankStarted { .. } => "RankStarted",
            Command::RankExited { .. } => "RankExited",
            Command::RankFailed { .. } => "RankFailed",
            Command::ScheduleRestart { .. } => "ScheduleRestart",
            Command::FailJob { .. } => "FailJob",
            Command::CheckpointPartCommitted { .. } => "CheckpointPartCommitted",
            Command::CheckpointCommitted { .. } => "CheckpointCommitted",
            Command::JobSucceeded { .. } => "JobSucceeded",
            Command::Batch { commands } => return write!(f, "Batch({})", commands.len()),
        };
        f.write_str(name)
    }
}

/// Most commands in one [`Command::Batch`].
pub const MAX_BATCH_COMMANDS: usize = 256;

/// Fixed allowance, in bytes, for one command's encoding besides its strings (field
/// names, numbers, punctuation); see [`Command::approx_encoded_bytes`].
const COMMAND_OVERHEAD_BYTES: usize = 512;

impl Command {
    /// An estimate of the command's encoded size in a log entry, in bytes: the lengths
    /// of its variable-size strings plus a fixed allowance per command and per string.
    /// It bounds the JSON size for text without characters JSON escapes (tested);
    /// escaped control characters can make the JSON larger. Cheap (no encoding); used to
    /// bound the size of a batch.
    pub fn approx_encoded_bytes(&self) -> usize {
        const PER_STRING: usize = PER_STRING_BYTES;
        let strings = |v: &[String]| v.iter().map(|s| s.len() + PER_STRING).sum::<usize>();
        match self {
            Command::SubmitJob {
                request_id,
                spec,
                shards,
                ..
            } => {
                COMMAND_OVERHEAD_BYTES
                    + request_id.len()
                    + spec.approx_string_bytes()
                    + strings(shards)
            }
            Command::PlaceJob { placements, .. } | Command::ScheduleRestart { placements, .. } => {
                COMMAND_OVERHEAD_BYTES
                    + placements
                        .iter()
                        .map(|(_, w)| w.len() + 2 * PER_STRING)
                        .sum::<usize>()
            }
            Command::CheckpointPartCommitted { part, .. } => {
                COMMAND_OVERHEAD_BYTES
                    + part.dir.len()
                    // JSON text inside a JSON string: its quotes get escaped.
                    + 2 * part.state_json.len()
                    + part
                        .files
                        .iter()
                        .map(|f| f.path.len() + f.digest.len() + 4 * PER_STRING)
                        .sum::<usize>()
            }
            Command::Batch { commands } => {
                COMMAND_OVERHEAD_BYTES
                    + commands
                        .iter()
                        .map(Command::approx_encoded_bytes)
                        .sum::<usize>()
            }
            _ => 2 * COMMAND_OVERHEAD_BYTES,
        }
    }
}

/// What applying a command produced.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Response {
    /// Applied (or a membership / blank entry).
    #[default]
    Ok,
    /// A submit: the job, and whether this command created it.
    JobSubmitted {
        /// Job id.
        job_id: String,
        /// False when the request id already existed.
        created: bool,
    },
    /// The command was invalid or stale and changed nothing.
    Rejected {
        /// Why.
        reason: String,
    },
    /// The responses to the commands of a [`Command::Batch`], in its order.
    Batch {
        /// One response per command.
        responses: Vec<Response>,
    },
}

fn reject(reason: impl Into<String>) -> Response {
    Response::Rejected {
        reason: reason.into(),
    }
}

/// A key of the state that a command touched (it keeps the derived [`JobIndex`] current).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum DirtyKey {
    /// A job (or its removal).
    Job(String),
    /// A worker.
    Worker(String),
    /// A request id entry (or its removal).
    RequestId(String),
    /// `next_job_seq`.
    Meta,
}

/// Returns true for ids made of 1..=64 bytes of `[A-Za-z0-9._-]`.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

impl ClusterState {
    /// Job ids by lifecycle class.
    pub fn job_index(&self) -> &JobIndex {
        &self.index
    }

    /// Rebuilds the job index from `jobs` (after filling `jobs` other than by `apply`).
    pub fn rebuild_index(&mut self) {
        let mut index = JobIndex::default();
        for (id, job) in &self.jobs {
            index.update(id, Some(job));
        }
        self.index = index;
    }

    /// Applies one command; returns the response and records touched keys in `dirty`.
    /// Deterministic: the same state and command give the same result on every replica.
    pub fn apply(&mut self, cmd: &Command, dirty: &mut BTreeSet<DirtyKey>) -> Response {
        if matches!(cmd, Command::Batch { .. }) {
            // Each command of the batch updates the index itself.
            return self.apply_one(cmd, dirty);
        }
        let mut touched = BTreeSet::new();
        let response = self.apply_one(cmd, &mut touched);
        for key in &touched {
            if let DirtyKey::Job(id) = key {
                self.index.update(id, self.jobs.get(id).map(|j| &**j));
            }
        }
        dirty.append(&mut touched);
        response
    }

    fn apply_one(&mut self, cmd: &Command, dirty: &mut BTreeSet<DirtyKey>) -> Response {
        match cmd {
            Command::SubmitJob {
                request_id,
                spec,
                shards,
                submitted_at_ms,
            } => self.submit(request_id, spec, shards, *submitted_at_ms, dirty),
            Command::CancelJob { job_id, at_ms } => self.with_live_job(job_id, dirty, |job| {
                job.state = JobState::Cancelled;
                job.finished_at_ms = *at_ms;
                job.failure_cause = Some("cancelled by user".into());
                Response::Ok
            }),
            Command::RegisterWorker {
                worker_id,
                host,
                http_addr,
                slots,
                at_ms,
            } => {
                if !valid_id(worker_id) || host.is_empty() || http_addr.is_empty() || *slots == 0 {
                    return reject("invalid worker registration");
                }
                self.workers.insert(
                    worker_id.clone(),
                    WorkerRecord {
                        worker_id: worker_id.clone(),
                        host: host.clone(),
                        http_addr: http_addr.clone(),
                        slots: *slots,
                        state: WorkerState::Alive,
                        registered_at_ms: *at_ms,
                        expired_at_ms: 0,
                    },
                );
                dirty.insert(DirtyKey::Worker(worker_id.clone()));
                Response::Ok
            }
            Command::ExpireWorker { worker_id, at_ms } => {
                self.expire_worker(worker_id, *at_ms, dirty)
            }
            Command::PlaceJob {
                job_id,
                placements,
                at_ms: _,
            } => self.place_job(job_id, placements, dirty),
            Command::RankStarted {
                job_id,
                rank,
                attempt,
                worker_id,
                pid,
                at_ms,
            } => self.with_current_rank(job_id, *rank, *attempt, Some(worker_id), dirty, |_, r| {
                if r.state != RankState::Pending {
                    return reject(format!(
                        "rank {} attempt {} is not pending",
                        r.rank, r.attempt
                    ));
                }
                r.state = RankState::Running;
                r.pid = *pid;
                r.started_at_ms = *at_ms;
                Response::Ok
            }),
            Command::RankExited {
                job_id,
                rank,
                attempt,
                worker_id,
                exit_code,
                signal,
                spawn_error,
                agent_fault,
                at_ms,
            } => self.with_current_rank(job_id, *rank, *attempt, Some(worker_id), dirty, |_, r| {
                if !matches!(r.state, RankState::Pending | RankState::Running) {
                    return reject(format!(
                        "rank {} attempt {} already ended",
                        r.rank, r.attempt
                    ));
                }
                r.exit_code = *exit_code;
                r.signal = *signal;
                r.exited_at_ms = *at_ms;
                if *exit_code == Some(0) && spawn_error.is_empty() {
                    r.state = RankState::Exited;
                    r.failure = None;
                } else {
                    r.state = RankState::Failed;
                    r.agent_fault = *agent_fault && !spawn_error.is_empty();
                    r.failure = Some(if r.agent_fault {
                        format!(
                            "rank {} attempt {} could not start on {worker_id}, for a \
                             resource error of the agent (not the rank's): {spawn_error}",
                            r.rank, r.attempt
                        )
                    } else if !spawn_error.is_empty() {
                        format!(
                            "rank {} attempt {} could not start: {spawn_error}",
                            r.rank, r.attempt
                        )
                    } else if let Some(sig) = signal {
                        format!(
                            "rank {} attempt {} was killed by signal {sig}",
                            r.rank, r.attempt
                        )
                    } else {
                        format!(
                            "rank {} attempt {} exited with code {}",
                            r.rank,
                            r.attempt,
                            exit_code.map_or("?".to_string(), |c| c.to_string())
                        )
                    });
                }
                Response::Ok
            }),
            Command::RankFailed {
                job_id,
                rank,
                attempt,
                cause,
                at_ms,
            } => self.with_current_rank(job_id, *rank, *attempt, None, dirty, |_, r| {
                if !matches!(r.state, RankState::Pending | RankState::Running) {
                    return reject(format!(
                        "rank {} attempt {} already ended",
                        r.rank, r.attempt
                    ));
                }
                r.state = RankState::Failed;
                r.exited_at_ms = *at_ms;
                r.failure = Some(format!("rank {} attempt {}: {cause}", r.rank, r.attempt));
                Response::Ok
            }),
            Command::ScheduleRestart {
                job_id,
                placements,
                failed_at_ms,
                delay_ms,
                cause,
                resume_step,
                agent_fault,
            } => self.schedule_restart(
                job_id,
                placements,
                *failed_at_ms,
                *delay_ms,
                cause,
                *resume_step,
                *agent_fault,
                dirty,
            ),
            Command::FailJob {
                job_id,
                cause,
                at_ms,
            } => self.with_live_job(job_id, dirty, |job| {
                job.state = JobState::Failed;
                job.finished_at_ms = *at_ms;
                job.failure_cause = Some(cause.clone());
                Response::Ok
            }),
            Command::CheckpointPartCommitted { job_id, step, part } => {
                self.part_committed(job_id, *step, part, dirty)
            }
            Command::CheckpointCommitted {
                job_id,
                step,
                at_ms: _,
            } => self.with_live_job(job_id, dirty, |job| {
                let Some(parts) = job.pending_parts.get(step) else {
                    return reject(format!("no parts of step {step} are pending"));
                };
                if parts.len() != job.spec.world_size as usize {
                    return reject(format!(
                        "step {step} has {} of {} parts",
                        parts.len(),
                        job.spec.world_size
                    ));
                }
                let parts: Vec<PartInfo> = parts.values().cloned().collect();
                job.committed.insert(*step, parts);
                job.committed_step = Some(job.committed_step.map_or(*step, |s| s.max(*step)));
                job.pending_parts.retain(|s, _| s > step);
                while job.committed.len() > job.spec.ckpt_keep as usize {
                    job.committed.pop_first();
                }
                Response::Ok
            }),
            Command::JobSucceeded { job_id, at_ms } => self.with_live_job(job_id, dirty, |job| {
                if job.state != JobState::Running || !job.all_ranks_succeeded() {
                    return reject("not every rank of the current attempt exited 0");
                }
                job.state = JobState::Succeeded;
                job.finished_at_ms = *at_ms;
                Response::Ok
            }),
            Command::Batch { commands } => {
                if commands.len() > MAX_BATCH_COMMANDS {
                    return reject(format!(
                        "a batch of {} commands is above the limit of {MAX_BATCH_COMMANDS}",
                        commands.len()
                    ));
                }
                if commands.iter().any(|c| matches!(c, Command::Batch { .. })) {
                    return reject("a batch must not contain a batch");
                }
                Response::Batch {
                    responses: commands.iter().map(|c| self.apply(c, dirty)).collect(),
                }
            }
        }
    }

    fn submit(
        &mut self,
        request_id: &str,
        spec: &JobSpec,
        shards: &[String],
        submitted_at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        if request_id.is_empty() || request_id.len() > MAX_REQUEST_ID_BYTES {
            return reject(format!(
                "request id must be 1..={MAX_REQUEST_ID_BYTES} bytes"
            ));
        }
        if let Some(job_id) = self.request_ids.get(request_id) {
            return match self.jobs.get(job_id) {
                Some(job) if job.spec != *spec => reject(format!(
                    "request id {request_id} was already used for {job_id} with a different spec"
                )),
                _ => Response::JobSubmitted {
                    job_id: job_id.clone(),
                    created: false,
                },
            };
        }
        if let Err(e) = spec.validate(MAX_WORLD_SIZE) {
            return reject(e);
        }
        if shards.len() > MAX_SHARDS {
            return reject(format!(
                "{} shards is above the limit of {MAX_SHARDS}",
                shards.len()
            ));
        }
        let plan = match shard_planner::assign_shards(shards, spec.world_size) {
            Ok(p) => p,
            Err(e) => return reject(format!("shard plan: {e}")),
        };
        let seq = self.next_job_seq + 1;
        self.next_job_seq = seq;
        dirty.insert(DirtyKey::Meta);
        let job_id = format!("job-{seq:06}");
        let ranks = (0..spec.world_size)
            .map(|rank| RankRecord {
                rank,
                attempt: 0,
                worker_id: None,
                state: RankState::Unplaced,
                local_rank: 0,
                local_world_size: 0,
                exit_code: None,
                signal: None,
                failure: None,
                started_at_ms: 0,
                exited_at_ms: 0,
                pid: 0,
                not_before_ms: 0,
                resume_step: None,
                resume_dir: String::new(),
                attempt_workers: Vec::new(),
                agent_fault: false,
            })
            .collect();
        let job = Job {
            id: job_id.clone(),
            seq,
            request_id: request_id.to_string(),
            spec: spec.clone(),
            shard_plan: plan,
            shard_count: shards.len() as u32,
            state: JobState::Pending,
            submitted_at_ms,
            finished_at_ms: 0,
            failure_cause: None,
            ranks,
            restarts_used: 0,
            restarts: Vec::new(),
            agent_fault_restarts: 0,
            master_port: master_port(seq, 0),
            pending_parts: BTreeMap::new(),
            committed: BTreeMap::new(),
            committed_step: None,
        };
        // Indexed now (its fixed size computed once, kept by the index), so that the
        // eviction below counts it.
        self.index.update(&job_id, Some(&job));
        self.jobs.insert(job_id.clone(), Arc::new(job));
        self.request_ids
            .insert(request_id.to_string(), job_id.clone());
        dirty.insert(DirtyKey::Job(job_id.clone()));
        dirty.insert(DirtyKey::RequestId(request_id.to_string()));
        self.evict_old_jobs(MAX_JOBS_RETAINED, MAX_STATE_BYTES, dirty);
        Response::JobSubmitted {
            job_id,
            created: true,
        }
    }

    /// Drops the oldest terminal jobs while more than `max_jobs` are kept or their
    /// estimated size ([`JobIndex::total_bytes`]) is above `max_bytes`: the bounded
    /// state ([`MAX_JOBS_RETAINED`], [`MAX_STATE_BYTES`]). Pending and running jobs are
    /// never dropped (the leader refuses submits instead).
    fn evict_old_jobs(&mut self, max_jobs: usize, max_bytes: u64, dirty: &mut BTreeSet<DirtyKey>) {
        let excess = self.jobs.len().saturating_sub(max_jobs);
        let mut bytes = self.index.total_bytes();
        if excess == 0 && bytes <= max_bytes {
            return;
        }
        let mut victims: Vec<(String, String)> = Vec::new();
        for id in &self.index.terminal {
            if victims.len() >= excess && bytes <= max_bytes {
                break;
            }
            let Some(job) = self.jobs.get(id) else {
                continue;
            };
            bytes = bytes.saturating_sub(self.index.job_bytes(id));
            victims.push((job.id.clone(), job.request_id.clone()));
        }
        for (job_id, request_id) in victims {
            self.jobs.remove(&job_id);
            self.request_ids.remove(&request_id);
            dirty.insert(DirtyKey::Job(job_id));
            dirty.insert(DirtyKey::RequestId(request_id));
        }
    }

    fn with_live_job(
        &mut self,
        job_id: &str,
        dirty: &mut BTreeSet<DirtyKey>,
        f: impl FnOnce(&mut Job) -> Response,
    ) -> Response {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return reject(format!("unknown job {job_id}"));
        };
        if job.state.is_terminal() {
            return reject(format!("job {job_id} is already {}", job.state.as_str()));
        }
        // A pointer to the job as it was: `make_mut` copies the job only while a snapshot
        // (or this comparison) still shares it.
        let before = Arc::clone(job);
        let resp = f(Arc::make_mut(job));
        if **job != *before {
            dirty.insert(DirtyKey::Job(job_id.to_string()));
        }
        resp
    }

    /// Runs `f` on the current attempt of a rank; rejects a stale attempt, another
    /// worker's report, or a job that is not running.
    fn with_current_rank(
        &mut self,
        job_id: &str,
        rank: u32,
        attempt: u32,
        worker_id: Option<&String>,
        dirty: &mut BTreeSet<DirtyKey>,
        f: impl FnOnce(&JobSpec, &mut RankRecord) -> Response,
    ) -> Response {
        self.with_live_job(job_id, dirty, |job| {
            if job.state != JobState::Running {
                return reject(format!("job {job_id} is {}", job.state.as_str()));
            }
            let Some(r) = job.ranks.get_mut(rank as usize) else {
                return reject(format!("job {job_id} has no rank {rank}"));
            };
            if r.attempt != attempt {
                return reject(format!(
                    "stale attempt: rank {rank} of {job_id} is at attempt {}, not {attempt}",
                    r.attempt
                ));
            }
            if let Some(w) = worker_id
                && r.worker_id.as_ref() != Some(w)
            {
                return reject(format!(
                    "rank {rank} attempt {attempt} of {job_id} is not placed on {w}"
                ));
            }
            f(&job.spec, r)
        })
    }

    fn expire_worker(
        &mut self,
        worker_id: &str,
        at_ms: u64,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        let Some(w) = self.workers.get_mut(worker_id) else {
            return reject(format!("unknown worker {worker_id}"));
        };
        if w.state == WorkerState::Expired {
            return reject(format!("worker {worker_id} is already expired"));
        }
        w.state = WorkerState::Expired;
        w.expired_at_ms = at_ms;
        dirty.insert(DirtyKey::Worker(worker_id.to_string()));
        for job in self.jobs.values_mut() {
            let holds_live_rank = job.state == JobState::Running
                && job.ranks.iter().any(|r| {
                    r.worker_id.as_deref() == Some(worker_id)
                        && matches!(r.state, RankState::Pending | RankState::Running)
                });
            if !holds_live_rank {
                continue;
            }
            let job = Arc::make_mut(job);
            let mut touched = false;
            for r in &mut job.ranks {
                if r.worker_id.as_deref() == Some(worker_id)
                    && matches!(r.state, RankState::Pending | RankState::Running)
                {
                    r.state = RankState::Failed;
                    r.exited_at_ms = at_ms;
                    r.failure = Some(format!(
                        "rank {} attempt {}: worker {worker_id} expired (no heartbeat)",
                        r.rank, r.attempt
                    ));
                    touched = true;
                }
            }
            if touched {
                dirty.insert(DirtyKey::Job(job.id.clone()));
            }
        }
        Response::Ok
    }

    /// Validates that `placements` put each of `ranks` on an alive worker exactly once
    /// and that no worker gets more ranks than its free slots.
    fn check_placements(
        &self,
        job_id: &str,
        ranks: &BTreeSet<u32>,
        placements: &[(u32, String)],
    ) -> Result<(), String> {
        let placed: BTreeSet<u32> = placements.iter().map(|(r, _)| *r).collect();
        if placed != *ranks || placed.len() != placements.len() {
            return Err("placement does not cover exactly the ranks to place".into());
        }
        let mut wanted: BTreeMap<&str, u32> = BTreeMap::new();
        for (_, w) in placements {
            *wanted.entry(w.as_str()).or_default() += 1;
        }
        let used = self.slots_used(Some((job_id, ranks)));
        for (w, n) in wanted {
            let Some(rec) = self.workers.get(w) else {
                return Err(format!("unknown worker {w}"));
            };
            if rec.state != WorkerState::Alive {
                return Err(format!("worker {w} is expired"));
            }
            let free = rec.slots.saturating_sub(used.get(w).copied().unwrap_or(0));
            if n > free {
                return Err(format!("worker {w} has {free} free slots, not {n}"));
            }
        }
        Ok(())
    }

    /// Slots in use per worker by ranks of running jobs that are placed and not ended,
    /// leaving out the ranks named in `except` (which are being re-placed). Visits only
    /// running jobs ([`JobIndex::running`]).
    pub fn slots_used(&self, except: Option<(&str, &BTreeSet<u32>)>) -> BTreeMap<String, u32> {
        let mut used = BTreeMap::new();
        // Only running jobs are placed (a job gets its workers when it leaves pending).
        for job in self.index.running.iter().filter_map(|id| self.jobs.get(id)) {
            for r in &job.ranks {
                if let Some((j, ranks)) = except
                    && j == job.id
                    && ranks.contains(&r.rank)
                {
                    continue;
                }
                if let (Some(w), RankState::Pending | RankState::Running) = (&r.worker_id, r.state)
                {
                    *used.entry(w.clone()).or_insert(0) += 1;
                }
            }
        }
        used
    }

    fn place_job(
        &mut self,
        job_id: &str,
        placements: &[(u32, String)],
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        let Some(job) = self.jobs.get(job_id) else {
            return reject(format!("unknown job {job_id}"));
        };
        if job.state != JobState::Pending {
            return reject(format!(
                "job {job_id} is {}, not pending",
                job.state.as_str()
            ));
        }
        let all: BTreeSet<u32> = (0..job.spec.world_size).collect();
        if let Err(e) = self.check_placements(job_id, &all, placements) {
            return reject(e);
        }
        let job = Arc::make_mut(self.jobs.get_mut(job_id).expect("checked above"));
        job.state = JobState::Running;
        assign_placements(job, placements, 0);
        dirty.insert(DirtyKey::Job(job_id.to_string()));
        Response::Ok
    }

    #[allow(clippy::too_many_arguments)]
    fn schedule_restart(
        &mut self,
        job_id: &str,
        placements: &[(u32, String)],
        failed_at_ms: u64,
        delay_ms: u64,
        cause: &str,
        resume_step: Option<u64>,
        agent_fault: bool,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        let Some(job) = self.jobs.get(job_id) else {
            return reject(format!("unknown job {job_id}"));
        };
        if job.state != JobState::Running {
            return reject(format!(
                "job {job_id} is {}, not running",
                job.state.as_str()
            ));
        }
        if agent_fault {
            if job.agent_fault_restarts >= MAX_AGENT_FAULT_RESTARTS {
                return reject(format!(
                    "job {job_id} had its {MAX_AGENT_FAULT_RESTARTS} restarts for agent errors"
                ));
            }
            if !job
                .ranks
                .iter()
                .filter(|r| r.state == RankState::Failed)
                .all(|r| r.agent_fault)
            {
                return reject("a rank failed for its own reasons: the restart spends budget");
            }
        } else if job.restarts_used >= job.spec.restart.max_restarts {
            return reject(format!("job {job_id} has no restart budget left"));
        }
        // Budgeted restarts count in `restarts_used`, agent-fault ones apart; the backoff
        // grows with each kind's own count.
        let (number, backoff_number) = if agent_fault {
            (job.restarts_used, job.agent_fault_restarts + 1)
        } else {
            (job.restarts_used + 1, job.restarts_used + 1)
        };
        let policy = job.spec.restart.clone();
        if delay_ms < policy.min_delay_ms(backoff_number) {
            return reject(format!(
                "restart delay {delay_ms} ms is below the policy's minimum of {} ms",
                policy.min_delay_ms(backoff_number)
            ));
        }
        if !job.ranks.iter().any(|r| r.state == RankState::Failed) {
            return reject("no rank of the job has failed");
        }
        let ranks: BTreeSet<u32> = placements.iter().map(|(r, _)| *r).collect();
        let required: BTreeSet<u32> = match policy.scope {
            RestartScope::Group => (0..job.spec.world_size).collect(),
            RestartScope::Rank => job
                .ranks
                .iter()
                .filter(|r| r.state == RankState::Failed)
                .map(|r| r.rank)
                .collect(),
        };
        if ranks != required {
            return reject(format!(
                "restart must cover ranks {required:?} for scope {:?}",
                policy.scope
            ));
        }
        if let Some(step) = resume_step
            && !job.committed.contains_key(&step)
        {
            return reject(format!("step {step} is not a kept committed step"));
        }
        if let Err(e) = self.check_placements(job_id, &ranks, placements) {
            return reject(e);
        }
        let job = Arc::make_mut(self.jobs.get_mut(job_id).expect("checked above"));
        job.restarts_used = number;
        if agent_fault {
            job.agent_fault_restarts += 1;
        }
        // Resuming from an older step than the newest committed one means the newer
        // steps failed verification: forget them, so the step can be committed again.
        match resume_step {
            Some(step) => {
                job.committed.retain(|s, _| *s <= step);
                job.committed_step = Some(step);
            }
            None => {
                job.committed.clear();
                job.committed_step = None;
            }
        }
        // Parts written by the attempts being replaced never mix with the new attempts'.
        for parts in job.pending_parts.values_mut() {
            parts.retain(|rank, _| !ranks.contains(rank));
        }
        job.pending_parts.retain(|_, parts| !parts.is_empty());
        let not_before_ms = failed_at_ms.saturating_add(delay_ms);
        job.restarts.push(RestartRecord {
            number,
            failed_at_ms,
            delay_ms,
            not_before_ms,
            cause: cause.to_string(),
            ranks: ranks.iter().copied().collect(),
            resume_step,
            agent_fault,
        });
        if policy.scope == RestartScope::Group {
            // A new port per restart of either kind (the sum only grows).
            job.master_port = master_port(job.seq, number + job.agent_fault_restarts);
        }
        for r in &mut job.ranks {
            if !ranks.contains(&r.rank) {
                continue;
            }
            r.attempt += 1;
            r.exit_code = None;
            r.signal = None;
            r.failure = None;
            r.agent_fault = false;
            r.started_at_ms = 0;
            r.exited_at_ms = 0;
            r.pid = 0;
            r.not_before_ms = not_before_ms;
            r.resume_step = resume_step;
            r.resume_dir = resume_step
                .and_then(|s| job.committed.get(&s))
                .and_then(|parts| parts.get(r.rank as usize))
                .map(|p| p.dir.clone())
                .unwrap_or_default();
        }
        assign_placements(job, placements, not_before_ms);
        dirty.insert(DirtyKey::Job(job_id.to_string()));
        Response::Ok
    }

    fn part_committed(
        &mut self,
        job_id: &str,
        step: u64,
        part: &PartInfo,
        dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        let rank = part.rank;
        let attempt = part.attempt;
        if let Some(job) = self.jobs.get(job_id)
            && job.committed_step.is_some_and(|c| step <= c)
        {
            // The same part again, already in its committed step: a retry whose first
            // try was committed but not acknowledged (the leader died before replying).
            // It succeeds and changes nothing; rejecting it would tell the agent that
            // its attempt is stale and end a healthy rank.
            if job
                .committed
                .get(&step)
                .is_some_and(|parts| parts.contains(part))
            {
                return Response::Ok;
            }
            return reject(format!("step {step} is not after the committed step"));
        }
        if part.files.len() > 4096 || part.state_json.len() > 64 * 1024 || part.dir.is_empty() {
            return reject("checkpoint part is too large or has no directory");
        }
        self.with_current_rank(job_id, rank, attempt, None, dirty, |_, r| {
            if !matches!(r.state, RankState::Pending | RankState::Running) {
                return reject(format!("rank {rank} attempt {attempt} is not running"));
            }
            Response::Ok
        })
        .and_then_ok(|| {
            let job = Arc::make_mut(
                self.jobs
                    .get_mut(job_id)
                    .expect("checked by with_current_rank"),
            );
            job.pending_parts
                .entry(step)
                .or_default()
                .insert(rank, part.clone());
            while job.pending_parts.len() > MAX_PENDING_CKPT_STEPS {
                job.pending_parts.pop_first();
            }
            dirty.insert(DirtyKey::Job(job_id.to_string()));
            Response::Ok
        })
    }
}

trait ResponseExt {
    fn and_then_ok(self, f: impl FnOnce() -> Response) -> Response;
}

impl ResponseExt for Response {
    fn and_then_ok(self, f: impl FnOnce() -> Response) -> Response {
        match self {
            Response::Ok => f(),
            other => other,
        }
    }
}

/// MASTER_PORT of a job's `restart`-th group attempt: spread over
/// [`MASTER_PORT_BASE`, `MASTER_PORT_BASE + MASTER_PORT_SPAN`) so a restarted group
/// does not collide with the port its predecessor may still hold.
pub fn master_port(seq: u64, restart: u32) -> u32 {
    let offset =
        (seq.wrapping_mul(97).wrapping_add(u64::from(restart) * 13)) % u64::from(MASTER_PORT_SPAN);
    MASTER_PORT_BASE + offset as u32
}

/// Places the given ranks (a fresh attempt, state Pending) and recomputes local ranks
/// of the whole job.
fn assign_placements(job: &mut Job, placements: &[(u32, String)], not_before_ms: u64) {
    for (rank, worker) in placements {
        let r = &mut job.ranks[*rank as usize];
        r.worker_id = Some(worker.clone());
        r.state = RankState::Pending;
        r.not_before_ms = not_before_ms;
        r.attempt_workers.push((r.attempt, worker.clone()));
    }
    let current: Vec<(u32, String)> = job
        .ranks
        .iter()
        .filter_map(|r| r.worker_id.clone().map(|w| (r.rank, w)))
        .collect();
    if current.len() == job.ranks.len()
        && let Ok(locals) = shard_planner::local_ranks(&current)
    {
        for (r, (local_rank, local_world_size)) in job.ranks.iter_mut().zip(locals) {
            r.local_rank = local_rank;
            r.local_world_size = local_world_size;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(world_size: u32) -> JobSpec {
        JobSpec {
            name: String::new(),
            world_size,
            command: vec!["train".into()],
            env: BTreeMap::new(),
            dataset: String::new(),
            ckpt_dir: "/ckpt".into(),
            ckpt_keep: 2,
            restart: RestartPolicy {
                max_restarts: 2,
                ..RestartPolicy::default()
            },
            progress_timeout_ms: 0,
            working_dir: String::new(),
            ckpt_url: String::new(),
            ckpt_commit_tier: String::new(),
        }
    }

    fn apply(s: &mut ClusterState, cmd: Command) -> Response {
        s.apply(&cmd, &mut BTreeSet::new())
    }

    fn cluster_with_job(world_size: u32) -> (ClusterState, String) {
        let mut s = ClusterState::default();
        for w in ["w1", "w2"] {
            let r = apply(
                &mut s,
                Command::RegisterWorker {
                    worker_id: w.into(),
                    host: "127.0.0.1".into(),
                    http_addr: "127.0.0.1:1".into(),
                    slots: 4,
                    at_ms: 1,
                },
            );
            assert_eq!(r, Response::Ok);
        }
        let r = apply(
            &mut s,
            Command::SubmitJob {
                request_id: "req".into(),
                spec: spec(world_size),
                shards: vec![],
                submitted_at_ms: 2,
            },
        );
        let Response::JobSubmitted {
            job_id,
            created: true,
        } = r
        else {
            panic!("{r:?}")
        };
        let placements = (0..world_size)
            .map(|r| (r, if r % 2 == 0 { "w1" } else { "w2" }.to_string()))
            .collect();
        assert_eq!(
            apply(
                &mut s,
                Command::PlaceJob {
                    job_id: job_id.clone(),
                    placements,
                    at_ms: 3
                }
            ),
            Response::Ok
        );
        (s, job_id)
    }

    fn exit(job_id: &str, rank: u32, attempt: u32, worker: &str, code: i32) -> Command {
        Command::RankExited {
            job_id: job_id.into(),
            rank,
            attempt,
            worker_id: worker.into(),
            exit_code: Some(code),
            signal: None,
            spawn_error: String::new(),
            at_ms: 100,
            agent_fault: false,
        }
    }

    #[test]
    fn a_batch_applies_each_command_in_order_as_if_alone() {
        let submit = |req: &str| Command::SubmitJob {
            request_id: req.into(),
            spec: spec(2),
            shards: vec![],
            submitted_at_ms: 2,
        };
        // The same commands applied one by one and as one batch give the same state and
        // the same responses, a rejected member included.
        let commands = vec![
            submit("a"),
            submit("b"),
            Command::CancelJob {
                job_id: "no-such-job".into(),
                at_ms: 3,
            },
            submit("a"),
        ];
        let mut alone = ClusterState::default();
        let mut alone_dirty = BTreeSet::new();
        let expected: Vec<Response> = commands
            .iter()
            .map(|c| alone.apply(c, &mut alone_dirty))
            .collect();
        assert!(matches!(expected[2], Response::Rejected { .. }));
        let mut batched = ClusterState::default();
        let mut batched_dirty = BTreeSet::new();
        let r = batched.apply(
            &Command::Batch {
                commands: commands.clone(),
            },
            &mut batched_dirty,
        );
        assert_eq!(
            r,
            Response::Batch {
                responses: expected
            }
        );
        assert_eq!(batched, alone);
        assert_eq!(batched_dirty, alone_dirty);

        // A nested batch or one over the limit is rejected whole and changes nothing.
        for bad in [
            vec![submit("c"), Command::Batch { commands: vec![] }],
            vec![submit("d"); MAX_BATCH_COMMANDS + 1],
        ] {
            let before = batched.clone();
            let r = apply(&mut batched, Command::Batch { commands: bad });
            assert!(matches!(r, Response::Rejected { .. }), "{r:?}");
            assert_eq!(batched, before);
        }
    }

    /// The index kept by `apply` equals one rebuilt from scratch.
    fn assert_index_current(s: &ClusterState) {
        let mut rebuilt = s.clone();
        rebuilt.rebuild_index();
        assert_eq!(s.job_index(), rebuilt.job_index());
    }

    #[test]
    fn the_job_index_follows_every_state_change_and_survives_serialization() {
        let (mut s, placed) = cluster_with_job(2);
        assert_index_current(&s);
        assert!(s.job_index().running.contains(&placed));
        let submit = |req: String| Command::SubmitJob {
            request_id: req,
            spec: spec(1),
            shards: vec![],
            submitted_at_ms: 5,
        };
        let r = apply(
            &mut s,
            Command::Batch {
                commands: (0..3).map(|i| submit(format!("b{i}"))).collect(),
            },
        );
        assert!(matches!(r, Response::Batch { .. }));
        assert_eq!(s.job_index().pending.len(), 3);
        assert_index_current(&s);
        let pending: Vec<String> = s.job_index().pending.iter().cloned().collect();
        apply(
            &mut s,
            Command::CancelJob {
                job_id: pending[0].clone(),
                at_ms: 6,
            },
        );
        apply(
            &mut s,
            Command::FailJob {
                job_id: placed.clone(),
                cause: "test".into(),
                at_ms: 7,
            },
        );
        assert_index_current(&s);
        assert!(s.job_index().terminal.contains(&pending[0]));
        assert!(s.job_index().terminal.contains(&placed));
        assert_eq!(s.job_index().running.len(), 0);
        // A deserialized state (snapshot, Raft state transfer) carries a rebuilt index.
        let json = serde_json::to_vec(&s).expect("encode");
        let back: ClusterState = serde_json::from_slice(&json).expect("decode");
        assert_eq!(back, s);
        assert_eq!(back.job_index().pending.len(), 2);
    }

    #[test]
    fn past_the_retention_limit_the_oldest_terminal_jobs_are_evicted() {
        let mut s = ClusterState::default();
        let submit = |i: usize| Command::SubmitJob {
            request_id: format!("r{i}"),
            spec: spec(1),
            shards: vec![],
            submitted_at_ms: 1,
        };
        for i in 0..MAX_JOBS_RETAINED {
            apply(&mut s, submit(i));
        }
        let oldest: Vec<String> = s.jobs.keys().take(3).cloned().collect();
        for id in &oldest {
            apply(
                &mut s,
                Command::CancelJob {
                    job_id: id.clone(),
                    at_ms: 2,
                },
            );
        }
        let mut dirty = BTreeSet::new();
        s.apply(&submit(MAX_JOBS_RETAINED), &mut dirty);
        s.apply(&submit(MAX_JOBS_RETAINED + 1), &mut dirty);
        assert_eq!(s.jobs.len(), MAX_JOBS_RETAINED);
        assert!(!s.jobs.contains_key(&oldest[0]) && !s.jobs.contains_key(&oldest[1]));
        assert!(s.jobs.contains_key(&oldest[2]), "only as many as needed go");
        assert!(!s.request_ids.contains_key("r0") && !s.request_ids.contains_key("r1"));
        assert!(dirty.contains(&DirtyKey::Job(oldest[0].clone())));
        assert_index_current(&s);
        // Pending jobs are never evicted: with no terminal job left, the state grows.
        let before = s.jobs.len();
        apply(&mut s, submit(MAX_JOBS_RETAINED + 2));
        apply(&mut s, submit(MAX_JOBS_RETAINED + 3));
        assert_eq!(s.jobs.len(), before + 1);
        assert_index_current(&s);
    }

    #[test]
    fn the_size_estimate_of_a_submit_bounds_its_json_encoding() {
        let mut big = spec(4);
        big.command = vec!["x".repeat(4_000); 20];
        big.env = (0..50)
            .map(|i| (format!("K{i}"), "v".repeat(100)))
            .collect();
        for (s, shards) in [
            (spec(1), vec![]),
            (
                big,
                (0..1_000)
                    .map(|i| format!("/data/shard-{i:05}.bin"))
                    .collect(),
            ),
        ] {
            let cmd = Command::SubmitJob {
                request_id: "r".repeat(24),
                spec: s,
                shards,
                submitted_at_ms: 1,
            };
            let json = serde_json::to_vec(&cmd).expect("encode").len();
            let estimate = cmd.approx_encoded_bytes();
            assert!(estimate >= json, "estimate {estimate} < encoded {json}");
            assert!(estimate <= 2 * json + 1_024, "estimate {estimate} ≫ {json}");
        }
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let p = RestartPolicy {
            backoff_initial_ms: 500,
            backoff_max_ms: 30_000,
            ..RestartPolicy::default()
        };
        assert_eq!(p.base_delay_ms(1), 500);
        assert_eq!(p.base_delay_ms(2), 1_000);
        assert_eq!(p.base_delay_ms(3), 2_000);
        assert_eq!(p.base_delay_ms(10), 30_000);
        assert_eq!(p.base_delay_ms(200), 30_000);
        assert_eq!(p.jittered_delay_ms(1, -1.0), 400);
        assert_eq!(p.jittered_delay_ms(1, 1.0), 600);
        assert_eq!(p.jittered_delay_ms(1, f64::NAN), 500);
        assert_eq!(p.min_delay_ms(2), 800);
    }

    #[test]
    fn submit_is_idempotent_by_request_id() {
        let (mut s, job_id) = cluster_with_job(2);
        let again = apply(
            &mut s,
            Command::SubmitJob {
                request_id: "req".into(),
                spec: spec(2),
                shards: vec![],
                submitted_at_ms: 9,
            },
        );
        assert_eq!(
            again,
            Response::JobSubmitted {
                job_id,
                created: false
            }
        );
        assert_eq!(s.jobs.len(), 1);
        let different = apply(
            &mut s,
            Command::SubmitJob {
                request_id: "req".into(),
                spec: spec(3),
                shards: vec![],
                submitted_at_ms: 9,
            },
        );
        assert!(matches!(different, Response::Rejected { .. }));
        assert_eq!(s.jobs.len(), 1);
    }

    #[test]
    fn invalid_specs_are_rejected_and_change_nothing() {
        let mut s = ClusterState::default();
        for bad in [
            JobSpec {
                world_size: 0,
                ..spec(1)
            },
            JobSpec {
                command: vec![],
                ..spec(1)
            },
            JobSpec {
                ckpt_dir: "relative".into(),
                ..spec(1)
            },
            JobSpec {
                restart: RestartPolicy {
                    backoff_initial_ms: 10,
                    backoff_max_ms: 5,
                    ..RestartPolicy::default()
                },
                ..spec(1)
            },
        ] {
            let before = s.clone();
            let r = apply(
                &mut s,
                Command::SubmitJob {
                    request_id: "x".into(),
                    spec: bad,
                    shards: vec![],
                    submitted_at_ms: 1,
                },
            );
            assert!(matches!(r, Response::Rejected { .. }), "{r:?}");
            assert_eq!(s, before);
        }
    }

    #[test]
    fn stale_attempt_reports_are_rejected() {
        let (mut s, job_id) = cluster_with_job(2);
        assert_eq!(apply(&mut s, exit(&job_id, 1, 0, "w2", 1)), Response::Ok);
        let placements = vec![(0, "w1".to_string()), (1, "w2".to_string())];
        let restart = Command::ScheduleRestart {
            job_id: job_id.clone(),
            placements,
            failed_at_ms: 100,
            delay_ms: 500,
            cause: "rank 1 exited".into(),
            resume_step: None,
            agent_fault: false,
        };
        assert_eq!(apply(&mut s, restart), Response::Ok);
        let job = &s.jobs[&job_id];
        assert!(
            job.ranks
                .iter()
                .all(|r| r.attempt == 1 && r.state == RankState::Pending && r.not_before_ms == 600)
        );
        // Rank 0's old attempt exits after being stopped: stale, changes nothing.
        let before = s.clone();
        assert!(matches!(
            apply(&mut s, exit(&job_id, 0, 0, "w1", 143)),
            Response::Rejected { .. }
        ));
        assert_eq!(s, before);
        // A report from the wrong worker is rejected too.
        assert!(matches!(
            apply(&mut s, exit(&job_id, 0, 1, "w2", 0)),
            Response::Rejected { .. }
        ));
    }

    #[test]
    fn restart_budget_and_delay_floor_are_enforced() {
        let (mut s, job_id) = cluster_with_job(1);
        for attempt in 0..2 {
            assert_eq!(
                apply(&mut s, exit(&job_id, 0, attempt, "w1", 1)),
                Response::Ok
            );
            let n = attempt + 1;
            let floor = s.jobs[&job_id].spec.restart.min_delay_ms(n);
            let too_short = Command::ScheduleRestart {
                job_id: job_id.clone(),
                placements: vec![(0, "w1".into())],
                failed_at_ms: 100,
                delay_ms: floor - 1,
                cause: "c".into(),
                resume_step: None,
                agent_fault: false,
            };
            assert!(matches!(
                apply(&mut s, too_short),
                Response::Rejected { .. }
            ));
            let ok = Command::ScheduleRestart {
                job_id: job_id.clone(),
                placements: vec![(0, "w1".into())],
                failed_at_ms: 100,
                delay_ms: floor,
                cause: "c".into(),
                resume_step: None,
                agent_fault: false,
            };
            assert_eq!(apply(&mut s, ok), Response::Ok);
        }
        assert_eq!(apply(&mut s, exit(&job_id, 0, 2, "w1", 1)), Response::Ok);
        let over = Command::ScheduleRestart {
            job_id: job_id.clone(),
            placements: vec![(0, "w1".into())],
            failed_at_ms: 100,
            delay_ms: 100_000,
            cause: "c".into(),
            resume_step: None,
            agent_fault: false,
        };
        assert!(matches!(apply(&mut s, over), Response::Rejected { .. }));
        assert_eq!(s.jobs[&job_id].restarts_used, 2);
    }

    #[test]
    fn placement_respects_slots_and_expiry() {
        let mut s = ClusterState::default();
        apply(
            &mut s,
            Command::RegisterWorker {
                worker_id: "w1".into(),
                host: "h".into(),
                http_addr: "h:1".into(),
                slots: 1,
                at_ms: 0,
            },
        );
        let Response::JobSubmitted { job_id, .. } = apply(
            &mut s,
            Command::SubmitJob {
                request_id: "a".into(),
                spec: spec(2),
                shards: vec![],
                submitted_at_ms: 0,
            },
        ) else {
            panic!()
        };
        let over = Command::PlaceJob {
            job_id: job_id.clone(),
            placements: vec![(0, "w1".into()), (1, "w1".into())],
            at_ms: 1,
        };
        assert!(matches!(apply(&mut s, over), Response::Rejected { .. }));
        apply(
            &mut s,
            Command::ExpireWorker {
                worker_id: "w1".into(),
                at_ms: 2,
            },
        );
        let on_expired = Command::PlaceJob {
            job_id: job_id.clone(),
            placements: vec![(0, "w1".into())],
            at_ms: 3,
        };
        assert!(matches!(
            apply(&mut s, on_expired),
            Response::Rejected { .. }
        ));
        assert_eq!(s.jobs[&job_id].state, JobState::Pending);
    }

    #[test]
    fn worker_expiry_fails_its_ranks() {
        let (mut s, job_id) = cluster_with_job(2);
        assert_eq!(
            apply(
                &mut s,
                Command::ExpireWorker {
                    worker_id: "w2".into(),
                    at_ms: 50
                }
            ),
            Response::Ok
        );
        let r1 = &s.jobs[&job_id].ranks[1];
        assert_eq!(r1.state, RankState::Failed);
        assert!(r1.failure.as_deref().unwrap_or("").contains("expired"));
        assert_eq!(s.jobs[&job_id].ranks[0].state, RankState::Pending);
    }

    fn part(rank: u32, attempt: u32, step: u64) -> PartInfo {
        PartInfo {
            rank,
            attempt,
            dir: format!("step-{step:08}/rank-{rank}/attempt-{attempt}"),
            files: vec![],
            state_json: "{}".into(),
        }
    }

    #[test]
    fn checkpoint_commits_only_with_every_part_and_keeps_k() {
        let (mut s, job_id) = cluster_with_job(2);
        for step in [10, 20, 30] {
            let commit = Command::CheckpointCommitted {
                job_id: job_id.clone(),
                step,
                at_ms: 1,
            };
            assert_eq!(
                apply(
                    &mut s,
                    Command::CheckpointPartCommitted {
                        job_id: job_id.clone(),
                        step,
                        part: part(0, 0, step)
                    }
                ),
                Response::Ok
            );
            assert!(matches!(
                apply(&mut s, commit.clone()),
                Response::Rejected { .. }
            ));
            assert_eq!(
                apply(
                    &mut s,
                    Command::CheckpointPartCommitted {
                        job_id: job_id.clone(),
                        step,
                        part: part(1, 0, step)
                    }
                ),
                Response::Ok
            );
            assert_eq!(apply(&mut s, commit), Response::Ok);
        }
        let job = &s.jobs[&job_id];
        assert_eq!(job.committed_step, Some(30));
        assert_eq!(
            job.committed.keys().copied().collect::<Vec<_>>(),
            vec![20, 30]
        );
        // A retry of a part already committed with its step (its first reply lost in a
        // failover) succeeds and changes nothing; any other part for a committed step is
        // rejected; a stale attempt's part too.
        let before = s.jobs[&job_id].clone();
        let retry = Command::CheckpointPartCommitted {
            job_id: job_id.clone(),
            step: 30,
            part: part(0, 0, 30),
        };
        assert_eq!(apply(&mut s, retry), Response::Ok);
        assert_eq!(s.jobs[&job_id], before);
        let mut other = part(0, 0, 30);
        other.dir.push_str("-other");
        let old = Command::CheckpointPartCommitted {
            job_id: job_id.clone(),
            step: 30,
            part: other,
        };
        assert!(matches!(apply(&mut s, old), Response::Rejected { .. }));
        let older = Command::CheckpointPartCommitted {
            job_id: job_id.clone(),
            step: 20,
            part: part(0, 0, 30),
        };
        assert!(matches!(apply(&mut s, older), Response::Rejected { .. }));
        let stale = Command::CheckpointPartCommitted {
            job_id: job_id.clone(),
            step: 40,
            part: part(0, 7, 40),
        };
        assert!(matches!(apply(&mut s, stale), Response::Rejected { .. }));
        // Restart resumes each rank from its own committed part.
        apply(&mut s, exit(&job_id, 0, 0, "w1", 1));
        let restart = Command::ScheduleRestart {
            job_id: job_id.clone(),
            placements: vec![(0, "w1".into()), (1, "w2".into())],
            failed_at_ms: 0,
            delay_ms: 500,
            cause: "c".into(),
            resume_step: Some(30),
            agent_fault: false,
        };
        assert_eq!(apply(&mut s, restart), Response::Ok);
        assert_eq!(
            s.jobs[&job_id].ranks[1].resume_dir,
            "step-00000030/rank-1/attempt-0"
        );
    }

    #[test]
    fn job_succeeds_only_when_all_ranks_exited_zero() {
        let (mut s, job_id) = cluster_with_job(2);
        apply(&mut s, exit(&job_id, 0, 0, "w1", 0));
        let done = Command::JobSucceeded {
            job_id: job_id.clone(),
            at_ms: 5,
        };
        assert!(matches!(
            apply(&mut s, done.clone()),
            Response::Rejected { .. }
        ));
        apply(&mut s, exit(&job_id, 1, 0, "w2", 0));
        assert_eq!(apply(&mut s, done), Response::Ok);
        assert_eq!(s.jobs[&job_id].state, JobState::Succeeded);
        // Terminal jobs accept nothing more.
        assert!(matches!(
            apply(&mut s, Command::CancelJob { job_id, at_ms: 6 }),
            Response::Rejected { .. }
        ));
    }

    #[test]
    fn resuming_from_an_older_step_forgets_newer_steps_and_stale_parts() {
        let (mut s, job_id) = cluster_with_job(2);
        for step in [10, 20] {
            for rank in 0..2 {
                let c = Command::CheckpointPartCommitted {
                    job_id: job_id.clone(),
                    step,
                    part: part(rank, 0, step),
                };
                assert_eq!(apply(&mut s, c), Response::Ok);
            }
            let c = Command::CheckpointCommitted {
                job_id: job_id.clone(),
                step,
                at_ms: 1,
            };
            assert_eq!(apply(&mut s, c), Response::Ok);
        }
        // Rank 0 of attempt 0 got its part of step 30 in before rank 1 failed.
        let c = Command::CheckpointPartCommitted {
            job_id: job_id.clone(),
            step: 30,
            part: part(0, 0, 30),
        };
        assert_eq!(apply(&mut s, c), Response::Ok);
        apply(&mut s, exit(&job_id, 1, 0, "w2", 1));
        let restart = Command::ScheduleRestart {
            job_id: job_id.clone(),
            placements: vec![(0, "w1".into()), (1, "w2".into())],
            failed_at_ms: 0,
            delay_ms: 500,
            cause: "step 20 is corrupt".into(),
            resume_step: Some(10),
            agent_fault: false,
        };
        assert_eq!(apply(&mut s, restart), Response::Ok);
        let job = &s.jobs[&job_id];
        assert_eq!(job.committed_step, Some(10));
        assert_eq!(job.committed.keys().copied().collect::<Vec<_>>(), vec![10]);
        assert!(
            job.pending_parts.is_empty(),
            "attempt-0 parts must not mix with attempt 1"
        );
        // Step 20 can be committed again by the new attempt.
        let c = Command::CheckpointPartCommitted {
            job_id: job_id.clone(),
            step: 20,
            part: part(0, 1, 20),
        };
        assert_eq!(apply(&mut s, c), Response::Ok);
    }

    /// A job's size estimate is at least its real encoding and at most a few times it,
    /// as it runs: placed, with checkpoint parts, restarted; and with a large shard list.
    #[test]
    fn a_jobs_size_estimate_covers_its_encoding() {
        let check = |job: &Job, what: &str| {
            let real = serde_json::to_vec(job).expect("encode").len() as u64;
            let estimate = job.approx_encoded_bytes();
            assert!(
                real <= estimate && estimate <= 4 * real,
                "{what}: estimate {estimate}, real {real}"
            );
        };
        let (mut s, job_id) = cluster_with_job(2);
        check(&s.jobs[&job_id], "placed");
        for step in [10, 20, 30] {
            for rank in 0..2 {
                let mut p = part(rank, 0, step);
                p.files = (0..20)
                    .map(|i| FileEntry {
                        path: format!("shard-{i:04}.bin"),
                        size_bytes: 1 << 20,
                        digest: "b".repeat(64),
                    })
                    .collect();
                p.state_json = format!(r#"{{"epoch":3,"order":"{}"}}"#, "7".repeat(500));
                let c = Command::CheckpointPartCommitted {
                    job_id: job_id.clone(),
                    step,
                    part: p,
                };
                assert_eq!(apply(&mut s, c), Response::Ok);
            }
            let commit = Command::CheckpointCommitted {
                job_id: job_id.clone(),
                step,
                at_ms: 1,
            };
            assert_eq!(apply(&mut s, commit), Response::Ok);
        }
        check(&s.jobs[&job_id], "with checkpoints");
        assert_eq!(apply(&mut s, exit(&job_id, 1, 0, "w2", 1)), Response::Ok);
        let restart = Command::ScheduleRestart {
            job_id: job_id.clone(),
            placements: vec![(0, "w1".to_string()), (1, "w2".to_string())],
            failed_at_ms: 100,
            delay_ms: 500,
            cause: "rank 1 exited with code 1".into(),
            resume_step: Some(30),
            agent_fault: false,
        };
        assert_eq!(apply(&mut s, restart), Response::Ok);
        check(&s.jobs[&job_id], "restarted");
        assert_index_current(&s);
        let shards: Vec<String> = (0..1_000)
            .map(|i| format!("/data/imagenet/train/shard-{i:06}.tar"))
            .collect();
        let r = apply(
            &mut s,
            Command::SubmitJob {
                request_id: "many-shards".into(),
                spec: spec(64),
                shards: shards.clone(),
                submitted_at_ms: 3,
            },
        );
        let Response::JobSubmitted { job_id: big, .. } = r else {
            panic!("{r:?}");
        };
        check(&s.jobs[&big], "1,000 shards, 64 ranks");
        assert_eq!(
            s.jobs[&big].approx_encoded_bytes(),
            submit_bytes(&spec(64), &shards) + (big.len() + "many-shards".len()) as u64,
            "what the leader admits a submit by is what it adds"
        );
        assert_eq!(
            s.job_index().total_bytes(),
            s.jobs
                .values()
                .map(|j| j.approx_encoded_bytes())
                .sum::<u64>()
        );
    }

    /// Past the byte budget, the oldest finished jobs are dropped until the estimate
    /// fits; unfinished jobs never are.
    #[test]
    fn finished_jobs_are_dropped_to_stay_within_the_byte_budget() {
        let mut s = ClusterState::default();
        let mut ids = Vec::new();
        for i in 0..6 {
            let r = apply(
                &mut s,
                Command::SubmitJob {
                    request_id: format!("r{i}"),
                    spec: spec(1),
                    shards: (0..10)
                        .map(|k| format!("{k}{}", "s".repeat(1_000)))
                        .collect(),
                    submitted_at_ms: 1,
                },
            );
            let Response::JobSubmitted { job_id, .. } = r else {
                panic!("{r:?}");
            };
            ids.push(job_id);
        }
        for id in &ids[..4] {
            let cancel = Command::CancelJob {
                job_id: id.clone(),
                at_ms: 2,
            };
            assert_eq!(apply(&mut s, cancel), Response::Ok);
        }
        let evict = |s: &mut ClusterState, max_bytes: u64| {
            let mut dirty = BTreeSet::new();
            s.evict_old_jobs(MAX_JOBS_RETAINED, max_bytes, &mut dirty);
            for key in &dirty {
                if let DirtyKey::Job(id) = key {
                    let job = s.jobs.get(id).cloned();
                    s.index.update(id, job.as_deref());
                }
            }
            assert_index_current(s);
        };
        let index = s.job_index();
        let fits = index.total_bytes() - index.job_bytes(&ids[0]) - index.job_bytes(&ids[1]);
        assert!(index.unfinished_bytes() < fits);
        evict(&mut s, fits);
        assert!(!s.jobs.contains_key(&ids[0]) && !s.jobs.contains_key(&ids[1]));
        assert!(!s.request_ids.contains_key("r0") && !s.request_ids.contains_key("r1"));
        assert!(s.jobs.contains_key(&ids[2]), "only as many as needed go");
        assert_eq!(s.job_index().total_bytes(), fits);
        // Unfinished jobs stay, whatever the budget.
        evict(&mut s, 1);
        let kept: Vec<&String> = s.jobs.keys().collect();
        assert_eq!(kept, vec![&ids[4], &ids[5]]);
    }
}
