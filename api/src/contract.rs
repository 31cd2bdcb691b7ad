//! The contract, emitted for other languages: this crate's wire spellings, environment
//! variables, shared limits and JSON shapes, rendered as the Python module
//! `python/src/cumulus/_contract.py` and the machine-readable `api/contract.json`.
//!
//! Rendering only (strings in, strings out): the `cumulus-contract` binary writes the
//! files ([`REGENERATE`]), and this crate's test `tests/contract.rs` fails when a checked-in
//! copy differs from what [`files`] renders. The output is deterministic: constants sorted
//! by name, enums by name, shapes in a fixed order, fields in their writer's order.

use std::fmt::Write as _;

use crate::shape::{FieldType, Shape};
use crate::states::{
    CheckpointTier, CommitTier, JobState, MemberRole, RankPhase, RankState, RestartPath,
    RestartScope, Role, StopAction, StragglerAction, WorkerPhase,
};
use crate::{
    blobs, client_config, gpus, leader, limits, manifest, metric_json, rank_env, rank_local,
    states, token,
};

/// The one command that rewrites both generated files.
pub const REGENERATE: &str = "cargo run -p cumulus-api --bin cumulus-contract";
/// The generated Python module, relative to the repository root.
pub const PYTHON_PATH: &str = "python/src/cumulus/_contract.py";
/// The machine-readable contract, relative to the repository root.
pub const JSON_PATH: &str = "api/contract.json";

/// A constant's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value {
    /// An integer.
    Int(i128),
    /// A string.
    Str(&'static str),
    /// A list of strings, in order.
    Strs(&'static [&'static str]),
}

/// One constant of the contract.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Constant {
    /// Its name in Python (and in `contract.json`).
    pub name: &'static str,
    /// Where Rust defines it, e.g. `cumulus_api::limits::MAX_SHARDS`.
    pub rust: String,
    /// The value.
    pub value: Value,
    /// One sentence of documentation.
    pub doc: &'static str,
}

/// One enum of wire spellings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireEnum {
    /// Its Python class name.
    pub name: &'static str,
    /// The Rust type.
    pub rust: &'static str,
    /// One sentence of documentation.
    pub doc: &'static str,
    /// Python name of the tuple of every spelling.
    pub all_name: &'static str,
    /// `(Rust variant, spelling)`, in declaration order.
    pub members: Vec<(String, &'static str)>,
    /// The default spelling, where the enum has a default.
    pub default: Option<(&'static str, &'static str)>,
    /// A named subset of the spellings, sorted: `(Python name, doc, spellings)`.
    pub subset: Option<(&'static str, &'static str, Vec<&'static str>)>,
}

/// Everything the contract holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contract {
    /// Constants, sorted by name.
    pub constants: Vec<Constant>,
    /// Enums, sorted by name.
    pub enums: Vec<WireEnum>,
    /// JSON object shapes, each after the shapes it refers to.
    pub shapes: Vec<&'static Shape>,
}

fn last_segment(path: &str) -> &str {
    path.rsplit("::").next().unwrap_or(path).trim()
}

macro_rules! constant {
    ($kind:ident, $($path:ident)::+, $doc:literal) => {
        constant!($kind, $($path)::+ as last, $doc)
    };
    ($kind:ident, $($path:ident)::+ as last, $doc:literal) => {{
        let rust = concat!("cumulus_api::", stringify!($($path)::+)).replace(' ', "");
        Constant {
            name: last_segment(stringify!($($path)::+)),
            rust,
            value: constant!(@value $kind, $($path)::+),
            doc: $doc,
        }
    }};
    ($kind:ident, $($path:ident)::+ as $name:literal, $doc:literal) => {{
        let rust = concat!("cumulus_api::", stringify!($($path)::+)).replace(' ', "");
        Constant {
            name: $name,
            rust,
            value: constant!(@value $kind, $($path)::+),
            doc: $doc,
        }
    }};
    (@value int, $($path:ident)::+) => { Value::Int($($path)::+ as i128) };
    (@value str, $($path:ident)::+) => { Value::Str($($path)::+) };
    (@value strs, $($path:ident)::+) => { Value::Strs($($path)::+) };
}

/// Every constant of the contract, sorted by name.
fn constants() -> Vec<Constant> {
    let mut all = job_spec_limit_constants();
    all.extend(report_limit_constants());
    all.extend(connection_constants());
    all.extend(manifest_constants());
    all.extend(rank_env_constants());
    all.extend(client_config_constants());
    all.extend(blob_constants());
    all.extend(metric_constants());
    all.sort_by(|a, b| a.name.cmp(b.name));
    all
}

