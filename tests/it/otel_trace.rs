//! One trace across the outbox, read from OpenTelemetry's in-memory
//! exporter: an HTTP request carrying a W3C `traceparent` places an order
//! through the idem-http layer, whose handler publishes an event in
//! `run_in_tx` on PostgreSQL; `PgRelay` sends it to a broker (Kafka, NATS
//! JetStream) and an idem consumer handles it.
//!
//! The invariants: the request's trace continues into the idem call, the
//! `create` span and the stored message; the relay's `send` span and the
//! consumer's `process` span link to that `create` span (or, with
//! `Consumer::continue_trace`, the `process` span and the handler's spans
//! are in the request's trace, as children of `create`); a replayed request
//! creates no second message and no second `create` span.

use idem::Idempotency;
use idem::consumer::kafka::rdkafka::admin::{
    AdminClient, AdminOptions, NewTopic, TopicReplication,
};
use idem::consumer::kafka::rdkafka::{client::DefaultClientContext, config::ClientConfig};
use idem::consumer::kafka::{KafkaConfig, KafkaConsumer};
use idem::consumer::nats::{NatsConfig, NatsConsumer, async_nats};
use idem::consumer::{Adapter, Consumer, Message};
use idem::http::IdempotencyLayer;
use idem::outbox::{KafkaSink, NatsSink, PgRelay, Sink};
use idem::postgres::{PgStore, RunInTx};
use idem_testkit::otel::{SpanData, Traces, attribute, named, one, same_span};
use idem_testkit::{KafkaBroker, PgTestDb};
use opentelemetry::trace::{SpanId, TraceId};
use std::time::Duration;

/// The caller's trace, as its `traceparent` names it.
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// The one `process` span (named for the consumer's source: a topic, a
/// stream and its consumer).
fn processed(spans: &[SpanData]) -> &SpanData {
    let found: Vec<_> = spans
        .iter()
        .filter(|s| s.name.starts_with("process "))
        .collect();
    assert_eq!(found.len(), 1, "one message handled once");
    found[0]
}

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}_{}",
        std::process::id(),
        idem_testkit::unix_ms()
    )
}

