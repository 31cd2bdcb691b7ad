//! The states and settings every process names, each with its one wire spelling.
//!
//! The gRPC messages carry these as strings (`JobInfo.state`, `RankInfo.state`,
//! `RestartPolicy.scope`, `JobSpec.ckpt_commit_tier`) and the Raft log and snapshots as
//! serde's lowercase names; both spellings come from here. Python's `cumulus.models`
//! uses the same strings (the table in `docs/architecture.md`, "Wire names").

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A name that is not one of an enum's wire spellings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} {value:?} is not one of {expected}")]
pub struct UnknownName {
    /// What was being parsed, e.g. `"job state"`.
    pub what: &'static str,
    /// The text that did not match (cut to 64 bytes).
    pub value: String,
    /// The accepted spellings, e.g. `"l1, l2"`.
    pub expected: &'static str,
}

impl UnknownName {
    fn new(what: &'static str, value: &str, expected: &'static str) -> Self {
        let mut end = value.len().min(64);
        while !value.is_char_boundary(end) {
            end -= 1;
        }
        Self {
            what,
            value: value[..end].to_string(),
            expected,
        }
    }
}

/// Implements `as_str`, `Display`, `FromStr` and `ALL` from one table of spellings.
macro_rules! wire_enum {
    ($ty:ident, $what:literal, $expected:literal, { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];

            /// The wire spelling (the same as serde's).
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $name),+
                }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $ty {
            type Err = UnknownName;

            /// Exact (case-sensitive) wire spelling.
            fn from_str(text: &str) -> Result<Self, UnknownName> {
                match text {
                    $($name => Ok($ty::$variant),)+
                    other => Err(UnknownName::new($what, other, $expected)),
                }
            }
        }
    };
}

/// Lifecycle of a job: `pending` → `running` → `succeeded` | `failed` | `cancelled` |
/// `timed_out`; a pause takes `pending` or `running` to `paused`, and a resume takes
/// `paused` back to `pending`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    /// Accepted, not yet placed.
    Pending,
    /// Placed; ranks are starting, running or waiting for a restart.
    Running,
    /// Every rank of its current attempt exited 0.
    Succeeded,
    /// Out of restart budget, or unrunnable; the cause is recorded.
    Failed,
    /// Cancelled by a user.
    Cancelled,
    /// Paused by a user: its ranks stopped (at a committed step when they checkpointed
    /// on request) and hold no slots; a resume queues it again. Not terminal.
    Paused,
    /// Its time limit ran out: its ranks were asked to checkpoint and stop.
    #[serde(rename = "timed_out")]
    TimedOut,
}

wire_enum!(JobState, "job state", "pending, running, succeeded, failed, cancelled, paused, timed_out", {
    Pending => "pending",
    Running => "running",
    Succeeded => "succeeded",
    Failed => "failed",
    Cancelled => "cancelled",
    Paused => "paused",
    TimedOut => "timed_out",
});

impl JobState {
    /// Succeeded, Failed, Cancelled or TimedOut: nothing will run for the job again.
    pub const fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed | JobState::Cancelled | JobState::TimedOut
        )
    }
}

/// Why the ranks of a running job are asked to stop: what the rank-local API answers
/// (`GET /v1/control`, progress replies) and the Python runtime's `stop_request()`.
/// Every stop follows one protocol (docs/architecture.md, "Stopping a rank"): the rank is
/// told, then its process group gets SIGTERM after a notice, then SIGKILL after the
/// job's stop grace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopAction {
    /// The attempt is no longer wanted (cancel, a group restart, the job ended): exit.
    Stop,
    /// The user paused the job: commit a checkpoint at this step and exit 0; the job
    /// resumes from it.
    Pause,
    /// The job's time limit is near: commit a checkpoint and exit 0; the job ends
    /// `timed_out`.
    TimeLimit,
    /// The scheduler needs the slots for a job of higher priority: commit a checkpoint
    /// and exit 0; the job is queued again.
    Preempt,
}

wire_enum!(StopAction, "stop action", "stop, pause, time_limit, preempt", {
    Stop => "stop",
    Pause => "pause",
    TimeLimit => "time_limit",
    Preempt => "preempt",
});

/// State of a rank's current attempt, as the Raft log and snapshots store it (serde
/// names `unplaced`, `pending`, …). The APIs show a [`RankPhase`] instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RankState {
    /// Not placed on a worker.
    Unplaced,
    /// Placed; to be started once the leader's clock passes the attempt's not-before time.
    Pending,
    /// The agent started the process.
    Running,
    /// The process exited with code 0.
    Exited,
    /// The attempt failed (non-zero exit, signal, spawn error, worker expiry, hang, loss).
    Failed,
}

