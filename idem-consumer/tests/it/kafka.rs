//! Kafka adapter against a real Kafka-protocol broker: every test spawns
//! its own `tansu` (idem-testkit's `KafkaBroker`, in memory, on a free
//! port) and its own redis-server for idem's store. Ground truth is an
//! external ledger of side effects and the offsets the **broker** reports
//! as committed for the group (never idem's or the adapter's own view).

use idem_consumer::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_consumer::kafka::rdkafka::client::DefaultClientContext;
use idem_consumer::kafka::rdkafka::config::ClientConfig;
use idem_consumer::kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use idem_consumer::kafka::rdkafka::message::{Header, Headers, Message as _, OwnedHeaders};
use idem_consumer::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem_consumer::kafka::rdkafka::{Offset, TopicPartitionList};
use idem_consumer::kafka::{KafkaConfig, KafkaConsumer, KafkaReport, header_names};
use idem_consumer::{Consumer, ErrorClass, KeyDeriver, KeySource, Message, dead_letter_field};
use idem_core::Idempotency;
use idem_redis::RedisStore;
use idem_testkit::{FileLedger, KafkaBroker, Ledger, RedisServer};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

// ------------------------------------------------------------------ helpers

fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

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

fn producer(bootstrap: &str) -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "false")
        .set("linger.ms", "0")
        .create()
        .unwrap()
}

/// Publishes one record to an explicit partition.
async fn publish(
    p: &FutureProducer,
    topic: &str,
    partition: i32,
    id: Option<&str>,
    payload: &[u8],
) {
    let mut headers = OwnedHeaders::new();
    if let Some(id) = id {
        headers = headers.insert(Header {
            key: header_names::IDEMPOTENCY_KEY,
            value: Some(id),
        });
    }
    let record = FutureRecord::<str, [u8]>::to(topic)
        .partition(partition)
        .payload(payload)
        .headers(headers);
    p.send(record, Duration::from_secs(10))
        .await
        .unwrap_or_else(|(e, _)| panic!("cannot publish to {topic}/{partition}: {e}"));
}

fn order(i: usize, sent_at: u64) -> Vec<u8> {
    format!(
        r#"{{"order":"o-{i}","amount":{},"sent_at":{sent_at}}}"#,
        100 + i
    )
    .into_bytes()
}

fn order_of(m: &Message) -> String {
    let v: serde_json::Value = m.json().unwrap_or_default();
    v["order"].as_str().unwrap_or("?").to_owned()
}

/// `n` orders round-robin over `partitions` with their id in the key
/// header, then every 5th again with the same id (into another partition)
/// and every 7th under a new id and timestamp (a re-publish: one order
/// under payload-derived keys, two under header keys). Returns the number
/// of records.
async fn publish_orders(p: &FutureProducer, topic: &str, partitions: i32, n: usize) -> usize {
    let mut sent = 0;
    for i in 0..n {
        let part = (i as i32) % partitions;
        publish(p, topic, part, Some(&format!("o-{i}")), &order(i, 1)).await;
        sent += 1;
    }
    for i in 0..n {
        let part = (i as i32 + 1) % partitions;
        if i % 5 == 0 {
            publish(p, topic, part, Some(&format!("o-{i}")), &order(i, 1)).await;
            sent += 1;
        }
        if i % 7 == 0 {
            let id = format!("o-{i}-again");
            publish(p, topic, part, Some(&id), &order(i, 99)).await;
            sent += 1;
        }
    }
    sent
}

/// The group's committed offsets as the broker reports them, per partition
/// (`None`: nothing committed).
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
    let got = c
        .committed_offsets(tpl, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("cannot read committed offsets of {group}: {e}"));
    (0..partitions)
        .map(|p| match got.find_partition(topic, p).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => Some(o),
            _ => None,
        })
        .collect()
}

fn high_watermarks(bootstrap: &str, topic: &str, partitions: i32) -> Vec<i64> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    (0..partitions)
        .map(|p| {
            c.fetch_watermarks(topic, p, Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("cannot read watermarks of {topic}/{p}: {e}"))
                .1
        })
        .collect()
}

/// Every record of a topic: headers, key and payload.
struct Record {
    headers: BTreeMap<String, String>,
    payload: Vec<u8>,
}

