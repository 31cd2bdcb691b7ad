//! The gRPC `WorkerService`: registration, heartbeats (soft state, answered with the
//! desired rank attempts), and the rank events and checkpoint parts the leader commits.

use openraft::async_runtime::watch::WatchReceiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cumulus_api::v1;
use cumulus_api::v1::worker_service_server::WorkerService;
use cumulus_api::{AttemptKey, FileEntry};
use cumulus_raft_store::Command;
use cumulus_raft_store::state::{JobState, PartInfo, WorkerState};
use tonic::{Request, Response, Status};

use crate::blobs;
use crate::convert::{desired_digest, desired_for_worker, next_backoff_end_ms, wanted_digest};
use crate::error::{ApiError, to_status};
use crate::node::Node;
use crate::soft::{ProgressSoft, WorkerSoft, now_ms};

/// Most observed ranks accepted in one heartbeat.
pub const MAX_OBSERVED_PER_HEARTBEAT: usize = 4_096;
/// Most warm spares one heartbeat may list (an agent keeps at most
/// `cumulus_api::limits::MAX_WARM_SPARES` per job; the list is soft state, shown in the
/// cluster status).
pub const MAX_WARM_SPARES_PER_HEARTBEAT: usize = 1_024;
/// Longest `WatchDesired` long poll, in milliseconds.
pub const MAX_WATCH_MS: u64 = 30_000;

/// The reply to a heartbeat or a watch: the worker's desired set, versioned by the
/// applied log index and the leader's clock (read under one lock), and the earliest
/// backoff end among its pending attempts.
fn desired_reply(node: &Node, worker_id: &str) -> (v1::HeartbeatResponse, Option<u64>) {
    let term = node.raft.metrics().borrow_watched().current_term;
    let now = now_ms();
    node.shared.read(|d| {
        let registered = d
            .state
            .workers
            .get(worker_id)
            .is_some_and(|w| w.state == WorkerState::Alive);
        let desired = if registered {
            desired_for_worker(&d.state, worker_id, now)
        } else {
            Vec::new()
        };
        let next = if registered {
            next_backoff_end_ms(&d.state, worker_id, now)
        } else {
            None
        };
        let mut spare_jobs: Vec<String> = if registered {
            d.state
                .job_index()
                .placed_on(worker_id)
                .filter(|(job_id, _)| {
                    d.state
                        .jobs
                        .get(job_id)
                        .is_some_and(|j| j.state == JobState::Running && j.spec.warm_spares > 0)
                })
                .map(|(job_id, _)| job_id.clone())
                .collect()
        } else {
            Vec::new()
        };
        spare_jobs.sort_unstable();
        spare_jobs.dedup();
        let reply = v1::HeartbeatResponse {
            registered,
            desired_digest: desired_digest(&desired),
            spare_jobs,
            desired,
            term,
            desired_index: d.last_applied.map_or(0, |l| l.index),
            desired_at_ms: now,
        };
        (reply, next)
    })
}

/// Serves the worker API of one node.
pub struct WorkerSvc {
    /// This coordinator's shared context (state, soft state, proposer).
    pub node: Arc<Node>,
    /// The cluster CA that signs enrolling workers' certificates (`--tls-ca-key`);
    /// `None`: this coordinator answers `Enrol` with FAILED_PRECONDITION.
    pub enrolment_ca: Option<Arc<cumulus_tls::generate::ClusterCa>>,
}

/// Most host names one enrolment may ask for.
pub const MAX_ENROL_HOSTS: usize = 16;

