//! Feature `otel`: OpenTelemetry spans exported to memory and read back,
//! for the tests of idem's `otel` features (the `idem.call`, `idem.http`
//! and `idem.grpc` spans, the outbox's `create`, `send` and `process`
//! spans).
//!
//! [`Traces::install`] makes `tracing-opentelemetry`'s layer, on a tracer
//! whose every ended span goes to an [`InMemorySpanExporter`], the default
//! subscriber of the current thread; [`Traces::spans`] and
//! [`Traces::ended`] read the ended spans back, and [`attribute`],
//! [`named`], [`one`] and [`same_span`] pick in them.

use opentelemetry::trace::{SpanContext, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use std::time::Duration;
use tracing_subscriber::layer::SubscriberExt;

pub use opentelemetry_sdk::trace::SpanData;

/// `tracing-opentelemetry`'s layer on a tracer that exports every ended
/// span to memory, the default subscriber of this thread while it lives.
///
/// The subscriber is this thread's only: run the test on a current-thread
/// runtime (`#[tokio::test]`'s default) so that the spans of the tasks it
/// spawns (a server's, a run's) reach it too.
///
/// ```
/// use idem_testkit::otel::{Traces, attribute, one};
///
/// let traces = Traces::install();
/// tracing::info_span!("charge", order = "o-1").in_scope(|| {});
/// let spans = traces.spans();
/// let charge = one(&spans, "charge");
/// assert_eq!(attribute(charge, "order").as_deref(), Some("o-1"));
/// ```
#[derive(Debug)]
pub struct Traces {
    exporter: InMemorySpanExporter,
    provider: SdkTracerProvider,
    _default: tracing::subscriber::DefaultGuard,
}

impl Traces {
    /// Installs the exporter as this thread's default subscriber, until
    /// the returned value is dropped.
    pub fn install() -> Traces {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("idem-testkit"));
        let _default = tracing::subscriber::set_default(tracing_subscriber::registry().with(layer));
        Traces {
            exporter,
            provider,
            _default,
        }
    }

    /// The ended spans, all of them. Read before the provider shuts down
    /// (on drop): the in-memory exporter forgets its spans then.
    ///
    /// # Panics
    ///
    /// When the provider cannot flush or the exporter cannot be read.
    #[allow(
        clippy::expect_used,
        reason = "test support: a failed read fails the test"
    )]
    pub fn spans(&self) -> Vec<SpanData> {
        self.provider
            .force_flush()
            .expect("the tracer provider flushes");
        self.exporter
            .get_finished_spans()
            .expect("the in-memory exporter is readable")
    }

    /// The ended spans named `name`, once there are `count` of them: the
    /// end of a run may still be going on in a task after the answer.
    /// Polls every 10 ms, for 5 s at most.
    ///
    /// # Panics
    ///
    /// With "fewer than {count} `{name}` spans ended" when there are still
    /// fewer after 5 s, and as [`Traces::spans`] does.
    #[allow(
        clippy::panic,
        reason = "test support: a span that never ends fails the test"
    )]
    pub async fn ended(&self, name: &str, count: usize) -> Vec<SpanData> {
        for _ in 0..500 {
            let spans: Vec<SpanData> = self
                .spans()
                .into_iter()
                .filter(|s| s.name == name)
                .collect();
            if spans.len() >= count {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("fewer than {count} `{name}` spans ended");
    }
}

/// The value of `span`'s attribute `key`, as text, if it has one.
pub fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

/// The spans named `name`, in the order they ended.
pub fn named<'a>(spans: &'a [SpanData], name: &str) -> Vec<&'a SpanData> {
    spans.iter().filter(|s| s.name == name).collect()
}

/// The one span named `name`.
///
/// # Panics
///
/// When there is none or more than one, listing the names of all.
#[allow(
    clippy::indexing_slicing,
    reason = "test support: the length is asserted first"
)]
pub fn one<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
    let found = named(spans, name);
    assert_eq!(
        found.len(),
        1,
        "one span named {name:?}; all: {:?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    found[0]
}

/// The same span, whether seen locally or carried (a link's context is
/// remote: it came through a message's headers).
pub fn same_span(a: &SpanContext, b: &SpanContext) -> bool {
    (a.trace_id(), a.span_id()) == (b.trace_id(), b.span_id())
}

/// Asserts what a server layer's spans must be for a request that carried
/// `traceparent` with `trace` and `parent`: `server` (`idem.http`,
/// `idem.grpc`) is the request's server span in that trace, the caller's
/// span its parent; `call` (`idem.call`) is its child, with `idem.outcome`
/// `outcome` and `idem.key` shown hashed, never as `key` in clear.
/// Returns the key as shown.
///
/// # Panics
///
/// When any of that does not hold.
#[allow(clippy::panic, reason = "test support: an assertion")]
pub fn assert_call_in_server_span(
    server: &SpanData,
    call: &SpanData,
    (trace, parent): (&str, &str),
    outcome: &str,
    key: &str,
) -> String {
    use opentelemetry::trace::{SpanId, SpanKind, TraceId};
    let trace = TraceId::from_hex(trace).unwrap_or_else(|e| panic!("trace id {trace}: {e}"));
    let parent = SpanId::from_hex(parent).unwrap_or_else(|e| panic!("span id {parent}: {e}"));
    assert_eq!(server.span_context.trace_id(), trace);
    assert_eq!(server.parent_span_id, parent);
    assert_eq!(server.span_kind, SpanKind::Server);
    assert_eq!(call.span_context.trace_id(), trace);
    assert_eq!(call.parent_span_id, server.span_context.span_id());
    assert_eq!(attribute(call, "idem.outcome").as_deref(), Some(outcome));
    let shown = attribute(call, "idem.key").unwrap_or_default();
    assert!(!shown.is_empty(), "no idem.key on the call's span");
    assert!(
        !shown.contains(key),
        "the raw key reached the span: {shown}"
    );
    shown
}
