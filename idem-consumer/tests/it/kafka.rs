//! Kafka adapter against a real Kafka-protocol broker: every test spawns
//! its own `tansu` (idem-testkit's `KafkaBroker`, in memory, on a free
//! port) and its own redis-server for idem's store. Ground truth is an
//! external ledger of side effects and the offsets the **broker** reports
//! as committed for the group (never idem's or the adapter's own view).
//!
//! The shared scenarios (`support`) run on a [`Topic`] (the place: a topic
//! of one partition and its dead-letter topic) through [`GroupMember`]s.
//! Kafka has no per-message ack: a member's `poll` is a slice of
//! [`KafkaConsumer::run`], which decides records and commits offsets by
//! its own rule (see [`GroupMember`]). Three shared scenarios do not run
//! here; this module's own versions stand in for them:
//! `killed_before_the_ack_the_redelivery_replays` counts redeliveries by
//! delivery count, which Kafka does not keep (a record read again after a
//! crash is delivery 1: the own test checks the commit and the replays),
//! `killed_mid_handler_one_extra_run_after_the_lease` needs the next
//! member in before the dead holder's lease ends (see the own test), and
//! `run_survives_a_broker_restart` bounces the broker under a running
//! member, which tansu (in memory) survives empty and librdkafka 2.12 does
//! not survive at all (see the restart test).
//!
//! What stays here is Kafka's own: partitions, rebalances, the commit rule,
//! the retry and dead-letter topics and their headers.

use crate::support::{self, DeadLetter, Member, Place, idem_on, order, order_of};
use idem_consumer::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_consumer::kafka::rdkafka::client::DefaultClientContext;
use idem_consumer::kafka::rdkafka::config::ClientConfig;
use idem_consumer::kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use idem_consumer::kafka::rdkafka::message::{Header, Headers, Message as _, OwnedHeaders};
use idem_consumer::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem_consumer::kafka::rdkafka::{Offset, TopicPartitionList};
use idem_consumer::kafka::{KafkaConfig, KafkaConsumer, KafkaReport, header_names};
use idem_consumer::{
    Classify, Consumer, ConsumerError, ErrorClass, KeyDeriver, KeySource, Message, PollReport,
    dead_letter_field,
};
use idem_core::Idempotency;
use idem_redis::RedisStore;
use idem_testkit::{FileLedger, KafkaBroker, Ledger, RedisServer};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::fmt;
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

/// A record read back: its offset, headers and payload.
struct Record {
    offset: i64,
    headers: BTreeMap<String, String>,
    /// Every header as on the wire: in order, repeats kept, raw bytes.
    header_list: Vec<(String, Option<Vec<u8>>)>,
    payload: Vec<u8>,
}

/// Up to `expect` records of `topic` from its beginning (fewer after 20 s).
fn read_all(bootstrap: &str, topic: &str, partitions: i32, expect: usize) -> Vec<Record> {
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    read(bootstrap, &tpl, |out| out.len() >= expect, Duration::ZERO)
}

/// The records of `topic` (of one partition) from `offset` on: at least
/// to its high watermark, and on until none came for 300 ms (tansu may
/// report a high watermark short of records produced concurrently).
fn read_from(bootstrap: &str, topic: &str, offset: i64) -> Vec<Record> {
    let end = high_watermarks(bootstrap, topic, 1)[0];
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Offset(offset))
        .unwrap();
    let reached = |out: &[Record]| out.last().map_or(offset, |r| r.offset + 1) >= end;
    read(bootstrap, &tpl, reached, Duration::from_millis(300))
}

/// Reads the partitions of `from` until `done` says so and nothing came
/// for `quiet` (or, with nothing done, 20 s).
fn read(
    bootstrap: &str,
    from: &TopicPartitionList,
    done: impl Fn(&[Record]) -> bool,
    quiet: Duration,
) -> Vec<Record> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", unique("reader"))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    c.assign(from).unwrap();
    let mut out = Vec::new();
    let (start, mut last) = (Instant::now(), Instant::now());
    while start.elapsed() < Duration::from_secs(20) && !(done(&out) && last.elapsed() >= quiet) {
        let Some(Ok(m)) = c.poll(Duration::from_millis(50)) else {
            continue;
        };
        last = Instant::now();
        let header_list: Vec<(String, Option<Vec<u8>>)> = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                    .collect()
            })
            .unwrap_or_default();
        let headers = header_list
            .iter()
            .map(|(k, v)| {
                let v = v.as_deref().unwrap_or_default();
                (k.clone(), String::from_utf8_lossy(v).into_owned())
            })
            .collect();
        out.push(Record {
            offset: m.offset(),
            headers,
            header_list,
            payload: m.payload().unwrap_or_default().to_vec(),
        });
    }
    out
}

/// Test settings: short session and commit interval, quick fetches.
fn cfg(bootstrap: &str, group: &str, topic: &str) -> KafkaConfig {
    // The adapter's view (assignments, revocations, commits, records
    // kept) and librdkafka's group protocol (the shared scenarios'
    // members ask for `debug=cgrp`), shown with a failing test's output;
    // `RUST_LOG` overrides it.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("idem_consumer=debug,librdkafka=debug,warn")
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
    KafkaConfig::new(bootstrap, group, [topic])
        .commit_interval(Duration::from_millis(100))
        .set("session.timeout.ms", "3000")
        .set("heartbeat.interval.ms", "300")
        .set("fetch.wait.max.ms", "50")
        .set("topic.metadata.refresh.interval.ms", "1000")
}

/// Runs `step` until it says done, 50 ms apart, failing after `deadline`.
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
    // Its own loop, so a timeout says where each partition stood.
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let (got, ends) = commits_and_ends(bootstrap, group, topic, partitions).await;
        if at_the_end(&got, &ends) {
            return;
        }
        assert!(
            Instant::now() < end,
            "not reached within 60s: committed offsets at the end of every partition of \
             {topic} (committed {got:?}, ends {ends:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The group's committed offsets, then the partitions' ends, read in that
/// order: a commit at or past an end read after it covers every record
/// before that end. Both are read again on each call, as records may
/// still arrive (a retry topic fills while it is consumed) and tansu may
/// report an end short of records produced just before.
async fn commits_and_ends(
    bootstrap: &str,
    group: &str,
    topic: &str,
    partitions: i32,
) -> (Vec<Option<i64>>, Vec<i64>) {
    let (b, g, t) = (bootstrap.to_owned(), group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let got = committed(&b, &g, &t, partitions);
        (got, high_watermarks(&b, &t, partitions))
    })
    .await
    .unwrap()
}

/// Every partition committed at or past its end.
fn at_the_end(committed: &[Option<i64>], ends: &[i64]) -> bool {
    committed.len() == ends.len()
        && committed
            .iter()
            .zip(ends)
            .all(|(c, e)| c.is_some_and(|c| c >= *e))
}

fn counts(runs: impl IntoIterator<Item = String>) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for k in runs {
        *m.entry(k).or_default() += 1;
    }
    m
}

// ------------------------------------------------------------------ the place

/// A topic with its dead-letter topic (`<name>.DLT`) and a consumer group,
/// on a broker of its own (killed on drop) or, in a worker process, on
/// the test's.
struct Topic {
    broker: Option<KafkaBroker>,
    bootstrap: String,
    name: String,
    group: String,
    partitions: i32,
    producer: FutureProducer,
    /// The next dead letter [`Place::dead_letters`] returns.
    dead_read: std::sync::Mutex<i64>,
}

impl Drop for Topic {
    /// A failing test shows the end of the broker's log too.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        if let Some(broker) = &self.broker {
            let log = std::fs::read_to_string(broker.dir().join("tansu.log")).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines.get(lines.len().saturating_sub(40)..).unwrap_or(&[]);
            println!(
                "tansu's log, last {} lines:\n{}",
                tail.len(),
                tail.join("\n")
            );
        }
    }
}

