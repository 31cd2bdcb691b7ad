//! Everything an attempt needs before its process starts: its shards (S3 ones fetched into
//! the dataset cache), its checkpoint store and staging directory, the resume step
//! verified, its working and output directories ([`super::workdir`]), and the rank
//! contract's environment.

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cumulus_api::{AttemptKey, DesiredRank, rank_env};
use cumulus_ckpt::{CheckpointStore, CommitTier, LocalStore, TieredStore};
use tokio::io::AsyncWriteExt;

use crate::logs::{ExitRecord, LogWriter};
use crate::spawn::SpawnRequest;

use super::*;

/// Why an attempt could not be prepared. Its text becomes the attempt's spawn error (in
/// its log and in the exit the leader records).
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The desired attempt itself cannot be run (an empty command, a NUL byte, a bad env
    /// name, a shard path with a newline, a resume without a checkpoint target).
    #[error("{0}")]
    Invalid(String),
    /// This worker lacks a setting the job needs (S3 access for `s3://` shards or an S3
    /// checkpoint target).
    #[error("{0}")]
    MissingSetting(String),
    /// A dataset shard in S3 could not be fetched and verified.
    #[error("cannot fetch dataset shard {url}: {source}")]
    Shard {
        /// The shard's `s3://` URL.
        url: String,
        /// What failed.
        source: CkptError,
    },
    /// A checkpoint operation failed: opening the S3 target, preparing the staging dir.
    #[error("{what}: {source}")]
    Checkpoint {
        /// What was being done.
        what: &'static str,
        /// What failed.
        source: CkptError,
    },
    /// The rank's part of the resume step does not verify.
    #[error("checkpoint part {dir:?} of step {step} failed verification: {why}")]
    Resume {
        /// The part directory the leader named.
        dir: String,
        /// The resume step.
        step: u64,
        /// What is wrong.
        why: String,
    },
    /// A shard or the checkpoint dir is not a normalized path under this agent's allowed
    /// roots (`--allowed-dataset-roots`, `--allowed-ckpt-roots`).
    #[error("refused by this agent: {0}")]
    Path(#[from] cumulus_api::paths::PathError),
    /// A file of the attempt could not be written on this worker.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// The attempt ended (stopped by the agent) while it was being prepared.
    #[error("attempt {0} ended while its shards were fetched")]
    Ended(AttemptKey),
}

impl Supervisor {
    /// Writes the shards file, prepares checkpoint staging, verifies the resume part and
    /// builds the command with the rank environment.
    pub(super) async fn prepare(
        &self,
        key: &AttemptKey,
        d: &DesiredRank,
        token: &str,
    ) -> Result<SpawnRequest, PrepareError> {
        let settings = &self.inner.settings;
        let (program, args) = d
            .command
            .split_first()
            .ok_or_else(|| PrepareError::Invalid("the desired rank has an empty command".into()))?;
        if d.command.iter().any(|a| a.contains('\0')) {
            return Err(PrepareError::Invalid(
                "a command argument contains a NUL byte".into(),
            ));
        }
        let creds = settings.identity.run_as.creds(
            &key.job_id,
            (!d.resume_job_id.is_empty()).then_some(d.resume_job_id.as_str()),
        );
        let mut env = settings.identity.base_env(std::env::vars_os());
        let mut job_env: Vec<(&String, &String)> = d.env.iter().collect();
        job_env.sort();
        for (name, value) in job_env {
            if name.is_empty() || name.contains(['=', '\0']) || value.contains('\0') {
                return Err(PrepareError::Invalid(format!(
                    "invalid environment variable {name:?}"
                )));
            }
            let agent_sets = rank_env::CONTRACT_VARS.contains(&name.as_str())
                || (settings.has_gpus && rank_env::GPU_VARS.contains(&name.as_str()));
            if !agent_sets {
                env.push((name.into(), value.into()));
            }
        }

        self.check_paths(d, creds.as_ref()).await?;
        let (shards_path, plan_path) = self.write_rank_files(key, d, creds.as_ref()).await?;

        let master_addr = if d.master_addr.is_empty() {
            settings.advertise_host.as_str()
        } else {
            d.master_addr.as_str()
        };
        let mut contract: Vec<(&str, OsString)> = vec![
            (rank_env::RANK, d.rank.to_string().into()),
            (rank_env::WORLD_SIZE, d.world_size.to_string().into()),
            (rank_env::LOCAL_RANK, d.local_rank.to_string().into()),
            (
                rank_env::LOCAL_WORLD_SIZE,
                d.local_world_size.to_string().into(),
            ),
            (rank_env::MASTER_ADDR, master_addr.into()),
            (rank_env::MASTER_PORT, d.master_port.to_string().into()),
            (rank_env::JOB_ID, d.job_id.clone().into()),
            (rank_env::ATTEMPT, d.attempt.to_string().into()),
            (rank_env::SHARDS_FILE, shards_path.into_os_string()),
            (rank_env::AGENT_URL, settings.rank_api_url.clone().into()),
            (rank_env::AGENT_TOKEN, token.into()),
        ];
        if let Some(socket) = &settings.rank_api_socket {
            contract.push((rank_env::AGENT_SOCKET, socket.clone().into_os_string()));
        }
        if let Some(path) = plan_path {
            contract.push((rank_env::DATA_PLAN, path.into_os_string()));
        }
        if d.gpus.iter().any(|g| !cumulus_api::gpus::is_valid_uuid(g)) {
            return Err(PrepareError::Invalid("a GPU UUID is invalid".into()));
        }
        if settings.has_gpus || !d.gpus.is_empty() {
            contract.push((
                rank_env::CUDA_VISIBLE_DEVICES,
                cumulus_api::gpus::cuda_visible_devices(&d.gpus).into(),
            ));
        }
        if d.gpu_memory_permille > 0 && !d.gpus.is_empty() {
            contract.push((
                rank_env::GPU_MEMORY_FRACTION,
                cumulus_api::gpus::permille_to_fraction(
                    d.gpu_memory_permille
                        .min(cumulus_api::gpus::WHOLE_GPU_PERMILLE),
                )
                .into(),
            ));
        }

        if !d.ckpt_dir.is_empty() || !d.ckpt_url.is_empty() {
            let store = self.job_store(d, creds.as_ref()).await?;
            let staging = store
                .prepare_staging(&key.job_id, key.rank, key.attempt)
                .await
                .map_err(|source| PrepareError::Checkpoint {
                    what: "cannot prepare checkpoint staging",
                    source,
                })?;
            contract.push((rank_env::CKPT_STAGING, staging.clone().into_os_string()));
            if let Some(step) = d.resume_step {
                let from_job = if d.resume_job_id.is_empty() {
                    key.job_id.as_str()
                } else {
                    d.resume_job_id.as_str()
                };
                // After an elastic resize a rank may resume from another rank's part.
                let part_rank = d.resume_rank.unwrap_or(key.rank);
                let dir = verify_resume(&*store, from_job, part_rank, step, &d.resume_dir).await?;
                contract.push((rank_env::RESUME_STEP, step.to_string().into()));
                contract.push((rank_env::RESUME_DIR, dir.into_os_string()));
            }
            if let Some(entry) = self.table().entries.get_mut(key) {
                entry.ckpt = Some(CkptTarget { store, staging });
            }
        } else if d.resume_step.is_some() {
            return Err(PrepareError::Invalid(
                "resume_step is set but the job has no checkpoint target".into(),
            ));
        }
        // The job's own workdir (unpacked afresh), then the attempt's output dir.
        let workdir = self.prepare_workdir(key, d, creds.as_ref()).await?;
        let output = self.prepare_output_dir(key, creds.as_ref()).await?;
        contract.push((rank_env::OUTPUT_DIR, output.into_os_string()));
        env.extend(contract.into_iter().map(|(k, v)| (OsString::from(k), v)));
        Ok(SpawnRequest {
            program: program.into(),
            args: args.iter().map(OsString::from).collect(),
            env,
            working_dir: workdir
                .or_else(|| (!d.working_dir.is_empty()).then(|| PathBuf::from(&d.working_dir))),
            creds,
            ..SpawnRequest::default()
        })
    }
}

impl Supervisor {
    /// Writes the attempt's shards file (s3:// shards fetched to local copies first) and,
    /// for an elastic job, its data plan, each given to the rank's user under `--run-as`.
    /// Returns the shards file's path and the data plan's, if any.
    async fn write_rank_files(
        &self,
        key: &AttemptKey,
        d: &DesiredRank,
        creds: Option<&crate::identity::RankCreds>,
    ) -> Result<(PathBuf, Option<PathBuf>), PrepareError> {
        let shards_path = shards_file(&self.inner.settings.data_dir, key);
        if let Some(bad) = d.shards.iter().find(|s| s.contains(['\n', '\0'])) {
            return Err(PrepareError::Invalid(format!(
                "shard path {bad:?} contains a newline or NUL"
            )));
        }
        let mut shards = String::with_capacity(d.shards.iter().map(|s| s.len() + 1).sum());
        for s in &d.shards {
            if s.starts_with("s3://") {
                let local = self.fetch_shard(key, s).await?;
                shards.push_str(&local);
            } else {
                shards.push_str(s);
            }
            shards.push('\n');
        }
        write_file_atomic(&shards_path, shards.as_bytes())
            .await
            .map_err(|source| PrepareError::Write {
                path: shards_path.clone(),
                source,
            })?;
        if let Some(creds) = creds {
            give_shards_file(&shards_path, creds)
                .await
                .map_err(|source| PrepareError::Write {
                    path: shards_path.clone(),
                    source,
                })?;
        }

        let plan_path = (!d.data_plan_json.is_empty())
            .then(|| data_plan_file(&self.inner.settings.data_dir, key));
        if let Some(path) = &plan_path {
            write_file_atomic(path, d.data_plan_json.as_bytes())
                .await
                .map_err(|source| PrepareError::Write {
                    path: path.clone(),
                    source,
                })?;
            if let Some(creds) = creds {
                give_shards_file(path, creds)
                    .await
                    .map_err(|source| PrepareError::Write {
                        path: path.clone(),
                        source,
                    })?;
            }
        }

        Ok((shards_path, plan_path))
    }

    /// Checks the job's host paths against this agent's roots before anything is
    /// created: the checkpoint dir and every local shard normalized and under their
    /// roots as written, and with symlinks resolved (each shard directory once), on the
    /// blocking pool.
    ///
    /// With ranks running as another user (`creds`), each local shard must also be
    /// readable by that user: a rank that cannot read its data fails the same way at
    /// every restart.
    async fn check_paths(
        &self,
        d: &DesiredRank,
        creds: Option<&crate::identity::RankCreds>,
    ) -> Result<(), PrepareError> {
        use cumulus_api::paths::{PathKind, check_job_path};
        let roots = &self.inner.settings.roots;
        roots.check_spec_lexical("", &d.ckpt_dir, &d.working_dir)?;
        let mut shard_dirs = std::collections::BTreeSet::new();
        for s in d.shards.iter().filter(|s| !s.starts_with("s3://")) {
            check_job_path(PathKind::Dataset, s)?;
            roots.dataset.check_lexical(s)?;
            if let Some(dir) = std::path::Path::new(s).parent().and_then(|p| p.to_str()) {
                shard_dirs.insert(dir.to_owned());
            }
        }
        if roots.dataset.is_any() && roots.ckpt.is_any() && creds.is_none() {
            return Ok(());
        }
        let roots = roots.clone();
        let ckpt_dir = d.ckpt_dir.clone();
        let local_shards: Vec<String> = match creds {
            Some(_) => d
                .shards
                .iter()
                .filter(|s| !s.starts_with("s3://"))
                .cloned()
                .collect(),
            None => Vec::new(),
        };
        let creds = creds.cloned();
        tokio::task::spawn_blocking(move || {
            for dir in &shard_dirs {
                roots.dataset.check_resolved(dir)?;
            }
            if let Some(creds) = &creds {
                for shard in &local_shards {
                    check_readable_by(Path::new(shard), creds)?;
                }
            }
            if !ckpt_dir.is_empty() {
                roots.ckpt.check_resolved(&ckpt_dir)?;
            }
            Ok::<_, PrepareError>(())
        })
        .await
        .map_err(|e| PrepareError::Invalid(format!("the path check task failed: {e}")))?
    }

    /// Local path of an `s3://` shard from the dataset cache (downloaded and verified on a
    /// miss), pinned in the cache for as long as the attempt's entry exists.
    pub(super) async fn fetch_shard(
        &self,
        key: &AttemptKey,
        url: &str,
    ) -> Result<String, PrepareError> {
        let cache = self.inner.settings.dataset_cache.as_ref().ok_or_else(|| {
            PrepareError::MissingSetting(format!(
                "shard {url} is in S3 but this worker has no S3 settings (--s3-endpoint, ...)"
            ))
        })?;
        let (fetched, pin) =
            cache
                .fetch_pinned(url)
                .await
                .map_err(|source| PrepareError::Shard {
                    url: url.to_string(),
                    source,
                })?;
        match self.table().entries.get_mut(key) {
            Some(entry) => entry.shard_pins.push(pin),
            None => return Err(PrepareError::Ended(key.clone())),
        }
        crate::metrics::metrics().dataset_fetch(fetched.hit, fetched.size_bytes);
        if fetched.hit {
            tracing::info!(attempt = %key, shard = url, "dataset cache hit");
        } else {
            tracing::info!(attempt = %key, shard = url, bytes = fetched.size_bytes, "dataset cache miss: downloaded and verified");
        }
        fetched
            .path
            .to_str()
            .map(str::to_owned)
            .ok_or_else(|| PrepareError::Invalid(format!("cache path of {url} is not UTF-8")))
    }

    /// The checkpoint store of a desired attempt: [`LocalStore`] on `ckpt_dir`, or with an
    /// S3 target a [`TieredStore`] (L1 = `ckpt_dir`, else `<data_dir>/ckpt-l1`; L2 = S3).
    /// With ranks running as another user (`creds`), the local store gives them their
    /// staging and seals their parts ([`cumulus_ckpt::RankAccess`]).
    pub(super) async fn job_store(
        &self,
        d: &DesiredRank,
        creds: Option<&crate::identity::RankCreds>,
    ) -> Result<Arc<dyn CheckpointStore>, PrepareError> {
        let access = creds.map(|c| cumulus_ckpt::RankAccess {
            uid: c.uid,
            gid: c.gid,
        });
        if d.ckpt_url.is_empty() {
            return Ok(Arc::new(
                LocalStore::new(&d.ckpt_dir).with_rank_access(access),
            ));
        }
        let connector = self.inner.settings.s3.as_ref().ok_or_else(|| {
            PrepareError::MissingSetting(format!(
                "the job checkpoints to {} but this worker has no S3 settings (--s3-endpoint, --s3-access-key, ...)",
                d.ckpt_url
            ))
        })?;
        let l2 = connector
            .store(&d.ckpt_url)
            .await
            .map_err(|source| PrepareError::Checkpoint {
                what: "cannot use the S3 checkpoint target",
                source,
            })?;
        let tier = CommitTier::from_spec(&d.ckpt_commit_tier)
            .map_err(|e| PrepareError::Invalid(e.to_string()))?;
        let l1_root = if d.ckpt_dir.is_empty() {
            self.inner.settings.data_dir.join("ckpt-l1")
        } else {
            PathBuf::from(&d.ckpt_dir)
        };
        Ok(Arc::new(TieredStore::new(
            LocalStore::new(l1_root).with_rank_access(access),
            l2,
            tier,
            L1_KEEP_STEPS,
        )))
    }
}

/// Parts of its own each rank keeps on the worker's disk (L1) with an S3 target.
pub(super) const L1_KEEP_STEPS: usize = 2;

/// Checks `rank`'s part of step `step` of job `job_id` (the rank's own job, or the job it
/// was started from) against the step's manifest and returns its local directory
/// (restored from L2 first when the store is tiered and L1 lacks it).
pub(super) async fn verify_resume(
    store: &dyn CheckpointStore,
    job_id: &str,
    rank: u32,
    step: u64,
    resume_dir: &str,
) -> Result<PathBuf, PrepareError> {
    if !cumulus_api::is_job_id(job_id) {
        return Err(PrepareError::Invalid(format!(
            "resume job id {} is invalid",
            cumulus_api::text::escape_control(job_id)
        )));
    }
    let fail = |why: String| PrepareError::Resume {
        dir: resume_dir.to_string(),
        step,
        why,
    };
    if resume_dir.is_empty() {
        return Err(fail("the leader sent no resume_dir".into()));
    }
    let manifest = store
        .read_manifest(job_id, step)
        .await
        .map_err(|e| fail(e.to_string()))?;
    if manifest.step != step || manifest.job_id != job_id {
        return Err(fail(format!(
            "the manifest is for {} step {}",
            manifest.job_id, manifest.step
        )));
    }
    let part = manifest
        .parts
        .iter()
        .find(|p| p.rank == rank)
        .ok_or_else(|| fail(format!("the manifest has no part for rank {rank}")))?;
    if part.dir != resume_dir {
        return Err(fail(format!(
            "the manifest names {:?} for rank {rank}",
            part.dir
        )));
    }
    store
        .resume_part_path(job_id, part)
        .await
        .map_err(|e| fail(e.to_string()))
}

/// Gives the shards file to the rank's user (mode `0400`) and its job directory of the
/// agent's data dir to the job's group (`0750`): other jobs' ranks cannot list it.
async fn give_shards_file(path: &Path, creds: &crate::identity::RankCreds) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let (uid, gid) = (creds.uid, creds.gid);
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || {
        std::os::unix::fs::lchown(&path, Some(uid), Some(gid))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400))?;
        if let Some(dir) = path.parent() {
            std::os::unix::fs::lchown(dir, None, Some(gid))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750))?;
        }
        Ok(())
    })
    .await
    .map_err(io::Error::other)?
}

