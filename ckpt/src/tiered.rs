//! Two checkpoint tiers: L1 on the worker's local disk ([`LocalStore`]) and L2 in S3
//! ([`S3Store`]).
//!
//! A part is always committed to L1 first (hash + rename: fast, local). Then:
//! - [`CommitTier::L2`] (the default with an S3 target): the part is uploaded and verified in
//!   L2 before [`CheckpointStore::commit_part`] returns, so the leader only ever sees parts
//!   that survive the loss of the machine. The L1 copy is then a cache and is not fsynced
//!   ([`Durability::Cache`]): a machine crash can tear it, and a resume, which re-hashes
//!   every byte of an L1 copy, then restores it from L2. (Fsyncing it wrote every byte to
//!   the local disk before the upload could start; docs/perf-notes.md, "Checkpoints in S3".)
//! - [`CommitTier::L1`]: the L1 commit is durable (every fsync of the local protocol),
//!   `commit_part` returns at once and the upload runs in the background
//!   (bounded concurrency; the S3 store retries transient errors with backoff until its
//!   deadline, permanent ones are logged and surfaced by the L2 check of the step).
//!
//! Manifests, `LATEST`, listing and step verification belong to the commit tier: L2 by
//! default (the leader's view must not depend on one worker's disk); with `L1` the L1 root
//! must be shared with the leader (as `ckpt_dir` is today). A resume
//! ([`CheckpointStore::resume_part_path`]) uses the
//! L1 copy when it verifies and otherwise restores the part from L2 into L1, verifying every
//! byte. With [`CommitTier::L2`], each rank keeps at most [`TieredStore::l1_keep_steps`] of its
//! own parts in L1; with [`CommitTier::L1`], L1 retention is the leader's (it prunes the shared
//! L1 root to the kept committed steps) and the leader mirrors manifests and `LATEST` to L2.

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use cumulus_api::CommitTier;
use tokio::sync::Semaphore;

use crate::{
    CheckpointStore, CkptError, Durability, LocalStore, Manifest, PartRecord, S3Store,
    parse_part_dir_rel, parse_step_dir_name,
};

/// L1 (local disk) + L2 (S3). See the module documentation.
#[derive(Clone, Debug)]
pub struct TieredStore {
    l1: LocalStore,
    l2: S3Store,
    commit_at: CommitTier,
    l1_keep_steps: usize,
    background: Arc<Semaphore>,
}

/// Most background (L1-commit) uploads of one tiered store in flight at once.
const MAX_BACKGROUND_UPLOADS: usize = 4;

impl TieredStore {
    /// L1 at `l1`, L2 at `l2`, committing at `commit_at`; each rank keeps its newest
    /// `l1_keep_steps` (≥ 1) parts in L1.
    pub fn new(l1: LocalStore, l2: S3Store, commit_at: CommitTier, l1_keep_steps: usize) -> Self {
        Self {
            l1,
            l2,
            commit_at,
            l1_keep_steps: l1_keep_steps.max(1),
            background: Arc::new(Semaphore::new(MAX_BACKGROUND_UPLOADS)),
        }
    }

    /// The L1 tier.
    pub fn l1(&self) -> &LocalStore {
        &self.l1
    }

    /// The L2 tier.
    pub fn l2(&self) -> &S3Store {
        &self.l2
    }

    /// The tier that holds manifests and `LATEST`: the commit tier.
    fn meta(&self) -> &dyn CheckpointStore {
        match self.commit_at {
            CommitTier::L1 => &self.l1,
            CommitTier::L2 => &self.l2,
        }
    }

    /// How many of its own parts each rank keeps in L1.
    pub fn l1_keep_steps(&self) -> usize {
        self.l1_keep_steps
    }

