//! What can go wrong around a message, before or beside its handler.

use idem_core::{DeriveError, KeyError};

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
        }
    }
}
