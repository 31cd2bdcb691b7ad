//! Whom a client accepts as its server: a certificate that the cluster CA issued for
//! the host dialled and for server authentication (rustls' [`WebPkiServerVerifier`])
//! is not enough, since every member's and enrolled worker's certificate passes those
//! checks; the certificate must also name the identity the client means to reach
//! ([`ExpectedServer`]): any coordinator for users and workers, exactly the peer's node
//! id between coordinators, exactly the worker whose agent a coordinator calls.
//!
//! A server that fails is refused during the handshake, before any request (and the
//! token it carries) is sent, with a [`WrongServer`] error naming both identities.

use std::fmt;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

use crate::{Identity, RootCertStore, TlsError, identity_of, provider};

/// The identity a client accepts in its server's certificate.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ExpectedServer {
    /// Any coordinator (`cumulus://coordinator/N`): what users and workers talk to.
    AnyCoordinator,
    /// The coordinator with this node id: a Raft peer.
    Coordinator(u64),
    /// The agent of this worker id.
    Worker(String),
}

impl ExpectedServer {
    /// Whether a certificate naming `found` is acceptable.
    pub fn accepts(&self, found: &Identity) -> bool {
        match (self, found) {
            (ExpectedServer::AnyCoordinator, Identity::Coordinator(_)) => true,
            (ExpectedServer::Coordinator(want), Identity::Coordinator(id)) => want == id,
            (ExpectedServer::Worker(want), Identity::Worker(id)) => want == id,
            _ => false,
        }
    }
}

impl fmt::Display for ExpectedServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExpectedServer::AnyCoordinator => {
                write!(f, "a coordinator (cumulus://coordinator/N)")
            }
            ExpectedServer::Coordinator(id) => {
                write!(f, "coordinator {id} ({})", Identity::Coordinator(*id).uri())
            }
            ExpectedServer::Worker(id) => {
                write!(f, "worker {id} ({})", Identity::Worker(id.clone()).uri())
            }
        }
    }
}

/// A server whose certificate (valid under the cluster CA) names another identity than
/// the one expected, or none.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the server at {host} is not {expected}: its certificate names {found}")]
pub struct WrongServer {
    /// The host dialled.
    pub host: String,
    /// Whom the client meant to reach.
    pub expected: ExpectedServer,
    /// What the certificate names: an identity URI, or why it names none.
    pub found: String,
}

/// A [`ServerCertVerifier`]: the CA, host and server-authentication checks of
/// [`WebPkiServerVerifier`], then the identity the certificate names against an
/// [`ExpectedServer`].
#[derive(Debug)]
pub struct IdentityVerifier {
    webpki: Arc<WebPkiServerVerifier>,
    expected: ExpectedServer,
}

impl IdentityVerifier {
    /// A verifier trusting `roots` that accepts only `expected`.
    ///
    /// # Errors
    /// [`TlsError::Config`] when rustls cannot use the roots.
    pub fn new(
        roots: Arc<RootCertStore>,
        expected: ExpectedServer,
    ) -> Result<IdentityVerifier, TlsError> {
        let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider())
            .build()
            .map_err(|e| TlsError::Config(format!("server verifier: {e}")))?;
        Ok(IdentityVerifier { webpki, expected })
    }

    /// Whom it accepts.
    pub fn expected(&self) -> &ExpectedServer {
        &self.expected
    }
}

impl ServerCertVerifier for IdentityVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let verified = self.webpki.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        let found = match identity_of(end_entity) {
            Ok(identity) if self.expected.accepts(&identity) => return Ok(verified),
            Ok(identity) => identity.uri(),
            Err(e) => e.to_string(),
        };
        Err(rustls::Error::Other(rustls::OtherError(Arc::new(
            WrongServer {
                host: server_name.to_str().into_owned(),
                expected: self.expected.clone(),
                found,
            },
        ))))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }

    fn root_hint_subjects(&self) -> Option<&[DistinguishedName]> {
        self.webpki.root_hint_subjects()
    }
}
