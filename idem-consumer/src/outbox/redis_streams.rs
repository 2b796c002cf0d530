//! [`RedisStreamsSink`]: `XADD`s a batch in one pipelined round trip.

use super::{OutboxMessage, Sink, SinkError, for_all, own_name_refused};
use crate::error::ConsumerError;
use async_trait::async_trait;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, RedisResult, Value};
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

const BROKER: &str = "redis-streams";

/// The fields of an entry the sink writes itself (`topic` only on a
/// stream shared by topics, but a header never takes it: a consumer of
/// such a stream reads it).
const OWN_FIELDS: [&str; 4] = ["id", "payload", "key", "topic"];

/// Publishes outbox messages as stream entries: `XADD <topic> * id <id>
/// payload <payload> key <key>` (with `MAXLEN ~ n` when
/// [`max_len`](Self::max_len) is set; to another stream than the topic with
/// [`stream_for`](Self::stream_for)), the fields a
/// [`RedisStreamsConsumer`](crate::redis_streams::RedisStreamsConsumer)
/// reads by default, then one field per [header](OutboxMessage::headers),
/// named as the header (`… key <key> traceparent 00-…`). A header named
/// like one of the sink's fields (`id`, `payload`, `key`, `topic`) refuses
/// the message: the consumer would read it in place of that field, or the
/// field in place of it. A batch is one pipeline, one round trip; an entry is
/// confirmed once Redis answered its `XADD` (as durable as the server's
/// persistence settings make any write).
///
/// | what happened | result |
/// | --- | --- |
/// | `XADD` answered with an entry id | `Ok` |
/// | the stream's key holds another type (`WRONGTYPE`) | `Refused`, that message only |
/// | the ACL user may not write the key (`NOPERM`) | `Refused`, that message only |
/// | a header named `id`, `payload`, `key` or `topic` | `Refused`, that message only (nothing sent for it) |
/// | any other error reply (`OOM`, `READONLY`, `LOADING`…) | `Unavailable`, that message only |
/// | connection lost, no answer within [`timeout`](Self::timeout) | `Unavailable`, every message |
///
/// Any connection of redis-rs works (`ConnectionManager`, a cluster's
/// `ClusterConnection`…); [`connect`](Self::connect) opens an
/// auto-reconnecting `ConnectionManager`. A cluster takes a pipeline only
/// within one hash slot, so there a batch spanning topics of several slots
/// goes as one pipeline per stream, all sent at once.
///
/// ```no_run
/// use idem_consumer::outbox::RedisStreamsSink;
/// use idem_consumer::redis_streams::redis;
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let conn = redis::aio::ConnectionManager::new(redis::Client::open("redis://127.0.0.1/")?).await?;
/// let sink = RedisStreamsSink::new(conn).max_len(1_000_000);
/// # let _ = sink;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStreamsSink<C = ConnectionManager> {
    conn: C,
    /// The stream of a topic; `None`: the topic itself.
    stream: Option<StreamFor>,
    max_len: Option<usize>,
    timeout: Duration,
    describe: String,
}

/// A topic's stream name, as given to [`RedisStreamsSink::stream_for`].
type StreamFor = Arc<dyn Fn(&str) -> String + Send + Sync>;

impl<C> fmt::Debug for RedisStreamsSink<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStreamsSink")
            .field("describe", &self.describe)
            .field("stream_for", &self.stream.as_ref().map(|_| "<fn>"))
            .field("max_len", &self.max_len)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RedisStreamsSink<ConnectionManager> {
    /// Connects to the Redis at `url` with an auto-reconnecting connection
    /// (2 s to connect, 5 s per answer).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_consumer::ConsumerError> {
    /// let sink = idem_consumer::outbox::RedisStreamsSink::connect("redis://127.0.0.1/").await?;
    /// # let _ = sink;
    /// # Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, ConsumerError> {
        let client = redis::Client::open(url).map_err(|e| {
            ConsumerError::Config(format!(
                "`{url}` is not a Redis URL ({e}); write it as redis://[user:password@]host[:port][/db]"
            ))
        })?;
        let addr = client.get_connection_info().addr().to_string();
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(Duration::from_secs(5)))
            .set_connection_timeout(Some(Duration::from_secs(2)));
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(|e| {
                ConsumerError::broker(
                    BROKER,
                    "connect",
                    format!("{e} (is Redis running at {addr}?)"),
                )
            })?;
        let mut sink = RedisStreamsSink::new(conn);
        sink.describe = format!("{BROKER} {addr}");
        Ok(sink)
    }
}

