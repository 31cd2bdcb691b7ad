//! Generates the tonic/prost code from `proto/cumulus.proto` with the vendored protoc,
//! so no system protoc is needed. Without the `grpc` feature nothing is generated.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/cumulus.proto");
    if std::env::var_os("CARGO_FEATURE_GRPC").is_none() {
        return Ok(());
    }
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; nothing else reads the environment concurrently.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("PROTOC", protoc);
    }
    tonic_prost_build::configure()
        // Messages double as the JSON bodies of the REST mirror.
        .type_attribute(".", "#[derive(serde::Serialize, serde::Deserialize)]")
        .type_attribute(".", "#[serde(default)]")
        // JSON has no NaN or infinities; metrics carry them as strings (`metric_json`).
        .field_attribute(
            ".cumulus.v1.RankStatus.metrics",
            "#[serde(with = \"crate::metric_json\")]",
        )
        .field_attribute(
            ".cumulus.v1.JobSummary.metrics",
            "#[serde(with = \"crate::metric_json\")]",
        )
        .field_attribute(
            ".cumulus.v1.ProgressSample.metrics",
            "#[serde(with = \"crate::metric_json\")]",
        )
        .field_attribute(
            ".cumulus.v1.ObservedRank.metrics",
            "#[serde(with = \"crate::metric_json\")]",
        )
        .compile_protos(&["proto/cumulus.proto"], &["proto"])?;
    Ok(())
}
