//! The broker-agnostic message, and where its idempotency key comes from.

use crate::error::ConsumerError;
use bytes::Bytes;
use idem_core::{Fingerprint, KeyDeriver, KeyPart, validate_key_part};
use std::fmt;
use std::sync::Arc;

/// One delivery of a message, as every adapter hands it to the core.
///
/// Cheap to clone (the payload is shared [`Bytes`]).
///
/// ```
/// use idem_consumer::Message;
/// let m = Message::new(r#"{"order":7}"#)
///     .with_id("order-7")
///     .with_delivery_count(2)
///     .with_source("redis-streams", "orders");
/// assert_eq!((m.id(), m.delivery_count(), m.source()), (Some("order-7"), 2, "orders"));
/// ```
#[derive(Clone, Debug)]
pub struct Message {
    payload: Bytes,
    // Shared, not owned: a handler gets its message by value, and a clone
    // per handler must not copy the id and position again.
    id: Option<Arc<str>>,
    id_error: Option<String>,
    delivery_count: u32,
    broker: &'static str,
    /// `None` until an adapter names it: no allocation for the empty name
    /// of a message about to get one.
    source: Option<Arc<str>>,
    position: Option<Arc<str>>,
    /// The producer's W3C trace context (`traceparent`, `tracestate`).
    traceparent: Option<Arc<str>>,
    tracestate: Option<Arc<str>>,
}

impl Message {
    /// A first delivery of `payload`, without an id.
    pub fn new(payload: impl Into<Bytes>) -> Message {
        Message {
            payload: payload.into(),
            id: None,
            id_error: None,
            delivery_count: 1,
            broker: "custom",
            source: None,
            position: None,
            traceparent: None,
            tracestate: None,
        }
    }

    /// The producer's message id (`Nats-Msg-Id`, AMQP `message_id`, a field…).
    pub fn with_id(mut self, id: impl Into<String>) -> Message {
        self.id = Some(Arc::from(id.into()));
        self
    }

    /// Marks the id as present but unreadable (a header of the wrong type,
    /// bytes that are not UTF-8): the message is dead-lettered with
    /// [`ConsumerError::UnreadableId`] instead of being keyed on something
    /// else.
    pub fn with_unreadable_id(mut self, why: impl Into<String>) -> Message {
        self.id_error = Some(why.into());
        self
    }

    /// How many times the broker has delivered it, this delivery included
    /// (1 for the first). Zero is read as 1.
    pub fn with_delivery_count(mut self, n: u32) -> Message {
        self.delivery_count = n.max(1);
        self
    }

    /// The broker's name and the stream, subject or queue it came from
    /// (recorded in the message's tracing span).
    pub fn with_source(mut self, broker: &'static str, source: impl Into<Arc<str>>) -> Message {
        self.broker = broker;
        self.source = Some(source.into());
        self
    }

    /// Where the delivery sits in its source, for operators reading a
    /// message's span: Kafka's `partition@offset`, a Redis stream entry's
    /// id, a JetStream stream sequence.
    ///
    /// ```
    /// let m = idem_consumer::Message::new("{}").with_position("3@1042");
    /// assert_eq!(m.position(), Some("3@1042"));
    /// ```
    pub fn with_position(mut self, position: impl Into<String>) -> Message {
        self.position = Some(Arc::from(position.into()));
        self
    }

