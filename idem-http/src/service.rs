//! `IdempotencyService`: what happens to one request.

use crate::key::{IdempotencyKey, key_from_headers};
use crate::layer::Config;
use crate::problem::ProblemKind;
use crate::scope;
use crate::stored::{FORMAT_VERSION, StoredResponse};
use crate::{IDEMPOTENCY_RETENTION, IDEMPOTENT_REPLAYED};
use axum::body::Body;
use axum::extract::OriginalUri;
use bytes::{Bytes, BytesMut};
use futures_util::future::{BoxFuture, FutureExt};
use futures_util::stream::{self, StreamExt};
use http::header::{HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body::{Body as HttpBody, Frame};
use http_body_util::{BodyExt, BodyStream, Limited, StreamBody};
use idem_core::{Error, Fingerprint, Idempotency, KeyError, KeyPart, Outcome};
use std::any::Any;
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower_service::Service;
use tracing::Instrument;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The future of [`IdempotencyService`]: the response, or the inner
/// service's own error (never one of the layer's: those are responses).
pub type ResponseFuture<E> = BoxFuture<'static, Result<Response<Body>, E>>;

/// The service made by [`IdempotencyLayer`](crate::IdempotencyLayer); see
/// the [crate documentation](crate) for what it does.
///
/// It takes `http::Request<B>` for any body `B` (axum's, hyper's
/// `Incoming`, …), hands the inner service an `http::Request<axum::body::Body>`
/// and answers `http::Response<axum::body::Body>`.
///
/// ```
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_http::{IdempotencyLayer, IdempotencyService};
/// use tower_layer::Layer;
///
/// let idem = Idempotency::builder(MemoryStore::new()).build();
/// let inner = tower::service_fn(|_req: http::Request<axum::body::Body>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::from("ok")))
/// });
/// let svc: IdempotencyService<_> = IdempotencyLayer::new(idem).layer(inner);
/// ```
pub struct IdempotencyService<S> {
    inner: S,
    idem: Idempotency,
    config: Arc<Config>,
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, idem: Idempotency, config: Arc<Config>) -> Self {
        IdempotencyService {
            inner,
            idem,
            config,
        }
    }
}

impl<S: Clone> Clone for IdempotencyService<S> {
    fn clone(&self) -> Self {
        IdempotencyService {
            inner: self.inner.clone(),
            idem: self.idem.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("idem", &self.idem)
            .finish_non_exhaustive()
    }
}

impl<S, B, ResBody> Service<Request<B>> for IdempotencyService<S>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The service that was driven to readiness handles this request.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        let idem = self.idem.clone();
        let config = Arc::clone(&self.config);
        Box::pin(handle(inner, idem, config, request))
    }
}

/// Why the run body did not produce a response to store.
enum RunError<E> {
    /// The runtime refused or failed (in flight, mismatch, store down, …).
    Idem(Error),
    /// A response to send as it is, with the key released: a status that is
    /// not stored, an oversized body, a panic turned into a 500.
    Respond(Response<Body>),
    /// The inner service's own error, passed on (the key is released).
    Inner(E),
}

impl<E> From<Error> for RunError<E> {
    fn from(e: Error) -> Self {
        RunError::Idem(e)
    }
}

async fn passthrough<S, B, ResBody>(
    mut inner: S,
    request: Request<B>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let response = inner.call(request.map(Body::new)).await?;
    Ok(response.map(Body::new))
}

async fn handle<S, B, ResBody>(
    inner: S,
    idem: Idempotency,
    cfg: Arc<Config>,
    request: Request<B>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    if !cfg.methods.contains(request.method()) {
        return passthrough(inner, request).await;
    }
    let span = tracing::info_span!(
        "idem.http",
        method = %request.method(),
        path = request.uri().path()
    );
    handle_idempotent(inner, idem, cfg, request)
        .instrument(span)
        .await
}

