//! Redis Streams adapter: a consumer group read with `XREADGROUP`, acked
//! with `XACK`, stale entries taken over with `XAUTOCLAIM`, failures moved
//! to a dead-letter stream.
//!
//! Redis has no "nack": an entry that is not acked stays in the group's
//! pending list and any consumer takes it with `XAUTOCLAIM` once it has been
//! idle for [`StreamsConfig::claim_idle`]. A nack with a delay therefore
//! re-claims the entry for ourselves with its idle time set so that it
//! becomes claimable after that delay (`XCLAIM … IDLE n JUSTID`, which does
//! not count as a delivery), and remembers when: the fetch that follows
//! blocks for new entries no longer than that, then scans the pending list
//! at once. So a nacked entry comes back after its delay (never before:
//! Redis counts idle time in whole milliseconds, so the delay is rounded up
//! and one millisecond added) plus up to one tick of Redis's timer, which
//! is when it ends a blocked `XREADGROUP` (1/`hz`: 100 ms at the default
//! `hz 10`; a 500 ms nack measured 595 ms), instead of at the next periodic
//! scan (a quarter of `claim_idle`, at most 1 s, after a blocked read:
//! measured 1.0–1.1 s). While a handler runs, the owner re-claims its
//! in-flight entries every [`Consumer::keep_alive_period`](crate::Consumer::keep_alive_period) so nobody else's
//! `XAUTOCLAIM` takes them mid-run.
//!
//! A batch is settled by one Lua script (one round trip, atomic): acks,
//! nacks, and each dead letter `XADD`ed to the dead-letter stream then
//! acked, **only if the `XADD` succeeded**. An entry whose dead letter could
//! not be written (the key holds another type, Redis is out of memory)
//! stays pending and comes back after `claim_idle`; `poll` returns the
//! error, which names the stream to fix. Each entry id is settled once per
//! batch, whatever the batch holds.
//!
//! Entries are hashes of fields: the payload is in one field (default
//! `payload`), the producer's id, when there is one, in another (default
//! `id`); the W3C trace context in the fields `traceparent` and
//! `tracestate` (as [`RedisStreamsSink`](crate::outbox::RedisStreamsSink)
//! writes a message's headers), when UTF-8: on the [`Message`] and on its
//! dead letter whatever the build, continued by the `otel` feature.
//!
//! ```no_run
//! use idem_consumer::redis_streams::{RedisStreamsConsumer, StreamsConfig};
//! use idem_consumer::{Adapter, Consumer, Message};
//! use idem_core::Idempotency;
//! use idem_redis::RedisStore;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let idem = Idempotency::builder(RedisStore::connect("redis://127.0.0.1/").await?).build();
//! let consumer = Consumer::new(idem, "orders.charge").max_failures(5);
//! let stream = RedisStreamsConsumer::connect(
//!     "redis://127.0.0.1/",
//!     StreamsConfig::new("orders", "billing", "billing-1"),
//! ).await?;
//! stream.ensure_group().await?;
//! let charge = |m: Message| async move { Ok::<_, std::io::Error>(format!("charged {:?}", m.id())) };
//! let shutdown = std::future::pending::<()>(); // e.g. tokio::signal::ctrl_c()
//! stream.run(&consumer, &charge, shutdown).await?;
//! # Ok(()) }
//! ```

/// The `redis` crate this adapter is built on, re-exported so your
/// connection and setup code uses the same version.
pub use redis;

use crate::adapter::{Adapter, Recovery, handle_deliveries};
use crate::consumer::Consumer;
use crate::decision::Classify;
use crate::decision::{DeadLetterReason, Decision};
use crate::error::ConsumerError;
use crate::message::Message;
use idem_core::outbox::TRACE_HEADERS;
use idem_core::{FinishRoundTrip, finish_round_trip};
use idem_redis::RedisStore;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::streams::{StreamAutoClaimReply, StreamId, StreamPendingCountReply, StreamReadReply};
use redis::{RedisError, Script, Value};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::HashMap;
use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

const BROKER: &str = "redis-streams";

/// Where and how to consume.
///
/// ```
/// use idem_consumer::redis_streams::StreamsConfig;
/// use std::time::Duration;
/// let cfg = StreamsConfig::new("orders", "billing", "billing-1")
///     .dead_letter_stream("orders:failed")
///     .claim_idle(Duration::from_secs(60))
///     .batch(32);
/// assert_eq!(cfg.dead_letter(), "orders:failed");
/// ```
#[derive(Debug, Clone)]
pub struct StreamsConfig {
    stream: String,
    group: String,
    consumer: String,
    dead_letter: String,
    payload_field: String,
    id_field: String,
    batch: usize,
    block: Duration,
    claim_idle: Duration,
    start_id: String,
    keep_claimed: bool,
}

