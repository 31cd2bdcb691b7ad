//! The TLS flags of every Cumulus binary.

use std::path::PathBuf;
use std::sync::Arc;

use crate::{Credentials, Identity, Tls, TlsError};

/// `--tls-cert`, `--tls-key`, `--tls-ca`, `--insecure`. TLS is required: either all three
/// files, or `--insecure` for plaintext (which the process logs as a warning).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct TlsArgs {
    /// This process's certificate (PEM, naming it as `cumulus://coordinator/ID` or
    /// `cumulus://worker/ID`; `cumulusctl certs issue` makes one).
    #[arg(long, env = "CUMULUS_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "CUMULUS_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The cluster CA certificate (PEM): servers and clients are verified against it.
    #[arg(long, env = "CUMULUS_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Plaintext on every listener and connection: tokens and job data travel readable
    /// by anyone on the network. Only for a trusted network or a single machine.
    #[arg(
        long,
        env = "CUMULUS_INSECURE",
        action = clap::ArgAction::SetTrue,
        value_parser = clap::builder::BoolishValueParser::new(),
        conflicts_with_all = ["tls_cert", "tls_key", "tls_ca"]
    )]
    pub insecure: bool,
}

/// The TLS flags are incomplete or their files unusable.
#[derive(Debug, thiserror::Error)]
pub enum TlsArgsError {
    /// Neither the files nor `--insecure`.
    #[error(
        "TLS is required: give --tls-cert, --tls-key and --tls-ca (`cumulusctl certs init` \
         makes a CA and certificates), or --insecure for plaintext"
    )]
    Missing,
    /// Some of the three files but not all.
    #[error("give all of --tls-cert, --tls-key and --tls-ca (missing: {0})")]
    Partial(String),
    /// The files cannot be used.
    #[error(transparent)]
    Files(#[from] TlsError),
    /// The certificate names another process than this one.
    #[error(
        "--tls-cert names {found}, but this is {want}: issue it a certificate of its own \
         (`cumulusctl certs issue {}`)",
        issue_args(want)
    )]
    WrongIdentity {
        /// Who the certificate names.
        found: Identity,
        /// Who this process is.
        want: Identity,
    },
}

/// The `certs issue` arguments that make a certificate for `identity`.
fn issue_args(identity: &Identity) -> String {
    match identity {
        Identity::Coordinator(id) => format!("coordinator {id}"),
        Identity::Worker(id) => format!("worker {id}"),
        Identity::User(name) => format!("user {name}"),
    }
}

impl TlsArgs {
    /// [`TlsArgs::load`] for the process `want`: its certificate must name it.
    ///
    /// # Errors
    /// [`TlsArgsError`], [`TlsArgsError::WrongIdentity`] for another's certificate.
    pub fn load_for(&self, want: &Identity) -> Result<Tls, TlsArgsError> {
        let tls = self.load()?;
        if let Some(creds) = tls.credentials()
            && creds.identity() != want
        {
            return Err(TlsArgsError::WrongIdentity {
                found: creds.identity().clone(),
                want: want.clone(),
            });
        }
        Ok(tls)
    }

    /// Loads the credentials, or returns [`Tls::Insecure`] with `--insecure`.
    ///
    /// # Errors
    /// [`TlsArgsError`].
    pub fn load(&self) -> Result<Tls, TlsArgsError> {
        if self.insecure {
            return Ok(Tls::Insecure);
        }
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (Some(cert), Some(key), Some(ca)) => {
                Ok(Tls::On(Arc::new(Credentials::load(cert, key, ca)?)))
            }
            (None, None, None) => Err(TlsArgsError::Missing),
            (cert, key, ca) => {
                let missing: Vec<&str> = [
                    ("--tls-cert", cert.is_none()),
                    ("--tls-key", key.is_none()),
                    ("--tls-ca", ca.is_none()),
                ]
                .into_iter()
                .filter_map(|(flag, absent)| absent.then_some(flag))
                .collect();
                Err(TlsArgsError::Partial(missing.join(", ")))
            }
        }
    }
}