/// Checks the host names an enrolling worker asks its certificate to serve: at most
/// [`MAX_ENROL_HOSTS`], each an IP address or a DNS name (labels of 1..=63 letters,
/// digits and hyphens, 253 bytes in all).
fn check_enrol_hosts(hosts: &[String]) -> Result<(), Status> {
    if hosts.len() > MAX_ENROL_HOSTS {
        return Err(Status::invalid_argument(format!(
            "{} host names, more than {MAX_ENROL_HOSTS}",
            hosts.len()
        )));
    }
    for h in hosts {
        let dns_ok = h.len() <= 253
            && h.split('.').all(|label| {
                (1..=63).contains(&label.len())
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            });
        if !dns_ok && h.parse::<std::net::IpAddr>().is_err() {
            return Err(Status::invalid_argument(format!(
                "host {:?} is neither an IP address nor a DNS name",
                h.escape_debug().to_string()
            )));
        }
    }
    Ok(())
}

fn check_worker_id(id: &str) -> Result<(), Status> {
    cumulus_api::ids::check_worker_id(id)
        .map_err(|e| Status::invalid_argument(format!("invalid worker id: {e}")))
}

/// The worker a request's connection proved to be: the worker id its verified client
/// certificate names (`None`: plaintext, no certificate, or not a worker's).
fn certified_worker<T>(req: &Request<T>) -> Option<String> {
    match req
        .extensions()
        .get::<cumulus_listen::ConnInfo>()?
        .peer_identity()?
    {
        cumulus_tls::Identity::Worker(id) => Some(id),
        _ => None,
    }
}

/// Checks the worker id a request claims and, with TLS on (`tls`), that the
/// connection's certificate names that worker: a worker can no longer report, register
/// or commit as another (the cluster token alone proves nothing about which worker).
fn check_worker(tls: bool, certified: Option<String>, id: &str) -> Result<(), Status> {
    check_worker_id(id)?;
    if !tls || certified.as_deref() == Some(id) {
        return Ok(());
    }
    tracing::warn!(
        claimed = id,
        ?certified,
        "refused a worker request whose connection's certificate does not name the worker"
    );
    Err(Status::permission_denied(match certified {
        Some(other) => {
            format!("worker {id:?} is refused: the connection's certificate names worker {other:?}")
        }
        None => format!("worker {id:?} is refused: the connection presents no worker certificate"),
    }))
}

fn check_job_id(id: &str) -> Result<(), Status> {
    cumulus_api::ids::check_job_id(id)
        .map_err(|e| Status::invalid_argument(format!("invalid job id: {e}")))
}

#[tonic::async_trait]
impl WorkerService for WorkerSvc {
    async fn register(
        &self,
        req: Request<v1::RegisterWorkerRequest>,
    ) -> Result<Response<v1::RegisterWorkerResponse>, Status> {
        let certified = certified_worker(&req);
        let r = req.into_inner();
        check_worker(self.node.tls, certified, &r.worker_id)?;
        if r.host.is_empty() || r.http_addr.is_empty() || r.slots == 0 || r.slots > 4_096 {
            return Err(Status::invalid_argument(
                "host, http_addr and 1..=4096 slots are required",
            ));
        }
        if r.gpus.len() > cumulus_api::limits::MAX_GPUS_PER_WORKER {
            return Err(Status::invalid_argument(format!(
                "{} GPUs, more than the limit of {}",
                r.gpus.len(),
                cumulus_api::limits::MAX_GPUS_PER_WORKER
            )));
        }
        let gpus = r
            .gpus
            .iter()
            .map(|g| cumulus_raft_store::state::GpuDevice {
                index: g.index,
                uuid: g.uuid.clone(),
                name: g.name.clone(),
                memory_total_bytes: g.memory_total_bytes,
            })
            .collect();
        self.node.require_leader().map_err(to_status)?;
        self.node
            .propose_ok(Command::RegisterWorker {
                worker_id: r.worker_id.clone(),
                host: r.host,
                http_addr: r.http_addr,
                slots: r.slots,
                gpus,
                at_ms: now_ms(),
            })
            .await
            .map_err(|e| match e {
                // apply's refusal of the inventory is the request's fault.
                ApiError::FailedPrecondition(reason) => Status::invalid_argument(reason),
                e => to_status(e),
            })?;
        self.node.soft().workers.insert(
            r.worker_id,
            WorkerSoft {
                last_seen: Instant::now(),
                observed: Vec::new(),
                resources: v1::Resources::default(),
            },
        );
        Ok(Response::new(v1::RegisterWorkerResponse {
            heartbeat_interval_ms: self.node.limits.heartbeat_interval_ms,
            heartbeat_timeout_ms: self.node.limits.heartbeat_timeout_ms,
        }))
    }

