//! `python`: the Python package's benchmarks (issue 23), run by `python/bench/bench.py` in
//! the project's virtualenv (`python/.venv`, made by `scripts/setup.sh`): DDP steps/s
//! under Cumulus vs `torchrun`, rank `kill -9` → first step after resume vs `torchrun
//! --max-restarts`, the cost of `cumulus.runtime.report()` on the caller's thread, and the
//! time a 1 GiB PyTorch checkpoint blocks the training loop vs `torch.save` + `fsync`.
//! The script prints its own table; its JSON rows become rows of this run. In smoke mode
//! sizes shrink and no target is judged.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use serde::Deserialize;

use crate::Ctx;
use crate::report::Row;

/// The project's virtualenv interpreter.
const VENV_PYTHON: &str = "python/.venv/bin/python";
/// The benchmark script.
const SCRIPT: &str = "python/bench/bench.py";

/// One row of the script's JSON.
#[derive(Deserialize)]
struct PyRow {
    /// What was measured.
    what: String,
    /// The value, in `unit` (absent when the measurement failed).
    value: Option<f64>,
    /// Its unit.
    unit: String,
    /// The target as text, when there is one.
    target: Option<String>,
    /// Whether it was met (absent in smoke mode or without a target).
    met: Option<bool>,
    /// Why the measurement failed, when it did.
    error: Option<String>,
}

/// The workspace root (this crate's parent directory).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the bench crate lives in the workspace")
        .to_path_buf()
}

pub async fn run(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    let root = root();
    let python = root.join(VENV_PYTHON);
    if !python.exists() {
        bail!(
            "{} is missing: run ./scripts/setup.sh (it makes the virtualenv with PyTorch)",
            python.display()
        );
    }
    let out = ctx.work_dir.join("python");
    std::fs::create_dir_all(&out).context("python bench output dir")?;
    let mut command = Command::new(&python);
    command
        .arg(root.join(SCRIPT))
        .arg("--out")
        .arg(&out)
        .current_dir(&root);
    if ctx.smoke {
        command.arg("--smoke");
    }
    let status = tokio::task::spawn_blocking(move || command.status())
        .await
        .context("waiting for the python bench")?
        .context("starting the python bench")?;
    let json = std::fs::read_dir(&out)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "json"))
        .context("the python bench wrote no JSON")?;
    let rows: Vec<PyRow> = serde_json::from_slice(&std::fs::read(&json)?)
        .with_context(|| format!("parsing {}", json.display()))?;
    let errors: Vec<String> = rows
        .iter()
        .filter_map(|r| r.error.as_ref().map(|e| format!("{}: {e}", r.what)))
        .collect();
    // torchrun itself sometimes fails every restart on a loaded 2-core machine (gloo's
    // "connectFullMesh … Connection refused"): in smoke mode, which only checks that the
    // scenario runs, that is reported, not fatal; a full run fails on it.
    let fatal: Vec<&String> = errors
        .iter()
        .filter(|e| !(ctx.smoke && e.contains("torchrun")))
        .collect();
    for e in errors.iter().filter(|e| !fatal.contains(e)) {
        eprintln!("   (smoke) torchrun comparison not measured: {e}");
    }
    if !fatal.is_empty() || (!status.success() && errors.is_empty()) {
        bail!("python bench failed ({status}): {}", errors.join("; "));
    }
    Ok(rows
        .into_iter()
        .filter_map(|r| {
            Some(Row {
                scenario: "python".into(),
                metric: r.what,
                value: r.value?,
                unit: r.unit,
                target: r.target,
                met: r.met,
                samples: 1,
            })
        })
        .collect())
}
