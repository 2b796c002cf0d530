//! RabbitMQ adapter (`lapin`): `basic_ack`, `basic_nack` with requeue after
//! the nack delay, dead letters published with idem's reason (or rejected
//! to the queue's dead-letter exchange), AMQP `message_id` as key.
//!
//! RabbitMQ cannot delay a requeue, so a nacked delivery is held (it keeps
//! its prefetch slot) for its delay and then nacked with requeue. Delivery
//! counts come from the `x-delivery-count` header that **quorum queues**
//! add; on a classic queue the adapter only knows first delivery (1) from
//! redelivery (2), so use a quorum queue when `max_deliveries` matters.
//! While a handler runs nothing is needed: RabbitMQ redelivers only when
//! the channel closes.
//!
//! **Dead letters.** RabbitMQ cannot add headers to a message it
//! dead-letters, so with [`RabbitConfig::dead_letter_exchange`] the adapter
//! publishes the dead letter itself: to that exchange (routing key: the
//! delivery's own, or [`RabbitConfig::dead_letter_routing_key`]),
//! persistent, `mandatory`, with publisher confirms, keeping the original
//! properties and headers and adding idem's fields
//! ([`DeadLetterReason::fields`]: `idem-reason`, `idem-kind`,
//! `idem-deliveries`, `idem-failures`). The original is acked only once the
//! broker confirmed the dead letter; a dead letter the broker refuses or
//! cannot route is logged and the original is nacked with requeue after
//! [`DEAD_LETTER_RETRY`], so nothing is lost. Without a dead-letter
//! exchange configured, dead letters are rejected without requeue to the
//! queue's own `x-dead-letter-exchange` (see [`declare_queue`]) and carry
//! only RabbitMQ's `x-death`; the reason is then only in the log and the
//! [`Decision`].
//!
//! **Trace context** (feature `otel`): the `traceparent` and `tracestate`
//! headers, long strings or byte arrays (as some clients send text: Python's
//! pika for `bytes` values), when UTF-8; a header of another type is
//! ignored.
//!
//! ```no_run
//! use idem_consumer::rabbitmq::{RabbitConfig, RabbitConsumer, declare_queue};
//! use idem_consumer::{Adapter, Consumer, Message};
//! use idem_core::Idempotency;
//! use idem_redis::RedisStore;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let conn = lapin::Connection::connect("amqp://guest:guest@127.0.0.1:5672/%2f", Default::default()).await?;
//! let channel = conn.create_channel().await?;
//! declare_queue(&channel, "orders", "orders.dlx", "orders.dead").await?;
//! let idem = Idempotency::builder(RedisStore::connect("redis://127.0.0.1/").await?).build();
//! let consumer = Consumer::new(idem, "orders.charge");
//! let cfg = RabbitConfig::new("orders").dead_letter_exchange("orders.dlx");
//! let rabbit = RabbitConsumer::new(channel, cfg).await?;
//! let charge = |m: Message| async move { Ok::<_, std::io::Error>(m.payload().len()) };
//! rabbit.run(&consumer, &charge, std::future::pending::<()>()).await?;
//! # Ok(()) }
//! ```

/// The `lapin` crate this adapter is built on, re-exported so your
/// connection and setup code uses the same version.
pub use lapin;

use crate::adapter::{Adapter, Recovery};
use crate::decision::{DeadLetterReason, Decision};
use crate::error::ConsumerError;
use crate::message::Message;
use futures_util::StreamExt;

use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    BasicRejectOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};

use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Acker, BasicProperties, Channel, Confirmation, ExchangeKind};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

const BROKER: &str = "rabbitmq";

/// The header quorum queues count earlier deliveries in.
const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// How long a delivery whose dead letter the broker refused (or could not
/// route) is held before it is nacked with requeue, to be handled again:
/// long enough not to spin on a misconfigured dead-letter exchange.
pub const DEAD_LETTER_RETRY: Duration = Duration::from_secs(5);

