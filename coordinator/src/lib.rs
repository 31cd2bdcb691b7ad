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

/// A peer given on the command line: `ID=GRPC_ADDR@HTTP_ADDR`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Raft node id (≥ 1).
    pub id: NodeId,
    /// Its addresses.
    pub node: CumulusNode,
}

/// A `--peer` value that is not `ID=GRPC_HOST:PORT@HTTP_HOST:PORT`.
#[derive(Debug, thiserror::Error)]
#[error("peer {0:?} must look like ID=GRPC_HOST:PORT@HTTP_HOST:PORT")]
pub struct BadPeer(pub String);

/// Parses `ID=GRPC_ADDR@HTTP_ADDR`, e.g. `1=127.0.0.1:7001@127.0.0.1:8001`.
///
/// # Errors
/// [`BadPeer`] when it is malformed (the id must be a non-zero integer, both addresses
/// `host:port`).
pub fn parse_peer(s: &str) -> Result<Peer, BadPeer> {
    let bad = || BadPeer(s.to_owned());
    let (id, addrs) = s.split_once('=').ok_or_else(bad)?;
    let (grpc, http) = addrs.split_once('@').ok_or_else(bad)?;
    let id: NodeId = id.parse().map_err(|_| bad())?;
    if id == 0 || grpc.is_empty() || http.is_empty() || !grpc.contains(':') || !http.contains(':') {
        return Err(bad());
    }
    Ok(Peer {
        id,
        node: CumulusNode {
            grpc_addr: grpc.to_string(),
            http_addr: http.to_string(),
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
    /// Address the gRPC server (Raft, client and worker services) listens on.
    #[arg(long)]
    pub grpc_listen: SocketAddr,
    /// Address the HTTP server (REST, SSE logs, health) listens on.
    #[arg(long)]
    pub http_listen: SocketAddr,
    /// Every member of the initial cluster, this node included: `ID=GRPC@HTTP` (repeat).
    /// With `--join`, this node's own entry is enough.
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
    let (grpc_listener, http_listener) = bind_listeners(&config, &tls).await?;
    info!(node_id = config.node_id, grpc = %me.grpc_addr, http = %me.http_addr, tls = node.tls, "coordinator listening");

    let grpc_task = spawn_grpc(
        &node,
        grpc_listener,
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

/// Binds the gRPC and HTTP ports and wraps them in bounded listeners (TLS when
/// configured): their connection caps lowered, with a warning, to fit the open-file
/// limit, and on the gRPC port connections reserved for coordinators. Returns
/// `(gRPC, HTTP)`.
///
/// # Errors
/// A port in use, an unreadable open-file limit, an unusable server TLS configuration.
async fn bind_listeners(
    config: &Config,
    tls: &Tls,
) -> anyhow::Result<(
    cumulus_listen::BoundedListener,
    cumulus_listen::BoundedListener,
)> {
    let grpc_listener = tokio::net::TcpListener::bind(config.grpc_listen)
        .await
        .with_context(|| format!("binding gRPC on {}", config.grpc_listen))?;
    let http_listener = tokio::net::TcpListener::bind(config.http_listen)
        .await
        .with_context(|| format!("binding HTTP on {}", config.http_listen))?;
    let budget = cumulus_listen::fd_budget(cumulus_listen::open_fds())
        .context("reading the open-file limit")?;
    let caps = cumulus_listen::fit_caps(
        &[config.max_grpc_connections, config.max_http_connections],
        budget,
    );
    if caps != [config.max_grpc_connections, config.max_http_connections] {
        warn!(
            grpc = caps[0],
            http = caps[1],
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
    .with_tls(server_tls);
    Ok((grpc_listener, http_listener))
}

/// Serves the gRPC services on `listener` until `cancel`: Raft (the `peer_token` only;
/// a pristine node votes only for `initial_members`), the client service (the cluster
/// `token` or a user's) and the worker service (the cluster `token` only; enrolment
/// signed by `enrolment_ca`). Returns the server's task.
fn spawn_grpc(
    node: &Arc<Node>,
    listener: cumulus_listen::BoundedListener,
    initial_members: Vec<NodeId>,
    token: Arc<str>,
    peer_token: Arc<str>,
    enrolment_ca: Option<Arc<cumulus_tls::generate::ClusterCa>>,
    cancel: CancellationToken,
) -> tokio::task::JoinHandle<Result<(), tonic::transport::Error>> {
    let interceptor = AuthInterceptor { token };
    // HTTP/2 and TCP keepalive: a replication stream from a leader that vanished (host
    // down, network cut) ends instead of holding its task and openraft's behind it.
    // Streams per connection and header bytes bounded; `TrackLayer` counts each
    // connection's calls for the listener's first-request and idle deadlines.
    let grpc = tonic::transport::Server::builder()
        .concurrency_limit_per_connection(cumulus_listen::GRPC_MAX_CONCURRENT_STREAMS as usize)
        .max_concurrent_streams(cumulus_listen::GRPC_MAX_CONCURRENT_STREAMS)
        .http2_max_header_list_size(cumulus_listen::HTTP2_MAX_HEADER_LIST_BYTES)
        .http2_keepalive_interval(Some(Duration::from_millis(network::KEEPALIVE_INTERVAL_MS)))
        .http2_keepalive_timeout(Some(Duration::from_millis(network::KEEPALIVE_TIMEOUT_MS)))
        .layer(cumulus_listen::TrackLayer)
        .layer(metrics::GrpcTimingLayer)
        .add_service(tonic::service::interceptor::InterceptedService::new(
            RaftServiceServer::new(raft_service::RaftSvc::new(node.clone(), initial_members))
                .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES),
            AuthInterceptor { token: peer_token },
        ))
        // Users: the cluster token or a user's token, with its role.
        .add_service(ClientServiceServer::with_interceptor(
            client_service::ClientSvc { node: node.clone() },
            auth::UserAuth { node: node.clone() },
        ))
        .add_service(WorkerServiceServer::with_interceptor(
            worker_service::WorkerSvc {
                node: node.clone(),
                enrolment_ca,
            },
            interceptor,
        ));
    // The bounded listeners set TCP_NODELAY on every accepted connection: with Nagle's
    // algorithm a small gRPC reply (an AppendEntries ack, a submit's answer) written
    // behind unacknowledged bytes waits for the peer's delayed ACK (~40 ms on Linux).
    tokio::spawn(
        grpc.serve_with_incoming_shutdown(listener.into_incoming(), async move {
            cancel.cancelled().await
        }),
    )
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
        for bad in ["", "1", "x=a:1@b:2", "0=a:1@b:2", "1=a:1", "1=a@b:2"] {
            assert!(parse_peer(bad).is_err(), "{bad}");
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
