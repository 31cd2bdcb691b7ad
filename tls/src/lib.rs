//! TLS for every Cumulus connection (coordinator gRPC and HTTP, worker agent HTTP, peer
//! and worker connections), with rustls and one crypto provider (aws-lc-rs).
//!
//! - [`Trust`]: the cluster CA a process trusts (every client, every server).
//! - [`Credentials`]: a process's own certificate and key with the CA: servers present
//!   them; coordinators and workers also present them as client certificates (mutual
//!   TLS), so the servers know which coordinator or worker is calling.
//! - [`Identity`]: who a certificate names, as a URI subject alternative name
//!   (`cumulus://coordinator/3`, `cumulus://worker/node-7`, `cumulus://user/alice`),
//!   read back from a verified peer certificate with [`identity_of`].
//! - [`verify`]: whom a client accepts as its server ([`ExpectedServer`]): the CA and
//!   the host are not enough, the certificate must name the coordinator (or worker) the
//!   client means to reach.
//! - [`generate`]: a cluster CA and certificates issued by it (rcgen), as `cumulusctl
//!   certs`, `cumulusctl local up`, the compose cluster and the tests make them.
//! - [`args`] (feature `clap`): the `--tls-cert`, `--tls-key`, `--tls-ca` and
//!   `--insecure` flags every binary takes.
//!
//! Users and programs that are not cluster members (cumulusctl, the Python SDK) verify
//! the server against the CA and that it names a coordinator, and authenticate with a
//! bearer token or a user's certificate (which may only authenticate a client: it
//! carries no server-authentication usage). A worker without a certificate can enrol: it sends a signing request
//! for a key it made ([`generate::Request`]) with the cluster token, and a coordinator
//! holding the CA key signs it ([`generate::ClusterCa::sign_request`]).

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

#[cfg(feature = "clap")]
pub mod args;
pub mod generate;
pub mod verify;

pub use rustls;
pub use verify::{ExpectedServer, IdentityVerifier, WrongServer};

/// Largest certificate, key or CA file read, in bytes.
pub const MAX_PEM_FILE_BYTES: u64 = 1024 * 1024;
/// The URI scheme of an identity in a certificate's subject alternative names.
pub const IDENTITY_SCHEME: &str = "cumulus://";
/// ALPN protocols a server offers: HTTP/2 (gRPC) and HTTP/1.1 (REST, logs).
pub const SERVER_ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// The crypto provider of every configuration here (aws-lc-rs, which the S3 client
/// already links).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// Installs [`provider`] as the process default, for libraries that build their own
/// configurations (tonic, reqwest). Idempotent; call it at the start of `main`.
pub fn install_default_provider() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}

/// Who a certificate names.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Identity {
    /// A coordinator, by Raft node id.
    Coordinator(u64),
    /// A worker agent, by worker id.
    Worker(String),
    /// A user (a client certificate instead of a token).
    User(String),
}

impl Identity {
    /// The URI subject alternative name that carries it.
    pub fn uri(&self) -> String {
        match self {
            Identity::Coordinator(id) => format!("{IDENTITY_SCHEME}coordinator/{id}"),
            Identity::Worker(id) => format!("{IDENTITY_SCHEME}worker/{id}"),
            Identity::User(name) => format!("{IDENTITY_SCHEME}user/{name}"),
        }
    }

    /// Parses [`Identity::uri`]'s form; `None` for anything else.
    pub fn from_uri(uri: &str) -> Option<Identity> {
        let rest = uri.strip_prefix(IDENTITY_SCHEME)?;
        let (kind, name) = rest.split_once('/')?;
        let name_ok = !name.is_empty()
            && name.len() <= 128
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-@".contains(&b));
        if !name_ok {
            return None;
        }
        match kind {
            "coordinator" => name
                .parse()
                .ok()
                .filter(|id| *id != 0)
                .map(Identity::Coordinator),
            "worker" => Some(Identity::Worker(name.to_owned())),
            "user" => Some(Identity::User(name.to_owned())),
            _ => None,
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Coordinator(id) => write!(f, "coordinator {id}"),
            Identity::Worker(id) => write!(f, "worker {id}"),
            Identity::User(name) => write!(f, "user {name}"),
        }
    }
}

/// The identity a (verified) certificate names: its one `cumulus://` URI subject
/// alternative name.
///
/// # Errors
/// [`TlsError::BadCertificate`] when it does not parse, names no identity or several.
pub fn identity_of(cert: &CertificateDer<'_>) -> Result<Identity, TlsError> {
    peer_cert_of(cert).map(|p| p.identity)
}

