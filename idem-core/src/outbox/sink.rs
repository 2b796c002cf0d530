//! What a broker promises the relay: a [`Sink`] publishes and confirms, or
//! says why not ([`SinkError`]).

use super::message::OutboxMessage;
use crate::BoxError;
use async_trait::async_trait;

/// Why a [`Sink`] did not publish a message: the relay parks a refused
/// message (with this reason, for an operator) and retries an unavailable
/// one with backoff.
///
/// ```
/// use idem_core::outbox::SinkError;
///
/// let e = SinkError::refused("no such topic `orders`");
/// assert!(!e.is_retryable()); // parked for an operator
/// assert_eq!(e.to_string(), "the broker refused the message: no such topic `orders`");
/// let e = SinkError::unavailable("connection reset");
/// assert!(e.is_retryable()); // sent again after a backoff
/// ```
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The broker refused this message and would refuse it again (too
    /// large, no such topic or stream, not authorised). The relay parks it
    /// and, to keep the key's order, the key's later messages behind it;
    /// other keys go on. An operator lists, retries or drops parked messages
    /// (`idem outbox list|retry|drop`).
    #[error("the broker refused the message: {reason}")]
    Refused {
        /// What the broker said, and what to change.
        reason: String,
        /// The client's error, when there is one.
        #[source]
        source: Option<BoxError>,
    },
    /// The broker could not be reached or did not confirm in time. The
    /// message stays and is sent again after a backoff (with the same id).
    #[error("could not publish: {reason}")]
    Unavailable {
        /// What failed.
        reason: String,
        /// The client's error, when there is one.
        #[source]
        source: Option<BoxError>,
    },
}

impl SinkError {
    /// A refusal the relay parks.
    ///
    /// ```
    /// let e = idem_core::outbox::SinkError::refused("message too large (2 MB over the 1 MB limit)");
    /// assert!(!e.is_retryable());
    /// ```
    pub fn refused(reason: impl Into<String>) -> SinkError {
        SinkError::Refused {
            reason: reason.into(),
            source: None,
        }
    }

    /// A failure the relay retries.
    ///
    /// ```
    /// let e = idem_core::outbox::SinkError::unavailable("connection refused");
    /// assert!(e.is_retryable());
    /// ```
    pub fn unavailable(reason: impl Into<String>) -> SinkError {
        SinkError::Unavailable {
            reason: reason.into(),
            source: None,
        }
    }

    /// Keeps the client's error as the source.
    ///
    /// ```
    /// use std::error::Error as _;
    /// let io = std::io::Error::other("reset");
    /// let e = idem_core::outbox::SinkError::unavailable("publish").with_source(io);
    /// assert!(e.source().is_some());
    /// ```
    pub fn with_source(mut self, err: impl Into<BoxError>) -> SinkError {
        match &mut self {
            SinkError::Refused { source, .. } | SinkError::Unavailable { source, .. } => {
                *source = Some(err.into());
            }
        }
        self
    }

    /// Whether the relay sends the message again (`Unavailable`) rather
    /// than parking it (`Refused`).
    ///
    /// ```
    /// assert!(idem_core::outbox::SinkError::unavailable("timeout").is_retryable());
    /// ```
    pub fn is_retryable(&self) -> bool {
        matches!(self, SinkError::Unavailable { .. })
    }

    /// The reason alone, as stored beside a parked message.
    ///
    /// ```
    /// assert_eq!(idem_core::outbox::SinkError::refused("no such topic").reason(), "no such topic");
    /// ```
    pub fn reason(&self) -> &str {
        match self {
            SinkError::Refused { reason, .. } | SinkError::Unavailable { reason, .. } => reason,
        }
    }
}

/// A broker the relay publishes to.
///
/// `send` publishes every message and waits until the broker confirmed
/// each (a stream entry written, a JetStream ack, a publisher confirm, a
/// Kafka delivery report), answering one result per message, in order. The
/// relay never puts two messages with the same key in one call, so a sink
/// may publish them all at once; a key's next message waits for the
/// previous one's confirmation. `Ok` means durable on the broker: the relay
/// deletes the row on it.
///
/// Two methods are required, `send` and `describe`; `system` names the
/// broker for traces (feature `otel`) and defaults to `custom`. A sink
/// publishes each message's [`headers`](OutboxMessage::headers) unchanged
/// as the broker's headers: they carry the trace context. The trait is
/// `#[async_trait]`, so an implementation carries the attribute too: idem
/// re-exports it (`#[idem::async_trait]`, or `idem_core::async_trait`), so
/// a sink of your own needs no `async-trait` dependency.
///
/// ```
/// use idem_core::async_trait;
/// use idem_core::outbox::{OutboxMessage, Sink, SinkError};
/// use std::sync::Mutex;
///
/// /// Keeps what it was given (a sink for a test or an in-process hand-off).
/// #[derive(Default)]
/// struct Recorded(Mutex<Vec<OutboxMessage>>);
///
/// #[async_trait]
/// impl Sink for Recorded {
///     async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
///         let mut kept = self.0.lock().unwrap();
///         batch.iter().map(|m| {
///             if m.payload.len() > 1024 {
///                 return Err(SinkError::refused("over 1 KiB"));
///             }
///             kept.push(m.clone());
///             Ok(())
///         }).collect()
///     }
///     fn describe(&self) -> String { "memory".into() }
/// }
/// ```
#[async_trait]
pub trait Sink: Send + Sync {
    /// Publishes `batch` (distinct keys) and waits for the broker's
    /// confirmations: one result per message, in order.
    async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>>;

    /// What the sink publishes to, for logs (`redis-streams 127.0.0.1:6379`).
    fn describe(&self) -> String;

    /// The broker as the OpenTelemetry messaging conventions name it
    /// (`messaging.system`: `kafka`, `rabbitmq`, `aws_sqs`; `nats` and
    /// `redis` where they name none), for the relay's `send` spans.
    fn system(&self) -> &'static str {
        "custom"
    }
}

#[async_trait]
impl<S: Sink + ?Sized> Sink for std::sync::Arc<S> {
    async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
        (**self).send(batch).await
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn system(&self) -> &'static str {
        (**self).system()
    }
}
