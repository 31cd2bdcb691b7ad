//! Where the cluster is: `cluster.json` (written by `local up`) and the resolution of
//! `--addr`, `--http`, `--token`/`--token-file` against it.

use std::collections::HashSet;
use std::fs;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::args::GlobalOpts;
use cumulus_client::ClientTls;

// The name of the cluster description inside `--local-dir`, and the largest read back:
// the contract's, as the Python SDK's.
pub use cumulus_api::client_config::{CLUSTER_FILE, MAX_CLUSTER_FILE_BYTES};
/// Largest token accepted, bytes.
pub const MAX_TOKEN_BYTES: usize = cumulus_api::token::MAX_TOKEN_BYTES;

/// Errors of reading or resolving the cluster configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The token file cannot be read.
    #[error("cannot read the token file {path} (--token-file or CUMULUS_TOKEN_FILE): {source}")]
    TokenFile {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// An I/O error on a named file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// `cluster.json` is not valid.
    #[error("{path} is not a valid cluster file: {reason}")]
    BadClusterFile {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// The token file or value is not usable.
    #[error("bad token ({origin}): {reason}")]
    BadToken {
        /// Where it came from (flag or file).
        origin: String,
        /// What was wrong.
        reason: String,
    },
    /// An address is not `host:port`.
    #[error("bad address {addr:?} in {flag}: expected host:port")]
    BadAddress {
        /// The flag it came from.
        flag: &'static str,
        /// The value.
        addr: String,
    },
    /// The TLS files cannot be used.
    #[error("{0}")]
    Tls(cumulus_tls::TlsError),
    /// `--tls-cert` names a coordinator or a worker, not a user.
    #[error(
        "{path} is the certificate of {identity}, not of a user: issue one with `cumulusctl certs issue user NAME`"
    )]
    NotAUserCertificate {
        /// The certificate file.
        path: PathBuf,
        /// Whom it names.
        identity: String,
    },
    /// Nothing says where the cluster is.
    #[error(
        "no {what}: pass {flag}, or start a local cluster with `cumulusctl local up` (looked for {path})"
    )]
    Missing {
        /// What is missing.
        what: &'static str,
        /// The flag that would provide it.
        flag: &'static str,
        /// The cluster file that was looked for.
        path: PathBuf,
    },
}

/// One coordinator of a local cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoordinatorEntry {
    /// Raft node id, 1..=n.
    pub node_id: u64,
    /// gRPC `host:port`.
    pub grpc: String,
    /// HTTP `host:port`.
    pub http: String,
    /// OS process id while running; `null` once stopped by `local down`.
    pub pid: Option<u32>,
    /// Its `--data-dir` (absolute).
    pub data_dir: PathBuf,
    /// Its combined stdout+stderr log (absolute).
    pub log: PathBuf,
}

/// One worker agent of a local cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerEntry {
    /// Worker id, e.g. `worker-1`.
    pub worker_id: String,
    /// OS process id while running; `null` once stopped by `local down`.
    pub pid: Option<u32>,
    /// Its `--data-dir` (absolute).
    pub data_dir: PathBuf,
    /// Its combined stdout+stderr log (absolute).
    pub log: PathBuf,
    /// Rank slots it offers.
    #[serde(default = "default_slots")]
    pub slots: u32,
}

fn default_slots() -> u32 {
    4
}

/// `<local-dir>/cluster.json`: what `local up` started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterFile {
    /// The cluster token file (absolute path, mode 0600).
    pub token_file: PathBuf,
    /// The directory of the cluster's CA and certificates (`ca.pem`, `coordinator-N.pem`,
    /// `worker-ID.pem`, keys 0600); `None`: the cluster runs with `--insecure`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_dir: Option<PathBuf>,
    /// Coordinators, by node id.
    pub coordinators: Vec<CoordinatorEntry>,
    /// Worker agents.
    pub workers: Vec<WorkerEntry>,
}

impl ClusterFile {
    /// The CA certificate of a TLS cluster.
    pub fn ca_file(&self) -> Option<PathBuf> {
        self.tls_dir
            .as_ref()
            .map(|d| d.join(cumulus_tls::generate::CA_FILE))
    }