impl Topic {
    /// A new broker with the topic (of `partitions`) and its dead-letter
    /// topic (of one).
    async fn create(prefix: &str, partitions: i32) -> Topic {
        let broker = KafkaBroker::start();
        let bootstrap = broker.bootstrap();
        let topic = Topic {
            producer: producer(&bootstrap),
            broker: Some(broker),
            bootstrap,
            name: unique(prefix),
            group: unique("billing"),
            partitions,
            dead_read: std::sync::Mutex::new(0),
        };
        topic.create_topics().await;
        topic
    }

    /// Creates the topics (again, after a restart: tansu keeps them in memory).
    async fn create_topics(&self) {
        create_topic(&self.bootstrap, &self.name, self.partitions).await;
        create_topic(&self.bootstrap, &self.dead_letter_topic(), 1).await;
    }

    fn broker(&mut self) -> &mut KafkaBroker {
        self.broker.as_mut().expect("the test's own broker")
    }

    fn dead_letter_topic(&self) -> String {
        format!("{}.DLT", self.name)
    }

    /// The test settings for a member of the topic's group.
    fn cfg(&self) -> KafkaConfig {
        cfg(&self.bootstrap, &self.group, &self.name)
    }

    /// The settings of the shared scenarios' members: the session timeout
    /// is `redeliver_after` (a dead member's partitions move after it, at
    /// least [`SHORTEST_SESSION`]), and the cooperative-sticky assignor
    /// keeps a partition with its member while others join, so that
    /// nothing it decided is read again.
    fn member_cfg(&self, redeliver_after: Duration) -> KafkaConfig {
        let session = redeliver_after.max(SHORTEST_SESSION).as_millis();
        self.cfg()
            .set("partition.assignment.strategy", "cooperative-sticky")
            .set("session.timeout.ms", session.to_string())
            .set("heartbeat.interval.ms", (session / 5).to_string())
            // Joins, syncs and assignments, for the output of a failing
            // test: a survivor once waited 60 s for an assignment that
            // never came, and nothing said why.
            .set("debug", "cgrp")
    }

    /// Publishes one record to an explicit partition, its id (if any) in the
    /// key header.
    async fn publish_to(&self, partition: i32, id: Option<&str>, payload: &[u8]) {
        self.publish_raw(partition, id.map(str::as_bytes), payload)
            .await;
    }

    /// Publishes one record with a record key (Kafka's, not idem's) and
    /// its id in the key header.
    async fn publish_keyed(&self, partition: i32, record_key: &str, id: &str, payload: &[u8]) {
        let headers = OwnedHeaders::new().insert(Header {
            key: header_names::IDEMPOTENCY_KEY,
            value: Some(id.as_bytes()),
        });
        let record = FutureRecord::<str, [u8]>::to(&self.name)
            .partition(partition)
            .key(record_key)
            .payload(payload)
            .headers(headers);
        self.producer
            .send(record, Duration::from_secs(10))
            .await
            .unwrap_or_else(|(e, _)| panic!("cannot publish to {}/{partition}: {e}", self.name));
    }

    /// Publishes one record with any bytes in the key header.
    async fn publish_raw(&self, partition: i32, id: Option<&[u8]>, payload: &[u8]) {
        let mut headers = OwnedHeaders::new();
        if let Some(id) = id {
            headers = headers.insert(Header {
                key: header_names::IDEMPOTENCY_KEY,
                value: Some(id),
            });
        }
        let record = FutureRecord::<str, [u8]>::to(&self.name)
            .partition(partition)
            .payload(payload)
            .headers(headers);
        self.producer
            .send(record, Duration::from_secs(10))
            .await
            .unwrap_or_else(|(e, _)| panic!("cannot publish to {}/{partition}: {e}", self.name));
    }

    /// Publishes one record to partition 0 with `headers`, in order (a
    /// name may repeat: Kafka headers are a list).
    #[cfg(feature = "otel")]
    async fn publish_with_headers(&self, headers: &[(&str, &str)], payload: &[u8]) {
        let mut h = OwnedHeaders::new();
        for (key, value) in headers {
            h = h.insert(Header {
                key,
                value: Some(*value),
            });
        }
        let record = FutureRecord::<str, [u8]>::to(&self.name)
            .partition(0)
            .payload(payload)
            .headers(h);
        self.producer
            .send(record, Duration::from_secs(10))
            .await
            .unwrap_or_else(|(e, _)| panic!("cannot publish to {}/0: {e}", self.name));
    }

    /// The group's committed offsets, per partition, as the broker says.
    async fn committed(&self) -> Vec<Option<i64>> {
        let (b, g, t, n) = (
            self.bootstrap.clone(),
            self.group.clone(),
            self.name.clone(),
            self.partitions,
        );
        tokio::task::spawn_blocking(move || committed(&b, &g, &t, n))
            .await
            .unwrap()
    }

    async fn until_committed_to_the_end(&self) {
        until_committed_to_the_end(&self.bootstrap, &self.group, &self.name, self.partitions).await;
    }

    /// A new consumer of the topic runs `handler` until the group's commit
    /// is at the end of every partition, then stops: its report.
    async fn run_to_the_end<C, T, E, H, Fut>(
        &self,
        consumer: &Consumer<C>,
        handler: &H,
    ) -> Result<KafkaReport, ConsumerError>
    where
        H: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: serde::Serialize + serde::de::DeserializeOwned,
        E: std::fmt::Display,
        C: Classify<E>,
    {
        let kc = KafkaConsumer::connect(self.cfg()).unwrap();
        self.run_on_to_the_end(&kc, consumer, handler).await
    }

    /// [`run_to_the_end`](Self::run_to_the_end) on the consumer `kc`.
    async fn run_on_to_the_end<C, T, E, H, Fut>(
        &self,
        kc: &KafkaConsumer,
        consumer: &Consumer<C>,
        handler: &H,
    ) -> Result<KafkaReport, ConsumerError>
    where
        H: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: serde::Serialize + serde::de::DeserializeOwned,
        E: std::fmt::Display,
        C: Classify<E>,
    {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let check = async {
            self.until_committed_to_the_end().await;
            stop.send(()).unwrap();
        };
        let (report, ()) = tokio::join!(kc.run(consumer, handler, stopped), check);
        report
    }

    /// The first `n` records of the dead-letter topic (fewer after 20 s).
    async fn dead_letter_records(&self, n: usize) -> Vec<Record> {
        let (b, d) = (self.bootstrap.clone(), self.dead_letter_topic());
        tokio::task::spawn_blocking(move || read_all(&b, &d, 1, n))
            .await
            .unwrap()
    }
}

/// The shortest session timeout of a member: a dead member keeps its
/// partitions this long at least.
const SHORTEST_SESSION: Duration = Duration::from_millis(500);

impl Place for Topic {
    type Adapter = GroupMember;
    const WORKER_ENV: &'static str = "IDEM_KAFKA";
    const WORKER_TEST: &'static str = "kafka::worker";

    async fn publish(&self, id: Option<&str>, payload: &[u8]) {
        self.publish_to(0, id, payload).await;
    }

    /// A member of the group, configured as [`Topic::member_cfg`].
    async fn adapter(&self, _: &str, redeliver_after: Duration) -> GroupMember {
        GroupMember {
            cfg: self.member_cfg(redeliver_after),
            topic: self.name.clone(),
            bootstrap: self.bootstrap.clone(),
            partitions: self.partitions,
            member: tokio::sync::Mutex::new(None),
        }
    }

    /// The group's commit at the end of every partition.
    async fn drained(&self) -> bool {
        let (at, ends) =
            commits_and_ends(&self.bootstrap, &self.group, &self.name, self.partitions).await;
        at_the_end(&at, &ends)
    }

    /// The key header, idem's fields and the payload of the records of the
    /// dead-letter topic not returned before.
    async fn dead_letters(&self) -> Vec<DeadLetter> {
        let from = *self.dead_read.lock().unwrap();
        let (b, d) = (self.bootstrap.clone(), self.dead_letter_topic());
        let read = tokio::task::spawn_blocking(move || read_from(&b, &d, from))
            .await
            .unwrap();
        if let Some(r) = read.last() {
            *self.dead_read.lock().unwrap() = r.offset + 1;
        }
        read.into_iter()
            .map(|r| {
                let h = |k: &str| r.headers.get(k).cloned();
                DeadLetter {
                    id: h(header_names::IDEMPOTENCY_KEY),
                    kind: h(dead_letter_field::KIND),
                    reason: h(dead_letter_field::REASON),
                    deliveries: h(dead_letter_field::DELIVERIES).map(|n| n.parse().unwrap()),
                    payload: r.payload,
                }
            })
            .collect()
    }

