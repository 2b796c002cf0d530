//! The client side, for tonic clients: one idempotency key per logical
//! operation, made before the first attempt and sent on every retry, with
//! the same key grammar (`idem-key`) and retry policy ([`RetryPolicy`]) as
//! idem's HTTP client, so a retried RPC can never run twice.
//!
//! ```no_run
//! use idem_grpc::client::{Operation, RetryPolicy};
//! use std::time::Duration;
//! # mod pb { #[derive(Clone, PartialEq, prost::Message)] pub struct CreatePaymentRequest { #[prost(string, tag = "1")] pub request_id: String } }
//! # async fn create_payment(_: tonic::Request<pb::CreatePaymentRequest>) -> Result<tonic::Response<()>, tonic::Status> { Ok(tonic::Response::new(())) }
//!
//! # async fn demo() -> Result<(), idem_grpc::client::CallError> {
//! let op = Operation::new() // a fresh UUIDv4 key
//!     .retry(RetryPolicy::default().max_retries(4).initial_backoff(Duration::from_millis(100)));
//! let message = pb::CreatePaymentRequest { request_id: op.key().to_owned() }; // AIP-155
//! // Each attempt sends the same key: in the metadata (`op.request`) and,
//! // here, in the message too.
//! let reply = op.call(|| create_payment(op.request(message.clone()))).await?;
//! println!("{} attempts, replayed: {}", reply.attempts, reply.replayed);
//! # Ok(()) }
//! ```

use crate::{IDEM_ERROR, IDEMPOTENT_REPLAYED, RETRY_PUSHBACK};
use std::fmt;
use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;
use tonic::Code;
use tonic::metadata::{MetadataMap, MetadataValue};

pub use idem_key::{KeyError, RetryPolicy};

/// One logical operation: its key, and how it is retried.
///
/// ```
/// use idem_grpc::client::Operation;
/// let a = Operation::new();
/// let b = Operation::new();
/// assert_ne!(a.key(), b.key()); // one key per operation
/// let mine = Operation::with_key("order-7-payment").unwrap(); // your own key
/// assert_eq!(mine.key(), "order-7-payment");
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct Operation {
    key: String,
    /// The metadata value: the key in the grammar's wire form (quoted when
    /// it must be), made once.
    wire: MetadataValue<tonic::metadata::Ascii>,
    policy: RetryPolicy,
}

impl Default for Operation {
    fn default() -> Self {
        Operation::new()
    }
}

impl Operation {
    /// An operation with a fresh UUIDv4 key and the default [`RetryPolicy`]
    /// (2 retries, 0.5 s doubling to 5 s with jitter, 30 s deadline).
    ///
    /// ```
    /// let op = idem_grpc::client::Operation::new();
    /// assert_eq!(op.key().len(), 36);
    /// ```
    pub fn new() -> Operation {
        let key = uuid::Uuid::new_v4().to_string();
        // Reached by no input: a hyphenated UUID is 36 hex digits and
        // hyphens, a bare token of the grammar and a valid metadata value.
        #[allow(clippy::expect_used)]
        let wire = key.parse().expect("a UUID is a valid metadata value");
        Operation {
            key,
            wire,
            policy: RetryPolicy::default(),
        }
    }

    /// An operation with your own key (an order id, say), checked against
    /// the grammar the server layer applies (1–255 printable ASCII
    /// characters, not all spaces), so it is never refused for its form.
    ///
    /// ```
    /// use idem_grpc::client::Operation;
    /// assert!(Operation::with_key("with space").is_ok()); // sent quoted
    /// assert!(Operation::with_key("tab\there").is_err());
    /// ```
    pub fn with_key(key: impl Into<String>) -> Result<Operation, KeyError> {
        let key = key.into();
        let wire = idem_key::encode(&key)?;
        // The grammar allows only printable ASCII, which metadata accepts.
        let wire = wire
            .parse()
            .map_err(|_| KeyError::NotPrintable { byte: 0, at: 0 })?;
        Ok(Operation {
            key,
            wire,
            policy: RetryPolicy::default(),
        })
    }

    /// How the operation is retried.
    ///
    /// ```
    /// use idem_grpc::client::{Operation, RetryPolicy};
    /// let op = Operation::new().retry(RetryPolicy::no_retries());
    /// ```
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The key (to put in the request message too, for a method keyed by
    /// AIP-155 `request_id`).
    ///
    /// ```
    /// let op = idem_grpc::client::Operation::with_key("k-1").unwrap();
    /// assert_eq!(op.key(), "k-1");
    /// ```
    pub fn key(&self) -> &str {
        &self.key
    }

    /// A tonic request for `message` carrying the key as `idempotency-key`
    /// metadata. Build one per attempt.
    ///
    /// ```
    /// let op = idem_grpc::client::Operation::with_key("k-1").unwrap();
    /// let req = op.request(());
    /// assert_eq!(req.metadata().get("idempotency-key").unwrap(), "k-1");
    /// ```
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        self.attach(request.metadata_mut());
        request
    }

