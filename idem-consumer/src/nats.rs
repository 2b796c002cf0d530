//! NATS JetStream adapter: a pull consumer, `ack` / `nak` with delay /
//! `term`, progress acks while a handler runs, `Nats-Msg-Id` as key.
//!
//! You create the stream and the durable pull consumer with `async-nats`
//! (ack policy `explicit`, the default; leave `max_deliver` unlimited: idem
//! counts handler failures, [`Consumer::max_failures`](crate::Consumer::max_failures),
//! and deliveries itself) and hand it over. Dead letters must go to a
//! subject the consumer does not receive (see
//! [`NatsConfig::dead_letter_subject`]).
//! While handlers run, every in-flight message gets an `AckKind::Progress`
//! each [`Consumer::keep_alive_period`](crate::Consumer::keep_alive_period) (and at least three times per
//! `ack_wait`), so the server does not redeliver it to someone else.
//!
//! JetStream's own de-duplication drops a re-published `Nats-Msg-Id` within
//! the stream's duplicate window (2 minutes by default); idem covers what it
//! cannot: redeliveries after a crash, and re-publishes after the window.
//!
//! ```no_run
//! use async_nats::jetstream::{self, consumer::pull};
//! use idem_consumer::nats::{NatsConfig, NatsConsumer};
//! use idem_consumer::{Adapter, Consumer, Message};
//! use idem_core::Idempotency;
//! use idem_redis::RedisStore;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let js = jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
//! let stream = js.get_stream("ORDERS").await?; // capturing `ORDERS.>`
//! let config = pull::Config {
//!     durable_name: Some("billing".into()),
//!     filter_subject: "ORDERS.new".into(), // not the dead letters
//!     ..Default::default()
//! };
//! let pull = stream.get_or_create_consumer("billing", config).await?;
//! let idem = Idempotency::builder(RedisStore::connect("redis://127.0.0.1/").await?).build();
//! let consumer = Consumer::new(idem, "orders.charge");
//! let cfg = NatsConfig::new().dead_letter_subject("ORDERS.dead");
//! let nats = NatsConsumer::with_jetstream(&js, pull, cfg).await?;
//! let charge = |m: Message| async move { Ok::<_, std::io::Error>(m.payload().len()) };
//! nats.run(&consumer, &charge, std::future::pending::<()>()).await?;
//! # Ok(()) }
//! ```

/// The `async-nats` crate this adapter is built on, re-exported so your
/// connection and setup code uses the same version.
pub use async_nats;

use crate::adapter::Adapter;
use crate::decision::{DeadLetterReason, Decision};
use crate::error::ConsumerError;
use crate::message::Message;
use async_nats::HeaderMap;
use async_nats::header::HeaderName;
use async_nats::jetstream::consumer::pull::{self, Stream as PullStream};
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::context::GetStreamByNameErrorKind;
use async_nats::jetstream::stream::RetentionPolicy;
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

const BROKER: &str = "nats";

/// How long a pull request waits on the server: when it expires unanswered
/// the client sends a new one, which bounds how long a lost one can stall
/// the consumer ([`NatsConfig::idle_heartbeat`]).
const PULL_EXPIRES: Duration = Duration::from_secs(10);

/// How to consume.
///
/// ```
/// use idem_consumer::nats::NatsConfig;
/// let cfg = NatsConfig::new().batch(64).dead_letter_subject("ORDERS.dead");
/// ```
#[derive(Debug, Clone)]
pub struct NatsConfig {
    batch: usize,
    block: Duration,
    dead_letter_subject: Option<String>,
    progress: bool,
    id_header: String,
    idle_heartbeat: Option<Duration>,
}

impl Default for NatsConfig {
    fn default() -> Self {
        NatsConfig::new()
    }
}

impl NatsConfig {
    /// Defaults: batches of 32, wait up to 1 s for messages, no dead-letter
    /// subject (dead letters are only terminated), progress acks on, keys
    /// from the `Nats-Msg-Id` header, no idle heartbeats.
    pub fn new() -> NatsConfig {
        NatsConfig {
            batch: 32,
            block: Duration::from_secs(1),
            dead_letter_subject: None,
            progress: true,
            id_header: "Nats-Msg-Id".into(),
            idle_heartbeat: None,
        }
    }

