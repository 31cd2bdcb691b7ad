//! Scenario `ckpt_s3` (issue 5): the cost of committing a checkpoint step to S3 through
//! the two-tier store, against a plain multipart PUT of the same bytes with the same client.
//!
//! A real S3 server (`s3s-fs`, started on loopback, storing on the same disk) holds the
//! bucket. 4 ranks each have 256 MiB (smoke: 6 MiB) of pseudo-random bytes in their staging
//! directory (written before the clock starts). **Cumulus**: the 4 ranks commit their part
//! in parallel ([`CheckpointStore::commit_part`] of a [`TieredStore`] committing at L2:
//! BLAKE3 overlapped with fsync, rename into L1, then a multipart upload whose parts are
//! verified by the server against their signed SigV4 payload hash, then a `HEAD` of size
//! and digest metadata), then the leader checks every part by `HEAD`
//! ([`CheckpointStore::check_part`], as the coordinator's finalize does),
//! writes the manifest and moves `LATEST` with a conditional PUT. **Raw**: the same 4 files
//! uploaded in parallel by plain multipart PUTs (same part size, same bound on requests in
//! flight, same client settings), nothing else. Ratio = raw time / Cumulus time (target
//! ≥ 0.9). The two runs alternate which goes first; objects are deleted between runs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use cumulus_ckpt::{
    CheckpointStore, CommitTier, LocalStore, MANIFEST_FORMAT_VERSION, Manifest, PartRecord,
    S3Location, S3Settings, S3Store, TieredStore,
};
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::sync::Semaphore;

use crate::Ctx;
use crate::report::{Row, ms};

/// Scenario name in every row.
const SCENARIO: &str = "ckpt_s3";
/// Ranks of the step.
const RANKS: u32 = 4;
/// Job id of the step.
const JOB: &str = "bench-ckpt-s3";
/// The bucket.
const BUCKET: &str = "cumulus-bench";
/// File name of a rank's data in its part.
const PART_FILE: &str = "model.bin";
/// Throughput target: raw time / Cumulus time.
const TARGET_RATIO: f64 = 0.9;

/// Runs the scenario.
pub async fn run(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    let per_rank_bytes: u64 = ctx.pick(256 << 20, 6 << 20);
    let part_size_bytes: u64 = ctx.pick(16 << 20, 5 << 20);
    let reps: usize = ctx.pick(3, 1);
    let dir = ctx.work_dir.join(SCENARIO);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let server = cumulus_e2e::S3Server::start()
        .await
        .context("starting s3s-fs")?;
    server
        .create_bucket(BUCKET)
        .await
        .context("creating the bucket")?;
    let settings = S3Settings {
        multipart_threshold_bytes: part_size_bytes,
        part_size_bytes,
        ..server.access.settings()
    };
    let client = settings.client().await?;

    // The ranks' files, written once (not timed): staging copies are made per run.
    let sources: Vec<PathBuf> = (0..RANKS)
        .map(|r| dir.join(format!("source-{r}.bin")))
        .collect();
    for (rank, path) in sources.iter().enumerate() {
        write_pattern(path, per_rank_bytes, rank as u64)?;
    }

    let mut cumulus = Vec::new();
    let mut raw = Vec::new();
    for rep in 0..reps {
        let order = if rep % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for cumulus_first in order {
            if cumulus_first {
                cumulus.push(
                    cumulus_step(&dir, rep, &client, &settings, &sources, per_rank_bytes).await?,
                );
            } else {
                raw.push(raw_put(&client, &settings, &sources, per_rank_bytes, rep).await?);
            }
            clear_bucket(&client).await?;
        }
    }
    let best = |v: &[Duration]| v.iter().copied().min().unwrap_or_default();
    let cumulus_total = best(&cumulus.iter().map(|t| t.total).collect::<Vec<_>>());
    let raw_total = best(&raw);
    let ratio = raw_total.as_secs_f64() / cumulus_total.as_secs_f64().max(1e-9);
    let mib = (per_rank_bytes * u64::from(RANKS)) as f64 / f64::from(1 << 20);
    let mut rows = vec![
        Row::new(SCENARIO, "step size", mib, "MiB", 1),
        Row::new(
            SCENARIO,
            "raw multipart PUT, best",
            ms(raw_total),
            "ms",
            raw.len(),
        ),
        Row::new(
            SCENARIO,
            "Cumulus L2 step, best",
            ms(cumulus_total),
            "ms",
            cumulus.len(),
        ),
        Row::new(
            SCENARIO,
            "Cumulus slowest commit_part (L1 + upload + verify), best",
            ms(best(&cumulus.iter().map(|t| t.parts).collect::<Vec<_>>())),
            "ms",
            cumulus.len(),
        ),
        Row::new(
            SCENARIO,
            "Cumulus leader verify + manifest + LATEST, best",
            ms(best(&cumulus.iter().map(|t| t.finish).collect::<Vec<_>>())),
            "ms",
            cumulus.len(),
        ),
        Row::new(
            SCENARIO,
            "raw multipart PUT throughput",
            mib / raw_total.as_secs_f64().max(1e-9),
            "MiB/s",
            raw.len(),
        ),
        Row::new(
            SCENARIO,
            "Cumulus L2 step throughput",
            mib / cumulus_total.as_secs_f64().max(1e-9),
            "MiB/s",
            cumulus.len(),
        ),
    ];
    rows.push(Row::at_least(
        SCENARIO,
        "throughput ratio raw/Cumulus (1 GiB step, 4 ranks, S3)",
        ratio,
        "ratio",
        reps,
        TARGET_RATIO,
    ));
    drop(server);
    std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    Ok(rows)
}

