//! The write-ahead log of Raft entries: entries survive a reopen across segments; a torn
//! tail is cut and zeroed, damage elsewhere refuses to open; a truncation never lets an
//! old record reappear; a purge deletes old segments; a data dir written before the WAL
//! (entries in sled) is migrated.

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use cumulus_raft_store::Entry;
use cumulus_raft_store::open;
use cumulus_raft_store::state::Command;
use cumulus_raft_store::wal::{SEGMENT_BYTES, Wal};
use openraft::RaftLogReader;
use openraft::storage::RaftLogStorage;

/// An entry of `term` at `index` whose payload is about `shard_bytes` long.
fn entry(term: u64, index: u64, shard_bytes: usize) -> Entry {
    common::entry(
        term,
        index,
        Command::SubmitJob {
            owner: String::new(),
            request_id: format!("r{term}-{index}"),
            spec: common::spec(&format!("t{term}")),
            shards: vec!["s".repeat(shard_bytes)],
            submitted_at_ms: index,
        },
    )
}

fn entries(term: u64, from: u64, to: u64, shard_bytes: usize) -> Vec<Entry> {
    (from..to).map(|i| entry(term, i, shard_bytes)).collect()
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").path())
        .collect();
    out.sort();
    out
}

#[test]
fn entries_survive_reopen_across_segments() {
    let dir = tempfile::tempdir().expect("temp dir");
    // 1 MiB entries: 40 of them span three 16 MiB segments.
    let big = 1 << 20;
    let written = entries(1, 1, 41, big);
    {
        let wal = Wal::open(dir.path(), None).expect("open");
        for chunk in written.chunks(7) {
            wal.append(chunk.to_vec()).expect("append");
        }
        assert_eq!(wal.read(0, 100).expect("read"), written);
        assert!(wal.segment_count() >= 3, "{}", wal.segment_count());
    }
    let wal = Wal::open(dir.path(), None).expect("reopen");
    assert_eq!(wal.read(1, 41).expect("read"), written);
    assert_eq!(wal.read(10, 12).expect("read"), written[9..11].to_vec());
    assert_eq!(wal.last().expect("last"), Some(written[39].log_id));
    assert!(segments(dir.path()).len() >= 3);
    assert!(SEGMENT_BYTES < 40 * big as u64);
}

/// The first entries of `written` whose JSON adds up to at most `max_bytes` (at least one).
fn prefix_within(written: &[Entry], max_bytes: usize) -> Vec<Entry> {
    let mut total = 0;
    let mut out = Vec::new();
    for e in written {
        total += serde_json::to_vec(e).expect("encode").len();
        if !out.is_empty() && total > max_bytes {
            break;
        }
        out.push(e.clone());
    }
    out
}

#[test]
fn a_limited_read_stops_at_the_byte_limit_but_returns_at_least_one_entry() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut written = entries(1, 1, 21, 1_000);
    written[7] = entry(1, 8, 20_000);
    let check = |wal: &Wal| {
        let first = wal.read_limited(1, 21, 5_000).expect("read");
        assert_eq!(first, prefix_within(&written, 5_000));
        assert_eq!(
            first.len(),
            3,
            "three ~1.3 KB entries fit 5,000 bytes, a fourth does not"
        );
        // An entry larger than the limit comes alone.
        assert_eq!(
            wal.read_limited(8, 21, 5_000).expect("read"),
            written[7..8].to_vec()
        );
        assert_eq!(
            wal.read_limited(5, 21, 5_000).expect("read"),
            written[4..7].to_vec()
        );
        assert_eq!(wal.read_limited(1, 21, usize::MAX).expect("read"), written);
        assert!(wal.read_limited(21, 30, 5_000).expect("read").is_empty());
    };
    {
        let wal = Wal::open(dir.path(), None).expect("open");
        wal.append(written.clone()).expect("append");
        check(&wal);
    }
    // Read back from disk (nothing cached).
    check(&Wal::open(dir.path(), None).expect("reopen"));
}

