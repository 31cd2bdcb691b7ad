//! The contract between Cumulus processes, in one crate every other crate uses (as neon's
//! `pageserver_api`): what coordinators, worker agents, the CLI, rank processes and the
//! tests say to each other, and nothing else: no policy, no state, no network. Its one
//! read of the file system is [`paths::Roots`], which resolves symlinks (`canonicalize`,
//! read-only) so that coordinators and agents judge a job's path by one rule; the
//! leader-following client, which connects and retries, is the `cumulus-client` crate.
//!
//! - [`v1`] (feature `grpc`, on by default): the gRPC contract, package `cumulus.v1`, the
//!   messages and the tonic clients and servers generated from `proto/cumulus.proto`.
//!   Every generated message also derives `serde::Serialize`/`Deserialize` (with
//!   `#[serde(default)]`), so the coordinator's REST mirror uses the same shapes as gRPC.
//! - [`states`]: job state, rank state and phase, restart scope, commit tier, with their
//!   one wire spelling.
//! - [`rank_env`]: the environment variables of the rank contract.
//! - [`rank_local`]: the bodies of the rank-local HTTP API (agent ↔ rank).
//! - [`limits`]: the limits more than one process checks.
//! - [`client_config`]: how a client (`cumulusctl`, the Python SDK) finds and reaches a
//!   cluster: its environment variables, `cluster.json`, its retry bounds.
//! - [`manifest`]: a checkpoint step's `MANIFEST.json`: file names, formats, fields.
//! - [`shape`]: the shape of a JSON object one process writes and another reads.
//! - [`contract`] (feature `grpc`): all of the above rendered for other languages: the
//!   generated Python module `cumulus._contract` and `api/contract.json`
//!   (`cargo run -p cumulus-api --bin cumulus-contract` rewrites them).
//! - [`gpus`]: GPU UUIDs, memory shares in thousandths, `CUDA_VISIBLE_DEVICES`.
//! - [`files`]: one file of a checkpoint part, with its format-1 compatibility.
//! - [`attempt`]: [`AttemptKey`], the identity of a rank attempt.
//! - [`ids`]: the one rule for job ids and worker ids.
//! - [`paths`]: which host paths a job may name (normalized, under the allowed roots).
//! - [`token`]: what a bearer token must look like.
//! - [`users`]: users' tokens (`cu.<name>.<secret>`), their names and stored hashes.
//! - [`text`]: user-supplied text on a terminal (printable names, escaped output).
//! - [`leader`]: how a follower names the leader to a client (the metadata and header);
//!   the client that follows it is the `cumulus-client` crate.
//!
//! Python's `cumulus` package speaks the same names: it imports them from the generated
//! `cumulus._contract` ([`contract`]); `docs/architecture.md` ("Wire names") has the
//! table.

pub mod attempt;
pub mod client_config;
#[cfg(feature = "grpc")]
pub mod contract;
pub mod feature_stats;
pub mod files;
pub mod gpus;
pub mod ids;
pub mod leader;
pub mod limits;
pub mod manifest;
pub mod paths;
pub mod rank_env;
pub mod rank_local;
pub mod shape;
pub mod states;
pub mod text;
pub mod token;
pub mod users;

pub use attempt::{AttemptKey, is_job_id};
pub use files::FileEntry;
pub use states::{
    CommitTier, JobState, RankPhase, RankState, RestartScope, Role, StopAction, UnknownName,
    WorkerPhase,
};

/// Generated code for `cumulus.v1`.
#[cfg(feature = "grpc")]
#[allow(clippy::all, clippy::too_many_lines, missing_docs)]
pub mod v1 {
    tonic::include_proto!("cumulus.v1");
}

#[cfg(feature = "grpc")]
pub use v1::*;

#[cfg(feature = "grpc")]
impl v1::Job {
    /// The job's state, parsed from its wire spelling.
    pub fn job_state(&self) -> Result<JobState, UnknownName> {
        self.state.parse()
    }
}

#[cfg(feature = "grpc")]
impl v1::JobSummary {
    /// The job's state, parsed from its wire spelling.
    pub fn job_state(&self) -> Result<JobState, UnknownName> {
        self.state.parse()
    }
}

#[cfg(feature = "grpc")]
impl v1::WorkerInfo {
    /// The worker's state, parsed from its wire spelling.
    pub fn worker_phase(&self) -> Result<WorkerPhase, UnknownName> {
        self.state.parse()
    }
}

#[cfg(feature = "grpc")]
impl v1::RankStatus {
    /// The rank's state as shown, parsed from its wire spelling.
    pub fn phase(&self) -> Result<RankPhase, UnknownName> {
        self.state.parse()
    }
}
