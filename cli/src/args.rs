//! Command-line grammar of `cumulusctl` (clap derive).
//!
//! Global options come first or anywhere (`global = true`); every connection option also
//! reads an environment variable, and when neither is given the values come from the
//! `cluster.json` that `cumulusctl local up` writes into `--local-dir`.

use cumulus_api::client_config::{
    DEFAULT_LOCAL_DIR, ENV_ADDR, ENV_HTTP, ENV_INSECURE, ENV_LOCAL_DIR, ENV_TIMEOUT, ENV_TLS_CA,
    ENV_TLS_CERT, ENV_TLS_KEY, ENV_TOKEN, ENV_TOKEN_FILE, RETRY_TOTAL_MS,
};
use cumulus_api::limits::{MAX_PRIORITY, MAX_STOP_GRACE_MS, MAX_SUMMARIES};
pub use cumulus_api::{CommitTier, RestartScope};
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

// The contract's bounds as clap's ranges take them (`u64`, or `i64` for smaller types).
/// Longest `--stop-grace-s`, in seconds.
const MAX_STOP_GRACE_S: u64 = MAX_STOP_GRACE_MS / 1000;
/// Bound of `--startup-timeout-s`.
const MAX_STARTUP_TIMEOUT_S: u64 = cumulus_api::limits::MAX_STARTUP_TIMEOUT_MS / 1000;
/// Bound of `--priority` (`-PRIORITY_BOUND..=PRIORITY_BOUND`).
const PRIORITY_BOUND: i64 = MAX_PRIORITY as i64;
/// Most summaries `summary --limit` asks for.
const SUMMARIES_BOUND: i64 = MAX_SUMMARIES as i64;
/// Most shards `dataset split --shards` writes (the most one job may have).
const SHARDS_BOUND: i64 = crate::dataset::MAX_SHARDS as i64;

/// `cumulusctl`: submit, inspect, tail and cancel Cumulus jobs; run a local cluster.
#[derive(Debug, Parser)]
#[command(
    name = "cumulusctl",
    version,
    about,
    long_about = None,
    propagate_version = true,
    after_help = "Examples:
  cumulusctl demo                                   # local cluster, training job, a rank killed and resumed
  cumulusctl local up                               # 3 coordinators + 2 workers on 127.0.0.1 under .cumulus/
  cumulusctl dataset split data/digits/digits.csv.gz --shards 8 --out shards --holdout-out holdout.csv
  cumulusctl submit --world-size 4 --dataset shards --ckpt-dir ckpt -- python train.py
  cumulusctl run --upload . --requirements requirements.txt -- python train.py
  cumulusctl run -c 'import sys; print(sys.version)'
  cumulusctl logs -f job-000001
  cumulusctl status job-000001"
)]
pub struct Cli {
    /// Options shared by every command.
    #[command(flatten)]
    pub global: GlobalOpts,
    /// The command to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Options shared by every command.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Global options")]
pub struct GlobalOpts {
    /// Coordinator gRPC addresses, comma-separated `host:port` (any member; writes follow
    /// the leader). Default: the local cluster's, from `<local-dir>/cluster.json`.
    #[arg(long, global = true, env = ENV_ADDR, value_delimiter = ',')]
    pub addr: Vec<String>,
    /// Coordinator HTTP addresses, comma-separated `host:port` (used by `logs`).
    /// Default: the local cluster's, from `<local-dir>/cluster.json`.
    #[arg(long, global = true, env = ENV_HTTP, value_delimiter = ',')]
    pub http: Vec<String>,
    /// Cluster bearer token, from the environment only: `--token` on the command line is
    /// refused (every user of the machine sees it in `ps`).
    #[arg(
        long,
        global = true,
        env = ENV_TOKEN,
        conflicts_with = "token_file",
        hide = true,
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// File holding the cluster bearer token (surrounding whitespace is ignored), or set
    /// CUMULUS_TOKEN.
    #[arg(long, global = true, env = ENV_TOKEN_FILE)]
    pub token_file: Option<PathBuf>,
    /// The cluster's CA certificate (PEM): coordinators are verified against it. Default:
    /// the local cluster's, from `<local-dir>/cluster.json`.
    #[arg(long, global = true, env = ENV_TLS_CA)]
    pub tls_ca: Option<PathBuf>,
    /// A user's client certificate (PEM, issued by `certs issue user NAME`): with
    /// `--tls-key` it authenticates as that user (a token counts only when `--token-file`
    /// is given on the command line, never one from the environment).
    #[arg(long, global = true, env = ENV_TLS_CERT, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of `--tls-cert` (PEM).
    #[arg(long, global = true, env = ENV_TLS_KEY, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Talk plaintext to a cluster started with `--insecure`.
    #[arg(
        long,
        global = true,
        env = ENV_INSECURE,
        action = clap::ArgAction::SetTrue,
        value_parser = clap::builder::BoolishValueParser::new(),
        conflicts_with_all = ["tls_ca", "tls_cert"]
    )]
    pub insecure: bool,
    /// Directory of the local cluster (`local up` writes `cluster.json` there).
    #[arg(
        long,
        global = true,
        env = ENV_LOCAL_DIR,
        default_value = DEFAULT_LOCAL_DIR
    )]
    pub local_dir: PathBuf,
    /// Output format: human tables (`wide`: more columns), or JSON or YAML for scripts.
    #[arg(short = 'o', long, global = true, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
    /// Give up on an unreachable or leaderless cluster after this many seconds
    /// (1..=3600): every call retries the other coordinators and follows the leader
    /// until then (a failover takes about a second).
    #[arg(long, global = true, env = ENV_TIMEOUT, value_name = "SECONDS",
          default_value_t = RETRY_TOTAL_MS / 1000, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub timeout: u64,
    /// Show the client's own diagnostics on stderr (retries, leader changes): `-v`
    /// warnings, `-vv` info, `-vvv` debug. `RUST_LOG` overrides.
    #[arg(short = 'v', long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
}