/// Refuses a shard the rank's user cannot read by its mode bits (see
/// [`crate::identity::readable_by`]); a shard that does not exist is left for the rank
/// to report.
fn check_readable_by(shard: &Path, creds: &crate::identity::RankCreds) -> Result<(), PrepareError> {
    let Ok(meta) = std::fs::metadata(shard) else {
        return Ok(());
    };
    if crate::identity::readable_by(&meta, creds) {
        return Ok(());
    }
    use std::os::unix::fs::MetadataExt;
    Err(PrepareError::Invalid(format!(
        "shard {} is not readable by the ranks' user (uid {}, gid {}; the file is mode \
         {:04o}, owner {}:{}): make the dataset readable by them",
        shard.display(),
        creds.uid,
        creds.gid,
        meta.mode() & 0o7777,
        meta.uid(),
        meta.gid()
    )))
}

/// Writes why `exit` (a record of an attempt that could not start) could not start to
/// the attempt's log, finishes the log and returns `exit`.
pub(super) async fn fail_start(mut log: LogWriter, exit: ExitRecord) -> ExitRecord {
    let message = exit.spawn_error.as_deref().unwrap_or("");
    let line = format!("[cumulus: cannot start the rank: {message}]\n");
    if let Err(e) = log.append(line.as_bytes()).await {
        tracing::warn!("cannot write to log: {e}");
    }
    if let Err(e) = log.finish().await {
        tracing::warn!("cannot finish log: {e}");
    }
    exit
}

pub(super) async fn append_line(path: &Path, line: &str) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        tokio::fs::create_dir_all(dir).await?;
    }
    let mut file = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .await?;
    file.write_all(line.as_bytes()).await?;
    file.sync_all().await
}

pub(super) async fn write_file_atomic(path: &Path, content: &[u8]) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::other("path has no parent"))?;
    tokio::fs::create_dir_all(dir).await?;
    let tmp = path.with_extension("tmp");
    let mut file = tokio::fs::File::create(&tmp).await?;
    file.write_all(content).await?;
    file.sync_all().await?;
    drop(file);
    tokio::fs::rename(&tmp, path).await
}
