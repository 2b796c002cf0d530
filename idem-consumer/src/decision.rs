//! What to tell the broker about a message, and why.

use std::fmt;
use std::time::Duration;

/// What the adapter tells the broker about one message.
///
/// | idem says | decision |
/// | --- | --- |
/// | `Executed`, `Replayed`, `Recovered` (and the body-ran outcomes `LeaseLost`, `NotStored`, `NotConfirmed`, `Unprotected`: a redelivery could only run the body again, and `require_final` does not apply) | [`Ack`](Decision::Ack) |
/// | `InProgress { retry_after }` | [`Nack`](Decision::Nack) after `retry_after` (or, with `.wait(d)`, the first run's result and `Ack`) |
/// | store unavailable (fail-closed, nothing ran) | `Nack` with backoff |
/// | handler `Err`, retryable | key released, failure counted in idem's store, `Nack` with backoff; `DeadLetter` at `max_failures` failures |
/// | a delivery over the `max_deliveries` valve whose work is not done | `DeadLetter`, handler not run |
/// | handler `Err`, permanent | [`DeadLetter`](Decision::DeadLetter) |
/// | `FingerprintMismatch`, unkeyable message | `DeadLetter` |
///
/// ```
/// use idem_consumer::Decision;
/// assert!(Decision::Ack.is_ack());
/// assert_eq!(Decision::Ack.to_string(), "ack");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Decision {
    /// Done (or a duplicate of done work): remove it from the broker.
    Ack,
    /// Not done, nothing left half-done by this delivery: deliver it again
    /// after `delay`.
    Nack {
        /// How long the broker should wait before the next delivery.
        delay: Duration,
    },
    /// Never going to succeed as it is: move it aside (dead-letter stream,
    /// exchange or subject, or terminate) for a human.
    DeadLetter {
        /// Why.
        reason: DeadLetterReason,
    },
}

impl Decision {
    /// True for [`Decision::Ack`].
    pub fn is_ack(&self) -> bool {
        matches!(self, Decision::Ack)
    }

    /// True for [`Decision::Nack`].
    pub fn is_nack(&self) -> bool {
        matches!(self, Decision::Nack { .. })
    }

    /// True for [`Decision::DeadLetter`].
    pub fn is_dead_letter(&self) -> bool {
        matches!(self, Decision::DeadLetter { .. })
    }

    /// `"ack"`, `"nack"` or `"dead_letter"`, as recorded in tracing spans.
    pub fn as_str(&self) -> &'static str {
        match self {
            Decision::Ack => "ack",
            Decision::Nack { .. } => "nack",
            Decision::DeadLetter { .. } => "dead_letter",
        }
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decision::Ack => f.write_str("ack"),
            Decision::Nack { delay } => write!(f, "nack (redeliver in {} ms)", delay.as_millis()),
            Decision::DeadLetter { reason } => write!(f, "dead_letter ({reason})"),
        }
    }
}

/// Why a message was dead-lettered. Its `Display` is what adapters write
/// next to the dead-lettered message.
///
/// ```
/// use idem_consumer::DeadLetterReason;
/// let r = DeadLetterReason::MaxDeliveries { deliveries: 5, last_error: "timeout".into() };
/// assert_eq!(r.kind(), "max_deliveries");
/// assert!(r.to_string().contains("timeout"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// The handler failed with an error classified as permanent.
    Permanent(String),
    /// The handler ran and failed with retryable errors as many times as
    /// [`Consumer::max_failures`](crate::Consumer::max_failures) allows.
    /// Counted per key in idem's store: deliveries that never ran the
    /// handler (a consumer killed before it, an in-flight duplicate) do
    /// not count.
    MaxFailures {
        /// Handler runs that failed for this key, this one included.
        failures: u32,
        /// The last error.
        last_error: String,
    },
    /// The broker delivered the message more often than the safety valve
    /// [`Consumer::max_deliveries`](crate::Consumer::max_deliveries)
    /// allows, whatever the handler did: a loop that never reaches the
    /// handler (a consumer that crashes on it every time). A message whose
    /// work is done is still acked at any delivery count.
    MaxDeliveries {
        /// Deliveries so far, this one included.
        deliveries: u32,
        /// Why this delivery did not run.
        last_error: String,
    },
    /// The key was used before by a message with another payload: two
    /// different messages claim one id.
    FingerprintMismatch,
    /// The message cannot be keyed or read (no id, bad id, payload not JSON…).
    BadMessage(String),
    /// idem could not store or read this message's result (record
    /// unreadable, result too large or not serializable).
    Store(String),
}

