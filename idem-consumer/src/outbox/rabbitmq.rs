//! [`RabbitSink`]: publishes under publisher confirms, `mandatory`, and
//! awaits the batch's confirms together.

use super::{OutboxMessage, Sink, SinkError, for_all, own_name_refused};
use crate::error::ConsumerError;
use async_trait::async_trait;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
    PublisherConfirm,
};
use std::fmt;
use std::time::Duration;
use tokio::sync::Mutex;
use tokio::time::{Instant, timeout_at};

const BROKER: &str = "rabbitmq";

/// The header carrying the message's ordering key, for readers that want it.
const KEY_HEADER: &str = "idem-outbox-key";

/// AMQP `delivery_mode` of a message the broker writes to disk.
const PERSISTENT: u8 = 2;

/// How long [`RabbitSink::connect`] and a reconnection wait for the broker.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Publishes outbox messages to an exchange (default `""`, which routes
/// by queue name) with routing key `topic`, on a channel of its own in
/// confirm mode: `mandatory`, persistent, `content_type
/// application/json`, AMQP `message_id = id` (the id a
/// [`RabbitConsumer`](crate::rabbitmq::RabbitConsumer) reads by default)
/// and header `idem-outbox-key = key`, beside the message's own
/// [`headers`](OutboxMessage::headers), each a long string (a header named
/// `idem-outbox-key` refuses the message: see the [module](super)). The
/// batch is published at once and
/// its confirms awaited together: `Ok` once the broker confirmed the
/// message routed (and, for durable queues, written).
///
/// | what happened | result |
/// | --- | --- |
/// | confirmed, routed to a queue | `Ok` |
/// | returned: no queue is bound for the routing key (`basic.return`) | `Refused` |
/// | the exchange does not exist | `Refused`, every message |
/// | topic, id, key or a header's name over AMQP's 255 bytes | `Refused` |
/// | a header named `idem-outbox-key` | `Refused` |
/// | the broker nacked it (a queue could not take it) | `Unavailable` |
/// | the channel or connection closed, no confirm within [`confirm_timeout`](Self::confirm_timeout) | `Unavailable` |
///
/// A closed channel is opened again on the next `send`; a closed
/// connection too when the sink was made with [`connect`](Self::connect)
/// (with [`new`](Self::new) it stays `Unavailable`: make a new sink on a
/// new connection).
///
/// ```no_run
/// use idem_consumer::outbox::RabbitSink;
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let conn = lapin::Connection::connect("amqp://guest:guest@127.0.0.1:5672/%2f", Default::default()).await?;
/// let sink = RabbitSink::new(conn).await?.exchange("orders");
/// # let _ = sink;
/// # Ok(()) }
/// ```
pub struct RabbitSink {
    link: Mutex<Link>,
    /// Where to connect again, when the sink made the connection.
    url: Option<String>,
    exchange: String,
    confirm_timeout: Duration,
}

/// The connection and the confirm-mode channel published on.
struct Link {
    conn: Option<Connection>,
    channel: Option<Channel>,
    /// Whether the exchange was found on `channel`: the channel made with
    /// the sink predates [`RabbitSink::exchange`].
    checked: bool,
}

impl fmt::Debug for RabbitSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitSink")
            .field("exchange", &self.exchange)
            .field("confirm_timeout", &self.confirm_timeout)
            .finish_non_exhaustive()
    }
}

/// Why a channel cannot be had, for every message of the batch.
struct NoChannel {
    refused: bool,
    reason: String,
    source: String,
}

impl RabbitSink {
    /// Publishes on a new channel of `conn` (in confirm mode). Fails when
    /// the connection cannot open one.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let conn = lapin::Connection::connect("amqp://guest:guest@127.0.0.1:5672/%2f", Default::default()).await?;
    /// let sink = idem_consumer::outbox::RabbitSink::new(conn).await?;
    /// # let _ = sink;
    /// # Ok(()) }
    /// ```
    pub async fn new(conn: Connection) -> Result<Self, ConsumerError> {
        let channel = open_channel(&conn).await.map_err(|e| {
            ConsumerError::broker(
                BROKER,
                "confirm_select",
                format!("{e}; the sink needs a connection that can open a channel in confirm mode"),
            )
        })?;
        Ok(RabbitSink::with(conn, channel, None))
    }

