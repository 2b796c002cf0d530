//! Feature `otel`: a request's `idem.http` span continues the caller's
//! W3C trace (`traceparent`) unless the application's own span already
//! carries one, and the call's `idem.call` span in it carries the outcome
//! and the hashed key. Spans are exported to memory and read back.

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::Request;
use http_body_util::BodyExt;
use idem_core::{Idempotency, MemoryStore};
use idem_http::IdempotencyLayer;
use idem_testkit::otel::{Traces, assert_call_in_server_span, attribute};
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState,
};
use tower::ServiceExt;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";
const KEY: &str = "order-7f3c";

fn app() -> Router {
    let idem = Idempotency::builder(MemoryStore::new()).build();
    Router::new()
        .route("/pay", post(|| async { "paid" }))
        .layer(IdempotencyLayer::new(idem))
}

/// POSTs to `/pay` with `key` and, if given, a `traceparent`; the body is
/// read whole, as a client would.
async fn pay(app: &Router, traceparent: Option<String>) -> String {
    let mut request = Request::post("/pay").header("idempotency-key", KEY);
    if let Some(tp) = traceparent {
        request = request.header("traceparent", tp);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::from("{}")).unwrap())
        .await
        .unwrap();
    assert!(response.status().is_success());
    let body = response.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(body.to_vec()).unwrap()
}

fn traceparent(trace: &str, parent: &str) -> String {
    format!("00-{trace}-{parent}-01")
}

#[tokio::test]
async fn a_request_continues_its_callers_trace_and_a_retry_replays_in_its_own() {
    let traces = Traces::install();
    let app = app();
    assert_eq!(pay(&app, Some(traceparent(TRACE, PARENT))).await, "paid");

    let http = traces.ended("idem.http", 1).await;
    let call = traces.ended("idem.call", 1).await;
    // idem.http is the request's server span, the caller's span (remote)
    // its parent; idem.call is its child, with the outcome and the key, hashed.
    let shown = assert_call_in_server_span(&http[0], &call[0], (TRACE, PARENT), "executed", KEY);
    assert!(http[0].parent_span_is_remote);

    // The retry, another trace of the client's: replayed, in that trace.
    let retry_trace = "0af7651916cd43dd8448eb211c80319c";
    assert_eq!(
        pay(&app, Some(traceparent(retry_trace, "b7ad6b7169203331"))).await,
        "paid"
    );
    let call = traces.ended("idem.call", 2).await;
    let retry = call
        .iter()
        .find(|s| s.span_context.trace_id() == TraceId::from_hex(retry_trace).unwrap())
        .expect("the retry's idem.call continues the retry's trace");
    assert_eq!(
        attribute(retry, "idem.outcome").as_deref(),
        Some("replayed")
    );
    // The same key shows the same way: retries correlate without it.
    assert_eq!(attribute(retry, "idem.key"), Some(shown));
}

#[tokio::test]
async fn a_request_without_traceparent_starts_a_trace() {
    let traces = Traces::install();
    let app = app();
    pay(&app, None).await;

    let http = traces.ended("idem.http", 1).await;
    let call = traces.ended("idem.call", 1).await;
    assert_eq!(http[0].parent_span_id, SpanId::INVALID);
    assert_eq!(http[0].span_kind, SpanKind::Server);
    assert_ne!(
        http[0].span_context.trace_id(),
        TraceId::from_hex(TRACE).unwrap()
    );
    assert_eq!(
        call[0].span_context.trace_id(),
        http[0].span_context.trace_id()
    );
    assert_eq!(call[0].parent_span_id, http[0].span_context.span_id());
}

#[tokio::test]
async fn a_malformed_traceparent_is_as_none() {
    let traces = Traces::install();
    let app = app();
    pay(&app, Some("00-not-a-trace-01".to_owned())).await;

    let http = traces.ended("idem.http", 1).await;
    assert_eq!(http[0].parent_span_id, SpanId::INVALID);
    assert_eq!(http[0].span_kind, SpanKind::Server);
}

/// An application's server span (tower-http's TraceLayer, say) has read
/// the request's trace context already: idem.http is its internal child,
/// and never a second server span.
#[tokio::test]
async fn under_an_applications_traced_span_the_layer_span_is_its_internal_child() {
    let traces = Traces::install();
    let app = app();
    let app_trace = TraceId::from_hex("11111111111111111111111111111111").unwrap();
    let server = tracing::info_span!("app.request", otel.kind = "server");
    let remote = SpanContext::new(
        app_trace,
        SpanId::from_hex("2222222222222222").unwrap(),
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    );
    server
        .set_parent(opentelemetry::Context::new().with_remote_span_context(remote))
        .unwrap();
    // The header names another trace: the application's span wins.
    pay(&app, Some(traceparent(TRACE, PARENT)))
        .instrument(server.clone())
        .await;
    drop(server);

    let outer = traces.ended("app.request", 1).await;
    let http = traces.ended("idem.http", 1).await;
    let call = traces.ended("idem.call", 1).await;
    assert_eq!(http[0].span_context.trace_id(), app_trace);
    assert_eq!(http[0].parent_span_id, outer[0].span_context.span_id());
    assert_eq!(http[0].span_kind, SpanKind::Internal);
    assert_eq!(call[0].span_context.trace_id(), app_trace);
}
