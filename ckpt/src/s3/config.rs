//! What a process is told about S3: [`S3Settings`] (endpoint, credentials, part size,
//! concurrency, retry deadline) and where a job's checkpoints go ([`S3Location`]).

use std::time::Duration;

use aws_sdk_s3::Client;
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{
    BehaviorVersion, Credentials, Region, RequestChecksumCalculation, ResponseChecksumValidation,
};

use crate::CkptError;

use super::*;

/// How to reach an S3-compatible server. Credentials come from the flags when both keys
/// are set, otherwise from the AWS default chain (environment `AWS_ACCESS_KEY_ID` /
/// `AWS_SECRET_ACCESS_KEY`, profile files, instance metadata).
#[derive(Clone, Debug)]
pub struct S3Settings {
    /// Endpoint URL, e.g. `http://127.0.0.1:9000`; `None` = AWS's regional endpoint.
    pub endpoint_url: Option<String>,
    /// Region name used for signing (MinIO and s3s-fs accept any, e.g. `us-east-1`).
    pub region: String,
    /// Path-style addressing (`http://host/bucket/key`), required by MinIO and s3s-fs.
    pub force_path_style: bool,
    /// Access key id; used only together with `secret_access_key`.
    pub access_key_id: Option<String>,
    /// Secret access key; used only together with `access_key_id`.
    pub secret_access_key: Option<String>,
    /// Files larger than this many bytes go up with multipart upload.
    pub multipart_threshold_bytes: u64,
    /// Size of one multipart part, in bytes (≥ [`MIN_PART_SIZE_BYTES`]).
    pub part_size_bytes: u64,
    /// Most requests of this store in flight at once (bounded parallel parts), ≥ 1.
    pub max_concurrent_requests: usize,
    /// How long transient failures of one operation are retried, in milliseconds.
    pub retry_deadline_ms: u64,
    /// TCP connect timeout, in milliseconds.
    pub connect_timeout_ms: u64,
    /// Timeout of one request attempt, in milliseconds.
    pub attempt_timeout_ms: u64,
}

impl Default for S3Settings {
    fn default() -> Self {
        Self {
            endpoint_url: None,
            region: "us-east-1".into(),
            force_path_style: false,
            access_key_id: None,
            secret_access_key: None,
            multipart_threshold_bytes: 16 * 1024 * 1024,
            part_size_bytes: 16 * 1024 * 1024,
            max_concurrent_requests: 8,
            retry_deadline_ms: 120_000,
            connect_timeout_ms: 3_000,
            attempt_timeout_ms: 120_000,
        }
    }
}

impl S3Settings {
    /// Checks the settings: region not empty, part size in `[5 MiB, 5 GiB]`, threshold ≥
    /// part size, concurrency in `1..=256`, both keys or neither, endpoint `http(s)://`.
    pub fn validate(&self) -> Result<(), CkptError> {
        let bad = |m: String| Err(CkptError::Invalid(m));
        if self.region.is_empty() {
            return bad("S3 region is empty".into());
        }
        if !(MIN_PART_SIZE_BYTES..=5 * 1024 * 1024 * 1024).contains(&self.part_size_bytes) {
            return bad(format!(
                "S3 part size {} is outside [5 MiB, 5 GiB]",
                self.part_size_bytes
            ));
        }
        if self.multipart_threshold_bytes < self.part_size_bytes {
            return bad("S3 multipart threshold is below the part size".into());
        }
        if !(1..=256).contains(&self.max_concurrent_requests) {
            return bad(format!(
                "S3 concurrency {} is outside 1..=256",
                self.max_concurrent_requests
            ));
        }
        if self.access_key_id.is_some() != self.secret_access_key.is_some() {
            return bad("give both S3 access key and secret key, or neither".into());
        }
        if let Some(url) = &self.endpoint_url
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            return bad(format!("S3 endpoint {url:?} is not an http(s):// URL"));
        }
        Ok(())
    }

    /// Builds an S3 client from these settings (SDK retries off: [`S3Store`] retries
    /// itself, with a deadline; checksums only where S3 requires them: we send Content-MD5).
    pub async fn client(&self) -> Result<Client, CkptError> {
        self.validate()?;
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .region(Region::new(self.region.clone()))
            .retry_config(RetryConfig::disabled())
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(Duration::from_millis(self.connect_timeout_ms))
                    .operation_attempt_timeout(Duration::from_millis(self.attempt_timeout_ms))
                    .build(),
            );
        if let Some(url) = &self.endpoint_url {
            loader = loader.endpoint_url(url);
        }
        if let (Some(key), Some(secret)) = (&self.access_key_id, &self.secret_access_key) {
            loader = loader.credentials_provider(Credentials::new(
                key.clone(),
                secret.clone(),
                None,
                None,
                "cumulus-flags",
            ));
        }
        let shared = loader.load().await;
        let config = aws_sdk_s3::config::Builder::from(&shared)
            .force_path_style(self.force_path_style)
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired)
            .build();
        Ok(Client::from_conf(config))
    }
}

/// A bucket and key prefix, parsed from `s3://bucket/prefix` (prefix may be empty).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Location {
    /// Bucket name: 3..=63 of `[a-z0-9.-]`.
    pub bucket: String,
    /// Key prefix without leading or trailing `/` (may be empty).
    pub prefix: String,
}

impl S3Location {
    /// Parses `s3://bucket` or `s3://bucket/some/prefix/`. [`CkptError::Invalid`] for any
    /// other shape, an invalid bucket name or an empty/`.`/`..` prefix component.
    pub fn parse(url: &str) -> Result<Self, CkptError> {
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| CkptError::Invalid(format!("{url:?} is not an s3:// URL")))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_end_matches('/');
        if !(3..=63).contains(&bucket.len())
            || !bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        {
            return Err(CkptError::Invalid(format!(
                "{bucket:?} in {url:?} is not a valid bucket name (3..=63 of a-z 0-9 . -)"
            )));
        }
        if prefix.len() > 512
            || (!prefix.is_empty()
                && prefix
                    .split('/')
                    .any(|c| c.is_empty() || c == "." || c == ".."))
        {
            return Err(CkptError::Invalid(format!(
                "prefix {prefix:?} in {url:?} has an empty, '.' or '..' component or is too long"
            )));
        }
        Ok(Self {
            bucket: bucket.into(),
            prefix: prefix.into(),
        })
    }

    /// `prefix/rest`, or `rest` for an empty prefix.
    pub fn key(&self, rest: &str) -> String {
        if self.prefix.is_empty() {
            rest.to_owned()
        } else {
            format!("{}/{rest}", self.prefix)
        }
    }
}

impl std::fmt::Display for S3Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "s3://{}/{}", self.bucket, self.prefix)
    }
}
