//! An outgoing message, and how its id is made: what every store writes and
//! every relay hands to a sink.

use bytes::Bytes;
use sha2::{Digest, Sha256};

/// Longest message name (a topic plus its ordinal in the body) and message
/// key, in bytes: both are written into broker headers and keys, where
/// brokers cap far below what a database column would take.
pub const MAX_OUTBOX_FIELD: usize = 512;

/// One outgoing message, as a relay hands it to a [`Sink`](super::Sink).
///
/// ```
/// use idem_core::outbox::{message_id, OutboxMessage};
///
/// let m = OutboxMessage {
///     id: message_id("idem:orders:create:o-1", "orders.created"),
///     topic: "orders.created".into(),
///     key: "o-1".into(),
///     payload: bytes::Bytes::from_static(br#"{"order":"o-1"}"#),
///     attempts: 0,
/// };
/// // A re-send carries the same id, so the consumer runs its effect once.
/// let again = OutboxMessage { attempts: 1, ..m.clone() };
/// assert_eq!(again.id, m.id);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    /// Deterministic id ([`message_id`]): the same for every re-send, so the
    /// consumer on the other side de-duplicates on it. Sinks put it in the
    /// broker's own id field (`Nats-Msg-Id`, AMQP `message_id`, the Kafka
    /// `idempotency-key` header, the stream entry's `id` field).
    pub id: String,
    /// Where it goes: a stream, subject, topic or routing key, as the sink
    /// interprets it.
    pub topic: String,
    /// The ordering key: messages with one key are published in the order
    /// they were committed, one at a time (a Kafka record key, say).
    pub key: String,
    /// The serialized message (JSON as written by `publish`).
    pub payload: Bytes,
    /// How many earlier attempts failed (0 on the first send).
    pub attempts: u32,
}

/// The id of the message a call publishes: the first 16 bytes of
/// SHA-256 over the call's record key (namespace, scope and key, as the
/// store sees it) and the message's name (its topic, then `#1`, `#2`… for
/// further messages to the same topic in one body), as 32 hex digits.
///
/// The same call publishing the same message always gets the same id, in
/// any process, so a re-sent message is recognised downstream.
///
/// ```
/// let a = idem_core::outbox::message_id("idem:orders:create:o-1", "orders.created");
/// assert_eq!(a.len(), 32);
/// assert_eq!(a, idem_core::outbox::message_id("idem:orders:create:o-1", "orders.created"));
/// assert_ne!(a, idem_core::outbox::message_id("idem:orders:create:o-1", "orders.created#1"));
/// ```
pub fn message_id(record_key: &str, name: &str) -> String {
    let mut h = Sha256::new();
    h.update(record_key.as_bytes());
    // A separator no key contains (keys refuse control characters), so
    // ("a", "bc") and ("ab", "c") never meet.
    h.update([0u8]);
    h.update(name.as_bytes());
    hex::encode(&h.finalize()[..16])
}
