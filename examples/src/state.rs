//! The checkpoint state (`state.json`): everything besides the weights and the momentum
//! buffers that a resumed rank needs to continue exactly where the checkpoint left off,
//! plus what identifies the run (hyper-parameters, data fingerprint) so that a resume
//! with other arguments or other data is refused instead of silently diverging.
//!
//! Every f64 and every 64-bit integer that must survive exactly is stored as a hex
//! string (`"0x"` + 16 digits of the bits), since JSON numbers pass through layers
//! (the agent, the leader, `google.protobuf.Struct`) that may round them to f64.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use thiserror::Error;

use crate::digest::{DigestParseError, RecordDigest};

/// The value of [`TrainState::format`] this version writes and accepts.
pub const STATE_FORMAT: &str = "cumulus-trainer-state/1";

/// Largest `state.json` accepted, in bytes (the rank-local API's limit on the state
/// object, [`cumulus_api::limits::MAX_STATE_JSON_BYTES`]).
pub const MAX_STATE_BYTES: u64 = cumulus_api::limits::MAX_STATE_JSON_BYTES as u64;

fn parse_hex_u64(text: &str) -> Option<u64> {
    let digits = text.strip_prefix("0x")?;
    if digits.len() != 16 {
        return None;
    }
    u64::from_str_radix(digits, 16).ok()
}

struct HexVisitor(&'static str);

impl Visitor<'_> for HexVisitor {
    type Value = u64;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} as \"0x\" followed by 16 hex digits", self.0)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
        parse_hex_u64(v).ok_or_else(|| E::invalid_value(de::Unexpected::Str(v), &self))
    }
}

/// A u64 stored exactly as `"0x"` + 16 hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HexU64(pub u64);

impl Serialize for HexU64 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("0x{:016x}", self.0))
    }
}

impl<'de> Deserialize<'de> for HexU64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(HexVisitor("a 64-bit integer"))
            .map(HexU64)
    }
}

/// An f64 stored exactly as `"0x"` + 16 hex digits of its IEEE-754 bits.
#[derive(Debug, Clone, Copy)]
pub struct HexF64(pub f64);

impl PartialEq for HexF64 {
    /// Bit equality (so NaN equals the same NaN, and 0.0 differs from −0.0).
    fn eq(&self, other: &Self) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}

impl Serialize for HexF64 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("0x{:016x}", self.0.to_bits()))
    }
}

impl<'de> Deserialize<'de> for HexF64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(HexVisitor("the bits of an f64"))
            .map(|b| HexF64(f64::from_bits(b)))
    }
}

/// The content of `state.json`, also sent as the `state` object of
/// `POST /v1/checkpoint`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainState {
    /// Always [`STATE_FORMAT`].
    pub format: String,
    /// Steps (mini-batches) completed; the checkpoint's step number.
    pub step: u64,
    /// Steps of the whole run: `epochs × ceil(records_per_epoch / batch_size)`.
    pub total_steps: u64,
    /// The current epoch, 0-based; equals `epochs` once training is complete.
    pub epoch: u32,
    /// Epochs of the whole run.
    pub epochs: u32,
    /// Records of the current epoch already consumed (a multiple of `batch_size`).
    pub position: u64,
    /// Records in one epoch (all records of the rank's shards).
    pub records_per_epoch: u64,
    /// Records consumed over the whole run: `epoch × records_per_epoch + position`.
    pub records_consumed: u64,
    /// Index (in the shards file) of the shard of the next record; `None` when complete.
    pub next_shard_index: Option<u64>,
    /// Base name of the shard of the next record; `None` when complete.
    pub next_shard: Option<String>,
    /// 0-based line index of the next record in its shard; `None` when complete.
    pub next_record_index: Option<u64>,
    /// PRNG (splitmix64) state at the start of the current epoch, from which the
    /// epoch's record order is drawn.
    pub rng_state: HexU64,
    /// Running record digest after `records_consumed` records, 64 hex characters.
    pub digest: String,
    /// Records per mini-batch.
    pub batch_size: u64,
    /// The seed of the record order.
    pub seed: HexU64,
    /// Learning rate.
    pub lr: HexF64,
    /// Momentum.
    pub momentum: HexF64,
    /// Classes of the model.
    pub classes: u32,
    /// Features of the model.
    pub features: u64,
    /// Factor every raw feature value is multiplied by.
    pub feature_scale: HexF64,
    /// How the features were normalized ([`crate::trainer::normalization_fingerprint`]);
    /// "" in states written before it was recorded (they resume only a run that scales).
    #[serde(default)]
    pub normalization: String,
    /// Sum of the per-record losses of the current epoch so far.
    pub epoch_loss_sum: HexF64,
    /// Mean per-record loss of the previous epoch; `None` during epoch 0.
    pub last_epoch_loss: Option<HexF64>,
    /// Shards in the shards file.
    pub shard_count: u64,
    /// [`crate::data::Dataset::fingerprint`] of the training data, 64 hex characters.
    pub data_fingerprint: String,
}

