//! NATS JetStream adapter: a pull consumer, `ack` / `nak` with delay /
//! `term`, progress acks while a handler runs, `Nats-Msg-Id` as key.
//!
//! You create the stream and the durable pull consumer with `async-nats`
//! (ack policy `explicit`, the default; leave `max_deliver` unlimited, this
//! adapter applies [`Consumer::max_deliveries`](crate::Consumer::max_deliveries) itself) and hand it over.
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
//! use idem_core::{Idempotency, RedisStore};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let js = jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
//! let stream = js.get_stream("ORDERS").await?;
//! let pull = stream
//!     .get_or_create_consumer("billing", pull::Config { durable_name: Some("billing".into()), ..Default::default() })
//!     .await?;
//! let idem = Idempotency::builder(RedisStore::connect("redis://127.0.0.1/").await?).build();
//! let consumer = Consumer::new(idem, "orders.charge");
//! let nats = NatsConsumer::new(pull, NatsConfig::new().dead_letter_subject("ORDERS.dead")).await?;
//! let charge = |m: Message| async move { Ok::<_, std::io::Error>(m.payload().len()) };
//! nats.run(&consumer, &charge, std::future::pending::<()>()).await?;
//! # Ok(()) }
//! ```

/// The `async-nats` crate this adapter is built on, re-exported so your
/// connection and setup code uses the same version.
pub use async_nats;

use crate::adapter::Adapter;
use crate::decision::Decision;
use crate::error::ConsumerError;
use crate::message::Message;
use async_nats::HeaderMap;
use async_nats::header::HeaderName;
use async_nats::jetstream::consumer::pull::{self, Stream as PullStream};
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

const BROKER: &str = "nats";

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
}

impl Default for NatsConfig {
    fn default() -> Self {
        NatsConfig::new()
    }
}