#[derive(Clone)]
struct App {
    idem: Idempotency,
    pool: idem::postgres::sqlx::PgPool,
    topic: String,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Order {
    order: String,
    amount: i64,
}

/// The handler behind the idem-http layer: the order's event is published
/// in the transaction its result commits in.
async fn place(
    axum::extract::State(app): axum::extract::State<App>,
    axum::Json(o): axum::Json<Order>,
) -> Result<axum::Json<String>, (axum::http::StatusCode, String)> {
    app.idem
        .call("orders.place", &o.order)
        .run_in_tx(&app.pool, async |tx| {
            idem::outbox::publish(&mut *tx, &app.topic, &o.order, &o).await?;
            Ok::<_, idem::Error>(o.order.clone())
        })
        .await
        .map(axum::Json)
        .map_err(|e| (axum::http::StatusCode::SERVICE_UNAVAILABLE, e.to_string()))
}

/// Serves the orders API on a free port and places order `o-1` twice (the
/// second a client's retry), each request carrying the caller's trace.
async fn place_twice(idem: &Idempotency, pool: &idem::postgres::sqlx::PgPool, topic: &str) {
    let app = axum::Router::new()
        .route("/orders", axum::routing::post(place))
        .layer(IdempotencyLayer::new(idem.clone()))
        .with_state(App {
            idem: idem.clone(),
            pool: pool.clone(),
            topic: topic.to_owned(),
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/orders", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::new();
    for _ in 0..2 {
        let response = client
            .post(&url)
            .header("traceparent", format!("00-{TRACE}-{CALLER_SPAN}-01"))
            .header("idempotency-key", "order-o-1")
            .json(&serde_json::json!({"order": "o-1", "amount": 500}))
            .send()
            .await
            .unwrap();
        assert!(
            response.status().is_success(),
            "{:?}",
            response.text().await
        );
    }
}

/// Relays what committed through `sink`, checking one message went.
async fn relay(store: &PgStore, sink: impl Sink + 'static) {
    let relay = PgRelay::new(store, sink);
    let report = relay.drain_once().await.unwrap();
    assert_eq!(report.sent, 1, "one message committed, one relayed");
}

/// The consumer's broker.
enum Broker<'a> {
    Kafka(&'a KafkaConsumer),
    Nats(&'a NatsConsumer),
}

/// Runs the broker's consumer until its handler has handled one message
/// (or 60 s), the handler opening a span of its own (`ship`).
async fn consume_one(broker: Broker<'_>, consumer: &Consumer) {
    let (handled, seen) = tokio::sync::watch::channel(0);
    let ship = |m: Message| {
        let handled = handled.clone();
        async move {
            let _ship = tracing::info_span!("ship").entered();
            let _: serde_json::Value = m.json().map_err(|e| e.to_string())?;
            handled.send_modify(|n| *n += 1);
            Ok::<_, String>(())
        }
    };
    let done = async move {
        let mut seen = seen;
        let one = seen.wait_for(|n| *n >= 1);
        drop(tokio::time::timeout(Duration::from_secs(60), one).await);
    };
    match broker {
        Broker::Kafka(k) => drop(k.run(consumer, &ship, done).await.unwrap()),
        Broker::Nats(n) => n.run(consumer, &ship, done).await.unwrap(),
    }
    assert_eq!(*handled.borrow(), 1, "the relayed message was handled");
}

/// Checks the producer's half: the request's trace through the call to
/// one `create` span (none for the replay), and returns that span.
fn check_producer<'a>(spans: &'a [SpanData], topic: &str) -> &'a SpanData {
    let trace = TraceId::from_hex(TRACE).unwrap();
    let http = named(spans, "idem.http");
    assert_eq!(http.len(), 2, "two requests");
    for h in &http {
        assert_eq!(
            h.span_context.trace_id(),
            trace,
            "the request continues the caller's trace"
        );
        assert_eq!(h.parent_span_id, SpanId::from_hex(CALLER_SPAN).unwrap());
    }
    // The consumer's own call (scope `orders.ship`) is checked apart.
    let calls: Vec<_> = named(spans, "idem.call")
        .into_iter()
        .filter(|c| attribute(c, "scope").as_deref() != Some("orders.ship"))
        .collect();
    assert_eq!(
        calls.len(),
        3,
        "the layer's call per request, the handler's once"
    );
    assert!(calls.iter().all(|c| c.span_context.trace_id() == trace));
    let outcomes: Vec<_> = calls
        .iter()
        .filter_map(|c| attribute(c, "idem.outcome"))
        .collect();
    assert!(outcomes.iter().any(|o| o == "executed"), "{outcomes:?}");
    assert!(outcomes.iter().any(|o| o == "replayed"), "{outcomes:?}");
    for c in &calls {
        let key = attribute(c, "idem.key").unwrap_or_default();
        assert!(
            !key.contains("o-1"),
            "keys are hashed unless log_keys: {key}"
        );
    }
    let create = one(spans, &format!("create {topic}"));
    assert_eq!(create.span_context.trace_id(), trace);
    assert_eq!(
        attribute(create, "messaging.operation.type").as_deref(),
        Some("create")
    );
    assert_eq!(
        attribute(create, "messaging.destination.name").as_deref(),
        Some(topic)
    );
    assert!(attribute(create, "messaging.message.id").is_some());
    create
}

/// The relay's `send` span: in a trace of its own, linked to `create`.
fn check_send(spans: &[SpanData], topic: &str, create: &SpanData, system: &str) {
    let send = one(spans, &format!("send {topic}"));
    assert_ne!(send.span_context.trace_id(), create.span_context.trace_id());
    assert_eq!(attribute(send, "messaging.system").as_deref(), Some(system));
    assert!(
        send.links
            .iter()
            .any(|l| same_span(&l.span_context, &create.span_context)),
        "the send span links to the create span: {:?}",
        send.links
    );
}

#[tokio::test]
async fn kafka_handler_continues_the_requests_trace() {
    let traces = Traces::install();
    let db = PgTestDb::new().await;
    let store = PgStore::from_pool(db.pool.clone());
    store.migrate().await.unwrap();
    let idem = Idempotency::builder(store.clone()).build();
    let kafka = KafkaBroker::start();
    let topic = unique("otel_kafka");
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", kafka.bootstrap())
        .create()
        .unwrap();
    let new = NewTopic::new(&topic, 1, TopicReplication::Fixed(1));
    for created in admin
        .create_topics([&new], &AdminOptions::new())
        .await
        .unwrap()
    {
        created.unwrap();
    }

    place_twice(&idem, &db.pool, &topic).await;
    relay(&store, KafkaSink::from_brokers(&kafka.bootstrap()).unwrap()).await;
    let consumer = Consumer::new(idem.clone(), "orders.ship").continue_trace(true);
    let adapter = KafkaConsumer::connect(KafkaConfig::new(
        kafka.bootstrap(),
        unique("ship"),
        [&topic],
    ))
    .unwrap();
    consume_one(Broker::Kafka(&adapter), &consumer).await;
    adapter.close().await;

    let spans = traces.spans();
    let create = check_producer(&spans, &topic);
    check_send(&spans, &topic, create, "kafka");
    let process = processed(&spans);
    assert_eq!(
        process.span_context.trace_id(),
        create.span_context.trace_id()
    );
    assert_eq!(process.parent_span_id, create.span_context.span_id());
    assert_eq!(
        attribute(process, "messaging.system").as_deref(),
        Some("kafka")
    );
    assert_eq!(
        attribute(process, "idem.outcome").as_deref(),
        Some("executed")
    );
    let ship = one(&spans, "ship");
    assert_eq!(
        ship.span_context.trace_id(),
        TraceId::from_hex(TRACE).unwrap(),
        "the handler runs in the caller's trace"
    );
}

#[tokio::test]
async fn nats_process_span_links_to_the_create_span() {
    let traces = Traces::install();
    let db = PgTestDb::new().await;
    let store = PgStore::from_pool(db.pool.clone());
    store.migrate().await.unwrap();
    let idem = Idempotency::builder(store.clone()).build();
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let client = tokio::time::timeout(Duration::from_secs(5), async_nats::connect(&nats_url))
        .await
        .unwrap_or_else(|_| panic!("NATS at {nats_url} did not answer: start `nats-server -js`"))
        .unwrap_or_else(|e| panic!("cannot connect to NATS at {nats_url}: {e}"));
    let js = async_nats::jetstream::new(client);
    let stream = unique("OTEL");
    let topic = format!("{stream}.orders");
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![format!("{stream}.>")],
        ..Default::default()
    })
    .await
    .unwrap();

