//! Kafka adapter (`rdkafka`): a consumer group whose offsets are committed
//! only up to the lowest record not yet decided.
//!
//! Kafka has no per-message ack: the group keeps one offset per partition,
//! "everything before this is done". This adapter handles the records of a
//! partition concurrently (at most [`Consumer::concurrency`] at once over
//! all partitions), and commits, every [`KafkaConfig::commit_interval`],
//! the **lowest offset not yet decided** of each partition (see
//! [`OffsetTracker`]). A crash at any moment therefore re-delivers only
//! records at or after an undecided one, and idem replays the ones whose
//! side effect is already recorded.
//!
//! | idem's decision | what happens to the record | its offset |
//! | --- | --- | --- |
//! | ack (executed, replayed, recovered) | done | decided |
//! | nack, the handler failed (retryable) | run again in this process after the backoff, up to [`KafkaConfig::attempts_in_process`] runs; then published to the retry topic (or, without one, the dead-letter topic) | undecided until published, then decided |
//! | nack, the handler did not run (idem's store down, another consumer holds the key) | waits and tries again for as long as the partition is ours: fail-closed | undecided |
//! | dead-letter (permanent error, `max_failures`, `max_deliveries`, bad key, fingerprint mismatch) | published to the dead-letter topic with the reason headers ([`header_names`] and the shared [`dead_letter_field`](crate::dead_letter_field)s) | undecided until published, then decided |
//!
//! A record whose idempotency key is already in flight in this process
//! waits for that one to finish (then replays); with
//! [`KafkaConfig::in_order_per_key`], records of one partition with the same
//! record key also run one after the other, in offset order.
//!
//! **Rebalances.** When the group takes a partition away, the adapter stops
//! starting its records, gives those in flight up to
//! [`KafkaConfig::revoke_deadline`] to finish, commits what is decided and
//! lets the partition go. A handler still running after the deadline keeps
//! its idem lease while it runs: the next owner's claim waits
//! (`InProgress`) and then replays its result; if this process dies
//! instead, the next owner takes over after the lease (`Recovered`), and a
//! late completion by the old holder is refused by owner token.
//!
//! **Keys.** By default the `idempotency-key` header ([`KafkaKey`]); or the
//! record key plus a hash of the payload; or derived from the payload by
//! giving the [`Consumer`] a [`KeySource::Payload`](crate::KeySource). The
//! fingerprint is the payload hash: a key reused for another payload is
//! dead-lettered.
//!
//! ```no_run
//! use idem_consumer::kafka::{KafkaConfig, KafkaConsumer};
//! use idem_consumer::{Consumer, Message};
//! use idem_core::{Idempotency, RedisStore};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let idem = Idempotency::builder(RedisStore::connect("redis://127.0.0.1/").await?).build();
//! let consumer = Consumer::new(idem, "orders.charge");
//! let kafka = KafkaConsumer::connect(
//!     KafkaConfig::new("127.0.0.1:9092", "billing", ["orders"]).dead_letter_topic("orders.DLT"),
//! )?;
//! let charge = |m: Message| async move { Ok::<_, std::io::Error>(m.payload().len()) };
//! kafka.run(&consumer, &charge, std::future::pending::<()>()).await?;
//! # Ok(()) }
//! ```

/// The `rdkafka` crate this adapter is built on, re-exported so your
/// producer and admin code uses the same version.
pub use rdkafka;

mod hand_off;
mod offsets;
mod poller;

pub use hand_off::header_names;
pub use offsets::{OffsetTracker, PartitionOffsets};

use crate::consumer::Consumer;
use crate::decision::{Classify, DeadLetterReason, Decision};
use crate::error::ConsumerError;
use crate::message::Message;
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::future::OptionFuture;
use futures_util::stream::FuturesUnordered;
use hand_off::Destination;
use idem_core::Outcome;
use poller::{Ctx, Shared, Taken, header};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::FutureProducer;
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;
use tokio::sync::{Mutex, mpsc};
use tokio::time::Instant;

const BROKER: &str = "kafka";