/// Phases of one Cumulus step.
struct CumulusTimes {
    parts: Duration,
    finish: Duration,
    total: Duration,
}

/// `size_bytes` of a pseudo-random pattern (seeded) into a new file at `path`.
fn write_pattern(path: &Path, size_bytes: u64, seed: u64) -> anyhow::Result<()> {
    use std::io::Write;
    let mut file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut chunk = vec![0u8; 1 << 20];
    let mut left = size_bytes;
    while left > 0 {
        for word in chunk.chunks_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes()[..word.len()]);
        }
        let len = left.min(chunk.len() as u64) as usize;
        file.write_all(&chunk[..len])?;
        left -= len as u64;
    }
    file.sync_all()?;
    Ok(())
}

async fn cumulus_step(
    dir: &Path,
    rep: usize,
    client: &aws_sdk_s3::Client,
    settings: &S3Settings,
    sources: &[PathBuf],
    per_rank_bytes: u64,
) -> anyhow::Result<CumulusTimes> {
    let l1 = dir.join(format!("l1-{rep}"));
    let l2 = S3Store::new(
        client.clone(),
        settings.clone(),
        S3Location::parse(&format!("s3://{BUCKET}/cumulus"))?,
    );
    let store = Arc::new(TieredStore::new(
        LocalStore::new(&l1),
        l2,
        CommitTier::L2,
        2,
    ));
    let step = 100 + rep as u64;
    let mut stagings = Vec::new();
    for (rank, source) in (0..RANKS).zip(sources) {
        let staging = store.prepare_staging(JOB, rank, 0).await?;
        std::fs::copy(source, staging.join(PART_FILE)).context("staging copy")?;
        stagings.push(staging);
    }
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (rank, staging) in (0..RANKS).zip(stagings) {
        let store = Arc::clone(&store);
        tasks.push(tokio::spawn(async move {
            let began = Instant::now();
            let part = store
                .commit_part(
                    JOB,
                    step,
                    rank,
                    0,
                    &staging,
                    serde_json::json!({ "rank": rank }),
                )
                .await
                .with_context(|| format!("commit_part of rank {rank}"))?;
            anyhow::Ok((part, began.elapsed()))
        }));
    }
    let mut parts: Vec<PartRecord> = Vec::new();
    let mut slowest = Duration::ZERO;
    for task in tasks {
        let (part, took) = task.await.context("rank task")??;
        parts.push(part);
        slowest = slowest.max(took);
    }
    parts.sort_by_key(|p| p.rank);
    let finish_start = Instant::now();
    for part in &parts {
        store.check_part(JOB, part).await?;
    }
    let manifest = Manifest {
        format_version: MANIFEST_FORMAT_VERSION,
        job_id: JOB.into(),
        step,
        world_size: RANKS,
        committed_at_ms: 0,
        parts,
    };
    store.write_manifest(&manifest).await?;
    store.write_latest(JOB, step).await?;
    let finish = finish_start.elapsed();
    let total = start.elapsed();
    let bytes = store.verify_step(JOB, step).await?.total_bytes();
    anyhow::ensure!(
        bytes == per_rank_bytes * u64::from(RANKS),
        "manifest records {bytes} bytes"
    );
    std::fs::remove_dir_all(&l1).ok();
    Ok(CumulusTimes {
        parts: slowest,
        finish,
        total,
    })
}