fn read_all(bootstrap: &str, topic: &str, partitions: i32, expect: usize) -> Vec<Record> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", unique("reader"))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    c.assign(&tpl).unwrap();
    let mut out = Vec::new();
    let end = Instant::now() + Duration::from_secs(20);
    while out.len() < expect && Instant::now() < end {
        let Some(Ok(m)) = c.poll(Duration::from_millis(200)) else {
            continue;
        };
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| {
                        (
                            h.key.to_owned(),
                            String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.push(Record {
            headers,
            payload: m.payload().unwrap_or_default().to_vec(),
        });
    }
    out
}

async fn idem_on(url: &str, lease: Duration) -> Idempotency {
    let store = RedisStore::connect(url).await.unwrap();
    Idempotency::builder(store)
        .namespace("kafka-test")
        .lease(lease)
        .build()
}

/// Test settings: short session and commit interval, quick fetches.
fn cfg(bootstrap: &str, group: &str, topic: &str) -> KafkaConfig {
    // `RUST_LOG=idem_consumer=debug` shows the adapter's view when a test fails.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    KafkaConfig::new(bootstrap, group, [topic])
        .commit_interval(Duration::from_millis(100))
        .set("session.timeout.ms", "3000")
        .set("heartbeat.interval.ms", "300")
        .set("fetch.wait.max.ms", "50")
        .set("topic.metadata.refresh.interval.ms", "1000")
}

async fn until(what: &str, deadline: Duration, mut step: impl AsyncFnMut() -> bool) {
    let end = Instant::now() + deadline;
    while !step().await {
        assert!(
            Instant::now() < end,
            "not reached within {deadline:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the broker has the group's commit at the end of every partition.
async fn until_committed_to_the_end(bootstrap: &str, group: &str, topic: &str, partitions: i32) {
    let (b, g, t) = (bootstrap.to_owned(), group.to_owned(), topic.to_owned());
    let ends = {
        let (b, t) = (b.clone(), t.clone());
        tokio::task::spawn_blocking(move || high_watermarks(&b, &t, partitions))
            .await
            .unwrap()
    };
    until(
        "committed offsets at the end of every partition",
        Duration::from_secs(60),
        async || {
            let (b, g, t) = (b.clone(), g.clone(), t.clone());
            let got = tokio::task::spawn_blocking(move || committed(&b, &g, &t, partitions))
                .await
                .unwrap();
            got.iter().zip(&ends).all(|(c, e)| *c == Some(*e))
        },
    )
    .await;
}

fn counts(runs: impl IntoIterator<Item = String>) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for k in runs {
        *m.entry(k).or_default() += 1;
    }
    m
}

// ------------------------------------------------------------------- tests

/// Two consumers (two group members) in one process, payload-derived keys:
/// duplicates and re-publishes under new ids run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_members_payload_keys_duplicates_and_republishes_run_each_order_once() {
    let kafka = KafkaBroker::start();
    let redis = RedisServer::start();
    let (topic, group) = (unique("orders"), unique("billing"));
    create_topic(&kafka.bootstrap(), &topic, 3).await;
    let n = 60;
    let sent = publish_orders(&producer(&kafka.bootstrap()), &topic, 3, n).await;
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(2)).await,
        "orders.charge",
    )
    .keys(KeySource::Payload(
        KeyDeriver::new().exclude("/sent_at").unwrap(),
    ));
    let ledger = Ledger::new();
    let charge = |m: Message| {
        let ledger = &ledger;
        async move {
            // partition@offset, for the message's span
            let position = m.position().unwrap_or_default();
            assert!(
                position
                    .split_once('@')
                    .is_some_and(|(p, o)| p.parse::<i32>().is_ok() && o.parse::<i64>().is_ok()),
                "{position:?}"
            );
            ledger.record(&order_of(&m));
            Ok::<_, String>(())
        }
    };
    let a = KafkaConsumer::connect(cfg(&kafka.bootstrap(), &group, &topic)).unwrap();
    let b = KafkaConsumer::connect(cfg(&kafka.bootstrap(), &group, &topic)).unwrap();
    let bootstrap = kafka.bootstrap();
    let done = until_committed_to_the_end(&bootstrap, &group, &topic, 3);
    let (ra, rb, ()) = tokio::join!(
        a.run(&consumer, &charge, until_stopped(&ledger, n)),
        b.run(&consumer, &charge, until_stopped(&ledger, n)),
        done,
    );
    let mut total = ra.unwrap();
    total.add(rb.unwrap());
    assert_eq!(total.dead_lettered, 0, "{total:?}");
    assert_eq!(
        ledger.total(),
        n,
        "one charge per order: {:?}",
        ledger.duplicates()
    );
    assert!(
        total.acked >= sent,
        "every record acked: {total:?} of {sent}"
    );
}

