//! A Cumulus coordinator: one Raft node (openraft, sled storage, tonic transport) that
//! serves the client, worker and Raft gRPC services and the HTTP API on its two ports,
//! and runs the leader-only control loops while it leads.
//!
//! `main.rs` parses [`Config`] and calls [`run`]; everything else lives here.

pub mod api;
pub mod auth;
pub mod blobs;
pub mod client_service;
pub mod control;
pub mod convert;
pub mod datadir;
pub mod error;
pub mod http;
pub mod localfs;
pub mod logs;
pub mod metrics;
pub mod network;
pub mod node;
pub mod proposer;
pub mod raft_service;
pub mod ready;
pub mod rejoin;
pub mod shares;
pub mod snapshots;
pub mod soft;
pub mod terms;
pub mod ui;
pub mod worker_service;

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use cumulus_api::v1::client_service_server::ClientServiceServer;
use cumulus_api::v1::raft_service_server::RaftServiceServer;
use cumulus_api::v1::worker_service_server::WorkerServiceServer;
use cumulus_raft_store::{CumulusNode, NodeId, SharedState};
use cumulus_tls::Tls;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::auth::{AddToken, AuthInterceptor};
// Workers: the cluster token only (never a user's).
use crate::network::{MAX_RAFT_MESSAGE_BYTES, Network};
use crate::node::{Node, NodeLimits, Raft};
use crate::soft::SoftState;

/// A peer given on the command line: `ID=GRPC_ADDR@HTTP_ADDR[@RAFT_ADDR]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Raft node id (≥ 1).
    pub id: NodeId,
    /// Its addresses.
    pub node: CumulusNode,
}

/// A `--peer` value that is not `ID=GRPC_HOST:PORT@HTTP_HOST:PORT[@RAFT_HOST:PORT]`.
#[derive(Debug, thiserror::Error)]
#[error(
    "peer {0:?} must look like ID=GRPC_HOST:PORT@HTTP_HOST:PORT, or \
     ID=GRPC_HOST:PORT@HTTP_HOST:PORT@RAFT_HOST:PORT for a node started with --raft-listen"
)]
pub struct BadPeer(pub String);

/// Parses `ID=GRPC_ADDR@HTTP_ADDR[@RAFT_ADDR]`, e.g. `1=127.0.0.1:7001@127.0.0.1:8001`
/// or, for a node whose Raft service has a port of its own (`--raft-listen`),
/// `1=127.0.0.1:7001@127.0.0.1:8001@127.0.0.1:7101`.
///
/// # Errors
/// [`BadPeer`] when it is malformed (the id must be a non-zero integer, every address
/// `host:port`).
pub fn parse_peer(s: &str) -> Result<Peer, BadPeer> {
    let bad = || BadPeer(s.to_owned());
    let (id, addrs) = s.split_once('=').ok_or_else(bad)?;
    let parts: Vec<&str> = addrs.split('@').collect();
    let (grpc, http, raft) = match parts[..] {
        [grpc, http] => (grpc, http, ""),
        [grpc, http, raft] if !raft.is_empty() => (grpc, http, raft),
        _ => return Err(bad()),
    };
    let id: NodeId = id.parse().map_err(|_| bad())?;
    let host_port = |a: &str| !a.is_empty() && a.contains(':');
    if id == 0 || !host_port(grpc) || !host_port(http) || !(raft.is_empty() || host_port(raft)) {
        return Err(bad());
    }
    Ok(Peer {
        id,
        node: CumulusNode {
            grpc_addr: grpc.to_string(),
            http_addr: http.to_string(),
            raft_addr: raft.to_string(),
        },
    })
}