    /// Deletes this rank's L1 parts of all but its newest `l1_keep_steps` steps (and step
    /// directories left empty). Errors are logged: L1 retention never fails a commit.
    async fn prune_l1_rank(&self, job_id: &str, rank: u32) {
        let job_dir = self.l1.job_dir(job_id);
        let keep = self.l1_keep_steps;
        let result = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            let mut steps: Vec<(u64, PathBuf)> = Vec::new();
            for entry in std::fs::read_dir(&job_dir)? {
                let entry = entry?;
                let Some(step) = entry.file_name().to_str().and_then(parse_step_dir_name) else {
                    continue;
                };
                let rank_dir = entry.path().join(format!("rank-{rank}"));
                if rank_dir.is_dir() {
                    steps.push((step, rank_dir));
                }
            }
            steps.sort_by_key(|(step, _)| *step);
            let old = steps.len().saturating_sub(keep);
            for (_, rank_dir) in steps.into_iter().take(old) {
                std::fs::remove_dir_all(&rank_dir)?;
                if let Some(step_dir) = rank_dir.parent() {
                    // Fails (harmlessly) while other ranks' parts are still there.
                    let _ = std::fs::remove_dir(step_dir);
                }
            }
            Ok(())
        })
        .await;
        match result {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(job_id, rank, "L1 retention failed: {e}"),
            Err(e) => tracing::warn!(job_id, rank, "L1 retention task failed: {e}"),
        }
    }
}

#[async_trait::async_trait]
impl CheckpointStore for TieredStore {
    async fn prepare_staging(
        &self,
        job_id: &str,
        rank: u32,
        attempt: u32,
    ) -> Result<PathBuf, CkptError> {
        self.l1.prepare_staging(job_id, rank, attempt).await
    }

    async fn commit_part(
        &self,
        job_id: &str,
        step: u64,
        rank: u32,
        attempt: u32,
        staging: &Path,
        state: serde_json::Value,
    ) -> Result<PartRecord, CkptError> {
        let durability = match self.commit_at {
            CommitTier::L2 => Durability::Cache,
            CommitTier::L1 => Durability::Durable,
        };
        let record = self
            .l1
            .clone()
            .with_durability(durability)
            .commit_part(job_id, step, rank, attempt, staging, state)
            .await?;
        let local = self
            .l1
            .local_part_path(job_id, &record.dir)
            .ok_or_else(|| CkptError::Invalid(format!("part dir {:?} is invalid", record.dir)))?;
        match self.commit_at {
            CommitTier::L2 => {
                self.l2.upload_part(job_id, &record, &local).await?;
                self.prune_l1_rank(job_id, rank).await;
            }
            CommitTier::L1 => {
                let store = self.clone();
                let job_id = job_id.to_owned();
                let upload = record.clone();
                tokio::spawn(async move {
                    let Ok(_permit) = store.background.acquire().await else {
                        return;
                    };
                    if let Err(e) = store.l2.upload_part(&job_id, &upload, &local).await {
                        tracing::error!(job_id, part = %upload.dir, "L2 upload failed: {e}");
                        return;
                    }
                    // No per-rank L1 pruning here: L1 holds the committed steps (and the
                    // leader prunes L1 to them), so deleting a rank's older parts could
                    // break the committed step that LATEST names. In L2, a part that
                    // arrived after its step was passed over is deleted again.
                    match store.l2.discard_part_if_superseded(&job_id, &upload).await {
                        Ok(false) => {
                            tracing::info!(job_id, part = %upload.dir, "part uploaded to L2")
                        }
                        Ok(true) => tracing::info!(
                            job_id,
                            part = %upload.dir,
                            "part uploaded after L2 moved past its step; deleted from L2"
                        ),
                        Err(e) => tracing::warn!(
                            job_id,
                            part = %upload.dir,
                            "cannot check whether the uploaded part is still wanted: {e}"
                        ),
                    }
                });
            }
        }
        Ok(record)
    }

    async fn verify_part(&self, job_id: &str, part: &PartRecord) -> Result<(), CkptError> {
        self.meta().verify_part(job_id, part).await
    }

