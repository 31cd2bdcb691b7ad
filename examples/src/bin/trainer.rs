//! `cumulus-trainer`: a softmax-regression trainer on CSV shards that uses the Cumulus
//! rank contract. See the library (`cumulus_examples`) for the semantics.
//!
//! Exit codes: 0 success; 1 bad arguments, bad input data or I/O failure; 2 a resume
//! that cannot be done (clap's usage errors also exit 2); 3 the agent rejected this
//! attempt as stale; 4 a checkpoint could not be committed after every retry.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use cumulus_api::feature_stats::FeatureStats;
use cumulus_examples::data;
use cumulus_examples::digest::expected_digest;
use cumulus_examples::env::RankEnv;
use cumulus_examples::trainer::{
    self, EXIT_INPUT, FeatureScale, Hyper, RESULT_FILE, RankResult, TrainConfig, TrainError,
    elastic,
};

/// Softmax-regression trainer on CSV shards, using the Cumulus rank contract.
#[derive(Debug, Parser)]
#[command(name = "cumulus-trainer", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train this rank's model on its shards (resuming when CUMULUS_RESUME_DIR is set).
    Train(TrainArgs),
    /// Print the record digest a run over these shards must end with.
    Digest(DigestArgs),
    /// Measure the accuracy of a weights.bin on a test CSV.
    Eval(EvalArgs),
}

#[derive(Debug, Args)]
struct TrainArgs {
    /// File listing this rank's shard paths, one per line, in order.
    #[arg(long, env = "CUMULUS_SHARDS_FILE")]
    shards_file: Option<PathBuf>,
    /// Holdout CSV (same columns) to measure accuracy on at the end.
    #[arg(long)]
    test_file: Option<PathBuf>,
    /// Output dir; weights.bin and result.json go to OUT/rank-<RANK>/.
    #[arg(long)]
    out: PathBuf,
    /// Passes over all of this rank's records.
    #[arg(long, default_value_t = 20)]
    epochs: u32,
    /// Records per mini-batch (one step).
    #[arg(long, default_value_t = 16)]
    batch_size: u64,
    /// Learning rate.
    #[arg(long, default_value_t = 0.1)]
    lr: f64,
    /// Momentum, in [0, 1).
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    /// Seed of the per-epoch record shuffle.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Commit a checkpoint every this many steps when CUMULUS_CKPT_STAGING is set
    /// (0: never).
    #[arg(long, default_value_t = 25)]
    ckpt_every: u64,
    /// Sleep this many milliseconds after each step (simulates a heavier model).
    #[arg(long, default_value_t = 0)]
    step_sleep_ms: u64,
    /// Sleep --step-sleep-ms after a step only while this file exists (a test keeps a
    /// run going for as long as it needs, then removes the file to let it finish).
    #[arg(long)]
    slow_file: Option<PathBuf>,
    /// Number of classes (default: the largest training label + 1).
    #[arg(long)]
    classes: Option<u32>,
    /// How features are scaled: "standardize" (each column to mean 0 and standard
    /// deviation 1 with the whole data set's statistics, the same on every rank), "auto"
    /// (times 1 / max |value| over this rank's data), or a factor.
    #[arg(long, default_value = "standardize")]
    feature_scale: FeatureScale,
    /// The feature statistics to standardize with (default: `.feature-stats.json`
    /// beside the shards, which `cumulusctl dataset split` writes; else computed over
    /// this rank's own data).
    #[arg(long)]
    feature_stats: Option<PathBuf>,
    /// Print a progress line every this many steps (the last step is always printed).
    #[arg(long, default_value_t = 20)]
    log_every: u64,
    /// Steps of the run of an elastic job's rank (CUMULUS_DATA_PLAN set), the same on
    /// every rank: each step takes up to --batch-size of the records the job's data plan
    /// deals this rank, and once every epoch is done the steps are empty. Pick it large
    /// enough for the smallest world size. Only for elastic jobs.
    #[arg(long)]
    total_steps: Option<u64>,
}

