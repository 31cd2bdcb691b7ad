//! gRPC client of the coordinators' `ClientService`: the shared leader-following client
//! ([`cumulus_client::LeaderClient`]) with the CLI's bounds and errors.
//!
//! Every call carries `authorization: Bearer <token>`. A follower answers a write with
//! UNAVAILABLE and the leader's address in [`cumulus_api::leader::LEADER_GRPC_METADATA`]:
//! the call is retried there at once. A transport error, a timeout, or UNAVAILABLE without
//! a leader (an election in progress) rotates to the next configured address, with
//! backoff. Both are bounded by [`RetryPolicy`] (default 20 tries within 30 s). Any other
//! answer (a full cluster refusing a submit included) is shown at once.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cumulus_api::blobs::CHUNK_BYTES;
use cumulus_api::client_config;
use cumulus_api::client_service_client::ClientServiceClient;
use cumulus_api::{BlobChunk, GetBlobRequest, PutBlobResponse, StatBlobRequest, StatBlobResponse};
use cumulus_api::{
    CancelJobRequest, ClusterStatusRequest, ClusterStatusResponse, DeleteJobRequest,
    DeleteJobResponse, GetJobRequest, GetJobSummaryRequest, JobResponse, JobSummary,
    ListCheckpointsRequest, ListCheckpointsResponse, ListJobSummariesRequest,
    ListJobSummariesResponse, ListJobsRequest, ListJobsResponse, PauseJobRequest, PurgeJobsRequest,
    PurgeJobsResponse, ResumeJobRequest, SubmitJobRequest, SubmitJobResponse,
};
use cumulus_client::{self as leader, CallError, ChannelSettings, ConfigError, LeaderClient};
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::config::Conn;

/// A failing call warns once (on stderr, via tracing) after this many tries.
pub const WARN_AFTER_ATTEMPTS: u32 = 5;

/// Slowest transfer rate a blob upload or download is given time for, bytes per second
/// ([`RetryPolicy::for_transfer`]).
pub const MIN_TRANSFER_BYTES_PER_S: u64 = 1024 * 1024;

/// Longest wait for the next chunk of a blob download.
pub const CHUNK_IDLE_TIMEOUT: Duration = Duration::from_millis(client_config::REQUEST_TIMEOUT_MS);

/// Bounds of one call's retry loop and of every attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Most attempts of one call (≥ 1).
    pub max_attempts: u32,
    /// No new attempt starts after this much time since the first.
    pub max_total: Duration,
    /// First backoff before retrying after a rotate.
    pub backoff_initial: Duration,
    /// Largest backoff (doubles from `backoff_initial`).
    pub backoff_max: Duration,
    /// TCP connect timeout of each attempt.
    pub connect_timeout: Duration,
    /// Whole-request timeout of each attempt.
    pub request_timeout: Duration,
}

impl Default for RetryPolicy {
    /// The contract's bounds ([`cumulus_api::client_config`]), as the Python SDK's.
    fn default() -> Self {
        RetryPolicy {
            max_attempts: client_config::RETRY_MAX_TRIES,
            max_total: Duration::from_millis(client_config::RETRY_TOTAL_MS),
            backoff_initial: Duration::from_millis(client_config::RETRY_BACKOFF_INITIAL_MS),
            backoff_max: Duration::from_millis(client_config::RETRY_BACKOFF_MAX_MS),
            connect_timeout: Duration::from_millis(client_config::CONNECT_TIMEOUT_MS),
            request_timeout: Duration::from_millis(client_config::REQUEST_TIMEOUT_MS),
        }
    }
}

impl RetryPolicy {
    /// One try per configured address, no waiting in between: for polling loops that
    /// have their own deadline (e.g. waiting for a cluster to come up).
    pub fn single_pass(addresses: usize) -> Self {
        RetryPolicy {
            max_attempts: addresses.max(1) as u32 + 1,
            max_total: Duration::from_secs(5),
            backoff_initial: Duration::from_millis(0),
            backoff_max: Duration::from_millis(0),
            connect_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(3),
        }
    }

    /// This policy with each attempt given time to move `bytes` at
    /// [`MIN_TRANSFER_BYTES_PER_S`] on top of its request timeout (a blob upload is one
    /// request; the channel's timeout covers all of it).
    pub fn for_transfer(self, bytes: u64) -> Self {
        RetryPolicy {
            request_timeout: self.request_timeout
                + Duration::from_secs(bytes.div_ceil(MIN_TRANSFER_BYTES_PER_S)),
            ..self
        }
    }

    /// The shared client's policy: only transport failures, timeouts and elections are
    /// retried; one warning after [`WARN_AFTER_ATTEMPTS`] tries.
    fn leader_policy(&self) -> leader::RetryPolicy {
        leader::RetryPolicy {
            max_attempts: self.max_attempts.max(1),
            max_total: self.max_total,
            initial_backoff: self.backoff_initial,
            max_backoff: self.backoff_max,
            attempt_timeout: self.request_timeout,
            retry_server_errors: false,
            warn_after_attempts: WARN_AFTER_ATTEMPTS,
        }
    }
}

