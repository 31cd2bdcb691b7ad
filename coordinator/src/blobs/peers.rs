//! Blobs between coordinators: `RaftService.ReplicateBlob` (this node streams a blob it
//! holds to a peer, which stores it) and `RaftService.FetchBlob` (this node asks a peer
//! for a blob it lacks). Peers are reached as the Raft network reaches them
//! (`crate::network`): the peer token, and with TLS a certificate that must name the
//! coordinator expected. The uploader and time of a blob travel in metadata
//! ([`UPLOADER_METADATA`], [`STORED_AT_METADATA`]) so every holder can count it against
//! its uploader's quota.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use cumulus_api::blobs::CHUNK_BYTES;
use cumulus_api::v1::raft_service_client::RaftServiceClient;
use cumulus_api::v1::{BlobChunk, GetBlobRequest};
use cumulus_client::Refusals;
use cumulus_raft_store::NodeId;
use cumulus_tls::Credentials;
use futures::{Stream, StreamExt};
use tonic::codegen::InterceptedService;
use tonic::transport::Channel;

use super::BlobError;
use super::store::{BlobHeader, BlobMeta};
use crate::auth::AddToken;

/// gRPC metadata naming a blob's uploader (ReplicateBlob's request, FetchBlob's answer).
pub const UPLOADER_METADATA: &str = "x-cumulus-blob-uploader";
/// gRPC metadata carrying when a blob was first stored, in ms since the Unix epoch.
pub const STORED_AT_METADATA: &str = "x-cumulus-blob-stored-at-ms";
/// Longest uploader name accepted from a peer, in bytes (a user name or `worker/ID`).
pub const MAX_UPLOADER_BYTES: usize = 160;
/// Connect timeout of a peer's channel, in milliseconds.
pub const CONNECT_TIMEOUT_MS: u64 = 2_000;
/// Most peer clients cached (one per member; a membership churned past it starts over).
pub const MAX_PEER_CLIENTS: usize = 64;

type PeerClient = RaftServiceClient<InterceptedService<Channel, AddToken>>;

/// Clients of the other coordinators' Raft service, for blobs.
pub struct BlobPeers {
    /// The peer token.
    auth: AddToken,
    /// Client TLS; `None`: plaintext.
    tls: Option<Arc<Credentials>>,
    /// One client per peer, with the address it was made for.
    clients: Mutex<HashMap<NodeId, (String, PeerClient)>>,
}

/// Provenance from metadata: the uploader when it is a plausible name, and the time.
pub fn provenance_from(md: &tonic::metadata::MetadataMap, size_bytes: u64) -> BlobMeta {
    let uploader = md
        .get(UPLOADER_METADATA)
        .and_then(|v| v.to_str().ok())
        .filter(|u| {
            u.len() <= MAX_UPLOADER_BYTES
                && u.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_./".contains(&b))
        })
        .unwrap_or_default()
        .to_string();
    let stored_at_ms = md
        .get(STORED_AT_METADATA)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(crate::soft::now_ms);
    BlobMeta {
        size_bytes,
        uploader,
        stored_at_ms,
    }
}

/// Puts `meta`'s uploader and time into `md` (an uploader that is not a valid header
/// value is left out).
pub fn provenance_into(md: &mut tonic::metadata::MetadataMap, meta: &BlobMeta) {
    if let Ok(v) = meta.uploader.parse() {
        md.insert(UPLOADER_METADATA, v);
    }
    if let Ok(v) = meta.stored_at_ms.to_string().parse() {
        md.insert(STORED_AT_METADATA, v);
    }
}

/// The chunks of a blob on the wire: the first names it, every one carries at most
/// [`CHUNK_BYTES`] (a blob of zero bytes is one empty chunk). The stream stops at the
/// first error of `data` (the receiver then refuses a short blob).
pub fn to_chunks<S>(header: &BlobHeader, data: S) -> impl Stream<Item = BlobChunk> + Send + 'static
where
    S: Stream<Item = Result<Bytes, BlobError>> + Send + 'static,
{
    let first = BlobChunk {
        digest: header.digest.clone(),
        size_bytes: header.size_bytes,
        data: Vec::new(),
    };
    let rest = data
        .take_while(|r| futures::future::ready(r.is_ok()))
        .filter_map(|r| futures::future::ready(r.ok()))
        .flat_map(|b| {
            let pieces: Vec<BlobChunk> = b
                .chunks(CHUNK_BYTES)
                .map(|c| BlobChunk {
                    digest: String::new(),
                    size_bytes: 0,
                    data: c.to_vec(),
                })
                .collect();
            futures::stream::iter(pieces)
        });
    futures::stream::once(futures::future::ready(first)).chain(rest)
}

