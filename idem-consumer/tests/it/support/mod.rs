//! The scenarios every broker adapter must pass, written once and run by
//! each broker's test module (`tests/it/{redis_streams,nats,rabbitmq,kafka}.rs`)
//! through its [`Place`]: a uniquely named stream, queue or topic on a real
//! broker, and its consumers ([`Member`]s).
//! Ground truth is an external ledger of side effects; completion is
//! counted from the adapters' own reports (each message acked or
//! dead-lettered exactly once), then checked on the broker ([`Place::drained`]).

#![allow(dead_code)] // each test binary uses its own subset

use idem_consumer::{
    Adapter, Classify, Consumer, ConsumerError, ErrorClass, KeyDeriver, KeySource, Message,
    PollReport,
};
use idem_core::Idempotency;
use idem_redis::RedisStore;
use idem_testkit::{FileLedger, Ledger, RedisServer};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// One dead-lettered message as the broker keeps it, with idem's fields
/// (`DeadLetterReason::fields`); what a place does not record is `None`.
#[derive(Debug, Clone)]
pub(crate) struct DeadLetter {
    pub id: Option<String>,
    pub kind: Option<String>,
    pub reason: Option<String>,
    pub deliveries: Option<u32>,
    pub payload: Vec<u8>,
}

/// A consumer of a place, as the scenarios drive it: every [`Adapter`]
/// (brokers with per-message acks, through the shared fetch → handle →
/// settle loop), and Kafka's group member, whose own `run` decides records
/// and commits offsets (`kafka.rs` says how it polls).
pub(crate) trait Member: Send + Sync {
    /// Handles what arrives within a short wait and settles it
    /// ([`Adapter::poll`]).
    fn poll<C, T, E, H, Fut>(
        &self,
        consumer: &Consumer<C>,
        handler: &H,
    ) -> impl Future<Output = Result<PollReport, ConsumerError>> + Send
    where
        H: Fn(Message) -> Fut + Sync,
        Fut: Future<Output = Result<T, E>> + Send,
        T: Serialize + DeserializeOwned + Send + Sync,
        E: fmt::Display + Send,
        C: Classify<E>;

    /// Handles and settles until `shutdown`, then drains ([`Adapter::run`]).
    fn run<C, T, E, H, Fut, S>(
        &self,
        consumer: &Consumer<C>,
        handler: &H,
        shutdown: S,
    ) -> impl Future<Output = Result<(), ConsumerError>> + Send
    where
        H: Fn(Message) -> Fut + Sync,
        Fut: Future<Output = Result<T, E>> + Send,
        T: Serialize + DeserializeOwned + Send + Sync,
        E: fmt::Display + Send,
        C: Classify<E>,
        S: Future + Send;

    /// Runs the handlers of the next deliveries through idem and returns
    /// without telling the broker anything (the crash before the ack).
    fn handle_unsettled<C, T, E, H, Fut>(
        &self,
        consumer: &Consumer<C>,
        handler: &H,
    ) -> impl Future<Output = ()> + Send
    where
        H: Fn(Message) -> Fut + Sync,
        Fut: Future<Output = Result<T, E>> + Send,
        T: Serialize + DeserializeOwned + Send + Sync,
        E: fmt::Display + Send,
        C: Classify<E>;
}

impl<A: Adapter> Member for A {
    fn poll<C, T, E, H, Fut>(
        &self,
        consumer: &Consumer<C>,
        handler: &H,
    ) -> impl Future<Output = Result<PollReport, ConsumerError>> + Send
    where
        H: Fn(Message) -> Fut + Sync,
        Fut: Future<Output = Result<T, E>> + Send,
        T: Serialize + DeserializeOwned + Send + Sync,
        E: fmt::Display + Send,
        C: Classify<E>,
    {
        Adapter::poll(self, consumer, handler)
    }

    fn run<C, T, E, H, Fut, S>(
        &self,
        consumer: &Consumer<C>,
        handler: &H,
        shutdown: S,
    ) -> impl Future<Output = Result<(), ConsumerError>> + Send
    where
        H: Fn(Message) -> Fut + Sync,
        Fut: Future<Output = Result<T, E>> + Send,
        T: Serialize + DeserializeOwned + Send + Sync,
        E: fmt::Display + Send,
        C: Classify<E>,
        S: Future + Send,
    {
        Adapter::run(self, consumer, handler, shutdown)
    }

    /// One fetched batch, handled; its decisions never applied.
    async fn handle_unsettled<C, T, E, H, Fut>(&self, consumer: &Consumer<C>, handler: &H)
    where
        H: Fn(Message) -> Fut + Sync,
        Fut: Future<Output = Result<T, E>> + Send,
        T: Serialize + DeserializeOwned + Send + Sync,
        E: fmt::Display + Send,
        C: Classify<E>,
    {
        loop {
            let fetched = self.fetch().await.unwrap();
            if fetched.is_empty() {
                continue;
            }
            let _decided = self.handle(consumer, handler, fetched).await;
            return;
        }
    }
}