/// Errors of a client call; callers branch on them (exit codes, hints, polling).
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// UNAUTHENTICATED: wrong or missing token.
    #[error("the coordinator rejected the token (check --token/--token-file)")]
    Unauthenticated,
    /// NOT_FOUND, with the coordinator's message.
    #[error("{0}")]
    NotFound(String),
    /// INVALID_ARGUMENT, with the coordinator's message.
    #[error("{0}")]
    InvalidArgument(String),
    /// Any other non-retryable status.
    #[error("{method}: coordinator answered {code:?}: {message}")]
    Rpc {
        /// The RPC.
        method: &'static str,
        /// gRPC status code.
        code: Code,
        /// The status message.
        message: String,
    },
    /// Every try failed with a retryable error (a [`CallError::Exhausted`]: tries, time
    /// spent, the last address and error).
    #[error(transparent)]
    Exhausted(CallError),
    /// A blob transfer failed on this side: a local file, a stalled stream, bytes that
    /// do not match the blob's digest or size.
    #[error("{0}")]
    Transfer(String),
    /// An address cannot be made into an endpoint.
    #[error("bad coordinator address {0:?}")]
    BadAddress(String),
    /// The token cannot be sent as metadata.
    #[error("the token cannot be sent in a header (visible ASCII only)")]
    BadToken,
}

/// Maps a final status to a [`ClientError`].
fn to_error(method: &'static str, status: &Status) -> ClientError {
    match status.code() {
        Code::Unauthenticated => ClientError::Unauthenticated,
        Code::NotFound => ClientError::NotFound(status.message().to_string()),
        Code::InvalidArgument => ClientError::InvalidArgument(status.message().to_string()),
        code => ClientError::Rpc {
            method,
            code,
            message: status.message().to_string(),
        },
    }
}

/// Maps an error of the shared client to a [`ClientError`].
fn from_call_error(e: CallError) -> ClientError {
    match e {
        CallError::Rejected {
            method,
            code,
            message,
            ..
        } => to_error(method, &Status::new(code, message)),
        e @ CallError::Exhausted { .. } => ClientError::Exhausted(e),
        // The CLI gives no cancellation token.
        CallError::Cancelled { method } => ClientError::Rpc {
            method,
            code: Code::Cancelled,
            message: "cancelled".into(),
        },
    }
}

/// Client of the coordinators' `ClientService`.
#[derive(Debug)]
pub struct Client {
    inner: LeaderClient,
    policy: RetryPolicy,
}

impl Client {
    /// A client of the coordinators in `conn` with the default policy.
    pub fn new(conn: &Conn) -> Result<Self, ClientError> {
        Self::with_policy(
            conn,
            RetryPolicy {
                max_total: conn.retry_total,
                ..RetryPolicy::default()
            },
        )
    }

    /// A client with an explicit retry policy.
    pub fn with_policy(conn: &Conn, policy: RetryPolicy) -> Result<Self, ClientError> {
        let settings = ChannelSettings {
            connect_timeout: policy.connect_timeout,
            request_timeout: policy.request_timeout,
            keep_alive: None,
            tls: conn.tls.clone(),
        };
        let inner = LeaderClient::new(&conn.grpc, &conn.token, settings).map_err(|e| match e {
            ConfigError::NoCoordinators => ClientError::BadAddress(String::new()),
            ConfigError::BadAddress { addr, .. } => ClientError::BadAddress(addr),
            ConfigError::BadToken => ClientError::BadToken,
        })?;
        Ok(Client { inner, policy })
    }

    /// The retry policy in use.
    pub fn policy(&self) -> RetryPolicy {
        self.policy
    }

    /// Runs one RPC with leader following and bounded retries. `f` gets a client bound
    /// to the address of the attempt and a request already carrying the token.
    pub async fn call<M, T, F, Fut>(
        &self,
        method: &'static str,
        msg: M,
        mut f: F,
    ) -> Result<T, ClientError>
    where
        M: Clone,
        F: FnMut(ClientServiceClient<Channel>, tonic::Request<M>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        self.inner
            .call(
                method,
                &self.policy.leader_policy(),
                None,
                &msg,
                |channel, request| f(ClientServiceClient::new(channel), request),
            )
            .await
            .map_err(from_call_error)
    }

    /// `SubmitJob`. Keep `req.request_id` fixed across retries of the same intent.
    pub async fn submit_job(
        &self,
        req: SubmitJobRequest,
    ) -> Result<SubmitJobResponse, ClientError> {
        self.call(
            "SubmitJob",
            req,
            |mut c, r| async move { c.submit_job(r).await },
        )
        .await
    }

