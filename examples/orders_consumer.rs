//! Charges each order once, whatever the broker redelivers.
//!
//! A producer publishes order events with duplicates (the same id twice),
//! a re-publish (same order, new id and timestamp), a poison order that
//! can never be charged and a flaky one that fails its first delivery; the
//! consumer runs every message through idem and prints what it acked,
//! nacked and dead-lettered, then how many charges were made.
//!
//! ```sh
//! cargo run --example orders_consumer --features redis-streams,nats,rabbitmq
//! NATS_URL=nats://127.0.0.1:4222 cargo run --example orders_consumer --features redis-streams,nats,rabbitmq
//! AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f cargo run --example orders_consumer --features redis-streams,nats,rabbitmq
//! KAFKA_BROKERS=127.0.0.1:9092 cargo run --example orders_consumer --features redis-streams,nats,rabbitmq,kafka
//! ```
//!
//! idem keeps its records in the Redis at `REDIS_URL` (default
//! `redis://127.0.0.1:6379/`); the broker is Redis Streams on that same
//! Redis unless `NATS_URL`, `AMQP_URL` or `KAFKA_BROKERS` is set (for
//! Kafka: `tansu broker --storage-engine memory://tansu/` is a Kafka-protocol
//! broker from crates.io, `cargo install tansu --features dynostore`).

use idem::consumer::nats::{NatsConfig, NatsConsumer, async_nats, pull_config};
use idem::consumer::rabbitmq::{RabbitConfig, RabbitConsumer, declare_queue, lapin};
use idem::consumer::redis_streams::{RedisStreamsConsumer, StreamsConfig};
use idem::consumer::{
    Adapter, Classify, Consumer, ConsumerError, Decision, ErrorClass, KeyDeriver, KeySource,
    Message,
};
use idem::{Idempotency, RedisStore};
use serde::Deserialize;
use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, Deserialize)]
struct Order {
    order: String,
    amount: i64,
}

#[derive(Debug)]
enum ChargeError {
    /// The payment provider timed out: worth another delivery.
    Timeout,
    /// The order cannot be charged as it is.
    Invalid(String),
}

impl std::fmt::Display for ChargeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChargeError::Timeout => f.write_str("payment provider timed out"),
            ChargeError::Invalid(why) => write!(f, "invalid order: {why}"),
        }
    }
}

