//! The S3 (L2) checkpoint tier: [`S3Store`] on aws-sdk-s3, for AWS S3, MinIO and other
//! S3-compatible servers (path-style addressing, custom endpoint).
//!
//! # Layout (docs/architecture.md "Checkpoint layout (S3)")
//! ```text
//! s3://<bucket>/<prefix>/<job_id>/step-00000100/rank-0/attempt-1/<file>   one part's files
//! s3://<bucket>/<prefix>/<job_id>/step-00000100/MANIFEST.json            after every part
//! s3://<bucket>/<prefix>/<job_id>/LATEST                                 last, conditional
//! ```
//! Every object of a part carries its digest (`blake3:<hex>`, [`crate::digest`]) as user
//! metadata (`x-amz-meta-digest`; parts of format-1 manifests carry `x-amz-meta-sha256`); an
//! upload is verified before it counts: every request of part data is signed with
//! SigV4 over the SHA-256 of its body (`x-amz-content-sha256`), which the server checks
//! against the bytes it received before it stores them (AWS S3, MinIO and s3s all refuse a
//! mismatch), and a final `HEAD` must show the recorded size and digest. (Part data is
//! not also sent with `Content-MD5`: the body's SHA-256 already covers it, and an MD5 of
//! every byte cost the 2-core benchmark machine about a tenth of its CPU time; see
//! docs/perf-notes.md, "Checkpoints in S3".) Small metadata objects (manifest, `LATEST`) carry
//! `Content-MD5` and their ETag is checked, because `LATEST`'s conditional writes compare
//! ETags anyway. A reader
//! ([`S3Store::verify_part`]) checks size and digest metadata by `HEAD`; a restore
//! ([`S3Store::restore_part`]) hashes every byte it downloads.
//!
//! `LATEST` moves with conditional writes (`If-Match` on the ETag read, `If-None-Match: *`
//! when absent): a writer whose view is stale gets 412 and re-reads, and a write that would
//! move `LATEST` backwards past a step that still verifies is refused.
//!
//! Transient failures (endpoint unreachable, timeouts, 5xx, 503 SlowDown) are retried with
//! exponential backoff until [`S3Settings::retry_deadline_ms`]; permanent ones (bad
//! credentials, missing bucket, access denied) are returned at once as
//! [`CkptError::Remote`] with a [`RemoteKind`] callers can branch on.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_s3::Client;
use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{
    BehaviorVersion, Credentials, Region, RequestChecksumCalculation, ResponseChecksumValidation,
};
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::operation::RequestId as _;
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use futures::{StreamExt, TryStreamExt};
use md5::{Digest as _, Md5};
use tokio::io::AsyncWriteExt;
use tokio::sync::Semaphore;

use crate::{
    CheckpointStore, CkptError, FileEntry, LATEST_FILE, MANIFEST_FILE, MAX_LATEST_BYTES,
    MAX_MANIFEST_BYTES, Manifest, PartRecord, parse_digest, parse_step_dir_name, part_dir_rel,
    step_dir_name, validate_job_id,
};

/// User-metadata key holding a part object's digest (`<algorithm>:<hex>`, as in its
/// [`FileEntry`]); sent as `x-amz-meta-digest`.
pub const DIGEST_METADATA_KEY: &str = "digest";
/// User-metadata key of the bare hex SHA-256 of objects uploaded for format-1 manifests
/// (`x-amz-meta-sha256`); still accepted for `sha256:` digests.
pub const LEGACY_SHA256_METADATA_KEY: &str = "sha256";
/// Most objects listed under one job prefix (pagination stops there).
pub const MAX_LISTED_OBJECTS: usize = 1_000_000;
/// Most attempts of one conditional `LATEST` update before giving up (412 races).
const MAX_LATEST_RACES: u32 = 16;
/// Smallest multipart part S3 accepts (except the last), in bytes.
pub const MIN_PART_SIZE_BYTES: u64 = 5 * 1024 * 1024;
/// Largest number of parts of one multipart upload (S3's limit).
pub const MAX_UPLOAD_PARTS: u64 = 10_000;

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

/// Builds [`S3Store`]s for `s3://` URLs from one lazily created client; every store of a
/// connector shares one bound on requests in flight. Cheap to clone.
#[derive(Clone)]
pub struct S3Connector {
    settings: S3Settings,
    client: Arc<tokio::sync::OnceCell<Client>>,
    requests: Arc<Semaphore>,
}

impl std::fmt::Debug for S3Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Connector")
            .field("endpoint", &self.settings.endpoint_url)
            .field("region", &self.settings.region)
            .finish_non_exhaustive()
    }
}

impl S3Connector {
    /// A connector for `settings` (validated; the client is built on first use).
    pub fn new(settings: S3Settings) -> Result<Self, CkptError> {
        settings.validate()?;
        let requests = Arc::new(Semaphore::new(settings.max_concurrent_requests.max(1)));
        Ok(Self {
            settings,
            client: Arc::new(tokio::sync::OnceCell::new()),
            requests,
        })
    }