    /// Puts the key in `metadata` as `idempotency-key` (replacing one there).
    ///
    /// ```
    /// let op = idem_grpc::client::Operation::with_key("k-1").unwrap();
    /// let mut md = tonic::metadata::MetadataMap::new();
    /// op.attach(&mut md);
    /// assert_eq!(md.get("idempotency-key").unwrap(), "k-1");
    /// ```
    pub fn attach(&self, metadata: &mut MetadataMap) {
        metadata.insert("idempotency-key", self.wire.clone());
    }

    /// Runs `attempt` until it succeeds, fails for good, or the policy's
    /// retries or deadline run out. Each attempt must send this
    /// operation's key ([`request`](Self::request)).
    ///
    /// Retried: `UNAVAILABLE` (server or store down), `ABORTED` (the key
    /// is in flight), `DEADLINE_EXCEEDED` and attempts cut off by the
    /// deadline, `RESOURCE_EXHAUSTED` (unless the layer refused the request
    /// as too large), and `INTERNAL` unless it is a replay. Never retried:
    /// other codes, `key-reused` and `response-not-kept` among them. A
    /// `grpc-retry-pushback-ms` hint is a lower bound on the next delay,
    /// capped at the policy's `max_retry_after`.
    ///
    /// ```
    /// use idem_grpc::client::{Operation, RetryPolicy};
    /// use std::sync::atomic::{AtomicU32, Ordering};
    /// use std::time::Duration;
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let op = Operation::new().retry(RetryPolicy::default().initial_backoff(Duration::from_millis(10)));
    /// let tries = AtomicU32::new(0);
    /// let reply = op
    ///     .call(|| async {
    ///         match tries.fetch_add(1, Ordering::SeqCst) {
    ///             0 => Err(tonic::Status::unavailable("connection refused")),
    ///             _ => Ok(tonic::Response::new("done")),
    ///         }
    ///     })
    ///     .await
    ///     .unwrap();
    /// assert_eq!((reply.attempts, *reply.response.get_ref()), (2, "done"));
    /// # });
    /// ```
    pub async fn call<T, F, Fut>(&self, mut attempt: F) -> Result<Reply<T>, CallError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let deadline = Instant::now() + self.policy.get_deadline();
        let mut schedule = self.policy.schedule();
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let status = match tokio::time::timeout_at(deadline, attempt()).await {
                Ok(Ok(response)) => {
                    let replayed = response
                        .metadata()
                        .get(IDEMPOTENT_REPLAYED.as_str())
                        .is_some_and(|v| v == "true");
                    return Ok(Reply {
                        response,
                        key: self.key.clone(),
                        attempts,
                        replayed,
                    });
                }
                Ok(Err(status)) => status,
                Err(_) => tonic::Status::deadline_exceeded(
                    "the operation's deadline passed during the attempt",
                ),
            };
            let fail = |kind| CallError {
                kind,
                status: status.clone(),
                key: self.key.clone(),
                attempts,
            };
            if !retryable(&status) {
                tracing::debug!(key = %self.key, attempts, code = ?status.code(), "final status; not retried");
                return Err(fail(CallErrorKind::Refused));
            }
            let Some(backoff) = schedule.next() else {
                return Err(fail(CallErrorKind::RetriesExhausted));
            };
            let delay = self.policy.combine(backoff, pushback(status.metadata()));
            if Instant::now() + delay >= deadline {
                return Err(fail(CallErrorKind::DeadlineExceeded));
            }
            tracing::debug!(key = %self.key, attempts, code = ?status.code(), ?delay, "retrying with the same key");
            tokio::time::sleep(delay).await;
        }
    }
}

fn retryable(status: &tonic::Status) -> bool {
    let md = status.metadata();
    let replayed = md
        .get(IDEMPOTENT_REPLAYED.as_str())
        .is_some_and(|v| v == "true");
    let refusal = md.get(IDEM_ERROR.as_str()).and_then(|v| v.to_str().ok());
    match status.code() {
        Code::Unavailable | Code::Aborted | Code::DeadlineExceeded => !replayed,
        Code::ResourceExhausted => !replayed && refusal != Some("request-too-large"),
        Code::Internal => !replayed,
        _ => false,
    }
}

fn pushback(md: &MetadataMap) -> Option<Duration> {
    let ms: u64 = md
        .get(RETRY_PUSHBACK.as_str())?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_millis(ms))
}

/// A successful call: the response, and how it was obtained.
#[derive(Debug)]
#[non_exhaustive]
pub struct Reply<T> {
    /// The response, metadata included.
    pub response: tonic::Response<T>,
    /// The operation's key.
    pub key: String,
    /// How many attempts were made (1 = no retry).
    pub attempts: u32,
    /// Whether the server replayed a stored answer (`idempotent-replayed`).
    pub replayed: bool,
}

/// Why an operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CallErrorKind {
    /// A status that is final: retrying cannot change it.
    Refused,
    /// Every retry of the policy was spent on retryable statuses.
    RetriesExhausted,
    /// The policy's deadline passed (or the next retry could not start
    /// before it).
    DeadlineExceeded,
}