impl StreamsConfig {
    /// Consume `stream` in consumer group `group` as consumer `consumer`
    /// (unique per process: a restarted process may reuse its name).
    ///
    /// Defaults: dead letters to `<stream>:dead`, payload field `payload`,
    /// id field `id`, batches of 64, block 1 s for new entries, stale after
    /// 30 s idle, a new group starts at the beginning of the stream (`0`).
    pub fn new(
        stream: impl Into<String>,
        group: impl Into<String>,
        consumer: impl Into<String>,
    ) -> StreamsConfig {
        let stream = stream.into();
        StreamsConfig {
            dead_letter: format!("{stream}:dead"),
            stream,
            group: group.into(),
            consumer: consumer.into(),
            payload_field: "payload".into(),
            id_field: "id".into(),
            batch: 64,
            block: Duration::from_secs(1),
            claim_idle: Duration::from_secs(30),
            start_id: "0".into(),
            keep_claimed: true,
        }
    }

    /// The stream dead-lettered entries are added to, with fields `payload`,
    /// `id` (the producer's id, empty when none), `source_id` (the entry's id
    /// in the consumed stream) and those of
    /// [`DeadLetterReason::fields`](crate::DeadLetterReason::fields)
    /// (`idem-reason`, `idem-kind`, `idem-deliveries`, and `idem-failures`
    /// when counted), and the entry's `traceparent` and `tracestate` when it
    /// has them. It must be a stream or not exist: an entry whose dead
    /// letter cannot be added is left pending, not acked.
    pub fn dead_letter_stream(mut self, stream: impl Into<String>) -> Self {
        self.dead_letter = stream.into();
        self
    }

    /// The field holding the payload (default `payload`).
    pub fn payload_field(mut self, field: impl Into<String>) -> Self {
        self.payload_field = field.into();
        self
    }

    /// The field holding the producer's message id (default `id`).
    pub fn id_field(mut self, field: impl Into<String>) -> Self {
        self.id_field = field.into();
        self
    }

    /// Entries fetched at once (default 64, at least 1).
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.max(1);
        self
    }

    /// How long `XREADGROUP` blocks waiting for new entries (default 1 s).
    pub fn block(mut self, d: Duration) -> Self {
        self.block = d;
        self
    }

    /// How long a pending entry stays idle before any consumer takes it over
    /// with `XAUTOCLAIM` (default 30 s). Also the longest nack delay, and
    /// how long an entry whose dead letter could not be written waits.
    pub fn claim_idle(mut self, d: Duration) -> Self {
        self.claim_idle = d.max(Duration::from_millis(1));
        self
    }

    /// Where a group created by [`RedisStreamsConsumer::ensure_group`]
    /// starts: `0` (everything in the stream, the default) or `$` (only new
    /// entries).
    pub fn start_id(mut self, id: impl Into<String>) -> Self {
        self.start_id = id.into();
        self
    }

    /// Whether to re-claim in-flight entries while handlers run (default
    /// on). Off, a handler slower than `claim_idle` sees its entry taken
    /// over by another consumer, which gets `InProgress` from idem and nacks.
    pub fn keep_claimed(mut self, on: bool) -> Self {
        self.keep_claimed = on;
        self
    }

    /// The dead-letter stream's name.
    pub fn dead_letter(&self) -> &str {
        &self.dead_letter
    }

    /// The stream's name.
    pub fn stream(&self) -> &str {
        &self.stream
    }
}

/// One fetched entry: its stream id and the message made of it (or why
/// no message could be made: such entries are dead-lettered).
///
/// ```no_run
/// use idem_consumer::redis_streams::{RedisStreamsConsumer, StreamEntry};
/// use idem_consumer::{Adapter, Consumer, ConsumerError, Message};
///
/// # async fn demo(stream: RedisStreamsConsumer, consumer: Consumer) -> Result<(), ConsumerError> {
/// let entries: Vec<StreamEntry> = stream.fetch().await?;
/// for e in &entries {
///     let id = e.message.as_ref().ok().and_then(|m| m.id());
///     println!("{} (delivery {}): message id {id:?}", e.id, e.deliveries);
/// }
/// let charge = |m: Message| async move { Ok::<_, std::io::Error>(m.payload().len()) };
/// // With idem's store on this same Redis, the successes' acks ride here.
/// let decided = stream.handle(&consumer, &charge, entries).await;
/// stream.settle(decided).await?; // the rest: one XACK, or one settle script
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct StreamEntry {
    /// The entry's id in the stream (`1700000000000-0`).
    pub id: String,
    /// The message, or why the entry is not one.
    pub message: Result<Message, ConsumerError>,
    /// Deliveries of the entry to the group, this one included.
    pub deliveries: u32,
    /// Acked already, in the round trip that stored its result.
    acked: bool,
}