    /// The store of `url` (`s3://bucket/prefix`).
    pub async fn store(&self, url: &str) -> Result<S3Store, CkptError> {
        let location = S3Location::parse(url)?;
        let client = self
            .client
            .get_or_try_init(|| self.settings.client())
            .await?
            .clone();
        let mut store = S3Store::new(client, self.settings.clone(), location);
        store.requests = self.requests.clone();
        Ok(store)
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

/// What kind of S3 failure [`CkptError::Remote`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteKind {
    /// The endpoint could not be reached or did not answer in time (transient).
    Unreachable,
    /// The server rejected the credentials (`InvalidAccessKeyId`, `SignatureDoesNotMatch`).
    BadCredentials,
    /// The bucket does not exist (`NoSuchBucket`).
    NoSuchBucket,
    /// The credentials are valid but may not do this (`AccessDenied`).
    AccessDenied,
    /// The server asked us to slow down (503 `SlowDown`, 429) (transient).
    Throttled,
    /// A conditional request failed or an object changed under us (412, size/hash mismatch).
    Changed,
    /// A 5xx server error (transient).
    Server,
    /// Any other failure (permanent).
    Other,
}

impl RemoteKind {
    /// True for failures worth retrying with backoff.
    pub fn is_transient(self) -> bool {
        matches!(self, Self::Unreachable | Self::Throttled | Self::Server)
    }
}

impl std::fmt::Display for RemoteKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Unreachable => "endpoint unreachable",
            Self::BadCredentials => "credentials rejected",
            Self::NoSuchBucket => "bucket does not exist",
            Self::AccessDenied => "access denied",
            Self::Throttled => "throttled (SlowDown)",
            Self::Changed => "object changed or precondition failed",
            Self::Server => "server error",
            Self::Other => "request failed",
        })
    }
}

/// Classifies an SDK error: (kind, HTTP status if any, detail text).
///
/// The detail of an S3 error response is its status, code, message and request id
/// (`HTTP 503 SlowDown: Please reduce your request rate. (request id …)`), not the SDK's
/// debug dump of the whole raw response; transport and unparsable-response errors keep the
/// SDK's full error chain.
fn classify<E>(error: &SdkError<E, HttpResponse>) -> (RemoteKind, Option<u16>, String)
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let detail = DisplayErrorContext(error).to_string();
    match error {
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) => {
            (RemoteKind::Unreachable, None, detail)
        }
        SdkError::ResponseError(ctx) => {
            let status = ctx.raw().status().as_u16();
            let kind = if status >= 500 {
                RemoteKind::Server
            } else {
                RemoteKind::Other
            };
            (kind, Some(status), detail)
        }
        SdkError::ServiceError(ctx) => {
            let status = ctx.raw().status().as_u16();
            let code = ctx.err().code().unwrap_or_default();
            let kind = match (code, status) {
                ("InvalidAccessKeyId" | "SignatureDoesNotMatch" | "InvalidToken", _) => {
                    RemoteKind::BadCredentials
                }
                ("NoSuchBucket", _) => RemoteKind::NoSuchBucket,
                ("AccessDenied", _) => RemoteKind::AccessDenied,
                ("SlowDown" | "Throttling" | "RequestLimitExceeded", _) | (_, 429 | 503) => {
                    RemoteKind::Throttled
                }
                ("PreconditionFailed", _) | (_, 412) => RemoteKind::Changed,
                // A server without the operation (s3s-fs: ListMultipartUploads) will not
                // grow it by retrying.
                ("NotImplemented", _) | (_, 501) => RemoteKind::Other,
                (_, 403) => RemoteKind::AccessDenied,
                (_, s) if s >= 500 => RemoteKind::Server,
                _ => RemoteKind::Other,
            };
            let mut detail = match (code, ctx.err().message()) {
                // A HEAD answer has no body, hence no error document.
                ("", _) => format!("HTTP {status} (no S3 error code in the response)"),
                (code, Some(message)) if !message.is_empty() => {
                    format!("HTTP {status} {code}: {message}")
                }
                (code, _) => format!("HTTP {status} {code}"),
            };
            if let Some(id) = ctx.err().meta().request_id() {
                detail.push_str(&format!(" (request id {id})"));
            }
            (kind, Some(status), detail)
        }
        _ => (RemoteKind::Other, None, detail),
    }
}

/// True when the error is a 404 (no such key / no such upload).
fn is_not_found<E>(error: &SdkError<E, HttpResponse>) -> bool
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    match error {
        SdkError::ServiceError(ctx) => {
            let code = ctx.err().code().unwrap_or_default();
            (ctx.raw().status().as_u16() == 404 && code != "NoSuchBucket")
                || code == "NoSuchKey"
                || code == "NotFound"
        }
        _ => false,
    }
}

/// The L2 tier: checkpoints in an S3 bucket under a prefix. Cheap to clone (one client).
///
/// It stores steps, manifests and `LATEST`; parts are committed into it by
/// [`crate::TieredStore`], which stages and commits on local disk (L1) first and then calls
/// [`S3Store::upload_part`]. Its own [`CheckpointStore::prepare_staging`] /
/// [`CheckpointStore::commit_part`] refuse with [`CkptError::Invalid`] for that reason.
#[derive(Clone)]
pub struct S3Store {
    client: Client,
    location: S3Location,
    settings: Arc<S3Settings>,
    endpoint: String,
    requests: Arc<Semaphore>,
}

