//! [`S3Args`]: the command-line flags of the S3 settings, shared by `cumulus-coordinator`
//! and `cumulus-worker` (feature `clap`; a library user builds [`S3Settings`] directly).

use super::*;

/// Command-line flags of the S3 settings, shared by `cumulus-coordinator` and
/// `cumulus-worker` (flatten into a clap parser). Every flag also reads an environment
/// variable.
#[derive(Clone, Debug, clap::Args)]
pub struct S3Args {
    /// S3 endpoint URL for checkpoint targets (`--ckpt-url s3://…`), e.g.
    /// `http://127.0.0.1:9000` for MinIO; unset = AWS's regional endpoint.
    #[arg(long = "s3-endpoint", env = "CUMULUS_S3_ENDPOINT")]
    pub endpoint: Option<String>,
    /// S3 region used for signing.
    #[arg(
        long = "s3-region",
        env = "CUMULUS_S3_REGION",
        default_value = "us-east-1"
    )]
    pub region: String,
    /// Path-style addressing (`http://host/bucket/key`); MinIO and s3s-fs need it.
    #[arg(long = "s3-path-style", env = "CUMULUS_S3_PATH_STYLE")]
    pub path_style: bool,
    /// S3 access key id; without it (and the secret) the AWS default chain is used
    /// (`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`, profile, instance metadata).
    #[arg(long = "s3-access-key", env = "CUMULUS_S3_ACCESS_KEY")]
    pub access_key: Option<String>,
    /// S3 secret access key (prefer the environment variable).
    #[arg(
        long = "s3-secret-key",
        env = "CUMULUS_S3_SECRET_KEY",
        hide_env_values = true
    )]
    pub secret_key: Option<String>,
    /// Multipart part size, MiB (5..=5120).
    #[arg(long = "s3-part-size-mib", env = "CUMULUS_S3_PART_SIZE_MIB", default_value_t = 16,
          value_parser = clap::value_parser!(u64).range(5..=5120))]
    pub part_size_mib: u64,
    /// Most S3 requests in flight per process (bounded parallel parts), 1..=256.
    #[arg(long = "s3-max-concurrency", env = "CUMULUS_S3_MAX_CONCURRENCY", default_value_t = 8,
          value_parser = clap::value_parser!(u64).range(1..=256))]
    pub max_concurrency: u64,
    /// How long transient S3 failures (unreachable, 5xx, SlowDown) of one request are
    /// retried with backoff, milliseconds.
    #[arg(
        long = "s3-retry-deadline-ms",
        env = "CUMULUS_S3_RETRY_DEADLINE_MS",
        default_value_t = 120_000
    )]
    pub retry_deadline_ms: u64,
}

impl S3Args {
    /// The settings these flags describe (multipart above one part size).
    pub fn settings(&self) -> S3Settings {
        let part_size_bytes = self.part_size_mib * 1024 * 1024;
        S3Settings {
            endpoint_url: self.endpoint.clone(),
            region: self.region.clone(),
            force_path_style: self.path_style,
            access_key_id: self.access_key.clone(),
            secret_access_key: self.secret_key.clone(),
            multipart_threshold_bytes: part_size_bytes,
            part_size_bytes,
            max_concurrent_requests: usize::try_from(self.max_concurrency).unwrap_or(8),
            retry_deadline_ms: self.retry_deadline_ms,
            ..S3Settings::default()
        }
    }
}