/// Output format of every command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Human-readable tables.
    Table,
    /// Tables with more columns (`list`: priority, progress, rate, running time and the
    /// workers), as `kubectl -o wide`; elsewhere the same as `table`.
    Wide,
    /// JSON (the proto messages as serde_json); `logs` prints one JSON object per line.
    Json,
    /// YAML: the same fields as JSON (`logs`: JSON lines, as with `-o json`).
    Yaml,
}

impl OutputFormat {
    /// True for the formats meant for scripts (JSON, YAML).
    pub fn is_data(self) -> bool {
        matches!(self, OutputFormat::Json | OutputFormat::Yaml)
    }
}

/// The commands.
// Parsed once per invocation: the size of the `Submit` variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Submit a job: `submit --world-size 4 -- python train.py --lr 0.1`.
    Submit(SubmitArgs),
    /// Submit a job, stream its output and exit with its outcome: `run -c 'print(42)'`.
    ///
    /// Like `docker run`: submits, prints the ranks' output as it comes, waits for the
    /// end and exits 0 when the job succeeded, else with the failing rank's exit code.
    /// `run --upload . --requirements requirements.txt -- python train.py` sends the
    /// current directory and an environment; `run -c CODE` runs `python3 -c CODE`.
    /// Ctrl-C asks whether to cancel the job (on a terminal; otherwise it leaves the job
    /// running and says how to follow it).
    Run(RunArgs),
    /// What a job's ranks left in `$CUMULUS_OUTPUT_DIR`: list, download.
    #[command(subcommand)]
    Artifacts(ArtifactsCommand),
    /// Show one job: state, ranks, restarts.
    Status(JobArg),
    /// Show one job with its events in time order (submitted, failures, restarts and
    /// their causes, the end), as `kubectl describe`.
    Describe(JobArg),
    /// List jobs, oldest first (filters: `--state`, `--name`, `--limit`).
    List(ListArgs),
    /// Progress summaries: one job's (step, steps/s, ETA, metrics, running and paused
    /// time, and its progress history), or, without JOB, the newest jobs' in a table.
    Summary(SummaryArgs),
    /// Follow a job live until it ends: a progress bar per rank with its step, rate,
    /// time left and metrics. Exits 0 when the job succeeded.
    Watch(JobArg),
    /// Cancel a job (its ranks are stopped).
    Cancel(JobArg),
    /// Pause a job: its ranks are asked to checkpoint and stop, then it holds no slots
    /// until `resume` (a pending job is parked at once). No restart budget is spent.
    Pause(JobArg),
    /// Resume a paused job: it is queued again and continues from its newest committed
    /// step, on any workers.
    Resume(JobArg),
    /// Forget a finished job (`--checkpoints`: delete its checkpoints first).
    Delete(DeleteArgs),
    /// Forget every finished job that ended before `--older-than` (only your own unless
    /// you are an administrator): `purge --state cancelled --older-than 7d`.
    Purge(PurgeArgs),
    /// Print the logs of a job's ranks (all attempts), `-f` to follow.
    Logs(LogsArgs),
    /// Checkpoints of a job.
    #[command(subcommand)]
    Ckpt(CkptCommand),
    /// The coordinator cluster.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// The worker agents: slots, heartbeats, resources and GPUs.
    Workers,
    /// Users' tokens (administrators): create, list, revoke.
    #[command(subcommand)]
    Token(TokenCommand),
    /// Who the token in use names, and its role.
    Whoami,
    /// Print a shell completion script: `source <(cumulusctl completion bash)`, or
    /// `cumulusctl completion zsh > "${fpath[1]}/_cumulusctl"`, or
    /// `cumulusctl completion fish > ~/.config/fish/completions/cumulusctl.fish`.
    Completion(CompletionArgs),
    /// Dataset preparation.
    #[command(subcommand)]
    Dataset(DatasetCommand),
    /// A local cluster of background processes on 127.0.0.1, under --local-dir.
    #[command(subcommand)]
    Local(LocalCommand),
    /// End-to-end demo: local cluster, digits training job, a rank killed and resumed.
    Demo(DemoArgs),
    /// TLS certificates: a cluster CA and the certificates it issues.
    #[command(subcommand)]
    Certs(CertsCommand),
}

/// `certs` subcommands.
#[derive(Debug, Subcommand)]
pub enum CertsCommand {
    /// Make a cluster CA in DIR (`ca.pem`, and `ca-key.pem` readable only by you: keep it
    /// off the cluster's machines), plus a certificate per coordinator and worker named.
    Init(CertsInitArgs),
    /// Issue one more certificate with the CA in DIR.
    Issue(CertsIssueArgs),
}

/// `certs init` options.
#[derive(Debug, Args)]
pub struct CertsInitArgs {
    /// Directory for the CA and certificates (created 0700).
    #[arg(long)]
    pub dir: PathBuf,
    /// Coordinator node ids to issue certificates for (`coordinator-ID.pem`),
    /// comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub coordinators: Vec<u64>,
    /// Worker ids to issue certificates for (`ID.pem`), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub workers: Vec<String>,
    /// Host names or IP addresses every certificate serves, besides localhost and the
    /// loopback addresses (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub hosts: Vec<String>,
}

