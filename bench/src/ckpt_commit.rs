//! Scenario `ckpt_commit` (issue 3, measurement 6): the cost of committing a checkpoint
//! step through the local backend, against the cost of writing the same bytes without
//! Cumulus.
//!
//! **Large step.** 4 ranks each write 256 MiB (smoke: 4 MiB) of pseudo-random bytes into
//! their staging directory ([`CheckpointStore::prepare_staging`]), then commit them as
//! their part ([`CheckpointStore::commit_part`]: BLAKE3 of every file overlapped with its
//! fsync, fsync of directories, rename), all 4 in parallel, as 4 ranks with their agents
//! do; then the leader checks every part ([`CheckpointStore::check_part`]: files and sizes,
//! in parallel, one per core, as the coordinator's finalizer does), writes the manifest and
//! `LATEST`. The baseline writes the same bytes to 4 plain files in the same file system and
//! `sync_all`s each, 4 in parallel. Ratio = raw time / Cumulus time (target ≥ 0.9). The two
//! runs alternate which goes first; everything is removed (and `sync`ed) between runs so
//! that neither inherits the other's dirty pages. 9 counted rounds (median of the per-round
//! ratios) follow one uncounted warm-up round of both arms.
//!
//! The phases are timed separately so that a miss is explained by measurement, not by
//! guesswork: how long the ranks take to write into page cache, how long the slowest
//! `commit_part` takes, how long the leader's check takes, and, outside the commit, how
//! long a full verification of the step takes ([`CheckpointStore::verify_step`], what a
//! resume pays: every byte re-read and hashed) and how long the digest alone of the same
//! bytes takes (the raw files, read back from page cache by 4 threads).
//!
//! History (docs/perf-notes.md, "Checkpoint commit"): with SHA-256 hashed by the agent and
//! again by the leader at finalize, the ratio was 0.25–0.42 on this machine; each hash
//! pass cost about as much as the raw write + fsync. Manifest format 2 (BLAKE3) and a
//! leader that checks sizes at finalize, leaving the full verification to the resume, are
//! the two changes that close that gap.
//!
//! **Small commit.** 200 samples (smoke: 20) of a single 4 KiB file committed as a part
//! (`prepare_staging` + write + `commit_part`) against 200 atomic file replaces (write a
//! temp file, fsync it, rename it over the target, fsync the directory), interleaved
//! sample by sample (alternating which goes first): p50 and p99 of each and the p50 ratio.
//! No target: it tells what a checkpoint of a small model costs over the minimum a durable
//! replace needs.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use cumulus_ckpt::{CheckpointStore, LocalStore, MANIFEST_FORMAT_VERSION, Manifest, PartRecord};

use crate::Ctx;
use crate::report::{Row, ms, percentile};

/// Scenario name in every row.
const SCENARIO: &str = "ckpt_commit";
/// Ranks of the large step.
const RANKS: u32 = 4;
/// Bytes of one `write` call (and of each rank's pseudo-random pattern).
const CHUNK_BYTES: usize = 4 << 20;
/// Size of the small commit's single file.
const SMALL_BYTES: usize = 4096;
/// Job id of the large step.
const JOB_LARGE: &str = "bench-ckpt-large";
/// Job id of the small commits.
const JOB_SMALL: &str = "bench-ckpt-small";
/// File name of a rank's data in its part (and of the raw files: `raw-<rank>.bin`).
const PART_FILE: &str = "model.bin";
/// Throughput target: raw time / Cumulus time.
const TARGET_RATIO: f64 = 0.9;

/// Runs the scenario.
pub async fn run(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    let per_rank_bytes: u64 = ctx.pick(256 << 20, 4 << 20);
    // 9 counted rounds (5 until session 13, whose per-round ratios ranged 0.68–1.75 within
    // one run: the host's disk and page cache, not either arm).
    let reps: usize = ctx.pick(9, 1);
    // One uncounted round of both arms first: the first large write of a process ran
    // 2–4× slower than later ones on this machine for whichever arm went first (session 5,
    // three runs), which is the host warming up, not either arm.
    let warmup_reps: usize = ctx.pick(1, 0);
    let small_samples: usize = ctx.pick(200, 20);
    let load_before = load_average()?;
    let dir = ctx.work_dir.join(SCENARIO);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;

    let large = measure_large(&dir, per_rank_bytes, warmup_reps, reps).await?;
    let mut rows = large_rows(&large, per_rank_bytes);
    rows.push(Row::new(
        SCENARIO,
        "host 1-min load average before the runs",
        load_before,
        "load",
        1,
    ));

    let small = small_commits(&dir, small_samples).await?;
    rows.extend(small_rows(&small));
    std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    Ok(rows)
}