/// A received blob stream: the header its first chunk names and its bytes (the first
/// chunk's included). A later chunk naming another blob, a chunk over [`CHUNK_BYTES`] or
/// a broken stream ends the bytes with an error.
///
/// # Errors
/// [`BlobError::Invalid`] for an empty stream; [`BlobError::Aborted`] when it breaks
/// before its first chunk.
pub async fn from_chunks(
    mut chunks: tonic::Streaming<BlobChunk>,
) -> Result<
    (
        BlobHeader,
        impl Stream<Item = Result<Bytes, BlobError>> + Unpin + Send + 'static,
    ),
    BlobError,
> {
    let first = chunks
        .message()
        .await
        .map_err(|s| BlobError::Aborted(format!("the blob stream broke: {}", s.message())))?
        .ok_or_else(|| BlobError::Invalid("an empty blob stream (no first chunk)".into()))?;
    let header = BlobHeader {
        digest: first.digest,
        size_bytes: first.size_bytes,
    };
    let named = header.digest.clone();
    let check = move |c: BlobChunk| -> Result<Bytes, BlobError> {
        if !c.digest.is_empty() && c.digest != named {
            return Err(BlobError::Invalid(format!(
                "a later chunk of blob {named} names another blob"
            )));
        }
        if c.data.len() > CHUNK_BYTES {
            return Err(BlobError::Invalid(format!(
                "a chunk of {} bytes, more than {CHUNK_BYTES}",
                c.data.len()
            )));
        }
        Ok(Bytes::from(c.data))
    };
    let first_data = check(BlobChunk {
        digest: String::new(),
        size_bytes: 0,
        data: first.data,
    });
    let rest = chunks.map(move |item| match item {
        Ok(c) => check(c),
        Err(s) => Err(BlobError::Aborted(format!(
            "the blob stream broke: {}",
            s.message()
        ))),
    });
    Ok((
        header,
        Box::pin(futures::stream::once(futures::future::ready(first_data)).chain(rest)),
    ))
}

impl BlobPeers {
    /// Clients calling with `auth` (the peer token), over TLS with `tls`.
    pub fn new(auth: AddToken, tls: Option<Arc<Credentials>>) -> BlobPeers {
        BlobPeers {
            auth,
            tls,
            clients: Mutex::default(),
        }
    }