/// The same files as plain multipart uploads, 4 in parallel, parts bounded by the same
/// number of requests in flight.
async fn raw_put(
    client: &aws_sdk_s3::Client,
    settings: &S3Settings,
    sources: &[PathBuf],
    per_rank_bytes: u64,
    rep: usize,
) -> anyhow::Result<Duration> {
    let requests = Arc::new(Semaphore::new(settings.max_concurrent_requests));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (rank, source) in sources.iter().enumerate() {
        let client = client.clone();
        let requests = Arc::clone(&requests);
        let source = source.clone();
        let part_size = settings.part_size_bytes;
        let key = format!("raw/{rep}/rank-{rank}.bin");
        tasks.push(tokio::spawn(async move {
            multipart(&client, &requests, &key, &source, per_rank_bytes, part_size).await
        }));
    }
    for task in tasks {
        task.await.context("upload task")??;
    }
    Ok(start.elapsed())
}

async fn multipart(
    client: &aws_sdk_s3::Client,
    requests: &Arc<Semaphore>,
    key: &str,
    source: &Path,
    size: u64,
    part_size: u64,
) -> anyhow::Result<()> {
    let created = client
        .create_multipart_upload()
        .bucket(BUCKET)
        .key(key)
        .send()
        .await?;
    let upload_id = created.upload_id().context("no upload id")?.to_owned();
    let count = size.div_ceil(part_size);
    let mut parts = Vec::new();
    for index in 0..count {
        let upload_id = upload_id.clone();
        let requests = Arc::clone(requests);
        let client = client.clone();
        let source = source.to_owned();
        let key = key.to_owned();
        parts.push(tokio::spawn(async move {
            let _permit = requests.acquire_owned().await?;
            let offset = index * part_size;
            let len = part_size.min(size - offset) as usize;
            let mut file = tokio::fs::File::open(&source).await?;
            file.seek(std::io::SeekFrom::Start(offset)).await?;
            let mut buffer = vec![0u8; len];
            file.read_exact(&mut buffer).await?;
            let number = i32::try_from(index + 1)?;
            let out = client
                .upload_part()
                .bucket(BUCKET)
                .key(&key)
                .upload_id(&upload_id)
                .part_number(number)
                .body(ByteStream::from(buffer))
                .send()
                .await?;
            anyhow::Ok(
                CompletedPart::builder()
                    .part_number(number)
                    .set_e_tag(out.e_tag().map(str::to_owned))
                    .build(),
            )
        }));
    }
    let mut completed = Vec::new();
    for part in parts {
        completed.push(part.await.context("part task")??);
    }
    client
        .complete_multipart_upload()
        .bucket(BUCKET)
        .key(key)
        .upload_id(&upload_id)
        .multipart_upload(
            CompletedMultipartUpload::builder()
                .set_parts(Some(completed))
                .build(),
        )
        .send()
        .await?;
    Ok(())
}

/// Deletes every object of the bucket (between runs).
async fn clear_bucket(client: &aws_sdk_s3::Client) -> anyhow::Result<()> {
    let listed = client.list_objects_v2().bucket(BUCKET).send().await?;
    for object in listed.contents() {
        if let Some(key) = object.key() {
            client
                .delete_object()
                .bucket(BUCKET)
                .key(key)
                .send()
                .await?;
        }
    }
    anyhow::ensure!(
        listed.is_truncated() != Some(true),
        "more objects than one listing page"
    );
    Ok(())
}
