use super::*;

fn log_id(index: u64) -> LogId {
    LogId::new(
        crate::LeaderId {
            term: 1,
            node_id: 1,
        },
        index,
    )
}

fn in_sled(tree: &sled::Tree) -> Option<LogId> {
    let bytes = tree.get(KEY_COMMITTED).expect("get").expect("saved");
    decode_meta::<Option<LogId>>(META_TREE, KEY_COMMITTED, &bytes)
        .expect("a format-2 record")
        .value
}

/// Saves within [`SAVE_COMMITTED_INTERVAL`] of the last write stay in memory; the
/// first one past it writes the newest value, and dropping the saver writes the one
/// still pending.
#[test]
fn the_committed_log_id_is_written_at_most_once_per_interval_and_on_close() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = sled::Config::new().path(dir.path()).open().expect("sled");
    let tree = db.open_tree(META_TREE).expect("tree");
    let t0 = Instant::now();
    let mut saver = CommittedSaver {
        meta: tree.clone(),
        last_write: None,
        pending: None,
    };
    saver.save(Some(log_id(1)), t0).expect("save");
    assert_eq!(in_sled(&tree), Some(log_id(1)), "the first save is written");
    saver
        .save(Some(log_id(2)), t0 + Duration::from_millis(10))
        .expect("save");
    saver
        .save(Some(log_id(3)), t0 + Duration::from_millis(20))
        .expect("save");
    assert_eq!(in_sled(&tree), Some(log_id(1)), "inside the interval");
    assert_eq!(saver.pending, Some(Some(log_id(3))));
    saver
        .save(Some(log_id(4)), t0 + SAVE_COMMITTED_INTERVAL)
        .expect("save");
    assert_eq!(in_sled(&tree), Some(log_id(4)), "past the interval");
    assert_eq!(saver.pending, None);
    saver
        .save(
            Some(log_id(5)),
            t0 + SAVE_COMMITTED_INTERVAL + Duration::from_millis(1),
        )
        .expect("save");
    drop(saver);
    assert_eq!(in_sled(&tree), Some(log_id(5)), "written on close");
}