/// Resolves once the ledger holds `n` distinct keys and a little after (so
/// the commit of the last ones is sent).
async fn until_stopped(ledger: &Ledger, n: usize) {
    loop {
        if ledger.total() >= n {
            tokio::time::sleep(Duration::from_millis(2000)).await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_completion_commits_nothing_past_the_undecided_offset() {
    let kafka = KafkaBroker::start();
    let redis = RedisServer::start();
    let (topic, group) = (unique("ooo"), unique("billing"));
    create_topic(&kafka.bootstrap(), &topic, 1).await;
    let p = producer(&kafka.bootstrap());
    for i in 0..10 {
        publish(&p, &topic, 0, Some(&format!("o-{i}")), &order(i, 1)).await;
    }
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(3)).await,
        "orders.charge",
    );
    let ledger = Ledger::new();
    let (release, released) = tokio::sync::watch::channel(false);
    let charge = |m: Message| {
        let (ledger, mut released) = (&ledger, released.clone());
        async move {
            if order_of(&m) == "o-5" {
                // Offset 5 is slow: everything after it finishes first.
                let _ = released.wait_for(|r| *r).await;
            }
            ledger.record(&order_of(&m));
            Ok::<_, String>(())
        }
    };
    let kc = KafkaConsumer::connect(cfg(&kafka.bootstrap(), &group, &topic)).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let check = async {
        until(
            "offsets 0-4 and 6-9 handled",
            Duration::from_secs(30),
            async || ledger.total() == 9,
        )
        .await;
        // Only offset 5 undecided, and the broker acknowledged a commit
        // since: the adapter has nothing more to commit until 5 is decided.
        until(
            "5 alone undecided, its commit acknowledged",
            Duration::from_secs(10),
            async || kc.undecided() == 1 && kc.last_committed(&topic, 0).is_some(),
        )
        .await;
        let (b, g, t) = (kafka.bootstrap(), group.clone(), topic.clone());
        let at = tokio::task::spawn_blocking(move || committed(&b, &g, &t, 1))
            .await
            .unwrap();
        assert_eq!(
            at,
            vec![Some(5)],
            "7, 8, 9 are done but 5 is not: the group's offset stays at 5 (nothing past 4)"
        );
        release.send(true).unwrap();
        until_committed_to_the_end(&kafka.bootstrap(), &group, &topic, 1).await;
        stop.send(()).unwrap();
    };
    let (report, ()) = tokio::join!(kc.run(&consumer, &charge, stopped), check);
    let report = report.unwrap();
    assert_eq!(report.acked, 10, "{report:?}");
    assert_eq!(ledger.total(), 10);
    assert!(ledger.duplicates().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_records_go_to_the_dead_letter_topic_with_their_reason_and_the_partition_moves_on() {
    let kafka = KafkaBroker::start();
    let redis = RedisServer::start();
    let (topic, group) = (unique("poison"), unique("billing"));
    let dlt = format!("{topic}.DLT");
    create_topic(&kafka.bootstrap(), &topic, 1).await;
    create_topic(&kafka.bootstrap(), &dlt, 1).await;
    let p = producer(&kafka.bootstrap());
    for i in 0..10 {
        publish(&p, &topic, 0, Some(&format!("o-{i}")), &order(i, 1)).await;
    }
    // A key header that is not UTF-8: bad input, dead-lettered unrun.
    let bad = OwnedHeaders::new().insert(Header {
        key: header_names::IDEMPOTENCY_KEY,
        value: Some(&[0xff_u8, 0xfe][..]),
    });
    p.send(
        FutureRecord::<str, [u8]>::to(&topic)
            .partition(0)
            .payload(&order(10, 1)[..])
            .headers(bad),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(2)).await,
        "orders.charge",
    )
    .backoff(Duration::from_millis(20), Duration::from_millis(50))
    .classify(|e: &String| ErrorClass::from_retryable(!e.starts_with("declined")));
    let ledger = Ledger::new();
    let charge = |m: Message| {
        let ledger = &ledger;
        async move {
            let o = order_of(&m);
            ledger.record(&o);
            match o.as_str() {
                "o-3" => Err("declined: card stolen".to_owned()),
                "o-6" => Err("timeout talking to the bank".to_owned()),
                _ => Ok(()),
            }
        }
    };
    let kc = KafkaConsumer::connect(cfg(&kafka.bootstrap(), &group, &topic)).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let check = async {
        until_committed_to_the_end(&kafka.bootstrap(), &group, &topic, 1).await;
        stop.send(()).unwrap();
    };
    let (report, ()) = tokio::join!(kc.run(&consumer, &charge, stopped), check);
    let report = report.unwrap();
    assert_eq!(report.dead_lettered, 3, "{report:?}");
    assert_eq!(report.acked, 8, "the rest of the partition: {report:?}");
    assert_eq!(report.retried, 2, "o-6 ran 3 times in process: {report:?}");
    assert_eq!(ledger.count("o-3"), 1, "permanent: one run");
    assert_eq!(ledger.count("o-6"), 3, "retryable: the in-process attempts");
    assert_eq!(ledger.count("o-10"), 0, "unkeyable: never run");
    let dead = tokio::task::spawn_blocking({
        let (b, d) = (kafka.bootstrap(), dlt.clone());
        move || read_all(&b, &d, 1, 3)
    })
    .await
    .unwrap();
    assert_eq!(dead.len(), 3);
    let by_order: BTreeMap<String, &Record> = dead
        .iter()
        .map(|r| {
            let v: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
            (v["order"].as_str().unwrap().to_owned(), r)
        })
        .collect();
    let h = |o: &str, k: &str| by_order[o].headers.get(k).cloned().unwrap_or_default();
    assert_eq!(h("o-3", header_names::REASON_KIND), "permanent");
    assert_eq!(h("o-3", dead_letter_field::KIND), "permanent");
    assert_eq!(h("o-3", dead_letter_field::DELIVERIES), "1");
    assert!(h("o-3", header_names::REASON).contains("card stolen"));
    assert_eq!(h("o-3", header_names::ORIGINAL_TOPIC), topic);
    assert_eq!(h("o-3", header_names::ORIGINAL_PARTITION), "0");
    assert_eq!(h("o-3", header_names::ORIGINAL_OFFSET), "3");
    assert_eq!(h("o-3", header_names::ATTEMPTS), "1");
    assert_eq!(
        h("o-3", header_names::IDEMPOTENCY_KEY),
        "o-3",
        "original headers kept"
    );
    assert_eq!(h("o-6", header_names::REASON_KIND), "max_failures");
    assert_eq!(h("o-6", dead_letter_field::FAILURES), "3");
    assert!(h("o-6", header_names::REASON).contains("timeout talking to the bank"));
    assert_eq!(h("o-6", header_names::ORIGINAL_OFFSET), "6");
    assert_eq!(h("o-6", header_names::ATTEMPTS), "3");
    assert_eq!(h("o-6", dead_letter_field::DELIVERIES), "3");
    assert_eq!(
        h("o-6", dead_letter_field::KIND),
        h("o-6", header_names::REASON_KIND)
    );
    assert_eq!(h("o-10", header_names::REASON_KIND), "bad_message");
    assert_eq!(h("o-10", header_names::ORIGINAL_OFFSET), "10");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_topic_takes_what_still_fails_and_the_attempts_carry_on() {
    let kafka = KafkaBroker::start();
    let redis = RedisServer::start();
    let (topic, group) = (unique("retry"), unique("billing"));
    let retry = format!("{topic}.retry");
    create_topic(&kafka.bootstrap(), &topic, 1).await;
    create_topic(&kafka.bootstrap(), &retry, 1).await;
    let p = producer(&kafka.bootstrap());
    for i in 0..4 {
        publish(&p, &topic, 0, Some(&format!("o-{i}")), &order(i, 1)).await;
    }
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(2)).await,
        "orders.charge",
    )
    .backoff(Duration::from_millis(20), Duration::from_millis(50));
    let ledger = Ledger::new();
    let charge = |m: Message| {
        let ledger = &ledger;
        async move {
            let o = order_of(&m);
            let run = ledger.record(&o);
            // o-1 fails its first 4 runs: 2 in process, 2 after one trip
            // through the retry topic; the 5th (after a second trip) succeeds.
            if o == "o-1" && run <= 4 {
                return Err(format!("flaky, run {run}, delivery {}", m.delivery_count()));
            }
            Ok::<_, String>(m.delivery_count())
        }
    };
    let kc = KafkaConsumer::connect(
        cfg(&kafka.bootstrap(), &group, &topic)
            .attempts_in_process(2)
            .retry_topic(&retry),
    )
    .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let check = async {
        until_committed_to_the_end(&kafka.bootstrap(), &group, &topic, 1).await;
        until_committed_to_the_end(&kafka.bootstrap(), &group, &retry, 1).await;
        stop.send(()).unwrap();
    };
    let (report, ()) = tokio::join!(kc.run(&consumer, &charge, stopped), check);
    let report = report.unwrap();
    assert_eq!(
        report.retry_published, 2,
        "o-1 went through the retry topic twice: {report:?}"
    );
    assert_eq!(report.redelivered, 2, "{report:?}");
    assert_eq!(report.dead_lettered, 0, "{report:?}");
    assert_eq!(
        report.retried, 2,
        "one in-process retry per hop: {report:?}"
    );
    assert_eq!(
        ledger.count("o-1"),
        5,
        "2 + 2 + 1 runs, the last one succeeding"
    );
    for o in ["o-0", "o-2", "o-3"] {
        assert_eq!(ledger.count(o), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_nothing_runs_nothing_is_committed_then_everything_runs_once() {
    let kafka = KafkaBroker::start();
    let mut redis = RedisServer::start();
    let (topic, group) = (unique("storedown"), unique("billing"));
    create_topic(&kafka.bootstrap(), &topic, 1).await;
    let p = producer(&kafka.bootstrap());
    for i in 0..5 {
        publish(&p, &topic, 0, Some(&format!("o-{i}")), &order(i, 1)).await;
    }
    let store = RedisStore::connect(&redis.url()).await.unwrap();
    let idem = Idempotency::builder(store)
        .namespace("t")
        .store_retries(0)
        .build();
    let consumer = Consumer::new(idem, "orders.charge")
        .backoff(Duration::from_millis(50), Duration::from_millis(100));
    redis.kill();
    let ledger = Ledger::new();
    let charge = |m: Message| {
        let ledger = &ledger;
        async move {
            ledger.record(&order_of(&m));
            Ok::<_, String>(())
        }
    };
    let kc = KafkaConsumer::connect(cfg(&kafka.bootstrap(), &group, &topic)).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let check = async {
        // Commits go on (the consumer is alive) but none moves past offset 0.
        until("all five taken", Duration::from_secs(30), async || {
            kc.undecided() == 5
        })
        .await;
        tokio::time::sleep(Duration::from_millis(1000)).await; // ten commit intervals
        let (b, g, t) = (kafka.bootstrap(), group.clone(), topic.clone());
        let at = tokio::task::spawn_blocking(move || committed(&b, &g, &t, 1))
            .await
            .unwrap();
        assert!(
            matches!(at[0], None | Some(0)),
            "nothing committed while nothing could run: {at:?}"
        );
        assert_eq!(ledger.total(), 0, "fail-closed: nothing ran");
        redis.restart();
        until_committed_to_the_end(&kafka.bootstrap(), &group, &topic, 1).await;
        stop.send(()).unwrap();
    };
    let (report, ()) = tokio::join!(kc.run(&consumer, &charge, stopped), check);
    let report = report.unwrap();
    assert!(
        report.nacked >= 5,
        "each waited while the store was down: {report:?}"
    );
    assert_eq!((report.acked, report.dead_lettered), (5, 0), "{report:?}");
    assert_eq!(ledger.total(), 5);
    assert!(ledger.duplicates().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_restarts_empty_redelivers_everything_and_nothing_runs_twice() {
    let mut kafka = KafkaBroker::start();
    let redis = RedisServer::start();
    let (topic, group) = (unique("restart"), unique("billing"));
    create_topic(&kafka.bootstrap(), &topic, 2).await;
    let p = producer(&kafka.bootstrap());
    for i in 0..20 {
        publish(
            &p,
            &topic,
            (i % 2) as i32,
            Some(&format!("o-{i}")),
            &order(i, 1),
        )
        .await;
    }
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(2)).await,
        "orders.charge",
    );
    let ledger = Ledger::new();
    let charge = |m: Message| {
        let ledger = &ledger;
        async move {
            ledger.record(&order_of(&m));
            Ok::<_, String>(())
        }
    };
    let bootstrap = kafka.bootstrap(); // the same port after the restart
    let run = async |expect: usize| {
        let kc = KafkaConsumer::connect(cfg(&bootstrap, &group, &topic)).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let check = async {
            until("the orders charged", Duration::from_secs(60), async || {
                ledger.total() >= expect
            })
            .await;
            until_committed_to_the_end(&bootstrap, &group, &topic, 2).await;
            stop.send(()).unwrap();
        };
        let (report, ()) = tokio::join!(kc.run(&consumer, &charge, stopped), check);
        report.unwrap()
    };
    run(20).await;
    // tansu keeps everything in memory: it comes back without topics,
    // records or offsets, and the producer sends its records again. The
    // member is closed across the restart: librdkafka 2.12 crashes on
    // tansu's answer to a fetch of a topic it no longer knows (a zero topic
    // id with a leader tag, librdkafka issue #5280's code path), which no
    // Kafka broker sends.
    kafka.restart();
    create_topic(&kafka.bootstrap(), &topic, 2).await;
    let p = producer(&kafka.bootstrap());
    for i in 0..30 {
        publish(
            &p,
            &topic,
            (i % 2) as i32,
            Some(&format!("o-{i}")),
            &order(i, 1),
        )
        .await;
    }
    let report = run(30).await;
    assert_eq!(ledger.total(), 30, "{:?}", ledger.duplicates());
    assert!(ledger.duplicates().is_empty());
    assert!(
        report.replayed >= 20,
        "the first 20 came back and replayed: {report:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_partition_gives_its_handler_the_deadline_then_the_next_owner_waits_and_replays()
{
    let kafka = KafkaBroker::start();
    let redis = RedisServer::start();
    let (topic, group) = (unique("revoke"), unique("billing"));
    create_topic(&kafka.bootstrap(), &topic, 1).await;
    let p = producer(&kafka.bootstrap());
    for i in 0..5 {
        publish(&p, &topic, 0, Some(&format!("o-{i}")), &order(i, 1)).await;
    }
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(2)).await,
        "orders.charge",
    )
    .backoff(Duration::from_millis(50), Duration::from_millis(200));
    let ledger = Ledger::new();
    let (release, released) = tokio::sync::watch::channel(false);
    let charge = |m: Message| {
        let (ledger, mut released) = (&ledger, released.clone());
        async move {
            if order_of(&m) == "o-2" {
                let _ = released.wait_for(|r| *r).await;
            }
            ledger.record(&order_of(&m)); // the side effect, at completion
            Ok::<_, String>(())
        }
    };
    let short = |c: KafkaConfig| c.revoke_deadline(Duration::from_millis(300));
    let a = KafkaConsumer::connect(short(cfg(&kafka.bootstrap(), &group, &topic))).unwrap();
    let (stop_a, stopped_a) = tokio::sync::oneshot::channel::<()>();
    let (stop_b, stopped_b) = tokio::sync::oneshot::channel::<()>();
    let (go_b, b_may_start) = tokio::sync::oneshot::channel::<()>();
    let check = async {
        until(
            "all but o-2 done, 2 committed",
            Duration::from_secs(30),
            async || ledger.total() == 4 && a.last_committed(&topic, 0) == Some(2),
        )
        .await;
        // A second member joins: the group takes the partition from A while
        // o-2's handler runs; A waits 300 ms for it, then gives it up.
        go_b.send(()).unwrap();
        until(
            "the partition given up",
            Duration::from_secs(30),
            async || a.partitions_given_up() >= 1,
        )
        .await;
        let (bs, g, t) = (kafka.bootstrap(), group.clone(), topic.clone());
        let at = tokio::task::spawn_blocking(move || committed(&bs, &g, &t, 1))
            .await
            .unwrap();
        assert_eq!(
            at,
            vec![Some(2)],
            "the revocation committed what was decided, not past o-2"
        );
        // The handler outlived the deadline; it still holds o-2's lease, so
        // the next owner's claim waits. Let it finish now.
        tokio::time::sleep(Duration::from_millis(300)).await;
        release.send(true).unwrap();
        until_committed_to_the_end(&kafka.bootstrap(), &group, &topic, 1).await;
        stop_a.send(()).unwrap();
        stop_b.send(()).unwrap();
    };
    let run_b = async {
        let _ = b_may_start.await;
        // Connecting joins the group.
        let b = KafkaConsumer::connect(short(cfg(&kafka.bootstrap(), &group, &topic))).unwrap();
        b.run(&consumer, &charge, stopped_b).await
    };
    let (ra, rb, ()) = tokio::join!(a.run(&consumer, &charge, stopped_a), run_b, check);
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(ledger.count("o-2"), 1, "one side effect for o-2");
    assert_eq!(ledger.total(), 5, "{:?}", ledger.duplicates());
    assert!(
        ra.replayed + rb.replayed >= 1,
        "the next owner replayed o-2: {ra:?} {rb:?}"
    );
}

/// Shutdown drains: a record whose handler failed when shutdown came gets
/// no further attempt (it is neither retried nor moved to the dead-letter
/// topic), the record decided before it is committed, and the broker's
/// offset stays at the undecided one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_starts_no_further_attempt_and_commits_only_what_is_decided() {
    let kafka = KafkaBroker::start();
    let redis = RedisServer::start();
    let (topic, group) = (unique("drain"), unique("billing"));
    create_topic(&kafka.bootstrap(), &topic, 1).await;
    create_topic(&kafka.bootstrap(), &format!("{topic}.DLT"), 1).await;
    let p = producer(&kafka.bootstrap());
    for i in 0..2 {
        publish(&p, &topic, 0, Some(&format!("o-{i}")), &order(i, 1)).await;
    }
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(2)).await,
        "orders.charge",
    )
    .backoff(Duration::from_millis(20), Duration::from_millis(50));
    let ledger = Ledger::new();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let charge = |m: Message| {
        let (ledger, stop) = (&ledger, &stop);
        async move {
            let o = order_of(&m);
            if o == "o-1" {
                // Fails once o-0 is done, and asks for shutdown as it does.
                until("o-0 done", Duration::from_secs(30), async || {
                    ledger.count("o-0") == 1
                })
                .await;
                ledger.record(&o);
                let _ = stop.send(true);
                return Err("timeout talking to the bank".to_owned());
            }
            ledger.record(&o);
            Ok(())
        }
    };
    let kc = KafkaConsumer::connect(cfg(&kafka.bootstrap(), &group, &topic)).unwrap();
    let mut shutdown = stopped.clone();
    let report = kc
        .run(&consumer, &charge, async move {
            let _ = shutdown.wait_for(|s| *s).await;
        })
        .await
        .unwrap();
    assert_eq!(
        ledger.count("o-1"),
        1,
        "no attempt after shutdown: {report:?}"
    );
    assert_eq!(
        (report.acked, report.retried, report.dead_lettered),
        (1, 0, 0),
        "{report:?}"
    );
    let (b, g, t) = (kafka.bootstrap(), group.clone(), topic.clone());
    let at = tokio::task::spawn_blocking(move || committed(&b, &g, &t, 1))
        .await
        .unwrap();
    assert_eq!(at, vec![Some(1)], "o-0 committed, o-1 (offset 1) not");
}

/// Two copies of one record (same key and payload) in one partition, the
/// first failing once: each offset is decided once, the copy waits for the
/// first and replays, the side effect happens once and the group commits
/// to the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_in_one_partition_with_a_failing_first_are_decided_once_each() {
    let kafka = KafkaBroker::start();
    let redis = RedisServer::start();
    let (topic, group) = (unique("copies"), unique("billing"));
    create_topic(&kafka.bootstrap(), &topic, 1).await;
    let p = producer(&kafka.bootstrap());
    for i in [0, 0, 1] {
        publish(&p, &topic, 0, Some(&format!("o-{i}")), &order(i, 1)).await;
    }
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(2)).await,
        "orders.charge",
    )
    .backoff(Duration::from_millis(20), Duration::from_millis(50));
    let (runs, charged) = (Ledger::new(), Ledger::new());
    let charge = |m: Message| {
        let (runs, charged) = (&runs, &charged);
        async move {
            let o = order_of(&m);
            if runs.record(&o) == 1 && o == "o-0" {
                return Err("timeout talking to the bank".to_owned());
            }
            charged.record(&o);
            Ok(())
        }
    };
    let kc = KafkaConsumer::connect(cfg(&kafka.bootstrap(), &group, &topic)).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let check = async {
        until_committed_to_the_end(&kafka.bootstrap(), &group, &topic, 1).await;
        stop.send(()).unwrap();
    };
    let (report, ()) = tokio::join!(kc.run(&consumer, &charge, stopped), check);
    let report = report.unwrap();
    assert_eq!((charged.count("o-0"), charged.count("o-1")), (1, 1));
    assert_eq!(report.acked, 3, "every offset decided once: {report:?}");
    assert_eq!(report.replayed, 1, "the copy replayed: {report:?}");
    assert_eq!(report.dead_lettered, 0, "{report:?}");
}

