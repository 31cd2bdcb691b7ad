//! Opening a node's storage ([`open`]): every check before any write, then the repairs
//! and migrations the checks allow. A child of `store`, so it builds the stores' private
//! parts directly.

use super::*;

/// Opens (creating if needed) the sled database under `dir` and the write-ahead log in
/// `dir/wal`, and returns the log store and the state machine store of one node. Log
/// entries of a data dir from before the write-ahead log are moved into it.
///
/// Checks come before any write: every record in sled is read and verified (its
/// checksum, then that sled holds the newest generation written, [`crate::record`]),
/// the write-ahead log is scanned, and a torn tail is cut only when the saved committed
/// index lies before it. A refusal writes nothing of Cumulus's (sled's own recovery, run
/// by `sled::open`, may rewrite sled's files). Then format-1 records (earlier versions)
/// are rewritten in format 2.
///
/// # Errors
/// [`OpenError`] when sled or the write-ahead log fails, a stored record is corrupt
/// ([`OpenError::CorruptRecord`] names the tree and the key), sled lost flushed writes
/// ([`OpenError::LostWrites`]), or a committed entry is missing or lies in a torn tail.
pub fn open(dir: &Path) -> Result<(LogStore, StateMachineStore), OpenError> {
    let errs = OpenErrors {
        path: dir.display().to_string(),
    };
    let db = sled::Config::new()
        .path(dir)
        .open()
        .map_err(|e| errs.sled(e))?;
    let legacy_logs = db.open_tree(LEGACY_LOGS_TREE).map_err(|e| errs.sled(e))?;
    let meta = db.open_tree(META_TREE).map_err(|e| errs.sled(e))?;
    let snap_tree = db.open_tree(SNAPSHOT_TREE).map_err(|e| errs.sled(e))?;

    // 1. Every record in sled, verified; nothing is written before all checks pass.
    let (generation_file, recorded_generation) =
        GenerationFile::open(dir).map_err(|e| match e {
            Ok(io) => OpenError::Generation(io),
            Err(reason) => errs.corrupt(GENERATION_FILE, reason),
        })?;
    let records = MetaRecords::read(&meta, &errs)?;
    let found_generation = records.check_generation(recorded_generation, &errs)?;
    let data = restore_state(&snap_tree, &errs)?;

    // 2. The write-ahead log: scanned without writing, then a torn tail is cut only if
    // the saved committed index (a lower bound of what is committed) lies before it.
    let wal = open_wal(dir, &db, &legacy_logs, &records, &errs)?;

    // 3. Format-1 records of an earlier version are rewritten in format 2, once.
    let generation = records.rewrite_legacy(
        &db,
        &meta,
        &generation_file,
        found_generation.max(recorded_generation),
        &errs,
    )?;

    let (changes, _) = watch::channel(0);
    let snapshot_bytes = snap_tree
        .get(KEY_SNAPSHOT)
        .ok()
        .flatten()
        .map_or(0, |v| v.len() as u64);
    let shared = Arc::new(SharedState {
        data: RwLock::new(data),
        changes,
        snapshot_bytes: snapshot_bytes.into(),
    });
    let flusher = Flusher::start().map_err(OpenError::Flusher)?;
    flusher.set_durable_end(
        wal.last()
            .map_err(OpenError::Wal)?
            .map_or(0, |l| l.index + 1),
    );
    let committed_tree = meta.clone();
    Ok((
        LogStore {
            db: db.clone(),
            meta,
            wal,
            vote: Arc::new(Mutex::new(records.vote.map(|r| r.value))),
            committed: Arc::new(Mutex::new(CommittedSaver {
                meta: committed_tree,
                last_write: None,
                pending: None,
            })),
            generation: Arc::new(Generations {
                file: generation_file,
                next: AtomicU64::new(generation + 1),
            }),
            flusher,
            local_node: None,
        },
        StateMachineStore {
            db,
            snap_tree,
            shared,
        },
    ))
}

/// The errors [`open`] refuses with, each naming the data directory.
struct OpenErrors {
    /// The data directory, as shown to users.
    path: String,
}

impl OpenErrors {
    /// A sled error: [`OpenError::SledCorrupt`] for damage sled found in its own files,
    /// [`OpenError::Sled`] otherwise.
    fn sled(&self, source: sled::Error) -> OpenError {
        match source {
            sled::Error::Corruption { .. } => OpenError::SledCorrupt {
                path: self.path.clone(),
                source,
            },
            source => OpenError::Sled {
                path: self.path.clone(),
                source,
            },
        }
    }