/// Command-line configuration of `cumulus-coordinator`.
#[derive(clap::Parser, Debug, Clone)]
#[command(
    name = "cumulus-coordinator",
    version,
    about = "A Cumulus coordinator (one Raft node)."
)]
pub struct Config {
    /// Raft node id of this coordinator (≥ 1, unique in the cluster).
    #[arg(long, env = "CUMULUS_NODE_ID")]
    pub node_id: NodeId,
    /// Address the gRPC server (client and worker services; Raft too, without
    /// `--raft-listen`) listens on.
    #[arg(long)]
    pub grpc_listen: SocketAddr,
    /// Address the HTTP server (REST, SSE logs, health) listens on.
    #[arg(long)]
    pub http_listen: SocketAddr,
    /// Address the Raft service (and blob replication between coordinators) listens on,
    /// apart from the gRPC port, which then serves clients and workers only: a firewall
    /// or NetworkPolicy can admit only coordinators to this port. This node's `--peer`
    /// entry must then name its Raft address (`ID=GRPC@HTTP@RAFT`), and it is added to a
    /// cluster with `cluster add-learner ID GRPC@HTTP@RAFT`. Every member must run a
    /// version that knows `--raft-listen`. Without it, Raft shares the gRPC port.
    #[arg(long, env = "CUMULUS_RAFT_LISTEN")]
    pub raft_listen: Option<SocketAddr>,
    /// Every member of the initial cluster, this node included: `ID=GRPC@HTTP`, or
    /// `ID=GRPC@HTTP@RAFT` for a member started with `--raft-listen` (repeat). With
    /// `--join`, this node's own entry is enough.
    #[arg(long = "peer", value_parser = parse_peer, required = true)]
    pub peers: Vec<Peer>,
    /// Directory of this node's sled database (created if missing).
    #[arg(long)]
    pub data_dir: PathBuf,
    /// File holding the cluster bearer token.
    #[arg(long, env = "CUMULUS_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// The cluster bearer token, from the environment only (`--token` on the command
    /// line is refused: every local user sees it in `ps`).
    #[arg(long, env = "CUMULUS_TOKEN", hide = true, hide_env_values = true)]
    pub token: Option<String>,
    /// File holding the peer token: the credential coordinators present to each other's
    /// Raft service. Only coordinators hold it (never workers, ranks or users); it must
    /// differ from the cluster token, which the Raft service refuses.
    #[arg(long, env = "CUMULUS_PEER_TOKEN_FILE")]
    pub peer_token_file: Option<PathBuf>,
    /// The peer token, from the environment only (`--peer-token` on the command line is
    /// refused).
    #[arg(long, env = "CUMULUS_PEER_TOKEN", hide = true, hide_env_values = true)]
    pub peer_token: Option<String>,
    /// Heartbeat interval workers are told to use, in milliseconds.
    #[arg(long, default_value_t = 1_000)]
    pub heartbeat_interval_ms: u64,
    /// A worker silent for this long is expired and its ranks rescheduled, in milliseconds.
    #[arg(long, default_value_t = 5_000)]
    pub heartbeat_timeout_ms: u64,
    /// Largest world size a job may ask for.
    #[arg(long, default_value_t = 1_024)]
    pub max_world_size: u32,
    /// Most bytes of state (estimated encoded size) the pending and running jobs may
    /// hold; a submit past it is refused with RESOURCE_EXHAUSTED. At least 1 MiB, at
    /// most the default (half the 2 GiB snapshot a follower accepts).
    #[arg(long, default_value_t = cumulus_raft_store::state::MAX_STATE_BYTES)]
    pub max_state_bytes: u64,
    /// Where a job's dataset and checkpoint dir may lie.
    #[command(flatten)]
    pub roots: cumulus_api::paths::RootsArgs,
    /// TLS: this coordinator's certificate (naming `cumulus://coordinator/ID`), key and
    /// the cluster CA; or `--insecure`.
    #[command(flatten)]
    pub tls: cumulus_tls::args::TlsArgs,
    /// The cluster CA's key (PEM, readable by this user only): this coordinator then
    /// signs certificates for workers that enrol (`cumulus-worker --tls-enrol`) with the
    /// cluster token. Whoever holds this key can mint any member's certificate: give it
    /// only to coordinators, and only where workers enrol (the compose cluster does).
    #[arg(long, env = "CUMULUS_TLS_CA_KEY", requires = "tls_ca")]
    pub tls_ca_key: Option<PathBuf>,
    /// Raft heartbeat interval between coordinators, in milliseconds.
    #[arg(long, default_value_t = 50)]
    pub raft_heartbeat_ms: u64,
    /// Lower bound of the Raft election timeout, in milliseconds.
    #[arg(long, default_value_t = 200)]
    pub election_timeout_min_ms: u64,
    /// Upper bound of the Raft election timeout, in milliseconds.
    #[arg(long, default_value_t = 400)]
    pub election_timeout_max_ms: u64,
    /// Fewest applied entries between two snapshots (each compacts the log). Between
    /// this and `--snapshot-max-entries`, the interval is the number of jobs and workers
    /// in the state (see `snapshots`).
    #[arg(long, default_value_t = 5_000)]
    pub snapshot_every_entries: u64,
    /// Most applied entries between two snapshots, which bounds what a restart
    /// re-applies.
    #[arg(long, default_value_t = 100_000)]
    pub snapshot_max_entries: u64,
    /// Log entries kept behind each snapshot (a follower lagging by more than this
    /// catches up by a snapshot install instead of log entries).
    #[arg(long, default_value_t = 1_000)]
    pub keep_log_entries: u64,
    /// Join an existing cluster: never bootstrap, wait to be added with
    /// `cumulusctl cluster add-learner`. Use it for every node started after the cluster
    /// was created, and for a node whose data dir was wiped (after `cluster remove`).
    #[arg(long)]
    pub join: bool,
    /// Recover a node whose data dir refuses to open (corrupt raft log, snapshot or
    /// database): after `cumulusctl cluster remove ID`, checks with the other
    /// coordinators (`--peer`) that this node is no longer a member, moves the data dir
    /// aside to `<data-dir>.damaged-<unix seconds>`, and starts empty as with `--join`;
    /// then `cluster add-learner` and `cluster promote` bring it back.
    #[arg(long)]
    pub rejoin_empty: bool,
    /// Threads of the async runtime (Raft, gRPC, HTTP, control loop); blocking work
    /// (snapshots, checkpoint verification, log truncation) has its own pool. One by
    /// default: a write crosses a dozen tasks, and on a thread of its own each hop is a
    /// function call, not a wake-up of another thread (docs/perf-notes.md, "One runtime thread": 1 thread
    /// gave 0.98 of etcd's rate at one client vs 0.92 with 2, on 2 cores). Raise it when
    /// one core no longer keeps up (many thousands of workers or clients).
    #[arg(long, env = "CUMULUS_WORKER_THREADS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=256))]
    pub worker_threads: u16,
    /// Most connections open at once on the gRPC port (clients, workers, peers); more
    /// are closed at accept. Scaled down to fit the open-file limit, which keeps
    /// descriptors in reserve for the raft log and the database.
    #[arg(long, default_value_t = 4_096)]
    pub max_grpc_connections: usize,
    /// Most connections open at once on the HTTP port; more are closed at accept.
    #[arg(long, default_value_t = 1_024)]
    pub max_http_connections: usize,
    /// Most concurrent SSE log streams served by this node; one user (not an
    /// administrator) may hold a quarter of them, and the last eighth is kept for
    /// administrators (`shares`).
    #[arg(long, default_value_t = 256)]
    pub max_log_streams: usize,
    /// S3 settings for jobs with an S3 checkpoint target (`--ckpt-url s3://…`): the leader
    /// verifies parts, writes manifests and LATEST there.
    #[command(flatten)]
    pub s3: cumulus_ckpt::S3Args,
    /// The blob store (packed working directories, artifacts): under `<data-dir>/blobs`,
    /// or in the S3 bucket of `--blob-url`.
    #[command(flatten)]
    pub blobs: blobs::BlobArgs,
    /// File holding the scrape token: it reads `GET /metrics` and nothing else (give it
    /// to Prometheus instead of a user's token). Without it, `/metrics` takes a user's
    /// token of any role, or the cluster token.
    #[arg(long, env = "CUMULUS_METRICS_TOKEN_FILE")]
    pub metrics_token_file: Option<PathBuf>,
}