/// When the next `XAUTOCLAIM` scan of the pending list runs, and from where.
#[derive(Debug)]
struct Scan {
    /// Where the next scan resumes.
    cursor: String,
    /// No periodic scan before this: an entry only goes stale after
    /// `claim_idle`, so scanning on every poll would cost a round trip per
    /// batch for nothing.
    not_before: Option<Instant>,
    /// When entries we nacked become claimable: a scan runs as soon as one
    /// is due, and a blocked read waits no longer than the earliest.
    nacks_due: Vec<Instant>,
}

impl Scan {
    /// Whether to scan now, and from where; forgets the nacks now due.
    fn start(&mut self, now: Instant) -> Option<String> {
        let due = self.nacks_due.len();
        self.nacks_due.retain(|t| *t > now);
        if self.nacks_due.len() < due {
            // The nacked entries may sit before the cursor.
            return Some("0-0".into());
        }
        let periodic = self.not_before.is_none_or(|t| now >= t);
        periodic.then(|| self.cursor.clone())
    }

    /// The earliest nack still to come due.
    fn next_due(&self) -> Option<Instant> {
        self.nacks_due.iter().min().copied()
    }
}

/// A consumer of one stream in one consumer group.
///
/// ```no_run
/// use idem_consumer::redis_streams::{RedisStreamsConsumer, StreamsConfig};
/// use idem_consumer::{Adapter, Consumer, ConsumerError, Message};
/// use idem_core::Idempotency;
///
/// # async fn demo(idem: Idempotency) -> Result<(), ConsumerError> {
/// let cfg = StreamsConfig::new("orders", "billing", "billing-1");
/// let stream = RedisStreamsConsumer::connect("redis://127.0.0.1/", cfg).await?;
/// stream.ensure_group().await?;
/// assert_eq!(stream.config().dead_letter(), "orders:dead");
/// let consumer = Consumer::new(idem, "orders.charge");
/// let charge = |m: Message| async move { Ok::<_, std::io::Error>(m.payload().len()) };
/// let report = stream.poll(&consumer, &charge).await?;
/// println!("{} fetched, {} redelivered", report.fetched, report.redelivered);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStreamsConsumer {
    /// Commands that answer at once: acks, claims, dead letters.
    conn: ConnectionManager,
    /// `XREADGROUP … BLOCK`: on its own connection, so a blocked read does
    /// not hold up acks behind it on a multiplexed pipeline.
    reader: ConnectionManager,
    cfg: Arc<StreamsConfig>,
    source: Arc<str>,
    /// Shared by clones: they consume as the same consumer.
    scan: Arc<Mutex<Scan>>,
    /// Acks no longer ride with idem's results: the store is not this
    /// Redis (its `XACK`s acked nothing), or its user may not `XACK`.
    riding_off: Arc<AtomicBool>,
}

impl fmt::Debug for RedisStreamsConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStreamsConsumer")
            .field("config", &self.cfg)
            .finish_non_exhaustive()
    }
}

fn broker_err(op: &'static str) -> impl Fn(RedisError) -> ConsumerError {
    move |e| ConsumerError::broker_error(BROKER, op, e)
}

impl RedisStreamsConsumer {
    /// Connects to the Redis at `url` (two auto-reconnecting connections).
    pub async fn connect(url: &str, cfg: StreamsConfig) -> Result<Self, ConsumerError> {
        let client = redis::Client::open(url).map_err(broker_err("connect"))?;
        let commands = ConnectionManagerConfig::new()
            .set_response_timeout(Some(Duration::from_secs(5)))
            .set_connection_timeout(Some(Duration::from_secs(2)));
        let reads = ConnectionManagerConfig::new()
            .set_response_timeout(Some(cfg.block + Duration::from_secs(5)))
            .set_connection_timeout(Some(Duration::from_secs(2)));
        let conn = ConnectionManager::new_with_config(client.clone(), commands)
            .await
            .map_err(broker_err("connect"))?;
        let reader = ConnectionManager::new_with_config(client, reads)
            .await
            .map_err(broker_err("connect"))?;
        Ok(Self::from_connections(conn, reader, cfg))
    }