impl<C> RedisStreamsSink<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Publishes through `conn` (cloned per batch, as redis-rs connections
    /// are meant to be). Defaults: no trimming, 10 s per batch.
    ///
    /// ```no_run
    /// use idem_consumer::outbox::RedisStreamsSink;
    /// use idem_consumer::redis_streams::redis;
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let cluster = redis::cluster::ClusterClient::new(vec!["redis://127.0.0.1:7000/"])?;
    /// let sink = RedisStreamsSink::new(cluster.get_async_connection().await?);
    /// # let _ = sink;
    /// # Ok(()) }
    /// ```
    pub fn new(conn: C) -> Self {
        RedisStreamsSink {
            conn,
            stream: None,
            max_len: None,
            timeout: Duration::from_secs(10),
            describe: BROKER.to_owned(),
        }
    }

    /// Trims each stream to about `n` entries as it adds one (`MAXLEN ~
    /// n`: whole macro nodes, so cheaply and never below `n`). Keep `n`
    /// well above what consumers may lag behind: a trimmed entry that was
    /// never read is lost to them.
    ///
    /// ```
    /// # fn demo(conn: idem_consumer::redis_streams::redis::aio::ConnectionManager) {
    /// let sink = idem_consumer::outbox::RedisStreamsSink::new(conn).max_len(100_000);
    /// # let _ = sink; }
    /// ```
    pub fn max_len(mut self, n: usize) -> Self {
        self.max_len = Some(n);
        self
    }

    /// How long a batch may wait for Redis's answers before every message
    /// of it is `Unavailable` (default 10 s). Entries may still have been
    /// written: the relay sends them again, under the same ids, and the
    /// consumer replays the copies.
    ///
    /// ```
    /// # fn demo(conn: idem_consumer::redis_streams::redis::aio::ConnectionManager) {
    /// use std::time::Duration;
    /// let sink = idem_consumer::outbox::RedisStreamsSink::new(conn).timeout(Duration::from_secs(2));
    /// # let _ = sink; }
    /// ```
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = d;
        self
    }

    /// Publishes each topic's messages to the stream `f(topic)` instead of
    /// the stream named after the topic: several topics into one stream
    /// (`|_| "events".into()`), a prefix (`|t| format!("shop:{t}")`), a
    /// rename. An entry whose stream is not its topic also carries the
    /// topic, in a field `topic` (`XADD <stream> * id … payload … key …
    /// topic …`), so that a consumer of a shared stream can tell them
    /// apart. `f` is called once per message of a batch: keep it cheap,
    /// and the same for every call (a topic's messages keep their order
    /// only within one stream).
    ///
    /// ```
    /// use idem_consumer::outbox::RedisStreamsSink;
    /// # fn demo(conn: idem_consumer::redis_streams::redis::aio::ConnectionManager) {
    /// // `orders.created` and `orders.paid` into the stream `orders`, the rest under `shop:`.
    /// let sink = RedisStreamsSink::new(conn).stream_for(|topic| match topic {
    ///     "orders.created" | "orders.paid" => "orders".to_owned(),
    ///     other => format!("shop:{other}"),
    /// });
    /// assert_eq!(sink.stream_of("orders.paid"), "orders");
    /// assert_eq!(sink.stream_of("refunds"), "shop:refunds");
    /// # }
    /// ```
    pub fn stream_for<F>(mut self, f: F) -> Self
    where
        F: Fn(&str) -> String + Send + Sync + 'static,
    {
        self.stream = Some(Arc::new(f));
        self
    }

    fn pipeline(&self, batch: &[&OutboxMessage]) -> redis::Pipeline {
        let mut pipe = redis::pipe();
        // Answers per command: one WRONGTYPE must not fail the others.
        pipe.ignore_errors();
        for m in batch {
            let stream = self.stream_of(&m.topic);
            let cmd = pipe.cmd("XADD").arg(stream.as_ref());
            if let Some(n) = self.max_len {
                cmd.arg("MAXLEN").arg("~").arg(n);
            }
            cmd.arg("*")
                .arg("id")
                .arg(&m.id)
                .arg("payload")
                .arg(m.payload.as_ref())
                .arg("key")
                .arg(&m.key);
            if stream != m.topic.as_str() {
                cmd.arg("topic").arg(&m.topic);
            }
            for (name, value) in &m.headers {
                cmd.arg(name).arg(value);
            }
        }
        pipe
    }

    /// What one `XADD`'s error reply means for its message.
    fn judge(&self, m: &OutboxMessage, e: RedisError) -> SinkError {
        let stream = self.stream_of(&m.topic);
        let of_topic = if stream == m.topic.as_str() {
            String::new()
        } else {
            format!(" (the stream of topic `{}`)", m.topic)
        };
        match e.code() {
            Some("WRONGTYPE") => SinkError::refused(format!(
                "the key `{stream}`{of_topic} holds another type than a stream (WRONGTYPE); \
                 delete or rename it, or publish the message to another topic"
            ))
            .with_source(e),
            Some("NOPERM") => SinkError::refused(format!(
                "the Redis user may not XADD to `{stream}`{of_topic} (NOPERM); grant it `+xadd` \
                 on the key (see docs/operating.md, Redis ACL)"
            ))
            .with_source(e),
            _ => SinkError::unavailable(format!("XADD to `{stream}`{of_topic} failed"))
                .with_source(e),
        }
    }
}

