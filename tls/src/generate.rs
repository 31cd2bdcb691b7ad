//! A cluster CA and the certificates it issues, generated with rcgen: what `cumulusctl
//! certs`, `cumulusctl local up`, the compose cluster's init step and the tests use.
//!
//! Keys are ECDSA P-256. A leaf certificate names its holder as a URI subject
//! alternative name ([`Identity::uri`]). A coordinator's or worker's also names the
//! hosts it serves as DNS and IP names (always `localhost`, `127.0.0.1` and `::1` too)
//! and may serve and connect (extended key usages server and client auth), so one
//! certificate per process is enough. A user's names no host and may only connect
//! (client auth): it can never serve as a coordinator. The CA is valid for 10 years, leaves for [`LEAF_VALIDITY_DAYS`]; both from one
//! day before they are made, which absorbs small clock differences between machines.
//! Except a user's: it is valid from the second it is issued, because its notBefore
//! tells the coordinators when it was issued, and a certificate issued before its user
//! was (re)created does not authenticate as them (the coordinator's `auth` module). A
//! coordinator whose clock is behind the issuing machine's refuses it in the handshake
//! (not yet valid) until its clock reaches that second.

use std::io::Write;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;

use crate::{Identity, TlsError};

/// Days a leaf certificate is valid.
pub const LEAF_VALIDITY_DAYS: i64 = 825;
/// Days the CA is valid.
pub const CA_VALIDITY_DAYS: i64 = 3650;
/// Host names every leaf certificate carries besides the ones asked for.
pub const LOCAL_HOSTS: [&str; 3] = ["localhost", "127.0.0.1", "::1"];
/// File name of the CA certificate in a certificate directory.
pub const CA_FILE: &str = "ca.pem";
/// File name of the CA key in a certificate directory (mode 0600).
pub const CA_KEY_FILE: &str = "ca-key.pem";

fn gen_err(e: rcgen::Error) -> TlsError {
    TlsError::Generate(e.to_string())
}

fn validity(params: &mut CertificateParams, days: i64) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(1);
    params.not_after = now + time::Duration::days(days);
}

/// Valid from `not_before`, to the whole second (what X.509 stores), for
/// [`LEAF_VALIDITY_DAYS`] from now.
fn valid_from(params: &mut CertificateParams, not_before: time::OffsetDateTime) {
    params.not_before = not_before.replace_nanosecond(0).unwrap_or(not_before);
    params.not_after = time::OffsetDateTime::now_utc() + time::Duration::days(LEAF_VALIDITY_DAYS);
}

/// Parameters that name `identity` (URI subject alternative name and common name) and
/// the hosts it serves: `hosts` and [`LOCAL_HOSTS`], each once. Nothing else: what a
/// signing request carries.
fn named_params(identity: &Identity, hosts: &[String]) -> Result<CertificateParams, TlsError> {
    let mut names: Vec<String> = LOCAL_HOSTS.iter().map(|h| h.to_string()).collect();
    for h in hosts {
        if !names.contains(h) {
            names.push(h.clone());
        }
    }
    let mut params = CertificateParams::new(names).map_err(gen_err)?;
    params
        .subject_alt_names
        .push(SanType::URI(identity.uri().try_into().map_err(gen_err)?));
    params
        .distinguished_name
        .push(DnType::CommonName, identity.to_string());
    Ok(params)
}

/// The parameters of a leaf certificate for `identity`, valid [`LEAF_VALIDITY_DAYS`]:
/// for a coordinator or worker, serving `hosts` and [`LOCAL_HOSTS`] with server and
/// client authentication, from a day ago; for a user, client authentication only and no
/// host (`hosts` is ignored), from now (the second it is issued).
fn leaf_params(identity: &Identity, hosts: &[String]) -> Result<CertificateParams, TlsError> {
    let user = matches!(identity, Identity::User(_));
    let mut params = named_params(identity, hosts)?;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = if user {
        params
            .subject_alt_names
            .retain(|n| matches!(n, SanType::URI(_)));
        vec![ExtendedKeyUsagePurpose::ClientAuth]
    } else {
        vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ]
    };
    params.use_authority_key_identifier_extension = true;
    if user {
        valid_from(&mut params, time::OffsetDateTime::now_utc());
    } else {
        validity(&mut params, LEAF_VALIDITY_DAYS);
    }
    Ok(params)
}

