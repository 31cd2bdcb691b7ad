//! Talking to S3: one lazily built client per process ([`S3Connector`]), and every SDK
//! error classified into a [`RemoteKind`] callers branch on (transient or permanent).

use std::sync::Arc;

use aws_sdk_s3::Client;
use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::operation::RequestId as _;
use tokio::sync::Semaphore;

use crate::CkptError;

use super::*;

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
pub(super) fn classify<E>(error: &SdkError<E, HttpResponse>) -> (RemoteKind, Option<u16>, String)
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
pub(super) fn is_not_found<E>(error: &SdkError<E, HttpResponse>) -> bool
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
