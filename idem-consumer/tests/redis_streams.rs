//! Redis Streams adapter against real redis-server processes (spawned by
//! idem-testkit): exactly once under duplicates, tasks and processes,
//! crashes, slow handlers, poison messages, a store outage and bad input.
//! Ground truth is an external ledger of side effects.

use idem_consumer::redis_streams::{RedisStreamsConsumer, StreamsConfig};
use idem_consumer::{Adapter, PollReport};
use idem_consumer::{Consumer, ErrorClass, KeyDeriver, KeySource, Message};
use idem_core::{Idempotency, RedisStore};
use idem_testkit::{FileLedger, Ledger, RedisServer, eventually};
use redis::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

// ------------------------------------------------------------------ helpers

async fn conn(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn publish(
    c: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    id: Option<&str>,
    payload: &[u8],
) {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*").arg("payload").arg(payload);
    if let Some(id) = id {
        cmd.arg("id").arg(id);
    }
    let _: String = cmd.query_async(c).await.unwrap();
}

fn order(i: usize, sent_at: u64) -> Vec<u8> {
    format!(
        r#"{{"order":"o-{i}","amount":{},"sent_at":{sent_at}}}"#,
        100 + i
    )
    .into_bytes()
}

/// Publishes `n` orders with ids `o-i`, then duplicates: every 5th again
/// with the same id and payload, every 7th under a new id with a new
/// timestamp. Returns how many entries were added.
async fn publish_orders(url: &str, stream: &str, n: usize) -> usize {
    let mut c = conn(url).await;
    let mut added = 0;
    for i in 0..n {
        publish(&mut c, stream, Some(&format!("o-{i}")), &order(i, 1)).await;
        added += 1;
    }
    for i in 0..n {
        if i % 5 == 0 {
            publish(&mut c, stream, Some(&format!("o-{i}")), &order(i, 1)).await;
            added += 1;
        }
        if i % 7 == 0 {
            publish(
                &mut c,
                stream,
                Some(&format!("o-{i}-republished")),
                &order(i, 99),
            )
            .await;
            added += 1;
        }
    }
    added
}

/// Nothing pending and nothing unread in the group.
async fn drained(url: &str, stream: &str, group: &str) -> bool {
    let mut c = conn(url).await;
    let groups: Vec<HashMap<String, Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(&mut c)
        .await
        .unwrap();
    groups.iter().any(|g| {
        let name = matches!(g.get("name"), Some(Value::BulkString(b)) if b == group.as_bytes());
        name && matches!(g.get("pending"), Some(Value::Int(0)))
            && matches!(g.get("lag"), Some(Value::Int(0)))
    })
}

async fn dead_letters(url: &str, stream: &str) -> Vec<HashMap<String, String>> {
    let mut c = conn(url).await;
    let entries: Vec<(String, HashMap<String, Vec<u8>>)> = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(&mut c)
        .await
        .unwrap();
    entries
        .into_iter()
        .map(|(_, f)| {
            f.into_iter()
                .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
                .collect()
        })
        .collect()
}

fn order_key() -> KeySource {
    KeySource::Payload(KeyDeriver::new().exclude("/sent_at").unwrap())
}

async fn idem_on(url: &str, lease: Duration) -> Idempotency {
    let store = RedisStore::connect(url).await.unwrap();
    Idempotency::builder(store)
        .namespace("consumer-test")
        .lease(lease)
        .build()
}

fn order_of(m: &Message) -> String {
    let v: serde_json::Value = m.json().unwrap_or_default();
    v["order"].as_str().unwrap_or("?").to_owned()
}

/// Polls until `stop`, summing the reports.
async fn poll_until<C, T, E, H, Fut>(
    stream: &RedisStreamsConsumer,
    consumer: &Consumer<C>,
    handler: &H,
    stop: &AtomicBool,
) -> PollReport
where
    H: Fn(Message) -> Fut + Sync,
    Fut: std::future::Future<Output = Result<T, E>> + Send,
    T: serde::Serialize + serde::de::DeserializeOwned + Send + Sync,
    E: std::fmt::Display + Send,
    C: idem_consumer::Classify<E>,
{
    let mut total = PollReport::default();
    while !stop.load(Ordering::SeqCst) {
        let r = stream.poll(consumer, handler).await.unwrap();
        total.fetched += r.fetched;
        total.redelivered += r.redelivered;
        total.acked += r.acked;
        total.nacked += r.nacked;
        total.dead_lettered += r.dead_lettered;
    }
    total
}

/// Runs `step` until it says done, failing after `deadline`.
async fn until(what: &str, deadline: Duration, mut step: impl AsyncFnMut() -> bool) {
    let end = std::time::Instant::now() + deadline;
    while !step().await {
        assert!(
            std::time::Instant::now() < end,
            "not reached within {deadline:?}: {what}"
        );
    }
}

fn cfg(stream: &str, name: &str) -> StreamsConfig {
    StreamsConfig::new(stream, "g", name)
        .block(Duration::from_millis(100))
        .batch(16)
}

// ------------------------------------------------------------------- tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_tasks_duplicates_and_republishes_run_each_order_once_and_ack_everything() {
    let server = RedisServer::start();
    let url = server.url();
    let n = 200;
    let added = publish_orders(&url, "orders", n).await;
    let idem = idem_on(&url, Duration::from_secs(2)).await;
    let consumer = Consumer::new(idem, "orders.charge").keys(order_key());
    let ledger = Ledger::new();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..4 {
        let stream = RedisStreamsConsumer::connect(
            &url,
            cfg("orders", &format!("c{t}")).claim_idle(Duration::from_millis(500)),
        )
        .await
        .unwrap();
        stream.ensure_group().await.unwrap();
        let (consumer, ledger, stop) = (consumer.clone(), ledger.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let charge = async |m: Message| -> Result<String, String> {
                ledger.record(&order_of(&m));
                Ok(format!("charged {}", order_of(&m)))
            };
            poll_until(&stream, &consumer, &charge, &stop).await
        }));
    }
    eventually("every entry acked", Duration::from_secs(60), || async {
        drained(&url, "orders", "g").await.then_some(())
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    let mut acked = 0;
    for t in tasks {
        let r = t.await.unwrap();
        // A copy read while its twin still runs in another task gets
        // InProgress and is nacked; it comes back and is acked as a replay.
        assert_eq!(r.dead_lettered, 0, "{r:?}");
        acked += r.acked;
    }
    assert_eq!(acked, added, "every entry acked exactly once");
    assert_eq!(
        ledger.total(),
        n,
        "one charge per order: {:?}",
        ledger.duplicates()
    );
    assert!(ledger.duplicates().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_dead_lettered_and_the_rest_of_the_batch_is_acked() {
    let server = RedisServer::start();
    let url = server.url();
    let mut c = conn(&url).await;
    for i in 0..8 {
        let body = match i {
            2 => br#"{"kind":"permanent"}"#.to_vec(),
            5 => br#"{"kind":"retryable"}"#.to_vec(),
            _ => format!(r#"{{"kind":"ok","n":{i}}}"#).into_bytes(),
        };
        publish(&mut c, "jobs", Some(&format!("j{i}")), &body).await;
    }
    let idem = idem_on(&url, Duration::from_secs(5)).await;
    let consumer = Consumer::new(idem, "jobs")
        .max_deliveries(3)
        .backoff(Duration::from_millis(20), Duration::from_millis(50))
        .classify(|e: &String| ErrorClass::from_retryable(e != "permanent"));
    let stream = RedisStreamsConsumer::connect(
        &url,
        cfg("jobs", "c").claim_idle(Duration::from_millis(150)),
    )
    .await
    .unwrap();
    stream.ensure_group().await.unwrap();
    let ledger = Ledger::new();
    let handler = async |m: Message| -> Result<(), String> {
        ledger.record(m.id().unwrap_or("?"));
        let v: serde_json::Value = m.json().map_err(|e| e.to_string())?;
        match v["kind"].as_str() {
            Some("ok") => Ok(()),
            Some(k) => Err(k.to_owned()),
            None => Err("no kind".into()),
        }
    };
    let mut total = PollReport::default();
    until("all entries settled", Duration::from_secs(30), async || {
        let r = stream.poll(&consumer, &handler).await.unwrap();
        total.acked += r.acked;
        total.nacked += r.nacked;
        total.dead_lettered += r.dead_lettered;
        drained(&url, "jobs", "g").await
    })
    .await;
    assert_eq!((total.acked, total.nacked, total.dead_lettered), (6, 2, 2));
    let dead = dead_letters(&url, "jobs:dead").await;
    let by_id: BTreeMap<&str, &HashMap<String, String>> =
        dead.iter().map(|f| (f["id"].as_str(), f)).collect();
    assert_eq!(by_id.len(), 2);
    assert_eq!(
        (
            by_id["j2"]["kind"].as_str(),
            by_id["j2"]["deliveries"].as_str()
        ),
        ("permanent", "1")
    );
    assert_eq!(
        (
            by_id["j5"]["kind"].as_str(),
            by_id["j5"]["deliveries"].as_str()
        ),
        ("max_deliveries", "3")
    );
    assert!(
        by_id["j5"]["reason"].contains("retryable"),
        "{:?}",
        by_id["j5"]
    );
    assert_eq!(by_id["j2"]["payload"], r#"{"kind":"permanent"}"#);
    assert_eq!(
        (ledger.count("j2"), ledger.count("j5"), ledger.count("j0")),
        (1, 3, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_dead_lettered_with_its_reason_and_runs_nothing() {
    let server = RedisServer::start();
    let url = server.url();
    let mut c = conn(&url).await;
    // Payload-derived keys: a payload that is not JSON, an entry without payload.
    publish(&mut c, "in", None, b"\xff not json").await;
    let _: String = redis::cmd("XADD")
        .arg("in")
        .arg("*")
        .arg("body")
        .arg("x")
        .query_async(&mut c)
        .await
        .unwrap();
    // Id keys: empty, 10 KB and non-UTF-8 ids.
    publish(&mut c, "ids", Some(""), b"{}").await;
    publish(&mut c, "ids", Some(&"x".repeat(10 * 1024)), b"{}").await;
    let _: String = redis::cmd("XADD")
        .arg("ids")
        .arg("*")
        .arg("payload")
        .arg("{}")
        .arg("id")
        .arg(&b"\xff\xfe"[..])
        .query_async(&mut c)
        .await
        .unwrap();
    let idem = idem_on(&url, Duration::from_secs(5)).await;
    let ledger = Ledger::new();
    let handler = async |_: Message| -> Result<(), String> {
        ledger.record("ran");
        Ok(())
    };
    for (name, keys, expect) in [
        (
            "in",
            KeySource::Payload(KeyDeriver::new()),
            vec!["not valid JSON", "no `payload` field"],
        ),
        (
            "ids",
            KeySource::MessageId,
            vec!["empty", "10240 bytes", "not UTF-8"],
        ),
    ] {
        let consumer = Consumer::new(idem.clone(), name).keys(keys);
        let stream = RedisStreamsConsumer::connect(&url, cfg(name, "c"))
            .await
            .unwrap();
        stream.ensure_group().await.unwrap();
        let r = stream.poll(&consumer, &handler).await.unwrap();
        assert_eq!(
            (r.fetched, r.dead_lettered),
            (expect.len(), expect.len()),
            "{name}: {r:?}"
        );
        let dead = dead_letters(&url, &format!("{name}:dead")).await;
        for needle in expect {
            assert!(
                dead.iter()
                    .any(|f| f["kind"] == "bad_message" && f["reason"].contains(needle)),
                "{name}: no dead letter mentions {needle:?}: {dead:?}"
            );
        }
        assert!(drained(&url, name, "g").await);
    }
    assert_eq!(ledger.total(), 0);
}

/// A handler slower than the idle time: with the owner re-claiming its
/// entry nobody else gets it; without, the other consumer takes it over,
/// gets `InProgress` and nacks until the first finishes and acks it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_handlers_keep_their_entries_or_the_duplicate_waits_for_a_replay() {
    for keep in [true, false] {
        let server = RedisServer::start();
        let url = server.url();
        let mut c = conn(&url).await;
        publish(&mut c, "slow", Some("s-1"), br#"{"n":1}"#).await;
        let idem = idem_on(&url, Duration::from_secs(3)).await;
        let consumer = Consumer::new(idem, "slow")
            .backoff(Duration::from_millis(20), Duration::from_millis(50));
        let config = |name: &str| {
            cfg("slow", name)
                .claim_idle(Duration::from_millis(200))
                .keep_claimed(keep)
        };
        let a = RedisStreamsConsumer::connect(&url, config("a"))
            .await
            .unwrap();
        let b = RedisStreamsConsumer::connect(&url, config("b"))
            .await
            .unwrap();
        a.ensure_group().await.unwrap();
        let ledger = Ledger::new();
        let b_runs = AtomicUsize::new(0);
        let slow = async |m: Message| -> Result<(), String> {
            ledger.record(m.id().unwrap_or("?"));
            tokio::time::sleep(Duration::from_millis(1200)).await;
            Ok(())
        };
        let counting = async |m: Message| -> Result<(), String> {
            b_runs.fetch_add(1, Ordering::SeqCst);
            ledger.record(m.id().unwrap_or("?"));
            Ok(())
        };
        let stop = AtomicBool::new(false);
        let (ra, rb) = tokio::join!(
            async {
                let r = a.poll(&consumer, &slow).await.unwrap();
                // Keep polling so a's own nacked entry can come back to it.
                tokio::time::sleep(Duration::from_millis(100)).await;
                r
            },
            async {
                // Let a take the entry first.
                tokio::time::sleep(Duration::from_millis(50)).await;
                let mut total = PollReport::default();
                let end = std::time::Instant::now() + Duration::from_secs(4);
                while std::time::Instant::now() < end && !stop.load(Ordering::SeqCst) {
                    let r = b.poll(&consumer, &counting).await.unwrap();
                    total.redelivered += r.redelivered;
                    total.acked += r.acked;
                    total.nacked += r.nacked;
                    if drained(&url, "slow", "g").await {
                        break;
                    }
                }
                total
            }
        );
        // a's XACK settles the entry whoever holds it now. Without the
        // owner's re-claims, b may also get its nacked copy back after a
        // completed and ack it as a replay (XACK is idempotent): the side
        // effect still ran once (ledger, below).
        assert_eq!(ra.acked, 1, "keep={keep}: a {ra:?} b {rb:?}");
        let b_acks = if keep { 0..=0 } else { 0..=1 };
        assert!(b_acks.contains(&rb.acked), "keep={keep}: a {ra:?} b {rb:?}");
        if keep {
            assert_eq!(
                rb.redelivered, 0,
                "the owner's re-claims kept b off its entry"
            );
        } else {
            assert!(
                rb.redelivered >= 1 && rb.nacked >= 1,
                "b took over, got InProgress, nacked: {rb:?}"
            );
        }
        assert!(drained(&url, "slow", "g").await);
        assert_eq!(ledger.count("s-1"), 1, "keep={keep}");
        assert_eq!(b_runs.load(Ordering::SeqCst), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_nothing_runs_everything_nacked_then_processed_exactly_once() {
    let broker = RedisServer::start();
    let mut store_server = RedisServer::start();
    let url = broker.url();
    let mut c = conn(&url).await;
    for i in 0..5 {
        publish(
            &mut c,
            "s",
            Some(&format!("m{i}")),
            format!(r#"{{"i":{i}}}"#).as_bytes(),
        )
        .await;
    }
    let store = RedisStore::connect(&store_server.url()).await.unwrap();
    let idem = Idempotency::builder(store)
        .namespace("t")
        .store_retries(0)
        .build();
    let consumer =
        Consumer::new(idem, "s").backoff(Duration::from_millis(20), Duration::from_millis(50));
    let stream =
        RedisStreamsConsumer::connect(&url, cfg("s", "c").claim_idle(Duration::from_millis(150)))
            .await
            .unwrap();
    stream.ensure_group().await.unwrap();
    let ledger = Ledger::new();
    let h = async |m: Message| -> Result<(), String> {
        ledger.record(m.id().unwrap_or("?"));
        Ok(())
    };
    store_server.kill();
    let r = stream.poll(&consumer, &h).await.unwrap();
    assert_eq!((r.fetched, r.nacked, r.acked), (5, 5, 0));
    assert_eq!(ledger.total(), 0, "fail-closed: nothing ran");
    store_server.restart();
    eventually(
        "processed after the store is back",
        Duration::from_secs(20),
        || async {
            stream.poll(&consumer, &h).await.unwrap();
            drained(&url, "s", "g").await.then_some(())
        },
    )
    .await;
    assert_eq!(ledger.total(), 5);
    assert!(ledger.duplicates().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_survives_a_broker_restart_and_recreates_its_group() {
    let mut broker = RedisServer::start();
    let store_server = RedisServer::start();
    let url = broker.url();
    let idem = idem_on(&store_server.url(), Duration::from_secs(5)).await;
    let consumer =
        Consumer::new(idem, "r").backoff(Duration::from_millis(20), Duration::from_millis(100));
    let stream = RedisStreamsConsumer::connect(&url, cfg("r", "c"))
        .await
        .unwrap();
    stream.ensure_group().await.unwrap();
    let ledger = Ledger::new();
    let stop = tokio::sync::Notify::new();
    let h = async |m: Message| -> Result<(), String> {
        ledger.record(m.id().unwrap_or("?"));
        Ok(())
    };
    let run = stream.run(&consumer, &h, stop.notified());
    let drive = async {
        let mut c = conn(&url).await;
        publish(&mut c, "r", Some("before"), b"{}").await;
        eventually("first message", Duration::from_secs(10), || async {
            (ledger.count("before") == 1).then_some(())
        })
        .await;
        broker.kill();
        tokio::time::sleep(Duration::from_millis(300)).await;
        broker.restart();
        // The restarted broker has no stream and no group (no persistence);
        // the consumer recreates its group and goes on.
        let mut c = conn(&url).await;
        eventually("group recreated", Duration::from_secs(10), || async {
            let groups: redis::RedisResult<Vec<HashMap<String, Value>>> = redis::cmd("XINFO")
                .arg("GROUPS")
                .arg("r")
                .query_async(&mut c.clone())
                .await;
            groups.ok().filter(|g| !g.is_empty()).map(|_| ())
        })
        .await;
        publish(&mut c, "r", Some("after"), b"{}").await;
        publish(&mut c, "r", Some("before"), b"{}").await;
        eventually("second message", Duration::from_secs(10), || async {
            drained(&url, "r", "g").await.then_some(())
        })
        .await;
        stop.notify_one();
    };
    let (res, ()) = tokio::join!(run, drive);
    res.unwrap();
    assert_eq!((ledger.count("before"), ledger.count("after")), (1, 1));
}

// ------------------------------------------------------ processes (re-exec)

/// Child process entry: runs only when re-executed by a test below.
#[test]
fn worker() {
    let Ok(mode) = std::env::var("IDEM_CONSUMER_WORKER") else {
        return;
    };
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("worker: {k} not set"));
    let (url, dir, name) = (
        env("IDEM_URL"),
        PathBuf::from(env("IDEM_DIR")),
        env("IDEM_NAME"),
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
        let idem = idem_on(&url, Duration::from_millis(1500)).await;
        let consumer = Consumer::new(idem, "orders.charge").keys(order_key());
        let kill_self = || unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        };
        match mode.as_str() {
            "hammer" => {
                let stop = dir.join("stop");
                let mut tasks = Vec::new();
                for t in 0..2 {
                    let stream =
                        RedisStreamsConsumer::connect(&url, cfg("orders", &format!("{name}-{t}")))
                            .await
                            .unwrap();
                    let (consumer, ledger, stop) = (consumer.clone(), ledger.clone(), stop.clone());
                    tasks.push(tokio::spawn(async move {
                        let charge = async |m: Message| -> Result<(), String> {
                            ledger.record(&order_of(&m));
                            Ok(())
                        };
                        while !stop.exists() {
                            stream.poll(&consumer, &charge).await.unwrap();
                        }
                    }));
                }
                for t in tasks {
                    t.await.unwrap();
                }
            }
            // The seeds' crash: side effect done and stored, killed before the ack.
            "crash-before-ack" => {
                let stream = RedisStreamsConsumer::connect(&url, cfg("orders", &name))
                    .await
                    .unwrap();
                let charge = async |m: Message| -> Result<(), String> {
                    ledger.record(&order_of(&m));
                    Ok(())
                };
                loop {
                    let entries = stream.fetch().await.unwrap();
                    if entries.is_empty() {
                        continue;
                    }
                    let _decided = stream.handle(&consumer, &charge, entries).await;
                    kill_self();
                }
            }
            // Killed in the middle of the handler, after its side effect.
            "crash-mid-handler" => {
                let stream = RedisStreamsConsumer::connect(&url, cfg("orders", &name))
                    .await
                    .unwrap();
                let charge = async |m: Message| -> Result<(), String> {
                    ledger.record(&order_of(&m));
                    kill_self();
                    Ok(())
                };
                loop {
                    stream.poll(&consumer, &charge).await.unwrap();
                }
            }
            other => panic!("worker: unknown mode {other}"),
        }
    });
    std::process::exit(0);
}

fn spawn_worker(mode: &str, url: &str, dir: &Path, name: &str) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "worker", "--nocapture", "--test-threads", "1"])
        .env("IDEM_CONSUMER_WORKER", mode)
        .env("IDEM_URL", url)
        .env("IDEM_DIR", dir)
        .env("IDEM_NAME", name)
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_of_two_consumers_each_run_every_order_once() {
    let server = RedisServer::start();
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let n = 150;
    let added = publish_orders(&url, "orders", n).await;
    let setup = RedisStreamsConsumer::connect(&url, cfg("orders", "setup"))
        .await
        .unwrap();
    setup.ensure_group().await.unwrap();
    let mut children: Vec<_> = (0..2)
        .map(|p| spawn_worker("hammer", &url, dir.path(), &format!("p{p}")))
        .collect();
    eventually("every entry acked", Duration::from_secs(60), || async {
        drained(&url, "orders", "g").await.then_some(())
    })
    .await;
    std::fs::write(dir.path().join("stop"), b"").unwrap();
    for c in &mut children {
        assert!(c.wait().unwrap().success());
    }
    let ledger = FileLedger::at(dir.path().join("ledger"));
    let counts = counts(&ledger);
    assert_eq!(counts.len(), n, "{added} entries");
    assert!(
        counts.values().all(|&c| c == 1),
        "duplicates: {:?}",
        counts.iter().filter(|(_, c)| **c > 1).collect::<Vec<_>>()
    );
    let pids: std::collections::BTreeSet<u32> = ledger.runs().iter().map(|r| r.pid).collect();
    assert_eq!(pids.len(), 2, "both processes did work");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_side_effect_before_the_ack_the_redelivery_replays_and_acks() {
    let server = RedisServer::start();
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let n = 5;
    publish_orders(&url, "orders", n).await;
    let setup = RedisStreamsConsumer::connect(&url, cfg("orders", "setup"))
        .await
        .unwrap();
    setup.ensure_group().await.unwrap();
    let mut child = spawn_worker("crash-before-ack", &url, dir.path(), "victim");
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

    let idem = idem_on(&url, Duration::from_millis(1500)).await;
    let consumer = Consumer::new(idem, "orders.charge").keys(order_key());
    let stream = RedisStreamsConsumer::connect(
        &url,
        cfg("orders", "survivor").claim_idle(Duration::from_millis(200)),
    )
    .await
    .unwrap();
    let charge = async |m: Message| -> Result<(), String> {
        ledger.record(&order_of(&m));
        Ok(())
    };
    let mut claimed = 0;
    until("everything acked", Duration::from_secs(20), async || {
        claimed += stream.poll(&consumer, &charge).await.unwrap().redelivered;
        drained(&url, "orders", "g").await
    })
    .await;
    assert!(
        claimed >= before.len(),
        "the victim's entries were redelivered: {claimed}"
    );
    let after = counts(&ledger);
    assert_eq!(after.len(), n);
    assert!(
        after.values().all(|&c| c == 1),
        "replayed, not re-run: {after:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_handler_the_redelivery_takes_over_after_the_lease_with_one_extra_run() {
    let server = RedisServer::start();
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let mut c = conn(&url).await;
    publish(&mut c, "orders", Some("o-0"), &order(0, 1)).await;
    let setup = RedisStreamsConsumer::connect(&url, cfg("orders", "setup"))
        .await
        .unwrap();
    setup.ensure_group().await.unwrap();
    let mut child = spawn_worker("crash-mid-handler", &url, dir.path(), "victim");
    child.wait().unwrap();
    let ledger = FileLedger::at(dir.path().join("ledger"));
    assert_eq!(counts(&ledger).get("o-0"), Some(&1));

    let idem = idem_on(&url, Duration::from_millis(1500)).await;
    // Each InProgress answer while the dead holder's lease lives is a
    // delivery: leave room for them (see StreamsConfig::claim_idle).
    let consumer = Consumer::new(idem, "orders.charge")
        .keys(order_key())
        .max_deliveries(50)
        .backoff(Duration::from_millis(50), Duration::from_millis(200));
    let stream = RedisStreamsConsumer::connect(
        &url,
        cfg("orders", "survivor").claim_idle(Duration::from_millis(200)),
    )
    .await
    .unwrap();
    let charge = async |m: Message| -> Result<(), String> {
        ledger.record(&order_of(&m));
        Ok(())
    };
    let mut nacked = 0;
    until(
        "taken over and acked",
        Duration::from_secs(20),
        async || {
            nacked += stream.poll(&consumer, &charge).await.unwrap().nacked;
            drained(&url, "orders", "g").await
        },
    )
    .await;
    assert!(
        nacked >= 1,
        "InProgress while the dead holder's lease lived"
    );
    assert_eq!(
        counts(&ledger).get("o-0"),
        Some(&2),
        "exactly one extra run, after the lease"
    );
}