    /// Connects to `url` (`amqp://user:password@host:port/vhost`), and
    /// connects again on a later `send` when the connection was lost.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_consumer::ConsumerError> {
    /// let sink = idem_consumer::outbox::RabbitSink::connect("amqp://guest:guest@127.0.0.1:5672/%2f")
    ///     .await?
    ///     .exchange("orders");
    /// # let _ = sink;
    /// # Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, ConsumerError> {
        let conn = connect(url).await.map_err(|e| {
            ConsumerError::broker(
                BROKER,
                "connect",
                format!("{e}; check that RabbitMQ runs and the URL's credentials and vhost"),
            )
        })?;
        let channel = open_channel(&conn)
            .await
            .map_err(|e| ConsumerError::broker(BROKER, "confirm_select", e))?;
        Ok(RabbitSink::with(conn, channel, Some(url.to_owned())))
    }

    fn with(conn: Connection, channel: Channel, url: Option<String>) -> Self {
        RabbitSink {
            link: Mutex::new(Link {
                conn: Some(conn),
                channel: Some(channel),
                checked: false,
            }),
            url,
            exchange: String::new(),
            confirm_timeout: Duration::from_secs(30),
        }
    }

    /// Publishes to `exchange` (default `""`, the default exchange: the
    /// routing key, here the topic, names the queue). It must exist: a
    /// missing exchange refuses every message.
    ///
    /// ```no_run
    /// # async fn demo(conn: lapin::Connection) -> Result<(), idem_consumer::ConsumerError> {
    /// let sink = idem_consumer::outbox::RabbitSink::new(conn).await?.exchange("orders");
    /// # let _ = sink;
    /// # Ok(()) }
    /// ```
    pub fn exchange(mut self, exchange: impl Into<String>) -> Self {
        self.exchange = exchange.into();
        self
    }

    /// How long a batch waits for its confirms (default 30 s); those
    /// missing then are `Unavailable` (and sent again by the relay: the
    /// consumer replays a copy that was in fact written).
    ///
    /// ```no_run
    /// # async fn demo(conn: lapin::Connection) -> Result<(), idem_consumer::ConsumerError> {
    /// use std::time::Duration;
    /// let sink = idem_consumer::outbox::RabbitSink::new(conn).await?.confirm_timeout(Duration::from_secs(5));
    /// # let _ = sink;
    /// # Ok(()) }
    /// ```
    pub fn confirm_timeout(mut self, d: Duration) -> Self {
        self.confirm_timeout = d;
        self
    }

    /// The channel to publish on: the open one, or a new one (on a new
    /// connection when the sink has the URL), the exchange checked.
    async fn channel(&self) -> Result<Channel, NoChannel> {
        let mut link = self.link.lock().await;
        if let Some(ch) = link.channel.clone().filter(|c| c.status().connected()) {
            if !link.checked {
                if let Err(e) = self.check_exchange(&ch).await {
                    // The broker closed the channel with its refusal.
                    link.channel = None;
                    return Err(e);
                }
                link.checked = true;
            }
            return Ok(ch);
        }
        link.channel = None;
        link.checked = false;
        let usable = link.conn.as_ref().is_some_and(|c| c.status().connected());
        if !usable {
            let Some(url) = &self.url else {
                return Err(NoChannel {
                    refused: false,
                    reason: "the RabbitMQ connection is closed; make a new RabbitSink on a new \
                             connection (or use RabbitSink::connect, which reconnects)"
                        .into(),
                    source: "connection closed".into(),
                });
            };
            link.conn = None;
            let conn = connect(url).await.map_err(|e| NoChannel {
                refused: false,
                reason: "cannot connect to RabbitMQ".into(),
                source: e,
            })?;
            tracing::info!(sink = BROKER, "connected to RabbitMQ again");
            link.conn = Some(conn);
        }
        let Some(conn) = link.conn.as_ref() else {
            return Err(NoChannel {
                refused: false,
                reason: "no RabbitMQ connection".into(),
                source: "connection closed".into(),
            });
        };
        let channel = open_channel(conn).await.map_err(|e| NoChannel {
            refused: false,
            reason: "cannot open a channel".into(),
            source: e,
        })?;
        self.check_exchange(&channel).await?;
        link.channel = Some(channel.clone());
        link.checked = true;
        Ok(channel)
    }

    /// A passive declare: a publish to a missing exchange would close the
    /// channel after the fact, failing the batch as if the broker were down.
    async fn check_exchange(&self, channel: &Channel) -> Result<(), NoChannel> {
        if self.exchange.is_empty() {
            return Ok(());
        }
        let name = ShortString::try_new(self.exchange.as_str()).map_err(|e| NoChannel {
            refused: true,
            reason: format!("the exchange name `{}` is too long for AMQP", self.exchange),
            source: e.to_string(),
        })?;
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..ExchangeDeclareOptions::default()
        };
        let declare =
            channel.exchange_declare(name, ExchangeKind::Direct, passive, FieldTable::default());
        let answer = tokio::time::timeout(CONNECT_TIMEOUT, declare)
            .await
            .map_err(|_| NoChannel {
                refused: false,
                reason: format!(
                    "RabbitMQ did not say within {CONNECT_TIMEOUT:?} whether the exchange `{}` exists",
                    self.exchange
                ),
                source: "timed out".into(),
            })?;
        answer.map_err(|e| {
            let missing = matches!(
                e.kind(),
                lapin::ErrorKind::ProtocolError(p)
                    if *p.kind() == AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)
            );
            NoChannel {
                refused: missing,
                reason: if missing {
                    format!(
                        "the exchange `{}` does not exist; declare it or fix RabbitSink::exchange",
                        self.exchange
                    )
                } else {
                    format!("cannot check the exchange `{}`", self.exchange)
                },
                source: e.to_string(),
            }
        })
    }

    async fn publish(
        &self,
        channel: &Channel,
        m: &OutboxMessage,
    ) -> Result<PublisherConfirm, SinkError> {
        let too_long =
            |what: &str| SinkError::refused(format!("the {what} is over AMQP's 255 bytes"));
        let routing_key = ShortString::try_new(m.topic.as_str()).map_err(|_| too_long("topic"))?;
        let message_id = ShortString::try_new(m.id.as_str()).map_err(|_| too_long("id"))?;
        let exchange =
            ShortString::try_new(self.exchange.as_str()).map_err(|_| too_long("exchange"))?;
        own_name_refused(m, &[KEY_HEADER])?;
        let mut headers = FieldTable::default();
        for (name, value) in &m.headers {
            let name = ShortString::try_new(name.as_str()).map_err(|_| too_long("header name"))?;
            headers.insert(name, AMQPValue::LongString(value.as_str().into()));
        }
        headers.insert(
            ShortString::try_new(KEY_HEADER).map_err(|_| too_long("header"))?,
            AMQPValue::LongString(m.key.as_str().into()),
        );
        let properties = BasicProperties::default()
            .with_message_id(message_id)
            .with_delivery_mode(PERSISTENT)
            .with_content_type(
                ShortString::try_new("application/json").map_err(|_| too_long("content type"))?,
            )
            .with_headers(headers);
        // Mandatory: a message no queue takes comes back (basic.return)
        // instead of being confirmed and dropped.
        let mandatory = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        channel
            .basic_publish(exchange, routing_key, mandatory, &m.payload, properties)
            .await
            .map_err(|e| {
                SinkError::unavailable("publishing failed: the channel is closed").with_source(e)
            })
    }

    /// What a confirm (or its absence) means for its message.
    fn judge(
        &self,
        m: &OutboxMessage,
        confirm: Result<Result<Confirmation, lapin::Error>, tokio::time::error::Elapsed>,
    ) -> Result<(), SinkError> {
        match confirm {
            Ok(Ok(Confirmation::Ack(None))) => Ok(()),
            Ok(Ok(Confirmation::Ack(Some(ret)))) => Err(SinkError::refused(format!(
                "no queue is bound for routing key `{}` on exchange `{}` ({} {}); bind a queue \
                 or fix the topic",
                m.topic, self.exchange, ret.reply_code, ret.reply_text
            ))),
            Ok(Ok(Confirmation::Nack(_))) => Err(SinkError::unavailable(
                "the broker did not take the message (publisher nack)",
            )),
            Ok(Ok(Confirmation::NotRequested)) => Err(SinkError::unavailable(
                "publisher confirms are off on the channel",
            )),
            Ok(Err(e)) => Err(SinkError::unavailable(
                "the channel closed before the broker confirmed the message",
            )
            .with_source(e)),
            Err(_) => Err(SinkError::unavailable(format!(
                "the broker did not confirm the message within {:?}",
                self.confirm_timeout
            ))),
        }
    }
}