    /// Uses connections you made. `reader` serves only the blocking reads;
    /// its response timeout must exceed the configured block time.
    pub fn from_connections(
        conn: ConnectionManager,
        reader: ConnectionManager,
        cfg: StreamsConfig,
    ) -> Self {
        RedisStreamsConsumer {
            conn,
            reader,
            source: Arc::from(cfg.stream.as_str()),
            cfg: Arc::new(cfg),
            scan: Arc::new(Mutex::new(Scan {
                cursor: "0-0".into(),
                not_before: None,
                nacks_due: Vec::new(),
            })),
            riding_off: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &StreamsConfig {
        &self.cfg
    }

    /// Creates the consumer group (and the stream) if missing.
    pub async fn ensure_group(&self) -> Result<(), ConsumerError> {
        let mut conn = self.conn.clone();
        let created: Result<(), RedisError> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.cfg.stream)
            .arg(&self.cfg.group)
            .arg(&self.cfg.start_id)
            .arg("MKSTREAM")
            .query_async(&mut conn)
            .await;
        match created {
            Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
            other => other.map_err(broker_err("ensure_group")),
        }
    }

    async fn claim_stale(&self) -> Result<Vec<StreamEntry>, ConsumerError> {
        let mut conn = self.conn.clone();
        let Some(start) = self.scan().start(Instant::now()) else {
            return Ok(Vec::new());
        };
        let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
            .arg(&self.cfg.stream)
            .arg(&self.cfg.group)
            .arg(&self.cfg.consumer)
            .arg(millis(self.cfg.claim_idle))
            .arg(&start)
            .arg("COUNT")
            .arg(self.cfg.batch)
            .query_async(&mut conn)
            .await
            .map_err(broker_err("claim"))?;
        {
            // A full page, or a scan that has not wrapped yet, may have more
            // stale entries: look again next poll. Else wait a while.
            let more = reply.claimed.len() >= self.cfg.batch || reply.next_stream_id != "0-0";
            let pause = (self.cfg.claim_idle / 4).min(Duration::from_secs(1));
            let mut scan = self.scan();
            scan.cursor = reply.next_stream_id.clone();
            scan.not_before = (!more).then(|| Instant::now() + pause);
        }
        if !reply.deleted_ids.is_empty() {
            // Trimmed out of the stream while pending: nothing left to handle.
            let _: Result<usize, _> = redis::cmd("XACK")
                .arg(&self.cfg.stream)
                .arg(&self.cfg.group)
                .arg(&reply.deleted_ids)
                .query_async(&mut conn)
                .await;
        }
        if reply.claimed.is_empty() {
            return Ok(Vec::new());
        }
        let counts = self.delivery_counts(&reply.claimed).await?;
        Ok(reply
            .claimed
            .into_iter()
            .map(|sid| {
                // XAUTOCLAIM counted this delivery; a missing count means the
                // entry was acked meanwhile, and a second delivery is the
                // least it can be.
                let n = counts.get(&sid.id).copied().unwrap_or(2);
                self.entry(sid, n)
            })
            .collect())
    }

    /// Delivery counts of our own pending entries, from `XPENDING`.
    async fn delivery_counts(
        &self,
        ids: &[StreamId],
    ) -> Result<HashMap<String, u32>, ConsumerError> {
        let mut conn = self.conn.clone();
        let mut pipe = redis::pipe();
        for sid in ids {
            pipe.cmd("XPENDING")
                .arg(&self.cfg.stream)
                .arg(&self.cfg.group)
                .arg(&sid.id)
                .arg(&sid.id)
                .arg(1)
                .arg(&self.cfg.consumer);
        }
        let replies: Vec<StreamPendingCountReply> = pipe
            .query_async(&mut conn)
            .await
            .map_err(broker_err("pending"))?;
        Ok(replies
            .into_iter()
            .flat_map(|r| r.ids)
            .map(|p| (p.id, u32::try_from(p.times_delivered).unwrap_or(u32::MAX)))
            .collect())
    }

    fn entry(&self, mut sid: StreamId, deliveries: u32) -> StreamEntry {
        let message = self
            .parse_fields(&mut sid.map, deliveries)
            .map(|m| m.at_position(Arc::from(sid.id.as_str())));
        StreamEntry {
            id: sid.id,
            message,
            deliveries,
            acked: false,
        }
    }

    /// The scan state. A panic elsewhere while it was held left nothing
    /// half-written that matters (a cursor, times), so poisoning is ignored.
    fn scan(&self) -> std::sync::MutexGuard<'_, Scan> {
        self.scan.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The entry's message, its payload and id taken out of `fields`
    /// (moved, not copied).
    fn parse_fields(
        &self,
        fields: &mut HashMap<String, Value>,
        deliveries: u32,
    ) -> Result<Message, ConsumerError> {
        // One field may be both (a key made of the payload itself).
        let id = if self.cfg.id_field == self.cfg.payload_field {
            fields.get(&self.cfg.id_field).cloned()
        } else {
            fields.remove(&self.cfg.id_field)
        };
        let payload = match fields.remove(&self.cfg.payload_field) {
            Some(Value::BulkString(b)) => b,
            Some(Value::SimpleString(s)) => s.into_bytes(),
            Some(other) => {
                return Err(ConsumerError::Malformed(format!(
                    "field `{}` is not a string but {other:?}",
                    self.cfg.payload_field
                )));
            }
            None => {
                return Err(ConsumerError::Malformed(format!(
                    "the entry has no `{}` field; producers must XADD the payload under it \
                     (or set StreamsConfig::payload_field)",
                    self.cfg.payload_field
                )));
            }
        };
        let mut msg = Message::new(payload)
            .with_delivery_count(deliveries)
            .with_source(BROKER, self.source.clone());
        match id {
            None => {}
            Some(Value::BulkString(b)) => match String::from_utf8(b) {
                Ok(id) => msg = msg.with_id(id),
                Err(_) => {
                    msg = msg
                        .with_unreadable_id(format!("field `{}` is not UTF-8", self.cfg.id_field))
                }
            },
            Some(Value::SimpleString(s)) => msg = msg.with_id(s),
            Some(other) => {
                msg = msg.with_unreadable_id(format!(
                    "field `{}` is {other:?}, not a string",
                    self.cfg.id_field
                ))
            }
        }
        // Read whatever the build: a dead letter carries them on.
        for name in TRACE_HEADERS {
            let value = match fields.get(name) {
                Some(Value::BulkString(b)) => std::str::from_utf8(b).ok(),
                Some(Value::SimpleString(s)) => Some(s.as_str()),
                _ => None,
            };
            if let Some(value) = value {
                msg = msg.with_trace_header(name, value);
            }
        }
        Ok(msg)
    }

    /// Re-claims our in-flight entries (resetting their idle time) so that
    /// no other consumer's `XAUTOCLAIM` takes them while the handler runs.
    /// `JUSTID` keeps their delivery counts. Failures are only logged: the
    /// worst case is a takeover, which idem answers with `InProgress`.
    async fn touch(&self, ids: &[&str]) {
        if ids.is_empty() {
            return;
        }
        let mut conn = self.conn.clone();
        let r: Result<Value, _> = redis::cmd("XCLAIM")
            .arg(&self.cfg.stream)
            .arg(&self.cfg.group)
            .arg(&self.cfg.consumer)
            .arg(0)
            .arg(ids)
            .arg("JUSTID")
            .query_async(&mut conn)
            .await;
        if let Err(e) = r {
            tracing::warn!(error = %e, "could not re-claim in-flight stream entries");
        }
    }

    /// A batch decided all-ack, the usual one: a plain `XACK`, itself
    /// atomic, costs the server a third of the settle script (no script
    /// call, no argument parsing in Lua). An id twice is acked once.
    async fn ack_all(&self, decisions: &[(StreamEntry, Decision)]) -> Result<(), ConsumerError> {
        let mut xack = redis::cmd("XACK");
        xack.arg(&self.cfg.stream).arg(&self.cfg.group);
        let mut seen = HashSet::with_capacity(decisions.len());
        for (entry, _) in decisions {
            if !entry.acked && seen.insert(entry.id.as_str()) {
                xack.arg(&entry.id);
            }
        }
        if seen.is_empty() {
            return Ok(());
        }
        let _: usize = xack
            .query_async(&mut self.conn.clone())
            .await
            .map_err(broker_err("apply"))?;
        Ok(())
    }
    /// The round trip that stores the results of the entries at `done`
    /// through `store` with their `XACK` after them
    /// ([`RedisStore::finish_batch_then`]); the entries it confirms acked
    /// are marked in `acked`.
    fn ack_round_trip(
        &self,
        store: &RedisStore,
        done: &[usize],
        fetched: &[StreamEntry],
        acked: &Arc<Mutex<Vec<bool>>>,
    ) -> Option<FinishRoundTrip> {
        if self.riding_off.load(Ordering::Relaxed) {
            return None;
        }
        let mut xack = redis::cmd("XACK");
        xack.arg(&self.cfg.stream).arg(&self.cfg.group);
        let mut ids: HashSet<&str> = HashSet::with_capacity(done.len());
        for &i in done {
            if let Some(entry) = fetched.get(i)
                && ids.insert(entry.id.as_str())
            {
                xack.arg(&entry.id);
            }
        }
        if ids.is_empty() {
            return None;
        }
        let sent = ids.len();
        let (store, done, acked, off) = (
            store.clone(),
            done.to_vec(),
            Arc::clone(acked),
            Arc::clone(&self.riding_off),
        );
        // What the store answered for the `XACK`, if it carried it (not on
        // a cluster, nor with a key twice: the entries are acked as usual).
        let land = move |reply: Result<Value, idem_core::Error>| {
            let n = match reply {
                // The store's user may not XACK (ACLs): every batch would
                // pay a refused command.
                Ok(Value::ServerError(e)) if e.code() == "NOPERM" => Some(0),
                Ok(v) => redis::from_redis_value::<usize>(v).ok(),
                Err(_) => None,
            };
            match n {
                // All pending, all acked, after their results.
                Some(n) if n == sent => {
                    let mut acked = acked.lock().unwrap_or_else(PoisonError::into_inner);
                    for i in done {
                        if let Some(a) = acked.get_mut(i) {
                            *a = true;
                        }
                    }
                }
                Some(0) => {
                    off.store(true, Ordering::Relaxed);
                    tracing::info!(
                        "the idem store's Redis acked none of this stream's entries (another \
                         Redis, or a user without +xack): acks no longer ride with results for \
                         this consumer"
                    );
                }
                // Some acked elsewhere meanwhile, or the round trip failed:
                // all are acked again on their own (an XACK is idempotent).
                _ => {}
            }
        };
        Some(finish_round_trip(move |ops| {
            Box::pin(async move {
                let (replies, xacked) = store.finish_batch_then(ops, &xack).await;
                if let Some(reply) = xacked {
                    land(reply);
                }
                replies
            })
        }))
    }
}

impl RedisStreamsConsumer {
    /// Up to `count` new entries, waiting up to `wait` for them (not at
    /// all when zero).
    async fn read_new(
        &self,
        count: usize,
        wait: Duration,
    ) -> Result<Vec<StreamEntry>, ConsumerError> {
        let mut read = redis::cmd("XREADGROUP");
        read.arg("GROUP")
            .arg(&self.cfg.group)
            .arg(&self.cfg.consumer)
            .arg("COUNT")
            .arg(count);
        if !wait.is_zero() {
            // Whole milliseconds, rounded up: `BLOCK 0` would block forever.
            read.arg("BLOCK").arg(millis_ceil(wait));
        }
        read.arg("STREAMS").arg(&self.cfg.stream).arg(">");
        let reply: Option<StreamReadReply> = read
            .query_async(&mut self.reader.clone())
            .await
            .map_err(broker_err("fetch"))?;
        Ok(reply
            .map(|r| r.keys)
            .unwrap_or_default()
            .into_iter()
            .flat_map(|key| key.ids)
            .map(|sid| self.entry(sid, 1))
            .collect())
    }

