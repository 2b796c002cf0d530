//! What can go wrong around a message, before or beside its handler.

use idem_core::{DeriveError, KeyError};
use std::fmt;
use std::sync::Arc;

/// Errors of the consumer core and its adapters.
///
/// Message-level errors (bad id, payload that cannot be keyed) never stop a
/// consumer: they become a [`Decision::DeadLetter`](crate::Decision) for that
/// message, with this error as the reason. Broker-level errors are returned by
/// the adapters' `poll` and `run`.
///
/// ```
/// use idem_consumer::ConsumerError;
/// let e = ConsumerError::MissingId;
/// assert!(e.to_string().contains("message id"));
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The key source needs a message id and the message has none.
    #[error(
        "the message has no message id and keys come from message ids; have the producer set one, \
         or use `KeySource::IdOrPayload` to derive keys from the payload"
    )]
    MissingId,

    /// The message id cannot be an idempotency key (empty, too long, control characters).
    #[error("the message id cannot be used as an idempotency key: {0}")]
    InvalidId(#[source] KeyError),

    /// A header or field that should hold the id has the wrong type or encoding.
    #[error("the message id is unreadable: {0}; producers must send it as a UTF-8 string")]
    UnreadableId(String),

    /// No key could be derived from the payload.
    #[error("no idempotency key can be derived from the payload: {0}")]
    Derive(#[from] DeriveError),

    /// The payload is missing or malformed at the transport level (for
    /// example a Redis stream entry without its payload field).
    #[error("malformed message: {0}")]
    Malformed(String),

    /// A broker command failed (connection lost, permission, unknown stream).
    #[error(
        "{broker} {op} failed: {reason}; check that the broker is up and the consumer's settings match it"
    )]
    Broker {
        /// Which broker adapter.
        broker: &'static str,
        /// The operation that failed (`fetch`, `ack`, `nack`, `dead_letter`, …).
        op: &'static str,
        /// What the broker or its client said.
        reason: String,
        /// The broker client's own error, when there is one
        /// ([`ConsumerError::broker_error`]): its kind and its causes.
        #[source]
        source: Option<BrokerSource>,
    },

    /// The adapter was configured in a way that cannot work.
    #[error("invalid consumer configuration: {0}")]
    Config(String),
}

impl ConsumerError {
    /// A failed broker command, for adapters (your own included).
    ///
    /// ```
    /// let e = idem_consumer::ConsumerError::broker("sqs", "receive", "connection refused");
    /// assert!(e.to_string().starts_with("sqs receive failed: connection refused"));
    /// ```
    pub fn broker(broker: &'static str, op: &'static str, e: impl std::fmt::Display) -> Self {
        ConsumerError::Broker {
            broker,
            op,
            reason: e.to_string(),
            source: None,
        }
    }

    /// A broker error that keeps the client's own error as its
    /// [`source`](std::error::Error::source) (a [`BrokerSource`]), so a
    /// caller can downcast it (to `lapin::Error`, `redis::RedisError`, …)
    /// and walk its causes.
    ///
    /// ```
    /// use idem_consumer::{BrokerSource, ConsumerError};
    /// use std::error::Error as _;
    /// let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
    /// let e = ConsumerError::broker_error("sqs", "receive", io);
    /// assert!(e.to_string().starts_with("sqs receive failed: connection refused"));
    /// let cause = e.source().and_then(|s| s.downcast_ref::<BrokerSource>()).unwrap();
    /// assert!(cause.downcast_ref::<std::io::Error>().is_some());
    /// ```
    pub fn broker_error(
        broker: &'static str,
        op: &'static str,
        e: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        ConsumerError::Broker {
            broker,
            op,
            reason: e.to_string(),
            source: Some(BrokerSource(Arc::new(e))),
        }
    }
}

/// A broker client's own error inside [`ConsumerError::Broker`], shared so
/// that the error stays `Clone`. It displays as the client's error, its
/// [`source`](std::error::Error::source) is the client error's, and
/// [`downcast_ref`](BrokerSource::downcast_ref) reaches the client's type.
#[derive(Debug, Clone)]
pub struct BrokerSource(Arc<dyn std::error::Error + Send + Sync>);

impl BrokerSource {
    /// The client's error.
    ///
    /// ```
    /// let e = idem_consumer::ConsumerError::broker_error("x", "fetch", std::fmt::Error);
    /// # let _ = e;
    /// ```
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }

    /// The client's error as `T`, if it is one.
    ///
    /// ```
    /// use idem_consumer::{BrokerSource, ConsumerError};
    /// use std::error::Error as _;
    /// let e = ConsumerError::broker_error("x", "fetch", std::fmt::Error);
    /// let cause = e.source().and_then(|s| s.downcast_ref::<BrokerSource>()).unwrap();
    /// assert!(cause.downcast_ref::<std::fmt::Error>().is_some());
    /// ```
    pub fn downcast_ref<T: std::error::Error + 'static>(&self) -> Option<&T> {
        self.0.downcast_ref::<T>()
    }
}

impl From<Box<dyn std::error::Error + Send + Sync>> for BrokerSource {
    fn from(e: Box<dyn std::error::Error + Send + Sync>) -> Self {
        BrokerSource(Arc::from(e))
    }
}

impl fmt::Display for BrokerSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for BrokerSource {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}