/// Runs `warmup_reps` uncounted then `reps` counted rounds of the large step: each
/// round one Cumulus step and one raw write of `per_rank_bytes` per rank in `dir`,
/// alternating which goes first, settling the disk after each; prints every round.
/// Returns the counted rounds' `(Cumulus, raw)` times.
///
/// # Errors
/// Writing, committing, checking or removing the files fails.
async fn measure_large(
    dir: &Path,
    per_rank_bytes: u64,
    warmup_reps: usize,
    reps: usize,
) -> anyhow::Result<Vec<(CumulusTimes, RawTimes)>> {
    let patterns: Vec<Vec<u8>> = (0..RANKS)
        .map(|rank| pattern(CHUNK_BYTES, 0x5eed_0000 + u64::from(rank)))
        .collect();
    let mut large = Vec::with_capacity(reps);
    for rep in 0..warmup_reps + reps {
        let cumulus_first = rep % 2 == 0;
        let mut cumulus = None;
        let mut raw = None;
        for cumulus_turn in [cumulus_first, !cumulus_first] {
            if cumulus_turn {
                cumulus = Some(cumulus_step(dir, per_rank_bytes, &patterns).await?);
            } else {
                raw = Some(raw_write(dir, per_rank_bytes, &patterns).await?);
            }
            settle(dir)?;
        }
        let cumulus = cumulus.expect("the loop runs the Cumulus turn once");
        let raw = raw.expect("the loop runs the raw turn once");
        let counted = rep >= warmup_reps;
        eprintln!(
            "   rep {}{}: cumulus {:.0} ms (write {:.0}, parts {:.0}, check {:.0}, manifest+latest {:.1}), raw {:.0} ms; full verify {:.0} ms, digest alone {:.0} ms",
            rep + 1,
            if counted {
                ""
            } else {
                " (warm-up, not counted)"
            },
            ms(cumulus.total),
            ms(cumulus.write),
            ms(cumulus.parts),
            ms(cumulus.check),
            ms(cumulus.manifest_latest),
            ms(raw.write_fsync),
            ms(cumulus.full_verify),
            ms(raw.hash)
        );
        if counted {
            large.push((cumulus, raw));
        }
    }
    Ok(large)
}

/// The large step's rows from the counted rounds (`per_rank_bytes` per rank): the
/// raw/Cumulus ratio (the target; median of per-round ratios), both throughputs, the
/// Cumulus step's total and phases, the raw total, the digest alone and the full
/// verification.
fn large_rows(large: &[(CumulusTimes, RawTimes)], per_rank_bytes: u64) -> Vec<Row> {
    let total_bytes = per_rank_bytes * u64::from(RANKS);
    let n = large.len();
    let median_of = |f: &dyn Fn(&(CumulusTimes, RawTimes)) -> f64| -> f64 {
        percentile(&large.iter().map(f).collect::<Vec<_>>(), 50.0)
    };
    let mb_per_s = |d: Duration| total_bytes as f64 / 1e6 / d.as_secs_f64();
    let ratio = median_of(&|(c, r)| r.write_fsync.as_secs_f64() / c.total.as_secs_f64());
    let gib = total_bytes as f64 / f64::from(1u32 << 30);
    let size = format!("{gib:.3} GiB over {RANKS} ranks");
    vec![
        Row::at_least(
            SCENARIO,
            &format!("raw/cumulus throughput, {size} (median of per-run ratios)"),
            ratio,
            "ratio",
            n,
            TARGET_RATIO,
        ),
        Row::new(
            SCENARIO,
            "cumulus step commit throughput",
            median_of(&|(c, _)| mb_per_s(c.total)),
            "MB/s",
            n,
        ),
        Row::new(
            SCENARIO,
            "raw write+fsync throughput",
            median_of(&|(_, r)| mb_per_s(r.write_fsync)),
            "MB/s",
            n,
        ),
        Row::new(
            SCENARIO,
            "cumulus step total",
            median_of(&|(c, _)| ms(c.total)),
            "ms",
            n,
        ),
        Row::new(
            SCENARIO,
            "  ranks write into staging (page cache)",
            median_of(&|(c, _)| ms(c.write)),
            "ms",
            n,
        ),
        Row::new(
            SCENARIO,
            "  commit_part, slowest rank (blake3 + fsync + rename)",
            median_of(&|(c, _)| ms(c.parts)),
            "ms",
            n,
        ),
        Row::new(
            SCENARIO,
            "  leader check_part x4 (files + sizes)",
            median_of(&|(c, _)| ms(c.check)),
            "ms",
            n,
        ),
        Row::new(
            SCENARIO,
            "  leader manifest + LATEST",
            median_of(&|(c, _)| ms(c.manifest_latest)),
            "ms",
            n,
        ),
        Row::new(
            SCENARIO,
            "raw write+fsync total",
            median_of(&|(_, r)| ms(r.write_fsync)),
            "ms",
            n,
        ),
        Row::new(
            SCENARIO,
            "blake3 alone of the same bytes, 4 threads, page cache",
            median_of(&|(_, r)| ms(r.hash)),
            "ms",
            n,
        ),
        Row::new(
            SCENARIO,
            "full verify_step after the commit (what a resume reads; not in the total)",
            median_of(&|(c, _)| ms(c.full_verify)),
            "ms",
            n,
        ),
    ]
}

