//! Admission: a submitted job's checks before it enters the log (request id, spec,
//! names and paths under the roots, dataset listing, checkpoint target, capacity, a
//! workdir blob held by the blob store, the state's byte budget), then its proposal; a
//! resumed job's spec completed from its source.

use std::path::Path;

use cumulus_api::Role;
use cumulus_api::users::Principal;
use cumulus_api::v1;
use cumulus_raft_store::Command;
use cumulus_raft_store::Response;
use cumulus_raft_store::stage;
use cumulus_raft_store::state::submit_bytes;

use super::authorization::{require_owner, require_role};
use crate::convert::spec_from_proto;
use crate::error::ApiError;
use crate::localfs;
use crate::localfs::MAX_DATASET_FILES;
use crate::node::Node;
use crate::soft::now_ms;

/// Lists a dataset directory's regular files (not hidden), sorted by name, as
/// absolute paths. Blocking; call it off the runtime thread.
///
/// # Errors
/// `InvalidArgument` when the directory is missing, unreadable, empty or too large.
pub fn list_dataset(dir: &str) -> Result<Vec<String>, ApiError> {
    let path = Path::new(dir);
    let entries = std::fs::read_dir(path).map_err(|e| {
        ApiError::InvalidArgument(format!(
            "dataset {dir} cannot be read: {e} (give an existing directory of shard files)"
        ))
    })?;
    let mut shards = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| ApiError::InvalidArgument(format!("dataset {dir}: {e}")))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            return Err(ApiError::InvalidArgument(format!(
                "dataset {dir} holds a file whose name is not UTF-8"
            )));
        };
        if name.starts_with('.') {
            continue;
        }
        // The type comes with the directory entry (`d_type`): no `stat` per shard on the
        // write path (std falls back to `lstat` where the filesystem leaves it unknown).
        // Like `lstat`, a symlink is not a file here.
        let file_type = entry
            .file_type()
            .map_err(|e| ApiError::InvalidArgument(format!("dataset {dir}/{name}: {e}")))?;
        if file_type.is_file() {
            shards.push(path.join(name).to_string_lossy().to_string());
        }
        if shards.len() > MAX_DATASET_FILES {
            return Err(ApiError::InvalidArgument(format!(
                "dataset {dir} has more than {MAX_DATASET_FILES} files"
            )));
        }
    }
    if shards.is_empty() {
        return Err(ApiError::InvalidArgument(format!(
            "dataset {dir} has no shard files"
        )));
    }
    shards.sort();
    Ok(shards)
}

/// Creates the checkpoint root `dir` unless it is already a directory: one `stat` in the
/// common case (every job of a user shares a root) instead of `create_dir_all`'s failing
/// `mkdir` then `stat`. Blocking; call it off the runtime thread.
///
/// # Errors
/// [`ApiError::InvalidArgument`] naming `dir` when it cannot be created.
fn ensure_ckpt_dir(dir: &str) -> Result<(), ApiError> {
    if Path::new(dir).is_dir() {
        return Ok(());
    }
    create_shared_dirs(Path::new(dir)).map_err(|e| {
        ApiError::InvalidArgument(format!("checkpoint dir {dir} cannot be created: {e}"))
    })
}

/// Mode of the checkpoint root and the parents [`ensure_ckpt_dir`] creates: ranks running
/// as other users (`--run-as`) pass through them to their job's directory, which the
/// worker gives the job's group alone.
const CKPT_ROOT_MODE: u32 = 0o755;