    async fn heartbeat(
        &self,
        req: Request<v1::HeartbeatRequest>,
    ) -> Result<Response<v1::HeartbeatResponse>, Status> {
        let certified = certified_worker(&req);
        let r = req.into_inner();
        check_worker(self.node.tls, certified, &r.worker_id)?;
        if r.observed.len() > MAX_OBSERVED_PER_HEARTBEAT {
            return Err(Status::invalid_argument(
                "too many observed ranks in one heartbeat",
            ));
        }
        if let Some(res) = &r.resources
            && (res.gpus.len() > cumulus_api::limits::MAX_GPUS_PER_WORKER
                || res.gpus.iter().any(|g| {
                    g.uuid.len() > cumulus_api::limits::MAX_GPU_UUID_BYTES
                        || g.error.len() > cumulus_api::limits::MAX_GPU_ERROR_BYTES
                }))
        {
            return Err(Status::invalid_argument(format!(
                "a heartbeat carries at most {} GPUs, UUIDs of at most {} bytes and errors of \
                 at most {} bytes",
                cumulus_api::limits::MAX_GPUS_PER_WORKER,
                cumulus_api::limits::MAX_GPU_UUID_BYTES,
                cumulus_api::limits::MAX_GPU_ERROR_BYTES
            )));
        }
        if let Some(res) = &r.resources
            && (res.warm_spares.len() > MAX_WARM_SPARES_PER_HEARTBEAT
                || res
                    .warm_spares
                    .iter()
                    .any(|w| !cumulus_api::is_job_id(&w.job_id)))
        {
            return Err(Status::invalid_argument(format!(
                "a heartbeat carries at most {MAX_WARM_SPARES_PER_HEARTBEAT} warm spares, \
                 each of a job id"
            )));
        }
        self.node.require_leader().map_err(to_status)?;
        let registered = self.node.read_state(|s| {
            s.workers
                .get(&r.worker_id)
                .is_some_and(|w| w.state == WorkerState::Alive)
        });
        if !registered {
            return Ok(Response::new(desired_reply(&self.node, &r.worker_id).0));
        }
        crate::metrics::metrics().heartbeats.inc();
        {
            let at = Instant::now();
            let mut soft = self.node.soft();
            for o in &r.observed {
                let key = AttemptKey::new(o.job_id.clone(), o.rank, o.attempt);
                let p = soft
                    .progress
                    .entry(key)
                    .or_insert(ProgressSoft::observed_at(at, o.step, o.total_steps));
                p.advance(at, o.step);
                // An agent older than `reported` sends a step only once the rank reported.
                p.mark_reported(at, o.reported || o.step > 0);
                p.total_steps = o.total_steps;
                p.seen_at = at;
                p.in_process = o.in_process;
                // Bounded names only (the agent checks them too); NaN and infinities
                // are kept: a diverging run shows them.
                p.metrics = o
                    .metrics
                    .iter()
                    .filter(|(k, _)| {
                        !k.is_empty() && k.len() <= cumulus_api::limits::MAX_METRIC_NAME_BYTES
                    })
                    .take(cumulus_api::limits::MAX_METRICS)
                    .map(|(k, v)| (k.clone(), *v))
                    .collect();
            }
            soft.workers.insert(
                r.worker_id.clone(),
                WorkerSoft {
                    last_seen: at,
                    // The metrics live in `progress`; kept once, not twice.
                    observed: r
                        .observed
                        .into_iter()
                        .map(|mut o| {
                            o.metrics.clear();
                            o
                        })
                        .collect(),
                    resources: r.resources.unwrap_or_default(),
                },
            );
        }
        Ok(Response::new(desired_reply(&self.node, &r.worker_id).0))
    }