/// The small commits' rows: p50 and p99 of a 4 KiB part commit and of an atomic file
/// replace, and the ratio of their p50s.
fn small_rows(small: &SmallTimes) -> Vec<Row> {
    let n = small.cumulus_ms.len();
    let c50 = percentile(&small.cumulus_ms, 50.0);
    let r50 = percentile(&small.replace_ms, 50.0);
    vec![
        Row::new(SCENARIO, "4 KiB part commit p50", c50, "ms", n),
        Row::new(
            SCENARIO,
            "4 KiB part commit p99",
            percentile(&small.cumulus_ms, 99.0),
            "ms",
            n,
        ),
        Row::new(
            SCENARIO,
            "4 KiB atomic file replace p50",
            r50,
            "ms",
            small.replace_ms.len(),
        ),
        Row::new(
            SCENARIO,
            "4 KiB atomic file replace p99",
            percentile(&small.replace_ms, 99.0),
            "ms",
            small.replace_ms.len(),
        ),
        Row::new(
            SCENARIO,
            "4 KiB part commit / atomic replace, p50",
            c50 / r50,
            "ratio",
            n,
        ),
    ]
}

/// The host's 1-minute load average (`/proc/loadavg`): how busy the CPUs were, which
/// matters because hashing is CPU-bound.
fn load_average() -> anyhow::Result<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").context("reading /proc/loadavg")?;
    text.split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("/proc/loadavg holds {text:?}"))
}

/// Phases of one large Cumulus step commit.
struct CumulusTimes {
    /// Start until every rank has written its bytes into its staging dir (no fsync).
    write: Duration,
    /// The longest `commit_part` of any rank.
    parts: Duration,
    /// The leader's `check_part` of every part (in parallel, one per core).
    check: Duration,
    /// The leader's `write_manifest` + `write_latest`.
    manifest_latest: Duration,
    /// Start until `LATEST` names the step.
    total: Duration,
    /// `verify_step` of the committed step afterwards (not part of `total`): every byte
    /// re-read and hashed, as a resume does.
    full_verify: Duration,
}

/// One raw baseline run.
struct RawTimes {
    /// Start until every file is written and `sync_all`ed.
    write_fsync: Duration,
    /// The digest of the same files read back by 4 threads in parallel (not part of the
    /// baseline: tells what the hashing in `commit_part` costs on its own).
    hash: Duration,
}

/// A non-constant pattern of `len` bytes from a splitmix64 sequence seeded with `seed`.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Writes `size_bytes` to a new file at `path` from `chunk`, stamping each chunk's first 8
/// bytes with its index so that no two chunks are equal; `sync_all` at the end when `fsync`.
fn write_data(path: &Path, size_bytes: u64, chunk: &mut [u8], fsync: bool) -> anyhow::Result<()> {
    let mut file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut left = size_bytes;
    let mut index = 0u64;
    while left > 0 {
        let len = usize::try_from(left.min(chunk.len() as u64)).expect("at most a chunk's length");
        chunk[..8].copy_from_slice(&index.to_le_bytes());
        file.write_all(&chunk[..len])
            .with_context(|| format!("writing {}", path.display()))?;
        left -= len as u64;
        index += 1;
    }
    if fsync {
        file.sync_all()
            .with_context(|| format!("fsync {}", path.display()))?;
    }
    Ok(())
}