impl NatsConfig {
    /// Defaults: batches of 32, wait up to 1 s for messages, no dead-letter
    /// subject (dead letters are only terminated), progress acks on, keys
    /// from the `Nats-Msg-Id` header.
    pub fn new() -> NatsConfig {
        NatsConfig {
            batch: 32,
            block: Duration::from_secs(1),
            dead_letter_subject: None,
            progress: true,
            id_header: "Nats-Msg-Id".into(),
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
    /// must capture it) before terminating them. Headers: the original
    /// `Nats-Msg-Id` as `Idem-Original-Id`, `Idem-Dead-Reason`,
    /// `Idem-Dead-Kind`, `Idem-Deliveries`, `Idem-Source`.
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
}

/// A JetStream pull consumer run through idem.
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
    /// its ack policy is `explicit`.
    pub async fn new(mut consumer: PullConsumer, cfg: NatsConfig) -> Result<Self, ConsumerError> {
        let info = consumer
            .info()
            .await
            .map_err(|e| ConsumerError::broker(BROKER, "consumer_info", e))?;
        if info.config.ack_policy != AckPolicy::Explicit {
            return Err(ConsumerError::Config(format!(
                "JetStream consumer `{}` must use AckPolicy::Explicit: with another policy \
                 a failed message cannot be redelivered alone",
                info.name
            )));
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
        reason: &crate::DeadLetterReason,
        deliveries: i64,
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
        // Header values cannot hold line breaks.
        let text = reason.to_string().replace(['\r', '\n'], " ");
        headers.insert("Idem-Dead-Reason", text.as_str());
        headers.insert("Idem-Dead-Kind", reason.kind());
        headers.insert("Idem-Deliveries", deliveries.to_string().as_str());
        headers.insert("Idem-Source", &*self.source);
        let ack = m
            .context
            .publish_with_headers(subject.clone(), headers, m.payload.clone())
            .await
            .map_err(|e| ConsumerError::broker(BROKER, "dead_letter", e))?;
        ack.await
            .map_err(|e| ConsumerError::broker(BROKER, "dead_letter", e))?;
        Ok(())
    }
}

/// Pull, `ack` / `nak` with delay / dead-letter subject and `term`, progress
/// acks while handlers run.
impl Adapter for NatsConsumer {
    type Delivery = jetstream::Message;

    /// Waits up to the configured block time for messages and returns those
    /// ready, at most a batch.
    async fn fetch(&self) -> Result<Vec<jetstream::Message>, ConsumerError> {
        let mut guard = self.messages.lock().await;
        if guard.is_none() {
            let stream = self
                .consumer
                .stream()
                .max_messages_per_batch(self.cfg.batch)
                .heartbeat(Duration::from_secs(5))
                .expires(Duration::from_secs(30))
                .messages()
                .await
                .map_err(|e| ConsumerError::broker(BROKER, "subscribe", e))?;
            *guard = Some(stream);
        }
        let Some(stream) = guard.as_mut() else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        let first = tokio::time::timeout(self.cfg.block, stream.next()).await;
        let mut next = match first {
            Err(_) | Ok(None) => return Ok(out),
            Ok(Some(item)) => Some(item),
        };
        while let Some(item) = next.take() {
            match item {
                Ok(m) => out.push(m),
                Err(e) => {
                    // Missed heartbeats and similar: drop the subscription so
                    // the next fetch opens a fresh one; keep what we have.
                    *guard = None;
                    if out.is_empty() {
                        return Err(ConsumerError::broker(BROKER, "fetch", e));
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
    /// count from the JetStream metadata.
    fn message_of(&self, m: &jetstream::Message) -> Result<Message, ConsumerError> {
        let (deliveries, sequence) = match m.info() {
            Ok(info) => (
                u32::try_from(info.delivered).unwrap_or(1),
                Some(info.stream_sequence),
            ),
            Err(e) => {
                tracing::warn!(error = %e, "JetStream message without readable delivery info");
                (1, None)
            }
        };
        let mut msg = Message::new(m.payload.clone())
            .with_delivery_count(deliveries)
            .with_source(BROKER, self.source.clone());
        if let Some(sequence) = sequence {
            msg = msg.with_position(sequence.to_string());
        }
        if let Some(id) = m
            .headers
            .as_ref()
            .and_then(|h| h.get(self.id_header.clone()))
        {
            msg = msg.with_id(id.as_str());
        }
        Ok(msg)
    }

    /// `ack`, `nak` with the delay, or publish to the dead-letter subject
    /// and `term`. A dead letter that cannot be published is nacked for an
    /// `ack_wait` instead (never lost) and its error returned.
    async fn apply(
        &self,
        m: &jetstream::Message,
        decision: &Decision,
    ) -> Result<(), ConsumerError> {
        let sent = match decision {
            Decision::Ack => m.ack().await,
            Decision::Nack { delay } => m.ack_with(AckKind::Nak(Some(*delay))).await,
            Decision::DeadLetter { reason } => {
                let deliveries = m.info().map(|i| i.delivered).unwrap_or(1);
                match self.dead_letter(m, reason, deliveries).await {
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
        sent.map_err(|e| ConsumerError::broker(BROKER, "ack", e))
    }

    /// Progress acks at least three times per `ack_wait`, when enabled.
    fn keep_alive_period(&self) -> Option<Duration> {
        self.cfg.progress.then_some(self.ack_wait / 3)
    }

    /// An `AckKind::Progress` for every message of the batch.
    async fn keep_alive(&self, in_flight: &[jetstream::Message]) {
        for m in in_flight {
            if let Err(e) = m.ack_with(AckKind::Progress).await {
                tracing::warn!(error = %e, "progress ack failed");
            }
        }
    }
}

/// A durable pull consumer configuration suited to this adapter: explicit
/// acks, unlimited server-side deliveries (the [`Consumer`](crate::Consumer) counts them),
/// the given `ack_wait`.
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
