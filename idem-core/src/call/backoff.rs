//! How a call re-sends a store operation that could not reach the store:
//! the schedule a claim and a step's record and read share, and the one
//! loop every re-send runs (a complete's too, on its lease-bound schedule).

use super::is_unavailable;
use crate::error::Error;
use backon::{BackoffBuilder, ExponentialBuilder};
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

/// Sends, and sends again after each of `schedule`'s delays while the
/// store could not be reached; any other answer (a reply, another error)
/// is returned at once. The first send is a plain await: nearly every
/// write succeeds, and the schedule is built only after one did not.
pub(super) async fn resend<T, F, Fut>(
    schedule: impl BackoffBuilder,
    what: &'static str,
    mut send: F,
) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let mut failed = match send().await {
        Err(e) if is_unavailable(&e) => e,
        answered => return answered,
    };
    for delay in schedule.build() {
        tracing::debug!(error = %failed, ?delay, what, "did not reach the store; re-sending");
        tokio::time::sleep(delay).await;
        failed = match send().await {
            Err(e) if is_unavailable(&e) => e,
            answered => return answered,
        };
    }
    Err(failed)
}
