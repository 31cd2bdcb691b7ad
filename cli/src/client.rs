//! gRPC client of the coordinators' `ClientService`, with leader following.
//!
//! Every call carries `authorization: Bearer <token>`. A follower answers a write with
//! UNAVAILABLE and the leader's address in [`cumulus_proto::LEADER_GRPC_METADATA`]: the
//! call is retried there at once. A transport error, a timeout, or UNAVAILABLE without a
//! leader (an election in progress) rotates to the next configured address, with
//! backoff. Both are bounded by [`RetryPolicy`] (default 20 tries within 30 s).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cumulus_proto::client_service_client::ClientServiceClient;
use cumulus_proto::{
    CancelJobRequest, ClusterStatusRequest, ClusterStatusResponse, GetJobRequest, JobResponse,
    ListCheckpointsRequest, ListCheckpointsResponse, ListJobsRequest, ListJobsResponse,
    SubmitJobRequest, SubmitJobResponse,
};
use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::config::Conn;

/// A failing call warns once (on stderr, via tracing) after this many tries.
pub const WARN_AFTER_ATTEMPTS: u32 = 5;

/// Most distinct addresses (configured + leader hints) a client keeps channels for.
pub const MAX_CHANNELS: usize = 64;

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
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 20,
            max_total: Duration::from_secs(30),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(10),
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

    /// Backoff before retry number `retry` (1-based) after a rotate.
    pub fn backoff(&self, retry: u32) -> Duration {
        let factor = 1u32
            .checked_shl(retry.saturating_sub(1).min(16))
            .unwrap_or(u32::MAX);
        self.backoff_initial
            .saturating_mul(factor)
            .min(self.backoff_max)
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
    /// Every try failed with a retryable error.
    #[error(
        "{method}: no coordinator answered after {attempts} tries in {elapsed_ms} ms (last, from {last_addr}: {last})"
    )]
    Exhausted {
        /// The RPC.
        method: &'static str,
        /// Tries made.
        attempts: u32,
        /// Time spent, milliseconds.
        elapsed_ms: u64,
        /// Address of the last try.
        last_addr: String,
        /// Last error.
        last: String,
    },
    /// An address cannot be made into an endpoint.
    #[error("bad coordinator address {0:?}")]
    BadAddress(String),
    /// The token cannot be sent as metadata.
    #[error("the token cannot be sent in a header (visible ASCII only)")]
    BadToken,
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Retry at once at this leader address.
    Leader(String),
    /// Retry at the next configured address, after backoff.
    Rotate,
    /// Give up with this error.
    Fail,
}

/// Classifies a failed attempt (pure: unit-tested on constructed statuses).
pub fn classify(status: &Status) -> Next {
    match status.code() {
        Code::Unavailable => match leader_hint(status.metadata()) {
            Some(addr) => Next::Leader(addr),
            None => Next::Rotate,
        },
        // Endpoint timeouts surface as CANCELLED ("Timeout expired").
        Code::Cancelled | Code::DeadlineExceeded => Next::Rotate,
        // A connection reset mid-call surfaces as UNKNOWN/INTERNAL with a transport message.
        Code::Unknown | Code::Internal if is_transport_message(status.message()) => Next::Rotate,
        _ => Next::Fail,
    }
}

fn is_transport_message(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("transport error") || m.contains("h2 protocol error") || m.contains("connection")
}

