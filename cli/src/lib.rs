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
//! - [`run`]: `run`: submit, stream the output, exit with the job's outcome;
//! - [`upload`]: `--upload DIR` into the cluster's blob store, blob downloads;
//! - [`artifacts`]: `artifacts ls/get`;
//! - [`watch`]: `summary` and `watch` (live per-rank progress bars);
//! - [`dataset`]: `dataset split`;
//! - [`local`]: `local up/down/status`;
//! - [`demo`]: the end-to-end demo;
//! - [`app`]: dispatch and error hints for `main`.
//!
//! Crates of ours it uses: `cumulus-api` (the contract), `cumulus-tls` and
//! `cumulus-client` (connections), and `cumulus-bundle` (packing `--upload`, reading
//! artifacts).

pub mod app;
pub mod args;
pub mod artifacts;
pub mod client;
pub mod config;
pub mod dataset;
pub mod demo;
pub mod jobs;
pub mod local;
pub mod logs;
pub mod output;
pub mod render;
pub mod run;
pub mod upload;
pub mod upload_cache;
pub mod watch;