/// What `certs issue` issues for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CertKind {
    /// A coordinator (ID: its node id).
    Coordinator,
    /// A worker agent (ID: its worker id).
    Worker,
    /// A user (ID: the user's name, as `token create` made it): with `--tls-cert` and
    /// `--tls-key` and no token, `cumulusctl` authenticates as that user, with the role
    /// the cluster gave them; `token revoke` revokes the certificate too.
    User,
}

/// `certs issue` options.
#[derive(Debug, Args)]
pub struct CertsIssueArgs {
    /// What the certificate is for.
    #[arg(value_enum)]
    pub kind: CertKind,
    /// The coordinator's node id, the worker's id or the user's name.
    pub id: String,
    /// Directory of the CA (`ca.pem`, `ca-key.pem`); the certificate is written there
    /// as `coordinator-ID.pem`, `ID.pem` or `user-NAME.pem` with its key.
    #[arg(long)]
    pub dir: PathBuf,
    /// Host names or IP addresses it serves, besides localhost and the loopback
    /// addresses (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub hosts: Vec<String>,
}

/// A job id argument.
#[derive(Debug, Args)]
pub struct JobArg {
    /// Job id, e.g. `job-000001`.
    pub job: String,
}

/// `delete` options.
#[derive(Debug, Args)]
pub struct DeleteArgs {
    /// Job id, e.g. `job-000001`.
    pub job: String,
    /// Delete the job's checkpoints too (its directory under the checkpoint dir, or its
    /// S3 prefix), before the job itself.
    #[arg(long)]
    pub checkpoints: bool,
}

/// `purge` options.
#[derive(Debug, Args)]
pub struct PurgeArgs {
    /// Only jobs that ended at least this long ago, e.g. `7d`, `12h`.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration_ms)]
    pub older_than: u64,
    /// Only jobs that ended in this state (succeeded, failed, cancelled, timed_out;
    /// default: any of them).
    #[arg(long, value_parser = parse_job_state)]
    pub state: Option<cumulus_api::JobState>,
    /// Delete their checkpoints too.
    #[arg(long)]
    pub checkpoints: bool,
}

/// `submit` options.
#[derive(Debug, Args)]
pub struct SubmitArgs {
    /// Number of ranks (processes) of the job: at least 1, at most the cluster's maximum
    /// (its coordinators' `--max-world-size`, 1024 by default). `MIN:MAX` makes it
    /// elastic: it starts with as many ranks as fit (at least MIN), continues with fewer
    /// when a lost worker's ranks have no room, and grows back at a checkpoint boundary;
    /// the records not consumed are dealt over the new ranks exactly once.
    #[arg(long, value_parser = parse_elastic_world_size, value_name = "N|MIN:MAX")]
    pub world_size: WorldSize,
    /// What the job runs with: data, checkpoints, restarts, resources, code, environment.
    #[command(flatten)]
    pub job: JobOpts,
    /// Wait until the job finishes; exit 0 only if it succeeded.
    #[arg(long)]
    pub wait: bool,
    /// With --wait: give up waiting after this many seconds (the job keeps running).
    #[arg(long, requires = "wait")]
    pub wait_timeout_s: Option<u64>,
    /// The command every rank runs (argv; argv[0] is looked up in PATH on the worker).
    /// Put it after `--` when it has options of its own.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    pub command: Vec<String>,
}

/// `run` options: those of `submit`, one rank by default, and `-c CODE`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Number of ranks (processes) of the job.
    #[arg(long, default_value_t = 1, value_parser = parse_world_size)]
    pub world_size: u32,
    /// What the job runs with: data, checkpoints, restarts, resources, code, environment.
    #[command(flatten)]
    pub job: JobOpts,
    /// Run this Python code (`python3 -c CODE` on every rank) instead of a command.
    #[arg(
        short = 'c',
        long = "code",
        value_name = "CODE",
        conflicts_with = "command"
    )]
    pub code: Option<String>,
    /// The command every rank runs (argv; argv[0] is looked up in PATH on the worker).
    /// Put it after `--` when it has options of its own.
    #[arg(
        required_unless_present = "code",
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    pub command: Vec<String>,
}