    async fn watch_desired(
        &self,
        req: Request<v1::WatchDesiredRequest>,
    ) -> Result<Response<v1::HeartbeatResponse>, Status> {
        let certified = certified_worker(&req);
        let r = req.into_inner();
        check_worker(self.node.tls, certified, &r.worker_id)?;
        if r.timeout_ms == 0 || r.timeout_ms > MAX_WATCH_MS {
            return Err(Status::invalid_argument(format!(
                "timeout_ms must be 1..={MAX_WATCH_MS}"
            )));
        }
        self.node.require_leader().map_err(to_status)?;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(r.timeout_ms);
        let mut changes = self.node.shared.changes.subscribe();
        loop {
            // Every applied change wakes every watcher: the check is the digest alone,
            // O(the worker's ranks); the desired set is built only for the answer.
            let wall_now = now_ms();
            let (registered, digest, next_backoff_end) = self.node.shared.read(|d| {
                let registered = d
                    .state
                    .workers
                    .get(&r.worker_id)
                    .is_some_and(|w| w.state == WorkerState::Alive);
                (
                    registered,
                    wanted_digest(&d.state, &r.worker_id, wall_now),
                    next_backoff_end_ms(&d.state, &r.worker_id, wall_now),
                )
            });
            let now = tokio::time::Instant::now();
            if !registered || digest != r.known_digest || now >= deadline {
                let (reply, _) = desired_reply(&self.node, &r.worker_id);
                return Ok(Response::new(reply));
            }
            // Wake when the state changes, when a pending attempt's backoff ends, or at the deadline.
            let wake = next_backoff_end
                .map(|at| now + Duration::from_millis(at.saturating_sub(now_ms())))
                .map_or(deadline, |w| w.min(deadline));
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                changed = changes.changed() => {
                    if changed.is_err() {
                        return Err(Status::unavailable("the coordinator is shutting down"));
                    }
                }
            }
            if !self.node.is_leader() {
                return Err(to_status(ApiError::NotLeader {
                    leader: self.node.leader_node(),
                }));
            }
        }
    }

    async fn rank_started(
        &self,
        req: Request<v1::RankStartedRequest>,
    ) -> Result<Response<v1::Ack>, Status> {
        let certified = certified_worker(&req);
        let r = req.into_inner();
        check_worker(self.node.tls, certified, &r.worker_id)?;
        check_job_id(&r.job_id)?;
        self.node
            .propose_ok(Command::RankStarted {
                job_id: r.job_id,
                rank: r.rank,
                attempt: r.attempt,
                worker_id: r.worker_id,
                pid: r.pid,
                at_ms: now_ms(),
            })
            .await
            .map_err(to_status)?;
        Ok(Response::new(v1::Ack {}))
    }

    async fn rank_exited(
        &self,
        req: Request<v1::RankExitedRequest>,
    ) -> Result<Response<v1::Ack>, Status> {
        let certified = certified_worker(&req);
        let r = req.into_inner();
        check_worker(self.node.tls, certified, &r.worker_id)?;
        check_job_id(&r.job_id)?;
        if r.spawn_error.len() > 4_096 {
            return Err(Status::invalid_argument(
                "spawn_error is longer than 4096 bytes",
            ));
        }
        if r.agent_evidence.len() > 4_096 {
            return Err(Status::invalid_argument(
                "agent_evidence is longer than 4096 bytes",
            ));
        }
        if r.exit_code.is_none() && r.signal.is_none() && r.spawn_error.is_empty() {
            return Err(Status::invalid_argument(
                "an exit needs an exit code, a signal or a spawn error",
            ));
        }
        let artifacts = r.artifacts.as_ref().map(crate::convert::blob_from_proto);
        if let Some(a) = &artifacts
            && !a.is_valid()
        {
            return Err(Status::invalid_argument(format!(
                "artifacts {:?} of {} bytes is not a blob: it needs a BLAKE3 digest (64 \
                 lowercase hex digits) and a size between 1 and {} bytes",
                cumulus_api::text::escape_control(&a.digest.chars().take(80).collect::<String>()),
                a.size_bytes,
                cumulus_api::blobs::MAX_BLOB_BYTES
            )));
        }
        self.node
            .propose_ok(Command::RankExited {
                job_id: r.job_id,
                rank: r.rank,
                attempt: r.attempt,
                worker_id: r.worker_id,
                exit_code: r.exit_code,
                signal: r.signal,
                spawn_error: r.spawn_error,
                at_ms: now_ms(),
                agent_fault: r.agent_fault,
                agent_evidence: r.agent_evidence,
                exec_failed: r.exec_failed,
                step: r.step,
                total_steps: r.total_steps,
                artifacts,
                cause: cumulus_api::text::bounded_line(
                    &r.cause,
                    cumulus_api::limits::MAX_EXIT_CAUSE_BYTES,
                ),
            })
            .await
            .map_err(to_status)?;
        Ok(Response::new(v1::Ack {}))
    }

    async fn commit_checkpoint_part(
        &self,
        req: Request<v1::CommitCheckpointPartRequest>,
    ) -> Result<Response<v1::Ack>, Status> {
        let started = Instant::now();
        let certified = certified_worker(&req);
        let r = req.into_inner();
        check_worker(self.node.tls, certified, &r.worker_id)?;
        check_job_id(&r.job_id)?;
        let files: Vec<FileEntry> = r.files.into_iter().map(FileEntry::from).collect();
        let part_bytes: u64 = files.iter().map(|f| f.size_bytes).sum();
        // The part's paths, digests, directory and state are checked here, before a byte
        // of it reaches the log; `apply` checks its step and attempt against the job.
        let record = cumulus_ckpt::PartRecord::from_reported(
            r.step,
            r.rank,
            r.attempt,
            r.dir,
            files,
            &r.state_json,
        )
        .map_err(|e| Status::invalid_argument(format!("checkpoint part: {e}")))?;
        // Only the worker the attempt is placed on may commit for it.
        let placed = self.node.read_state(|s| {
            s.jobs
                .get(&r.job_id)
                .and_then(|j| j.ranks.get(r.rank as usize))
                .is_some_and(|rk| rk.worker_id.as_deref() == Some(r.worker_id.as_str()))
        });
        if !placed {
            return Err(to_status(ApiError::FailedPrecondition(format!(
                "rank {} of {} is not placed on {}",
                r.rank, r.job_id, r.worker_id
            ))));
        }
        let part = PartInfo {
            rank: r.rank,
            attempt: r.attempt,
            dir: record.dir,
            files: record.files,
            state_json: r.state_json,
        };
        self.node
            .propose_ok(Command::CheckpointPartCommitted {
                job_id: r.job_id,
                step: r.step,
                part,
            })
            .await
            .map_err(to_status)?;
        let m = crate::metrics::metrics();
        m.part_commit_seconds
            .observe(started.elapsed().as_secs_f64());
        m.part_bytes.inc_by(part_bytes);
        Ok(Response::new(v1::Ack {}))
    }

    async fn enrol(
        &self,
        req: Request<v1::EnrolWorkerRequest>,
    ) -> Result<Response<v1::EnrolWorkerResponse>, Status> {
        let from = req
            .extensions()
            .get::<cumulus_listen::ConnInfo>()
            .and_then(|c| c.remote_addr);
        let r = req.into_inner();
        let Some(ca) = &self.enrolment_ca else {
            return Err(Status::failed_precondition(
                "this coordinator signs no worker certificates: start it with --tls-ca-key, \
                 or issue the worker one with `cumulusctl certs issue worker ID`",
            ));
        };
        check_worker_id(&r.worker_id)?;
        check_enrol_hosts(&r.hosts)?;
        let identity = cumulus_tls::Identity::Worker(r.worker_id.clone());
        let cert_pem = ca
            .sign_request(&identity, &r.hosts, &r.csr_pem)
            .map_err(|e| match e {
                cumulus_tls::TlsError::BadRequest(why) => {
                    Status::invalid_argument(format!("certificate signing request: {why}"))
                }
                other => Status::internal(other.to_string()),
            })?;
        tracing::info!(
            worker_id = %r.worker_id,
            hosts = ?r.hosts,
            ?from,
            "signed a certificate for an enrolling worker"
        );
        Ok(Response::new(v1::EnrolWorkerResponse { cert_pem }))
    }

    type GetBlobStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<v1::BlobChunk, Status>> + Send + 'static>,
    >;

    /// An attempt's artifacts, stored like a user's upload (a majority of the voters
    /// before the answer); recorded as uploaded by `worker/ID`, outside every quota.
    async fn put_blob(
        &self,
        req: Request<tonic::Streaming<v1::BlobChunk>>,
    ) -> Result<Response<v1::PutBlobResponse>, Status> {
        let worker = check_blob_worker(self.node.tls, certified_worker(&req))?;
        let (header, chunks) = blobs::peers::from_chunks(req.into_inner()).await?;
        self.node
            .blobs
            .put(header, &blobs::ops::Uploader::Worker(worker), chunks)
            .await
            .map(Response::new)
            .map_err(Status::from)
    }

    /// A blob a job needs (its workdir), fetched from a peer first when this coordinator
    /// lacks it; verified as it streams.
    async fn get_blob(
        &self,
        req: Request<v1::GetBlobRequest>,
    ) -> Result<Response<Self::GetBlobStream>, Status> {
        check_blob_worker(self.node.tls, certified_worker(&req))?;
        let digest = req.into_inner().digest;
        let read = self.node.blobs.open(&digest).await?;
        let header = blobs::BlobHeader {
            digest,
            size_bytes: read.size_bytes,
        };
        Ok(Response::new(Box::pin(blobs::peers::download_chunks(
            header,
            read.chunks,
        ))))
    }
}

