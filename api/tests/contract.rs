//! The generated contract files are checked in; this fails while one is stale, naming the
//! command that regenerates them.

#![cfg(feature = "grpc")]

use cumulus_api::contract::{REGENERATE, files};

#[test]
fn the_checked_in_contract_files_are_what_the_generator_writes() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repository root");
    let stale: Vec<&str> = files()
        .into_iter()
        .filter(|(rel, text)| std::fs::read_to_string(root.join(rel)).ok().as_ref() != Some(text))
        .map(|(rel, _)| rel)
        .collect();
    assert!(
        stale.is_empty(),
        "the generated contract is stale or missing: {}\nregenerate with: {REGENERATE}",
        stale.join(", ")
    );
}
