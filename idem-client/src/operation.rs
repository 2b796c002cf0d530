//! The retry loop: one logical operation, sent under one idempotency key
//! until it succeeds, fails for good, or runs out of retries.

use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use reqwest::Url;
use serde::de::DeserializeOwned;

use crate::error::{ClientErrorKind, GiveUpReason, RequestContext};
use crate::key::IDEMPOTENCY_KEY;
use crate::problem::is_problem_json;
use crate::retry::{is_retryable_status, retry_after};
use crate::{ClientError, Problem, RetryPolicy};

/// Name of the response header that marks a replayed (stored) outcome; its
/// value is `true` when the server answered from its record instead of
/// running the operation.
///
/// ```
/// assert_eq!(idem_client::IDEMPOTENT_REPLAYED, "idempotent-replayed");
/// ```
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// How much of an error response body is read (for problem details).
const ERROR_BODY_CAP: usize = 64 * 1024;
/// How much of an error response body is kept in [`ClientErrorKind::Status`].
const SNIPPET_CAP: usize = 1024;

/// A successful outcome: the decoded body plus what the client knows about
/// how it was obtained.
///
/// ```
/// use http::StatusCode;
/// use idem_client::Response;
///
/// let r = Response { value: 7, key: "k".into(), status: StatusCode::CREATED, replayed: false, attempts: 1 };
/// assert_eq!(r.value, 7);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response<T> {
    /// The response body, decoded from JSON. An empty body decodes as JSON
    /// `null`, so `()` and `Option<_>` accept `204 No Content`.
    pub value: T,
    /// The idempotency key the operation was sent with.
    pub key: String,
    /// The (2xx) status of the answering attempt.
    pub status: StatusCode,
    /// `true` when the server answered `Idempotent-Replayed: true`, i.e. the
    /// operation had already been applied and this is its stored outcome.
    pub replayed: bool,
    /// Attempts made, 1 when the first attempt answered.
    pub attempts: u32,
}

/// One logical operation: everything needed to (re)send it.
pub(crate) struct Operation<'a> {
    pub(crate) http: &'a reqwest::Client,
    pub(crate) method: Method,
    pub(crate) path: String,
    pub(crate) url: Url,
    pub(crate) key: String,
    pub(crate) key_value: HeaderValue,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Option<Bytes>,
}

/// What one attempt produced.
enum Outcome<T> {
    Done(Response<T>),
    Final(ClientError),
    Retry(ClientError, Option<Duration>),
}

