//! The outbox relay against each broker's bare publish loop, in the same
//! run, on the same broker.
//!
//! ```sh
//! cargo bench -p idem-consumer --bench relay            # every broker
//! cargo bench -p idem-consumer --bench relay -- nats    # or: redis, rabbitmq, kafka, redis-outbox
//! ```
//!
//! `redis-outbox` is the outbox of a `RedisStore` (`outbox::stage`): the
//! same bare `XADD` loop against a `RedisRelay` draining the store's outbox
//! stream into the Redis Streams sink on the same server, and what staging
//! a message adds to a call (16 calls in flight, with and without one).
//!
//! Both loops publish `MESSAGES` messages with distinct keys, `BATCH` at a
//! time, and wait for the broker's confirmation of each batch (a stream
//! entry, a JetStream ack, a publisher confirm, a Kafka delivery report):
//! the bare loop with the broker's client alone, the relay from the outbox
//! table (filled beforehand, not timed) through the broker's sink, deleting
//! each confirmed row. One relay, then two at once. Rounds alternate; the
//! best round of each loop is reported. Redis is a private redis-server,
//! Kafka a private tansu (skipped when tansu is not installed), NATS and
//! RabbitMQ the local ones (`NATS_URL`, `AMQP_URL`), PostgreSQL as
//! idem-testkit finds it.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a bench program: it fails loudly and prints its report"
)]

use futures_util::future::join_all;
use idem_consumer::kafka::rdkafka::ClientConfig;
use idem_consumer::kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_consumer::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem_consumer::nats::async_nats;
use idem_consumer::outbox::{KafkaSink, NatsSink, RabbitSink, RedisStreamsSink, Sink};
use idem_consumer::rabbitmq::lapin;
use idem_consumer::redis_streams::redis;
use idem_postgres::PgStore;
use idem_postgres::outbox::{Outbox, Relay};
use idem_postgres::sqlx;
use idem_testkit::{PgTestDb, RedisServer};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MESSAGES: usize = 20_000;
const BATCH: usize = 256;
const ROUNDS: usize = 3;

fn payload(i: usize) -> String {
    format!(r#"{{"order":"o-{i}","amount":{i},"currency":"EUR"}}"#)
}

/// Fills the outbox with `MESSAGES` rows for `topic` (not timed).
async fn fill(outbox: &Outbox, pool: &sqlx::PgPool, topic: &str, run: usize) {
    for chunk in (0..MESSAGES).collect::<Vec<_>>().chunks(1000) {
        let mut tx = pool.begin().await.expect("begin");
        for &i in chunk {
            let v: serde_json::Value = serde_json::from_str(&payload(i)).expect("json");
            outbox
                .publish_with_id(
                    &mut tx,
                    topic,
                    &format!("k{run}-{i}"),
                    &format!("m{run}-{i}"),
                    &v,
                )
                .await
                .expect("publish");
        }
        tx.commit().await.expect("commit");
    }
}

/// Drains the outbox with `relays` relays at once; messages per second.
async fn relay<S: Sink + 'static>(store: &PgStore, sink: Arc<S>, relays: usize) -> f64 {
    let start = Instant::now();
    let tasks = (0..relays).map(|_| {
        let relay = Relay::new(store, Arc::clone(&sink)).batch_size(BATCH);
        async move {
            let mut sent = 0;
            loop {
                let pass = relay.drain_once().await.expect("relay pass");
                assert_eq!(pass.parked + pass.failed, 0, "the broker refused: {pass:?}");
                if pass.sent == 0 {
                    return sent;
                }
                sent += pass.sent;
            }
        }
    });
    let sent: u64 = join_all(tasks).await.into_iter().sum();
    let secs = start.elapsed().as_secs_f64();
    let left = store.outbox().backlog().await.expect("backlog").pending;
    assert_eq!(
        (sent, left),
        (MESSAGES as u64, 0),
        "the relays left messages"
    );
    MESSAGES as f64 / secs
}

/// What every broker's phase provides.
trait Broker {
    type Sink: Sink + 'static;
    /// A fresh destination for round `run`; its name.
    async fn topic(&self, run: usize) -> String;
    /// The bare client loop: messages per second.
    async fn bare(&self, topic: &str) -> f64;
    fn sink(&self) -> Arc<Self::Sink>;
    async fn cleanup(&self, _topic: &str) {}
}