/// What the current run is: the values a checkpoint must match to be resumed by it.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSpec {
    /// Epochs.
    pub epochs: u32,
    /// Records per mini-batch (≥ 1).
    pub batch_size: u64,
    /// Seed of the record order.
    pub seed: u64,
    /// Learning rate.
    pub lr: f64,
    /// Momentum.
    pub momentum: f64,
    /// Classes.
    pub classes: u32,
    /// Features.
    pub features: u64,
    /// Feature scale factor.
    pub feature_scale: f64,
    /// [`crate::trainer::normalization_fingerprint`] of the run.
    pub normalization: String,
    /// Records per epoch (≥ 1).
    pub records_per_epoch: u64,
    /// Shards in the shards file.
    pub shard_count: u64,
    /// Data fingerprint, 64 hex characters.
    pub data_fingerprint: String,
}

impl RunSpec {
    /// Steps per epoch: `ceil(records_per_epoch / batch_size)`.
    pub fn steps_per_epoch(&self) -> u64 {
        self.records_per_epoch.div_ceil(self.batch_size)
    }

    /// Steps of the whole run.
    pub fn total_steps(&self) -> u64 {
        self.steps_per_epoch() * u64::from(self.epochs)
    }
}

/// Why a checkpoint state cannot be resumed by this run.
#[derive(Debug, Error, PartialEq)]
pub enum StateError {
    /// `format` is not [`STATE_FORMAT`].
    #[error("state.json has format {found:?}; this trainer reads {STATE_FORMAT:?}")]
    Format {
        /// The format found.
        found: String,
    },
    /// The state's step is not the step the agent asked to resume.
    #[error("state.json is for step {state_step}, but CUMULUS_RESUME_STEP is {resume_step}")]
    Step {
        /// Step in the state.
        state_step: u64,
        /// `CUMULUS_RESUME_STEP`.
        resume_step: u64,
    },
    /// A value identifying the run differs from this run's.
    #[error(
        "state.json has {field} = {found}, but this run has {expected}: resume with the \
         same arguments and data as the checkpointed run"
    )]
    Mismatch {
        /// The field.
        field: &'static str,
        /// This run's value.
        expected: String,
        /// The checkpoint's value.
        found: String,
    },
    /// The position fields contradict each other.
    #[error("state.json is inconsistent: {0}")]
    Inconsistent(String),
    /// The digest is not 64 hex characters.
    #[error("state.json: {0}")]
    Digest(#[from] DigestParseError),
}

