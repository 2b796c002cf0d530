//! The limits on a call's durations, shared by the runtime (`idem-core`,
//! which refuses other values with `Error::InvalidConfig`) and the
//! `#[idempotent]` macro (`idem-macros`, which refuses literal ones at
//! compile time): one definition, so the two never disagree.

use std::time::Duration;

/// Shortest result TTL or lease: stores count them in whole milliseconds.
///
/// ```
/// assert_eq!(idem_key::MIN_DURATION.as_millis(), 1);
/// ```
pub const MIN_DURATION: Duration = Duration::from_millis(1);

/// Longest accepted result TTL: a year.
///
/// ```
/// assert_eq!(idem_key::MAX_TTL.as_secs(), 365 * 24 * 3600);
/// ```
pub const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// Longest accepted lease: a day (a body holding a key longer is a bug).
///
/// ```
/// assert!(idem_key::MAX_LEASE < idem_key::MAX_TTL);
/// ```
pub const MAX_LEASE: Duration = Duration::from_secs(24 * 3600);