#[test]
fn a_torn_tail_is_cut_and_the_log_goes_on() {
    let dir = tempfile::tempdir().expect("temp dir");
    let written = entries(1, 1, 11, 100);
    let tail_offset = {
        let wal = Wal::open(dir.path(), None).expect("open");
        wal.append(written.clone()).expect("append");
        // Where the next record would go: after the 10 records.
        let seg = &segments(dir.path())[0];
        let data = std::fs::read(seg).expect("read segment");
        data.iter().rposition(|b| *b != 0).expect("records") as u64 + 1
    };
    // A torn write: an 11th record of 2,000 bytes of which only the sectors up to the
    // next sector boundary reached the disk (the rest of its span stays zero).
    let seg = segments(dir.path())[0].clone();
    let file = OpenOptions::new().write(true).open(&seg).expect("open");
    let mut torn = Vec::new();
    torn.extend_from_slice(&2_000u32.to_le_bytes());
    torn.extend_from_slice(&0xdead_beef_u32.to_le_bytes());
    torn.extend_from_slice(&11u64.to_le_bytes());
    let boundary = (tail_offset + 16).div_ceil(512) * 512;
    torn.resize((boundary - tail_offset) as usize, b'x');
    file.write_all_at(&torn, tail_offset).expect("tear");
    file.sync_all().expect("sync");

    let wal = Wal::open(dir.path(), None).expect("a torn tail opens");
    assert_eq!(wal.read(0, 100).expect("read"), written);
    // The torn bytes are gone, and the log takes new entries where it ended.
    let data = std::fs::read(&seg).expect("read segment");
    assert!(
        data[tail_offset as usize..].iter().all(|b| *b == 0),
        "the torn tail is zeroed"
    );
    let more = entries(2, 11, 13, 100);
    wal.append(more.clone()).expect("append after the tear");
    drop(wal);
    let wal = Wal::open(dir.path(), None).expect("reopen");
    let mut all = written;
    all.extend(more);
    assert_eq!(wal.read(0, 100).expect("read"), all);
}

#[test]
fn bytes_after_a_zero_header_are_zeroed_on_open() {
    // A torn batch whose first page never reached the disk but a later one did: the log
    // ends at the zero header, and the later bytes must not survive to be read as
    // records once new entries are written over the start.
    let dir = tempfile::tempdir().expect("temp dir");
    let written = entries(1, 1, 4, 100);
    {
        let wal = Wal::open(dir.path(), None).expect("open");
        wal.append(written.clone()).expect("append");
    }
    let seg = segments(dir.path())[0].clone();
    let end = std::fs::read(&seg)
        .expect("read")
        .iter()
        .rposition(|b| *b != 0)
        .expect("records") as u64
        + 1;
    let file = OpenOptions::new().write(true).open(&seg).expect("open");
    file.write_all_at(b"stale bytes of a torn batch", end + 4_096)
        .expect("write");
    file.sync_all().expect("sync");
    let wal = Wal::open(dir.path(), None).expect("reopen");
    assert_eq!(wal.read(0, 10).expect("read"), written);
    let data = std::fs::read(&seg).expect("read");
    assert!(data[end as usize..].iter().all(|b| *b == 0));
}

#[test]
fn damage_in_an_older_segment_refuses_to_open() {
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let wal = Wal::open(dir.path(), None).expect("open");
        wal.append(entries(1, 1, 21, 1 << 20)).expect("append");
    }
    let first = segments(dir.path())[0].clone();
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&first)
        .expect("open");
    // Flip a byte inside the payload of the second record.
    let mut byte = [0u8; 1];
    let at = (1 << 20) + 5_000;
    file.read_exact_at(&mut byte, at).expect("read");
    byte[0] ^= 0xff;
    file.write_all_at(&byte, at).expect("write");
    file.sync_all().expect("sync");
    let err = match Wal::open(dir.path(), None) {
        Ok(_) => panic!("a damaged older segment must not open"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("corrupt") && err.contains("CRC"), "{err}");
}

