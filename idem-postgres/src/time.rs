//! Durations as the stores count them, and as PostgreSQL answers them.

use idem_core::store::{record_ttl, store_lease};
use sqlx::postgres::types::PgInterval;
use std::time::Duration;

// A duration as every store counts it: whole ms, at least 1, clamped.
pub(crate) use idem_core::store::millis;

/// The lease as every store counts it (`idem_core::store::store_lease`),
/// in ms.
pub(crate) fn lease_ms(lease: Duration) -> u64 {
    millis(store_lease(lease))
}

/// How long a claimed record is kept (`idem_core::store::record_ttl`: the
/// result TTL and at least two leases), in ms.
pub(crate) fn record_ttl_ms(ttl: Duration, lease: Duration) -> u64 {
    millis(record_ttl(ttl, lease))
}

/// Milliseconds as PostgreSQL's `bigint` binds them, saturating.
pub(crate) fn ms_i64(ms: u64) -> i64 {
    i64::try_from(ms).unwrap_or(i64::MAX)
}

/// Time left, as an interval between two database timestamps, in whole ms
/// rounded up (as the other stores count it). Such an interval has days
/// and microseconds only; months are counted as 30 days all the same.
pub(crate) fn interval_ms(left: Option<PgInterval>) -> Option<i64> {
    left.map(|i| {
        let days = i64::from(i.months) * 30 + i64::from(i.days);
        let us = days
            .saturating_mul(86_400_000_000)
            .saturating_add(i.microseconds);
        us.div_euclid(1000) + i64::from(us.rem_euclid(1000) > 0)
    })
}

/// Whole milliseconds left, zero once past (or unknown).
pub(crate) fn duration_ms(ms: Option<i64>) -> Duration {
    Duration::from_millis(ms.and_then(|m| u64::try_from(m).ok()).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iv(days: i32, microseconds: i64) -> Option<PgInterval> {
        Some(PgInterval {
            months: 0,
            days,
            microseconds,
        })
    }

    #[test]
    fn intervals_count_whole_ms_rounded_up() {
        assert_eq!(interval_ms(None), None);
        assert_eq!(interval_ms(iv(0, 1)), Some(1));
        assert_eq!(interval_ms(iv(0, 1000)), Some(1));
        assert_eq!(interval_ms(iv(0, 1001)), Some(2));
        assert_eq!(interval_ms(iv(0, -1500)), Some(-1));
        assert_eq!(interval_ms(iv(0, -1000)), Some(-1));
        assert_eq!(interval_ms(iv(1, 0)), Some(86_400_000));
        // the longest record idem keeps (about 317 years) does not overflow
        assert_eq!(interval_ms(iv(115_741, 0)), Some(115_741 * 86_400_000));
    }
}