/// What a served connection knows of its client's verified certificate: whom it names
/// and since when it is valid (a user's certificate counts only if it was issued after
/// the user was created: the coordinator's `auth::authenticate`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerCert {
    /// Whom it names ([`identity_of`]).
    pub identity: Identity,
    /// Its notBefore, in milliseconds since the Unix epoch (whole seconds: X.509 times
    /// have no fraction; negative before 1970).
    pub not_before_unix_ms: i64,
}

/// The [`PeerCert`] of a (verified) certificate, parsed once.
///
/// # Errors
/// [`TlsError::BadCertificate`] when it does not parse, names no identity or several.
pub fn peer_cert_of(cert: &CertificateDer<'_>) -> Result<PeerCert, TlsError> {
    let bad = |why: &str| TlsError::BadCertificate(why.to_owned());
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| bad(&format!("does not parse: {e}")))?;
    let not_before_unix_ms = parsed
        .validity()
        .not_before
        .timestamp()
        .saturating_mul(1000);
    let san = parsed
        .subject_alternative_name()
        .map_err(|e| bad(&format!("its subject alternative names do not parse: {e}")))?
        .ok_or_else(|| bad("it has no subject alternative names"))?;
    let mut found = san.value.general_names.iter().filter_map(|n| match n {
        x509_parser::extensions::GeneralName::URI(u) if u.starts_with(IDENTITY_SCHEME) => Some(*u),
        _ => None,
    });
    let uri = found
        .next()
        .ok_or_else(|| bad("it names no cumulus:// identity"))?;
    if found.next().is_some() {
        return Err(bad("it names more than one cumulus:// identity"));
    }
    let identity =
        Identity::from_uri(uri).ok_or_else(|| bad(&format!("identity {uri:?} is malformed")))?;
    Ok(PeerCert {
        identity,
        not_before_unix_ms,
    })
}

/// What a certificate says about how long it is valid and which hosts it serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertSummary {
    /// End of its validity, in seconds since the Unix epoch.
    pub not_after_unix_s: i64,
    /// Its DNS names and IP addresses (as text).
    pub hosts: Vec<String>,
}

/// The [`CertSummary`] of a certificate.
///
/// # Errors
/// [`TlsError::BadCertificate`] when it does not parse.
pub fn summary_of(cert: &CertificateDer<'_>) -> Result<CertSummary, TlsError> {
    use x509_parser::extensions::GeneralName;
    let bad = |why: String| TlsError::BadCertificate(why);
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| bad(format!("does not parse: {e}")))?;
    let mut hosts = Vec::new();
    if let Some(san) = parsed
        .subject_alternative_name()
        .map_err(|e| bad(format!("its subject alternative names do not parse: {e}")))?
    {
        for name in &san.value.general_names {
            match name {
                GeneralName::DNSName(d) => hosts.push((*d).to_owned()),
                GeneralName::IPAddress(b) => {
                    let ip = match b.len() {
                        4 => <[u8; 4]>::try_from(*b).ok().map(std::net::IpAddr::from),
                        16 => <[u8; 16]>::try_from(*b).ok().map(std::net::IpAddr::from),
                        _ => None,
                    };
                    if let Some(ip) = ip {
                        hosts.push(ip.to_string());
                    }
                }
                _ => {}
            }
        }
    }
    Ok(CertSummary {
        not_after_unix_s: parsed.validity().not_after.timestamp(),
        hosts,
    })
}

/// Why TLS files or configurations cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file cannot be read, or is too large.
    #[error("cannot read {what} {}: {source}", path.display())]
    Read {
        /// `certificate`, `key` or `CA certificate`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file holds no usable PEM of the expected kind.
    #[error("{what} {} holds no usable PEM: {reason}", path.display())]
    Pem {
        /// `certificate`, `key` or `CA certificate`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A certificate that does not parse or names no (single) identity.
    #[error("certificate: {0}")]
    BadCertificate(String),
    /// rustls refused the configuration (a key that does not match the certificate, a
    /// CA it cannot use).
    #[error("{0}")]
    Config(String),
    /// Certificate generation failed.
    #[error("certificate generation: {0}")]
    Generate(String),
    /// A certificate signing request that is too large, does not parse, or whose
    /// signature fails.
    #[error("certificate signing request: {0}")]
    BadRequest(String),
    /// Writing generated files failed.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

fn read_pem_file(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    let read_err = |source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    };
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_PEM_FILE_BYTES + 1).read_to_end(&mut bytes))
        .map_err(read_err)?;
    if bytes.len() as u64 > MAX_PEM_FILE_BYTES {
        return Err(read_err(std::io::Error::other(format!(
            "larger than {MAX_PEM_FILE_BYTES} bytes"
        ))));
    }
    Ok(bytes)
}