/// One 4-rank step committed through `LocalStore` the way ranks, agents and the leader do
/// it; the store is removed afterwards.
async fn cumulus_step(
    dir: &Path,
    per_rank_bytes: u64,
    patterns: &[Vec<u8>],
) -> anyhow::Result<CumulusTimes> {
    let root = dir.join("ckpt");
    let store = Arc::new(LocalStore::new(&root));
    let step = 100;
    let chunks: Vec<Vec<u8>> = patterns.to_vec();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (rank, mut chunk) in (0..RANKS).zip(chunks) {
        let store = Arc::clone(&store);
        tasks.push(tokio::spawn(async move {
            let staging = store.prepare_staging(JOB_LARGE, rank, 0).await?;
            let file = staging.join(PART_FILE);
            tokio::task::spawn_blocking(move || {
                write_data(&file, per_rank_bytes, &mut chunk, false)
            })
            .await
            .context("writer thread")??;
            let written = Instant::now();
            let part = store
                .commit_part(
                    JOB_LARGE,
                    step,
                    rank,
                    0,
                    &staging,
                    serde_json::json!({ "rank": rank }),
                )
                .await
                .with_context(|| format!("commit_part of rank {rank}"))?;
            anyhow::Ok((part, written, written.elapsed()))
        }));
    }
    let mut parts: Vec<PartRecord> = Vec::new();
    let mut all_written = start;
    let mut slowest_part = Duration::ZERO;
    for task in tasks {
        let (part, written, commit) = task.await.context("rank task")??;
        parts.push(part);
        all_written = all_written.max(written);
        slowest_part = slowest_part.max(commit);
    }
    parts.sort_by_key(|p| p.rank);

    // As the leader's finalize does: parts checked in parallel, at most one per core.
    let check_start = Instant::now();
    {
        use futures::StreamExt;
        let parallel = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 16));
        let store = &store;
        let checks: Vec<_> = parts
            .iter()
            .map(|part| async move {
                store
                    .check_part(JOB_LARGE, part)
                    .await
                    .with_context(|| format!("checking part {}", part.dir))
            })
            .collect();
        let mut verified = futures::stream::iter(checks).buffer_unordered(parallel);
        while let Some(result) = verified.next().await {
            result?;
        }
    }
    let check = check_start.elapsed();
    let manifest_start = Instant::now();
    let manifest = Manifest {
        format_version: MANIFEST_FORMAT_VERSION,
        job_id: JOB_LARGE.into(),
        step,
        world_size: RANKS,
        committed_at_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
        parts,
    };
    store
        .write_manifest(&manifest)
        .await
        .context("write_manifest")?;
    store
        .write_latest(JOB_LARGE, step)
        .await
        .context("write_latest")?;
    let manifest_latest = manifest_start.elapsed();
    let total = start.elapsed();

    // Sanity: the step reads back complete (not timed).
    let latest = store.read_latest(JOB_LARGE).await?;
    anyhow::ensure!(
        latest == Some(step),
        "LATEST names {latest:?}, not step {step}"
    );
    let verify_start = Instant::now();
    let bytes = store.verify_step(JOB_LARGE, step).await?.total_bytes();
    let full_verify = verify_start.elapsed();
    anyhow::ensure!(
        bytes == per_rank_bytes * u64::from(RANKS),
        "manifest records {bytes} bytes"
    );
    std::fs::remove_dir_all(&root).with_context(|| format!("removing {}", root.display()))?;
    Ok(CumulusTimes {
        write: all_written - start,
        parts: slowest_part,
        check,
        manifest_latest,
        total,
        full_verify,
    })
}