/// Where a record's idempotency key (the core's message id) comes from.
///
/// To derive keys from the payload instead, give the [`Consumer`]
/// [`KeySource::Payload`](crate::KeySource::Payload): it ignores ids.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KafkaKey {
    /// A header set by the producer (default `idempotency-key`). A record
    /// without it falls back to the consumer's key source (by default the
    /// payload); a value that is not UTF-8 is dead-lettered.
    Header(String),
    /// The record key and a SHA-256 of the payload, `"<key>:<hash>"`: the
    /// same record re-published is one key, two records under one key are
    /// two. A record without a key falls back to the consumer's key source.
    RecordKeyAndPayloadHash,
}

impl Default for KafkaKey {
    fn default() -> Self {
        KafkaKey::Header(header_names::IDEMPOTENCY_KEY.to_owned())
    }
}

/// How to consume.
///
/// ```
/// use idem_consumer::kafka::{KafkaConfig, KafkaKey};
/// use std::time::Duration;
/// let cfg = KafkaConfig::new("127.0.0.1:9092", "billing", ["orders"])
///     .key(KafkaKey::RecordKeyAndPayloadHash)
///     .retry_topic("orders.retry")
///     .dead_letter_topic("orders.DLT")
///     .commit_interval(Duration::from_millis(200))
///     .set("session.timeout.ms", "10000");
/// assert_eq!(cfg.dead_letter_for("orders"), "orders.DLT");
/// ```
#[derive(Debug, Clone)]
pub struct KafkaConfig {
    brokers: String,
    group: String,
    topics: Vec<String>,
    key: KafkaKey,
    client: Vec<(String, String)>,
    attempts_in_process: u32,
    retry_topic: Option<String>,
    dead_letter_topic: Option<String>,
    commit_interval: Duration,
    revoke_deadline: Duration,
    in_order_per_key: bool,
    buffer: usize,
    publish_timeout: Duration,
}

impl KafkaConfig {
    /// Consume `topics` from the brokers `brokers` (`host:port,…`) in
    /// consumer group `group`.
    ///
    /// Defaults: keys from the `idempotency-key` header, 3 runs in process
    /// before a failing record is moved, no retry topic, dead letters to
    /// `<topic>.DLT`, commits every 500 ms, 10 s for handlers to finish on
    /// a revocation, records of a partition run concurrently, 256 records
    /// buffered, a new group starts at the earliest offset.
    pub fn new<S: Into<String>>(
        brokers: impl Into<String>,
        group: impl Into<String>,
        topics: impl IntoIterator<Item = S>,
    ) -> KafkaConfig {
        KafkaConfig {
            brokers: brokers.into(),
            group: group.into(),
            topics: topics.into_iter().map(Into::into).collect(),
            key: KafkaKey::default(),
            client: Vec::new(),
            attempts_in_process: 3,
            retry_topic: None,
            dead_letter_topic: None,
            commit_interval: Duration::from_millis(500),
            revoke_deadline: Duration::from_secs(10),
            in_order_per_key: false,
            buffer: 256,
            publish_timeout: Duration::from_secs(10),
        }
    }

    /// Where keys come from (default the `idempotency-key` header).
    pub fn key(mut self, key: KafkaKey) -> Self {
        self.key = key;
        self
    }

