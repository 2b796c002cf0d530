//! Keeping the broker from redelivering a message while its handler runs.

use std::future::Future;
use std::time::Duration;
use tokio::time::{Instant, MissedTickBehavior, interval_at};

/// Runs `work`, calling `beat` every `period` until it finishes.
///
/// Adapters use it to tell the broker "still working" in step with idem's
/// own lease keep-alive (which renews every third of the lease): JetStream
/// progress acks, a Redis Streams owner re-claiming its entries. A beat that
/// is slow does not delay `work`: both are polled together.
///
/// ```
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use std::time::Duration;
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let beats = AtomicU32::new(0);
/// let out = idem_consumer::with_heartbeat(
///     async { tokio::time::sleep(Duration::from_millis(55)).await; 7 },
///     Duration::from_millis(10),
///     || async { beats.fetch_add(1, Ordering::Relaxed); },
/// ).await;
/// assert_eq!(out, 7);
/// assert!(beats.load(Ordering::Relaxed) >= 3);
/// # });
/// ```
pub async fn with_heartbeat<F, B, BF>(work: F, period: Duration, mut beat: B) -> F::Output
where
    F: Future,
    B: FnMut() -> BF,
    BF: Future<Output = ()>,
{
    let period = period.max(Duration::from_millis(1));
    let beating = async move {
        let mut ticker = interval_at(Instant::now() + period, period);
        // After a stall, one beat is enough: a burst would only load the broker.
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            beat().await;
        }
    };
    tokio::select! {
        biased;
        out = work => out,
        never = beating => never,
    }
}