/// The same bytes written to 4 plain files and `sync_all`ed, 4 in parallel; then (untimed
/// for the baseline) hashed by 4 threads. The files are removed afterwards.
async fn raw_write(
    dir: &Path,
    per_rank_bytes: u64,
    patterns: &[Vec<u8>],
) -> anyhow::Result<RawTimes> {
    let raw_dir = dir.join("raw");
    std::fs::create_dir_all(&raw_dir).with_context(|| format!("creating {}", raw_dir.display()))?;
    let paths: Vec<PathBuf> = (0..RANKS)
        .map(|r| raw_dir.join(format!("raw-{r}.bin")))
        .collect();
    let chunks: Vec<Vec<u8>> = patterns.to_vec();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (path, mut chunk) in paths.iter().cloned().zip(chunks) {
        tasks.push(tokio::task::spawn_blocking(move || {
            write_data(&path, per_rank_bytes, &mut chunk, true)
        }));
    }
    for task in tasks {
        task.await.context("writer thread")??;
    }
    let write_fsync = start.elapsed();

    let hash_start = Instant::now();
    let mut tasks = Vec::new();
    for path in paths {
        tasks.push(tokio::task::spawn_blocking(move || {
            cumulus_ckpt::hash_file(&path)
        }));
    }
    for task in tasks {
        let (size, _) = task.await.context("hash thread")??;
        anyhow::ensure!(
            size == per_rank_bytes,
            "hashed {size} bytes of a {per_rank_bytes}-byte file"
        );
    }
    let hash = hash_start.elapsed();
    std::fs::remove_dir_all(&raw_dir).with_context(|| format!("removing {}", raw_dir.display()))?;
    Ok(RawTimes { write_fsync, hash })
}

/// Flushes the file system (`sync`) so that the deletions and dirty pages of one run do
/// not land in the next run's measurement.
fn settle(dir: &Path) -> anyhow::Result<()> {
    let status = std::process::Command::new("sync")
        .status()
        .context("running sync")?;
    anyhow::ensure!(status.success(), "sync failed: {status}");
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("fsync {}", dir.display()))
}

/// Latencies of the small commits, in milliseconds.
struct SmallTimes {
    /// `prepare_staging` + write 4 KiB + `commit_part`.
    cumulus_ms: Vec<f64>,
    /// Write temp + fsync + rename + fsync dir.
    replace_ms: Vec<f64>,
}

/// `samples` small part commits and `samples` atomic replaces, interleaved.
async fn small_commits(dir: &Path, samples: usize) -> anyhow::Result<SmallTimes> {
    let store = LocalStore::new(dir.join("small-ckpt"));
    let replace_dir = dir.join("small-replace");
    std::fs::create_dir_all(&replace_dir)
        .with_context(|| format!("creating {}", replace_dir.display()))?;
    let mut times = SmallTimes {
        cumulus_ms: Vec::with_capacity(samples),
        replace_ms: Vec::with_capacity(samples),
    };
    for i in 0..samples {
        let content = pattern(SMALL_BYTES, 0xabc0_0000 + i as u64);
        let cumulus_first = i % 2 == 0;
        for cumulus_turn in [cumulus_first, !cumulus_first] {
            if cumulus_turn {
                let start = Instant::now();
                let staging = store.prepare_staging(JOB_SMALL, 0, 0).await?;
                let file = staging.join(PART_FILE);
                std::fs::write(&file, &content)
                    .with_context(|| format!("writing {}", file.display()))?;
                store
                    .commit_part(
                        JOB_SMALL,
                        i as u64 + 1,
                        0,
                        0,
                        &staging,
                        serde_json::json!({ "sample": i }),
                    )
                    .await
                    .with_context(|| format!("small commit {i}"))?;
                times.cumulus_ms.push(ms(start.elapsed()));
            } else {
                let start = Instant::now();
                atomic_replace(&replace_dir, &content)?;
                times.replace_ms.push(ms(start.elapsed()));
            }
        }
    }
    Ok(times)
}

/// Durably replaces `<dir>/state.bin` with `content`: temp file, fsync, rename, fsync dir.
fn atomic_replace(dir: &Path, content: &[u8]) -> anyhow::Result<()> {
    let tmp = dir.join("state.bin.tmp");
    let target = dir.join("state.bin");
    let mut file =
        std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    file.write_all(content)
        .with_context(|| format!("writing {}", tmp.display()))?;
    file.sync_all()
        .with_context(|| format!("fsync {}", tmp.display()))?;
    drop(file);
    std::fs::rename(&tmp, &target).with_context(|| format!("renaming to {}", target.display()))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("fsync {}", dir.display()))
}
