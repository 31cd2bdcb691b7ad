//! `--rejoin-empty`: the recovery path of a node whose data dir refused to open (a
//! corrupt raft log, snapshot or sled file, or a committed index past the log).
//!
//! A voter that lost its log must not vote: with an empty log it would grant its vote to
//! a candidate missing entries it had acknowledged, and that candidate could win without
//! them (Raft's safety argument counts this node's acknowledgement). So the node comes
//! back only after an operator removed it from the membership (`cumulusctl cluster
//! remove ID`): this module asks the leader for the membership and refuses while the
//! node is still a voter, then moves the damaged data dir aside (kept for
//! inspection, never deleted) and lets the node start empty as with `--join`; the
//! operator then adds it back with `cluster add-learner` (it catches up from the leader
//! by entries or a snapshot) and `cluster promote`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use cumulus_api::v1::ClusterStatusRequest;
use cumulus_api::v1::client_service_client::ClientServiceClient;
use cumulus_raft_store::NodeId;

use crate::Peer;
use crate::auth::AddToken;

/// Deadline of asking one other coordinator for the membership, in milliseconds.
pub const ASK_TIMEOUT_MS: u64 = 3_000;
/// How long to look for the leader among the other coordinators, in milliseconds.
pub const LEADER_WAIT_MS: u64 = 30_000;
/// Pause between two rounds of asking, in milliseconds.
pub const ASK_RETRY_MS: u64 = 500;

/// Checks with the leader (found among the other coordinators in `peers`) that `node_id`
/// is no longer a member,
/// then moves `data_dir` aside to `<data_dir>.damaged-<unix seconds>` (when it exists)
/// and returns where it went.
///
/// # Errors
/// No other coordinator is given or answers; the node is still a member; the move fails.
pub async fn prepare(
    node_id: NodeId,
    peers: &[Peer],
    data_dir: &Path,
    auth: AddToken,
    tls: Option<Arc<cumulus_tls::Credentials>>,
) -> anyhow::Result<Option<PathBuf>> {
    let others: Vec<&Peer> = peers.iter().filter(|p| p.id != node_id).collect();
    if others.is_empty() {
        bail!(
            "--rejoin-empty needs the other coordinators' addresses (--peer ID=GRPC@HTTP for \
             each) to check that node {node_id} was removed from the membership"
        );
    }
    // Only the leader's answer counts: a follower may not have applied the removal yet.
    let deadline = tokio::time::Instant::now() + Duration::from_millis(LEADER_WAIT_MS);
    let members = loop {
        let mut leader_members = None;
        for peer in &others {
            match ask_members(peer, auth.clone(), tls.as_deref()).await {
                Ok(Some(members)) => {
                    leader_members = Some((peer.id, members));
                    break;
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(peer = peer.id, error = %e, "cannot ask for the membership")
                }
            }
        }
        if let Some(found) = leader_members {
            break found;
        }
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "no other coordinator answered as the leader within {LEADER_WAIT_MS} ms; \
                 cannot confirm that node {node_id} was removed from the membership (it \
                 must be before it starts empty)"
            );
        }
        tokio::time::sleep(Duration::from_millis(ASK_RETRY_MS)).await;
    };
    let (leader, members) = members;
    if members.contains(&node_id) {
        bail!(
            "node {node_id} is still a voting member of the cluster (says the leader, node \
             {leader}): a node that lost its log must not vote. Run `cumulusctl cluster \
             remove {node_id}` first, then start it again with --rejoin-empty"
        );
    }
    move_aside(data_dir)
}

/// Node ids of the voters, when `peer` is the leader (`None` when it is not). With TLS
/// its certificate must name it (`cumulus://coordinator/{id}`). A learner never votes,
/// so an operator may add the node back as a learner before or after it starts.
async fn ask_members(
    peer: &Peer,
    auth: AddToken,
    tls: Option<&cumulus_tls::Credentials>,
) -> anyhow::Result<Option<Vec<NodeId>>> {
    let grpc_addr = &peer.node.grpc_addr;
    let endpoint = crate::network::endpoint(grpc_addr, tls.is_some())
        .with_context(|| format!("bad address {grpc_addr}"))?
        .connect_timeout(Duration::from_millis(ASK_TIMEOUT_MS))
        .timeout(Duration::from_millis(ASK_TIMEOUT_MS));
    let connector = tls
        .map(|creds| crate::network::peer_connector(creds, peer.id, Default::default()))
        .transpose()?;
    let channel = cumulus_client::connect(&endpoint, connector)
        .await
        .with_context(|| format!("connecting to coordinator {} at {grpc_addr}", peer.id))?;
    let mut client = ClientServiceClient::with_interceptor(channel, auth);
    let status = client
        .cluster_status(ClusterStatusRequest {})
        .await
        .with_context(|| format!("cluster status from {grpc_addr}"))?
        .into_inner();
    if status.leader_id != Some(status.node_id) {
        return Ok(None);
    }
    Ok(Some(
        status
            .members
            .iter()
            .filter(|m| m.voter)
            .map(|m| m.node_id)
            .collect(),
    ))
}

/// Renames `data_dir` to `<data_dir>.damaged-<unix seconds>`; `None` when it does not
/// exist or is empty (then it is left in place).
fn move_aside(data_dir: &Path) -> anyhow::Result<Option<PathBuf>> {
    let empty = match std::fs::read_dir(data_dir) {
        Ok(mut items) => items.next().is_none(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", data_dir.display())),
    };
    if empty {
        return Ok(None);
    }
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut name = data_dir.as_os_str().to_owned();
    name.push(format!(".damaged-{secs}"));
    let aside = PathBuf::from(name);
    std::fs::rename(data_dir, &aside).with_context(|| {
        format!(
            "moving the damaged data dir {} aside to {}",
            data_dir.display(),
            aside.display()
        )
    })?;
    Ok(Some(aside))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_damaged_data_dir_is_moved_aside_and_an_empty_one_stays() {
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path().join("coord-1");
        assert_eq!(move_aside(&dir).expect("missing"), None);
        std::fs::create_dir(&dir).expect("mkdir");
        assert_eq!(move_aside(&dir).expect("empty"), None);
        assert!(dir.exists());
        std::fs::write(dir.join("db"), b"x").expect("write");
        let aside = move_aside(&dir).expect("move").expect("moved");
        assert!(!dir.exists());
        assert_eq!(std::fs::read(aside.join("db")).expect("kept"), b"x");
        assert!(
            aside
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("coord-1.damaged-")),
            "{}",
            aside.display()
        );
    }
}