/// A uniquely named stream, queue or topic on a real broker, with a
/// dead-letter destination; deleted on drop by the place that created it.
pub(crate) trait Place: Send + Sync + Sized + 'static {
    /// The consumer under test.
    type Adapter: Member + 'static;
    /// Prefix of the environment variables handed to worker processes.
    const WORKER_ENV: &'static str;
    /// The worker test's full name in the test binary (`nats::worker`), which
    /// a worker process is re-executed with (`--exact`).
    const WORKER_TEST: &'static str;

    /// Publishes a message, with a producer id or without.
    fn publish(&self, id: Option<&str>, payload: &[u8]) -> impl Future<Output = ()> + Send;
    /// A consumer in the place's one consumer group, redelivering unacked
    /// messages after `redeliver_after` where the broker has such a
    /// setting (ack wait, claim idle time), dead letters configured.
    fn adapter(
        &self,
        name: &str,
        redeliver_after: Duration,
    ) -> impl Future<Output = Self::Adapter> + Send;
    /// Nothing left to deliver, nothing waiting for an ack.
    fn drained(&self) -> impl Future<Output = bool> + Send;
    /// Dead letters so far (some brokers deliver them asynchronously).
    fn dead_letters(&self) -> impl Future<Output = Vec<DeadLetter>> + Send;
    /// Whether the adapter says where each delivery sits in its source
    /// (`Message::position`): a stream entry id, a stream sequence.
    const POSITIONED: bool = true;
    /// Whether the broker may hand one message to two consumers at once
    /// (SQS standard queues deliver at least once, "occasionally more than
    /// one copy"): each copy is settled, so a message can be settled twice
    /// while its body still runs once.
    const COPIES: bool = false;
    /// How long to wait before re-publishing an id, for brokers that drop
    /// re-published ids within a window (JetStream).
    fn duplicate_gap(&self) -> Duration {
        Duration::ZERO
    }
    /// What a worker process needs to find the place again.
    fn to_env(&self) -> Vec<(String, String)>;
    /// The place from a worker's environment (not deleted when dropped).
    fn from_env() -> impl Future<Output = Self> + Send;
}

// ------------------------------------------------------------------ helpers

/// Runs `cleanup` to completion from a `Drop` (which cannot await), on a
/// short-lived runtime of its own on another thread, so it also works
/// inside the test's runtime.
pub(crate) fn clean_up_aside(cleanup: impl Future<Output = ()> + Send + 'static) {
    let _ = std::thread::spawn(move || {
        if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            rt.block_on(cleanup);
        }
    })
    .join();
}

pub(crate) fn order(i: usize, sent_at: u64) -> Vec<u8> {
    format!(
        r#"{{"order":"o-{i}","amount":{},"sent_at":{sent_at}}}"#,
        100 + i
    )
    .into_bytes()
}

pub(crate) fn order_of(m: &Message) -> String {
    let v: serde_json::Value = m.json().unwrap_or_default();
    v["order"].as_str().unwrap_or("?").to_owned()
}

/// One charge per order: keys from the payload without its timestamp, so
/// a re-publish under a new id is a duplicate too.
pub(crate) fn order_key() -> KeySource {
    KeySource::Payload(KeyDeriver::new().exclude("/sent_at").unwrap())
}

pub(crate) async fn idem_on(url: &str, lease: Duration) -> Idempotency {
    let store = RedisStore::connect(url).await.unwrap();
    Idempotency::builder(store)
        .namespace("consumer-test")
        .lease(lease)
        .build()
}

/// A consumer on `url` charging orders.
pub(crate) async fn orders_consumer(url: &str, lease: Duration) -> Consumer {
    Consumer::new(idem_on(url, lease).await, "orders.charge").keys(order_key())
}

/// Runs `step` until it says done, failing after `deadline`.
pub(crate) async fn until(what: &str, deadline: Duration, mut step: impl AsyncFnMut() -> bool) {
    let end = Instant::now() + deadline;
    while !step().await {
        assert!(
            Instant::now() < end,
            "not reached within {deadline:?}: {what}"
        );
    }
}

