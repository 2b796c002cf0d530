//! RabbitMQ adapter against the broker on 127.0.0.1:5672 (guest/guest, or
//! `AMQP_URL`), with unique queue and exchange names per test, deleted
//! after. Ground truth is an external ledger of side effects.

use idem_consumer::rabbitmq::{RabbitConfig, RabbitConsumer, declare_queue};
use idem_consumer::{Adapter, PollReport};
use idem_consumer::{Consumer, ErrorClass, KeyDeriver, KeySource, Message};
use idem_core::{Idempotency, RedisStore};
use idem_testkit::{FileLedger, Ledger, RedisServer};
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ExchangeDeleteOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

// ------------------------------------------------------------------ helpers

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// Connects, or fails the test saying why (never passes silently).
async fn connect() -> Connection {
    let url = amqp_url();
    tokio::time::timeout(Duration::from_secs(10), Connection::connect(&url, Default::default()))
        .await
        .unwrap_or_else(|_| panic!("RabbitMQ at {url} did not answer within 10 s: start rabbitmq-server (or run .ci/run, which does), or set AMQP_URL"))
        .unwrap_or_else(|e| panic!("cannot connect to RabbitMQ at {url}: {e}; start rabbitmq-server (or run .ci/run), or set AMQP_URL"))
}

fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}.{}.{}.{}",
        std::process::id(),
        idem_testkit::unix_ms() % 1_000_000_000,
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// A quorum queue with its dead-letter exchange and queue, deleted on drop.
struct TestQueue {
    conn: Connection,
    channel: Channel,
    queue: String,
    dlx: String,
    dead: String,
}

impl TestQueue {
    async fn create(prefix: &str) -> TestQueue {
        let conn = connect().await;
        let channel = conn.create_channel().await.unwrap();
        let queue = unique(prefix);
        let (dlx, dead) = (format!("{queue}.dlx"), format!("{queue}.dead"));
        declare_queue(&channel, &queue, &dlx, &dead).await.unwrap();
        TestQueue {
            conn,
            channel,
            queue,
            dlx,
            dead,
        }
    }

    async fn consumer(&self, cfg: impl FnOnce(RabbitConfig) -> RabbitConfig) -> RabbitConsumer {
        let channel = self.conn.create_channel().await.unwrap();
        RabbitConsumer::new(
            channel,
            cfg(RabbitConfig::new(&self.queue)
                .block(Duration::from_millis(200))
                .prefetch(16)),
        )
        .await
        .unwrap()
    }

    async fn publish(&self, id: Option<&str>, headers: Option<FieldTable>, payload: &[u8]) {
        let mut props = BasicProperties::default();
        if let Some(id) = id {
            props = props.with_message_id(ShortString::from(id));
        }
        if let Some(h) = headers {
            props = props.with_headers(h);
        }
        self.channel
            .basic_publish(
                "".into(),
                self.queue.as_str().into(),
                BasicPublishOptions::default(),
                payload,
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    async fn ready(&self, queue: &str) -> u32 {
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        self.channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await
            .unwrap()
            .message_count()
    }

    /// The dead-lettered messages: (x-death reason, payload).
    async fn dead_letters(&self) -> Vec<(String, Vec<u8>)> {
        let mut out = Vec::new();
        while let Some(m) = self
            .channel
            .basic_get(self.dead.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let reason = m
                .delivery
                .properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get("x-first-death-reason").cloned())
                .map(|v| match v {
                    AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            out.push((reason, m.delivery.data.clone()));
        }
        out
    }
}

impl Drop for TestQueue {
    fn drop(&mut self) {
        let names = (self.queue.clone(), self.dlx.clone(), self.dead.clone());
        // Drop cannot await: delete from a short-lived runtime of its own.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let Ok(Ok(conn)) = tokio::time::timeout(
                    Duration::from_secs(5),
                    Connection::connect(&amqp_url(), Default::default()),
                )
                .await
                else {
                    return;
                };
                if let Ok(ch) = conn.create_channel().await {
                    let _ = ch
                        .queue_delete(names.0.as_str().into(), QueueDeleteOptions::default())
                        .await;
                    let _ = ch
                        .queue_delete(names.2.as_str().into(), QueueDeleteOptions::default())
                        .await;
                    let _ = ch
                        .exchange_delete(names.1.as_str().into(), ExchangeDeleteOptions::default())
                        .await;
                }
                let _ = conn.close(200, "bye".into()).await;
            });
        })
        .join();
    }
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

