//! The rank contract: the environment variables a worker agent sets for every rank
//! process, and that a trainer (the example trainer, the Python `cumulus.runtime`) reads.
//!
//! The names are torchrun's where torchrun has one (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), so an ordinary DDP script runs
//! unchanged; the rest are `CUMULUS_*`. The Python runtime's `_env.py` names the same
//! variables (the table in `docs/architecture.md`, "Wire names").

/// Global rank, `0..WORLD_SIZE`.
pub const RANK: &str = "RANK";
/// Number of ranks of the job.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Rank among the job's ranks on this worker, `0..LOCAL_WORLD_SIZE`.
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Number of the job's ranks on this worker.
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Host of rank 0's rendezvous (the torch.distributed `env://` store).
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// Port of rank 0's rendezvous, chosen per job by the leader.
pub const MASTER_PORT: &str = "MASTER_PORT";
/// The job id, `job-NNNNNN`.
pub const JOB_ID: &str = "CUMULUS_JOB_ID";
/// The rank's attempt number (0 for its first run).
pub const ATTEMPT: &str = "CUMULUS_ATTEMPT";
/// File listing the rank's dataset shards, one path per line.
pub const SHARDS_FILE: &str = "CUMULUS_SHARDS_FILE";
/// Base URL of the agent's rank-local API (`http://127.0.0.1:<port>`).
pub const AGENT_URL: &str = "CUMULUS_AGENT_URL";
/// Bearer token of this rank attempt for the rank-local API.
pub const AGENT_TOKEN: &str = "CUMULUS_AGENT_TOKEN";
/// Unix socket of the rank-local API (an absolute path), set when ranks run as another
/// user than the agent (`cumulus-worker --run-as`): clients then send every request
/// through it (the path of [`AGENT_URL`] still applies; its host and port do not), and
/// the agent checks that the calling process belongs to the rank whose token it presents.
pub const AGENT_SOCKET: &str = "CUMULUS_AGENT_SOCKET";
/// Directory the rank writes a checkpoint part into before committing it (set when the
/// job has a checkpoint directory).
pub const CKPT_STAGING: &str = "CUMULUS_CKPT_STAGING";
/// Directory of the committed part this attempt resumes from (set with
/// [`RESUME_STEP`], or neither).
pub const RESUME_DIR: &str = "CUMULUS_RESUME_DIR";
/// Checkpoint step this attempt resumes from.
pub const RESUME_STEP: &str = "CUMULUS_RESUME_STEP";
/// The GPUs a rank may use, by UUID, comma-separated (CUDA's own variable). Set by an
/// agent that has GPUs for every rank it starts: empty for a rank that asked for none, so
/// it cannot take a GPU another rank was given.
pub const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
/// The rank's share of its GPU's memory, a decimal fraction in `(0, 1]` (set only for a
/// job with `gpu_memory_fraction`); the Python runtime passes it to
/// `torch.cuda.set_per_process_memory_fraction`. Cooperative: nothing enforces it.
pub const GPU_MEMORY_FRACTION: &str = "CUMULUS_GPU_MEMORY_FRACTION";

/// A directory private to this attempt, empty at its start: what the rank leaves there
/// is packed and uploaded to the cluster's blob store when the attempt ends (also when
/// it fails), and listed as the job's artifacts (`cumulusctl artifacts`).
pub const OUTPUT_DIR: &str = "CUMULUS_OUTPUT_DIR";

/// An elastic job's data plan for this rank: a JSON file ([`RankDataPlan`]), set for
/// every attempt of a job submitted with a world size `MIN:MAX`. It tells the rank the
/// world size it runs at, the one before the latest resize, and the segments of its
/// records for the epochs that differ from its shards file.
pub const DATA_PLAN: &str = "CUMULUS_DATA_PLAN";