/// AMQP `delivery_mode` of a message the broker writes to disk.
const PERSISTENT: u8 = 2;

fn short(what: &str, s: &str) -> Result<ShortString, ConsumerError> {
    ShortString::try_new(s)
        .map_err(|e| ConsumerError::Config(format!("{what} `{s}` is too long for AMQP: {e}")))
}

fn amqp_err(op: &'static str) -> impl Fn(lapin::Error) -> ConsumerError {
    move |e| ConsumerError::broker_error(BROKER, op, e)
}

/// Declares a durable **quorum** queue whose rejected messages go to the
/// fanout exchange `dlx`, bound to the durable queue `dead`. Idempotent.
/// Give the consumer the same exchange
/// ([`RabbitConfig::dead_letter_exchange`]) so that its dead letters carry
/// idem's reason.
pub async fn declare_queue(
    channel: &Channel,
    queue: &str,
    dlx: &str,
    dead: &str,
) -> Result<(), ConsumerError> {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .exchange_declare(
            short("exchange", dlx)?,
            ExchangeKind::Fanout,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(amqp_err("declare"))?;
    channel
        .queue_declare(short("queue", dead)?, durable, FieldTable::default())
        .await
        .map_err(amqp_err("declare"))?;
    channel
        .queue_bind(
            short("queue", dead)?,
            short("exchange", dlx)?,
            short("routing key", "")?,
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(amqp_err("declare"))?;
    let mut args = FieldTable::default();
    args.insert(
        short("argument", "x-queue-type")?,
        AMQPValue::LongString("quorum".into()),
    );
    args.insert(
        short("argument", "x-dead-letter-exchange")?,
        AMQPValue::LongString(dlx.into()),
    );
    channel
        .queue_declare(short("queue", queue)?, durable, args)
        .await
        .map_err(amqp_err("declare"))?;
    Ok(())
}

/// How to consume.
///
/// ```
/// use idem_consumer::rabbitmq::RabbitConfig;
/// let cfg = RabbitConfig::new("orders").prefetch(64).id_header("x-order-id");
/// ```
#[derive(Debug, Clone)]
pub struct RabbitConfig {
    queue: String,
    prefetch: u16,
    block: Duration,
    id_header: Option<String>,
    consumer_tag: String,
    setup_timeout: Duration,
    dead_letter_exchange: Option<String>,
    dead_letter_routing_key: Option<String>,
}

impl RabbitConfig {
    /// Consume `queue`. Defaults: prefetch (and batch) 32, wait up to 1 s
    /// for a first message, keys from the `message_id` property.
    pub fn new(queue: impl Into<String>) -> RabbitConfig {
        RabbitConfig {
            queue: queue.into(),
            prefetch: 32,
            block: Duration::from_secs(1),
            id_header: None,
            consumer_tag: String::new(),
            setup_timeout: Duration::from_secs(30),
            dead_letter_exchange: None,
            dead_letter_routing_key: None,
        }
    }

    /// Publish dead letters to this exchange, with idem's reason, kind and
    /// counts as headers, and ack the original once the broker confirmed
    /// the dead letter (see the [module](self) documentation). Usually the
    /// queue's own dead-letter exchange (`dlx` of [`declare_queue`]); `""`
    /// is the default exchange (route by queue name with
    /// [`dead_letter_routing_key`](Self::dead_letter_routing_key)).
    /// [`RabbitConsumer::new`] enables publisher confirms on its channel and
    /// checks that the exchange exists.
    ///
    /// Without it, dead letters are rejected to the queue's
    /// `x-dead-letter-exchange` and carry only RabbitMQ's `x-death`.
    ///
    /// ```
    /// use idem_consumer::rabbitmq::RabbitConfig;
    /// let cfg = RabbitConfig::new("orders").dead_letter_exchange("orders.dlx");
    /// # let _ = cfg;
    /// ```
    pub fn dead_letter_exchange(mut self, exchange: impl Into<String>) -> Self {
        self.dead_letter_exchange = Some(exchange.into());
        self
    }

    /// The routing key of published dead letters (default: the routing key
    /// the message was published with). Only used with
    /// [`dead_letter_exchange`](Self::dead_letter_exchange).
    ///
    /// ```
    /// use idem_consumer::rabbitmq::RabbitConfig;
    /// let cfg = RabbitConfig::new("orders").dead_letter_exchange("").dead_letter_routing_key("orders.dead");
    /// # let _ = cfg;
    /// ```
    pub fn dead_letter_routing_key(mut self, key: impl Into<String>) -> Self {
        self.dead_letter_routing_key = Some(key.into());
        self
    }

    /// Unacked deliveries the broker hands over at once, and the batch size
    /// (at least 1).
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = n.max(1);
        self
    }

    /// How long a poll waits for a first message (default 1 s).
    pub fn block(mut self, d: Duration) -> Self {
        self.block = d;
        self
    }

    /// Take the id from this header (a string) instead of `message_id`;
    /// a header of another type dead-letters the message as unreadable.
    pub fn id_header(mut self, name: impl Into<String>) -> Self {
        self.id_header = Some(name.into());
        self
    }

    /// How long [`RabbitConsumer::new`] waits for the broker to accept the
    /// consumer (default 30 s). A broker can leave it waiting for good: a
    /// quorum queue without a leader answers nothing.
    ///
    /// ```
    /// use idem_consumer::rabbitmq::RabbitConfig;
    /// use std::time::Duration;
    ///
    /// let cfg = RabbitConfig::new("orders").setup_timeout(Duration::from_secs(5));
    /// # let _ = cfg;
    /// ```
    pub fn setup_timeout(mut self, d: Duration) -> Self {
        self.setup_timeout = d;
        self
    }
}

/// A RabbitMQ queue consumer run through idem.
///
/// ```no_run
/// use idem_consumer::rabbitmq::{lapin::Channel, RabbitConfig, RabbitConsumer};
/// use idem_consumer::{Adapter, Consumer, ConsumerError, Message};
/// use idem_core::Idempotency;
///
/// # async fn demo(channel: Channel, idem: Idempotency) -> Result<(), ConsumerError> {
/// let consumer = Consumer::new(idem, "orders.charge");
/// let rabbit = RabbitConsumer::new(channel, RabbitConfig::new("orders").prefetch(64)).await?;
/// let charge = |m: Message| async move { Ok::<_, std::io::Error>(m.payload().len()) };
/// let report = rabbit.poll(&consumer, &charge).await?; // one batch, settled
/// println!("{} acked, {} nacked", report.acked, report.nacked);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RabbitConsumer {
    deliveries: Arc<Mutex<lapin::Consumer>>,
    /// The consuming channel, which also publishes dead letters (confirms on).
    channel: Channel,
    cfg: Arc<RabbitConfig>,
    source: Arc<str>,
}