/// The events the producer sends: (message id, payload).
fn events(run: u64) -> Vec<(String, String)> {
    let order = |n: u32, amount: i64, sent_at: u32| {
        format!(r#"{{"order":"ord-{run}-{n}","amount":{amount},"sent_at":{sent_at}}}"#)
    };
    let mut e: Vec<(String, String)> = (1..=6)
        .map(|n| (format!("evt-{run}-{n}"), order(n, 100 * i64::from(n), 0)))
        .collect();
    e.push((format!("evt-{run}-2"), order(2, 200, 0))); // the same event delivered twice
    e.push((format!("evt-{run}-3-retry"), order(3, 300, 9))); // re-published under a new id
    e.push((format!("evt-{run}-7"), order(7, -5, 0))); // poison: never chargeable
    e.push((format!("evt-{run}-8"), order(8, 800, 0))); // flaky: the first attempt times out
    e
}

struct Shop {
    charged: Mutex<Vec<String>>,
    flaky_seen: Mutex<HashSet<String>>,
}

impl Shop {
    /// The side effect: charge the customer.
    async fn charge(&self, m: Message) -> Result<String, ChargeError> {
        let o: Order = m.json().map_err(|e| ChargeError::Invalid(e.to_string()))?;
        if o.amount <= 0 {
            return Err(ChargeError::Invalid(format!(
                "amount {} is not positive",
                o.amount
            )));
        }
        if o.order.ends_with("-8")
            && self
                .flaky_seen
                .lock()
                .map(|mut s| s.insert(o.order.clone()))
                .unwrap_or(false)
        {
            return Err(ChargeError::Timeout);
        }
        if let Ok(mut c) = self.charged.lock() {
            c.push(o.order.clone());
        }
        println!("  charged {} ({} cents)", o.order, o.amount);
        Ok(format!("receipt-{}", o.order))
    }
}

#[derive(Default)]
struct Tally {
    acked: usize,
    nacked: usize,
    dead: usize,
}

impl Tally {
    fn add(&mut self, d: &Decision) {
        match d {
            Decision::Ack => self.acked += 1,
            Decision::Nack { .. } => self.nacked += 1,
            _ => self.dead += 1,
        }
    }
}

/// Fetches, handles and settles batches until `expected` messages are acked
/// or dead-lettered (or 30 s passed), printing each decision: the same code
/// for every broker.
async fn drain<A, C, H, Fut>(
    broker: &A,
    consumer: &Consumer<C>,
    handler: &H,
    expected: usize,
) -> Result<Tally, ConsumerError>
where
    A: Adapter,
    C: Classify<ChargeError>,
    H: Fn(Message) -> Fut + Sync,
    Fut: Future<Output = Result<String, ChargeError>> + Send,
{
    let mut t = Tally::default();
    let deadline = Instant::now() + Duration::from_secs(30);
    while t.acked + t.dead < expected && Instant::now() < deadline {
        let decided = broker
            .handle(consumer, handler, broker.fetch().await?)
            .await;
        for (delivery, d) in &decided {
            let msg = broker.message_of(delivery).ok();
            println!(
                "  {:<18} -> {d}",
                msg.as_ref().and_then(Message::id).unwrap_or("(no id)")
            );
            t.add(d);
        }
        broker.settle(decided).await?;
    }
    Ok(t)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let store = match tokio::time::timeout(Duration::from_secs(3), RedisStore::connect(&redis_url))
        .await
    {
        Ok(Ok(s)) => s,
        _ => {
            eprintln!(
                "nothing answers on {redis_url}: start one with `redis-server` (or set REDIS_URL)"
            );
            std::process::exit(1);
        }
    };
    let idem = Idempotency::builder(store)
        .namespace("orders-example")
        .lease(Duration::from_secs(10))
        .build();
    let consumer = Consumer::new(idem, "orders.charge")
        // One order, one charge: key on the order itself, not on the event id,
        // so a re-published event is a duplicate too.
        .keys(KeySource::Payload(KeyDeriver::new().exclude("/sent_at")?))
        .max_deliveries(3)
        .backoff(Duration::from_millis(200), Duration::from_secs(2))
        .classify(|e: &ChargeError| ErrorClass::from_retryable(matches!(e, ChargeError::Timeout)));
    let shop = Arc::new(Shop {
        charged: Mutex::new(Vec::new()),
        flaky_seen: Mutex::new(HashSet::new()),
    });
    let handler = |m: Message| {
        let shop = shop.clone();
        async move { shop.charge(m).await }
    };
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let events = events(run);
    let expected = events.len();

    let t = if let Ok(brokers) = std::env::var("KAFKA_BROKERS") {
        println!("broker: Kafka at {brokers}");
        kafka::drain(&brokers, run, &events, &consumer, &handler).await?
    } else if let Ok(url) = std::env::var("NATS_URL") {
        println!("broker: NATS JetStream at {url}");
        let js = async_nats::jetstream::new(async_nats::connect(&url).await?);
        let name = format!("ORDERS_EXAMPLE_{run}");
        let stream = js
            .create_stream(async_nats::jetstream::stream::Config {
                name: name.clone(),
                subjects: vec![format!("{name}.>")],
                duplicate_window: Duration::from_millis(100),
                ..Default::default()
            })
            .await?;
        for (id, payload) in &events {
            let mut h = async_nats::HeaderMap::new();
            h.insert("Nats-Msg-Id", id.as_str());
            js.publish_with_headers(format!("{name}.orders"), h, payload.clone().into())
                .await?
                .await?;
            tokio::time::sleep(Duration::from_millis(150)).await; // past JetStream's own de-duplication
        }
        let mut config = pull_config("billing", Duration::from_secs(10));
        config.filter_subject = format!("{name}.orders"); // not the dead letters
        let pull = stream.create_consumer(config).await?;
        let nats = NatsConsumer::new(
            pull,
            NatsConfig::new().dead_letter_subject(format!("{name}.dead")),
        )
        .await?;
        let t = drain(&nats, &consumer, &handler, expected).await?;
        js.delete_stream(&name).await?;
        t
    } else if let Ok(url) = std::env::var("AMQP_URL") {
        println!("broker: RabbitMQ at {url}");
        let conn = lapin::Connection::connect(&url, Default::default()).await?;
        let channel = conn.create_channel().await?;
        let queue = format!("orders-example-{run}");
        declare_queue(
            &channel,
            &queue,
            &format!("{queue}.dlx"),
            &format!("{queue}.dead"),
        )
        .await?;
        for (id, payload) in &events {
            let props = lapin::BasicProperties::default().with_message_id(id.as_str().into());
            channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    Default::default(),
                    payload.as_bytes(),
                    props,
                )
                .await?
                .await?;
        }
        let rabbit =
            RabbitConsumer::new(conn.create_channel().await?, RabbitConfig::new(&queue)).await?;
        let t = drain(&rabbit, &consumer, &handler, expected).await?;
        for q in [queue.clone(), format!("{queue}.dead")] {
            channel
                .queue_delete(q.as_str().into(), Default::default())
                .await?;
        }
        channel
            .exchange_delete(format!("{queue}.dlx").as_str().into(), Default::default())
            .await?;
        t
    } else {
        println!("broker: Redis Streams at {redis_url}");
        let name = format!("orders-example-{run}");
        let mut conn = idem::consumer::redis_streams::redis::Client::open(redis_url.as_str())?
            .get_multiplexed_async_connection()
            .await?;
        for (id, payload) in &events {
            let _: String = idem::consumer::redis_streams::redis::cmd("XADD")
                .arg(&name)
                .arg("*")
                .arg("id")
                .arg(id)
                .arg("payload")
                .arg(payload)
                .query_async(&mut conn)
                .await?;
        }
        let config = StreamsConfig::new(&name, "billing", "billing-1")
            .claim_idle(Duration::from_millis(300));
        let stream = RedisStreamsConsumer::connect(&redis_url, config).await?;
        stream.ensure_group().await?;
        let t = drain(&stream, &consumer, &handler, expected).await?;
        let _: () = idem::consumer::redis_streams::redis::cmd("DEL")
            .arg(&name)
            .arg(format!("{name}:dead"))
            .query_async(&mut conn)
            .await?;
        t
    };

    let charged = shop.charged.lock().map(|c| c.clone()).unwrap_or_default();
    println!(
        "{expected} messages: {} acked, {} nacked (redelivered later), {} dead-lettered; \
         {} charges for the 7 chargeable orders (the 8th is poison)",
        t.acked,
        t.nacked,
        t.dead,
        charged.len()
    );
    Ok(())
}