/// `create_dir_all` with [`CKPT_ROOT_MODE`] set on every directory it creates, whatever
/// the process umask (the coordinator binary's is `0077`, for its data dir).
fn create_shared_dirs(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let missing: Vec<&Path> = dir
        .ancestors()
        .take_while(|p| !p.as_os_str().is_empty() && !p.is_dir())
        .collect();
    for path in missing.into_iter().rev() {
        match std::fs::create_dir(path) {
            Ok(()) => {
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(CKPT_ROOT_MODE))?
            }
            // Created meanwhile by another submit.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && path.is_dir() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The objects under an S3 dataset prefix whose names do not start with a dot, as
/// `s3://bucket/key` shard URLs (sorted).
///
/// # Errors
/// `InvalidArgument` when the prefix cannot be listed (with the S3 reason), is empty or
/// holds more than [`MAX_DATASET_FILES`] objects.
async fn list_s3_dataset(node: &Node, url: &str) -> Result<Vec<String>, ApiError> {
    let bad = |e: cumulus_ckpt::CkptError| {
        ApiError::InvalidArgument(format!("dataset {url} cannot be listed: {e}"))
    };
    let store = node.s3.store(url).await.map_err(bad)?;
    // As in a local dataset, an object whose name starts with a dot is not a shard (the
    // feature statistics `dataset split` writes, `.feature-stats.json`, is one).
    let keys: Vec<String> = store
        .list_objects()
        .await
        .map_err(bad)?
        .into_iter()
        .filter(|k| !k.rsplit('/').next().unwrap_or(k).starts_with('.'))
        .collect();
    if keys.is_empty() {
        return Err(ApiError::InvalidArgument(format!(
            "dataset {url} has no objects"
        )));
    }
    if keys.len() > MAX_DATASET_FILES {
        return Err(ApiError::InvalidArgument(format!(
            "dataset {url} has more than {MAX_DATASET_FILES} objects"
        )));
    }
    let bucket = &store.location().bucket;
    Ok(keys
        .into_iter()
        .map(|k| format!("s3://{bucket}/{k}"))
        .collect())
}

/// Admission checks a user would otherwise learn of only after the restart budget is
/// spent, or never: a dataset with fewer shards than ranks (a rank would get none), and,
/// unless `allow_pending`, a job larger than the alive workers offer in all (it would
/// stay pending for ever). A cluster with no alive worker (still starting) accepts it.
///
/// # Errors
/// `InvalidArgument` saying what is wrong and how to fix it.
fn check_fits(
    node: &Node,
    spec: &cumulus_raft_store::state::JobSpec,
    shard_count: usize,
    allow_pending: bool,
) -> Result<(), ApiError> {
    if !spec.dataset.is_empty() && shard_count < spec.world_size as usize {
        return Err(ApiError::InvalidArgument(format!(
            "the dataset {} has {shard_count} shard{} for {} ranks: ranks {}..{} would get \
             none; split it into at least {} shards (cumulusctl dataset split --shards N) \
             or lower --world-size",
            spec.dataset,
            if shard_count == 1 { "" } else { "s" },
            spec.world_size,
            shard_count,
            spec.world_size - 1,
            spec.world_size
        )));
    }
    if allow_pending {
        return Ok(());
    }
    let outlook = node.read_state(|s| {
        let any_alive = s
            .workers
            .values()
            .any(|w| w.state == cumulus_raft_store::state::WorkerState::Alive);
        any_alive.then(|| s.capacity_outlook(spec))
    });
    match outlook {
        Some(cumulus_raft_store::state::Outlook::Never(why)) => {
            Err(ApiError::InvalidArgument(format!(
                "the job is larger than the cluster: it {}; submit with --allow-pending (allow_pending) to queue it until workers join",
                why.trim_start_matches("cannot be placed: it ")
            )))
        }
        _ => Ok(()),
    }
}

/// Submits a job (idempotent by request id).
///
/// # Errors
/// `InvalidArgument` for a bad spec or dataset; `ResourceExhausted` past the state's
/// byte budget ([`Node::reserve_state_bytes`]); `NotLeader`/`Unavailable` from Raft.
pub async fn submit(
    node: &Node,
    who: &Principal,
    req: v1::SubmitJobRequest,
) -> Result<v1::SubmitJobResponse, ApiError> {
    require_role(who, Role::Submit, "submit jobs")?;
    let start_ns = stage::now_ns();
    let mut proposed_ns = None;
    let result = submit_checked(node, who, req, &mut proposed_ns).await;
    if let Some(proposed_ns) = proposed_ns {
        tracing::trace!(
            target: stage::TARGET,
            stage = "submit",
            start_ns,
            proposed_ns,
            end_ns = stage::now_ns(),
        );
    }
    result
}

/// [`submit`]'s checks and proposal; sets `proposed_ns` ([`stage::now_ns`]) when the
/// command goes to Raft.
async fn submit_checked(
    node: &Node,
    who: &Principal,
    mut req: v1::SubmitJobRequest,
    proposed_ns: &mut Option<u64>,
) -> Result<v1::SubmitJobResponse, ApiError> {
    let owner = who.name.as_str();
    node.require_leader()?;
    if req.request_id.is_empty() || req.request_id.len() > 128 {
        return Err(ApiError::InvalidArgument(
            "request_id must be 1..=128 bytes".into(),
        ));
    }
    let Some(spec) = req.spec.as_ref() else {
        return Err(ApiError::InvalidArgument(
            "the request has no job spec".into(),
        ));
    };
    // A retried request id returns its job before any validation against today's disk.
    let existing = node.read_state(|s| s.request_ids.get(&req.request_id).cloned());
    if !spec.resume_from_job.is_empty() {
        let mut spec = spec.clone();
        fill_from_resumed_job(node, who, &mut spec)?;
        req.spec = Some(spec);
    }
    let spec = spec_from_proto(
        req.spec.as_ref().expect("checked above"),
        node.limits.max_world_size,
    )?;
    let roots = &node.limits.roots;
    if existing.is_none() {
        // Checked at admission, not in `apply`: the log may hold older jobs' names.
        if !cumulus_api::text::is_printable(&spec.name) {
            return Err(ApiError::InvalidArgument(format!(
                "job name {} holds control or invisible characters",
                cumulus_api::text::escape_control(&spec.name)
            )));
        }
        roots.check_spec_lexical(&spec.dataset, &spec.ckpt_dir, &spec.working_dir)?;
    }
    let mut shards = if existing.is_some() || spec.dataset.is_empty() {
        node.read_state(|s| {
            existing
                .as_ref()
                .and_then(|id| s.jobs.get(id))
                .map(|j| j.shard_plan.concat())
                .unwrap_or_default()
        })
    } else if spec.dataset.starts_with("s3://") {
        list_s3_dataset(node, &spec.dataset).await?
    } else {
        // A local dataset is listed below, with the checkpoint dir check.
        Vec::new()
    };
    if !spec.ckpt_url.is_empty() && existing.is_none() {
        // Fail the submit, not the first commit, on a bad target: unreachable endpoint, bad
        // credentials, missing bucket, access denied.
        let store = node.s3.store(&spec.ckpt_url).await.map_err(|e| {
            ApiError::InvalidArgument(format!("checkpoint target {}: {e}", spec.ckpt_url))
        })?;
        store.check_access().await.map_err(|e| {
            ApiError::InvalidArgument(format!(
                "checkpoint target {} is not usable: {e}",
                spec.ckpt_url
            ))
        })?;
    }
    // The user's directories may sit on a slow or hung network mount: list and check them
    // on the blocking pool (one hand-off for both), never on the runtime thread, which
    // also runs Raft's heartbeats (one thread by default) — unless the fast path of
    // `localfs` can confirm both on local file systems without blocking.
    let list_local =
        existing.is_none() && !spec.dataset.is_empty() && !spec.dataset.starts_with("s3://");
    let check_ckpt_dir = existing.is_none() && !spec.ckpt_dir.is_empty();
    if list_local || check_ckpt_dir {
        let dataset = list_local.then_some(spec.dataset.as_str());
        let ckpt_dir = check_ckpt_dir.then_some(spec.ckpt_dir.as_str());
        let inline = node
            .local_fs
            .fresh_table()
            .and_then(|table| localfs::checks_inline(&table, dataset, ckpt_dir));
        let listed = match inline {
            Some(listed) => listed,
            None => {
                let dataset = dataset.map(str::to_owned);
                let ckpt_dir = ckpt_dir.map(str::to_owned);
                let roots = roots.clone();
                tokio::task::spawn_blocking(move || {
                    // The fast path above takes no symlinks; here every one is resolved
                    // and must stay under the roots before anything is listed or created.
                    let listed = dataset
                        .as_deref()
                        .map(|d| {
                            roots.dataset.check_resolved(d)?;
                            list_dataset(d)
                        })
                        .transpose()?;
                    if let Some(ckpt_dir) = &ckpt_dir {
                        roots.ckpt.check_resolved(ckpt_dir)?;
                        ensure_ckpt_dir(ckpt_dir)?;
                    }
                    Ok::<_, ApiError>(listed)
                })
                .await
                .map_err(|e| {
                    ApiError::Internal(format!("the dataset listing task failed: {e}"))
                })??
            }
        };
        if let Some(listed) = listed {
            shards = listed;
        }
    }
    shards.sort();
    if existing.is_none() {
        check_fits(node, &spec, shards.len(), req.allow_pending)?;
        // A workdir blob must be in the blob store (on the leader, and a majority).
        if let Some(workdir) = req.spec.as_ref().and_then(|s| s.workdir.as_ref()) {
            super::blobs::check_workdir(node, workdir).await?;
        }
    }
    // A new job must fit the state's byte budget; a retried request id adds nothing.
    let _reservation = if existing.is_none() {
        Some(node.reserve_state_bytes(submit_bytes(&spec, &shards), who)?)
    } else {
        None
    };
    let warnings = cumulus_api::warnings::submit_warnings(
        spec.restart.max_restarts,
        !spec.ckpt_dir.is_empty() || !spec.ckpt_url.is_empty(),
    );
    let cmd = Command::SubmitJob {
        request_id: req.request_id.clone(),
        spec,
        shards,
        submitted_at_ms: now_ms(),
        owner: owner.to_string(),
    };
    *proposed_ns = Some(stage::now_ns());
    match node.propose(cmd).await? {
        Response::JobSubmitted { job_id, created } => Ok(v1::SubmitJobResponse {
            job_id,
            created,
            warnings,
        }),
        Response::Rejected { reason } => Err(ApiError::InvalidArgument(reason)),
        Response::Ok | Response::Batch { .. } => {
            Err(ApiError::Internal("submit produced no job".into()))
        }
    }
}

/// Completes a spec that resumes from an earlier job (`resume_from_job`): the step
/// defaults to that job's newest committed one, and the dataset and checkpoint target
/// (which must be the same) to that job's when left empty. Whether the step, world size
/// and shard plan fit is `apply`'s check.
///
/// # Errors
/// `InvalidArgument` for a malformed id; `NotFound` for an unknown job;
/// `PermissionDenied` when `who` may not read that job's checkpoints;
/// `FailedPrecondition` when it has no committed step.
fn fill_from_resumed_job(
    node: &Node,
    who: &Principal,
    spec: &mut v1::JobSpec,
) -> Result<(), ApiError> {
    let job_id = spec.resume_from_job.clone();
    if !cumulus_raft_store::state::is_job_id(&job_id) {
        return Err(ApiError::InvalidArgument(format!(
            "resume_from {} is not a job id (job-NNNNNN)",
            cumulus_api::text::escape_control(&job_id)
        )));
    }
    require_owner(node, who, &job_id, "resume from")?;
    let (source, newest) = node
        .read_state(|s| {
            s.jobs
                .get(&job_id)
                .map(|j| (j.spec.clone(), j.committed_step))
        })
        .ok_or_else(|| ApiError::NotFound(format!("no job {job_id:?}")))?;
    if spec.resume_from_step.is_none() {
        spec.resume_from_step = Some(newest.ok_or_else(|| {
            ApiError::FailedPrecondition(format!(
                "{job_id} has no committed checkpoint to resume from"
            ))
        })?);
    }
    if spec.dataset.is_empty() {
        spec.dataset = source.dataset;
    }
    if spec.ckpt_dir.is_empty() && spec.ckpt_url.is_empty() {
        spec.ckpt_dir = source.ckpt_dir;
        spec.ckpt_url = source.ckpt_url;
        if spec.ckpt_commit_tier.is_empty() {
            spec.ckpt_commit_tier = source.ckpt_commit_tier;
        }
    }
    Ok(())
}