    /// Messages pulled and handled at once (default 32, at least 1). Also
    /// the most the client buffers: a buffered message's `ack_wait` runs.
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.max(1);
        self
    }

    /// How long a poll waits for a first message (default 1 s).
    pub fn block(mut self, d: Duration) -> Self {
        self.block = d;
        self
    }

    /// Publish dead letters to this subject (through JetStream: a stream
    /// must capture it) before terminating them. Headers: the fields of
    /// [`DeadLetterReason::fields`] (`idem-reason`, `idem-kind`,
    /// `idem-deliveries`, `idem-failures`, names in
    /// [`dead_letter_field`](crate::dead_letter_field)), the original
    /// `Nats-Msg-Id` as `Idem-Original-Id`, `stream/consumer` as
    /// `Idem-Source`, and the original's `traceparent` and `tracestate`.
    ///
    /// The subject must be one the consumer does not receive itself
    /// (outside its `filter_subject`, or in another stream):
    /// [`NatsConsumer::new`] refuses it otherwise, since each dead letter
    /// would come back as a new message and be dead-lettered again. Inside
    /// the consumer's own stream but outside its filter is fine: the stream's
    /// limits (`max_age`, `max_msgs`) then apply to dead letters too, and
    /// any unfiltered consumer of that stream sees them.
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = Some(subject.into());
        self
    }

    /// Send progress acks while handlers run (default on). Off, a handler
    /// slower than `ack_wait` sees its message redelivered, and the
    /// redelivery gets `InProgress` from idem and is nacked.
    pub fn progress(mut self, on: bool) -> Self {
        self.progress = on;
        self
    }

    /// The header holding the producer's id (default `Nats-Msg-Id`).
    pub fn id_header(mut self, name: impl Into<String>) -> Self {
        self.id_header = name.into();
        self
    }

    /// Asks the server for a heartbeat every `every` while the pull
    /// subscription waits with nothing to deliver (default: none). Two
    /// missed in a row fail the poll, and the next one opens a fresh
    /// subscription: a pull request lost while the connection stayed up
    /// is noticed within two heartbeats. Without them the client re-sends
    /// its pull request when the last one expires (after 10 s, or two
    /// heartbeats if longer, plus 5 s) and after every reconnect, so a
    /// consumer never stalls for longer.
    ///
    /// Not free: with heartbeats on, the client arms a new timer for every
    /// message it receives, 5–18 % of the consumer thread's work per
    /// message in `cargo bench -p idem-consumer --bench consumer -- nats`.
    ///
    /// ```
    /// use idem_consumer::nats::NatsConfig;
    /// use std::time::Duration;
    /// let cfg = NatsConfig::new().idle_heartbeat(Some(Duration::from_secs(5)));
    /// ```
    pub fn idle_heartbeat(mut self, every: Option<Duration>) -> Self {
        self.idle_heartbeat = every;
        self
    }

    /// The server refuses a heartbeat longer than half the pull request's
    /// expiry.
    fn pull_expires(&self) -> Duration {
        PULL_EXPIRES.max(self.idle_heartbeat.unwrap_or_default().saturating_mul(2))
    }
}

/// A JetStream pull consumer run through idem.
///
/// ```no_run
/// use idem_consumer::nats::async_nats::jetstream::consumer::PullConsumer;
/// use idem_consumer::nats::{NatsConfig, NatsConsumer};
/// use idem_consumer::{Adapter, Consumer, ConsumerError, Message};
/// use idem_core::Idempotency;
///
/// # async fn demo(pull: PullConsumer, idem: Idempotency) -> Result<(), ConsumerError> {
/// let consumer = Consumer::new(idem, "orders.charge");
/// let nats = NatsConsumer::new(pull, NatsConfig::new().batch(64)).await?;
/// let charge = |m: Message| async move { Ok::<_, std::io::Error>(m.payload().len()) };
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// nats.run(&consumer, &charge, stopped).await?; // `stop.send(())` drains and returns
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct NatsConsumer {
    consumer: PullConsumer,
    /// The pull subscription, opened on first use and reopened after an error.
    messages: Arc<Mutex<Option<PullStream>>>,
    cfg: Arc<NatsConfig>,
    ack_wait: Duration,
    source: Arc<str>,
    /// Parsed once: a well-known name (`Nats-Msg-Id`) only matches the
    /// headers of received messages in its parsed form.
    id_header: HeaderName,
}

impl fmt::Debug for NatsConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsConsumer")
            .field("source", &self.source)
            .field("config", &self.cfg)
            .field("ack_wait", &self.ack_wait)
            .finish_non_exhaustive()
    }
}

