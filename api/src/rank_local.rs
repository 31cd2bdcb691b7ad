//! The bodies of the rank-local HTTP API (docs/architecture.md, "Rank-local HTTP API"),
//! served by the worker agent (`worker/src/rank_api.rs`) and spoken by ranks: the Rust
//! example trainer (`examples/src/agent.rs`) and the Python runtime
//! (`python/src/cumulus/runtime/_agent.py`).
//!
//! Every body is JSON. Paths: `POST /v1/progress` ([`ProgressReport`] → 204, or 200
//! [`ControlReply`] once the rank is asked to stop), `GET /v1/control` (200
//! [`ControlReply`]), `POST /v1/checkpoint` ([`CheckpointRequest`] → 200
//! [`CommitReply`]), `GET /v1/checkpoints` (200 [`CheckpointsReply`]). Errors are
//! [`ErrorReply`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::StopAction;

/// Body of `POST /v1/progress`. `total_steps` and `metrics` may be left out (0 and none);
/// at most [`crate::limits::MAX_METRICS`] metrics, names 1..=
/// [`crate::limits::MAX_METRIC_NAME_BYTES`] bytes; values are numbers, or NaN and the
/// infinities spelled as [`crate::metric_json`] says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProgressReport {
    /// Steps completed.
    pub step: u64,
    /// Steps of the whole run (0: unknown).
    #[serde(default)]
    pub total_steps: u64,
    /// Named metrics, e.g. `loss` (NaN and infinities included).
    #[serde(default, with = "crate::metric_json")]
    pub metrics: BTreeMap<String, f64>,
}

/// Body of `POST /v1/checkpoint`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointRequest {
    /// The checkpoint's step.
    pub step: u64,
    /// The rank's resume state, a JSON object of at most
    /// [`crate::limits::MAX_STATE_JSON_BYTES`] bytes serialized compactly.
    pub state: serde_json::Value,
}

/// The 200 reply of `POST /v1/checkpoint`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommitReply {
    /// The committed part, relative to the job's checkpoint dir, e.g.
    /// `step-00000100/rank-0/attempt-1`.
    pub dir: String,
}

/// The 200 reply of `GET /v1/checkpoints`: the committed steps of the rank's job as its
/// checkpoint store shows them (the step `LATEST` names and every older step with a
/// valid manifest), ascending, at most the newest [`MAX_LISTED_STEPS`]. Empty for a job
/// without checkpoints or before its first committed step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointsReply {
    /// Committed steps, ascending.
    pub steps: Vec<u64>,
}

/// Most steps one [`CheckpointsReply`] lists (the newest ones): its JSON stays under
/// [`MAX_REPLY_BYTES`] (each step is at most 21 bytes with its comma).
pub const MAX_LISTED_STEPS: usize = 1024;

/// What the agent asks of the rank: the 200 reply of `GET /v1/control` and of a progress
/// report once the rank has been asked to stop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlReply {
    /// [`ACTION_NONE`] (go on) or a [`StopAction`]'s wire name.
    pub action: String,
}

/// The action of a [`ControlReply`] that asks nothing.
pub const ACTION_NONE: &str = "none";

/// Most bytes of a rank-local reply body a rank reads (every reply is far shorter; a
/// longer one is cut there, so a broken agent cannot make a rank buffer without bound).
pub const MAX_REPLY_BYTES: usize = 64 * 1024;

impl ControlReply {
    /// The reply for `action` (`None`: go on).
    pub fn new(action: Option<StopAction>) -> Self {
        Self {
            action: action.map_or(ACTION_NONE, StopAction::as_str).to_string(),
        }
    }

    /// The stop action asked for: `None` for [`ACTION_NONE`]; an action this version does
    /// not know is taken for a plain [`StopAction::Stop`] (a newer agent's request to
    /// stop is still a request to stop).
    pub fn stop_action(&self) -> Option<StopAction> {
        if self.action == ACTION_NONE {
            return None;
        }
        Some(self.action.parse().unwrap_or(StopAction::Stop))
    }
}

/// The body of every error reply: `{"error": message}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// What went wrong, for a person.
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_may_leave_out_totals_and_metrics() {
        let r: ProgressReport = serde_json::from_str(r#"{"step": 3}"#).expect("parses");
        assert_eq!((r.step, r.total_steps, r.metrics.len()), (3, 0, 0));
    }

    #[test]
    fn control_replies_round_trip_and_unknown_actions_stop() {
        for action in [None, Some(StopAction::Pause), Some(StopAction::TimeLimit)] {
            let json = serde_json::to_string(&ControlReply::new(action)).expect("serializes");
            let back: ControlReply = serde_json::from_str(&json).expect("parses");
            assert_eq!(back.stop_action(), action, "{json}");
        }
        let newer = ControlReply {
            action: "drain_somehow".into(),
        };
        assert_eq!(newer.stop_action(), Some(StopAction::Stop));
    }

    #[test]
    fn the_longest_checkpoint_listing_fits_a_reply() {
        let reply = CheckpointsReply {
            steps: vec![u64::MAX; MAX_LISTED_STEPS],
        };
        let json = serde_json::to_vec(&reply).expect("serializes");
        assert!(json.len() <= MAX_REPLY_BYTES, "{} bytes", json.len());
    }
}
