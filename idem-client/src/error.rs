//! The client's error type.

use std::error::Error as _;
use std::fmt;

use http::{Method, StatusCode};

use crate::Problem;

/// Why the client stopped retrying; see [`ClientError::GaveUp`].
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

/// Everything that can go wrong when sending an operation.
///
/// The message (`Display`) says what happened, with which key after how many
/// attempts, and what to do next. Accessors such as [`status`](Self::status)
/// and [`problem`](Self::problem) look through [`GaveUp`](Self::GaveUp) to
/// the last failure.
///
/// ```
/// use idem_client::{validate_key, ClientError};
///
/// let err = validate_key("").unwrap_err();
/// assert!(matches!(err, ClientError::InvalidKey { .. }));
/// assert!(err.to_string().contains("empty"));
/// assert_eq!(err.status(), None);
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The request could not be completed: connection refused or reset, a
    /// timeout, or the response body broke off. Always retried; seen on its
    /// own only inside [`GaveUp`](Self::GaveUp).
    #[non_exhaustive]
    Transport {
        /// The underlying reqwest error.
        #[source]
        source: reqwest::Error,
        /// HTTP method of the operation.
        method: Method,
        /// Request path, relative to the base URL.
        path: String,
        /// The idempotency key sent.
        key: String,
        /// Attempts made so far, including this one.
        attempts: u32,
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
        /// HTTP method of the operation.
        method: Method,
        /// Request path, relative to the base URL.
        path: String,
        /// The idempotency key sent.
        key: String,
        /// Attempts made so far, including this one.
        attempts: u32,
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
        /// HTTP method of the operation.
        method: Method,
        /// Request path, relative to the base URL.
        path: String,
        /// The idempotency key sent.
        key: String,
        /// Attempts made, including this one.
        attempts: u32,
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
        /// HTTP method of the operation.
        method: Method,
        /// Request path, relative to the base URL.
        path: String,
        /// The idempotency key sent.
        key: String,
        /// Attempts made, including this one.
        attempts: u32,
    },
    /// The request body could not be serialized to JSON; nothing was sent.
    #[non_exhaustive]
    Encode {
        /// The JSON error.
        #[source]
        source: serde_json::Error,
        /// HTTP method of the operation.
        method: Method,
        /// Request path, relative to the base URL.
        path: String,
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
        last: Box<ClientError>,
        /// Why the client stopped.
        reason: GiveUpReason,
        /// HTTP method of the operation.
        method: Method,
        /// Request path, relative to the base URL.
        path: String,
        /// The idempotency key sent on every attempt.
        key: String,
        /// Attempts made.
        attempts: u32,
    },
    /// Invalid configuration: a bad base URL, path, or header.
    #[non_exhaustive]
    Build {
        /// What is wrong.
        reason: String,
    },
}