/// The options of a job that `submit` and `run` share.
#[derive(Debug, Args)]
pub struct JobOpts {
    /// Dataset directory: its regular files, sorted by name, are the shards; shard i goes
    /// to rank i mod world-size. Must be readable at this path on the workers. Or an S3
    /// prefix `s3://bucket/prefix`: its objects are the shards, downloaded by the workers
    /// into their dataset cache (needs the S3 settings on coordinators and workers).
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// Checkpoint root directory (checkpoints are disabled without it).
    #[arg(long)]
    pub ckpt_dir: Option<PathBuf>,
    /// Committed checkpoint steps to keep (cluster default 3).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub ckpt_keep: Option<u32>,
    /// S3 checkpoint target (L2), `s3://bucket/prefix`. The coordinators and workers need
    /// `--s3-endpoint` etc.; the submit fails at once on a missing bucket or bad credentials.
    #[arg(long)]
    pub ckpt_url: Option<String>,
    /// With `--ckpt-url`: where a step counts as committed, `l2` (default: uploaded and
    /// verified in S3) or `l1` (local disk, S3 in the background; needs `--ckpt-dir`).
    #[arg(long, value_enum)]
    pub ckpt_commit_tier: Option<CommitTier>,
    /// Job-wide restart budget (cluster default 3); past it the job fails.
    #[arg(long)]
    pub max_restarts: Option<u32>,
    /// What a failure restarts (cluster default: group).
    #[arg(long, value_enum)]
    pub restart_scope: Option<RestartScope>,
    /// Delay before the first restart, milliseconds; doubles per restart (±20% jitter).
    #[arg(long)]
    pub backoff_initial_ms: Option<u64>,
    /// Upper bound of the restart delay, milliseconds.
    #[arg(long)]
    pub backoff_max_ms: Option<u64>,
    /// Restart a first attempt that fails at once like any failure. Without it, when every
    /// rank exits non-zero within 10 s of its start, before any progress report, with the
    /// same exit code and error (a mistyped script path), the job fails at once with that
    /// error and spends no restart budget. For programs whose first start may fail by
    /// chance.
    #[arg(long)]
    pub no_fail_fast: bool,
    /// Idle interpreters each worker keeps for this job (0..=8, default 0: none), started
    /// in the job's environment with --warm-imports done, holding no slot and no GPU: a
    /// replacement rank takes one instead of starting Python and importing again. Needs a
    /// command `python SCRIPT ...` or `python -m MODULE ...`.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=cumulus_api::limits::MAX_WARM_SPARES as i64))]
    pub warm_spares: Option<u32>,
    /// Modules the warm spares import before they get a rank, comma-separated (e.g.
    /// torch,numpy). None may touch a GPU on import (a spare whose imports initialize
    /// CUDA exits unused).
    #[arg(long, value_name = "MODULES", value_delimiter = ',')]
    pub warm_imports: Vec<String>,
    /// A rank whose reported step does not advance for this many seconds after its
    /// first progress report is declared hung and restarted (0 or absent: off). Pick
    /// a few times the longest gap between two reports (a checkpoint, an evaluation).
    #[arg(long)]
    pub progress_timeout_s: Option<u64>,
    /// Seconds from a rank's process start to its first progress report (imports, data
    /// loading, rendezvous) before it is declared hung, 1..=604800 (default with
    /// --progress-timeout-s: 600; without it, only when given).
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=MAX_STARTUP_TIMEOUT_S))]
    pub startup_timeout_s: Option<u64>,
    /// Seconds between SIGTERM and SIGKILL when a rank is stopped (cancel, restart),
    /// and between a pause request and SIGTERM: room for a last checkpoint (0..=3600;
    /// default: the agent's --stop-grace-ms, 5 s).
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(0..=MAX_STOP_GRACE_S))]
    pub stop_grace_s: Option<u64>,
    /// Queue priority, -1000..=1000 (default 0): pending jobs start highest priority
    /// first, in submission order within one priority.
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(i32).range(-PRIORITY_BOUND..=PRIORITY_BOUND))]
    pub priority: Option<i32>,
    /// May be preempted: when a job of higher priority waits for its slots, this job's
    /// ranks are asked to checkpoint and stop (as for a pause) and the job is queued
    /// again, resuming from that step; no restart budget is spent.
    #[arg(long)]
    pub preemptible: bool,
    /// Start from a committed checkpoint of an earlier job: `JOB` (its newest step) or
    /// `JOB@STEP`. Same world size and shard plan as that job; its dataset and
    /// checkpoint target are used when not given here. The step is kept until this job
    /// commits one of its own.
    #[arg(long, value_name = "JOB[@STEP]", value_parser = parse_resume_from)]
    pub resume_from: Option<ResumeFromArg>,
    /// Running time the job may use, e.g. `90m`, `2h`, `1d` (time paused or queued is
    /// not counted); then it ends `timed_out`.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration_ms)]
    pub time_limit: Option<u64>,
    /// Ask the ranks to checkpoint and stop this long before the time limit, e.g. `5m`
    /// (as Slurm's `--signal`); SIGTERM comes at the limit.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration_ms, requires = "time_limit")]
    pub signal_before: Option<u64>,
    /// Accept a job larger than the alive workers offer in all (slots, GPUs): it stays
    /// pending until workers join. Without it such a submit is refused.
    #[arg(long)]
    pub allow_pending: bool,
    /// Whole GPUs per rank (as Slurm's `--gpus-per-task`): each rank gets distinct GPUs
    /// of its worker, named in its `CUDA_VISIBLE_DEVICES`; a job's ranks are packed onto
    /// as few workers as possible. 0 or absent: none.
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=64))]
    pub gpus_per_rank: Option<u32>,
    /// Share of one GPU each rank gets, 0 < F <= 1 (as Ray's `num_gpus=0.5`): ranks of
    /// this and other jobs share a GPU while their fractions sum to at most 1. Implies one
    /// GPU per rank. Set as `CUMULUS_GPU_MEMORY_FRACTION` for the rank (cooperative: the
    /// Python runtime passes it to PyTorch; nothing enforces it).
    #[arg(long, value_parser = parse_gpu_fraction)]
    pub gpu_memory_fraction: Option<f64>,
    /// What to do about a straggler, a rank whose steps/s (from its progress reports)
    /// stays below --straggler-fraction of the median of the job's other ranks for
    /// --straggler-window-s: `warn` (default: an event in `describe`, a mark in the ranks
    /// table), `restart` (restart it, on another worker when one has room; spends restart
    /// budget), `exclude` (keep it running, avoid its worker in this job's later
    /// placements), `off`.
    #[arg(long, value_enum, value_name = "ACTION")]
    pub straggler_action: Option<cumulus_api::StragglerAction>,
    /// Share of the other ranks' median steps/s below which a rank counts as slow,
    /// 0.1..=0.95 (default 0.7).
    #[arg(long, value_name = "F", value_parser = parse_straggler_fraction)]
    pub straggler_fraction: Option<f64>,
    /// Seconds a rank must stay slow to be flagged a straggler, 2..=86400 (default 60).
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(2..=86_400))]
    pub straggler_window_s: Option<u64>,
    /// Extra environment variable for every rank, `KEY=VALUE` (repeatable).
    #[arg(long = "env", value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// Human-readable job name (≤ 128 bytes).
    #[arg(long)]
    pub name: Option<String>,
    /// Working directory of every rank: a path on the workers (default: the worker's
    /// own). See `--upload` to send a directory instead.
    #[arg(long)]
    pub workdir: Option<PathBuf>,
    /// Send this directory as the ranks' working directory: packed (honouring
    /// `.gitignore` and `.cumulusignore`; `.git` is left out), stored in the cluster once
    /// per content (an unchanged directory uploads nothing), and unpacked afresh for
    /// every attempt.
    #[arg(long, value_name = "DIR", conflicts_with = "workdir")]
    pub upload: Option<PathBuf>,
    /// Most MiB the files of `--upload` may hold (default 512, at most 2048); past it the
    /// upload is refused, naming the largest files.
    #[arg(long, value_name = "MIB", requires = "upload",
          value_parser = clap::value_parser!(u64).range(1..=MAX_UPLOAD_MIB))]
    pub max_upload_mib: Option<u64>,
    /// Python environment: install the packages of this requirements file (pip's format)
    /// into a virtual environment built with uv on each worker, cached and shared
    /// between jobs.
    #[arg(long, value_name = "FILE", help_heading = "Environment")]
    pub requirements: Option<PathBuf>,
    /// Python environment: install this package (a requirement such as `numpy` or
    /// `torch==2.3.1`; repeatable), as `--requirements` does.
    #[arg(long, value_name = "PKG", help_heading = "Environment")]
    pub pip: Vec<String>,
    /// Python environment: this Python version, `3.X` or `3.X.Y` (default: the worker's
    /// python3).
    #[arg(long, value_name = "3.X", value_parser = parse_python_version, help_heading = "Environment")]
    pub python: Option<String>,
    /// Python environment: the package index uv installs from (default: uv's).
    #[arg(long, value_name = "URL", help_heading = "Environment")]
    pub index_url: Option<String>,
    /// Python environment: also look for packages here, a directory on the workers or a
    /// URL (repeatable, at most 16).
    #[arg(long, value_name = "PATH|URL", help_heading = "Environment")]
    pub find_links: Vec<String>,
    /// Python environment: use no package index, only `--find-links`.
    #[arg(long, conflicts_with = "index_url", help_heading = "Environment")]
    pub no_index: bool,
    /// Idempotency key (1..=128 bytes); default: random, generated once per invocation
    /// and reused by every retry, so a retried submit never creates two jobs.
    #[arg(long)]
    pub request_id: Option<String>,
}

