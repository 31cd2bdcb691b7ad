//! What the state holds: jobs with their ranks, restarts and checkpoint parts, workers,
//! and [`ClusterState`] itself, with the estimates of their encoded size.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::*;

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
    /// Part directory (relative to the checkpoint dir of `resume_job_id`) this attempt
    /// resumes from.
    pub resume_dir: String,
    /// The job whose checkpoint this attempt resumes from when it is another one (a job
    /// started with `resume_from` that has committed no step of its own); "" = this job.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub resume_job_id: String,
    /// Worker of every attempt so far, `(attempt, worker_id)`, for log retrieval.
    pub attempt_workers: Vec<(u32, String)>,
    /// The current attempt failed because its agent could not start it for lack of a
    /// local resource (descriptors, memory, disk, process slots): not the rank's fault.
    #[serde(default)]
    pub agent_fault: bool,
    /// The last progress `(step, total_steps)` the current attempt reported before it
    /// exited, kept for the job's status once the process is gone ((0, 0): none).
    #[serde(default, skip_serializing_if = "is_zero_pair")]
    pub last_progress: (u64, u64),
    /// No restart can fix the current attempt's failure (its program cannot be executed,
    /// its environment could not be built, or it exited `EXIT_CANNOT_RUN`): the leader
    /// fails the job instead of restarting it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exec_failed: bool,
    /// What the current attempt died of, as its agent reported it (one printable line of
    /// at most [`cumulus_api::limits::MAX_EXIT_CAUSE_BYTES`]: the exception its runtime
    /// reported, else the last line of its output); `None` for none or a clean exit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_cause: Option<String>,
    /// UUIDs of the GPUs of the current attempt (empty for a job without GPUs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<String>,
    /// The current attempt continues the previous attempt's process (an in-process
    /// restart): its agent hands the live process the new attempt instead of starting one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_process: bool,
}

impl RankRecord {
    /// Makes this rank's next attempt: a new attempt number, nothing of the previous
    /// attempt's exit or progress, resuming from `resume`. Placement fields are the
    /// caller's.
    pub(super) fn new_attempt(&mut self, resume: ResumePoint) {
        self.attempt += 1;
        self.exit_code = None;
        self.signal = None;
        self.failure = None;
        self.agent_fault = false;
        self.exec_failed = false;
        self.exit_cause = None;
        self.in_process = false;
        self.last_progress = (0, 0);
        self.started_at_ms = 0;
        self.exited_at_ms = 0;
        self.pid = 0;
        self.set_resume(resume);
    }

    /// Sets where the current attempt resumes from.
    pub(super) fn set_resume(&mut self, resume: ResumePoint) {
        self.resume_step = resume.step;
        self.resume_dir = resume.dir;
        self.resume_job_id = resume.job_id;
    }
}

/// Where a rank's attempt resumes from ([`Job::resume_point`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResumePoint {
    /// The committed step (`None`: from scratch).
    pub step: Option<u64>,
    /// The rank's part directory in it, relative to its job's checkpoint dir.
    pub dir: String,
    /// The job that committed it when not this one ("").
    pub job_id: String,
}

/// The committed step of another job a job was started from (its `spec.resume_from`,
/// resolved at submit), with that step's part directories.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkPoint {
    /// The job that committed the step.
    pub job_id: String,
    /// The step.
    pub step: u64,
    /// Each rank's part directory in it (index = rank), relative to that job's
    /// checkpoint dir.
    pub dirs: Vec<String>,
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
    /// Ranks restarted (every rank for a group restart, one for a rank restart).
    pub ranks: Vec<u32>,
    /// Step resumed from.
    pub resume_step: Option<u64>,
    /// A restart after agent resource errors only ([`MAX_AGENT_FAULT_RESTARTS`]): it
    /// spent none of the job's restart budget (`number` is the budget's count then).
    #[serde(default)]
    pub agent_fault: bool,
    /// How it was carried out: [`RestartPath::InProcess`] when `in_process_ranks` kept
    /// their processes, else [`RestartPath::Full`].
    #[serde(default, skip_serializing_if = "is_full")]
    pub path: RestartPath,
    /// Why that path, in words (what made an in-process restart possible or ruled it out).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub path_reason: String,
    /// Ranks whose new attempt continues in the previous attempt's process.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub in_process_ranks: Vec<u32>,
}

