//! Outbox sinks against real brokers: Redis (a private redis-server per
//! test), NATS (the machine's 127.0.0.1:4222 with a unique stream per
//! test; a private `nats-server -js` for the outage), RabbitMQ
//! (127.0.0.1:5672, unique queues, deleted after) and Kafka (a private
//! `tansu` per test).
//!
//! For each broker: what the sink publishes is what the matching adapter
//! reads by default (id and payload); a relay's re-send of a whole batch
//! runs each message's handler once (the copies replay); a refusal is the
//! refused message's alone; a broker that is down makes every message
//! `Unavailable`, in seconds. Ground truth is a ledger of handler runs.

use crate::support;

use bytes::Bytes;
use idem_consumer::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_consumer::kafka::rdkafka::client::DefaultClientContext;
use idem_consumer::kafka::rdkafka::config::ClientConfig;
use idem_consumer::kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use idem_consumer::kafka::rdkafka::{Offset, TopicPartitionList};
use idem_consumer::kafka::{KafkaConfig, KafkaConsumer, KafkaReport};
use idem_consumer::nats::{NatsConfig, NatsConsumer, async_nats, pull_config};
use idem_consumer::outbox::{
    KafkaSink, NatsSink, OutboxMessage, RabbitSink, RedisStreamsSink, Sink, SinkError,
};
use idem_consumer::rabbitmq::{RabbitConfig, RabbitConsumer, lapin};
use idem_consumer::redis_streams::{RedisStreamsConsumer, StreamsConfig};
use idem_consumer::{Adapter, Consumer, Message};
use idem_core::outbox::message_id;
use idem_core::{Idempotency, MemoryStore, Outcome};
use idem_testkit::{FaultProxy, KafkaBroker, Ledger, NatsServer, RedisCluster, RedisServer};
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

// ------------------------------------------------------------------ helpers

fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}_{}_{}_{}",
        std::process::id(),
        idem_testkit::unix_ms() % 1_000_000_000,
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// `n` messages to `topic` with distinct keys, ids as the relay makes them.
fn outbox(tag: &str, topic: &str, n: usize) -> Vec<OutboxMessage> {
    (0..n)
        .map(|i| {
            message(
                tag,
                topic,
                i,
                format!(r#"{{"order":"o-{i}","tag":"{tag}"}}"#),
            )
        })
        .collect()
}

fn message(tag: &str, topic: &str, i: usize, payload: impl Into<Bytes>) -> OutboxMessage {
    OutboxMessage::new(
        message_id(&format!("idem:outbox-test:{tag}:{i}"), topic),
        topic,
        format!("order-{i}"),
        payload,
    )
}

fn consumer() -> Consumer {
    Consumer::new(
        Idempotency::builder(MemoryStore::new()).build(),
        "orders.ship",
    )
}

fn assert_all_ok(results: &[Result<(), SinkError>], n: usize) {
    assert_eq!(results.len(), n, "one result per message: {results:?}");
    for (i, r) in results.iter().enumerate() {
        assert!(r.is_ok(), "message {i} not confirmed: {r:?}");
    }
}

fn assert_all_unavailable(results: &[Result<(), SinkError>], n: usize) {
    assert_eq!(results.len(), n, "one result per message: {results:?}");
    for (i, r) in results.iter().enumerate() {
        assert!(
            matches!(r, Err(SinkError::Unavailable { .. })),
            "message {i} should be Unavailable: {r:?}"
        );
    }
}

/// `results` are `Ok` except at `refused`, which is `Refused`.
fn assert_refused_only(results: &[Result<(), SinkError>], n: usize, refused: usize) {
    assert_eq!(results.len(), n, "one result per message: {results:?}");
    for (i, r) in results.iter().enumerate() {
        if i == refused {
            assert!(
                matches!(r, Err(SinkError::Refused { .. })),
                "message {i} should be Refused: {r:?}"
            );
        } else {
            assert!(r.is_ok(), "message {i} should be Ok: {r:?}");
        }
    }
}

/// One message as the consumer side saw it.
#[derive(Debug, Clone)]
struct Seen {
    id: Option<String>,
    payload: Bytes,
    outcome: Option<Outcome>,
}

fn seen(m: &Message, outcome: Option<Outcome>) -> Seen {
    Seen {
        id: m.id().map(str::to_owned),
        payload: m.payload().clone(),
        outcome,
    }
}

/// Each sent message arrived once with its id and payload.
fn assert_carried(sent: &[OutboxMessage], got: &[Seen]) {
    let got: BTreeMap<Option<String>, Bytes> = got
        .iter()
        .map(|s| (s.id.clone(), s.payload.clone()))
        .collect();
    let want: BTreeMap<Option<String>, Bytes> = sent
        .iter()
        .map(|m| (Some(m.id.clone()), m.payload.clone()))
        .collect();
    assert_eq!(got, want, "the consumer reads each id with its payload");
}

/// Each id ran once (the ledger) and arrived twice: executed, then replayed.
fn assert_ran_once_each(sent: &[OutboxMessage], got: &[Seen], ledger: &Ledger) {
    assert_eq!(got.len(), 2 * sent.len(), "both copies arrived: {got:?}");
    for m in sent {
        assert_eq!(ledger.count(&m.id), 1, "{} ran once", m.id);
        let mut outcomes: Vec<_> = got
            .iter()
            .filter(|s| s.id.as_deref() == Some(&m.id))
            .map(|s| format!("{:?}", s.outcome))
            .collect();
        outcomes.sort();
        assert_eq!(
            outcomes,
            ["Some(Executed)", "Some(Replayed)"],
            "{}: the re-sent copy replays",
            m.id
        );
    }
    assert_eq!(ledger.total(), sent.len(), "{:?}", ledger.duplicates());
}

/// Takes `expect` messages through `adapter` and `consumer` (the handler
/// records each id in `ledger`), settling each as the consumer decides.
async fn consume<A: Adapter>(
    adapter: &A,
    consumer: &Consumer,
    ledger: &Ledger,
    expect: usize,
) -> Vec<Seen> {
    let ship = |m: Message| async move {
        ledger.record(m.id().unwrap_or("(no id)"));
        Ok::<_, String>(())
    };
    let mut got = Vec::new();
    let end = Instant::now() + Duration::from_secs(20);
    while got.len() < expect {
        assert!(
            Instant::now() < end,
            "only {} of {expect} messages reached the consumer within 20 s: {got:?}",
            got.len()
        );
        let deliveries = adapter
            .fetch()
            .await
            .unwrap_or_else(|e| panic!("fetch: {e}"));
        for d in deliveries {
            let m = adapter
                .message_of(&d)
                .unwrap_or_else(|e| panic!("not a message: {e}"));
            let handled = consumer.handle(&m, &ship).await;
            adapter
                .apply(&d, &handled.decision)
                .await
                .unwrap_or_else(|e| panic!("settling: {e}"));
            got.push(seen(&m, handled.outcome));
        }
    }
    got
}

// -------------------------------------------------------------------- Redis

async fn stream_consumer(url: &str, stream: &str) -> RedisStreamsConsumer {
    let c = RedisStreamsConsumer::connect(url, StreamsConfig::new(stream, "g", "c1"))
        .await
        .unwrap_or_else(|e| panic!("cannot consume {stream} at {url}: {e}"));
    c.ensure_group().await.unwrap();
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_sink_entries_carry_the_id_and_payload_the_consumer_reads() {
    let server = RedisServer::start();
    let sink = RedisStreamsSink::connect(&server.url())
        .await
        .unwrap()
        .max_len(1000);
    assert!(
        sink.describe().starts_with("redis-streams 127.0.0.1:"),
        "{}",
        sink.describe()
    );
    let batch = outbox("redis-ids", "orders", 5);
    assert_all_ok(&sink.send(&batch).await, 5);
    let fields: Vec<(String, BTreeMap<String, String>)> = redis::cmd("XRANGE")
        .arg("orders")
        .arg("-")
        .arg("+")
        .query(&mut server.connection())
        .unwrap();
    assert_eq!(fields[0].1.get("key").map(String::as_str), Some("order-0"));
    let adapter = stream_consumer(&server.url(), "orders").await;
    let got = consume(&adapter, &consumer(), &Ledger::new(), 5).await;
    assert_carried(&batch, &got);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_sink_a_resent_batch_runs_each_handler_once() {
    let server = RedisServer::start();
    let sink = RedisStreamsSink::connect(&server.url()).await.unwrap();
    let batch = outbox("redis-twice", "orders", 5);
    assert_all_ok(&sink.send(&batch).await, 5);
    assert_all_ok(&sink.send(&batch).await, 5);
    let adapter = stream_consumer(&server.url(), "orders").await;
    let ledger = Ledger::new();
    let got = consume(&adapter, &consumer(), &ledger, 10).await;
    assert_ran_once_each(&batch, &got, &ledger);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_sink_refuses_a_topic_that_is_not_a_stream_and_only_that_message() {
    let server = RedisServer::start();
    server.cli(&["SET", "plain", "a string"]);
    let sink = RedisStreamsSink::connect(&server.url()).await.unwrap();
    let mut batch = outbox("redis-wrongtype", "orders", 3);
    batch[1].topic = "plain".into();
    let results = sink.send(&batch).await;
    assert_refused_only(&results, 3, 1);
    let reason = results[1].as_ref().unwrap_err().reason().to_owned();
    assert!(
        reason.contains("WRONGTYPE") && reason.contains("plain"),
        "{reason}"
    );
    assert_eq!(server.cli(&["XLEN", "orders"]).trim(), "2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_sink_with_redis_down_answers_unavailable_for_every_message() {
    let mut server = RedisServer::start();
    let sink = RedisStreamsSink::connect(&server.url())
        .await
        .unwrap()
        .timeout(Duration::from_secs(2));
    server.kill();
    let results = sink.send(&outbox("redis-down", "orders", 4)).await;
    assert_all_unavailable(&results, 4);
}

/// On a cluster the pipeline spans slots (each topic on its own node);
/// answers still map per message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_sink_on_a_cluster_publishes_across_slots_and_refuses_per_message() {
    let cluster = RedisCluster::start();
    let client = redis::cluster::ClusterClient::new(cluster.urls()).unwrap();
    let conn = client.get_async_connection().await.unwrap();
    let sink = RedisStreamsSink::new(conn);
    let mut batch: Vec<OutboxMessage> = (0..6)
        .map(|i| {
            message(
                "cluster",
                &format!("orders-{i}"),
                i,
                format!(r#"{{"i":{i}}}"#),
            )
        })
        .collect();
    let owners: std::collections::BTreeSet<usize> =
        batch.iter().map(|m| cluster.slot_owner(&m.topic)).collect();
    assert!(owners.len() > 1, "the topics span nodes: {owners:?}");
    let mut plain = client.get_connection().unwrap();
    let _: () = redis::cmd("SET")
        .arg("plain")
        .arg("x")
        .query(&mut plain)
        .unwrap();
    batch[3].topic = "plain".into();
    assert_refused_only(&sink.send(&batch).await, 6, 3);
    for m in batch.iter().filter(|m| m.topic != "plain") {
        let len: usize = redis::cmd("XLEN").arg(&m.topic).query(&mut plain).unwrap();
        assert_eq!(len, 1, "{}", m.topic);
    }
}

/// `stream_for`: two topics into one stream, the rest under a prefix; the
/// topic travels in a `topic` field when the stream is another name, no
/// stream is named after a mapped topic, the consumer of the shared stream
/// reads every id, and a refusal names both the stream and the topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_sink_stream_for_routes_topics_to_the_streams_it_names() {
    let server = RedisServer::start();
    let sink = RedisStreamsSink::connect(&server.url())
        .await
        .unwrap()
        .stream_for(|topic| match topic {
            "orders.created" | "orders.paid" => "orders".to_owned(),
            other => format!("shop:{other}"),
        });
    let mut batch = outbox("redis-route", "orders.created", 6);
    for m in batch.iter_mut().skip(3) {
        m.topic = "orders.paid".into();
    }
    batch.push(message("redis-route", "refunds", 6, r#"{"refund":1}"#));
    assert_all_ok(&sink.send(&batch).await, 7);

    let entries: Vec<(String, BTreeMap<String, String>)> = redis::cmd("XRANGE")
        .arg("orders")
        .arg("-")
        .arg("+")
        .query(&mut server.connection())
        .unwrap();
    let topics: Vec<&str> = entries
        .iter()
        .map(|(_, f)| f.get("topic").map_or("(none)", String::as_str))
        .collect();
    assert_eq!(
        topics,
        [
            "orders.created",
            "orders.created",
            "orders.created",
            "orders.paid",
            "orders.paid",
            "orders.paid"
        ]
    );
    assert_eq!(server.cli(&["XLEN", "shop:refunds"]).trim(), "1");
    assert_eq!(
        server
            .cli(&["EXISTS", "orders.created", "orders.paid", "refunds"])
            .trim(),
        "0"
    );
    let adapter = stream_consumer(&server.url(), "orders").await;
    let got = consume(&adapter, &consumer(), &Ledger::new(), 6).await;
    assert_carried(&batch[..6], &got);

    // A refusal names the stream the topic went to.
    server.cli(&["SET", "shop:plain", "a string"]);
    let mut refused = outbox("redis-route-refused", "orders.created", 3);
    refused[1].topic = "plain".into();
    let results = sink.send(&refused).await;
    assert_refused_only(&results, 3, 1);
    let reason = results[1].as_ref().unwrap_err().reason().to_owned();
    assert!(
        reason.contains("`shop:plain`") && reason.contains("topic `plain`"),
        "{reason}"
    );
    // Without a mapping an entry has no `topic` field (the format as before).
    let plain = RedisStreamsSink::connect(&server.url()).await.unwrap();
    assert_all_ok(&plain.send(&outbox("redis-unmapped", "direct", 1)).await, 1);
    let entries: Vec<(String, BTreeMap<String, String>)> = redis::cmd("XRANGE")
        .arg("direct")
        .arg("-")
        .arg("+")
        .query(&mut server.connection())
        .unwrap();
    assert!(!entries[0].1.contains_key("topic"), "{entries:?}");
}

/// On a cluster, topics of several slots routed into fewer streams: one
/// pipeline per stream, every entry where the mapping put it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_sink_stream_for_on_a_cluster_groups_by_stream() {
    let cluster = RedisCluster::start();
    let client = redis::cluster::ClusterClient::new(cluster.urls()).unwrap();
    let conn = client.get_async_connection().await.unwrap();
    let sink = RedisStreamsSink::new(conn).stream_for(|topic| {
        let i: usize = topic.trim_start_matches("orders-").parse().unwrap_or(0);
        format!("merged-{}", i % 3)
    });
    let batch: Vec<OutboxMessage> = (0..9)
        .map(|i| message("cluster-route", &format!("orders-{i}"), i, "{}"))
        .collect();
    let owners: std::collections::BTreeSet<usize> = (0..3)
        .map(|i| cluster.slot_owner(&format!("merged-{i}")))
        .collect();
    assert!(owners.len() > 1, "the streams span nodes: {owners:?}");
    assert_all_ok(&sink.send(&batch).await, 9);
    let mut conn = client.get_connection().unwrap();
    for i in 0..3 {
        let len: usize = redis::cmd("XLEN")
            .arg(format!("merged-{i}"))
            .query(&mut conn)
            .unwrap();
        assert_eq!(len, 3, "merged-{i}");
    }
}

// --------------------------------------------------------------------- NATS

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// Connects, or fails the test saying why (never passes silently).
async fn nats_client(url: &str) -> async_nats::Client {
    tokio::time::timeout(Duration::from_secs(5), async_nats::connect(url))
        .await
        .unwrap_or_else(|_| panic!("NATS at {url} did not answer within 5 s: start `nats-server -js` (or run .ci/run, which does), or set NATS_URL"))
        .unwrap_or_else(|e| panic!("cannot connect to NATS at {url}: {e}; start `nats-server -js` (or run .ci/run), or set NATS_URL"))
}

/// A stream capturing `<name>.>`, deleted on drop.
struct NatsStream {
    url: String,
    name: String,
    js: async_nats::jetstream::Context,
}

impl NatsStream {
    /// A short duplicate window: a relay re-sends long after it in
    /// production, and JetStream would otherwise drop the copies itself.
    async fn create(url: &str, prefix: &str) -> NatsStream {
        NatsStream::create_with(url, prefix, -1).await
    }

    /// With messages up to `max_message_size` bytes (-1: no limit).
    async fn create_with(url: &str, prefix: &str, max_message_size: i32) -> NatsStream {
        let js = async_nats::jetstream::new(nats_client(url).await);
        let name = unique(prefix);
        js.create_stream(async_nats::jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            duplicate_window: Duration::from_millis(200),
            max_message_size,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("cannot create stream {name} at {url} (is JetStream enabled? run nats-server with -js): {e}"));
        NatsStream {
            url: url.to_owned(),
            name,
            js,
        }
    }

    fn subject(&self) -> String {
        format!("{}.in", self.name)
    }

    async fn adapter(&self) -> NatsConsumer {
        let stream = self.js.get_stream(&self.name).await.unwrap();
        let pull = stream
            .get_or_create_consumer("c", pull_config("c", Duration::from_secs(30)))
            .await
            .unwrap();
        NatsConsumer::new(pull, NatsConfig::new()).await.unwrap()
    }
}

impl Drop for NatsStream {
    fn drop(&mut self) {
        let (url, name) = (self.url.clone(), self.name.clone());
        support::clean_up_aside(async move {
            if let Ok(Ok(c)) =
                tokio::time::timeout(Duration::from_secs(2), async_nats::connect(url)).await
            {
                let _ = async_nats::jetstream::new(c).delete_stream(&name).await;
            }
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_sink_messages_carry_the_id_and_payload_the_consumer_reads() {
    let stream = NatsStream::create(&nats_url(), "outbox_ids").await;
    let sink = NatsSink::new(stream.js.clone());
    assert!(sink.describe().starts_with("nats "), "{}", sink.describe());
    let batch = outbox("nats-ids", &stream.subject(), 5);
    assert_all_ok(&sink.send(&batch).await, 5);
    let got = consume(&stream.adapter().await, &consumer(), &Ledger::new(), 5).await;
    assert_carried(&batch, &got);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_sink_a_resent_batch_runs_each_handler_once() {
    let stream = NatsStream::create(&nats_url(), "outbox_twice").await;
    let sink = NatsSink::new(stream.js.clone());
    let batch = outbox("nats-twice", &stream.subject(), 5);
    assert_all_ok(&sink.send(&batch).await, 5);
    tokio::time::sleep(Duration::from_millis(300)).await; // past the duplicate window
    assert_all_ok(&sink.send(&batch).await, 5);
    let ledger = Ledger::new();
    let got = consume(&stream.adapter().await, &consumer(), &ledger, 10).await;
    assert_ran_once_each(&batch, &got, &ledger);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_sink_refuses_a_subject_no_stream_captures_and_an_oversized_message_only() {
    let stream = NatsStream::create(&nats_url(), "outbox_refused").await;
    let sink = NatsSink::new(stream.js.clone());
    let mut batch = outbox("nats-refused", &stream.subject(), 3);
    batch[1].topic = format!("{}.nowhere", unique("no_stream"));
    let results = sink.send(&batch).await;
    assert_refused_only(&results, 3, 1);
    let reason = results[1].as_ref().unwrap_err().reason().to_owned();
    assert!(reason.contains("no JetStream stream"), "{reason}");

    let max = stream.js.client().server_info().max_payload;
    let mut batch = outbox("nats-large", &stream.subject(), 3);
    batch[2].payload = Bytes::from(vec![b'x'; max + 1]);
    let results = sink.send(&batch).await;
    assert_refused_only(&results, 3, 2);
    assert!(
        results[2]
            .as_ref()
            .unwrap_err()
            .reason()
            .contains("max_payload"),
        "{results:?}"
    );
    // The connection survived the refusal.
    assert_all_ok(
        &sink.send(&outbox("nats-after", &stream.subject(), 2)).await,
        2,
    );

    // The stream's own limit: JetStream refuses it in the ack.
    let small = NatsStream::create_with(&nats_url(), "outbox_small", 300).await;
    let mut batch = outbox("nats-small", &small.subject(), 3);
    batch[0].payload = Bytes::from(vec![b'x'; 500]);
    let results = sink.send(&batch).await;
    assert_refused_only(&results, 3, 0);
    assert!(
        results[0]
            .as_ref()
            .unwrap_err()
            .reason()
            .contains("max_msg_size"),
        "{results:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_sink_with_the_server_down_answers_unavailable_for_every_message() {
    let mut server = NatsServer::start();
    let client = nats_client(&server.url()).await;
    let js = async_nats::jetstream::context::ContextBuilder::new()
        .timeout(Duration::from_secs(1))
        .build(client);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "ORDERS".into(),
        subjects: vec!["ORDERS.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let sink = NatsSink::new(js);
    assert_all_ok(&sink.send(&outbox("nats-up", "ORDERS.in", 2)).await, 2);
    server.kill();
    let results = sink.send(&outbox("nats-down", "ORDERS.in", 4)).await;
    assert_all_unavailable(&results, 4);
}

// ----------------------------------------------------------------- RabbitMQ

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// Connects, or fails the test saying why (never passes silently).
async fn amqp_connect(url: &str) -> lapin::Connection {
    tokio::time::timeout(Duration::from_secs(10), lapin::Connection::connect(url, Default::default()))
        .await
        .unwrap_or_else(|_| panic!("RabbitMQ at {url} did not answer within 10 s: start rabbitmq-server (or run .ci/run, which does), or set AMQP_URL"))
        .unwrap_or_else(|e| panic!("cannot connect to RabbitMQ at {url}: {e}; start rabbitmq-server (or run .ci/run), or set AMQP_URL"))
}

/// A durable queue named uniquely, deleted on drop.
struct RabbitQueue {
    url: String,
    name: String,
}

impl RabbitQueue {
    async fn create(prefix: &str) -> RabbitQueue {
        let url = amqp_url();
        let name = unique(prefix);
        let conn = amqp_connect(&url).await;
        let channel = conn.create_channel().await.unwrap();
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .queue_declare(name.as_str().into(), durable, FieldTable::default())
            .await
            .unwrap_or_else(|e| panic!("cannot declare queue {name}: {e}"));
        let _ = conn.close(200, "bye".into()).await;
        RabbitQueue { url, name }
    }

    async fn adapter(&self) -> RabbitConsumer {
        let conn = amqp_connect(&self.url).await;
        let channel = conn.create_channel().await.unwrap();
        RabbitConsumer::new(channel, RabbitConfig::new(&self.name))
            .await
            .unwrap()
    }
}

impl Drop for RabbitQueue {
    fn drop(&mut self) {
        let (url, name) = (self.url.clone(), self.name.clone());
        support::clean_up_aside(async move {
            let Ok(Ok(conn)) = tokio::time::timeout(
                Duration::from_secs(5),
                lapin::Connection::connect(&url, Default::default()),
            )
            .await
            else {
                return;
            };
            if let Ok(ch) = conn.create_channel().await {
                let _ = ch
                    .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
            let _ = conn.close(200, "bye".into()).await;
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_sink_messages_carry_the_id_and_payload_the_consumer_reads() {
    let queue = RabbitQueue::create("outbox.ids").await;
    let sink = RabbitSink::new(amqp_connect(&queue.url).await)
        .await
        .unwrap();
    let batch = outbox("rabbit-ids", &queue.name, 5);
    assert_all_ok(&sink.send(&batch).await, 5);
    let got = consume(&queue.adapter().await, &consumer(), &Ledger::new(), 5).await;
    assert_carried(&batch, &got);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_sink_a_resent_batch_runs_each_handler_once() {
    let queue = RabbitQueue::create("outbox.twice").await;
    let sink = RabbitSink::connect(&queue.url).await.unwrap().exchange("");
    let batch = outbox("rabbit-twice", &queue.name, 5);
    assert_all_ok(&sink.send(&batch).await, 5);
    assert_all_ok(&sink.send(&batch).await, 5);
    let ledger = Ledger::new();
    let got = consume(&queue.adapter().await, &consumer(), &ledger, 10).await;
    assert_ran_once_each(&batch, &got, &ledger);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_sink_refuses_a_routing_key_no_queue_is_bound_to_and_only_that_message() {
    let queue = RabbitQueue::create("outbox.refused").await;
    let sink = RabbitSink::connect(&queue.url).await.unwrap();
    let mut batch = outbox("rabbit-refused", &queue.name, 3);
    batch[1].topic = unique("outbox.nowhere");
    let results = sink.send(&batch).await;
    assert_refused_only(&results, 3, 1);
    let reason = results[1].as_ref().unwrap_err().reason().to_owned();
    assert!(reason.contains("no queue is bound"), "{reason}");

    // A missing exchange refuses the batch; the sink keeps working after.
    let elsewhere = RabbitSink::connect(&queue.url)
        .await
        .unwrap()
        .exchange(unique("outbox.no-exchange"));
    let results = elsewhere
        .send(&outbox("rabbit-no-exchange", &queue.name, 2))
        .await;
    for r in &results {
        assert!(
            matches!(r, Err(SinkError::Refused { reason, .. }) if reason.contains("does not exist")),
            "{results:?}"
        );
    }
    assert_all_ok(&sink.send(&outbox("rabbit-after", &queue.name, 2)).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_sink_with_the_broker_gone_answers_unavailable_for_every_message() {
    let queue = RabbitQueue::create("outbox.down").await;
    let uri: lapin::uri::AMQPUri = queue.url.parse().unwrap();
    let upstream = format!("{}:{}", uri.authority.host, uri.authority.port);
    let upstream = tokio::net::lookup_host(&upstream)
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = FaultProxy::start(upstream);
    let through = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port());
    let sink = RabbitSink::connect(&through)
        .await
        .unwrap()
        .confirm_timeout(Duration::from_secs(2));
    assert_all_ok(&sink.send(&outbox("rabbit-up", &queue.name, 2)).await, 2);
    // The connections close and the port with them: the sink's reconnect
    // finds nothing listening.
    drop(proxy);
    let results = sink.send(&outbox("rabbit-down", &queue.name, 4)).await;
    assert_all_unavailable(&results, 4);
}

/// A queue that rejects publishes when full (`x-overflow: reject-publish`)
/// nacks the one over its length: `Unavailable`, to be sent again once
/// consumers made room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_sink_a_publisher_nack_is_unavailable_for_that_message() {
    let queue = RabbitQueue::create("outbox.full").await;
    let full = unique("outbox.full.one");
    let conn = amqp_connect(&queue.url).await;
    let channel = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(1));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    channel
        .queue_declare(full.as_str().into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    let sink = RabbitSink::new(conn).await.unwrap();
    let mut batch = outbox("rabbit-nack", &queue.name, 3);
    batch[0].topic = full.clone();
    batch[1].topic = full.clone();
    let results = sink.send(&batch).await;
    let _ = channel
        .queue_delete(full.as_str().into(), QueueDeleteOptions::default())
        .await;
    assert!(results[0].is_ok(), "{results:?}");
    assert!(
        matches!(&results[1], Err(SinkError::Unavailable { reason, .. }) if reason.contains("nack")),
        "{results:?}"
    );
    assert!(results[2].is_ok(), "{results:?}");
}

// -------------------------------------------------------------------- Kafka

async fn create_topic(bootstrap: &str, name: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    let res = admin
        .create_topics([&topic], &AdminOptions::new())
        .await
        .unwrap_or_else(|e| panic!("cannot create topic {name} on {bootstrap}: {e}"));
    for r in res {
        r.unwrap_or_else(|(t, e)| panic!("cannot create topic {t}: {e}"));
    }
}

fn kafka_sink(bootstrap: &str) -> KafkaSink {
    KafkaSink::new(
        ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("message.timeout.ms", "10000"),
    )
    .unwrap()
}

/// The group's committed offsets, per partition (`None`: nothing yet).
///
/// Their sum is the records consumed: offsets start at 0 and the sink
/// writes no transaction markers. (Not the high watermark: tansu 0.6
/// reported 1 for a partition holding two records produced in one batch.)
fn committed(bootstrap: &str, group: &str, topic: &str, partitions: i32) -> Vec<Option<i64>> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let Ok(got) = c.committed_offsets(tpl, Duration::from_secs(5)) else {
        return Vec::new();
    };
    (0..partitions)
        .map(|p| match got.find_partition(topic, p).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => Some(o),
            _ => None,
        })
        .collect()
}

/// Runs a default `KafkaConsumer` (quicker polls aside) on `topic` until
/// the group committed `records` records.
async fn kafka_consume(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    records: i64,
    ledger: &Ledger,
) -> (Vec<Seen>, KafkaReport) {
    let group = unique("sinks");
    let cfg = KafkaConfig::new(bootstrap, &group, [topic])
        .set("fetch.wait.max.ms", "50")
        .commit_interval(Duration::from_millis(100));
    let kafka = KafkaConsumer::connect(cfg).unwrap();
    let got = Mutex::new(Vec::new());
    let ship = |m: Message| {
        let got = &got;
        async move {
            ledger.record(m.id().unwrap_or("(no id)"));
            got.lock().unwrap().push(seen(&m, Some(Outcome::Executed)));
            Ok::<_, String>(())
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let check = async {
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let (b, g, t) = (bootstrap.to_owned(), group.clone(), topic.to_owned());
            let at = tokio::task::spawn_blocking(move || committed(&b, &g, &t, partitions))
                .await
                .unwrap();
            if at.iter().flatten().sum::<i64>() >= records {
                break;
            }
            assert!(
                Instant::now() < end,
                "the consumer did not commit {records} records of {topic} within 30 s ({} \
                 handler runs, committed {at:?})",
                ledger.total()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let _ = stop.send(());
    };
    let consumer = consumer();
    let (report, ()) = tokio::join!(kafka.run(&consumer, &ship, stopped), check);
    let report = report.unwrap_or_else(|e| panic!("kafka consumer: {e}"));
    (got.into_inner().unwrap(), report)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_sink_records_carry_the_id_and_payload_the_consumer_reads() {
    let kafka = KafkaBroker::start();
    let topic = unique("outbox-ids");
    create_topic(&kafka.bootstrap(), &topic, 3).await;
    let sink = kafka_sink(&kafka.bootstrap());
    assert!(
        sink.describe().starts_with("kafka 127.0.0.1:"),
        "{}",
        sink.describe()
    );
    let batch = outbox("kafka-ids", &topic, 5);
    assert_all_ok(&sink.send(&batch).await, 5);
    let (got, _) = kafka_consume(&kafka.bootstrap(), &topic, 3, 5, &Ledger::new()).await;
    assert_carried(&batch, &got);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_sink_a_resent_batch_runs_each_handler_once() {
    let kafka = KafkaBroker::start();
    let topic = unique("outbox-twice");
    create_topic(&kafka.bootstrap(), &topic, 3).await;
    let sink = kafka_sink(&kafka.bootstrap());
    let batch = outbox("kafka-twice", &topic, 5);
    assert_all_ok(&sink.send(&batch).await, 5);
    assert_all_ok(&sink.send(&batch).await, 5);
    let ledger = Ledger::new();
    let (_, report) = kafka_consume(&kafka.bootstrap(), &topic, 3, 10, &ledger).await;
    for m in &batch {
        assert_eq!(ledger.count(&m.id), 1, "{} ran once", m.id);
    }
    assert_eq!(ledger.total(), 5, "{:?}", ledger.duplicates());
    assert_eq!((report.acked, report.replayed), (10, 5), "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_sink_refuses_a_record_over_message_max_bytes_and_only_that_one() {
    let kafka = KafkaBroker::start();
    let topic = unique("outbox-large");
    create_topic(&kafka.bootstrap(), &topic, 3).await;
    let sink = KafkaSink::new(
        ClientConfig::new()
            .set("bootstrap.servers", kafka.bootstrap())
            .set("message.timeout.ms", "10000")
            .set("message.max.bytes", "1000"),
    )
    .unwrap();
    let mut batch = outbox("kafka-large", &topic, 3);
    batch[1].payload = Bytes::from(vec![b'x'; 5000]);
    let results = sink.send(&batch).await;
    assert_refused_only(&results, 3, 1);
    assert!(
        results[1]
            .as_ref()
            .unwrap_err()
            .reason()
            .contains("message.max.bytes"),
        "{results:?}"
    );
}

/// librdkafka gives up on a topic the cluster does not know after
/// `topic.metadata.propagation.max.ms` (30 s by default, 1 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_sink_refuses_a_topic_the_broker_does_not_know_and_only_that_record() {
    let kafka = KafkaBroker::start();
    let topic = unique("outbox-known");
    create_topic(&kafka.bootstrap(), &topic, 1).await;
    let sink = KafkaSink::new(
        ClientConfig::new()
            .set("bootstrap.servers", kafka.bootstrap())
            .set("message.timeout.ms", "10000")
            .set("topic.metadata.propagation.max.ms", "1000"),
    )
    .unwrap();
    let mut batch = outbox("kafka-unknown", &topic, 3);
    batch[1].topic = unique("outbox-unknown");
    let results = sink.send(&batch).await;
    assert_refused_only(&results, 3, 1);
    assert!(
        results[1]
            .as_ref()
            .unwrap_err()
            .reason()
            .contains("does not exist"),
        "{results:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_sink_with_the_broker_down_answers_unavailable_for_every_message() {
    let mut kafka = KafkaBroker::start();
    let topic = unique("outbox-down");
    create_topic(&kafka.bootstrap(), &topic, 3).await;
    let sink = KafkaSink::new(
        ClientConfig::new()
            .set("bootstrap.servers", kafka.bootstrap())
            .set("message.timeout.ms", "3000"),
    )
    .unwrap();
    assert_all_ok(&sink.send(&outbox("kafka-up", &topic, 2)).await, 2);
    kafka.kill();
    let results = sink.send(&outbox("kafka-down", &topic, 4)).await;
    assert_all_unavailable(&results, 4);
}