    fn to_env(&self) -> Vec<(String, String)> {
        vec![
            ("IDEM_KAFKA_BOOTSTRAP".into(), self.bootstrap.clone()),
            ("IDEM_KAFKA_TOPIC".into(), self.name.clone()),
            ("IDEM_KAFKA_GROUP".into(), self.group.clone()),
            ("IDEM_KAFKA_PARTITIONS".into(), self.partitions.to_string()),
        ]
    }

    async fn from_env() -> Topic {
        let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("worker: {k} not set"));
        let bootstrap = env("IDEM_KAFKA_BOOTSTRAP");
        Topic {
            broker: None,
            producer: producer(&bootstrap),
            bootstrap,
            name: env("IDEM_KAFKA_TOPIC"),
            group: env("IDEM_KAFKA_GROUP"),
            partitions: env("IDEM_KAFKA_PARTITIONS").parse().unwrap(),
            dead_read: std::sync::Mutex::new(0),
        }
    }
}

// ----------------------------------------------------------------- the member

/// How long a slice waits with nothing taken (a fetch's block time).
const IDLE: Duration = Duration::from_millis(200);
/// How long a slice goes on with records taken and none decided nor
/// committed (idem's store down, a key held by a dead consumer) before it
/// hands back.
const STALL: Duration = Duration::from_secs(2);

/// A member of the topic's group for the shared scenarios: a
/// [`KafkaConsumer`] joined on first use.
///
/// * `poll` is a slice of [`KafkaConsumer::run`]: it ends once nothing is
///   undecided for [`IDLE`], or once records wait without progress for
///   [`STALL`]. When a slice leaves records undecided (waiting for the
///   store, or taken and not started) the member then leaves the group,
///   and the next slice joins again and reads from the group's commit, as
///   a new member would: the shared scenarios restart consumers. (The next
///   `run` of the same consumer would handle them too: see
///   `records_waiting_at_shutdown_are_handled_once_by_the_next_run_in_order`.)
/// * Its report counts as nacked what Kafka retries in process or waits
///   for (the handler failed, or could not run): a nack elsewhere.
/// * `handle_unsettled` runs the handler of every record the topic holds
///   when it starts (new records, not replays) and commits none.
struct GroupMember {
    cfg: KafkaConfig,
    topic: String,
    bootstrap: String,
    partitions: i32,
    member: tokio::sync::Mutex<Option<KafkaConsumer>>,
}

impl GroupMember {
    /// Runs the member (joining first if it is not in the group) until
    /// `shutdown`, or a quiet moment without one; leaves the group (and
    /// returns once it has left) after a shutdown, or if anything is left
    /// undecided.
    async fn run_once<C, T, E, H, Fut, S>(
        &self,
        consumer: &Consumer<C>,
        handler: &H,
        shutdown: Option<S>,
    ) -> Result<KafkaReport, ConsumerError>
    where
        H: Fn(Message) -> Fut + Sync,
        Fut: Future<Output = Result<T, E>> + Send,
        T: Serialize + DeserializeOwned + Send + Sync,
        E: fmt::Display + Send,
        C: Classify<E>,
        S: Future + Send,
    {
        let mut slot = self.member.lock().await;
        let kc = match slot.take() {
            Some(kc) => kc,
            None => KafkaConsumer::connect(self.cfg.clone())?,
        };
        let shut_down = shutdown.is_some();
        let ran = match shutdown {
            Some(s) => kc.run(consumer, handler, s).await,
            None => kc.run(consumer, handler, quiet(&kc)).await,
        };
        if ran.is_ok() && kc.undecided() == 0 && !shut_down {
            *slot = Some(kc);
        } else {
            // Left before the next member joins: one joining while this
            // one was still leaving was the moment a survivor once waited
            // 60 s for an assignment (tansu 0.6).
            kc.close().await;
        }
        ran
    }
}

/// Resolves once `kc` has had nothing undecided for [`IDLE`], or records
/// undecided and no decision or commit for [`STALL`].
async fn quiet(kc: &KafkaConsumer) {
    let progress = || (kc.undecided(), kc.commits());
    let (mut seen, mut changed, mut busy) = (progress(), Instant::now(), Instant::now());
    loop {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let now = progress();
        if now.0 > 0 {
            busy = Instant::now();
        } else if busy.elapsed() >= IDLE {
            return;
        }
        if now != seen {
            (seen, changed) = (now, Instant::now());
        } else if now.0 > 0 && changed.elapsed() >= STALL {
            return;
        }
    }
}

impl Member for GroupMember {
    async fn poll<C, T, E, H, Fut>(
        &self,
        consumer: &Consumer<C>,
        handler: &H,
    ) -> Result<PollReport, ConsumerError>
    where
        H: Fn(Message) -> Fut + Sync,
        Fut: Future<Output = Result<T, E>> + Send,
        T: Serialize + DeserializeOwned + Send + Sync,
        E: fmt::Display + Send,
        C: Classify<E>,
    {
        let r = self
            .run_once(consumer, handler, None::<std::future::Pending<()>>)
            .await?;
        let mut report = PollReport::default();
        report.fetched = r.fetched;
        report.redelivered = r.redelivered;
        report.acked = r.acked;
        report.nacked = r.nacked + r.retried + r.retry_published;
        report.dead_lettered = r.dead_lettered;
        Ok(report)
    }

    async fn run<C, T, E, H, Fut, S>(
        &self,
        consumer: &Consumer<C>,
        handler: &H,
        shutdown: S,
    ) -> Result<(), ConsumerError>
    where
        H: Fn(Message) -> Fut + Sync,
        Fut: Future<Output = Result<T, E>> + Send,
        T: Serialize + DeserializeOwned + Send + Sync,
        E: fmt::Display + Send,
        C: Classify<E>,
        S: Future + Send,
    {
        self.run_once(consumer, handler, Some(shutdown))
            .await
            .map(drop)
    }