/// With TLS on, a blob call on the worker service must come from a worker's certificate
/// (the cluster token alone does not name a worker). Returns the worker's id (`""`
/// without TLS).
fn check_blob_worker(tls: bool, certified: Option<String>) -> Result<String, Status> {
    match (tls, certified) {
        (_, Some(id)) => Ok(id),
        (false, None) => Ok(String::new()),
        (true, None) => Err(Status::permission_denied(
            "a blob call on the worker service needs a worker certificate",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enrolment_hosts_are_ip_addresses_or_dns_names_and_bounded() {
        let ok =
            |h: &[&str]| check_enrol_hosts(&h.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert!(ok(&[]).is_ok());
        assert!(ok(&["3f2a9c1b0d4e", "worker-1.cluster.local", "10.0.0.7", "::1"]).is_ok());
        for bad in [
            "",
            "a b",
            "a..b",
            "-a",
            "a-",
            "a/b",
            "é",
            &"a".repeat(64),
            "a\u{1b}[2J",
        ] {
            let err = ok(&[bad]).expect_err(bad);
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{bad:?}");
        }
        let long = ["a".repeat(63).as_str(); 4].join(".");
        assert!(ok(&[&long]).is_err(), "more than 253 bytes");
        let many: Vec<String> = (0..=MAX_ENROL_HOSTS).map(|i| format!("h{i}")).collect();
        assert!(check_enrol_hosts(&many).is_err());
    }
}
