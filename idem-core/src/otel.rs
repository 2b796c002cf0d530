//! One trace across the outbox (feature `otel`): the W3C trace context a
//! message carries from the call that staged it, through the relay, to
//! the consumer that handles it, and the spans of the OpenTelemetry
//! messaging semantic conventions around it ([`SEMCONV`]).
//!
//! idem writes `tracing` spans; `tracing-opentelemetry`'s layer turns them
//! into OpenTelemetry spans. Without that layer (or without a subscriber
//! that takes INFO spans) every function here does nothing and messages
//! carry no headers. The W3C propagator is used directly, never the global
//! one (which is a no-op until an application sets it), so a message
//! always carries `traceparent` when its call was traced.
//!
//! The model, as the conventions draw it for a message created in one
//! place and sent from another:
//! - **create**: when a call's result is stored with its messages, one
//!   `create` span per message (kind producer), a child of the call's
//!   span; its context is stored with the message ([`TRACE_HEADERS`]).
//!   A replay stores nothing and creates nothing.
//! - **send**: the relay's publish of a batch (kind producer, in the
//!   relay's own trace), **linked** to each message's `create` span: one
//!   send carries many messages from many traces, so it can be the child
//!   of none of them. The stored context is published unchanged.
//! - **process**: the consumer's handling of a message (kind consumer),
//!   **linked** to its `create` span by default: a redelivered message is
//!   handled in several traces, and a batch comes from many. A consumer can
//!   opt in to continuing the producer's trace as the span's parent
//!   instead, for single-message handling.
//!
//! ```
//! use idem_core::otel;
//! // A message without trace headers continues nothing.
//! assert!(otel::remote_context(|_| None).is_none());
//! let carried = otel::remote_context(|name| {
//!     (name == "traceparent").then_some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
//! });
//! assert_eq!(
//!     carried.map(|c| c.trace_id().to_string()).as_deref(),
//!     Some("4bf92f3577b34da6a3ce929d0e0e4736")
//! );
//! ```

use crate::outbox::{OutboxMessage, TRACE_HEADERS};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{SpanContext, TraceContextExt};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The version of the OpenTelemetry semantic conventions the spans follow
/// (the messaging conventions are still "Development" there: names may
/// change in a later version).
pub const SEMCONV: &str = "1.42.0";

/// The W3C trace context of `span`, as message headers: empty when the
/// span is disabled or has no OpenTelemetry context (no
/// `tracing-opentelemetry` layer).
///
/// ```
/// // No subscriber here: nothing to carry.
/// assert!(idem_core::otel::headers_of(&tracing::Span::current()).is_empty());
/// ```
pub fn headers_of(span: &tracing::Span) -> Vec<(String, String)> {
    if span.is_disabled() {
        return Vec::new();
    }
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return Vec::new();
    }
    let mut headers = Headers(Vec::with_capacity(2));
    TraceContextPropagator::new().inject_context(&cx, &mut headers);
    headers.0
}

/// The remote span context carried by a message or request whose header
/// values `get` returns by name (`traceparent`, `tracestate`); `None` when
/// there is none or it does not parse.
pub fn remote_context<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Option<SpanContext> {
    let carrier = Lookup {
        traceparent: Some(get(TRACE_HEADERS[0])?),
        tracestate: get(TRACE_HEADERS[1]),
    };
    let cx = TraceContextPropagator::new().extract(&carrier);
    let sc = cx.span().span_context().clone();
    sc.is_valid().then_some(sc)
}

/// Makes `span` continue `remote` as its parent (a request's
/// `traceparent`), unless the current span, which `span` was opened in,
/// carries a trace already (an application's tracing layer that extracted
/// the header first). Call it before entering `span`.
pub fn continue_remote(span: &tracing::Span, remote: Option<SpanContext>) {
    let Some(remote) = remote else { return };
    if span.is_disabled() || has_local_parent() {
        return;
    }
    let cx = opentelemetry::Context::new().with_remote_span_context(remote);
    // Fails only once the span has started exporting, which it has not.
    let _ = span.set_parent(cx);
}

