//! [`Command`]: a state change as it travels in the Raft log, and [`Response`], what
//! applying it answered.

use serde::{Deserialize, Serialize};

use super::*;

/// The GPUs of one rank in a placement: `(rank, GPU UUIDs)`.
pub type RankGpus = (u32, Vec<String>);

/// A state change, proposed by a coordinator and applied by every replica.
// A submit carries the whole spec inline; commands live one per log entry for a short
// while, so the variants' size difference costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Create a job (or return the one `request_id` already created).
    SubmitJob {
        /// Idempotency key of the submit: the same key returns the job it created.
        request_id: String,
        /// The spec, validated and with its defaults filled in.
        spec: JobSpec,
        /// Shard paths of the dataset, sorted by name.
        shards: Vec<String>,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        submitted_at_ms: u64,
        /// Who submitted it: the authenticated user's name
        /// ([`cumulus_api::users::CLUSTER_ADMIN`] for the cluster token; "" in entries
        /// written before users existed).
        #[serde(default)]
        owner: String,
    },
    /// Create a user with a token (only its secret's digest is stored).
    CreateUser {
        /// The user's name ([`cumulus_api::users::is_valid_user_name`]).
        name: String,
        /// What the user may do.
        role: cumulus_api::Role,
        /// SHA-256 of the token's secret, lowercase hex.
        secret_sha256: String,
        /// The administrator who created it.
        created_by: String,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// Revoke a user's token: the user can no longer authenticate.
    RevokeUser {
        /// The user's name.
        name: String,
    },
    /// Cancel a job.
    CancelJob {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// A user pauses a job: a pending job is parked at once; a running one's ranks are
    /// asked to checkpoint and stop ([`Job::stop`]), and [`Command::JobStopped`] then
    /// parks it.
    PauseJob {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// A user resumes a paused job: it is queued again and resumes from its newest
    /// committed step. Spends no restart budget.
    ResumeJob {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// The leader asks a running job's ranks to checkpoint and stop: its time limit is
    /// near ([`StopAction::TimeLimit`]) or its slots are wanted
    /// ([`StopAction::Preempt`]).
    RequestStop {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// Why ([`StopAction::Stop`] and [`StopAction::Pause`] are refused here).
        action: StopAction,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// The leader asks a running elastic job below its most ranks to checkpoint and stop
    /// before it grows: [`Job::stop`] becomes a [`StopAction::Preempt`] with
    /// [`StopRequest::grow`] set; once no rank runs, the leader resizes the job from the
    /// step they committed ([`Command::ResizeJob`]).
    RequestGrow {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// No rank of a job with a stop in flight runs any more (and a step they completed
    /// is committed): a pause parks it, a preemption queues it again, a time limit ends
    /// it `timed_out`.
    JobStopped {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// Forget a finished job (`cumulusctl delete`, `purge`): its record and its request
    /// id. Its checkpoints, when asked, were deleted by the leader before.
    DeleteJob {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
    },
    /// A worker (re-)registers.
    RegisterWorker {
        /// The worker agent's id.
        worker_id: String,
        /// Host name or address the worker's ranks are reached at (MASTER_ADDR when rank 0 runs there).
        host: String,
        /// Agent HTTP address.
        http_addr: String,
        /// Rank slots the worker offers.
        slots: u32,
        /// Its GPUs, in index order (empty: none).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        gpus: Vec<GpuDevice>,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// A worker went silent for the heartbeat timeout: its ranks fail.
    ExpireWorker {
        /// The worker agent's id.
        worker_id: String,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// Gang placement of a pending job.
    PlaceJob {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// `(rank, worker_id)` for every rank.
        placements: Vec<(u32, String)>,
        /// `(rank, GPU UUIDs)` for every rank of a job with GPUs (empty otherwise).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        gpus: Vec<RankGpus>,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// The agent started a rank attempt.
    RankStarted {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// Global rank, `0..world_size`.
        rank: u32,
        /// The rank's attempt number (0 for its first run).
        attempt: u32,
        /// The worker reporting it; `apply` rejects a worker the attempt is not placed on.
        worker_id: String,
        /// The rank process's pid on its worker.
        pid: u32,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// A rank attempt's process exited (or could not start).
    RankExited {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// Global rank, `0..world_size`.
        rank: u32,
        /// The rank's attempt number (0 for its first run).
        attempt: u32,
        /// The worker reporting it; `apply` rejects a worker the attempt is not placed on.
        worker_id: String,
        /// Exit code, when it exited.
        exit_code: Option<i32>,
        /// Signal, when killed.
        signal: Option<i32>,
        /// Non-empty when it could not start.
        spawn_error: String,
        /// It could not start for lack of a resource on the agent, or it exited with
        /// [`cumulus_api::rank_env::EXIT_AGENT_UNREACHABLE`] and `agent_evidence` says why
        /// that was the agent's doing (not the rank's fault).
        #[serde(default)]
        agent_fault: bool,
        /// With `agent_fault` and exit code `EXIT_AGENT_UNREACHABLE`: what the agent saw of
        /// its own rank-local API during the attempt (connections turned away, not serving).
        #[serde(default, skip_serializing_if = "String::is_empty")]
        agent_evidence: String,
        /// No restart can fix it, the leader fails the job: its program cannot be
        /// executed (missing, not executable; with `spawn_error`), its environment could
        /// not be built (with `spawn_error`), or it exited with
        /// [`cumulus_api::rank_env::EXIT_CANNOT_RUN`].
        #[serde(default)]
        exec_failed: bool,
        /// The last step the rank reported before it exited (0: none).
        #[serde(default)]
        step: u64,
        /// The total steps of that report (0: unknown).
        #[serde(default)]
        total_steps: u64,
        /// What the attempt left in its `CUMULUS_OUTPUT_DIR`, stored in the blob store
        /// before this report (`None`: nothing, or its upload failed). Recorded in
        /// [`Job::artifacts`] only when the exit is accepted.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        artifacts: Option<BlobRef>,
        /// What the attempt died of, as its agent tells (the exception its runtime
        /// reported, else the last line of its output); `apply` keeps it as one printable
        /// line of at most [`cumulus_api::limits::MAX_EXIT_CAUSE_BYTES`]. Empty: none.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        cause: String,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// The leader declared a running attempt failed (hung, lost by its agent).
    RankFailed {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// Global rank, `0..world_size`.
        rank: u32,
        /// The rank's attempt number (0 for its first run).
        attempt: u32,
        /// Human-readable cause, shown to users.
        cause: String,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// Restart ranks with new attempt numbers after a stamped delay.
    ScheduleRestart {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// `(rank, worker_id)` of every restarted rank.
        placements: Vec<(u32, String)>,
        /// `(rank, GPU UUIDs)` of every restarted rank of a job with GPUs (empty otherwise).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        gpus: Vec<RankGpus>,
        /// Leader time of the failure.
        failed_at_ms: u64,
        /// Restart delay with its ±20% jitter already drawn, in ms.
        delay_ms: u64,
        /// Cause shown to users.
        cause: String,
        /// Step to resume from (the newest committed step that verified).
        resume_step: Option<u64>,
        /// Every failed rank failed for an agent resource error: the restart spends no
        /// budget (one of [`MAX_AGENT_FAULT_RESTARTS`] instead).
        #[serde(default)]
        agent_fault: bool,
        /// Ranks whose new attempt continues in the previous attempt's process (an
        /// in-process restart; empty: a full one). Each stays on its worker.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        in_process: Vec<u32>,
        /// Why the leader chose that path, shown to users.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        path_reason: String,
    },
    /// An elastic job changes its number of ranks to `placements.len()` (every rank a
    /// new attempt, placed as given), resuming from `resume_step`, its unconsumed
    /// records dealt over the new ranks ([`Job::resize`]). Spends no restart budget.
    ResizeJob {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// `(rank, worker_id)` for every rank `0..new world size`.
        placements: Vec<(u32, String)>,
        /// `(rank, GPU UUIDs)` for every rank of a job with GPUs (empty otherwise).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        gpus: Vec<RankGpus>,
        /// Step to resume from (the newest committed step that verified; `None`: from
        /// scratch).
        resume_step: Option<u64>,
        /// Why, shown to users as the resize event's cause.
        cause: String,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// Fail a job for good.
    FailJob {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// Human-readable cause, shown to users.
        cause: String,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// A rank attempt committed its part of a checkpoint step.
    CheckpointPartCommitted {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// Checkpoint step.
        step: u64,
        /// Part (rank, attempt, dir, files, state).
        part: PartInfo,
    },
    /// Every rank's part of `step` arrived and verified; the manifest is written.
    CheckpointCommitted {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// Checkpoint step.
        step: u64,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// Every rank of the current attempt exited 0.
    JobSucceeded {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// The leader's clock when it proposed this, in ms since the Unix epoch (`apply` reads no clock).
        at_ms: u64,
    },
    /// The leader found a running rank attempt slower than the job's other ranks for
    /// the job's straggler window: recorded in [`Job::stragglers`]; the job's
    /// [`StragglerAction`] may fail the attempt and avoid its worker.
    FlagStraggler {
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// The flag (rank, attempt, worker, rates, action, leader time).
        flag: StragglerFlag,
    },
    /// The leader's downsampled samples of running jobs' progress, kept in each job's
    /// [`ProgressHistory`] (bounds: the `history` module; at most one such command per
    /// [`HISTORY_INTERVAL_MS`] from a leader).
    RecordProgress {
        /// At most [`MAX_HISTORY_JOBS`] samples, one per job.
        samples: Vec<ProgressSampleIn>,
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
            Command::CreateUser { .. } => "CreateUser",
            Command::RevokeUser { .. } => "RevokeUser",
            Command::CancelJob { .. } => "CancelJob",
            Command::PauseJob { .. } => "PauseJob",
            Command::ResumeJob { .. } => "ResumeJob",
            Command::RequestStop { .. } => "RequestStop",
            Command::RequestGrow { .. } => "RequestGrow",
            Command::JobStopped { .. } => "JobStopped",
            Command::DeleteJob { .. } => "DeleteJob",
            Command::RegisterWorker { .. } => "RegisterWorker",
            Command::ExpireWorker { .. } => "ExpireWorker",
            Command::PlaceJob { .. } => "PlaceJob",
            Command::RankStarted { .. } => "RankStarted",
            Command::RankExited { .. } => "RankExited",
            Command::RankFailed { .. } => "RankFailed",
            Command::ScheduleRestart { .. } => "ScheduleRestart",
            Command::ResizeJob { .. } => "ResizeJob",
            Command::FailJob { .. } => "FailJob",
            Command::CheckpointPartCommitted { .. } => "CheckpointPartCommitted",
            Command::CheckpointCommitted { .. } => "CheckpointCommitted",
            Command::JobSucceeded { .. } => "JobSucceeded",
            Command::FlagStraggler { .. } => "FlagStraggler",
            Command::RecordProgress { .. } => "RecordProgress",
            Command::Batch { commands } => return write!(f, "Batch({})", commands.len()),
        };
        f.write_str(name)
    }
}

/// Most commands in one [`Command::Batch`].
pub const MAX_BATCH_COMMANDS: usize = 256;

/// Fixed allowance, in bytes, for one command's encoding besides its strings (field
/// names, numbers, punctuation); see [`Command::approx_encoded_bytes`].
pub(super) const COMMAND_OVERHEAD_BYTES: usize = 512;

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
            Command::PlaceJob {
                placements, gpus, ..
            }
            | Command::ScheduleRestart {
                placements, gpus, ..
            }
            | Command::ResizeJob {
                placements, gpus, ..
            } => {
                COMMAND_OVERHEAD_BYTES
                    + placements
                        .iter()
                        .map(|(_, w)| w.len() + 2 * PER_STRING)
                        .sum::<usize>()
                    + gpus
                        .iter()
                        .map(|(_, g)| strings(g) + 2 * PER_STRING)
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
            Command::RecordProgress { samples } => {
                COMMAND_OVERHEAD_BYTES
                    + samples
                        .iter()
                        .map(|s| {
                            // Field names and five numbers of up to 20 digits; a
                            // metric's name and bits with their punctuation.
                            s.job_id.len()
                                + 160
                                + s.metrics.iter().map(|(n, _)| n.len() + 32).sum::<usize>()
                        })
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
        /// The job's id (`job-NNNNNN`).
        job_id: String,
        /// False when the request id already existed.
        created: bool,
    },
    /// The command was invalid or stale and changed nothing.
    Rejected {
        /// Human-readable cause, shown to users.
        reason: String,
    },
    /// The responses to the commands of a [`Command::Batch`], in its order.
    Batch {
        /// One response per command.
        responses: Vec<Response>,
    },
}

pub(super) fn reject(reason: impl Into<String>) -> Response {
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

/// The replay guard of `RegisterWorker`: 1..=64 bytes of `[A-Za-z0-9._-]`, not `.` or
/// `..`. Admission checks worker ids by the one rule of [`cumulus_api::ids`] (stricter:
/// no leading `.` or `-`) before proposing; this looser check stays as it was because
/// apply must accept every entry an earlier version committed, or replicas replaying
/// the log would diverge from those restored from a snapshot.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}
