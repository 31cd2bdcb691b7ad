//! The Cumulus example trainer: softmax regression (multinomial logistic regression)
//! trained with deterministic mini-batch SGD with momentum on CSV shards, using the
//! Cumulus rank contract (environment, rank-local HTTP API, checkpoint staging, resume).
//!
//! Every rank trains its own model on its own shards; there is no collective
//! communication. The library holds everything but the command line:
//!
//! - [`data`]: the shards file, CSV shards (plain or `.gz`), validation, feature scaling;
//! - [`rng`]: the small seeded PRNG (splitmix64) that shuffles each epoch;
//! - [`digest`]: the running SHA-256 record digest (exactly-once evidence);
//! - [`model`]: the model, its gradient and the momentum optimizer (f64, fixed order);
//! - [`state`]: the checkpoint state (`state.json`) and its validation on resume;
//! - [`env`]: the rank environment variables;
//! - [`agent`]: the client of the worker agent's rank-local HTTP API;
//! - [`trainer`]: the training loop, checkpoints, resume and the final result.
//!
//! Determinism: the record order of an epoch depends only on the seed and the epoch (the
//! PRNG state at the start of the epoch is saved in the checkpoint), every float sum runs
//! in one fixed order on one thread, and the weights start at zero, so a run resumed from
//! any checkpoint ends with weights byte-identical to an uninterrupted run.

pub mod agent;
pub mod data;
pub mod digest;
pub mod env;
pub mod model;
pub mod rng;
pub mod state;
pub mod trainer;
