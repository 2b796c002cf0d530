//! The retry policy idem's clients share (HTTP: `idem-client`; gRPC:
//! `idem-grpc`'s client): one definition, so both retry the same way.

use backon::{BackoffBuilder, ExponentialBuilder};
use std::time::Duration;

/// How idem's clients (`idem-client`'s `Client`, `idem-grpc`'s `client`)
/// retry one logical operation.
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
/// use idem_key::RetryPolicy;
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
    /// use idem_key::RetryPolicy;
    /// assert_eq!(RetryPolicy::new(), RetryPolicy::default());
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// A policy that makes exactly one attempt and never retries.
    ///
    /// ```
    /// use idem_key::RetryPolicy;
    /// assert_eq!(RetryPolicy::no_retries().get_max_retries(), 0);
    /// ```
    pub fn no_retries() -> Self {
        Self::default().max_retries(0)
    }

    /// How many retries to make after the first attempt (0 disables retrying).
    ///
    /// ```
    /// use idem_key::RetryPolicy;
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
    /// use idem_key::RetryPolicy;
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
    /// use idem_key::RetryPolicy;
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
    /// use idem_key::RetryPolicy;
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
    /// use idem_key::RetryPolicy;
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
    /// use idem_key::RetryPolicy;
    /// assert_eq!(RetryPolicy::default().get_max_retries(), 2);
    /// ```
    pub fn get_max_retries(&self) -> u32 {
        self.max_retries
    }

    /// The configured initial backoff.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_key::RetryPolicy;
    /// assert_eq!(RetryPolicy::default().get_initial_backoff(), Duration::from_millis(500));
    /// ```
    pub fn get_initial_backoff(&self) -> Duration {
        self.initial_backoff
    }

    /// The configured backoff cap.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_key::RetryPolicy;
    /// assert_eq!(RetryPolicy::default().get_max_backoff(), Duration::from_secs(5));
    /// ```
    pub fn get_max_backoff(&self) -> Duration {
        self.max_backoff
    }

    /// The configured overall deadline.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_key::RetryPolicy;
    /// assert_eq!(RetryPolicy::default().get_deadline(), Duration::from_secs(30));
    /// ```
    pub fn get_deadline(&self) -> Duration {
        self.deadline
    }

    /// The configured cap on `Retry-After`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_key::RetryPolicy;
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
    ///
    /// ```
    /// use std::time::Duration;
    /// let policy = idem_key::RetryPolicy::default().max_retries(3);
    /// let delays: Vec<Duration> = policy.schedule().collect();
    /// assert_eq!(delays.len(), 3);
    /// assert!(delays[0] >= Duration::from_millis(250) && delays[0] <= Duration::from_millis(500));
    /// ```
    pub fn schedule(&self) -> impl Iterator<Item = Duration> + Send {
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
    /// (capped) `Retry-After` when the server sent one (for gRPC,
    /// `grpc-retry-pushback-ms`).
    ///
    /// ```
    /// use std::time::Duration;
    /// let policy = idem_key::RetryPolicy::default(); // hints capped at 30 s
    /// let ms = Duration::from_millis;
    /// assert_eq!(policy.combine(ms(200), Some(ms(1000))), ms(1000));
    /// assert_eq!(policy.combine(ms(200), Some(ms(90_000))), ms(30_000));
    /// assert_eq!(policy.combine(ms(200), None), ms(200));
    /// ```
    pub fn combine(&self, backoff: Duration, retry_after: Option<Duration>) -> Duration {
        match retry_after {
            Some(hint) => backoff.max(hint.min(self.max_retry_after)),
            None => backoff,
        }
    }
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
}
