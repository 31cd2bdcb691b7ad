//! The client API's operations, shared by the gRPC `ClientService`
//! (`crate::client_service`) and the REST mirror (`crate::http`), one module per concern:
//!
//! - `authorization`: the role and ownership checks ([`require_role`],
//!   [`require_owner`]) every other concern runs first;
//! - `admission`: [`submit`] and its checks (spec, paths under the roots, dataset
//!   listing, checkpoint target, capacity, byte budget);
//! - `jobs`: reading jobs ([`get_job`], [`job_summary`], [`job_summaries`],
//!   [`list_jobs`]);
//! - `lifecycle`: [`cancel`], [`pause`], [`resume`], [`delete`], [`purge`];
//! - `membership`: [`cluster_status`] and the Raft membership changes
//!   ([`add_learner`], [`promote_member`], [`remove_member`]);
//! - `users`: [`create_user`], [`revoke_user`], [`list_users`];
//! - `checkpoints`: [`list_checkpoints`], and deleting a job's checkpoints;
//! - `blobs`: the blob store as clients see it ([`stat_blob`], [`put_blob`],
//!   [`get_blob`]) and the admission check of a workdir blob.
//!
//! Every operation is reached through the re-exports here (`crate::api::submit`).

mod admission;
mod authorization;
mod blobs;
mod checkpoints;
mod jobs;
mod lifecycle;
mod membership;
mod users;

pub use admission::{list_dataset, submit};
pub use authorization::{require_owner, require_role};
pub use blobs::{get_blob, put_blob, stat_blob};
pub use checkpoints::list_checkpoints;
pub use jobs::{DEFAULT_SUMMARIES, MAX_SUMMARIES, get_job, job_summaries, job_summary, list_jobs};
pub use lifecycle::{MAX_PURGE_JOBS, cancel, delete, pause, purge, resume};
pub use membership::{
    ADD_LEARNER_TIMEOUT_MS, MAX_MEMBER_ADDR_BYTES, add_learner, cluster_status, promote_member,
    remove_member,
};
pub use users::{create_user, list_users, revoke_user};