    /// How long a read may block: until `deadline`, or until the earliest
    /// nacked entry comes due if that is sooner.
    fn read_wait(&self, deadline: Instant) -> Duration {
        let until = match self.scan().next_due() {
            Some(due) => due.min(deadline),
            None => deadline,
        };
        until.saturating_duration_since(Instant::now())
    }

    /// The idle time (ms) to preset on an entry nacked with `delay` so that
    /// `XAUTOCLAIM` (min idle `claim_idle`) takes it back after the delay,
    /// and how long after the reply to scan for it. Redis counts idle time
    /// in whole milliseconds of its own clock: the delay is rounded up and
    /// 1 ms added so that the entry never comes back early, and 1 ms more
    /// before the scan so that the scan does not come too early to find it.
    fn nack_idle(&self, delay: Duration) -> (u64, Duration) {
        let claim_idle = millis(self.cfg.claim_idle);
        let wait = millis_ceil(delay).saturating_add(1).min(claim_idle);
        (
            claim_idle - wait,
            Duration::from_millis(wait.saturating_add(1)),
        )
    }

    /// Adds a dead-letter record to the settle script: the entry's payload,
    /// the producer's id, the entry's id and idem's reason fields.
    fn add_dead_letter(
        &self,
        settle: &mut redis::ScriptInvocation<'_>,
        entry: &StreamEntry,
        reason: &DeadLetterReason,
    ) {
        let msg = entry.message.as_ref().ok();
        let fields = reason.fields(entry.deliveries);
        // The producer's trace context goes with the message.
        let trace: Vec<(&str, &str)> = TRACE_HEADERS
            .iter()
            .filter_map(|&name| Some((name, msg?.trace_header(name)?)))
            .collect();
        settle
            .arg("D")
            .arg(&entry.id)
            .arg(DEAD_LETTER_OWN_FIELDS + fields.len() + trace.len())
            .arg("payload")
            .arg(msg.map_or(&[][..], |m| &m.payload()[..]))
            .arg("id")
            .arg(msg.and_then(Message::id).unwrap_or(""))
            .arg("source_id")
            .arg(&entry.id);
        for (name, value) in fields {
            settle.arg(name).arg(value);
        }
        for (name, value) in trace {
            settle.arg(name).arg(value);
        }
    }