fn is_full(path: &RestartPath) -> bool {
    *path == RestartPath::Full
}

/// A checkpoint part accepted from a rank attempt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartInfo {
    /// Global rank, `0..world_size`.
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
    /// Number of shards of the job's dataset (all ranks together).
    pub shard_count: u32,
    /// Where the job is in its lifecycle ([`JobState`]).
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
    /// Every restart, oldest first (budgeted and agent-fault ones).
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
    /// Who submitted it ([`cumulus_api::users::CLUSTER_ADMIN`] for the cluster token; ""
    /// for a job submitted before users existed, which only administrators may act on).
    #[serde(default)]
    pub owner: String,
    /// A stop in flight (pause, time limit, preemption): its ranks are being asked to
    /// checkpoint and stop; none is restarted meanwhile. Cleared when the stop
    /// completes ([`Command::JobStopped`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopRequest>,
    /// Running time of the job's earlier runs (before its latest pause or preemption),
    /// in milliseconds.
    #[serde(default)]
    pub running_ms: u64,
    /// Leader time the current run began (its placement), in ms since the Unix epoch;
    /// 0 while it is not running.
    #[serde(default)]
    pub run_started_at_ms: u64,
    /// The step of another job this one started from (`spec.resume_from`): its ranks
    /// resume there whenever the job has no committed step of its own to resume from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork: Option<ForkPoint>,
    /// Time spent paused in earlier pauses, in milliseconds.
    #[serde(default)]
    pub paused_ms: u64,
    /// Leader time the current pause began, in ms since the Unix epoch (0: not paused).
    #[serde(default)]
    pub paused_at_ms: u64,
    /// How many times the job's state has changed (pending → running → paused → …): a
    /// version that only grows, as a job's state alone no longer does once it can be
    /// paused, resumed and preempted.
    #[serde(default)]
    pub state_changes: u64,
    /// Rank attempts the leader flagged as stragglers, oldest first (at most
    /// [`MAX_STRAGGLER_FLAGS`]; [`Command::FlagStraggler`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stragglers: Vec<StragglerFlag>,
    /// Workers the job's later placements avoid when others have room: its stragglers'
    /// workers under [`StragglerAction::Restart`] and [`StragglerAction::Exclude`],
    /// oldest first (at most [`MAX_AVOIDED_WORKERS`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub avoided_workers: Vec<String>,
    /// What the ranks' attempts left in `CUMULUS_OUTPUT_DIR`: for each rank, the newest
    /// attempt that left any, in rank order (at most one per rank, so at most the world
    /// size). Recorded from an accepted [`Command::RankExited`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub artifacts: Vec<Artifact>,
    /// Elastic jobs: every change of the world size, oldest first (at most
    /// [`MAX_RESIZES_KEPT`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resizes: Vec<ResizeRecord>,
    /// Elastic jobs: the data plans of the kept committed steps and of the current ranks,
    /// oldest first ([`Job::data_plan_at`]); empty until the first resize (the standard
    /// plan).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub data_plans: Vec<DataPlanRecord>,
    /// Elastic jobs: resizes so far (a new MASTER_PORT each).
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub resize_count: u32,
    /// Elastic jobs: the highest attempt number any rank had at the latest resize, so a
    /// rank added again never reuses an attempt number (and its directories).
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub attempt_floor: u32,
    /// Elastic jobs: the `(attempt, worker)` records of the ranks a shrink removed, by
    /// rank, so that their logs stay readable (`cumulusctl logs`); a rank a grow adds
    /// again takes its records back.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub removed_rank_workers: BTreeMap<u32, Vec<(u32, String)>>,
}

fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

/// What one rank attempt left in its `CUMULUS_OUTPUT_DIR`, packed and stored in the
/// blob store by its agent before the attempt's exit was reported.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifact {
    /// Global rank, `0..world_size`.
    pub rank: u32,
    /// The attempt that left it.
    pub attempt: u32,
    /// The packed directory (tar.gz).
    pub blob: BlobRef,
}

/// A request that a running job's ranks checkpoint and stop.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopRequest {
    /// Why: [`StopAction::Pause`], [`StopAction::TimeLimit`] or [`StopAction::Preempt`].
    pub action: StopAction,
    /// Leader time of the request, in ms since the Unix epoch.
    pub requested_at_ms: u64,
    /// A grow of an elastic job ([`Command::RequestGrow`], action
    /// [`StopAction::Preempt`]): once its ranks stopped at a committed step, the leader
    /// resizes it from there ([`Command::ResizeJob`] clears the stop) instead of redoing
    /// the steps since its last commit; when the room is gone by then, `JobStopped`
    /// queues it again as a preemption does.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub grow: bool,
}

impl Job {
    /// Running time at leader time `now_ms`, in milliseconds: the earlier runs' plus the
    /// current run's (time paused or queued is not counted).
    pub fn running_ms_at(&self, now_ms: u64) -> u64 {
        let current = if self.state == JobState::Running && self.run_started_at_ms > 0 {
            now_ms.saturating_sub(self.run_started_at_ms)
        } else {
            0
        };
        self.running_ms.saturating_add(current)
    }

    /// Where `rank` resumes from when its job resumes from its own committed `step`;
    /// `None` (no usable step of its own) means the fork point, if the job has one, else
    /// from scratch.
    pub fn resume_point(&self, step: Option<u64>, rank: u32) -> ResumePoint {
        match (step, &self.fork) {
            (Some(step), _) => ResumePoint {
                step: Some(step),
                // After a resize, rank `r` resumes from the part of rank `r mod` the
                // step's world size (`Job::resize`).
                dir: self
                    .committed
                    .get(&step)
                    .and_then(|parts| parts.get(rank as usize % parts.len().max(1)))
                    .map(|p| p.dir.clone())
                    .unwrap_or_default(),
                job_id: String::new(),
            },
            (None, Some(fork)) => ResumePoint {
                step: Some(fork.step),
                dir: fork.dirs.get(rank as usize).cloned().unwrap_or_default(),
                job_id: fork.job_id.clone(),
            },
            (None, None) => ResumePoint::default(),
        }
    }

    /// The steps of this job's checkpoint dir that must be kept: the committed ones, and
    /// `also` (steps other jobs were started from and still need).
    pub fn kept_steps(&self, also: impl IntoIterator<Item = u64>) -> Vec<u64> {
        let mut keep: Vec<u64> = self.committed.keys().copied().chain(also).collect();
        keep.sort_unstable();
        keep.dedup();
        keep
    }

    /// Time paused at leader time `now_ms`, in milliseconds: earlier pauses plus the
    /// current one.
    pub fn paused_ms_at(&self, now_ms: u64) -> u64 {
        let current = if self.paused_at_ms > 0 {
            now_ms.saturating_sub(self.paused_at_ms)
        } else {
            0
        };
        self.paused_ms.saturating_add(current)
    }

    /// Begins a pause at `at_ms`.
    pub(super) fn begin_pause(&mut self, at_ms: u64) {
        self.paused_at_ms = at_ms.max(1);
    }

    /// Ends the current pause, if any, at `at_ms`: its time joins `paused_ms`.
    pub(super) fn end_pause(&mut self, at_ms: u64) {
        if self.paused_at_ms > 0 {
            self.paused_ms = self
                .paused_ms
                .saturating_add(at_ms.saturating_sub(self.paused_at_ms));
            self.paused_at_ms = 0;
        }
    }

