//! What the services call on the blob store: stat, put (the quota, the local write, the
//! majority rule), receive a peer's replica, and open a blob for reading (fetching it
//! from a peer first when this node lacks it). With `--blob-url` ([`Backend::S3`]),
//! stat, put, read and admission go to the bucket instead (`super::s3`): no majority, no
//! peers.
//!
//! An upload is acknowledged once a majority of the voters, this node included when it
//! votes, hold the blob: it is written here first (verified, fsynced), then streamed from
//! this node's copy to every other voter in parallel (`ReplicateBlob`); the answer comes
//! as soon as enough peers stored it, the other streams finish in the background
//! (bounded by [`MAX_OUTGOING_REPLICATIONS`](super::MAX_OUTGOING_REPLICATIONS)). Within
//! [`transfer_deadline`] plus [`SLOT_WAIT_MS`] the upload fails with UNAVAILABLE naming
//! the coordinators that did not store it; what this node stored stays until garbage
//! collection.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use cumulus_api::Role;
use cumulus_api::users::Principal;
use cumulus_api::v1;
use cumulus_raft_store::NodeId;
use futures::Stream;
use openraft::async_runtime::watch::WatchReceiver;
use tokio::sync::mpsc;

use super::{
    Backend, BlobError, BlobHeader, BlobMeta, BlobRead, Blobs, REPLICATE_BASE_TIMEOUT_MS,
    SLOT_WAIT_MS, slot, transfer_deadline,
};
use crate::soft::now_ms;

/// Who uploads a blob: a user (counted against their quota unless an administrator), or
/// a worker agent storing an attempt's artifacts (bounded by the agent per job).
#[derive(Clone, Debug)]
pub enum Uploader {
    /// A user, with their role.
    User(Principal),
    /// A worker agent, by id (`""` when the connection does not prove one: plaintext).
    Worker(String),
}

impl Uploader {
    /// The name recorded in the blob's sidecar: the user's, or `worker/ID`.
    pub fn recorded_name(&self) -> String {
        match self {
            Uploader::User(p) => p.name.clone(),
            Uploader::Worker(id) if id.is_empty() => "worker".into(),
            Uploader::Worker(id) => format!("worker/{id}"),
        }
    }
}

/// Bytes of an upload in progress, counted against its uploader's quota until dropped.
pub(super) struct Reservation<'a> {
    blobs: &'a Blobs,
    who: String,
    bytes: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut reserved = self
            .blobs
            .reserved
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(n) = reserved.get_mut(&self.who) {
            *n = n.saturating_sub(self.bytes);
            if *n == 0 {
                reserved.remove(&self.who);
            }
        }
    }
}

/// The coordinators of the membership as this node sees it.
struct Members {
    /// Voters other than this node, with their gRPC addresses.
    other_voters: Vec<(NodeId, String)>,
    /// Learners other than this node.
    learners: Vec<(NodeId, String)>,
    /// How many voters there are.
    voters: usize,
    /// Whether this node votes.
    me_voter: bool,
}

impl Blobs {
    fn members(&self) -> Members {
        let m = self.raft.metrics();
        let m = m.borrow_watched();
        let ms = m.membership_config.membership();
        let voter_ids: BTreeSet<NodeId> = ms.voter_ids().collect();
        let mut other_voters = Vec::new();
        let mut learners = Vec::new();
        for (id, node) in ms.nodes() {
            if *id == self.id {
                continue;
            }
            // Blob replication is a peer-only call of the Raft service: its address.
            let entry = (*id, node.raft_target().to_string());
            if voter_ids.contains(id) {
                other_voters.push(entry);
            } else {
                learners.push(entry);
            }
        }
        Members {
            other_voters,
            learners,
            voters: voter_ids.len(),
            me_voter: voter_ids.contains(&self.id),
        }
    }

