//! Waiting for a condition without timing assertions.

use std::future::Future;
use std::time::{Duration, Instant};

/// Polls `check` every 50 ms until it returns `Some`, and returns that.
///
/// `deadline` should be generous: this waits for something that must
/// happen, it never asserts how fast.
///
/// # Panics
///
/// With "not reached within {deadline}: {what}" when `deadline` passes first.
pub async fn eventually<T, F, Fut>(what: &str, deadline: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let end = Instant::now() + deadline;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < end,
            "not reached within {deadline:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