    /// Ends the current run at `at_ms`: its time joins `running_ms`.
    pub(super) fn end_run(&mut self, at_ms: u64) {
        if self.run_started_at_ms > 0 {
            self.running_ms = self
                .running_ms
                .saturating_add(at_ms.saturating_sub(self.run_started_at_ms));
            self.run_started_at_ms = 0;
        }
    }

    /// Takes every rank off its worker for a later placement (after a pause or a
    /// preemption): a placed rank gets a new attempt number (an attempt never runs
    /// twice), and every rank resumes from the newest committed step. Parts of steps
    /// that never completed are dropped (their attempts are gone).
    pub(super) fn requeue_ranks(&mut self) {
        let resume_step = self.committed_step;
        for i in 0..self.ranks.len() {
            let resume = self.resume_point(resume_step, self.ranks[i].rank);
            let r = &mut self.ranks[i];
            let placed = r.worker_id.is_some() || r.state != RankState::Unplaced;
            if placed {
                r.new_attempt(resume);
            } else {
                r.set_resume(resume);
            }
            r.worker_id = None;
            r.state = RankState::Unplaced;
            r.not_before_ms = 0;
            r.gpus.clear();
        }
        self.pending_parts.clear();
    }

    /// Records what attempt `attempt` of `rank` left in its output directory: it
    /// replaces the rank's entry of an older (or the same) attempt and is dropped beside
    /// a newer one's; entries stay in rank order, one per rank.
    pub(super) fn record_artifact(&mut self, rank: u32, attempt: u32, blob: &BlobRef) {
        let artifact = Artifact {
            rank,
            attempt,
            blob: blob.clone(),
        };
        match self.artifacts.binary_search_by_key(&rank, |a| a.rank) {
            Ok(i) if self.artifacts[i].attempt <= attempt => self.artifacts[i] = artifact,
            Ok(_) => {}
            Err(i) => self.artifacts.insert(i, artifact),
        }
    }

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
                    + r.exit_cause.as_ref().map_or(0, String::len)
                    + r.resume_dir.len()
                    + r.resume_job_id.len()
                    + r.gpus
                        .iter()
                        .map(|g| g.len() + PER_STRING_BYTES)
                        .sum::<usize>()
                    + r.attempt_workers
                        .iter()
                        .map(|(_, w)| w.len() + 2 * PER_STRING_BYTES)
                        .sum::<usize>()
            })
            .sum();
        let removed: usize = self
            .removed_rank_workers
            .values()
            .flatten()
            .map(|(_, w)| w.len() + 2 * PER_STRING_BYTES)
            .sum();
        let restarts: usize = self
            .restarts
            .iter()
            .map(|r| {
                RESTART_BYTES
                    + r.cause.len()
                    + r.path_reason.len()
                    + 11 * (r.ranks.len() + r.in_process_ranks.len())
            })
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
        let fork = self.fork.as_ref().map_or(0, |f| {
            f.job_id.len()
                + f.dirs
                    .iter()
                    .map(|d| d.len() + PER_STRING_BYTES)
                    .sum::<usize>()
        });
        let artifacts: usize = self
            .artifacts
            .iter()
            .map(|a| ARTIFACT_BYTES + a.blob.digest.len())
            .sum();
        let elastic: usize = self
            .data_plans
            .iter()
            .map(DataPlanRecord::approx_bytes)
            .sum::<usize>()
            + self
                .resizes
                .iter()
                .map(|r| RESTART_BYTES + r.cause.len())
                .sum::<usize>()
            + removed;
        (ranks
            + restarts
            + parts
            + fork
            + artifacts
            + elastic
            + self.approx_straggler_bytes()
            + self.failure_cause.as_ref().map_or(0, String::len)) as u64
    }
}