// ------------------------------------------------------ processes (re-exec)

/// Child process entry: runs only when re-executed by a test below.
#[test]
fn worker() {
    let Ok(mode) = std::env::var("IDEM_KAFKA_WORKER") else {
        return;
    };
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("worker: {k} not set"));
    let (redis, bootstrap, topic, group, dir) = (
        env("IDEM_REDIS"),
        env("IDEM_KAFKA"),
        env("IDEM_TOPIC"),
        env("IDEM_GROUP"),
        PathBuf::from(env("IDEM_DIR")),
    );
    idem_testkit::run_worker(async move {
        let ledger = FileLedger::at(dir.join("ledger"));
        let consumer = Consumer::new(
            idem_on(&redis, Duration::from_millis(1500)).await,
            "orders.charge",
        );
        let stop = dir.join("stop");
        let stopped = async {
            while !stop.exists() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        let kill_self = || unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        };
        match mode.as_str() {
            "member" => {
                let kc = KafkaConsumer::connect(cfg(&bootstrap, &group, &topic)).unwrap();
                let ledger = &ledger;
                let charge = |m: Message| async move {
                    ledger.record(&order_of(&m));
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    Ok::<_, String>(())
                };
                // Tell the test once this member owns partitions.
                let marker = dir.join(format!("assigned-{}", std::process::id()));
                let announce = async {
                    loop {
                        if kc.client().assignment().is_ok_and(|a| a.count() > 0) {
                            std::fs::write(&marker, b"").unwrap();
                        } else {
                            let _ = std::fs::remove_file(&marker);
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                };
                tokio::select! {
                    r = kc.run(&consumer, &charge, stopped) => { r.unwrap(); }
                    () = announce => {}
                }
            }
            // The seeds' crash: every side effect done and stored, killed
            // before any commit.
            "crash-before-commit" => {
                let n: usize = env("IDEM_N").parse().unwrap();
                let kc = KafkaConsumer::connect(
                    cfg(&bootstrap, &group, &topic).commit_interval(Duration::from_secs(3600)),
                )
                .unwrap();
                let ledger = &ledger;
                let charge = |m: Message| async move {
                    ledger.record(&order_of(&m));
                    Ok::<_, String>(())
                };
                let watch = async {
                    loop {
                        if ledger.runs().len() >= n && kc.undecided() == 0 {
                            kill_self();
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                };
                tokio::select! {
                    r = kc.run(&consumer, &charge, std::future::pending::<()>()) => { r.unwrap(); }
                    () = watch => {}
                }
            }
            // Killed in the middle of the handler, after its side effect.
            "crash-mid-handler" => {
                let kc = KafkaConsumer::connect(cfg(&bootstrap, &group, &topic)).unwrap();
                let ledger = &ledger;
                let charge = |m: Message| async move {
                    ledger.record(&order_of(&m));
                    kill_self();
                    Ok::<_, String>(())
                };
                kc.run(&consumer, &charge, std::future::pending::<()>())
                    .await
                    .unwrap();
            }
            other => panic!("worker: unknown mode {other}"),
        }
    });
    std::process::exit(0);
}

struct Setup {
    kafka: KafkaBroker,
    redis: RedisServer,
    topic: String,
    group: String,
    dir: tempfile::TempDir,
}

impl Setup {
    async fn new(prefix: &str, partitions: i32) -> Setup {
        let kafka = KafkaBroker::start();
        let redis = RedisServer::start();
        let (topic, group) = (unique(prefix), unique("billing"));
        create_topic(&kafka.bootstrap(), &topic, partitions).await;
        Setup {
            kafka,
            redis,
            topic,
            group,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn spawn(&self, mode: &str, extra: &[(&str, &str)]) -> std::process::Child {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "kafka::worker",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("IDEM_KAFKA_WORKER", mode)
        .env("IDEM_REDIS", self.redis.url())
        .env("IDEM_KAFKA", self.kafka.bootstrap())
        .env("IDEM_TOPIC", &self.topic)
        .env("IDEM_GROUP", &self.group)
        .env("IDEM_DIR", self.dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
        for (k, v) in extra {
            cmd.env(k, v);
        }
        cmd.spawn().unwrap()
    }

    /// A new member of the group charging into the shared ledger, until
    /// every partition is committed to its end.
    async fn drain_as_the_next_member(&self, partitions: i32) -> KafkaReport {
        let consumer = Consumer::new(
            idem_on(&self.redis.url(), Duration::from_millis(1500)).await,
            "orders.charge",
        );
        let ledger = self.ledger();
        let charge = |m: Message| {
            let ledger = &ledger;
            async move {
                ledger.record(&order_of(&m));
                Ok::<_, String>(())
            }
        };
        let bootstrap = self.kafka.bootstrap();
        let kc = KafkaConsumer::connect(cfg(&bootstrap, &self.group, &self.topic)).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let check = async {
            until_committed_to_the_end(&bootstrap, &self.group, &self.topic, partitions).await;
            stop.send(()).unwrap();
        };
        let (report, ()) = tokio::join!(kc.run(&consumer, &charge, stopped), check);
        report.unwrap()
    }

    fn ledger(&self) -> FileLedger {
        FileLedger::at(self.dir.path().join("ledger"))
    }

    fn members_assigned(&self) -> usize {
        std::fs::read_dir(self.dir.path())
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| e.file_name().to_string_lossy().starts_with("assigned-"))
                    .count()
            })
            .unwrap_or(0)
    }
}

fn ledger_counts(l: &FileLedger) -> BTreeMap<String, usize> {
    counts(l.runs().into_iter().map(|r| r.key))
}

fn assert_killed(status: std::process::ExitStatus) {
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL),
        "the worker was to kill itself: {status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_in_one_group_over_three_partitions_run_every_order_once() {
    let s = Setup::new("procs", 3).await;
    let mut children = [s.spawn("member", &[]), s.spawn("member", &[])];
    // Both members own partitions (the group rebalanced to two) before
    // anything is published, so both do work.
    until(
        "both members assigned",
        Duration::from_secs(60),
        async || s.members_assigned() == 2,
    )
    .await;
    let n = 90;
    publish_orders(&producer(&s.kafka.bootstrap()), &s.topic, 3, n).await;
    until_committed_to_the_end(&s.kafka.bootstrap(), &s.group, &s.topic, 3).await;
    std::fs::write(s.dir.path().join("stop"), b"").unwrap();
    for c in &mut children {
        assert!(c.wait().unwrap().success());
    }
    let runs = s.ledger().runs();
    let counts = counts(runs.iter().map(|r| r.key.clone()));
    // Header keys: the re-published orders (`o-N-again`) are other keys,
    // so they are charged under the same order name a second time.
    let expected: BTreeMap<String, usize> = (0..n)
        .map(|i| (format!("o-{i}"), if i % 7 == 0 { 2 } else { 1 }))
        .collect();
    assert_eq!(counts, expected, "duplicates of a key ran once");
    let pids: std::collections::BTreeSet<u32> = runs.iter().map(|r| r.pid).collect();
    assert_eq!(pids.len(), 2, "both processes did work");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_side_effect_before_the_commit_the_next_member_replays_and_commits() {
    let s = Setup::new("crash", 3).await;
    let n = 9;
    let p = producer(&s.kafka.bootstrap());
    for i in 0..n {
        publish(
            &p,
            &s.topic,
            (i % 3) as i32,
            Some(&format!("o-{i}")),
            &order(i, 1),
        )
        .await;
    }
    let status = s
        .spawn("crash-before-commit", &[("IDEM_N", &n.to_string())])
        .wait()
        .unwrap();
    assert_killed(status);
    let before = ledger_counts(&s.ledger());
    assert_eq!(
        before.len(),
        n,
        "the victim charged everything before dying"
    );
    let (b, g, t) = (s.kafka.bootstrap(), s.group.clone(), s.topic.clone());
    let at = tokio::task::spawn_blocking(move || committed(&b, &g, &t, 3))
        .await
        .unwrap();
    assert_eq!(at, vec![None, None, None], "killed before any commit");

    // The dead member's session runs out, the group rebalances to the new one.
    let report = s.drain_as_the_next_member(3).await;
    assert_eq!(
        report.replayed, n,
        "every record came back and replayed: {report:?}"
    );
    let after = ledger_counts(&s.ledger());
    assert_eq!(after, before, "no second side effect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_handler_the_next_member_takes_over_after_the_lease_with_one_extra_run() {
    let s = Setup::new("mid", 1).await;
    publish(
        &producer(&s.kafka.bootstrap()),
        &s.topic,
        0,
        Some("o-0"),
        &order(0, 1),
    )
    .await;
    assert_killed(s.spawn("crash-mid-handler", &[]).wait().unwrap());
    assert_eq!(ledger_counts(&s.ledger()).get("o-0"), Some(&1));

    let report = s.drain_as_the_next_member(1).await;
    assert_eq!(
        report.recovered, 1,
        "taken over after the dead holder's lease: {report:?}"
    );
    assert_eq!(
        ledger_counts(&s.ledger()).get("o-0"),
        Some(&2),
        "exactly one extra run"
    );
}