    /// The peer token file beside the cluster token file (`peer-token`, mode 0600): what
    /// the local coordinators present to each other's Raft service.
    pub fn peer_token_file(&self) -> PathBuf {
        self.token_file.with_file_name("peer-token")
    }

    /// Path of the cluster file inside `local_dir`.
    pub fn path_in(local_dir: &Path) -> PathBuf {
        local_dir.join(CLUSTER_FILE)
    }

    /// Reads and validates `<local_dir>/cluster.json`; `Ok(None)` when it does not exist.
    pub fn load(local_dir: &Path) -> Result<Option<ClusterFile>, ConfigError> {
        let path = Self::path_in(local_dir);
        let bytes = match read_limited(&path, MAX_CLUSTER_FILE_BYTES) {
            Ok(b) => b,
            Err(ConfigError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let file: ClusterFile =
            serde_json::from_slice(&bytes).map_err(|e| ConfigError::BadClusterFile {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        file.validate().map_err(|e| ConfigError::BadClusterFile {
            path,
            reason: e.to_string(),
        })?;
        Ok(Some(file))
    }

    /// Checks the invariants a reader relies on.
    ///
    /// # Errors
    /// [`ClusterFileError`] naming the first bad entry.
    pub fn validate(&self) -> Result<(), ClusterFileError> {
        if self.coordinators.is_empty() {
            return Err(ClusterFileError::NoCoordinators);
        }
        let mut ids = HashSet::new();
        for c in &self.coordinators {
            if c.node_id == 0 || !ids.insert(c.node_id) {
                return Err(ClusterFileError::NodeId(c.node_id));
            }
            for (what, addr) in [("grpc", &c.grpc), ("http", &c.http)] {
                if addr.parse::<SocketAddr>().is_err() {
                    return Err(ClusterFileError::Address {
                        node_id: c.node_id,
                        what,
                        addr: addr.clone(),
                    });
                }
            }
        }
        let mut workers = HashSet::new();
        for w in &self.workers {
            if cumulus_api::ids::check_worker_id(&w.worker_id).is_err()
                || !workers.insert(w.worker_id.as_str())
            {
                return Err(ClusterFileError::WorkerId(w.worker_id.clone()));
            }
            if w.slots == 0 {
                return Err(ClusterFileError::NoSlots(w.worker_id.clone()));
            }
        }
        Ok(())
    }

    /// Writes the file atomically: `cluster.json.tmp`, fsync, rename over `cluster.json`.
    pub fn store(&self, local_dir: &Path) -> Result<(), ConfigError> {
        let path = Self::path_in(local_dir);
        let tmp = local_dir.join(format!("{CLUSTER_FILE}.tmp"));
        let json = serde_json::to_vec_pretty(self).expect("a ClusterFile always serializes");
        let io = |source| ConfigError::Io {
            path: tmp.clone(),
            source,
        };
        let mut f = fs::File::create(&tmp).map_err(io)?;
        f.write_all(&json).map_err(io)?;
        f.write_all(b"\n").map_err(io)?;
        f.sync_all().map_err(io)?;
        drop(f);
        fs::rename(&tmp, &path).map_err(|source| ConfigError::Io {
            path: path.clone(),
            source,
        })?;
        Ok(())
    }

    /// gRPC addresses of every coordinator, in node-id order.
    pub fn grpc_addrs(&self) -> Vec<String> {
        self.coordinators.iter().map(|c| c.grpc.clone()).collect()
    }

    /// HTTP addresses of every coordinator, in node-id order.
    pub fn http_addrs(&self) -> Vec<String> {
        self.coordinators.iter().map(|c| c.http.clone()).collect()
    }
}

/// Reads at most `limit` bytes of `path`; more is an error.
fn read_limited(path: &Path, limit: u64) -> Result<Vec<u8>, ConfigError> {
    use std::io::Read;
    let io = |source| ConfigError::Io {
        path: path.to_path_buf(),
        source,
    };
    let f = fs::File::open(path).map_err(io)?;
    let mut buf = Vec::new();
    f.take(limit + 1).read_to_end(&mut buf).map_err(io)?;
    if buf.len() as u64 > limit {
        return Err(ConfigError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("larger than {limit} bytes"),
            ),
        });
    }
    Ok(buf)
}

/// Reads a token file: trimmed, non-empty, ≤ [`MAX_TOKEN_BYTES`], visible ASCII only.
pub fn read_token_file(path: &Path) -> Result<String, ConfigError> {
    let bytes = read_limited(path, MAX_TOKEN_BYTES as u64 + 64).map_err(|e| match e {
        ConfigError::Io { path, source } => ConfigError::TokenFile { path, source },
        other => other,
    })?;
    let text = String::from_utf8(bytes).map_err(|_| ConfigError::BadToken {
        origin: path.display().to_string(),
        reason: "not UTF-8".into(),
    })?;
    check_token(text.trim(), &path.display().to_string())
}

/// Validates a token value with [`cumulus_api::token::check`].
pub fn check_token(token: &str, origin: &str) -> Result<String, ConfigError> {
    cumulus_api::token::check(token).map_err(|e| ConfigError::BadToken {
        origin: origin.to_string(),
        reason: e.to_string(),
    })?;
    Ok(token.to_string())
}

/// Normalizes one address: strips `http://` or `https://`, a trailing `/`, and requires
/// `host:port`.
pub fn normalize_addr(raw: &str, flag: &'static str) -> Result<String, ConfigError> {
    let s = raw.trim();
    let s = s
        .strip_prefix("http://")
        .or_else(|| s.strip_prefix("https://"))
        .unwrap_or(s);
    let s = s.strip_suffix('/').unwrap_or(s);
    let bad = || ConfigError::BadAddress {
        flag,
        addr: raw.to_string(),
    };
    let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
    if host.is_empty() || host.contains('/') || port.parse::<u16>().map_or(true, |p| p == 0) {
        return Err(bad());
    }
    Ok(s.to_string())
}

/// Where and how to reach the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conn {
    /// Coordinator gRPC `host:port` addresses (non-empty).
    pub grpc: Vec<String>,
    /// Coordinator HTTP `host:port` addresses (may be empty when only gRPC was given).
    pub http: Vec<String>,
    /// The cluster bearer token.
    pub token: String,
    /// TLS: the CA that verifies the coordinators (`None`: plaintext, `--insecure`).
    pub tls: Option<ClientTls>,
    /// How long a call keeps retrying an unreachable or leaderless cluster (`--timeout`).
    pub retry_total: std::time::Duration,
}

impl Conn {
    /// `https` with TLS, else `http`.
    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }
}

