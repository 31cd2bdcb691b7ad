use std::net::SocketAddr;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::generate::{CA_FILE, ClusterCa, PairFiles};
use super::*;

struct Pki {
    _dir: tempfile::TempDir,
    dir: PathBuf,
    ca: ClusterCa,
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tls");
    let ca = ClusterCa::generate("test cluster").expect("ca");
    ca.write(&path).expect("write ca");
    Pki {
        _dir: dir,
        dir: path,
        ca,
    }
}

impl Pki {
    fn credentials(&self, name: &str, identity: Identity) -> Credentials {
        let files = self
            .ca
            .issue(&identity, &["node-a.example".into()])
            .expect("issue")
            .write(&self.dir, name)
            .expect("write");
        Credentials::load(&files.cert, &files.key, &self.dir.join(CA_FILE)).expect("load")
    }
}

#[test]
fn identities_round_trip_and_malformed_ones_are_refused() {
    for id in [
        Identity::Coordinator(3),
        Identity::Worker("node-7.rack_2".into()),
        Identity::User("alice@example".into()),
    ] {
        assert_eq!(Identity::from_uri(&id.uri()), Some(id));
    }
    for bad in [
        "cumulus://coordinator/0",
        "cumulus://coordinator/x",
        "cumulus://worker/",
        "cumulus://worker/a/b",
        "cumulus://admin/root",
        "https://worker/a",
        "cumulus://worker/a b",
    ] {
        assert_eq!(Identity::from_uri(bad), None, "{bad}");
    }
}

#[test]
fn issued_certificates_load_with_their_identity() {
    let pki = pki();
    let c = pki.credentials("coordinator-1", Identity::Coordinator(1));
    assert_eq!(c.identity(), &Identity::Coordinator(1));
    assert!(c.client_config(ExpectedServer::AnyCoordinator).is_ok());
    let w = pki.credentials("worker-1", Identity::Worker("w-1".into()));
    assert_eq!(w.identity(), &Identity::Worker("w-1".into()));
    let mode = |p: &Path| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).expect("stat").permissions().mode() & 0o777
    };
    let files = PairFiles::in_dir(&pki.dir, "worker-1");
    assert_eq!(mode(&files.key), 0o600, "keys are private");
    assert_eq!(mode(&pki.dir.join(generate::CA_KEY_FILE)), 0o600);
    assert_eq!(mode(&pki.dir), 0o700);

    // A CA loaded back from its files issues certificates the first one verifies.
    let again = ClusterCa::load(&pki.dir.join(CA_FILE), &pki.dir.join(generate::CA_KEY_FILE))
        .expect("load ca");
    let files = again
        .issue(&Identity::Worker("w-2".into()), &[])
        .expect("issue")
        .write(&pki.dir, "worker-2")
        .expect("write");
    Credentials::load(&files.cert, &files.key, &pki.dir.join(CA_FILE)).expect("same CA");
}

#[test]
fn unusable_files_are_refused_with_their_name() {
    let pki = pki();
    let a = PairFiles::in_dir(&pki.dir, "a");
    let b = PairFiles::in_dir(&pki.dir, "b");
    pki.credentials("a", Identity::Worker("a".into()));
    pki.credentials("b", Identity::Worker("b".into()));
    let ca = pki.dir.join(CA_FILE);
    let err = Credentials::load(&a.cert, &b.key, &ca).expect_err("key of another certificate");
    assert!(matches!(err, TlsError::Config(_)), "{err}");
    let missing = pki.dir.join("missing.pem");
    let err = Credentials::load(&missing, &a.key, &ca).expect_err("missing file");
    assert!(err.to_string().contains("missing.pem"), "{err}");
    let err = Credentials::load(&a.key, &a.key, &ca).expect_err("a key is no certificate");
    assert!(err.to_string().contains("no usable PEM"), "{err}");

    // A certificate without a cumulus:// identity is refused.
    let key = rcgen::KeyPair::generate().expect("key");
    let plain = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .expect("params")
        .self_signed(&key)
        .expect("self-signed");
    let err = identity_of(plain.der()).expect_err("no identity");
    assert!(err.to_string().contains("no cumulus:// identity"), "{err}");
}

/// One TLS connection on loopback: the server's view of the client's identity (`None`
/// when it presented no certificate), or the handshake error of either side.
async fn handshake(
    server: &Credentials,
    client: Arc<ClientConfig>,
) -> Result<Option<Identity>, String> {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr: SocketAddr = listener.local_addr().expect("addr");
    let acceptor = TlsAcceptor::from(server.server_config().expect("server config"));
    let serve = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.expect("accept");
        let mut tls = acceptor.accept(tcp).await.map_err(|e| e.to_string())?;
        let peer = match tls.get_ref().1.peer_certificates() {
            Some(chain) => Some(identity_of(&chain[0]).map_err(|e| e.to_string())?),
            None => None,
        };
        let mut buf = [0u8; 4];
        tls.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
        tls.write_all(b"pong").await.map_err(|e| e.to_string())?;
        tls.shutdown().await.ok();
        Ok::<_, String>(peer)
    });
    let connector = TlsConnector::from(client);
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = ServerName::try_from("127.0.0.1").expect("name");
    let client_side = async {
        let mut tls = connector
            .connect(name, tcp)
            .await
            .map_err(|e| e.to_string())?;
        tls.write_all(b"ping").await.map_err(|e| e.to_string())?;
        let mut buf = [0u8; 4];
        tls.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(())
    }
    .await;
    let server_side = serve.await.expect("server task");
    client_side?;
    server_side
}