#[test]
fn a_truncated_suffix_never_reappears() {
    let dir = tempfile::tempdir().expect("temp dir");
    let wal = Wal::open(dir.path(), None).expect("open");
    // Entries 1..=30 of term 1, spanning segments; then a new leader's shorter entries
    // replace 5..: none of the old records may read as valid after a reopen.
    wal.append(entries(1, 1, 31, 1 << 20)).expect("append");
    let segments_before = wal.segment_count();
    wal.truncate(5).expect("truncate");
    assert!(wal.segment_count() < segments_before);
    assert_eq!(wal.read(0, 100).expect("read"), entries(1, 1, 5, 1 << 20));
    let replacement = entries(2, 5, 8, 10);
    wal.append(replacement.clone()).expect("append");
    drop(wal);
    let wal = Wal::open(dir.path(), None).expect("reopen");
    let mut expected = entries(1, 1, 5, 1 << 20);
    expected.extend(replacement);
    assert_eq!(wal.read(0, 100).expect("read"), expected);
    assert_eq!(wal.last().expect("last"), Some(expected[6].log_id));
    // Truncating everything leaves an empty log that takes entries again.
    wal.truncate(1).expect("truncate all");
    assert_eq!(wal.last().expect("last"), None);
    wal.append(entries(3, 1, 3, 10)).expect("append");
    drop(wal);
    let wal = Wal::open(dir.path(), None).expect("reopen");
    assert_eq!(wal.read(0, 100).expect("read"), entries(3, 1, 3, 10));
}

#[test]
fn purge_deletes_old_segments_and_reopen_skips_purged_records() {
    let dir = tempfile::tempdir().expect("temp dir");
    let wal = Wal::open(dir.path(), None).expect("open");
    wal.append(entries(1, 1, 41, 1 << 20)).expect("append");
    let before = segments(dir.path()).len();
    wal.purge(35).expect("purge");
    assert!(segments(dir.path()).len() < before);
    assert_eq!(wal.read(0, 100).expect("read"), entries(1, 36, 41, 1 << 20));
    drop(wal);
    let wal = Wal::open(dir.path(), Some(35)).expect("reopen");
    assert_eq!(wal.read(0, 100).expect("read"), entries(1, 36, 41, 1 << 20));
    // Purging past the end (a snapshot installed ahead of the log) empties it; the next
    // entries start after the purge point.
    wal.purge(100).expect("purge all");
    assert_eq!(wal.last().expect("last"), None);
    wal.append(entries(2, 101, 103, 10)).expect("append");
    drop(wal);
    let wal = Wal::open(dir.path(), Some(100)).expect("reopen");
    assert_eq!(wal.read(0, 200).expect("read"), entries(2, 101, 103, 10));
}

#[test]
fn an_append_at_or_below_the_last_index_replaces_the_log_from_there() {
    let dir = tempfile::tempdir().expect("temp dir");
    let wal = Wal::open(dir.path(), None).expect("open");
    wal.append(entries(1, 1, 6, 10)).expect("append");
    wal.append(entries(2, 3, 4, 10)).expect("append over 3");
    let mut expected = entries(1, 1, 3, 10);
    expected.extend(entries(2, 3, 4, 10));
    assert_eq!(wal.read(0, 10).expect("read"), expected);
    drop(wal);
    let wal = Wal::open(dir.path(), None).expect("reopen");
    assert_eq!(wal.read(0, 10).expect("read"), expected);
    // Entries of one append must be consecutive.
    let mut broken = entries(2, 4, 6, 10);
    broken.swap(0, 1);
    assert!(wal.append(broken).is_err());
    assert_eq!(wal.read(0, 10).expect("read"), expected);
}

#[test]
fn an_unknown_file_in_the_log_directory_refuses_to_open() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("notes.txt"), b"x").expect("write");
    assert!(Wal::open(dir.path(), None).is_err());
}

#[tokio::test]
async fn a_log_written_by_the_sled_store_is_moved_into_the_wal() {
    let dir = tempfile::tempdir().expect("temp dir");
    let old = entries(1, 1, 6, 50);
    {
        // The layout before the WAL: entries as JSON in the sled tree `raft_logs`.
        let db = common::retry_locked(|| sled::open(dir.path())).expect("sled");
        let tree = db.open_tree("raft_logs").expect("tree");
        for e in &old {
            tree.insert(
                e.log_id.index.to_be_bytes(),
                serde_json::to_vec(e).expect("json"),
            )
            .expect("insert");
        }
        db.flush().expect("flush");
    }
    {
        let (mut log, _sm) = common::retry_locked(|| open(dir.path())).expect("open migrates");
        assert_eq!(log.try_get_log_entries(0..10).await.expect("read"), old);
        let state = log.get_log_state().await.expect("state");
        assert_eq!(state.last_log_id, Some(old[4].log_id));
        log.purge(old[1].log_id).await.expect("purge");
    }
    {
        let db = common::retry_locked(|| sled::open(dir.path())).expect("sled");
        let tree = db.open_tree("raft_logs").expect("tree");
        assert!(tree.is_empty(), "the sled copy is cleared after the move");
    }
    let (mut log, _sm) = common::retry_locked(|| open(dir.path())).expect("reopen");
    assert_eq!(
        log.try_get_log_entries(0..10).await.expect("read"),
        old[2..].to_vec()
    );
}