    async fn handle_unsettled<C, T, E, H, Fut>(&self, consumer: &Consumer<C>, handler: &H)
    where
        H: Fn(Message) -> Fut + Sync,
        Fut: Future<Output = Result<T, E>> + Send,
        T: Serialize + DeserializeOwned + Send + Sync,
        E: fmt::Display + Send,
        C: Classify<E>,
    {
        let (b, t, n) = (self.bootstrap.clone(), self.topic.clone(), self.partitions);
        let ends = tokio::task::spawn_blocking(move || high_watermarks(&b, &t, n))
            .await
            .unwrap();
        // Where the handler ran (`partition@offset`): a record is taken
        // (undecided) before its handler starts.
        let ran = std::sync::Mutex::new(std::collections::HashSet::new());
        let watched = |m: Message| {
            ran.lock()
                .unwrap()
                .insert(m.position().unwrap_or_default().to_owned());
            handler(m)
        };
        let everything_ran = || {
            let ran = ran.lock().unwrap();
            let mut all = ends
                .iter()
                .enumerate()
                .flat_map(|(p, &end)| (0..end).map(move |o| format!("{p}@{o}")));
            all.all(|at| ran.contains(&at))
        };
        // The first commit is due in an hour; `run` is dropped, not shut
        // down (which would commit), and the member stays in the group.
        let cfg = self.cfg.clone().commit_interval(Duration::from_secs(3600));
        let kc = KafkaConsumer::connect(cfg).unwrap();
        let handled = async {
            while !(everything_ran() && kc.undecided() == 0) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::select! {
            ran = kc.run(consumer, &watched, std::future::pending::<()>()) => {
                panic!("run returned: {ran:?}");
            }
            () = handled => {}
        }
        *self.member.lock().await = Some(kc);
    }
}

// ------------------------------------------------------------------- shared

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_tasks_duplicates_and_republishes_run_each_order_once_and_ack_everything() {
    support::four_tasks_run_each_order_once(Topic::create("once", 1).await).await;
}

/// The retryable one runs three times in process, then goes to the
/// dead-letter topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_go_to_the_dead_letter_topic_the_rest_acked() {
    support::poison_messages_are_dead_lettered_the_rest_acked(Topic::create("poison", 1).await)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_nothing_runs_everything_nacked_then_processed_exactly_once() {
    support::store_down_nothing_runs_then_everything_once(Topic::create("store-down", 1).await)
        .await;
}

#[test]
fn worker() {
    support::worker::<Topic>();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_of_two_consumers_each_run_every_order_once() {
    support::two_processes_run_every_order_once(Topic::create("procs", 1).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_dead_lettered_with_its_reason_and_runs_nothing() {
    // Payload-derived keys: not JSON.
    let by_payload = Topic::create("bad-payload", 1).await;
    by_payload.publish(None, b"\xff not json").await;
    let payload_keys = KeySource::Payload(KeyDeriver::new());
    support::bad_input_is_dead_lettered_and_runs_nothing(&by_payload, payload_keys, &["JSON"])
        .await;
    // Header keys: an empty one.
    let by_id = Topic::create("bad-id", 1).await;
    by_id.publish(Some(""), b"{}").await;
    support::bad_input_is_dead_lettered_and_runs_nothing(&by_id, KeySource::MessageId, &["empty"])
        .await;
    // Header keys: 10 KB, and bytes that are not UTF-8.
    let by_header = Topic::create("bad-header", 1).await;
    by_header.publish(Some(&"x".repeat(10 * 1024)), b"{}").await;
    by_header.publish_raw(0, Some(&[0xff, 0xfe]), b"{}").await;
    support::bad_input_is_dead_lettered_and_runs_nothing(
        &by_header,
        KeySource::MessageId,
        &["10240 bytes", "not UTF-8"],
    )
    .await;
}

/// Each killed member stays in the group until its session (500 ms) runs
/// out; the next one reads from the group's commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_dead_letters_no_valid_order_and_loses_none() {
    let place = Topic::create("loop", 1).await;
    support::a_crash_loop_dead_letters_nothing_and_loses_nothing(place, SHORTEST_SESSION).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_the_batch_in_flight_finish_and_settles_it() {
    support::shutdown_drains_the_batch_in_flight(Topic::create("drain", 1).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_abandoned_at_the_drain_deadline_keeps_its_key_until_the_lease() {
    let place = Topic::create("abandon", 1).await;
    support::shutdown_past_the_deadline_keeps_the_key_until_the_lease(place).await;
}

// ------------------------------------------------------------- Kafka's own

/// `close` returns, and the member has left, even when the poll thread is
/// blocked on a full buffer (records polled that no `run` takes): it sees
/// the channel closed. A next member then gets the partition and every
/// record from the commit (none was decided).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_returns_with_the_poll_thread_blocked_on_a_full_buffer() {
    let t = Topic::create("close-full", 1).await;
    for i in 0..20 {
        t.publish(Some(&format!("o-{i}")), &order(i, 1)).await;
    }
    let kc = KafkaConsumer::connect(t.member_cfg(Duration::from_secs(1)).buffer(1)).unwrap();
    until(
        "the poll thread holding records",
        Duration::from_secs(30),
        async || {
            tokio::time::sleep(Duration::from_millis(20)).await;
            // One in the channel, and one taken that waits for room.
            kc.undecided() >= 2
        },
    )
    .await;
    tokio::time::timeout(Duration::from_secs(30), kc.close())
        .await
        .expect("close returned");
    let redis = RedisServer::start();
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(2)).await,
        "orders",
    )
    .keys(KeySource::MessageId);
    let ledger = Ledger::new();
    let charge = async |m: Message| -> Result<(), String> {
        ledger.record(&order_of(&m));
        Ok(())
    };
    let next = t.adapter("next", Duration::from_secs(1)).await;
    until("every order charged", Duration::from_secs(60), async || {
        next.poll(&consumer, &charge).await.unwrap();
        ledger.total() == 20
    })
    .await;
    assert!(ledger.duplicates().is_empty(), "{:?}", ledger.duplicates());
}

/// `n` orders round-robin over the topic's partitions with their id in the
/// key header, then every 5th again with the same id (into another
/// partition) and every 7th under a new id and timestamp (a re-publish:
/// one order under payload-derived keys, two under header keys). Returns
/// the number of records.
async fn publish_orders_over_partitions(t: &Topic, n: usize) -> usize {
    let mut sent = 0;
    for i in 0..n {
        let part = (i as i32) % t.partitions;
        t.publish_to(part, Some(&format!("o-{i}")), &order(i, 1))
            .await;
        sent += 1;
    }
    for i in 0..n {
        let part = (i as i32 + 1) % t.partitions;
        if i % 5 == 0 {
            t.publish_to(part, Some(&format!("o-{i}")), &order(i, 1))
                .await;
            sent += 1;
        }
        if i % 7 == 0 {
            let id = format!("o-{i}-again");
            t.publish_to(part, Some(&id), &order(i, 99)).await;
            sent += 1;
        }
    }
    sent
}

/// Two consumers (two group members) in one process over three
/// partitions, payload-derived keys: copies in other partitions, handled
/// by the other member, and re-publishes under new ids run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_members_payload_keys_duplicates_and_republishes_run_each_order_once() {
    let t = Topic::create("orders", 3).await;
    let redis = RedisServer::start();
    let n = 60;
    let sent = publish_orders_over_partitions(&t, n).await;
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
    let a = KafkaConsumer::connect(t.cfg()).unwrap();
    let b = KafkaConsumer::connect(t.cfg()).unwrap();
    // Both run until the group's commit is at the end of every partition:
    // a member stopped earlier (say once every order ran) could leave a
    // partition the group hands it late unread and uncommitted.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let until_done = || {
        let mut stopped = stopped.clone();
        async move { stopped.wait_for(|s| *s).await.map(drop) }
    };
    let check = async {
        t.until_committed_to_the_end().await;
        stop.send_replace(true);
    };
    let (ra, rb, ()) = tokio::join!(
        a.run(&consumer, &charge, until_done()),
        b.run(&consumer, &charge, until_done()),
        check,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_completion_commits_nothing_past_the_undecided_offset() {
    let t = Topic::create("ooo", 1).await;
    let redis = RedisServer::start();
    for i in 0..10 {
        t.publish_to(0, Some(&format!("o-{i}")), &order(i, 1)).await;
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
    let kc = KafkaConsumer::connect(t.cfg()).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let check = async {
        until(
            "offsets 0-4 and 6-9 handled",
            Duration::from_secs(30),
            async || ledger.total() == 9,
        )
        .await;
        // Only offset 5 undecided, and the broker acknowledged the commit
        // up to it (an earlier commit may have covered less: a commit tick
        // can fall between two decisions): the adapter has nothing more to
        // commit until 5 is decided.
        until(
            "5 alone undecided, the commit up to it acknowledged",
            Duration::from_secs(10),
            async || kc.undecided() == 1 && kc.last_committed(&t.name, 0) == Some(5),
        )
        .await;
        assert_eq!(
            t.committed().await,
            vec![Some(5)],
            "7, 8, 9 are done but 5 is not: the group's offset stays at 5 (nothing past 4)"
        );
        release.send(true).unwrap();
        t.until_committed_to_the_end().await;
        stop.send(()).unwrap();
    };
    let (report, ()) = tokio::join!(kc.run(&consumer, &charge, stopped), check);
    let report = report.unwrap();
    assert_eq!(report.acked, 10, "{report:?}");
    assert_eq!(ledger.total(), 10);
    assert!(ledger.duplicates().is_empty());
}

/// Beyond the shared poison scenario: the dead-letter records' Kafka
/// headers (origin, attempts, the original headers), a key header that is
/// not UTF-8 among them, and the partition's commit past all three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_records_go_to_the_dead_letter_topic_with_their_reason_and_the_partition_moves_on() {
    let t = Topic::create("poison", 1).await;
    let redis = RedisServer::start();
    for i in 0..10 {
        t.publish_to(0, Some(&format!("o-{i}")), &order(i, 1)).await;
    }
    // A key header that is not UTF-8: bad input, dead-lettered unrun.
    t.publish_raw(0, Some(&[0xff_u8, 0xfe][..]), &order(10, 1))
        .await;
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
    let report = t.run_to_the_end(&consumer, &charge).await;
    let report = report.unwrap();
    assert_eq!(report.dead_lettered, 3, "{report:?}");
    assert_eq!(report.acked, 8, "the rest of the partition: {report:?}");
    assert_eq!(report.retried, 2, "o-6 ran 3 times in process: {report:?}");
    assert_eq!(ledger.count("o-3"), 1, "permanent: one run");
    assert_eq!(ledger.count("o-6"), 3, "retryable: the in-process attempts");
    assert_eq!(ledger.count("o-10"), 0, "unkeyable: never run");
    let dead = t.dead_letter_records(3).await;
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
    assert_eq!(h("o-3", header_names::ORIGINAL_TOPIC), t.name);
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
    let t = Topic::create("retry", 1).await;
    let redis = RedisServer::start();
    let retry = format!("{}.retry", t.name);
    create_topic(&t.bootstrap, &retry, 1).await;
    for i in 0..4 {
        t.publish_to(0, Some(&format!("o-{i}")), &order(i, 1)).await;
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
    let kc = KafkaConsumer::connect(t.cfg().attempts_in_process(2).retry_topic(&retry)).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let check = async {
        t.until_committed_to_the_end().await;
        // The retry topic grows while o-1 makes its hops: its end is
        // final once the fifth run is done.
        until("o-1's fifth run", Duration::from_secs(60), async || {
            ledger.count("o-1") >= 5
        })
        .await;
        until_committed_to_the_end(&t.bootstrap, &t.group, &retry, 1).await;
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

/// Beyond the shared store-down scenario: the commit rule while nothing
/// can run (the group's offset does not move).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_nothing_runs_nothing_is_committed_then_everything_runs_once() {
    let t = Topic::create("storedown", 1).await;
    let mut redis = RedisServer::start();
    for i in 0..5 {
        t.publish_to(0, Some(&format!("o-{i}")), &order(i, 1)).await;
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
    let kc = KafkaConsumer::connect(t.cfg()).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let check = async {
        // Commits go on (the consumer is alive) but none moves past offset 0.
        until("all five taken", Duration::from_secs(30), async || {
            kc.undecided() == 5
        })
        .await;
        tokio::time::sleep(Duration::from_millis(1000)).await; // ten commit intervals
        let at = t.committed().await;
        assert!(
            matches!(at[0], None | Some(0)),
            "nothing committed while nothing could run: {at:?}"
        );
        assert_eq!(ledger.total(), 0, "fail-closed: nothing ran");
        redis.restart();
        t.until_committed_to_the_end().await;
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
    let mut t = Topic::create("restart", 2).await;
    let redis = RedisServer::start();
    for i in 0..20 {
        t.publish_to((i % 2) as i32, Some(&format!("o-{i}")), &order(i, 1))
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
    let run = async |t: &Topic, expect: usize| {
        let kc = KafkaConsumer::connect(t.cfg()).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let check = async {
            until("the orders charged", Duration::from_secs(60), async || {
                ledger.total() >= expect
            })
            .await;
            t.until_committed_to_the_end().await;
            stop.send(()).unwrap();
        };
        let (report, ()) = tokio::join!(kc.run(&consumer, &charge, stopped), check);
        // Closed, not dropped: a drop closes it later, on the poll thread,
        // maybe after the restart below.
        kc.close().await;
        report.unwrap()
    };
    run(&t, 20).await;
    // tansu keeps everything in memory: it comes back without topics,
    // records or offsets, and the producer sends its records again. The
    // member is closed across the restart: librdkafka 2.12 crashes on
    // tansu's answer to a fetch of a topic it no longer knows (a zero topic
    // id with a leader tag, an upstream librdkafka defect), which no
    // Kafka broker sends.
    t.broker().restart(); // the same port
    t.create_topics().await;
    t.producer = producer(&t.bootstrap);
    for i in 0..30 {
        t.publish_to((i % 2) as i32, Some(&format!("o-{i}")), &order(i, 1))
            .await;
    }
    let report = run(&t, 30).await;
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
    let t = Topic::create("revoke", 1).await;
    let redis = RedisServer::start();
    for i in 0..5 {
        t.publish_to(0, Some(&format!("o-{i}")), &order(i, 1)).await;
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
    let a = KafkaConsumer::connect(short(t.cfg())).unwrap();
    let (stop_a, stopped_a) = tokio::sync::oneshot::channel::<()>();
    let (stop_b, stopped_b) = tokio::sync::oneshot::channel::<()>();
    let (go_b, b_may_start) = tokio::sync::oneshot::channel::<()>();
    let check = async {
        until(
            "all but o-2 done, 2 committed",
            Duration::from_secs(30),
            async || ledger.total() == 4 && a.last_committed(&t.name, 0) == Some(2),
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
        assert_eq!(
            t.committed().await,
            vec![Some(2)],
            "the revocation committed what was decided, not past o-2"
        );
        // The handler outlived the deadline; it still holds o-2's lease, so
        // the next owner's claim waits. Let it finish now.
        tokio::time::sleep(Duration::from_millis(300)).await;
        release.send(true).unwrap();
        t.until_committed_to_the_end().await;
        stop_a.send(()).unwrap();
        stop_b.send(()).unwrap();
    };
    let run_b = async {
        let _ = b_may_start.await;
        // Connecting joins the group.
        let b = KafkaConsumer::connect(short(t.cfg())).unwrap();
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
/// offset stays at the undecided one. The next `run` of the same consumer
/// runs it again and the offset moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_starts_no_further_attempt_and_commits_only_what_is_decided() {
    let t = Topic::create("drain", 1).await;
    let redis = RedisServer::start();
    for i in 0..2 {
        t.publish_to(0, Some(&format!("o-{i}")), &order(i, 1)).await;
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
    let kc = KafkaConsumer::connect(t.cfg()).unwrap();
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
    assert_eq!(
        t.committed().await,
        vec![Some(1)],
        "o-0 committed, o-1 (offset 1) not"
    );
    // The next run (a supervisor restarting the loop, the bank back up).
    let succeed = |m: Message| {
        let ledger = &ledger;
        async move {
            ledger.record(&order_of(&m));
            Ok::<_, String>(())
        }
    };
    let second = t.run_on_to_the_end(&kc, &consumer, &succeed).await;
    let second = second.unwrap();
    assert_eq!(
        (ledger.count("o-0"), ledger.count("o-1")),
        (1, 2),
        "o-1 ran again, once: {second:?}"
    );
    assert_eq!((second.fetched, second.acked), (1, 1), "{second:?}");
    assert_eq!(t.committed().await, vec![Some(2)]);
}

/// Two copies of one record (same key and payload) in one partition, the
/// first failing once: each offset is decided once, the copy waits for the
/// first and replays, the side effect happens once and the group commits
/// to the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_in_one_partition_with_a_failing_first_are_decided_once_each() {
    let t = Topic::create("copies", 1).await;
    let redis = RedisServer::start();
    for i in [0, 0, 1] {
        t.publish_to(0, Some(&format!("o-{i}")), &order(i, 1)).await;
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
    let report = t.run_to_the_end(&consumer, &charge).await;
    let report = report.unwrap();
    assert_eq!((charged.count("o-0"), charged.count("o-1")), (1, 1));
    assert_eq!(report.acked, 3, "every offset decided once: {report:?}");
    assert_eq!(report.replayed, 1, "the copy replayed: {report:?}");
    assert_eq!(report.dead_lettered, 0, "{report:?}");
}

/// `n` records in partition 0 under one record key (so, in order-per-key
/// mode, each waits for the one before it), ids `o-0`…
async fn publish_behind_one_record_key(t: &Topic, n: usize) {
    for i in 0..n {
        t.publish_keyed(0, "customer-7", &format!("o-{i}"), &order(i, 1))
            .await;
    }
}

/// Resolves once `o-0`'s handler started and every one of `n` records was
/// taken from the broker, and then a moment more (nothing else to do, the
/// run loop moves them from the poll thread's channel into its queue of
/// records waiting to start: the state the defect lost). The moment only
/// decides whether the test can see the defect, never whether it passes.
async fn until_all_taken_and_o0_started(kc: &KafkaConsumer, started: &Ledger, n: usize) {
    until(
        "o-0 started and every record taken",
        Duration::from_secs(30),
        async || started.count("o-0") >= 1 && kc.undecided() == n,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// A `run` shut down while many records wait behind a slow one (the same
/// record key, in order-per-key mode) starts none of them; the next `run`
/// of the same consumer handles every one of them exactly once, in offset
/// order, and the group's offset reaches the end. (Before the fix they
/// were dropped with the first run's queue: never handled, their offsets
/// holding the partition's commit at 1 for good.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_waiting_at_shutdown_are_handled_once_by_the_next_run_in_order() {
    const N: usize = 30;
    let t = Topic::create("rerun", 1).await;
    let redis = RedisServer::start();
    publish_behind_one_record_key(&t, N).await;
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(2)).await,
        "orders.charge",
    );
    let (started, charged) = (Ledger::new(), Ledger::new());
    let order_done = std::sync::Mutex::new(Vec::new());
    let (release, released) = tokio::sync::watch::channel(false);
    let charge = |m: Message| {
        let (started, charged, order_done) = (&started, &charged, &order_done);
        let mut released = released.clone();
        async move {
            let o = order_of(&m);
            started.record(&o);
            if o == "o-0" {
                let _ = released.wait_for(|r| *r).await;
            }
            charged.record(&o);
            order_done.lock().unwrap().push(o);
            Ok::<_, String>(())
        }
    };
    let kc = KafkaConsumer::connect(t.cfg().in_order_per_key(true)).unwrap();
    // Run 1: shut down while o-0 runs and the rest wait behind it; o-0 is
    // let go as shutdown comes, so it finishes in the drain.
    let shutdown = async {
        until_all_taken_and_o0_started(&kc, &started, N).await;
        release.send(true).unwrap();
    };
    let first = kc.run(&consumer, &charge, shutdown).await.unwrap();
    assert_eq!(started.total(), 1, "shutdown started nothing more");
    assert_eq!((first.fetched, first.acked), (1, 1), "{first:?}");
    assert_eq!(kc.undecided(), N - 1, "the rest taken, undecided");
    assert_eq!(t.committed().await, vec![Some(1)], "o-0 committed");
    // Run 2, on the same consumer: the records left waiting come first.
    let second = t.run_on_to_the_end(&kc, &consumer, &charge).await;
    let second = second.unwrap();
    for i in 0..N {
        let o = format!("o-{i}");
        assert_eq!(
            (started.count(&o), charged.count(&o)),
            (1, 1),
            "{o} ran exactly once"
        );
    }
    assert_eq!(
        (second.fetched, second.acked, second.replayed),
        (N - 1, N - 1, 0),
        "{second:?}"
    );
    let expected: Vec<String> = (0..N).map(|i| format!("o-{i}")).collect();
    assert_eq!(
        *order_done.lock().unwrap(),
        expected,
        "one record key: offset order, across both runs"
    );
    assert_eq!(t.committed().await, vec![Some(N as i64)]);
    assert_eq!(kc.undecided(), 0);
}

/// A handler still running at the drain deadline is dropped; the next
/// `run` of the same consumer handles its record again first: its idem key
/// keeps the dropped handler's lease, so that run waits (fail-closed) and
/// takes over once the lease ends (`Recovered`, the body's second start),
/// then handles the records that waited behind it, each once, and the
/// group's offset reaches the end. (Before the fix the dropped record and
/// those behind it were never handled again by this consumer.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_dropped_at_the_drain_deadline_is_taken_over_by_the_next_run_after_its_lease() {
    const N: usize = 10;
    let t = Topic::create("rerun-drop", 1).await;
    let redis = RedisServer::start();
    publish_behind_one_record_key(&t, N).await;
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_millis(1500)).await,
        "orders.charge",
    )
    .drain_timeout(Duration::from_millis(100))
    .backoff(Duration::from_millis(50), Duration::from_millis(200));
    let (started, charged) = (Ledger::new(), Ledger::new());
    let charge = |m: Message| {
        let (started, charged) = (&started, &charged);
        async move {
            let o = order_of(&m);
            if started.record(&o) == 1 && o == "o-0" {
                // The first start of o-0 never ends: dropped at the deadline.
                std::future::pending::<()>().await;
            }
            charged.record(&o);
            Ok::<_, String>(())
        }
    };
    let kc = KafkaConsumer::connect(t.cfg().in_order_per_key(true)).unwrap();
    let first = kc
        .run(
            &consumer,
            &charge,
            until_all_taken_and_o0_started(&kc, &started, N),
        )
        .await
        .unwrap();
    assert_eq!(
        (first.fetched, first.acked, first.abandoned),
        (1, 0, 1),
        "{first:?}"
    );
    assert_eq!(charged.total(), 0);
    assert_eq!(kc.undecided(), N);
    let second = t.run_on_to_the_end(&kc, &consumer, &charge).await;
    let second = second.unwrap();
    assert_eq!(started.count("o-0"), 2, "o-0 started again once");
    for i in 0..N {
        let o = format!("o-{i}");
        assert_eq!(charged.count(&o), 1, "{o} completed exactly once");
        if i > 0 {
            assert_eq!(started.count(&o), 1, "{o} ran once");
        }
    }
    assert_eq!(
        (
            second.fetched,
            second.acked,
            second.recovered,
            second.replayed
        ),
        (N, N, 1, 0),
        "{second:?}"
    );
    assert_eq!(t.committed().await, vec![Some(N as i64)]);
    assert_eq!(kc.undecided(), 0);
}

// ------------------------------------------------------ processes (re-exec)

/// Runs the shared worker in `mode` (it kills itself) and returns its
/// ledger.
fn spawn_to_die(t: &Topic, mode: &str, redis: &RedisServer, dir: &std::path::Path) -> FileLedger {
    let status = support::spawn_worker(t, mode, &redis.url(), dir, SHORTEST_SESSION)
        .wait()
        .unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL),
        "the worker was to kill itself: {status:?}"
    );
    FileLedger::at(dir.join("ledger"))
}

fn ledger_counts(l: &FileLedger) -> BTreeMap<String, usize> {
    counts(l.runs().into_iter().map(|r| r.key))
}

/// A new member of the group (the shared worker's consumer) charging into
/// `ledger`, until every partition is committed to its end.
async fn drain_as_the_next_member(
    t: &Topic,
    redis: &RedisServer,
    ledger: &FileLedger,
) -> KafkaReport {
    let consumer = support::orders_consumer(&redis.url(), Duration::from_millis(1500)).await;
    let charge = |m: Message| async move {
        ledger.record(&order_of(&m));
        Ok::<_, String>(())
    };
    let kc = KafkaConsumer::connect(t.member_cfg(SHORTEST_SESSION)).unwrap();
    let report = t.run_on_to_the_end(&kc, &consumer, &charge).await;
    report.unwrap()
}

/// The seeds' crash, as Kafka has it: a member (a process) that did every
/// side effect and stored every result, SIGKILLed before any commit. The
/// group's offsets stay where they were; the next member reads everything
/// again and replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_side_effect_before_the_commit_the_next_member_replays_and_commits() {
    let t = Topic::create("crash", 3).await;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let n = 9;
    for i in 0..n {
        t.publish_to((i % 3) as i32, Some(&format!("o-{i}")), &order(i, 1))
            .await;
    }
    let ledger = spawn_to_die(&t, "crash-before-ack", &redis, dir.path());
    let before = ledger_counts(&ledger);
    assert_eq!(
        before.len(),
        n,
        "the victim charged everything before dying"
    );
    assert_eq!(
        t.committed().await,
        vec![None, None, None],
        "killed before any commit"
    );

    // The dead member's session runs out, the group rebalances to the new one.
    let report = drain_as_the_next_member(&t, &redis, &ledger).await;
    assert_eq!(
        report.replayed, n,
        "every record came back and replayed: {report:?}"
    );
    assert_eq!(ledger_counts(&ledger), before, "no second side effect");
}

/// The shared `killed_mid_handler_one_extra_run_after_the_lease` also
/// wants the next member to meet the dead holder's lease (1.5 s), which
/// tansu does not allow: a member joining a group whose leader is another
/// member waits 3 s there (its `PAUSE_MS`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_handler_the_next_member_takes_over_after_the_lease_with_one_extra_run() {
    let t = Topic::create("mid", 1).await;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    t.publish(Some("o-0"), &order(0, 1)).await;
    let ledger = spawn_to_die(&t, "crash-mid-handler", &redis, dir.path());
    assert_eq!(ledger_counts(&ledger).get("o-0"), Some(&1));

    let report = drain_as_the_next_member(&t, &redis, &ledger).await;
    assert_eq!(
        report.recovered, 1,
        "taken over after the dead holder's lease: {report:?}"
    );
    assert_eq!(
        ledger_counts(&ledger).get("o-0"),
        Some(&2),
        "exactly one extra run"
    );
}

// ------------------------------------------------------------ trace context

/// A W3C `traceparent` (the recommendation's example trace) that a later
/// one of the same record overrides.
#[cfg(feature = "otel")]
const TRACEPARENT_OLD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
/// The same trace, another span: the `traceparent` that counts.
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-b7ad6b7169203331-01";
/// A W3C `tracestate`.
const TRACESTATE: &str = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7";

/// What `KafkaSink` publishes is each message's stored headers, in their
/// order, byte for byte (names as given, a repeated name kept twice),
/// followed by its own `idempotency-key`; a message without stored
/// headers carries `idempotency-key` alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_sink_publishes_the_stored_headers_unchanged_before_the_idempotency_key() {
    use idem_consumer::outbox::{KafkaSink, OutboxMessage, Sink};
    let t = Topic::create("sink_headers", 1).await;
    let sink = KafkaSink::new(
        ClientConfig::new()
            .set("bootstrap.servers", &t.bootstrap)
            .set("message.timeout.ms", "10000"),
    )
    .unwrap();
    assert_eq!(sink.system(), "kafka");
    let stored: Vec<(String, String)> = [
        ("traceparent", TRACEPARENT),
        ("tracestate", TRACESTATE),
        ("x-tenant", "acme é"),
        ("x-tenant", "second"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let with =
        OutboxMessage::new("id-with", &t.name, "k-1", r#"{"n":1}"#).with_headers(stored.clone());
    let without = OutboxMessage::new("id-without", &t.name, "k-1", r#"{"n":2}"#);
    // One key: one partition, in this order.
    for r in sink.send(&[with, without]).await {
        r.unwrap();
    }
    let (b, n) = (t.bootstrap.clone(), t.name.clone());
    let records = tokio::task::spawn_blocking(move || read_all(&b, &n, 1, 2))
        .await
        .unwrap();
    assert_eq!(records.len(), 2);
    let mut want: Vec<(String, Option<Vec<u8>>)> = stored
        .iter()
        .map(|(k, v)| (k.clone(), Some(v.as_bytes().to_vec())))
        .collect();
    want.push((
        header_names::IDEMPOTENCY_KEY.to_owned(),
        Some(b"id-with".to_vec()),
    ));
    assert_eq!(records[0].header_list, want);
    assert_eq!(
        records[1].header_list,
        [(
            header_names::IDEMPOTENCY_KEY.to_owned(),
            Some(b"id-without".to_vec())
        )]
    );
}

/// With `otel`, the adapter hands the handler the record's trace context:
/// of a `traceparent` sent twice (Kafka headers are appended, never
/// replaced) the last one, with `tracestate`; a record without them is
/// handled as before, with none.
#[cfg(feature = "otel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_sees_the_last_traceparent_of_a_record_and_none_without_one() {
    use idem_core::MemoryStore;
    let t = Topic::create("trace", 1).await;
    t.publish_with_headers(
        &[
            (header_names::IDEMPOTENCY_KEY, "o-1"),
            ("traceparent", TRACEPARENT_OLD),
            ("tracestate", TRACESTATE),
            ("traceparent", TRACEPARENT),
        ],
        &order(1, 1),
    )
    .await;
    t.publish_to(0, Some("o-2"), &order(2, 1)).await;
    let consumer = Consumer::new(Idempotency::builder(MemoryStore::new()).build(), "trace");
    let seen = std::sync::Mutex::new(BTreeMap::new());
    let handle = |m: Message| {
        let seen = &seen;
        async move {
            let trace = (
                m.trace_header("traceparent").map(str::to_owned),
                m.trace_header("tracestate").map(str::to_owned),
            );
            seen.lock()
                .unwrap()
                .insert(m.id().unwrap_or("?").to_owned(), trace);
            Ok::<_, String>(())
        }
    };
    let report = t.run_to_the_end(&consumer, &handle).await;
    assert_eq!(report.unwrap().acked, 2);
    let seen = seen.into_inner().unwrap();
    assert_eq!(
        seen.get("o-1"),
        Some(&(Some(TRACEPARENT.to_owned()), Some(TRACESTATE.to_owned())))
    );
    assert_eq!(seen.get("o-2"), Some(&(None, None)));
}

// ------------------------------------------- header names that are not UTF-8

/// A header name that is not UTF-8: Kafka header names are bytes on the
/// wire, and a producer in another language writes the bytes it is given.
const NOT_UTF8_NAME: &[u8] = b"\xff\xfetrace";

/// Publishes one record, with `headers` in order, to partition 0 of
/// `topic` as any Kafka client may: a Produce request (v3, one record
/// batch of magic 2, acks from all replicas) written by hand, since
/// rdkafka's producer only writes header names that are `&str`. Fails
/// unless the broker answers that it stored the record.
fn produce_raw(bootstrap: &str, topic: &str, headers: &[(&[u8], &[u8])], payload: &[u8]) {
    use std::io::{Read as _, Write as _};
    fn varint(out: &mut Vec<u8>, v: i64) {
        let mut z = ((v << 1) ^ (v >> 63)) as u64; // zigzag
        while z >= 0x80 {
            out.push((z as u8) | 0x80);
            z >>= 7;
        }
        out.push(z as u8);
    }
    fn bytes(out: &mut Vec<u8>, b: &[u8]) {
        varint(out, b.len() as i64);
        out.extend_from_slice(b);
    }
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as i16).to_be_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    let mut record = vec![0]; // attributes
    varint(&mut record, 0); // timestamp delta
    varint(&mut record, 0); // offset delta
    varint(&mut record, -1); // no key
    bytes(&mut record, payload);
    varint(&mut record, headers.len() as i64);
    for (name, value) in headers {
        bytes(&mut record, name);
        bytes(&mut record, value);
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    // The batch from its attributes on: what its CRC-32C covers.
    let mut covered = Vec::new();
    covered.extend(0_i16.to_be_bytes()); // attributes: no compression
    covered.extend(0_i32.to_be_bytes()); // last offset delta
    covered.extend(now.to_be_bytes()); // first timestamp
    covered.extend(now.to_be_bytes()); // max timestamp
    covered.extend((-1_i64).to_be_bytes()); // producer id: none
    covered.extend((-1_i16).to_be_bytes()); // producer epoch
    covered.extend((-1_i32).to_be_bytes()); // base sequence
    covered.extend(1_i32.to_be_bytes()); // one record
    bytes(&mut covered, &record);
    let mut batch = Vec::new();
    batch.extend(0_i64.to_be_bytes()); // base offset
    batch.extend(((4 + 1 + 4 + covered.len()) as i32).to_be_bytes()); // length from here
    batch.extend((-1_i32).to_be_bytes()); // partition leader epoch
    batch.push(2); // magic
    batch.extend(crc32c(&covered).to_be_bytes());
    batch.extend(covered);
    let mut request = Vec::new();
    request.extend(0_i16.to_be_bytes()); // Produce
    request.extend(3_i16.to_be_bytes()); // v3
    request.extend(7_i32.to_be_bytes()); // correlation id
    string(&mut request, "idem-raw-producer"); // client id
    request.extend((-1_i16).to_be_bytes()); // transactional id: none
    request.extend((-1_i16).to_be_bytes()); // acks: all
    request.extend(10_000_i32.to_be_bytes()); // timeout (ms)
    request.extend(1_i32.to_be_bytes()); // one topic
    string(&mut request, topic);
    request.extend(1_i32.to_be_bytes()); // one partition
    request.extend(0_i32.to_be_bytes()); // partition 0
    request.extend((batch.len() as i32).to_be_bytes());
    request.extend(batch);
    let mut conn = std::net::TcpStream::connect(bootstrap)
        .unwrap_or_else(|e| panic!("cannot connect to {bootstrap}: {e}"));
    conn.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    conn.write_all(&(request.len() as i32).to_be_bytes())
        .unwrap();
    conn.write_all(&request).unwrap();
    let mut size = [0; 4];
    conn.read_exact(&mut size)
        .unwrap_or_else(|e| panic!("no answer to the Produce request from {bootstrap}: {e}"));
    let mut response = vec![0; i32::from_be_bytes(size) as usize];
    conn.read_exact(&mut response).unwrap();
    // Correlation id, one topic (count, name), one partition (count,
    // index), then its error code.
    assert_eq!(response[..4], 7_i32.to_be_bytes(), "{response:?}");
    let at = 4 + 4 + 2 + topic.len() + 4 + 4;
    let error = i16::from_be_bytes([response[at], response[at + 1]]);
    assert_eq!(
        error, 0,
        "{bootstrap} refused the record to {topic}/0: Kafka error code {error}"
    );
}

/// CRC-32C (Castagnoli), the checksum of a Kafka record batch.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0_u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn crc32c_gives_the_check_value() {
    assert_eq!(crc32c(b"123456789"), 0xe306_9283);
}

/// Publishes one record to `t`'s partition 0 through [`produce_raw`].
async fn publish_raw_headers(t: &Topic, headers: &[(&[u8], &[u8])], payload: Vec<u8>) {
    let (b, n) = (t.bootstrap.clone(), t.name.clone());
    let headers: Vec<(Vec<u8>, Vec<u8>)> = headers
        .iter()
        .map(|(k, v)| (k.to_vec(), v.to_vec()))
        .collect();
    tokio::task::spawn_blocking(move || {
        let headers: Vec<(&[u8], &[u8])> = headers
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
            .collect();
        produce_raw(&b, &n, &headers, &payload);
    })
    .await
    .unwrap();
}

/// A record whose header name is not UTF-8 is handled once and acked; its
/// readable headers are kept: the key header after the unreadable one
/// gives the record its id (and, with `otel`, the `traceparent` after it
/// its trace context). The records around it are handled as usual and
/// the group commits to the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_whose_header_name_is_not_utf8_is_handled_once_and_acked_its_readable_headers_kept()
 {
    let t = Topic::create("raw_header_name", 1).await;
    let redis = RedisServer::start();
    t.publish_to(0, Some("o-0"), &order(0, 1)).await;
    publish_raw_headers(
        &t,
        &[
            (NOT_UTF8_NAME, b"x"),
            (header_names::IDEMPOTENCY_KEY.as_bytes(), b"o-1"),
            (b"traceparent", TRACEPARENT.as_bytes()),
        ],
        order(1, 1),
    )
    .await;
    t.publish_to(0, Some("o-2"), &order(2, 1)).await;
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(2)).await,
        "orders.charge",
    );
    let ledger = Ledger::new();
    let seen = std::sync::Mutex::new(BTreeMap::new());
    let charge = |m: Message| {
        let (ledger, seen) = (&ledger, &seen);
        async move {
            let o = order_of(&m);
            ledger.record(&o);
            let got = (
                m.id().map(str::to_owned),
                m.trace_header("traceparent").map(str::to_owned),
            );
            seen.lock().unwrap().insert(o, got);
            Ok::<_, String>(())
        }
    };
    let report = t.run_to_the_end(&consumer, &charge).await;
    let report = report.unwrap();
    assert_eq!(report.acked, 3, "{report:?}");
    assert_eq!(report.dead_lettered, 0, "{report:?}");
    assert_eq!(ledger.count("o-1"), 1, "handled once");
    assert_eq!(ledger.total(), 3);
    assert!(ledger.duplicates().is_empty());
    assert_eq!(t.committed().await, [Some(3)], "committed past it");
    let seen = seen.into_inner().unwrap();
    let trace = cfg!(feature = "otel").then(|| TRACEPARENT.to_owned());
    assert_eq!(seen.get("o-1"), Some(&(Some("o-1".to_owned()), trace)));
    assert_eq!(seen.get("o-2"), Some(&(Some("o-2".to_owned()), None)));
}

/// The headers of the first record of `topic` (partition 0), in order:
/// `None` where rdkafka cannot read a header's name (it panics on a name
/// that is not UTF-8; caught here).
fn first_record_headers(bootstrap: &str, topic: &str) -> Vec<Option<(String, Vec<u8>)>> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", unique("reader"))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning)
        .unwrap();
    c.assign(&tpl).unwrap();
    let start = Instant::now();
    loop {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no record in {topic} within 20 s"
        );
        let Some(Ok(m)) = c.poll(Duration::from_millis(50)) else {
            continue;
        };
        let Some(h) = m.headers() else {
            return Vec::new();
        };
        return (0..h.count())
            .map(|i| {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.try_get(i)))
                    .ok()
                    .map(|h| {
                        let h = h.unwrap();
                        (h.key.to_owned(), h.value.unwrap_or_default().to_vec())
                    })
            })
            .collect();
    }
}

