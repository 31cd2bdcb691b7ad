//! The hostile-input faults: forged Raft RPCs ([`forge_raft_rpcs`]) and a flood of
//! idle connections against every listener ([`flood_listeners`]).

use std::sync::Arc;
use std::time::Duration;

use crate::Cluster;
use crate::history::Anomaly;

/// Sends every coordinator forged Raft RPCs — a leadership-transfer vote with the client
/// token, a vote from a non-member and a vote of term `u64::MAX` with the peer token, and
/// a vote at term 2^48 with the peer token and a member's own certificate — and records
/// an anomaly for each one not refused.
pub(super) async fn forge_raft_rpcs(cluster: &Cluster, anomalies: &mut Vec<Anomaly>) {
    use cumulus_api::v1::RaftPayload;
    use cumulus_api::v1::raft_service_client::RaftServiceClient;
    let vote = |candidate: u64, term: u64| {
        RaftPayload {
        body: serde_json::json!({
            "vote": {"leader_id": {"term": term, "node_id": candidate}, "committed": false},
            "last_log_id": {"leader_id": {"term": 1u64 << 40, "node_id": candidate}, "index": 1u64 << 40},
            "leadership_transfer": true,
        })
        .to_string()
        .into_bytes(),
    }
    };
    let members: Vec<u64> = cluster.coordinators.iter().map(|c| c.id).collect();
    let member = members[0];
    for c in &cluster.coordinators {
        if c.proc.child.is_none() {
            continue;
        }
        let Ok(channel) = crate::coordinator_channel(&c.grpc, cluster.client_tls().as_ref()).await
        else {
            continue;
        };
        for (token, rpc, what) in [
            (
                crate::TOKEN,
                vote(member, 1 << 40),
                "a vote with the client token",
            ),
            (
                crate::PEER_TOKEN,
                vote(99, 1 << 40),
                "a vote from a non-member",
            ),
            (
                crate::PEER_TOKEN,
                vote(member, u64::MAX),
                "a vote of term u64::MAX",
            ),
        ] {
            let mut client =
                RaftServiceClient::with_interceptor(channel.clone(), crate::Auth::new(token));
            match client.vote(rpc).await {
                Ok(_) => anomalies.push(Anomaly {
                    job_id: "-".into(),
                    what: format!("coordinator {} granted or answered {what}", c.id),
                }),
                Err(status)
                    if matches!(
                        status.code(),
                        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
                    ) => {}
                Err(_) => {} // unreachable right now (a fault): not a grant
            }
        }
    }
    // The term-bound probe: with the peer token and member 0's own certificate, a vote at
    // 2^48 (far above every node's term) must be refused by every other coordinator: a
    // granted one once left the cluster leaderless for good.
    let Ok(own_tls) = cluster.member_tls(&cumulus_tls::Identity::Coordinator(member)) else {
        return;
    };
    let own_tls = own_tls.or(cluster.client_tls());
    for c in cluster.coordinators.iter().filter(|c| c.id != member) {
        if c.proc.child.is_none() {
            continue;
        }
        let Ok(channel) = crate::coordinator_channel(&c.grpc, own_tls.as_ref()).await else {
            continue;
        };
        let mut client =
            RaftServiceClient::with_interceptor(channel, crate::Auth::new(crate::PEER_TOKEN));
        if client.vote(vote(member, 1 << 48)).await.is_ok() {
            anomalies.push(Anomaly {
                job_id: "-".into(),
                what: format!(
                    "coordinator {} answered a member's vote at term 2^48 instead of refusing it",
                    c.id
                ),
            });
        }
    }
}

/// Connections opened against each listener by [`flood_listeners`].
const FLOOD_CONNECTIONS: usize = 600;

/// The HTTP/2 client connection preface (RFC 9113, section 3.4): what a connection that
/// never opens a stream sends.
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Opens [`FLOOD_CONNECTIONS`] connections to every coordinator's gRPC and HTTP port and
/// every agent's API and rank API, holds them for `hold`, then closes them. Every other
/// connection is silent; the rest complete the TLS handshake where the port is TLS and
/// send the HTTP/2 preface, then nothing (the HTTP/2 idle flood: such connections were
/// once kept forever).
pub(super) async fn flood_listeners(cluster: &Cluster, hold: Duration) {
    use cumulus_tls::ExpectedServer;
    // (address, whom its certificate names when the cluster is TLS)
    let mut targets: Vec<(String, Option<ExpectedServer>)> = Vec::new();
    for c in &cluster.coordinators {
        let me = Some(ExpectedServer::Coordinator(c.id));
        targets.push((c.grpc_listen.clone(), me.clone()));
        targets.push((c.http.clone(), me));
    }
    for w in &cluster.workers {
        let info = cluster.dir.path().join(&w.name).join("agent.json");
        if let Ok(v) = std::fs::read(&info)
            .map_err(anyhow::Error::from)
            .and_then(|b| Ok(serde_json::from_slice::<serde_json::Value>(&b)?))
        {
            if let Some(a) = v["listen_addr"].as_str() {
                targets.push((a.to_string(), Some(ExpectedServer::Worker(w.name.clone()))));
            }
            // The rank-local API is plaintext on loopback.
            if let Some(a) = v["rank_api_addr"].as_str() {
                targets.push((a.to_string(), None));
            }
        }
    }
    let ca_pem = cluster.client_tls().map(|t| t.ca_pem);
    // Held only to be dropped: plain streams and TLS streams alike.
    let mut open: Vec<Box<dyn std::any::Any + Send>> = Vec::new();
    for (t, expected) in &targets {
        let tls = match (&ca_pem, expected) {
            (Some(ca), Some(expected)) => {
                match cumulus_tls::client_config_from_pem(ca, None, expected.clone()) {
                    Ok(config) => {
                        let mut config = (*config).clone();
                        config.alpn_protocols = vec![b"h2".to_vec()];
                        Some(tokio_rustls::TlsConnector::from(Arc::new(config)))
                    }
                    Err(_) => None,
                }
            }
            _ => None,
        };
        for k in 0..FLOOD_CONNECTIONS {
            let Ok(Ok(conn)) =
                tokio::time::timeout(Duration::from_secs(1), tokio::net::TcpStream::connect(t))
                    .await
            else {
                break;
            };
            if k % 2 == 0 {
                open.push(Box::new(conn));
                continue;
            }
            let preface = async {
                use tokio::io::AsyncWriteExt;
                match &tls {
                    Some(connector) => {
                        let name =
                            tokio_rustls::rustls::pki_types::ServerName::try_from("localhost")
                                .expect("a valid name");
                        let mut stream = connector.connect(name, conn).await.ok()?;
                        stream.write_all(H2_PREFACE).await.ok()?;
                        Some(Box::new(stream) as Box<dyn std::any::Any + Send>)
                    }
                    None => {
                        let mut conn = conn;
                        conn.write_all(H2_PREFACE).await.ok()?;
                        Some(Box::new(conn) as Box<dyn std::any::Any + Send>)
                    }
                }
            };
            if let Ok(Some(c)) = tokio::time::timeout(Duration::from_secs(2), preface).await {
                open.push(c);
            }
        }
    }
    tokio::time::sleep(hold).await;
    drop(open);
}