    /// `GetJob`.
    pub async fn get_job(
        &self,
        job_id: &str,
        linearizable: bool,
    ) -> Result<JobResponse, ClientError> {
        let req = GetJobRequest {
            job_id: job_id.to_string(),
            linearizable,
        };
        self.call("GetJob", req, |mut c, r| async move { c.get_job(r).await })
            .await
    }

    /// `ListJobs`.
    pub async fn list_jobs(&self, linearizable: bool) -> Result<ListJobsResponse, ClientError> {
        let req = ListJobsRequest { linearizable };
        self.call(
            "ListJobs",
            req,
            |mut c, r| async move { c.list_jobs(r).await },
        )
        .await
    }

    /// `CancelJob`.
    pub async fn cancel_job(&self, job_id: &str) -> Result<JobResponse, ClientError> {
        let req = CancelJobRequest {
            job_id: job_id.to_string(),
        };
        self.call(
            "CancelJob",
            req,
            |mut c, r| async move { c.cancel_job(r).await },
        )
        .await
    }

    /// `PauseJob`.
    pub async fn pause_job(&self, job_id: &str) -> Result<JobResponse, ClientError> {
        let req = PauseJobRequest {
            job_id: job_id.to_string(),
        };
        self.call(
            "PauseJob",
            req,
            |mut c, r| async move { c.pause_job(r).await },
        )
        .await
    }

    /// `ResumeJob`.
    pub async fn resume_job(&self, job_id: &str) -> Result<JobResponse, ClientError> {
        let req = ResumeJobRequest {
            job_id: job_id.to_string(),
        };
        self.call(
            "ResumeJob",
            req,
            |mut c, r| async move { c.resume_job(r).await },
        )
        .await
    }

    /// `DeleteJob`.
    pub async fn delete_job(
        &self,
        job_id: &str,
        checkpoints: bool,
    ) -> Result<DeleteJobResponse, ClientError> {
        let req = DeleteJobRequest {
            job_id: job_id.to_string(),
            checkpoints,
        };
        self.call(
            "DeleteJob",
            req,
            |mut c, r| async move { c.delete_job(r).await },
        )
        .await
    }

    /// `PurgeJobs`.
    pub async fn purge_jobs(
        &self,
        req: PurgeJobsRequest,
    ) -> Result<PurgeJobsResponse, ClientError> {
        self.call(
            "PurgeJobs",
            req,
            |mut c, r| async move { c.purge_jobs(r).await },
        )
        .await
    }

    /// `ClusterStatus`.
    pub async fn cluster_status(&self) -> Result<ClusterStatusResponse, ClientError> {
        self.call(
            "ClusterStatus",
            ClusterStatusRequest {},
            |mut c, r| async move { c.cluster_status(r).await },
        )
        .await
    }

    /// `CreateUser`: the new user's token, answered once.
    pub async fn create_user(
        &self,
        req: cumulus_api::CreateUserRequest,
    ) -> Result<cumulus_api::CreateUserResponse, ClientError> {
        self.call("CreateUser", req, |mut c, r| async move {
            c.create_user(r).await
        })
        .await
    }

    /// `RevokeUser`.
    pub async fn revoke_user(&self, name: &str) -> Result<(), ClientError> {
        self.call(
            "RevokeUser",
            cumulus_api::RevokeUserRequest { name: name.into() },
            |mut c, r| async move { c.revoke_user(r).await },
        )
        .await
        .map(|_| ())
    }

    /// `ListUsers`.
    pub async fn list_users(&self) -> Result<cumulus_api::ListUsersResponse, ClientError> {
        self.call(
            "ListUsers",
            cumulus_api::ListUsersRequest {},
            |mut c, r| async move { c.list_users(r).await },
        )
        .await
    }

    /// `WhoAmI`.
    pub async fn who_am_i(&self) -> Result<cumulus_api::WhoAmIResponse, ClientError> {
        self.call(
            "WhoAmI",
            cumulus_api::WhoAmIRequest {},
            |mut c, r| async move { c.who_am_i(r).await },
        )
        .await
    }

    /// `AddLearner` (waits until the learner caught up).
    pub async fn add_learner(
        &self,
        req: cumulus_api::AddLearnerRequest,
    ) -> Result<ClusterStatusResponse, ClientError> {
        self.call("AddLearner", req, |mut c, r| async move {
            c.add_learner(r).await
        })
        .await
    }

    /// `PromoteMember`.
    pub async fn promote_member(&self, node_id: u64) -> Result<ClusterStatusResponse, ClientError> {
        let req = cumulus_api::PromoteMemberRequest { node_id };
        self.call("PromoteMember", req, |mut c, r| async move {
            c.promote_member(r).await
        })
        .await
    }

