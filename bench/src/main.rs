//! `cumulus-bench`: measures Cumulus on this machine with real clusters of real
//! processes on 127.0.0.1, prints a table and writes the rows as JSON.
//!
//! ```sh
//! cargo build --release --workspace --bins
//! ./target/release/cumulus-bench                                # every scenario
//! ./target/release/cumulus-bench --smoke --only failover         # quick check that it runs
//! ```
//! Benchmarks are never tests: `--smoke` shrinks every scenario so CI can check that it
//! executes, and asserts nothing about speed.

mod ckpt_commit;
mod ckpt_s3;
mod cluster_ops;
mod elastic;
mod heartbeat_scale;
mod memory;
mod metrics_scrape;
mod procstat;
mod python;
mod report;
mod scheduler;
mod training;
mod write_path;
mod write_stages;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;

use crate::report::Row;

/// Command line.
#[derive(Parser, Debug)]
#[command(
    name = "cumulus-bench",
    about = "Benchmarks of Cumulus (real processes on loopback)."
)]
struct Args {
    /// Small sizes and few repetitions: checks that every scenario runs, measures little.
    #[arg(long)]
    smoke: bool,
    /// Comma-separated scenarios to run (default: all): write_path, write_stages, failover,
    /// follower_catchup, rank_restart, rank_restart_run_as, worker_expiry, elastic_shrink,
    /// heartbeat_scale, metrics_scrape, scheduler, pause, ckpt_commit, ckpt_s3, training,
    /// memory, python.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Directory for the JSON results (created).
    #[arg(long, default_value = "target/bench-results")]
    out: PathBuf,
    /// Concurrent clients measured by `write_path` (comma-separated, each 1..=999;
    /// default 1,16,64), e.g. `--write-clients 1` for a quick look at one client.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u16).range(1..=999))]
    write_clients: Vec<u16>,
}

/// What every scenario gets.
pub struct Ctx {
    /// Smoke mode: tiny sizes.
    pub smoke: bool,
    /// Scratch directory for this run (removed at the end).
    pub work_dir: PathBuf,
    /// Concurrent clients `write_path` measures, in order.
    pub write_clients: Vec<usize>,
}

impl Ctx {
    /// `full` normally, `smoke` in smoke mode.
    pub fn pick<T>(&self, full: T, smoke: T) -> T {
        if self.smoke { smoke } else { full }
    }
}

/// Every scenario, in the order they run.
pub const SCENARIOS: &[&str] = &[
    "write_path",
    "write_stages",
    "failover",
    "follower_catchup",
    "rank_restart",
    "rank_restart_run_as",
    "worker_expiry",
    "elastic_shrink",
    "heartbeat_scale",
    "metrics_scrape",
    "scheduler",
    "pause",
    "ckpt_commit",
    "ckpt_s3",
    "training",
    "memory",
    "python",
];

async fn run_one(name: &str, ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    match name {
        "write_path" => write_path::run(ctx).await,
        "write_stages" => write_stages::run(ctx).await,
        "failover" => cluster_ops::failover(ctx).await,
        "follower_catchup" => cluster_ops::follower_catchup(ctx).await,
        "rank_restart" => cluster_ops::rank_restart(ctx).await,
        "rank_restart_run_as" => cluster_ops::rank_restart_run_as(ctx).await,
        "worker_expiry" => cluster_ops::worker_expiry(ctx).await,
        "elastic_shrink" => elastic::shrink(ctx).await,
        "heartbeat_scale" => heartbeat_scale::run(ctx).await,
        "metrics_scrape" => metrics_scrape::run(ctx).await,
        "scheduler" => scheduler::run(ctx).await,
        "pause" => cluster_ops::pause(ctx).await,
        "ckpt_commit" => ckpt_commit::run(ctx).await,
        "ckpt_s3" => ckpt_s3::run(ctx).await,
        "training" => training::run(ctx).await,
        "memory" => memory::run(ctx).await,
        "python" => python::run(ctx).await,
        other => anyhow::bail!(
            "unknown scenario {other:?}; known: {}",
            SCENARIOS.join(", ")
        ),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let selected: Vec<String> = if args.only.is_empty() {
        SCENARIOS.iter().map(|s| s.to_string()).collect()
    } else {
        args.only.clone()
    };
    let work = tempfile::Builder::new()
        .prefix("cumulus-bench-")
        .tempdir()
        .context("scratch dir")?;
    let ctx = Ctx {
        smoke: args.smoke,
        work_dir: work.path().to_path_buf(),
        write_clients: if args.write_clients.is_empty() {
            write_path::CONCURRENCY.to_vec()
        } else {
            args.write_clients.iter().map(|&c| usize::from(c)).collect()
        },
    };
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for name in &selected {
        let start = Instant::now();
        eprintln!("== {name}");
        match run_one(name, &ctx).await {
            Ok(mut r) => {
                eprintln!("   done in {:.1} s", start.elapsed().as_secs_f64());
                rows.append(&mut r);
            }
            Err(e) => {
                eprintln!("   FAILED: {e:#}");
                failures.push(format!("{name}: {e:#}"));
            }
        }
    }
    report::print_table(&rows);
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let file = args.out.join(format!(
        "bench-{stamp}{}.json",
        if args.smoke { "-smoke" } else { "" }
    ));
    let doc = serde_json::json!({
        "unix_time": stamp,
        "smoke": args.smoke,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "rows": rows,
        "failures": failures,
    });
    std::fs::write(&file, serde_json::to_vec_pretty(&doc)?)
        .with_context(|| format!("writing {}", file.display()))?;
    println!("results: {}", file.display());
    if !failures.is_empty() {
        anyhow::bail!(
            "{} scenario(s) failed: {}",
            failures.len(),
            failures.join("; ")
        );
    }
    Ok(())
}