/// Largest certificate signing request [`ClusterCa::sign_request`] reads, in bytes
/// (one P-256 request with a few names is under 1 KiB).
pub const MAX_REQUEST_PEM_BYTES: usize = 16 * 1024;

/// A new key and a certificate signing request for it naming `identity` (what a worker
/// sends to enrol; the signer decides what the certificate finally names).
#[derive(Clone, Debug)]
pub struct Request {
    /// The new private key (PKCS#8 PEM): it never leaves the process that made it.
    pub key_pem: String,
    /// The signing request (PKCS#10 PEM), signed with that key.
    pub request_pem: String,
}

impl Request {
    /// Generates an ECDSA P-256 key and a request for `identity` serving `hosts`.
    ///
    /// # Errors
    /// [`TlsError::Generate`] when rcgen fails (a host name it cannot encode).
    pub fn generate(identity: &Identity, hosts: &[String]) -> Result<Request, TlsError> {
        // Names only: validity, usages and key identifiers are the signer's to choose
        // (and rcgen puts none of them in a request).
        let params = named_params(identity, hosts)?;
        let key = KeyPair::generate().map_err(gen_err)?;
        let request = params.serialize_request(&key).map_err(gen_err)?;
        Ok(Request {
            key_pem: key.serialize_pem(),
            request_pem: request.pem().map_err(gen_err)?,
        })
    }
}

/// A certificate and its key, as PEM.
#[derive(Clone, Debug)]
pub struct Issued {
    /// The certificate.
    pub cert_pem: String,
    /// Its private key (PKCS#8).
    pub key_pem: String,
}

/// A cluster CA that can issue certificates.
pub struct ClusterCa {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
    key_pem: String,
}

impl ClusterCa {
    /// Generates a new CA named `name` (its common name).
    ///
    /// # Errors
    /// [`TlsError::Generate`] when rcgen fails.
    pub fn generate(name: &str) -> Result<ClusterCa, TlsError> {
        let key = KeyPair::generate().map_err(gen_err)?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(gen_err)?;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.distinguished_name.push(DnType::CommonName, name);
        validity(&mut params, CA_VALIDITY_DAYS);
        let cert = params.self_signed(&key).map_err(gen_err)?;
        let key_pem = key.serialize_pem();
        Ok(ClusterCa {
            issuer: Issuer::new(params, key),
            cert_pem: cert.pem(),
            key_pem,
        })
    }

    /// Loads a CA made by [`ClusterCa::generate`] from its certificate and key files.
    ///
    /// # Errors
    /// [`TlsError`] when a file cannot be read or does not parse.
    pub fn load(cert: &Path, key: &Path) -> Result<ClusterCa, TlsError> {
        let read = |what, path: &Path| {
            std::fs::read_to_string(path).map_err(|source| TlsError::Read {
                what,
                path: path.to_path_buf(),
                source,
            })
        };
        let cert_pem = read("CA certificate", cert)?;
        let key_pem = read("CA key", key)?;
        let key_pair = KeyPair::from_pem(&key_pem).map_err(gen_err)?;
        // A key of another CA would sign certificates that nobody trusts.
        let cert_der = rustls::pki_types::CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(|e| TlsError::BadCertificate(format!("CA {}: {e}", cert.display())))?;
        let (_, parsed) = x509_parser::parse_x509_certificate(cert_der.as_ref())
            .map_err(|e| TlsError::BadCertificate(format!("CA {}: {e}", cert.display())))?;
        if parsed.public_key().subject_public_key.data.as_ref() != key_pair.public_key_raw() {
            return Err(TlsError::Config(format!(
                "the CA key {} does not belong to the CA certificate {}",
                key.display(),
                cert.display()
            )));
        }
        let issuer = Issuer::from_ca_cert_pem(&cert_pem, key_pair).map_err(gen_err)?;
        Ok(ClusterCa {
            issuer,
            cert_pem,
            key_pem,
        })
    }

    /// The CA certificate as PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Issues a certificate for `identity` serving `hosts` (DNS names or IP addresses;
    /// [`LOCAL_HOSTS`] are added); a user's serves nothing (client authentication only,
    /// no host names).
    ///
    /// # Errors
    /// [`TlsError::Generate`] for a host name rcgen cannot encode, or when signing fails.
    pub fn issue(&self, identity: &Identity, hosts: &[String]) -> Result<Issued, TlsError> {
        let params = leaf_params(identity, hosts)?;
        self.sign_new_key(params)
    }