impl Operation<'_> {
    pub(crate) async fn run<T: DeserializeOwned>(
        self,
        policy: &RetryPolicy,
        per_attempt: Duration,
    ) -> Result<Response<T>, ClientError> {
        let start = Instant::now();
        let deadline = policy.get_deadline();
        let mut schedule = policy.schedule();
        let mut attempts: u32 = 0;
        loop {
            attempts = attempts.saturating_add(1);
            let timeout = per_attempt.min(deadline.saturating_sub(start.elapsed()));
            let (error, hint) = match self.attempt::<T>(attempts, timeout).await {
                Outcome::Done(response) => {
                    tracing::debug!(
                        method = %self.method,
                        path = %self.path,
                        key = %self.key,
                        attempt = attempts,
                        status = response.status.as_u16(),
                        replayed = response.replayed,
                        "idem request succeeded"
                    );
                    return Ok(response);
                }
                Outcome::Final(error) => {
                    tracing::info!(
                        method = %self.method,
                        path = %self.path,
                        key = %self.key,
                        attempt = attempts,
                        status = error.status().map(|s| s.as_u16()),
                        error = %error,
                        "idem request failed; not retryable"
                    );
                    return Err(error);
                }
                Outcome::Retry(error, hint) => (error, hint),
            };
            // The backoff schedule decides whether to retry at all; the
            // server's Retry-After can only lengthen the wait.
            let next = match schedule.next() {
                None => Err(GiveUpReason::RetriesExhausted),
                Some(backoff) => {
                    let delay = policy.combine(backoff, hint);
                    if start.elapsed().saturating_add(delay) >= deadline {
                        Err(GiveUpReason::DeadlineExceeded)
                    } else {
                        Ok(delay)
                    }
                }
            };
            let status = error.status().map(|s| s.as_u16());
            match next {
                Ok(delay) => {
                    tracing::warn!(
                        method = %self.method,
                        path = %self.path,
                        key = %self.key,
                        attempt = attempts,
                        status,
                        error = %error,
                        retry_after_ms = hint.map(|d| d.as_millis()),
                        delay_ms = delay.as_millis(),
                        "idem request failed; retrying with the same key"
                    );
                    tokio::time::sleep(delay).await;
                }
                Err(reason) => {
                    tracing::warn!(
                        method = %self.method,
                        path = %self.path,
                        key = %self.key,
                        attempt = attempts,
                        status,
                        error = %error,
                        %reason,
                        "idem request failed; giving up"
                    );
                    let request = RequestContext::new(self.method, self.path, self.key, attempts);
                    return Err(ClientError::request(
                        ClientErrorKind::GaveUp {
                            last: error,
                            reason,
                        },
                        request,
                    ));
                }
            }
        }
    }

    /// Which request a failure of attempt number `attempt` is about.
    fn context(&self, attempt: u32) -> RequestContext {
        RequestContext::new(
            self.method.clone(),
            self.path.clone(),
            self.key.clone(),
            attempt,
        )
    }

    async fn attempt<T: DeserializeOwned>(&self, attempt: u32, timeout: Duration) -> Outcome<T> {
        let mut request = self
            .http
            .request(self.method.clone(), self.url.clone())
            .headers(self.headers.clone())
            .header(IDEMPOTENCY_KEY, self.key_value.clone())
            .timeout(timeout);
        if let Some(body) = &self.body {
            request = request
                .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
                .body(body.clone());
        }
        let fail = |kind: ClientErrorKind| ClientError::request(kind, self.context(attempt));
        let transport = |source: reqwest::Error| fail(ClientErrorKind::Transport { source });
        let mut response = match request.send().await {
            Ok(response) => response,
            Err(e) => return Outcome::Retry(transport(e), None),
        };
        let status = response.status();
        let headers = response.headers();
        let replayed = headers
            .get(IDEMPOTENT_REPLAYED)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));

        if status.is_success() {
            let bytes = match response.bytes().await {
                Ok(bytes) => bytes,
                // The operation may have been applied; the same key makes
                // the retry safe and returns the stored outcome.
                Err(e) => return Outcome::Retry(transport(e), None),
            };
            let json: &[u8] = if bytes.trim_ascii().is_empty() {
                b"null"
            } else {
                &bytes
            };
            return match serde_json::from_slice(json) {
                Ok(value) => Outcome::Done(Response {
                    value,
                    key: self.key.clone(),
                    status,
                    replayed,
                    attempts: attempt,
                }),
                Err(source) => Outcome::Final(fail(ClientErrorKind::Decode { source, status })),
            };
        }

        let hint = retry_after(headers, SystemTime::now());
        let problem_json = headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(is_problem_json);
        let body = read_capped(&mut response, ERROR_BODY_CAP).await;
        let problem = if problem_json {
            Problem::parse(&body)
        } else {
            None
        };
        let snippet =
            String::from_utf8_lossy(body.get(..SNIPPET_CAP).unwrap_or(&body)).into_owned();
        if status == StatusCode::GONE
            && let Some(processed_status) = problem.as_ref().and_then(Problem::response_not_kept)
        {
            return Outcome::Final(fail(ClientErrorKind::ResponseNotKept {
                processed_status,
                problem: problem.unwrap_or_default(),
            }));
        }
        let error = fail(ClientErrorKind::Status {
            status,
            problem,
            body: snippet,
            replayed,
        });
        if is_retryable_status(status, replayed) {
            Outcome::Retry(error, hint)
        } else {
            Outcome::Final(error)
        }
    }
}

/// Reads at most about `cap` bytes of the body; a broken body just ends early.
async fn read_capped(response: &mut reqwest::Response, cap: usize) -> Vec<u8> {
    let mut buf = Vec::new();
    while buf.len() < cap {
        match response.chunk().await {
            Ok(Some(chunk)) => buf.extend_from_slice(&chunk),
            Ok(None) | Err(_) => break,
        }
    }
    buf
}
