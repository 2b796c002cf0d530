//! Retry policy: how often, how long between attempts, and when to stop.

use std::time::{Duration, SystemTime};

use backon::{BackoffBuilder, ExponentialBuilder};
use http::{HeaderMap, StatusCode};

/// How a [`Client`](crate::Client) retries one logical operation.
///
/// Every retry re-sends the *same* `Idempotency-Key`, so a retry can never
/// apply the operation twice: the server either finishes the first attempt's
/// work or replays its stored outcome.
///
/// # Schedule
///
/// The delay before retry *n* (counting from 0) is drawn with **equal jitter**
/// from `[b/2, b)`, where `b = min(initial_backoff · 2ⁿ, max_backoff)`. The
/// schedule comes from [`backon`]'s [`ExponentialBuilder`] with jitter.
///
/// A `Retry-After` header on a retryable response (delta-seconds or an
/// HTTP-date) is a lower bound on the next delay, itself capped at
/// [`max_retry_after`](Self::max_retry_after).
///
/// The client stops when `max_retries` retries have been made, or when the
/// next attempt could not start before the overall
/// [`deadline`](Self::deadline), which also bounds each attempt's timeout.
///
/// # Defaults
///
/// | setting | default |
/// |---|---|
/// | `max_retries` | 2 (so at most 3 attempts) |
/// | `initial_backoff` | 500 ms |
/// | `max_backoff` | 5 s |
/// | `deadline` | 30 s |
/// | `max_retry_after` | 30 s |
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use idem_client::RetryPolicy;
///
/// let policy = RetryPolicy::default()
///     .max_retries(4)
///     .initial_backoff(Duration::from_millis(100))
///     .max_backoff(Duration::from_secs(5))
///     .deadline(Duration::from_secs(20));
/// assert_eq!(policy.get_max_retries(), 4);
/// assert_eq!(policy.get_deadline(), Duration::from_secs(20));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    max_retries: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    deadline: Duration,
    max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_retries: 2,
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(5),
            deadline: Duration::from_secs(30),
            max_retry_after: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// The default policy (same as [`RetryPolicy::default`]).
    ///
    /// ```
    /// use idem_client::RetryPolicy;
    /// assert_eq!(RetryPolicy::new(), RetryPolicy::default());
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// A policy that makes exactly one attempt and never retries.
    ///
    /// ```
    /// use idem_client::RetryPolicy;
    /// assert_eq!(RetryPolicy::no_retries().get_max_retries(), 0);
    /// ```
    pub fn no_retries() -> Self {
        Self::default().max_retries(0)
    }

    /// How many retries to make after the first attempt (0 disables retrying).
    ///
    /// ```
    /// use idem_client::RetryPolicy;
    /// let p = RetryPolicy::default().max_retries(5);
    /// assert_eq!(p.get_max_retries(), 5);
    /// ```
    pub fn max_retries(mut self, max_retries: u32) -> Self {
        self.max_retries = max_retries;
        self
    }

    /// Base of the first backoff; it doubles on every retry up to
    /// [`max_backoff`](Self::max_backoff). A value above `max_backoff` is
    /// treated as `max_backoff`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_client::RetryPolicy;
    /// let p = RetryPolicy::default().initial_backoff(Duration::from_millis(250));
    /// assert_eq!(p.get_initial_backoff(), Duration::from_millis(250));
    /// ```
    pub fn initial_backoff(mut self, initial_backoff: Duration) -> Self {
        self.initial_backoff = initial_backoff;
        self
    }

    /// Cap on the exponential backoff (before jitter and `Retry-After`).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_client::RetryPolicy;
    /// let p = RetryPolicy::default().max_backoff(Duration::from_secs(2));
    /// assert_eq!(p.get_max_backoff(), Duration::from_secs(2));
    /// ```
    pub fn max_backoff(mut self, max_backoff: Duration) -> Self {
        self.max_backoff = max_backoff;
        self
    }

    /// Overall time budget for one logical operation, measured from the
    /// first attempt. Each attempt's timeout is shortened to fit, and no
    /// retry is started whose delay would end past the deadline.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_client::RetryPolicy;
    /// let p = RetryPolicy::default().deadline(Duration::from_secs(10));
    /// assert_eq!(p.get_deadline(), Duration::from_secs(10));
    /// ```
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// Largest `Retry-After` the client will honour; a longer one is cut to
    /// this value (and the deadline still applies).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_client::RetryPolicy;
    /// let p = RetryPolicy::default().max_retry_after(Duration::from_secs(5));
    /// assert_eq!(p.get_max_retry_after(), Duration::from_secs(5));
    /// ```
    pub fn max_retry_after(mut self, max_retry_after: Duration) -> Self {
        self.max_retry_after = max_retry_after;
        self
    }

    /// The configured number of retries.
    ///
    /// ```
    /// use idem_client::RetryPolicy;
    /// assert_eq!(RetryPolicy::default().get_max_retries(), 2);
    /// ```
    pub fn get_max_retries(&self) -> u32 {
        self.max_retries
    }

    /// The configured initial backoff.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_client::RetryPolicy;
    /// assert_eq!(RetryPolicy::default().get_initial_backoff(), Duration::from_millis(500));
    /// ```
    pub fn get_initial_backoff(&self) -> Duration {
        self.initial_backoff
    }

    /// The configured backoff cap.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_client::RetryPolicy;
    /// assert_eq!(RetryPolicy::default().get_max_backoff(), Duration::from_secs(5));
    /// ```
    pub fn get_max_backoff(&self) -> Duration {
        self.max_backoff
    }

    /// The configured overall deadline.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_client::RetryPolicy;
    /// assert_eq!(RetryPolicy::default().get_deadline(), Duration::from_secs(30));
    /// ```
    pub fn get_deadline(&self) -> Duration {
        self.deadline
    }

    /// The configured cap on `Retry-After`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_client::RetryPolicy;
    /// assert_eq!(RetryPolicy::default().get_max_retry_after(), Duration::from_secs(30));
    /// ```
    pub fn get_max_retry_after(&self) -> Duration {
        self.max_retry_after
    }

    /// The delay schedule for one operation: an iterator yielding at most
    /// `max_retries` delays.
    ///
    /// backon's jitter turns a base `d` into `d + U[0,1)·d`; starting from
    /// half the configured values therefore gives equal jitter in `[b/2, b)`.
    pub(crate) fn schedule(&self) -> impl Iterator<Item = Duration> + Send {
        let max = self.max_backoff;
        let initial = self.initial_backoff.min(max);
        let max_times = usize::try_from(self.max_retries).unwrap_or(usize::MAX);
        ExponentialBuilder::default()
            .with_min_delay(initial / 2)
            .with_max_delay(max / 2)
            .with_factor(2.0)
            .with_max_times(max_times)
            .with_jitter()
            .build()
    }

    /// The delay to wait before the next attempt: the backoff, raised to the
    /// (capped) `Retry-After` when the server sent one.
    pub(crate) fn combine(&self, backoff: Duration, retry_after: Option<Duration>) -> Duration {
        match retry_after {
            Some(hint) => backoff.max(hint.min(self.max_retry_after)),
            None => backoff,
        }
    }
}

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
    fn default_schedule_is_equal_jitter_within_bounds() {
        let policy = RetryPolicy::default().max_retries(6);
        let delays: Vec<_> = policy.schedule().collect();
        assert_eq!(delays.len(), 6);
        let bases = [500u64, 1000, 2000, 4000, 5000, 5000];
        for (d, base) in delays.iter().zip(bases) {
            let base = Duration::from_millis(base);
            assert!(*d >= base / 2, "{d:?} < {:?}", base / 2);
            assert!(*d <= base, "{d:?} > {base:?}");
        }
    }

    #[test]
    fn schedule_respects_max_retries_zero() {
        assert_eq!(RetryPolicy::no_retries().schedule().count(), 0);
    }

    #[test]
    fn initial_above_max_is_capped() {
        let policy = RetryPolicy::default()
            .initial_backoff(Duration::from_secs(10))
            .max_backoff(Duration::from_secs(1));
        for d in policy.schedule() {
            assert!(d <= Duration::from_secs(1));
        }
    }

    #[test]
    fn retry_after_is_lower_bound_and_capped() {
        let policy = RetryPolicy::default().max_retry_after(Duration::from_secs(3));
        let ms = Duration::from_millis;
        assert_eq!(policy.combine(ms(200), None), ms(200));
        assert_eq!(policy.combine(ms(200), Some(ms(1000))), ms(1000));
        assert_eq!(policy.combine(ms(2000), Some(ms(1000))), ms(2000));
        assert_eq!(policy.combine(ms(200), Some(ms(60_000))), ms(3000));
    }

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