/// Largest `--max-upload-mib`: the cluster's cap on one blob.
pub const MAX_UPLOAD_MIB: u64 = cumulus_api::blobs::MAX_BLOB_BYTES / (1024 * 1024);

/// Parses `--python`: `3.X` or `3.X.Y`.
fn parse_python_version(text: &str) -> Result<String, String> {
    let text = text.trim();
    if text.is_empty() || !cumulus_api::blobs::is_valid_python_version(text) {
        return Err(format!(
            "{} is not a Python version like 3.11 or 3.11.9",
            cumulus_api::text::escape_control(text)
        ));
    }
    Ok(text.to_string())
}

/// `artifacts` subcommands.
#[derive(Debug, Subcommand)]
pub enum ArtifactsCommand {
    /// List what a job's ranks left in `$CUMULUS_OUTPUT_DIR` (the newest attempt of each
    /// rank that left any): rank, attempt, path, size.
    Ls(ArtifactsLsArgs),
    /// Download one file of a rank's artifacts.
    Get(ArtifactsGetArgs),
}

/// `artifacts ls JOB [--rank N]`.
#[derive(Debug, Args)]
pub struct ArtifactsLsArgs {
    /// Job id, e.g. `job-000001`.
    pub job: String,
    /// Only this rank's.
    #[arg(long)]
    pub rank: Option<u32>,
}

/// `artifacts get JOB PATH [--rank N] [--out FILE]`.
#[derive(Debug, Args)]
pub struct ArtifactsGetArgs {
    /// Job id, e.g. `job-000001`.
    pub job: String,
    /// The file's path in the artifacts, as `artifacts ls` shows it.
    pub path: String,
    /// Whose artifacts (default: rank 0's).
    #[arg(long, default_value_t = 0)]
    pub rank: u32,
    /// Where to write it (default: the file's name in the current directory; `-`:
    /// standard output). (`-o` is the output format of every command.)
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Replace the file if it exists.
    #[arg(long)]
    pub force: bool,
}

/// `logs` options.
#[derive(Debug, Args)]
pub struct LogsArgs {
    /// Job id, e.g. `job-000001`.
    pub job: String,
    /// Follow: keep streaming until the job finishes and every log is drained.
    #[arg(short = 'f', long)]
    pub follow: bool,
    /// Only this rank (default: every rank).
    #[arg(long)]
    pub rank: Option<u32>,
    /// Only the last N lines of each rank's logs so far (with `-f`, then follow from
    /// there), as `kubectl logs --tail`.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub tail: Option<u32>,
    /// Only output written in this last span, e.g. `10m`, `2h` (as `kubectl logs
    /// --since`; the workers' clocks, to within a second: a line up to a second older may
    /// show).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration_ms)]
    pub since: Option<u64>,
    /// Write the lines as the ranks wrote them, control characters and all. Without it,
    /// on a terminal, control characters (ESC, carriage return, …) and bidirectional
    /// controls are shown as escapes such as `\x1b` and `\u{202e}`; into a pipe or a file
    /// the lines are always written as they came.
    #[arg(long)]
    pub raw: bool,
}