    place_twice(&idem, &db.pool, &topic).await;
    relay(&store, NatsSink::new(js.clone())).await;
    let pull = js
        .get_stream(&stream)
        .await
        .unwrap()
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("ship".into()),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();
    let adapter = NatsConsumer::new(pull, NatsConfig::new().block(Duration::from_millis(200)))
        .await
        .unwrap();
    consume_one(
        Broker::Nats(&adapter),
        &Consumer::new(idem.clone(), "orders.ship"),
    )
    .await;
    let _ = js.delete_stream(&stream).await;

    let spans = traces.spans();
    let create = check_producer(&spans, &topic);
    check_send(&spans, &topic, create, "nats");
    let process = processed(&spans);
    assert_ne!(
        process.span_context.trace_id(),
        create.span_context.trace_id(),
        "by default the handling starts a trace of its own…"
    );
    assert!(
        process
            .links
            .iter()
            .any(|l| same_span(&l.span_context, &create.span_context)),
        "…linked to the span that created the message: {:?}",
        process.links
    );
    assert_eq!(
        attribute(process, "messaging.system").as_deref(),
        Some("nats")
    );
    assert_eq!(
        attribute(process, "messaging.operation.type").as_deref(),
        Some("process")
    );
}

/// The `idem.key` attribute: a hash by default, the key with `log_keys`,
/// absent with `keys_in_spans(false)`; `idem.outcome` in every case.
#[tokio::test]
async fn keys_in_spans_are_hashed_clear_or_omitted() {
    let traces = Traces::install();
    let call = |idem: Idempotency| async move {
        idem.call("op", "alice@example.com")
            .run(|| async { Ok::<_, idem::Error>(1u8) })
            .await
            .unwrap();
    };
    let memory = idem::MemoryStore::new;
    call(Idempotency::builder(memory()).build()).await;
    call(Idempotency::builder(memory()).log_keys(true).build()).await;
    call(Idempotency::builder(memory()).keys_in_spans(false).build()).await;
    let spans = traces.spans();
    let calls = named(&spans, "idem.call");
    assert_eq!(calls.len(), 3);
    let keys: Vec<_> = calls.iter().map(|c| attribute(c, "idem.key")).collect();
    assert!(
        keys[0]
            .as_deref()
            .is_some_and(|k| k.starts_with('#') && !k.contains("alice"))
    );
    assert!(
        keys[1]
            .as_deref()
            .is_some_and(|k| k.contains("alice@example.com"))
    );
    assert_eq!(keys[2], None);
    for c in calls {
        assert_eq!(attribute(c, "idem.outcome").as_deref(), Some("executed"));
    }
}

#[path = "../../examples/otel_trace.rs"]
#[allow(dead_code, reason = "the example's `main` is not called here")]
mod example;

/// `examples/otel_trace.rs` run as its reader runs it, on a Redis of its
/// own: the printed tree shows one `create` span for the order placed
/// twice, the consumer's `process` span and the handler's `ship` span
/// under it (in the request's trace), and the relay's `send` span linked
/// to it from a trace of its own.
#[tokio::test]
async fn the_example_prints_one_orders_trace_as_a_tree() {
    let redis = idem_testkit::RedisServer::start();
    let spans = example::trace_one_order(&redis.url()).await.unwrap();
    let tree = example::tree(&spans);
    let lines: Vec<&str> = tree.lines().collect();
    let find = |what: &str| {
        let found: Vec<usize> = (0..lines.len())
            .filter(|&i| lines[i].trim_start().starts_with(what))
            .collect();
        assert_eq!(found.len(), 1, "one span {what:?} in:\n{tree}");
        found[0]
    };
    let depth = |i: usize| lines[i].len() - lines[i].trim_start().len();
    let (create, process, ship) = (find("create orders-"), find("process "), find("ship ["));
    assert!(
        create < process
            && process < ship
            && depth(create) < depth(process)
            && depth(process) < depth(ship),
        "process under create, ship under process:\n{tree}"
    );
    let trace_of = |i: usize| (0..=i).rev().find(|&j| lines[j].starts_with("trace "));
    assert_eq!(
        trace_of(create),
        trace_of(ship),
        "the handler runs in the request's trace:\n{tree}"
    );
    let send = find("send orders-");
    assert!(lines[send].contains("links to `create orders-"), "{tree}");
    assert_ne!(
        trace_of(send),
        trace_of(create),
        "the relay's own trace:\n{tree}"
    );
    assert!(
        tree.contains("idem.outcome=replayed"),
        "the retry replays:\n{tree}"
    );
}
