//! The checkpoint commit of a rank attempt: its staging directory committed as its part
//! of a step (locally, then in the tier the job commits at) and reported to the leader,
//! re-reported, not re-committed, when a retried commit finds the part unacknowledged.

use std::sync::Arc;

use cumulus_api::rank_local::MAX_LISTED_STEPS;
use cumulus_api::{AttemptKey, CommitCheckpointPartRequest};

use super::*;

impl Supervisor {
    /// Commits the content of the attempt's staging directory as its part of `step`, then
    /// reports the part to the leader. Commits of one attempt are serialized. Returns the
    /// part directory (`step-00000100/rank-0/attempt-1`) once the leader acknowledged it.
    pub async fn commit_checkpoint(
        &self,
        token: &str,
        step: u64,
        state: serde_json::Value,
    ) -> Result<String, CommitError> {
        let started = std::time::Instant::now();
        let (key, lock) = self.commit_target(token)?;
        let mut unacked = lock.lock().await;
        // Re-check after waiting: the attempt may have been stopped meanwhile.
        let (_, _) = self.commit_target(token)?;
        let target = {
            let table = self.table();
            let entry = table.entries.get(&key).ok_or(CommitError::UnknownToken)?;
            entry
                .ckpt
                .clone()
                .ok_or_else(|| CommitError::NotReady(key.clone()))?
        };
        let part = match unacked.take() {
            Some(previous) if previous.step == step => previous.part,
            _ => {
                target
                    .store
                    .commit_part(
                        &key.job_id,
                        step,
                        key.rank,
                        key.attempt,
                        &target.staging,
                        state,
                    )
                    .await?
            }
        };
        let local_ms = started.elapsed().as_secs_f64() * 1e3;
        let state_json = serde_json::to_string(&part.state).expect("a JSON value serializes");
        let request = CommitCheckpointPartRequest {
            worker_id: self.inner.settings.worker_id.clone(),
            job_id: key.job_id.clone(),
            rank: key.rank,
            attempt: key.attempt,
            step,
            dir: part.dir.clone(),
            files: part.files.iter().cloned().map(Into::into).collect(),
            state_json,
        };
        let result = self
            .inner
            .client
            .call(
                "CommitCheckpointPart",
                self.inner.settings.commit_retry,
                &request,
                |mut c, r| async move { c.commit_checkpoint_part(r).await },
            )
            .await;
        match result {
            Ok(_) => {
                let total_ms = started.elapsed().as_secs_f64() * 1e3;
                tracing::info!(
                    attempt = %key,
                    step,
                    dir = %part.dir,
                    local_ms,
                    leader_ms = total_ms - local_ms,
                    "checkpoint part acknowledged"
                );
                let m = crate::metrics::metrics();
                m.checkpoint_seconds
                    .observe(started.elapsed().as_secs_f64());
                m.checkpoint_bytes
                    .inc_by(part.files.iter().map(|f| f.size_bytes).sum());
                Ok(part.dir)
            }
            Err(e) if e.is_stale() => Err(CommitError::Stale(e.to_string())),
            Err(e) => {
                *unacked = Some(UnackedPart { step, part });
                Err(CommitError::Coordinator(e))
            }
        }
    }

    /// The committed steps of the job of the attempt `token` names, ascending, as its
    /// checkpoint store shows them: the step `LATEST` names and every older step whose
    /// manifest reads and validates (a step left partial by a restart has none), at most
    /// the newest [`MAX_LISTED_STEPS`] of them. Empty for a job without checkpoints, or
    /// before `LATEST` exists. Reads at most that many manifests; never hashes content.
    ///
    /// # Errors
    /// [`CommitError::UnknownToken`]; [`CommitError::NotReady`] while the attempt's
    /// checkpoint target is being prepared; [`CommitError::Store`] when the store cannot
    /// be read (an unusable step is skipped, not an error).
    pub async fn committed_steps(&self, token: &str) -> Result<Vec<u64>, CommitError> {
        let (key, target) = {
            let table = self.table();
            let key = table
                .tokens
                .get(token)
                .ok_or(CommitError::UnknownToken)?
                .clone();
            let entry = table.entries.get(&key).ok_or(CommitError::UnknownToken)?;
            if !entry.ckpt_enabled {
                return Ok(Vec::new());
            }
            let target = entry
                .ckpt
                .clone()
                .ok_or_else(|| CommitError::NotReady(key.clone()))?;
            (key, target)
        };
        let store = &*target.store;
        let Some(latest) = store.read_latest(&key.job_id).await? else {
            return Ok(Vec::new());
        };
        let mut candidates: Vec<u64> = store
            .list_steps(&key.job_id)
            .await?
            .into_iter()
            .filter(|&s| s <= latest)
            .collect();
        if !candidates.contains(&latest) {
            candidates.push(latest);
        }
        candidates.sort_unstable();
        let newest = &candidates[candidates.len().saturating_sub(MAX_LISTED_STEPS)..];
        let mut steps = Vec::with_capacity(newest.len());
        for &step in newest {
            match store.read_manifest(&key.job_id, step).await {
                Ok(_) => steps.push(step),
                Err(e) if e.is_unusable_checkpoint() => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(steps)
    }

    #[allow(clippy::type_complexity)]
    fn commit_target(
        &self,
        token: &str,
    ) -> Result<(AttemptKey, Arc<tokio::sync::Mutex<Option<UnackedPart>>>), CommitError> {
        let table = self.table();
        let key = table
            .tokens
            .get(token)
            .ok_or(CommitError::UnknownToken)?
            .clone();
        let entry = table.entries.get(&key).ok_or(CommitError::UnknownToken)?;
        if entry.stopping {
            return Err(CommitError::NotDesired(key));
        }
        if !entry.ckpt_enabled {
            return Err(CommitError::Disabled(key.job_id));
        }
        Ok((key, entry.commit_lock.clone()))
    }
}