/// The bounds of a job's spec ([`limits`]) that more than one process checks: name and
/// idempotency key, world size, command and environment, shards, restarts, checkpoints
/// kept, priority, stop grace and time limit, and the unit of a GPU share.
fn job_spec_limit_constants() -> Vec<Constant> {
    vec![
        constant!(
            int,
            limits::MAX_REQUEST_ID_BYTES,
            "Longest submit idempotency key, in bytes (never empty)."
        ),
        constant!(
            int,
            limits::MAX_JOB_NAME_BYTES,
            "Longest job name, in bytes."
        ),
        constant!(
            int,
            limits::MAX_WORLD_SIZE,
            "Largest world size a job may have."
        ),
        constant!(
            int,
            limits::MAX_COMMAND_ARGS,
            "Most arguments of a rank command."
        ),
        constant!(
            int,
            limits::MAX_ARG_BYTES,
            "Longest command argument, env key or env value, in bytes."
        ),
        constant!(
            int,
            limits::MAX_ENV_ENTRIES,
            "Most ``env`` entries of a job."
        ),
        constant!(int, limits::MAX_SHARDS, "Most shards of one job."),
        constant!(
            int,
            limits::MAX_SHARDS_FILE_BYTES,
            "Largest shards file a rank reads, in bytes."
        ),
        constant!(
            int,
            limits::MAX_RESTART_BUDGET,
            "Most restarts a job may be given (``max_restarts``)."
        ),
        constant!(
            int,
            limits::MAX_BACKOFF_MS,
            "Longest restart backoff, in milliseconds."
        ),
        constant!(
            int,
            limits::MAX_CKPT_KEEP,
            "Most kept checkpoint steps (``ckpt_keep``)."
        ),
        constant!(
            int,
            limits::MAX_PRIORITY,
            "Highest queue priority (and, negated, the lowest)."
        ),
        constant!(
            int,
            limits::MAX_STOP_GRACE_MS,
            "Longest stop grace a job may ask for, in milliseconds."
        ),
        constant!(
            int,
            limits::MAX_TIME_LIMIT_MS,
            "Longest time limit a job may ask for, in milliseconds."
        ),
        constant!(
            int,
            limits::DEFAULT_STARTUP_TIMEOUT_MS,
            "Startup timeout of a job with a progress timeout that names none, in milliseconds."
        ),
        constant!(
            int,
            limits::MAX_STARTUP_TIMEOUT_MS,
            "Longest startup timeout a job may ask for, in milliseconds."
        ),
        constant!(
            int,
            limits::DEFAULT_STRAGGLER_FRACTION_PERMILLE,
            "Default straggler fraction of a job, in thousandths of the median rate of its other ranks."
        ),
        constant!(
            int,
            limits::MIN_STRAGGLER_FRACTION_PERMILLE,
            "Smallest straggler fraction a job may ask for, in thousandths."
        ),
        constant!(
            int,
            limits::MAX_STRAGGLER_FRACTION_PERMILLE,
            "Largest straggler fraction a job may ask for, in thousandths."
        ),
        constant!(
            int,
            limits::DEFAULT_STRAGGLER_WINDOW_MS,
            "Default straggler window of a job, in milliseconds."
        ),
        constant!(
            int,
            limits::MIN_STRAGGLER_WINDOW_MS,
            "Shortest straggler window a job may ask for, in milliseconds."
        ),
        constant!(
            int,
            limits::MAX_STRAGGLER_WINDOW_MS,
            "Longest straggler window a job may ask for, in milliseconds."
        ),
        constant!(
            int,
            limits::MAX_WARM_SPARES,
            "Most warm spares a job may ask each of its workers to keep."
        ),
        constant!(
            int,
            limits::MAX_WARM_IMPORTS,
            "Most modules a job's warm spares may import before an assignment."
        ),
        constant!(
            int,
            limits::MAX_WARM_IMPORT_BYTES,
            "Longest module name in warm_imports, in bytes."
        ),
        constant!(
            int,
            gpus::WHOLE_GPU_PERMILLE,
            "Thousandths of a GPU in one whole GPU."
        ),
    ]
}

/// The limits ([`limits`]) of what ranks and agents report (checkpoint parts, resume
/// state, metrics, GPUs) and of what a job list answers.
fn report_limit_constants() -> Vec<Constant> {
    vec![
        constant!(
            int,
            limits::MAX_PART_FILES,
            "Most files in one checkpoint part."
        ),
        constant!(
            int,
            limits::MAX_STATE_JSON_BYTES,
            "Largest per-rank resume state, compact JSON, in bytes."
        ),
        constant!(
            int,
            limits::MAX_METRICS,
            "Most metrics in one progress report."
        ),
        constant!(
            int,
            limits::MAX_METRIC_NAME_BYTES,
            "Longest metric name, in bytes."
        ),
        constant!(
            int,
            limits::MAX_GPUS_PER_WORKER,
            "Most GPUs one worker registers, and one rank asks for."
        ),
        constant!(
            int,
            limits::MAX_GPU_UUID_BYTES,
            "Longest GPU UUID, in bytes."
        ),
        constant!(
            int,
            limits::MAX_GPU_NAME_BYTES,
            "Longest GPU product name, in bytes."
        ),
        constant!(
            int,
            limits::MAX_GPU_ERROR_BYTES,
            "Longest GPU error text in a heartbeat, in bytes."
        ),
        constant!(
            int,
            limits::MAX_EXIT_CAUSE_BYTES,
            "Longest cause of a rank's exit (one line), in bytes."
        ),
        constant!(
            int,
            limits::MAX_SUMMARIES,
            "Most job summaries one list answers."
        ),
        constant!(
            int,
            limits::DEFAULT_SUMMARIES,
            "Job summaries a list without a limit answers."
        ),
    ]
}

