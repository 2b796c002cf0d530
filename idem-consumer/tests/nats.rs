//! NATS JetStream adapter against real servers: the machine's NATS on
//! 127.0.0.1:4222 (or `NATS_URL`) with a unique stream per test, deleted
//! after; tests that kill the broker spawn a private `nats-server -js`.
//! Ground truth is an external ledger of side effects.

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::PullConsumer, stream};
use idem_consumer::nats::{NatsConfig, NatsConsumer, pull_config};
use idem_consumer::{Adapter, PollReport};
use idem_consumer::{Consumer, ErrorClass, KeyDeriver, KeySource, Message};
use idem_core::{Idempotency, RedisStore};
use idem_testkit::{FileLedger, Ledger, NatsServer, RedisServer};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

// ------------------------------------------------------------------ helpers

fn shared_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// Connects, or fails the test saying why (never passes silently).
async fn js_at(url: &str) -> jetstream::Context {
    let client = tokio::time::timeout(Duration::from_secs(5), async_nats::connect(url))
        .await
        .unwrap_or_else(|_| panic!("NATS at {url} did not answer within 5 s: start `nats-server -js` (or run .ci/run, which does), or set NATS_URL"))
        .unwrap_or_else(|e| panic!("cannot connect to NATS at {url}: {e}; start `nats-server -js` (or run .ci/run), or set NATS_URL"));
    jetstream::new(client)
}

fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}_{}_{}_{}",
        std::process::id(),
        idem_testkit::unix_ms() % 1_000_000_000,
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// A stream named uniquely for one test, capturing `<name>.>`, deleted on drop.
struct TestStream {
    url: String,
    name: String,
    js: jetstream::Context,
}