    /// Any librdkafka consumer property (`session.timeout.ms`,
    /// `security.protocol`, …), applied after this adapter's own
    /// (`enable.auto.commit=false` is required and cannot be overridden).
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.client.push((key.into(), value.into()));
        self
    }

    /// Runs of a failing handler in this process, with the consumer's
    /// backoff between them, before the record is moved to the retry or
    /// dead-letter topic (default 3, at least 1).
    pub fn attempts_in_process(mut self, n: u32) -> Self {
        self.attempts_in_process = n.max(1);
        self
    }

    /// Move records still failing after the in-process attempts to this
    /// topic, and consume it too (it is added to the subscription). The
    /// attempts carry on in the `idem-attempts` header (the delivery count
    /// when consumed back) and idem counts the handler's failures per key,
    /// so the consumer's `max_failures` still ends in the dead-letter topic.
    pub fn retry_topic(mut self, topic: impl Into<String>) -> Self {
        self.retry_topic = Some(topic.into());
        self
    }

    /// The dead-letter topic for every source topic (default
    /// `<topic>.DLT`, per topic).
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// How often decided offsets are committed (default 500 ms).
    pub fn commit_interval(mut self, d: Duration) -> Self {
        self.commit_interval = d.max(Duration::from_millis(1));
        self
    }

    /// How long in-flight handlers of a revoked partition may run before it
    /// is given up anyway (default 10 s). Keep it below the group's
    /// rebalance timeout (`max.poll.interval.ms`).
    pub fn revoke_deadline(mut self, d: Duration) -> Self {
        self.revoke_deadline = d;
        self
    }

    /// Run the records of one partition that share a record key one after
    /// the other, in offset order (default off: concurrently).
    pub fn in_order_per_key(mut self, on: bool) -> Self {
        self.in_order_per_key = on;
        self
    }

    /// Records taken from the broker and not yet started, at most (default
    /// 256, at least 1); polling pauses beyond it.
    pub fn buffer(mut self, n: usize) -> Self {
        self.buffer = n.max(1);
        self
    }

    /// The dead-letter topic for records of `topic`.
    pub fn dead_letter_for(&self, topic: &str) -> String {
        match &self.dead_letter_topic {
            Some(t) => t.clone(),
            None => format!("{topic}.DLT"),
        }
    }

    fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group)
            .set("auto.offset.reset", "earliest");
        for (k, v) in &self.client {
            c.set(k, v);
        }
        // The whole point: offsets move only by the commit rule.
        c.set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false");
        c
    }

    /// The core's message for a record: payload, id per [`KafkaKey`],
    /// delivery count from the `idem-attempts` header.
    fn message_of(
        &self,
        payload: Bytes,
        record_key: Option<&[u8]>,
        headers: Option<&OwnedHeaders>,
        topic: &Arc<str>,
    ) -> Message {
        let attempts = header(headers, header_names::ATTEMPTS)
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|v| v.trim().parse::<u32>().ok())
            .unwrap_or(0);
        let msg = Message::new(payload.clone())
            .with_delivery_count(attempts.saturating_add(1))
            .with_source(BROKER, topic.clone());
        match &self.key {
            KafkaKey::Header(name) => match header(headers, name) {
                None => msg,
                Some(v) => match std::str::from_utf8(v) {
                    Ok(id) => msg.with_id(id),
                    Err(_) => msg.with_unreadable_id(format!("header `{name}` is not UTF-8")),
                },
            },
            KafkaKey::RecordKeyAndPayloadHash => match record_key {
                None => msg,
                Some(k) => {
                    let key = match std::str::from_utf8(k) {
                        Ok(s) => s.to_owned(),
                        Err(_) => hex(k),
                    };
                    let digest = Sha256::digest(&payload);
                    msg.with_id(format!("{key}:{}", hex(&digest[..16])))
                }
            },
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// What a [`run`](KafkaConsumer::run) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct KafkaReport {
    /// Records taken from the broker and started.
    pub fetched: usize,
    /// Of those, records back from the retry topic (delivery count over 1).
    pub redelivered: usize,
    /// Acked: done, replayed or recovered; their offsets are decided.
    pub acked: usize,
    /// Of those, duplicates answered with the stored result (idem's `Replayed`).
    pub replayed: usize,
    /// Of those, taken over from a holder that died mid-handler (idem's
    /// `Recovered`: the handler ran again once its lease ran out).
    pub recovered: usize,
    /// Handler runs repeated in process after a retryable failure.
    pub retried: usize,
    /// Waits because the handler could not run (store down, key in flight
    /// elsewhere), each followed by another try.
    pub nacked: usize,
    /// Moved to the retry topic.
    pub retry_published: usize,
    /// Moved to the dead-letter topic.
    pub dead_lettered: usize,
    /// Left undecided because their partition was revoked or `run` shut
    /// down (the next owner handles them; idem replays what was done).
    pub abandoned: usize,
}

impl KafkaReport {
    /// Adds another report's counts to this one.
    pub fn add(&mut self, other: KafkaReport) {
        self.fetched += other.fetched;
        self.redelivered += other.redelivered;
        self.acked += other.acked;
        self.replayed += other.replayed;
        self.recovered += other.recovered;
        self.retried += other.retried;
        self.nacked += other.nacked;
        self.retry_published += other.retry_published;
        self.dead_lettered += other.dead_lettered;
        self.abandoned += other.abandoned;
    }
}

/// How one record's handling ended.
enum End {
    Acked,
    Moved(Destination),
    Abandoned,
}

/// One finished record, back in the handler loop.
struct Done {
    taken: Taken,
    gates: Vec<String>,
    end: End,
    report: KafkaReport,
}

