//! The blob cache against a transport serving blobs from memory: verified fetches, one
//! flight per digest, a corrupted cached blob fetched again, LRU eviction within the
//! bound.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

/// Blobs kept in memory, counting the fetches; `gate` (when set) holds every fetch until
/// the test adds a permit.
#[derive(Default)]
struct MemoryTransport {
    blobs: Mutex<HashMap<String, Vec<u8>>>,
    gets: AtomicUsize,
    gate: Option<Arc<tokio::sync::Semaphore>>,
    /// Bytes served in place of the real ones (a coordinator sending garbage).
    corrupt: bool,
}

impl MemoryTransport {
    fn add(&self, bytes: Vec<u8>) -> (String, u64) {
        let digest = blake3::hash(&bytes).to_hex().to_string();
        let size = bytes.len() as u64;
        self.blobs.lock().unwrap().insert(digest.clone(), bytes);
        (digest, size)
    }
}

impl BlobTransport for MemoryTransport {
    fn get<'a>(&'a self, digest: &'a str) -> BoxFuture<'a, Result<ByteStream, String>> {
        Box::pin(async move {
            self.gets.fetch_add(1, Ordering::SeqCst);
            if let Some(gate) = &self.gate {
                gate.acquire().await.map_err(|e| e.to_string())?.forget();
            }
            let mut bytes = self
                .blobs
                .lock()
                .unwrap()
                .get(digest)
                .cloned()
                .ok_or_else(|| format!("no blob {digest}"))?;
            if self.corrupt {
                bytes[0] ^= 1;
            }
            let chunks: Vec<Result<Vec<u8>, String>> =
                bytes.chunks(7).map(|c| Ok(c.to_vec())).collect();
            Ok(Box::pin(futures::stream::iter(chunks)) as ByteStream)
        })
    }

    fn put<'a>(
        &'a self,
        path: &'a Path,
        (digest, _): (&'a str, u64),
        _deadline: Duration,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
            self.blobs.lock().unwrap().insert(digest.to_string(), bytes);
            Ok(())
        })
    }
}

fn cache(dir: &Path, max_bytes: u64, transport: &Arc<MemoryTransport>) -> Arc<BlobCache> {
    BlobCache::open(
        dir,
        max_bytes,
        Arc::clone(transport) as Arc<dyn BlobTransport>,
    )
    .expect("open")
}

#[tokio::test]
async fn a_blob_is_fetched_verified_and_then_served_from_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let transport = Arc::new(MemoryTransport::default());
    let (digest, size) = transport.add(b"hello, blob store".to_vec());
    let cache = cache(dir.path(), 1 << 20, &transport);
    let lease = cache.get(&digest, size).await.expect("fetched");
    assert_eq!(std::fs::read(lease.path()).unwrap(), b"hello, blob store");
    assert_eq!(lease.path(), dir.path().join(BLOB_CACHE_DIR).join(&digest));
    drop(lease);
    let again = cache.get(&digest, size).await.expect("cached");
    assert_eq!(transport.gets.load(Ordering::SeqCst), 1);
    drop(again);
    // A reopened cache knows it, and a wrong size is refused before any fetch.
    let reopened = super::BlobCache::open(
        dir.path(),
        1 << 20,
        Arc::clone(&transport) as Arc<dyn BlobTransport>,
    )
    .expect("reopen");
    assert!(reopened.contains(&digest));
    assert!(matches!(
        reopened.get(&digest, 0).await,
        Err(BlobError::Invalid { .. })
    ));
    assert!(matches!(
        reopened.get("not-a-digest", 3).await,
        Err(BlobError::Invalid { .. })
    ));
}

