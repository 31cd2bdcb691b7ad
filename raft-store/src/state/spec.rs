//! A job as submitted: [`JobSpec`] and [`RestartPolicy`], with their validation.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::*;

/// Restart policy of a job, with every default filled in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestartPolicy {
    /// What a failure restarts.
    pub scope: RestartScope,
    /// Job-wide restart budget.
    pub max_restarts: u32,
    /// Delay of the first restart before jitter, in milliseconds.
    pub backoff_initial_ms: u64,
    /// Cap of the delay before jitter, in milliseconds.
    pub backoff_max_ms: u64,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            scope: RestartScope::Group,
            max_restarts: 3,
            backoff_initial_ms: 500,
            backoff_max_ms: 30_000,
        }
    }
}

impl RestartPolicy {
    /// Base delay of restart number `n` (1-based), before jitter:
    /// `min(initial × 2^(n−1), max)` in milliseconds (saturating).
    pub fn base_delay_ms(&self, n: u32) -> u64 {
        let exp = n.saturating_sub(1).min(63);
        let factor = 1u64.checked_shl(exp).unwrap_or(u64::MAX);
        self.backoff_initial_ms
            .saturating_mul(factor)
            .min(self.backoff_max_ms)
    }

    /// The delay of restart `n` jittered by `unit` ∈ [−1, 1]: base × (1 + 0.2·unit).
    /// The leader draws `unit` at random and stamps the result into the command.
    pub fn jittered_delay_ms(&self, n: u32, unit: f64) -> u64 {
        let unit = if unit.is_finite() {
            unit.clamp(-1.0, 1.0)
        } else {
            0.0
        };
        let base = self.base_delay_ms(n) as f64;
        (base * (1.0 + BACKOFF_JITTER_FRACTION * unit))
            .round()
            .max(0.0) as u64
    }

    /// The smallest delay the policy allows for restart `n`: base × 0.8.
    pub fn min_delay_ms(&self, n: u32) -> u64 {
        self.jittered_delay_ms(n, -1.0)
    }
}

/// Committed checkpoint steps kept when a submit names none.
pub const DEFAULT_CKPT_KEEP: u32 = 3;

/// A job as submitted, validated and with defaults filled in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    /// Human-readable name (≤ 128 bytes).
    pub name: String,
    /// Number of ranks.
    pub world_size: u32,
    /// argv of every rank.
    pub command: Vec<String>,
    /// Extra environment of every rank (sorted for determinism).
    pub env: BTreeMap<String, String>,
    /// Dataset directory, or an S3 prefix `s3://bucket/prefix` ("" = none).
    pub dataset: String,
    /// Checkpoint root ("" = disabled).
    pub ckpt_dir: String,
    /// Committed checkpoint steps kept.
    pub ckpt_keep: u32,
    /// What a failure restarts, the restart budget and its backoff.
    pub restart: RestartPolicy,
    /// Hang detection: no progress for this long fails the rank (0 = off), in milliseconds.
    pub progress_timeout_ms: u64,
    /// Working directory of the ranks ("" = the worker's).
    pub working_dir: String,
    /// S3 checkpoint target `s3://bucket/prefix` ("" = none).
    #[serde(default)]
    pub ckpt_url: String,
    /// Commit tier with an S3 target: "l1" or "l2" ("" = l2).
    #[serde(default)]
    pub ckpt_commit_tier: String,
}

impl JobSpec {
    /// The smallest spec: `world_size` ranks running `command`, every other field at the
    /// API's default (no name, env, dataset or checkpoints; [`DEFAULT_CKPT_KEEP`] kept
    /// steps; the default restart policy; no hang detection). Set the rest with struct
    /// update syntax; [`JobSpec::validate`] still decides whether it is acceptable.
    pub fn new(world_size: u32, command: Vec<String>) -> Self {
        Self {
            name: String::new(),
            world_size,
            command,
            env: BTreeMap::new(),
            dataset: String::new(),
            ckpt_dir: String::new(),
            ckpt_keep: DEFAULT_CKPT_KEEP,
            restart: RestartPolicy::default(),
            progress_timeout_ms: 0,
            working_dir: String::new(),
            ckpt_url: String::new(),
            ckpt_commit_tier: String::new(),
        }
    }

    /// The bytes of the spec's variable-size strings, each with a per-string allowance
    /// (quotes, comma): the part of its encoded size that varies.
    pub fn approx_string_bytes(&self) -> usize {
        self.name.len()
            + self
                .command
                .iter()
                .map(|a| a.len() + PER_STRING_BYTES)
                .sum::<usize>()
            + self
                .env
                .iter()
                .map(|(k, v)| k.len() + v.len() + 2 * PER_STRING_BYTES)
                .sum::<usize>()
            + self.dataset.len()
            + self.ckpt_dir.len()
            + self.working_dir.len()
            + self.ckpt_url.len()
            + self.ckpt_commit_tier.len()
    }