/// Waits until the broker agrees that everything was settled (acks may be
/// sent without waiting for the broker's answer).
pub(crate) async fn assert_drained<P: Place>(place: &P) {
    until(
        "the broker has nothing left",
        Duration::from_secs(10),
        async || {
            if place.drained().await {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            false
        },
    )
    .await;
}

/// Publishes `n` orders with ids `o-i`, then duplicates: every 5th again
/// with the same id and payload, every 7th under a new id with a new
/// timestamp. Returns how many messages went out.
pub(crate) async fn publish_orders<P: Place>(place: &P, n: usize) -> usize {
    for i in 0..n {
        place.publish(Some(&format!("o-{i}")), &order(i, 1)).await;
    }
    tokio::time::sleep(place.duplicate_gap()).await;
    let mut added = n;
    for i in 0..n {
        if i % 5 == 0 {
            place.publish(Some(&format!("o-{i}")), &order(i, 1)).await;
            added += 1;
        }
        if i % 7 == 0 {
            place
                .publish(Some(&format!("o-{i}-republished")), &order(i, 99))
                .await;
            added += 1;
        }
    }
    added
}

fn counts(ledger: &FileLedger) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for r in ledger.runs() {
        *m.entry(r.key).or_default() += 1;
    }
    m
}

fn settled(r: &PollReport) -> usize {
    r.acked + r.dead_lettered
}

// ---------------------------------------------------------------- scenarios

/// N orders plus duplicates (same id, and the same order under a new id),
/// four consumer tasks: every order charged once, every message acked
/// exactly once.
pub(crate) async fn four_tasks_run_each_order_once<P: Place>(place: P) {
    let redis = RedisServer::start();
    let n = 200;
    let added = publish_orders(&place, n).await;
    let consumer = orders_consumer(&redis.url(), Duration::from_secs(2)).await;
    let ledger = Ledger::new();
    let done = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..4 {
        let adapter = place
            .adapter(&format!("c{t}"), Duration::from_secs(2))
            .await;
        let (consumer, ledger, done, stop) =
            (consumer.clone(), ledger.clone(), done.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let charge = async |m: Message| -> Result<String, String> {
                if P::POSITIONED {
                    assert!(m.position().is_some_and(|p| !p.is_empty()), "no position");
                }
                ledger.record(&order_of(&m));
                Ok(format!("charged {}", order_of(&m)))
            };
            let mut total = PollReport::default();
            while !stop.load(Ordering::SeqCst) {
                let r = adapter.poll(&consumer, &charge).await.unwrap();
                done.fetch_add(settled(&r), Ordering::SeqCst);
                total.add(r);
            }
            total
        }));
    }
    until(
        "every message settled",
        Duration::from_secs(60),
        async || {
            tokio::time::sleep(Duration::from_millis(50)).await;
            done.load(Ordering::SeqCst) >= added
        },
    )
    .await;
    stop.store(true, Ordering::SeqCst);
    let mut total = PollReport::default();
    for t in tasks {
        total.add(t.await.unwrap());
    }
    // A copy delivered while its twin still runs in another task gets
    // InProgress and is nacked; it comes back and is acked as a replay.
    if P::COPIES {
        assert!(
            total.acked >= added && total.dead_lettered == 0,
            "{total:?}"
        );
    } else {
        assert_eq!((total.acked, total.dead_lettered), (added, 0), "{total:?}");
    }
    assert_drained(&place).await;
    assert_eq!(
        ledger.total(),
        n,
        "one charge per order: {:?}",
        ledger.duplicates()
    );
}