async fn phase<B: Broker>(
    name: &str,
    broker: &B,
    store: &PgStore,
    pool: &sqlx::PgPool,
    run: &mut usize,
) {
    let (mut bare, mut one, mut two) = (0f64, 0f64, 0f64);
    for _ in 0..ROUNDS {
        *run += 1;
        let topic = broker.topic(*run).await;
        bare = bare.max(broker.bare(&topic).await);
        for (relays, best) in [(1, &mut one), (2, &mut two)] {
            *run += 1;
            fill(&store.outbox(), pool, &topic, *run).await;
            *best = best.max(relay(store, broker.sink(), relays).await);
        }
        broker.cleanup(&topic).await;
    }
    println!(
        "{name:<14} bare {bare:>8.0} msg/s   relay {one:>8.0} msg/s  ratio {:.2}   2 relays {two:>8.0} msg/s  ratio {:.2}",
        one / bare,
        two / bare
    );
}

// ---------------------------------------------------------------- Redis

struct RedisBroker {
    conn: redis::aio::MultiplexedConnection,
    sink: Arc<RedisStreamsSink>,
}

impl Broker for RedisBroker {
    type Sink = RedisStreamsSink;
    async fn topic(&self, run: usize) -> String {
        format!("bench.relay.{run}")
    }
    async fn bare(&self, topic: &str) -> f64 {
        let mut c = self.conn.clone();
        let start = Instant::now();
        for chunk in (0..MESSAGES).collect::<Vec<_>>().chunks(BATCH) {
            let mut p = redis::pipe();
            for &i in chunk {
                p.cmd("XADD")
                    .arg(topic)
                    .arg("*")
                    .arg("id")
                    .arg(format!("b-{i}"))
                    .arg("payload")
                    .arg(payload(i))
                    .arg("key")
                    .arg(format!("k-{i}"));
            }
            let _: Vec<String> = p.query_async(&mut c).await.expect("XADD");
        }
        MESSAGES as f64 / start.elapsed().as_secs_f64()
    }
    fn sink(&self) -> Arc<RedisStreamsSink> {
        Arc::clone(&self.sink)
    }
    async fn cleanup(&self, topic: &str) {
        let mut c = self.conn.clone();
        let _: Result<(), _> = redis::cmd("DEL").arg(topic).query_async(&mut c).await;
    }
}

// ----------------------------------------------------------------- NATS

struct NatsBroker {
    js: async_nats::jetstream::Context,
    sink: Arc<NatsSink>,
}

impl Broker for NatsBroker {
    type Sink = NatsSink;
    async fn topic(&self, run: usize) -> String {
        let name = format!("IDEM_BENCH_RELAY_{}_{run}", std::process::id());
        self.js
            .create_stream(async_nats::jetstream::stream::Config {
                name: name.clone(),
                subjects: vec![format!("{name}.out")],
                ..Default::default()
            })
            .await
            .expect("create stream (is JetStream on?)");
        format!("{name}.out")
    }
    async fn bare(&self, topic: &str) -> f64 {
        let start = Instant::now();
        for chunk in (0..MESSAGES).collect::<Vec<_>>().chunks(BATCH) {
            let mut acks = Vec::with_capacity(chunk.len());
            for &i in chunk {
                let mut h = async_nats::HeaderMap::new();
                h.insert("Nats-Msg-Id", format!("b-{i}").as_str());
                acks.push(
                    self.js
                        .publish_with_headers(topic.to_owned(), h, payload(i).into())
                        .await
                        .expect("publish"),
                );
            }
            for a in join_all(acks.into_iter().map(std::future::IntoFuture::into_future)).await {
                a.expect("ack");
            }
        }
        MESSAGES as f64 / start.elapsed().as_secs_f64()
    }
    fn sink(&self) -> Arc<NatsSink> {
        Arc::clone(&self.sink)
    }
    async fn cleanup(&self, topic: &str) {
        let stream = topic.trim_end_matches(".out");
        let _ = self.js.delete_stream(stream).await;
    }
}

// ------------------------------------------------------------- RabbitMQ

struct RabbitBroker {
    channel: lapin::Channel,
    sink: Arc<RabbitSink>,
}

impl Broker for RabbitBroker {
    type Sink = RabbitSink;
    async fn topic(&self, run: usize) -> String {
        let q = format!("idem.bench.relay.{}.{run}", std::process::id());
        let args = {
            let mut t = lapin::types::FieldTable::default();
            t.insert(
                "x-queue-type".into(),
                lapin::types::AMQPValue::LongString("quorum".into()),
            );
            t
        };
        self.channel
            .queue_declare(
                q.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
            )
            .await
            .expect("declare queue");
        q
    }
    async fn bare(&self, topic: &str) -> f64 {
        let start = Instant::now();
        for chunk in (0..MESSAGES).collect::<Vec<_>>().chunks(BATCH) {
            let mut confirms = Vec::with_capacity(chunk.len());
            for &i in chunk {
                let props = lapin::BasicProperties::default()
                    .with_message_id(format!("b-{i}").into())
                    .with_delivery_mode(2);
                confirms.push(
                    self.channel
                        .basic_publish(
                            "".into(),
                            topic.into(),
                            lapin::options::BasicPublishOptions {
                                mandatory: true,
                                ..Default::default()
                            },
                            payload(i).as_bytes(),
                            props,
                        )
                        .await
                        .expect("publish"),
                );
            }
            for c in join_all(confirms).await {
                assert!(c.expect("confirm").is_ack(), "nacked");
            }
        }
        MESSAGES as f64 / start.elapsed().as_secs_f64()
    }
    fn sink(&self) -> Arc<RabbitSink> {
        Arc::clone(&self.sink)
    }
    async fn cleanup(&self, topic: &str) {
        let _ = self
            .channel
            .queue_delete(topic.into(), Default::default())
            .await;
    }
}

