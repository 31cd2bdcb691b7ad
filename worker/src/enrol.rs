//! Enrolment (`--tls-enrol`): an agent without a certificate gets one from the
//! coordinators, as kubelet's TLS bootstrap and Consul's auto-encrypt do.
//!
//! The agent makes its own key (it never leaves the agent), sends a certificate signing
//! request with its worker id and advertised host to `WorkerService.Enrol` over TLS
//! (the server verified against `--tls-ca`, no client certificate), authenticated by the
//! cluster token, and a coordinator started with `--tls-ca-key` answers with a
//! certificate naming `cumulus://worker/ID`. Key, certificate and the CA they were issued
//! under are kept in `<data-dir>/tls/` (0700; key 0600) and used again at the next
//! start while they still fit: same CA, same worker id, the advertised host among the
//! certificate's names, and more than [`RENEW_BEFORE_DAYS`] of validity left.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use cumulus_client::ClientTls;
use cumulus_tls::generate::{Issued, PairFiles, Request};
use cumulus_tls::{Credentials, Identity};
use tokio_util::sync::CancellationToken;

use crate::client::{ClientError, CoordinatorClient, RetryPolicy};

/// Directory of the enrolled credentials under the data dir.
pub const ENROL_DIR: &str = "tls";
/// File stem of the enrolled certificate and key (`worker.pem`, `worker-key.pem`).
pub const ENROL_NAME: &str = "worker";
/// File of the CA certificate the enrolled certificate was issued under.
pub const ENROL_CA_FILE: &str = "issued-by-ca.pem";
/// A certificate with less validity left than this is replaced at start.
pub const RENEW_BEFORE_DAYS: i64 = 30;
/// How long an agent keeps asking the coordinators before it gives up (its supervisor,
/// a restart policy or systemd, starts it again).
pub const ENROL_DEADLINE: Duration = Duration::from_secs(120);

/// What enrolment needs.
pub struct Enrolment<'a> {
    /// The agent's data dir (`tls/` is made in it).
    pub data_dir: &'a Path,
    /// The worker id the certificate must name.
    pub worker_id: &'a str,
    /// The host the agent advertises (the certificate must serve it).
    pub advertise_host: &'a str,
    /// The cluster CA certificate file (`--tls-ca`).
    pub ca: &'a Path,
    /// The coordinators' gRPC addresses.
    pub coordinators: &'a [String],
    /// The cluster token.
    pub token: &'a str,
}

/// The certificate and key files enrolment keeps in `data_dir`.
pub fn files(data_dir: &Path) -> PairFiles {
    PairFiles::in_dir(&data_dir.join(ENROL_DIR), ENROL_NAME)
}

