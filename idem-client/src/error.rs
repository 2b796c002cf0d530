//! The client's error type: one [`ClientError`] made of what went wrong
//! ([`ClientErrorKind`]) and which request it happened to
//! ([`RequestContext`]).

use std::error::Error as StdError;
use std::fmt;

use http::{Method, StatusCode};

use crate::Problem;

/// Why the client stopped retrying; see [`ClientErrorKind::GaveUp`].
///
/// ```
/// use idem_client::GiveUpReason;
/// assert_eq!(GiveUpReason::RetriesExhausted.to_string(), "the retry limit was reached");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GiveUpReason {
    /// `max_retries` retries were made and the last one failed too.
    RetriesExhausted,
    /// The next attempt (after its delay) could not start before the
    /// policy's overall deadline.
    DeadlineExceeded,
}

impl fmt::Display for GiveUpReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GiveUpReason::RetriesExhausted => "the retry limit was reached",
            GiveUpReason::DeadlineExceeded => {
                "the next attempt could not start before the overall deadline"
            }
        })
    }
}

/// The request an error is about: which operation, under which key, after
/// how many attempts. See [`ClientError::context`].
///
/// ```
/// use idem_client::validate_key;
/// // A key checked on its own belongs to no request.
/// assert!(validate_key("").unwrap_err().context().is_none());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RequestContext {
    /// HTTP method of the operation.
    pub method: Method,
    /// Request path, relative to the base URL.
    pub path: String,
    /// The idempotency key the operation is sent with (on every attempt).
    pub key: String,
    /// Attempts made so far, including the failing one; `0` when the error
    /// came before anything was sent (the body did not encode).
    pub attempts: u32,
}

impl RequestContext {
    pub(crate) fn new(method: Method, path: String, key: String, attempts: u32) -> Self {
        RequestContext {
            method,
            path,
            key,
            attempts,
        }
    }

    /// Whether at least one attempt was sent.
    fn sent(&self) -> bool {
        self.attempts > 0
    }
}

