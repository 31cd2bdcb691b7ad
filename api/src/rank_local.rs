//! The bodies of the rank-local HTTP API (docs/architecture.md, "Rank-local HTTP API"),
//! served by the worker agent (`worker/src/rank_api.rs`) and spoken by ranks: the Rust
//! example trainer (`examples/src/agent.rs`) and the Python runtime
//! (`python/src/cumulus/runtime/_agent.py`).
//!
//! Every body is JSON. Paths: `POST /v1/progress` ([`ProgressReport`] → 204, or 200
//! [`ControlReply`] once the rank is asked to stop), `GET /v1/control` (200
//! [`ControlReply`]), `POST /v1/checkpoint` ([`CheckpointRequest`] → 200
//! [`CommitReply`]), `GET /v1/checkpoints` (200 [`CheckpointsReply`]), `POST
//! /v1/exception` ([`ExceptionReport`] → 204: what the process is dying of). Errors are
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

/// The 200 reply of `GET /v1/restart` (a long poll, at most [`MAX_RESTART_POLL_MS`]): the
/// new attempt an in-process restart hands the rank's live process. The rank leaves its
/// step, tears its process group down, sets `env` in its environment (after removing
/// [`RESTART_CLEARED_VARS`]), tells the agent with `POST /v1/restart` under the new
/// token within [`RESTART_ACK_TIMEOUT_MS`] of the offer (else the agent kills it and the
/// job falls back to a full restart), waits `hold_ms`, and re-enters training from the
/// resume step the environment names. A poll that times out answers 204.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestartOffer {
    /// The new attempt number (`CUMULUS_ATTEMPT`).
    pub attempt: u32,
    /// The rank contract's variables of the new attempt (its token, `MASTER_PORT`,
    /// staging and resume variables, ...), by name.
    pub env: BTreeMap<String, String>,
    /// The rest of the restart's backoff, in ms from when the agent learned it.
    pub hold_ms: u64,
    /// How long the agent waits for the rank's `POST /v1/restart`, in ms.
    pub ack_timeout_ms: u64,
}

/// Longest wait of one `GET /v1/restart`, in milliseconds (`?timeout_ms=` is capped to it).
pub const MAX_RESTART_POLL_MS: u64 = 30_000;
/// How long an in-process restart waits for its rank's `POST /v1/restart` (the rank left
/// its step and tore down its process group), in milliseconds: past it the agent kills
/// the process and the job falls back to a full restart.
pub const RESTART_ACK_TIMEOUT_MS: u64 = 10_000;
/// Variables a rank removes from its environment before it sets a [`RestartOffer`]'s
/// `env` (the new attempt sets them again when it has them).
pub const RESTART_CLEARED_VARS: [&str; 3] = [
    crate::rank_env::CKPT_STAGING,
    crate::rank_env::RESUME_STEP,
    crate::rank_env::RESUME_DIR,
];

/// Most steps one [`CheckpointsReply`] lists (the newest ones): its JSON stays under
/// [`MAX_REPLY_BYTES`] (each step is at most 21 bytes with its comma).
pub const MAX_LISTED_STEPS: usize = 1024;

/// Body of `POST /v1/exception`: the uncaught exception the rank's process is about to
/// die of, sent once by its runtime's exception hook (the Python runtime's
/// `sys.excepthook`). The agent keeps the last one of the attempt and, when the process
/// then exits non-zero, reports [`ExceptionReport::summary`] as the cause of the exit.
/// Bounds ([`ExceptionReport::validate`]): the type 1..=[`MAX_EXCEPTION_TYPE_BYTES`]
/// bytes, the message at most [`MAX_EXCEPTION_MESSAGE_BYTES`], at most
/// [`MAX_EXCEPTION_FRAMES`] frames of at most [`MAX_EXCEPTION_FRAME_BYTES`] each, the
/// origin at most [`MAX_EXCEPTION_FRAME_BYTES`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExceptionReport {
    /// The exception's type, e.g. `ValueError` or `torch.OutOfMemoryError`.
    #[serde(rename = "type")]
    pub type_name: String,
    /// Its message (`str(exc)`), possibly empty or several lines.
    #[serde(default)]
    pub message: String,
    /// The last frames of its traceback, innermost last, each `file:line in function`.
    #[serde(default)]
    pub frames: Vec<String>,
    /// Where it was raised in the job's own code, `file:line` with the file's base name
    /// (`train.py:42`): the innermost frame outside the Python installation, else the
    /// innermost one; `""` when unknown.
    #[serde(default)]
    pub origin: String,
}

/// Longest exception type of an [`ExceptionReport`], in bytes.
pub const MAX_EXCEPTION_TYPE_BYTES: usize = 256;
/// Longest exception message of an [`ExceptionReport`], in bytes (a rank's runtime cuts
/// a longer one).
pub const MAX_EXCEPTION_MESSAGE_BYTES: usize = 2048;
/// Most frames of an [`ExceptionReport`] (the innermost ones).
pub const MAX_EXCEPTION_FRAMES: usize = 16;
/// Longest frame (and origin) of an [`ExceptionReport`], in bytes.
pub const MAX_EXCEPTION_FRAME_BYTES: usize = 512;