    /// True when the job checkpoints (a local root, an S3 target, or both).
    pub fn ckpt_enabled(&self) -> bool {
        !self.ckpt_dir.is_empty() || !self.ckpt_url.is_empty()
    }

    /// Checks every field against the limits of this module; `max_world_size` is the
    /// cluster's own limit (≤ [`MAX_WORLD_SIZE`]).
    ///
    /// # Errors
    /// A message naming the first invalid field.
    pub fn validate(&self, max_world_size: u32) -> Result<(), String> {
        let max_world_size = max_world_size.min(MAX_WORLD_SIZE);
        if self.world_size == 0 || self.world_size > max_world_size {
            return Err(format!(
                "world size {} is out of range: it must be between 1 and {max_world_size}",
                self.world_size
            ));
        }
        if self.name.len() > MAX_JOB_NAME_BYTES {
            return Err(format!(
                "job name is longer than {MAX_JOB_NAME_BYTES} bytes"
            ));
        }
        if self.command.is_empty() || self.command[0].trim().is_empty() {
            return Err("the command is empty: give the program to run after `--`".into());
        }
        if self.command.len() > MAX_COMMAND_ARGS {
            return Err(format!(
                "the command has {} arguments, more than the limit of {MAX_COMMAND_ARGS}",
                self.command.len()
            ));
        }
        if let Some(a) = self
            .command
            .iter()
            .find(|a| a.len() > MAX_ARG_BYTES || a.contains('\0'))
        {
            return Err(format!(
                "command argument {:?}… is longer than {MAX_ARG_BYTES} bytes or contains NUL",
                a.chars().take(32).collect::<String>()
            ));
        }
        if self.env.len() > MAX_ENV_ENTRIES {
            return Err(format!("more than {MAX_ENV_ENTRIES} env entries"));
        }
        for (k, v) in &self.env {
            let key_ok = !k.is_empty()
                && k.len() <= MAX_ARG_BYTES
                && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                && !k.as_bytes()[0].is_ascii_digit();
            if !key_ok {
                return Err(format!(
                    "env key {k:?} is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)"
                ));
            }
            if v.len() > MAX_ARG_BYTES || v.contains('\0') {
                return Err(format!(
                    "env value of {k} is longer than {MAX_ARG_BYTES} bytes or contains NUL"
                ));
            }
        }
        for (field, path) in [
            ("dataset", &self.dataset),
            ("ckpt_dir", &self.ckpt_dir),
            ("working_dir", &self.working_dir),
        ] {
            let s3_dataset = field == "dataset" && path.starts_with("s3://");
            if !path.is_empty()
                && ((!path.starts_with('/') && !s3_dataset)
                    || path.len() > MAX_ARG_BYTES
                    || path.contains('\0'))
            {
                return Err(format!("{field} {path:?} must be an absolute path"));
            }
        }
        if !self.ckpt_url.is_empty()
            && (!self.ckpt_url.starts_with("s3://")
                || self.ckpt_url.len() > MAX_ARG_BYTES
                || self.ckpt_url.contains('\0'))
        {
            return Err(format!(
                "ckpt_url {:?} must be an s3://bucket/prefix URL",
                self.ckpt_url
            ));
        }
        let tier = CommitTier::from_spec(&self.ckpt_commit_tier).map_err(|_| {
            format!(
                "ckpt_commit_tier {:?} must be l1 or l2",
                self.ckpt_commit_tier
            )
        })?;
        if tier == CommitTier::L1 && (self.ckpt_url.is_empty() || self.ckpt_dir.is_empty()) {
            return Err(
                "ckpt_commit_tier l1 needs both ckpt_url (L2) and a shared ckpt_dir (L1)".into(),
            );
        }
        if self.ckpt_keep == 0 || self.ckpt_keep > MAX_CKPT_KEEP {
            return Err(format!("ckpt_keep must be between 1 and {MAX_CKPT_KEEP}"));
        }
        let r = &self.restart;
        if r.max_restarts > MAX_RESTART_BUDGET {
            return Err(format!(
                "max_restarts {} is above the limit of {MAX_RESTART_BUDGET}",
                r.max_restarts
            ));
        }
        if r.backoff_initial_ms > MAX_BACKOFF_MS || r.backoff_max_ms > MAX_BACKOFF_MS {
            return Err(format!(
                "backoff delays must be at most {MAX_BACKOFF_MS} ms"
            ));
        }
        if r.backoff_max_ms < r.backoff_initial_ms {
            return Err(format!(
                "backoff_max_ms ({}) is below backoff_initial_ms ({})",
                r.backoff_max_ms, r.backoff_initial_ms
            ));
        }
        if self.progress_timeout_ms > 7 * 24 * 3_600_000 {
            return Err("progress timeout is above 7 days".into());
        }
        Ok(())
    }
}