wire_enum!(RankState, "rank state", "unplaced, pending, running, exited, failed", {
    Unplaced => "unplaced",
    Pending => "pending",
    Running => "running",
    Exited => "exited",
    Failed => "failed",
});

/// A rank's state as the APIs show it (`RankStatus.state`): what a user can tell apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RankPhase {
    /// Not started yet: unplaced, or placed and about to start.
    Pending,
    /// Placed and waiting out a restart backoff of a running job.
    Waiting,
    /// The process runs.
    Running,
    /// The process exited with code 0.
    Exited,
    /// The attempt failed.
    Failed,
    /// Its job has ended (cancelled, failed, timed out) while the attempt was not: it is
    /// stopped with the job (its agent signals what is left of its process) and never
    /// runs on. Its exit code or signal shows once its agent reports the exit.
    Stopped,
}

wire_enum!(RankPhase, "rank phase", "pending, waiting, running, exited, failed, stopped", {
    Pending => "pending",
    Waiting => "waiting",
    Running => "running",
    Exited => "exited",
    Failed => "failed",
    Stopped => "stopped",
});

/// Whether a failure restarts every rank of the job or only the failed one
/// (`RestartPolicy.scope`; `""` on the wire means the default, `group`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum RestartScope {
    /// Stop and restart every rank (what collective jobs need). Default.
    #[default]
    Group,
    /// Restart only the rank that failed.
    Rank,
}

wire_enum!(RestartScope, "restart scope", "group, rank", {
    Group => "group",
    Rank => "rank",
});

impl RestartScope {
    /// Parses a spec's scope, where `""` means the default ([`RestartScope::Group`]).
    pub fn from_spec(text: &str) -> Result<Self, UnknownName> {
        if text.is_empty() {
            Ok(Self::default())
        } else {
            text.parse()
        }
    }
}

/// How a restart was carried out (`RestartRecord.path`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RestartPath {
    /// Every restarted rank got a new process. Default.
    #[default]
    Full,
    /// The surviving ranks kept their processes and re-entered their training function
    /// (`cumulus.runtime.run`); the others got a new process.
    InProcess,
}

wire_enum!(RestartPath, "restart path", "full, in_process", {
    Full => "full",
    InProcess => "in_process",
});

/// What the leader does about a straggler: a rank whose steps/s stays below the job's
/// straggler fraction of the median of its other ranks for the job's straggler window
/// (`JobSpec.straggler_action`, `cumulusctl submit --straggler-action`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum StragglerAction {
    /// Flag it (an event in `describe`, the rank's `straggler` field); nothing else.
    /// Default.
    #[default]
    Warn,
    /// Flag it and fail its attempt: it restarts under the job's restart policy (and
    /// budget), on another worker when one has room; its worker is avoided from then on.
    Restart,
    /// Flag it and avoid its worker in the job's later placements (restarts, requeues),
    /// when other workers have room; the attempt runs on.
    Exclude,
    /// No straggler detection for the job.
    Off,
}

wire_enum!(StragglerAction, "straggler action", "warn, restart, exclude, off", {
    Warn => "warn",
    Restart => "restart",
    Exclude => "exclude",
    Off => "off",
});

impl StragglerAction {
    /// Parses a spec's action, where `""` means the default ([`StragglerAction::Warn`]).
    pub fn from_spec(text: &str) -> Result<Self, UnknownName> {
        if text.is_empty() {
            Ok(Self::default())
        } else {
            text.parse()
        }
    }
}

/// What a user may do (`cumulusctl token create --role`), from most to least.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Reads everything (jobs, logs, checkpoints, the cluster); changes nothing.
    Read,
    /// As `read`, plus submits jobs and cancels its own; reads the logs of its own jobs
    /// only.
    Submit,
    /// Anything: any job, membership, users' tokens. The cluster token is an admin's.
    Admin,
}

wire_enum!(Role, "role", "admin, submit, read", {
    Read => "read",
    Submit => "submit",
    Admin => "admin",
});

/// Where a checkpoint step with an S3 target counts as committed
/// (`JobSpec.ckpt_commit_tier`; `""` means the default, `l2`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum CommitTier {
    /// On the worker's local disk; the upload to S3 follows in the background.
    L1,
    /// Only once uploaded to S3 and verified there. Default.
    #[default]
    L2,
}

wire_enum!(CommitTier, "commit tier", "l1, l2", {
    L1 => "l1",
    L2 => "l2",
});