/// A record waiting for its turn (its key is in flight).
struct Waiting {
    taken: Taken,
    key: Result<String, ConsumerError>,
    gates: Vec<String>,
}

/// A Kafka consumer-group member run through idem.
///
/// [`connect`](Self::connect) joins the group on a polling thread of its
/// own; [`run`](Self::run) handles records until its shutdown future
/// completes. Dropping it leaves the group.
pub struct KafkaConsumer {
    consumer: Arc<BaseConsumer<Ctx>>,
    producer: FutureProducer,
    shared: Arc<Shared>,
    rx: Mutex<mpsc::Receiver<Taken>>,
    cfg: Arc<KafkaConfig>,
    stop: Arc<AtomicBool>,
}

impl fmt::Debug for KafkaConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaConsumer")
            .field("config", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Drop for KafkaConsumer {
    fn drop(&mut self) {
        // The poll thread sees the flag (or its channel closed), drops its
        // handle on the consumer and so leaves the group.
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl KafkaConsumer {
    /// Creates the consumer and its producer (for retry and dead-letter
    /// topics), subscribes and starts polling: the member joins the group
    /// now, and records assigned to it wait (at most
    /// [`KafkaConfig::buffer`]) until [`run`](Self::run) handles them, so
    /// connect when you are about to run.
    ///
    /// Fails with [`ConsumerError::Config`] on an invalid librdkafka
    /// property or no topic; the broker is reached lazily (librdkafka
    /// retries and reconnects on its own).
    pub fn connect(cfg: KafkaConfig) -> Result<KafkaConsumer, ConsumerError> {
        if cfg.topics.is_empty() {
            return Err(ConsumerError::Config(
                "KafkaConfig has no topic to consume".into(),
            ));
        }
        let cfg = Arc::new(cfg);
        let shared = Arc::new(Shared::new(cfg.revoke_deadline));
        let consumer: BaseConsumer<Ctx> = cfg
            .client_config()
            .create_with_context(Ctx {
                shared: shared.clone(),
            })
            .map_err(|e| ConsumerError::Config(format!("kafka consumer: {e}")))?;
        let mut topics: Vec<&str> = cfg.topics.iter().map(String::as_str).collect();
        if let Some(rt) = &cfg.retry_topic {
            if !topics.contains(&rt.as_str()) {
                topics.push(rt);
            }
        }
        consumer
            .subscribe(&topics)
            .map_err(|e| ConsumerError::broker(BROKER, "subscribe", e))?;
        let mut producer_cfg = ClientConfig::new();
        producer_cfg
            .set("bootstrap.servers", &cfg.brokers)
            .set("enable.idempotence", "false");
        let producer: FutureProducer = producer_cfg
            .create()
            .map_err(|e| ConsumerError::Config(format!("kafka producer: {e}")))?;
        let consumer = Arc::new(consumer);
        let (tx, rx) = mpsc::channel(cfg.buffer);
        let stop = Arc::new(AtomicBool::new(false));
        {
            let (consumer, shared, cfg, stop) =
                (consumer.clone(), shared.clone(), cfg.clone(), stop.clone());
            std::thread::Builder::new()
                .name("idem-kafka-poll".into())
                .spawn(move || poller::poll_loop(consumer, shared, cfg, tx, stop))
                .map_err(|e| ConsumerError::Config(format!("cannot start the poll thread: {e}")))?;
        }
        Ok(KafkaConsumer {
            consumer,
            producer,
            shared,
            rx: Mutex::new(rx),
            cfg,
            stop,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &KafkaConfig {
        &self.cfg
    }

    /// Offset commits the broker accepted so far.
    pub fn commits(&self) -> u64 {
        self.shared.commits()
    }

    /// The last offset this consumer committed for a partition it owns (the
    /// next one to read, in Kafka's terms).
    pub fn last_committed(&self, topic: &str, partition: i32) -> Option<i64> {
        self.shared.last_committed(topic, partition)
    }

    /// Partitions this consumer gave up on revocation so far (a rebalance
    /// took them, or the consumer is closing).
    pub fn partitions_given_up(&self) -> u64 {
        self.shared.given_up()
    }

    /// Records taken and not yet decided, over the partitions owned.
    pub fn undecided(&self) -> usize {
        self.shared.undecided()
    }

    /// The underlying librdkafka consumer (assignment, positions, committed
    /// offsets…). Do not commit through it: the adapter owns the offsets.
    pub fn client(&self) -> &BaseConsumer<impl rdkafka::consumer::ConsumerContext> {
        &*self.consumer
    }

    /// Handles records until `shutdown` completes, committing decided
    /// offsets every [`KafkaConfig::commit_interval`]; returns what it did.
    /// On shutdown it drains: it starts nothing more (a record waiting
    /// between in-process attempts is abandoned at once, undecided), lets
    /// running handlers finish (up to [`KafkaConfig::revoke_deadline`])
    /// and commits what is decided. A handler still running at the
    /// deadline is dropped: its offset stays uncommitted and its idem key
    /// keeps its lease, so the next owner waits and replays, or takes over
    /// after the lease (`Recovered`).
    ///
    /// Fails with [`ConsumerError::Config`] if `run` is already running on
    /// this consumer.
    pub async fn run<C, T, E, H, Fut>(
        &self,
        consumer: &Consumer<C>,
        handler: &H,
        shutdown: impl Future,
    ) -> Result<KafkaReport, ConsumerError>
    where
        H: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        C: Classify<E>,
    {
        let mut rx = self.rx.try_lock().map_err(|_| {
            ConsumerError::Config("KafkaConsumer::run is already running on this consumer".into())
        })?;
        let mut shutdown = pin!(shutdown);
        let mut report = KafkaReport::default();
        let mut running = FuturesUnordered::new();
        let mut waiting: VecDeque<Waiting> = VecDeque::new();
        let mut busy: HashSet<String> = HashSet::new();
        let mut ticker = tokio::time::interval(self.cfg.commit_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let limit = consumer.batch_concurrency();
        let mut closed = false;
        let mut committing: Option<tokio::task::JoinHandle<()>> = None;
        // Records started and not finished, per partition assignment: those
        // dropped at the shutdown deadline are released from the count.
        let mut in_flight: HashMap<(Arc<str>, i32, u64), usize> = HashMap::new();
        self.shared.set_closing(false);
        loop {
            // Start what may start, in arrival order: a record whose gate
            // (its idem key, or its record key in order-per-key mode) is
            // held waits, and so do later records sharing a gate with it.
            // A record of a partition revoked meanwhile is dropped (the
            // next owner reads it from the last commit).
            if running.len() < limit && !waiting.is_empty() {
                let mut blocked: HashSet<String> = HashSet::new();
                let mut keep = VecDeque::with_capacity(waiting.len());
                let mut start = Vec::new();
                while let Some(w) = waiting.pop_front() {
                    if running.len() + start.len() >= limit {
                        keep.push_back(w);
                        keep.extend(waiting.drain(..));
                        break;
                    }
                    let free = w
                        .gates
                        .iter()
                        .all(|g| !busy.contains(g) && !blocked.contains(g));
                    if !free {
                        blocked.extend(w.gates.iter().cloned());
                        keep.push_back(w);
                        continue;
                    }
                    if self.shared.begin(&w.taken) {
                        busy.extend(w.gates.iter().cloned());
                        start.push(w);
                    }
                }
                waiting = keep;
                for w in start {
                    let t = &w.taken;
                    *in_flight
                        .entry((t.topic.clone(), t.partition, t.epoch))
                        .or_default() += 1;
                    report.fetched += 1;
                    if w.taken.msg.delivery_count() > 1 {
                        report.redelivered += 1;
                    }
                    running.push(self.process(consumer, handler, w));
                }
            }
            let room = !closed && waiting.len() < self.cfg.buffer;
            tokio::select! {
                biased;
                _ = &mut shutdown => break,
                Some(done) = running.next(), if !running.is_empty() => {
                    self.finish(done, &mut busy, &mut in_flight, &mut report);
                }
                Some(_) = OptionFuture::from(committing.as_mut()), if committing.is_some() => {
                    committing = None;
                }
                taken = rx.recv(), if room => match taken {
                    Some(taken) => waiting.push_back(self.gated(consumer, taken)),
                    None => closed = true,
                },
                _ = ticker.tick(), if committing.is_none() => {
                    committing = self.start_commit();
                    if closed && running.is_empty() {
                        return Err(ConsumerError::broker(
                            BROKER,
                            "poll",
                            "the polling thread stopped",
                        ));
                    }
                }
            }
        }
        // Shutdown drains: nothing new starts, not even another attempt of
        // a record in flight (a paused one is abandoned at once); running
        // handlers get the revocation deadline; then whatever is decided is
        // committed. A handler dropped at the deadline keeps its idem lease
        // (the next owner replays it, or takes over after the lease) and
        // its offset stays uncommitted.
        self.shared.set_closing(true);
        let end = Instant::now() + self.cfg.revoke_deadline;
        while !running.is_empty() {
            match tokio::time::timeout_at(end, running.next()).await {
                Ok(Some(done)) => self.finish(done, &mut busy, &mut in_flight, &mut report),
                Ok(None) => break,
                Err(_) => {
                    tracing::warn!(
                        in_flight = running.len(),
                        "shutdown with handlers still running; their records stay uncommitted"
                    );
                    break;
                }
            }
        }
        drop(running);
        for ((topic, partition, epoch), n) in in_flight {
            report.abandoned += n;
            self.shared.dropped(&topic, partition, epoch, n);
        }
        if let Some(c) = committing.take() {
            let _ = c.await;
        }
        if let Some(c) = self.start_commit() {
            let _ = c.await;
        }
        Ok(report)
    }

    /// Keys and gates of a record just taken.
    fn gated<C>(&self, consumer: &Consumer<C>, taken: Taken) -> Waiting {
        let key = consumer.key_of(&taken.msg);
        let mut gates = Vec::with_capacity(2);
        if let Ok(k) = &key {
            gates.push(format!("k:{k}"));
        }
        if self.cfg.in_order_per_key {
            if let Some(rk) = &taken.record_key {
                gates.push(format!("r:{}:{}:{}", taken.topic, taken.partition, hex(rk)));
            }
        }
        Waiting { taken, key, gates }
    }

    fn finish(
        &self,
        done: Done,
        busy: &mut HashSet<String>,
        in_flight: &mut HashMap<(Arc<str>, i32, u64), usize>,
        report: &mut KafkaReport,
    ) {
        for g in &done.gates {
            busy.remove(g);
        }
        let t = &done.taken;
        let at = (t.topic.clone(), t.partition, t.epoch);
        if let Some(n) = in_flight.get_mut(&at) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                in_flight.remove(&at);
            }
        }
        report.add(done.report);
        let t = &done.taken;
        match done.end {
            End::Abandoned => {
                report.abandoned += 1;
                self.shared.abandon(t);
            }
            End::Acked | End::Moved(_) => {
                match &done.end {
                    End::Acked => report.acked += 1,
                    End::Moved(Destination::Retry(_)) => report.retry_published += 1,
                    _ => report.dead_lettered += 1,
                }
                if !self.shared.decide(t) {
                    tracing::debug!(
                        topic = &*t.topic,
                        partition = t.partition,
                        offset = t.offset,
                        "decided after its partition was given up; the next owner replays it"
                    );
                }
            }
        }
    }

    /// Starts a commit of what the commit rule allows, on a blocking
    /// thread (librdkafka's synchronous commit), so the handlers keep
    /// running meanwhile; `None` when there is nothing new to commit.
    fn start_commit(&self) -> Option<tokio::task::JoinHandle<()>> {
        let list = self.shared.to_commit();
        if list.is_empty() {
            return None;
        }
        let (consumer, shared) = (self.consumer.clone(), self.shared.clone());
        Some(tokio::task::spawn_blocking(move || {
            tracing::debug!(offsets = ?list, "committing decided offsets");
            match consumer.commit(&offsets_list(&list), CommitMode::Sync) {
                Ok(()) => shared.committed(&list),
                Err(e) => {
                    shared.commit_failed();
                    tracing::warn!(error = %e, "offset commit failed; retried at the next interval");
                }
            }
        }))
    }

    /// Pauses `d`, or less when `t`'s partition is revoked meanwhile;
    /// returns whether the partition is still ours.
    async fn pause(&self, t: &Taken, d: Duration) -> bool {
        let end = Instant::now() + d;
        loop {
            let revoked = self.shared.revoked.notified();
            if !self.shared.is_live(t) {
                return false;
            }
            tokio::select! {
                _ = tokio::time::sleep_until(end) => return self.shared.is_live(t),
                _ = revoked => {}
            }
        }
    }

    /// One record from start to decision: handler runs through idem,
    /// in-process retries, then the hand-off to another topic when needed.
    async fn process<C, T, E, H, Fut>(
        &self,
        consumer: &Consumer<C>,
        handler: &H,
        w: Waiting,
    ) -> Done
    where
        H: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        C: Classify<E>,
    {
        let Waiting {
            mut taken,
            key,
            gates,
        } = w;
        let mut report = KafkaReport::default();
        let fingerprint = consumer.fingerprint_of(&taken.msg);
        // The handler's last error, for the reason header when it is moved.
        let last_error: StdMutex<Option<String>> = StdMutex::new(None);
        let ran = AtomicBool::new(false);
        let watched = |m: Message| {
            ran.store(true, Ordering::Relaxed);
            let fut = handler(m);
            let last_error = &last_error;
            async move {
                let out = fut.await;
                if let Err(e) = &out {
                    *last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                }
                out
            }
        };
        let mut runs_here = 0u32;
        let dest = loop {
            ran.store(false, Ordering::Relaxed);
            let handled = consumer
                .handle_keyed(&taken.msg, key.clone(), Some(fingerprint), &watched)
                .await;
            match handled.decision {
                Decision::Ack => {
                    match handled.outcome {
                        Some(Outcome::Replayed) => report.replayed += 1,
                        Some(Outcome::Recovered) => report.recovered += 1,
                        _ => {}
                    }
                    return Done {
                        taken,
                        gates,
                        end: End::Acked,
                        report,
                    };
                }
                Decision::DeadLetter { reason } => {
                    break Destination::DeadLetter(self.cfg.dead_letter_for(&taken.topic), reason);
                }
                Decision::Nack { delay } if !ran.load(Ordering::Relaxed) => {
                    // Nothing ran (store down, or the key is in flight
                    // elsewhere): the record is fine, keep it and wait.
                    report.nacked += 1;
                    if !self.pause(&taken, delay).await {
                        return Done {
                            taken,
                            gates,
                            end: End::Abandoned,
                            report,
                        };
                    }
                }
                Decision::Nack { delay } => {
                    runs_here += 1;
                    if runs_here >= self.cfg.attempts_in_process {
                        break match &self.cfg.retry_topic {
                            Some(rt) => Destination::Retry(rt.clone()),
                            None => Destination::DeadLetter(
                                self.cfg.dead_letter_for(&taken.topic),
                                // Every attempt counted here ran the handler
                                // and failed, over every hop.
                                DeadLetterReason::MaxFailures {
                                    failures: taken.msg.delivery_count(),
                                    last_error: last_error
                                        .lock()
                                        .unwrap_or_else(|p| p.into_inner())
                                        .clone()
                                        .unwrap_or_else(|| "nacked".into()),
                                },
                            ),
                        };
                    }
                    if !self.pause(&taken, delay).await {
                        return Done {
                            taken,
                            gates,
                            end: End::Abandoned,
                            report,
                        };
                    }
                    report.retried += 1;
                    let next = taken.msg.delivery_count().saturating_add(1);
                    taken.msg = taken.msg.clone().with_delivery_count(next);
                }
            }
        };
        // Moved aside: the offset is decided only once the broker has the
        // copy, so a failed publish never loses the record.
        let attempts = taken.msg.delivery_count();
        let mut failures = 0u32;
        loop {
            match hand_off::publish(
                &self.producer,
                &taken,
                &dest,
                attempts,
                self.cfg.publish_timeout,
            )
            .await
            {
                Ok(()) => {
                    return Done {
                        taken,
                        gates,
                        end: End::Moved(dest),
                        report,
                    };
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    let pause = consumer.backoff_for(failures);
                    tracing::warn!(error = %e, retry_in_ms = pause.as_millis() as u64, "could not move the record aside; retrying");
                    if !self.pause(&taken, pause).await {
                        return Done {
                            taken,
                            gates,
                            end: End::Abandoned,
                            report,
                        };
                    }
                }
            }
        }
    }
}

fn offsets_list(list: &[(String, i32, i64)]) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::with_capacity(list.len());
    for (topic, partition, offset) in list {
        if let Err(e) = tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset)) {
            tracing::warn!(error = %e, "cannot list an offset to commit");
        }
    }
    tpl
}
