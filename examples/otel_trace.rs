//! Follow one order across the outbox in OpenTelemetry, and print the
//! trace as a tree.
//!
//! ```text
//! checkout ─ idem.call ─ create orders ─(stored with the result)─▶ Redis ─ relay: send ─▶ stream ─▶ process ─ ship
//! ```
//!
//! A request span (`checkout`, what an HTTP server's span would be) places
//! an order as an idem call whose body stages an event; the call's result
//! and the message, with the W3C context of its `create` span, are stored
//! in one step. The relay's `send` span links to that `create` span; the
//! consumer's `process` span continues it (`Consumer::continue_trace`), so
//! the handler's own span `ship` lands in the request's trace. A retried
//! request replays: no second message, no second `create`.
//!
//! ```sh
//! cargo run --example otel_trace --features otel,redis-streams   # Redis at REDIS_URL
//! ```
#![allow(clippy::print_stdout, reason = "it prints the trace")]
use idem::consumer::redis_streams::{RedisStreamsConsumer, StreamsConfig};
use idem::consumer::{Adapter, Consumer, Message};
use idem::outbox::{self, RedisRelay, RedisStreamsSink};
use idem::{Error, Idempotency, RedisStore};
use opentelemetry::trace::{SpanId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use std::collections::HashMap;
use std::time::Duration;
use tracing_subscriber::layer::SubscriberExt;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1/".into());
    print!("{}", tree(&trace_one_order(&url).await?));
    Ok(())
}

/// Places one order twice, relays its message and consumes it, and
/// returns every span this made (on this thread: a current-thread runtime).
pub(crate) async fn trace_one_order(
    url: &str,
) -> Result<Vec<SpanData>, Box<dyn std::error::Error>> {
    // Spans go to an in-memory exporter (an OTLP exporter in production).
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("orders"));
    let _traced = tracing::subscriber::set_default(tracing_subscriber::registry().with(layer));

    let store = RedisStore::connect(url).await?;
    let idem = Idempotency::builder(store.clone())
        .namespace("otel-example")
        .build();
    let run = format!("{:x}", std::time::UNIX_EPOCH.elapsed()?.as_millis());
    let (stream, order) = (format!("orders-{run}"), format!("o-{run}"));

    // The request, and the client's retry of it: one order, one message.
    for attempt in ["first", "retry"] {
        let checkout = tracing::info_span!("checkout", attempt);
        let placed: Result<String, Error> = tracing::Instrument::instrument(
            idem.call("orders.place", &order).run(|| async {
                let event = serde_json::json!({ "order": order, "amount": 500 });
                outbox::stage(&stream, &order, &event)?; // stored with the result
                Ok(order.clone())
            }),
            checkout,
        )
        .await;
        placed?;
    }

    // The relay publishes the stored message, its trace context unchanged.
    let relay = RedisRelay::new(&store, RedisStreamsSink::connect(url).await?);
    relay.drain_once().await?;

    // The shipping service handles it in the request's trace.
    let consumer = Consumer::new(idem.clone(), "orders.ship").continue_trace(true);
    let config =
        StreamsConfig::new(&stream, "shipping", "shipping-1").block(Duration::from_millis(100));
    let broker = RedisStreamsConsumer::connect(url, config).await?;
    let (shipped, mut seen) = tokio::sync::watch::channel(false);
    let ship = |m: Message| {
        let shipped = shipped.clone();
        async move {
            let _ship = tracing::info_span!("ship").entered();
            let _: serde_json::Value = m.json().map_err(|e| e.to_string())?;
            shipped.send_replace(true);
            Ok::<_, String>(())
        }
    };
    let done = async move {
        let _ = tokio::time::timeout(Duration::from_secs(30), seen.wait_for(|s| *s)).await;
    };
    broker.run(&consumer, &ship, done).await?;

    // Read the spans before the provider shuts down: the in-memory
    // exporter forgets them then.
    provider.force_flush()?;
    let spans = exporter.get_finished_spans()?;
    provider.shutdown()?;
    Ok(spans)
}

/// Each trace as a tree: a span under its parent, in start order, with
/// the attributes that say what it did and the spans it links to.
pub(crate) fn tree(spans: &[SpanData]) -> String {
    let mut out = String::new();
    let names: HashMap<SpanId, &str> = spans
        .iter()
        .map(|s| (s.span_context.span_id(), s.name.as_ref()))
        .collect();
    let mut children: HashMap<SpanId, Vec<&SpanData>> = HashMap::new();
    let mut roots = Vec::new();
    for s in spans {
        if names.contains_key(&s.parent_span_id) {
            children.entry(s.parent_span_id).or_default().push(s);
        } else {
            roots.push(s);
        }
    }
    roots.sort_by_key(|s| s.start_time);
    for root in roots {
        out += &format!("trace {}\n", root.span_context.trace_id());
        print_span(&mut out, root, &children, &names, 1);
    }
    out
}

fn print_span(
    out: &mut String,
    span: &SpanData,
    children: &HashMap<SpanId, Vec<&SpanData>>,
    names: &HashMap<SpanId, &str>,
    depth: usize,
) {
    let shown: Vec<String> = span
        .attributes
        .iter()
        .filter(|kv| {
            let k = kv.key.as_str();
            k.starts_with("idem.outcome") || k == "messaging.system"
        })
        .map(|kv| format!("{}={}", kv.key, kv.value))
        .collect();
    let links: Vec<String> = span
        .links
        .iter()
        .map(|l| {
            let to = names.get(&l.span_context.span_id()).copied().unwrap_or("?");
            format!(" ↪ links to `{to}` in trace {}", l.span_context.trace_id())
        })
        .collect();
    *out += &format!(
        "{}{} [{:?}] {}{}\n",
        "  ".repeat(depth),
        span.name,
        span.span_kind,
        shown.join(" "),
        links.concat()
    );
    let mut kids = children
        .get(&span.span_context.span_id())
        .cloned()
        .unwrap_or_default();
    kids.sort_by_key(|s| s.start_time);
    for kid in kids {
        print_span(out, kid, children, names, depth + 1);
    }
}