    /// [`OpenError::Corrupt`]: the record `what` does not parse or is inconsistent.
    fn corrupt(&self, what: &str, reason: String) -> OpenError {
        OpenError::Corrupt {
            path: self.path.clone(),
            what: what.into(),
            reason,
        }
    }

    /// [`OpenError::CorruptRecord`]: the record at `key` of sled tree `tree` fails its
    /// checksum, does not parse or cannot be rewritten.
    fn bad_record(&self, tree: &str, key: &[u8], reason: String) -> OpenError {
        OpenError::CorruptRecord {
            path: self.path.clone(),
            tree: tree.into(),
            key: String::from_utf8_lossy(key).into_owned(),
            reason,
        }
    }
}

/// The records of tree `raft_meta` as read on open, each verified ([`decode_meta`]);
/// `None` where the key holds nothing.
struct MetaRecords {
    /// The vote (a flushed record: it carries a generation).
    vote: Option<MetaRecord<Vote>>,
    /// The purge point (a flushed record: it carries a generation).
    last_purged: Option<MetaRecord<LogId>>,
    /// The committed log id (not flushed: generation 0).
    committed: Option<MetaRecord<Option<LogId>>>,
}

impl MetaRecords {
    /// Reads and verifies the vote, the purge point and the committed log id, in that
    /// order, from `meta` (tree `raft_meta`). Writes nothing.
    ///
    /// # Errors
    /// [`OpenError::Sled`] or [`OpenError::SledCorrupt`] when sled cannot read a key,
    /// [`OpenError::CorruptRecord`] (naming the tree and the key) when a record fails its
    /// checksum or does not parse.
    fn read(meta: &sled::Tree, errs: &OpenErrors) -> Result<MetaRecords, OpenError> {
        let read = |key: &[u8]| -> Result<Option<sled::IVec>, OpenError> {
            meta.get(key).map_err(|e| errs.sled(e))
        };
        let vote: Option<MetaRecord<Vote>> = read(KEY_VOTE)?
            .map(|v| decode_meta(META_TREE, KEY_VOTE, &v))
            .transpose()
            .map_err(|e| errs.bad_record(META_TREE, KEY_VOTE, e.to_string()))?;
        let last_purged: Option<MetaRecord<LogId>> = read(KEY_LAST_PURGED)?
            .map(|v| decode_meta(META_TREE, KEY_LAST_PURGED, &v))
            .transpose()
            .map_err(|e| errs.bad_record(META_TREE, KEY_LAST_PURGED, e.to_string()))?;
        let committed: Option<MetaRecord<Option<LogId>>> = read(KEY_COMMITTED)?
            .map(|v| decode_meta(META_TREE, KEY_COMMITTED, &v))
            .transpose()
            .map_err(|e| errs.bad_record(META_TREE, KEY_COMMITTED, e.to_string()))?;
        Ok(MetaRecords {
            vote,
            last_purged,
            committed,
        })
    }

    /// The purge point's log id, if one is saved.
    fn purged_id(&self) -> Option<LogId> {
        self.last_purged.as_ref().map(|r| r.value)
    }

    /// The saved committed log id, if any.
    fn committed_id(&self) -> Option<LogId> {
        self.committed.as_ref().and_then(|r| r.value)
    }

    /// Checks that sled still holds the newest flushed generation: the newest of the
    /// vote's and the purge point's generations must be at least `recorded_generation`
    /// (the generation file's). Returns that newest generation (0 when neither has one).
    ///
    /// # Errors
    /// [`OpenError::LostWrites`] when sled holds only older generations: its recovery
    /// stopped at a damaged message and dropped every later write.
    fn check_generation(
        &self,
        recorded_generation: u64,
        errs: &OpenErrors,
    ) -> Result<u64, OpenError> {
        // sled stops its recovery at a damaged message and drops every later write: a
        // flushed record older than the generation file's means writes were lost.
        let newest = [
            (KEY_VOTE, self.vote.as_ref().and_then(|r| r.generation)),
            (
                KEY_LAST_PURGED,
                self.last_purged.as_ref().and_then(|r| r.generation),
            ),
        ]
        .into_iter()
        .filter_map(|(key, generation)| generation.map(|g| (key, g)))
        .max_by_key(|(_, g)| *g);
        let found_generation = newest.map_or(0, |(_, g)| g);
        if found_generation < recorded_generation {
            return Err(OpenError::LostWrites {
                path: errs.path.clone(),
                newest: newest.map_or_else(
                    || {
                        format!(
                            "tree `{META_TREE}`: neither key `vote` nor key `last_purged` holds one"
                        )
                    },
                    |(key, _)| {
                        format!("tree `{META_TREE}`, key `{}`", String::from_utf8_lossy(key))
                    },
                ),
                found: found_generation,
                recorded: recorded_generation,
            });
        }
        Ok(found_generation)
    }