    /// `RemoveMember`.
    pub async fn remove_member(&self, node_id: u64) -> Result<ClusterStatusResponse, ClientError> {
        let req = cumulus_api::RemoveMemberRequest { node_id };
        self.call("RemoveMember", req, |mut c, r| async move {
            c.remove_member(r).await
        })
        .await
    }

    /// `GetJobSummary`.
    pub async fn get_job_summary(&self, job_id: &str) -> Result<JobSummary, ClientError> {
        let req = GetJobSummaryRequest {
            job_id: job_id.to_string(),
        };
        self.call("GetJobSummary", req, |mut c, r| async move {
            c.get_job_summary(r).await
        })
        .await
    }

    /// `ListJobSummaries`.
    pub async fn list_job_summaries(
        &self,
        req: ListJobSummariesRequest,
    ) -> Result<ListJobSummariesResponse, ClientError> {
        self.call("ListJobSummaries", req, |mut c, r| async move {
            c.list_job_summaries(r).await
        })
        .await
    }

    /// `ListCheckpoints`.
    pub async fn list_checkpoints(
        &self,
        job_id: &str,
    ) -> Result<ListCheckpointsResponse, ClientError> {
        let req = ListCheckpointsRequest {
            job_id: job_id.to_string(),
        };
        self.call("ListCheckpoints", req, |mut c, r| async move {
            c.list_checkpoints(r).await
        })
        .await
    }

    /// `StatBlob`: whether the cluster stores the blob `digest`, and its size.
    pub async fn stat_blob(&self, digest: &str) -> Result<StatBlobResponse, ClientError> {
        let req = StatBlobRequest {
            digest: digest.to_string(),
        };
        self.call(
            "StatBlob",
            req,
            |mut c, r| async move { c.stat_blob(r).await },
        )
        .await
    }

    /// `PutBlob`: streams the file at `path`, whose BLAKE3 is `digest` and size
    /// `size_bytes`, in chunks of [`CHUNK_BYTES`] (the first names the blob). Answered
    /// once the cluster stored it durably. Use a client made with
    /// [`RetryPolicy::for_transfer`]. A retried attempt sends the file again from its
    /// start (the cluster keeps a blob once, by its digest).
    pub async fn put_blob(
        &self,
        path: &Path,
        digest: &str,
        size_bytes: u64,
    ) -> Result<PutBlobResponse, ClientError> {
        let upload = Upload {
            path: path.to_path_buf(),
            digest: digest.to_string(),
            size_bytes,
            failed: Arc::new(Mutex::new(None)),
        };
        let failed = upload.failed.clone();
        let result = self
            .call("PutBlob", upload, |mut c, r| async move {
                let (metadata, extensions, upload) = r.into_parts();
                c.put_blob(tonic::Request::from_parts(
                    metadata,
                    extensions,
                    upload.chunks(),
                ))
                .await
            })
            .await;
        let local = failed.lock().map(|mut f| f.take()).unwrap_or_default();
        match (result, local) {
            (Err(_), Some(e)) => Err(ClientError::Transfer(e)),
            (result, _) => result,
        }
    }

    /// `GetBlob`: writes the blob `digest` into `out`, at most `max_bytes`, each chunk
    /// within [`CHUNK_IDLE_TIMEOUT`]; checks its BLAKE3 against `digest`. Its size.
    pub async fn get_blob(
        &self,
        digest: &str,
        max_bytes: u64,
        out: &mut (dyn std::io::Write + Send),
    ) -> Result<u64, ClientError> {
        let req = GetBlobRequest {
            digest: digest.to_string(),
        };
        let mut stream = self
            .call(
                "GetBlob",
                req,
                |mut c, r| async move { c.get_blob(r).await },
            )
            .await?;
        let mut hasher = blake3::Hasher::new();
        let mut total = 0u64;
        loop {
            let chunk = match tokio::time::timeout(CHUNK_IDLE_TIMEOUT, stream.message()).await {
                Err(_) => {
                    return Err(ClientError::Transfer(format!(
                        "blob {digest}: no data for {} s",
                        CHUNK_IDLE_TIMEOUT.as_secs()
                    )));
                }
                Ok(Err(status)) => return Err(to_error("GetBlob", &status)),
                Ok(Ok(None)) => break,
                Ok(Ok(Some(chunk))) => chunk,
            };
            if chunk.data.len() > CHUNK_BYTES {
                return Err(ClientError::Transfer(format!(
                    "blob {digest}: a chunk of {} bytes, over {CHUNK_BYTES}",
                    chunk.data.len()
                )));
            }
            total += chunk.data.len() as u64;
            if total > max_bytes {
                return Err(ClientError::Transfer(format!(
                    "blob {digest}: more than the {max_bytes} bytes expected"
                )));
            }
            hasher.update(&chunk.data);
            out.write_all(&chunk.data)
                .map_err(|e| ClientError::Transfer(format!("writing blob {digest}: {e}")))?;
        }
        let got = hasher.finalize().to_hex();
        if got.as_str() != digest {
            return Err(ClientError::Transfer(format!(
                "blob {digest}: the bytes received hash to {got}"
            )));
        }
        Ok(total)
    }
}