impl Config {
    fn validate(&self) -> anyhow::Result<CumulusNode> {
        let mut ids = BTreeMap::new();
        for p in &self.peers {
            if ids.insert(p.id, p.node.clone()).is_some() {
                bail!("peer id {} is given twice", p.id);
            }
        }
        let Some(me) = ids.get(&self.node_id).cloned() else {
            bail!("--peer must include this node (id {})", self.node_id);
        };
        self.validate_raft_listen(&me)?;
        if self.heartbeat_interval_ms == 0
            || self.heartbeat_timeout_ms <= self.heartbeat_interval_ms
        {
            bail!("--heartbeat-timeout-ms must be larger than --heartbeat-interval-ms (> 0)");
        }
        if self.election_timeout_min_ms <= self.raft_heartbeat_ms
            || self.election_timeout_max_ms <= self.election_timeout_min_ms
        {
            bail!("need raft heartbeat < election timeout min < election timeout max");
        }
        if self.snapshot_every_entries == 0
            || self.snapshot_max_entries < self.snapshot_every_entries
        {
            bail!("need 1 <= --snapshot-every-entries <= --snapshot-max-entries");
        }
        let max_state = cumulus_raft_store::state::MAX_STATE_BYTES;
        if !(MIN_STATE_BYTES..=max_state).contains(&self.max_state_bytes) {
            bail!("need {MIN_STATE_BYTES} <= --max-state-bytes <= {max_state}");
        }
        self.blobs.validate()?;
        Ok(me)
    }

    /// `--raft-listen` must be a port of its own, and this node's `--peer` entry (`me`)
    /// must name a Raft address exactly when it is given: peers dial the Raft address
    /// in the membership, and without `--raft-listen` nothing serves it.
    fn validate_raft_listen(&self, me: &CumulusNode) -> anyhow::Result<()> {
        let Some(raft) = self.raft_listen else {
            if !me.raft_addr.is_empty() {
                bail!(
                    "this node's --peer entry names a Raft address ({}), but no --raft-listen \
                     was given: add --raft-listen, or drop the third address from its \
                     --peer entry (Raft then shares the gRPC port)",
                    me.raft_addr
                );
            }
            return Ok(());
        };
        // Port 0 (any free port) never collides; otherwise the same port on the same
        // or an unspecified (`0.0.0.0`, `[::]`) address does.
        let clash = |other: SocketAddr| {
            raft.port() != 0
                && raft.port() == other.port()
                && (raft.ip() == other.ip()
                    || raft.ip().is_unspecified()
                    || other.ip().is_unspecified())
        };
        if clash(self.grpc_listen) {
            bail!(
                "--raft-listen {raft} is the gRPC port (--grpc-listen {}): give Raft a port \
                 of its own, or leave --raft-listen out to share the gRPC port",
                self.grpc_listen
            );
        }
        if clash(self.http_listen) {
            bail!(
                "--raft-listen {raft} is the HTTP port (--http-listen {}): give Raft a port \
                 of its own",
                self.http_listen
            );
        }
        if me.raft_addr.is_empty() {
            bail!(
                "--raft-listen is given, but this node's --peer entry ({}={}@{}) names no \
                 Raft address: write it as ID=GRPC@HTTP@RAFT, with the address peers reach \
                 --raft-listen at",
                self.node_id,
                me.grpc_addr,
                me.http_addr
            );
        }
        if me.raft_addr == me.grpc_addr {
            bail!(
                "this node's --peer entry gives the same address for gRPC and Raft ({}): \
                 with --raft-listen, Raft has a port of its own",
                me.raft_addr
            );
        }
        Ok(())
    }
}

/// Checks this node's entry in the membership its data dir holds (`stored`; `None`
/// for a node that is not a member yet) against `--raft-listen` (`raft_listen`): peers
/// dial the Raft address stored there, so a member stored with Raft on its gRPC port
/// cannot move it to a port of its own by a flag (its peers would dial a port that
/// no longer serves Raft), nor the reverse. The membership, not `--peer`, is what
/// peers use once the cluster exists.
///
/// # Errors
/// A mismatch, naming the stored addresses and how to move the member (remove it and
/// add it back with the new addresses, docs/deploy.md).
pub fn check_stored_raft_addr(
    node_id: NodeId,
    raft_listen: Option<SocketAddr>,
    stored: Option<&CumulusNode>,
) -> anyhow::Result<()> {
    let Some(stored) = stored else {
        return Ok(());
    };
    let how = "to move a member between a shared and a separate Raft port, remove it \
               (cumulusctl cluster remove ID), restart it with the new flags and \
               --rejoin-empty, and add it back with cumulusctl cluster add-learner \
               (docs/deploy.md, \"Moving Raft to a port of its own\")";
    match (raft_listen, stored.raft_addr.is_empty()) {
        (Some(addr), true) => bail!(
            "--raft-listen {addr} is given, but node {node_id} is a member with Raft on its \
             gRPC port ({stored}): its peers would dial {} for Raft, which would no longer \
             serve it; {how}",
            stored.grpc_addr
        ),
        (None, false) => bail!(
            "node {node_id} is a member with Raft on a port of its own ({stored}), but no \
             --raft-listen is given: its peers would dial {} for Raft, which nothing would \
             serve; add --raft-listen, or {how}",
            stored.raft_addr
        ),
        _ => Ok(()),
    }
}

/// Smallest `--max-state-bytes`, in bytes.
pub const MIN_STATE_BYTES: u64 = 1 << 20;