/// A failed operation: the last status, which key and how many attempts.
/// The message says what to do.
///
/// ```
/// use idem_grpc::client::{CallErrorKind, Operation, RetryPolicy};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let op = Operation::with_key("k").unwrap().retry(RetryPolicy::no_retries());
/// let err = op
///     .call(|| async { Err::<tonic::Response<()>, _>(tonic::Status::invalid_argument("bad amount")) })
///     .await
///     .unwrap_err();
/// assert_eq!(err.kind(), CallErrorKind::Refused);
/// assert_eq!(err.status().code(), tonic::Code::InvalidArgument);
/// assert!(err.to_string().contains("key k"));
/// # });
/// ```
#[derive(Debug, Clone, thiserror::Error)]
pub struct CallError {
    kind: CallErrorKind,
    status: tonic::Status,
    key: String,
    attempts: u32,
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (code, message) = (self.status.code(), self.status.message());
        let n = self.attempts;
        let k = &self.key;
        match self.kind {
            CallErrorKind::Refused => write!(
                f,
                "the call (key {k}, {n} attempt(s)) failed with {code:?}: {message}; this status is final, so it was not retried — fix the request (a new operation needs a new key)"
            ),
            CallErrorKind::RetriesExhausted => write!(
                f,
                "the call (key {k}) still failed after {n} attempts, last with {code:?}: {message}; retry the operation later with the same key (it runs at most once)"
            ),
            CallErrorKind::DeadlineExceeded => write!(
                f,
                "the call (key {k}, {n} attempt(s)) ran out of its deadline, last with {code:?}: {message}; retry the operation later with the same key (it runs at most once)"
            ),
        }
    }
}

impl CallError {
    /// Why it failed.
    ///
    /// ```
    /// # use idem_grpc::client::{CallErrorKind, Operation, RetryPolicy};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let op = Operation::new().retry(RetryPolicy::no_retries());
    /// let err = op.call(|| async { Err::<tonic::Response<()>, _>(tonic::Status::unavailable("down")) }).await.unwrap_err();
    /// assert_eq!(err.kind(), CallErrorKind::RetriesExhausted);
    /// # });
    /// ```
    pub fn kind(&self) -> CallErrorKind {
        self.kind
    }

    /// The last status the server (or the transport) answered.
    ///
    /// ```
    /// # use idem_grpc::client::{Operation, RetryPolicy};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let op = Operation::new().retry(RetryPolicy::no_retries());
    /// let err = op.call(|| async { Err::<tonic::Response<()>, _>(tonic::Status::not_found("no")) }).await.unwrap_err();
    /// assert_eq!(err.status().message(), "no");
    /// # });
    /// ```
    pub fn status(&self) -> &tonic::Status {
        &self.status
    }

    /// The operation's key.
    ///
    /// ```
    /// # use idem_grpc::client::{Operation, RetryPolicy};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let op = Operation::with_key("k-9").unwrap().retry(RetryPolicy::no_retries());
    /// let err = op.call(|| async { Err::<tonic::Response<()>, _>(tonic::Status::not_found("no")) }).await.unwrap_err();
    /// assert_eq!(err.key(), "k-9");
    /// # });
    /// ```
    pub fn key(&self) -> &str {
        &self.key
    }

    /// How many attempts were made.
    ///
    /// ```
    /// # use idem_grpc::client::{Operation, RetryPolicy};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let op = Operation::new().retry(RetryPolicy::no_retries());
    /// let err = op.call(|| async { Err::<tonic::Response<()>, _>(tonic::Status::not_found("no")) }).await.unwrap_err();
    /// assert_eq!(err.attempts(), 1);
    /// # });
    /// ```
    pub fn attempts(&self) -> u32 {
        self.attempts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_statuses_are_retried() {
        let with = |code: Code, md: &[(&'static str, &'static str)]| {
            let mut m = MetadataMap::new();
            for (k, v) in md {
                m.insert(*k, MetadataValue::from_static(v));
            }
            retryable(&tonic::Status::with_metadata(code, "x", m))
        };
        for code in [
            Code::Unavailable,
            Code::Aborted,
            Code::DeadlineExceeded,
            Code::ResourceExhausted,
            Code::Internal,
        ] {
            assert!(with(code, &[]), "{code:?}");
            assert!(
                !with(code, &[("idempotent-replayed", "true")]),
                "replayed {code:?}"
            );
        }
        for code in [
            Code::InvalidArgument,
            Code::FailedPrecondition,
            Code::NotFound,
            Code::Unimplemented,
            Code::PermissionDenied,
            Code::Unauthenticated,
        ] {
            assert!(!with(code, &[]), "{code:?}");
        }
        assert!(!with(
            Code::ResourceExhausted,
            &[("idem-error", "request-too-large")]
        ));
    }

    #[test]
    fn pushback_is_read_in_milliseconds() {
        let mut m = MetadataMap::new();
        assert_eq!(pushback(&m), None);
        m.insert("grpc-retry-pushback-ms", MetadataValue::from_static("250"));
        assert_eq!(pushback(&m), Some(Duration::from_millis(250)));
        m.insert("grpc-retry-pushback-ms", MetadataValue::from_static("-1"));
        assert_eq!(pushback(&m), None);
    }
}