/// Allowance per string of the estimates (quotes, comma, escapes of ordinary text), in
/// bytes.
pub(super) const PER_STRING_BYTES: usize = 8;
/// Allowance for a job's field names and scalar fields, and its spec's, in bytes.
pub(super) const JOB_BYTES: usize = 2_048;
/// Allowance for one rank record's field names and scalar fields, in bytes.
pub(super) const RANK_BYTES: usize = 512;
/// Allowance for one restart record's field names and scalar fields, in bytes.
pub(super) const RESTART_BYTES: usize = 256;
/// Allowance for one checkpoint part's field names and scalar fields, in bytes.
pub(super) const PART_BYTES: usize = 256;
/// Allowance for one artifact's field names and scalar fields, in bytes.
pub(super) const ARTIFACT_BYTES: usize = 96;
/// Allowance for one checkpoint part file's field names and size, in bytes.
pub(super) const PART_FILE_BYTES: usize = 64;

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

/// Whether a worker is heartbeating: the contract's [`cumulus_api::WorkerPhase`] (the
/// same serde names, `alive` and `expired`, in the log and snapshots as on the wire).
pub use cumulus_api::WorkerPhase as WorkerState;

/// One GPU of a worker, as its agent registered it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuDevice {
    /// NVML index on the worker.
    pub index: u32,
    /// NVML UUID (unique among the alive workers; [`cumulus_api::gpus::is_valid_uuid`]).
    pub uuid: String,
    /// Product name (printable, at most [`MAX_GPU_NAME_BYTES`]).
    pub name: String,
    /// Its memory, in bytes.
    pub memory_total_bytes: u64,
}

/// A user of the cluster and the digest of their token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserRecord {
    /// The user's name.
    pub name: String,
    /// What the user may do.
    pub role: cumulus_api::Role,
    /// SHA-256 of the token's secret, lowercase hex ([`cumulus_api::users::secret_digest`]).
    pub secret_sha256: String,
    /// The administrator who created it.
    pub created_by: String,
    /// Leader time of the creation, ms since the Unix epoch.
    pub created_at_ms: u64,
}

/// A worker agent known to the cluster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// The worker agent's id.
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
    /// Its GPUs, in index order (at most [`MAX_GPUS_PER_WORKER`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<GpuDevice>,
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
    /// Users by name (at most [`cumulus_api::users::MAX_USERS`]).
    #[serde(default)]
    pub users: BTreeMap<String, UserRecord>,
    /// Progress histories of jobs by id ([`Command::RecordProgress`]; bounded as its
    /// module `history` says). Shared like `jobs`: a snapshot copies pointers.
    #[serde(default)]
    pub histories: BTreeMap<String, Arc<ProgressHistory>>,
    /// Job ids by lifecycle class (derived from `jobs`).
    #[serde(skip)]
    pub(super) index: JobIndex,
}

/// The serialized fields of [`ClusterState`]; deserializing goes through it so that the
/// derived index is always rebuilt.
#[derive(Deserialize)]
struct ClusterStateData {
    next_job_seq: u64,
    jobs: BTreeMap<String, Arc<Job>>,
    request_ids: BTreeMap<String, String>,
    workers: BTreeMap<String, WorkerRecord>,
    #[serde(default)]
    users: BTreeMap<String, UserRecord>,
    #[serde(default)]
    histories: BTreeMap<String, Arc<ProgressHistory>>,
}

impl From<ClusterStateData> for ClusterState {
    fn from(d: ClusterStateData) -> ClusterState {
        let mut state = ClusterState {
            next_job_seq: d.next_job_seq,
            jobs: d.jobs,
            request_ids: d.request_ids,
            workers: d.workers,
            users: d.users,
            histories: d.histories,
            index: JobIndex::default(),
        };
        state.rebuild_index();
        state
    }
}

fn is_zero_pair(p: &(u64, u64)) -> bool {
    *p == (0, 0)
}
