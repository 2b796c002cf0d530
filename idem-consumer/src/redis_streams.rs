//! Redis Streams adapter: a consumer group read with `XREADGROUP`, acked
//! with `XACK`, stale entries taken over with `XAUTOCLAIM`, failures moved
//! to a dead-letter stream.
//!
//! Redis has no "nack": an entry that is not acked stays in the group's
//! pending list and any consumer takes it with `XAUTOCLAIM` once it has been
//! idle for [`StreamsConfig::claim_idle`]. A nack with a delay therefore
//! re-claims the entry for ourselves with its idle time set so that it
//! becomes claimable after that delay (`XCLAIM … IDLE n JUSTID`, which does
//! not count as a delivery). While a handler runs, the owner re-claims its
//! in-flight entries every [`Consumer::keep_alive_period`](crate::Consumer::keep_alive_period) so nobody else's
//! `XAUTOCLAIM` takes them mid-run.
//!
//! Entries are hashes of fields: the payload is in one field (default
//! `payload`), the producer's id, when there is one, in another (default
//! `id`).
//!
//! ```no_run
//! use idem_consumer::redis_streams::{RedisStreamsConsumer, StreamsConfig};
//! use idem_consumer::{Adapter, Consumer, Message};
//! use idem_core::{Idempotency, RedisStore};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let idem = Idempotency::builder(RedisStore::connect("redis://127.0.0.1/").await?).build();
//! let consumer = Consumer::new(idem, "orders.charge").max_deliveries(5);
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

use crate::adapter::{Adapter, Recovery};
use crate::decision::Decision;
use crate::error::ConsumerError;
use crate::message::Message;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::streams::{StreamAutoClaimReply, StreamId, StreamPendingCountReply, StreamReadReply};
use redis::{RedisError, Value};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
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
    /// `id`, `source_id`, `reason`, `kind` and `deliveries`.
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
    /// with `XAUTOCLAIM` (default 30 s). Also the longest nack delay.
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
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct StreamEntry {
    /// The entry's id in the stream (`1700000000000-0`).
    pub id: String,
    /// The message, or why the entry is not one.
    pub message: Result<Message, ConsumerError>,
}

/// A consumer of one stream in one consumer group.
#[derive(Clone)]
pub struct RedisStreamsConsumer {
    /// Commands that answer at once: acks, claims, dead letters.
    conn: ConnectionManager,
    /// `XREADGROUP … BLOCK`: on its own connection, so a blocked read does
    /// not hold up acks behind it on a multiplexed pipeline.
    reader: ConnectionManager,
    cfg: Arc<StreamsConfig>,
    source: Arc<str>,
    /// Where the next `XAUTOCLAIM` scan of the pending list resumes, and
    /// when it may run: an entry only goes stale after `claim_idle`, so
    /// scanning on every poll would cost a round trip per batch for nothing.
    cursor: Arc<Mutex<(String, Option<Instant>)>>,
}

impl fmt::Debug for RedisStreamsConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStreamsConsumer")
            .field("config", &self.cfg)
            .finish_non_exhaustive()
    }
}