impl ClientError {
    /// The HTTP status behind this error, looking through
    /// [`GaveUp`](Self::GaveUp).
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
        match self {
            ClientError::Status { status, .. } | ClientError::Decode { status, .. } => {
                Some(*status)
            }
            ClientError::ResponseNotKept { .. } => Some(StatusCode::GONE),
            ClientError::GaveUp { last, .. } => last.status(),
            _ => None,
        }
    }

    /// The parsed `application/problem+json` body, looking through
    /// [`GaveUp`](Self::GaveUp).
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
        match self {
            ClientError::Status { problem, .. } => problem.as_ref(),
            ClientError::ResponseNotKept { problem, .. } => Some(problem),
            ClientError::GaveUp { last, .. } => last.problem(),
            _ => None,
        }
    }

    /// The idempotency key involved, if any.
    ///
    /// ```
    /// use idem_client::validate_key;
    /// assert_eq!(validate_key("\n").unwrap_err().key(), Some("\n"));
    /// ```
    pub fn key(&self) -> Option<&str> {
        match self {
            ClientError::Transport { key, .. }
            | ClientError::Status { key, .. }
            | ClientError::Decode { key, .. }
            | ClientError::ResponseNotKept { key, .. }
            | ClientError::InvalidKey { key, .. }
            | ClientError::GaveUp { key, .. } => Some(key),
            _ => None,
        }
    }

    /// How many attempts were made (`None` when nothing was sent).
    ///
    /// ```
    /// use idem_client::validate_key;
    /// assert_eq!(validate_key("").unwrap_err().attempts(), None);
    /// ```
    pub fn attempts(&self) -> Option<u32> {
        match self {
            ClientError::Transport { attempts, .. }
            | ClientError::Status { attempts, .. }
            | ClientError::Decode { attempts, .. }
            | ClientError::ResponseNotKept { attempts, .. }
            | ClientError::GaveUp { attempts, .. } => Some(*attempts),
            _ => None,
        }
    }

    /// A one-line description of a single attempt's failure, for `GaveUp`.
    fn summary(&self) -> String {
        match self {
            ClientError::Status {
                status,
                replayed,
                problem,
                body,
                ..
            } => {
                let mut s = status.to_string();
                if *replayed {
                    s.push_str(" (replayed)");
                }
                if let Some(said) = server_said(problem.as_ref(), body) {
                    s.push_str(&format!(" (server said: {said})"));
                }
                s
            }
            ClientError::Transport { source, .. } => transport_summary(source),
            other => other.to_string(),
        }
    }
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientError::Transport {
                source,
                method,
                path,
                key,
                attempts,
            } => write!(
                f,
                "{method} {path} failed after {} (key {}): {}; check that the server is \
                 running and the base URL is right; retrying with the same key is safe",
                plural_attempts(*attempts),
                short_key(key),
                transport_summary(source),
            ),
            ClientError::Status {
                status,
                problem,
                body,
                replayed,
                method,
                path,
                key,
                attempts,
            } => {
                write!(
                    f,
                    "{method} {path} failed with {status}{} after {} (key {}): {}",
                    if *replayed { " (replayed)" } else { "" },
                    plural_attempts(*attempts),
                    short_key(key),
                    advice(*status, *replayed),
                )?;
                if let Some(said) = server_said(problem.as_ref(), body) {
                    write!(f, " (server said: {said})")?;
                }
                Ok(())
            }
            ClientError::ResponseNotKept {
                processed_status,
                method,
                path,
                key,
                attempts,
                ..
            } => {
                write!(f, "{method} {path} was processed")?;
                if let Some(status) = processed_status {
                    write!(f, " (status {status})")?;
                }
                write!(
                    f,
                    " but the server did not keep its response, so it cannot be replayed \
                     (key {}, {}): the operation was applied, so do not send it again with \
                     this key or a new one; look its result up another way",
                    short_key(key),
                    plural_attempts(*attempts),
                )
            }
            ClientError::Decode {
                source,
                status,
                method,
                path,
                key,
                attempts,
            } => write!(
                f,
                "{method} {path} succeeded with {status} after {} (key {}) but the response \
                 body did not decode: {source}; the operation was applied, so do not resend it \
                 with a new key: fix the response type, then the same key returns the stored \
                 response",
                plural_attempts(*attempts),
                short_key(key),
            ),
            ClientError::Encode {
                source,
                method,
                path,
            } => write!(
                f,
                "could not encode the body of {method} {path} as JSON: {source}; nothing was sent"
            ),
            ClientError::InvalidKey { key, reason } => write!(
                f,
                "invalid idempotency key {:?}: {reason}; nothing was sent: use 1-255 visible \
                 ASCII characters (a UUID works), or let the client generate a key",
                truncate_chars(key, 40),
            ),
            ClientError::GaveUp {
                last,
                reason,
                method,
                path,
                key,
                attempts,
            } => write!(
                f,
                "{method} {path} gave up after {} (key {}) because {reason}; last error: {}; \
                 the operation may or may not have been applied: retry later with the same \
                 key to complete it exactly once",
                plural_attempts(*attempts),
                short_key(key),
                last.summary(),
            ),
            ClientError::Build { reason } => {
                write!(f, "invalid client configuration: {reason}")
            }
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

    fn status_err(code: u16, replayed: bool, problem: Option<Problem>) -> ClientError {
        ClientError::Status {
            status: StatusCode::from_u16(code).unwrap_or_default(),
            problem,
            body: String::new(),
            replayed,
            method: Method::POST,
            path: "/payments".into(),
            key: "5f0c".into(),
            attempts: 1,
        }
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
        let err = ClientError::GaveUp {
            last: Box::new(status_err(503, false, Some(problem))),
            reason: GiveUpReason::RetriesExhausted,
            method: Method::POST,
            path: "/payments".into(),
            key: "5f0c".into(),
            attempts: 3,
        };
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
        let err = ClientError::ResponseNotKept {
            processed_status: Some(StatusCode::CREATED),
            problem: Problem::default(),
            method: Method::POST,
            path: "/payments".into(),
            key: "5f0c".into(),
            attempts: 1,
        };
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
}