    /// The client of peer `id` at `addr` (made once per address).
    fn client(&self, id: NodeId, addr: &str) -> Result<PeerClient, String> {
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((a, c)) = clients.get(&id)
            && a == addr
        {
            return Ok(c.clone());
        }
        let endpoint = crate::network::endpoint(addr, self.tls.is_some())
            .map_err(|e| format!("bad peer address {addr}: {e}"))?
            .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_millis(crate::network::KEEPALIVE_INTERVAL_MS))
            .keep_alive_timeout(Duration::from_millis(crate::network::KEEPALIVE_TIMEOUT_MS));
        let connector = match &self.tls {
            Some(creds) => Some(
                crate::network::peer_connector(creds, id, Refusals::default())
                    .map_err(|e| format!("TLS for coordinator {id}: {e}"))?,
            ),
            None => None,
        };
        let channel = cumulus_client::connect_lazy(&endpoint, connector);
        let client = RaftServiceClient::with_interceptor(channel, self.auth.clone());
        if clients.len() >= MAX_PEER_CLIENTS {
            clients.clear();
        }
        clients.insert(id, (addr.to_string(), client.clone()));
        Ok(client)
    }

    /// Streams a blob to peer `id` at `addr` (`ReplicateBlob`) within `deadline`.
    ///
    /// # Errors
    /// Why the peer does not hold it: unreachable, refused, timed out.
    pub async fn replicate<S>(
        &self,
        (id, addr): (NodeId, &str),
        header: &BlobHeader,
        meta: &BlobMeta,
        data: S,
        deadline: Duration,
    ) -> Result<(), String>
    where
        S: Stream<Item = Result<Bytes, BlobError>> + Send + 'static,
    {
        let mut client = self.client(id, addr)?;
        let mut request = tonic::Request::new(to_chunks(header, data));
        request.set_timeout(deadline);
        provenance_into(request.metadata_mut(), meta);
        let call = client.replicate_blob(request);
        match tokio::time::timeout(deadline, call).await {
            Ok(Ok(answer)) => {
                let a = answer.into_inner();
                if a.digest == header.digest && a.size_bytes == header.size_bytes {
                    Ok(())
                } else {
                    Err(format!(
                        "answered for blob {} of {} bytes",
                        a.digest, a.size_bytes
                    ))
                }
            }
            Ok(Err(status)) => Err(format!("{:?}: {}", status.code(), status.message())),
            Err(_) => Err(format!("no answer within {} ms", deadline.as_millis())),
        }
    }

    /// Asks peer `id` at `addr` for blob `digest` (`FetchBlob`); the answer must name it
    /// within `open_deadline`. Returns its header, provenance and bytes.
    ///
    /// # Errors
    /// [`BlobError::NotFound`] when the peer does not hold it; [`BlobError::Unavailable`]
    /// when it cannot be asked or answers otherwise.
    pub async fn fetch(
        &self,
        (id, addr): (NodeId, &str),
        digest: &str,
        open_deadline: Duration,
    ) -> Result<
        (
            BlobHeader,
            BlobMeta,
            impl Stream<Item = Result<Bytes, BlobError>> + Unpin + Send + 'static,
        ),
        BlobError,
    > {
        let mut client = self.client(id, addr).map_err(BlobError::Unavailable)?;
        let request = tonic::Request::new(GetBlobRequest {
            digest: digest.to_string(),
        });
        let opened = tokio::time::timeout(open_deadline, client.fetch_blob(request))
            .await
            .map_err(|_| {
                BlobError::Unavailable(format!(
                    "coordinator {id}: no answer within {} ms",
                    open_deadline.as_millis()
                ))
            })?;
        let response = match opened {
            Ok(r) => r,
            Err(s) if s.code() == tonic::Code::NotFound => {
                return Err(BlobError::NotFound(format!(
                    "coordinator {id} does not hold blob {digest}"
                )));
            }
            Err(s) => {
                return Err(BlobError::Unavailable(format!(
                    "coordinator {id}: {:?}: {}",
                    s.code(),
                    s.message()
                )));
            }
        };
        let md = response.metadata().clone();
        let (header, data) = from_chunks(response.into_inner()).await?;
        if header.digest != digest {
            return Err(BlobError::Unavailable(format!(
                "coordinator {id} answered with blob {}",
                header.digest
            )));
        }
        let meta = provenance_from(&md, header.size_bytes);
        Ok((header, meta, data))
    }
}

/// A blob read as the gRPC stream of a download (`GetBlob`, `FetchBlob`): the first
/// chunk names the blob (with the first bytes), each carries at most [`CHUNK_BYTES`]; a
/// read that fails (a corrupt blob: DATA_LOSS) ends the stream with its status.
pub fn download_chunks<S>(
    header: BlobHeader,
    chunks: S,
) -> impl Stream<Item = Result<BlobChunk, tonic::Status>> + Send + 'static
where
    S: Stream<Item = Result<Bytes, BlobError>> + Unpin + Send + 'static,
{
    futures::stream::unfold(
        (Some(header), chunks, false),
        |(mut header, mut chunks, done)| async move {
            if done {
                return None;
            }
            match chunks.next().await {
                Some(Ok(data)) => {
                    let (digest, size_bytes) = header
                        .take()
                        .map_or((String::new(), 0), |h| (h.digest, h.size_bytes));
                    let chunk = BlobChunk {
                        digest,
                        size_bytes,
                        data: Vec::from(data),
                    };
                    Some((Ok(chunk), (header, chunks, false)))
                }
                Some(Err(e)) => Some((Err(e.into()), (header, chunks, true))),
                // A blob of zero bytes: one chunk that names it.
                None => header.take().map(|h| {
                    let chunk = BlobChunk {
                        digest: h.digest,
                        size_bytes: h.size_bytes,
                        data: Vec::new(),
                    };
                    (Ok(chunk), (None, chunks, true))
                }),
            }
        },
    )
}