#[tokio::test]
async fn mutual_tls_names_the_member_and_users_need_no_certificate() {
    let pki = pki();
    let coordinator = pki.credentials("coordinator-1", Identity::Coordinator(1));
    let worker = pki.credentials("worker-1", Identity::Worker("w-1".into()));
    let peer = handshake(
        &coordinator,
        worker
            .client_config(ExpectedServer::AnyCoordinator)
            .expect("client"),
    )
    .await
    .expect("mutual TLS");
    assert_eq!(peer, Some(Identity::Worker("w-1".into())));
    let user = handshake(
        &coordinator,
        worker
            .trust()
            .client_config(ExpectedServer::AnyCoordinator)
            .expect("client"),
    )
    .await
    .expect("server-only TLS");
    assert_eq!(user, None, "a user presents no certificate");

    // A client of another cluster (another CA) can verify nothing and is refused.
    let other = pki_other();
    let err = handshake(
        &coordinator,
        other
            .trust()
            .client_config(ExpectedServer::AnyCoordinator)
            .expect("client"),
    )
    .await
    .expect_err("another CA");
    assert!(
        err.contains("certificate") || err.contains("Unknown"),
        "{err}"
    );
    let err = handshake(
        &coordinator,
        other
            .client_config(ExpectedServer::AnyCoordinator)
            .expect("client"),
    )
    .await
    .expect_err("a client certificate of another CA");
    assert!(!err.is_empty());
}

fn pki_other() -> Credentials {
    // Loaded into memory: the files may go with their temp dir.
    pki().credentials("x", Identity::Worker("x".into()))
}

#[tokio::test]
async fn a_signed_request_names_whom_the_signer_chose_and_works_for_mutual_tls() {
    let pki = pki();
    // The request asks to be a coordinator; the signer names it worker w-9.
    let request = generate::Request::generate(&Identity::Coordinator(1), &["w-9.example".into()])
        .expect("request");
    let cert_pem = pki
        .ca
        .sign_request(
            &Identity::Worker("w-9".into()),
            &["w-9.example".into()],
            &request.request_pem,
        )
        .expect("sign");
    let files = PairFiles::in_dir(&pki.dir, "w-9");
    std::fs::write(&files.cert, &cert_pem).expect("write cert");
    std::fs::write(&files.key, &request.key_pem).expect("write key");
    let worker = Credentials::load(&files.cert, &files.key, &pki.dir.join(CA_FILE)).expect("load");
    assert_eq!(worker.identity(), &Identity::Worker("w-9".into()));
    let coordinator = pki.credentials("coordinator-1", Identity::Coordinator(1));
    let peer = handshake(
        &coordinator,
        worker
            .client_config(ExpectedServer::AnyCoordinator)
            .expect("client"),
    )
    .await
    .expect("mutual TLS with the signed certificate");
    assert_eq!(peer, Some(Identity::Worker("w-9".into())));

    // A request whose signature does not match its key, garbage, and an oversized
    // request are refused before anything is signed.
    let mut tampered = request.request_pem.clone().into_bytes();
    let body_start = tampered.iter().position(|b| *b == b'\n').expect("pem") + 40;
    tampered[body_start] = if tampered[body_start] == b'A' {
        b'B'
    } else {
        b'A'
    };
    let tampered = String::from_utf8(tampered).expect("ascii");
    let worker_w9 = Identity::Worker("w-9".into());
    for bad in [tampered, "not a request".to_string(), "A".repeat(20_000)] {
        let err = pki
            .ca
            .sign_request(&worker_w9, &[], &bad)
            .expect_err("refused");
        assert!(matches!(err, TlsError::BadRequest(_)), "{err}");
    }
}

#[test]
fn a_ca_key_of_another_ca_is_refused() {
    let a = pki();
    let b = pki();
    let err = ClusterCa::load(&a.dir.join(CA_FILE), &b.dir.join(generate::CA_KEY_FILE))
        .err()
        .expect("another CA's key");
    assert!(err.to_string().contains("does not belong"), "{err}");
    ClusterCa::load(&a.dir.join(CA_FILE), &a.dir.join(generate::CA_KEY_FILE)).expect("own key");
}