impl NatsConsumer {
    /// Wraps a pull consumer. Fails with [`ConsumerError::Config`] unless
    /// its ack policy is `explicit`, and when the dead-letter subject is one
    /// the consumer would receive itself (it matches the consumer's
    /// `filter_subject(s)`): every dead letter would come back as a new
    /// message, forever.
    ///
    /// Without a JetStream context this cannot see the stream's subjects,
    /// so a consumer **without a filter** and with a dead-letter subject is
    /// refused too: set `filter_subject`, or build it with
    /// [`with_jetstream`](NatsConsumer::with_jetstream), which reads them.
    pub async fn new(consumer: PullConsumer, cfg: NatsConfig) -> Result<Self, ConsumerError> {
        NatsConsumer::build(None, consumer, cfg).await
    }

    /// [`new`](NatsConsumer::new), checking the dead-letter subject against
    /// the streams themselves: refused when the consumer's own stream
    /// captures it and the consumer's filter (or, without one, the stream)
    /// lets it through, and when no stream captures it at all (every dead
    /// letter would fail to publish and its message be nacked again and
    /// again). A dead-letter subject in the consumer's own stream but
    /// outside its filter is accepted (read dead letters with a consumer
    /// filtered on it); a warning is logged when the stream keeping dead
    /// letters has `Interest` retention, which drops a dead letter that no
    /// consumer's filter covers when it is published.
    ///
    /// ```no_run
    /// use idem_consumer::nats::{NatsConfig, NatsConsumer, async_nats, pull_config};
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let js = async_nats::jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
    /// let mut config = pull_config("billing", std::time::Duration::from_secs(30));
    /// config.filter_subject = "ORDERS.new".into(); // not ORDERS.dead
    /// let pull = js.get_stream("ORDERS").await?.get_or_create_consumer("billing", config).await?;
    /// let cfg = NatsConfig::new().dead_letter_subject("ORDERS.dead");
    /// let nats = NatsConsumer::with_jetstream(&js, pull, cfg).await?;
    /// # Ok(()) }
    /// ```
    pub async fn with_jetstream(
        js: &jetstream::Context,
        consumer: PullConsumer,
        cfg: NatsConfig,
    ) -> Result<Self, ConsumerError> {
        NatsConsumer::build(Some(js), consumer, cfg).await
    }

    async fn build(
        js: Option<&jetstream::Context>,
        mut consumer: PullConsumer,
        cfg: NatsConfig,
    ) -> Result<Self, ConsumerError> {
        let info = consumer
            .info()
            .await
            .map_err(|e| ConsumerError::broker_error(BROKER, "consumer_info", e))?
            .clone();
        if info.config.ack_policy != AckPolicy::Explicit {
            return Err(ConsumerError::Config(format!(
                "JetStream consumer `{}` must use AckPolicy::Explicit: with another policy \
                 a failed message cannot be redelivered alone",
                info.name
            )));
        }
        if let Some(subject) = &cfg.dead_letter_subject {
            let on = Receiver {
                consumer: &info.name,
                stream: &info.stream_name,
                filters: filters_of(&info.config),
            };
            match js {
                Some(js) => check_dead_letters_on_streams(js, &on, subject).await?,
                None => {
                    check_dead_letter_subject(&on, subject, None)?;
                }
            }
        }
        let ack_wait = if info.config.ack_wait.is_zero() {
            Duration::from_secs(30)
        } else {
            info.config.ack_wait
        };
        let source: Arc<str> = Arc::from(format!("{}/{}", info.stream_name, info.name).as_str());
        let id_header: HeaderName = cfg.id_header.parse().map_err(|e| {
            ConsumerError::Config(format!("`{}` is not a header name: {e}", cfg.id_header))
        })?;
        Ok(NatsConsumer {
            consumer,
            messages: Arc::new(Mutex::new(None)),
            cfg: Arc::new(cfg),
            ack_wait,
            source,
            id_header,
        })
    }

    /// The server's `ack_wait` for this consumer.
    pub fn ack_wait(&self) -> Duration {
        self.ack_wait
    }

    async fn dead_letter(
        &self,
        m: &jetstream::Message,
        reason: &DeadLetterReason,
        deliveries: u32,
    ) -> Result<(), ConsumerError> {
        let Some(subject) = &self.cfg.dead_letter_subject else {
            return Ok(());
        };
        let mut headers = HeaderMap::new();
        if let Some(id) = m
            .headers
            .as_ref()
            .and_then(|h| h.get(self.id_header.clone()))
        {
            headers.insert("Idem-Original-Id", id.as_str());
        }
        // The producer's trace context goes with the message, as the other
        // brokers' dead letters keep every header.
        for name in idem_core::outbox::TRACE_HEADERS {
            if let Some(value) = m.headers.as_ref().and_then(|h| h.get(name)) {
                headers.insert(name, value.as_str());
            }
        }
        for (name, value) in reason.fields(deliveries) {
            headers.insert(name, value.as_str());
        }
        headers.insert("Idem-Source", &*self.source);
        let ack = m
            .context
            .publish_with_headers(subject.clone(), headers, m.payload.clone())
            .await
            .map_err(|e| ConsumerError::broker_error(BROKER, "dead_letter", e))?;
        ack.await
            .map_err(|e| ConsumerError::broker_error(BROKER, "dead_letter", e))?;
        Ok(())
    }
}