impl fmt::Debug for RabbitConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitConsumer")
            .field("config", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl RabbitConsumer {
    /// Sets the channel's prefetch and starts consuming the queue; with a
    /// [dead-letter exchange](RabbitConfig::dead_letter_exchange), checks
    /// that it exists and turns on publisher confirms first.
    ///
    /// A broker that does not answer within the config's
    /// [`setup_timeout`](RabbitConfig::setup_timeout) is an error, not a
    /// wait without end. A dead-letter exchange that does not exist is a
    /// [`ConsumerError::Config`] (and the broker closes the channel).
    pub async fn new(channel: Channel, cfg: RabbitConfig) -> Result<Self, ConsumerError> {
        let (queue, tag) = (
            short("queue", &cfg.queue)?,
            short("consumer tag", &cfg.consumer_tag)?,
        );
        let setup = async {
            if let Some(exchange) = &cfg.dead_letter_exchange {
                prepare_dead_letters(&channel, exchange).await?;
            }
            channel
                .basic_qos(cfg.prefetch, BasicQosOptions::default())
                .await
                .map_err(amqp_err("qos"))?;
            channel
                .basic_consume(
                    queue,
                    tag,
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(amqp_err("consume"))
        };
        let deliveries = tokio::time::timeout(cfg.setup_timeout, setup)
            .await
            .map_err(|_| {
                ConsumerError::broker(
                    BROKER,
                    "consume",
                    format!(
                        "RabbitMQ did not accept a consumer on queue {:?} within {:?}; check that \
                         the queue is available (a quorum queue needs a leader) and that no \
                         resource alarm blocks the connection",
                        cfg.queue, cfg.setup_timeout
                    ),
                )
            })??;
        Ok(RabbitConsumer {
            deliveries: Arc::new(Mutex::new(deliveries)),
            channel,
            source: Arc::from(cfg.queue.as_str()),
            cfg: Arc::new(cfg),
        })
    }
}

/// `basic_ack`; `basic_nack` with requeue once the delay has passed (in a
/// task of its own, so the next batch need not wait); dead letters
/// published with idem's fields and then acked (or, without a dead-letter
/// exchange configured, `basic_reject` without requeue). Each delivery is
/// settled once. Nothing while handlers run: RabbitMQ redelivers only when
/// the channel closes.
impl Adapter for RabbitConsumer {
    type Delivery = Delivery;

    /// Waits up to the block time for deliveries; returns those ready, at
    /// most a prefetch's worth.
    async fn fetch(&self) -> Result<Vec<Delivery>, ConsumerError> {
        let mut stream = self.deliveries.lock().await;
        let mut out = Vec::new();
        let mut next = match tokio::time::timeout(self.cfg.block, stream.next()).await {
            Err(_) => return Ok(out),
            Ok(None) => {
                return Err(ConsumerError::broker(
                    BROKER,
                    "fetch",
                    "the consumer was cancelled or its channel closed; create a new RabbitConsumer on a new channel",
                ));
            }
            Ok(Some(item)) => Some(item),
        };
        while let Some(item) = next.take() {
            out.push(item.map_err(amqp_err("fetch"))?);
            if out.len() >= usize::from(self.cfg.prefetch) {
                break;
            }
            next = futures_util::FutureExt::now_or_never(stream.next()).flatten();
        }
        Ok(out)
    }

    /// Payload, `message_id` (or the configured header) as id, delivery
    /// count from `x-delivery-count` (quorum queues) or the redelivered
    /// flag; with `otel`, the `traceparent` and `tracestate` headers.
    fn delivery_count(&self, d: &Delivery) -> u32 {
        delivery_count(d)
    }

    fn message_of(&self, d: &Delivery) -> Result<Message, ConsumerError> {
        let headers = d.properties.headers().as_ref().map(FieldTable::inner);
        let mut msg = Message::new(d.data.clone())
            .with_delivery_count(delivery_count(d))
            .with_source(BROKER, self.source.clone());
        match &self.cfg.id_header {
            None => {
                if let Some(id) = d.properties.message_id() {
                    msg = msg.with_id(id.as_str());
                }
            }
            Some(name) => match headers.and_then(|h| h.get(name.as_str())) {
                None => {}
                Some(AMQPValue::LongString(s)) => match std::str::from_utf8(s.as_bytes()) {
                    Ok(id) => msg = msg.with_id(id),
                    Err(_) => msg = msg.with_unreadable_id(format!("header `{name}` is not UTF-8")),
                },
                Some(AMQPValue::ShortString(s)) => msg = msg.with_id(s.as_str()),
                Some(other) => {
                    msg = msg
                        .with_unreadable_id(format!("header `{name}` is {other:?}, not a string"))
                }
            },
        }
        #[cfg(feature = "otel")]
        if let Some(h) = headers {
            msg = crate::otel::with_trace_headers(msg, |name| trace_header(h, name));
        }
        Ok(msg)
    }

    async fn apply(&self, d: &Delivery, decision: &Decision) -> Result<(), ConsumerError> {
        match decision {
            Decision::Ack => ack(&d.acker).await,
            Decision::Nack { delay } => {
                nack_after(d.acker.clone(), *delay);
                Ok(())
            }
            Decision::DeadLetter { reason } => match &self.cfg.dead_letter_exchange {
                Some(exchange) => self.publish_dead_letter(d, exchange, reason).await,
                None => {
                    tracing::warn!(queue = %self.source, reason = %reason, kind = reason.kind(), "rejecting to the queue's dead-letter exchange (set RabbitConfig::dead_letter_exchange for dead letters that carry the reason)");
                    d.acker
                        .reject(BasicRejectOptions { requeue: false })
                        .await
                        .map(drop)
                        .map_err(amqp_err("dead_letter"))
                }
            },
        }
    }

    /// Every error stops [`run`](Adapter::run): they all mean the channel
    /// or connection is gone (the broker has requeued every unacked
    /// delivery); open a new channel and `RabbitConsumer`.
    async fn recover(&self, _: &ConsumerError) -> Recovery {
        Recovery::Stop
    }
}

impl RabbitConsumer {
    /// Publishes `d`'s dead letter to `exchange` and acks `d` once the
    /// broker confirmed it; a dead letter refused, unroutable or not
    /// confirmed in time leaves `d` to be nacked with requeue after
    /// [`DEAD_LETTER_RETRY`] instead.
    async fn publish_dead_letter(
        &self,
        d: &Delivery,
        exchange: &str,
        reason: &DeadLetterReason,
    ) -> Result<(), ConsumerError> {
        let routing_key = match &self.cfg.dead_letter_routing_key {
            Some(k) => short("routing key", k)?,
            None => d.routing_key.clone(),
        };
        let properties = dead_letter_properties(&d.properties, reason.fields(delivery_count(d)));
        // Mandatory: a dead letter no queue takes comes back instead of
        // vanishing, and the original is then kept.
        let mandatory = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let channel_gone = |e: lapin::Error| {
            tracing::warn!(queue = %self.source, exchange, error = %e, "publishing a dead letter closed the channel; the broker requeues the message");
            ConsumerError::broker(
                BROKER,
                "dead_letter",
                format!(
                    "publishing the dead letter to exchange {exchange:?} failed ({e}); the channel \
                     is closed, so the broker requeues the message: check that the exchange \
                     exists, then open a new channel and RabbitConsumer"
                ),
            )
        };
        let confirm = self
            .channel
            .basic_publish(
                short("exchange", exchange)?,
                routing_key.clone(),
                mandatory,
                &d.data,
                properties,
            )
            .await
            .map_err(channel_gone)?;
        let refused = match tokio::time::timeout(CONFIRM_WAIT, confirm).await {
            Ok(Ok(Confirmation::Ack(None))) => None,
            Ok(Ok(Confirmation::Ack(Some(_)))) => {
                Some("no queue is bound to the dead-letter exchange for its routing key")
            }
            Ok(Ok(Confirmation::Nack(_))) => Some("the broker refused it (publisher nack)"),
            Ok(Ok(Confirmation::NotRequested)) => Some("publisher confirms are off on the channel"),
            Ok(Err(e)) => return Err(channel_gone(e)),
            Err(_) => Some("the broker did not confirm it in time"),
        };
        match refused {
            None => {
                tracing::warn!(queue = %self.source, exchange, routing_key = %routing_key, reason = %reason, kind = reason.kind(), "dead-lettered");
                ack(&d.acker).await
            }
            Some(why) => {
                tracing::error!(queue = %self.source, exchange, routing_key = %routing_key, why, retry_in_ms = DEAD_LETTER_RETRY.as_millis() as u64, "the dead letter was not written; the message is kept and requeued");
                nack_after(d.acker.clone(), DEAD_LETTER_RETRY);
                Ok(())
            }
        }
    }
}

/// How long a dead letter's publisher confirm is awaited.
const CONFIRM_WAIT: Duration = Duration::from_secs(30);

/// Checks that `exchange` exists (the default exchange always does) and
/// turns on publisher confirms, for [`RabbitConsumer::publish_dead_letter`].
async fn prepare_dead_letters(channel: &Channel, exchange: &str) -> Result<(), ConsumerError> {
    if !exchange.is_empty() {
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..ExchangeDeclareOptions::default()
        };
        channel
            .exchange_declare(
                short("exchange", exchange)?,
                ExchangeKind::Direct,
                passive,
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                ConsumerError::Config(format!(
                    "the dead-letter exchange {exchange:?} is not usable ({e}); declare it \
                     (declare_queue does) or fix RabbitConfig::dead_letter_exchange, then open a \
                     new channel"
                ))
            })?;
    }
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(amqp_err("confirm_select"))
}