/// Runs the coordinator until `shutdown` completes, then stops its servers, its loops
/// and its Raft node.
///
/// # Errors
/// Bad configuration, an unusable data dir (corrupt files refuse to start), a port in use.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let me = config.validate()?;
    let Credentials {
        roots,
        tls,
        enrolment_ca,
        token,
        peer_token,
    } = load_credentials(&config)?;
    metrics::init(
        &config.data_dir,
        config.metrics_token_file.as_deref(),
        &[&*token, &*peer_token],
    )?;
    if config.rejoin_empty {
        rejoin_empty(&config, &token, &tls).await?;
    }
    let (raft, shared) = start_raft(&config, &peer_token, &tls).await?;
    // This node's entry in the membership its data dir holds, asked of the core (whose
    // metrics may not have reported the loaded state yet).
    let node_id = config.node_id;
    let stored = raft
        .with_raft_state(move |st| {
            st.membership_state
                .effective()
                .membership()
                .get_node(&node_id)
                .cloned()
        })
        .await
        .context("reading this node's stored membership")?;
    if let Err(e) = check_stored_raft_addr(node_id, config.raft_listen, stored.as_ref()) {
        let _ = raft.shutdown().await;
        return Err(e);
    }
    let cancel = CancellationToken::new();
    let blob_peers =
        blobs::peers::BlobPeers::new(AddToken::new(&peer_token)?, network::client_tls(&tls));
    let blobs = Arc::new(blobs::Blobs::load(
        &config.data_dir,
        &config.blobs,
        (config.node_id, raft.clone(), shared.clone()),
        (
            blob_peers,
            blobs::Backend::open(&config.blobs, &config.s3).await?,
        ),
    )?);
    let node = new_node(
        &config,
        (&raft, shared),
        (roots, blobs.clone()),
        token.clone(),
        &tls,
        &cancel,
    )?;
    bootstrap_if_first(&config, &raft).await?;

    // Whom a pristine node may vote for: the members it bootstraps with (a joining node,
    // none: it is added as a learner first).
    let initial_members: Vec<NodeId> = if config.join || config.rejoin_empty {
        Vec::new()
    } else {
        config.peers.iter().map(|p| p.id).collect()
    };
    let Listeners {
        grpc: grpc_listener,
        http: http_listener,
        raft: raft_listener,
    } = bind_listeners(&config, &tls).await?;
    info!(
        node_id = config.node_id,
        grpc = %me.grpc_addr,
        http = %me.http_addr,
        raft = %me.raft_target(),
        tls = node.tls,
        "coordinator listening"
    );

    let grpc_task = spawn_grpc(
        &node,
        (grpc_listener, raft_listener),
        initial_members,
        token,
        peer_token,
        enrolment_ca,
        cancel.clone(),
    );
    let http_task = tokio::spawn(cumulus_listen::serve_http(
        http_listener,
        http::router(node.clone()),
        cancel.clone(),
    ));
    let control_task = tokio::spawn(control::run(node.clone(), cancel.clone()));
    tokio::spawn(metrics::watch_leader(node.clone(), cancel.clone()));
    let blob_gc_task = tokio::spawn(blobs::gc::run(blobs, cancel.clone()));
    let snapshot_task = tokio::spawn(snapshots::run(
        raft.clone(),
        node.shared.clone(),
        snapshots::SnapshotInterval {
            min_entries: config.snapshot_every_entries,
            max_entries: config.snapshot_max_entries,
        },
        cancel.clone(),
    ));

    let mut grpc_task = grpc_task;
    let mut http_task = http_task;
    tokio::select! {
        _ = shutdown => info!("shutting down"),
        r = &mut grpc_task => warn!(result = ?r, "gRPC server stopped"),
        r = &mut http_task => warn!(result = ?r, "HTTP server stopped"),
        why = raft_core_stopped(raft.metrics()) => {
            // Fail-stop: a node whose Raft core is gone must not go on serving `/health`
            // and `cluster status` from its last metrics (a panicked core's node read as
            // leader at an old term while another node led). No graceful shutdown: the
            // servers end with the process.
            tracing::error!(reason = %why, "the raft core stopped; exiting");
            bail!("the raft core stopped: {why}");
        }
    }
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        let _ = control_task.await;
        let _ = blob_gc_task.await;
        let _ = snapshot_task.await;
        let _ = grpc_task.await;
        let _ = http_task.await;
    })
    .await;
    if let Err(e) = raft.shutdown().await {
        warn!(error = %e, "raft shutdown");
    }
    Ok(())
}

/// What a coordinator trusts and is trusted with, loaded from its configuration before
/// it touches its data dir.
struct Credentials {
    /// The roots jobs' dataset and checkpoint directories must lie under.
    roots: cumulus_api::paths::JobRoots,
    /// This node's TLS credentials (identity `cumulus://coordinator/N`), or `--insecure`.
    tls: Tls,
    /// The cluster CA that signs enrolling workers' certificates (`--tls-ca-key`).
    enrolment_ca: Option<Arc<cumulus_tls::generate::ClusterCa>>,
    /// The cluster token (clients, workers, the administrator).
    token: Arc<str>,
    /// The token coordinators present to each other's Raft service.
    peer_token: Arc<str>,
}

/// Loads the job roots, TLS credentials, enrolment CA and both tokens from `config`,
/// logging an info line when jobs may name any directory and a warning for `--insecure`.
///
/// # Errors
/// A token given on the command line, unreadable roots, TLS files or tokens, an
/// enrolment CA key others may read, or a peer token equal to the cluster token.
fn load_credentials(config: &Config) -> anyhow::Result<Credentials> {
    if let Some(t) = &config.token {
        cumulus_api::token::refuse_command_line(t, "--token", "CUMULUS_TOKEN")?;
    }
    if let Some(t) = &config.peer_token {
        cumulus_api::token::refuse_command_line(t, "--peer-token", "CUMULUS_PEER_TOKEN")?;
    }
    let roots = config.roots.load()?;
    if roots.dataset.is_any() || roots.ckpt.is_any() {
        tracing::info!(
            "no --allowed-dataset-roots or --allowed-ckpt-roots: jobs may name any dataset or checkpoint dir this coordinator can list or create"
        );
    }
    let tls = config
        .tls
        .load_for(&cumulus_tls::Identity::Coordinator(config.node_id))?;
    if matches!(tls, Tls::Insecure) {
        warn!(
            "--insecure: every connection is plaintext; tokens and job data cross the network readable"
        );
    }
    let enrolment_ca = match (&config.tls_ca_key, &config.tls.tls_ca) {
        (Some(key), Some(ca)) => Some(Arc::new(load_enrolment_ca(ca, key)?)),
        _ => None,
    };
    let token = auth::load_token(config.token_file.as_deref(), config.token.as_deref())?;
    let peer_token = auth::load_peer_token(
        config.peer_token_file.as_deref(),
        config.peer_token.as_deref(),
    )?;
    if peer_token == token {
        bail!(
            "the peer token must differ from the cluster token (clients and workers hold \
             the cluster token; only coordinators may speak Raft)"
        );
    }
    Ok(Credentials {
        roots,
        tls,
        enrolment_ca,
        token,
        peer_token,
    })
}