#[tokio::test]
async fn bytes_that_do_not_match_the_digest_are_refused_and_not_cached() {
    let dir = tempfile::tempdir().unwrap();
    let transport = Arc::new(MemoryTransport {
        corrupt: true,
        ..MemoryTransport::default()
    });
    let (digest, size) = transport.add(vec![7u8; 100]);
    let cache = cache(dir.path(), 1 << 20, &transport);
    let err = cache.get(&digest, size).await.expect_err("corrupt");
    assert!(matches!(err, BlobError::Fetch { .. }), "{err}");
    assert!(err.to_string().contains("hash to"), "{err}");
    assert_eq!(
        transport.gets.load(Ordering::SeqCst),
        FETCH_ATTEMPTS as usize
    );
    assert!(!cache.contains(&digest));
    assert_eq!(cache.cached_bytes(), 0);
    // Nothing is left behind in the cache's directory.
    let left: Vec<_> = std::fs::read_dir(dir.path().join(BLOB_CACHE_DIR))
        .unwrap()
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test]
async fn a_corrupted_cached_blob_is_removed_and_fetched_again() {
    let dir = tempfile::tempdir().unwrap();
    let transport = Arc::new(MemoryTransport::default());
    let (digest, size) = transport.add(b"#!/bin/sh\necho the real script\n".to_vec());
    let cache = cache(dir.path(), 1 << 20, &transport);
    let path = cache
        .get(&digest, size)
        .await
        .expect("fetched")
        .path()
        .to_owned();
    // Flipped on disk (a bad sector, someone's edit): same size, other bytes.
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[3] ^= 0x20;
    std::fs::write(&path, &bytes).unwrap();
    let lease = cache.get(&digest, size).await.expect("fetched again");
    assert_eq!(transport.gets.load(Ordering::SeqCst), 2);
    assert_eq!(
        std::fs::read(lease.path()).unwrap(),
        b"#!/bin/sh\necho the real script\n"
    );
    assert_eq!(cache.cached_bytes(), size);
}

#[tokio::test]
async fn concurrent_gets_of_one_digest_share_one_fetch() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let transport = Arc::new(MemoryTransport {
        gate: Some(Arc::clone(&gate)),
        ..MemoryTransport::default()
    });
    let (digest, size) = transport.add(vec![42u8; 4096]);
    let cache = cache(dir.path(), 1 << 20, &transport);
    let tasks: Vec<_> = (0..3)
        .map(|_| {
            let (cache, digest) = (Arc::clone(&cache), digest.clone());
            tokio::spawn(async move { cache.get(&digest, size).await.map(|l| l.path().to_owned()) })
        })
        .collect();
    // Wait until all three are getting it (one fetching, two waiting on its flight).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while cache.in_flight(&digest) < 3 || transport.gets.load(Ordering::SeqCst) < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the gets never overlapped"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    gate.add_permits(10);
    for t in tasks {
        let path = t.await.unwrap().expect("leased");
        assert_eq!(path, dir.path().join(BLOB_CACHE_DIR).join(&digest));
    }
    assert_eq!(transport.gets.load(Ordering::SeqCst), 1);
    assert_eq!(cache.in_flight(&digest), 0);
}

#[tokio::test]
async fn least_recently_used_unpinned_blobs_are_evicted_to_stay_within_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let transport = Arc::new(MemoryTransport::default());
    let blobs: Vec<(String, u64)> = (0..4u8).map(|i| transport.add(vec![i; 400])).collect();
    // Room for two blobs of 400 bytes.
    let cache = cache(dir.path(), 1_000, &transport);
    drop(cache.get(&blobs[0].0, 400).await.unwrap());
    drop(cache.get(&blobs[1].0, 400).await.unwrap());
    // Blob 0 used again: blob 1 is now the least recently used.
    drop(cache.get(&blobs[0].0, 400).await.unwrap());
    let pinned = cache.get(&blobs[2].0, 400).await.unwrap();
    assert!(cache.contains(&blobs[0].0) && !cache.contains(&blobs[1].0));
    assert!(!dir.path().join(BLOB_CACHE_DIR).join(&blobs[1].0).exists());
    assert!(cache.cached_bytes() <= 1_000);
    // Blob 2 is pinned: blob 0 goes for blob 3.
    let also = cache.get(&blobs[3].0, 400).await.unwrap();
    assert!(!cache.contains(&blobs[0].0));
    // Both pinned: a fifth fetch does not fit, and a blob above the bound never does.
    let (fifth, _) = transport.add(vec![9u8; 400]);
    assert!(matches!(
        cache.get(&fifth, 400).await,
        Err(BlobError::Full { .. })
    ));
    let (big, _) = transport.add(vec![1u8; 1_001]);
    assert!(matches!(
        cache.get(&big, 1_001).await,
        Err(BlobError::Invalid { .. })
    ));
    drop((pinned, also));
    assert!(cache.get(&fifth, 400).await.is_ok());
    assert!(cache.cached_bytes() <= 1_000);
    // A smaller bound at the next start trims the cache, oldest first.
    drop(cache);
    let trimmed = super::BlobCache::open(
        dir.path(),
        500,
        Arc::clone(&transport) as Arc<dyn BlobTransport>,
    )
    .unwrap();
    assert!(trimmed.cached_bytes() <= 500);
}
