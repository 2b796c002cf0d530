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
//! **Lease.** A request's claim has the runtime's lease, not one bounded by
//! the invocation's deadline as the SQS handler's are: build the
//! `Idempotency` of an HTTP function with a lease no longer than the
//! function's timeout, so that a request cut off by the timeout frees its
//! key for the client's retry within one timeout.

use lambda_http::Error as LambdaError;
use lambda_runtime::Diagnostic;
use std::fmt;
use tower_layer::Layer;
use tower_service::Service;

pub use idem_http::{IdempotencyLayer, IdempotencyService};
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

/// `service` behind `layer`: the service `lambda_http::run` takes, as
/// [`run`] does.
pub fn service<S>(layer: &IdempotencyLayer, service: S) -> IdempotencyService<S> {
    layer.layer(service)
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
    lambda_http::run(layer.layer(service)).await
}
