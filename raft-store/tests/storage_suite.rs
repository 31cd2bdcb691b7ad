//! openraft's storage conformance suite (`openraft::testing::log::Suite`) run against our
//! log store (write-ahead log + sled) and state machine, each test on a fresh directory.

use cumulus_raft_store::{LogStore, StateMachineStore, TypeConfig, open};
use openraft::testing::log::{StoreBuilder, Suite};
use openraft::{ErrorSubject, ErrorVerb, StorageError};
use tempfile::TempDir;

struct StoreDirBuilder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, TempDir> for StoreDirBuilder {
    async fn build(
        &self,
    ) -> Result<(TempDir, LogStore, StateMachineStore), StorageError<TypeConfig>> {
        let err = |e: &dyn std::error::Error| {
            StorageError::from_io_error(
                ErrorSubject::Store,
                ErrorVerb::Write,
                std::io::Error::other(e.to_string()),
            )
        };
        let dir = tempfile::tempdir().map_err(|e| err(&e))?;
        let (log, sm) = open(dir.path()).map_err(|e| err(&e))?;
        Ok((dir, log, sm))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openraft_storage_suite_passes_on_our_store() {
    if let Err(e) = Suite::test_all(StoreDirBuilder).await {
        panic!("openraft storage suite failed: {e}");
    }
}