impl std::fmt::Debug for S3Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Store")
            .field("location", &self.location)
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl S3Store {
    /// A store for `location` over `client` (build it with [`S3Settings::client`]; one
    /// client may serve many stores).
    pub fn new(client: Client, settings: S3Settings, location: S3Location) -> Self {
        let endpoint = settings
            .endpoint_url
            .clone()
            .unwrap_or_else(|| format!("AWS {}", settings.region));
        let requests = Arc::new(Semaphore::new(settings.max_concurrent_requests.max(1)));
        Self {
            client,
            location,
            settings: Arc::new(settings),
            endpoint,
            requests,
        }
    }

    /// The bucket and prefix of this store.
    pub fn location(&self) -> &S3Location {
        &self.location
    }

    /// The underlying client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Checks that the bucket exists and these credentials may list it (one `ListObjectsV2`
    /// of at most one key). Errors: [`CkptError::Remote`] with `Unreachable`,
    /// `BadCredentials`, `NoSuchBucket`, `AccessDenied`, … (after retrying transient ones).
    pub async fn check_access(&self) -> Result<(), CkptError> {
        let key = self.location.key("");
        self.retry("list", &key, || {
            self.client
                .list_objects_v2()
                .bucket(&self.location.bucket)
                .prefix(&key)
                .max_keys(1)
                .send()
        })
        .await?;
        Ok(())
    }

    /// Size and ETag of object `key` (a full key in the bucket). [`CkptError::NotFound`]
    /// when absent.
    pub async fn head(&self, key: &str) -> Result<(u64, Option<String>), CkptError> {
        let head = self
            .retry("head", key, || {
                self.client
                    .head_object()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .send()
            })
            .await?;
        let size = head
            .content_length()
            .and_then(|l| u64::try_from(l).ok())
            .ok_or_else(|| self.remote_error("head", key, RemoteKind::Other, "no size".into()))?;
        Ok((size, head.e_tag().map(str::to_owned)))
    }

    /// The body of object `key`, only while its ETag is `etag` (`If-Match`): a changed
    /// object is [`CkptError::Remote`] with [`RemoteKind::Changed`].
    pub async fn get_if_match(&self, key: &str, etag: &str) -> Result<ByteStream, CkptError> {
        let output = self
            .retry("get", key, || {
                self.client
                    .get_object()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .if_match(etag)
                    .send()
            })
            .await?;
        Ok(output.body)
    }

    /// Keys of the objects under the store's prefix (full keys, sorted; at most
    /// [`MAX_LISTED_OBJECTS`]); keys ending in `/` (folder markers) are skipped.
    pub async fn list_objects(&self) -> Result<Vec<String>, CkptError> {
        let prefix = if self.location.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.location.prefix)
        };
        let mut keys = self.list_keys(&prefix).await?;
        keys.retain(|k| !k.ends_with('/'));
        keys.sort();
        Ok(keys)
    }

    fn job_key(&self, job_id: &str, rest: &str) -> String {
        self.location.key(&format!("{job_id}/{rest}"))
    }

    fn remote_error(
        &self,
        op: &'static str,
        key: &str,
        kind: RemoteKind,
        detail: String,
    ) -> CkptError {
        CkptError::Remote {
            op,
            url: format!("s3://{}/{key}", self.location.bucket),
            endpoint: self.endpoint.clone(),
            kind,
            detail,
        }
    }

    /// Runs `call` (one request) with a concurrency permit, retrying transient failures
    /// with exponential backoff (100 ms doubling to 5 s) until the retry deadline (the
    /// last attempt is made at the deadline). A transient failure given up on says how
    /// many attempts were made over how long.
    async fn retry<T, E, F, Fut>(
        &self,
        op: &'static str,
        key: &str,
        mut call: F,
    ) -> Result<T, CkptError>
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, SdkError<E, HttpResponse>>>,
    {
        let started = tokio::time::Instant::now();
        let deadline = started + Duration::from_millis(self.settings.retry_deadline_ms);
        let mut delay = Duration::from_millis(100);
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let result = {
                let _permit = self
                    .requests
                    .acquire()
                    .await
                    .map_err(|_| CkptError::Invalid("S3 store closed".into()))?;
                call().await
            };
            match result {
                Ok(value) => return Ok(value),
                Err(error) => {
                    let (kind, _status, detail) = classify(&error);
                    if is_not_found(&error) {
                        return Err(CkptError::NotFound {
                            what: format!("s3://{}/{key}", self.location.bucket),
                        });
                    }
                    if !kind.is_transient() {
                        return Err(self.remote_error(op, key, kind, detail));
                    }
                    let now = tokio::time::Instant::now();
                    if now >= deadline {
                        let detail = format!(
                            "{detail}; gave up after {attempts} attempts in {} ms (retry deadline {} ms)",
                            started.elapsed().as_millis(),
                            self.settings.retry_deadline_ms
                        );
                        return Err(self.remote_error(op, key, kind, detail));
                    }
                    // The last attempt is made at the deadline, not one backoff before it.
                    let pause = delay.min(deadline - now);
                    tracing::warn!(op, key, %kind, retry_in_ms = pause.as_millis() as u64, "transient S3 failure: {detail}");
                    tokio::time::sleep(pause).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// Uploads the files of an already committed local part (directory `local_dir`, files
    /// as in `record`) to `<job>/<record.dir>/…`, verifying each object (Content-MD5, ETag =
    /// MD5, then `HEAD` size + SHA-256 metadata) before returning. Re-uploading the same
    /// part is harmless (same keys, same bytes).
    pub async fn upload_part(
        &self,
        job_id: &str,
        record: &PartRecord,
        local_dir: &Path,
    ) -> Result<(), CkptError> {
        validate_job_id(job_id)?;
        record.validate()?;
        let mut uploads = Vec::with_capacity(record.files.len());
        for file in &record.files {
            let key = self.job_key(job_id, &format!("{}/{}", record.dir, file.path));
            let path = local_dir.join(&file.path);
            uploads.push(async move { self.upload_file(&key, &path, file).await });
        }
        // Files go up a few at a time; parts of large files are bounded by the semaphore.
        futures::stream::iter(uploads)
            .buffer_unordered(4)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }

    /// Uploads one file (single PUT or multipart) and verifies the object.
    async fn upload_file(&self, key: &str, path: &Path, file: &FileEntry) -> Result<(), CkptError> {
        if file.size_bytes > self.settings.multipart_threshold_bytes {
            self.upload_multipart(key, path, file).await?;
        } else {
            let bytes = bytes::Bytes::from(read_range(path, 0, file.size_bytes).await?);
            // The SigV4 payload hash (signed, checked by the server) verifies the body.
            self.retry("put", key, || {
                self.client
                    .put_object()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .metadata(DIGEST_METADATA_KEY, &file.digest)
                    .body(ByteStream::from(bytes.clone()))
                    .send()
            })
            .await?;
        }
        self.check_object(key, file, "verify upload").await
    }

    async fn upload_multipart(
        &self,
        key: &str,
        path: &Path,
        file: &FileEntry,
    ) -> Result<(), CkptError> {
        let part_size = self
            .settings
            .part_size_bytes
            .max(file.size_bytes.div_ceil(MAX_UPLOAD_PARTS));
        let created = self
            .retry("create multipart upload", key, || {
                self.client
                    .create_multipart_upload()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .metadata(DIGEST_METADATA_KEY, &file.digest)
                    .send()
            })
            .await?;
        let upload_id = created
            .upload_id()
            .ok_or_else(|| {
                self.remote_error(
                    "create multipart upload",
                    key,
                    RemoteKind::Other,
                    "no upload id".into(),
                )
            })?
            .to_owned();
        let count = file.size_bytes.div_ceil(part_size).max(1);
        // Each part is its own task, so that reading, signing (SHA-256 of the body) and
        // sending parts use every runtime thread rather than the one polling this
        // future; at most `max_concurrent_requests` of this file's parts are alive at once
        // (each holds its bytes), and the store's semaphore bounds requests across files.
        // A dropped upload aborts its part tasks.
        let mut parts = Vec::new();
        for index in 0..count {
            let offset = index * part_size;
            let len = part_size.min(file.size_bytes - offset);
            let store = self.clone();
            let task_key = key.to_owned();
            let upload_id = upload_id.clone();
            let path = path.to_owned();
            parts.push(async move {
                let task = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
                    store
                        .upload_one_part(&task_key, &upload_id, &path, index, offset, len)
                        .await
                }));
                match task.await {
                    Ok(result) => result,
                    Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
                    Err(error) => Err(CkptError::Io {
                        op: "upload part task",
                        path: PathBuf::from(format!("s3://{}/{key}", self.location.bucket)),
                        source: std::io::Error::other(error),
                    }),
                }
            });
        }
        let result: Result<Vec<CompletedPart>, CkptError> = futures::stream::iter(parts)
            .buffer_unordered(self.settings.max_concurrent_requests.max(1))
            .try_collect()
            .await;
        let mut completed = match result {
            Ok(parts) => parts,
            Err(error) => {
                self.abort_upload(key, &upload_id).await;
                return Err(error);
            }
        };
        completed.sort_by_key(|p| p.part_number());
        let body = CompletedMultipartUpload::builder()
            .set_parts(Some(completed))
            .build();
        if let Err(error) = self
            .retry("complete multipart upload", key, || {
                self.client
                    .complete_multipart_upload()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .upload_id(&upload_id)
                    .multipart_upload(body.clone())
                    .send()
            })
            .await
        {
            self.abort_upload(key, &upload_id).await;
            return Err(error);
        }
        Ok(())
    }

    /// Uploads part `index` (bytes `offset..offset + len` of `path`) of a multipart upload.
    /// The SigV4 payload hash (signed, checked by the server) verifies the body.
    async fn upload_one_part(
        &self,
        key: &str,
        upload_id: &str,
        path: &Path,
        index: u64,
        offset: u64,
        len: u64,
    ) -> Result<CompletedPart, CkptError> {
        let bytes = bytes::Bytes::from(read_range(path, offset, len).await?);
        let number = i32::try_from(index + 1).expect("part number ≤ 10,000");
        let output = self
            .retry("upload part", key, || {
                self.client
                    .upload_part()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .upload_id(upload_id)
                    .part_number(number)
                    .body(ByteStream::from(bytes.clone()))
                    .send()
            })
            .await?;
        Ok(CompletedPart::builder()
            .part_number(number)
            .set_e_tag(output.e_tag().map(str::to_owned))
            .build())
    }

    async fn abort_upload(&self, key: &str, upload_id: &str) {
        if let Err(e) = self
            .retry("abort multipart upload", key, || {
                self.client
                    .abort_multipart_upload()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .upload_id(upload_id)
                    .send()
            })
            .await
        {
            tracing::warn!(
                key,
                "cannot abort multipart upload (prune cleans it up later): {e}"
            );
        }
    }

    /// `HEAD`s one object: its size and SHA-256 metadata must match `file`.
    async fn check_object(
        &self,
        key: &str,
        file: &FileEntry,
        op: &'static str,
    ) -> Result<(), CkptError> {
        let head = match self
            .retry(op, key, || {
                self.client
                    .head_object()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .send()
            })
            .await
        {
            Ok(head) => head,
            Err(CkptError::NotFound { what }) => {
                return Err(CkptError::Corrupt {
                    path: PathBuf::from(what),
                    reason: "is missing".into(),
                });
            }
            Err(e) => return Err(e),
        };
        let size = head.content_length().and_then(|l| u64::try_from(l).ok());
        let metadata = head.metadata();
        let digest = metadata
            .and_then(|m| m.get(DIGEST_METADATA_KEY))
            .cloned()
            .or_else(|| {
                metadata
                    .and_then(|m| m.get(LEGACY_SHA256_METADATA_KEY))
                    .map(|hex| format!("sha256:{hex}"))
            });
        if size != Some(file.size_bytes) || digest.as_deref() != Some(file.digest.as_str()) {
            return Err(CkptError::Corrupt {
                path: PathBuf::from(format!("s3://{}/{key}", self.location.bucket)),
                reason: format!(
                    "has size {size:?} and digest {digest:?}, the record says {} and {}",
                    file.size_bytes, file.digest
                ),
            });
        }
        Ok(())
    }

    /// For a part uploaded in the background (commit tier `l1`): deletes the part's objects
    /// when its step can no longer be mirrored to L2, and returns whether it did. That is
    /// the case when L2's `LATEST` names a newer step and the step has no L2 manifest: the
    /// leader mirrors kept steps oldest first and stops at the first whose parts are not
    /// all in L2, so a step it went past without writing its manifest had already left the
    /// kept set (for good: the kept set only loses old steps), and L2's prune may have run
    /// before this upload ended. Without this, such a late part would stay in the bucket
    /// with no manifest after the job's last prune.
    ///
    /// # Errors
    /// An invalid record, or a storage error reading `LATEST` or the manifest or deleting
    /// (nothing is deleted unless both reads succeeded).
    pub async fn discard_part_if_superseded(
        &self,
        job_id: &str,
        part: &PartRecord,
    ) -> Result<bool, CkptError> {
        validate_job_id(job_id)?;
        let step = part.validate()?;
        match self.read_latest(job_id).await? {
            Some(latest) if latest > step => {}
            _ => return Ok(false),
        }
        match self.read_manifest(job_id, step).await {
            Err(CkptError::NotFound { .. }) => {}
            Ok(_) | Err(CkptError::Corrupt { .. }) => return Ok(false),
            Err(e) => return Err(e),
        }
        let prefix = self.job_key(job_id, &format!("{}/", part.dir));
        self.delete_keys(self.list_keys(&prefix).await?).await?;
        Ok(true)
    }

    /// Deletes `keys` in order (each with retries); stops at the first failure.
    async fn delete_keys(&self, keys: Vec<String>) -> Result<(), CkptError> {
        for key in keys {
            self.retry("delete", &key, || {
                self.client
                    .delete_object()
                    .bucket(&self.location.bucket)
                    .key(&key)
                    .send()
            })
            .await?;
        }
        Ok(())
    }

    /// Downloads `part` into `dest` (created; must not exist yet), hashing every byte: each
    /// file must have the recorded size and digest ([`CkptError::Corrupt`] otherwise). The
    /// files are fsynced; on error `dest` may hold a partial copy the caller removes.
    pub async fn restore_part(
        &self,
        job_id: &str,
        part: &PartRecord,
        dest: &Path,
    ) -> Result<(), CkptError> {
        validate_job_id(job_id)?;
        part.validate()?;
        let io = |op: &'static str, path: &Path| {
            let path = path.to_owned();
            move |source| CkptError::Io { op, path, source }
        };
        for file in &part.files {
            let key = self.job_key(job_id, &format!("{}/{}", part.dir, file.path));
            let target = dest.join(&file.path);
            if let Some(parent) = target.parent() {
                tokio::fs::create_dir_all(parent)
                    .await
                    .map_err(io("create dir", parent))?;
            }
            let output = match self
                .retry("get", &key, || {
                    self.client
                        .get_object()
                        .bucket(&self.location.bucket)
                        .key(&key)
                        .send()
                })
                .await
            {
                Ok(output) => output,
                Err(CkptError::NotFound { what }) => {
                    return Err(CkptError::Corrupt {
                        path: PathBuf::from(what),
                        reason: "is missing".into(),
                    });
                }
                Err(e) => return Err(e),
            };
            let mut out = tokio::fs::File::create(&target)
                .await
                .map_err(io("create", &target))?;
            let mut body = output.body;
            let mut hasher = parse_digest(&file.digest)?.hasher();
            let mut size = 0u64;
            while let Some(chunk) = body.try_next().await.map_err(|e| {
                self.remote_error("get", &key, RemoteKind::Unreachable, e.to_string())
            })? {
                size += chunk.len() as u64;
                if size > file.size_bytes {
                    break;
                }
                hasher.update(&chunk);
                out.write_all(&chunk).await.map_err(io("write", &target))?;
            }
            out.sync_all().await.map_err(io("fsync", &target))?;
            let digest = hasher.finalize();
            if size != file.size_bytes || digest != file.digest {
                return Err(CkptError::Corrupt {
                    path: PathBuf::from(format!("s3://{}/{key}", self.location.bucket)),
                    reason: format!(
                        "downloaded {size} bytes with digest {digest}; the manifest says {} bytes, {}",
                        file.size_bytes, file.digest
                    ),
                });
            }
        }
        Ok(())
    }

    /// Reads a small object whole: `None` when absent, [`CkptError::Corrupt`] when larger
    /// than `limit` bytes. Returns the bytes and the ETag.
    async fn get_small(
        &self,
        key: &str,
        limit: u64,
    ) -> Result<Option<(Vec<u8>, Option<String>)>, CkptError> {
        let output = match self
            .retry("get", key, || {
                self.client
                    .get_object()
                    .bucket(&self.location.bucket)
                    .key(key)
                    .send()
            })
            .await
        {
            Ok(output) => output,
            Err(CkptError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let corrupt = |reason: String| CkptError::Corrupt {
            path: PathBuf::from(format!("s3://{}/{key}", self.location.bucket)),
            reason,
        };
        if output
            .content_length()
            .is_some_and(|l| u64::try_from(l).map_or(true, |l| l > limit))
        {
            return Err(corrupt(format!("is larger than {limit} bytes")));
        }
        let etag = output.e_tag().map(str::to_owned);
        let mut body = output.body;
        let mut bytes = Vec::new();
        while let Some(chunk) = body
            .try_next()
            .await
            .map_err(|e| self.remote_error("get", key, RemoteKind::Unreachable, e.to_string()))?
        {
            if (bytes.len() + chunk.len()) as u64 > limit {
                return Err(corrupt(format!("is larger than {limit} bytes")));
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(Some((bytes, etag)))
    }

    /// `LATEST` and its ETag; `None` when absent.
    async fn read_latest_tagged(
        &self,
        job_id: &str,
    ) -> Result<Option<(u64, Option<String>)>, CkptError> {
        validate_job_id(job_id)?;
        let key = self.job_key(job_id, LATEST_FILE);
        let Some((bytes, etag)) = self.get_small(&key, MAX_LATEST_BYTES).await? else {
            return Ok(None);
        };
        let step = std::str::from_utf8(&bytes)
            .ok()
            .and_then(|text| text.strip_suffix('\n'))
            .and_then(parse_step_dir_name)
            .ok_or_else(|| CkptError::Corrupt {
                path: PathBuf::from(format!("s3://{}/{key}", self.location.bucket)),
                reason: format!("{:?} is not a step name", String::from_utf8_lossy(&bytes)),
            })?;
        Ok(Some((step, etag)))
    }

    /// Keys under `prefix` (paginated, at most [`MAX_LISTED_OBJECTS`]).
    async fn list_keys(&self, prefix: &str) -> Result<Vec<String>, CkptError> {
        let mut keys = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let page = self
                .retry("list", prefix, || {
                    self.client
                        .list_objects_v2()
                        .bucket(&self.location.bucket)
                        .prefix(prefix)
                        .set_continuation_token(token.clone())
                        .send()
                })
                .await?;
            keys.extend(
                page.contents()
                    .iter()
                    .filter_map(|o| o.key().map(str::to_owned)),
            );
            if keys.len() > MAX_LISTED_OBJECTS {
                return Err(CkptError::Invalid(format!(
                    "more than {MAX_LISTED_OBJECTS} objects under s3://{}/{prefix}",
                    self.location.bucket
                )));
            }
            match page.next_continuation_token() {
                Some(next) if page.is_truncated() == Some(true) => token = Some(next.to_owned()),
                _ => return Ok(keys),
            }
        }
    }

    /// Aborts multipart uploads under the job's prefix that were started more than
    /// `older_than_ms` ago (abandoned by a crashed uploader). Returns how many it aborted.
    pub async fn abort_stale_uploads(
        &self,
        job_id: &str,
        older_than_ms: u64,
    ) -> Result<usize, CkptError> {
        validate_job_id(job_id)?;
        let prefix = self.job_key(job_id, "");
        let listed = self
            .retry("list multipart uploads", &prefix, || {
                self.client
                    .list_multipart_uploads()
                    .bucket(&self.location.bucket)
                    .prefix(&prefix)
                    .send()
            })
            .await?;
        let now = std::time::SystemTime::now();
        let mut aborted = 0;
        for upload in listed.uploads() {
            let (Some(key), Some(id)) = (upload.key(), upload.upload_id()) else {
                continue;
            };
            let old = upload.initiated().is_none_or(|t| {
                std::time::SystemTime::try_from(*t)
                    .ok()
                    .and_then(|t| now.duration_since(t).ok())
                    .is_some_and(|age| age.as_millis() >= u128::from(older_than_ms))
            });
            if old {
                self.abort_upload(key, id).await;
                aborted += 1;
            }
        }
        Ok(aborted)
    }
}

/// Reads `len` bytes at `offset` of `path`: one blocking-pool task (open + one positioned
/// read), not one round trip to the pool per 2 MiB as `tokio::fs` reads would take.
async fn read_range(path: &Path, offset: u64, len: u64) -> Result<Vec<u8>, CkptError> {
    use std::os::unix::fs::FileExt as _;
    let len = usize::try_from(len).map_err(|_| CkptError::Invalid("part too large".into()))?;
    let path = path.to_owned();
    crate::local::blocking(move || {
        let io = |op: &'static str| {
            let path = path.clone();
            move |source| CkptError::Io { op, path, source }
        };
        let file = std::fs::File::open(&path).map_err(io("open"))?;
        let mut buffer = vec![0u8; len];
        file.read_exact_at(&mut buffer, offset)
            .map_err(io("read"))?;
        Ok(buffer)
    })
    .await
}

/// The ETag (quotes stripped) must be the hex MD5 of what we sent.
fn check_etag(etag: Option<&str>, md5: &[u8]) -> Result<(), String> {
    let expected = hex::encode(md5);
    match etag.map(|e| e.trim_matches('"')) {
        Some(e) if e.eq_ignore_ascii_case(&expected) => Ok(()),
        other => Err(format!(
            "server ETag {other:?} is not the MD5 {expected} of the bytes sent"
        )),
    }
}

fn base64_encode(bytes: &[u8]) -> String {
    aws_smithy_types::base64::encode(bytes)
}

#[async_trait::async_trait]
impl CheckpointStore for S3Store {
    async fn prepare_staging(
        &self,
        _job_id: &str,
        _rank: u32,
        _attempt: u32,
    ) -> Result<PathBuf, CkptError> {
        Err(CkptError::Invalid(
            "an S3 store is the L2 tier and has no staging: commit through TieredStore".into(),
        ))
    }

    async fn commit_part(
        &self,
        _job_id: &str,
        _step: u64,
        _rank: u32,
        _attempt: u32,
        _staging: &Path,
        _state: serde_json::Value,
    ) -> Result<PartRecord, CkptError> {
        Err(CkptError::Invalid(
            "an S3 store is the L2 tier: commit through TieredStore (L1 then upload)".into(),
        ))
    }

    async fn verify_part(&self, job_id: &str, part: &PartRecord) -> Result<(), CkptError> {
        validate_job_id(job_id)?;
        part.validate()?;
        for file in &part.files {
            let key = self.job_key(job_id, &format!("{}/{}", part.dir, file.path));
            self.check_object(&key, file, "verify").await?;
        }
        Ok(())
    }

    async fn write_manifest(&self, manifest: &Manifest) -> Result<(), CkptError> {
        manifest.validate()?;
        let bytes = serde_json::to_vec_pretty(manifest)
            .map_err(|e| CkptError::Invalid(format!("cannot serialize manifest: {e}")))?;
        if bytes.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(CkptError::Invalid("manifest too large".into()));
        }
        let key = self.job_key(
            &manifest.job_id,
            &format!("{}/{MANIFEST_FILE}", step_dir_name(manifest.step)),
        );
        let md5 = Md5::digest(&bytes);
        let content_md5 = base64_encode(&md5);
        let bytes = bytes::Bytes::from(bytes);
        let output = self
            .retry("put manifest", &key, || {
                self.client
                    .put_object()
                    .bucket(&self.location.bucket)
                    .key(&key)
                    .content_md5(&content_md5)
                    .content_type("application/json")
                    .body(ByteStream::from(bytes.clone()))
                    .send()
            })
            .await?;
        check_etag(output.e_tag(), &md5)
            .map_err(|why| self.remote_error("put manifest", &key, RemoteKind::Changed, why))
    }

    async fn read_manifest(&self, job_id: &str, step: u64) -> Result<Manifest, CkptError> {
        validate_job_id(job_id)?;
        let key = self.job_key(job_id, &format!("{}/{MANIFEST_FILE}", step_dir_name(step)));
        let path = PathBuf::from(format!("s3://{}/{key}", self.location.bucket));
        let (bytes, _) = self
            .get_small(&key, MAX_MANIFEST_BYTES)
            .await?
            .ok_or_else(|| CkptError::NotFound {
                what: format!("manifest {}", path.display()),
            })?;
        let manifest: Manifest =
            serde_json::from_slice(&bytes).map_err(|e| CkptError::Corrupt {
                path: path.clone(),
                reason: format!("unparsable manifest: {e}"),
            })?;
        manifest.validate().map_err(|e| CkptError::Corrupt {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        if manifest.job_id != job_id || manifest.step != step {
            return Err(CkptError::Corrupt {
                path,
                reason: format!("manifest is of {} step {}", manifest.job_id, manifest.step),
            });
        }
        Ok(manifest)
    }

    async fn verify_step(&self, job_id: &str, step: u64) -> Result<Manifest, CkptError> {
        let manifest = self.read_manifest(job_id, step).await?;
        for part in &manifest.parts {
            self.verify_part(job_id, part).await?;
        }
        Ok(manifest)
    }

    async fn write_latest(&self, job_id: &str, step: u64) -> Result<(), CkptError> {
        validate_job_id(job_id)?;
        let key = self.job_key(job_id, LATEST_FILE);
        let body = bytes::Bytes::from(format!("{}\n", step_dir_name(step)));
        for _ in 0..MAX_LATEST_RACES {
            let current = self.read_latest_tagged(job_id).await;
            let etag = match current {
                Ok(Some((current, _))) if current == step => return Ok(()),
                Ok(Some((current, _)))
                    if current > step && self.verify_step(job_id, current).await.is_ok() =>
                {
                    return Err(self.remote_error(
                        "put LATEST",
                        &key,
                        RemoteKind::Changed,
                        format!(
                            "LATEST names step {current}, which verifies; refusing to move it back to {step}"
                        ),
                    ));
                }
                Ok(Some((_, etag))) => etag,
                Ok(None) => None,
                // A corrupt LATEST is replaced (conditionally on what is there).
                Err(CkptError::Corrupt { .. }) => self
                    .retry("head LATEST", &key, || {
                        self.client
                            .head_object()
                            .bucket(&self.location.bucket)
                            .key(&key)
                            .send()
                    })
                    .await?
                    .e_tag()
                    .map(str::to_owned),
                Err(e) => return Err(e),
            };
            let result = self
                .retry("put LATEST", &key, || {
                    let request = self
                        .client
                        .put_object()
                        .bucket(&self.location.bucket)
                        .key(&key)
                        .content_type("text/plain")
                        .body(ByteStream::from(body.clone()));
                    match &etag {
                        Some(etag) => request.if_match(etag),
                        None => request.if_none_match("*"),
                    }
                    .send()
                })
                .await;
            match result {
                Ok(_) => return Ok(()),
                Err(CkptError::Remote {
                    kind: RemoteKind::Changed,
                    ..
                }) => {
                    tracing::debug!(job_id, step, "LATEST changed under us; re-reading");
                    continue;
                }
                Err(e) => return Err(e),
            }
        }
        Err(self.remote_error(
            "put LATEST",
            &key,
            RemoteKind::Changed,
            format!("LATEST kept changing under {MAX_LATEST_RACES} conditional writes"),
        ))
    }

    async fn read_latest(&self, job_id: &str) -> Result<Option<u64>, CkptError> {
        Ok(self.read_latest_tagged(job_id).await?.map(|(step, _)| step))
    }

    async fn list_steps(&self, job_id: &str) -> Result<Vec<u64>, CkptError> {
        validate_job_id(job_id)?;
        let prefix = self.job_key(job_id, "");
        let mut steps = BTreeSet::new();
        let mut token: Option<String> = None;
        loop {
            let page = self
                .retry("list", &prefix, || {
                    self.client
                        .list_objects_v2()
                        .bucket(&self.location.bucket)
                        .prefix(&prefix)
                        .delimiter("/")
                        .set_continuation_token(token.clone())
                        .send()
                })
                .await?;
            for common in page.common_prefixes() {
                if let Some(step) = common
                    .prefix()
                    .and_then(|p| p.strip_prefix(&prefix))
                    .and_then(|p| p.strip_suffix('/'))
                    .and_then(parse_step_dir_name)
                {
                    steps.insert(step);
                }
            }
            if steps.len() > MAX_LISTED_OBJECTS {
                return Err(CkptError::Invalid("too many steps listed".into()));
            }
            match page.next_continuation_token() {
                Some(next) if page.is_truncated() == Some(true) => token = Some(next.to_owned()),
                _ => return Ok(steps.into_iter().collect()),
            }
        }
    }

    async fn prune(&self, job_id: &str, keep: &[u64]) -> Result<Vec<u64>, CkptError> {
        validate_job_id(job_id)?;
        // Uploads abandoned by a crashed writer (an hour is far beyond any live upload's
        // retry deadline).
        match self.abort_stale_uploads(job_id, 3_600_000).await {
            Ok(0) => {}
            Ok(aborted) => tracing::info!(job_id, aborted, "aborted abandoned multipart uploads"),
            Err(e) => tracing::debug!(job_id, "cannot clean up abandoned multipart uploads: {e}"),
        }
        let Some(latest) = self.read_latest(job_id).await? else {
            return Ok(Vec::new());
        };
        let mut deleted = Vec::new();
        for step in self.list_steps(job_id).await? {
            if step >= latest || keep.contains(&step) {
                continue;
            }
            let prefix = self.job_key(job_id, &format!("{}/", step_dir_name(step)));
            // The manifest goes first, so a half-deleted step is never taken for whole.
            let manifest = format!("{prefix}{MANIFEST_FILE}");
            let mut keys = self.list_keys(&prefix).await?;
            keys.sort_by_key(|k| *k != manifest);
            self.delete_keys(keys).await?;
            deleted.push(step);
        }
        Ok(deleted)
    }

    fn local_part_path(&self, _job_id: &str, _part_dir: &str) -> Option<PathBuf> {
        None
    }

    fn describe(&self) -> String {
        format!("{} (endpoint {})", self.location, self.endpoint)
    }
}

/// Key of one file of a part, relative to the store's prefix (for tools and tests).
pub fn part_file_key(job_id: &str, step: u64, rank: u32, attempt: u32, path: &str) -> String {
    format!("{job_id}/{}/{path}", part_dir_rel(step, rank, attempt))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations() {
        let l = S3Location::parse("s3://ckpt-bucket/a/b/").expect("valid");
        assert_eq!(l.bucket, "ckpt-bucket");
        assert_eq!(l.prefix, "a/b");
        assert_eq!(l.key("job-1/LATEST"), "a/b/job-1/LATEST");
        let l = S3Location::parse("s3://bkt").expect("valid");
        assert_eq!(l.prefix, "");
        assert_eq!(l.key("x"), "x");
        for bad in [
            "http://b/x",
            "s3://",
            "s3://ab",
            "s3://Bad/x",
            "s3://bkt/a//b",
            "s3://bkt/../x",
        ] {
            assert!(S3Location::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn settings_validation() {
        S3Settings::default()
            .validate()
            .expect("defaults are valid");
        let bad = S3Settings {
            part_size_bytes: 1024,
            ..S3Settings::default()
        };
        assert!(bad.validate().is_err());
        let bad = S3Settings {
            access_key_id: Some("k".into()),
            ..S3Settings::default()
        };
        assert!(bad.validate().is_err());
        let bad = S3Settings {
            endpoint_url: Some("127.0.0.1:9000".into()),
            ..S3Settings::default()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn etags() {
        let md5 = Md5::digest(b"abc");
        assert!(check_etag(Some("\"900150983cd24fb0d6963f7d28e17f72\""), &md5).is_ok());
        assert!(check_etag(Some("\"00\""), &md5).is_err());
        assert!(check_etag(None, &md5).is_err());
    }
}