fn order_key() -> KeySource {
    KeySource::Payload(KeyDeriver::new().exclude("/sent_at").unwrap())
}

/// Publishes `n` orders, every 5th again with the same id, every 7th under
/// a new id and timestamp; returns how many messages went out.
async fn publish_orders(q: &TestQueue, n: usize) -> usize {
    let mut added = 0;
    for i in 0..n {
        q.publish(Some(&format!("o-{i}")), None, &order(i, 1)).await;
        added += 1;
        if i % 5 == 0 {
            q.publish(Some(&format!("o-{i}")), None, &order(i, 1)).await;
            added += 1;
        }
        if i % 7 == 0 {
            q.publish(Some(&format!("o-{i}-republished")), None, &order(i, 99))
                .await;
            added += 1;
        }
    }
    added
}

async fn idem_on(url: &str, lease: Duration) -> Idempotency {
    let store = RedisStore::connect(url).await.unwrap();
    Idempotency::builder(store)
        .namespace("rabbit-test")
        .lease(lease)
        .build()
}

async fn until(what: &str, deadline: Duration, mut step: impl AsyncFnMut() -> bool) {
    let end = Instant::now() + deadline;
    while !step().await {
        assert!(
            Instant::now() < end,
            "not reached within {deadline:?}: {what}"
        );
    }
}

