//! The lease an invocation's calls get, from the invocation's deadline.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The default [`stop_margin`](crate::sqs::SqsBatchHandler::stop_margin):
/// how long before the deadline a batch stops running records and answers.
pub const DEFAULT_STOP_MARGIN: Duration = Duration::from_millis(500);

/// The invocation's deadline from a Lambda [`Context`](lambda_runtime::Context):
/// `None` for `0` (no deadline given, as in `Context::default()`).
///
/// ```
/// use std::time::{Duration, UNIX_EPOCH};
/// let mut ctx = lambda_runtime::Context::default();
/// assert_eq!(idem_lambda::deadline_of(&ctx), None);
/// ctx.deadline = 1_700_000_000_000;
/// assert_eq!(idem_lambda::deadline_of(&ctx), Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000)));
/// ```
pub fn deadline_of(ctx: &lambda_runtime::Context) -> Option<SystemTime> {
    (ctx.deadline != 0).then(|| UNIX_EPOCH + Duration::from_millis(ctx.deadline))
}

/// Where an invocation's lease came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseSource {
    /// The deadline is ahead: the lease is the configured one, or the time
    /// left when that is shorter.
    Deadline {
        /// Time left until the deadline when the batch started.
        remaining: Duration,
    },
    /// No deadline was given: the configured lease, and no stop.
    NoDeadline,
    /// The deadline has passed already (cargo-lambda's local emulator
    /// sends 1970; a clock that is far off): the configured lease, and no
    /// stop.
    PastDeadline {
        /// How long ago it was.
        by: Duration,
    },
}

/// What the deadline rule gives one invocation: the lease of every call it
/// makes, and when it stops running records (see [`plan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeasePlan {
    /// The lease of each record's call.
    pub lease: Duration,
    /// How long after the start the batch stops running records and
    /// reports those not finished as failures; `None`: never.
    pub stop_after: Option<Duration>,
    /// Which case of the rule applied.
    pub source: LeaseSource,
}

/// The deadline rule.
///
/// - **Deadline ahead**, `remaining` left: the lease is
///   `min(configured, remaining)`, so a claim made in this invocation never
///   runs past its end; the batch stops running records `margin` before the
///   deadline (at most half of `remaining` before it), answers for the
///   records that finished, and reports the rest as failures, rather than
///   letting Lambda time the whole invocation out (which redelivers every
///   record of the batch).
/// - **No deadline, or one in the past** (cargo-lambda's emulator, a bad
///   clock): the configured lease, no stop, and a `tracing` warning. A past
///   deadline cannot bound anything, and a lease of zero would make every
///   claim lapse at once, letting duplicates run side by side.
///
/// ```
/// use idem_lambda::{LeaseSource, plan};
/// use std::time::{Duration, SystemTime};
/// let now = SystemTime::now();
/// let lease = Duration::from_secs(30);
/// let margin = Duration::from_millis(500);
///
/// let p = plan(Some(now + Duration::from_secs(10)), now, lease, margin);
/// assert_eq!(p.lease, Duration::from_secs(10));
/// assert_eq!(p.stop_after, Some(Duration::from_millis(9_500)));
///
/// let p = plan(Some(SystemTime::UNIX_EPOCH), now, lease, margin); // cargo-lambda's 1970
/// assert_eq!((p.lease, p.stop_after), (lease, None));
/// assert!(matches!(p.source, LeaseSource::PastDeadline { .. }));
/// ```
pub fn plan(
    deadline: Option<SystemTime>,
    now: SystemTime,
    configured: Duration,
    margin: Duration,
) -> LeasePlan {
    let Some(deadline) = deadline else {
        return LeasePlan {
            lease: configured,
            stop_after: None,
            source: LeaseSource::NoDeadline,
        };
    };
    match deadline.duration_since(now) {
        // At least a millisecond left (idem's shortest lease).
        Ok(remaining) if remaining >= idem_core::MIN_DURATION => LeasePlan {
            lease: configured.min(remaining),
            stop_after: Some(remaining - margin.min(remaining / 2)),
            source: LeaseSource::Deadline { remaining },
        },
        Ok(remaining) => LeasePlan {
            lease: configured,
            stop_after: None,
            source: LeaseSource::PastDeadline { by: remaining },
        },
        Err(past) => LeasePlan {
            lease: configured,
            stop_after: None,
            source: LeaseSource::PastDeadline {
                by: past.duration(),
            },
        },
    }
}

/// [`plan`], and the warning for a deadline that cannot bound the lease.
pub(crate) fn plan_and_warn(
    deadline: Option<SystemTime>,
    configured: Duration,
    margin: Duration,
) -> LeasePlan {
    let p = plan(deadline, SystemTime::now(), configured, margin);
    match p.source {
        LeaseSource::Deadline { .. } => {}
        LeaseSource::NoDeadline => tracing::warn!(
            lease_ms = configured.as_millis() as u64,
            "the invocation has no deadline: each call gets the configured lease, and the \
             batch is not stopped before a timeout"
        ),
        LeaseSource::PastDeadline { by } => tracing::warn!(
            lease_ms = configured.as_millis() as u64,
            past_ms = by.as_millis() as u64,
            "the invocation's deadline has passed already (a local emulator, or a clock far \
             off): each call gets the configured lease, and the batch is not stopped before \
             a timeout"
        ),
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_closer_than_the_lease_bounds_it() {
        let now = SystemTime::now();
        let p = plan(
            Some(now + Duration::from_secs(3)),
            now,
            Duration::from_secs(30),
            Duration::from_millis(500),
        );
        assert_eq!(p.lease, Duration::from_secs(3));
        assert_eq!(p.stop_after, Some(Duration::from_millis(2_500)));
    }

    #[test]
    fn a_far_deadline_keeps_the_configured_lease() {
        let now = SystemTime::now();
        let p = plan(
            Some(now + Duration::from_secs(900)),
            now,
            Duration::from_secs(30),
            Duration::from_millis(500),
        );
        assert_eq!(p.lease, Duration::from_secs(30));
        assert_eq!(p.stop_after, Some(Duration::from_millis(899_500)));
    }

    #[test]
    fn the_margin_is_at_most_half_the_time_left() {
        let now = SystemTime::now();
        let p = plan(
            Some(now + Duration::from_millis(600)),
            now,
            Duration::from_secs(30),
            Duration::from_millis(500),
        );
        assert_eq!(p.lease, Duration::from_millis(600));
        assert_eq!(p.stop_after, Some(Duration::from_millis(300)));
    }

    #[test]
    fn no_deadline_or_the_deadline_now_falls_back() {
        let now = SystemTime::now();
        let lease = Duration::from_secs(30);
        let p = plan(None, now, lease, DEFAULT_STOP_MARGIN);
        assert_eq!(
            (p.lease, p.stop_after, p.source),
            (lease, None, LeaseSource::NoDeadline)
        );
        let p = plan(Some(now), now, lease, DEFAULT_STOP_MARGIN);
        assert_eq!((p.lease, p.stop_after), (lease, None));
        assert_eq!(p.source, LeaseSource::PastDeadline { by: Duration::ZERO });
    }
}