async fn handle_idempotent<S, B, ResBody>(
    inner: S,
    idem: Idempotency,
    cfg: Arc<Config>,
    request: Request<B>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    if request.extensions().get::<IdempotencyKey>().is_some() {
        // An outer IdempotencyLayer already holds this request's key: claiming
        // it again here would find it in flight and answer 409.
        tracing::trace!("already under an outer idempotency layer: passing through");
        return passthrough(inner, request).await;
    }
    let (mut parts, body) = request.into_parts();
    let key = match key_from_headers(&parts.headers) {
        Ok(Some(key)) => key,
        Ok(None) if cfg.require_key => {
            tracing::debug!("refused: Idempotency-Key required but missing");
            return Ok(cfg.problem(
                ProblemKind::MissingKey,
                "This endpoint requires an Idempotency-Key header: send a fresh unique value (e.g. a UUID) per operation, and the same value when retrying it.",
                false,
            ));
        }
        Ok(None) => {
            tracing::trace!("no Idempotency-Key: passing through");
            return passthrough(inner, Request::from_parts(parts, body)).await;
        }
        Err(e) => {
            tracing::debug!(error = %e, "refused: malformed Idempotency-Key");
            return Ok(cfg.problem(ProblemKind::InvalidKey, &e.to_string(), false));
        }
    };
    let tenant = cfg.tenant.as_ref().and_then(|hook| hook(&parts));
    let scope = scope::compose(&cfg.scope, tenant.as_deref());

    let body = match read_request_body(body, cfg.max_request_body).await {
        Ok(body) => body,
        Err(ReadError::TooLarge) => {
            tracing::debug!(
                limit = cfg.max_request_body,
                "refused: request body over the limit"
            );
            let detail = format!(
                "The request body is over the {}-byte limit of idempotent requests.",
                cfg.max_request_body
            );
            return Ok(cfg.problem(ProblemKind::RequestTooLarge, &detail, false));
        }
        Err(ReadError::Failed(e)) => {
            tracing::debug!(error = %e, "refused: the request body could not be read");
            return Ok(cfg.problem(
                ProblemKind::UnreadableRequest,
                "The request body could not be read.",
                false,
            ));
        }
    };
    let fingerprint = request_fingerprint(&parts, &body);
    parts.extensions.insert(IdempotencyKey(key.clone()));
    let request = Request::from_parts(parts, Body::from(body));

    let mut call = idem
        .call(&scope, key.as_str())
        .fingerprint_raw(fingerprint)
        .ttl(cfg.retention)
        .wait(cfg.wait);
    if let Some(lease) = cfg.lease {
        call = call.lease(lease);
    }
    let config: &Config = &cfg;
    match call
        .run_outcome(move || execute(inner, request, config))
        .await
    {
        Ok((stored, Outcome::Replayed)) => {
            tracing::debug!(status = stored.status, "replaying the stored response");
            Ok(replay(stored, config))
        }
        Ok((stored, outcome)) => {
            tracing::debug!(%outcome, status = stored.status, "handler ran; response stored");
            Ok(first_response(stored, config))
        }
        Err(RunError::Respond(response)) => Ok(response),
        Err(RunError::Inner(e)) => Err(e),
        Err(RunError::Idem(e)) => Ok(idem_error(e, config)),
    }
}

/// Runs the handler once, and decides whether its response is stored.
async fn execute<S, ResBody>(
    mut inner: S,
    request: Request<Body>,
    cfg: &Config,
) -> Result<StoredResponse, RunError<S::Error>>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    // A panic in the handler becomes a 500 problem here, so the key is
    // released (by the Err) and the client gets an answer instead of a
    // reset connection.
    let outcome = AssertUnwindSafe(async move { inner.call(request).await })
        .catch_unwind()
        .await;
    let response = match outcome {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => {
            tracing::debug!("the inner service failed; key released");
            return Err(RunError::Inner(e));
        }
        Err(panic) => {
            tracing::error!(
                panic = panic_message(panic.as_ref()),
                "the handler panicked: answering 500 and releasing the Idempotency-Key"
            );
            return Err(RunError::Respond(cfg.problem(
                ProblemKind::HandlerPanicked,
                "The request failed and was not recorded; it is safe to retry with the same Idempotency-Key.",
                false,
            )));
        }
    };
    let status = response.status();
    if !is_stored(status) {
        tracing::debug!(
            status = status.as_u16(),
            "status is not stored: key released, a retry runs the handler again"
        );
        return Err(RunError::Respond(response.map(Body::new)));
    }
    let (parts, body) = response.into_parts();
    match buffer_response(Body::new(body), cfg.max_response_body).await {
        Buffered::Complete(bytes) => Ok(StoredResponse::new(parts, bytes, cfg.replay_set_cookie)),
        Buffered::TooLarge(body) => {
            tracing::debug!(
                limit = cfg.max_response_body,
                "response over the size limit: streamed as is, not stored, key released"
            );
            Err(RunError::Respond(Response::from_parts(parts, body)))
        }
        Buffered::Failed(e) => {
            tracing::warn!(error = %e, "the response body failed: answering 500 and releasing the key");
            Err(RunError::Respond(cfg.problem(
                ProblemKind::ResponseFailed,
                "The response could not be produced; retry with the same Idempotency-Key.",
                false,
            )))
        }
    }
}