/// What went wrong; see [`ClientError::kind`].
///
/// Its `Display` is the failure alone, without the request;
/// [`ClientError`]'s message adds the request and what to do next. Its
/// [`source`](StdError::source), which [`ClientError`] hands on, is the
/// transport or JSON error, or for [`GaveUp`](Self::GaveUp) the last
/// attempt's error.
///
/// ```
/// use idem_client::{validate_key, ClientErrorKind};
///
/// let err = validate_key("").unwrap_err();
/// assert!(matches!(err.kind(), ClientErrorKind::InvalidKey { .. }));
/// ```
// No `#[error]` attributes: `Display` is written by hand below, thiserror
// derives `source` from the `#[source]` fields.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientErrorKind {
    /// The request could not be completed: connection refused or reset, a
    /// timeout, or the response body broke off. Always retried; seen on its
    /// own only inside [`GaveUp`](Self::GaveUp).
    #[non_exhaustive]
    Transport {
        /// The underlying reqwest error.
        #[source]
        source: reqwest::Error,
    },
    /// The server answered with a status that is not success: either one
    /// that is never retried (most 4xx, a replayed 500), or, inside
    /// [`GaveUp`](Self::GaveUp), the last retryable one.
    #[non_exhaustive]
    Status {
        /// The response status.
        status: StatusCode,
        /// The `application/problem+json` body, if the server sent one.
        problem: Option<Problem>,
        /// The start of the response body (lossy UTF-8, at most 1 KiB).
        body: String,
        /// Whether the response carried `Idempotent-Replayed: true`.
        replayed: bool,
    },
    /// The server says the operation **was applied** under this key, but it
    /// did not keep the response (too large to store, or a stream), so it
    /// cannot be replayed: an idem server's `410` problem of type
    /// `response-not-kept`. Never retried, and the operation must not be
    /// sent again with a new key: look its result up another way.
    #[non_exhaustive]
    ResponseNotKept {
        /// The status the operation answered when it was applied, when the
        /// server said (the problem's `processed_status` member).
        processed_status: Option<StatusCode>,
        /// The problem document.
        problem: Problem,
    },
    /// The server answered with success, but the body did not decode into
    /// the requested type. The operation *was* applied. Not retried.
    #[non_exhaustive]
    Decode {
        /// The JSON error.
        #[source]
        source: serde_json::Error,
        /// The (successful) response status.
        status: StatusCode,
    },
    /// The request body could not be serialized to JSON; nothing was sent.
    #[non_exhaustive]
    Encode {
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// A caller-supplied idempotency key is malformed; nothing was sent.
    /// See [`validate_key`](crate::validate_key).
    #[non_exhaustive]
    InvalidKey {
        /// The rejected key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Retryable failures continued until the retry limit or the deadline.
    /// The operation may or may not have been applied; retrying later with
    /// the same key settles it exactly once.
    #[non_exhaustive]
    GaveUp {
        /// The failure of the last attempt.
        #[source]
        last: ClientError,
        /// Why the client stopped.
        reason: GiveUpReason,
    },
    /// Invalid configuration: a bad base URL, path, or header.
    #[non_exhaustive]
    Build {
        /// What is wrong.
        reason: String,
    },
}

/// The failure alone, without the request: the one-line form
/// [`GaveUp`](ClientErrorKind::GaveUp) quotes for its last attempt.
impl fmt::Display for ClientErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientErrorKind::Status {
                status,
                replayed,
                problem,
                body,
            } => {
                write!(f, "{status}")?;
                if *replayed {
                    f.write_str(" (replayed)")?;
                }
                if let Some(said) = server_said(problem.as_ref(), body) {
                    write!(f, " (server said: {said})")?;
                }
                Ok(())
            }
            ClientErrorKind::Transport { source } => f.write_str(&transport_summary(source)),
            ClientErrorKind::ResponseNotKept {
                processed_status, ..
            } => {
                f.write_str("the operation was processed")?;
                if let Some(status) = processed_status {
                    write!(f, " (status {status})")?;
                }
                f.write_str(" but the server did not keep its response")
            }
            ClientErrorKind::Decode { source, status } => {
                write!(f, "{status} whose body did not decode: {source}")
            }
            ClientErrorKind::Encode { source } => {
                write!(
                    f,
                    "could not encode the body as JSON: {source}; nothing was sent"
                )
            }
            ClientErrorKind::InvalidKey { key, reason } => write!(
                f,
                "invalid idempotency key {:?}: {reason}; nothing was sent: use 1-255 visible \
                 ASCII characters (a UUID works), or let the client generate a key",
                short_key(key),
            ),
            ClientErrorKind::GaveUp { last, reason } => {
                write!(f, "gave up because {reason}; last error: {}", last.kind())
            }
            ClientErrorKind::Build { reason } => {
                write!(f, "invalid client configuration: {reason}")
            }
        }
    }
}

/// Everything that can go wrong when sending an operation: what went wrong
/// ([`kind`](Self::kind)) and, when a request was being made, which one
/// ([`context`](Self::context)).
///
/// The message (`Display`) says what happened, with which key after how many
/// attempts, and what to do next. Accessors such as [`status`](Self::status)
/// and [`problem`](Self::problem) look through
/// [`GaveUp`](ClientErrorKind::GaveUp) to the last failure;
/// [`source`](StdError::source) leads to the transport or JSON error behind
/// it.
///
/// ```
/// use idem_client::{validate_key, ClientErrorKind};
///
/// let err = validate_key("").unwrap_err();
/// assert!(matches!(err.kind(), ClientErrorKind::InvalidKey { .. }));
/// assert!(err.to_string().contains("empty"));
/// assert_eq!(err.status(), None);
/// ```
// Boxed: the kind carries a parsed `Problem` inline, and every `Result` of
// the client would otherwise be some 200 bytes wide.
pub struct ClientError(Box<Repr>);

#[derive(Debug)]
struct Repr {
    kind: ClientErrorKind,
    context: Option<RequestContext>,
}

impl ClientError {
    /// An error about one request.
    pub(crate) fn request(kind: ClientErrorKind, context: RequestContext) -> Self {
        ClientError(Box::new(Repr {
            kind,
            context: Some(context),
        }))
    }

    /// An error that belongs to no request (a bad key checked on its own,
    /// a bad configuration).
    pub(crate) fn bare(kind: ClientErrorKind) -> Self {
        ClientError(Box::new(Repr {
            kind,
            context: None,
        }))
    }

    /// A bad configuration: base URL, path or header.
    pub(crate) fn build(reason: String) -> Self {
        ClientError::bare(ClientErrorKind::Build { reason })
    }