// ------------------------------------------------------------------- tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_tasks_duplicates_and_republishes_run_each_order_once_and_ack_everything() {
    let redis = RedisServer::start();
    let q = TestQueue::create("idem.once").await;
    let n = 200;
    let added = publish_orders(&q, n).await;
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(2)).await,
        "orders.charge",
    )
    .keys(order_key());
    let ledger = Ledger::new();
    let settled = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let rabbit = q.consumer(|c| c).await;
        let (consumer, ledger, settled, stop) = (
            consumer.clone(),
            ledger.clone(),
            settled.clone(),
            stop.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let ledger = &ledger;
            let charge = |m: Message| async move {
                ledger.record(&order_of(&m));
                Ok::<_, String>(format!("charged {}", order_of(&m)))
            };
            let mut total = PollReport::default();
            while !stop.load(Ordering::SeqCst) {
                let r = rabbit.poll(&consumer, &charge).await.unwrap();
                settled.fetch_add(r.acked + r.dead_lettered, Ordering::SeqCst);
                total.add(r);
            }
            total
        }));
    }
    until("every message acked", Duration::from_secs(60), async || {
        tokio::time::sleep(Duration::from_millis(50)).await;
        settled.load(Ordering::SeqCst) >= added
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    let mut total = PollReport::default();
    for t in tasks {
        total.add(t.await.unwrap());
    }
    // A copy delivered while its twin runs in another task gets InProgress
    // and is nacked; it comes back and is acked as a replay. Every message
    // is acked exactly once in the end.
    assert_eq!((total.acked, total.dead_lettered), (added, 0), "{total:?}");
    assert_eq!(q.ready(&q.queue).await, 0);
    assert_eq!(
        ledger.total(),
        n,
        "one charge per order: {:?}",
        ledger.duplicates()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_rejected_to_the_dead_letter_exchange_the_rest_acked() {
    let redis = RedisServer::start();
    let q = TestQueue::create("idem.poison").await;
    for i in 0..8 {
        let body = match i {
            2 => br#"{"kind":"permanent"}"#.to_vec(),
            5 => br#"{"kind":"retryable"}"#.to_vec(),
            _ => format!(r#"{{"kind":"ok","n":{i}}}"#).into_bytes(),
        };
        q.publish(Some(&format!("j{i}")), None, &body).await;
    }
    let consumer = Consumer::new(idem_on(&redis.url(), Duration::from_secs(5)).await, "jobs")
        .max_deliveries(3)
        .backoff(Duration::from_millis(20), Duration::from_millis(50))
        .classify(|e: &String| ErrorClass::from_retryable(e != "permanent"));
    let rabbit = q.consumer(|c| c).await;
    let ledger = Ledger::new();
    let ledger_ref = &ledger;
    let handler = |m: Message| async move {
        ledger_ref.record(m.id().unwrap_or("?"));
        let v: serde_json::Value = m.json().map_err(|e| e.to_string())?;
        match v["kind"].as_str() {
            Some("ok") => Ok(()),
            Some(k) => Err(k.to_owned()),
            None => Err("no kind".to_owned()),
        }
    };
    let mut total = PollReport::default();
    until("all settled", Duration::from_secs(30), async || {
        total.add(rabbit.poll(&consumer, &handler).await.unwrap());
        total.acked + total.dead_lettered == 8
    })
    .await;
    assert_eq!(
        (total.acked, total.nacked, total.dead_lettered),
        (6, 2, 2),
        "{total:?}"
    );
    // Quorum queues dead-letter asynchronously.
    let mut dead = Vec::new();
    until("two dead letters", Duration::from_secs(10), async || {
        dead.extend(q.dead_letters().await);
        dead.len() >= 2
    })
    .await;
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert!(
        dead.iter().all(|(reason, _)| reason == "rejected"),
        "{dead:?}"
    );
    assert!(dead.iter().any(|(_, p)| p == br#"{"kind":"permanent"}"#));
    assert!(dead.iter().any(|(_, p)| p == br#"{"kind":"retryable"}"#));
    assert_eq!(
        (ledger.count("j2"), ledger.count("j5"), ledger.count("j0")),
        (1, 3, 1),
        "x-delivery-count drives the limit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_rejected_with_its_reason_and_runs_nothing() {
    let redis = RedisServer::start();
    let idem = idem_on(&redis.url(), Duration::from_secs(5)).await;
    let ledger = Ledger::new();
    let ledger_ref = &ledger;
    let handler = |_: Message| async move {
        ledger_ref.record("ran");
        Ok::<_, String>(())
    };
    let header = |v: AMQPValue| {
        let mut h = FieldTable::default();
        h.insert("x-order-id".into(), v);
        Some(h)
    };
    // Payload-derived keys: not JSON. message_id keys: an empty id.
    // Header keys: a 10 KB id, an integer where a string belongs.
    let by_payload = TestQueue::create("idem.bad.payload").await;
    by_payload.publish(None, None, b"\xff not json").await;
    let by_id = TestQueue::create("idem.bad.id").await;
    by_id.publish(Some(""), None, b"{}").await;
    let by_header = TestQueue::create("idem.bad.header").await;
    by_header
        .publish(
            None,
            header(AMQPValue::LongString("x".repeat(10 * 1024).into())),
            b"{}",
        )
        .await;
    by_header
        .publish(None, header(AMQPValue::LongLongInt(7)), b"{}")
        .await;
    for (q, keys, id_header, n) in [
        (&by_payload, KeySource::Payload(KeyDeriver::new()), None, 1),
        (&by_id, KeySource::MessageId, None, 1),
        (&by_header, KeySource::MessageId, Some("x-order-id"), 2),
    ] {
        let consumer = Consumer::new(idem.clone(), "bad").keys(keys);
        let rabbit = q
            .consumer(|c| match id_header {
                Some(h) => c.id_header(h),
                None => c,
            })
            .await;
        let mut total = PollReport::default();
        until("bad input settled", Duration::from_secs(10), async || {
            total.add(rabbit.poll(&consumer, &handler).await.unwrap());
            total.dead_lettered == n
        })
        .await;
        assert_eq!(total.acked, 0);
        let mut dead = 0;
        until("dead letters arrive", Duration::from_secs(10), async || {
            dead += q.dead_letters().await.len();
            dead >= n
        })
        .await;
        assert_eq!(dead, n);
    }
    assert_eq!(ledger.total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn core_bad_input_reasons_for_amqp_messages() {
    // The reasons themselves (the broker only records "rejected"): what the
    // adapter makes of each bad delivery, through the core.
    let redis = RedisServer::start();
    let consumer = Consumer::new(idem_on(&redis.url(), Duration::from_secs(5)).await, "bad")
        .keys(KeySource::MessageId);
    let h = |_: Message| async { Ok::<_, String>(()) };
    for (m, needle) in [
        (Message::new("{}").with_id(""), "empty"),
        (
            Message::new("{}").with_id("x".repeat(10 * 1024)),
            "10240 bytes",
        ),
        (
            Message::new("{}")
                .with_unreadable_id("header `x-order-id` is LongLongInt(7), not a string"),
            "not a string",
        ),
    ] {
        let d = consumer.handle(&m, &h).await.decision;
        assert!(d.to_string().contains(needle), "{needle:?} not in {d}");
    }
}

// ------------------------------------------------------ processes (re-exec)

/// Child process entry: runs only when re-executed by a test below.
#[test]
fn worker() {
    let Ok(mode) = std::env::var("IDEM_RABBIT_WORKER") else {
        return;
    };
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("worker: {k} not set"));
    let (redis, queue, dir) = (
        env("IDEM_REDIS"),
        env("IDEM_QUEUE"),
        PathBuf::from(env("IDEM_DIR")),
    );
    let parent = std::os::unix::process::parent_id();
    std::thread::spawn(move || {
        loop {
            if std::os::unix::process::parent_id() != parent {
                std::process::exit(3);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let ledger = FileLedger::at(dir.join("ledger"));
        let consumer = Consumer::new(
            idem_on(&redis, Duration::from_millis(1500)).await,
            "orders.charge",
        )
        .keys(order_key());
        let conn = connect().await;
        let config = || {
            RabbitConfig::new(&queue)
                .block(Duration::from_millis(200))
                .prefetch(16)
        };
        match mode.as_str() {
            "hammer" => {
                let stop = dir.join("stop");
                let mut tasks = Vec::new();
                for t in 0..2 {
                    let rabbit =
                        RabbitConsumer::new(conn.create_channel().await.unwrap(), config())
                            .await
                            .unwrap();
                    let (consumer, ledger, stop) = (consumer.clone(), ledger.clone(), stop.clone());
                    tasks.push(tokio::spawn(async move {
                        let ledger = &ledger;
                        let charge = |m: Message| async move {
                            ledger.record(&order_of(&m));
                            Ok::<_, String>(())
                        };
                        let mut settled = 0;
                        while !stop.exists() {
                            let r = rabbit.poll(&consumer, &charge).await.unwrap();
                            settled += r.acked + r.dead_lettered;
                            std::fs::write(
                                dir_of(&stop).join(format!("settled-{}-{t}", std::process::id())),
                                settled.to_string(),
                            )
                            .unwrap();
                        }
                    }));
                }
                for t in tasks {
                    t.await.unwrap();
                }
            }
            // The seeds' crash: side effect done and stored, killed before the ack.
            "crash-before-ack" => {
                let rabbit = RabbitConsumer::new(conn.create_channel().await.unwrap(), config())
                    .await
                    .unwrap();
                let ledger = &ledger;
                let charge = |m: Message| async move {
                    ledger.record(&order_of(&m));
                    Ok::<_, String>(())
                };
                loop {
                    let fetched = rabbit.fetch().await.unwrap();
                    if fetched.is_empty() {
                        continue;
                    }
                    let _decided = rabbit.handle(&consumer, &charge, fetched).await;
                    unsafe {
                        libc::kill(libc::getpid(), libc::SIGKILL);
                    }
                }
            }
            other => panic!("worker: unknown mode {other}"),
        }
    });
    std::process::exit(0);
}

fn dir_of(p: &Path) -> &Path {
    p.parent().unwrap()
}

fn spawn_worker(mode: &str, redis: &str, q: &TestQueue, dir: &Path) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "worker", "--nocapture", "--test-threads", "1"])
        .env("IDEM_RABBIT_WORKER", mode)
        .env("IDEM_REDIS", redis)
        .env("IDEM_QUEUE", &q.queue)
        .env("IDEM_DIR", dir)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

fn counts(ledger: &FileLedger) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for r in ledger.runs() {
        *m.entry(r.key).or_default() += 1;
    }
    m
}

fn settled_by_children(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("settled-"))
        .filter_map(|e| {
            std::fs::read_to_string(e.path())
                .ok()?
                .parse::<usize>()
                .ok()
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_of_two_consumers_each_run_every_order_once() {
    let redis = RedisServer::start();
    let q = TestQueue::create("idem.procs").await;
    let n = 150;
    let added = publish_orders(&q, n).await;
    let dir = tempfile::tempdir().unwrap();
    let mut children: Vec<_> = (0..2)
        .map(|_| spawn_worker("hammer", &redis.url(), &q, dir.path()))
        .collect();
    until("every message acked", Duration::from_secs(60), async || {
        tokio::time::sleep(Duration::from_millis(100)).await;
        settled_by_children(dir.path()) >= added
    })
    .await;
    std::fs::write(dir.path().join("stop"), b"").unwrap();
    for c in &mut children {
        assert!(c.wait().unwrap().success());
    }
    assert_eq!(settled_by_children(dir.path()), added);
    assert_eq!(q.ready(&q.queue).await, 0);
    let ledger = FileLedger::at(dir.path().join("ledger"));
    let counts = counts(&ledger);
    assert_eq!(counts.len(), n);
    assert!(
        counts.values().all(|&c| c == 1),
        "{:?}",
        counts.iter().filter(|(_, c)| **c > 1).collect::<Vec<_>>()
    );
    let pids: std::collections::BTreeSet<u32> = ledger.runs().iter().map(|r| r.pid).collect();
    assert_eq!(pids.len(), 2, "both processes did work");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_side_effect_before_the_ack_the_redelivery_replays_and_acks() {
    let redis = RedisServer::start();
    let q = TestQueue::create("idem.crash").await;
    let n = 5;
    for i in 0..n {
        q.publish(Some(&format!("o-{i}")), None, &order(i, 1)).await;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut child = spawn_worker("crash-before-ack", &redis.url(), &q, dir.path());
    let status = child.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL)
    );
    let ledger = FileLedger::at(dir.path().join("ledger"));
    let before = counts(&ledger);
    assert!(
        !before.is_empty(),
        "the victim charged something before dying"
    );

    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_millis(1500)).await,
        "orders.charge",
    )
    .keys(order_key());
    let rabbit = q.consumer(|c| c).await;
    let ledger_ref = &ledger;
    let charge = |m: Message| async move {
        ledger_ref.record(&order_of(&m));
        Ok::<_, String>(())
    };
    let mut total = PollReport::default();
    until("everything acked", Duration::from_secs(20), async || {
        total.add(rabbit.poll(&consumer, &charge).await.unwrap());
        total.acked == n
    })
    .await;
    assert!(
        total.redelivered >= before.len(),
        "the victim's messages came back: {total:?}"
    );
    let after = counts(&ledger);
    assert_eq!(after.len(), n);
    assert!(
        after.values().all(|&c| c == 1),
        "replayed, not re-run: {after:?}"
    );
    assert_eq!(q.ready(&q.queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_nothing_runs_everything_nacked_then_processed_exactly_once() {
    let mut store_server = RedisServer::start();
    let q = TestQueue::create("idem.store.down").await;
    for i in 0..5 {
        q.publish(
            Some(&format!("m{i}")),
            None,
            format!(r#"{{"i":{i}}}"#).as_bytes(),
        )
        .await;
    }
    let store = RedisStore::connect(&store_server.url()).await.unwrap();
    let idem = Idempotency::builder(store)
        .namespace("t")
        .store_retries(0)
        .build();
    let consumer = Consumer::new(idem, "s")
        .max_deliveries(1000)
        .backoff(Duration::from_millis(20), Duration::from_millis(50));
    let rabbit = q.consumer(|c| c).await;
    let ledger = Ledger::new();
    let ledger_ref = &ledger;
    let h = |m: Message| async move {
        ledger_ref.record(m.id().unwrap_or("?"));
        Ok::<_, String>(())
    };
    store_server.kill();
    let mut down = PollReport::default();
    until("all five nacked", Duration::from_secs(10), async || {
        down.add(rabbit.poll(&consumer, &h).await.unwrap());
        down.nacked >= 5
    })
    .await;
    assert_eq!(
        (down.acked, ledger.total()),
        (0, 0),
        "fail-closed: nothing ran"
    );
    store_server.restart();
    let mut up = PollReport::default();
    until(
        "processed after the store is back",
        Duration::from_secs(20),
        async || {
            up.add(rabbit.poll(&consumer, &h).await.unwrap());
            up.acked == 5
        },
    )
    .await;
    assert_eq!(ledger.total(), 5);
    assert!(ledger.duplicates().is_empty());
}