/// In a batch of 8, a permanent error is dead-lettered after its first
/// delivery, a retryable one at its third failure (`max_failures(3)`); the
/// rest is acked.
pub(crate) async fn poison_messages_are_dead_lettered_the_rest_acked<P: Place>(place: P) {
    let redis = RedisServer::start();
    for i in 0..8 {
        let body = match i {
            2 => br#"{"kind":"permanent"}"#.to_vec(),
            5 => br#"{"kind":"retryable"}"#.to_vec(),
            _ => format!(r#"{{"kind":"ok","n":{i}}}"#).into_bytes(),
        };
        place.publish(Some(&format!("j{i}")), &body).await;
    }
    let consumer = Consumer::new(idem_on(&redis.url(), Duration::from_secs(5)).await, "jobs")
        .max_failures(3)
        .backoff(Duration::from_millis(20), Duration::from_millis(50))
        .classify(|e: &String| ErrorClass::from_retryable(e != "permanent"));
    let adapter = place.adapter("c", Duration::from_secs(1)).await;
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
    until("all settled", Duration::from_secs(30), async || {
        total.add(adapter.poll(&consumer, &handler).await.unwrap());
        settled(&total) == 8
    })
    .await;
    assert_eq!(
        (total.acked, total.nacked, total.dead_lettered),
        (6, 2, 2),
        "{total:?}"
    );
    assert_drained(&place).await;
    let mut dead = Vec::new();
    until("two dead letters", Duration::from_secs(10), async || {
        dead.extend(place.dead_letters().await);
        dead.len() >= 2
    })
    .await;
    assert_eq!(dead.len(), 2, "{dead:?}");
    let permanent = dead
        .iter()
        .find(|d| d.payload == br#"{"kind":"permanent"}"#);
    let retryable = dead
        .iter()
        .find(|d| d.payload == br#"{"kind":"retryable"}"#);
    let (Some(permanent), Some(retryable)) = (permanent, retryable) else {
        panic!("both poison messages dead-lettered: {dead:?}");
    };
    for (d, id, kind, deliveries) in [
        (permanent, "j2", "permanent", 1),
        (retryable, "j5", "max_failures", 3),
    ] {
        assert!(d.id.as_deref().is_none_or(|i| i == id), "{d:?}");
        assert!(d.kind.as_deref().is_none_or(|k| k == kind), "{d:?}");
        assert!(d.deliveries.is_none_or(|n| n == deliveries), "{d:?}");
    }
    assert!(
        retryable
            .reason
            .as_deref()
            .is_none_or(|r| r.contains("retryable")),
        "{retryable:?}"
    );
    assert_eq!(
        (ledger.count("j2"), ledger.count("j5"), ledger.count("j0")),
        (1, 3, 1),
        "three failures drive the limit"
    );
}

/// idem's store down (fail-closed): nothing runs, every message is nacked;
/// once the store is back each is processed exactly once.
pub(crate) async fn store_down_nothing_runs_then_everything_once<P: Place>(place: P) {
    let mut store_server = RedisServer::start();
    for i in 0..5 {
        let body = format!(r#"{{"i":{i}}}"#);
        place.publish(Some(&format!("m{i}")), body.as_bytes()).await;
    }
    let store = RedisStore::connect(&store_server.url()).await.unwrap();
    let idem = Idempotency::builder(store)
        .namespace("t")
        .store_retries(0)
        .build();
    let consumer = Consumer::new(idem, "s")
        .max_deliveries(1000)
        .backoff(Duration::from_millis(20), Duration::from_millis(50));
    let adapter = place.adapter("c", Duration::from_secs(1)).await;
    let ledger = Ledger::new();
    let h = async |m: Message| -> Result<(), String> {
        ledger.record(m.id().unwrap_or("?"));
        Ok(())
    };
    store_server.kill();
    let mut down = PollReport::default();
    until("all five nacked", Duration::from_secs(10), async || {
        down.add(adapter.poll(&consumer, &h).await.unwrap());
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
            up.add(adapter.poll(&consumer, &h).await.unwrap());
            up.acked == 5
        },
    )
    .await;
    assert_drained(&place).await;
    assert_eq!(ledger.total(), 5);
    assert!(ledger.duplicates().is_empty());
}

/// Bad input (published by the caller): every message dead-lettered as a
/// bad message whose reason mentions one of `reasons` each, nothing run.
pub(crate) async fn bad_input_is_dead_lettered_and_runs_nothing<P: Place>(
    place: &P,
    keys: KeySource,
    reasons: &[&str],
) {
    let redis = RedisServer::start();
    let consumer =
        Consumer::new(idem_on(&redis.url(), Duration::from_secs(5)).await, "bad").keys(keys);
    let adapter = place.adapter("c", Duration::from_secs(10)).await;
    let ledger = Ledger::new();
    let handler = async |_: Message| -> Result<(), String> {
        ledger.record("ran");
        Ok(())
    };
    let mut total = PollReport::default();
    until("bad input settled", Duration::from_secs(10), async || {
        total.add(adapter.poll(&consumer, &handler).await.unwrap());
        total.dead_lettered >= reasons.len()
    })
    .await;
    assert_eq!(
        (total.dead_lettered, total.acked),
        (reasons.len(), 0),
        "{total:?}"
    );
    assert_drained(place).await;
    let mut dead = Vec::new();
    until("dead letters arrive", Duration::from_secs(10), async || {
        dead.extend(place.dead_letters().await);
        dead.len() >= reasons.len()
    })
    .await;
    assert_eq!(dead.len(), reasons.len(), "{dead:?}");
    for needle in reasons {
        assert!(
            dead.iter()
                .all(|d| d.kind.as_deref().is_none_or(|k| k == "bad_message")),
            "{dead:?}"
        );
        assert!(
            dead.iter()
                .any(|d| d.reason.as_deref().is_none_or(|r| r.contains(needle))),
            "no dead letter mentions {needle:?}: {dead:?}"
        );
    }
    assert_eq!(ledger.total(), 0);
}

/// The broker restarted under a running consumer: [`Adapter::run`] (made
/// again when it gives up on a dead channel) processes the messages from
/// before and after exactly once, and every one is acked.
pub(crate) async fn run_survives_a_broker_restart<P: Place>(place: &P, bounce: impl FnOnce()) {
    let redis = RedisServer::start();
    let consumer = Consumer::new(idem_on(&redis.url(), Duration::from_secs(5)).await, "r")
        .backoff(Duration::from_millis(50), Duration::from_millis(200));
    let ledger = Ledger::new();
    let h = async |m: Message| -> Result<(), String> {
        ledger.record(m.id().unwrap_or("?"));
        Ok(())
    };
    let stop = AtomicBool::new(false);
    let stopped = tokio::sync::Notify::new();
    let runs = AtomicUsize::new(0);
    let consume = async {
        // A broker whose channel dies with it (RabbitMQ) makes `run` stop
        // with the error: a new adapter on a new connection goes on.
        while !stop.load(Ordering::SeqCst) {
            let adapter = loop {
                let made = tokio::time::timeout(
                    Duration::from_secs(5),
                    place.adapter("c", Duration::from_secs(1)),
                );
                if let Ok(a) = made.await {
                    break a;
                }
            };
            runs.fetch_add(1, Ordering::SeqCst);
            if let Err(e) = adapter.run(&consumer, &h, stopped.notified()).await {
                tracing::info!(error = %e, "run stopped; making a new adapter");
            }
        }
    };
    let drive = async {
        for i in 0..5 {
            place.publish(Some(&format!("m{i}")), b"{}").await;
        }
        until("the first five", Duration::from_secs(20), async || {
            tokio::time::sleep(Duration::from_millis(50)).await;
            ledger.total() == 5
        })
        .await;
        bounce();
        for i in 5..10 {
            until(
                "the broker takes messages again",
                Duration::from_secs(30),
                async || {
                    tokio::time::timeout(
                        Duration::from_secs(5),
                        place.publish(Some(&format!("m{i}")), b"{}"),
                    )
                    .await
                    .is_ok()
                },
            )
            .await;
        }
        // A redelivery of an early one replays, it does not run again.
        place.publish(Some("m0"), b"{}").await;
        until("all ten, acked", Duration::from_secs(30), async || {
            tokio::time::sleep(Duration::from_millis(100)).await;
            ledger.total() >= 10 && place.drained().await
        })
        .await;
        stop.store(true, Ordering::SeqCst);
        stopped.notify_waiters();
    };
    tokio::join!(consume, drive);
    assert_eq!(ledger.total(), 10);
    assert!(ledger.duplicates().is_empty(), "{:?}", ledger.duplicates());
}

// ------------------------------------------------------ processes (re-exec)

/// The child side: runs only when the test binary was re-executed by
/// [`spawn_worker`]. `hammer`: two consumer tasks until a stop file
/// appears, writing how many they settled; `crash-before-ack`: SIGKILL
/// after the side effects of a batch, before its acks; `crash-mid-handler`:
/// SIGKILL inside the first handler, after its side effect.
pub(crate) fn worker<P: Place>() {
    let Ok(mode) = std::env::var(format!("{}_WORKER", P::WORKER_ENV)) else {
        return;
    };
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("worker: {k} not set"));
    let (redis, dir) = (env("IDEM_REDIS"), std::path::PathBuf::from(env("IDEM_DIR")));
    let redeliver_after = Duration::from_millis(env("IDEM_REDELIVER_MS").parse().unwrap());
    idem_testkit::run_worker(async move {
        let place = P::from_env().await;
        let ledger = FileLedger::at(dir.join("ledger"));
        let consumer = orders_consumer(&redis, Duration::from_millis(1500)).await;
        let kill_self = || {
            use rustix::process::{Signal, getpid, kill_process};
            let _ = kill_process(getpid(), Signal::KILL);
        };
        let pid = std::process::id();
        match mode.as_str() {
            "hammer" => {
                let stop = dir.join("stop");
                let mut tasks = Vec::new();
                for t in 0..2 {
                    let adapter = place.adapter(&format!("p{pid}-{t}"), redeliver_after).await;
                    let (consumer, ledger, stop, dir) =
                        (consumer.clone(), ledger.clone(), stop.clone(), dir.clone());
                    tasks.push(tokio::spawn(async move {
                        let charge = async |m: Message| -> Result<(), String> {
                            ledger.record(&order_of(&m));
                            Ok(())
                        };
                        let mut done = 0;
                        while !stop.exists() {
                            done += settled(&adapter.poll(&consumer, &charge).await.unwrap());
                            std::fs::write(
                                dir.join(format!("settled-{pid}-{t}")),
                                done.to_string(),
                            )
                            .unwrap();
                        }
                    }));
                }
                for t in tasks {
                    t.await.unwrap();
                }
            }
            "crash-before-ack" => {
                let adapter = place.adapter("victim", redeliver_after).await;
                let charge = async |m: Message| -> Result<(), String> {
                    ledger.record(&order_of(&m));
                    Ok(())
                };
                adapter.handle_unsettled(&consumer, &charge).await;
                kill_self();
            }
            "crash-mid-handler" => {
                // A lease the first redelivery meets on a loaded machine.
                let consumer = orders_consumer(&redis, victim_lease(redeliver_after)).await;
                let adapter = place.adapter("victim", redeliver_after).await;
                let charge = async |m: Message| -> Result<(), String> {
                    ledger.record(&order_of(&m));
                    kill_self();
                    Ok(())
                };
                loop {
                    adapter.poll(&consumer, &charge).await.unwrap();
                }
            }
            "crash-loop" => {
                // One handler at a time, so that a kill interrupts at most
                // one run; the effect is the handler's last step.
                let consumer = consumer.concurrency(1);
                let adapter = place.adapter("looped", redeliver_after).await;
                let charge = async |m: Message| -> Result<(), String> {
                    tokio::time::sleep(Duration::from_millis(60)).await;
                    ledger.record(&order_of(&m));
                    Ok(())
                };
                adapter
                    .run(&consumer, &charge, std::future::pending::<()>())
                    .await
                    .unwrap();
            }
            other => panic!("worker: unknown mode {other}"),
        }
    });
    std::process::exit(0);
}

/// Every adapter of one test shares `redeliver_after` (on JetStream it is
/// the durable consumer's `ack_wait`).
pub(crate) fn spawn_worker<P: Place>(
    place: &P,
    mode: &str,
    redis: &str,
    dir: &Path,
    redeliver_after: Duration,
) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            P::WORKER_TEST,
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(format!("{}_WORKER", P::WORKER_ENV), mode)
        .env("IDEM_REDIS", redis)
        .env("IDEM_DIR", dir)
        .env("IDEM_REDELIVER_MS", redeliver_after.as_millis().to_string())
        .envs(place.to_env())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
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

/// Two processes of two consumer tasks each on N orders plus duplicates:
/// every order charged once, every message settled once, nothing left.
pub(crate) async fn two_processes_run_every_order_once<P: Place>(place: P) {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let n = 150;
    let added = publish_orders(&place, n).await;
    let mut children: Vec<_> = (0..2)
        .map(|_| {
            spawn_worker(
                &place,
                "hammer",
                &redis.url(),
                dir.path(),
                Duration::from_secs(10),
            )
        })
        .collect();
    until(
        "every message settled",
        Duration::from_secs(60),
        async || {
            tokio::time::sleep(Duration::from_millis(100)).await;
            settled_by_children(dir.path()) >= added
        },
    )
    .await;
    std::fs::write(dir.path().join("stop"), b"").unwrap();
    for c in &mut children {
        assert!(c.wait().unwrap().success());
    }
    if P::COPIES {
        assert!(settled_by_children(dir.path()) >= added);
    } else {
        assert_eq!(settled_by_children(dir.path()), added);
    }
    assert_drained(&place).await;
    let ledger = FileLedger::at(dir.path().join("ledger"));
    let counts = counts(&ledger);
    assert_eq!(counts.len(), n, "{added} messages");
    assert!(
        counts.values().all(|&c| c == 1),
        "duplicates: {:?}",
        counts.iter().filter(|(_, c)| **c > 1).collect::<Vec<_>>()
    );
    // Which process took which messages is the broker's business: under
    // load one of them may take everything, which is no defect.
}

/// The seeds' crash: a consumer process SIGKILLed after its side effects,
/// before its acks. The broker redelivers; the redeliveries replay (no
/// second side effect) and are acked.
pub(crate) async fn killed_before_the_ack_the_redelivery_replays<P: Place>(
    place: P,
    redeliver_after: Duration,
) {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let n = 5;
    for i in 0..n {
        place.publish(Some(&format!("o-{i}")), &order(i, 1)).await;
    }
    let status = spawn_worker(
        &place,
        "crash-before-ack",
        &redis.url(),
        dir.path(),
        redeliver_after,
    )
    .wait()
    .unwrap();
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

    let consumer = orders_consumer(&redis.url(), Duration::from_millis(1500)).await;
    let adapter = place.adapter("survivor", redeliver_after).await;
    let charge = async |m: Message| -> Result<(), String> {
        ledger.record(&order_of(&m));
        Ok(())
    };
    let mut total = PollReport::default();
    until("everything acked", Duration::from_secs(20), async || {
        total.add(adapter.poll(&consumer, &charge).await.unwrap());
        total.acked == n
    })
    .await;
    assert!(
        total.redelivered >= before.len(),
        "the victim's messages came back: {total:?}"
    );
    assert_drained(&place).await;
    let after = counts(&ledger);
    assert_eq!(after.len(), n);
    assert!(
        after.values().all(|&c| c == 1),
        "replayed, not re-run: {after:?}"
    );
}

/// The lease of the consumer killed inside its handler: the broker's
/// redelivery delay and 3 s more, so that the first redelivery comes while
/// it lives however slowly a loaded machine starts the survivor.
fn victim_lease(redeliver_after: Duration) -> Duration {
    redeliver_after + Duration::from_secs(3)
}

/// A consumer process killed inside its handler, after the side effect:
/// while the dead holder's lease ([`victim_lease`]) lives the redeliveries
/// get `InProgress` and are nacked; then one takes over (`Recovered`):
/// exactly one extra run, and the message is acked.
pub(crate) async fn killed_mid_handler_one_extra_run_after_the_lease<P: Place>(
    place: P,
    redeliver_after: Duration,
) {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    place.publish(Some("o-0"), &order(0, 1)).await;
    spawn_worker(
        &place,
        "crash-mid-handler",
        &redis.url(),
        dir.path(),
        redeliver_after,
    )
    .wait()
    .unwrap();
    let ledger = FileLedger::at(dir.path().join("ledger"));
    assert_eq!(counts(&ledger).get("o-0"), Some(&1));

    // Each InProgress answer is a delivery: leave room for them.
    let consumer = orders_consumer(&redis.url(), Duration::from_millis(1500))
        .await
        .max_deliveries(50)
        .backoff(Duration::from_millis(50), Duration::from_millis(200));
    let adapter = place.adapter("survivor", redeliver_after).await;
    let charge = async |m: Message| -> Result<(), String> {
        ledger.record(&order_of(&m));
        Ok(())
    };
    let mut total = PollReport::default();
    until(
        "taken over and acked",
        Duration::from_secs(20),
        async || {
            total.add(adapter.poll(&consumer, &charge).await.unwrap());
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
    assert_drained(&place).await;
}

/// A consumer SIGKILLed 12 times 0.3–0.8 s apart, with
/// the default limits. Broker redeliveries after crashes and in-flight
/// nacks used to spend `max_deliveries` and dead-letter valid orders that
/// never ran; failures are now counted per key in idem's store, so
/// nothing is dead-lettered, nothing lost, and each kill costs at most the
/// one run it interrupted.
pub(crate) async fn a_crash_loop_dead_letters_nothing_and_loses_nothing<P: Place>(
    place: P,
    redeliver_after: Duration,
) {
    let redis = RedisServer::start();
    crash_loop_with_the_store_at(place, redeliver_after, &redis.url()).await;
}

/// The crash loop, idem's store on the Redis at `store_url` (for Redis
/// Streams, possibly the stream's own: then acks ride with results).
pub(crate) async fn crash_loop_with_the_store_at<P: Place>(
    place: P,
    redeliver_after: Duration,
    store_url: &str,
) {
    let dir = tempfile::tempdir().unwrap();
    let n = 24;
    for i in 0..n {
        place.publish(Some(&format!("o-{i}")), &order(i, 1)).await;
    }
    let kills = 12;
    for k in 0..kills {
        let mut child = spawn_worker(&place, "crash-loop", store_url, dir.path(), redeliver_after);
        // 0.3–0.8 s apart, a fixed spread rather than luck.
        tokio::time::sleep(Duration::from_millis(300 + (k * 173 % 500))).await;
        child.kill().unwrap();
        child.wait().unwrap();
    }
    let ledger = FileLedger::at(dir.path().join("ledger"));
    let consumer = orders_consumer(store_url, Duration::from_millis(1500)).await;
    let adapter = place.adapter("survivor", redeliver_after).await;
    let charge = async |m: Message| -> Result<(), String> {
        ledger.record(&order_of(&m));
        Ok(())
    };
    let mut total = PollReport::default();
    until(
        "every order charged and nothing pending",
        Duration::from_secs(60),
        async || {
            total.add(adapter.poll(&consumer, &charge).await.unwrap());
            counts(&ledger).len() == n && place.drained().await
        },
    )
    .await;
    assert_eq!(total.dead_lettered, 0, "{total:?}");
    assert_drained(&place).await;
    let dead = place.dead_letters().await;
    assert!(dead.is_empty(), "valid orders dead-lettered: {dead:?}");
    let counts = counts(&ledger);
    assert_eq!(counts.len(), n, "every order charged: {counts:?}");
    let extra: usize = counts.values().map(|c| c - 1).sum();
    assert!(
        extra <= kills as usize,
        "each kill may cost the one run it interrupted, no more: {counts:?}"
    );
}

/// `run`'s shutdown lets the batch in flight finish and
/// settles it. It used to drop the batch, release its keys, and leave the
/// messages to be run again (as `Executed`) by the next consumer.
pub(crate) async fn shutdown_drains_the_batch_in_flight<P: Place>(place: P) {
    let redis = RedisServer::start();
    let n = 3;
    for i in 0..n {
        place.publish(Some(&format!("o-{i}")), &order(i, 1)).await;
    }
    let consumer = orders_consumer(&redis.url(), Duration::from_millis(1500))
        .await
        .drain_timeout(Duration::from_secs(20));
    let adapter = place.adapter("drained", Duration::from_secs(1)).await;
    let ledger = shut_down_mid_handler(adapter, &consumer, Duration::from_millis(400)).await;
    assert!(ledger.total() >= 1, "a handler was running at the shutdown");
    let charge = async |m: Message| -> Result<(), String> {
        ledger.record(&order_of(&m));
        Ok(())
    };
    // Whatever ran was settled: the next consumer runs only what never ran
    // (and replays what comes back, on brokers that return prefetched
    // messages), so every order is charged once.
    let again = place.adapter("after", Duration::from_secs(1)).await;
    let mut total = PollReport::default();
    until("the rest processed", Duration::from_secs(20), async || {
        total.add(again.poll(&consumer, &charge).await.unwrap());
        (0..n).all(|i| ledger.count(&format!("o-{i}")) >= 1) && place.drained().await
    })
    .await;
    for i in 0..n {
        assert_eq!(
            ledger.count(&format!("o-{i}")),
            1,
            "o-{i} charged once: {total:?}"
        );
    }
    assert_drained(&place).await;
}

/// A handler still running at the drain deadline is
/// abandoned, not released: its key stays held until the lease runs out,
/// and the redelivery takes over as `Recovered` (one extra run, after the
/// lease), never as a fresh `Executed`.
pub(crate) async fn shutdown_past_the_deadline_keeps_the_key_until_the_lease<P: Place>(place: P) {
    let redis = RedisServer::start();
    place.publish(Some("o-0"), &order(0, 1)).await;
    let outcomes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = outcomes.clone();
    let store = RedisStore::connect(&redis.url()).await.unwrap();
    let idem = Idempotency::builder(store)
        .namespace("consumer-test")
        .lease(Duration::from_millis(1500))
        .on_outcome(move |e: &idem_core::OutcomeEvent| seen.lock().unwrap().push(e.outcome))
        .build();
    let consumer = Consumer::new(idem, "orders.charge")
        .keys(order_key())
        .drain_timeout(Duration::from_millis(100))
        .backoff(Duration::from_millis(50), Duration::from_millis(200));
    let adapter = place.adapter("abandoned", Duration::from_secs(1)).await;
    let ledger = shut_down_mid_handler(adapter, &consumer, Duration::from_secs(30)).await;
    assert_eq!(ledger.count("o-0"), 1);
    let key = order_key().key(&Message::new(order(0, 1))).unwrap();
    let held = consumer
        .idem()
        .inspect("orders.charge", &key)
        .await
        .unwrap();
    assert_eq!(
        held.map(|r| r.state),
        Some(idem_core::KeyState::Pending),
        "the abandoned handler's key is held, not released"
    );
    let charge = async |m: Message| -> Result<(), String> {
        ledger.record(&order_of(&m));
        Ok(())
    };
    let survivor = place.adapter("survivor", Duration::from_secs(1)).await;
    let mut total = PollReport::default();
    // Kafka: each member that joins an empty group waits out tansu's
    // initial rebalance delay (3 s), and a loaded machine can make it join
    // more than once. Beyond that, a survivor was twice never assigned its
    // partition at all (tansu 0.6), when it joined while the
    // first member was still leaving; a member now leaves (`close`) before
    // the next joins, and the group log (`debug=cgrp`) is printed with a
    // failure.
    until(
        "taken over and acked",
        Duration::from_secs(60),
        async || {
            total.add(survivor.poll(&consumer, &charge).await.unwrap());
            total.acked == 1
        },
    )
    .await;
    assert_eq!(ledger.count("o-0"), 2, "one extra run, after the lease");
    let outcomes = outcomes.lock().unwrap().clone();
    assert!(
        outcomes.contains(&idem_core::CallOutcome::Recovered)
            && !outcomes.contains(&idem_core::CallOutcome::Executed),
        "the redelivery took over the held key: {outcomes:?}"
    );
    assert_drained(&place).await;
}

/// Runs `adapter` with handlers that charge first, then work for `work`,
/// and signals its shutdown as soon as the first charge is made (a deploy
/// landing mid-handler). Returns the charges once `run` has returned and
/// the adapter is gone.
async fn shut_down_mid_handler<A: Member>(
    adapter: A,
    consumer: &Consumer,
    work: Duration,
) -> Ledger {
    let ledger = Ledger::new();
    let started = tokio::sync::Notify::new();
    let charge = async |m: Message| -> Result<(), String> {
        // The effect first: a shutdown now must not free the key of a
        // charged order.
        ledger.record(&order_of(&m));
        started.notify_one();
        tokio::time::sleep(work).await;
        Ok(())
    };
    adapter
        .run(consumer, &charge, started.notified())
        .await
        .unwrap();
    drop(adapter);
    ledger
}