#[derive(Debug, Args)]
struct DigestArgs {
    /// File listing shard paths, one per line, in order.
    #[arg(long)]
    shards_file: PathBuf,
    /// Epochs of the run.
    #[arg(long)]
    epochs: u32,
    /// Seed of the run's record shuffle (as `train --seed`).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the order-free record sum instead, as JSON `{"count", "sum"}`: what the
    /// `record_sum`s of an elastic run's last ranks add up to (the seed plays no part).
    #[arg(long)]
    order_free: bool,
}

#[derive(Debug, Args)]
struct EvalArgs {
    /// A weights.bin written by `train`.
    #[arg(long)]
    weights: PathBuf,
    /// Test CSV.
    #[arg(long)]
    test_file: PathBuf,
    /// Feature scale of a training run that scaled (default: the normalization
    /// recorded in result.json beside the weights, statistics included).
    #[arg(long)]
    feature_scale: Option<f64>,
}

fn train(args: TrainArgs) -> Result<(), TrainError> {
    let env = RankEnv::from_process_env()?;
    let shards_file = args.shards_file.ok_or_else(|| {
        TrainError::Config(
            "no shards file: pass --shards-file or set CUMULUS_SHARDS_FILE".to_string(),
        )
    })?;
    let config = TrainConfig {
        shards_file,
        test_file: args.test_file,
        out_dir: args.out,
        hyper: Hyper {
            epochs: args.epochs,
            batch_size: args.batch_size,
            lr: args.lr,
            momentum: args.momentum,
            seed: args.seed,
        },
        classes: args.classes,
        feature_scale: args.feature_scale,
        feature_stats: args.feature_stats,
        ckpt_every: args.ckpt_every,
        step_sleep_ms: args.step_sleep_ms,
        slow_file: args.slow_file,
        log_every: args.log_every,
        total_steps: args.total_steps,
    };
    let mut out = std::io::stdout().lock();
    trainer::run(&config, &env, &mut out).map(|_| ())
}

fn digest(args: DigestArgs) -> Result<(), TrainError> {
    if args.epochs == 0 {
        return Err(TrainError::Config(
            "--epochs must be at least 1".to_string(),
        ));
    }
    let paths = data::read_shards_file(&args.shards_file)?;
    let dataset = data::load_shards(&paths)?;
    if args.order_free {
        let sum = elastic::expected_sum(&dataset, args.epochs);
        println!(
            "{}",
            serde_json::json!({"count": sum.count, "sum": sum.sum_hex()})
        );
        return Ok(());
    }
    println!(
        "{}",
        expected_digest(&dataset, args.epochs, args.seed).to_hex()
    );
    Ok(())
}

/// The normalization of the run that wrote `weights` (its `result.json`): the feature
/// statistics when it standardized, and the scale.
fn normalization_from_result(weights: &Path) -> anyhow::Result<(Option<FeatureStats>, f64)> {
    let path = weights.parent().unwrap_or(Path::new(".")).join(RESULT_FILE);
    let text = std::fs::read(&path).with_context(|| {
        format!(
            "no --feature-scale given and cannot read {}",
            path.display()
        )
    })?;
    let result: RankResult = serde_json::from_slice(&text)
        .with_context(|| format!("{} is not a trainer result", path.display()))?;
    Ok((result.feature_stats, result.feature_scale))
}

fn eval(args: EvalArgs) -> anyhow::Result<()> {
    let (stats, scale) = match args.feature_scale {
        Some(s) if s.is_finite() && s > 0.0 => (None, s),
        Some(s) => anyhow::bail!("--feature-scale {s} must be a positive finite number"),
        None => normalization_from_result(&args.weights)?,
    };
    let r = trainer::evaluate(&args.weights, &args.test_file, stats.as_ref(), scale)?;
    println!(
        "accuracy={:.4} records={} classes={}",
        r.accuracy, r.records, r.classes
    );
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Train(a) => train(a).map_err(|e| (e.exit_code(), e.to_string())),
        Command::Digest(a) => digest(a).map_err(|e| (e.exit_code(), e.to_string())),
        Command::Eval(a) => eval(a).map_err(|e| (EXIT_INPUT, format!("{e:#}"))),
    };
    let _ = std::io::stdout().flush();
    match code {
        Ok(()) => ExitCode::SUCCESS,
        Err((code, message)) => {
            eprintln!("cumulus-trainer: error: {message}");
            ExitCode::from(u8::try_from(code).unwrap_or(1))
        }
    }
}
