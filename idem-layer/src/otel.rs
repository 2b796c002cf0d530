//! A request's span continues the caller's trace (feature `otel`): the W3C
//! trace context (`traceparent`, `tracestate`) an HTTP request's headers or
//! a gRPC call's metadata carry, read with idem-core's W3C propagator
//! ([`idem_core::otel::remote_context`]).
//!
//! The layer's span (`idem.http`, `idem.grpc`) is usually opened inside
//! the application's own server span (tower-http's `TraceLayer`, or a
//! tonic interceptor's span), which has read the same headers already:
//! then it is that span's internal child and takes nothing from the
//! headers, so a request never has two server spans. Only when the span
//! it is opened in carries no trace is the layer's span the request's
//! server span (`otel.kind = "server"`), the child of the caller's span,
//! or the root of a new trace when the request carries none.

use http::HeaderMap;
use opentelemetry::trace::TraceContextExt;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Makes `span`, just opened in the current span and not entered yet, the
/// server span of a request with `headers` when the current span carries
/// no trace: records `otel.kind = "server"` (a field `span` declares
/// empty) and continues the caller's trace from the headers. Under a span
/// that carries a trace it does nothing: `span` is an internal child.
///
/// Without `tracing-opentelemetry`'s layer it does nothing either.
///
/// ```
/// let span = tracing::info_span!("idem.http", otel.kind = tracing::field::Empty);
/// let mut headers = http::HeaderMap::new();
/// headers.insert(
///     "traceparent",
///     http::HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
/// );
/// // No subscriber here: nothing to continue, and nothing fails.
/// idem_layer::otel::continue_request(&span, &headers);
/// ```
pub fn continue_request(span: &tracing::Span, headers: &HeaderMap) {
    if span.is_disabled() || current_has_trace() {
        return;
    }
    // Before the span starts: its kind is fixed when it does.
    span.record("otel.kind", "server");
    // A value that is not visible ASCII is no trace context: as if absent.
    let remote = idem_core::otel::remote_context(|name| headers.get(name)?.to_str().ok());
    idem_core::otel::continue_remote(span, remote);
}

/// Whether the current span (the one the layer's span was opened in)
/// belongs to a trace already.
fn current_has_trace() -> bool {
    let current = tracing::Span::current();
    !current.is_disabled() && current.context().span().span_context().is_valid()
}