/// What a client needs to connect to a cluster and find its leader: the bearer token
/// bounds, the leader header of a follower's reply, and from [`cumulus_tls`] the CA
/// certificate's file name, the PEM file bound and the certificates' identity scheme.
fn connection_constants() -> Vec<Constant> {
    vec![
        constant!(
            int,
            token::MIN_TOKEN_BYTES,
            "Shortest bearer token, in bytes."
        ),
        constant!(
            int,
            token::MAX_TOKEN_BYTES,
            "Longest bearer token, in bytes."
        ),
        constant!(
            str,
            leader::LEADER_HTTP_HEADER,
            "HTTP header naming the leader's HTTP address in a follower's 503."
        ),
        Constant {
            name: "CA_FILE",
            rust: "cumulus_tls::generate::CA_FILE".into(),
            value: Value::Str(cumulus_tls::generate::CA_FILE),
            doc: "File name of the cluster's CA certificate inside its TLS directory.",
        },
        Constant {
            name: "MAX_PEM_FILE_BYTES",
            rust: "cumulus_tls::MAX_PEM_FILE_BYTES".into(),
            value: Value::Int(i128::from(cumulus_tls::MAX_PEM_FILE_BYTES)),
            doc: "Largest PEM file (certificate, key) read, in bytes.",
        },
        Constant {
            name: "IDENTITY_SCHEME",
            rust: "cumulus_tls::IDENTITY_SCHEME".into(),
            value: Value::Str(cumulus_tls::IDENTITY_SCHEME),
            doc: "Scheme of the identity URI in every certificate the cluster CA issues.",
        },
    ]
}

/// The checkpoint layout ([`manifest`]): the manifest's and `LATEST`'s file names, the
/// manifest formats written and read, and the manifest's size bound.
fn manifest_constants() -> Vec<Constant> {
    vec![
        constant!(
            str,
            manifest::MANIFEST_FILE,
            "File name of a step's manifest, inside ``step-N/``."
        ),
        constant!(
            str,
            manifest::LATEST_FILE,
            "File name of the pointer to the newest committed step."
        ),
        constant!(
            int,
            manifest::MANIFEST_FORMAT_VERSION,
            "The manifest format written now."
        ),
        constant!(
            int,
            manifest::MIN_MANIFEST_FORMAT_VERSION,
            "The oldest manifest format still read."
        ),
        constant!(
            int,
            manifest::MAX_MANIFEST_BYTES,
            "Largest ``MANIFEST.json``, in bytes."
        ),
    ]
}

/// The rank's side of the contract: every variable a rank is started with and the exit
/// code of a rank that could not reach its agent ([`rank_env`]), and the rank-local
/// API's "no action" spelling and reply bound ([`rank_local`]).
fn rank_env_constants() -> Vec<Constant> {
    vec![
        constant!(strs, rank_env::CONTRACT_VARS as "RANK_CONTRACT_VARS", "Every variable of the rank contract, in order."),
        constant!(strs, rank_env::GPU_VARS as "RANK_GPU_VARS", "Variables an agent with GPUs sets for every rank."),
        constant!(str, rank_env::RANK as "RANK_ENV_RANK", "Global rank, ``0..WORLD_SIZE``."),
        constant!(str, rank_env::WORLD_SIZE as "RANK_ENV_WORLD_SIZE", "Number of ranks of the job."),
        constant!(str, rank_env::LOCAL_RANK as "RANK_ENV_LOCAL_RANK", "Rank among the job's ranks on this worker."),
        constant!(str, rank_env::LOCAL_WORLD_SIZE as "RANK_ENV_LOCAL_WORLD_SIZE", "Number of the job's ranks on this worker."),
        constant!(str, rank_env::MASTER_ADDR as "RANK_ENV_MASTER_ADDR", "Host of rank 0's rendezvous."),
        constant!(str, rank_env::MASTER_PORT as "RANK_ENV_MASTER_PORT", "Port of rank 0's rendezvous."),
        constant!(str, rank_env::JOB_ID as "RANK_ENV_JOB_ID", "The job id."),
        constant!(str, rank_env::ATTEMPT as "RANK_ENV_ATTEMPT", "The rank's attempt number (0 for its first run)."),
        constant!(str, rank_env::SHARDS_FILE as "RANK_ENV_SHARDS_FILE", "File listing the rank's shards, one path a line."),
        constant!(str, rank_env::AGENT_URL as "RANK_ENV_AGENT_URL", "Base URL of the agent's rank-local API."),
        constant!(str, rank_env::AGENT_TOKEN as "RANK_ENV_AGENT_TOKEN", "Bearer token of this attempt for the rank-local API."),
        constant!(str, rank_env::AGENT_SOCKET as "RANK_ENV_AGENT_SOCKET", "Unix socket of the rank-local API (ranks run as another user)."),
        constant!(str, rank_env::CKPT_STAGING as "RANK_ENV_CKPT_STAGING", "Directory a checkpoint part is written into before its commit."),
        constant!(str, rank_env::RESUME_DIR as "RANK_ENV_RESUME_DIR", "Directory of the committed part this attempt resumes from."),
        constant!(str, rank_env::RESUME_STEP as "RANK_ENV_RESUME_STEP", "Checkpoint step this attempt resumes from."),
        constant!(str, rank_env::CUDA_VISIBLE_DEVICES as "RANK_ENV_CUDA_VISIBLE_DEVICES", "The GPUs a rank may use, by UUID, comma-separated."),
        constant!(str, rank_env::GPU_MEMORY_FRACTION as "RANK_ENV_GPU_MEMORY_FRACTION", "The rank's share of its GPU's memory, ``0 < f <= 1``."),
        constant!(
            int,
            rank_env::EXIT_AGENT_UNREACHABLE,
            "Exit code of a rank that could not reach its agent's rank-local API after its retries."
        ),
        constant!(str, rank_env::OUTPUT_DIR as "RANK_ENV_OUTPUT_DIR", "Directory whose contents are uploaded as the attempt's artifacts when it ends."),
        constant!(str, rank_env::DATA_PLAN as "RANK_ENV_DATA_PLAN", "An elastic job's data plan for the rank (JSON file)."),
        constant!(str, rank_env::DATA_STATE_KEY as "RANK_DATA_STATE_KEY", "Key of the data position in an elastic job's checkpoint state."),
        constant!(int, rank_env::MAX_DATA_CARRY_BYTES as "RANK_MAX_DATA_CARRY_BYTES", "Largest carry of a data position, compact JSON, in bytes."),
        constant!(
            int,
            rank_env::EXIT_CANNOT_RUN,
            "Exit code of a rank that cannot run here whatever restarts: the job fails at once."
        ),
        constant!(str, rank_local::ACTION_NONE as "RANK_ACTION_NONE", "The rank-local control action that asks nothing (go on)."),
        constant!(int, rank_local::MAX_REPLY_BYTES as "RANK_MAX_REPLY_BYTES", "Most bytes of a rank-local reply body a rank reads."),
        constant!(int, rank_local::MAX_LISTED_STEPS as "RANK_MAX_LISTED_STEPS", "Most committed steps one rank-local GET /v1/checkpoints reply lists (the newest)."),
        constant!(int, rank_local::MAX_EXCEPTION_TYPE_BYTES as "RANK_MAX_EXCEPTION_TYPE_BYTES", "Longest exception type of a rank-local POST /v1/exception, in bytes."),
        constant!(int, rank_local::MAX_EXCEPTION_MESSAGE_BYTES as "RANK_MAX_EXCEPTION_MESSAGE_BYTES", "Longest exception message of a rank-local POST /v1/exception, in bytes."),
        constant!(int, rank_local::MAX_EXCEPTION_FRAMES as "RANK_MAX_EXCEPTION_FRAMES", "Most frames of a rank-local POST /v1/exception (the innermost)."),
        constant!(int, rank_local::MAX_EXCEPTION_FRAME_BYTES as "RANK_MAX_EXCEPTION_FRAME_BYTES", "Longest frame (and origin) of a rank-local POST /v1/exception, in bytes."),
        constant!(int, rank_local::MAX_RESTART_POLL_MS as "RANK_MAX_RESTART_POLL_MS", "Longest wait of one rank-local GET /v1/restart long poll, in milliseconds."),
        constant!(int, rank_local::RESTART_ACK_TIMEOUT_MS as "RANK_RESTART_ACK_TIMEOUT_MS", "How long an in-process restart waits for the rank's POST /v1/restart before it falls back to a full restart, in milliseconds."),
    ]
}

