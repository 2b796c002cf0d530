//! RFC 9457 problem details for the layer's own error responses.

use axum::body::Body;
use http::{HeaderValue, Response, StatusCode, header};
use serde::Serialize;
use std::time::Duration;

/// The media type of every error the layer answers itself.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The errors the layer answers itself, each with its own problem `type`.
///
/// The `type` member of the problem document is the layer's
/// [`problem_type_base`](crate::IdempotencyLayer::problem_type_base)
/// followed by [`slug`](ProblemKind::slug); the crate documentation lists
/// them under "Problem types".
///
/// ```
/// use idem_http::ProblemKind;
/// assert_eq!(ProblemKind::KeyInUse.slug(), "key-in-use");
/// assert_eq!(ProblemKind::KeyInUse.status(), http::StatusCode::CONFLICT);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// `400`: the `Idempotency-Key` header is malformed.
    InvalidKey,
    /// `400`: the route requires an `Idempotency-Key` and none was sent.
    MissingKey,
    /// `400`: the request body could not be read.
    UnreadableRequest,
    /// `406`: the stored response has a content coding (from a compression
    /// layer inside this one) that this request does not accept, and the
    /// layer cannot decode it (only `gzip` and `deflate` are decoded).
    EncodingNotAcceptable,
    /// `409`: a request with this key is being processed right now.
    KeyInUse,
    /// `410`: the request with this key **was processed**, but its response
    /// was not kept (over the size limit, or streamed), so it cannot be
    /// replayed. Not retryable: the operation must not be sent again.
    ResponseNotKept,
    /// `413`: the request body is over the layer's buffering limit.
    RequestTooLarge,
    /// `422`: the key was used before with a different request.
    KeyReused,
    /// `500`: the handler panicked (the key was released).
    HandlerPanicked,
    /// `500`: the handler's response body failed mid-way (the key was released).
    ResponseFailed,
    /// `500`: the stored response or the configuration cannot be used.
    Internal,
    /// `503`: the idempotency store cannot be reached; the handler did not run.
    StoreUnavailable,
}

impl ProblemKind {
    /// The last segment of the problem `type` URI.
    ///
    /// ```
    /// assert_eq!(idem_http::ProblemKind::KeyReused.slug(), "key-reused");
    /// ```
    pub fn slug(self) -> &'static str {
        match self {
            ProblemKind::InvalidKey => "invalid-key",
            ProblemKind::MissingKey => "missing-key",
            ProblemKind::UnreadableRequest => "unreadable-request",
            ProblemKind::EncodingNotAcceptable => "encoding-not-acceptable",
            ProblemKind::KeyInUse => "key-in-use",
            ProblemKind::ResponseNotKept => "response-not-kept",
            ProblemKind::RequestTooLarge => "request-too-large",
            ProblemKind::KeyReused => "key-reused",
            ProblemKind::HandlerPanicked => "handler-panicked",
            ProblemKind::ResponseFailed => "response-failed",
            ProblemKind::Internal => "internal-error",
            ProblemKind::StoreUnavailable => "store-unavailable",
        }
    }

    /// The HTTP status answered.
    ///
    /// ```
    /// assert_eq!(idem_http::ProblemKind::KeyReused.status().as_u16(), 422);
    /// ```
    pub fn status(self) -> StatusCode {
        match self {
            ProblemKind::InvalidKey | ProblemKind::MissingKey | ProblemKind::UnreadableRequest => {
                StatusCode::BAD_REQUEST
            }
            ProblemKind::EncodingNotAcceptable => StatusCode::NOT_ACCEPTABLE,
            ProblemKind::KeyInUse => StatusCode::CONFLICT,
            ProblemKind::ResponseNotKept => StatusCode::GONE,
            ProblemKind::RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProblemKind::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemKind::HandlerPanicked | ProblemKind::ResponseFailed | ProblemKind::Internal => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            ProblemKind::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The short, fixed `title` of the problem.
    ///
    /// ```
    /// assert_eq!(idem_http::ProblemKind::MissingKey.title(), "Idempotency-Key required");
    /// ```
    pub fn title(self) -> &'static str {
        match self {
            ProblemKind::InvalidKey => "Invalid Idempotency-Key",
            ProblemKind::MissingKey => "Idempotency-Key required",
            ProblemKind::UnreadableRequest => "Unreadable request body",
            ProblemKind::EncodingNotAcceptable => "Stored response encoding not acceptable",
            ProblemKind::KeyInUse => "Request in progress",
            ProblemKind::ResponseNotKept => "Request processed, response not kept",
            ProblemKind::RequestTooLarge => "Request body too large",
            ProblemKind::KeyReused => "Idempotency-Key reused",
            ProblemKind::HandlerPanicked => "Internal error",
            ProblemKind::ResponseFailed => "Internal error",
            ProblemKind::Internal => "Internal error",
            ProblemKind::StoreUnavailable => "Idempotency store unavailable",
        }
    }
}

#[derive(Serialize)]
struct ProblemDoc<'a> {
    #[serde(rename = "type")]
    kind: String,
    title: &'a str,
    status: u16,
    detail: &'a str,
    /// Extension member of `response-not-kept`: the status the handler
    /// answered when the request was processed.
    #[serde(skip_serializing_if = "Option::is_none")]
    processed_status: Option<u16>,
}

/// Builds a problem+json response. `retry_after` adds a `Retry-After`
/// header; `processed_status` adds the `processed_status` member.
pub(crate) fn problem_response(
    type_base: &str,
    kind: ProblemKind,
    detail: &str,
    retry_after: Option<Duration>,
    processed_status: Option<u16>,
) -> Response<Body> {
    let status = kind.status();
    let doc = ProblemDoc {
        kind: format!("{type_base}{}", kind.slug()),
        title: kind.title(),
        status: status.as_u16(),
        detail,
        processed_status,
    };
    // Serializing this struct of strings and an integer cannot fail; keep a
    // fixed document as a fallback all the same.
    let body = serde_json::to_vec(&doc).unwrap_or_else(|_| {
        format!(
            r#"{{"title":"{}","status":{}}}"#,
            kind.title(),
            status.as_u16()
        )
        .into_bytes()
    });
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Some(after) = retry_after {
        headers.insert(
            header::RETRY_AFTER,
            HeaderValue::from(retry_after_secs(after)),
        );
    }
    response
}

/// Whole seconds for `Retry-After`, rounded up (a sub-second hint is 1 s),
/// saturating: `Duration::MAX` is `u64::MAX` seconds, not an overflow.
pub(crate) fn retry_after_secs(d: Duration) -> u64 {
    let secs = d.as_secs();
    if d.subsec_nanos() > 0 {
        secs.saturating_add(1)
    } else {
        secs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up() {
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_secs(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1500)), 2);
        assert_eq!(retry_after_secs(Duration::ZERO), 0);
    }

    #[test]
    fn retry_after_saturates() {
        assert_eq!(retry_after_secs(Duration::MAX), u64::MAX);
        let r = problem_response("", ProblemKind::KeyInUse, "busy", Some(Duration::MAX), None);
        assert_eq!(
            r.headers()[header::RETRY_AFTER],
            u64::MAX.to_string().as_str()
        );
    }

    #[test]
    fn problem_has_rfc9457_members() {
        let r = problem_response(
            "https://errors.example.com/idempotency/",
            ProblemKind::KeyInUse,
            "busy",
            Some(Duration::from_secs(1)),
            None,
        );
        assert_eq!(r.status(), StatusCode::CONFLICT);
        assert_eq!(r.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    }
}
