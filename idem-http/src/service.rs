//! `IdempotencyService`: what happens to one request, up to its claim. The
//! idempotent run itself is in `run`, the answers built from stored records
//! in `answer`.

use crate::config::Config;
use crate::key::{IdempotencyKey, key_from_headers};
use crate::problem::ProblemKind;
use crate::run::Job;
use axum::body::Body;
use axum::extract::OriginalUri;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::header;
use http::{Request, Response};
use http_body::Body as HttpBody;
use http_body_util::{BodyExt, Limited};
use idem_core::{Fingerprint, Idempotency};
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::oneshot;
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
    S::Error: Send + 'static,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    if !cfg.methods.contains(request.method()) {
        return passthrough(inner, request).await;
    }
    if let Some(bypass) = &cfg.bypass {
        let (parts, body) = request.into_parts();
        let skip = bypass(&parts);
        let request = Request::from_parts(parts, body);
        if skip {
            tracing::trace!("bypassed: passing through unclaimed");
            return passthrough(inner, request).await;
        }
        return handle_traced(inner, idem, cfg, request).await;
    }
    handle_traced(inner, idem, cfg, request).await
}

async fn handle_traced<S, B, ResBody>(
    inner: S,
    idem: Idempotency,
    cfg: Arc<Config>,
    request: Request<B>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
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
    S::Error: Send + 'static,
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
    let tenant = cfg.tenant.tenant_of(&parts);
    let scope = idem_key::scope::compose(&cfg.scope, tenant.as_deref());

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
    let accept_encoding = parts.headers.get(header::ACCEPT_ENCODING).cloned();
    parts.extensions.insert(IdempotencyKey(key.clone()));
    let request = Request::from_parts(parts, Body::from(body));

    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        tracing::error!("IdempotencyLayer needs a Tokio runtime to run handlers: answering 500");
        return Ok(cfg.problem(
            ProblemKind::Internal,
            "The idempotency layer is misconfigured (no Tokio runtime); the request was not processed.",
            false,
        ));
    };
    let (reply, answer) = oneshot::channel();
    let job = Job {
        inner,
        idem,
        cfg: Arc::clone(&cfg),
        scope,
        key,
        fingerprint,
        accept_encoding,
        request,
    };
    // The run is a task of its own: hyper drops this future when the client
    // goes away, and a started handler must not stop half-way through its
    // effects (unless the user asked for that, below).
    let task = runtime.spawn(job.run(reply).in_current_span());
    let abort = cfg
        .cancel_on_disconnect
        .then(|| AbortOnDrop(Some(task.abort_handle())));
    let answer = answer.await;
    if let Some(mut abort) = abort {
        // Answered: from here on the client's body drives cancellation.
        abort.0 = None;
    }
    match answer {
        Ok(answer) => answer,
        Err(_) => {
            tracing::error!("the idempotent run ended without an answer: 500");
            Ok(cfg.problem(
                ProblemKind::Internal,
                "The idempotency layer failed; the request may have been processed.",
                false,
            ))
        }
    }
}

/// Aborts the run's task when the service future is dropped before the
/// answer came (`cancel_on_disconnect(true)`). As for any call dropped
/// mid-body, the key stays in flight until its lease ends (the handler may
/// have made effects); the retry after that runs it again as a re-run.
struct AbortOnDrop(Option<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(handle) = self.0.take() {
            tracing::debug!("client gone before the answer: cancelling the handler");
            handle.abort();
        }
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