#[cfg(not(feature = "kafka"))]
mod kafka {
    pub async fn drain<C, H>(
        _: &str,
        _: u64,
        _: &[(String, String)],
        _: &C,
        _: &H,
    ) -> Result<super::Tally, Box<dyn std::error::Error>> {
        Err("KAFKA_BROKERS needs the `kafka` feature: add it to --features".into())
    }
}

/// Kafka has no per-message ack: the adapter runs its own loop and commits
/// each partition up to the lowest record not yet decided.
#[cfg(feature = "kafka")]
mod kafka {
    use super::{ChargeError, Tally};
    use idem::consumer::kafka::rdkafka::admin::{
        AdminClient, AdminOptions, NewTopic, TopicReplication,
    };
    use idem::consumer::kafka::rdkafka::client::DefaultClientContext;
    use idem::consumer::kafka::rdkafka::config::ClientConfig;
    use idem::consumer::kafka::rdkafka::message::{Header, OwnedHeaders};
    use idem::consumer::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
    use idem::consumer::kafka::{KafkaConfig, KafkaConsumer, header_names};
    use idem::consumer::{Classify, Consumer, Message};
    use std::future::Future;
    use std::time::{Duration, Instant};

    pub async fn drain<C, H, Fut>(
        brokers: &str,
        run: u64,
        events: &[(String, String)],
        consumer: &Consumer<C>,
        handler: &H,
    ) -> Result<Tally, Box<dyn std::error::Error>>
    where
        C: Classify<ChargeError>,
        H: Fn(Message) -> Fut,
        Fut: Future<Output = Result<String, ChargeError>>,
    {
        let topic = format!("orders-example-{run}");
        let dead = format!("{topic}.DLT");
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()?;
        let topics = [
            NewTopic::new(&topic, 1, TopicReplication::Fixed(1)),
            NewTopic::new(&dead, 1, TopicReplication::Fixed(1)),
        ];
        for created in admin.create_topics(&topics, &AdminOptions::new()).await? {
            created.map_err(|(t, e)| format!("cannot create topic {t}: {e}"))?;
        }
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()?;
        for (id, payload) in events {
            let headers = OwnedHeaders::new().insert(Header {
                key: header_names::IDEMPOTENCY_KEY,
                value: Some(id.as_str()),
            });
            let record = FutureRecord::<str, str>::to(&topic)
                .payload(payload)
                .headers(headers);
            producer
                .send(record, Duration::from_secs(10))
                .await
                .map_err(|(e, _)| e)?;
        }
        let kafka = KafkaConsumer::connect(KafkaConfig::new(brokers, "billing", [&topic]))?;
        // Done once the group's offset is past every event (or 30 s passed).
        let end = events.len() as i64;
        let deadline = Instant::now() + Duration::from_secs(30);
        let done = async {
            while kafka.last_committed(&topic, 0) != Some(end) && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        let report = kafka.run(consumer, handler, done).await?;
        println!("  {report:?}");
        Ok(Tally {
            acked: report.acked,
            nacked: report.retried + report.nacked,
            dead: report.dead_lettered,
        })
    }
}
