//! `cumulus-nemesis`: the long nemesis schedule. Runs seeded nemesis runs (a fresh
//! cluster each) until `--runs` runs are done and `--minutes` have passed, prints one
//! JSON report per run and a summary, and exits non-zero when any run found an anomaly.
//!
//! Build the workspace binaries first (`cargo build --workspace --bins`); run from the
//! same target dir, e.g. `target/debug/cumulus-nemesis --runs 100 --minutes 0`.

use std::collections::BTreeMap;
use std::time::Instant;

use clap::Parser;
use cumulus_e2e::nemesis::{FAULTS, RunOpts, run};

/// Command line.
#[derive(Parser, Debug)]
#[command(
    name = "cumulus-nemesis",
    about = "Seeded nemesis runs against real clusters."
)]
struct Args {
    /// At least this many runs.
    #[arg(long, default_value_t = 1)]
    runs: u32,
    /// And at least this many minutes of runs.
    #[arg(long, default_value_t = 0)]
    minutes: u64,
    /// Seed of the first run (each next run adds 1). Default: from the clock.
    #[arg(long)]
    seed: Option<u64>,
    /// Fault phase of each run, in seconds.
    #[arg(long, default_value_t = 40)]
    fault_secs: u64,
    /// Concurrent clients per run.
    #[arg(long, default_value_t = 3)]
    clients: usize,
    /// Trainer epochs per run.
    #[arg(long, default_value_t = 2)]
    epochs: u32,
    /// Inject only this fault kind, every time one is drawn (e.g. `corrupt-follower-sled`;
    /// the kinds are listed in docs/reliability.md).
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(FAULTS))]
    only: Option<String>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let first = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(1)
    });
    let start = Instant::now();
    let mut n = 0u64;
    let mut failed = Vec::new();
    let mut errors: Vec<(u64, String)> = Vec::new();
    let mut faults: BTreeMap<String, u64> = BTreeMap::new();
    let mut ops: BTreeMap<String, u64> = BTreeMap::new();
    let mut sled_outcomes: BTreeMap<String, u64> = BTreeMap::new();
    let (mut acked, mut reads, mut restarts) = (0u64, 0u64, 0u64);
    while n < u64::from(args.runs) || start.elapsed().as_secs() < args.minutes * 60 {
        let seed = first + n;
        n += 1;
        let opts = RunOpts {
            seed,
            fault_ms: args.fault_secs * 1_000,
            clients: args.clients,
            epochs: args.epochs,
            hang_first: false,
            only: args.only.clone(),
        };
        // SIGINT/SIGTERM end the schedule: the run in flight is dropped (its cluster's
        // processes are killed by the harness's Drop) and the summary of the completed
        // runs is still printed.
        let outcome = tokio::select! {
            r = run(&opts) => Some(r),
            _ = stop_signal() => None,
        };
        let Some(outcome) = outcome else {
            eprintln!("seed {seed}: stopped by a signal; the run in flight is not counted");
            n -= 1;
            break;
        };
        let report = match outcome {
            Ok(report) => report,
            Err(e) => {
                // The harness could not complete the run (e.g. a cluster that did not
                // start): recorded and counted, and the schedule goes on.
                eprintln!("seed {seed}: run error: {e:#}");
                errors.push((seed, format!("{e:#}")));
                continue;
            }
        };
        println!("{}", serde_json::to_string(&report)?);
        for (k, v) in &report.faults {
            *faults.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &report.sled_outcomes {
            *sled_outcomes.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &report.ops {
            *ops.entry(k.clone()).or_default() += v;
        }
        acked += report.acked_submits;
        reads += report.reads;
        restarts += u64::from(report.trainer_restarts);
        if !report.anomalies.is_empty() {
            failed.push((seed, report.anomalies.clone()));
        }
    }
    eprintln!(
        "summary: {n} runs in {} s, seeds {first}..{}; ops {ops:?}; acked submits {acked}; linearizable reads {reads}; faults {faults:?}; corrupt-follower-sled outcomes {sled_outcomes:?}; trainer restarts {restarts}; runs with anomalies {}; runs the harness could not complete {}",
        start.elapsed().as_secs(),
        first + n - 1,
        failed.len(),
        errors.len()
    );
    for (seed, a) in &failed {
        eprintln!("seed {seed}: {a:#?}");
    }
    for (seed, e) in &errors {
        eprintln!("seed {seed}: run error: {e}");
    }
    anyhow::ensure!(failed.is_empty(), "{} runs found anomalies", failed.len());
    anyhow::ensure!(
        errors.is_empty(),
        "{} runs could not complete",
        errors.len()
    );
    Ok(())
}

/// Resolves on the first SIGINT or SIGTERM.
async fn stop_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        // Without signal handlers the schedule simply cannot be stopped early.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
}