    /// [`with_position`](Message::with_position) from a shared copy: no
    /// `String` made on the way.
    #[cfg_attr(
        not(any(feature = "nats", feature = "redis-streams", feature = "kafka")),
        allow(
            dead_code,
            reason = "only the adapters use it; idem-lambda builds none"
        )
    )]
    pub(crate) fn at_position(mut self, position: Arc<str>) -> Message {
        self.position = Some(position);
        self
    }

    /// A W3C trace-context header the producer sent (`traceparent` or
    /// `tracestate`, matched exactly: NATS header names are case-sensitive,
    /// and idem's sinks write them lower case); other names are ignored.
    /// With the `otel` feature, the message's `process` span links to the
    /// span it names.
    ///
    /// ```
    /// let m = idem_consumer::Message::new("{}")
    ///     .with_trace_header("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    ///     .with_trace_header("x-other", "ignored");
    /// assert!(m.trace_header("traceparent").is_some());
    /// assert_eq!(m.trace_header("x-other"), None);
    /// ```
    pub fn with_trace_header(mut self, name: &str, value: impl Into<Arc<str>>) -> Message {
        match name {
            "traceparent" => self.traceparent = Some(value.into()),
            "tracestate" => self.tracestate = Some(value.into()),
            _ => {}
        }
        self
    }

    /// The trace-context header `name` (`traceparent` or `tracestate`), if
    /// the producer sent it.
    pub fn trace_header(&self, name: &str) -> Option<&str> {
        match name {
            "traceparent" => self.traceparent.as_deref(),
            "tracestate" => self.tracestate.as_deref(),
            _ => None,
        }
    }

    /// The payload bytes.
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// The producer's message id, if any.
    pub fn id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    /// Deliveries so far, this one included.
    pub fn delivery_count(&self) -> u32 {
        self.delivery_count
    }

    /// The adapter's name (`redis-streams`, `nats`, `rabbitmq`, …).
    pub fn broker(&self) -> &'static str {
        self.broker
    }

    /// The stream, subject or queue.
    pub fn source(&self) -> &str {
        self.source.as_deref().unwrap_or("")
    }

    /// Where the delivery sits in its source, if the adapter says.
    pub fn position(&self) -> Option<&str> {
        self.position.as_deref()
    }

    /// The payload parsed as JSON into `T`.
    ///
    /// ```
    /// let m = idem_consumer::Message::new(r#"{"amount":500}"#);
    /// let v: serde_json::Value = m.json().unwrap();
    /// assert_eq!(v["amount"], 500);
    /// ```
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, ConsumerError> {
        serde_json::from_slice(&self.payload)
            .map_err(|e| ConsumerError::Malformed(format!("payload is not the expected JSON: {e}")))
    }
}

type CustomKey = dyn Fn(&Message) -> Result<String, ConsumerError> + Send + Sync;

/// Where a message's idempotency key comes from.
///
/// ```
/// use idem_consumer::{KeySource, Message};
/// use idem_core::KeyDeriver;
///
/// let by_payload = KeySource::Payload(KeyDeriver::new().exclude("/sent_at")?);
/// let a = by_payload.key(&Message::new(r#"{"order":7,"sent_at":1}"#).with_id("a")).unwrap();
/// let b = by_payload.key(&Message::new(r#"{"order":7,"sent_at":2}"#).with_id("b")).unwrap();
/// assert_eq!(a, b); // same order re-published under a new id: one key
///
/// let by_id = KeySource::MessageId;
/// assert_eq!(by_id.key(&Message::new("x").with_id("order-7")).unwrap(), "order-7");
/// assert!(by_id.key(&Message::new("x")).is_err());
/// # Ok::<(), idem_core::DeriveError>(())
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub enum KeySource {
    /// The message id; a message without one is dead-lettered.
    MessageId,
    /// Derived from the payload (canonical JSON, SHA-256); ids are ignored,
    /// so a re-publish under a new id is still a duplicate.
    Payload(KeyDeriver),
    /// The message id when there is one, else derived from the payload
    /// (the default, with no excluded fields).
    IdOrPayload(KeyDeriver),
    /// Your own function (a field of the payload, a header…).
    Custom(Arc<CustomKey>),
}

impl Default for KeySource {
    fn default() -> Self {
        KeySource::IdOrPayload(KeyDeriver::new())
    }
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::MessageId => f.write_str("MessageId"),
            KeySource::Payload(d) => f.debug_tuple("Payload").field(d).finish(),
            KeySource::IdOrPayload(d) => f.debug_tuple("IdOrPayload").field(d).finish(),
            KeySource::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

impl KeySource {
    /// A key from your own function.
    ///
    /// ```
    /// use idem_consumer::{KeySource, Message, ConsumerError};
    /// let ks = KeySource::custom(|m: &Message| {
    ///     let v: serde_json::Value = m.json()?;
    ///     v["order_id"].as_str().map(str::to_owned).ok_or_else(|| ConsumerError::Malformed("no order_id".into()))
    /// });
    /// assert_eq!(ks.key(&Message::new(r#"{"order_id":"o-1"}"#)).unwrap(), "o-1");
    /// ```
    pub fn custom(
        f: impl Fn(&Message) -> Result<String, ConsumerError> + Send + Sync + 'static,
    ) -> KeySource {
        KeySource::Custom(Arc::new(f))
    }