/// The original properties, persistent, with idem's fields added to the
/// headers; the quorum queue's `x-delivery-count` is dropped (it counted
/// deliveries from the original queue: `idem-deliveries` has it).
fn dead_letter_properties(
    original: &BasicProperties,
    fields: Vec<(&'static str, String)>,
) -> BasicProperties {
    let mut headers = FieldTable::default();
    if let Some(h) = original.headers() {
        for (k, v) in h.inner() {
            if k.as_str() != DELIVERY_COUNT_HEADER {
                headers.insert(k.clone(), v.clone());
            }
        }
    }
    for (name, value) in fields {
        headers.insert(ShortString::from(name), AMQPValue::LongString(value.into()));
    }
    original
        .clone()
        .with_headers(headers)
        .with_delivery_mode(PERSISTENT)
}

async fn ack(acker: &Acker) -> Result<(), ConsumerError> {
    acker
        .ack(BasicAckOptions::default())
        .await
        .map(drop)
        .map_err(amqp_err("ack"))
}

/// Nacks with requeue after `delay`, in a task of its own so the next
/// batch need not wait (RabbitMQ cannot delay a requeue).
fn nack_after(acker: Acker, delay: Duration) {
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        let requeue = BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        };
        if let Err(e) = acker.nack(requeue).await {
            // The channel is gone: the broker requeues it anyway.
            tracing::warn!(error = %e, "delayed nack failed");
        }
    });
}

