//! The training workload of the tests: the digits shards, the trainer's job spec, and
//! checks of its results against a reference.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use cumulus_api::v1;

use crate::*;

/// The example workload: digits split into shards and a holdout file.
pub struct Workload {
    /// Shard directory.
    pub shards_dir: PathBuf,
    /// Holdout CSV.
    pub holdout: PathBuf,
}

/// Creates `files` empty files in `dir` (created) whose names are `name_bytes` long
/// (at least 9): a dataset whose shard list is large without its shards taking space.
pub fn make_named_files(dir: &Path, files: usize, name_bytes: usize) -> anyhow::Result<()> {
    anyhow::ensure!(name_bytes >= 9, "names need at least 9 bytes");
    std::fs::create_dir_all(dir)?;
    for i in 0..files {
        let name = format!("{i:08}-{}", "s".repeat(name_bytes - 9));
        std::fs::File::create(dir.join(name))?;
    }
    Ok(())
}

/// Splits the bundled digits data with `cumulusctl dataset split` into `shards` shards
/// plus a 20% holdout, under `dir`.
pub fn prepare_digits(dir: &Path, shards: u32) -> anyhow::Result<Workload> {
    let shards_dir = dir.join("shards");
    let holdout = dir.join("holdout.csv");
    let data = workspace_root().join("data/digits/digits.csv.gz");
    let out = Command::new(bin("cumulusctl"))
        .args(["dataset", "split"])
        .arg(&data)
        .arg("--shards")
        .arg(shards.to_string())
        .arg("--out")
        .arg(&shards_dir)
        .arg("--holdout-fraction")
        .arg("0.2")
        .arg("--holdout-out")
        .arg(&holdout)
        .output()?;
    if !out.status.success() {
        bail!(
            "dataset split failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(Workload {
        shards_dir,
        holdout,
    })
}

/// A trainer job spec: world size `world_size` over `w`, checkpoints to `ckpt_dir`,
/// results under `out_dir`.
pub fn trainer_spec(
    w: &Workload,
    world_size: u32,
    ckpt_dir: &Path,
    out_dir: &Path,
    extra: &[&str],
) -> v1::JobSpec {
    let mut command = vec![
        bin("cumulus-trainer").to_string_lossy().to_string(),
        "train".into(),
        "--test-file".into(),
        w.holdout.to_string_lossy().to_string(),
        "--out".into(),
        out_dir.to_string_lossy().to_string(),
    ];
    command.extend(extra.iter().map(|s| s.to_string()));
    v1::JobSpec {
        world_size,
        command,
        dataset: w.shards_dir.to_string_lossy().to_string(),
        ckpt_dir: ckpt_dir.to_string_lossy().to_string(),
        ..Default::default()
    }
}

/// A one-rank job whose rank ignores SIGTERM (and any stop request) and sleeps 10
/// minutes, with the job's stop grace `stop_grace_ms`: only SIGKILL ends it.
pub fn sigterm_ignoring_spec(stop_grace_ms: u64) -> v1::JobSpec {
    v1::JobSpec {
        world_size: 1,
        command: vec![
            "sh".into(),
            "-c".into(),
            "trap '' TERM; exec sleep 600".into(),
        ],
        stop_grace_ms,
        ..Default::default()
    }
}

/// A rank's `result.json` written by the trainer.
pub fn read_result(out_dir: &Path, rank: u32) -> anyhow::Result<serde_json::Value> {
    let p = out_dir.join(format!("rank-{rank}")).join("result.json");
    let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// Asserts (panics otherwise) that every rank of a `world_size`-rank trainer job whose
/// outputs are under `out` consumed each record of its shards exactly once per epoch (its
/// reported digest equals [`expected_digest`]) and, when `min_accuracy` is given, reached
/// at least that holdout accuracy (a fraction in 0..=1).
pub fn assert_trainer_results(
    cluster: &Cluster,
    w: &Workload,
    out: &Path,
    world_size: u32,
    epochs: u32,
    min_accuracy: Option<f64>,
) {
    for rank in 0..world_size {
        let r = read_result(out, rank).expect("result.json");
        let want = expected_digest(w, world_size, rank, epochs, cluster.dir.path())
            .expect("expected digest");
        assert_eq!(
            r["digest"].as_str(),
            Some(want.as_str()),
            "rank {rank}: every record exactly once"
        );
        if let Some(min) = min_accuracy {
            let acc = r["accuracy"].as_f64().expect("accuracy");
            assert!(acc >= min, "rank {rank} accuracy {acc} < {min}");
        }
    }
}

/// The digest the trainer must report for `rank` when it consumed each record of its
/// shards exactly once per epoch, computed by `cumulus-trainer digest` from the shard
/// files read directly.
pub fn expected_digest(
    w: &Workload,
    world_size: u32,
    rank: u32,
    epochs: u32,
    tmp: &Path,
) -> anyhow::Result<String> {
    // The shards as the coordinator lists them: the files whose names do not start with
    // a dot (`.feature-stats.json` is not one).
    let mut shards: Vec<PathBuf> = std::fs::read_dir(&w.shards_dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| !n.to_string_lossy().starts_with('.'))
        })
        .collect();
    shards.sort();
    let mine: Vec<String> = shards
        .iter()
        .enumerate()
        .filter(|(i, _)| *i as u32 % world_size == rank)
        .map(|(_, p)| p.to_string_lossy().to_string())
        .collect();
    let list = tmp.join(format!("expected-rank-{rank}.shards"));
    std::fs::write(&list, mine.join("\n") + "\n")?;
    let out = Command::new(bin("cumulus-trainer"))
        .args(["digest", "--shards-file"])
        .arg(&list)
        .arg("--epochs")
        .arg(epochs.to_string())
        .output()?;
    if !out.status.success() {
        bail!(
            "trainer digest failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8(out.stdout)?;
    let digest = text
        .split_whitespace()
        .last()
        .context("digest output is empty")?
        .to_string();
    Ok(digest)
}
