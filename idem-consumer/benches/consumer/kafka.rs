//! The Kafka phase: the adapter against rdkafka's own consume+commit loop
//! (a `BaseConsumer` polling, committing every batch), on a private `tansu`
//! broker. Each round consumes a fresh topic of [`MESSAGES`] records in
//! three partitions with a fresh group; the clock starts at the first record
//! (the group join is not timed) and stops once the group's offsets cover
//! every record.

use super::floor::RedisFloor;
use super::{BATCH, consumer, noop, payload};

/// Records per round: five times the other phases'. A round of 5,000 took
/// about 50 ms, of which the adapter's last commit interval (up to 20 ms)
/// and tansu's fetch waits were a share that moved the ratio from 0.6 to
/// 1.15 between rounds of one binary.
pub(crate) const MESSAGES: usize = 25_000;
use idem_consumer::Message;
use idem_consumer::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_consumer::kafka::rdkafka::client::DefaultClientContext;
use idem_consumer::kafka::rdkafka::config::ClientConfig;
use idem_consumer::kafka::rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _};
use idem_consumer::kafka::rdkafka::message::{Header, Message as _, OwnedHeaders};
use idem_consumer::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem_consumer::kafka::{KafkaConfig, KafkaConsumer, header_names};
use idem_testkit::KafkaBroker;
use std::sync::OnceLock;
use std::time::Duration;

const PARTITIONS: i32 = 3;

async fn setup(bootstrap: &str, run: usize) -> String {
    let topic = format!("bench-{run}");
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin client");
    let t = NewTopic::new(&topic, PARTITIONS, TopicReplication::Fixed(1));
    for r in admin
        .create_topics([&t], &AdminOptions::new())
        .await
        .expect("create topic")
    {
        r.expect("create topic");
    }
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", "5")
        .create()
        .expect("producer");
    let sends = (0..MESSAGES).map(|i| {
        let id = format!("o-{run}-{i}");
        let body = payload(run, i);
        let producer = &producer;
        let topic = &topic;
        async move {
            let headers = OwnedHeaders::new().insert(Header {
                key: header_names::IDEMPOTENCY_KEY,
                value: Some(id.as_str()),
            });
            let record = FutureRecord::<str, str>::to(topic)
                .partition((i as i32) % PARTITIONS)
                .payload(&body)
                .headers(headers);
            producer
                .send(record, Duration::from_secs(30))
                .await
                .map_err(|(e, _)| e)
                .expect("publish");
        }
    });
    futures_util::future::join_all(sends).await;
    topic
}

fn client(bootstrap: &str, group: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", "10");
    c
}

/// rdkafka alone: poll, commit every batch (async), a final sync commit.
/// With a floor, each batch (or what a poll gap leaves) is deduplicated
/// before its commit.
fn bare(bootstrap: &str, topic: &str, run: usize, floor: Option<RedisFloor>) -> f64 {
    let group = format!("{}-{run}", if floor.is_some() { "floor" } else { "bare" });
    let c: BaseConsumer = client(bootstrap, &group).create().expect("consumer");
    c.subscribe(&[topic]).expect("subscribe");
    let rt = tokio::runtime::Handle::current();
    let mut keys: Vec<Vec<u8>> = Vec::with_capacity(BATCH);
    let flush = |keys: &mut Vec<Vec<u8>>| {
        if let Some(f) = &floor
            && !keys.is_empty()
        {
            rt.block_on(f.dedup(keys));
            keys.clear();
        }
    };
    let mut start = None;
    let mut seen = 0usize;
    while seen < MESSAGES {
        let Some(m) = c.poll(Duration::from_millis(100)) else {
            flush(&mut keys);
            continue;
        };
        let m = m.expect("poll");
        start.get_or_insert_with(super::Timer::start);
        seen += 1;
        if floor.is_some() {
            keys.push(m.payload().unwrap_or_default().to_vec());
        }
        if seen.is_multiple_of(BATCH) {
            flush(&mut keys);
            c.commit_message(&m, CommitMode::Async).expect("commit");
        }
        drop(m);
    }
    flush(&mut keys);
    c.commit_consumer_state(CommitMode::Sync)
        .expect("final commit");
    start.map_or(f64::MAX, |s| s.rate_of(MESSAGES))
}

/// Through the adapter: a no-op handler run once per record through idem,
/// offsets committed by the commit rule.
async fn idem(bootstrap: &str, redis_url: &str, topic: &str, run: usize) -> f64 {
    let consumer = consumer(redis_url, run).await;
    let kc = KafkaConsumer::connect(
        KafkaConfig::new(bootstrap, format!("idem-{run}"), [topic])
            .commit_interval(Duration::from_millis(20))
            .set("fetch.wait.max.ms", "10"),
    )
    .expect("kafka consumer");
    let start: OnceLock<super::Timer> = OnceLock::new();
    let handler = |m: Message| {
        start.get_or_init(super::Timer::start);
        noop(m)
    };
    let done = async {
        loop {
            let committed: i64 = (0..PARTITIONS)
                .map(|p| kc.last_committed(topic, p).unwrap_or(0))
                .sum();
            if committed >= MESSAGES as i64 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    let mut rate = None;
    let report = kc
        .run(&consumer, &handler, async {
            done.await;
            rate = start.get().map(|t| t.rate_of(MESSAGES));
        })
        .await
        .expect("run");
    assert_eq!(report.acked, MESSAGES, "{report:?}");
    rate.unwrap_or(0.0)
}

/// One round: a fresh topic each for the bare loop, the floor and the
/// adapter. Returns (bare, floor, idem).
/// The floor's and idem's rates come with their allocations and CPU per
/// message.
pub(crate) async fn round(
    kafka: &KafkaBroker,
    redis_url: &str,
    run: usize,
) -> (f64, super::Sample, super::Sample) {
    let bootstrap = kafka.bootstrap();
    let mut rates = Vec::new();
    for (offset, floor) in [
        (0, None),
        (200_000, Some(RedisFloor::connect(redis_url, run).await)),
    ] {
        let t = setup(&bootstrap, run + offset).await;
        let bs = bootstrap.clone();
        let rate = tokio::task::spawn_blocking(move || bare(&bs, &t, run, floor))
            .await
            .expect("bare loop");
        rates.push(super::Sample::last(rate));
    }
    let t = setup(&bootstrap, run + 100_000).await;
    let i = idem(&bootstrap, redis_url, &t, run).await;
    (rates[0].rate, rates[1], super::Sample::last(i))
}
