//! The replicated state of a Cumulus cluster and the pure, deterministic `apply` of
//! [`Command`]s to it.
//!
//! `apply` reads no clock, draws no random number and does no I/O: every time and every
//! jittered delay is stamped into the command by the leader that proposed it
//! (docs/architecture.md, "The replicated state"). Every command is validated here too, so a stale
//! or malformed command that reaches the log changes nothing and is answered with
//! [`Response::Rejected`].
//!
//! The module is split along its seams: [`spec`] (what a user submits), [`model`] (what
//! the state holds), [`index`] (what is derived from it), [`command`] (what the log
//! carries), [`apply`] (how a command changes the state) and `capacity` (what the
//! alive workers offer, and whether a job or a placement fits it).

mod apply;
mod capacity;
mod command;
mod elastic;
mod history;
mod index;
mod model;
mod spec;
mod straggler;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_code;
#[cfg(test)]
mod tests_elastic;
#[cfg(test)]
mod tests_inprocess;

pub use cumulus_api::limits::{
    MAX_ARG_BYTES, MAX_BACKOFF_MS, MAX_CKPT_KEEP, MAX_COMMAND_ARGS, MAX_ENV_ENTRIES,
    MAX_GPU_NAME_BYTES, MAX_GPU_UUID_BYTES, MAX_GPUS_PER_WORKER, MAX_JOB_NAME_BYTES,
    MAX_REQUEST_ID_BYTES, MAX_RESTART_BUDGET, MAX_SHARDS, MAX_WORLD_SIZE,
};
pub use cumulus_api::{
    CommitTier, FileEntry, JobState, RankState, RestartPath, RestartScope, StopAction,
};

pub use apply::*;
pub use capacity::*;
pub use command::*;
pub use elastic::*;
pub use history::*;
pub use index::*;
pub use model::*;
pub use spec::*;
pub use straggler::*;

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