/// A JetStream consumer, as far as the subjects it receives go.
struct Receiver<'a> {
    consumer: &'a str,
    stream: &'a str,
    /// `filter_subject` and `filter_subjects`; empty: the whole stream.
    filters: Vec<String>,
}

fn filters_of(config: &jetstream::consumer::Config) -> Vec<String> {
    let mut filters = config.filter_subjects.clone();
    if !config.filter_subject.is_empty() {
        filters.push(config.filter_subject.clone());
    }
    filters
}

/// Refuses a dead-letter subject that `on` would receive itself, judged
/// from its filters and, when known, its stream's subjects. Returns
/// whether the consumer's own stream captures the subject (`None`:
/// unknown).
fn check_dead_letter_subject(
    on: &Receiver<'_>,
    dead: &str,
    stream_subjects: Option<&[String]>,
) -> Result<Option<bool>, ConsumerError> {
    if let Some(why) = unpublishable(dead) {
        return Err(ConsumerError::Config(format!(
            "dead-letter subject `{dead}` cannot be published to: {why}; give a plain \
             subject such as `ORDERS.dead`"
        )));
    }
    let in_stream =
        stream_subjects.map(|subjects| subjects.iter().find(|p| subject_matches(p, dead)).cloned());
    let filter = on.filters.iter().find(|f| subject_matches(f, dead));
    let loops = match (&in_stream, filter) {
        // Another stream keeps it: the consumer never sees it.
        (Some(None), _) => None,
        (_, Some(f)) => Some(format!("it matches the consumer's filter `{f}`")),
        (Some(Some(p)), None) if on.filters.is_empty() => Some(format!(
            "the consumer has no filter and its stream captures `{p}`"
        )),
        (Some(Some(_)), None) => None,
        (None, None) if on.filters.is_empty() => {
            return Err(ConsumerError::Config(format!(
                "JetStream consumer `{}` has no filter_subject, so it receives everything \
                 stream `{}` captures, and without the stream's subjects the dead-letter \
                 subject `{dead}` cannot be checked: set the consumer's filter_subject to \
                 what it should handle (e.g. `ORDERS.new`), or build it with \
                 `NatsConsumer::with_jetstream`, which reads the stream's subjects",
                on.consumer, on.stream
            )));
        }
        (None, None) => None,
    };
    match loops {
        Some(why) => Err(ConsumerError::Config(format!(
            "dead-letter subject `{dead}` would be delivered to JetStream consumer `{}` of \
             stream `{}` itself ({why}): every dead letter would come back as a new message \
             and be dead-lettered again, forever. Set the consumer's filter_subject to the \
             subjects it should handle (e.g. `ORDERS.new`, leaving `ORDERS.dead` out), or \
             publish dead letters to a subject of another stream",
            on.consumer, on.stream
        ))),
        None => Ok(in_stream.map(|p| p.is_some())),
    }
}

/// [`check_dead_letter_subject`] with the stream's subjects, then: some
/// stream must capture the subject, and one with `Interest` retention
/// may drop dead letters (warned).
async fn check_dead_letters_on_streams(
    js: &jetstream::Context,
    on: &Receiver<'_>,
    dead: &str,
) -> Result<(), ConsumerError> {
    let own = js
        .get_stream(on.stream)
        .await
        .map_err(|e| ConsumerError::broker_error(BROKER, "stream_info", e))?;
    let own = own.cached_info();
    let in_own = check_dead_letter_subject(on, dead, Some(&own.config.subjects))?;
    let (keeper, retention) = if in_own == Some(true) {
        (own.config.name.clone(), own.config.retention)
    } else {
        let name = match js.stream_by_subject(dead).await {
            Ok(name) => name,
            Err(e) if e.kind() == GetStreamByNameErrorKind::NotFound => {
                return Err(ConsumerError::Config(format!(
                    "no JetStream stream captures the dead-letter subject `{dead}`: every dead \
                     letter would fail to publish and its message be nacked again and again; \
                     create a stream with `{dead}` among its subjects (or add it to stream `{}`, \
                     outside consumer `{}`'s filter)",
                    on.stream, on.consumer
                )));
            }
            Err(e) => return Err(ConsumerError::broker_error(BROKER, "stream_by_subject", e)),
        };
        let keeper = js
            .get_stream(&name)
            .await
            .map_err(|e| ConsumerError::broker_error(BROKER, "stream_info", e))?;
        (name, keeper.cached_info().config.retention)
    };
    if retention == RetentionPolicy::Interest {
        tracing::warn!(
            subject = dead,
            stream = %keeper,
            "dead letters go to a stream with Interest retention: one published while no \
             consumer's filter covers `{dead}` is dropped at once; create that consumer first, \
             or keep dead letters in a stream with Limits retention"
        );
    }
    Ok(())
}

