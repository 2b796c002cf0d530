//! A store-level claim in one call, for tests that drive `Store` directly.

use idem_core::Fingerprint;
use idem_core::store::{Claim, Token};
use std::time::Duration;

/// The [`Claim`] of `key` by `token`, with a lease and TTL in ms, asking for
/// the time left.
///
/// ```
/// let token = idem_core::store::Token::random();
/// let c = idem_testkit::claim("k", &token, 300, 60_000, None);
/// assert_eq!((c.key, c.lease.as_millis(), c.ttl.as_millis()), ("k", 300, 60_000));
/// ```
pub fn claim<'a>(
    key: &'a str,
    token: &'a Token,
    lease_ms: u64,
    ttl_ms: u64,
    fingerprint: Option<&'a Fingerprint>,
) -> Claim<'a> {
    Claim::new(
        key,
        token,
        Duration::from_millis(lease_ms),
        Duration::from_millis(ttl_ms),
    )
    .fingerprint(fingerprint)
    .want_ttl_left(true)
}