/// `--rejoin-empty`: checks with the leader (found among the other `--peer`s, asked
/// with the cluster `token`) that this node is no longer a member, then moves its data
/// dir aside (when it exists) and logs where it went.
///
/// # Errors
/// No other coordinator is given or answers; the node is still a member; the move fails.
async fn rejoin_empty(config: &Config, token: &Arc<str>, tls: &Tls) -> anyhow::Result<()> {
    let aside = rejoin::prepare(
        config.node_id,
        &config.peers,
        &config.data_dir,
        AddToken::new(token)?,
        network::client_tls(tls),
    )
    .await?;
    if let Some(aside) = aside {
        warn!(
            data_dir = %config.data_dir.display(),
            moved_to = %aside.display(),
            "moved the damaged data dir aside; starting empty, waiting to be added back \
             with `cumulusctl cluster add-learner`"
        );
    }
    Ok(())
}

/// Prepares the data dir, opens the Raft log and state machine under it and starts
/// this node's Raft core, whose peers it reaches with `peer_token` over `tls`. Returns
/// the core's handle and the state machine's applied state.
///
/// # Errors
/// A data dir others may read, damaged stores (the node refuses to start and changes
/// nothing), an invalid Raft configuration.
async fn start_raft(
    config: &Config,
    peer_token: &Arc<str>,
    tls: &Tls,
) -> anyhow::Result<(Raft, Arc<SharedState>)> {
    datadir::prepare(&config.data_dir)?;
    let (mut log_store, sm_store) = cumulus_raft_store::open(&config.data_dir.join("raft"))?;
    log_store.set_local_node(config.node_id);
    let shared = sm_store.shared();

    let raft_config = openraft::Config {
        cluster_name: "cumulus".into(),
        heartbeat_interval: config.raft_heartbeat_ms,
        election_timeout_min: config.election_timeout_min_ms,
        election_timeout_max: config.election_timeout_max_ms,
        // Snapshots are triggered by `snapshots::run`, at an interval that grows with the
        // state.
        snapshot_policy: openraft::SnapshotPolicy::Never,
        max_in_snapshot_log_to_keep: config.keep_log_entries,
        // Replicate an entry as soon as the leader's `append` has written it, while the
        // leader's own `fdatasync` runs (its flush still counts toward the quorum only
        // once done). Off by default in openraft; it is what etcd's leader does.
        broadcast_submitted_on_append: Some(true),
        // A node cut off from a majority does not raise its term while it waits, so an
        // honest candidate is never far ahead of its voters (`terms`).
        enable_pre_vote: Some(true),
        ..Default::default()
    };
    let raft_config = Arc::new(raft_config.validate().context("raft configuration")?);
    let network = Network::new(AddToken::new(peer_token)?, network::client_tls(tls));
    let raft =
        cumulus_raft_store::Raft::new(config.node_id, raft_config, network, log_store, sm_store)
            .await
            .context("starting raft")?;
    Ok((raft, shared))
}

/// The node every service and loop shares: `raft` with its applied state `shared`, the
/// proposer (stopped by `cancel`), empty soft state, the limits from `config` and the
/// job `roots`, the blob store `blobs`, and the HTTPS client of the agents.
///
/// # Errors
/// The agents' HTTPS client or the S3 settings cannot be built.
fn new_node(
    config: &Config,
    (raft, shared): (&Raft, Arc<SharedState>),
    (roots, blobs): (cumulus_api::paths::JobRoots, Arc<blobs::Blobs>),
    token: Arc<str>,
    tls: &Tls,
    cancel: &CancellationToken,
) -> anyhow::Result<Arc<Node>> {
    let http = network::AgentHttp::new(network::client_tls(tls)).map_err(anyhow::Error::msg)?;
    Ok(Arc::new(Node {
        proposer: proposer::Proposer::start(raft.clone(), cancel.clone()),
        id: config.node_id,
        raft: raft.clone(),
        shared,
        soft: Mutex::new(SoftState::default()),
        limits: NodeLimits {
            heartbeat_interval_ms: config.heartbeat_interval_ms,
            heartbeat_timeout_ms: config.heartbeat_timeout_ms,
            max_world_size: config.max_world_size,
            max_state_bytes: config.max_state_bytes,
            roots,
        },
        token,
        tls: matches!(tls, Tls::On(_)),
        http,
        log_streams: shares::SharedSlots::new(config.max_log_streams),
        s3: cumulus_ckpt::S3Connector::new(config.s3.settings()).context("invalid S3 settings")?,
        local_fs: Arc::default(),
        state_reserved_bytes: Default::default(),
        blobs,
    }))
}