impl TrainState {
    /// Checks the state against this run and the step asked for; returns the parsed
    /// digest. Does not check the next-record fields against the record order (the
    /// trainer does, once it has drawn the epoch's order).
    pub fn check(&self, spec: &RunSpec, resume_step: u64) -> Result<RecordDigest, StateError> {
        if self.format != STATE_FORMAT {
            return Err(StateError::Format {
                found: self.format.clone(),
            });
        }
        if self.step != resume_step {
            return Err(StateError::Step {
                state_step: self.step,
                resume_step,
            });
        }
        fn mismatch<T: fmt::Debug + PartialEq>(
            field: &'static str,
            expected: T,
            found: T,
        ) -> Result<(), StateError> {
            if expected == found {
                Ok(())
            } else {
                Err(StateError::Mismatch {
                    field,
                    expected: format!("{expected:?}"),
                    found: format!("{found:?}"),
                })
            }
        }
        mismatch("epochs", spec.epochs, self.epochs)?;
        mismatch("batch_size", spec.batch_size, self.batch_size)?;
        mismatch("seed", spec.seed, self.seed.0)?;
        mismatch("lr", spec.lr.to_bits(), self.lr.0.to_bits())
            .map_err(|_| f64_mismatch("lr", spec.lr, self.lr.0))?;
        mismatch(
            "momentum",
            spec.momentum.to_bits(),
            self.momentum.0.to_bits(),
        )
        .map_err(|_| f64_mismatch("momentum", spec.momentum, self.momentum.0))?;
        mismatch("classes", spec.classes, self.classes)?;
        mismatch("features", spec.features, self.features)?;
        mismatch(
            "feature_scale",
            spec.feature_scale.to_bits(),
            self.feature_scale.0.to_bits(),
        )
        .map_err(|_| f64_mismatch("feature_scale", spec.feature_scale, self.feature_scale.0))?;
        let recorded = if self.normalization.is_empty() {
            "scale"
        } else {
            self.normalization.as_str()
        };
        mismatch("normalization", spec.normalization.as_str(), recorded)?;
        mismatch("shard_count", spec.shard_count, self.shard_count)?;
        mismatch(
            "records_per_epoch",
            spec.records_per_epoch,
            self.records_per_epoch,
        )?;
        mismatch(
            "data_fingerprint",
            spec.data_fingerprint.as_str(),
            self.data_fingerprint.as_str(),
        )?;
        mismatch("total_steps", spec.total_steps(), self.total_steps)?;

        let bad = |msg: String| Err(StateError::Inconsistent(msg));
        if self.epoch > self.epochs {
            return bad(format!("epoch {} > epochs {}", self.epoch, self.epochs));
        }
        let complete = self.epoch == self.epochs;
        if complete && self.position != 0 {
            return bad(format!(
                "training is complete but position is {}",
                self.position
            ));
        }
        if !complete && self.position >= self.records_per_epoch {
            return bad(format!(
                "position {} is not below records_per_epoch {}",
                self.position, self.records_per_epoch
            ));
        }
        if !self.position.is_multiple_of(self.batch_size) {
            return bad(format!(
                "position {} is not a multiple of batch_size {}",
                self.position, self.batch_size
            ));
        }
        let expected_step =
            u64::from(self.epoch) * spec.steps_per_epoch() + self.position / self.batch_size;
        if self.step != expected_step {
            return bad(format!(
                "step {} does not match epoch {} and position {} (expected step {expected_step})",
                self.step, self.epoch, self.position
            ));
        }
        let expected_records = u64::from(self.epoch) * self.records_per_epoch + self.position;
        if self.records_consumed != expected_records {
            return bad(format!(
                "records_consumed {} does not match epoch {} and position {} (expected {expected_records})",
                self.records_consumed, self.epoch, self.position
            ));
        }
        let next_fields = [
            self.next_shard_index.is_some(),
            self.next_shard.is_some(),
            self.next_record_index.is_some(),
        ];
        if next_fields.contains(&complete) {
            return bad(format!(
                "next_shard_index/next_shard/next_record_index must all be {} when epoch is {} of {}",
                if complete { "null" } else { "set" },
                self.epoch,
                self.epochs
            ));
        }
        if self.position == 0 && self.epoch_loss_sum.0 != 0.0 {
            return bad("epoch_loss_sum is not 0 at the start of an epoch".to_string());
        }
        if (self.epoch > 0) != self.last_epoch_loss.is_some() {
            return bad(format!(
                "last_epoch_loss must be set exactly when epoch > 0 (epoch {})",
                self.epoch
            ));
        }
        Ok(RecordDigest::from_hex(&self.digest)?)
    }
}