/// The blob store ([`blobs`]): blob names, the packed-directory format's limits, the
/// result files of a remote function.
fn blob_constants() -> Vec<Constant> {
    vec![
        constant!(int, blobs::DIGEST_HEX_LEN as "BLOB_DIGEST_HEX_LEN", "Length of a blob digest (BLAKE3, lowercase hex)."),
        constant!(
            int,
            blobs::DEFAULT_MAX_WORKDIR_BYTES,
            "Default cap on a packed working directory, in bytes."
        ),
        constant!(
            int,
            blobs::MAX_BLOB_BYTES,
            "Hard cap on one blob a coordinator accepts, in bytes."
        ),
        constant!(int, blobs::CHUNK_BYTES as "BLOB_CHUNK_BYTES", "Most bytes of one blob chunk on the wire."),
        constant!(
            int,
            blobs::MAX_UNPACKED_BYTES,
            "Most bytes an archive may unpack to."
        ),
        constant!(
            int,
            blobs::MAX_EXPANSION_RATIO,
            "Largest unpacked-to-packed ratio of an archive."
        ),
        constant!(
            int,
            blobs::MAX_ARCHIVE_ENTRIES,
            "Most entries of one archive."
        ),
        constant!(
            int,
            blobs::MAX_ENTRY_PATH_BYTES,
            "Longest path of one archive entry, in bytes."
        ),
        constant!(
            int,
            blobs::DEFAULT_MAX_ARTIFACT_BYTES,
            "Default cap on one attempt's packed artifacts, in bytes."
        ),
        constant!(
            int,
            blobs::DEFAULT_MAX_RESULT_BYTES,
            "Default cap on a remote function's pickled result, in bytes."
        ),
        constant!(
            int,
            blobs::MAX_REQUIREMENTS_BYTES,
            "Longest requirements text of an environment, in bytes."
        ),
        constant!(
            int,
            blobs::MAX_FIND_LINKS,
            "Most find-links entries of an environment."
        ),
        constant!(str, blobs::RESULT_FILE as "REMOTE_RESULT_FILE", "Where a remote function's result is written under the output dir."),
        constant!(str, blobs::ERROR_FILE as "REMOTE_ERROR_FILE", "Where a remote function's exception is written under the output dir."),
    ]
}

/// The JSON spellings of non-finite metric values ([`metric_json`]).
fn metric_constants() -> Vec<Constant> {
    vec![
        constant!(str, metric_json::NAN as "METRIC_JSON_NAN", "JSON spelling of a NaN metric value (a finite one is a number)."),
        constant!(str, metric_json::INFINITY as "METRIC_JSON_INFINITY", "JSON spelling of a metric value of +infinity."),
        constant!(str, metric_json::NEG_INFINITY as "METRIC_JSON_NEG_INFINITY", "JSON spelling of a metric value of -infinity."),
        constant!(
            int,
            states::MemberRole::UNREACHABLE_AFTER_HEARTBEATS as "MEMBER_UNREACHABLE_AFTER_HEARTBEATS",
            "Raft heartbeat intervals without an acknowledgement after which the leader shows a coordinator as ``unreachable``."
        ),
    ]
}