fn certs_from_pem(
    what: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem_err = |reason: String| TlsError::Pem {
        what,
        path: path.to_path_buf(),
        reason,
    };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err(e.to_string()))?;
    if certs.is_empty() {
        return Err(pem_err("no CERTIFICATE block".into()));
    }
    Ok(certs)
}

/// The cluster CA a process trusts.
#[derive(Clone)]
pub struct Trust {
    ca_pem: Arc<[u8]>,
    roots: Arc<RootCertStore>,
}

impl fmt::Debug for Trust {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Trust")
            .field("roots", &self.roots.len())
            .finish()
    }
}

impl Trust {
    /// Loads the CA certificate(s) from a PEM file.
    ///
    /// # Errors
    /// [`TlsError`] naming the file when it cannot be read or holds no usable CA.
    pub fn load(ca: &Path) -> Result<Trust, TlsError> {
        let pem = read_pem_file("CA certificate", ca)?;
        Trust::from_pem(ca, pem)
    }

    /// The CA from PEM bytes; `origin` names them in errors.
    ///
    /// # Errors
    /// [`TlsError`] when they hold no usable CA certificate.
    pub fn from_pem(origin: &Path, pem: Vec<u8>) -> Result<Trust, TlsError> {
        // Every TLS configuration of the process starts here: make the libraries that
        // build their own (tonic, reqwest) use the same provider.
        install_default_provider();
        let mut roots = RootCertStore::empty();
        for cert in certs_from_pem("CA certificate", origin, &pem)? {
            roots.add(cert).map_err(|e| TlsError::Pem {
                what: "CA certificate",
                path: origin.to_path_buf(),
                reason: e.to_string(),
            })?;
        }
        Ok(Trust {
            ca_pem: pem.into(),
            roots: Arc::new(roots),
        })
    }

    /// The CA as PEM (for tonic's and reqwest's own configurations).
    pub fn ca_pem(&self) -> &[u8] {
        &self.ca_pem
    }

    /// The CA as a rustls root store.
    pub fn roots(&self) -> Arc<RootCertStore> {
        self.roots.clone()
    }

    /// A client configuration that accepts only a server whose certificate the CA issued
    /// for the host dialled and names `expected` ([`IdentityVerifier`]), and presents no
    /// certificate (users and programs that authenticate with a token). No ALPN: the
    /// caller sets the protocols it speaks.
    ///
    /// # Errors
    /// [`TlsError::Config`] when rustls refuses it.
    pub fn client_config(&self, expected: ExpectedServer) -> Result<Arc<ClientConfig>, TlsError> {
        Ok(Arc::new(
            self.client_builder(expected)?.with_no_client_auth(),
        ))
    }

    fn client_builder(
        &self,
        expected: ExpectedServer,
    ) -> Result<rustls::ConfigBuilder<ClientConfig, rustls::client::WantsClientCert>, TlsError>
    {
        let verifier = IdentityVerifier::new(self.roots.clone(), expected)?;
        Ok(ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier)))
    }
}

/// A client configuration from PEM bytes (what the gRPC clients carry): the CA
/// `ca_pem`, a client certificate chain and key when `identity` is given, and a server
/// that must name `expected` ([`Trust::client_config`], [`Credentials::client_config`]).
///
/// # Errors
/// [`TlsError`] when the PEM holds no usable CA, certificate or key, or the key does not
/// match the certificate.
pub fn client_config_from_pem(
    ca_pem: &[u8],
    identity: Option<(&[u8], &[u8])>,
    expected: ExpectedServer,
) -> Result<Arc<ClientConfig>, TlsError> {
    let trust = Trust::from_pem(Path::new("(CA PEM)"), ca_pem.to_vec())?;
    match identity {
        None => trust.client_config(expected),
        Some((cert, key)) => Credentials::from_pem(
            trust,
            (Path::new("(certificate PEM)"), cert.to_vec()),
            (Path::new("(key PEM)"), key.to_vec()),
        )?
        .client_config(expected),
    }
}

/// A process's own certificate and key, with the CA it trusts.
#[derive(Clone)]
pub struct Credentials {
    trust: Trust,
    cert_pem: Arc<[u8]>,
    key_pem: Arc<[u8]>,
    chain: Vec<CertificateDer<'static>>,
    key: Arc<PrivateKeyDer<'static>>,
    identity: Identity,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("identity", &self.identity)
            .field("trust", &self.trust)
            .finish_non_exhaustive()
    }
}