    /// A malformed idempotency key.
    pub(crate) fn invalid_key(key: &str, reason: String) -> Self {
        ClientError::bare(ClientErrorKind::InvalidKey {
            key: key.to_owned(),
            reason,
        })
    }

    /// What went wrong.
    ///
    /// ```
    /// use idem_client::{Client, ClientErrorKind};
    /// let err = Client::builder("not a url").build().unwrap_err();
    /// assert!(matches!(err.kind(), ClientErrorKind::Build { .. }));
    /// ```
    pub fn kind(&self) -> &ClientErrorKind {
        &self.0.kind
    }

    /// Which request this error is about: method, path, key and attempts;
    /// `None` for a bad configuration or a key checked on its own.
    ///
    /// ```
    /// use idem_client::ClientError;
    /// # fn check(err: ClientError) {
    /// if let Some(request) = err.context() {
    ///     eprintln!("{} {} failed under key {}", request.method, request.path, request.key);
    /// }
    /// # }
    /// ```
    pub fn context(&self) -> Option<&RequestContext> {
        self.0.context.as_ref()
    }

    /// Takes the error apart into what went wrong and which request it was.
    ///
    /// ```
    /// use idem_client::{validate_key, ClientErrorKind};
    /// let (kind, context) = validate_key("").unwrap_err().into_parts();
    /// assert!(matches!(kind, ClientErrorKind::InvalidKey { .. }));
    /// assert!(context.is_none());
    /// ```
    pub fn into_parts(self) -> (ClientErrorKind, Option<RequestContext>) {
        let Repr { kind, context } = *self.0;
        (kind, context)
    }

    /// The HTTP status behind this error, looking through
    /// [`GaveUp`](ClientErrorKind::GaveUp).
    ///
    /// ```
    /// use idem_client::ClientError;
    /// # fn check(err: ClientError) {
    /// if err.status().is_some_and(|s| s.as_u16() == 422) {
    ///     // the key was reused with another body
    /// }
    /// # }
    /// ```
    pub fn status(&self) -> Option<StatusCode> {
        match self.kind() {
            ClientErrorKind::Status { status, .. } | ClientErrorKind::Decode { status, .. } => {
                Some(*status)
            }
            ClientErrorKind::ResponseNotKept { .. } => Some(StatusCode::GONE),
            ClientErrorKind::GaveUp { last, .. } => last.status(),
            _ => None,
        }
    }

    /// The parsed `application/problem+json` body, looking through
    /// [`GaveUp`](ClientErrorKind::GaveUp).
    ///
    /// ```
    /// use idem_client::ClientError;
    /// # fn check(err: ClientError) {
    /// if let Some(problem) = err.problem() {
    ///     eprintln!("server says: {:?}", problem.detail);
    /// }
    /// # }
    /// ```
    pub fn problem(&self) -> Option<&Problem> {
        match self.kind() {
            ClientErrorKind::Status { problem, .. } => problem.as_ref(),
            ClientErrorKind::ResponseNotKept { problem, .. } => Some(problem),
            ClientErrorKind::GaveUp { last, .. } => last.problem(),
            _ => None,
        }
    }

    /// The idempotency key involved: the one sent, or the one rejected;
    /// `None` when nothing was sent for another reason.
    ///
    /// ```
    /// use idem_client::validate_key;
    /// assert_eq!(validate_key("\n").unwrap_err().key(), Some("\n"));
    /// ```
    pub fn key(&self) -> Option<&str> {
        if let ClientErrorKind::InvalidKey { key, .. } = self.kind() {
            return Some(key);
        }
        self.sent().map(|request| request.key.as_str())
    }

    /// How many attempts were made (`None` when nothing was sent).
    ///
    /// ```
    /// use idem_client::validate_key;
    /// assert_eq!(validate_key("").unwrap_err().attempts(), None);
    /// ```
    pub fn attempts(&self) -> Option<u32> {
        self.sent().map(|request| request.attempts)
    }

    /// The request, if at least one attempt of it was sent.
    fn sent(&self) -> Option<&RequestContext> {
        self.context().filter(|request| request.sent())
    }
}

impl fmt::Debug for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientError")
            .field("kind", &self.0.kind)
            .field("context", &self.0.context)
            .finish()
    }
}