/// A dead letter of a record whose header name is not UTF-8 keeps every
/// original header in place, that one included, and adds the reason
/// after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_keeps_a_header_whose_name_is_not_utf8() {
    let t = Topic::create("raw_header_name_dlt", 1).await;
    let redis = RedisServer::start();
    publish_raw_headers(
        &t,
        &[
            (header_names::IDEMPOTENCY_KEY.as_bytes(), b"o-1"),
            (NOT_UTF8_NAME, b"x"),
            (b"x-tenant", b"acme"),
        ],
        order(1, 1),
    )
    .await;
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(2)).await,
        "orders.charge",
    )
    .classify(|e: &String| ErrorClass::from_retryable(!e.starts_with("declined")));
    let ledger = Ledger::new();
    let charge = |m: Message| {
        let ledger = &ledger;
        async move {
            ledger.record(&order_of(&m));
            Err::<(), _>("declined: card stolen".to_owned())
        }
    };
    let report = t.run_to_the_end(&consumer, &charge).await;
    let report = report.unwrap();
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    assert_eq!(ledger.count("o-1"), 1, "permanent: one run");
    let (b, d) = (t.bootstrap.clone(), t.dead_letter_topic());
    let headers = tokio::task::spawn_blocking(move || first_record_headers(&b, &d))
        .await
        .unwrap();
    let header = |name: &str| {
        headers
            .iter()
            .flatten()
            .rfind(|(k, _)| k == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    };
    assert_eq!(
        headers[..3],
        [
            Some((header_names::IDEMPOTENCY_KEY.to_owned(), b"o-1".to_vec())),
            None,
            Some(("x-tenant".to_owned(), b"acme".to_vec())),
        ],
        "the original headers in place, the unreadable one too: {headers:?}"
    );
    assert_eq!(headers.iter().filter(|h| h.is_none()).count(), 1);
    assert_eq!(
        header(header_names::REASON_KIND).as_deref(),
        Some("permanent")
    );
    assert_eq!(header(header_names::ORIGINAL_OFFSET).as_deref(), Some("0"));
    assert_eq!(header(header_names::ATTEMPTS).as_deref(), Some("1"));
}