/// `ckpt` subcommands.
#[derive(Debug, Subcommand)]
pub enum CkptCommand {
    /// List a job's checkpoints.
    Ls(JobArg),
}

/// `list` filters.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only jobs in these states (comma-separated: pending, running, succeeded, failed,
    /// cancelled, paused, timed_out).
    #[arg(long, value_delimiter = ',', value_parser = parse_job_state)]
    pub state: Vec<cumulus_api::JobState>,
    /// Only jobs whose name contains this text.
    #[arg(long)]
    pub name: Option<String>,
    /// Only the newest N jobs (after the other filters).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub limit: Option<u32>,
}

/// `summary` options.
#[derive(Debug, Args)]
pub struct SummaryArgs {
    /// Job id; without it, the newest jobs' summaries.
    pub job: Option<String>,
    /// Without JOB: only jobs in this state.
    #[arg(long, value_parser = parse_job_state, conflicts_with = "job")]
    pub state: Option<cumulus_api::JobState>,
    /// Without JOB: at most this many, newest first (default 50, at most 10000).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=SUMMARIES_BOUND), conflicts_with = "job")]
    pub limit: u32,
}

/// `completion SHELL`.
#[derive(Debug, Args)]
pub struct CompletionArgs {
    /// The shell.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

fn parse_job_state(text: &str) -> Result<cumulus_api::JobState, String> {
    text.trim()
        .parse()
        .map_err(|e: cumulus_api::UnknownName| e.to_string())
}

/// `token` subcommands.
#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Create a user with a role and print their token (shown once: the cluster keeps
    /// only its SHA-256). Give it to the user; they pass it with `--token-file` or
    /// `CUMULUS_TOKEN`.
    Create(TokenCreateArgs),
    /// List the users (names, roles, who created them; never a token).
    Ls,
    /// Revoke a user's token; their running jobs go on.
    Revoke(TokenNameArg),
}

/// `token create NAME --role ROLE`.
#[derive(Debug, Args)]
pub struct TokenCreateArgs {
    /// The user's name: 1..=32 bytes of [a-z0-9-], starting with a letter.
    pub name: String,
    /// `admin` (anything), `submit` (submit and cancel own jobs, read everything but
    /// others' logs) or `read` (read only).
    #[arg(long, value_enum)]
    pub role: cumulus_api::Role,
    /// Write the token to this file (created with mode 0600, never overwritten) instead
    /// of printing it.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// A user's name.
#[derive(Debug, Args)]
pub struct TokenNameArg {
    /// The user's name.
    pub name: String,
}

/// `cluster` subcommands.
#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Members, leader, Raft indexes and workers.
    Status,
    /// Add a coordinator (started with `--join`) as a non-voting learner; returns once it
    /// has caught up with the leader's log.
    AddLearner(AddLearnerArgs),
    /// Make a learner a voting member.
    Promote(MemberArg),
    /// Remove a voter or learner (stop its process afterwards; a wiped node may rejoin
    /// with `add-learner`).
    Remove(MemberArg),
}

/// `cluster add-learner ID ADDR`.
#[derive(Debug, Args)]
pub struct AddLearnerArgs {
    /// Raft node id of the new coordinator (≥ 1).
    #[arg(value_parser = clap::value_parser!(u64).range(1..))]
    pub id: u64,
    /// Its addresses: `GRPC_HOST:PORT@HTTP_HOST:PORT`, or
    /// `GRPC_HOST:PORT@HTTP_HOST:PORT@RAFT_HOST:PORT` for a coordinator started with
    /// `--raft-listen` (as in the coordinator's `--peer`).
    /// (Named apart from the global `--addr`, whose clap id it would otherwise share.)
    #[arg(value_name = "ADDR")]
    pub member_addr: String,
}

/// A member's Raft node id.
#[derive(Debug, Args)]
pub struct MemberArg {
    /// Raft node id (≥ 1).
    #[arg(value_parser = clap::value_parser!(u64).range(1..))]
    pub id: u64,
}

/// `dataset` subcommands.
#[derive(Debug, Subcommand)]
pub enum DatasetCommand {
    /// Split a CSV (or .csv.gz) of numeric columns, integer label last, into shards.
    Split(SplitArgs),
}

/// `dataset split` options.
#[derive(Debug, Args)]
pub struct SplitArgs {
    /// Input CSV, optionally gzip-compressed; no header; label (integer ≥ 0) last.
    pub file: PathBuf,
    /// Number of shard files to write (1..=100000).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=SHARDS_BOUND))]
    pub shards: u32,
    /// Output directory for `shard-00000.csv` …; must be empty or absent (see --force).
    #[arg(long)]
    pub out: PathBuf,
    /// Fraction of rows (0 ≤ f < 1) sent deterministically to --holdout-out.
    /// Default: 0.2 when --holdout-out is given, else 0.
    #[arg(long)]
    pub holdout_fraction: Option<f64>,
    /// Holdout CSV file (required when --holdout-fraction > 0; must lie outside --out).
    #[arg(long)]
    pub holdout_out: Option<PathBuf>,
    /// Write into a non-empty --out: existing `shard-*.csv` files there are replaced.
    #[arg(long)]
    pub force: bool,
}

/// `local` subcommands.
#[derive(Debug, Subcommand)]
pub enum LocalCommand {
    /// Start (or restart) the local cluster and wait until it is ready.
    Up(LocalUpArgs),
    /// Stop the local cluster (SIGTERM, then SIGKILL after 10 s).
    Down(LocalDownArgs),
    /// Which processes are alive, and the cluster status.
    Status,
}

