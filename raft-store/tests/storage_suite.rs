//! openraft's storage conformance suite (`openraft::testing::Suite`) run against our
//! sled log store and state machine, each test on a fresh sled database in a temp dir.

use cumulus_raft_store::{LogStore, NodeId, StateMachineStore, TypeConfig, open};
use openraft::testing::{StoreBuilder, Suite};
use openraft::{AnyError, ErrorSubject, ErrorVerb, StorageError, StorageIOError};
use tempfile::TempDir;

struct SledBuilder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, TempDir> for SledBuilder {
    async fn build(&self) -> Result<(TempDir, LogStore, StateMachineStore), StorageError<NodeId>> {
        let err = |e: &dyn std::error::Error| {
            StorageError::from(StorageIOError::new(
                ErrorSubject::Store,
                ErrorVerb::Write,
                AnyError::error(e.to_string()),
            ))
        };
        let dir = tempfile::tempdir().map_err(|e| err(&e))?;
        let (log, sm) = open(dir.path()).map_err(|e| err(&e))?;
        Ok((dir, log, sm))
    }
}

#[test]
fn openraft_storage_suite_passes_on_sled_store() {
    if let Err(e) = Suite::test_all(SledBuilder) {
        panic!("openraft storage suite failed: {e}");
    }
}