    /// The error for dead letters the script could not add (their entries
    /// stay pending), after logging each.
    fn dead_letters_failed(
        &self,
        failed: &[(String, String)],
        first: &(String, String),
    ) -> ConsumerError {
        for (id, error) in failed {
            tracing::error!(
                entry = %id,
                dead_letter_stream = %self.cfg.dead_letter,
                error = %error,
                "dead letter not written; the entry stays pending"
            );
        }
        let dead = &self.cfg.dead_letter;
        ConsumerError::broker(
            BROKER,
            "dead_letter",
            format!(
                "{} dead letter(s) could not be added to `{dead}` (entry {}: {}); those entries \
                 were not acked and come back after claim_idle ({} ms); make `{dead}` a stream \
                 (delete the key if it holds another type) or set StreamsConfig::dead_letter_stream",
                failed.len(),
                first.0,
                first.1,
                millis(self.cfg.claim_idle),
            ),
        )
    }
}

/// Fields of a dead letter besides idem's reason fields: `payload`, `id`,
/// `source_id`.
const DEAD_LETTER_OWN_FIELDS: usize = 3;

/// Settles one batch atomically; see `apply_batch`.
///
/// `KEYS[1]` the stream, `KEYS[2]` its dead-letter stream; `ARGV` the
/// group, the consumer, then one record per entry: `A id` (ack), `N id
/// idle_ms` (nack: re-claim with that idle time), `D id n f1 v1 … fn vn`
/// (dead letter of n fields, acked only once written). Records are checked
/// before the first write (Redis does not roll a script back). Replies
/// `{id, error}` for each dead letter not written.
const SETTLE_LUA: &str = r#"
local stream, dead = KEYS[1], KEYS[2]
local group, consumer = ARGV[1], ARGV[2]
local ops, i = {}, 3
while i <= #ARGV do
  local op, id = ARGV[i], ARGV[i + 1]
  if id == nil then
    return redis.error_reply('ERR idem-consumer settle: record without an id at argument ' .. i)
  end
  if op == 'A' then
    ops[#ops + 1] = {op, id}
    i = i + 2
  elseif op == 'N' and tonumber(ARGV[i + 2]) then
    ops[#ops + 1] = {op, id, ARGV[i + 2]}
    i = i + 3
  elseif op == 'D' and tonumber(ARGV[i + 2]) then
    local last = i + 2 + 2 * tonumber(ARGV[i + 2])
    if last <= i + 2 or last > #ARGV then
      return redis.error_reply('ERR idem-consumer settle: bad dead letter at argument ' .. i)
    end
    ops[#ops + 1] = {op, id, i + 3, last}
    i = last + 1
  else
    return redis.error_reply('ERR idem-consumer settle: bad record at argument ' .. i)
  end
end
local acks, failed = {}, {}
for _, o in ipairs(ops) do
  if o[1] == 'A' then
    acks[#acks + 1] = o[2]
  elseif o[1] == 'N' then
    redis.call('XCLAIM', stream, group, consumer, 0, o[2], 'IDLE', o[3], 'JUSTID')
  else
    local added = redis.pcall('XADD', dead, '*', unpack(ARGV, o[3], o[4]))
    if type(added) == 'table' and added.err then
      failed[#failed + 1] = {o[2], added.err}
    else
      acks[#acks + 1] = o[2]
    end
  end
end
-- unpack is bounded by Lua's stack: ack in slices.
for first = 1, #acks, 1000 do
  redis.call('XACK', stream, group, unpack(acks, first, math.min(first + 999, #acks)))
end
return failed
"#;

static SETTLE: LazyLock<Script> = LazyLock::new(|| Script::new(SETTLE_LUA));

/// Whole milliseconds, saturating.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Whole milliseconds, rounded up, saturating.
fn millis_ceil(d: Duration) -> u64 {
    u64::try_from(d.as_micros().div_ceil(1000)).unwrap_or(u64::MAX)
}

/// `XAUTOCLAIM` then `XREADGROUP`, `XACK`, nack by re-claiming with a preset
/// idle time, dead letters to a stream; in-flight entries re-claimed while
/// handlers run.
impl Adapter for RedisStreamsConsumer {
    type Delivery = StreamEntry;

    /// Fetches one batch: stale entries (idle over `claim_idle`, anyone's)
    /// first; new entries fill the rest of the batch. Waits up to the block
    /// time for new entries, or less when a nacked entry comes due first:
    /// then it scans for it and waits again for what is left of the block
    /// time.
    async fn fetch(&self) -> Result<Vec<StreamEntry>, ConsumerError> {
        let deadline = Instant::now() + self.cfg.block;
        loop {
            let mut entries = self.claim_stale().await?;
            if entries.len() < self.cfg.batch {
                // Never block with taken-over work in hand.
                let wait = if entries.is_empty() {
                    self.read_wait(deadline)
                } else {
                    Duration::ZERO
                };
                let fresh = self.read_new(self.cfg.batch - entries.len(), wait).await?;
                if entries.is_empty() {
                    // One `XREADGROUP` reply: each id once, in order.
                    entries = fresh;
                } else {
                    // Claimed and new entries are disjoint in Redis; a batch
                    // still never holds an entry id twice, so it is settled
                    // once.
                    let mut seen: HashSet<String> = entries.iter().map(|e| e.id.clone()).collect();
                    entries.extend(fresh.into_iter().filter(|e| seen.insert(e.id.clone())));
                }
            }
            if !entries.is_empty() || Instant::now() >= deadline {
                return Ok(entries);
            }
        }
    }

    fn message_of(&self, entry: &StreamEntry) -> Result<Message, ConsumerError> {
        entry.message.clone()
    }

    fn delivery_count(&self, entry: &StreamEntry) -> u32 {
        entry.deliveries
    }

    /// Handles the batch as every adapter does, but the acks of entries
    /// whose handlers succeeded ride in the round trip that stores their
    /// results, after them, when idem's store is a `RedisStore` on this
    /// same Redis (not a cluster): one round trip fewer per batch, and
    /// [`apply_batch`](Adapter::apply_batch) sends only what is left.
    /// Carried only when each such ack is confirmed; otherwise the entry is
    /// acked as usual. A store on another Redis acks nothing there, and
    /// riding stops for this consumer.
    async fn handle<C, T, E, H, Fut>(
        &self,
        consumer: &Consumer<C>,
        handler: &H,
        fetched: Vec<StreamEntry>,
    ) -> Vec<(StreamEntry, Decision)>
    where
        H: Fn(Message) -> Fut + Sync,
        Fut: Future<Output = Result<T, E>> + Send,
        T: Serialize + DeserializeOwned + Send + Sync,
        E: fmt::Display + Send,
        C: Classify<E>,
    {
        let acked = Arc::new(Mutex::new(vec![false; fetched.len()]));
        // Only through the `RedisStore` idem was built over: another store
        // has no round trip to share, and `apply_batch` acks every entry.
        let store = consumer.idem().store_as::<RedisStore>();
        let make = |done: &[usize], fetched: &[StreamEntry]| {
            self.ack_round_trip(store?, done, fetched, &acked)
        };
        let riding = store.is_some() && !self.riding_off.load(Ordering::Relaxed);
        let mut decided =
            handle_deliveries(self, consumer, handler, fetched, riding.then_some(&make)).await;
        let acked = acked.lock().unwrap_or_else(PoisonError::into_inner);
        for ((entry, decision), acked) in decided.iter_mut().zip(acked.iter()) {
            entry.acked = *acked && decision.is_ack();
        }
        decided
    }

    async fn apply(&self, entry: &StreamEntry, decision: &Decision) -> Result<(), ConsumerError> {
        self.apply_batch(std::slice::from_ref(&(entry.clone(), decision.clone())))
            .await
    }

    /// The whole batch in one atomic script (one round trip): one `XACK`
    /// for the acks, for each nack a re-claim with its idle time preset,
    /// for each dead letter an `XADD` to the dead-letter stream and, only
    /// if it succeeded, its `XACK`. An entry id that appears twice is
    /// settled once, with its first decision. Dead letters that could not
    /// be written leave their entries pending and make this return an
    /// error naming the stream to fix.
    async fn apply_batch(
        &self,
        decisions: &[(StreamEntry, Decision)],
    ) -> Result<(), ConsumerError> {
        if decisions.iter().all(|(e, d)| e.acked || d.is_ack()) {
            return self.ack_all(decisions).await;
        }
        let mut settle = SETTLE.prepare_invoke();
        settle
            .key(&self.cfg.stream)
            .key(&self.cfg.dead_letter)
            .arg(&self.cfg.group)
            .arg(&self.cfg.consumer);
        let mut seen = HashSet::new();
        let mut nack_waits = Vec::new();
        for (entry, decision) in decisions {
            if entry.acked && decision.is_ack() {
                seen.insert(entry.id.as_str());
                continue;
            }
            if !seen.insert(entry.id.as_str()) {
                tracing::debug!(entry = %entry.id, "entry twice in one batch: settled once, by its first decision");
                continue;
            }
            match decision {
                Decision::Ack => {
                    settle.arg("A").arg(&entry.id);
                }
                Decision::Nack { delay } => {
                    let (idle, wait) = self.nack_idle(*delay);
                    settle.arg("N").arg(&entry.id).arg(idle);
                    nack_waits.push(wait);
                }
                Decision::DeadLetter { reason } => {
                    self.add_dead_letter(&mut settle, entry, reason);
                }
            }
        }
        let failed: Vec<(String, String)> = settle
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(broker_err("apply"))?;
        let now = Instant::now();
        self.scan()
            .nacks_due
            .extend(nack_waits.into_iter().map(|w| now + w));
        match failed.first() {
            None => Ok(()),
            Some(first) => Err(self.dead_letters_failed(&failed, first)),
        }
    }

    /// A third of `claim_idle`, when [`StreamsConfig::keep_claimed`] is on.
    fn keep_alive_period(&self) -> Option<Duration> {
        self.cfg.keep_claimed.then_some(self.cfg.claim_idle / 3)
    }

    /// Re-claims the batch's entries (resetting their idle time) so that
    /// no other consumer's `XAUTOCLAIM` takes them while handlers run.
    /// `JUSTID` keeps their delivery counts.
    async fn keep_alive(&self, in_flight: &[StreamEntry]) {
        let ids: Vec<&str> = in_flight.iter().map(|e| e.id.as_str()).collect();
        self.touch(&ids).await;
    }

    /// A restarted Redis without persistence, or a deleted stream, lost the
    /// group: recreate it and poll again. Anything else: back off (the
    /// connections reconnect by themselves).
    async fn recover(&self, error: &ConsumerError) -> Recovery {
        if matches!(error, ConsumerError::Broker { reason, .. } if reason.contains("NOGROUP")) {
            match self.ensure_group().await {
                Ok(()) => return Recovery::Retry,
                Err(e) => tracing::warn!(error = %e, "could not recreate the consumer group"),
            }
        }
        Recovery::Backoff
    }
}