/// An upload of `PutBlob`: the file to send; cloned for each attempt.
#[derive(Debug, Clone)]
struct Upload {
    path: PathBuf,
    digest: String,
    size_bytes: u64,
    /// Why reading the file failed, if it did (the stream then ends early and the
    /// cluster refuses the short blob; this says why).
    failed: Arc<Mutex<Option<String>>>,
}

/// Where the chunk stream of an [`Upload`] is.
struct ChunkState {
    upload: Upload,
    file: Option<tokio::fs::File>,
    left: u64,
    first: bool,
}

impl Upload {
    /// The file as chunks of at most [`CHUNK_BYTES`]: exactly `size_bytes` bytes, the
    /// first chunk naming the blob (one empty chunk for an empty blob).
    fn chunks(self) -> impl futures::Stream<Item = BlobChunk> + Send + 'static {
        let left = self.size_bytes;
        let state = ChunkState {
            upload: self,
            file: None,
            left,
            first: true,
        };
        futures::stream::unfold(state, |mut st| async move {
            use tokio::io::AsyncReadExt;
            if !st.first && st.left == 0 {
                return None;
            }
            let n = usize::try_from(st.left.min(CHUNK_BYTES as u64)).unwrap_or(CHUNK_BYTES);
            let mut data = vec![0u8; n];
            let read = async {
                if st.file.is_none() {
                    st.file = Some(tokio::fs::File::open(&st.upload.path).await?);
                }
                let file = st.file.as_mut().expect("opened above");
                file.read_exact(&mut data).await.map(drop)
            };
            if let Err(e) = read.await {
                if let Ok(mut failed) = st.upload.failed.lock() {
                    *failed = Some(format!("reading {}: {e}", st.upload.path.display()));
                }
                return None;
            }
            st.left -= n as u64;
            let (digest, size_bytes) = if st.first {
                st.first = false;
                (st.upload.digest.clone(), st.upload.size_bytes)
            } else {
                (String::new(), 0)
            };
            Some((
                BlobChunk {
                    digest,
                    size_bytes,
                    data,
                },
                st,
            ))
        })
    }
}