    async fn check_part(&self, job_id: &str, part: &PartRecord) -> Result<(), CkptError> {
        self.meta().check_part(job_id, part).await
    }

    async fn write_manifest(&self, manifest: &Manifest) -> Result<(), CkptError> {
        self.meta().write_manifest(manifest).await
    }

    async fn read_manifest(&self, job_id: &str, step: u64) -> Result<Manifest, CkptError> {
        self.meta().read_manifest(job_id, step).await
    }

    async fn verify_step(&self, job_id: &str, step: u64) -> Result<Manifest, CkptError> {
        self.meta().verify_step(job_id, step).await
    }

    async fn write_latest(&self, job_id: &str, step: u64) -> Result<(), CkptError> {
        self.meta().write_latest(job_id, step).await
    }

    async fn read_latest(&self, job_id: &str) -> Result<Option<u64>, CkptError> {
        self.meta().read_latest(job_id).await
    }

    async fn list_steps(&self, job_id: &str) -> Result<Vec<u64>, CkptError> {
        self.meta().list_steps(job_id).await
    }

    async fn prune(&self, job_id: &str, keep: &[u64]) -> Result<Vec<u64>, CkptError> {
        self.meta().prune(job_id, keep).await
    }

    /// Deletes the job in L2 and in this process's L1; the L1 copies on other workers'
    /// disks are left to their own retention.
    async fn delete_job(&self, job_id: &str) -> Result<bool, CkptError> {
        let in_l2 = self.l2.delete_job(job_id).await?;
        let in_l1 = self.l1.delete_job(job_id).await?;
        Ok(in_l2 || in_l1)
    }

    fn local_part_path(&self, job_id: &str, part_dir: &str) -> Option<PathBuf> {
        self.l1.local_part_path(job_id, part_dir)
    }

    async fn resume_part_path(
        &self,
        job_id: &str,
        part: &PartRecord,
    ) -> Result<PathBuf, CkptError> {
        let path = self
            .l1
            .local_part_path(job_id, &part.dir)
            .ok_or_else(|| CkptError::Invalid(format!("part dir {:?} is invalid", part.dir)))?;
        match self.l1.verify_part(job_id, part).await {
            Ok(()) => return Ok(path),
            Err(e) => {
                tracing::info!(job_id, part = %part.dir, "no valid L1 copy ({e}); restoring from L2")
            }
        }
        let (step, rank, attempt) = parse_part_dir_rel(&part.dir)
            .ok_or_else(|| CkptError::Invalid(format!("part dir {:?} is invalid", part.dir)))?;
        let job_dir = self.l1.job_dir(job_id);
        let io = |op: &'static str, p: &Path| {
            let p = p.to_owned();
            move |source| CkptError::Io {
                op,
                path: p,
                source,
            }
        };
        let tmp = job_dir.join(format!(
            ".restore/step-{step}.rank-{rank}.attempt-{attempt}.{}",
            rand::random::<u64>()
        ));
        tokio::fs::create_dir_all(&tmp)
            .await
            .map_err(io("create dir", &tmp))?;
        let restored = self.l2.restore_part(job_id, part, &tmp).await;
        if let Err(e) = restored {
            let _ = tokio::fs::remove_dir_all(&tmp).await;
            return Err(e);
        }
        if tokio::fs::try_exists(&path).await.unwrap_or(false) {
            // A damaged L1 copy: replaced by the verified download.
            tokio::fs::remove_dir_all(&path)
                .await
                .map_err(io("remove", &path))?;
        }
        if let Some(parent) = path.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(io("create dir", parent))?;
        }
        tokio::fs::rename(&tmp, &path)
            .await
            .map_err(io("rename", &tmp))?;
        self.l1.verify_part(job_id, part).await?;
        tracing::info!(job_id, part = %part.dir, "part restored from L2 into L1");
        Ok(path)
    }

    fn describe(&self) -> String {
        format!("L1 {} + L2 {}", self.l1.describe(), self.l2.describe())
    }
}
