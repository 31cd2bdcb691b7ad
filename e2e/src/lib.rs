//! Test harness for end-to-end tests: starts real `cumulus-coordinator` and
//! `cumulus-worker` processes on 127.0.0.1 in a temp dir, talks to them over gRPC and
//! HTTP, kills them with SIGKILL, and waits on conditions (never on fixed sleeps).
//!
//! The binaries are taken from the cargo target dir of the test executable, so run
//! `cargo build --workspace --bins` before `cargo test` (the README's test command
//! does).

pub mod blobs;
pub mod browser;
mod cluster;
mod dump;
pub mod history;
pub mod nemesis;
pub mod net;
pub mod ranks;
mod s3;
mod workload;

use std::future::Future;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cumulus_api::v1;
use cumulus_api::v1::client_service_client::ClientServiceClient;
use cumulus_client::ClientTls;
use tonic::codegen::InterceptedService;
use tonic::transport::{Channel, Endpoint};

pub use cluster::*;
use dump::*;
pub use s3::*;
pub use workload::*;

/// The token every test cluster uses.
pub const TOKEN: &str = "e2e-test-token-0123456789abcdef";
/// Peer token of test clusters: what coordinators present to each other's Raft service
/// (in the file `peer-token` of the cluster's temp dir).
pub const PEER_TOKEN: &str = "e2e-peer-token-fedcba9876543210";

/// Directory holding the workspace's binaries (target/debug or target/release): the
/// directory of the running executable, or its parent for test executables in `deps/`.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the running executable has a path");
    let dir = exe.parent().expect("an executable lives in a directory");
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().expect("deps has a parent").to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

/// Path of a workspace binary; panics with the fix when it was not built.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

/// Root of the workspace (for the bundled data set).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e lives in the workspace")
        .to_path_buf()
}

/// Lowest port handed out by [`free_port`].
pub const TEST_PORT_MIN: u16 = 10_000;
/// One past the highest port handed out by [`free_port`]: below Linux's ephemeral range
/// (32768–60999), so no outgoing connection of any process can take a port between
/// the moment it is chosen and the moment a coordinator binds it.
pub const TEST_PORT_END: u16 = 32_000;

/// A free TCP port on 127.0.0.1 outside the ephemeral range, never the same twice in
/// one test process (bound, then released for the process that will use it).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let span = u32::from(TEST_PORT_END - TEST_PORT_MIN);
    // Spread concurrent test processes apart by pid.
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = TEST_PORT_MIN + ((start + n) % span) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {TEST_PORT_MIN}..{TEST_PORT_END}");
}

/// Polls `f` every 100 ms until it yields `Some`, or panics after `deadline` naming `what`.
pub async fn wait_for<T, F, Fut>(what: &str, deadline: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Adds the bearer token to gRPC calls.
#[derive(Clone)]
pub struct Auth(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl Auth {
    /// For `token`.
    pub fn new(token: &str) -> Self {
        Auth(format!("Bearer {token}").parse().expect("ascii token"))
    }
}

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        req.metadata_mut().insert("authorization", self.0.clone());
        Ok(req)
    }
}

/// An authenticated client of one coordinator.
pub type Client = ClientServiceClient<InterceptedService<Channel, Auth>>;

/// An authenticated worker-API client of one coordinator (tests that play an agent).
pub type WorkerClient =
    v1::worker_service_client::WorkerServiceClient<InterceptedService<Channel, Auth>>;

/// The longest a harness connection may take to be ready: TCP connect, TLS handshake
/// and HTTP/2 preface. tonic's `connect_timeout` bounds only the TCP connect; a
/// handshake through a proxied connection whose far side died (a killed coordinator
/// behind the nemesis proxy) otherwise waits forever.
pub const CONNECT_DEADLINE: Duration = Duration::from_secs(5);

/// `endpoint.connect()` within [`CONNECT_DEADLINE`].
///
/// # Errors
/// The connection failed, or was not ready in time (named with `addr`).
pub async fn connect_bounded(addr: &str, endpoint: Endpoint) -> anyhow::Result<Channel> {
    match tokio::time::timeout(CONNECT_DEADLINE, endpoint.connect()).await {
        Ok(connected) => Ok(connected?),
        Err(_) => anyhow::bail!("connecting to {addr}: not ready within {CONNECT_DEADLINE:?}"),
    }
}

/// A channel to the coordinator at `grpc_addr` (host:port): 1 s for the TCP connect,
/// [`CONNECT_DEADLINE`] until ready, 10 s per call. With `tls`, as the CLI connects: the
/// server must present a certificate of the CA naming a coordinator.
pub async fn coordinator_channel(
    grpc_addr: &str,
    tls: Option<&ClientTls>,
) -> anyhow::Result<Channel> {
    use cumulus_client::{Refusals, TlsConnector};
    let endpoint = cumulus_client::endpoint(grpc_addr, tls.is_some())?
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(10));
    let connector = match tls {
        Some(tls) => Some(TlsConnector::new(
            tls.rustls_config(cumulus_tls::ExpectedServer::AnyCoordinator)?,
            Refusals::default(),
        )),
        None => None,
    };
    let connect = cumulus_client::connect(&endpoint, connector);
    match tokio::time::timeout(CONNECT_DEADLINE, connect).await {
        Ok(connected) => Ok(connected?),
        Err(_) => anyhow::bail!("connecting to {grpc_addr}: not ready within {CONNECT_DEADLINE:?}"),
    }
}

/// `https://addr` with the client TLS `tls` (CA, and a client certificate when it has
/// one), or `http://addr` without.
///
/// # Errors
/// A bad address, or a TLS configuration tonic refuses.
pub fn endpoint(addr: &str, tls: Option<&ClientTls>) -> anyhow::Result<Endpoint> {
    Ok(match tls {
        None => Endpoint::from_shared(format!("http://{addr}"))?,
        Some(tls) => {
            let mut config = tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(&*tls.ca_pem));
            if let Some(id) = &tls.identity_pem {
                config = config.identity(tonic::transport::Identity::from_pem(&*id.cert, &*id.key));
            }
            Endpoint::from_shared(format!("https://{addr}"))?.tls_config(config)?
        }
    })
}

/// A worker-API client of the coordinator at `grpc_addr`, over `tls` (which must name
/// the worker whose id the calls carry, on a TLS cluster).
pub async fn worker_client(
    grpc_addr: &str,
    tls: Option<&ClientTls>,
) -> anyhow::Result<WorkerClient> {
    let ch = coordinator_channel(grpc_addr, tls).await?;
    Ok(v1::worker_service_client::WorkerServiceClient::with_interceptor(ch, Auth::new(TOKEN)))
}