impl DeadLetterReason {
    /// A stable machine-readable name: `permanent`, `max_failures`,
    /// `max_deliveries`, `fingerprint_mismatch`, `bad_message` or `store`.
    pub fn kind(&self) -> &'static str {
        match self {
            DeadLetterReason::Permanent(_) => "permanent",
            DeadLetterReason::MaxFailures { .. } => "max_failures",
            DeadLetterReason::MaxDeliveries { .. } => "max_deliveries",
            DeadLetterReason::FingerprintMismatch => "fingerprint_mismatch",
            DeadLetterReason::BadMessage(_) => "bad_message",
            DeadLetterReason::Store(_) => "store",
        }
    }
}

impl DeadLetterReason {
    /// How many times the handler ran and failed for this message's key,
    /// when the reason counts them.
    ///
    /// ```
    /// use idem_consumer::DeadLetterReason;
    /// let r = DeadLetterReason::MaxFailures { failures: 5, last_error: "timeout".into() };
    /// assert_eq!(r.failures(), Some(5));
    /// assert_eq!(DeadLetterReason::FingerprintMismatch.failures(), None);
    /// ```
    pub fn failures(&self) -> Option<u32> {
        match self {
            DeadLetterReason::MaxFailures { failures, .. } => Some(*failures),
            _ => None,
        }
    }

    /// What every adapter writes beside a dead letter (as headers, stream
    /// fields or message properties), so that a reader can tell a poison
    /// message from a delivery loop: `idem-reason` (this reason's text on
    /// one line), `idem-kind` ([`kind`](DeadLetterReason::kind)),
    /// `idem-deliveries` (the broker's count, this delivery included) and,
    /// when counted, `idem-failures`.
    ///
    /// ```
    /// use idem_consumer::DeadLetterReason;
    /// let r = DeadLetterReason::MaxFailures { failures: 5, last_error: "timeout\nretry".into() };
    /// let f = r.fields(7);
    /// assert_eq!(f[1], ("idem-kind", "max_failures".to_owned()));
    /// assert_eq!(f[2], ("idem-deliveries", "7".to_owned()));
    /// assert_eq!(f[3], ("idem-failures", "5".to_owned()));
    /// assert!(!f[0].1.contains('\n'));
    /// ```
    pub fn fields(&self, deliveries: u32) -> Vec<(&'static str, String)> {
        // Header values (NATS, RabbitMQ, Kafka) cannot hold line breaks.
        let text = self.to_string().replace(['\r', '\n'], " ");
        let mut fields = vec![
            (dead_letter_field::REASON, text),
            (dead_letter_field::KIND, self.kind().to_owned()),
            (dead_letter_field::DELIVERIES, deliveries.to_string()),
        ];
        if let Some(n) = self.failures() {
            fields.push((dead_letter_field::FAILURES, n.to_string()));
        }
        fields
    }
}

/// The names of the fields written beside every dead letter
/// ([`DeadLetterReason::fields`]), on every broker.
pub mod dead_letter_field {
    /// The reason, as text on one line.
    pub const REASON: &str = "idem-reason";
    /// [`DeadLetterReason::kind`](crate::DeadLetterReason::kind).
    pub const KIND: &str = "idem-kind";
    /// The broker's delivery count, this delivery included.
    pub const DELIVERIES: &str = "idem-deliveries";
    /// Handler runs that failed for the key, when counted.
    pub const FAILURES: &str = "idem-failures";
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeadLetterReason::Permanent(e) => write!(f, "permanent error: {e}"),
            DeadLetterReason::MaxFailures {
                failures,
                last_error,
            } => write!(
                f,
                "the handler failed {failures} times; last error: {last_error}"
            ),
            DeadLetterReason::MaxDeliveries {
                deliveries,
                last_error,
            } => write!(
                f,
                "gave up after {deliveries} deliveries; last error: {last_error}"
            ),
            DeadLetterReason::FingerprintMismatch => f.write_str(
                "another message with a different payload already used this idempotency key",
            ),
            DeadLetterReason::BadMessage(e) => write!(f, "bad message: {e}"),
            DeadLetterReason::Store(e) => write!(f, "result not storable or readable: {e}"),
        }
    }
}