    /// The key of `msg`, checked to be usable as an idem key.
    pub fn key(&self, msg: &Message) -> Result<String, ConsumerError> {
        if let Some(why) = &msg.id_error {
            return Err(ConsumerError::UnreadableId(why.clone()));
        }
        let key = match self {
            KeySource::MessageId => msg
                .id
                .as_deref()
                .ok_or(ConsumerError::MissingId)?
                .to_owned(),
            KeySource::Payload(d) => d.derive(&msg.payload)?,
            KeySource::IdOrPayload(d) => match &msg.id {
                // Not `to_string`: no formatter for a copy.
                Some(id) => String::from(&**id),
                None => d.derive(&msg.payload)?,
            },
            KeySource::Custom(f) => f(msg)?,
        };
        validate_key_part(KeyPart::Key, &key).map_err(ConsumerError::InvalidId)?;
        Ok(key)
    }

    /// [`key`](KeySource::key) and [`fingerprint`](KeySource::fingerprint)
    /// of one message, the payload's digest computed once when the key is
    /// derived from it (it is then the fingerprint too): parsing, canonical
    /// form and SHA-256 are most of a derived key's cost.
    pub(crate) fn key_and_fingerprint(
        &self,
        msg: &Message,
    ) -> (Result<String, ConsumerError>, Fingerprint) {
        let deriver = match self {
            KeySource::Payload(d) => Some(d),
            KeySource::IdOrPayload(d) if msg.id.is_none() => Some(d),
            _ => None,
        };
        match deriver {
            Some(d) if msg.id_error.is_none() => match d.digest(&msg.payload) {
                Ok(digest) => {
                    let key = KeyDeriver::key_of_digest(&digest);
                    let key = validate_key_part(KeyPart::Key, &key)
                        .map(|()| key)
                        .map_err(ConsumerError::InvalidId);
                    (key, Fingerprint::from_sha256(digest))
                }
                Err(e) => (Err(e.into()), Fingerprint::of_bytes(&msg.payload)),
            },
            _ => (self.key(msg), self.fingerprint(msg)),
        }
    }

    /// The payload's fingerprint: SHA-256 of its canonical JSON (minus the
    /// excluded fields) when it is JSON, of its bytes otherwise. A reused id
    /// with another payload is then refused instead of replayed.
    pub(crate) fn fingerprint(&self, msg: &Message) -> Fingerprint {
        let deriver = match self {
            KeySource::Payload(d) | KeySource::IdOrPayload(d) => Some(d),
            _ => None,
        };
        let digest = match deriver {
            Some(d) => d.digest(&msg.payload).ok(),
            None => KeyDeriver::new().digest(&msg.payload).ok(),
        };
        match digest {
            Some(d) => Fingerprint::from_sha256(d),
            None => Fingerprint::of_bytes(&msg.payload),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The payload digested once gives what `key` and `fingerprint` give
    /// apart, for every key source and payload kind.
    #[test]
    fn key_and_fingerprint_agree_with_key_then_fingerprint() {
        let excluding = KeyDeriver::new().exclude("/sent_at").unwrap();
        let sources = [
            KeySource::MessageId,
            KeySource::Payload(KeyDeriver::new()),
            KeySource::Payload(excluding.clone()),
            KeySource::IdOrPayload(KeyDeriver::new()),
            KeySource::IdOrPayload(excluding),
            KeySource::Custom(Arc::new(|m: &Message| {
                Ok(format!("c-{}", m.payload().len()))
            })),
        ];
        let msgs = [
            Message::new(r#"{"order":"o-1","sent_at":3}"#),
            Message::new(r#"{"order":"o-1","sent_at":3}"#).with_id("m-1"),
            Message::new("not json"),
            Message::new("not json").with_id("m-2"),
            Message::new(r#"{"a":1}"#).with_unreadable_id("bad header"),
        ];
        for source in &sources {
            for msg in &msgs {
                let (key, fp) = source.key_and_fingerprint(msg);
                let apart = source.key(msg);
                assert_eq!(
                    key.as_ref().map_err(ToString::to_string),
                    apart.as_ref().map_err(ToString::to_string),
                    "{source:?} {msg:?}"
                );
                assert_eq!(fp, source.fingerprint(msg), "{source:?} {msg:?}");
            }
        }
    }
}