impl Enrolment<'_> {
    /// The certificate and key to use: the kept ones when they still fit, otherwise new
    /// ones from the coordinators (retried for up to [`ENROL_DEADLINE`]).
    ///
    /// # Errors
    /// An unreadable CA; a coordinator's refusal (wrong token, no `--tls-ca-key`, a
    /// request it rejects); no answer before the deadline; files that cannot be written.
    pub async fn ensure(&self, cancel: &CancellationToken) -> anyhow::Result<PairFiles> {
        let files = files(self.data_dir);
        let ca_pem = std::fs::read(self.ca)
            .with_context(|| format!("cannot read --tls-ca {}", self.ca.display()))?;
        match self.kept(&files, &ca_pem) {
            Ok(()) => {
                tracing::info!(cert = %files.cert.display(), "using the enrolled certificate");
                return Ok(files);
            }
            Err(why) => {
                tracing::info!(%why, "enrolling: asking the coordinators for a certificate")
            }
        }
        let identity = Identity::Worker(self.worker_id.to_owned());
        let hosts = vec![self.advertise_host.to_owned()];
        let request = Request::generate(&identity, &hosts)?;
        let client = CoordinatorClient::with_tls(
            self.coordinators,
            self.token,
            Some(ClientTls {
                ca_pem: ca_pem.clone().into(),
                identity_pem: None,
            }),
            cancel.clone(),
        )
        .context("invalid coordinator client configuration")?;
        let message = cumulus_api::EnrolWorkerRequest {
            worker_id: self.worker_id.to_owned(),
            hosts,
            csr_pem: request.request_pem.clone(),
        };
        let started = Instant::now();
        let cert_pem = loop {
            let answer = client
                .call(
                    "Enrol",
                    RetryPolicy::STANDARD,
                    &message,
                    |mut c, r| async move { c.enrol(r).await },
                )
                .await;
            match answer {
                Ok(reply) => break reply.cert_pem,
                Err(e @ ClientError::Exhausted { .. }) if started.elapsed() < ENROL_DEADLINE => {
                    tracing::warn!(error = %e, "enrolment: no coordinator answered yet; trying again");
                }
                Err(e) => {
                    return Err(anyhow::Error::new(e).context(
                        "enrolment failed: no certificate for this agent (--tls-enrol needs a \
                         coordinator started with --tls-ca-key, and the cluster token)",
                    ));
                }
            }
        };
        let issued = Issued {
            cert_pem,
            key_pem: request.key_pem,
        };
        let dir = self.data_dir.join(ENROL_DIR);
        let files = issued.write(&dir, ENROL_NAME)?;
        cumulus_tls::generate::write_file(&dir.join(ENROL_CA_FILE), &ca_pem, 0o644)?;
        // What was written must load and name this worker: a coordinator answering with
        // something else is refused here, not at the first connection.
        self.kept(&files, &ca_pem)
            .map_err(|why| anyhow::anyhow!("the certificate the coordinators signed: {why}"))?;
        tracing::info!(cert = %files.cert.display(), "enrolled: certificate signed by the cluster CA");
        Ok(files)
    }

    /// Whether the kept files can be used again; the reason when not.
    fn kept(&self, files: &PairFiles, ca_pem: &[u8]) -> Result<(), String> {
        let issued_by = self.data_dir.join(ENROL_DIR).join(ENROL_CA_FILE);
        match std::fs::read(&issued_by) {
            Ok(bytes) if bytes == ca_pem => {}
            Ok(_) => return Err("the cluster CA changed since the last enrolment".into()),
            Err(_) => return Err("no enrolled certificate yet".into()),
        }
        let creds = Credentials::load(&files.cert, &files.key, self.ca)
            .map_err(|e| format!("the enrolled certificate cannot be used: {e}"))?;
        let want = Identity::Worker(self.worker_id.to_owned());
        if creds.identity() != &want {
            return Err(format!(
                "the enrolled certificate names {}",
                creds.identity()
            ));
        }
        let summary = creds.summary().map_err(|e| e.to_string())?;
        if !summary.hosts.iter().any(|h| h == self.advertise_host) {
            return Err(format!(
                "the enrolled certificate does not serve the advertised host {}",
                self.advertise_host
            ));
        }
        let now_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        if summary.not_after_unix_s - now_s < RENEW_BEFORE_DAYS * 86_400 {
            return Err("the enrolled certificate expires within 30 days".into());
        }
        Ok(())
    }
}

/// Checks the flags of enrolment: `--tls-enrol` needs `--tls-ca` and replaces
/// `--tls-cert` and `--tls-key`.
///
/// # Errors
/// When they are combined otherwise.
pub fn check_flags(tls: &cumulus_tls::args::TlsArgs) -> anyhow::Result<&Path> {
    if tls.tls_cert.is_some() || tls.tls_key.is_some() {
        bail!(
            "--tls-enrol gets the certificate and key from the coordinators: leave out --tls-cert and --tls-key"
        );
    }
    match &tls.tls_ca {
        Some(ca) => Ok(ca),
        None => bail!(
            "--tls-enrol needs --tls-ca (the cluster CA certificate, to verify the coordinators)"
        ),
    }
}