// The kind's message is part of this one, so the chain goes on from the
// kind's source rather than from the kind itself.
impl StdError for ClientError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.kind().source()
    }
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.context() {
            Some(request) => describe(self.kind(), request, f),
            None => fmt::Display::fmt(self.kind(), f),
        }
    }
}

/// The full message of an error about `request`: what happened, to which
/// operation, and what to do next.
fn describe(
    kind: &ClientErrorKind,
    request: &RequestContext,
    f: &mut fmt::Formatter<'_>,
) -> fmt::Result {
    let RequestContext {
        method,
        path,
        key,
        attempts,
    } = request;
    let attempts = plural_attempts(*attempts);
    let key = short_key(key);
    match kind {
        ClientErrorKind::Transport { source } => write!(
            f,
            "{method} {path} failed after {attempts} (key {key}): {}; check that the server is \
             running and the base URL is right; retrying with the same key is safe",
            transport_summary(source),
        ),
        ClientErrorKind::Status {
            status,
            problem,
            body,
            replayed,
        } => {
            write!(
                f,
                "{method} {path} failed with {status}{} after {attempts} (key {key}): {}",
                if *replayed { " (replayed)" } else { "" },
                advice(*status, *replayed),
            )?;
            if let Some(said) = server_said(problem.as_ref(), body) {
                write!(f, " (server said: {said})")?;
            }
            Ok(())
        }
        ClientErrorKind::ResponseNotKept {
            processed_status, ..
        } => {
            write!(f, "{method} {path} was processed")?;
            if let Some(status) = processed_status {
                write!(f, " (status {status})")?;
            }
            write!(
                f,
                " but the server did not keep its response, so it cannot be replayed \
                 (key {key}, {attempts}): the operation was applied, so do not send it again \
                 with this key or a new one; look its result up another way",
            )
        }
        ClientErrorKind::Decode { source, status } => write!(
            f,
            "{method} {path} succeeded with {status} after {attempts} (key {key}) but the \
             response body did not decode: {source}; the operation was applied, so do not \
             resend it with a new key: fix the response type, then the same key returns the \
             stored response",
        ),
        ClientErrorKind::Encode { source } => write!(
            f,
            "could not encode the body of {method} {path} as JSON: {source}; nothing was sent"
        ),
        ClientErrorKind::GaveUp { last, reason } => write!(
            f,
            "{method} {path} gave up after {attempts} (key {key}) because {reason}; last \
             error: {}; the operation may or may not have been applied: retry later with the \
             same key to complete it exactly once",
            last.kind(),
        ),
        ClientErrorKind::InvalidKey { .. } | ClientErrorKind::Build { .. } => {
            fmt::Display::fmt(kind, f)
        }
    }
}

/// What the caller should do about a final status.
fn advice(status: StatusCode, replayed: bool) -> &'static str {
    match status.as_u16() {
        400 => {
            "the server rejected the request as malformed; fix the request before sending it again"
        }
        401 => {
            "the request was not authenticated; check the credentials (for example the authorization header)"
        }
        403 => "the credentials are not allowed to do this; check their permissions",
        404 => "nothing answers at this path; check the base URL and the path",
        409 => {
            "a request with the same key is still being processed; retry later with the same key"
        }
        422 => {
            "the key was reused with a different request body; send a new key for a new operation"
        }
        429 => "the server is rate limiting; wait, then retry with the same key",
        500 if replayed => {
            "this is the stored outcome of an earlier attempt with this key, so retrying replays it; send a new key to try the operation again"
        }
        500..=599 if replayed => {
            "this is the stored outcome for this key; send a new key to try the operation again"
        }
        502..=504 => {
            "the server or a gateway in front of it is unavailable; retry later with the same key"
        }
        500..=599 => "the server failed; retrying later with the same key is safe",
        300..=399 => {
            "the server redirected, which the client does not follow for non-idempotent requests; fix the base URL or path"
        }
        _ => "the server refused the request; fix it before sending it again",
    }
}

fn server_said(problem: Option<&Problem>, body: &str) -> Option<String> {
    let text = match problem.and_then(Problem::summary) {
        Some(s) => s,
        None => body.trim().to_owned(),
    };
    if text.is_empty() {
        return None;
    }
    let one_line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    Some(truncate_chars(&one_line, 200))
}