/// The lowest-id member of a pristine cluster bootstraps it with the configured
/// membership; the others wait to be contacted (several nodes initializing at once race
/// their first elections). A joining or rejoining node never bootstraps: the leader adds
/// it. A failed initialization (state exists) is logged, not an error.
///
/// # Errors
/// The Raft core cannot say whether it is initialized.
async fn bootstrap_if_first(config: &Config, raft: &Raft) -> anyhow::Result<()> {
    let bootstrapper = !config.join
        && !config.rejoin_empty
        && config.peers.iter().map(|p| p.id).min() == Some(config.node_id);
    if bootstrapper && !raft.is_initialized().await? {
        let members: BTreeMap<NodeId, CumulusNode> = config
            .peers
            .iter()
            .map(|p| (p.id, p.node.clone()))
            .collect();
        match raft.initialize(members).await {
            Ok(()) => info!("initialized a new cluster"),
            Err(e) => info!(error = %e, "not initializing (state exists)"),
        }
    }
    Ok(())
}

/// Most connections open at once on the Raft port (`--raft-listen`), beyond the
/// [`cumulus_listen::COORDINATOR_RESERVED_CONNECTIONS`] kept for connections whose
/// certificate names a coordinator: only coordinators have any use for the port (a few
/// channels each), so anything else only ever holds a pending slot until refused.
pub const MAX_RAFT_CONNECTIONS: usize = 64;

/// The bound ports of a coordinator.
struct Listeners {
    /// The gRPC port: client and worker services, and Raft unless `raft` is set.
    grpc: cumulus_listen::BoundedListener,
    /// The HTTP port.
    http: cumulus_listen::BoundedListener,
    /// The Raft port of `--raft-listen`, if given.
    raft: Option<cumulus_listen::BoundedListener>,
}

/// Binds the gRPC, HTTP and (with `--raft-listen`) Raft ports and wraps them in bounded
/// listeners (TLS when configured): their connection caps lowered, with a warning, to
/// fit the open-file limit, and on the gRPC and Raft ports connections reserved for
/// coordinators.
///
/// # Errors
/// A port in use, an unreadable open-file limit, an unusable server TLS configuration.
async fn bind_listeners(config: &Config, tls: &Tls) -> anyhow::Result<Listeners> {
    let grpc_listener = tokio::net::TcpListener::bind(config.grpc_listen)
        .await
        .with_context(|| format!("binding gRPC on {}", config.grpc_listen))?;
    let http_listener = tokio::net::TcpListener::bind(config.http_listen)
        .await
        .with_context(|| format!("binding HTTP on {}", config.http_listen))?;
    let raft_listener = match config.raft_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding Raft on {addr} (--raft-listen)"))?,
        ),
        None => None,
    };
    let budget = cumulus_listen::fd_budget(cumulus_listen::open_fds())
        .context("reading the open-file limit")?;
    let raft_wanted = if raft_listener.is_some() {
        MAX_RAFT_CONNECTIONS + cumulus_listen::COORDINATOR_RESERVED_CONNECTIONS
    } else {
        0
    };
    let wanted = [
        config.max_grpc_connections,
        config.max_http_connections,
        raft_wanted,
    ];
    let caps = cumulus_listen::fit_caps(&wanted, budget);
    if caps != wanted {
        warn!(
            grpc = caps[0],
            http = caps[1],
            raft = caps[2],
            fd_budget = budget,
            "connection caps lowered to fit the open-file limit"
        );
    }
    let server_tls = match tls {
        Tls::On(creds) => Some(creds.server_config()?),
        Tls::Insecure => None,
    };
    // Raft between coordinators shares this port with clients but not their slots:
    // a connection whose verified TLS certificate names a coordinator leaves the
    // pending pool at its handshake and counts against connections reserved for
    // coordinators, so a client flood (idle, preface-only, refused) never takes them.
    let grpc_listener = cumulus_listen::BoundedListener::new(
        grpc_listener,
        "coordinator gRPC",
        cumulus_listen::Limits::connections(caps[0])
            .with_reserved(cumulus_listen::COORDINATOR_RESERVED_CONNECTIONS),
    )
    .with_tls(server_tls.clone());
    let http_listener = cumulus_listen::BoundedListener::new(
        http_listener,
        "coordinator HTTP",
        cumulus_listen::Limits::connections(caps[1]),
    )
    .with_tls(server_tls.clone());
    // The Raft port: its whole cap is for coordinators; the reserve still keeps their
    // connections apart from a flood's.
    let raft_listener = raft_listener.map(|l| {
        let cap = caps[2].saturating_sub(cumulus_listen::COORDINATOR_RESERVED_CONNECTIONS);
        cumulus_listen::BoundedListener::new(
            l,
            "coordinator Raft",
            cumulus_listen::Limits::connections(cap.max(16))
                .with_reserved(cumulus_listen::COORDINATOR_RESERVED_CONNECTIONS),
        )
        .with_tls(server_tls)
    });
    Ok(Listeners {
        grpc: grpc_listener,
        http: http_listener,
        raft: raft_listener,
    })
}

/// The layers every gRPC server of a coordinator runs requests through.
type GrpcLayers = tower_layer::Stack<
    metrics::GrpcTimingLayer,
    tower_layer::Stack<cumulus_listen::TrackLayer, tower_layer::Identity>,
>;

/// A gRPC server with the bounds every coordinator port has. HTTP/2 and TCP keepalive: a
/// replication stream from a leader that vanished (host down, network cut) ends instead
/// of holding its task and openraft's behind it. Streams per connection and header
/// bytes bounded; `TrackLayer` counts each connection's calls for the listener's
/// first-request and idle deadlines.
fn grpc_server() -> tonic::transport::Server<GrpcLayers> {
    tonic::transport::Server::builder()
        .concurrency_limit_per_connection(cumulus_listen::GRPC_MAX_CONCURRENT_STREAMS as usize)
        .max_concurrent_streams(cumulus_listen::GRPC_MAX_CONCURRENT_STREAMS)
        .http2_max_header_list_size(cumulus_listen::HTTP2_MAX_HEADER_LIST_BYTES)
        .http2_keepalive_interval(Some(Duration::from_millis(network::KEEPALIVE_INTERVAL_MS)))
        .http2_keepalive_timeout(Some(Duration::from_millis(network::KEEPALIVE_TIMEOUT_MS)))
        .layer(cumulus_listen::TrackLayer)
        .layer(metrics::GrpcTimingLayer)
}

