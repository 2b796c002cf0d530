//! `IdempotencyService`: what happens to one request, up to its claim. The
//! idempotent run itself is in `run`, the answers built from stored records
//! in `answer`.

use crate::config::Config;
use crate::key::{IdempotencyKey, key_from_headers};
use crate::prefer;
use crate::problem::ProblemKind;
use crate::run::Job;
use axum::body::Body;
use axum::extract::OriginalUri;
use futures_util::future::BoxFuture;
use http::header;
use http::{Request, Response};
use idem_core::{Fingerprint, Idempotency};
use idem_layer::settings::{Claim, MaxLease};
use idem_layer::task::{self, BytesBody, Inner, ReadError, TaskError, read_limited, take_ready};
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower_service::Service;
use tracing::Instrument;

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
    S: Service<Request<Body>, Response = Response<ResBody>> + Inner<Request<Body>, ResBody> + Clone,
    B: BytesBody,
    ResBody: BytesBody,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let inner = take_ready(&mut self.inner);
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
    B: BytesBody,
    ResBody: BytesBody,
{
    let response = inner.call(request.map(Body::new)).await?;
    Ok(response.map(Body::new))
}

async fn handle<S, B, ResBody>(
    inner: S,
    idem: Idempotency,
    cfg: Arc<Config>,
    mut request: Request<B>,
) -> Result<Response<Body>, S::Error>
where
    S: Inner<Request<Body>, ResBody>,
    B: BytesBody,
    ResBody: BytesBody,
{
    if !cfg.methods.contains(request.method()) {
        return passthrough(inner, request).await;
    }
    if let Some(bypass) = &cfg.bypass {
        let (parts, body) = request.into_parts();
        let skip = bypass(&parts);
        request = Request::from_parts(parts, body);
        if skip {
            tracing::trace!("bypassed: passing through unclaimed");
            return passthrough(inner, request).await;
        }
    }
    let span = tracing::info_span!(
        "idem.http",
        method = %request.method(),
        path = request.uri().path(),
        // Recorded only with `otel`, when this is the request's server span.
        otel.kind = tracing::field::Empty,
    );
    #[cfg(feature = "otel")]
    idem_layer::otel::continue_request(&span, request.headers());
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
    S: Inner<Request<Body>, ResBody>,
    B: BytesBody,
    ResBody: BytesBody,
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
        Ok(None) if cfg.settings.require_key => {
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
    let tenant = cfg
        .settings
        .tenant
        .tenant_of(&parts.headers, |hook| hook(&parts));
    let scope = idem_key::scope::compose_bytes(&cfg.scope, tenant.as_deref());

    let body = match read_limited(body, cfg.settings.max_request).await {
        Ok(body) => body,
        Err(ReadError::TooLarge) => {
            tracing::debug!(
                limit = cfg.settings.max_request,
                "refused: request body over the limit"
            );
            let detail = format!(
                "The request body is over the {}-byte limit of idempotent requests.",
                cfg.settings.max_request
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
    let wait = cfg.settings.wait_for(prefer::wait(&parts.headers));
    let accept_encoding = parts.headers.get(header::ACCEPT_ENCODING).cloned();
    let max_lease = parts.extensions.get::<MaxLease>().map(|m| m.0);
    parts.extensions.insert(IdempotencyKey(key.clone()));
    let request = Request::from_parts(parts, Body::from(body));

    let job = Job {
        inner,
        cfg: Arc::clone(&cfg),
        claim: Claim {
            idem,
            scope,
            key,
            fingerprint,
            max_lease,
        },
        accept_encoding,
        wait,
        request,
    };
    match task::run_until_answered(
        |reply| job.run(reply).in_current_span(),
        cfg.cancel_on_disconnect,
    )
    .await
    {
        Ok(answer) => answer,
        Err(TaskError::NoRuntime) => {
            tracing::error!(
                "IdempotencyLayer needs a Tokio runtime to run handlers: answering 500"
            );
            Ok(cfg.problem(
                ProblemKind::Internal,
                "The idempotency layer is misconfigured (no Tokio runtime); the request was not processed.",
                false,
            ))
        }
        Err(TaskError::NoAnswer) => {
            tracing::error!("the idempotent run ended without an answer: 500");
            Ok(cfg.problem(
                ProblemKind::Internal,
                "The idempotency layer failed; the request may have been processed.",
                false,
            ))
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