/// How a client finds and reaches a cluster ([`client_config`]): its environment
/// variables, the local cluster's directory and file, and the retry and timeout bounds.
fn client_config_constants() -> Vec<Constant> {
    vec![
        constant!(
            strs,
            client_config::CLIENT_ENV_VARS,
            "Every client environment variable, sorted."
        ),
        constant!(str, client_config::ENV_ADDR as "CLIENT_ENV_ADDR", "Coordinator gRPC addresses, comma-separated ``host:port``."),
        constant!(str, client_config::ENV_HTTP as "CLIENT_ENV_HTTP", "Coordinator HTTP addresses, comma-separated ``host:port``."),
        constant!(str, client_config::ENV_TOKEN as "CLIENT_ENV_TOKEN", "A bearer token."),
        constant!(str, client_config::ENV_TOKEN_FILE as "CLIENT_ENV_TOKEN_FILE", "File holding a bearer token."),
        constant!(str, client_config::ENV_TLS_CA as "CLIENT_ENV_TLS_CA", "The cluster's CA certificate (PEM)."),
        constant!(str, client_config::ENV_TLS_CERT as "CLIENT_ENV_TLS_CERT", "A user's client certificate (PEM)."),
        constant!(str, client_config::ENV_TLS_KEY as "CLIENT_ENV_TLS_KEY", "The private key of the client certificate (PEM)."),
        constant!(str, client_config::ENV_INSECURE as "CLIENT_ENV_INSECURE", "Plaintext to a cluster started with ``--insecure``."),
        constant!(str, client_config::ENV_LOCAL_DIR as "CLIENT_ENV_LOCAL_DIR", "Directory of the local cluster."),
        constant!(str, client_config::ENV_TIMEOUT as "CLIENT_ENV_TIMEOUT", "Seconds a ``cumulusctl`` call keeps retrying."),
        constant!(
            str,
            client_config::DEFAULT_LOCAL_DIR,
            "The local cluster's directory by default."
        ),
        constant!(
            str,
            client_config::CLUSTER_FILE,
            "File name of the local cluster's description."
        ),
        constant!(
            int,
            client_config::MAX_CLUSTER_FILE_BYTES,
            "Largest ``cluster.json`` a client reads, in bytes."
        ),
        constant!(
            int,
            client_config::RETRY_MAX_TRIES,
            "Most tries of one call, over all coordinators."
        ),
        constant!(
            int,
            client_config::RETRY_TOTAL_MS,
            "No new try of a call starts this long after its first, in ms."
        ),
        constant!(
            int,
            client_config::RETRY_BACKOFF_INITIAL_MS,
            "First backoff before the next coordinator, in ms (it doubles)."
        ),
        constant!(
            int,
            client_config::RETRY_BACKOFF_MAX_MS,
            "Largest backoff between tries, in milliseconds."
        ),
        constant!(
            int,
            client_config::CONNECT_TIMEOUT_MS,
            "TCP connect time limit of one try, in milliseconds."
        ),
        constant!(
            int,
            client_config::REQUEST_TIMEOUT_MS,
            "Time limit of one request, in milliseconds."
        ),
    ]
}

fn members<T: Copy + std::fmt::Debug>(
    all: &[T],
    as_str: fn(T) -> &'static str,
) -> Vec<(String, &'static str)> {
    all.iter().map(|v| (format!("{v:?}"), as_str(*v))).collect()
}

