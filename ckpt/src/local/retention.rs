//! Retention: pruning the steps older than `LATEST` that are not kept, with the stale
//! leftovers of interrupted writes and prunes, and deleting a whole job.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

use super::{LocalStore, fsync_dir, io_err};
use crate::{CkptError, LATEST_FILE, step_dir_name};

impl LocalStore {
    pub(super) fn prune_sync(&self, job_id: &str, keep: &[u64]) -> Result<Vec<u64>, CkptError> {
        let job_dir = self.checked_job_dir(job_id)?;
        let latest = self.read_latest_sync(job_id)?;
        let steps = self.list_steps_sync(job_id)?;
        let keep: BTreeSet<u64> = keep.iter().copied().collect();
        let Some(latest) = latest else {
            // Nothing committed yet: every step may still be in flight.
            return Ok(Vec::new());
        };
        let mut deleted = Vec::new();
        for &step in &steps {
            if step >= latest || keep.contains(&step) {
                continue;
            }
            // Rename first so that the step vanishes atomically; a crash during the removal
            // leaves a `*.tmp*` leftover that the next prune removes.
            let from = job_dir.join(step_dir_name(step));
            let doomed = job_dir.join(format!(
                "{}.tmp-prune-{:016x}",
                step_dir_name(step),
                rand::random::<u64>()
            ));
            fs::rename(&from, &doomed).map_err(io_err("rename", &from))?;
            fsync_dir(&job_dir)?;
            fs::remove_dir_all(&doomed).map_err(io_err("remove", &doomed))?;
            deleted.push(step);
        }

        // Stale leftovers: temp files and dirs in the job dir and in remaining committed steps.
        let mut scan_dirs = vec![job_dir.clone()];
        scan_dirs.extend(
            steps
                .iter()
                .filter(|step| **step <= latest && !deleted.contains(step))
                .map(|step| job_dir.join(step_dir_name(*step))),
        );
        for dir in &scan_dirs {
            let mut removed_any = false;
            for entry in fs::read_dir(dir).map_err(io_err("read dir", dir))? {
                let entry = entry.map_err(io_err("read dir", dir))?;
                let is_temp = entry
                    .file_name()
                    .to_str()
                    .is_some_and(|name| name.contains(".tmp"));
                if !is_temp {
                    continue;
                }
                let path = entry.path();
                let file_type = entry.file_type().map_err(io_err("stat", &path))?;
                if file_type.is_dir() {
                    fs::remove_dir_all(&path).map_err(io_err("remove", &path))?;
                } else {
                    fs::remove_file(&path).map_err(io_err("remove", &path))?;
                }
                removed_any = true;
            }
            if removed_any {
                fsync_dir(dir)?;
            }
        }
        Ok(deleted)
    }
}

/// Deletes the job directory `dir`: `LATEST` first (and the directory fsynced), so that
/// a crash during the removal leaves no `LATEST` naming a step half removed. `false` when
/// there was no such directory.
pub(super) fn delete_job_sync(dir: &Path) -> Result<bool, CkptError> {
    let io = |op: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| CkptError::Io { op, path, source }
    };
    if !dir.exists() {
        return Ok(false);
    }
    let latest = dir.join(LATEST_FILE);
    match std::fs::remove_file(&latest) {
        Ok(()) => fsync_dir(dir)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("remove", &latest)(e)),
    }
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(io("remove", dir)(e)),
    }
}
