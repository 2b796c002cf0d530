//! Feature `otel`: a protected call's `idem.grpc` span continues the
//! caller's W3C trace (`traceparent` metadata), and the call's `idem.call`
//! span in it carries the outcome and the hashed key. Spans are exported
//! to memory and read back.

use crate::support::{CREATE_PAYMENT, TestServer, payment};
use idem_core::{Idempotency, MemoryStore};
use idem_grpc::IdempotencyLayer;
use idem_testkit::Ledger;
use idem_testkit::otel::{Traces, assert_call_in_server_span, attribute};
use opentelemetry::trace::{SpanId, SpanKind, TraceId};

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";
const KEY: &str = "payment-5d1e";

async fn server() -> TestServer {
    let idem = Idempotency::builder(MemoryStore::new()).build();
    TestServer::start(
        IdempotencyLayer::new(idem).unary(CREATE_PAYMENT),
        Ledger::new(),
    )
    .await
}

#[tokio::test]
async fn a_call_continues_its_callers_trace_and_a_retry_replays_in_its_own() {
    let traces = Traces::install();
    let server = server().await;
    let raw = server.raw();
    let tp = format!("00-{TRACE}-{PARENT}-01");
    let first = raw
        .call(
            CREATE_PAYMENT,
            &[("idempotency-key", KEY), ("traceparent", &tp)],
            &payment(100),
        )
        .await;
    assert_eq!(first.grpc_status().as_deref(), Some("0"));

    let grpc = traces.ended("idem.grpc", 1).await;
    let call = traces.ended("idem.call", 1).await;
    // idem.grpc is the call's server span, the caller's span its parent;
    // idem.call is its child, with the outcome and the key, hashed.
    let shown = assert_call_in_server_span(&grpc[0], &call[0], (TRACE, PARENT), "executed", KEY);

    // The retry, another trace of the client's: replayed, in that trace.
    let retry_trace = "0af7651916cd43dd8448eb211c80319c";
    let tp = format!("00-{retry_trace}-b7ad6b7169203331-01");
    let retry = raw
        .call(
            CREATE_PAYMENT,
            &[("idempotency-key", KEY), ("traceparent", &tp)],
            &payment(100),
        )
        .await;
    assert!(retry.replayed());
    let call = traces.ended("idem.call", 2).await;
    let retry = call
        .iter()
        .find(|s| s.span_context.trace_id() == TraceId::from_hex(retry_trace).unwrap())
        .expect("the retry's idem.call continues the retry's trace");
    assert_eq!(
        attribute(retry, "idem.outcome").as_deref(),
        Some("replayed")
    );
    assert_eq!(attribute(retry, "idem.key"), Some(shown));
    assert_eq!(server.ledger.count(KEY), 1);
}

#[tokio::test]
async fn a_call_without_traceparent_starts_a_trace() {
    let traces = Traces::install();
    let server = server().await;
    let answer = server
        .raw()
        .call(CREATE_PAYMENT, &[("idempotency-key", KEY)], &payment(100))
        .await;
    assert_eq!(answer.grpc_status().as_deref(), Some("0"));

    let grpc = traces.ended("idem.grpc", 1).await;
    let call = traces.ended("idem.call", 1).await;
    assert_eq!(grpc[0].parent_span_id, SpanId::INVALID);
    assert_eq!(grpc[0].span_kind, SpanKind::Server);
    assert_ne!(
        grpc[0].span_context.trace_id(),
        TraceId::from_hex(TRACE).unwrap()
    );
    assert_eq!(
        call[0].span_context.trace_id(),
        grpc[0].span_context.trace_id()
    );
    assert_eq!(call[0].parent_span_id, grpc[0].span_context.span_id());
}