    /// As [`ClusterCa::issue`], but valid from `not_before` (to the second): a
    /// certificate as an earlier issue would have made it (tests of the rule that a
    /// certificate issued before its user was created does not authenticate).
    ///
    /// # Errors
    /// As [`ClusterCa::issue`].
    pub fn issue_valid_from(
        &self,
        identity: &Identity,
        hosts: &[String],
        not_before: std::time::SystemTime,
    ) -> Result<Issued, TlsError> {
        let mut params = leaf_params(identity, hosts)?;
        valid_from(&mut params, not_before.into());
        self.sign_new_key(params)
    }

    fn sign_new_key(&self, params: CertificateParams) -> Result<Issued, TlsError> {
        let key = KeyPair::generate().map_err(gen_err)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(gen_err)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// Signs the public key of a certificate signing request (PKCS#10, PEM, at most
    /// [`MAX_REQUEST_PEM_BYTES`]) as `identity` serving `hosts`, as [`ClusterCa::issue`]
    /// would: only the request's key and the proof that its sender holds the private key
    /// (the request's signature) are used; its subject, names and extensions are not
    /// (the caller decides who the certificate names). Returns the certificate as PEM.
    ///
    /// # Errors
    /// [`TlsError::BadRequest`] for a request that is too large, does not parse or whose
    /// signature fails; [`TlsError::Generate`] when signing fails.
    pub fn sign_request(
        &self,
        identity: &Identity,
        hosts: &[String],
        request_pem: &str,
    ) -> Result<String, TlsError> {
        if request_pem.len() > MAX_REQUEST_PEM_BYTES {
            return Err(TlsError::BadRequest(format!(
                "{} bytes, more than {MAX_REQUEST_PEM_BYTES}",
                request_pem.len()
            )));
        }
        let request = rcgen::CertificateSigningRequestParams::from_pem(request_pem)
            .map_err(|e| TlsError::BadRequest(e.to_string()))?;
        let params = leaf_params(identity, hosts)?;
        let cert = params
            .signed_by(&request.public_key, &self.issuer)
            .map_err(gen_err)?;
        Ok(cert.pem())
    }

    /// Writes `ca.pem` (0644) and `ca-key.pem` (0600) into `dir` (created 0700 if
    /// missing).
    ///
    /// # Errors
    /// [`TlsError::Write`] naming the file.
    pub fn write(&self, dir: &Path) -> Result<(), TlsError> {
        create_private_dir(dir)?;
        write_file(&dir.join(CA_FILE), self.cert_pem.as_bytes(), 0o644)?;
        write_file(&dir.join(CA_KEY_FILE), self.key_pem.as_bytes(), 0o600)
    }
}

/// The two files of an issued certificate in a directory: `<name>.pem` and
/// `<name>-key.pem`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairFiles {
    /// The certificate.
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
}

impl PairFiles {
    /// The file names of `name` in `dir`.
    pub fn in_dir(dir: &Path, name: &str) -> PairFiles {
        PairFiles {
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}-key.pem")),
        }
    }
}

impl Issued {
    /// Writes `<name>.pem` (0644) and `<name>-key.pem` (0600) into `dir`.
    ///
    /// # Errors
    /// [`TlsError::Write`] naming the file.
    pub fn write(&self, dir: &Path, name: &str) -> Result<PairFiles, TlsError> {
        create_private_dir(dir)?;
        let files = PairFiles::in_dir(dir, name);
        write_file(&files.cert, self.cert_pem.as_bytes(), 0o644)?;
        write_file(&files.key, self.key_pem.as_bytes(), 0o600)?;
        Ok(files)
    }
}

fn create_private_dir(dir: &Path) -> Result<(), TlsError> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        Ok(()) => Ok(()),
        Err(source) => Err(TlsError::Write {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

/// Writes `bytes` to `path` with `mode`, atomically (temp file, fsync, rename): a key is
/// never readable by others, even for a moment.
///
/// # Errors
/// [`TlsError::Write`] naming the file.
pub fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), TlsError> {
    use std::os::unix::fs::OpenOptionsExt;
    let err = |source| TlsError::Write {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    f.write_all(bytes).map_err(err)?;
    f.sync_all().map_err(err)?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(err)
}