/// The leader address named by an UNAVAILABLE answer, normalized to `host:port`.
pub fn leader_hint(md: &MetadataMap) -> Option<String> {
    let v = md
        .get(cumulus_proto::LEADER_GRPC_METADATA)?
        .to_str()
        .ok()?
        .trim();
    let v = v.strip_prefix("http://").unwrap_or(v);
    let v = v.strip_suffix('/').unwrap_or(v);
    if v.is_empty() || !v.contains(':') {
        return None;
    }
    Some(v.to_string())
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

/// The address choice of one call: a leader hint when there is one, else the configured
/// addresses in rotation, starting at the one that answered last.
#[derive(Debug, Clone)]
pub struct Rotation {
    addrs: Vec<String>,
    index: usize,
    hint: Option<String>,
}

impl Rotation {
    /// Starts at `preferred` (a leader learned by an earlier call) or `addrs[start]`.
    pub fn new(addrs: Vec<String>, start: usize, preferred: Option<String>) -> Self {
        let index = if addrs.is_empty() {
            0
        } else {
            start % addrs.len()
        };
        Rotation {
            addrs,
            index,
            hint: preferred,
        }
    }

    /// The address of the next attempt.
    pub fn current(&self) -> &str {
        self.hint
            .as_deref()
            .unwrap_or_else(|| &self.addrs[self.index])
    }

    /// Follows a leader hint. Returns false when the hint is the address just tried
    /// (a confused node): the caller then rotates instead.
    pub fn follow(&mut self, leader: String) -> bool {
        if leader == self.current() {
            return false;
        }
        self.hint = Some(leader);
        true
    }

    /// Moves on after a failed attempt: from a leader hint back to the configured address
    /// in use (it may know the new leader by now), else to the next configured address.
    pub fn rotate(&mut self) {
        if self.hint.take().is_none() {
            self.index = (self.index + 1) % self.addrs.len();
        }
    }

    /// Index of the configured address in use.
    pub fn index(&self) -> usize {
        self.index
    }
}

/// Client of the coordinators' `ClientService`.
#[derive(Debug)]
pub struct Client {
    addrs: Vec<String>,
    auth: AsciiMetadataValue,
    policy: RetryPolicy,
    state: Mutex<ClientState>,
}

#[derive(Debug, Default)]
struct ClientState {
    /// The leader learned from a hint, or the address that answered last.
    preferred: Option<String>,
    /// Rotation start for the next call.
    next_index: usize,
    /// One lazily connected channel per address (≤ [`MAX_CHANNELS`]).
    channels: HashMap<String, Channel>,
}

impl Client {
    /// A client of the coordinators in `conn` with the default policy.
    pub fn new(conn: &Conn) -> Result<Self, ClientError> {
        Self::with_policy(conn, RetryPolicy::default())
    }

    /// A client with an explicit retry policy.
    pub fn with_policy(conn: &Conn, policy: RetryPolicy) -> Result<Self, ClientError> {
        if conn.grpc.is_empty() {
            return Err(ClientError::BadAddress(String::new()));
        }
        let auth = AsciiMetadataValue::try_from(format!("Bearer {}", conn.token))
            .map_err(|_| ClientError::BadToken)?;
        for a in &conn.grpc {
            endpoint(a, &policy)?;
        }
        Ok(Client {
            addrs: conn.grpc.clone(),
            auth,
            policy,
            state: Mutex::new(ClientState::default()),
        })
    }

    /// The retry policy in use.
    pub fn policy(&self) -> RetryPolicy {
        self.policy
    }

    fn channel(&self, addr: &str) -> Result<Channel, ClientError> {
        let mut st = self
            .state
            .lock()
            .expect("client state lock is never poisoned: no panics while held");
        if let Some(c) = st.channels.get(addr) {
            return Ok(c.clone());
        }
        let ch = endpoint(addr, &self.policy)?.connect_lazy();
        if st.channels.len() >= MAX_CHANNELS {
            st.channels.clear();
        }
        st.channels.insert(addr.to_string(), ch.clone());
        Ok(ch)
    }

    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        req.metadata_mut()
            .insert("authorization", self.auth.clone());
        req
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
        let start = Instant::now();
        let mut rotation = {
            let st = self
                .state
                .lock()
                .expect("client state lock is never poisoned: no panics while held");
            Rotation::new(self.addrs.clone(), st.next_index, st.preferred.clone())
        };
        let mut attempts = 0u32;
        let mut rotations = 0u32;
        loop {
            attempts += 1;
            let addr = rotation.current().to_string();
            let result = match self.channel(&addr) {
                Ok(ch) => f(ClientServiceClient::new(ch), self.request(msg.clone())).await,
                Err(e) => Err(Status::unavailable(e.to_string())),
            };
            let status = match result {
                Ok(resp) => {
                    let mut st = self
                        .state
                        .lock()
                        .expect("client state lock is never poisoned: no panics while held");
                    st.preferred = Some(addr);
                    st.next_index = rotation.index();
                    return Ok(resp.into_inner());
                }
                Err(s) => s,
            };
            let next = classify(&status);
            tracing::debug!(method, %addr, code = ?status.code(), message = status.message(), ?next, "attempt failed");
            let wait = match next {
                Next::Fail => {
                    // A stale leader preference must not stick to later calls.
                    if status.code() != Code::Unauthenticated {
                        self.state
                            .lock()
                            .expect("client state lock is never poisoned: no panics while held")
                            .preferred = Some(addr);
                    }
                    return Err(to_error(method, &status));
                }
                Next::Leader(leader) => {
                    if rotation.follow(leader) {
                        Duration::ZERO
                    } else {
                        rotations += 1;
                        rotation.rotate();
                        self.policy.backoff(rotations)
                    }
                }
                Next::Rotate => {
                    rotations += 1;
                    rotation.rotate();
                    self.policy.backoff(rotations)
                }
            };
            if attempts >= self.policy.max_attempts
                || start.elapsed() + wait >= self.policy.max_total
            {
                let mut st = self
                    .state
                    .lock()
                    .expect("client state lock is never poisoned: no panics while held");
                st.preferred = None;
                st.next_index = rotation.index();
                return Err(ClientError::Exhausted {
                    method,
                    attempts,
                    elapsed_ms: start.elapsed().as_millis() as u64,
                    last_addr: addr,
                    last: format!("{:?}: {}", status.code(), status.message()),
                });
            }
            if attempts == WARN_AFTER_ATTEMPTS {
                tracing::warn!(
                    "{method}: no coordinator has answered after {attempts} tries (last, from {addr}: {}); still trying for up to {} s",
                    status.message(),
                    self.policy
                        .max_total
                        .saturating_sub(start.elapsed())
                        .as_secs()
                );
            }
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
        }
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

    /// `ClusterStatus`.
    pub async fn cluster_status(&self) -> Result<ClusterStatusResponse, ClientError> {
        self.call(
            "ClusterStatus",
            ClusterStatusRequest {},
            |mut c, r| async move { c.cluster_status(r).await },
        )
        .await
    }

    /// `AddLearner` (waits until the learner caught up).
    pub async fn add_learner(
        &self,
        req: cumulus_proto::AddLearnerRequest,
    ) -> Result<ClusterStatusResponse, ClientError> {
        self.call("AddLearner", req, |mut c, r| async move {
            c.add_learner(r).await
        })
        .await
    }

    /// `PromoteMember`.
    pub async fn promote_member(&self, node_id: u64) -> Result<ClusterStatusResponse, ClientError> {
        let req = cumulus_proto::PromoteMemberRequest { node_id };
        self.call("PromoteMember", req, |mut c, r| async move {
            c.promote_member(r).await
        })
        .await
    }

    /// `RemoveMember`.
    pub async fn remove_member(&self, node_id: u64) -> Result<ClusterStatusResponse, ClientError> {
        let req = cumulus_proto::RemoveMemberRequest { node_id };
        self.call("RemoveMember", req, |mut c, r| async move {
            c.remove_member(r).await
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
}

fn endpoint(addr: &str, policy: &RetryPolicy) -> Result<Endpoint, ClientError> {
    Endpoint::from_shared(format!("http://{addr}"))
        .map(|e| {
            e.connect_timeout(policy.connect_timeout)
                .timeout(policy.request_timeout)
        })
        .map_err(|_| ClientError::BadAddress(addr.to_string()))
}

/// A random request id: 16 random bytes as 32 lowercase hex characters.
pub fn new_request_id() -> String {
    hex::encode(rand::random::<[u8; 16]>())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unavailable_with_leader(addr: &str) -> Status {
        let mut md = MetadataMap::new();
        md.insert(
            cumulus_proto::LEADER_GRPC_METADATA,
            addr.parse().expect("ascii"),
        );
        Status::with_metadata(Code::Unavailable, "not the leader", md)
    }

    #[test]
    fn classify_follows_leader_hint_and_rotates_otherwise() {
        assert_eq!(
            classify(&unavailable_with_leader("127.0.0.1:5")),
            Next::Leader("127.0.0.1:5".into())
        );
        assert_eq!(
            classify(&unavailable_with_leader("http://127.0.0.1:5/")),
            Next::Leader("127.0.0.1:5".into())
        );
        assert_eq!(classify(&unavailable_with_leader("")), Next::Rotate);
        assert_eq!(
            classify(&Status::unavailable("no leader yet")),
            Next::Rotate
        );
        assert_eq!(
            classify(&Status::cancelled("Timeout expired")),
            Next::Rotate
        );
        assert_eq!(classify(&Status::deadline_exceeded("slow")), Next::Rotate);
        assert_eq!(classify(&Status::unknown("transport error")), Next::Rotate);
        assert_eq!(
            classify(&Status::unknown("the handler blew up")),
            Next::Fail
        );
        assert_eq!(classify(&Status::unauthenticated("bad token")), Next::Fail);
        assert_eq!(
            classify(&Status::not_found("no job job-000009")),
            Next::Fail
        );
        assert_eq!(
            classify(&Status::invalid_argument("world size 0")),
            Next::Fail
        );
    }

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
    fn rotation_visits_every_address_and_follows_hints() {
        let addrs: Vec<String> = vec!["a:1".into(), "b:1".into(), "c:1".into()];
        let mut r = Rotation::new(addrs.clone(), 1, None);
        assert_eq!(r.current(), "b:1");
        r.rotate();
        assert_eq!(r.current(), "c:1");
        r.rotate();
        assert_eq!(r.current(), "a:1");
        assert!(
            r.follow("z:9".into()),
            "a leader outside the list is followed"
        );
        assert_eq!(r.current(), "z:9");
        assert!(
            !r.follow("z:9".into()),
            "a hint naming the address just tried is not followed"
        );
        r.rotate();
        assert_eq!(
            r.current(),
            "a:1",
            "after a hint fails, rotation resumes where it was"
        );
        r.rotate();
        assert_eq!(r.current(), "b:1");

        let mut r = Rotation::new(addrs, 0, Some("c:1".into()));
        assert_eq!(r.current(), "c:1", "the preferred leader goes first");
        r.rotate();
        assert_eq!(r.current(), "a:1");
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        let p = RetryPolicy::default();
        assert_eq!(p.backoff(1), Duration::from_millis(100));
        assert_eq!(p.backoff(2), Duration::from_millis(200));
        assert_eq!(p.backoff(5), Duration::from_millis(1600));
        assert_eq!(p.backoff(6), Duration::from_secs(2));
        assert_eq!(p.backoff(1000), Duration::from_secs(2));
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
        use cumulus_proto::client_service_server::{ClientService, ClientServiceServer};
        use cumulus_proto::{
            CancelJobRequest, ClusterStatusRequest, GetJobRequest, Job, ListCheckpointsRequest,
            ListJobsRequest,
        };
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU32, Ordering};
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
                        cumulus_proto::LEADER_GRPC_METADATA,
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
                    }));
                }
                let id = format!("job-{:06}", jobs.len() + 1);
                jobs.insert(req.request_id, id.clone());
                Ok(Response::new(SubmitJobResponse {
                    job_id: id,
                    created: true,
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
            async fn add_learner(
                &self,
                req: Request<cumulus_proto::AddLearnerRequest>,
            ) -> Result<Response<ClusterStatusResponse>, Status> {
                self.0.gate(&req)?;
                Err(Status::unimplemented("not served by this test node"))
            }
            async fn promote_member(
                &self,
                req: Request<cumulus_proto::PromoteMemberRequest>,
            ) -> Result<Response<ClusterStatusResponse>, Status> {
                self.0.gate(&req)?;
                Err(Status::unimplemented("not served by this test node"))
            }
            async fn remove_member(
                &self,
                req: Request<cumulus_proto::RemoveMemberRequest>,
            ) -> Result<Response<ClusterStatusResponse>, Status> {
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
                grpc: addrs,
                http: vec![],
                token: token.into(),
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
                request_id: new_request_id(),
                spec: None,
            };
            let first = client.submit_job(req.clone()).await.expect("submit");
            assert_eq!(
                first,
                SubmitJobResponse {
                    job_id: "job-000001".into(),
                    created: true
                }
            );
            // A retry of the same intent (same request id) finds the same job.
            let again = client.submit_job(req).await.expect("resubmit");
            assert_eq!(
                again,
                SubmitJobResponse {
                    job_id: "job-000001".into(),
                    created: false
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
                ClientError::Exhausted {
                    attempts, method, ..
                } => {
                    assert_eq!(attempts, 6);
                    assert_eq!(method, "ListCheckpoints");
                }
                other => panic!("unexpected {other}"),
            }
            assert!(start.elapsed() < Duration::from_secs(10));
        }
    }
}
