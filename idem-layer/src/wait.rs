//! A duplicate that asks to wait: how long it asked for (HTTP's
//! `Prefer: wait=N`, gRPC's `idem-wait: N`), and how long it is granted
//! under the layer's cap ([`Settings::max_wait`](crate::settings::Settings::max_wait)).
//!
//! Both protocols count the wait in whole seconds, as RFC 7240's
//! `delta-seconds`: one or more ASCII digits, nothing else. A value that is
//! not one is no wait at all (RFC 7240 has preferences that cannot be
//! honoured ignored, never refused).

use std::time::Duration;

/// The cap of a wait a request asks for, by default: 10 s.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(10);

/// RFC 7240's `delta-seconds` (1*DIGIT), as a duration; `None` for anything
/// else (empty, a sign, a fraction, a space inside). A number too large
/// for a `u64` is the largest one (as RFC 9111 has caches treat an
/// overflowing delta-seconds): it is capped anyway.
///
/// ```
/// use idem_layer::wait::delta_seconds;
/// use std::time::Duration;
///
/// assert_eq!(delta_seconds("5"), Some(Duration::from_secs(5)));
/// assert_eq!(delta_seconds("007"), Some(Duration::from_secs(7)));
/// assert_eq!(delta_seconds("99999999999999999999999"), Some(Duration::from_secs(u64::MAX)));
/// assert_eq!(delta_seconds(""), None);
/// assert_eq!(delta_seconds("-1"), None);
/// assert_eq!(delta_seconds("1.5"), None);
/// assert_eq!(delta_seconds("1 0"), None);
/// ```
pub fn delta_seconds(value: &str) -> Option<Duration> {
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let seconds = value
        .bytes()
        .try_fold(0u64, |n, digit| {
            n.checked_mul(10)?.checked_add(u64::from(digit - b'0'))
        })
        .unwrap_or(u64::MAX);
    Some(Duration::from_secs(seconds))
}

/// A wait in whole seconds, rounded up: how a granted wait is reported
/// back (`Preference-Applied: wait=N`), so that a sub-second cap never
/// reads as no wait at all.
///
/// ```
/// use idem_layer::wait::whole_seconds;
/// use std::time::Duration;
///
/// assert_eq!(whole_seconds(Duration::from_secs(10)), 10);
/// assert_eq!(whole_seconds(Duration::from_millis(1500)), 2);
/// assert_eq!(whole_seconds(Duration::ZERO), 0);
/// ```
pub fn whole_seconds(wait: Duration) -> u64 {
    let seconds = wait.as_secs();
    if wait.subsec_nanos() > 0 {
        seconds.saturating_add(1)
    } else {
        seconds
    }
}

/// How long one request waits for an in-flight duplicate, and whether
/// that is what it asked for.
///
/// ```
/// use idem_layer::wait::Wait;
/// use std::time::Duration;
///
/// // Asked for 3600 s under a 10 s cap, no layer-wide wait.
/// let wait = Wait::of(Some(Duration::from_secs(3600)), Duration::from_secs(10), Duration::ZERO);
/// assert_eq!(wait.wait, Duration::from_secs(10));
/// assert_eq!(wait.granted, Some(Duration::from_secs(10)));
///
/// // Asked for nothing: the layer's own wait, nothing to report.
/// let wait = Wait::of(None, Duration::from_secs(10), Duration::from_secs(2));
/// assert_eq!(wait.wait, Duration::from_secs(2));
/// assert_eq!(wait.granted, None);
///
/// // A zero cap turns the requests' waits off.
/// let wait = Wait::of(Some(Duration::from_secs(5)), Duration::ZERO, Duration::ZERO);
/// assert_eq!((wait.wait, wait.granted), (Duration::ZERO, None));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wait {
    /// How long the request's call waits (`Call::wait`).
    pub wait: Duration,
    /// The wait the request asked for, as granted (after the cap); `None`
    /// when it asked for none or the layer does not grant any (its cap is
    /// zero): then nothing is reported back.
    pub granted: Option<Duration>,
}

impl Wait {
    /// The wait of a request that asked for `asked`, under the cap
    /// `max_wait` (zero: requests' waits ignored), on a layer whose own
    /// wait for every duplicate is `layer_wait`. An asked wait replaces
    /// the layer's (a client may ask to wait less, too).
    pub fn of(asked: Option<Duration>, max_wait: Duration, layer_wait: Duration) -> Wait {
        match asked {
            Some(asked) if !max_wait.is_zero() => {
                let granted = asked.min(max_wait);
                Wait {
                    wait: granted,
                    granted: Some(granted),
                }
            }
            _ => Wait {
                wait: layer_wait,
                granted: None,
            },
        }
    }

    /// This wait, no longer than `limit` (the call's own deadline).
    ///
    /// ```
    /// use idem_layer::wait::Wait;
    /// use std::time::Duration;
    ///
    /// let wait = Wait::of(Some(Duration::from_secs(5)), Duration::from_secs(10), Duration::ZERO)
    ///     .within(Duration::from_secs(2));
    /// assert_eq!(wait.wait, Duration::from_secs(2));
    /// assert_eq!(wait.granted, Some(Duration::from_secs(2)));
    /// ```
    #[must_use]
    pub fn within(self, limit: Duration) -> Wait {
        Wait {
            wait: self.wait.min(limit),
            granted: self.granted.map(|g| g.min(limit)),
        }
    }
}