impl CommitTier {
    /// Parses a spec's tier, where `""` means the default ([`CommitTier::L2`]).
    pub fn from_spec(text: &str) -> Result<Self, UnknownName> {
        if text.is_empty() {
            Ok(Self::default())
        } else {
            text.parse()
        }
    }
}

/// A worker agent as the leader shows it (`WorkerInfo.state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerPhase {
    /// Its heartbeats arrive; ranks may be placed on it.
    Alive,
    /// Its heartbeats stopped for longer than the expiry: its ranks were failed.
    Expired,
}

wire_enum!(WorkerPhase, "worker state", "alive, expired", {
    Alive => "alive",
    Expired => "expired",
});

/// A tier that holds a verified copy of a checkpoint step (`CheckpointInfo.tiers`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CheckpointTier {
    /// The checkpoint directory (a worker's local disk, or a shared one).
    L1,
    /// S3.
    L2,
}

wire_enum!(CheckpointTier, "checkpoint tier", "L1, L2", {
    L1 => "L1",
    L2 => "L2",
});

/// A coordinator of the cluster as the answering coordinator sees it
/// (`ClusterStatusResponse.members[].role`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberRole {
    /// The Raft leader.
    Leader,
    /// A voter following the leader.
    Follower,
    /// A voter asking for votes (the answering node itself only).
    Candidate,
    /// A non-voting member that receives the log.
    Learner,
    /// The leader has had no acknowledgement from it for more than
    /// [`MemberRole::UNREACHABLE_AFTER_HEARTBEATS`] heartbeat intervals (a dead or cut-off
    /// coordinator); `Member.last_role` says what it was.
    Unreachable,
    /// The answering node itself, shutting down.
    Shutdown,
}

wire_enum!(MemberRole, "member role", "leader, follower, candidate, learner, unreachable, shutdown", {
    Leader => "leader",
    Follower => "follower",
    Candidate => "candidate",
    Learner => "learner",
    Unreachable => "unreachable",
    Shutdown => "shutdown",
});

impl MemberRole {
    /// Raft heartbeat intervals without an acknowledgement after which the leader shows
    /// a member as [`MemberRole::Unreachable`] (1 s at the default 50 ms heartbeat).
    pub const UNREACHABLE_AFTER_HEARTBEATS: u64 = 20;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wire spelling, serde's spelling and `FromStr` agree for every variant.
    fn round_trips<T>(all: &[T])
    where
        T: Copy + fmt::Display + FromStr + Serialize + PartialEq + fmt::Debug,
        <T as FromStr>::Err: fmt::Debug,
    {
        for v in all {
            let text = v.to_string();
            assert_eq!(text.parse::<T>().expect("parses"), *v);
            assert_eq!(
                serde_json::to_string(v).expect("serializes"),
                format!("\"{text}\"")
            );
        }
    }

    #[test]
    fn every_variant_has_one_spelling_for_wire_serde_and_parse() {
        round_trips(JobState::ALL);
        round_trips(RankState::ALL);
        round_trips(RankPhase::ALL);
        round_trips(RestartScope::ALL);
        round_trips(StragglerAction::ALL);
        round_trips(RestartPath::ALL);
        round_trips(CommitTier::ALL);
        round_trips(Role::ALL);
        round_trips(StopAction::ALL);
        round_trips(MemberRole::ALL);
        round_trips(WorkerPhase::ALL);
        round_trips(CheckpointTier::ALL);
    }

    #[test]
    fn an_unknown_name_is_refused_with_the_accepted_spellings() {
        let e = "L3".parse::<CommitTier>().expect_err("unknown tier");
        assert_eq!(e.to_string(), r#"commit tier "L3" is not one of l1, l2"#);
        assert!("Running".parse::<JobState>().is_err(), "case-sensitive");
    }

    #[test]
    fn an_empty_spec_field_means_the_default() {
        assert_eq!(CommitTier::from_spec("").expect("default"), CommitTier::L2);
        assert_eq!(
            RestartScope::from_spec("").expect("default"),
            RestartScope::Group
        );
        assert_eq!(CommitTier::from_spec("l1").expect("l1"), CommitTier::L1);
    }

    #[test]
    fn only_finished_jobs_are_terminal() {
        assert!(JobState::Cancelled.is_terminal() && JobState::Succeeded.is_terminal());
        assert!(!JobState::Running.is_terminal() && !JobState::Pending.is_terminal());
        assert!(JobState::TimedOut.is_terminal() && !JobState::Paused.is_terminal());
    }
}
