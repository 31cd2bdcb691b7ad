//! Writes the generated contract files: `python/src/cumulus/_contract.py` and
//! `api/contract.json` (see `cumulus_api::contract`). Run from anywhere:
//! `cargo run -p cumulus-api --bin cumulus-contract`.

#[cfg(feature = "grpc")]
fn main() -> std::io::Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the api crate lives in the repository root");
    for (rel, text) in cumulus_api::contract::files() {
        let path = root.join(rel);
        let unchanged = std::fs::read_to_string(&path).is_ok_and(|old| old == text);
        if !unchanged {
            std::fs::write(&path, text)?;
        }
        println!("{} {rel}", if unchanged { "unchanged" } else { "wrote" });
    }
    Ok(())
}

#[cfg(not(feature = "grpc"))]
fn main() {
    eprintln!("cumulus-contract needs the crate's `grpc` feature (on by default)");
    std::process::exit(2);
}