/// Reads the CA certificate at `path` for a client's TLS.
///
/// # Errors
/// [`ConfigError::Tls`] naming the file.
pub fn client_tls(path: &Path) -> Result<ClientTls, ConfigError> {
    let trust = cumulus_tls::Trust::load(path).map_err(ConfigError::Tls)?;
    Ok(ClientTls {
        ca_pem: trust.ca_pem().into(),
        identity_pem: None,
    })
}

/// Resolves the connection from flags/env, falling back to `<local-dir>/cluster.json`.
pub fn resolve(global: &GlobalOpts) -> Result<Conn, ConfigError> {
    let needs_file = global.addr.is_empty()
        || global.http.is_empty()
        || (global.token.is_none() && global.token_file.is_none());
    let file = if needs_file {
        ClusterFile::load(&global.local_dir)?
    } else {
        None
    };
    let cluster_path = ClusterFile::path_in(&global.local_dir);

    let grpc: Vec<String> = if !global.addr.is_empty() {
        global
            .addr
            .iter()
            .filter(|a| !a.trim().is_empty())
            .map(|a| normalize_addr(a, "--addr"))
            .collect::<Result<_, _>>()?
    } else {
        file.as_ref()
            .map(ClusterFile::grpc_addrs)
            .unwrap_or_default()
    };
    if grpc.is_empty() {
        return Err(ConfigError::Missing {
            what: "coordinator address",
            flag: "--addr (or CUMULUS_ADDR)",
            path: cluster_path,
        });
    }
    let http: Vec<String> = if !global.http.is_empty() {
        global
            .http
            .iter()
            .filter(|a| !a.trim().is_empty())
            .map(|a| normalize_addr(a, "--http"))
            .collect::<Result<_, _>>()?
    } else if global.addr.is_empty() {
        file.as_ref()
            .map(ClusterFile::http_addrs)
            .unwrap_or_default()
    } else {
        // Explicit gRPC addresses of another cluster: the local file's HTTP ports would be wrong.
        Vec::new()
    };
    let certified = global.tls_cert.is_some() && global.tls_key.is_some();
    // With a user's certificate a token counts only when `--token-file` names it on the
    // command line: one from the environment (`CUMULUS_TOKEN`, which is environment-only,
    // or `CUMULUS_TOKEN_FILE`) is left unused, as the Python SDK does, so that an
    // administrator's token in the shell does not silently replace the certificate.
    let env_token_file =
        std::env::var_os(cumulus_api::client_config::ENV_TOKEN_FILE).map(PathBuf::from);
    let token_file = global
        .token_file
        .as_ref()
        .filter(|p| !(certified && env_token_file.as_ref() == Some(*p)));
    let env_token = global.token.as_ref().filter(|_| !certified);
    let token = if let Some(t) = env_token {
        cumulus_api::token::refuse_command_line(t, "--token", "CUMULUS_TOKEN").map_err(|e| {
            ConfigError::BadToken {
                origin: "--token".into(),
                reason: e.to_string(),
            }
        })?;
        check_token(t.trim(), "CUMULUS_TOKEN")?
    } else if let Some(p) = token_file {
        read_token_file(p)?
    } else if certified {
        // A user's certificate alone: never the local cluster's (administrator) token.
        String::new()
    } else if let Some(f) = &file {
        read_token_file(&f.token_file)?
    } else {
        return Err(ConfigError::Missing {
            what: "token",
            flag: "--token-file (or CUMULUS_TOKEN_FILE)",
            path: cluster_path,
        });
    };
    // TLS: --insecure, else --tls-ca, else the local cluster's CA when its addresses are
    // the ones used; explicit addresses without a CA are refused (as kubectl does without
    // a certificate authority).
    let ca_path: Option<PathBuf> = if global.insecure {
        None
    } else if let Some(ca) = &global.tls_ca {
        Some(ca.clone())
    } else if let Some(f) = file.as_ref().filter(|_| global.addr.is_empty()) {
        f.ca_file()
    } else {
        return Err(ConfigError::Missing {
            what: "TLS CA certificate",
            flag: "--tls-ca FILE (or CUMULUS_TLS_CA), or --insecure for a plaintext cluster",
            path: cluster_path,
        });
    };
    let mut tls = ca_path.as_deref().map(client_tls).transpose()?;
    if let (Some(cert), Some(key)) = (&global.tls_cert, &global.tls_key) {
        let (Some(tls), Some(ca)) = (tls.as_mut(), ca_path.as_deref()) else {
            return Err(ConfigError::Missing {
                what: "TLS CA certificate",
                flag: "--tls-ca FILE (or CUMULUS_TLS_CA), to verify the coordinators with",
                path: cluster_path,
            });
        };
        let creds = cumulus_tls::Credentials::load(cert, key, ca).map_err(ConfigError::Tls)?;
        if !matches!(creds.identity(), cumulus_tls::Identity::User(_)) {
            return Err(ConfigError::NotAUserCertificate {
                path: cert.clone(),
                identity: creds.identity().to_string(),
            });
        }
        tls.identity_pem = Some(cumulus_client::IdentityPem {
            cert: creds.cert_pem().into(),
            key: creds.key_pem().into(),
        });
    }
    Ok(Conn {
        grpc,
        http,
        token,
        tls,
        retry_total: std::time::Duration::from_secs(global.timeout),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::OutputFormat;

    fn sample(dir: &Path) -> ClusterFile {
        ClusterFile {
            token_file: dir.join("token"),
            tls_dir: None,
            coordinators: (1..=3)
                .map(|i| CoordinatorEntry {
                    node_id: i,
                    grpc: format!("127.0.0.1:{}", 7000 + i),
                    http: format!("127.0.0.1:{}", 8000 + i),
                    pid: Some(100 + i as u32),
                    data_dir: dir.join(format!("coord-{i}")),
                    log: dir.join(format!("coord-{i}.log")),
                })
                .collect(),
            workers: vec![WorkerEntry {
                worker_id: "worker-1".into(),
                pid: None,
                data_dir: dir.join("worker-1"),
                log: dir.join("worker-1.log"),
                slots: 4,
            }],
        }
    }

    fn opts(dir: &Path) -> GlobalOpts {
        GlobalOpts {
            addr: vec![],
            http: vec![],
            token: None,
            token_file: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            insecure: false,
            local_dir: dir.to_path_buf(),
            output: OutputFormat::Table,
            verbose: 0,
            timeout: 30,
        }
    }

    /// The keys of a JSON object, as a set.
    fn keys(v: &serde_json::Value) -> std::collections::BTreeSet<String> {
        v.as_object().expect("an object").keys().cloned().collect()
    }

    fn shape_keys(shape: &cumulus_api::shape::Shape) -> std::collections::BTreeSet<String> {
        shape.field_names().into_iter().map(String::from).collect()
    }

    #[test]
    fn cluster_file_fields_are_the_contract_shape() {
        use cumulus_api::client_config::{
            CLUSTER_FILE_COORDINATOR, CLUSTER_FILE_SHAPE, CLUSTER_FILE_WORKER,
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let mut f = sample(dir.path());
        f.tls_dir = Some(dir.path().join("tls"));
        let v = serde_json::to_value(&f).expect("json");
        assert_eq!(keys(&v), shape_keys(&CLUSTER_FILE_SHAPE));
        assert_eq!(
            keys(&v["coordinators"][0]),
            shape_keys(&CLUSTER_FILE_COORDINATOR)
        );
        assert_eq!(keys(&v["workers"][0]), shape_keys(&CLUSTER_FILE_WORKER));
        // What the contract says a writer may leave out, a reader here accepts without.
        let mut bare = v.clone();
        for field in CLUSTER_FILE_SHAPE.fields.iter().filter(|f| !f.required) {
            bare.as_object_mut().expect("object").remove(field.name);
        }
        for field in CLUSTER_FILE_WORKER.fields.iter().filter(|f| !f.required) {
            bare["workers"][0]
                .as_object_mut()
                .expect("object")
                .remove(field.name);
        }
        serde_json::from_value::<ClusterFile>(bare).expect("optional fields are optional");
    }

    #[test]
    fn cluster_file_round_trip_and_no_tmp_left() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(ClusterFile::load(dir.path()).expect("absent is fine"), None);
        let f = sample(dir.path());
        f.store(dir.path()).expect("store");
        assert_eq!(
            ClusterFile::load(dir.path()).expect("load"),
            Some(f.clone())
        );
        assert!(!dir.path().join("cluster.json.tmp").exists());
        // Overwrite with a changed pid.
        let mut g = f;
        g.coordinators[0].pid = None;
        g.store(dir.path()).expect("store");
        assert_eq!(ClusterFile::load(dir.path()).expect("load"), Some(g));
    }

    #[test]
    fn corrupt_or_invalid_cluster_file_is_rejected_with_reason() {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(dir.path().join(CLUSTER_FILE), b"{not json").expect("write");
        let err = ClusterFile::load(dir.path()).expect_err("corrupt");
        assert!(matches!(err, ConfigError::BadClusterFile { .. }), "{err}");

        let mut f = sample(dir.path());
        f.coordinators[1].node_id = 1;
        fs::write(
            dir.path().join(CLUSTER_FILE),
            serde_json::to_vec(&f).expect("json"),
        )
        .expect("write");
        let err = ClusterFile::load(dir.path()).expect_err("duplicate id");
        assert!(err.to_string().contains("repeated"), "{err}");

        let mut f = sample(dir.path());
        f.coordinators[2].grpc = "nowhere".into();
        fs::write(
            dir.path().join(CLUSTER_FILE),
            serde_json::to_vec(&f).expect("json"),
        )
        .expect("write");
        let err = ClusterFile::load(dir.path()).expect_err("bad addr");
        assert!(err.to_string().contains("nowhere"), "{err}");
    }

    #[test]
    fn resolve_falls_back_to_cluster_file_and_token_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = sample(dir.path());
        f.store(dir.path()).expect("store");
        fs::write(&f.token_file, "abc123abc123abc123\n").expect("token");
        let conn = resolve(&opts(dir.path())).expect("resolve");
        assert_eq!(
            conn.grpc,
            vec!["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"]
        );
        assert_eq!(
            conn.http,
            vec!["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]
        );
        assert_eq!(conn.token, "abc123abc123abc123");

        // Explicit flags win; explicit gRPC without --http does not borrow the file's HTTP.
        let mut o = opts(dir.path());
        o.addr = vec!["http://10.0.0.1:50051/".into(), "10.0.0.2:50051".into()];
        let other = dir.path().join("other-token");
        fs::write(&other, "0123456789abcdef0123\n").expect("token");
        o.token_file = Some(other);
        // Explicit addresses need a CA or --insecure.
        let err = resolve(&o).expect_err("no CA for explicit addresses");
        assert!(err.to_string().contains("--tls-ca"), "{err}");
        o.insecure = true;
        let conn = resolve(&o).expect("resolve");
        assert!(conn.tls.is_none());
        assert_eq!(conn.grpc, vec!["10.0.0.1:50051", "10.0.0.2:50051"]);
        assert!(conn.http.is_empty());
        assert_eq!(conn.token, "0123456789abcdef0123");

        // A token on the command line (not from CUMULUS_TOKEN) is refused: `ps` shows it.
        o.token_file = None;
        o.token = Some("0123456789abcdef0123-on-the-command-line".into());
        let err = resolve(&o).expect_err("token on the command line");
        assert!(err.to_string().contains("ps"), "{err}");
    }

    #[test]
    fn resolve_without_anything_says_what_is_missing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = resolve(&opts(dir.path())).expect_err("nothing");
        assert!(err.to_string().contains("--addr"), "{err}");
        let mut o = opts(dir.path());
        o.addr = vec!["127.0.0.1:1".into()];
        let err = resolve(&o).expect_err("no token");
        assert!(err.to_string().contains("--token-file"), "{err}");
    }

    #[test]
    fn addresses_and_tokens_are_validated() {
        assert_eq!(normalize_addr("h:1", "--addr").expect("ok"), "h:1");
        assert!(normalize_addr("h", "--addr").is_err());
        assert!(normalize_addr("h:0", "--addr").is_err());
        assert!(normalize_addr(":80", "--addr").is_err());
        assert!(normalize_addr("h:99999", "--addr").is_err());
        assert!(check_token("", "x").is_err());
        assert!(check_token("a b", "x").is_err());
        assert!(check_token(&"a".repeat(4097), "x").is_err());
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("t");
        fs::write(&p, "  \n").expect("write");
        assert!(read_token_file(&p).is_err());
    }
}

/// Why a local cluster file breaks an invariant its readers rely on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClusterFileError {
    /// It lists no coordinator.
    #[error("no coordinators")]
    NoCoordinators,
    /// A coordinator node id that is zero or repeated.
    #[error("coordinator node id {0} is zero or repeated")]
    NodeId(u64),
    /// A coordinator address that is not `ip:port`.
    #[error("coordinator {node_id} {what} address {addr:?} is not ip:port")]
    Address {
        /// The coordinator.
        node_id: u64,
        /// `grpc` or `http`.
        what: &'static str,
        /// The address as written.
        addr: String,
    },
    /// A worker id that is invalid or repeated.
    #[error("worker id {0:?} is invalid or repeated")]
    WorkerId(String),
    /// A worker with no slots.
    #[error("worker {0} has 0 slots")]
    NoSlots(String),
}
