//! The service wrapper that tells a connection's [`Activity`] when its requests start and
//! end, and whether one was useful: [`Track`] (and [`TrackLayer`] for tonic servers).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};

use crate::ConnInfo;
use crate::pool::{Activity, InFlight};

/// Adds [`Track`] to a tonic server (`Server::builder().layer(TrackLayer)`): the
/// connection's [`Activity`] comes from the [`ConnInfo`] tonic puts in every request's
/// extensions (the stream of [`crate::BoundedListener::into_incoming`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct TrackLayer;

impl<S> tower_layer::Layer<S> for TrackLayer {
    type Service = Track<S>;

    fn layer(&self, inner: S) -> Track<S> {
        Track {
            inner,
            activity: None,
        }
    }
}

/// Counts a connection's requests in flight from the moment the service is called until
/// the response body has been handed to the connection in full (so a long stream, SSE
/// or gRPC streaming, keeps its connection busy), and graduates the connection from the
/// pending pool at its first response that is not a refusal ([`is_refusal`]).
#[derive(Clone, Debug)]
pub struct Track<S> {
    inner: S,
    /// The connection's activity, when known when the connection is served; otherwise
    /// read from each request's [`ConnInfo`].
    activity: Option<Arc<Activity>>,
}

impl<S> Track<S> {
    pub(crate) fn new(inner: S, activity: Arc<Activity>) -> Track<S> {
        Track {
            inner,
            activity: Some(activity),
        }
    }
}

/// Whether a response refuses its caller, so that answering it proves nothing about the
/// connection: HTTP 401 or 403, or a gRPC status `UNAUTHENTICATED` (16) or
/// `PERMISSION_DENIED` (7) in the headers (tonic sends an interceptor's refusal as a
/// trailers-only response, the status in the headers).
pub fn is_refusal<B>(response: &Response<B>) -> bool {
    if matches!(
        response.status(),
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
    ) {
        return true;
    }
    matches!(
        response
            .headers()
            .get("grpc-status")
            .map(http::HeaderValue::as_bytes),
        Some(b"16" | b"7")
    )
}

impl<S, ReqBody, ResBody> tower_service::Service<Request<ReqBody>> for Track<S>
where
    S: tower_service::Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = Response<TrackedBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let activity = self.activity.clone().or_else(|| {
            req.extensions()
                .get::<ConnInfo>()
                .and_then(|i| i.activity.clone())
        });
        let in_flight = activity.as_ref().map(Activity::start);
        let response = self.inner.call(req);
        Box::pin(async move {
            let response = response.await?;
            if let Some(f) = &in_flight
                && !is_refusal(&response)
            {
                f.activity().graduate();
            }
            Ok(response.map(|inner| TrackedBody {
                inner,
                _in_flight: in_flight,
            }))
        })
    }
}

pin_project_lite::pin_project! {
    /// A response body that keeps its request counted in flight until it is dropped.
    pub struct TrackedBody<B> {
        #[pin]
        inner: B,
        _in_flight: Option<InFlight>,
    }
}

impl<B: Body> Body for TrackedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