/// `local up` options.
#[derive(Debug, Args)]
pub struct LocalUpArgs {
    /// Number of coordinators (Raft voters), 1..=7. Default 3 (or as recorded).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=7))]
    pub coordinators: Option<u32>,
    /// Number of workers, 0..=64. Default 2 (or as recorded).
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=64))]
    pub workers: Option<u32>,
    /// Rank slots per worker, 1..=1024. Default 4 (or as recorded).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub slots: Option<u32>,
    /// Directory holding `cumulus-coordinator` and `cumulus-worker` (default: next to
    /// this executable, else PATH).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Run as root: who the ranks run as (the workers' `--run-as`): a uid range
    /// FIRST-LAST (each job a user and group of its own), a user name, or UID[:GID].
    /// Default as root: 60000-60999; run by another user, ranks run as that user.
    #[arg(long, value_name = "FIRST-LAST|USER", conflicts_with = "allow_root")]
    pub run_as: Option<String>,
    /// Run as root: let the ranks run as root too, so that programs other users cannot
    /// reach (an interpreter under /root) can run; their code can then read the
    /// cluster's token, the peer token and every key under the local dir.
    #[arg(long)]
    pub allow_root: bool,
}

/// `local down` options.
#[derive(Debug, Args)]
pub struct LocalDownArgs {
    /// Also delete everything `local up` created (data, logs, token, cluster.json).
    #[arg(long)]
    pub purge: bool,
}

/// `demo` options.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Directory of the demo's cluster, data, checkpoints and outputs (wiped first).
    #[arg(long, default_value = ".cumulus-demo")]
    pub dir: PathBuf,
    /// Leave the cluster running at the end.
    #[arg(long)]
    pub keep: bool,
    /// Directory holding the cumulus binaries (default: next to this executable, else PATH).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
}

/// `submit --world-size`: a fixed number of ranks, or an elastic range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorldSize {
    /// The fewest ranks of an elastic job (`MIN`); 0 for a fixed world.
    pub min: u32,
    /// The number of ranks, or the most of an elastic job (`MAX`).
    pub max: u32,
}

/// Parses `submit --world-size`: `N` ([`parse_world_size`]) or `MIN:MAX` with
/// `1 <= MIN <= MAX`.
fn parse_elastic_world_size(text: &str) -> Result<WorldSize, String> {
    let Some((min, max)) = text.split_once(':') else {
        return parse_world_size(text).map(|max| WorldSize { min: 0, max });
    };
    let (min, max) = (parse_world_size(min)?, parse_world_size(max)?);
    if min > max {
        return Err(format!(
            "{text:?}: an elastic world size MIN:MAX needs MIN <= MAX"
        ));
    }
    Ok(WorldSize { min, max })
}

/// Parses `--world-size`: a whole number of ranks, at least 1 (the cluster checks its
/// own maximum).
fn parse_world_size(text: &str) -> Result<u32, String> {
    match text.trim().parse::<u32>() {
        Ok(0) => Err("a job has at least 1 rank".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "{text:?} is not a number of ranks (1 or more, up to the cluster's --max-world-size)"
        )),
    }
}

/// Parses `--straggler-fraction`: a number within the contract's bounds
/// (`MIN_STRAGGLER_FRACTION_PERMILLE..=MAX_STRAGGLER_FRACTION_PERMILLE` thousandths).
fn parse_straggler_fraction(text: &str) -> Result<f64, String> {
    use cumulus_api::limits::{MAX_STRAGGLER_FRACTION_PERMILLE, MIN_STRAGGLER_FRACTION_PERMILLE};
    let value: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number"))?;
    let (lo, hi) = (
        f64::from(MIN_STRAGGLER_FRACTION_PERMILLE) / 1000.0,
        f64::from(MAX_STRAGGLER_FRACTION_PERMILLE) / 1000.0,
    );
    if value.is_finite() && (lo..=hi).contains(&value) {
        Ok(value)
    } else {
        Err(format!("{text:?} is not between {lo} and {hi}"))
    }
}