/// The store's append contract under openraft 0.10: entries are readable when `append`
/// returns; each flush is reported through its callback; a vote (like a truncation or a
/// purge) returns only after every flush submitted before it was reported; and what was
/// reported survives a reopen.
#[tokio::test]
async fn appends_are_readable_at_once_and_flushes_are_reported_before_a_later_vote() {
    use cumulus_raft_store::{TypeConfig, Vote};
    use futures::FutureExt;
    use openraft::async_runtime::oneshot::Oneshot;
    use openraft::storage::IOFlushed;
    use openraft::type_config::alias::OneshotOf;

    let dir = tempfile::tempdir().expect("temp dir");
    let all = entries(1, 1, 31, 100);
    {
        let (mut log, _sm) = open(dir.path()).expect("open");
        let mut flushed = Vec::new();
        for chunk in all.chunks(3) {
            let (tx, rx) = OneshotOf::<TypeConfig>::channel();
            log.append(chunk.to_vec(), IOFlushed::signal(tx))
                .await
                .expect("append");
            let last = chunk.last().expect("non-empty").log_id.index;
            assert_eq!(
                log.try_get_log_entries(last..last + 1)
                    .await
                    .expect("read")
                    .len(),
                1,
                "entry {last} is readable when append returns"
            );
            flushed.push(rx);
        }
        log.save_vote(&Vote::new(2u64, 1u64)).await.expect("vote");
        for (i, rx) in flushed.into_iter().enumerate() {
            match rx.now_or_never() {
                Some(Ok(Ok(()))) => {}
                Some(other) => panic!("append {i} reported {other:?}"),
                None => panic!("append {i} not reported flushed before the vote returned"),
            }
        }
    }
    let (mut log, _sm) = common::retry_locked(|| open(dir.path())).expect("reopen");
    assert_eq!(log.try_get_log_entries(0..100).await.expect("read"), all);
    assert_eq!(
        log.read_vote().await.expect("vote"),
        Some(Vote::new(2u64, 1u64))
    );
}

/// On a follower (the entries name another node as their leader) an append is flushed
/// and reported before `append` returns (the inline path); it survives a reopen. On the
/// proposing node itself the same appends go through the sync thread and are reported
/// by the next barrier at the latest.
#[tokio::test]
async fn a_followers_append_is_reported_flushed_when_append_returns() {
    use cumulus_raft_store::{TypeConfig, Vote};
    use futures::FutureExt;
    use openraft::async_runtime::oneshot::Oneshot;
    use openraft::storage::IOFlushed;
    use openraft::type_config::alias::OneshotOf;

    let dir = tempfile::tempdir().expect("temp dir");
    // `common::entry` names node 1 as the leader.
    let all = entries(1, 1, 21, 100);
    {
        let (mut log, _sm) = open(dir.path()).expect("open");
        log.set_local_node(2);
        for chunk in all[..10].chunks(2) {
            let (tx, rx) = OneshotOf::<TypeConfig>::channel();
            log.append(chunk.to_vec(), IOFlushed::signal(tx))
                .await
                .expect("append");
            match rx.now_or_never() {
                Some(Ok(Ok(()))) => {}
                other => panic!("a follower's append was not reported flushed: {other:?}"),
            }
        }
        log.set_local_node(1);
        let mut flushed = Vec::new();
        for chunk in all[10..].chunks(2) {
            let (tx, rx) = OneshotOf::<TypeConfig>::channel();
            log.append(chunk.to_vec(), IOFlushed::signal(tx))
                .await
                .expect("append");
            flushed.push(rx);
        }
        log.save_vote(&Vote::new(2u64, 1u64)).await.expect("vote");
        for (i, rx) in flushed.into_iter().enumerate() {
            assert!(
                matches!(rx.now_or_never(), Some(Ok(Ok(())))),
                "the leader's append {i} was not reported flushed before the vote returned"
            );
        }
    }
    let (mut log, _sm) = common::retry_locked(|| open(dir.path())).expect("reopen");
    assert_eq!(log.try_get_log_entries(0..100).await.expect("read"), all);
}