/// Which statuses are stored and replayed: 2xx, 3xx and 4xx except 408,
/// 409, 425 and 429 (transient: the client is expected to retry). 1xx
/// (upgrades included) and 5xx release the key.
fn is_stored(status: StatusCode) -> bool {
    match status.as_u16() {
        408 | 409 | 425 | 429 => false,
        s => (200..500).contains(&s),
    }
}

/// SHA-256 over method, path, query and body, each length-prefixed. The
/// path is the one the client sent, also under a `Router::nest` (which strips
/// its prefix from the URI the inner router sees).
fn request_fingerprint(parts: &http::request::Parts, body: &[u8]) -> Fingerprint {
    let uri = parts
        .extensions
        .get::<OriginalUri>()
        .map_or(&parts.uri, |original| &original.0);
    Fingerprint::of_parts(&[
        parts.method.as_str().as_bytes(),
        uri.path().as_bytes(),
        uri.query().unwrap_or("").as_bytes(),
        body,
    ])
}

enum ReadError {
    TooLarge,
    Failed(BoxError),
}

async fn read_request_body<B>(body: B, limit: usize) -> Result<Bytes, ReadError>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > u64::try_from(limit).unwrap_or(u64::MAX) {
        return Err(ReadError::TooLarge);
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ReadError::TooLarge),
        Err(e) => Err(ReadError::Failed(e)),
    }
}

enum Buffered {
    Complete(Bytes),
    /// Over the limit: the whole body (what was read, then the rest).
    TooLarge(Body),
    Failed(axum::Error),
}

async fn buffer_response(mut body: Body, limit: usize) -> Buffered {
    if body.size_hint().lower() > u64::try_from(limit).unwrap_or(u64::MAX) {
        return Buffered::TooLarge(body);
    }
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut total = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(e) => return Buffered::Failed(e),
        };
        // Trailers are not stored (nor replayed).
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total = total.saturating_add(data.len());
        chunks.push(data);
        if total > limit {
            let head = stream::iter(chunks.into_iter().map(|c| Ok(Frame::data(c))));
            let rest = BodyStream::new(body);
            return Buffered::TooLarge(Body::new(StreamBody::new(head.chain(rest))));
        }
    }
    Buffered::Complete(match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.swap_remove(0),
        _ => {
            let mut all = BytesMut::with_capacity(total);
            for c in chunks {
                all.extend_from_slice(&c);
            }
            all.freeze()
        }
    })
}

fn retention_header(cfg: &Config, response: &mut Response<Body>) {
    if cfg.advertise_retention {
        response.headers_mut().insert(
            IDEMPOTENCY_RETENTION,
            HeaderValue::from(cfg.retention.as_secs()),
        );
    }
}

/// The response for the request that ran the handler: exactly what the
/// handler answered (every header, `Set-Cookie` included).
fn first_response(stored: StoredResponse, cfg: &Config) -> Response<Body> {
    let mut response = match stored.live {
        Some(live) => Response::from_parts(live.parts, Body::from(live.body)),
        // Not reached: the runtime hands back the value the body returned.
        None => match rebuild(&stored) {
            Ok(response) => response,
            Err(why) => return corrupt(why, cfg),
        },
    };
    retention_header(cfg, &mut response);
    response
}

/// A replay: the stored status, headers and body, marked as a replay.
fn replay(stored: StoredResponse, cfg: &Config) -> Response<Body> {
    let mut response = match rebuild(&stored) {
        Ok(response) => response,
        Err(why) => return corrupt(why, cfg),
    };
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    retention_header(cfg, &mut response);
    response
}

fn corrupt(why: String, cfg: &Config) -> Response<Body> {
    tracing::error!(reason = %why, "a stored response cannot be replayed");
    cfg.problem(
        ProblemKind::Internal,
        "The stored response for this Idempotency-Key cannot be replayed.",
        false,
    )
}

