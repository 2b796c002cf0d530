//! Outbox sinks: the brokers an outbox relay publishes through, one per
//! consumer adapter of this crate, each behind the adapter's feature.
//!
//! A body writes its outgoing messages in the transaction that stores its
//! result; a relay (idem-postgres) later hands them to a [`Sink`] and
//! deletes each only once the sink answered `Ok`, which here always means
//! **the broker confirmed the message durable**: a stream entry written, a
//! JetStream ack, a publisher confirm, a Kafka delivery report. A sink
//! publishes a whole batch at once (the relay never puts two messages with
//! one key in a batch) and answers one result per message, in order.
//!
//! Every message carries its [`OutboxMessage::id`] where the matching
//! adapter of this crate reads the message id **by default**, so an idem
//! [`Consumer`](crate::Consumer) on the other side runs its effect once
//! however often the relay re-sends:
//!
//! | sink | feature | where the id goes | also |
//! | --- | --- | --- | --- |
//! | [`RedisStreamsSink`] | `redis-streams` | field `id` (`XADD <topic> * id … payload … key …`) | `MAXLEN ~`; another stream than the topic: `stream_for` |
//! | [`NatsSink`] | `nats` | header `Nats-Msg-Id` | header `Idem-Outbox-Key` |
//! | [`RabbitSink`] | `rabbitmq` | property `message_id` | header `idem-outbox-key`, persistent, `mandatory` |
//! | [`KafkaSink`] | `kafka` | header `idempotency-key` | record key = the message key |
//! | [`SqsSink`] | `sqs` | message attribute `idem-id` | attribute `idem-outbox-key`; FIFO: `MessageGroupId` = key, `MessageDeduplicationId` = id |
//!
//! Every sink also publishes each message's
//! [`headers`](OutboxMessage::headers) unchanged as the broker's headers,
//! whatever the features of the relay's build (they carry the W3C trace
//! context when the producer was built with `otel`). Where headers share a
//! namespace with what the sink writes itself (a Redis Streams entry's
//! fields `id`, `payload`, `key`, `topic`; the AMQP header
//! `idem-outbox-key`; the SQS attributes `idem-id` and `idem-outbox-key`),
//! a header so named would overwrite it or be overwritten: the message is
//! `Refused`, nothing of it published.
//!
//! Failures are sorted for the relay: [`SinkError::Refused`] when the
//! broker would refuse the message again (too large, no stream or topic
//! for it, unroutable, not authorised), which the relay parks for an
//! operator; [`SinkError::Unavailable`] for everything that may pass on
//! its own (connection lost, timeout, a broker nack), which the relay
//! retries with the same id. Each sink's documentation lists its cases.
//!
//! ```no_run
//! # #[cfg(feature = "redis-streams")]
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_consumer::outbox::{OutboxMessage, RedisStreamsSink, Sink};
//!
//! let sink = RedisStreamsSink::connect("redis://127.0.0.1/").await?.max_len(100_000);
//! let batch = [OutboxMessage::new(
//!     idem_core::outbox::message_id("idem:orders:create:o-1", "orders.created"),
//!     "orders.created",
//!     "o-1",
//!     r#"{"order":"o-1"}"#,
//! )];
//! for result in sink.send(&batch).await {
//!     result?; // Refused: park it; Unavailable: try again later
//! }
//! # Ok(()) }
//! ```

pub use idem_core::outbox::{OutboxMessage, Sink, SinkError, async_trait};

#[cfg(feature = "kafka")]
mod kafka;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "rabbitmq")]
mod rabbitmq;
#[cfg(feature = "redis-streams")]
mod redis_streams;
#[cfg(feature = "sqs")]
mod sqs;

#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use kafka::KafkaSink;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub use nats::NatsSink;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub use rabbitmq::RabbitSink;
#[cfg(feature = "redis-streams")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis-streams")))]
pub use redis_streams::RedisStreamsSink;
#[cfg(feature = "sqs")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqs")))]
pub use sqs::{DEFAULT_MAX_MESSAGE_BYTES, KEY_ATTRIBUTE, SqsSink};

/// The same failure for every message of a batch (a connection lost
/// before any answer): `SinkError` is not `Clone`, so each gets its own,
/// with the client's error as text.
#[allow(dead_code)] // unused without any broker feature
fn for_all(
    n: usize,
    refused: bool,
    reason: &str,
    source: &dyn std::fmt::Display,
) -> Vec<Result<(), SinkError>> {
    (0..n)
        .map(|_| {
            let e = if refused {
                SinkError::refused(reason)
            } else {
                SinkError::unavailable(reason)
            };
            Err(e.with_source(source.to_string()))
        })
        .collect()
}

/// Refuses a message with a header named like something the sink writes
/// itself (`own`: its id, key, payload… under the broker's names): the
/// broker keeps one value per name, or the reader does, so the header
/// would overwrite the sink's own (the id a consumer keys on) or be
/// overwritten by it, and dropping it instead would not publish the
/// headers unchanged. Names match exactly, as every broker here compares
/// them.
#[allow(dead_code)] // unused without a broker feature that publishes headers
fn own_name_refused(m: &OutboxMessage, own: &[&str]) -> Result<(), SinkError> {
    match m
        .headers
        .iter()
        .find(|(name, _)| own.contains(&name.as_str()))
    {
        None => Ok(()),
        Some((name, _)) => Err(SinkError::refused(format!(
            "the message has a header `{name}`, a name the sink writes itself ({}); rename the \
             header",
            own.join(", ")
        ))),
    }
}

/// Whether `s` would break a header or protocol line: ids and keys come
/// from the database, where nothing stops a newline.
#[allow(dead_code)]
fn has_control(s: &str) -> bool {
    s.chars().any(char::is_control)
}