fn enums() -> Vec<WireEnum> {
    let mut all = vec![
        WireEnum {
            name: "JobState",
            rust: "cumulus_api::states::JobState",
            doc: "Lifecycle of a job (``Job.state``).",
            all_name: "JOB_STATES",
            members: members(JobState::ALL, JobState::as_str),
            default: None,
            subset: Some((
                "TERMINAL_JOB_STATES",
                "Job states after which nothing will run for the job again.",
                sorted(
                    JobState::ALL
                        .iter()
                        .filter(|s| s.is_terminal())
                        .map(|s| s.as_str()),
                ),
            )),
        },
        WireEnum {
            name: "RankState",
            rust: "cumulus_api::states::RankState",
            doc: "State of a rank's attempt as the Raft log stores it (the APIs show a ``RankPhase``).",
            all_name: "RANK_STATES",
            members: members(RankState::ALL, RankState::as_str),
            default: None,
            subset: None,
        },
        WireEnum {
            name: "RankPhase",
            rust: "cumulus_api::states::RankPhase",
            doc: "A rank's state as the APIs show it (``RankStatus.state``).",
            all_name: "RANK_PHASES",
            members: members(RankPhase::ALL, RankPhase::as_str),
            default: None,
            subset: None,
        },
        WireEnum {
            name: "RestartScope",
            rust: "cumulus_api::states::RestartScope",
            doc: "Whether a failure restarts every rank of the job or only the failed one.",
            all_name: "RESTART_SCOPES",
            members: members(RestartScope::ALL, RestartScope::as_str),
            default: Some(("DEFAULT_RESTART_SCOPE", RestartScope::default().as_str())),
            subset: None,
        },
        WireEnum {
            name: "RestartPath",
            rust: "cumulus_api::states::RestartPath",
            doc: "How a restart was carried out: new processes, or survivors kept in-process.",
            all_name: "RESTART_PATHS",
            members: members(RestartPath::ALL, RestartPath::as_str),
            default: Some(("DEFAULT_RESTART_PATH", RestartPath::default().as_str())),
            subset: None,
        },
        WireEnum {
            name: "CommitTier",
            rust: "cumulus_api::states::CommitTier",
            doc: "Where a checkpoint step with an S3 target counts as committed.",
            all_name: "COMMIT_TIERS",
            members: members(CommitTier::ALL, CommitTier::as_str),
            default: Some(("DEFAULT_COMMIT_TIER", CommitTier::default().as_str())),
            subset: None,
        },
        WireEnum {
            name: "StopAction",
            rust: "cumulus_api::states::StopAction",
            doc: "Why the ranks of a running job are asked to stop.",
            all_name: "STOP_ACTIONS",
            members: members(StopAction::ALL, StopAction::as_str),
            default: None,
            subset: None,
        },
        WireEnum {
            name: "StragglerAction",
            rust: "cumulus_api::states::StragglerAction",
            doc: "What the leader does about a rank that runs slower than its job's others.",
            all_name: "STRAGGLER_ACTIONS",
            members: members(StragglerAction::ALL, StragglerAction::as_str),
            default: Some((
                "DEFAULT_STRAGGLER_ACTION",
                StragglerAction::default().as_str(),
            )),
            subset: None,
        },
        WireEnum {
            name: "Role",
            rust: "cumulus_api::states::Role",
            doc: "What a user may do, from least to most.",
            all_name: "ROLES",
            members: members(Role::ALL, Role::as_str),
            default: None,
            subset: None,
        },
        WireEnum {
            name: "WorkerState",
            rust: "cumulus_api::states::WorkerPhase",
            doc: "A worker agent as the leader shows it (``WorkerInfo.state``).",
            all_name: "WORKER_STATES",
            members: members(WorkerPhase::ALL, WorkerPhase::as_str),
            default: None,
            subset: None,
        },
        WireEnum {
            name: "MemberRole",
            rust: "cumulus_api::states::MemberRole",
            doc: "A coordinator as the answering coordinator shows it (``MemberInfo.role``).",
            all_name: "MEMBER_ROLES",
            members: members(MemberRole::ALL, MemberRole::as_str),
            default: None,
            subset: None,
        },
        WireEnum {
            name: "CheckpointTier",
            rust: "cumulus_api::states::CheckpointTier",
            doc: "A tier that holds a verified copy of a checkpoint step (``CheckpointInfo.tiers``).",
            all_name: "CHECKPOINT_TIERS",
            members: members(CheckpointTier::ALL, CheckpointTier::as_str),
            default: None,
            subset: None,
        },
    ];
    all.sort_by(|a, b| a.name.cmp(b.name));
    all
}

fn sorted<'a>(items: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut v: Vec<&str> = items.collect();
    v.sort_unstable();
    v
}

/// The contract as this crate defines it.
pub fn contract() -> Contract {
    Contract {
        constants: constants(),
        enums: enums(),
        shapes: vec![
            &manifest::MANIFEST_FILE_ENTRY,
            &manifest::MANIFEST_PART,
            &manifest::MANIFEST,
            &client_config::CLUSTER_FILE_COORDINATOR,
            &client_config::CLUSTER_FILE_WORKER,
            &client_config::CLUSTER_FILE_SHAPE,
        ],
    }
}

/// Both generated files: `(path relative to the repository root, content)`.
pub fn files() -> Vec<(&'static str, String)> {
    let c = contract();
    vec![(PYTHON_PATH, python(&c)), (JSON_PATH, json(&c))]
}

// --- Python ----------------------------------------------------------------------------

/// `TimedOut` → `TIMED_OUT`.
fn upper_snake(variant: &str) -> String {
    let mut out = String::new();
    for (i, ch) in variant.chars().enumerate() {
        if ch.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(ch.to_ascii_uppercase());
    }
    out
}

/// `#: ` comment lines of `text`, wrapped to fit 100 columns after `indent`.
fn comment(out: &mut String, indent: &str, text: &str) {
    let width = 100 - indent.len() - 3;
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            let _ = writeln!(out, "{indent}#: {line}");
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        let _ = writeln!(out, "{indent}#: {line}");
    }
}

/// An integer literal, thousands separated with `_` from 10 000 up.
fn py_int(v: i128) -> String {
    let digits = v.unsigned_abs().to_string();
    let grouped = if digits.len() > 4 {
        let mut g = String::new();
        for (i, ch) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i).is_multiple_of(3) {
                g.push('_');
            }
            g.push(ch);
        }
        g
    } else {
        digits
    };
    if v < 0 {
        format!("-{grouped}")
    } else {
        grouped
    }
}

/// A string literal (the contract's strings are printable ASCII without quotes).
fn py_str(s: &str) -> String {
    assert!(
        s.bytes()
            .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\'),
        "a contract string must be plain printable ASCII: {s:?}"
    );
    format!("\"{s}\"")
}

/// A tuple of strings as `ruff format` leaves it: one item inline, more one per line
/// (with the magic trailing comma), each line indented by `indent` more.
fn py_tuple(out: &mut String, items: &[&str], indent: &str) {
    if let [one] = items {
        let _ = writeln!(out, "({},)", py_str(one));
        return;
    }
    out.push_str("(\n");
    for item in items {
        let _ = writeln!(out, "{indent}    {},", py_str(item));
    }
    let _ = writeln!(out, "{indent})");
}