impl TestStream {
    async fn create(url: &str, prefix: &str, duplicate_window: Duration) -> TestStream {
        let js = js_at(url).await;
        let name = unique(prefix);
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            duplicate_window,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("cannot create stream {name} at {url} (is JetStream enabled? run nats-server with -js): {e}"));
        TestStream {
            url: url.to_owned(),
            name,
            js,
        }
    }

    fn subject(&self, leaf: &str) -> String {
        format!("{}.{leaf}", self.name)
    }

    async fn pull(&self, durable: &str, ack_wait: Duration) -> PullConsumer {
        let stream = self.js.get_stream(&self.name).await.unwrap();
        let mut cfg = pull_config(durable, ack_wait);
        cfg.filter_subject = self.subject("in");
        stream.get_or_create_consumer(durable, cfg).await.unwrap()
    }

    async fn publish(&self, id: Option<&str>, payload: Vec<u8>) {
        let mut headers = HeaderMap::new();
        if let Some(id) = id {
            headers.insert("Nats-Msg-Id", id);
        }
        self.js
            .publish_with_headers(self.subject("in"), headers, payload.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// Nothing left to deliver and nothing waiting for an ack.
    async fn drained(&self, durable: &str) -> bool {
        let stream = self.js.get_stream(&self.name).await.unwrap();
        let info = stream.consumer_info(durable).await.unwrap();
        info.num_pending == 0 && info.num_ack_pending == 0
    }

    async fn redelivered(&self, durable: &str) -> usize {
        let stream = self.js.get_stream(&self.name).await.unwrap();
        stream.consumer_info(durable).await.unwrap().num_redelivered
    }

    /// The dead letters: (headers, payload).
    async fn dead_letters(&self) -> Vec<(BTreeMap<String, String>, Vec<u8>)> {
        let stream = self.js.get_stream(&self.name).await.unwrap();
        let mut cfg = pull_config(&unique("dl"), Duration::from_secs(30));
        cfg.filter_subject = self.subject("dead");
        let c: PullConsumer = stream.create_consumer(cfg).await.unwrap();
        let mut out = Vec::new();
        let mut msgs = c.fetch().max_messages(100).messages().await.unwrap();
        use futures_util::StreamExt;
        while let Some(Ok(m)) = msgs.next().await {
            let h = m
                .headers
                .as_ref()
                .map(|h| {
                    h.iter()
                        .map(|(k, v)| {
                            (
                                k.to_string(),
                                v.first().map(|x| x.to_string()).unwrap_or_default(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.push((h, m.payload.to_vec()));
        }
        out
    }
}

impl Drop for TestStream {
    fn drop(&mut self) {
        let (url, name) = (self.url.clone(), self.name.clone());
        // Drop cannot await: delete from a short-lived runtime of its own.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                if let Ok(Ok(c)) =
                    tokio::time::timeout(Duration::from_secs(2), async_nats::connect(url)).await
                {
                    let _ = jetstream::new(c).delete_stream(&name).await;
                }
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

/// Publishes `n` orders, then (after JetStream's duplicate window passed)
/// every 5th again with the same id and every 7th under a new id and
/// timestamp. Returns how many messages the stream took.
async fn publish_orders(s: &TestStream, n: usize, window: Duration) -> usize {
    for i in 0..n {
        s.publish(Some(&format!("o-{i}")), order(i, 1)).await;
    }
    tokio::time::sleep(window + Duration::from_millis(100)).await;
    let mut added = n;
    for i in 0..n {
        if i % 5 == 0 {
            s.publish(Some(&format!("o-{i}")), order(i, 1)).await;
            added += 1;
        }
        if i % 7 == 0 {
            s.publish(Some(&format!("o-{i}-republished")), order(i, 99))
                .await;
            added += 1;
        }
    }
    added
}

async fn idem_on(url: &str, lease: Duration) -> Idempotency {
    let store = RedisStore::connect(url).await.unwrap();
    Idempotency::builder(store)
        .namespace("nats-test")
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

fn cfg() -> NatsConfig {
    NatsConfig::new()
        .block(Duration::from_millis(200))
        .batch(16)
}

// ------------------------------------------------------------------- tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_tasks_duplicates_and_republishes_run_each_order_once_and_ack_everything() {
    let redis = RedisServer::start();
    let window = Duration::from_millis(200);
    let s = TestStream::create(&shared_url(), "idem_once", window).await;
    let n = 200;
    let added = publish_orders(&s, n, window).await;
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(2)).await,
        "orders.charge",
    )
    .keys(order_key());
    let ledger = Ledger::new();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let nats = NatsConsumer::new(s.pull("billing", Duration::from_secs(10)).await, cfg())
            .await
            .unwrap();
        let (consumer, ledger, stop) = (consumer.clone(), ledger.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let ledger = &ledger;
            let charge = |m: Message| async move {
                ledger.record(&order_of(&m));
                Ok::<_, String>(format!("charged {}", order_of(&m)))
            };
            let mut total = PollReport::default();
            while !stop.load(Ordering::SeqCst) {
                total.add(nats.poll(&consumer, &charge).await.unwrap());
            }
            total
        }));
    }
    until("every message acked", Duration::from_secs(60), async || {
        tokio::time::sleep(Duration::from_millis(100)).await;
        s.drained("billing").await
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    let mut total = PollReport::default();
    for t in tasks {
        total.add(t.await.unwrap());
    }
    // A copy delivered while its twin still runs in another task gets
    // InProgress and is nacked; it comes back and is acked as a replay.
    assert_eq!(total.dead_lettered, 0, "{total:?}");
    assert_eq!(total.acked, added, "every message acked once: {total:?}");
    assert_eq!(
        ledger.total(),
        n,
        "one charge per order: {:?}",
        ledger.duplicates()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_terminated_and_dead_lettered_the_rest_acked() {
    let redis = RedisServer::start();
    let s = TestStream::create(&shared_url(), "idem_poison", Duration::from_secs(60)).await;
    for i in 0..8 {
        let body = match i {
            2 => br#"{"kind":"permanent"}"#.to_vec(),
            5 => br#"{"kind":"retryable"}"#.to_vec(),
            _ => format!(r#"{{"kind":"ok","n":{i}}}"#).into_bytes(),
        };
        s.publish(Some(&format!("j{i}")), body).await;
    }
    let consumer = Consumer::new(idem_on(&redis.url(), Duration::from_secs(5)).await, "jobs")
        .max_deliveries(3)
        .backoff(Duration::from_millis(20), Duration::from_millis(50))
        .classify(|e: &String| ErrorClass::from_retryable(e != "permanent"));
    let nats = NatsConsumer::new(
        s.pull("jobs", Duration::from_secs(10)).await,
        cfg().dead_letter_subject(s.subject("dead")),
    )
    .await
    .unwrap();
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
        total.add(nats.poll(&consumer, &handler).await.unwrap());
        s.drained("jobs").await
    })
    .await;
    assert_eq!(
        (total.acked, total.nacked, total.dead_lettered),
        (6, 2, 2),
        "{total:?}"
    );
    let dead = s.dead_letters().await;
    let by_id: BTreeMap<String, &BTreeMap<String, String>> = dead
        .iter()
        .map(|(h, _)| (h["Idem-Original-Id"].clone(), h))
        .collect();
    assert_eq!(by_id.len(), 2, "{dead:?}");
    assert_eq!(
        (
            by_id["j2"]["Idem-Dead-Kind"].as_str(),
            by_id["j2"]["Idem-Deliveries"].as_str()
        ),
        ("permanent", "1")
    );
    assert_eq!(
        (
            by_id["j5"]["Idem-Dead-Kind"].as_str(),
            by_id["j5"]["Idem-Deliveries"].as_str()
        ),
        ("max_deliveries", "3")
    );
    assert!(dead.iter().any(|(_, p)| p == br#"{"kind":"permanent"}"#));
    assert_eq!(
        (ledger.count("j2"), ledger.count("j5"), ledger.count("j0")),
        (1, 3, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_dead_lettered_with_its_reason_and_runs_nothing() {
    let redis = RedisServer::start();
    let idem = idem_on(&redis.url(), Duration::from_secs(5)).await;
    let ledger = Ledger::new();
    let ledger_ref = &ledger;
    let handler = |_: Message| async move {
        ledger_ref.record("ran");
        Ok::<_, String>(())
    };
    let by_payload =
        TestStream::create(&shared_url(), "idem_bad_payload", Duration::from_secs(60)).await;
    by_payload.publish(None, b"\xff not json".to_vec()).await;
    by_payload.publish(None, Vec::new()).await;
    let by_id = TestStream::create(&shared_url(), "idem_bad_id", Duration::from_secs(60)).await;
    by_id.publish(None, b"{}".to_vec()).await;
    by_id
        .publish(Some(&"x".repeat(10 * 1024)), b"{}".to_vec())
        .await;
    for (s, keys, expect) in [
        (
            &by_payload,
            KeySource::Payload(KeyDeriver::new()),
            vec!["not valid JSON", "not valid JSON"],
        ),
        (
            &by_id,
            KeySource::MessageId,
            vec!["no message id", "10240 bytes"],
        ),
    ] {
        let consumer = Consumer::new(idem.clone(), "bad").keys(keys);
        let nats = NatsConsumer::new(
            s.pull("c", Duration::from_secs(10)).await,
            cfg().dead_letter_subject(s.subject("dead")),
        )
        .await
        .unwrap();
        let mut total = PollReport::default();
        until("bad input settled", Duration::from_secs(10), async || {
            total.add(nats.poll(&consumer, &handler).await.unwrap());
            s.drained("c").await
        })
        .await;
        assert_eq!(total.dead_lettered, expect.len(), "{total:?}");
        let dead = s.dead_letters().await;
        for needle in expect {
            assert!(
                dead.iter()
                    .any(|(h, _)| h["Idem-Dead-Kind"] == "bad_message"
                        && h["Idem-Dead-Reason"].contains(needle)),
                "no dead letter mentions {needle:?}: {dead:?}"
            );
        }
    }
    assert_eq!(ledger.total(), 0);
}

/// A handler slower than `ack_wait`: progress acks keep the message from
/// being redelivered; without them, the redelivery gets `InProgress`, is
/// nacked with a delay, and the late ack of the first delivery (after
/// `ack_wait`) still settles the message. The side effect runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_handlers_send_progress_or_the_redelivery_is_nacked_and_the_late_ack_settles_it() {
    let redis = RedisServer::start();
    for progress in [true, false] {
        let s = TestStream::create(&shared_url(), "idem_slow", Duration::from_secs(60)).await;
        s.publish(Some("s-1"), br#"{"n":1}"#.to_vec()).await;
        let consumer = Consumer::new(
            idem_on(&redis.url(), Duration::from_secs(6)).await,
            &unique("slow"),
        )
        .backoff(Duration::from_millis(100), Duration::from_millis(300));
        let ack_wait = Duration::from_millis(900);
        let a = NatsConsumer::new(s.pull("slow", ack_wait).await, cfg().progress(progress))
            .await
            .unwrap();
        let b = NatsConsumer::new(s.pull("slow", ack_wait).await, cfg().progress(progress))
            .await
            .unwrap();
        let ledger = Ledger::new();
        let ledger_ref = &ledger;
        let slow = |m: Message| async move {
            ledger_ref.record(m.id().unwrap_or("?"));
            tokio::time::sleep(Duration::from_millis(2500)).await;
            Ok::<_, String>(())
        };
        let (ra, rb) = tokio::join!(async { a.poll(&consumer, &slow).await.unwrap() }, async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let mut total = PollReport::default();
            let end = Instant::now() + Duration::from_secs(8);
            while Instant::now() < end {
                total.add(b.poll(&consumer, &slow).await.unwrap());
                if s.drained("slow").await {
                    break;
                }
            }
            total
        });
        assert_eq!(
            ledger.count("s-1"),
            1,
            "progress={progress}: a {ra:?} b {rb:?}"
        );
        assert!(s.drained("slow").await, "progress={progress}: settled");
        if progress {
            assert_eq!(
                (s.redelivered("slow").await, rb.fetched),
                (0, 0),
                "no redelivery: b {rb:?}"
            );
        } else {
            assert!(
                rb.nacked >= 1,
                "the redelivery was nacked while the first ran: {rb:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_survives_a_broker_restart_and_processes_everything_once() {
    let redis = RedisServer::start();
    let mut server = NatsServer::start();
    let s = TestStream::create(&server.url(), "idem_restart", Duration::from_secs(60)).await;
    for i in 0..10 {
        s.publish(
            Some(&format!("m{i}")),
            format!(r#"{{"i":{i}}}"#).into_bytes(),
        )
        .await;
    }
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(5)).await,
        "restart",
    )
    .backoff(Duration::from_millis(50), Duration::from_millis(200));
    let nats = NatsConsumer::new(s.pull("r", Duration::from_secs(2)).await, cfg())
        .await
        .unwrap();
    let ledger = Ledger::new();
    let ledger_ref = &ledger;
    let handler = |m: Message| async move {
        ledger_ref.record(m.id().unwrap_or("?"));
        Ok::<_, String>(())
    };
    let stop = tokio::sync::Notify::new();
    let drive = async {
        until("first ten", Duration::from_secs(20), async || {
            tokio::time::sleep(Duration::from_millis(50)).await;
            ledger.total() == 10
        })
        .await;
        server.kill();
        tokio::time::sleep(Duration::from_millis(500)).await;
        server.restart();
        let again = TestStream {
            url: server.url(),
            name: s.name.clone(),
            js: js_at(&server.url()).await,
        };
        for i in 10..20 {
            again
                .publish(
                    Some(&format!("m{i}")),
                    format!(r#"{{"i":{i}}}"#).into_bytes(),
                )
                .await;
        }
        until("all twenty, acked", Duration::from_secs(30), async || {
            tokio::time::sleep(Duration::from_millis(100)).await;
            ledger.total() >= 20 && again.drained("r").await
        })
        .await;
        std::mem::forget(again); // `s` deletes the stream
        stop.notify_one();
    };
    let (res, ()) = tokio::join!(nats.run(&consumer, &handler, stop.notified()), drive);
    res.unwrap();
    assert_eq!(ledger.total(), 20);
    assert!(ledger.duplicates().is_empty(), "{:?}", ledger.duplicates());
}

// ------------------------------------------------------ processes (re-exec)

/// Child process entry: runs only when re-executed by a test below.
#[test]
fn worker() {
    let Ok(mode) = std::env::var("IDEM_NATS_WORKER") else {
        return;
    };
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("worker: {k} not set"));
    let (redis, nats_url, stream, dir) = (
        env("IDEM_REDIS"),
        env("IDEM_NATS"),
        env("IDEM_STREAM"),
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
        let js = js_at(&nats_url).await;
        let pull: PullConsumer = js
            .get_stream(&stream)
            .await
            .unwrap()
            .get_consumer("billing")
            .await
            .unwrap();
        match mode.as_str() {
            "hammer" => {
                let stop = dir.join("stop");
                let mut tasks = Vec::new();
                for _ in 0..2 {
                    let nats = NatsConsumer::new(pull.clone(), cfg()).await.unwrap();
                    let (consumer, ledger, stop) = (consumer.clone(), ledger.clone(), stop.clone());
                    tasks.push(tokio::spawn(async move {
                        let ledger = &ledger;
                        let charge = |m: Message| async move {
                            ledger.record(&order_of(&m));
                            Ok::<_, String>(())
                        };
                        while !stop.exists() {
                            nats.poll(&consumer, &charge).await.unwrap();
                        }
                    }));
                }
                for t in tasks {
                    t.await.unwrap();
                }
            }
            // The seeds' crash: side effect done and stored, killed before the ack.
            "crash-before-ack" => {
                let nats = NatsConsumer::new(pull, cfg()).await.unwrap();
                let ledger = &ledger;
                let charge = |m: Message| async move {
                    ledger.record(&order_of(&m));
                    Ok::<_, String>(())
                };
                loop {
                    let fetched = nats.fetch().await.unwrap();
                    if fetched.is_empty() {
                        continue;
                    }
                    let _decided = nats.handle(&consumer, &charge, fetched).await;
                    unsafe {
                        libc::kill(libc::getpid(), libc::SIGKILL);
                    }
                }
            }
            // Killed in the middle of the handler, after its side effect.
            "crash-mid-handler" => {
                let nats = NatsConsumer::new(pull, cfg()).await.unwrap();
                let ledger = &ledger;
                let charge = |m: Message| async move {
                    ledger.record(&order_of(&m));
                    unsafe {
                        libc::kill(libc::getpid(), libc::SIGKILL);
                    }
                    Ok::<_, String>(())
                };
                loop {
                    nats.poll(&consumer, &charge).await.unwrap();
                }
            }
            other => panic!("worker: unknown mode {other}"),
        }
    });
    std::process::exit(0);
}

fn spawn_worker(mode: &str, redis: &str, s: &TestStream, dir: &Path) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "worker", "--nocapture", "--test-threads", "1"])
        .env("IDEM_NATS_WORKER", mode)
        .env("IDEM_REDIS", redis)
        .env("IDEM_NATS", &s.url)
        .env("IDEM_STREAM", &s.name)
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_of_two_consumers_each_run_every_order_once() {
    let redis = RedisServer::start();
    let window = Duration::from_millis(200);
    let s = TestStream::create(&shared_url(), "idem_procs", window).await;
    let n = 150;
    publish_orders(&s, n, window).await;
    s.pull("billing", Duration::from_secs(10)).await;
    let dir = tempfile::tempdir().unwrap();
    let mut children: Vec<_> = (0..2)
        .map(|_| spawn_worker("hammer", &redis.url(), &s, dir.path()))
        .collect();
    until("every message acked", Duration::from_secs(60), async || {
        tokio::time::sleep(Duration::from_millis(100)).await;
        s.drained("billing").await
    })
    .await;
    std::fs::write(dir.path().join("stop"), b"").unwrap();
    for c in &mut children {
        assert!(c.wait().unwrap().success());
    }
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
    let s = TestStream::create(&shared_url(), "idem_crash", Duration::from_secs(60)).await;
    let n = 5;
    for i in 0..n {
        s.publish(Some(&format!("o-{i}")), order(i, 1)).await;
    }
    let ack_wait = Duration::from_millis(800);
    s.pull("billing", ack_wait).await;
    let dir = tempfile::tempdir().unwrap();
    let mut child = spawn_worker("crash-before-ack", &redis.url(), &s, dir.path());
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
    let nats = NatsConsumer::new(s.pull("billing", ack_wait).await, cfg())
        .await
        .unwrap();
    let ledger_ref = &ledger;
    let charge = |m: Message| async move {
        ledger_ref.record(&order_of(&m));
        Ok::<_, String>(())
    };
    let mut total = PollReport::default();
    until("everything acked", Duration::from_secs(20), async || {
        total.add(nats.poll(&consumer, &charge).await.unwrap());
        s.drained("billing").await
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_handler_the_redelivery_takes_over_after_the_lease_with_one_extra_run() {
    let redis = RedisServer::start();
    let s = TestStream::create(&shared_url(), "idem_mid", Duration::from_secs(60)).await;
    s.publish(Some("o-0"), order(0, 1)).await;
    let ack_wait = Duration::from_millis(500);
    s.pull("billing", ack_wait).await;
    let dir = tempfile::tempdir().unwrap();
    spawn_worker("crash-mid-handler", &redis.url(), &s, dir.path())
        .wait()
        .unwrap();
    let ledger = FileLedger::at(dir.path().join("ledger"));
    assert_eq!(counts(&ledger).get("o-0"), Some(&1));

    // The dead holder's lease (1.5 s) outlives ack_wait: the first
    // redeliveries get InProgress and are nacked, then one takes over.
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_millis(1500)).await,
        "orders.charge",
    )
    .keys(order_key())
    .max_deliveries(50);
    let nats = NatsConsumer::new(s.pull("billing", ack_wait).await, cfg())
        .await
        .unwrap();
    let ledger_ref = &ledger;
    let charge = |m: Message| async move {
        ledger_ref.record(&order_of(&m));
        Ok::<_, String>(())
    };
    let mut total = PollReport::default();
    until(
        "taken over and acked",
        Duration::from_secs(20),
        async || {
            total.add(nats.poll(&consumer, &charge).await.unwrap());
            total.acked == 1
        },
    )
    .await;
    assert!(
        total.nacked >= 1,
        "InProgress while the dead holder's lease lived: {total:?}"
    );
    assert_eq!(
        counts(&ledger).get("o-0"),
        Some(&2),
        "exactly one extra run, after the lease"
    );
    // Acks are published without waiting for the server: give it a moment.
    until("the ack is in", Duration::from_secs(5), async || {
        s.drained("billing").await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_nothing_runs_everything_nacked_then_processed_exactly_once() {
    let mut store_server = RedisServer::start();
    let s = TestStream::create(&shared_url(), "idem_store_down", Duration::from_secs(60)).await;
    for i in 0..5 {
        s.publish(
            Some(&format!("m{i}")),
            format!(r#"{{"i":{i}}}"#).into_bytes(),
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
    let nats = NatsConsumer::new(s.pull("c", Duration::from_secs(10)).await, cfg())
        .await
        .unwrap();
    let ledger = Ledger::new();
    let ledger_ref = &ledger;
    let h = |m: Message| async move {
        ledger_ref.record(m.id().unwrap_or("?"));
        Ok::<_, String>(())
    };
    store_server.kill();
    let mut down = PollReport::default();
    until("all five nacked", Duration::from_secs(10), async || {
        down.add(nats.poll(&consumer, &h).await.unwrap());
        down.nacked >= 5
    })
    .await;
    assert_eq!(
        (down.acked, ledger.total()),
        (0, 0),
        "fail-closed: nothing ran"
    );
    store_server.restart();
    until(
        "processed after the store is back",
        Duration::from_secs(20),
        async || {
            nats.poll(&consumer, &h).await.unwrap();
            s.drained("c").await
        },
    )
    .await;
    assert_eq!(ledger.total(), 5);
    assert!(ledger.duplicates().is_empty());
}