/// The trace header `name` of a delivery, as text: a long string (what
/// idem's sink and most clients write) or a byte array (what a client may
/// send for a bytes value: Python's pika does for `bytes`), when UTF-8.
/// Any other type, or bytes that are not UTF-8, is no trace context: the
/// message is handled as one without it.
#[cfg(feature = "otel")]
fn trace_header(
    headers: &std::collections::BTreeMap<ShortString, AMQPValue>,
    name: &str,
) -> Option<String> {
    let bytes = match headers.get(name)? {
        AMQPValue::LongString(s) => s.as_bytes(),
        AMQPValue::ByteArray(b) => b.as_slice(),
        _ => return None,
    };
    std::str::from_utf8(bytes).ok().map(str::to_owned)
}

/// Deliveries so far, this one included: from the quorum queue's
/// `x-delivery-count` (deliveries before this one), else 2 for a
/// redelivery and 1 otherwise.
fn delivery_count(d: &Delivery) -> u32 {
    let before = d
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(DELIVERY_COUNT_HEADER))
        .and_then(as_u32);
    match before {
        Some(n) => n.saturating_add(1),
        None if d.redelivered => 2,
        None => 1,
    }
}

fn as_u32(v: &AMQPValue) -> Option<u32> {
    let n: i64 = match v {
        AMQPValue::ShortShortInt(n) => i64::from(*n),
        AMQPValue::ShortShortUInt(n) => i64::from(*n),
        AMQPValue::ShortInt(n) => i64::from(*n),
        AMQPValue::ShortUInt(n) => i64::from(*n),
        AMQPValue::LongInt(n) => i64::from(*n),
        AMQPValue::LongUInt(n) => i64::from(*n),
        AMQPValue::LongLongInt(n) => *n,
        _ => return None,
    };
    u32::try_from(n).ok()
}