/// Serves the gRPC services until `cancel`: Raft (the `peer_token` only; a pristine
/// node votes only for `initial_members`), the client service (the cluster `token` or a
/// user's) and the worker service (the cluster `token` only; enrolment signed by
/// `enrolment_ca`). With a Raft listener (`--raft-listen`), Raft is served there alone
/// and the gRPC listener serves only the client and worker services (a Raft call there
/// is answered `UNIMPLEMENTED`); without one, all three share the gRPC listener.
/// Returns the task of the servers, which ends when either server stops.
fn spawn_grpc(
    node: &Arc<Node>,
    (listener, raft_listener): (
        cumulus_listen::BoundedListener,
        Option<cumulus_listen::BoundedListener>,
    ),
    initial_members: Vec<NodeId>,
    token: Arc<str>,
    peer_token: Arc<str>,
    enrolment_ca: Option<Arc<cumulus_tls::generate::ClusterCa>>,
    cancel: CancellationToken,
) -> tokio::task::JoinHandle<Result<(), tonic::transport::Error>> {
    let interceptor = AuthInterceptor { token };
    let raft = tonic::service::interceptor::InterceptedService::new(
        RaftServiceServer::new(raft_service::RaftSvc::new(node.clone(), initial_members))
            .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES),
        AuthInterceptor { token: peer_token },
    );
    // Users: the cluster token or a user's token, with its role.
    let client = ClientServiceServer::with_interceptor(
        client_service::ClientSvc { node: node.clone() },
        auth::UserAuth { node: node.clone() },
    );
    let worker = WorkerServiceServer::with_interceptor(
        worker_service::WorkerSvc {
            node: node.clone(),
            enrolment_ca,
        },
        interceptor,
    );
    // The bounded listeners set TCP_NODELAY on every accepted connection: with Nagle's
    // algorithm a small gRPC reply (an AppendEntries ack, a submit's answer) written
    // behind unacknowledged bytes waits for the peer's delayed ACK (~40 ms on Linux).
    let stop = |cancel: CancellationToken| async move { cancel.cancelled().await };
    match raft_listener {
        None => {
            let grpc = grpc_server()
                .add_service(raft)
                .add_service(client)
                .add_service(worker);
            tokio::spawn(grpc.serve_with_incoming_shutdown(listener.into_incoming(), stop(cancel)))
        }
        Some(raft_listener) => {
            let grpc = grpc_server().add_service(client).add_service(worker);
            let raft = grpc_server().add_service(raft);
            let main =
                grpc.serve_with_incoming_shutdown(listener.into_incoming(), stop(cancel.clone()));
            let raft =
                raft.serve_with_incoming_shutdown(raft_listener.into_incoming(), stop(cancel));
            // Either server failing ends both (the coordinator then exits).
            tokio::spawn(async move { tokio::try_join!(main, raft).map(|_| ()) })
        }
    }
}

/// Resolves when this node's Raft core has stopped: its metrics report a fatal error
/// (a panic, a storage error) or their sender is gone (the core task ended). Returns
/// why, for the log and the exit error. Never resolves while the core runs.
pub async fn raft_core_stopped<W, R>(mut metrics: R) -> String
where
    W: openraft::async_runtime::watch::Watch,
    R: openraft::async_runtime::watch::WatchReceiver<
            W,
            openraft::RaftMetrics<cumulus_raft_store::TypeConfig>,
        >,
{
    loop {
        if let Err(fatal) = &metrics.borrow_watched().running_state {
            return fatal.to_string();
        }
        if metrics.changed().await.is_err() {
            return "its task ended".into();
        }
    }
}