fn f64_mismatch(field: &'static str, expected: f64, found: f64) -> StateError {
    StateError::Mismatch {
        field,
        expected: format!("{expected:e}"),
        found: format!("{found:e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> RunSpec {
        RunSpec {
            epochs: 3,
            batch_size: 4,
            seed: u64::MAX - 1,
            lr: 0.1,
            momentum: 0.9,
            classes: 10,
            features: 64,
            feature_scale: 1.0 / 16.0,
            normalization: "scale".into(),
            records_per_epoch: 10,
            shard_count: 2,
            data_fingerprint: "ab".repeat(32),
        }
    }

    fn state() -> TrainState {
        TrainState {
            format: STATE_FORMAT.to_string(),
            step: 4,
            total_steps: 9,
            epoch: 1,
            epochs: 3,
            position: 4,
            records_per_epoch: 10,
            records_consumed: 14,
            next_shard_index: Some(1),
            next_shard: Some("b.csv".to_string()),
            next_record_index: Some(2),
            rng_state: HexU64(0xdead_beef_0000_0001),
            digest: "00".repeat(32),
            batch_size: 4,
            seed: HexU64(u64::MAX - 1),
            lr: HexF64(0.1),
            momentum: HexF64(0.9),
            classes: 10,
            features: 64,
            feature_scale: HexF64(1.0 / 16.0),
            normalization: "scale".into(),
            epoch_loss_sum: HexF64(1.25),
            last_epoch_loss: Some(HexF64(0.3)),
            shard_count: 2,
            data_fingerprint: "ab".repeat(32),
        }
    }

    #[test]
    fn json_round_trip_is_exact() {
        let s = state();
        let text = serde_json::to_string(&s).unwrap();
        assert!(text.contains("\"seed\":\"0xfffffffffffffffe\""), "{text}");
        assert!(text.contains("\"lr\":\"0x3fb999999999999a\""), "{text}");
        let back: TrainState = serde_json::from_str(&text).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn a_consistent_state_passes() {
        assert_eq!(state().check(&spec(), 4), Ok(RecordDigest::zero()));
    }

    #[test]
    fn wrong_step_args_and_positions_are_refused() {
        assert!(matches!(
            state().check(&spec(), 5),
            Err(StateError::Step {
                state_step: 4,
                resume_step: 5
            })
        ));
        let mut other = spec();
        other.lr = 0.2;
        assert!(matches!(
            state().check(&other, 4),
            Err(StateError::Mismatch { field: "lr", .. })
        ));
        let mut other = spec();
        other.data_fingerprint = "cd".repeat(32);
        assert!(matches!(
            state().check(&other, 4),
            Err(StateError::Mismatch {
                field: "data_fingerprint",
                ..
            })
        ));
        let mut s = state();
        s.records_consumed = 13;
        assert!(matches!(
            s.check(&spec(), 4),
            Err(StateError::Inconsistent(_))
        ));
        let mut s = state();
        s.position = 3;
        assert!(matches!(
            s.check(&spec(), 4),
            Err(StateError::Inconsistent(_))
        ));
        let mut s = state();
        s.next_shard = None;
        assert!(matches!(
            s.check(&spec(), 4),
            Err(StateError::Inconsistent(_))
        ));
        let mut s = state();
        s.format = "other/9".to_string();
        assert!(matches!(
            s.check(&spec(), 4),
            Err(StateError::Format { .. })
        ));
        let mut s = state();
        s.digest = "xyz".to_string();
        assert!(matches!(s.check(&spec(), 4), Err(StateError::Digest(_))));
    }

    #[test]
    fn unknown_fields_and_bad_hex_are_refused() {
        let mut v = serde_json::to_value(state()).unwrap();
        v["extra"] = serde_json::json!(1);
        assert!(serde_json::from_value::<TrainState>(v).is_err());
        let mut v = serde_json::to_value(state()).unwrap();
        v["lr"] = serde_json::json!(0.1);
        assert!(serde_json::from_value::<TrainState>(v).is_err());
        let mut v = serde_json::to_value(state()).unwrap();
        v["seed"] = serde_json::json!("0x12");
        assert!(serde_json::from_value::<TrainState>(v).is_err());
    }
}