impl<C> RedisStreamsSink<C> {
    /// The stream a message of `topic` goes to: the topic itself, or what
    /// [`stream_for`](Self::stream_for) maps it to.
    ///
    /// ```
    /// # fn demo(conn: idem_consumer::redis_streams::redis::aio::ConnectionManager) {
    /// let sink = idem_consumer::outbox::RedisStreamsSink::new(conn);
    /// assert_eq!(sink.stream_of("orders.created"), "orders.created");
    /// # }
    /// ```
    pub fn stream_of<'t>(&self, topic: &'t str) -> Cow<'t, str> {
        match &self.stream {
            Some(f) => Cow::Owned(f(topic)),
            None => Cow::Borrowed(topic),
        }
    }
}

impl<C> RedisStreamsSink<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// `msgs`' results, in order: one pipeline, or one per stream on a
    /// cluster.
    async fn send_all(&self, msgs: &[&OutboxMessage]) -> Vec<Result<(), SinkError>> {
        if msgs.is_empty() {
            return Vec::new();
        }
        match self.query(msgs).await {
            // redis-rs refuses it before sending anything.
            Err(Failed::Error(e)) if e.code() == Some("CROSSSLOT") => self.per_stream(msgs).await,
            replies => self.answer(msgs, replies),
        }
    }
}

/// Why a pipeline has no answers.
enum Failed {
    Timeout,
    Error(RedisError),
}

impl<C> RedisStreamsSink<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    async fn query(&self, msgs: &[&OutboxMessage]) -> Result<Vec<RedisResult<Value>>, Failed> {
        let pipe = self.pipeline(msgs);
        let mut conn = self.conn.clone();
        match tokio::time::timeout(self.timeout, pipe.query_async(&mut conn)).await {
            Err(_) => Err(Failed::Timeout),
            Ok(r) => r.map_err(Failed::Error),
        }
    }

    /// One result per message from its pipeline's answers.
    fn answer(
        &self,
        msgs: &[&OutboxMessage],
        replies: Result<Vec<RedisResult<Value>>, Failed>,
    ) -> Vec<Result<(), SinkError>> {
        let replies = match replies {
            Err(Failed::Timeout) => {
                let why = format!("Redis did not answer within {:?}", self.timeout);
                tracing::warn!(sink = %self.describe, messages = msgs.len(), "{why}");
                return for_all(msgs.len(), false, &why, &"timed out");
            }
            Err(Failed::Error(e)) => {
                tracing::warn!(sink = %self.describe, messages = msgs.len(), error = %e, "XADD pipeline failed");
                return for_all(msgs.len(), false, "the XADD pipeline failed", &e);
            }
            Ok(r) => r,
        };
        if replies.len() != msgs.len() {
            let why = format!("{} answers to {} XADDs", replies.len(), msgs.len());
            return for_all(msgs.len(), false, &why, &"unexpected reply");
        }
        msgs.iter()
            .zip(replies)
            .map(|(m, r)| match r {
                Ok(_) => Ok(()),
                Err(e) => Err(self.judge(m, e)),
            })
            .collect()
    }

    /// A cluster takes a pipeline whose keys share one slot: one pipeline
    /// per stream, sent together, the answers put back in batch order.
    async fn per_stream(&self, batch: &[&OutboxMessage]) -> Vec<Result<(), SinkError>> {
        let mut groups: Vec<(Cow<'_, str>, Vec<usize>)> = Vec::new();
        for (i, m) in batch.iter().enumerate() {
            let stream = self.stream_of(&m.topic);
            match groups.iter_mut().find(|(s, _)| *s == stream) {
                Some((_, idx)) => idx.push(i),
                None => groups.push((stream, vec![i])),
            }
        }
        let answers = futures_util::future::join_all(groups.iter().map(|(_, idx)| async move {
            let msgs: Vec<&OutboxMessage> =
                idx.iter().filter_map(|&i| batch.get(i).copied()).collect();
            let replies = self.query(&msgs).await;
            self.answer(&msgs, replies)
        }))
        .await;
        let mut out: Vec<Option<Result<(), SinkError>>> = batch.iter().map(|_| None).collect();
        for ((_, idx), results) in groups.iter().zip(answers) {
            for (&i, r) in idx.iter().zip(results) {
                if let Some(slot) = out.get_mut(i) {
                    *slot = Some(r);
                }
            }
        }
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(SinkError::unavailable("no answer for the message"))))
            .collect()
    }
}

#[async_trait]
impl<C> Sink for RedisStreamsSink<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
        let refused: Vec<Option<SinkError>> = batch
            .iter()
            .map(|m| own_name_refused(m, &OWN_FIELDS).err())
            .collect();
        let sendable: Vec<&OutboxMessage> = batch
            .iter()
            .zip(&refused)
            .filter(|(_, r)| r.is_none())
            .map(|(m, _)| m)
            .collect();
        let mut sent = self.send_all(&sendable).await.into_iter();
        refused
            .into_iter()
            .map(|r| match r {
                Some(e) => Err(e),
                None => sent
                    .next()
                    .unwrap_or_else(|| Err(SinkError::unavailable("no answer for the message"))),
            })
            .collect()
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn system(&self) -> &'static str {
        "redis"
    }
}