    /// Rewrites the records of an earlier version (format 1, no generation) in format 2,
    /// once, after every check has passed: the vote and the purge point with the next
    /// generation after `generation` (the newest found or recorded), the committed log id
    /// with generation 0; then flushes sled and writes the new generation to
    /// `generation_file`. Returns the generation now newest (`generation` when nothing was
    /// rewritten).
    ///
    /// # Errors
    /// [`OpenError::CorruptRecord`] when a record cannot be encoded or inserted,
    /// [`OpenError::Sled`] or [`OpenError::SledCorrupt`] when the flush fails,
    /// [`OpenError::Generation`] when the generation file cannot be written.
    fn rewrite_legacy(
        &self,
        db: &sled::Db,
        meta: &sled::Tree,
        generation_file: &GenerationFile,
        mut generation: u64,
        errs: &OpenErrors,
    ) -> Result<u64, OpenError> {
        let purged_id = self.purged_id();
        let committed_id = self.committed_id();
        let legacy: Vec<&[u8]> = [
            (KEY_VOTE, self.vote.as_ref().map(|r| r.generation)),
            (
                KEY_LAST_PURGED,
                self.last_purged.as_ref().map(|r| r.generation),
            ),
            (KEY_COMMITTED, self.committed.as_ref().map(|r| r.generation)),
        ]
        .into_iter()
        .filter(|(_, g)| matches!(g, Some(None)))
        .map(|(key, _)| key)
        .collect();
        if !legacy.is_empty() {
            generation += 1;
            let rewrite = |key: &[u8]| -> Result<(), String> {
                let bytes = match key {
                    KEY_VOTE => encode_meta(
                        META_TREE,
                        key,
                        generation,
                        &self.vote.as_ref().map(|r| r.value),
                    ),
                    KEY_LAST_PURGED => encode_meta(META_TREE, key, generation, &purged_id),
                    _ => encode_meta(META_TREE, key, 0, &committed_id),
                }
                .map_err(|e| e.to_string())?;
                meta.insert(key, bytes).map_err(|e| e.to_string())?;
                Ok(())
            };
            for key in &legacy {
                rewrite(key).map_err(|reason| {
                    errs.bad_record(META_TREE, key, format!("cannot rewrite it: {reason}"))
                })?;
            }
            db.flush().map_err(|e| errs.sled(e))?;
            generation_file
                .write(generation)
                .map_err(OpenError::Generation)?;
            tracing::info!(
                keys = ?legacy.iter().map(|k| String::from_utf8_lossy(k)).collect::<Vec<_>>(),
                generation,
                "rewrote the raft metadata of an earlier version with checksums"
            );
        }
        Ok(generation)
    }
}

/// The applied state to start from: the newest snapshot's (tree `snapshot`, key
/// `current`, verified and decoded), or the empty state when there is none. The state
/// lives in memory; openraft re-applies the committed entries after it from the log.
///
/// # Errors
/// [`OpenError::Sled`] or [`OpenError::SledCorrupt`] when sled cannot read it,
/// [`OpenError::CorruptRecord`] when the snapshot record fails its CRC or its state does
/// not decode.
fn restore_state(snap_tree: &sled::Tree, errs: &OpenErrors) -> Result<SmData, OpenError> {
    let snapshot = match snap_tree.get(KEY_SNAPSHOT).map_err(|e| errs.sled(e))? {
        Some(v) => Some(
            StoredSnapshot::decode(&v)
                .map_err(|e| errs.bad_record(SNAPSHOT_TREE, KEY_SNAPSHOT, e.to_string()))?,
        ),
        None => None,
    };
    // The applied state lives in memory: it starts from the newest snapshot, and openraft
    // re-applies the committed entries after it from the log on start.
    let data = match &snapshot {
        Some(snap) => {
            let restored: SnapshotPayload = crate::codec::decode(&snap.data).map_err(|e| {
                errs.bad_record(
                    SNAPSHOT_TREE,
                    KEY_SNAPSHOT,
                    format!("its state does not decode: {e}"),
                )
            })?;
            SmData {
                last_applied: snap.meta.last_log_id,
                last_membership: snap.meta.last_membership.clone(),
                state: restored.state,
            }
        }
        None => SmData::default(),
    };
    Ok(data)
}