/// Whether a handler error is worth another delivery.
///
/// ```
/// use idem_consumer::ErrorClass;
/// assert_eq!(ErrorClass::from_retryable(false), ErrorClass::Permanent);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// Transient (timeout, 503, lock contention): nack and try again.
    Retryable,
    /// Will fail the same way every time (validation, unknown customer):
    /// dead-letter now.
    Permanent,
}

impl ErrorClass {
    /// `Retryable` when `retryable` is true, else `Permanent`.
    pub fn from_retryable(retryable: bool) -> ErrorClass {
        if retryable {
            ErrorClass::Retryable
        } else {
            ErrorClass::Permanent
        }
    }
}

/// Classifies a handler's errors. Implemented for every
/// `Fn(&E) -> ErrorClass`, for [`AllRetryable`] (the default) and for
/// [`ByTrait`] (uses the error type's own [`ClassifyError`]).
///
/// ```
/// use idem_consumer::{Classify, ErrorClass};
/// let c = |e: &String| ErrorClass::from_retryable(e.starts_with("timeout"));
/// assert_eq!(c.classify(&"bad amount".to_string()), ErrorClass::Permanent);
/// ```
pub trait Classify<E>: Send + Sync {
    /// The class of `error`.
    fn classify(&self, error: &E) -> ErrorClass;
}

impl<E, F> Classify<E> for F
where
    F: Fn(&E) -> ErrorClass + Send + Sync,
{
    fn classify(&self, error: &E) -> ErrorClass {
        self(error)
    }
}

/// The default classifier: every handler error is retryable, so nothing is
/// dead-lettered before `max_deliveries` (a transient failure mistaken for
/// a permanent one would lose the message to the dead-letter queue at once).
///
/// ```
/// use idem_consumer::{AllRetryable, Classify, Consumer, ErrorClass, Message};
/// use idem_core::{Idempotency, MemoryStore};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// assert_eq!(AllRetryable.classify(&"card declined"), ErrorClass::Retryable);
/// // A new consumer classifies this way until `.classify(..)` says otherwise.
/// let consumer = Consumer::new(Idempotency::builder(MemoryStore::new()).build(), "orders.charge");
/// let msg = Message::new("{}").with_id("m-1");
/// let handled = consumer.handle(&msg, &|_m: Message| async { Err::<(), _>("card declined") }).await;
/// assert!(handled.decision.is_nack()); // delivered again, not dead-lettered
/// # });
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct AllRetryable;

impl<E> Classify<E> for AllRetryable {
    fn classify(&self, _: &E) -> ErrorClass {
        ErrorClass::Retryable
    }
}

/// An error type that knows its own class; use it with
/// `Consumer::classify(ByTrait)`.
///
/// ```
/// use idem_consumer::{Classify, ClassifyError, ByTrait, ErrorClass};
/// enum PayError { Declined, Timeout }
/// impl ClassifyError for PayError {
///     fn class(&self) -> ErrorClass {
///         match self { PayError::Declined => ErrorClass::Permanent, PayError::Timeout => ErrorClass::Retryable }
///     }
/// }
/// assert_eq!(ByTrait.classify(&PayError::Declined), ErrorClass::Permanent);
/// ```
pub trait ClassifyError {
    /// The class of this error.
    fn class(&self) -> ErrorClass;
}

/// Classifier that asks the error itself, through [`ClassifyError`].
///
/// ```
/// use idem_consumer::{ByTrait, ClassifyError, Consumer, ErrorClass, Message};
/// use idem_core::{Idempotency, MemoryStore};
/// #[derive(Debug)]
/// enum PayError { Declined, Timeout }
/// impl std::fmt::Display for PayError {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { write!(f, "{self:?}") }
/// }
/// impl ClassifyError for PayError {
///     fn class(&self) -> ErrorClass { ErrorClass::from_retryable(matches!(self, PayError::Timeout)) }
/// }
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MemoryStore::new()).build();
/// let consumer = Consumer::new(idem, "orders.charge").classify(ByTrait);
/// let msg = Message::new("{}").with_id("m-1");
/// let handled = consumer.handle(&msg, &|_m: Message| async { Err::<(), _>(PayError::Declined) }).await;
/// assert!(handled.decision.is_dead_letter()); // permanent: no second delivery
/// # });
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct ByTrait;

impl<E: ClassifyError> Classify<E> for ByTrait {
    fn classify(&self, error: &E) -> ErrorClass {
        error.class()
    }
}