// ---------------------------------------------------------------- Kafka

struct KafkaBench {
    bootstrap: String,
    producer: FutureProducer,
    sink: Arc<KafkaSink>,
}

impl Broker for KafkaBench {
    type Sink = KafkaSink;
    async fn topic(&self, run: usize) -> String {
        use idem_consumer::kafka::rdkafka::admin::{
            AdminClient, AdminOptions, NewTopic, TopicReplication,
        };
        let topic = format!("bench-relay-{run}");
        let admin: AdminClient<idem_consumer::kafka::rdkafka::client::DefaultClientContext> =
            ClientConfig::new()
                .set("bootstrap.servers", &self.bootstrap)
                .create()
                .expect("admin client");
        let t = NewTopic::new(&topic, 3, TopicReplication::Fixed(1));
        for r in admin
            .create_topics([&t], &AdminOptions::new())
            .await
            .expect("create topic")
        {
            r.expect("create topic");
        }
        topic
    }
    async fn bare(&self, topic: &str) -> f64 {
        let start = Instant::now();
        for chunk in (0..MESSAGES).collect::<Vec<_>>().chunks(BATCH) {
            let sends = chunk.iter().map(|&i| {
                let (id, key, body) = (format!("b-{i}"), format!("k-{i}"), payload(i));
                async move {
                    let headers = OwnedHeaders::new().insert(Header {
                        key: "idempotency-key",
                        value: Some(id.as_str()),
                    });
                    let record = FutureRecord::to(topic)
                        .key(&key)
                        .payload(&body)
                        .headers(headers);
                    self.producer
                        .send(record, Duration::from_secs(30))
                        .await
                        .map_err(|(e, _)| e)
                        .expect("delivery");
                }
            });
            join_all(sends).await;
        }
        MESSAGES as f64 / start.elapsed().as_secs_f64()
    }
    fn sink(&self) -> Arc<KafkaSink> {
        Arc::clone(&self.sink)
    }
}

// --------------------------------------------------- the Redis outbox

/// Calls per second, 16 in flight, each staging `stage` messages.
async fn calls(idem: &idem_core::Idempotency, run: usize, stage: usize) -> f64 {
    let start = Instant::now();
    let per = MESSAGES / 16;
    let tasks = (0..16).map(|t| async move {
        for i in 0..per {
            let key = format!("{run}-{t}-{i}");
            let r: Result<u32, idem_core::Error> = idem
                .call("bench.stage", &key)
                .run(|| async {
                    for _ in 0..stage {
                        idem_core::outbox::stage("bench.out", &key, &payload(i))?;
                    }
                    Ok(1)
                })
                .await;
            r.expect("call");
        }
    });
    join_all(tasks).await;
    (per * 16) as f64 / start.elapsed().as_secs_f64()
}

/// Drains the Redis outbox with `relays` relays; messages per second.
async fn redis_relay(
    store: &idem_redis::RedisStore,
    sink: Arc<RedisStreamsSink>,
    relays: usize,
) -> f64 {
    let start = Instant::now();
    let tasks = (0..relays).map(|_| {
        let relay = idem_redis::outbox::RedisRelay::new(store, Arc::clone(&sink)).batch_size(BATCH);
        async move {
            let mut sent = 0;
            let mut idle = 0;
            // A standby relay finds the stream locked: it stops after a few
            // empty passes, as the one holding the lock does at the end.
            while idle < 3 {
                let pass = relay.drain_once().await.expect("relay pass");
                assert_eq!(pass.parked + pass.failed, 0, "the broker refused: {pass:?}");
                if pass.sent == 0 {
                    idle += 1;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                } else {
                    idle = 0;
                    sent += pass.sent;
                }
            }
            sent
        }
    });
    let sent: u64 = join_all(tasks).await.into_iter().sum();
    let secs = start.elapsed().as_secs_f64();
    let left = store.outbox().backlog().await.expect("backlog").pending;
    assert_eq!(
        (sent, left),
        (MESSAGES as u64 / 16 * 16, 0),
        "the relays left messages"
    );
    sent as f64 / secs
}