/// A committed log id past what this node has made durable (openraft 0.10 learns a
/// commit index before the entries' own flush) is saved capped at the durable end, so a
/// saved committed index always lies inside the log; one inside is saved as given.
#[tokio::test]
async fn a_committed_index_is_saved_capped_at_the_durable_log() {
    use cumulus_raft_store::Vote;
    let dir = tempfile::tempdir().expect("temp dir");
    let written = entries(1, 1, 6, 10);
    {
        let (mut log, _sm) = open(dir.path()).expect("open");
        log.append(written.clone(), openraft::storage::IOFlushed::noop())
            .await
            .expect("append");
        // A vote waits for every pending flush.
        log.save_vote(&Vote::new(1, 1)).await.expect("vote");
        // The leader's commit index, ahead of what this node's log holds.
        let ahead = entries(1, 9, 10, 10)[0].log_id;
        log.save_committed(Some(ahead)).await.expect("save");
        assert_eq!(
            log.read_committed().await.expect("read"),
            Some(written[4].log_id)
        );
        log.save_committed(Some(written[2].log_id))
            .await
            .expect("save");
    }
    let (mut log, _sm) = common::retry_locked(|| open(dir.path())).expect("reopen");
    assert_eq!(
        log.read_committed().await.expect("read"),
        Some(written[2].log_id)
    );
}