    /// What this node holds of `digest`: the index's record when the file is there with
    /// that size (the bytes are checked when read); a record whose file is gone or of
    /// another size is dropped (and such a file removed). With S3: what `HEAD` says of
    /// the object.
    ///
    /// # Errors
    /// [`BlobError::Invalid`] for a malformed digest; with S3,
    /// [`BlobError::Unavailable`] when the bucket cannot answer.
    pub async fn stat(&self, digest: &str) -> Result<Option<BlobMeta>, BlobError> {
        self.store.check_header(&BlobHeader {
            digest: digest.to_string(),
            size_bytes: 0,
        })?;
        if let Backend::S3(s3) = &self.backend {
            return s3.stat(digest).await;
        }
        let Some(meta) = self.store.held(digest) else {
            return Ok(None);
        };
        match tokio::fs::metadata(self.store.path_of(digest)).await {
            Ok(m) if m.is_file() && m.len() == meta.size_bytes => Ok(Some(meta)),
            _ => {
                tracing::warn!(
                    digest,
                    "a blob's file is missing or of the wrong size; dropping it"
                );
                let _ = self.store.remove(digest).await;
                Ok(None)
            }
        }
    }

    /// Counts `bytes` against `uploader`'s quota until the reservation is dropped; an
    /// administrator and a worker have none. `held` gives the bytes a user's stored blobs
    /// take (called under the reservations' lock); `place` names where they are stored.
    ///
    /// # Errors
    /// [`BlobError::Exhausted`] with the usage and the quota.
    pub(super) fn reserve_quota(
        &self,
        uploader: &Uploader,
        bytes: u64,
        held: impl FnOnce(&str) -> u64,
        place: &str,
    ) -> Result<Option<Reservation<'_>>, BlobError> {
        let Uploader::User(who) = uploader else {
            return Ok(None);
        };
        if who.role == Role::Admin {
            return Ok(None);
        }
        let mut reserved = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
        let held = held(&who.name);
        let pending = reserved.get(&who.name).copied().unwrap_or(0);
        let quota = self.quota_bytes_per_user;
        if held.saturating_add(pending).saturating_add(bytes) > quota {
            return Err(BlobError::Exhausted(format!(
                "user {} holds {held} bytes of blobs {place} ({pending} more being uploaded \
                 here); this blob of {bytes} bytes would pass the quota of {quota} bytes \
                 (--blob-quota-bytes-per-user). Blobs no job references are removed after \
                 the retention period",
                who.name
            )));
        }
        *reserved.entry(who.name.clone()).or_default() += bytes;
        Ok(Some(Reservation {
            blobs: self,
            who: who.name.clone(),
            bytes,
        }))
    }

    /// Stores an upload and answers once a majority of the voters hold it (with S3: once
    /// the bucket holds it, `replicas` 0). A blob already held is not read again (its
    /// bytes were verified when stored).
    ///
    /// # Errors
    /// [`BlobError::Invalid`] for a bad header or bytes that are not the blob;
    /// [`BlobError::Exhausted`] past the uploads in progress, the blobs held or the
    /// uploader's quota; [`BlobError::Unavailable`] when no majority holds it in time
    /// (naming the coordinators that failed); [`BlobError::Aborted`] when the upload's
    /// stream breaks.
    pub async fn put<S>(
        self: &Arc<Self>,
        header: BlobHeader,
        uploader: &Uploader,
        chunks: S,
    ) -> Result<v1::PutBlobResponse, BlobError>
    where
        S: Stream<Item = Result<Bytes, BlobError>> + Unpin + Send,
    {
        self.store.check_header(&header)?;
        let _slot = self.uploads.clone().try_acquire_owned().map_err(|_| {
            BlobError::Exhausted(format!(
                "{} uploads are in progress on this coordinator, the most it takes at once; retry",
                super::MAX_CONCURRENT_UPLOADS
            ))
        })?;
        if let Backend::S3(s3) = &self.backend {
            return self.put_s3(s3, header, uploader, chunks).await;
        }
        let meta = match self.stat(&header.digest).await? {
            Some(m) if m.size_bytes == header.size_bytes => m,
            Some(m) => {
                return Err(BlobError::Invalid(format!(
                    "blob {} is {} bytes, not the {} announced",
                    header.digest, m.size_bytes, header.size_bytes
                )));
            }
            None => {
                let _reservation = self.reserve_quota(
                    uploader,
                    header.size_bytes,
                    |who| self.store.usage_of(who),
                    "on this coordinator",
                )?;
                let meta = BlobMeta {
                    size_bytes: header.size_bytes,
                    uploader: uploader.recorded_name(),
                    stored_at_ms: now_ms(),
                };
                self.store.write(&header, meta, chunks).await?
            }
        };
        let replicas = self.replicate_to_majority(&header, &meta).await?;
        Ok(v1::PutBlobResponse {
            digest: header.digest,
            size_bytes: header.size_bytes,
            replicas,
        })
    }

    /// Streams the held blob `header` names to every other voter in parallel and returns
    /// how many voters hold it once they are a majority (with S3: 0 at once, the bucket
    /// holds it).
    ///
    /// # Errors
    /// [`BlobError::Unavailable`] naming each coordinator that failed, when no majority
    /// holds it within the deadline.
    pub async fn replicate_to_majority(
        self: &Arc<Self>,
        header: &BlobHeader,
        meta: &BlobMeta,
    ) -> Result<u32, BlobError> {
        if let Backend::S3(_) = &self.backend {
            return Ok(0);
        }
        let members = self.members();
        let needed = u32::try_from(members.voters / 2 + 1).unwrap_or(u32::MAX);
        let mut holders = u32::from(members.me_voter);
        if holders >= needed {
            return Ok(holders);
        }
        let deadline = transfer_deadline(header.size_bytes);
        let (tx, mut rx) = mpsc::channel(members.other_voters.len().max(1));
        let mut pending: BTreeSet<NodeId> = BTreeSet::new();
        for (id, addr) in members.other_voters {
            pending.insert(id);
            let (this, header, meta, tx) = (self.clone(), header.clone(), meta.clone(), tx.clone());
            tokio::spawn(async move {
                let result = this
                    .replicate_one((id, &addr), &header, &meta, deadline)
                    .await;
                if let Err(why) = &result {
                    tracing::warn!(digest = %header.digest, peer = id, %why, "a blob was not replicated");
                }
                // After the acknowledgment nobody listens: the stream finished anyway.
                let _ = tx.send((id, result)).await;
            });
        }
        drop(tx);
        let mut failed = Vec::new();
        let give_up = tokio::time::sleep(deadline + Duration::from_millis(SLOT_WAIT_MS));
        tokio::pin!(give_up);
        loop {
            tokio::select! {
                r = rx.recv() => match r {
                    Some((id, Ok(()))) => {
                        pending.remove(&id);
                        holders += 1;
                        if holders >= needed {
                            return Ok(holders);
                        }
                    }
                    Some((id, Err(why))) => {
                        pending.remove(&id);
                        failed.push(format!("coordinator {id}: {why}"));
                    }
                    None => break,
                },
                () = &mut give_up => {
                    failed.extend(pending.iter().map(|id| format!("coordinator {id}: no answer in time")));
                    break;
                }
            }
        }
        Err(BlobError::Unavailable(format!(
            "blob {} is held by {holders} of the {} voting coordinators, fewer than a \
             majority ({needed}); the upload is not acknowledged: {}",
            header.digest,
            members.voters,
            failed.join("; ")
        )))
    }

    /// Streams this node's copy to one peer (a slot of the outgoing streams and one of
    /// the reads held throughout).
    async fn replicate_one(
        &self,
        peer: (NodeId, &str),
        header: &BlobHeader,
        meta: &BlobMeta,
        deadline: Duration,
    ) -> Result<(), String> {
        let _out = slot(&self.outgoing, "replications to peers")
            .await
            .map_err(|e| e.to_string())?;
        let reading = slot(&self.reads, "blob reads")
            .await
            .map_err(|e| e.to_string())?;
        let read = self
            .store
            .read(&header.digest, reading)
            .await
            .map_err(|e| e.to_string())?;
        self.peers
            .replicate(peer, header, meta, read.chunks, deadline)
            .await
    }

    /// Stores a peer's replica (`ReplicateBlob`) here only; one already held is not
    /// received again.
    ///
    /// # Errors
    /// As [`super::LocalStore::write`]; [`BlobError::Exhausted`] when no replica slot
    /// frees up in time.
    pub async fn receive_replica<S>(
        &self,
        header: BlobHeader,
        meta: BlobMeta,
        chunks: S,
    ) -> Result<BlobMeta, BlobError>
    where
        S: Stream<Item = Result<Bytes, BlobError>> + Unpin + Send,
    {
        self.store.check_header(&header)?;
        if let Some(m) = self.stat(&header.digest).await?
            && m.size_bytes == header.size_bytes
        {
            return Ok(m);
        }
        let _slot = slot(&self.replicas, "replicas being received").await?;
        self.store.write(&header, meta, chunks).await
    }

    /// Opens a blob this node holds for reading, without asking peers (`FetchBlob`).
    ///
    /// # Errors
    /// [`BlobError::NotFound`] when it is not held here; [`BlobError::Exhausted`] when no
    /// read slot frees up in time.
    pub async fn open_local(&self, digest: &str) -> Result<(BlobMeta, BlobRead), BlobError> {
        let meta = self.stat(digest).await?.ok_or_else(|| {
            BlobError::NotFound(format!("blob {digest} is not held by this coordinator"))
        })?;
        let permit = slot(&self.reads, "blob reads").await?;
        Ok((meta, self.store.read(digest, permit).await?))
    }

    /// Opens a blob for reading, fetching it from a peer first when this node lacks it
    /// (with S3: streamed from the bucket, re-hashed as it goes).
    ///
    /// # Errors
    /// As [`Blobs::ensure_held`] and [`Blobs::open_local`].
    pub async fn open(&self, digest: &str) -> Result<BlobRead, BlobError> {
        if let Backend::S3(s3) = &self.backend {
            self.store.check_header(&BlobHeader {
                digest: digest.to_string(),
                size_bytes: 0,
            })?;
            let permit = slot(&self.reads, "blob reads").await?;
            return s3.open(digest, permit).await;
        }
        self.ensure_held(digest).await?;
        Ok(self.open_local(digest).await?.1)
    }

    /// What this node holds of `digest`, fetched from a peer first (voters, then
    /// learners) when it lacks it; concurrent callers fetch it once.
    ///
    /// # Errors
    /// [`BlobError::NotFound`] when no coordinator holds it; [`BlobError::Unavailable`]
    /// naming why each peer that might hold it could not give it.
    pub async fn ensure_held(&self, digest: &str) -> Result<BlobMeta, BlobError> {
        if let Some(m) = self.stat(digest).await? {
            return Ok(m);
        }
        if let Backend::S3(s3) = &self.backend {
            return Err(BlobError::NotFound(format!(
                "blob {digest} is not in the blob store ({})",
                s3.url()
            )));
        }
        let lock = self
            .fetching
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(digest.to_string())
            .or_default()
            .clone();
        let result = {
            let _guard = lock.lock().await;
            match self.stat(digest).await {
                Ok(Some(m)) => Ok(m),
                Ok(None) => self.fetch_from_peers(digest).await,
                Err(e) => Err(e),
            }
        };
        self.fetching
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(digest);
        result
    }

    /// Fetches `digest` from the first peer that holds it (voters, then learners).
    /// "Not held" is the answer once a majority of the voters (this node included) lack
    /// it: an acknowledged blob is on a majority, which would meet this one.
    async fn fetch_from_peers(&self, digest: &str) -> Result<BlobMeta, BlobError> {
        let _slot = slot(&self.fetches, "fetches from peers").await?;
        let members = self.members();
        let voter_ids: BTreeSet<NodeId> = members.other_voters.iter().map(|(id, _)| *id).collect();
        let mut why = Vec::new();
        let mut lacking = usize::from(members.me_voter);
        let open = Duration::from_millis(REPLICATE_BASE_TIMEOUT_MS);
        for (id, addr) in members.other_voters.iter().chain(&members.learners) {
            match self.peers.fetch((*id, addr), digest, open).await {
                Ok((header, meta, data)) => {
                    let write = self.store.write(&header, meta, data);
                    match tokio::time::timeout(transfer_deadline(header.size_bytes), write).await {
                        Ok(Ok(m)) => {
                            tracing::info!(digest, peer = id, "fetched a blob from a peer");
                            return Ok(m);
                        }
                        Ok(Err(e)) => why.push(format!("coordinator {id}: {e}")),
                        Err(_) => why.push(format!("coordinator {id}: the transfer timed out")),
                    }
                }
                Err(BlobError::NotFound(_)) => {
                    lacking += usize::from(voter_ids.contains(id));
                    why.push(format!("coordinator {id}: not held"));
                }
                Err(e) => why.push(e.to_string()),
            }
        }
        if lacking > members.voters / 2 {
            Err(BlobError::NotFound(format!(
                "blob {digest} is not in the blob store (a majority of the coordinators \
                 lack it)"
            )))
        } else {
            Err(BlobError::Unavailable(format!(
                "blob {digest} is not on this coordinator and could not be fetched: {}",
                why.join("; ")
            )))
        }
    }
}