/// Parses `--gpu-memory-fraction`: a number with 0 < F <= 1 in steps of 0.001.
fn parse_gpu_fraction(text: &str) -> Result<f64, String> {
    let value: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number"))?;
    cumulus_api::gpus::fraction_to_permille(value)
        .map(|_| value)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("cumulusctl").chain(args.iter().copied()))
    }

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn submit_takes_command_after_double_dash_with_its_own_flags() {
        let cli = parse(&[
            "--addr",
            "127.0.0.1:1,127.0.0.1:2",
            "submit",
            "--world-size",
            "4",
            "--env",
            "A=1",
            "--env",
            "B=x=y",
            "--restart-scope",
            "rank",
            "--",
            "python",
            "train.py",
            "--lr",
            "0.1",
        ])
        .expect("valid");
        assert_eq!(cli.global.addr, vec!["127.0.0.1:1", "127.0.0.1:2"]);
        let Command::Submit(s) = cli.command else {
            panic!("not submit")
        };
        assert_eq!(s.world_size, WorldSize { min: 0, max: 4 });
        assert_eq!(s.job.env, vec!["A=1", "B=x=y"]);
        assert_eq!(s.job.restart_scope, Some(RestartScope::Rank));
        assert_eq!(s.command, vec!["python", "train.py", "--lr", "0.1"]);
    }

    #[test]
    fn submit_without_double_dash_keeps_trailing_flags_in_command() {
        let cli = parse(&["submit", "--world-size", "2", "python", "-u", "x.py"]).expect("valid");
        let Command::Submit(s) = cli.command else {
            panic!("not submit")
        };
        assert_eq!(s.command, vec!["python", "-u", "x.py"]);
    }

    #[test]
    fn submit_takes_an_elastic_world_size() {
        let submit = |w: &str| match parse(&["submit", "--world-size", w, "--", "true"]) {
            Ok(Cli {
                command: Command::Submit(s),
                ..
            }) => Ok(s.world_size),
            Ok(_) => panic!("not a submit"),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(submit("2:4"), Ok(WorldSize { min: 2, max: 4 }));
        assert_eq!(submit("3:3"), Ok(WorldSize { min: 3, max: 3 }));
        assert!(submit("4:2").unwrap_err().contains("MIN <= MAX"));
        assert!(submit("0:2").is_err());
        assert!(submit("2:").is_err());
    }

    #[test]
    fn submit_rejects_zero_world_size_and_missing_command() {
        assert!(parse(&["submit", "--world-size", "0", "--", "true"]).is_err());
        assert!(parse(&["submit", "--world-size", "2"]).is_err());
        assert!(
            parse(&["submit", "--", "true"]).is_err(),
            "world size is required"
        );
    }

    #[test]
    fn token_and_token_file_conflict() {
        let err = parse(&["--token", "a", "--token-file", "f", "list"]).expect_err("conflict");
        assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
    }

    #[test]
    fn global_options_after_the_subcommand_and_json_output() {
        let cli =
            parse(&["status", "job-000001", "-o", "json", "--local-dir", "/x"]).expect("valid");
        assert_eq!(cli.global.output, OutputFormat::Json);
        assert_eq!(cli.global.local_dir, PathBuf::from("/x"));
        let Command::Status(j) = cli.command else {
            panic!("not status")
        };
        assert_eq!(j.job, "job-000001");
    }

    #[test]
    fn split_bounds_shards() {
        assert!(parse(&["dataset", "split", "f.csv", "--shards", "0", "--out", "d"]).is_err());
        assert!(
            parse(&[
                "dataset", "split", "f.csv", "--shards", "100001", "--out", "d"
            ])
            .is_err()
        );
        let cli = parse(&[
            "dataset", "split", "f.csv", "--shards", "100000", "--out", "d",
        ])
        .expect("valid");
        let Command::Dataset(DatasetCommand::Split(s)) = cli.command else {
            panic!("not split")
        };
        assert_eq!(s.shards, 100_000);
        assert_eq!(s.holdout_fraction, None);
    }

    #[test]
    fn logs_follow_and_rank() {
        let cli = parse(&["logs", "job-000002", "-f", "--rank", "3"]).expect("valid");
        let Command::Logs(l) = cli.command else {
            panic!("not logs")
        };
        assert!(l.follow);
        assert_eq!(l.rank, Some(3));
    }

    #[test]
    fn wait_timeout_requires_wait() {
        assert!(
            parse(&[
                "submit",
                "--world-size",
                "1",
                "--wait-timeout-s",
                "5",
                "--",
                "true"
            ])
            .is_err()
        );
        assert!(
            parse(&[
                "submit",
                "--world-size",
                "1",
                "--wait",
                "--wait-timeout-s",
                "5",
                "--",
                "true"
            ])
            .is_ok()
        );
    }
}

#[cfg(test)]
mod duration_tests {
    use super::parse_duration_ms;

    #[test]
    fn durations_are_human_or_seconds() {
        assert_eq!(parse_duration_ms("2h"), Ok(7_200_000));
        assert_eq!(parse_duration_ms("5m"), Ok(300_000));
        assert_eq!(parse_duration_ms("1d 12h"), Ok(129_600_000));
        assert_eq!(parse_duration_ms("90"), Ok(90_000));
        assert_eq!(parse_duration_ms("1500ms"), Ok(1_500));
        assert!(parse_duration_ms("0s").is_err());
        let e = parse_duration_ms("soon").expect_err("not a duration");
        assert!(e.contains("not a duration like"), "{e}");
    }
}

/// Parses a human duration (`90s`, `5m`, `2h`, `1d 12h`: the `humantime` syntax) into
/// milliseconds; a bare number is seconds.
///
/// # Errors
/// Text that is not a duration, or zero.
pub fn parse_duration_ms(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let duration = match text.parse::<u64>() {
        Ok(seconds) => std::time::Duration::from_secs(seconds),
        Err(_) => humantime::parse_duration(text)
            .map_err(|e| format!("{text:?} is not a duration like 90s, 5m, 2h or 1d ({e})"))?,
    };
    let ms = u64::try_from(duration.as_millis()).map_err(|_| "duration too long".to_string())?;
    if ms == 0 {
        return Err("the duration must be above zero".into());
    }
    Ok(ms)
}

/// `--resume-from JOB[@STEP]`: a job and, optionally, one of its committed steps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResumeFromArg {
    /// The job, `job-NNNNNN`.
    pub job: String,
    /// The step (`None`: the job's newest committed one).
    pub step: Option<u64>,
}

/// Parses `JOB` or `JOB@STEP` (`job-000012@400`).
///
/// # Errors
/// A job that is not `job-NNNNNN`, or a step that is not a number.
pub fn parse_resume_from(text: &str) -> Result<ResumeFromArg, String> {
    let (job, step) = match text.split_once('@') {
        Some((job, step)) => {
            let step = step.parse::<u64>().map_err(|_| {
                format!("step {step:?} is not a number (JOB@STEP, e.g. job-000012@400)")
            })?;
            (job, Some(step))
        }
        None => (text, None),
    };
    if !cumulus_api::is_job_id(job) {
        return Err(format!(
            "{} is not a job id (JOB or JOB@STEP, e.g. job-000012@400)",
            cumulus_api::text::escape_control(job)
        ));
    }
    Ok(ResumeFromArg {
        job: job.to_string(),
        step,
    })
}