/// Links `span` to `remote` (the span that created a message), or makes it
/// the parent when `as_parent` (a consumer's opt-in).
pub fn link_or_parent(span: &tracing::Span, remote: Option<SpanContext>, as_parent: bool) {
    let Some(remote) = remote else { return };
    if span.is_disabled() {
        return;
    }
    if as_parent {
        let cx = opentelemetry::Context::new().with_remote_span_context(remote);
        let _ = span.set_parent(cx);
    } else {
        span.add_link(remote);
    }
}

/// Sets attribute `key` on `span`'s OpenTelemetry span.
pub fn attribute(span: &tracing::Span, key: &'static str, value: impl Into<opentelemetry::Value>) {
    if !span.is_disabled() {
        span.set_attribute(key, value);
    }
}

/// The relay's `send` span for one batch to a sink whose
/// `messaging.system` is `system`: linked to every message's `create`
/// span, named for the destination when the batch has one.
pub fn send_span(system: &str, batch: &[OutboxMessage]) -> tracing::Span {
    if !tracing::level_enabled!(tracing::Level::INFO) {
        return tracing::Span::none();
    }
    let destination = match batch.split_first() {
        Some((first, rest)) if rest.iter().all(|m| m.topic == first.topic) => {
            Some(first.topic.as_str())
        }
        _ => None,
    };
    let span = tracing::info_span!(
        "send",
        otel.name = destination.map_or_else(|| "send".to_owned(), |d| format!("send {d}")),
        otel.kind = "producer",
        messaging.system = system,
        messaging.operation.type = "send",
        messaging.operation.name = "send",
        messaging.destination.name = destination,
        messaging.batch.message_count = batch.len(),
        messaging.message.id = (batch.len() == 1).then(|| batch[0].id.as_str()),
    );
    for m in batch {
        if let Some(sc) = remote_context(|n| m.header(n)) {
            span.add_link(sc);
        }
    }
    span
}

/// Opens the messaging conventions' `create` span for the message `id` to
/// `topic` (kind producer, a child of the current span: the call that
/// writes the message) and returns its W3C context as the headers to store
/// with the message ([`TRACE_HEADERS`]). A store that writes messages
/// itself, in the caller's transaction (idem-postgres's `outbox::publish`),
/// calls it; messages staged with [`stage`](crate::outbox::stage) get it
/// from the call. Empty when the span is off (no subscriber takes INFO
/// spans, no `tracing-opentelemetry` layer): the message then carries no
/// headers, and storing it costs nothing more.
///
/// ```
/// // No subscriber here: no span, nothing to store.
/// assert!(idem_core::otel::create_span_headers("orders.created", "id-1").is_empty());
/// ```
pub fn create_span_headers(topic: &str, id: &str) -> Vec<(String, String)> {
    if !tracing::level_enabled!(tracing::Level::INFO) {
        return Vec::new();
    }
    // The span ends when this returns: `create` covers making the message,
    // and what follows it (the write, the relay's send) links to it.
    let span = tracing::info_span!(
        "create",
        otel.name = format!("create {topic}"),
        otel.kind = "producer",
        messaging.operation.type = "create",
        messaging.operation.name = "create",
        messaging.destination.name = topic,
        messaging.message.id = id,
    );
    headers_of(&span)
}

/// `message` with the context of a new `create` span (a child of the
/// current span, the call's) in its headers.
pub(crate) fn created(mut message: OutboxMessage) -> OutboxMessage {
    message.headers = create_span_headers(&message.topic, &message.id);
    message
}

/// Whether the current span (the one `span` was opened in) carries a
/// trace already: then `span` continues that one.
fn has_local_parent() -> bool {
    let current = tracing::Span::current();
    !current.is_disabled() && current.context().span().span_context().is_valid()
}

struct Headers(Vec<(String, String)>);

impl Injector for Headers {
    fn set(&mut self, key: &str, value: String) {
        // The propagator sets `tracestate` even when the state is empty; an
        // empty header carries nothing (W3C: omit it), and every stored
        // message would pay for it.
        if TRACE_HEADERS.contains(&key) && !value.is_empty() {
            self.0.push((key.to_owned(), value));
        }
    }
}

/// A message's trace headers, looked up once.
struct Lookup<'a> {
    traceparent: Option<&'a str>,
    tracestate: Option<&'a str>,
}

impl Extractor for Lookup<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            "traceparent" => self.traceparent,
            "tracestate" => self.tracestate,
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        TRACE_HEADERS.to_vec()
    }
}