async fn redis_outbox(broker: &RedisBroker, url: &str, run: &mut usize) {
    let (mut bare, mut one, mut two, mut plain, mut staged) = (0f64, 0f64, 0f64, 0f64, 0f64);
    for _ in 0..ROUNDS {
        // A store of its own per round: a relay keeps its stream's lock
        // for its lease after its last pass.
        let store = idem_redis::RedisStore::connect(url).await.expect("store");
        let idem = idem_core::Idempotency::builder(store.clone())
            .namespace("bench")
            .build();
        *run += 1;
        let topic = broker.topic(*run).await;
        bare = bare.max(broker.bare(&topic).await);
        *run += 1;
        plain = plain.max(calls(&idem, *run, 0).await);
        for (relays, best) in [(1, &mut one), (2, &mut two)] {
            *run += 1;
            staged = staged.max(calls(&idem, *run, 1).await);
            *best = best.max(redis_relay(&store, broker.sink(), relays).await);
            // The next round's relays are new: free this one's lock.
            let mut c = broker.conn.clone();
            let _: Result<(), _> = redis::cmd("DEL")
                .arg("idem-outbox.relay")
                .query_async(&mut c)
                .await;
        }
        broker.cleanup(&topic).await;
        broker.cleanup("bench.out").await;
    }
    println!(
        "{:<14} bare {bare:>8.0} msg/s   relay {one:>8.0} msg/s  ratio {:.2}   2 relays {two:>8.0} msg/s  ratio {:.2}",
        "redis-outbox",
        one / bare,
        two / bare
    );
    println!(
        "{:<14} calls, 16 in flight: {plain:>8.0}/s without a message, {staged:>8.0}/s staging one (ratio {:.2})",
        "redis-outbox",
        staged / plain
    );
}

fn main() {
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let wanted = |b: &str| only.is_empty() || only.iter().any(|o| b.contains(o.as_str()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "{MESSAGES} messages per loop, distinct keys, batches of {BATCH} confirmed before the next, \
         best of {ROUNDS} alternating rounds; relay = from the PostgreSQL outbox through the broker's sink"
    );
    rt.block_on(async {
        let db = PgTestDb::new().await;
        let store = PgStore::from_pool(db.pool.clone());
        store.migrate().await.expect("migrate");
        let mut run = 0;
        if wanted("redis-streams") || wanted("redis-outbox") {
            let server = RedisServer::start();
            let client = redis::Client::open(server.url()).expect("redis url");
            let broker = RedisBroker {
                conn: client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("redis"),
                sink: Arc::new(
                    RedisStreamsSink::connect(&server.url())
                        .await
                        .expect("sink"),
                ),
            };
            if wanted("redis-streams") {
                phase("redis-streams", &broker, &store, &db.pool, &mut run).await;
            }
            if wanted("redis-outbox") {
                redis_outbox(&broker, &server.url(), &mut run).await;
            }
        }
        if wanted("nats") {
            let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
            let client = async_nats::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("NATS at {url}: {e}"));
            let js = async_nats::jetstream::new(client);
            let broker = NatsBroker {
                sink: Arc::new(NatsSink::new(js.clone())),
                js,
            };
            phase("nats", &broker, &store, &db.pool, &mut run).await;
        }
        if wanted("rabbitmq") {
            let amqp = std::env::var("AMQP_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
            let conn = lapin::Connection::connect(&amqp, Default::default())
                .await
                .unwrap_or_else(|e| panic!("RabbitMQ at {amqp}: {e}"));
            let channel = conn.create_channel().await.expect("channel");
            channel
                .confirm_select(Default::default())
                .await
                .expect("confirm mode");
            let broker = RabbitBroker {
                channel,
                sink: Arc::new(RabbitSink::connect(&amqp).await.expect("sink")),
            };
            phase("rabbitmq", &broker, &store, &db.pool, &mut run).await;
        }
        if wanted("kafka") {
            if std::panic::catch_unwind(idem_testkit::require_tansu).is_err() {
                println!(
                    "kafka          skipped: tansu is not installed (cargo xtask setup installs it)"
                );
                return;
            }
            let kafka = idem_testkit::KafkaBroker::start();
            let bootstrap = kafka.bootstrap();
            let producer: FutureProducer = ClientConfig::new()
                .set("bootstrap.servers", &bootstrap)
                .set("enable.idempotence", "true")
                .set("acks", "all")
                .create()
                .expect("producer");
            let broker = KafkaBench {
                sink: Arc::new(KafkaSink::from_brokers(&bootstrap).expect("sink")),
                bootstrap,
                producer,
            };
            phase("kafka", &broker, &store, &db.pool, &mut run).await;
        }
    });
}