/// Opens the write-ahead log in `dir/wal`: scans it without writing ([`Wal::scan`]), then
/// repairs it ([`crate::wal::ScannedWal::repair`]: a torn tail is cut only when the saved
/// committed index in `records` lies before it), moves the entries of a pre-WAL data dir
/// (sled tree `legacy_logs`) into it, and checks that the saved committed index lies
/// inside the durable log.
///
/// # Errors
/// [`OpenError::Wal`] when the log is damaged (anything but a torn tail past the saved
/// committed index) or cannot be read or repaired; [`OpenError::Corrupt`] when the
/// legacy log's migration fails or the saved committed index lies past the durable log
/// (acknowledged entries are missing).
fn open_wal(
    dir: &Path,
    db: &sled::Db,
    legacy_logs: &sled::Tree,
    records: &MetaRecords,
    errs: &OpenErrors,
) -> Result<Wal, OpenError> {
    let purged_id = records.purged_id();
    let committed_id = records.committed_id();
    let scanned = Wal::scan(&dir.join(WAL_DIR), purged_id.map(|l| l.index))?;
    // A log with no valid record while the sled tree of an earlier version still holds
    // entries is a migration cut short: its entries are in that tree, not in the tail.
    let migrating = scanned.last_index().is_none() && !legacy_logs.is_empty();
    let wal = scanned.repair(committed_id.map(|c| c.index).filter(|_| !migrating))?;
    migrate_legacy_log(db, legacy_logs, &wal, purged_id.map(|l| l.index))
        .map_err(|(what, reason)| errs.corrupt(&what, reason))?;
    // Every entry on disk now is durable (the repair synced the newest segment). The
    // committed index is saved only inside the durable log (`save_committed`), so one
    // past it means acknowledged entries were lost: refuse, never serve a cut log.
    let last_log = wal.last().map_err(OpenError::Wal)?.or(purged_id);
    if let Some(committed) = committed_id
        && last_log.is_none_or(|last| last.index < committed.index)
    {
        return Err(errs.corrupt(
            "committed index",
            format!(
                "the saved committed index {} lies past the durable raft log (last index {}): \
                 acknowledged entries are missing. {}",
                committed.index,
                last_log.map_or_else(|| "none".to_string(), |l| l.index.to_string()),
                crate::wal::RECOVERY_HINT
            ),
        ));
    }
    Ok(wal)
}

/// Moves the entries of a data dir written before the write-ahead log (sled tree
/// `raft_logs`, key: big-endian index, value: JSON entry) into the WAL, then clears the
/// tree. Every entry is validated first. A crash between the two steps leaves the WAL
/// holding the entries, and the next open only clears the tree.
fn migrate_legacy_log(
    db: &sled::Db,
    legacy: &sled::Tree,
    wal: &Wal,
    last_purged: Option<u64>,
) -> Result<(), LoadError> {
    if legacy.is_empty() {
        return Ok(());
    }
    let mut entries = Vec::new();
    for item in legacy.iter() {
        let (k, v) = item.map_err(|e| ("raft log".to_string(), e.to_string()))?;
        let key: [u8; 8] = k.as_ref().try_into().map_err(|_| {
            (
                "raft log key".to_string(),
                format!("key of {} bytes", k.len()),
            )
        })?;
        let entry: Entry = serde_json::from_slice(&v)
            .map_err(|e| ("raft log entry".to_string(), e.to_string()))?;
        if entry.log_id.index != u64::from_be_bytes(key) {
            return Err((
                "raft log entry".into(),
                "index does not match its key".into(),
            ));
        }
        if last_purged.is_none_or(|p| entry.log_id.index > p) {
            entries.push(entry);
        }
    }
    let wal_empty = wal
        .last()
        .map_err(|e| ("raft log".to_string(), e.to_string()))?
        .is_none();
    if wal_empty && !entries.is_empty() {
        let count = entries.len();
        wal.append(entries)
            .map_err(|e| ("raft log migration".to_string(), e.to_string()))?;
        tracing::info!(
            count,
            "moved the raft log from sled into the write-ahead log"
        );
    }
    legacy
        .clear()
        .and_then(|()| db.flush().map(|_| ()))
        .map_err(|e| ("raft log migration".to_string(), e.to_string()))
}
