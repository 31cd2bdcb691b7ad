//! TLS on a real cluster (the probes of the security issue): a sniffer between a client
//! and the leader sees only TLS records and never the token; plaintext gRPC and HTTP to
//! a TLS coordinator or agent get nothing; a client of another CA is refused; a worker's
//! certificate cannot speak for another worker; `cluster status` says whether the
//! cluster is insecure; and a process serving a worker's or a user's certificate on a
//! coordinator's address gets no request from cumulusctl or the other coordinators.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cumulus_api::v1;
use cumulus_e2e::{Cluster, ClusterOpts, TOKEN, worker_client};
use cumulus_tls::Identity;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const LONG: Duration = Duration::from_secs(120);

/// Copies `from` to `to`, appending every byte to `record`, until either side ends.
async fn pump(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    record: Arc<Mutex<Vec<u8>>>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                record
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .extend_from_slice(&buf[..n]);
                if to.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown().await;
}

/// A port on 127.0.0.1 forwarding to `target`, recording every byte both ways.
async fn recording_proxy(target: String) -> (String, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let seen: Arc<Mutex<Vec<u8>>> = Arc::default();
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(&target).await else {
                continue;
            };
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            tokio::spawn(pump(cr, sw, record.clone()));
            tokio::spawn(pump(sr, cw, record.clone()));
        }
    });
    (addr, seen)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_hides_the_token_refuses_plaintext_and_binds_worker_identities() {
    let cluster = Cluster::start(ClusterOpts {
        coordinators: 1,
        workers: 1,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    cluster.wait_leader(LONG).await;
    let coord = &cluster.coordinators[0];

    // 1. A sniffer between cumulusctl and the coordinator: TLS records only (each starts
    //    with content type 22 = handshake, version 3.x), never the token or the job name.
    let (proxy, seen) = recording_proxy(coord.grpc.clone()).await;
    let ca = cluster.ca_file().expect("a TLS cluster");
    let out = std::process::Command::new(cumulus_e2e::bin("cumulusctl"))
        .args(["--tls-ca", ca.to_str().expect("utf-8")])
        .args(["--addr", &proxy, "--token-file"])
        .arg(cluster.token_file())
        .args([
            "submit",
            "--name",
            "sniffed-job-name",
            "--world-size",
            "1",
            "--",
            "true",
        ])
        .output()
        .expect("cumulusctl");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = seen.lock().expect("lock").clone();
    assert!(bytes.len() > 100, "the sniffer saw the exchange");
    assert_eq!(&bytes[..2], &[0x16, 0x03], "a TLS handshake record first");
    assert!(
        !contains(&bytes, TOKEN.as_bytes()),
        "the token crossed in clear"
    );
    assert!(
        !contains(&bytes, b"sniffed-job-name"),
        "the job name crossed in clear"
    );

    // 2. Plaintext to a TLS coordinator (gRPC and HTTP) and to a TLS agent gets nothing.
    let plain = cumulus_e2e::coordinator_channel(&coord.grpc, None).await;
    if let Ok(ch) = plain {
        let mut c = v1::client_service_client::ClientServiceClient::with_interceptor(
            ch,
            cumulus_e2e::Auth::new(TOKEN),
        );
        assert!(c.list_jobs(v1::ListJobsRequest::default()).await.is_err());
    }
    let http = reqwest::Client::new();
    assert!(
        http.get(format!("http://{}/health", coord.http))
            .send()
            .await
            .is_err(),
        "plain HTTP to the coordinator"
    );
    let status = cluster.status().await.expect("status");
    assert!(!status.insecure, "cluster status says TLS is on");
    let agent = status.workers.first().expect("a worker").http_addr.clone();
    assert!(
        http.get(format!("http://{agent}/health"))
            .send()
            .await
            .is_err(),
        "plain HTTP to the agent"
    );

    // 3. A client that trusts another CA refuses the cluster's certificate.
    let other_ca = cumulus_tls::generate::ClusterCa::generate("another cluster").expect("ca");
    let stranger = cumulus_client::ClientTls {
        ca_pem: other_ca.cert_pem().as_bytes().into(),
        identity_pem: None,
    };
    assert!(
        cumulus_e2e::coordinator_channel(&coord.grpc, Some(&stranger))
            .await
            .is_err(),
        "a server certificate of another CA"
    );

    // 4. A worker certificate speaks only for its own worker id; none speaks for none.
    let impostor = cluster
        .member_tls(&Identity::Worker("impostor".into()))
        .expect("issue");
    let register = |worker_id: &str| v1::RegisterWorkerRequest {
        worker_id: worker_id.into(),
        host: "127.0.0.1".into(),
        http_addr: "127.0.0.1:1".into(),
        slots: 1,
        gpus: Vec::new(),
    };
    let mut as_impostor = worker_client(&coord.grpc, impostor.as_ref())
        .await
        .expect("client");
    let refused = as_impostor
        .register(register("worker-1"))
        .await
        .expect_err("registering as another worker");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused}");
    let refused = as_impostor
        .heartbeat(v1::HeartbeatRequest {
            worker_id: "worker-1".into(),
            ..Default::default()
        })
        .await
        .expect_err("a heartbeat as another worker");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused}");
    as_impostor
        .register(register("impostor"))
        .await
        .expect("its own id is fine");
    let mut no_cert = worker_client(&coord.grpc, cluster.client_tls().as_ref())
        .await
        .expect("client");
    let refused = no_cert
        .register(register("worker-2"))
        .await
        .expect_err("a worker call without a worker certificate");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insecure_cluster_says_so() {
    let cluster = Cluster::start(ClusterOpts {
        coordinators: 1,
        workers: 0,
        tls: false,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let status = cluster.status().await.expect("status");
    assert!(status.insecure);
    let out = cluster
        .cumulusctl(&["cluster", "status"])
        .expect("cumulusctl");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("--insecure"), "{text}");
}

/// The enrolled certificate and key of worker `name` (`<data-dir>/tls/`).
fn enrolled(cluster: &Cluster, name: &str) -> cumulus_tls::generate::PairFiles {
    cumulus_tls::generate::PairFiles::in_dir(&cluster.dir.path().join(name).join("tls"), "worker")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_without_certificates_enrol_with_the_cluster_token_and_keep_their_certificate() {
    use std::os::unix::fs::PermissionsExt;
    // No worker has a certificate: each makes a key and asks the coordinators, which
    // hold the CA key, to sign it. `Cluster::start` waits for both to register, which
    // with TLS needs a certificate naming the worker.
    let mut cluster = Cluster::start(ClusterOpts {
        coordinators: 1,
        workers: 2,
        enrol_workers: true,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let ca = cluster.ca_file().expect("a TLS cluster");
    for name in ["worker-1", "worker-2"] {
        let files = enrolled(&cluster, name);
        let creds = cumulus_tls::Credentials::load(&files.cert, &files.key, &ca)
            .unwrap_or_else(|e| panic!("{name}'s enrolled certificate: {e}"));
        assert_eq!(creds.identity(), &Identity::Worker(name.into()));
        let mode = std::fs::metadata(&files.key)
            .expect("key")
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{name}'s key is private: {mode:o}");
    }

    // The certificates serve the agents' APIs: a job's ranks run, and its logs come
    // back through the coordinator, which fetches them from the agent over TLS.
    let job = cluster
        .submit(
            "enrolled",
            v1::JobSpec {
                world_size: 2,
                command: vec!["sh".into(), "-c".into(), "echo enrolled-rank-$RANK".into()],
                ..Default::default()
            },
        )
        .await
        .expect("submit")
        .job_id;
    let done = cluster.wait_finished(&job, LONG).await;
    assert_eq!(
        done.job_state(),
        Ok(cumulus_api::JobState::Succeeded),
        "{done:?}"
    );
    let out = cluster
        .cumulusctl(&["logs", &job, "--rank", "1"])
        .expect("logs");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("enrolled-rank-1"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A restarted agent uses its certificate again instead of enrolling anew.
    let before = std::fs::read(enrolled(&cluster, "worker-1").cert).expect("cert");
    cluster.workers[0].kill9();
    cluster.spawn_worker(0).expect("restart");
    let log = cluster.workers[0].log.clone();
    cumulus_e2e::wait_for("the restarted agent to reuse its certificate", LONG, || {
        let log = log.clone();
        async move {
            std::fs::read_to_string(&log)
                .ok()
                .filter(|l| l.contains("using the enrolled certificate"))
        }
    })
    .await;
    assert_eq!(
        std::fs::read(enrolled(&cluster, "worker-1").cert).expect("cert"),
        before
    );

    // Enrolment needs the cluster token (a user's token is refused), a valid worker id
    // and host names, and a request signed by the key it names.
    let coord = cluster.coordinators[0].grpc.clone();
    let request = cumulus_tls::generate::Request::generate(
        &Identity::Worker("worker-9".into()),
        &["127.0.0.1".into()],
    )
    .expect("request");
    let enrol = |worker_id: &str, hosts: Vec<String>, csr_pem: String| v1::EnrolWorkerRequest {
        worker_id: worker_id.into(),
        hosts,
        csr_pem,
    };
    let ch = cumulus_e2e::coordinator_channel(&coord, cluster.client_tls().as_ref())
        .await
        .expect("channel");
    let mut as_user = v1::worker_service_client::WorkerServiceClient::with_interceptor(
        ch,
        cumulus_e2e::Auth::new("cu.alice.0123456789abcdef0123456789abcdef"),
    );
    let refused = as_user
        .enrol(enrol("worker-9", vec![], request.request_pem.clone()))
        .await
        .expect_err("a user's token");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused}");
    let mut client = worker_client(&coord, cluster.client_tls().as_ref())
        .await
        .expect("client");
    for (what, bad) in [
        (
            "a worker id with a slash",
            enrol("w/9", vec![], request.request_pem.clone()),
        ),
        (
            "a host with a space",
            enrol("worker-9", vec!["a b".into()], request.request_pem.clone()),
        ),
        (
            "seventeen hosts",
            enrol(
                "worker-9",
                (0..17).map(|i| format!("h{i}")).collect(),
                request.request_pem.clone(),
            ),
        ),
        ("no request", enrol("worker-9", vec![], "garbage".into())),
    ] {
        let refused = client.enrol(bad).await.expect_err(what);
        assert_eq!(
            refused.code(),
            tonic::Code::InvalidArgument,
            "{what}: {refused}"
        );
    }
    let signed = client
        .enrol(enrol(
            "worker-9",
            vec!["127.0.0.1".into()],
            request.request_pem,
        ))
        .await
        .expect("the cluster token enrols")
        .into_inner();
    use cumulus_tls::rustls::pki_types::pem::PemObject;
    let cert =
        cumulus_tls::rustls::pki_types::CertificateDer::from_pem_slice(signed.cert_pem.as_bytes())
            .expect("PEM");
    assert_eq!(
        cumulus_tls::identity_of(&cert).expect("identity"),
        Identity::Worker("worker-9".into())
    );
}

/// A process posing as a coordinator: a TLS server presenting a certificate of the
/// cluster CA that names someone else (a worker, a user).
struct Impostor {
    /// TCP connections accepted.
    connections: Arc<AtomicUsize>,
    /// Handshakes the server side completed.
    handshakes: Arc<AtomicUsize>,
    /// Every byte received after a completed handshake.
    received: Arc<Mutex<Vec<u8>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Impostor {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `tls`'s certificate (and key) on `listener`.
fn impostor(listener: TcpListener, tls: &cumulus_client::ClientTls) -> Impostor {
    use std::path::Path;
    let id = tls.identity_pem.as_ref().expect("a certificate to serve");
    let trust = cumulus_tls::Trust::from_pem(Path::new("ca"), tls.ca_pem.to_vec()).expect("CA");
    let creds = cumulus_tls::Credentials::from_pem(
        trust,
        (Path::new("cert"), id.cert.to_vec()),
        (Path::new("key"), id.key.to_vec()),
    )
    .expect("credentials");
    let acceptor = tokio_rustls::TlsAcceptor::from(creds.server_config().expect("server config"));
    let connections: Arc<AtomicUsize> = Arc::default();
    let handshakes: Arc<AtomicUsize> = Arc::default();
    let received: Arc<Mutex<Vec<u8>>> = Arc::default();
    let (c, h, r) = (connections.clone(), handshakes.clone(), received.clone());
    let task = tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            c.fetch_add(1, Ordering::SeqCst);
            let (acceptor, h, r) = (acceptor.clone(), h.clone(), r.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                h.fetch_add(1, Ordering::SeqCst);
                let mut buf = vec![0u8; 16 * 1024];
                while let Ok(n) = tls.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    r.lock().expect("lock").extend_from_slice(&buf[..n]);
                }
            });
        }
    });
    Impostor {
        connections,
        handshakes,
        received,
        task,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_and_peers_refuse_a_server_that_is_not_the_coordinator_they_expect() {
    let mut cluster = Cluster::start(ClusterOpts {
        coordinators: 3,
        workers: 0,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let leader = cluster.wait_leader(LONG).await;
    let ca = cluster.ca_file().expect("a TLS cluster");

    // 1. cumulusctl against a worker's and a user's certificate on a free port: refused
    //    in the handshake, naming what it found; nothing (no token) reaches the server.
    for (who, found) in [
        (
            Identity::Worker("mallory".into()),
            "cumulus://worker/mallory",
        ),
        (Identity::User("mallory".into()), "extended key usage"),
    ] {
        let tls = cluster.member_tls(&who).expect("issue").expect("TLS");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let server = impostor(listener, &tls);
        let out = std::process::Command::new(cumulus_e2e::bin("cumulusctl"))
            .args(["--tls-ca", ca.to_str().expect("utf-8"), "--timeout", "2"])
            .args(["--addr", &addr, "--token-file"])
            .arg(cluster.token_file())
            .args(["cluster", "status"])
            .output()
            .expect("cumulusctl");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "cumulusctl accepted {who}");
        assert!(stderr.contains(found), "{who}: {stderr}");
        assert!(
            server.connections.load(Ordering::SeqCst) >= 1,
            "{who}: it was dialled"
        );
        assert_eq!(
            server.handshakes.load(Ordering::SeqCst),
            0,
            "{who}: {stderr}"
        );
        assert!(server.received.lock().expect("lock").is_empty());

        // The e2e channel helper (the CLI's connector) says the same.
        let err = cumulus_e2e::coordinator_channel(&addr, cluster.client_tls().as_ref())
            .await
            .expect_err("a channel to an impostor");
        assert!(format!("{err:#}").contains(found), "{who}: {err:#}");
    }

    // 2. A follower stops and a worker's certificate is served on its address: the
    //    other coordinators' connections are refused and backed off (a bounded count,
    //    not a hot loop), and no Raft request (nor the peer token) arrives.
    let victim = cluster
        .coordinators
        .iter()
        .position(|c| c.id != leader)
        .expect("a follower");
    cluster.coordinators[victim].proc.kill9();
    let addr = cluster.coordinators[victim].grpc_listen.clone();
    let listener = cumulus_e2e::wait_for("the stopped follower's port", LONG, || {
        let addr = addr.clone();
        async move { TcpListener::bind(&addr).await.ok() }
    })
    .await;
    let tls = cluster
        .member_tls(&Identity::Worker("mallory".into()))
        .expect("issue")
        .expect("TLS");
    let server = impostor(listener, &tls);
    let started = Instant::now();
    cumulus_e2e::wait_for("the leader to dial the impostor", LONG, || {
        let n = server.connections.load(Ordering::SeqCst);
        async move { (n >= 1).then_some(()) }
    })
    .await;
    const WINDOW: Duration = Duration::from_secs(4);
    tokio::time::sleep(WINDOW).await;
    let dialled = server.connections.load(Ordering::SeqCst);
    // Two peers, each backing off from 0.5 s and doubling: a handful each in the window
    // (and its wait for the first); a hot loop made thousands.
    assert!(
        dialled <= 24,
        "{dialled} connections in {:?}",
        started.elapsed()
    );
    assert_eq!(server.handshakes.load(Ordering::SeqCst), 0);
    assert!(server.received.lock().expect("lock").is_empty());
    let log = std::fs::read_to_string(
        &cluster.coordinators[leader_index(&cluster, leader)]
            .proc
            .log,
    )
    .expect("leader log");
    let warnings = log
        .lines()
        .filter(|l| l.contains("refused the server's TLS certificate"))
        .collect::<Vec<_>>();
    assert!(
        warnings
            .iter()
            .any(|l| l.contains("is not coordinator") && l.contains("cumulus://worker/mallory")),
        "the leader names whom it expected and found: {warnings:#?}"
    );
    assert!(
        warnings.len() <= 4,
        "logged at most every few seconds: {warnings:#?}"
    );
    // openraft opens a new replication stream as soon as one fails: it waits out the
    // backoff instead of spinning on the refusal.
    let replication_errors = log
        .lines()
        .filter(|l| l.contains("RPCError") && l.contains("cumulus://worker/mallory"))
        .count();
    assert!(
        replication_errors <= 24,
        "{replication_errors} replication errors"
    );
    eprintln!(
        "the impostor was dialled {dialled} times in {:?}; the leader logged {} refusals \
         and {replication_errors} replication errors",
        started.elapsed(),
        warnings.len(),
    );
    // The cluster still serves with the two others.
    cluster.wait_leader(LONG).await;
}

fn leader_index(cluster: &Cluster, leader: u64) -> usize {
    cluster
        .coordinators
        .iter()
        .position(|c| c.id == leader)
        .expect("the leader is a member")
}