/// A docstring of `text` (wrapped) and the Rust item it comes from, indented by four.
fn docstring(out: &mut String, text: &str, rust: Option<&str>) {
    let mut wrapped = String::new();
    comment(&mut wrapped, "    ", text);
    let lines: Vec<&str> = wrapped
        .lines()
        .map(|l| l.trim_start().trim_start_matches("#: "))
        .collect();
    match (lines.as_slice(), rust) {
        ([one], None) if one.len() + 10 <= 100 => {
            let _ = writeln!(out, "    \"\"\"{one}\"\"\"");
        }
        _ => {
            let _ = write!(out, "    \"\"\"");
            for (i, l) in lines.iter().enumerate() {
                if i > 0 {
                    out.push_str("    ");
                }
                let _ = writeln!(out, "{l}");
            }
            if let Some(rust) = rust {
                let _ = writeln!(out, "\n    Rust: ``{rust}``.");
            }
            out.push_str("    \"\"\"\n");
        }
    }
}

/// `__all__` sorted as ruff's RUF022 wants it: SCREAMING_CASE, then CamelCase, then the
/// rest, each alphabetically.
fn all_sorted(mut names: Vec<String>) -> Vec<String> {
    fn class(name: &str) -> u8 {
        if name
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        {
            0
        } else if name.starts_with(|c: char| c.is_ascii_uppercase()) {
            1
        } else {
            2
        }
    }
    names.sort_by(|a, b| (class(a), a).cmp(&(class(b), b)));
    names
}

fn py_type(ty: FieldType) -> String {
    match ty {
        FieldType::Int => "int".into(),
        FieldType::OptionalInt => "int | None".into(),
        FieldType::Str => "str".into(),
        FieldType::Bool => "bool".into(),
        FieldType::Object => "dict[str, object]".into(),
        FieldType::List(shape) => format!("list[{}]", shape.name),
    }
}

/// The Python module.
pub fn python(c: &Contract) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        r#""""The contract between Cumulus processes, as the Rust crate ``cumulus-api`` defines it:
wire spellings of states, the rank and client environment variables, shared limits, and
the JSON shapes of ``MANIFEST.json`` and ``cluster.json``.

Generated by ``api/src/contract.rs``, do not edit; regenerate with
``{REGENERATE}`` (``cargo test -p cumulus-api``
fails while this file is stale). Standard library only.
"""

from __future__ import annotations

import enum
from typing import Final, TypedDict

"#
    );
    let mut names: Vec<String> = Vec::new();
    for k in &c.constants {
        names.push(k.name.to_string());
    }
    for e in &c.enums {
        names.push(e.name.to_string());
        names.push(e.all_name.to_string());
        if let Some((n, _)) = e.default {
            names.push(n.to_string());
        }
        if let Some((n, _, _)) = &e.subset {
            names.push(n.to_string());
        }
    }
    for s in &c.shapes {
        names.push(s.name.to_string());
    }
    out.push_str("__all__ = [\n");
    for n in all_sorted(names) {
        let _ = writeln!(out, "    {},", py_str(&n));
    }
    out.push_str("]\n");

    out.push_str("\n# --- Constants ");
    out.push_str(&"-".repeat(100 - "# --- Constants ".len()));
    out.push_str("\n\n");
    for k in &c.constants {
        comment(&mut out, "", &format!("{} Rust: ``{}``.", k.doc, k.rust));
        match k.value {
            Value::Int(v) => {
                let _ = writeln!(out, "{}: Final = {}", k.name, py_int(v));
            }
            Value::Str(s) => {
                let _ = writeln!(out, "{}: Final = {}", k.name, py_str(s));
            }
            Value::Strs(items) => {
                let _ = write!(out, "{}: Final[tuple[str, ...]] = ", k.name);
                py_tuple(&mut out, items, "");
            }
        }
    }

    out.push_str("\n# --- States ");
    out.push_str(&"-".repeat(100 - "# --- States ".len()));
    out.push('\n');
    out.push_str(
        r#"

class _Spelling(str, enum.Enum):
    """Base of the state enums: a member is its wire spelling, a ``str`` that compares,
    hashes, prints and formats as that spelling (``JobState.RUNNING == "running"``,
    ``f"{JobState.RUNNING}" == "running"``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)