/// Why `subject` cannot be published to (`None`: it can): empty, blank,
/// an empty token, or a wildcard token.
fn unpublishable(subject: &str) -> Option<&'static str> {
    if subject.is_empty() {
        return Some("it is empty");
    }
    if subject.chars().any(char::is_whitespace) {
        return Some("it contains whitespace");
    }
    let mut tokens = subject.split('.');
    if tokens.clone().any(str::is_empty) {
        return Some("it has an empty token (a leading, trailing or double `.`)");
    }
    tokens
        .any(|t| t == "*" || t == ">")
        .then_some("it has a wildcard token (`*` or `>`)")
}

/// Whether the subject `subject` matches `pattern`, with NATS wildcards:
/// `*` stands for exactly one token, `>` (last) for one or more.
fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut pattern = pattern.split('.');
    let mut subject = subject.split('.');
    loop {
        match (pattern.next(), subject.next()) {
            (Some(">"), Some(_)) => return pattern.next().is_none(),
            (Some("*"), Some(_)) => {}
            (Some(p), Some(s)) if p == s => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// A delivery's stream sequence and delivery count, when readable.
fn sequence_of(m: &jetstream::Message) -> Option<(u64, u32)> {
    m.info().ok().map(|info| {
        let delivered = u32::try_from(info.delivered).unwrap_or(u32::MAX);
        (info.stream_sequence, delivered.max(1))
    })
}

/// For each stream message of a batch, which delivery to settle (the
/// latest: the server tracks that one) and whose decision (the first:
/// the delivery that was handled; later ones are its copies). A delivery
/// without readable info settles alone.
fn once_per_sequence(sequences: &[Option<(u64, u32)>]) -> Vec<(usize, usize)> {
    let mut slot_of: HashMap<u64, usize> = HashMap::new();
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(sequences.len());
    for (i, seq) in sequences.iter().enumerate() {
        let Some((sequence, delivered)) = *seq else {
            out.push((i, i));
            continue;
        };
        match slot_of.get(&sequence) {
            Some(&slot) => {
                let latest = out[slot].0;
                if sequences[latest].is_some_and(|(_, d)| d < delivered) {
                    out[slot].0 = i;
                }
            }
            None => {
                slot_of.insert(sequence, out.len());
                out.push((i, i));
            }
        }
    }
    out
}

/// A JetStream message as the adapter fetched it: the message, and its
/// stream sequence and delivery count, read from its ack subject once
/// (the handling, the settling and the batch's report each need them).
/// Dereferences to the [`jetstream::Message`].
///
/// ```no_run
/// use idem_consumer::Adapter;
/// # async fn demo(nats: idem_consumer::nats::NatsConsumer) -> Result<(), idem_consumer::ConsumerError> {
/// for d in nats.fetch().await? {
///     let subject = &d.subject; // the jetstream::Message's fields
///     let sequence = d.stream_sequence();
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct NatsDelivery {
    message: jetstream::Message,
    /// Stream sequence and delivery count (at least 1); `None` when the
    /// ack subject could not be read.
    sequence: Option<(u64, u32)>,
}

impl NatsDelivery {
    /// The message's sequence in its stream, when its ack subject is
    /// readable.
    pub fn stream_sequence(&self) -> Option<u64> {
        self.sequence.map(|(sequence, _)| sequence)
    }

    /// How many times the server has delivered it (1 when unreadable).
    pub fn delivered(&self) -> u32 {
        self.sequence.map_or(1, |(_, delivered)| delivered)
    }

    /// The message itself.
    pub fn into_message(self) -> jetstream::Message {
        self.message
    }
}

/// A message fetched by other means (your own pull, a test), to hand to
/// the adapter's `handle` or `settle`: its ack subject is read here.
impl From<jetstream::Message> for NatsDelivery {
    fn from(message: jetstream::Message) -> NatsDelivery {
        let sequence = sequence_of(&message);
        NatsDelivery { message, sequence }
    }
}

impl std::ops::Deref for NatsDelivery {
    type Target = jetstream::Message;

    fn deref(&self) -> &jetstream::Message {
        &self.message
    }
}

/// Pull, `ack` / `nak` with delay / dead-letter subject and `term`, progress
/// acks while handlers run.
impl Adapter for NatsConsumer {
    type Delivery = NatsDelivery;

    /// Waits up to the configured block time for messages and returns those
    /// ready, at most a batch.
    async fn fetch(&self) -> Result<Vec<NatsDelivery>, ConsumerError> {
        let mut guard = self.messages.lock().await;
        if guard.is_none() {
            let stream = self
                .consumer
                .stream()
                .max_messages_per_batch(self.cfg.batch)
                .heartbeat(self.cfg.idle_heartbeat.unwrap_or_default())
                .expires(self.cfg.pull_expires())
                .messages()
                .await
                .map_err(|e| ConsumerError::broker_error(BROKER, "subscribe", e))?;
            *guard = Some(stream);
        }
        let Some(stream) = guard.as_mut() else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        // A message already buffered is taken without arming a timer (a
        // new timer wakes the runtime's driver thread).
        let first = match futures_util::FutureExt::now_or_never(stream.next()) {
            Some(item) => Ok(item),
            None => tokio::time::timeout(self.cfg.block, stream.next()).await,
        };
        let mut next = match first {
            Err(_) | Ok(None) => return Ok(out),
            Ok(Some(item)) => Some(item),
        };
        while let Some(item) = next.take() {
            match item {
                Ok(m) => out.push(NatsDelivery::from(m)),
                Err(e) => {
                    // Missed heartbeats and similar: drop the subscription so
                    // the next fetch opens a fresh one; keep what we have.
                    *guard = None;
                    if out.is_empty() {
                        return Err(ConsumerError::broker_error(BROKER, "fetch", e));
                    }
                    tracing::warn!(error = %e, "pull subscription failed; reopening");
                    return Ok(out);
                }
            }
            if out.len() >= self.cfg.batch {
                break;
            }
            // Take what is already buffered, without waiting for more.
            next = futures_util::FutureExt::now_or_never(stream.next()).flatten();
        }
        Ok(out)
    }

    /// Payload, `Nats-Msg-Id` (or the configured header) as id, delivery
    /// count from the JetStream metadata; with `otel`, the producer's trace
    /// context from `traceparent` and `tracestate`.
    fn message_of(&self, m: &NatsDelivery) -> Result<Message, ConsumerError> {
        if m.sequence.is_none() {
            tracing::warn!("JetStream message without readable delivery info");
        }
        let mut msg = Message::new(m.payload.clone())
            .with_delivery_count(m.delivered())
            .with_source(BROKER, self.source.clone());
        if let Some(sequence) = m.stream_sequence() {
            msg = msg.at_position(Arc::from(itoa::Buffer::new().format(sequence)));
        }
        if let Some(id) = m
            .headers
            .as_ref()
            .and_then(|h| h.get(self.id_header.clone()))
        {
            msg = msg.with_id(id.as_str());
        }
        // By exact name: NATS header names are case-sensitive, and a
        // `Traceparent` is not the W3C header idem's sinks write. Parsed,
        // as received names are (a well-known name only matches so). The
        // last value of a repeated one, as on every other broker.
        #[cfg(feature = "otel")]
        if let Some(headers) = m.headers.as_ref() {
            msg = crate::otel::with_trace_headers(msg, |name| {
                let name: HeaderName = name.parse().ok()?;
                headers.get_last(name).map(|v| v.as_str().to_owned())
            });
        }
        Ok(msg)
    }

    /// From the JetStream metadata alone (1 without it).
    fn delivery_count(&self, m: &NatsDelivery) -> u32 {
        m.delivered()
    }

    /// `ack`, `nak` with the delay, or publish to the dead-letter subject
    /// and `term`. A dead letter that cannot be published is nacked for an
    /// `ack_wait` instead (never lost) and its error returned.
    async fn apply(&self, m: &NatsDelivery, decision: &Decision) -> Result<(), ConsumerError> {
        let sent = match decision {
            Decision::Ack => m.ack().await,
            Decision::Nack { delay } => m.ack_with(AckKind::Nak(Some(*delay))).await,
            Decision::DeadLetter { reason } => {
                match self.dead_letter(m, reason, m.delivered()).await {
                    Ok(()) => m.ack_with(AckKind::Term).await,
                    Err(e) => {
                        tracing::error!(error = %e, "dead letter not published; nacking instead");
                        if let Err(nak) = m.ack_with(AckKind::Nak(Some(self.ack_wait))).await {
                            tracing::warn!(error = %nak, "nack after a failed dead letter failed too");
                        }
                        return Err(e);
                    }
                }
            }
        };
        sent.map_err(|e| ConsumerError::Broker {
            broker: BROKER,
            op: "ack",
            reason: e.to_string(),
            source: Some(e.into()),
        })
    }

    /// Settles each stream message once: two deliveries of one stream
    /// sequence in a batch (a redelivery after `ack_wait` fetched beside
    /// the first) get one ack, nak or dead letter, with the decision of
    /// the delivery that was handled (the first; the core gives a later
    /// copy that decision too) sent on the latest delivery. Acking one
    /// and nacking the other would let the ack remove a message whose
    /// handler failed, and a dead letter per delivery would duplicate it.
    async fn apply_batch(&self, decided: &[(NatsDelivery, Decision)]) -> Result<(), ConsumerError> {
        let sequences: Vec<_> = decided.iter().map(|(m, _)| m.sequence).collect();
        let once = once_per_sequence(&sequences);
        if once.len() < decided.len() {
            tracing::debug!(
                deliveries = decided.len(),
                messages = once.len(),
                "several deliveries of one stream message in a batch: settled once"
            );
        }
        let mut failed: Option<ConsumerError> = None;
        let mut dead_letters = Vec::new();
        for (m, decision) in once
            .iter()
            .filter_map(|&(m, d)| Some((&decided.get(m)?.0, &decided.get(d)?.1)))
        {
            if matches!(decision, Decision::DeadLetter { .. }) {
                dead_letters.push((m, decision));
                continue;
            }
            // An ack or a nak is a publish the client buffers, no reply
            // awaited: sent in turn, without a future per message (joined,
            // each would be a task of its own to allocate and poll).
            if let Err(e) = self.apply(m, decision).await {
                failed.get_or_insert(e);
            }
        }
        // A dead letter waits for JetStream's publish ack: together.
        let dead =
            futures_util::future::join_all(dead_letters.into_iter().map(|(m, d)| self.apply(m, d)));
        for sent in dead.await {
            if let Err(e) = sent {
                failed.get_or_insert(e);
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Progress acks at least three times per `ack_wait`, when enabled.
    fn keep_alive_period(&self) -> Option<Duration> {
        self.cfg.progress.then_some(self.ack_wait / 3)
    }

    /// An `AckKind::Progress` for every message of the batch.
    async fn keep_alive(&self, in_flight: &[NatsDelivery]) {
        for m in in_flight {
            if let Err(e) = m.ack_with(AckKind::Progress).await {
                tracing::warn!(error = %e, "progress ack failed");
            }
        }
    }
}

/// A durable pull consumer configuration suited to this adapter: explicit
/// acks, unlimited server-side deliveries (the [`Consumer`](crate::Consumer) counts them),
/// the given `ack_wait`. Set its `filter_subject` to what the consumer
/// handles when dead letters go to the same stream.
///
/// ```
/// let cfg = idem_consumer::nats::pull_config("billing", std::time::Duration::from_secs(30));
/// assert_eq!(cfg.durable_name.as_deref(), Some("billing"));
/// ```
pub fn pull_config(durable: &str, ack_wait: Duration) -> pull::Config {
    pull::Config {
        durable_name: Some(durable.to_owned()),
        ack_policy: AckPolicy::Explicit,
        ack_wait,
        max_deliver: -1,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_match_literally_and_with_wildcards() {
        for (pattern, subject, expected) in [
            ("ORDERS.dead", "ORDERS.dead", true),
            ("ORDERS.dead", "ORDERS.deadx", false),
            ("ORDERS.dead", "ORDERS", false),
            ("ORDERS", "ORDERS.dead", false),
            ("ORDERS.*", "ORDERS.dead", true),
            ("ORDERS.*", "ORDERS.dead.eu", false),
            ("ORDERS.*", "ORDERS", false),
            ("*.dead", "ORDERS.dead", true),
            ("*.*.eu", "ORDERS.dead.eu", true),
            ("ORDERS.>", "ORDERS.dead", true),
            ("ORDERS.>", "ORDERS.dead.eu", true),
            ("ORDERS.>", "ORDERS", false),
            (">", "ORDERS", true),
            (">", "ORDERS.dead", true),
            ("*.>", "ORDERS", false),
            ("*.>", "ORDERS.dead", true),
            ("ORDERS.*.>", "ORDERS.dead", false),
            ("ORDERS.*.>", "ORDERS.dead.eu", true),
            // `>` only counts as the last token; a partial one is literal.
            ("ORDERS.>.eu", "ORDERS.dead.eu", false),
            ("ORD*", "ORDERS", false),
            ("ORD*", "ORD*", true),
        ] {
            assert_eq!(
                subject_matches(pattern, subject),
                expected,
                "{pattern} ~ {subject}"
            );
        }
    }

    #[test]
    fn only_plain_subjects_can_take_dead_letters() {
        assert_eq!(unpublishable("ORDERS.dead"), None);
        assert_eq!(unpublishable("dead"), None);
        for bad in [
            "",
            "ORDERS.*",
            "ORDERS.>",
            ">",
            "ORDERS..dead",
            ".dead",
            "ORDERS.",
            "a b",
        ] {
            assert!(unpublishable(bad).is_some(), "{bad:?}");
        }
    }

    fn on(filters: &[&str]) -> Receiver<'static> {
        Receiver {
            consumer: "billing",
            stream: "ORDERS",
            filters: filters.iter().map(|f| f.to_string()).collect(),
        }
    }

    fn refused(r: Result<Option<bool>, ConsumerError>) -> String {
        match r {
            Err(ConsumerError::Config(why)) => why,
            other => panic!("expected a configuration error, got {other:?}"),
        }
    }

    #[test]
    fn a_dead_letter_subject_the_consumer_receives_is_refused() {
        let stream = ["ORDERS.>".to_string()];
        // No filter: the stream's subjects decide.
        let why = refused(check_dead_letter_subject(
            &on(&[]),
            "ORDERS.dead",
            Some(&stream),
        ));
        assert!(
            why.contains("no filter") && why.contains("filter_subject"),
            "{why}"
        );
        // A filter letting it through, known stream or not.
        for stream in [Some(&stream[..]), None] {
            let why = refused(check_dead_letter_subject(
                &on(&["ORDERS.*"]),
                "ORDERS.dead",
                stream,
            ));
            assert!(
                why.contains("`ORDERS.*`") && why.contains("forever"),
                "{why}"
            );
        }
        let why = refused(check_dead_letter_subject(
            &on(&["ORDERS.new", "ORDERS.>"]),
            "ORDERS.dead",
            None,
        ));
        assert!(why.contains("`ORDERS.>`"), "{why}");
    }

    #[test]
    fn a_dead_letter_subject_outside_the_filter_or_the_stream_is_accepted() {
        let stream = ["ORDERS.>".to_string()];
        let filtered = on(&["ORDERS.new", "ORDERS.*.created"]);
        // Same stream, filtered out.
        assert_eq!(
            check_dead_letter_subject(&filtered, "ORDERS.dead", Some(&stream)).ok(),
            Some(Some(true))
        );
        assert_eq!(
            check_dead_letter_subject(&filtered, "ORDERS.dead", None).ok(),
            Some(None)
        );
        // Another stream: even an unfiltered consumer never sees it, and
        // neither does a filter that only matches subjects it cannot get.
        for filters in [&[][..], &["DEAD.>"][..]] {
            assert_eq!(
                check_dead_letter_subject(&on(filters), "DEAD.orders", Some(&stream)).ok(),
                Some(Some(false)),
                "{filters:?}"
            );
        }
    }

    #[test]
    fn an_unfiltered_consumer_cannot_be_checked_without_the_stream() {
        let why = refused(check_dead_letter_subject(&on(&[]), "DEAD.orders", None));
        assert!(
            why.contains("with_jetstream") && why.contains("filter_subject"),
            "{why}"
        );
        let why = refused(check_dead_letter_subject(
            &on(&["ORDERS.new"]),
            "ORDERS.*",
            None,
        ));
        assert!(why.contains("wildcard"), "{why}");
    }

    #[test]
    fn deliveries_of_one_stream_message_settle_once_with_the_first_decision_on_the_latest() {
        let seqs = [
            Some((7, 1)),
            Some((8, 1)),
            Some((7, 3)),
            None,
            Some((7, 2)),
            None,
            Some((9, 4)),
        ];
        // (delivery settled, decision used)
        assert_eq!(
            once_per_sequence(&seqs),
            [(2, 0), (1, 1), (3, 3), (5, 5), (6, 6)]
        );
        assert!(once_per_sequence(&[]).is_empty());
    }
}
