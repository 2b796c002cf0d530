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
/// let m = OutboxMessage::new(
///     message_id("idem:orders:create:o-1", "orders.created"),
///     "orders.created",
///     "o-1",
///     bytes::Bytes::from_static(br#"{"order":"o-1"}"#),
/// );
/// // A re-send carries the same id, so the consumer runs its effect once.
/// let mut again = m.clone();
/// again.attempts = 1;
/// assert_eq!(again.id, m.id);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
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
    /// Headers stored with the message and published with it unchanged,
    /// as the broker's headers (Kafka and NATS headers, AMQP headers,
    /// Redis Streams fields, SQS message attributes). idem writes the W3C
    /// trace context here ([`TRACE_HEADERS`]) when the `otel` feature is
    /// on and the staging call was traced; empty otherwise.
    pub headers: Vec<(String, String)>,
}

/// The names of the headers that carry a message's W3C trace context
/// (`traceparent`, `tracestate`; <https://www.w3.org/TR/trace-context/>),
/// lower case as the recommendation writes them. Sinks publish them under
/// these names, and consumers read them under these names only (NATS
/// header names are case-sensitive).
pub const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

impl OutboxMessage {
    /// A message on its first send, without headers.
    ///
    /// ```
    /// let m = idem_core::outbox::OutboxMessage::new("id-1", "orders.created", "o-1", "{}");
    /// assert_eq!((m.attempts, m.headers.len()), (0, 0));
    /// ```
    pub fn new(
        id: impl Into<String>,
        topic: impl Into<String>,
        key: impl Into<String>,
        payload: impl Into<Bytes>,
    ) -> OutboxMessage {
        OutboxMessage {
            id: id.into(),
            topic: topic.into(),
            key: key.into(),
            payload: payload.into(),
            attempts: 0,
            headers: Vec::new(),
        }
    }

    /// The same message with `headers` (as a relay reads them back from
    /// its store).
    ///
    /// ```
    /// let m = idem_core::outbox::OutboxMessage::new("id-1", "t", "k", "{}")
    ///     .with_headers(vec![("traceparent".into(), "00-…".into())]);
    /// assert_eq!(m.header("traceparent"), Some("00-…"));
    /// ```
    pub fn with_headers(mut self, headers: Vec<(String, String)>) -> OutboxMessage {
        self.headers = headers;
        self
    }

    /// The same message after `attempts` failed sends.
    ///
    /// ```
    /// let m = idem_core::outbox::OutboxMessage::new("id-1", "t", "k", "{}").with_attempts(2);
    /// assert_eq!(m.attempts, 2);
    /// ```
    pub fn with_attempts(mut self, attempts: u32) -> OutboxMessage {
        self.attempts = attempts;
        self
    }

    /// The value of header `name` (exact name; the last, if repeated).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
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
