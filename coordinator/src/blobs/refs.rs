//! Which blobs the applied state references: a job's workdir (`JobSpec.workdir`) and its
//! artifacts (`Job.artifacts`). A user reads only the blobs of their own jobs; garbage
//! collection keeps every blob some job references.

use std::collections::HashSet;

use cumulus_api::users::Principal;
use cumulus_raft_store::state::{ClusterState, Job};

/// Every blob digest `job` references: its workdir, then its artifacts.
pub fn job_blobs(job: &Job) -> impl Iterator<Item = &str> {
    job.spec
        .workdir
        .iter()
        .map(|w| w.digest.as_str())
        .chain(job.artifacts.iter().map(|a| a.blob.digest.as_str()))
}

/// Whether `who` may read blob `digest`: an administrator (the cluster token included)
/// any; a user only one that a job they own references.
pub fn may_read(state: &ClusterState, who: &Principal, digest: &str) -> bool {
    who.role == cumulus_api::Role::Admin
        || state
            .jobs
            .values()
            .filter(|j| j.owner == who.name)
            .any(|j| job_blobs(j).any(|d| d == digest))
}

/// Drops from `candidates` every blob a job of `state` references.
pub fn drop_referenced(state: &ClusterState, candidates: &mut HashSet<String>) {
    for job in state.jobs.values() {
        if candidates.is_empty() {
            return;
        }
        for digest in job_blobs(job) {
            candidates.remove(digest);
        }
    }
}