fn rebuild(stored: &StoredResponse) -> Result<Response<Body>, String> {
    if stored.version != FORMAT_VERSION {
        return Err(format!("unknown record format version {}", stored.version));
    }
    let status = StatusCode::from_u16(stored.status)
        .map_err(|_| format!("invalid stored status {}", stored.status))?;
    let body = stored
        .body
        .to_bytes()
        .map_err(|e| format!("stored body: {e}"))?;
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    for (name, value) in &stored.headers {
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|e| format!("stored header name {name:?}: {e}"))?;
        let value = value
            .to_bytes()
            .map_err(|e| format!("stored header {name}: {e}"))
            .and_then(|v| {
                HeaderValue::from_maybe_shared(v).map_err(|e| format!("stored header {name}: {e}"))
            })?;
        headers.append(name, value);
    }
    Ok(response)
}

/// Maps a runtime error to the layer's answer.
fn idem_error(e: Error, cfg: &Config) -> Response<Body> {
    match e {
        Error::InProgress { .. } => {
            tracing::debug!("a request with this key is in flight: 409");
            cfg.problem(
                ProblemKind::KeyInUse,
                "A request with this Idempotency-Key is being processed; retry after the Retry-After delay to get its response.",
                true,
            )
        }
        Error::FingerprintMismatch => {
            tracing::debug!("key reused with another request: 422");
            cfg.problem(
                ProblemKind::KeyReused,
                "This Idempotency-Key was already used with a different request (method, path, query or body); use a new key for a new operation.",
                false,
            )
        }
        Error::Unavailable { .. } => {
            tracing::warn!(error = %e, "idempotency store unavailable: 503, handler not run");
            cfg.problem(
                ProblemKind::StoreUnavailable,
                "The request was not processed because the idempotency store is unavailable; retry later with the same Idempotency-Key.",
                true,
            )
        }
        Error::InvalidKey(ref k) if key_part(k) == Some(KeyPart::Key) => {
            tracing::debug!(error = %e, "key refused by the runtime: 400");
            cfg.problem(ProblemKind::InvalidKey, &k.to_string(), false)
        }
        other => {
            tracing::error!(error = %other, "idempotency layer failure: 500");
            cfg.problem(
                ProblemKind::Internal,
                "The idempotency layer failed; the request may not have been processed.",
                false,
            )
        }
    }
}

fn key_part(e: &KeyError) -> Option<KeyPart> {
    match e {
        KeyError::Empty { part }
        | KeyError::TooLong { part, .. }
        | KeyError::ControlChar { part, .. } => Some(*part),
        _ => None,
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> &str {
    if let Some(s) = panic.downcast_ref::<&'static str>() {
        s
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s
    } else {
        "(non-string panic payload)"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_statuses() {
        for s in [200, 201, 204, 303, 400, 404, 410, 422] {
            assert!(is_stored(StatusCode::from_u16(s).unwrap()), "{s}");
        }
        for s in [101, 408, 409, 425, 429, 500, 502, 503, 504] {
            assert!(!is_stored(StatusCode::from_u16(s).unwrap()), "{s}");
        }
    }

    #[test]
    fn fingerprint_covers_method_path_query_body() {
        let fp = |m: &str, uri: &str, body: &[u8]| {
            let (parts, ()) = Request::builder()
                .method(m)
                .uri(uri)
                .body(())
                .unwrap()
                .into_parts();
            request_fingerprint(&parts, body)
        };
        let base = fp("POST", "/a?x=1", b"{}");
        assert_eq!(base, fp("POST", "/a?x=1", b"{}"));
        assert_ne!(base, fp("PATCH", "/a?x=1", b"{}"));
        assert_ne!(base, fp("POST", "/b?x=1", b"{}"));
        assert_ne!(base, fp("POST", "/a?x=2", b"{}"));
        assert_ne!(base, fp("POST", "/a?x=1", b"{ }"));
    }

    #[tokio::test]
    async fn oversized_response_keeps_every_byte() {
        let chunks: Vec<Result<Frame<Bytes>, axum::Error>> = (0..10)
            .map(|i| Ok(Frame::data(Bytes::from(vec![i as u8; 100]))))
            .collect();
        let body = Body::new(StreamBody::new(stream::iter(chunks)));
        let Buffered::TooLarge(body) = buffer_response(body, 250).await else {
            panic!("expected TooLarge");
        };
        let all = body.collect().await.unwrap().to_bytes();
        assert_eq!(all.len(), 1000);
        assert_eq!(all[999], 9);
        assert_eq!(all[0], 0);
    }
}