#[tokio::test]
async fn a_client_accepts_only_the_server_identity_it_expects() {
    let pki = pki();
    let coordinator = pki.credentials("coordinator-1", Identity::Coordinator(1));
    let worker = pki.credentials("worker-1", Identity::Worker("w-1".into()));
    let user = pki.credentials("user-alice", Identity::User("alice".into()));
    let client = |expected| {
        worker
            .trust()
            .client_config(expected)
            .expect("client config")
    };

    for ok in [
        ExpectedServer::AnyCoordinator,
        ExpectedServer::Coordinator(1),
    ] {
        handshake(&coordinator, client(ok.clone()))
            .await
            .unwrap_or_else(|e| panic!("coordinator 1 as {ok}: {e}"));
    }
    handshake(&worker, client(ExpectedServer::Worker("w-1".into())))
        .await
        .expect("worker w-1 as itself");

    // Valid under the CA for the host dialled, but not whom the client means to reach.
    for (server, expected, found) in [
        (
            &coordinator,
            ExpectedServer::Coordinator(2),
            "cumulus://coordinator/1",
        ),
        (
            &worker,
            ExpectedServer::AnyCoordinator,
            "cumulus://worker/w-1",
        ),
        (
            &worker,
            ExpectedServer::Coordinator(1),
            "cumulus://worker/w-1",
        ),
        (
            &worker,
            ExpectedServer::Worker("w-2".into()),
            "cumulus://worker/w-1",
        ),
        (
            &coordinator,
            ExpectedServer::Worker("w-1".into()),
            "cumulus://coordinator/1",
        ),
    ] {
        let err = handshake(server, client(expected.clone()))
            .await
            .expect_err("a server of another identity");
        let want = format!("is not {expected}: its certificate names {found}");
        assert!(err.contains(&want), "expected {want:?} in {err:?}");
    }

    // A user's certificate cannot serve at all: no server-authentication usage.
    let err = handshake(&user, client(ExpectedServer::AnyCoordinator))
        .await
        .expect_err("a user's certificate serving");
    assert!(err.contains("extended key usage"), "{err}");
}

#[test]
fn only_members_certificates_may_serve() {
    use x509_parser::extensions::GeneralName;
    let pki = pki();
    let usages = |identity: Identity| {
        let issued = pki
            .ca
            .issue(&identity, &["node-a.example".into()])
            .expect("issue");
        let der = CertificateDer::from_pem_slice(issued.cert_pem.as_bytes()).expect("pem");
        let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).expect("parse");
        let eku = cert
            .extended_key_usage()
            .expect("extension parses")
            .expect("has extended key usages")
            .value
            .clone();
        let hosts = cert
            .subject_alternative_name()
            .expect("parses")
            .expect("has names")
            .value
            .general_names
            .iter()
            .filter(|n| matches!(n, GeneralName::DNSName(_) | GeneralName::IPAddress(_)))
            .count();
        assert_eq!(identity_of(&der).expect("identity"), identity);
        (eku.server_auth, eku.client_auth, hosts)
    };
    assert_eq!(usages(Identity::User("alice".into())), (false, true, 0));
    assert_eq!(usages(Identity::Coordinator(1)), (true, true, 4));
    assert_eq!(usages(Identity::Worker("w-1".into())), (true, true, 4));
}

/// A user's certificate is valid from the second it is issued (its notBefore tells the
/// coordinators when it was issued); a member's from a day before, which absorbs clock
/// differences; `issue_valid_from` sets the second asked for.
#[test]
fn a_users_certificate_is_valid_from_when_it_was_issued() {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};
    let pki = pki();
    let unix_ms = |t: SystemTime| {
        t.duration_since(UNIX_EPOCH)
            .expect("after 1970")
            .as_millis() as i64
    };
    let not_before = |issued: generate::Issued| {
        let der = CertificateDer::from_pem_slice(issued.cert_pem.as_bytes()).expect("pem");
        peer_cert_of(&der).expect("peer cert")
    };
    let before = unix_ms(SystemTime::now());
    let user = not_before(
        pki.ca
            .issue(&Identity::User("alice".into()), &[])
            .expect("issue"),
    );
    let after = unix_ms(SystemTime::now());
    assert_eq!(user.identity, Identity::User("alice".into()));
    assert_eq!(user.not_before_unix_ms % 1000, 0, "whole seconds");
    assert!(
        before - 1000 < user.not_before_unix_ms && user.not_before_unix_ms <= after,
        "{before} {} {after}",
        user.not_before_unix_ms
    );
    let worker = not_before(
        pki.ca
            .issue(&Identity::Worker("w-1".into()), &[])
            .expect("issue"),
    );
    assert!(worker.not_before_unix_ms <= before - 86_400_000 + 1000);

    let earlier = UNIX_EPOCH + Duration::from_millis(1_700_000_000_750);
    let old = pki
        .ca
        .issue_valid_from(&Identity::User("alice".into()), &[], earlier)
        .expect("issue");
    assert_eq!(not_before(old).not_before_unix_ms, 1_700_000_000_000);
}
