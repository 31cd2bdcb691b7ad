//! Limits that more than one process checks: the CLI and the Python SDK refuse a request
//! before sending it, the coordinator's API refuses it with a clear error, and `apply`
//! (the state machine) refuses it even if a buggy or hostile client got past both.
//!
//! Limits private to one process (queue depths, buffer sizes) stay with that process.

/// Longest submit idempotency key (`SubmitJobRequest.request_id`), in bytes; it is never
/// empty.
pub const MAX_REQUEST_ID_BYTES: usize = 128;
/// Longest job name, in bytes.
pub const MAX_JOB_NAME_BYTES: usize = 128;
/// Hard upper bound on world size accepted by `apply` (coordinators may set a lower one
/// with `--max-world-size`).
pub const MAX_WORLD_SIZE: u32 = 65_536;
/// Argument count limit of a rank command.
pub const MAX_COMMAND_ARGS: usize = 256;
/// Byte limit of one command argument, env key or env value.
pub const MAX_ARG_BYTES: usize = 4_096;
/// Limit on a job's env entries.
pub const MAX_ENV_ENTRIES: usize = 256;
/// Upper bound on the number of shards of one job.
pub const MAX_SHARDS: usize = 100_000;
/// Upper bound on restarts a job may be given (`max_restarts`).
pub const MAX_RESTART_BUDGET: u32 = 1_000;
/// Upper bound on the backoff delay of a restart policy, in milliseconds.
pub const MAX_BACKOFF_MS: u64 = 3_600_000;
/// Upper bound on kept checkpoint steps (`ckpt_keep`).
pub const MAX_CKPT_KEEP: u32 = 100;
/// Most files one checkpoint part may hold (and most directories one staging tree may
/// hold).
pub const MAX_PART_FILES: usize = 4096;
/// Largest serialized per-rank resume state (`state_json`, compact JSON), in bytes.
pub const MAX_STATE_JSON_BYTES: usize = 64 * 1024;
/// Most metrics in one progress report to the rank-local API.
pub const MAX_METRICS: usize = 64;
/// Longest metric name in a progress report, in bytes.
pub const MAX_METRIC_NAME_BYTES: usize = 128;
/// Longest cause of a rank's exit (`RankExitedRequest.cause`): one line, control
/// characters escaped, in bytes. The agent cuts what it sends to it, the coordinator's
/// API and `apply` cut again.
pub const MAX_EXIT_CAUSE_BYTES: usize = 512;
/// Most GPUs one worker may register, and most GPUs one rank may ask for.
pub const MAX_GPUS_PER_WORKER: usize = 64;
/// Longest GPU UUID, in bytes (NVML's are 40: `GPU-` and a hyphenated UUID).
pub const MAX_GPU_UUID_BYTES: usize = 128;
/// Longest GPU product name, in bytes.
pub const MAX_GPU_NAME_BYTES: usize = 128;
/// Longest GPU error text in a heartbeat, in bytes (the agent cuts NVML's messages to it).
pub const MAX_GPU_ERROR_BYTES: usize = 512;
/// Largest shards file a rank reads (`CUMULUS_SHARDS_FILE`), in bytes (64 MiB): the
/// example trainer and the Python runtime refuse a larger one.
pub const MAX_SHARDS_FILE_BYTES: u64 = 64 << 20;
/// Highest queue priority of a job (and, negated, the lowest): `-MAX_PRIORITY..=MAX_PRIORITY`.
pub const MAX_PRIORITY: i32 = 1_000;
/// Longest stop grace a job may ask for (`stop_grace_ms`): 1 hour, in milliseconds.
pub const MAX_STOP_GRACE_MS: u64 = 3_600_000;
/// Longest time limit a job may ask for (`time_limit_ms`): 365 days, in milliseconds.
pub const MAX_TIME_LIMIT_MS: u64 = 365 * 86_400_000;
/// An attempt's startup timeout when a job with a progress timeout names none
/// (`startup_timeout_ms` 0): 10 minutes from the process's start to its first progress
/// report, in milliseconds (room for imports, data loading and a rendezvous).
pub const DEFAULT_STARTUP_TIMEOUT_MS: u64 = 600_000;
/// Longest startup timeout a job may ask for (`startup_timeout_ms`): 7 days, in
/// milliseconds (as the progress timeout).
pub const MAX_STARTUP_TIMEOUT_MS: u64 = 7 * 86_400_000;
/// Most job summaries one `ListJobSummaries` answers (`limit` is `1..=MAX_SUMMARIES`).
pub const MAX_SUMMARIES: usize = 10_000;
/// Summaries a `ListJobSummaries` without a limit answers.
pub const DEFAULT_SUMMARIES: usize = 1_000;
/// Most warm spares a job may ask each of its workers to keep (`warm_spares`): idle
/// interpreters with the job's environment and imports, each taking a replacement rank's
/// place instead of a fresh process ([`crate::warm`]).
pub const MAX_WARM_SPARES: u32 = 8;
/// Most modules a job may name for its warm spares to import before an assignment
/// (`warm_imports`).
pub const MAX_WARM_IMPORTS: usize = 32;
/// Longest module name in `warm_imports`, in bytes.
pub const MAX_WARM_IMPORT_BYTES: usize = 128;
/// A straggler is a rank whose steps/s stays below this share of the median of its job's
/// other ranks for the job's straggler window, in thousandths (0.7), unless the job names
/// its own `straggler_fraction`.
pub const DEFAULT_STRAGGLER_FRACTION_PERMILLE: u32 = 700;
/// Smallest `straggler_fraction` a job may ask for, in thousandths (0.1).
pub const MIN_STRAGGLER_FRACTION_PERMILLE: u32 = 100;
/// Largest `straggler_fraction` a job may ask for, in thousandths (0.95): nearer 1, noise
/// alone would flag ranks.
pub const MAX_STRAGGLER_FRACTION_PERMILLE: u32 = 950;
/// How long a rank must stay below the straggler fraction to be flagged, unless the job
/// names its own `straggler_window_ms`: 60 s, in milliseconds.
pub const DEFAULT_STRAGGLER_WINDOW_MS: u64 = 60_000;
/// Shortest `straggler_window_ms` a job may ask for: 2 s, in milliseconds (progress
/// reaches the leader with heartbeats, one a second by default).
pub const MIN_STRAGGLER_WINDOW_MS: u64 = 2_000;
/// Longest `straggler_window_ms` a job may ask for: 1 day, in milliseconds.
pub const MAX_STRAGGLER_WINDOW_MS: u64 = 86_400_000;