impl ExceptionReport {
    /// Checks the bounds of every field (see [`ExceptionReport`]); the error says which
    /// one failed.
    pub fn validate(&self) -> Result<(), String> {
        if self.type_name.trim().is_empty() || self.type_name.len() > MAX_EXCEPTION_TYPE_BYTES {
            return Err(format!(
                "type must be 1..={MAX_EXCEPTION_TYPE_BYTES} bytes, got {}",
                self.type_name.len()
            ));
        }
        if self.message.len() > MAX_EXCEPTION_MESSAGE_BYTES {
            return Err(format!(
                "message must be at most {MAX_EXCEPTION_MESSAGE_BYTES} bytes, got {}",
                self.message.len()
            ));
        }
        if self.frames.len() > MAX_EXCEPTION_FRAMES {
            return Err(format!(
                "at most {MAX_EXCEPTION_FRAMES} frames, got {}",
                self.frames.len()
            ));
        }
        if let Some(f) = self
            .frames
            .iter()
            .chain(std::iter::once(&self.origin))
            .find(|f| f.len() > MAX_EXCEPTION_FRAME_BYTES)
        {
            return Err(format!(
                "frames and origin must be at most {MAX_EXCEPTION_FRAME_BYTES} bytes, got {}",
                f.len()
            ));
        }
        Ok(())
    }

    /// The exception in one printable line of at most
    /// [`crate::limits::MAX_EXIT_CAUSE_BYTES`]: `ValueError: bad lr (train.py:42)` (the
    /// message's first line, then the origin, else the base name and line of the
    /// innermost frame),
    /// control characters escaped. The origin is kept when the message must be cut.
    pub fn summary(&self) -> String {
        let max = crate::limits::MAX_EXIT_CAUSE_BYTES;
        let origin = if self.origin.trim().is_empty() {
            self.frames
                .last()
                .map(|f| {
                    let at = f.split(" in ").next().unwrap_or(f).trim();
                    at.rsplit('/').next().unwrap_or(at).to_string()
                })
                .unwrap_or_default()
        } else {
            self.origin.trim().to_string()
        };
        let origin = crate::text::bounded_line(&origin, max / 4);
        let suffix = if origin.is_empty() {
            String::new()
        } else {
            format!(" ({origin})")
        };
        let first_line = self.message.trim().lines().next().unwrap_or("").trim();
        let more = if self.message.trim().lines().nth(1).is_some() {
            " …"
        } else {
            ""
        };
        let head = if first_line.is_empty() {
            self.type_name.trim().to_string()
        } else {
            format!("{}: {first_line}{more}", self.type_name.trim())
        };
        let head = crate::text::bounded_line(&head, max.saturating_sub(suffix.len()));
        format!("{head}{suffix}")
    }
}

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
    fn exception_reports_validate_and_summarize_in_one_bounded_line() {
        let report: ExceptionReport = serde_json::from_str(
            r#"{"type": "ValueError", "message": "bad lr\nsee docs",
                "frames": ["/w/train.py:42 in main"], "origin": ""}"#,
        )
        .expect("parses");
        assert_eq!(report.validate(), Ok(()));
        assert_eq!(report.summary(), "ValueError: bad lr … (train.py:42)");
        let with_origin = ExceptionReport {
            origin: "train.py:42".into(),
            message: "x\u{1b}[2J".into(),
            ..report.clone()
        };
        assert_eq!(
            with_origin.summary(),
            "ValueError: x\\u{1b}[2J (train.py:42)"
        );
        let bare = ExceptionReport {
            type_name: "KeyboardInterrupt".into(),
            message: String::new(),
            frames: vec![],
            origin: String::new(),
        };
        assert_eq!(bare.summary(), "KeyboardInterrupt");
        let long = ExceptionReport {
            message: "m".repeat(MAX_EXCEPTION_MESSAGE_BYTES),
            origin: "train.py:7".into(),
            ..report.clone()
        };
        let line = long.summary();
        assert!(
            line.len() <= crate::limits::MAX_EXIT_CAUSE_BYTES,
            "{}",
            line.len()
        );
        assert!(line.ends_with("(train.py:7)"), "{line}");
        for bad in [
            ExceptionReport {
                type_name: " ".into(),
                ..report.clone()
            },
            ExceptionReport {
                message: "m".repeat(MAX_EXCEPTION_MESSAGE_BYTES + 1),
                ..report.clone()
            },
            ExceptionReport {
                frames: vec!["f".into(); MAX_EXCEPTION_FRAMES + 1],
                ..report.clone()
            },
            ExceptionReport {
                origin: "o".repeat(MAX_EXCEPTION_FRAME_BYTES + 1),
                ..report.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
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
