//! HTTP on Lambda (API Gateway REST and HTTP APIs, function URLs, ALB):
//! idem-http's `Idempotency-Key` layer on a `lambda_http` service.
//!
//! `lambda_http` turns each event into an [`http::Request`] and the
//! response back into the event's answer, so the layer works on Lambda as
//! it does behind axum: the first request with a key runs the handler, a
//! retry gets the stored response with `Idempotent-Replayed: true`, a
//! retry while the first still runs gets `409` with `Retry-After`, the
//! same key on another request `422` (idem-http's documentation has the
//! whole table).
//!
//! ```no_run
//! use idem_core::{Idempotency, MemoryStore};
//! use idem_lambda::http::{IdempotencyLayer, Request, run, service_fn};
//!
//! # async fn main_() -> Result<(), idem_lambda::http::lambda_http::Error> {
//! let idem = Idempotency::builder(MemoryStore::new()).namespace("payments").build();
//! let create = service_fn(|req: Request| async move {
//!     // … charge the card: once per Idempotency-Key …
//!     Ok::<_, std::convert::Infallible>(
//!         http::Response::builder().status(201).body(idem_lambda::http::Body::from(req.into_body())).unwrap(),
//!     )
//! });
//! run(IdempotencyLayer::new(idem).require_key(true), create).await
//! # }
//! ```
//!
//! **Lease.** [`run`] and [`service`] bound each request's claim by its
//! invocation's deadline, by the rule the SQS handler follows ([`plan`]):
//! the lease is the shorter of the layer's (or the runtime's) and the time
//! left, so a request cut off by the function's timeout frees its key for
//! the client's retry at that timeout, not one configured lease later. An
//! invocation without a deadline, or with one that has passed already
//! (cargo-lambda's local emulator sends 1970), keeps the configured lease,
//! with a `tracing` warning. The bound travels to the layer as a
//! [`MaxLease`] request extension.

use crate::deadline::{LeaseSource, deadline_of, plan};
use lambda_http::Error as LambdaError;
use lambda_http::RequestExt;
use lambda_runtime::Diagnostic;
use std::fmt;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};
use tower_layer::Layer;
use tower_service::Service;

pub use idem_http::{IdempotencyLayer, IdempotencyService, MaxLease};
pub use lambda_http;

/// The request a handler behind the layer gets: the event as an
/// [`http::Request`], its body read (the layer fingerprints it), with
/// `lambda_http`'s extensions kept (`lambda_http::RequestExt`: path and
/// query parameters, the request context, the Lambda context).
pub type Request = http::Request<Body>;

/// The body of a [`Request`], and of a response a handler makes.
pub type Body = axum::body::Body;

/// A handler from an async function of a [`Request`] (`tower::service_fn`).
pub fn service_fn<F>(f: F) -> tower::util::ServiceFn<F> {
    tower::service_fn(f)
}

/// `service` behind `layer`, each request's lease bounded by its
/// invocation's deadline: the service `lambda_http::run` takes, as [`run`]
/// does.
pub fn service<S>(layer: &IdempotencyLayer, service: S) -> DeadlineService<IdempotencyService<S>> {
    DeadlineService {
        inner: layer.layer(service),
    }
}

/// A service that gives each request a [`MaxLease`] of the time left
/// before its invocation's deadline (from the Lambda context `lambda_http`
/// puts in the request's extensions), for the idem layer inside it. Built
/// by [`service`].
#[derive(Clone, Debug)]
pub struct DeadlineService<S> {
    inner: S,
}

impl<S, B> Service<http::Request<B>> for DeadlineService<S>
where
    S: Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        bound_by_deadline(&mut request, SystemTime::now());
        self.inner.call(request)
    }
}

/// Inserts the [`MaxLease`] of `request`'s invocation, or warns that its
/// deadline cannot bound the lease.
fn bound_by_deadline<B>(request: &mut http::Request<B>, now: SystemTime) {
    let deadline = request.lambda_context_ref().and_then(deadline_of);
    // No stop margin: an HTTP request is answered when it ends, not cut short.
    match plan(deadline, now, Duration::MAX, Duration::ZERO).source {
        LeaseSource::Deadline { remaining } => {
            request.extensions_mut().insert(MaxLease(remaining));
        }
        LeaseSource::NoDeadline => tracing::warn!(
            "the request has no invocation deadline: its claim gets the configured lease"
        ),
        LeaseSource::PastDeadline { by } => tracing::warn!(
            past_ms = by.as_millis() as u64,
            "the invocation's deadline has passed already (a local emulator, or a clock far \
             off): the request's claim gets the configured lease"
        ),
    }
}

/// Runs `service` behind `layer` on Lambda (`lambda_http::run`): one event
/// at a time, until the runtime stops the process.
pub async fn run<S, ResBody>(layer: IdempotencyLayer, service: S) -> Result<(), LambdaError>
where
    S: Service<Request, Response = http::Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: fmt::Debug + Into<Diagnostic> + Send + 'static,
    ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    lambda_http::run(self::service(&layer, service)).await
}