impl Credentials {
    /// Loads the certificate (chain), its key and the CA, and checks that the key
    /// matches the certificate and that the certificate names an [`Identity`].
    ///
    /// # Errors
    /// [`TlsError`] naming the file or the check that fails.
    pub fn load(cert: &Path, key: &Path, ca: &Path) -> Result<Credentials, TlsError> {
        let trust = Trust::load(ca)?;
        let cert_pem = read_pem_file("certificate", cert)?;
        let key_pem = read_pem_file("key", key)?;
        Credentials::from_pem(trust, (cert, cert_pem), (key, key_pem))
    }

    /// [`Credentials::load`] from PEM bytes already read; each path names its bytes in
    /// errors.
    ///
    /// # Errors
    /// [`TlsError`] naming the path or the check that fails.
    pub fn from_pem(
        trust: Trust,
        (cert, cert_pem): (&Path, Vec<u8>),
        (key, key_pem): (&Path, Vec<u8>),
    ) -> Result<Credentials, TlsError> {
        let chain = certs_from_pem("certificate", cert, &cert_pem)?;
        let key_der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Pem {
            what: "key",
            path: key.to_path_buf(),
            reason: e.to_string(),
        })?;
        let identity = identity_of(&chain[0])?;
        let credentials = Credentials {
            trust,
            cert_pem: cert_pem.into(),
            key_pem: key_pem.into(),
            chain,
            key: Arc::new(key_der),
            identity,
        };
        // Building a server configuration checks that the key matches the certificate.
        credentials.server_config()?;
        Ok(credentials)
    }

    /// Who the certificate names.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// The [`CertSummary`] of the certificate (the first of the chain).
    ///
    /// # Errors
    /// [`TlsError::BadCertificate`] when it does not parse (it did when loaded).
    pub fn summary(&self) -> Result<CertSummary, TlsError> {
        summary_of(&self.chain[0])
    }

    /// The CA this process trusts.
    pub fn trust(&self) -> &Trust {
        &self.trust
    }

    /// The certificate chain as PEM.
    pub fn cert_pem(&self) -> &[u8] {
        &self.cert_pem
    }

    /// The private key as PEM.
    pub fn key_pem(&self) -> &[u8] {
        &self.key_pem
    }

    /// A server configuration: this certificate, ALPN `h2` and `http/1.1`, and client
    /// certificates verified against the CA when presented but not required (users
    /// come with a token instead; the services that need a member's identity check the
    /// [`identity_of`] the peer's certificate).
    ///
    /// # Errors
    /// [`TlsError::Config`] when the key does not match the certificate, or rustls
    /// refuses the CA.
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let verifier = WebPkiClientVerifier::builder_with_provider(self.trust.roots(), provider())
            .allow_unauthenticated()
            .build()
            .map_err(|e| TlsError::Config(format!("client verifier: {e}")))?;
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| TlsError::Config(format!("certificate and key: {e}")))?;
        config.alpn_protocols = SERVER_ALPN.iter().map(|p| p.to_vec()).collect();
        Ok(Arc::new(config))
    }

    /// A client configuration that presents this certificate (mutual TLS between
    /// members, or a user's certificate) and accepts only a server whose certificate the
    /// CA issued for the host dialled and names `expected` ([`IdentityVerifier`]). No
    /// ALPN: the caller sets the protocols it speaks.
    ///
    /// # Errors
    /// [`TlsError::Config`] when rustls refuses it.
    pub fn client_config(&self, expected: ExpectedServer) -> Result<Arc<ClientConfig>, TlsError> {
        let config = self
            .trust
            .client_builder(expected)?
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| TlsError::Config(format!("client certificate: {e}")))?;
        Ok(Arc::new(config))
    }
}

/// How a process's connections are secured: TLS with its credentials, or plaintext
/// (`--insecure`, which every binary logs as a warning and `cluster status` shows).
#[derive(Clone, Debug)]
pub enum Tls {
    /// TLS on every listener and connection.
    On(Arc<Credentials>),
    /// Plaintext, by explicit choice.
    Insecure,
}

impl Tls {
    /// The credentials, when TLS is on.
    pub fn credentials(&self) -> Option<&Arc<Credentials>> {
        match self {
            Tls::On(c) => Some(c),
            Tls::Insecure => None,
        }
    }

    /// `https` or `http`.
    pub fn scheme(&self) -> &'static str {
        match self {
            Tls::On(_) => "https",
            Tls::Insecure => "http",
        }
    }
}

#[cfg(test)]
mod tests;
