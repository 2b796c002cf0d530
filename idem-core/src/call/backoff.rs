//! How a call re-sends a store write that could not reach the store: the
//! one schedule a complete, a release and a step record share.

use backon::ExponentialBuilder;
use std::time::Duration;

/// Short and jittered: the write is re-sent within the lease, and many
/// calls failing at once must not retry in step.
pub(super) fn store_backoff(retries: usize) -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(10))
        .with_max_delay(Duration::from_millis(200))
        .with_jitter()
        .with_max_times(retries)
}