/// A saved committed index past the durable log can only come from lost entries (the
/// issue's two-node bit flip: saved committed 340, last log index 169): the store refuses
/// to open, names the data dir and the indexes, and says how to recover.
#[tokio::test]
async fn a_saved_committed_index_past_the_log_refuses_to_open() {
    let dir = tempfile::tempdir().expect("temp dir");
    let written = entries(1, 1, 6, 10);
    {
        let (mut log, _sm) = open(dir.path()).expect("open");
        log.append(written.clone(), openraft::storage::IOFlushed::noop())
            .await
            .expect("append");
    }
    {
        let db = common::retry_locked(|| sled::open(dir.path())).expect("sled");
        let meta = db.open_tree("raft_meta").expect("tree");
        let ahead = entries(1, 9, 10, 10)[0].log_id;
        meta.insert("committed", serde_json::to_vec(&Some(ahead)).expect("json"))
            .expect("insert");
        db.flush().expect("flush");
    }
    let err = match common::retry_locked(|| open(dir.path())) {
        Ok(_) => panic!("a committed index past the log must not open"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("committed index 9") && err.contains("last index 5"),
        "{err}"
    );
    assert!(err.contains("--rejoin-empty"), "{err}");
}

/// The segment's bytes, and where its records end.
fn segment_bytes(seg: &Path) -> (Vec<u8>, usize) {
    let data = std::fs::read(seg).expect("read segment");
    let end = data.iter().rposition(|b| *b != 0).expect("records") + 1;
    (data, end)
}

/// One flipped bit inside an acknowledged record of the newest segment is corruption,
/// not a torn write: the log refuses to open, names the file and offset, and leaves every
/// byte as it was (the probe: before, the node cut the log there and carried on).
#[test]
fn a_flipped_bit_in_the_newest_segment_refuses_to_open_and_changes_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let written = entries(1, 1, 41, 300);
    {
        let wal = Wal::open(dir.path(), None).expect("open");
        wal.append(written[..20].to_vec()).expect("append");
        wal.append(written[20..].to_vec()).expect("append");
    }
    let seg = segments(dir.path())[0].clone();
    let (before, end) = segment_bytes(&seg);
    // A bit in the middle of the records, then one in the last record.
    for at in [end / 2, end - 20] {
        let file = OpenOptions::new().write(true).open(&seg).expect("open");
        file.write_all_at(&[before[at] ^ 0x10], at as u64)
            .expect("flip");
        file.sync_all().expect("sync");
        let err = match Wal::open(dir.path(), None) {
            Ok(_) => panic!("a flipped bit at {at} must not open"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains("corrupt") && err.contains(&seg.display().to_string()),
            "{err}"
        );
        assert!(
            err.contains("offset") && err.contains("--rejoin-empty"),
            "{err}"
        );
        let mut flipped = before.clone();
        flipped[at] ^= 0x10;
        assert!(
            std::fs::read(&seg).expect("read") == flipped,
            "nothing on disk changes when the log refuses to open"
        );
        file.write_all_at(&[before[at]], at as u64)
            .expect("restore");
        file.sync_all().expect("sync");
    }
    let wal = Wal::open(dir.path(), None).expect("the repaired log opens");
    assert_eq!(wal.read(0, 100).expect("read"), written);
}

/// Offsets of the records' headers in `bytes`, whose records end at `end`.
fn record_offsets(bytes: &[u8], end: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < end {
        out.push(at);
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
        at += 16 + len;
    }
    out
}

/// A flipped bit in the length of the last record makes its span cover the zeros after
/// it, as a torn write would; but its zeros start where the record really ends, not at a
/// sector boundary: damage, refused (before, this cut an acknowledged entry).
#[test]
fn a_flipped_length_of_the_last_record_refuses_to_open() {
    let dir = tempfile::tempdir().expect("temp dir");
    let written = entries(1, 1, 11, 300);
    {
        let wal = Wal::open(dir.path(), None).expect("open");
        wal.append(written.clone()).expect("append");
    }
    let seg = segments(dir.path())[0].clone();
    let (bytes, end) = segment_bytes(&seg);
    let last = *record_offsets(&bytes, end).last().expect("records");
    for bit in [9u32, 12, 16] {
        let mut len = u32::from_le_bytes(bytes[last..last + 4].try_into().expect("4 bytes"));
        len ^= 1 << bit;
        let file = OpenOptions::new().write(true).open(&seg).expect("open");
        file.write_all_at(&len.to_le_bytes(), last as u64)
            .expect("flip");
        let err = match Wal::open(dir.path(), None) {
            Ok(_) => panic!("a flipped length (bit {bit}) must not open"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("corrupt"), "{err}");
        file.write_all_at(&bytes[last..last + 4], last as u64)
            .expect("restore");
    }
    let wal = Wal::open(dir.path(), None).expect("the restored log opens");
    assert_eq!(wal.read(0, 100).expect("read"), written);
}

/// A zeroed sector in the middle of acknowledged records (a lost or misdirected write)
/// is damage: zeros inside a record's written part, and valid records after it.
#[test]
fn a_zeroed_sector_followed_by_valid_records_refuses_to_open() {
    let dir = tempfile::tempdir().expect("temp dir");
    // ~2.3 KB records: each spans at least four whole sectors.
    let written = entries(1, 1, 11, 2_000);
    {
        let wal = Wal::open(dir.path(), None).expect("open");
        wal.append(written.clone()).expect("append");
    }
    let seg = segments(dir.path())[0].clone();
    let (_, end) = segment_bytes(&seg);
    // Zero a whole sector in the middle of the records (a lost or misdirected write).
    let sector = (end as u64 / 2) / 512 * 512;
    let file = OpenOptions::new().write(true).open(&seg).expect("open");
    file.write_all_at(&[0u8; 512], sector).expect("zero");
    file.sync_all().expect("sync");
    let err = match Wal::open(dir.path(), None) {
        Ok(_) => panic!("a zeroed sector before valid records must not open"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("corrupt"), "{err}");
}

/// The bad record has the exact shape of a torn write (written up to a sector boundary,
/// zeros after), but a valid record with a later index follows it: later records are
/// written only after earlier ones were, so it was acknowledged. Refuse.
#[test]
fn a_torn_looking_record_followed_by_a_valid_one_refuses_to_open() {
    let dir = tempfile::tempdir().expect("temp dir");
    let written = entries(1, 1, 11, 2_000);
    {
        let wal = Wal::open(dir.path(), None).expect("open");
        wal.append(written.clone()).expect("append");
    }
    let seg = segments(dir.path())[0].clone();
    let (bytes, end) = segment_bytes(&seg);
    // Record 5 (index 5): zero its payload from the first sector boundary inside it.
    let at = record_offsets(&bytes, end)[4];
    let len = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
    let from = (at + 16 + 1).div_ceil(512) * 512;
    let to = at + 16 + len;
    assert!(from < to, "the record spans a sector boundary");
    let file = OpenOptions::new().write(true).open(&seg).expect("open");
    file.write_all_at(&vec![0u8; to - from], from as u64)
        .expect("zero");
    let err = match Wal::open(dir.path(), None) {
        Ok(_) => panic!("a torn-looking record before valid ones must not open"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("a valid record (index 6)"), "{err}");
}

/// A store's data dir holding entries 1..=10 (~2.3 KB each) whose record 10 has the
/// exact shape of a torn write (its payload zero from the first sector boundary inside
/// it), and a saved committed log id of index `committed`. Returns the dir, the segment,
/// its bytes and the torn record's offset.
async fn torn_store(committed: u64) -> (tempfile::TempDir, PathBuf, Vec<u8>, usize) {
    let dir = tempfile::tempdir().expect("temp dir");
    let written = entries(1, 1, 11, 2_000);
    {
        let (mut log, _sm) = open(dir.path()).expect("open");
        log.append(written.clone(), openraft::storage::IOFlushed::noop())
            .await
            .expect("append");
    }
    {
        let db = common::retry_locked(|| sled::open(dir.path())).expect("sled");
        let meta = db.open_tree("raft_meta").expect("tree");
        let id = written[committed as usize - 1].log_id;
        meta.insert("committed", serde_json::to_vec(&Some(id)).expect("json"))
            .expect("insert");
        db.flush().expect("flush");
    }
    let seg = segments(&dir.path().join("wal"))[0].clone();
    let (bytes, end) = segment_bytes(&seg);
    let at = *record_offsets(&bytes, end).last().expect("records");
    let len = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
    let from = (at + 16 + 1).div_ceil(512) * 512;
    let to = at + 16 + len;
    assert!(from < to, "the record spans a sector boundary");
    let file = OpenOptions::new().write(true).open(&seg).expect("open");
    file.write_all_at(&vec![0u8; to - from], from as u64)
        .expect("tear");
    file.sync_all().expect("sync");
    let torn = std::fs::read(&seg).expect("read");
    (dir, seg, torn, at)
}

/// The probe: record 79 torn, saved committed index 83. A torn-looking tail that
/// holds a committed entry was acknowledged: the store refuses before it repairs
/// anything, naming the segment, the offset and the committed index, and every byte of
/// the segment stays as it was (before, the tail was zeroed first and the refusal came
/// after, destroying the evidence).
#[tokio::test]
async fn a_torn_tail_holding_a_committed_entry_refuses_and_changes_nothing() {
    let (dir, seg, torn, at) = torn_store(10).await;
    let err = match common::retry_locked(|| open(dir.path())) {
        Ok(_) => panic!("a torn tail holding committed entry 10 must not open"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(&seg.display().to_string())
            && err.contains(&format!("offset {at}"))
            && err.contains("committed index 10 lies in it")
            && err.contains("nothing on disk was changed"),
        "{err}"
    );
    assert!(err.contains("--rejoin-empty"), "{err}");
    assert!(
        std::fs::read(&seg).expect("read") == torn,
        "the segment's bytes are untouched"
    );
}

/// A torn tail past the saved committed index (record 10 torn, committed 9) held no
/// committed entry: it is still cut and zeroed, and the store opens with entries 1..=9.
#[tokio::test]
async fn a_torn_tail_past_the_committed_index_is_still_cut() {
    let (dir, seg, _torn, at) = torn_store(9).await;
    let (mut log, _sm) = common::retry_locked(|| open(dir.path())).expect("opens");
    let state = log.get_log_state().await.expect("log state");
    assert_eq!(state.last_log_id.map(|l| l.index), Some(9));
    assert_eq!(log.try_get_log_entries(1..11).await.expect("read").len(), 9);
    let data = std::fs::read(&seg).expect("read");
    assert!(
        data[at..].iter().all(|b| *b == 0),
        "the torn tail is zeroed"
    );
}
