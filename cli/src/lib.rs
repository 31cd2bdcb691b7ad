//! `cumulusctl`: the user's tool for a Cumulus cluster.
//!
//! Modules:
//! - [`args`]: the clap command-line grammar;
//! - [`config`]: `cluster.json` and resolution of `--addr`/`--http`/`--token`;
//! - [`client`]: gRPC `ClientService` client with leader following and bounded retries;
//! - [`logs`]: SSE log following with lossless, duplicate-free resume;
//! - [`render`]: human tables;
//! - [`output`]: `-o json|yaml` or the human text;
//! - [`jobs`]: submit/status/list/cancel/logs/ckpt/cluster commands;
//! - [`watch`]: `summary` and `watch` (live per-rank progress bars);
//! - [`dataset`]: `dataset split`;
//! - [`local`]: `local up/down/status`;
//! - [`demo`]: the end-to-end demo;
//! - [`app`]: dispatch and error hints for `main`.

pub mod app;
pub mod args;
pub mod client;
pub mod config;
pub mod dataset;
pub mod demo;
pub mod jobs;
pub mod local;
pub mod logs;
pub mod output;
pub mod render;
pub mod watch;