fn broker_err(op: &'static str) -> impl Fn(RedisError) -> ConsumerError {
    move |e| ConsumerError::broker(BROKER, op, e)
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
            cursor: Arc::new(Mutex::new(("0-0".into(), None))),
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
        let start = {
            let Ok(c) = self.cursor.lock() else {
                return Ok(Vec::new());
            };
            if c.1.is_some_and(|next| Instant::now() < next) {
                return Ok(Vec::new());
            }
            c.0.clone()
        };
        let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
            .arg(&self.cfg.stream)
            .arg(&self.cfg.group)
            .arg(&self.cfg.consumer)
            .arg(self.cfg.claim_idle.as_millis() as u64)
            .arg(&start)
            .arg("COUNT")
            .arg(self.cfg.batch)
            .query_async(&mut conn)
            .await
            .map_err(broker_err("claim"))?;
        if let Ok(mut c) = self.cursor.lock() {
            // A full page, or a scan that has not wrapped yet, may have more
            // stale entries: look again next poll. Else wait a while.
            let more = reply.claimed.len() >= self.cfg.batch || reply.next_stream_id != "0-0";
            let pause = (self.cfg.claim_idle / 4).min(Duration::from_secs(1));
            *c = (
                reply.next_stream_id.clone(),
                (!more).then(|| Instant::now() + pause),
            );
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

    fn entry(&self, sid: StreamId, deliveries: u32) -> StreamEntry {
        let message = self
            .parse_fields(&sid.map, deliveries)
            .map(|m| m.with_position(sid.id.clone()));
        StreamEntry {
            id: sid.id,
            message,
        }
    }

    fn parse_fields(
        &self,
        fields: &HashMap<String, Value>,
        deliveries: u32,
    ) -> Result<Message, ConsumerError> {
        let payload = match fields.get(&self.cfg.payload_field) {
            Some(Value::BulkString(b)) => b.clone(),
            Some(Value::SimpleString(s)) => s.clone().into_bytes(),
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
        match fields.get(&self.cfg.id_field) {
            None => {}
            Some(Value::BulkString(b)) => match String::from_utf8(b.clone()) {
                Ok(id) => msg = msg.with_id(id),
                Err(_) => {
                    msg = msg
                        .with_unreadable_id(format!("field `{}` is not UTF-8", self.cfg.id_field))
                }
            },
            Some(Value::SimpleString(s)) => msg = msg.with_id(s.clone()),
            Some(other) => {
                msg = msg.with_unreadable_id(format!(
                    "field `{}` is {other:?}, not a string",
                    self.cfg.id_field
                ))
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
}

/// `XAUTOCLAIM` then `XREADGROUP`, `XACK`, nack by re-claiming with a preset
/// idle time, dead letters to a stream; in-flight entries re-claimed while
/// handlers run.
impl Adapter for RedisStreamsConsumer {
    type Delivery = StreamEntry;

    /// Fetches one batch: stale entries (idle over `claim_idle`, anyone's)
    /// first; new entries fill the rest of the batch.
    async fn fetch(&self) -> Result<Vec<StreamEntry>, ConsumerError> {
        let mut entries = self.claim_stale().await?;
        if entries.len() < self.cfg.batch {
            let mut reader = self.reader.clone();
            let mut read = redis::cmd("XREADGROUP");
            read.arg("GROUP")
                .arg(&self.cfg.group)
                .arg(&self.cfg.consumer)
                .arg("COUNT")
                .arg(self.cfg.batch - entries.len());
            // Never block with taken-over work in hand.
            if entries.is_empty() {
                read.arg("BLOCK").arg(self.cfg.block.as_millis() as u64);
            }
            read.arg("STREAMS").arg(&self.cfg.stream).arg(">");
            let reply: Option<StreamReadReply> = read
                .query_async(&mut reader)
                .await
                .map_err(broker_err("fetch"))?;
            for key in reply.map(|r| r.keys).unwrap_or_default() {
                for sid in key.ids {
                    entries.push(self.entry(sid, 1));
                }
            }
        }
        Ok(entries)
    }

    fn message_of(&self, entry: &StreamEntry) -> Result<Message, ConsumerError> {
        entry.message.clone()
    }

    async fn apply(&self, entry: &StreamEntry, decision: &Decision) -> Result<(), ConsumerError> {
        self.apply_batch(std::slice::from_ref(&(entry.clone(), decision.clone())))
            .await
    }

    /// One `XACK` for all acks, for each nack a re-claim with its idle time
    /// preset, for each dead letter an `XADD` to the dead-letter stream then
    /// an `XACK`, in one atomic round trip.
    async fn apply_batch(
        &self,
        decisions: &[(StreamEntry, Decision)],
    ) -> Result<(), ConsumerError> {
        let mut conn = self.conn.clone();
        let mut pipe = redis::pipe();
        pipe.atomic();
        let acks: Vec<&str> = decisions
            .iter()
            .filter(|(_, d)| d.is_ack())
            .map(|(e, _)| e.id.as_str())
            .collect();
        if !acks.is_empty() {
            pipe.cmd("XACK")
                .arg(&self.cfg.stream)
                .arg(&self.cfg.group)
                .arg(&acks)
                .ignore();
        }
        for (entry, decision) in decisions {
            let id = &entry.id;
            let msg = entry.message.as_ref().ok();
            match decision {
                Decision::Ack => {}
                Decision::Nack { delay } => {
                    let idle = self.cfg.claim_idle.saturating_sub(*delay);
                    pipe.cmd("XCLAIM")
                        .arg(&self.cfg.stream)
                        .arg(&self.cfg.group)
                        .arg(&self.cfg.consumer)
                        .arg(0)
                        .arg(id)
                        .arg("IDLE")
                        .arg(idle.as_millis() as u64)
                        .arg("JUSTID")
                        .ignore();
                }
                Decision::DeadLetter { reason } => {
                    let payload = msg.map(|m| m.payload().to_vec()).unwrap_or_default();
                    let deliveries = msg.map_or(0, Message::delivery_count);
                    pipe.cmd("XADD")
                        .arg(&self.cfg.dead_letter)
                        .arg("*")
                        .arg("payload")
                        .arg(payload)
                        .arg("id")
                        .arg(msg.and_then(Message::id).unwrap_or(""))
                        .arg("source_id")
                        .arg(id)
                        .arg("reason")
                        .arg(reason.to_string())
                        .arg("kind")
                        .arg(reason.kind())
                        .arg("deliveries")
                        .arg(deliveries)
                        .ignore();
                    pipe.cmd("XACK")
                        .arg(&self.cfg.stream)
                        .arg(&self.cfg.group)
                        .arg(id)
                        .ignore();
                }
            }
        }
        let _: () = pipe
            .query_async(&mut conn)
            .await
            .map_err(broker_err("apply"))?;
        Ok(())
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