"#,
    );
    for e in &c.enums {
        let _ = writeln!(out, "\n\nclass {}(_Spelling):", e.name);
        docstring(&mut out, e.doc, Some(e.rust));
        out.push('\n');
        for (variant, spelling) in &e.members {
            let _ = writeln!(out, "    {} = {}", upper_snake(variant), py_str(spelling));
        }
        out.push_str("\n\n");
        comment(
            &mut out,
            "",
            &format!("Every spelling of :class:`{}`, in order.", e.name),
        );
        let spellings: Vec<&str> = e.members.iter().map(|(_, s)| *s).collect();
        let _ = write!(out, "{}: Final[tuple[str, ...]] = ", e.all_name);
        py_tuple(&mut out, &spellings, "");
        if let Some((name, value)) = e.default {
            comment(&mut out, "", &format!("The default :class:`{}`.", e.name));
            let _ = writeln!(out, "{name}: Final = {}", py_str(value));
        }
        if let Some((name, doc, items)) = &e.subset {
            comment(&mut out, "", doc);
            let _ = write!(out, "{name}: Final[frozenset[str]] = frozenset(\n    ");
            py_tuple(&mut out, items, "    ");
            out.push_str(")\n");
        }
    }

    out.push_str("\n# --- JSON shapes ");
    out.push_str(&"-".repeat(100 - "# --- JSON shapes ".len()));
    out.push('\n');
    for s in &c.shapes {
        let required: Vec<_> = s.fields.iter().filter(|f| f.required).collect();
        let optional: Vec<_> = s.fields.iter().filter(|f| !f.required).collect();
        let body = |out: &mut String, fields: &[&crate::shape::Field]| {
            for f in fields {
                comment(out, "    ", f.doc);
                let _ = writeln!(out, "    {}: {}", f.name, py_type(f.ty));
            }
        };
        if optional.is_empty() {
            let _ = writeln!(out, "\n\nclass {}(TypedDict):", s.name);
            docstring(&mut out, s.doc, None);
            out.push('\n');
            body(&mut out, &required);
        } else {
            let _ = writeln!(out, "\n\nclass _{}Required(TypedDict):", s.name);
            let doc = format!("The fields of :class:`{}` every writer writes.", s.name);
            docstring(&mut out, &doc, None);
            out.push('\n');
            body(&mut out, &required);
            let _ = writeln!(
                out,
                "\n\nclass {}(_{}Required, total=False):",
                s.name, s.name
            );
            docstring(&mut out, s.doc, None);
            out.push('\n');
            body(&mut out, &optional);
        }
    }
    out
}

// --- JSON ------------------------------------------------------------------------------

fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json_strs(items: &[&str]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| json_str(s)).collect();
    format!("[{}]", quoted.join(", "))
}

fn json_type(ty: FieldType) -> String {
    match ty {
        FieldType::Int => "\"int\"".into(),
        FieldType::OptionalInt => "\"int | null\"".into(),
        FieldType::Str => "\"string\"".into(),
        FieldType::Bool => "\"bool\"".into(),
        FieldType::Object => "\"object\"".into(),
        FieldType::List(shape) => json_str(&format!("list of {}", shape.name)),
    }
}

/// The machine-readable contract: one JSON object, two-space indented, keys in a fixed
/// order, entries sorted by name.
pub fn json(c: &Contract) -> String {
    let mut out = String::from("{\n");
    let _ = writeln!(
        out,
        "  \"generated_by\": {},",
        json_str(&format!("{REGENERATE} (api/src/contract.rs); do not edit"))
    );
    out.push_str("  \"constants\": {\n");
    for (i, k) in c.constants.iter().enumerate() {
        let value = match k.value {
            Value::Int(v) => v.to_string(),
            Value::Str(s) => json_str(s),
            Value::Strs(items) => json_strs(items),
        };
        let comma = if i + 1 < c.constants.len() { "," } else { "" };
        let _ = writeln!(
            out,
            "    {}: {{\"value\": {value}, \"rust\": {}}}{comma}",
            json_str(k.name),
            json_str(&k.rust)
        );
    }
    out.push_str("  },\n  \"enums\": {\n");
    for (i, e) in c.enums.iter().enumerate() {
        let spellings: Vec<&str> = e.members.iter().map(|(_, s)| *s).collect();
        let _ = write!(
            out,
            "    {}: {{\"rust\": {}, \"values\": {}",
            json_str(e.name),
            json_str(e.rust),
            json_strs(&spellings)
        );
        if let Some((_, d)) = e.default {
            let _ = write!(out, ", \"default\": {}", json_str(d));
        }
        if let Some((name, _, items)) = &e.subset {
            let _ = write!(
                out,
                ", {}: {}",
                json_str(&name.to_ascii_lowercase()),
                json_strs(items)
            );
        }
        let comma = if i + 1 < c.enums.len() { "," } else { "" };
        let _ = writeln!(out, "}}{comma}");
    }
    out.push_str("  },\n  \"shapes\": {\n");
    for (i, s) in c.shapes.iter().enumerate() {
        let _ = writeln!(out, "    {}: [", json_str(s.name));
        for (j, f) in s.fields.iter().enumerate() {
            let comma = if j + 1 < s.fields.len() { "," } else { "" };
            let _ = writeln!(
                out,
                "      {{\"name\": {}, \"type\": {}, \"required\": {}}}{comma}",
                json_str(f.name),
                json_type(f.ty),
                f.required
            );
        }
        let comma = if i + 1 < c.shapes.len() { "," } else { "" };
        let _ = writeln!(out, "    ]{comma}");
    }
    out.push_str("  }\n}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_numbers_render_as_python_writes_them() {
        assert_eq!(upper_snake("TimedOut"), "TIMED_OUT");
        assert_eq!(upper_snake("L2"), "L2");
        assert_eq!(py_int(128), "128");
        assert_eq!(py_int(3_600_000), "3_600_000");
        assert_eq!(py_int(-1000), "-1000");
        assert_eq!(py_int(100_000), "100_000");
    }

    #[test]
    fn every_name_is_unique() {
        let c = contract();
        let mut names: Vec<&str> = c.constants.iter().map(|k| k.name).collect();
        names.extend(c.enums.iter().flat_map(|e| [e.name, e.all_name]));
        names.extend(c.shapes.iter().map(|s| s.name));
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n, "a generated name is used twice");
    }

    #[test]
    fn rendering_is_deterministic() {
        assert_eq!(files(), files());
    }
}