/// The cluster CA that signs enrolling workers' certificates (`--tls-ca-key`): the key
/// file must be readable by its owner only and belong to the CA certificate.
///
/// # Errors
/// A key file that others may read, that cannot be read, or of another CA.
fn load_enrolment_ca(
    ca: &std::path::Path,
    key: &std::path::Path,
) -> anyhow::Result<cumulus_tls::generate::ClusterCa> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(key)
        .with_context(|| format!("cannot read --tls-ca-key {}", key.display()))?;
    if meta.mode() & 0o077 != 0 {
        bail!(
            "--tls-ca-key {} is readable or writable by others (mode {:o}): make it 0600",
            key.display(),
            meta.mode() & 0o777
        );
    }
    let signer = cumulus_tls::generate::ClusterCa::load(ca, key)
        .with_context(|| format!("--tls-ca-key {}", key.display()))?;
    info!(key = %key.display(), "signing certificates for workers that enrol");
    Ok(signer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stopped_raft_core_is_noticed() {
        use openraft::AsyncRuntime;
        use openraft::async_runtime::watch::{Watch, WatchSender};
        type W = <openraft::TokioRuntime as AsyncRuntime>::Watch;
        type Metrics = openraft::RaftMetrics<cumulus_raft_store::TypeConfig>;

        // A panicked core: its last metrics say so.
        let (tx, rx) = W::channel(Metrics::new_initial(1));
        let watcher = tokio::spawn(raft_core_stopped(rx));
        let mut failed = Metrics::new_initial(1);
        failed.running_state = Err(openraft::errors::Fatal::Panicked);
        tx.send(failed).expect("send");
        let why = tokio::time::timeout(Duration::from_secs(30), watcher)
            .await
            .expect("noticed")
            .expect("task");
        assert!(why.contains("panicked"), "{why}");

        // A core whose task ended without a word: the sender is gone.
        let (tx, rx) = W::channel(Metrics::new_initial(1));
        let watcher = tokio::spawn(raft_core_stopped(rx));
        drop(tx);
        let why = tokio::time::timeout(Duration::from_secs(30), watcher)
            .await
            .expect("noticed")
            .expect("task");
        assert_eq!(why, "its task ended");

        // A running core is not taken for a stopped one.
        let (tx, rx) = W::channel(Metrics::new_initial(1));
        let mut watcher = tokio::spawn(raft_core_stopped(rx));
        tx.send(Metrics::new_initial(1)).expect("send");
        tokio::select! {
            r = &mut watcher => panic!("a running core was reported stopped: {r:?}"),
            () = tokio::task::yield_now() => {}
        }
        watcher.abort();
        drop(tx);
    }

    #[test]
    fn peers_parse() {
        let p = parse_peer("2=127.0.0.1:7002@127.0.0.1:8002").expect("valid");
        assert_eq!(p.id, 2);
        assert_eq!(p.node.grpc_addr, "127.0.0.1:7002");
        assert_eq!(p.node.http_addr, "127.0.0.1:8002");
        assert_eq!(p.node.raft_addr, "");
        assert_eq!(p.node.raft_target(), "127.0.0.1:7002");
        let p = parse_peer("2=c2:7000@c2:8000@c2:7100").expect("valid, with a raft address");
        assert_eq!(p.node.raft_addr, "c2:7100");
        assert_eq!(p.node.raft_target(), "c2:7100");
        for bad in [
            "",
            "1",
            "x=a:1@b:2",
            "0=a:1@b:2",
            "1=a:1",
            "1=a@b:2",
            "1=a:1@b:2@",
            "1=a:1@b:2@c",
            "1=a:1@b:2@c:3@d:4",
        ] {
            assert!(parse_peer(bad).is_err(), "{bad}");
        }
    }

    /// A configuration of node 1 with `peer` as its `--peer` entry and `more` flags.
    fn config_with(peer: &str, more: &[&str]) -> Config {
        use clap::Parser;
        let mut args = vec![
            "cumulus-coordinator",
            "--node-id",
            "1",
            "--grpc-listen",
            "0.0.0.0:7000",
            "--http-listen",
            "0.0.0.0:8000",
            "--peer",
            peer,
            "--data-dir",
            "/tmp/unused",
        ];
        args.extend_from_slice(more);
        Config::try_parse_from(args).expect("parses")
    }

    #[test]
    fn the_stored_membership_decides_where_raft_is() {
        let shared = CumulusNode {
            grpc_addr: "c1:7000".into(),
            http_addr: "c1:8000".into(),
            raft_addr: String::new(),
        };
        let apart = CumulusNode {
            raft_addr: "c1:7100".into(),
            ..shared.clone()
        };
        let flag: SocketAddr = "0.0.0.0:7100".parse().expect("addr");
        // Not a member yet (pristine, joining): the flags decide.
        check_stored_raft_addr(1, Some(flag), None).expect("no membership");
        check_stored_raft_addr(1, None, None).expect("no membership");
        check_stored_raft_addr(1, None, Some(&shared)).expect("shared, as stored");
        check_stored_raft_addr(1, Some(flag), Some(&apart)).expect("apart, as stored");
        let err = check_stored_raft_addr(1, Some(flag), Some(&shared))
            .expect_err("moving by a flag")
            .to_string();
        assert!(
            err.contains("would no longer serve") && err.contains("cluster remove"),
            "{err}"
        );
        let err = check_stored_raft_addr(1, None, Some(&apart))
            .expect_err("dropping the flag")
            .to_string();
        assert!(
            err.contains("c1:7100") && err.contains("nothing would serve"),
            "{err}"
        );
    }

    #[test]
    fn a_raft_port_of_its_own_is_checked() {
        let apart = "1=c1:7000@c1:8000@c1:7100";
        let shared = "1=c1:7000@c1:8000";
        // Both ways that agree: Raft on the gRPC port, or on a port of its own.
        config_with(shared, &[]).validate().expect("shared port");
        config_with(apart, &["--raft-listen", "0.0.0.0:7100"])
            .validate()
            .expect("a port of its own");
        // Port 0 (tests: any free port) never collides.
        config_with(apart, &["--raft-listen", "127.0.0.1:0"])
            .validate()
            .expect("port 0");
        for (peer, flags, says) in [
            (
                apart,
                &["--raft-listen", "0.0.0.0:7000"][..],
                "is the gRPC port",
            ),
            (
                apart,
                &["--raft-listen", "10.0.0.1:7000"][..],
                "is the gRPC port",
            ),
            (
                apart,
                &["--raft-listen", "10.0.0.1:8000"][..],
                "is the HTTP port",
            ),
            (
                shared,
                &["--raft-listen", "0.0.0.0:7100"][..],
                "names no Raft address",
            ),
            (apart, &[][..], "no --raft-listen"),
            (
                "1=c1:7000@c1:8000@c1:7000",
                &["--raft-listen", "0.0.0.0:7100"][..],
                "same address for gRPC and Raft",
            ),
        ] {
            let err = config_with(peer, flags)
                .validate()
                .expect_err("refused")
                .to_string();
            assert!(err.contains(says), "{peer} {flags:?}: {err}");
        }
    }

    #[test]
    fn the_state_byte_budget_is_bounded_both_ways() {
        use clap::Parser;
        let config = |bytes: u64| {
            Config::try_parse_from([
                "cumulus-coordinator",
                "--node-id",
                "1",
                "--grpc-listen",
                "127.0.0.1:7001",
                "--http-listen",
                "127.0.0.1:8001",
                "--peer",
                "1=127.0.0.1:7001@127.0.0.1:8001",
                "--data-dir",
                "/tmp/unused",
                "--max-state-bytes",
                &bytes.to_string(),
            ])
            .expect("parses")
        };
        let max = cumulus_raft_store::state::MAX_STATE_BYTES;
        assert!(config(max).validate().is_ok());
        assert!(config(MIN_STATE_BYTES).validate().is_ok());
        for bad in [MIN_STATE_BYTES - 1, max + 1] {
            let err = config(bad).validate().expect_err("out of range");
            assert!(err.to_string().contains("--max-state-bytes"), "{err}");
        }
    }
}