async fn connect(url: &str) -> Result<Connection, String> {
    match tokio::time::timeout(
        CONNECT_TIMEOUT,
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await
    {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "RabbitMQ did not answer within {CONNECT_TIMEOUT:?}"
        )),
    }
}

async fn open_channel(conn: &Connection) -> Result<Channel, String> {
    let open = async {
        let channel = conn.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok::<_, lapin::Error>(channel)
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, open).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!(
            "RabbitMQ did not open a channel within {CONNECT_TIMEOUT:?}"
        )),
    }
}

#[async_trait]
impl Sink for RabbitSink {
    async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
        if batch.is_empty() {
            return Vec::new();
        }
        let channel = match self.channel().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(sink = BROKER, reason = %e.reason, error = %e.source, "no channel to publish on");
                return for_all(batch.len(), e.refused, &e.reason, &e.source);
            }
        };
        // One deadline for the batch: a broker blocking publishers (a
        // resource alarm) holds up the publishes themselves, not only the
        // confirms.
        let deadline = Instant::now() + self.confirm_timeout;
        let mut pending = Vec::with_capacity(batch.len());
        for m in batch {
            let published = match timeout_at(deadline, self.publish(&channel, m)).await {
                Ok(p) => p,
                Err(_) => Err(SinkError::unavailable(format!(
                    "RabbitMQ did not take the message within {:?} (is a resource alarm blocking \
                     publishers?)",
                    self.confirm_timeout
                ))),
            };
            pending.push(published);
        }
        let confirms = pending.into_iter().zip(batch).map(|(p, m)| async move {
            match p {
                Err(e) => Err(e),
                Ok(confirm) => self.judge(m, timeout_at(deadline, confirm).await),
            }
        });
        futures_util::future::join_all(confirms).await
    }

    fn describe(&self) -> String {
        format!("{BROKER} exchange `{}`", self.exchange)
    }

    fn system(&self) -> &'static str {
        "rabbitmq"
    }
}