/// A random request id: 16 random bytes as 32 lowercase hex characters.
pub fn new_request_id() -> String {
    hex::encode(rand::random::<[u8; 16]>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_keep_the_coordinator_message() {
        assert!(matches!(
            to_error("GetJob", &Status::unauthenticated("x")),
            ClientError::Unauthenticated
        ));
        let e = to_error("GetJob", &Status::not_found("no job job-000009"));
        assert_eq!(e.to_string(), "no job job-000009");
        let e = to_error(
            "SubmitJob",
            &Status::invalid_argument("world size 0 is out of range"),
        );
        assert_eq!(e.to_string(), "world size 0 is out of range");
        assert_eq!(
            ClientError::Unauthenticated.to_string(),
            "the coordinator rejected the token (check --token/--token-file)"
        );
    }

    #[test]
    fn request_ids_are_random_hex_of_32_chars() {
        let a = new_request_id();
        let b = new_request_id();
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    mod served {
        //! The client against real tonic servers on loopback: a follower that names the
        //! leader, a leader that keeps submits idempotent, a dead address.
        use super::*;
        use cumulus_api::client_service_server::{ClientService, ClientServiceServer};
        use cumulus_api::{
            CancelJobRequest, ClusterStatusRequest, GetJobRequest, Job, ListCheckpointsRequest,
            ListJobsRequest,
        };
        use std::collections::HashMap;
        use std::sync::atomic::{AtomicU32, Ordering};
        use std::sync::{Arc, Mutex};
        use std::time::Instant;
        use tonic::metadata::MetadataMap;
        use tonic::{Request, Response};

        const TOKEN: &str = "s3cret";

        #[derive(Default)]
        struct Node {
            /// None: this node is the leader. Some(addr): a follower naming addr.
            leader: Option<String>,
            /// Answer UNAVAILABLE without a leader this many times first (an election).
            unavailable_first: AtomicU32,
            calls: AtomicU32,
            jobs: Mutex<HashMap<String, String>>,
        }

        impl Node {
            fn gate<T>(&self, req: &Request<T>) -> Result<(), Status> {
                self.calls.fetch_add(1, Ordering::SeqCst);
                let auth = req
                    .metadata()
                    .get("authorization")
                    .and_then(|v| v.to_str().ok());
                if auth != Some(&format!("Bearer {TOKEN}")) {
                    return Err(Status::unauthenticated("missing or wrong bearer token"));
                }
                if self
                    .unavailable_first
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok()
                {
                    return Err(Status::unavailable("no leader elected yet"));
                }
                if let Some(l) = &self.leader {
                    let mut md = MetadataMap::new();
                    md.insert(
                        cumulus_api::leader::LEADER_GRPC_METADATA,
                        l.parse().expect("ascii"),
                    );
                    return Err(Status::with_metadata(
                        Code::Unavailable,
                        "not the leader",
                        md,
                    ));
                }
                Ok(())
            }
        }

        struct Svc(Arc<Node>);

        #[tonic::async_trait]
        impl ClientService for Svc {
            async fn submit_job(
                &self,
                req: Request<SubmitJobRequest>,
            ) -> Result<Response<SubmitJobResponse>, Status> {
                self.0.gate(&req)?;
                let req = req.into_inner();
                let mut jobs = self.0.jobs.lock().expect("lock");
                if let Some(id) = jobs.get(&req.request_id) {
                    return Ok(Response::new(SubmitJobResponse {
                        job_id: id.clone(),
                        created: false,
                        warnings: Vec::new(),
                    }));
                }
                let id = format!("job-{:06}", jobs.len() + 1);
                jobs.insert(req.request_id, id.clone());
                Ok(Response::new(SubmitJobResponse {
                    job_id: id,
                    created: true,
                    warnings: Vec::new(),
                }))
            }
            async fn get_job(
                &self,
                req: Request<GetJobRequest>,
            ) -> Result<Response<JobResponse>, Status> {
                self.0.gate(&req)?;
                let req = req.into_inner();
                if !self
                    .0
                    .jobs
                    .lock()
                    .expect("lock")
                    .values()
                    .any(|v| *v == req.job_id)
                {
                    return Err(Status::not_found(format!("no job {}", req.job_id)));
                }
                let job = Job {
                    id: req.job_id,
                    state: "running".into(),
                    ..Default::default()
                };
                Ok(Response::new(JobResponse {
                    job: Some(job),
                    linearizable: req.linearizable,
                }))
            }
            async fn list_jobs(
                &self,
                req: Request<ListJobsRequest>,
            ) -> Result<Response<ListJobsResponse>, Status> {
                self.0.gate(&req)?;
                Ok(Response::new(ListJobsResponse::default()))
            }
            async fn cancel_job(
                &self,
                req: Request<CancelJobRequest>,
            ) -> Result<Response<JobResponse>, Status> {
                self.0.gate(&req)?;
                Err(Status::invalid_argument("cannot cancel a finished job"))
            }
            async fn pause_job(
                &self,
                req: Request<PauseJobRequest>,
            ) -> Result<Response<JobResponse>, Status> {
                self.0.gate(&req)?;
                Err(Status::failed_precondition("job is already paused"))
            }
            async fn resume_job(
                &self,
                req: Request<ResumeJobRequest>,
            ) -> Result<Response<JobResponse>, Status> {
                self.0.gate(&req)?;
                Err(Status::failed_precondition("job is running, not paused"))
            }
            async fn delete_job(
                &self,
                req: Request<DeleteJobRequest>,
            ) -> Result<Response<DeleteJobResponse>, Status> {
                self.0.gate(&req)?;
                Err(Status::failed_precondition("job is running"))
            }
            async fn purge_jobs(
                &self,
                req: Request<PurgeJobsRequest>,
            ) -> Result<Response<PurgeJobsResponse>, Status> {
                self.0.gate(&req)?;
                Ok(Response::new(PurgeJobsResponse::default()))
            }
            async fn cluster_status(
                &self,
                req: Request<ClusterStatusRequest>,
            ) -> Result<Response<ClusterStatusResponse>, Status> {
                self.0.gate(&req)?;
                Ok(Response::new(ClusterStatusResponse::default()))
            }
            async fn list_checkpoints(
                &self,
                req: Request<ListCheckpointsRequest>,
            ) -> Result<Response<ListCheckpointsResponse>, Status> {
                self.0.gate(&req)?;
                Ok(Response::new(ListCheckpointsResponse::default()))
            }
            async fn get_job_summary(
                &self,
                req: Request<cumulus_api::GetJobSummaryRequest>,
            ) -> Result<Response<cumulus_api::JobSummary>, Status> {
                self.0.gate(&req)?;
                Err(Status::not_found("no such job"))
            }
            async fn list_job_summaries(
                &self,
                req: Request<cumulus_api::ListJobSummariesRequest>,
            ) -> Result<Response<cumulus_api::ListJobSummariesResponse>, Status> {
                self.0.gate(&req)?;
                Ok(Response::new(Default::default()))
            }
            async fn add_learner(
                &self,
                req: Request<cumulus_api::AddLearnerRequest>,
            ) -> Result<Response<ClusterStatusResponse>, Status> {
                self.0.gate(&req)?;
                Err(Status::unimplemented("not served by this test node"))
            }
            async fn promote_member(
                &self,
                req: Request<cumulus_api::PromoteMemberRequest>,
            ) -> Result<Response<ClusterStatusResponse>, Status> {
                self.0.gate(&req)?;
                Err(Status::unimplemented("not served by this test node"))
            }
            async fn remove_member(
                &self,
                req: Request<cumulus_api::RemoveMemberRequest>,
            ) -> Result<Response<ClusterStatusResponse>, Status> {
                self.0.gate(&req)?;
                Err(Status::unimplemented("not served by this test node"))
            }

            async fn create_user(
                &self,
                req: Request<cumulus_api::CreateUserRequest>,
            ) -> Result<Response<cumulus_api::CreateUserResponse>, Status> {
                self.0.gate(&req)?;
                Err(Status::unimplemented("not served by this test node"))
            }

            async fn revoke_user(
                &self,
                req: Request<cumulus_api::RevokeUserRequest>,
            ) -> Result<Response<cumulus_api::Ack>, Status> {
                self.0.gate(&req)?;
                Err(Status::unimplemented("not served by this test node"))
            }

            async fn list_users(
                &self,
                req: Request<cumulus_api::ListUsersRequest>,
            ) -> Result<Response<cumulus_api::ListUsersResponse>, Status> {
                self.0.gate(&req)?;
                Err(Status::unimplemented("not served by this test node"))
            }

            async fn who_am_i(
                &self,
                req: Request<cumulus_api::WhoAmIRequest>,
            ) -> Result<Response<cumulus_api::WhoAmIResponse>, Status> {
                self.0.gate(&req)?;
                Err(Status::unimplemented("not served by this test node"))
            }

            type GetBlobStream = std::pin::Pin<
                Box<
                    dyn futures::Stream<Item = Result<cumulus_api::BlobChunk, Status>>
                        + Send
                        + 'static,
                >,
            >;

            async fn stat_blob(
                &self,
                req: Request<cumulus_api::StatBlobRequest>,
            ) -> Result<Response<cumulus_api::StatBlobResponse>, Status> {
                self.0.gate(&req)?;
                Err(Status::unimplemented("not served by this test node"))
            }

            async fn put_blob(
                &self,
                _req: Request<tonic::Streaming<cumulus_api::BlobChunk>>,
            ) -> Result<Response<cumulus_api::PutBlobResponse>, Status> {
                Err(Status::unimplemented("not served by this test node"))
            }

            async fn get_blob(
                &self,
                req: Request<cumulus_api::GetBlobRequest>,
            ) -> Result<Response<Self::GetBlobStream>, Status> {
                self.0.gate(&req)?;
                Err(Status::unimplemented("not served by this test node"))
            }
        }

        async fn serve(node: Arc<Node>) -> String {
            let incoming =
                tonic::transport::server::TcpIncoming::bind("127.0.0.1:0".parse().expect("addr"))
                    .expect("bind");
            let addr = incoming.local_addr().expect("local addr").to_string();
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(ClientServiceServer::new(Svc(node)))
                    .serve_with_incoming(incoming),
            );
            addr
        }

        fn dead_addr() -> String {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").to_string()
            // dropped here: connections to it are refused
        }

        fn conn(addrs: Vec<String>, token: &str) -> Conn {
            Conn {
                retry_total: std::time::Duration::from_secs(30),
                grpc: addrs,
                http: vec![],
                token: token.into(),
                tls: None,
            }
        }

        fn fast() -> RetryPolicy {
            RetryPolicy {
                max_attempts: 6,
                max_total: Duration::from_secs(10),
                backoff_initial: Duration::from_millis(10),
                backoff_max: Duration::from_millis(40),
                ..RetryPolicy::default()
            }
        }

        #[tokio::test]
        async fn follows_the_leader_past_a_dead_node_and_submits_once() {
            let leader = Arc::new(Node::default());
            let leader_addr = serve(leader.clone()).await;
            let follower = Arc::new(Node {
                leader: Some(leader_addr.clone()),
                ..Default::default()
            });
            let follower_addr = serve(follower.clone()).await;
            // The leader is not even in the configured list: only the hint leads there.
            let client =
                Client::with_policy(&conn(vec![dead_addr(), follower_addr], TOKEN), fast())
                    .expect("client");
            let req = SubmitJobRequest {
                allow_pending: false,
                request_id: new_request_id(),
                spec: None,
            };
            let first = client.submit_job(req.clone()).await.expect("submit");
            assert_eq!(
                first,
                SubmitJobResponse {
                    job_id: "job-000001".into(),
                    created: true,
                    warnings: Vec::new(),
                }
            );
            // A retry of the same intent (same request id) finds the same job.
            let again = client.submit_job(req).await.expect("resubmit");
            assert_eq!(
                again,
                SubmitJobResponse {
                    job_id: "job-000001".into(),
                    created: false,
                    warnings: Vec::new(),
                }
            );
            assert_eq!(
                leader.jobs.lock().expect("lock").len(),
                1,
                "exactly one job"
            );
            // The learned leader is used directly: the follower saw only the first call.
            assert_eq!(follower.calls.load(Ordering::SeqCst), 1);
            let job = client.get_job("job-000001", true).await.expect("get");
            assert!(job.linearizable);
            let err = client
                .get_job("job-000404", true)
                .await
                .expect_err("unknown");
            assert!(
                matches!(&err, ClientError::NotFound(m) if m == "no job job-000404"),
                "{err}"
            );
            let err = client.cancel_job("job-000001").await.expect_err("invalid");
            assert_eq!(err.to_string(), "cannot cancel a finished job");
        }

        #[tokio::test]
        async fn retries_through_an_election_and_rejects_a_bad_token_at_once() {
            let node = Arc::new(Node {
                unavailable_first: AtomicU32::new(2),
                ..Default::default()
            });
            let addr = serve(node.clone()).await;
            let client =
                Client::with_policy(&conn(vec![addr.clone()], TOKEN), fast()).expect("client");
            client
                .list_jobs(true)
                .await
                .expect("answers after the election");
            assert_eq!(node.calls.load(Ordering::SeqCst), 3);

            let bad = Client::with_policy(&conn(vec![addr], "wrong"), fast()).expect("client");
            let before = node.calls.load(Ordering::SeqCst);
            let err = bad.cluster_status().await.expect_err("rejected");
            assert!(matches!(err, ClientError::Unauthenticated), "{err}");
            assert_eq!(node.calls.load(Ordering::SeqCst), before + 1, "not retried");
        }

        #[tokio::test]
        async fn gives_up_after_the_bounded_number_of_tries() {
            let client = Client::with_policy(&conn(vec![dead_addr(), dead_addr()], TOKEN), fast())
                .expect("client");
            let start = Instant::now();
            let err = client
                .list_checkpoints("job-000001")
                .await
                .expect_err("nobody home");
            match err {
                ClientError::Exhausted(CallError::Exhausted {
                    attempts, method, ..
                }) => {
                    assert_eq!(attempts, 6);
                    assert_eq!(method, "ListCheckpoints");
                }
                other => panic!("unexpected {other}"),
            }
            assert!(start.elapsed() < Duration::from_secs(10));
        }
    }
}

#[cfg(test)]
mod blob_tests {
    use super::*;
    use futures::StreamExt;

    async fn chunks_of(size: usize) -> (Vec<BlobChunk>, Vec<u8>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("blob");
        let bytes: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).expect("write");
        let upload = Upload {
            path,
            digest: blake3::hash(&bytes).to_hex().to_string(),
            size_bytes: size as u64,
            failed: Arc::new(Mutex::new(None)),
        };
        (upload.chunks().collect().await, bytes)
    }

    #[tokio::test]
    async fn an_upload_is_chunks_of_at_most_chunk_bytes_the_first_naming_the_blob() {
        for size in [0, 1, CHUNK_BYTES, CHUNK_BYTES + 1, 3 * CHUNK_BYTES - 7] {
            let (chunks, bytes) = chunks_of(size).await;
            assert_eq!(
                chunks.len(),
                size.div_ceil(CHUNK_BYTES).max(1),
                "size {size}"
            );
            assert_eq!(chunks[0].digest, blake3::hash(&bytes).to_hex().as_str());
            assert_eq!(chunks[0].size_bytes, size as u64);
            assert!(
                chunks[1..]
                    .iter()
                    .all(|c| c.digest.is_empty() && c.size_bytes == 0)
            );
            assert!(chunks.iter().all(|c| c.data.len() <= CHUNK_BYTES));
            let joined: Vec<u8> = chunks.into_iter().flat_map(|c| c.data).collect();
            assert_eq!(joined, bytes, "size {size}");
        }
    }

    #[tokio::test]
    async fn a_file_shorter_than_announced_ends_the_stream_and_says_why() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("blob");
        std::fs::write(&path, vec![1u8; 10]).expect("write");
        let upload = Upload {
            path,
            digest: "ab".repeat(32),
            size_bytes: CHUNK_BYTES as u64 + 5,
            failed: Arc::new(Mutex::new(None)),
        };
        let failed = upload.failed.clone();
        let chunks: Vec<BlobChunk> = upload.chunks().collect().await;
        assert!(chunks.is_empty(), "the first read already fails");
        let why = failed.lock().expect("lock").clone().expect("a reason");
        assert!(why.contains("reading") && why.contains("blob"), "{why}");
    }

    #[test]
    fn transfers_get_time_for_their_bytes() {
        let p = RetryPolicy::default();
        let t = p.for_transfer(512 * 1024 * 1024);
        assert_eq!(
            t.request_timeout,
            p.request_timeout + Duration::from_secs(512)
        );
        assert_eq!(p.for_transfer(0).request_timeout, p.request_timeout);
    }
}