/// Key of the object a rank of an elastic job puts in its checkpoint's resume state (the
/// JSON `state` of `POST /v1/checkpoint`) to tell the leader its data position:
/// `{"epoch", "segment", "record"}` (0-based: in that epoch, the segments before
/// `segment` and `record` records of segment `segment` are consumed) and an optional
/// `carry` (any JSON of at most [`MAX_DATA_CARRY_BYTES`], e.g. a running digest of the
/// records consumed) handed to the rank that takes its records over after a resize.
pub const DATA_STATE_KEY: &str = "cumulus_data";
/// Largest `carry` of a data position ([`DATA_STATE_KEY`]), compact JSON, in bytes; a
/// larger one is handed on as `null`.
pub const MAX_DATA_CARRY_BYTES: usize = 1024;

/// The records of one shard from `first_record` (0-based, counting records) to its end.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DataSegment {
    /// The shard's path.
    pub shard: String,
    /// Records of the shard before this one are not part of the segment.
    pub first_record: u64,
}

/// The content of [`DATA_PLAN`]: what an elastic job's rank reads, epoch by epoch.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RankDataPlan {
    /// Ranks the job runs with now (as `WORLD_SIZE`).
    pub world_size: u32,
    /// Ranks before the latest resize (equal to `world_size` when there was none).
    pub previous_world_size: u32,
    /// The committed step the current ranks started from (`None`: the job's start). An
    /// attempt resuming from exactly this step starts the plan: at `start_epoch`,
    /// segment 0, record 0, with `carry`; one resuming from a later step continues from
    /// its own checkpoint's position.
    pub from_step: Option<u64>,
    /// The epoch the plan's ranks start in.
    pub start_epoch: u32,
    /// This rank's segments for the epochs listed; every other epoch is its shards file
    /// (`CUMULUS_SHARDS_FILE`), each shard whole.
    pub epochs: std::collections::BTreeMap<u32, Vec<DataSegment>>,
    /// The `carry` values of the old ranks whose records this rank took over (old rank
    /// `j` goes to new rank `j mod world_size`), for the attempt that starts the plan.
    #[serde(default)]
    pub carry: Vec<serde_json::Value>,
}

/// Every variable of the rank contract. A job's own `env` entry with one of these names is
/// dropped by the agent (even when it does not set that variable for this attempt), so a
/// job cannot fake, say, a resume; tests remove them all to run hermetically.
pub const CONTRACT_VARS: &[&str] = &[
    RANK,
    WORLD_SIZE,
    LOCAL_RANK,
    LOCAL_WORLD_SIZE,
    MASTER_ADDR,
    MASTER_PORT,
    JOB_ID,
    ATTEMPT,
    SHARDS_FILE,
    AGENT_URL,
    AGENT_TOKEN,
    AGENT_SOCKET,
    CKPT_STAGING,
    RESUME_DIR,
    RESUME_STEP,
    GPU_MEMORY_FRACTION,
    OUTPUT_DIR,
    DATA_PLAN,
];

/// Variables an agent with GPUs sets for every rank; a job's own `env` entry with one of
/// these names is dropped there (on an agent without GPUs the job's value stays).
pub const GPU_VARS: &[&str] = &[CUDA_VISIBLE_DEVICES];

/// Exit code of a rank that stopped because it could not reach its agent's rank-local
/// API ([`AGENT_URL`], [`AGENT_SOCKET`]) after its retries: no answer at all (connection
/// refused, reset or closed, timed out), not an HTTP error status. 75 is `EX_TEMPFAIL`
/// of `sysexits.h`. The agent believes it only with evidence of its own: when its rank
/// API turned connections away (at its cap, accept errors) or was not serving during the
/// attempt, it reports the exit as its fault, and the restart spends none of the job's
/// budget (at most `MAX_AGENT_FAULT_RESTARTS` such restarts); otherwise the exit is the
/// rank's own failure like any other code. The example trainer and the Python runtime
/// exit with it; any trainer may.
pub const EXIT_AGENT_UNREACHABLE: i32 = 75;

/// Exit code of a rank that found it cannot run here, whatever restarts (a remote
/// function built for another Python version, a required module missing): `EX_CONFIG`
/// of `sysexits.h`. The agent reports it as a failure no restart can fix (like a program
/// that cannot be executed): the leader fails the job at once and spends no restart
/// budget. A rank exiting with it can only end its own job early.
pub const EXIT_CANNOT_RUN: i32 = 78;
