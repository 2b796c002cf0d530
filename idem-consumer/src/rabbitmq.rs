//! RabbitMQ adapter (`lapin`): `basic_ack`, `basic_nack` with requeue after
//! the nack delay, `basic_reject` without requeue to the queue's
//! dead-letter exchange, AMQP `message_id` as key.
//!
//! RabbitMQ cannot delay a requeue, so a nacked delivery is held (it keeps
//! its prefetch slot) for its delay and then nacked with requeue. Delivery
//! counts come from the `x-delivery-count` header that **quorum queues**
//! add; on a classic queue the adapter only knows first delivery (1) from
//! redelivery (2), so use a quorum queue when `max_deliveries` matters.
//! Dead letters are rejected without requeue: declare the queue with an
//! `x-dead-letter-exchange` (see [`declare_queue`]), or they are dropped by
//! the broker. The reason is logged and in the [`Decision`]; RabbitMQ adds
//! its own `x-death` header to the dead-lettered message. While a handler
//! runs nothing is needed: RabbitMQ redelivers only when the channel closes.
//!
//! ```no_run
//! use idem_consumer::rabbitmq::{RabbitConfig, RabbitConsumer, declare_queue};
//! use idem_consumer::{Adapter, Consumer, Message};
//! use idem_core::{Idempotency, RedisStore};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let conn = lapin::Connection::connect("amqp://guest:guest@127.0.0.1:5672/%2f", Default::default()).await?;
//! let channel = conn.create_channel().await?;
//! declare_queue(&channel, "orders", "orders.dlx", "orders.dead").await?;
//! let idem = Idempotency::builder(RedisStore::connect("redis://127.0.0.1/").await?).build();
//! let consumer = Consumer::new(idem, "orders.charge");
//! let rabbit = RabbitConsumer::new(channel, RabbitConfig::new("orders")).await?;
//! let charge = |m: Message| async move { Ok::<_, std::io::Error>(m.payload().len()) };
//! rabbit.run(&consumer, &charge, std::future::pending::<()>()).await?;
//! # Ok(()) }
//! ```

/// The `lapin` crate this adapter is built on, re-exported so your
/// connection and setup code uses the same version.
pub use lapin;

use crate::adapter::{Adapter, Recovery};
use crate::decision::Decision;
use crate::error::ConsumerError;
use crate::message::Message;
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, ExchangeKind};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

const BROKER: &str = "rabbitmq";

fn short(what: &str, s: &str) -> Result<ShortString, ConsumerError> {
    ShortString::try_new(s)
        .map_err(|e| ConsumerError::Config(format!("{what} `{s}` is too long for AMQP: {e}")))
}

fn amqp_err(op: &'static str) -> impl Fn(lapin::Error) -> ConsumerError {
    move |e| ConsumerError::broker(BROKER, op, e)
}

/// Declares a durable **quorum** queue whose rejected messages go to the
/// fanout exchange `dlx`, bound to the durable queue `dead`. Idempotent.
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
        }
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
#[derive(Clone)]
pub struct RabbitConsumer {
    deliveries: Arc<Mutex<lapin::Consumer>>,
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
    /// Sets the channel's prefetch and starts consuming the queue.
    ///
    /// A broker that does not answer within the config's
    /// [`setup_timeout`](RabbitConfig::setup_timeout) is an error, not a
    /// wait without end.
    pub async fn new(channel: Channel, cfg: RabbitConfig) -> Result<Self, ConsumerError> {
        let (queue, tag) = (
            short("queue", &cfg.queue)?,
            short("consumer tag", &cfg.consumer_tag)?,
        );
        let setup = async {
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
            source: Arc::from(cfg.queue.as_str()),
            cfg: Arc::new(cfg),
        })
    }
}

/// `basic_ack`; `basic_nack` with requeue once the delay has passed (in a
/// task of its own, so the next batch need not wait); `basic_reject`
/// without requeue for dead letters. Nothing while handlers run: RabbitMQ
/// redelivers only when the channel closes.
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
    /// count from `x-delivery-count` (quorum queues) or the redelivered flag.
    fn message_of(&self, d: &Delivery) -> Result<Message, ConsumerError> {
        let headers = d.properties.headers().as_ref().map(FieldTable::inner);
        // Quorum queues count deliveries before this one.
        let before = headers
            .and_then(|h| h.get("x-delivery-count"))
            .and_then(as_u32);
        let deliveries = match before {
            Some(n) => n.saturating_add(1),
            None if d.redelivered => 2,
            None => 1,
        };
        let mut msg = Message::new(d.data.clone())
            .with_delivery_count(deliveries)
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
        Ok(msg)
    }

    async fn apply(&self, d: &Delivery, decision: &Decision) -> Result<(), ConsumerError> {
        let done = match decision {
            Decision::Ack => d.acker.ack(BasicAckOptions::default()).await,
            Decision::Nack { delay } => {
                let (acker, delay) = (d.acker.clone(), *delay);
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
                Ok(true)
            }
            Decision::DeadLetter { reason } => {
                tracing::warn!(queue = %self.source, reason = %reason, kind = reason.kind(), "rejecting to the dead-letter exchange");
                d.acker.reject(BasicRejectOptions { requeue: false }).await
            }
        };
        done.map(|_| ()).map_err(amqp_err("ack"))
    }

    /// Every error stops [`run`](Adapter::run): they all mean the channel
    /// or connection is gone (the broker has requeued every unacked
    /// delivery); open a new channel and `RabbitConsumer`.
    async fn recover(&self, _: &ConsumerError) -> Recovery {
        Recovery::Stop
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
