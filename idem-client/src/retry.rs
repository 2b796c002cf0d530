//! When to retry an HTTP answer, and its `Retry-After`; the policy itself
//! is `idem-key`'s, shared with the gRPC client.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode};

pub use idem_key::RetryPolicy;

/// Whether a response with this status may be retried with the same key.
///
/// A replayed response (`Idempotent-Replayed: true`) is the stored outcome of
/// an earlier attempt: asking again gives the same answer, so it is final.
pub(crate) fn is_retryable_status(status: StatusCode, replayed: bool) -> bool {
    if replayed {
        return false;
    }
    matches!(status.as_u16(), 409 | 429 | 500 | 502 | 503 | 504)
}

/// Parses `Retry-After` (delta-seconds or HTTP-date) into a wait from `now`.
/// Dates in the past give zero; anything unparsable gives `None`.
pub(crate) fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if value.is_empty() {
        return None;
    }
    if value.bytes().all(|b| b.is_ascii_digit()) {
        // Saturate absurdly long values instead of failing: the cap applies later.
        let secs = value.parse::<u64>().unwrap_or(u64::MAX);
        return Some(Duration::from_secs(secs));
    }
    let when = httpdate::parse_http_date(value).ok()?;
    Some(when.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The `Retry-After` of a response, if present and parsable.
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?;
    parse_retry_after(value, now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_retry_after_forms() {
        let now = SystemTime::now();
        assert_eq!(parse_retry_after("1", now), Some(Duration::from_secs(1)));
        assert_eq!(
            parse_retry_after(" 120 ", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            parse_retry_after("99999999999999999999999", now),
            Some(Duration::from_secs(u64::MAX))
        );
        let later = httpdate::fmt_http_date(now + Duration::from_secs(10));
        let d = parse_retry_after(&later, now).unwrap_or_default();
        assert!(
            d >= Duration::from_secs(9) && d <= Duration::from_secs(10),
            "{d:?}"
        );
        let past = httpdate::fmt_http_date(now - Duration::from_secs(10));
        assert_eq!(parse_retry_after(&past, now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("", now), None);
        assert_eq!(parse_retry_after("-1", now), None);
        assert_eq!(parse_retry_after("soon", now), None);
    }

    #[test]
    fn retryable_statuses() {
        for code in [409, 429, 500, 502, 503, 504] {
            let s = StatusCode::from_u16(code).unwrap_or_default();
            assert!(is_retryable_status(s, false), "{code}");
            assert!(!is_retryable_status(s, true), "replayed {code}");
        }
        for code in [200, 201, 301, 400, 401, 403, 404, 408, 412, 422, 501, 505] {
            let s = StatusCode::from_u16(code).unwrap_or_default();
            assert!(!is_retryable_status(s, false), "{code}");
        }
    }
}