fn transport_summary(source: &reqwest::Error) -> String {
    let what = if source.is_timeout() {
        "the attempt timed out"
    } else if source.is_connect() {
        "could not connect"
    } else {
        "the request failed"
    };
    let mut chain = source.to_string();
    let mut cause = source.source();
    while let Some(c) = cause {
        chain.push_str(": ");
        chain.push_str(&c.to_string());
        cause = c.source();
    }
    format!("{what} ({chain})")
}

fn plural_attempts(n: u32) -> String {
    if n == 1 {
        "1 attempt".to_owned()
    } else {
        format!("{n} attempts")
    }
}

/// Keys are printed whole up to 40 characters (a UUID is 36).
fn short_key(key: &str) -> String {
    truncate_chars(key, 40)
}

fn truncate_chars(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(max.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payments(attempts: u32) -> RequestContext {
        RequestContext::new(Method::POST, "/payments".into(), "5f0c".into(), attempts)
    }

    fn status_err(code: u16, replayed: bool, problem: Option<Problem>) -> ClientError {
        ClientError::request(
            ClientErrorKind::Status {
                status: StatusCode::from_u16(code).unwrap_or_default(),
                problem,
                body: String::new(),
                replayed,
            },
            payments(1),
        )
    }

    #[test]
    fn status_422_message() {
        assert_eq!(
            status_err(422, false, None).to_string(),
            "POST /payments failed with 422 Unprocessable Entity after 1 attempt (key 5f0c): \
             the key was reused with a different request body; send a new key for a new operation"
        );
    }

    #[test]
    fn problem_is_quoted_and_reachable_through_gave_up() {
        let problem = Problem {
            title: Some("Busy".into()),
            ..Problem::default()
        };
        let err = ClientError::request(
            ClientErrorKind::GaveUp {
                last: status_err(503, false, Some(problem)),
                reason: GiveUpReason::RetriesExhausted,
            },
            payments(3),
        );
        let msg = err.to_string();
        assert!(msg.contains("gave up after 3 attempts"), "{msg}");
        assert!(
            msg.contains("503 Service Unavailable (server said: Busy)"),
            "{msg}"
        );
        assert_eq!(err.status(), Some(StatusCode::SERVICE_UNAVAILABLE));
        assert_eq!(err.problem().and_then(|p| p.title.as_deref()), Some("Busy"));
        assert_eq!(err.attempts(), Some(3));
        assert!(err.source().is_some());
    }

    #[test]
    fn response_not_kept_message() {
        let err = ClientError::request(
            ClientErrorKind::ResponseNotKept {
                processed_status: Some(StatusCode::CREATED),
                problem: Problem::default(),
            },
            payments(1),
        );
        assert_eq!(
            err.to_string(),
            "POST /payments was processed (status 201 Created) but the server did not keep \
             its response, so it cannot be replayed (key 5f0c, 1 attempt): the operation was \
             applied, so do not send it again with this key or a new one; look its result up \
             another way"
        );
        assert_eq!(err.status(), Some(StatusCode::GONE));
        assert_eq!(err.key(), Some("5f0c"));
    }

    #[test]
    fn long_keys_are_shortened() {
        let k = "k".repeat(300);
        assert_eq!(short_key(&k).chars().count(), 40);
        assert!(short_key(&k).ends_with('…'));
    }

    #[test]
    fn replayed_500_advice_says_new_key() {
        let msg = status_err(500, true, None).to_string();
        assert!(
            msg.contains("(replayed)") && msg.contains("send a new key"),
            "{msg}"
        );
    }

    #[test]
    fn an_encode_error_names_the_request_but_no_key_or_attempts() {
        let Err(source) = serde_json::from_str::<u8>("x") else {
            panic!("`x` is not JSON");
        };
        let err = ClientError::request(ClientErrorKind::Encode { source }, payments(0));
        assert_eq!(err.key(), None);
        assert_eq!(err.attempts(), None);
        assert_eq!(err.context().map(|r| r.path.as_str()), Some("/payments"));
        assert!(
            err.to_string()
                .starts_with("could not encode the body of POST /payments as JSON: expected value")
        );
        let json = err
            .source()
            .and_then(|s| s.downcast_ref::<serde_json::Error>());
        assert!(json.is_some(), "{err:?}");
    }
}
