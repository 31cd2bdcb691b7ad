//! How a client finds and reaches a cluster, the same for `cumulusctl` and the Python SDK
//! (`cumulus.Client`): the environment variables it reads, the local cluster's
//! `cluster.json` (written by `cumulusctl local up`), and the bounds of one call's retry
//! loop over the coordinators.

use crate::shape::{Field, FieldType, Shape};

/// Coordinator gRPC addresses, comma-separated `host:port` (`cumulusctl --addr`).
pub const ENV_ADDR: &str = "CUMULUS_ADDR";
/// Coordinator HTTP addresses, comma-separated `host:port` (`cumulusctl --http`; the
/// Python SDK's addresses).
pub const ENV_HTTP: &str = "CUMULUS_HTTP";
/// A bearer token (environment only: a token on a command line is refused).
pub const ENV_TOKEN: &str = "CUMULUS_TOKEN";
/// File holding a bearer token (`--token-file`).
pub const ENV_TOKEN_FILE: &str = "CUMULUS_TOKEN_FILE";
/// The cluster's CA certificate, PEM (`--tls-ca`).
pub const ENV_TLS_CA: &str = "CUMULUS_TLS_CA";
/// A user's client certificate, PEM (`--tls-cert`).
pub const ENV_TLS_CERT: &str = "CUMULUS_TLS_CERT";
/// The private key of the client certificate, PEM (`--tls-key`).
pub const ENV_TLS_KEY: &str = "CUMULUS_TLS_KEY";
/// Plaintext to a cluster started with `--insecure` (`1`, `true`, `yes`).
pub const ENV_INSECURE: &str = "CUMULUS_INSECURE";
/// Directory of the local cluster (`--local-dir`), where `cluster.json` is.
pub const ENV_LOCAL_DIR: &str = "CUMULUS_LOCAL_DIR";
/// Seconds a `cumulusctl` call keeps retrying an unreachable or leaderless cluster
/// (`--timeout`).
pub const ENV_TIMEOUT: &str = "CUMULUS_TIMEOUT";

/// Every client environment variable, sorted.
pub const CLIENT_ENV_VARS: &[&str] = &[
    ENV_ADDR,
    ENV_HTTP,
    ENV_INSECURE,
    ENV_LOCAL_DIR,
    ENV_TIMEOUT,
    ENV_TLS_CA,
    ENV_TLS_CERT,
    ENV_TLS_KEY,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
];

/// The local cluster's directory when neither `--local-dir` nor [`ENV_LOCAL_DIR`] says.
pub const DEFAULT_LOCAL_DIR: &str = ".cumulus";
/// File name of the local cluster's description, inside the local cluster's directory.
pub const CLUSTER_FILE: &str = "cluster.json";
/// Largest `cluster.json` a client reads, in bytes (1 MiB).
pub const MAX_CLUSTER_FILE_BYTES: u64 = 1024 * 1024;

/// Most tries of one call, over all coordinators.
pub const RETRY_MAX_TRIES: u32 = 20;
/// No new try of a call starts this long after its first, in milliseconds.
pub const RETRY_TOTAL_MS: u64 = 30_000;
/// First backoff before trying the next coordinator, in milliseconds; it doubles up to
/// [`RETRY_BACKOFF_MAX_MS`].
pub const RETRY_BACKOFF_INITIAL_MS: u64 = 100;
/// Largest backoff between tries, in milliseconds.
pub const RETRY_BACKOFF_MAX_MS: u64 = 2_000;
/// TCP connect time limit of one try, in milliseconds.
pub const CONNECT_TIMEOUT_MS: u64 = 2_000;
/// Time limit of one request, in milliseconds.
pub const REQUEST_TIMEOUT_MS: u64 = 10_000;

/// One coordinator in `cluster.json`.
pub const CLUSTER_FILE_COORDINATOR: Shape = Shape {
    name: "ClusterFileCoordinator",
    doc: "One coordinator in ``cluster.json``.",
    fields: &[
        Field::required("node_id", FieldType::Int, "Raft node id, 1..=n."),
        Field::required("grpc", FieldType::Str, "gRPC ``host:port``."),
        Field::required("http", FieldType::Str, "HTTP ``host:port``."),
        Field::required(
            "pid",
            FieldType::OptionalInt,
            "OS process id while running; ``None`` once stopped.",
        ),
        Field::required("data_dir", FieldType::Str, "Its ``--data-dir`` (absolute)."),
        Field::required("log", FieldType::Str, "Its log file (absolute)."),
    ],
};

/// One worker agent in `cluster.json`.
pub const CLUSTER_FILE_WORKER: Shape = Shape {
    name: "ClusterFileWorker",
    doc: "One worker agent in ``cluster.json``.",
    fields: &[
        Field::required("worker_id", FieldType::Str, "Worker id, e.g. ``worker-1``."),
        Field::required(
            "pid",
            FieldType::OptionalInt,
            "OS process id while running; ``None`` once stopped.",
        ),
        Field::required("data_dir", FieldType::Str, "Its ``--data-dir`` (absolute)."),
        Field::required("log", FieldType::Str, "Its log file (absolute)."),
        Field::optional("slots", FieldType::Int, "Rank slots it offers (default 4)."),
    ],
};

/// `cluster.json`: what `cumulusctl local up` started.
pub const CLUSTER_FILE_SHAPE: Shape = Shape {
    name: "ClusterFileJson",
    doc: "``<local-dir>/cluster.json``: what ``cumulusctl local up`` started.",
    fields: &[
        Field::required(
            "token_file",
            FieldType::Str,
            "The cluster token file (absolute path).",
        ),
        Field::optional(
            "tls_dir",
            FieldType::Str,
            "Directory of the cluster's CA (``ca.pem``) and certificates; absent: the \
             cluster runs with ``--insecure``.",
        ),
        Field::required(
            "coordinators",
            FieldType::List(&CLUSTER_FILE_COORDINATOR),
            "Coordinators, by node id.",
        ),
        Field::required(
            "workers",
            FieldType::List(&CLUSTER_FILE_WORKER),
            "Worker agents.",
        ),
    ],
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_client_environment_is_sorted_and_unique() {
        assert!(CLIENT_ENV_VARS.windows(2).all(|w| w[0] < w[1]));
    }
}
